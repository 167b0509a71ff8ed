"""Verify mode (issue 12; docs/design.md, "Verify"): the first n replays of a key are checked
against an eager run of the same call. Planted faults (a Python value, a rebound tensor, a
Python branch) are caught with the first differing output or state named, and the caller still
gets eager's results with the call's effects once; correct functions (an MLP, dropout, batch
norm in training mode, an HF decode step) stay silent. CPU emulation and, through the
``device`` fixture, CUDA."""

import collections
import copy
import dataclasses

import pytest
import torch

import autograph
from autograph import _config

from conftest import autograph_warnings, device_label, requires_cuda, states
from helpers.knob import Knob

Output = collections.namedtuple("Output", "hidden logits")


def only_warning(caught):
    messages = autograph_warnings(caught)
    assert len(messages) == 1, messages
    return messages[0]


# ---- planted faults ----


def test_a_python_float_read_in_the_function_is_caught(device, caught):
    scale = Knob(1.0)

    @autograph.graphed(verify=2)
    def f(x):
        return x, Output(x + 1, x * scale[0])

    x = torch.ones(4, device=device)
    for i in range(6):
        scale[0] = float(i + 1)
        hidden, output = f(x)
        assert torch.equal(output.logits, x * (i + 1)) and torch.equal(hidden, x)
    message = only_warning(caught)
    assert message.startswith(
        f"{f.__qualname__}(x: f32[4] {device_label(device)}) runs "
        f"eagerly: verify: its replay differs from an eager run"
    )
    assert f"out[1].logits (f32[4] {device_label(device)}): max abs error 1 in 4 of 4" in message
    assert "a Python value it reads" in message and "Pass what changes as an argument" in message
    # warmup, capture (graph made with 2.0), then the first replay checked: 3.0 != 2.0
    assert states(f) == [("eager", 6, 5, 1)]
    assert f.stats()[0].fallback_reason in message


def test_a_rebound_tensor_whose_old_one_stays_alive_is_caught(device, caught):
    weight = torch.ones(4, device=device)

    @autograph.graphed(verify=1)
    def f(x):
        return x * weight

    x = torch.ones(4, device=device)
    f(x), f(x)
    kept = weight  # noqa: F841 - alive, so the read watch sees nothing freed
    weight = torch.full((4,), 3.0, device=device)
    assert torch.equal(f(x), x * 3) and torch.equal(f(x), x * 3)
    assert "out (f32[4]" in only_warning(caught) and "max abs error 2" in only_warning(caught)
    assert states(f) == [("eager", 4, 3, 1)]


def test_a_branch_on_a_python_flag_set_between_calls_is_caught(device, caught):
    # The function reads the flag and never changes it: only verify can see the replay differ.
    flip = Knob(False)

    @autograph.graphed(verify=3)
    def f(x):
        return x - 1 if flip[0] else x + 1

    x = torch.zeros(3, device=device)
    results = []
    for i in range(5):
        flip[0] = i % 2 == 1  # the capture (call 2) records the x - 1 branch
        results.append(f(x))
    assert [r[0].item() for r in results] == [1, -1, 1, -1, 1]  # eager's, every call
    message = only_warning(caught)
    assert "verify: its replay differs from an eager run" in message
    assert "max abs error 2" in message
    assert states(f) == [("eager", 5, 4, 1)]


def test_a_branch_on_a_python_counter_is_caught_at_capture_before_verify(device, caught):
    # The function changes the counter: its capture sees that (docs/design.md, "Python state"),
    # before any replay could be verified.
    calls = [0]

    @autograph.graphed(verify=3)
    def f(x):
        calls[0] += 1
        return x + 1 if calls[0] % 2 else x - 1

    x = torch.zeros(3, device=device)
    results = [f(x) for _ in range(5)]
    assert [r[0].item() for r in results] == [1, -1, 1, -1, 1]  # eager's, every call
    message = only_warning(caught)
    assert "(calls[0]: 1 -> 2)" in message and "its replay differs" not in message
    assert states(f) == [("eager", 5, 4, 1)]


def test_state_the_call_writes_is_compared_and_named(device, caught):
    scale = Knob(1.0)

    @autograph.graphed(verify=1)
    def f(x):
        x.mul_(scale[0])

    x = torch.ones(4, device=device)
    f(x), f(x)
    scale[0] = 5.0
    assert f(x) is None
    assert torch.equal(x, torch.full((4,), 5.0, device=device))  # eager's write, once
    assert (
        "x, which the call writes, holds other values after the replay: max abs error 4"
        in only_warning(caught)
    )


def test_a_rebound_tensor_the_call_writes_is_named(device, caught):
    total = torch.zeros(2, device=device)

    @autograph.graphed(verify=2)
    def f(x):
        total.add_(x)
        return x * 2

    x = torch.ones(2, device=device)
    f(x), f(x)
    old = total
    total = torch.zeros(2, device=device)
    assert torch.equal(f(x), x * 2)  # the outputs agree; the state written does not
    assert torch.equal(total, x)  # eager's write, once
    assert "total, which the call writes" in only_warning(caught)
    # The replay wrote into the old tensor, which eager never touches: that stays
    # (docs/guide/seeing.md, verify mode).
    assert torch.equal(old, x * 3)


