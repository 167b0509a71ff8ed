"""Islands (issue 24): a graphed function whose key runs eagerly still graphs the top-level module
calls inside it, as a region would; results stay eager's."""

import warnings

import pytest
import torch

import autograph
from autograph.policy._islands import IDLE_CALLS

from conftest import autograph_warnings, states


def _model(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8)).to(
        device
    )


def _branchy(m):
    def f(x):
        y = m(x)
        if y.sum() > 0:  # a host read: f cannot be one graph
            y = y * 2
        return m(y)

    return f


def _island_rows(rows):
    return [r for r in rows if " > " in r.function]


def test_a_function_that_falls_back_graphs_the_module_calls_inside_it(device, caught):
    m = _model(device)
    plain = _branchy(m)
    f = autograph.graphed(_branchy(m))
    xs = [torch.randn(4, 8, device=device) * (1 if i % 2 else -1) for i in range(8)]
    with torch.no_grad():
        for x in xs:
            torch.testing.assert_close(f(x), plain(x), rtol=0, atol=0)
    own, *islands = f.stats()
    assert own.state == "eager"
    assert "Python condition" in own.fallback_reason
    assert islands == _island_rows(f.stats()) and islands
    assert all(r.function.startswith(own.function + " > Sequential") for r in islands)
    assert sum(r.replays for r in islands) >= 10  # both m calls, from the third call of f
    assert {r.state for r in islands} == {"graphed"}
    # One warning: the function's own fallback, said once.
    assert len(autograph_warnings(caught)) == 1


def test_a_function_that_calls_no_module_keeps_no_island(device, caught):
    # Entering an island puts autograph's dispatcher into nn.Module.__call__ and leaving it
    # takes it out, a change of torch's base class at each eager call: 136 us a call on the
    # H200 for a function whose bare call took 47 us, with no module call to graph.
    seen = []

    def tiny(x):
        seen.append(torch.nn.Module.__call__)
        y = torch.cat([x, x]) * 2
        if y.sum() > 1e30:  # a host read: the key runs eagerly
            y = y + 1
        return y

    f = autograph.graphed(tiny)
    original = torch.nn.Module.__call__
    for _ in range(16):
        x = torch.randn(4, device=device)
        torch.testing.assert_close(f(x), torch.cat([x, x]) * 2)
    (own,) = f.stats()
    assert own.state == "eager" and own.eager_calls == 16
    islanded = [i for i, call in enumerate(seen) if call is not original]
    assert len(islanded) == IDLE_CALLS and islanded[-1] < 12  # later eager calls: no island


def test_a_function_that_calls_its_module_only_later_keeps_its_island(device, caught):
    # Found by a hostile review of the first form, which dropped an island after one idle
    # call: a branch on the data that reaches the module only from the fourth call lost its
    # graphs for good.
    m = _model(device)
    calls = [0]

    def body(x):
        calls[0] += 1
        y = x * 2
        if y.sum() > 1e30:  # a host read: the key runs eagerly
            y = y + 1
        return m(y) if calls[0] > 3 else y

    f = autograph.graphed(body)
    with torch.no_grad():
        for i in range(12):
            x = torch.randn(4, 8, device=device)
            expected = m(x * 2) if i >= 3 else x * 2
            torch.testing.assert_close(f(x), expected, rtol=0, atol=0)
    islands = _island_rows(f.stats())
    assert islands and sum(r.replays for r in islands) >= 5


def test_islands_can_be_turned_off(device, caught):
    m = _model(device)
    f = autograph.graphed(_branchy(m), islands=False)
    with torch.no_grad():
        for _i in range(6):
            f(torch.randn(4, 8, device=device))
    assert _island_rows(f.stats()) == []
    assert states(f)[0][0] == "eager"
    assert autograph.stats(m) == []  # m was never called as a top-level module


def test_strict_still_raises_for_the_functions_own_fallback(device):
    m = _model(device)
    f = autograph.graphed(_branchy(m), strict=True)
    with torch.no_grad():
        f(torch.randn(4, 8, device=device))  # warmup
        with pytest.raises(autograph.CaptureError, match="Python condition"):
            f(torch.randn(4, 8, device=device))


def test_a_graphed_module_that_falls_back_graphs_its_submodule_calls(device, caught):
    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = _model(device)

        def forward(self, x):
            y = self.inner(x)
            return self.inner(y * 2 if y.sum() > 0 else y)

    torch.manual_seed(1)
    model = Branchy()
    reference = _branchy(model.inner)
    graphed = autograph.graphed(model)
    with torch.no_grad():
        for _i in range(6):
            x = torch.randn(4, 8, device=device)
            torch.testing.assert_close(graphed(x), reference(x), rtol=0, atol=0)
    rows = graphed.forward.stats()
    assert rows[0].state == "eager"
    assert sum(r.replays for r in _island_rows(rows)) > 0


def test_the_global_report_lists_each_module_once(device, caught):
    m = _model(device)
    f = autograph.graphed(_branchy(m))
    with torch.no_grad():
        for _i in range(4):
            f(torch.randn(4, 8, device=device))
    everything = autograph.stats()
    assert _island_rows(everything) == []
    assert any(r.function.startswith("Sequential") and r.replays for r in everything)


