"""The engine, run twice per test: on CPU tensors through the CPU emulation of CUDA graphs
(see conftest), and on a GPU with real CUDA graphs where there is one.

The emulation replays recorded ATen ops without re-running Python, with fixed addresses, like a
CUDA graph; so even without a GPU these tests exercise the real keys, phases, copies and
fallbacks.
"""
import collections
import dataclasses
import gc
import threading
import weakref

import pytest
import torch

import autograph
from conftest import autograph_warnings, device_label


def states(fn):
    return [(s.state, s.calls, s.eager_calls, s.replays) for s in fn.stats()]


def test_warmup_then_capture_then_replay(device):
    python_runs = []

    @autograph.graphed(warmup=2)
    def step(x, w):
        python_runs.append(1)
        return torch.relu(x @ w).sum(-1)

    w = torch.randn(8, 8, device=device)
    for i in range(6):
        x = torch.randn(4, 8, device=device)
        assert torch.equal(step(x, w), torch.relu(x @ w).sum(-1))
        expected_state = "warmup" if i < 2 else "graphed"
        assert step.stats()[0].state == expected_state
    # two warmups and one capture ran Python; three replays did not
    assert len(python_runs) == 3
    assert states(step) == [("graphed", 6, 2, 4)]


def test_each_call_runs_the_work_exactly_once_in_every_phase(device):
    counter = torch.zeros((), dtype=torch.int64, device=device)

    @autograph.graphed(warmup=2)
    def bump(x):
        counter.add_(1)
        return x + counter

    for n in range(1, 8):
        out = bump(torch.zeros(3, device=device))
        assert counter.item() == n
        assert torch.equal(out, torch.full((3,), float(n), device=device))


def test_several_shapes_get_separate_graphs(device):
    @autograph.graphed
    def double(x):
        return x * 2

    for n in (1, 2, 3, 1, 2, 3, 1):
        x = torch.randn(n, device=device)
        assert torch.equal(double(x), x * 2)
    assert sorted((s.key, s.calls) for s in double.stats()) == [
        (f"x: f32[{n}] {device_label(device)}", calls) for n, calls in ((1, 3), (2, 2), (3, 2))]


def test_pytree_inputs_and_outputs(device):
    @autograph.graphed
    def f(batch, scale=1.0):
        h = batch["x"] @ batch["w"][0]
        return {"h": h * scale, "parts": (h.sum(), [h.mean(-1)])}

    for _ in range(4):
        batch = {"x": torch.randn(2, 3, device=device), "w": [torch.randn(3, 3, device=device)]}
        out = f(batch, scale=2.0)
        h = batch["x"] @ batch["w"][0]
        assert torch.equal(out["h"], h * 2.0)
        assert torch.equal(out["parts"][0], h.sum())
        assert torch.equal(out["parts"][1][0], h.mean(-1))
    assert states(f) == [("graphed", 4, 1, 3)]


def test_outputs_are_owned_by_the_caller_across_calls(device):
    @autograph.graphed
    def f(x):
        return x + 1

    kept = [f(torch.full((2,), float(i), device=device)) for i in range(5)]
    assert [k[0].item() for k in kept] == [1, 2, 3, 4, 5]


def test_static_outputs_without_poisoning_support_fall_back_to_copies(emulated):
    # The CPU build of torch cannot poison storages, so "static" must still be safe.
    @autograph.graphed(outputs="static")
    def f(x):
        return x + 1

    kept = [f(torch.full((2,), float(i))) for i in range(4)]
    assert [k[0].item() for k in kept] == [1, 2, 3, 4]


def test_in_place_writes_reach_the_callers_tensor(device):
    @autograph.graphed
    def accumulate(total, x):
        total.add_(x)
        return total.sum()

    total = torch.zeros(3, device=device)
    for i in range(5):
        s = accumulate(total, torch.ones(3, device=device))
        assert torch.equal(total, torch.full((3,), i + 1.0, device=device))
        assert s.item() == 3 * (i + 1)


