"""Objects autograph does not know never make a call fail that eager runs (issue 35, section 5):
unhashable arguments, Mapping subclasses, TorchScript modules, pickled graphed modules, and
the island graphs that reset(f) drops."""

import collections
import io
import os
import pickle

import pytest
import torch

import autograph
from autograph.api._region import engine_of

from conftest import autograph_warnings, states


class _NoHash:
    __hash__ = None

    def __init__(self, scale):
        self.scale = scale


@pytest.mark.parametrize(
    "make",
    [lambda: __import__("numpy").array([1.0, 2.0]), lambda: _NoHash(2.0), lambda: bytearray(b"ab")],
    ids=["numpy", "hash_none", "bytearray"],
)
def test_an_unhashable_argument_runs_eagerly_with_the_reason_said_once(device, caught, make):
    @autograph.graphed
    def f(x, cfg):
        return x * len(cfg) if not isinstance(cfg, _NoHash) else x * cfg.scale

    for _ in range(4):
        x = torch.randn(3, device=device)
        torch.testing.assert_close(f(x, make()), x * 2)
    assert states(f) == [("eager", 4, 4, 0)]
    reason = f.stats()[0].fallback_reason
    assert reason.startswith(f"its argument cfg is an unhashable {type(make()).__name__},")
    assert len([w for w in autograph_warnings(caught) if "unhashable" in w]) == 1


def test_a_set_argument_is_keyed_by_its_value(device):
    @autograph.graphed
    def f(x, names):
        return x * 2 if "double" in names else x

    for names in [{"double"}, {"double"}, {"double"}, {"half"}, {"half"}, {"half"}]:
        x = torch.randn(3, device=device)
        torch.testing.assert_close(f(x, set(names)), x * 2 if "double" in names else x)
    assert states(f) == [("graphed", 3, 1, 2), ("graphed", 3, 1, 2)]


def _batch_encoding(data):
    transformers = pytest.importorskip("transformers")
    return transformers.BatchEncoding(data)


@pytest.mark.parametrize(
    "mapping", [collections.UserDict, _batch_encoding], ids=["UserDict", "BatchEncoding"]
)
def test_a_mapping_subclass_is_a_container_in_graphed_and_in_a_region(device, mapping):
    @autograph.graphed
    def f(batch):
        return batch["a"] * 2 + batch["b"]

    class Net(torch.nn.Module):
        def forward(self, batch):
            return f.__wrapped__(batch) + 1

    net = Net()
    with autograph.region():
        for step in range(4):
            batch = mapping(
                {
                    "a": torch.full((3,), float(step), device=device),
                    "b": torch.ones(3, device=device),
                }
            )
            torch.testing.assert_close(f(batch), batch["a"] * 2 + 1)
            torch.testing.assert_close(net(batch), batch["a"] * 2 + 2)
    assert states(f) == [("graphed", 4, 1, 3)]  # a graphed function's own warmup (1)
    # a module the region graphs of itself: a plain call and a watched warmup, then a capture
    assert states(net) == [("graphed", 4, 2, 2)]


def _tiny_sentence_transformer(tmp_path):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    transformers = pytest.importorskip("transformers")
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world", "graph", "fast"]
    vocab = os.path.join(tmp_path, "vocab.txt")
    with open(vocab, "w") as file:
        file.write("\n".join(words) + "\n")
    transformers.BertTokenizer(vocab).save_pretrained(tmp_path)
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=len(words),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
    )
    transformers.BertModel(config).save_pretrained(tmp_path)
    from sentence_transformers import models

    body = models.Transformer(str(tmp_path))
    pooling = models.Pooling(body.auto_model.config.hidden_size)
    return sentence_transformers.SentenceTransformer(modules=[body, pooling], device="cpu")


def test_sentence_transformers_encode_in_a_region(emulated, tmp_path):
    model = _tiny_sentence_transformer(tmp_path).eval()
    sentences = ["hello world", "graph fast", "hello fast"]
    expected = model.encode(sentences, convert_to_tensor=True)
    with autograph.region():
        for _ in range(4):
            torch.testing.assert_close(model.encode(sentences, convert_to_tensor=True), expected)
    # a module the region graphs of itself: a plain call and a watched warmup, then a capture
    assert states(model) == [("graphed", 4, 2, 2)]


class _Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.linear(x))


def _graphed_or_said(target):
    """Each key replayed, or ran eagerly with a reason: never silence."""
    rows = autograph.stats(target)
    assert rows
    for row in rows:
        assert (row.state == "graphed" and row.replays > 0) or row.fallback_reason


def test_a_scripted_module_is_graphed_in_a_region(device):
    scripted = torch.jit.script(_Small().to(device))
    with autograph.region():
        for _ in range(4):
            x = torch.randn(2, 4, device=device)
            torch.testing.assert_close(scripted(x), torch.relu(scripted.linear(x)))
    if device == "cpu":  # the region's warmup (2): a plain call and a watched warmup first
        assert states(scripted) == [("graphed", 4, 2, 2)]
    _graphed_or_said(scripted)


def test_a_traced_module_graphed_has_its_rows(device):
    small = _Small().to(device)
    traced = autograph.graphed(torch.jit.trace(small, torch.randn(2, 4, device=device)))
    for _ in range(4):
        x = torch.randn(2, 4, device=device)
        torch.testing.assert_close(traced(x), small(x))
    if device == "cpu":
        assert states(traced) == [("graphed", 4, 1, 3)]
    _graphed_or_said(traced)


@pytest.mark.parametrize("save", ["torch.save", "pickle"])
def test_a_pickled_graphed_module_loads_independent_and_graphs_again(device, save):
    model = autograph.graphed(_Small().to(device))
    for _ in range(4):
        model(torch.randn(2, 4, device=device))
    if save == "torch.save":
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
    else:
        loaded = pickle.loads(pickle.dumps(model))
    assert autograph.stats(loaded) == []
    assert loaded.forward._self_module() is loaded
    with torch.no_grad():
        loaded.linear.weight.add_(1.0)  # independent: the original keeps its weights
    for _ in range(4):
        x = torch.randn(2, 4, device=device)
        torch.testing.assert_close(loaded(x), torch.relu(loaded.linear(x)))
        torch.testing.assert_close(model(x), torch.relu(model.linear(x)))
    assert states(loaded) == [("graphed", 4, 1, 3)]
    assert states(model) == [("graphed", 8, 1, 7)]


def test_reset_drops_the_island_graphs_its_stats_listed(device):
    linear = torch.nn.Linear(4, 4).to(device)

    @autograph.graphed
    def f(x):
        y = linear(x)
        if y.sum() > 1e9:  # a host read: f's key runs eagerly, the Linear call is an island
            y = y * 2
        return y

    def calls():
        for _ in range(4):
            x = torch.randn(2, 4, device=device)
            torch.testing.assert_close(f(x), linear(x))

    with torch.no_grad():
        calls()
        islands = [(s.state, s.replays) for s in f.stats() if " > " in s.function]
        assert islands == [("graphed", 2)]
        f.reset()
        assert f.stats() == [] and engine_of(linear).stats() == []
        calls()  # graphed again from the start
        assert [(s.state, s.replays) for s in f.stats() if " > " in s.function] == islands