def test_graphed_generate_gets_the_speed_of_generate_in_a_region(device):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=128,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device).eval()
    prompt = torch.randint(0, 128, (1, 5), device=device)
    cache = transformers.StaticCache(config=config, max_cache_len=32)

    def generate(fn):
        with torch.inference_mode(), warnings.catch_warnings():
            cache.reset()  # one cache, as a server keeps it: the key of generate repeats
            warnings.simplefilter("ignore", FutureWarning)  # past_key_values, in 5.24
            return fn(prompt, past_key_values=cache, max_new_tokens=8, do_sample=False)

    expected = [generate(model.generate) for _ in range(4)]
    graphed = autograph.graphed(model.generate)
    got = [generate(graphed) for _ in range(4)]
    for a, b in zip(expected, got):
        assert torch.equal(a, b)
    rows = graphed.stats()
    assert rows[0].state == "eager"  # its stopping criteria read values on the host
    assert sum(r.replays for r in _island_rows(rows)) > 0


class _Cache:
    """A cache grown with torch.cat on every call, as HF's DynamicCache: its tensor rebound."""

    def __init__(self, device):
        self.keys = torch.zeros(1, 8, device=device)


class _Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, cache):
        cache.keys = torch.cat([cache.keys, self.proj(x)])
        return x + cache.keys.mean(0)


class _Decoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Attention(), _Attention()])
        self.head = torch.nn.Linear(8, 8)

    def forward(self, x, cache):
        for layer in self.layers:
            x = layer(x, cache)
        return self.head(x)


def test_module_calls_in_an_island_that_fall_back_get_no_island_of_their_own(device):
    # A decode step over a cache every layer rebinds: the step's key and each layer's run
    # eagerly for the same reason, and islands inside islands graphed every Linear down to
    # the leaves (about 80 graphs in the first call of an HF Llama decode loop in a region,
    # 0.28x to 0.44x eager's speed on the H200). The step's island graphs its own module
    # calls (the head); a layer, eager in it, runs its calls as written.
    torch.manual_seed(0)
    model = _Decoder().to(device)
    eager_model, cache, eager_cache = _Decoder().to(device), _Cache(device), _Cache(device)
    eager_model.load_state_dict(model.state_dict())
    xs = [torch.randn(1, 8, device=device) for _ in range(8)]
    with torch.no_grad():
        expected = [eager_model(x, eager_cache) for x in xs]
        with autograph.region() as region:
            got = [model(x, cache) for x in xs]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
    assert torch.equal(cache.keys, eager_cache.keys)
    (step,) = region.stats().keys
    assert step.state == "eager" and "replaces cache.keys on every call" in step.fallback_reason
    island = _island_rows(autograph.stats(model))
    layers = [r for r in island if "> _Attention" in r.function]
    assert len(layers) == 2 and {r.state for r in layers} == {"eager"}
    (head,) = [r for r in island if "> Linear" in r.function]
    assert head.state == "graphed" and head.replays >= 3
    for layer in model.layers:  # no island of a layer graphed its projection
        assert autograph.stats(layer.proj) == []


def test_a_key_that_rebinds_what_it_reads_runs_eagerly_without_a_capture(device, caught):
    # Watched twice (once could be a lazy first-call conversion), a call that lets go of a
    # tensor the caller held, which a graph would go on reading, runs eagerly from then on:
    # no capture is made and thrown away.
    layer = _Attention().to(device)
    cache, eager_cache = _Cache(device), _Cache(device)
    f = autograph.graphed(lambda x, cache: layer(x, cache))
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(1, 8, device=device)
            torch.testing.assert_close(f(x, cache), layer(x, eager_cache))
    assert torch.equal(cache.keys, eager_cache.keys)
    row, *island = f.stats()  # its island: the layer, eager for the same reason
    assert (row.state, row.calls, row.eager_calls, row.replays) == ("eager", 5, 5, 0)
    assert [r.state for r in island] == ["eager"] and island[0].replays == 0
    assert row.capture_seconds is None  # no capture was made
    assert "it replaces cache.keys on every call" in row.fallback_reason
    assert len(autograph_warnings(caught)) == 1


def test_a_first_call_that_converts_what_it_reads_is_graphed_after_a_second_watch(device):
    # A lazy conversion on the first call only (transformers 5.17's StaticCache moves its
    # position to the GPU at its first update): the second watched call frees nothing, and
    # the key is captured at the third.
    state = {"scale": torch.full((8,), 2.0, device=device, dtype=torch.float64)}

    def scaled(x):
        if state["scale"].dtype != x.dtype:
            state["scale"] = state["scale"].to(x.dtype)
        return x * state["scale"]

    f = autograph.graphed(scaled)
    for _ in range(6):
        x = torch.randn(8, device=device)
        torch.testing.assert_close(f(x), x * 2)
    assert states(f) == [("graphed", 6, 2, 4)]


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


class _Routed(torch.nn.Module):
    """Reads a value on the host (a router), then runs its blocks: eager, with an island."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(2))

    def forward(self, x):
        if x.abs().sum() > 0:  # a host read
            x = x * 1
        for block in self.blocks:
            x = block(x)
        return x


class _Top(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.routed, self.head = _Routed(), torch.nn.Linear(8, 4)

    def forward(self, x):
        if x.mean() > 100:  # a host read
            x = x * 0
        return self.head(self.routed(x))


def test_a_module_eager_for_a_host_read_in_an_island_keeps_an_island_of_its_own(device):
    # Found by a hostile review of the one-level rule: only keys that free what they read
    # lose their islands; a model with a host read at two depths keeps its blocks graphed.
    torch.manual_seed(0)
    model = _Top().to(device).eval()
    x = torch.randn(4, 8, device=device)
    with torch.no_grad():
        expected = model(x)
        f = autograph.graphed(lambda x: model(x))
        for _ in range(10):
            torch.testing.assert_close(f(x), expected, rtol=0, atol=0)
    for block in model.routed.blocks:
        (row,) = autograph.stats(block)
        assert row.state == "graphed" and row.replays >= 3