def test_outputs_aliasing_arguments_are_the_callers_tensors(device):
    @autograph.graphed
    def f(x, y):
        x.mul_(2)
        return x, x[1:], y.t(), x + 1

    for _ in range(3):
        x, y = torch.ones(4, device=device), torch.randn(2, 3, device=device)
        a, b, c, d = f(x, y)
        assert a is x and torch.equal(x, torch.full((4,), 2.0, device=device))
        assert b.data_ptr() == x.data_ptr() + x.element_size() and torch.equal(b, x[1:])
        assert c.data_ptr() == y.data_ptr() and torch.equal(c, y.t())
        assert torch.equal(d, x + 1)


def test_outputs_that_alias_each_other_stay_aliased(device):
    @autograph.graphed
    def f(x):
        y = x * 2
        return y, y[::2], y.view(2, 2)

    for _ in range(3):
        y, every_other, square = f(torch.arange(4.0, device=device))
        assert torch.equal(y, torch.arange(4.0, device=device) * 2)
        y.zero_()
        assert every_other.abs().sum() == 0 and square.abs().sum() == 0


def test_write_through_an_argument_that_shares_memory_runs_eagerly(device):
    @autograph.graphed
    def f(a, b):
        a.add_(1)
        return b * 1

    for _ in range(3):
        f(torch.zeros(2, device=device), torch.zeros(2, device=device))
    x = torch.zeros(2, device=device)
    assert torch.equal(f(x, x), torch.ones(2, device=device))   # eager sees the write through b


def test_random_ops_give_fresh_numbers_on_every_replay(device):
    @autograph.graphed
    def noise(x):
        return x + torch.rand(4, device=device)

    draws = [noise(torch.zeros(4, device=device)) for _ in range(5)]
    assert len({tuple(d.tolist()) for d in draws}) == 5


def test_python_side_effects_happen_at_capture_not_at_replay(device):
    seen = []

    @autograph.graphed
    def f(x):
        seen.append(x.shape)
        return x

    for _ in range(5):
        f(torch.zeros(1, device=device))
    assert len(seen) == 2  # warmup and capture (SPEC 7)


class Scaler(torch.nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.scale = scale

    @autograph.graphed
    def forward(self, x):
        return self.linear(x) * self.scale


def test_methods_keep_graphs_per_instance(device):
    a, b = Scaler(1.0).to(device), Scaler(3.0).to(device)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(2, 4, device=device)
            assert torch.equal(a(x), a.linear(x) * 1.0)
            assert torch.equal(b(x), b.linear(x) * 3.0)
    rows = Scaler.forward.stats()   # instances are numbered in order of first call
    assert len({r.function for r in rows}) == 2
    assert all(r.function.startswith("Scaler.forward#") for r in rows)
    assert [(r.state, r.calls) for r in rows] == [("graphed", 4), ("graphed", 4)]


def test_the_cache_keeps_no_instance_alive(device):
    model = Scaler(2.0).to(device)
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(2, 4, device=device))
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
    assert all(r.function != "Scaler.forward#1" for r in autograph.stats())


class Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("offset", torch.ones(4))

    def forward(self, x):
        return torch.nn.functional.gelu(self.linear(x)) + self.offset


def test_a_graphed_module_is_still_the_module(device):
    model = Plain().to(device)
    graphed = autograph.graphed(model)
    assert graphed is model and isinstance(graphed, Plain)
    assert set(graphed.state_dict()) == {"linear.weight", "linear.bias", "offset"}
    assert len(list(graphed.parameters())) == 2
    with torch.no_grad():
        for mode in ("train", "eval", "train"):
            getattr(graphed, mode)()
            for _ in range(3):
                x = torch.randn(3, 4, device=device)
                assert torch.equal(graphed(x), torch.nn.functional.gelu(model.linear(x)) + 1)
    assert sorted(r.key for r in graphed.forward.stats()) == [
        f"x: f32[3, 4] {device_label(device)} (no_grad, {mode})" for mode in ("eval", "train")]
    ref = weakref.ref(model)
    del model, graphed
    gc.collect()
    assert ref() is None


def test_replaced_parameters_are_captured_again(device):
    model = autograph.graphed(Plain().to(device))
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(2, 4, device=device))
        model.linear.weight.data = torch.randn(4, 4, device=device)
        model.offset = torch.full((4,), 5.0, device=device)  # a buffer replaced by assignment
        for _ in range(2):
            x = torch.randn(2, 4, device=device)
            expected = torch.nn.functional.gelu(model.linear(x)) + 5.0
            assert torch.equal(model(x), expected)