def test_strict_raises_after_leaving_eager_effects_once(device):
    scale = Knob(1.0)

    @autograph.graphed(verify=1, strict=True)
    def f(x):
        x.add_(scale[0])
        return x.sum()

    x = torch.zeros(2, device=device)
    f(x), f(x)
    scale[0] = 10.0
    with pytest.raises(autograph.CaptureError, match="verify: its replay differs"):
        f(x)
    assert torch.equal(x, torch.full((2,), 12.0, device=device))
    with pytest.raises(autograph.CaptureError, match="verify: its replay differs"):
        f(x)


# ---- silent where the graph is right ----


def mlp(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).to(
        device
    )


def test_an_mlp_is_verified_silently(device, caught):
    model = mlp(device).eval()
    graphed = autograph.graphed(copy.deepcopy(model), verify=3)
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(4, 16, device=device)
            assert torch.equal(graphed(x), model(x))
    assert autograph_warnings(caught) == []
    (row,) = autograph.stats(graphed)
    assert (row.state, row.replays, row.verified) == ("graphed", 5, 3)


def test_dropout_draws_the_same_numbers_in_the_check_and_the_replay(device, caught):
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5)).to(device)
    graphed = autograph.graphed(copy.deepcopy(model), verify=4)
    x = torch.randn(8, 16, device=device)

    def run(m):
        torch.manual_seed(1)
        with torch.no_grad():
            return [m(x) for _ in range(6)]

    for eager, replayed in zip(run(model), run(graphed)):  # one call's draws per call
        assert torch.equal(eager, replayed)
    assert autograph_warnings(caught) == []
    assert [(r.state, r.verified) for r in autograph.stats(graphed)] == [("graphed", 4)]


def test_batch_norm_in_training_mode_updates_its_statistics_once_per_call(device, caught):
    model = torch.nn.BatchNorm1d(4).to(device)
    graphed = autograph.graphed(copy.deepcopy(model), verify=3)
    with torch.no_grad():
        for i in range(5):
            x = torch.randn(8, 4, device=device) * (i + 1)
            assert torch.equal(graphed(x), model(x))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(getattr(graphed, name), getattr(model, name)), name
    assert graphed.num_batches_tracked.item() == 5
    assert autograph_warnings(caught) == []
    assert [(r.state, r.verified) for r in autograph.stats(graphed)] == [("graphed", 3)]


def test_writes_to_arguments_and_state_happen_once_per_checked_call(device):
    counter = torch.zeros((), device=device)

    @autograph.graphed(verify=3)
    def f(x):
        counter.add_(1)
        x.mul_(2)
        return x + counter

    x = torch.ones(2, device=device)
    outputs = [f(x) for _ in range(5)]
    assert counter.item() == 5 and torch.equal(x, torch.full((2,), 32.0, device=device))
    assert [o[0].item() for o in outputs] == [3, 6, 11, 20, 37]
    assert [(r.state, r.replays, r.verified) for r in f.stats()] == [("graphed", 4, 3)]


def test_outputs_within_the_tolerance_pass_and_the_tolerance_can_be_loosened(
    device, caught, monkeypatch
):
    scale = Knob(1.0)

    @autograph.graphed(verify=1)
    def f(x):
        return x * scale[0]

    monkeypatch.setitem(autograph.VERIFY_TOLERANCES, torch.float32, (0.0, 0.5))
    x = torch.ones(3, device=device)
    f(x), f(x)
    scale[0] = 1.25
    assert torch.equal(f(x), x)  # within atol=0.5: the graph's result, verified
    assert autograph_warnings(caught) == []
    assert [(r.state, r.verified) for r in f.stats()] == [("graphed", 1)]


def test_integer_outputs_must_match_exactly(device, caught):
    offset = Knob(0)

    @autograph.graphed(verify=1)
    def f(x):
        return x + offset[0]

    x = torch.zeros(3, dtype=torch.int64, device=device)
    f(x), f(x)
    offset[0] = 1
    assert torch.equal(f(x), x + 1)
    assert "max abs error 1 in 3 of 3 elements (integers must match exactly)" in only_warning(
        caught
    )


@dataclasses.dataclass
class Prediction:
    logits: torch.Tensor
    label: str


def test_non_tensor_outputs_are_compared_too(device, caught):
    label = Knob("a")

    @autograph.graphed(verify=1)
    def f(x):
        return {"prediction": Prediction(x * 2, label[0])}

    x = torch.ones(2, device=device)
    f(x), f(x)
    label[0] = "b"
    assert f(x)["prediction"].label == "b"
    assert "out['prediction'].label is 'b' in the eager run and 'a' in the replay" in only_warning(
        caught
    )