def test_calls_that_need_gradients_run_eagerly_and_say_so_once(device, caught):
    model = autograph.graphed(Plain().to(device))
    for _ in range(3):
        out = model(torch.randn(2, 4, device=device))
        assert out.requires_grad
    messages = autograph_warnings(caught)
    assert len(messages) == 1
    assert "runs eagerly: its outputs need gradients" in messages[0]
    assert "torch.no_grad()" in messages[0]
    assert caught[0].filename == __file__


def test_closed_over_parameters_that_need_gradients_are_found_at_warmup(device, caught):
    weight = torch.randn(3, requires_grad=True, device=device)

    @autograph.graphed
    def f(x):
        return x * weight

    for _ in range(3):
        assert f(torch.ones(3, device=device)).requires_grad
    assert states(f) == [("eager", 3, 3, 0)]
    assert len(autograph_warnings(caught)) == 1


def test_max_graphs_bounds_the_graphs_and_says_so_once(device, caught):
    @autograph.graphed(max_graphs=2)
    def f(x):
        return x + 1

    for n in range(1, 6):
        for _ in range(2):
            assert torch.equal(f(torch.zeros(n, device=device)), torch.ones(n, device=device))
    by_state = sorted(s.state for s in f.stats())
    assert by_state == ["eager", "eager", "eager", "graphed", "graphed"]
    messages = autograph_warnings(caught)
    assert len(messages) == 1 and "max_graphs=2" in messages[0]


def test_reset_drops_graphs_and_starts_over(device):
    @autograph.graphed
    def f(x):
        return x * 3

    for _ in range(3):
        f(torch.ones(2, device=device))
    f.reset()
    assert f.stats() == []
    assert torch.equal(f(torch.ones(2, device=device)), torch.full((2,), 3.0, device=device))
    assert states(f) == [("warmup", 1, 1, 0)]


def test_unsafe_operation_falls_back_once_with_the_users_line(device, caught):
    @autograph.graphed
    def f(x):
        if x.sum() > 0:
            return x * 2
        return x

    for _ in range(3):
        assert torch.equal(f(torch.ones(2, device=device)), torch.full((2,), 2.0, device=device))
    messages = autograph_warnings(caught)
    line = f.__wrapped__.__code__.co_firstlineno + 2
    assert messages == [f"test_unsafe_operation_falls_back_once_with_the_users_line"
                        f".<locals>.f(x: f32[2] {device_label(device)}) runs eagerly: "
                        f"a tensor used as a Python "
                        f"condition at test_graphed.py:{line} synchronises with the host"]
    assert f.stats()[0].fallback_reason == messages[0].split("runs eagerly: ")[1]


def test_unsafe_operation_only_on_the_capture_path_is_stopped(device, caught):
    read_on_host = [False]

    @autograph.graphed
    def f(x):
        if read_on_host[0]:
            return x.sum().item() + x
        return x + 1

    outs = [f(torch.zeros(1, device=device))]
    read_on_host[0] = True        # the warmup did not take this path; the capture does
    outs += [f(torch.zeros(1, device=device)) for _ in range(3)]
    assert [o.item() for o in outs] == [1.0, 0.0, 0.0, 0.0]
    assert f.stats()[0].state == "eager"
    assert ".item()" in autograph_warnings(caught)[0]


def test_strict_raises_instead_of_falling_back(device):
    @autograph.graphed(strict=True)
    def f(x):
        return x * x.sum().item()

    for _ in range(3):  # found at the (only) warmup call, then raised on every call
        with pytest.raises(autograph.CaptureError, match=r"runs eagerly: \.item\(\) at"):
            f(torch.ones(2, device=device))