def test_only_the_first_n_replays_after_each_capture_are_checked(device):
    scale = Knob(1.0)

    @autograph.graphed(verify=1)
    def f(x):
        return x * scale[0]

    x = torch.ones(2, device=device)
    for _ in range(4):
        f(x)
    scale[0] = 2.0
    assert torch.equal(f(x), x)  # no longer checked: the graph's stale result
    assert [(r.state, r.replays, r.verified) for r in f.stats()] == [("graphed", 4, 1)]


def test_verify_comes_from_the_environment_unless_set(device, monkeypatch):
    monkeypatch.setattr(_config, "ENV", _config.Environment(verify=2))

    @autograph.graphed
    def f(x):
        return x + 1

    @autograph.graphed(verify=0)
    def g(x):
        return x + 1

    x = torch.ones(2, device=device)
    for _ in range(5):
        f(x), g(x)
    assert [r.verified for r in f.stats()] == [2] and [r.verified for r in g.stats()] == [0]


def test_modules_in_a_region_are_verified_with_the_region_s_option(device, caught):
    model = mlp(device).eval()
    with torch.no_grad(), autograph.region(verify=2) as region:
        for _ in range(5):  # a plain call and a watched warmup (the region's warmup=2) first
            model(torch.randn(2, 16, device=device))
    assert [(r.state, r.replays, r.verified) for r in region.stats().keys] == [("graphed", 3, 2)]
    assert autograph_warnings(caught) == []


def test_verify_is_off_by_default(device):
    @autograph.graphed
    def f(x):
        return x + 1

    for _ in range(3):
        f(torch.ones(2, device=device))
    assert [r.verified for r in f.stats()] == [0]


# ---- a real model, on a GPU ----


@pytest.mark.cuda
@requires_cuda
def test_hf_llama_decode_with_static_cache_verifies_silently(caught):
    from helpers.models import llama, static_decode

    transformers, config, model = llama(layers=2)
    graphed_model = autograph.graphed(copy.deepcopy(model), verify=3)
    prompt = torch.randint(0, 1024, (1, 8), device="cuda")
    tokens = torch.randint(0, 1024, (8, 1, 1), device="cuda")

    def decode(m):
        return static_decode(m, transformers, config, prompt, tokens)

    got = decode(graphed_model)  # holds its cache, whose keys go when it dies
    for step, (a, b) in enumerate(zip(decode(model), got)):
        assert torch.equal(a, b), f"decode step {step} differs"
    assert autograph_warnings(caught) == []
    decode_row = autograph.stats(graphed_model)[1]
    assert (decode_row.state, decode_row.replays, decode_row.verified) == ("graphed", 7, 3)


def test_a_training_step_is_verified_and_trains_as_eagerly(device, caught):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1)
    ).to(device)
    graphed = autograph.graphed(copy.deepcopy(model), verify=3)
    for m in (model, graphed):
        torch.manual_seed(1)
        optimizer = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(6):
            m(torch.randn(4, 8, device=device)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    for a, b in zip(model.parameters(), graphed.parameters()):
        assert torch.equal(a, b)
    assert autograph_warnings(caught) == []
    assert [(r.state, r.replays, r.verified) for r in autograph.stats(graphed)] == [
        ("graphed", 5, 3)
    ]


def test_a_verified_call_writes_through_a_view_exactly_once(device):
    acc = torch.zeros(4, device=device)

    @autograph.graphed(verify=3)
    def accumulate(x):
        acc[:2].add_(x)
        return x * 1

    for _ in range(4):
        accumulate(torch.ones(2, device=device))
    assert torch.equal(acc, torch.tensor([4.0, 4.0, 0.0, 0.0], device=device))
    (row,) = accumulate.stats()
    assert (row.state, row.verified) == ("graphed", 2)


def test_an_hf_bert_encoder_served_with_buckets_verifies_silently(device, caught):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=256,
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config).to(device).eval()
    graphed = autograph.graphed(copy.deepcopy(model), buckets=[2, 4], verify=2)
    torch.manual_seed(1)
    with torch.inference_mode():
        for batch in (3, 4, 2, 3, 4, 3):
            ids = torch.randint(0, 256, (batch, 16), device=device)
            mask = torch.ones(batch, 16, dtype=torch.long, device=device)
            mask[0, 10:] = 0
            expected = model(ids, attention_mask=mask).last_hidden_state
            got = graphed(ids, attention_mask=mask).last_hidden_state
            assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    assert autograph_warnings(caught) == []
    rows = sorted(autograph.stats(graphed), key=lambda row: row.bucket)
    # bucket 2: one call (its warmup); bucket 4: five calls, warmup, capture, three replays:
    # the capture call's own result, its first replay with pad rows (checked once whether or
    # not verify is on) and the first two replays checked against eager runs
    assert [(r.bucket, r.state, r.verified) for r in rows] == [(2, "warmup", 0), (4, "graphed", 4)]