def test_users_own_exception_propagates_in_every_phase_and_the_key_recovers(device):
    counter = torch.zeros((), device=device)
    fail = [False]

    @autograph.graphed
    def f(x):
        counter.add_(1)
        if fail[0]:
            raise ValueError("bad input")
        return x + counter

    fail[0] = True
    with pytest.raises(ValueError, match="bad input"):   # warmup
        f(torch.zeros(1, device=device))
    fail[0] = False
    f(torch.zeros(1, device=device))
    fail[0] = True
    with pytest.raises(ValueError, match="bad input") as raised:   # capture
        f(torch.zeros(1, device=device))
    assert raised.traceback[-1].name == "f"
    assert counter.item() == 3  # the work before the raise ran, once, as in eager mode
    fail[0] = False
    assert f(torch.zeros(1, device=device)).item() == 4   # captured now
    assert f(torch.zeros(1, device=device)).item() == 5   # replayed
    assert f.stats()[0].state == "graphed"


def test_a_graphed_function_inside_another_becomes_part_of_its_graph(device):
    @autograph.graphed
    def inner(x):
        return x * 2

    @autograph.graphed
    def outer(x):
        return inner(x) + 1

    for _ in range(4):
        x = torch.randn(3, device=device)
        assert torch.equal(outer(x), x * 2 + 1)
    assert states(outer) == [("graphed", 4, 1, 3)]


def test_threads_calling_one_function_get_their_own_results(device):
    # On CUDA the capture may happen in a thread that never ran a matmul: its cuBLAS handle
    # must exist before the capture starts.
    @autograph.graphed
    def f(x, w):
        return torch.relu(x @ w)

    w = torch.randn(16, 16, device=device)
    errors = []

    def worker(seed):
        g = torch.Generator(device=device).manual_seed(seed)
        for _ in range(50):
            x = torch.randn(16, 16, generator=g, device=device)
            if not torch.equal(f(x, w), torch.relu(x @ w)):
                errors.append(seed)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert states(f) == [("graphed", 200, 1, 199)]


def test_stats_and_report(device, capsys):
    @autograph.graphed
    def f(x):
        return x + 1

    for _ in range(3):
        f(torch.zeros(2, device=device))
    row, = [r for r in autograph.stats() if r.function.endswith("<locals>.f")]
    assert (row.key, row.state, row.calls, row.replays, row.eager_calls, row.fallback_reason) \
        == (f"x: f32[2] {device_label(device)}", "graphed", 3, 2, 1, None)
    assert row.capture_seconds is not None and row.capture_seconds > 0
    autograph.report()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["function", "key", "state", "calls", "replays", "eager",
                                "capture", "ms", "MiB", "fallback", "reason"]
    line = next(line for line in lines if line.startswith(row.function))
    assert line.split()[1:8] == ["x:", "f32[2]", device_label(device), "graphed", "3", "2", "1"]


def test_disabled_environment_is_checked_on_every_call(device, monkeypatch):
    from autograph import _config
    runs = []

    @autograph.graphed
    def f(x):
        runs.append(1)
        return x

    monkeypatch.setattr(_config, "ENV", _config.Environment(disable=True))
    for _ in range(4):
        f(torch.zeros(1, device=device))
    assert len(runs) == 4 and f.stats() == []


def test_expanded_and_strided_arguments(device):
    @autograph.graphed
    def f(bias, x):
        return x + bias

    for _ in range(4):
        bias = torch.randn(8, device=device).expand(4, 8)   # stride 0 in the first dimension
        x = torch.randn(8, 4, device=device).t()             # not contiguous
        assert torch.equal(f(bias, x), x + bias)
    row, = f.stats()
    assert row.state == "graphed" and "strides=(0, 1)" in row.key


@dataclasses.dataclass
class Prediction:
    logits: torch.Tensor
    label: str


def test_dataclass_and_namedtuple_outputs(device):
    Pair = collections.namedtuple("Pair", "first second")

    @autograph.graphed
    def f(x):
        return Prediction(x * 2, "doubled"), Pair(x + 1, None)

    for _ in range(4):
        x = torch.randn(3, device=device)
        prediction, pair = f(x)
        assert isinstance(prediction, Prediction) and prediction.label == "doubled"
        assert torch.equal(prediction.logits, x * 2)
        assert isinstance(pair, Pair) and torch.equal(pair.first, x + 1) and pair.second is None
    assert f.stats()[0].state == "graphed"
