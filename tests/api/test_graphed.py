"""The engine, run twice per test: on CPU tensors through the CPU emulation of CUDA graphs
(see conftest), and on a GPU with real CUDA graphs where there is one.

The emulation replays recorded ATen ops without re-running Python, with fixed addresses, like a
CUDA graph; so even without a GPU these tests exercise the real keys, phases, copies and
fallbacks.
"""

import collections
import dataclasses
import gc
import sys
import threading
import weakref

import pytest
import torch

import autograph
from autograph import _config
from autograph.watch._guard import host_read_fix

from conftest import autograph_warnings, device_label, is_label_of, python_run_log, states


def test_warmup_then_capture_then_replay(device):
    log_run = python_run_log()

    @autograph.graphed(warmup=2)
    def step(x, w):
        log_run()
        return torch.relu(x @ w).sum(-1)

    w = torch.randn(8, 8, device=device)
    for i in range(6):
        x = torch.randn(4, 8, device=device)
        assert torch.equal(step(x, w), torch.relu(x @ w).sum(-1))
        expected_state = "warmup" if i < 2 else "graphed"
        assert step.stats()[0].state == expected_state
    # two warmups and one capture ran Python; three replays did not
    assert len(log_run.runs) == 3
    assert states(step) == [("graphed", 6, 2, 4)]


def test_each_call_runs_the_work_exactly_once_in_every_phase(device):
    counter = torch.zeros((), dtype=torch.int64, device=device)
    log_run = python_run_log()

    @autograph.graphed(warmup=2)
    def bump(x):
        log_run()
        counter.add_(1)
        return x + counter

    phases = []
    for n in range(1, 8):
        out = bump(torch.zeros(3, device=device))
        assert counter.item() == n
        assert torch.equal(out, torch.full((3,), float(n), device=device))
        phases.append(states(bump))
    # two warmups, the capture (replayed once for its result), then four replays: the
    # replays did the work without running Python
    assert phases == [
        [("warmup", 1, 1, 0)],
        [("warmup", 2, 2, 0)],
        [("graphed", 3, 2, 1)],
        *[[("graphed", n, 2, n - 2)] for n in range(4, 8)],
    ]
    assert len(log_run.runs) == 3


def test_several_shapes_get_separate_graphs(device):
    @autograph.graphed
    def double(x):
        return x * 2

    for n in (1, 2, 3, 1, 2, 3, 1):
        x = torch.randn(n, device=device)
        assert torch.equal(double(x), x * 2)
    assert [(s.key, s.state, s.calls, s.eager_calls, s.replays) for s in double.stats()] == [
        (f"x: f32[{n}] {device_label(device)}", "graphed", calls, 1, calls - 1)
        for n, calls in ((1, 3), (2, 2), (3, 2))
    ]


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
    assert states(f) == [("graphed", 5, 1, 4)]
    assert len({k.data_ptr() for k in kept}) == 5


def test_static_outputs_without_poisoning_support_fall_back_to_copies(emulated):
    # The CPU build of torch cannot poison storages, so "static" must still be safe.
    @autograph.graphed(outputs="static")
    def f(x):
        return x + 1

    kept = [f(torch.full((2,), float(i))) for i in range(4)]
    assert [k[0].item() for k in kept] == [1, 2, 3, 4]
    assert states(f) == [("graphed", 4, 1, 3)]


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
    assert states(accumulate) == [("graphed", 5, 1, 4)]


def test_outputs_aliasing_arguments_are_the_callers_tensors(device):
    @autograph.graphed
    def f(x, y):
        x.mul_(2)
        return x, x[1:], y.t(), x + 1

    for _ in range(4):
        x, y = torch.ones(4, device=device), torch.randn(2, 3, device=device)
        a, b, c, d = f(x, y)
        assert a is x and torch.equal(x, torch.full((4,), 2.0, device=device))
        assert b.data_ptr() == x.data_ptr() + x.element_size() and torch.equal(b, x[1:])
        assert c.data_ptr() == y.data_ptr() and torch.equal(c, y.t())
        assert torch.equal(d, x + 1)
    assert states(f) == [("graphed", 4, 1, 3)]


def test_outputs_that_alias_each_other_stay_aliased(device):
    @autograph.graphed
    def f(x):
        y = x * 2
        return y, y[::2], y.view(2, 2)

    for _ in range(4):
        y, every_other, square = f(torch.arange(4.0, device=device))
        assert torch.equal(y, torch.arange(4.0, device=device) * 2)
        y.zero_()
        assert every_other.abs().sum() == 0 and square.abs().sum() == 0
    assert states(f) == [("graphed", 4, 1, 3)]


def test_write_through_an_argument_that_shares_memory_runs_eagerly(device):
    def make():
        @autograph.graphed
        def f(a, b):
            a.add_(1)
            return b * 1

        return f

    def separate():
        return torch.zeros(2, device=device), torch.zeros(2, device=device)

    ones = torch.ones(2, device=device)
    f = make()
    for _ in range(3):
        assert torch.equal(f(*separate()), torch.zeros(2, device=device))
    assert states(f) == [("graphed", 3, 1, 2)]
    x = torch.zeros(2, device=device)
    assert torch.equal(f(x, x), ones)  # eager sees the write through b
    assert torch.equal(x, ones)
    assert states(f) == [("graphed", 4, 2, 2)]  # the graph stays, the call did not replay it
    assert torch.equal(f(*separate()), torch.zeros(2, device=device))
    assert states(f) == [("graphed", 5, 2, 3)]  # and serves the next call

    g = make()  # the capture call itself shares memory
    g(*separate())
    x = torch.zeros(2, device=device)
    assert torch.equal(g(x, x), ones) and torch.equal(x, ones)
    assert states(g) == [("warmup", 2, 2, 0)]  # ran eagerly, nothing captured
    for _ in range(2):
        assert torch.equal(g(*separate()), torch.zeros(2, device=device))
    assert states(g) == [("graphed", 4, 2, 2)]  # captured at the next call


def test_random_ops_give_fresh_numbers_on_every_replay_and_follow_the_seed(device):
    def noisy(x):
        return torch.nn.functional.dropout(x, 0.5) + torch.rand_like(x)

    graphed = autograph.graphed(noisy)

    def run(fn):
        torch.manual_seed(0)
        return [fn(torch.ones(64, device=device)) for _ in range(6)]

    first = run(graphed)
    assert states(graphed) == [("graphed", 6, 1, 5)]
    assert len({tuple(t.tolist()) for t in first}) == 6
    second = run(graphed)  # every call a replay now
    assert states(graphed) == [("graphed", 12, 1, 11)]
    # a capture and its replay advance the generator as one eager call does, and a replay
    # draws what an eager call would from the same generator state
    eager = run(noisy)
    assert all(torch.equal(a, b) for a, b in zip(first, eager))
    assert all(torch.equal(a, b) for a, b in zip(second, eager))


def test_python_side_effects_on_state_the_call_reaches_make_its_key_eager(device, caught):
    seen = []

    @autograph.graphed
    def f(x):
        seen.append(x.shape)
        return x * 2

    for _ in range(5):
        assert torch.equal(f(torch.ones(1, device=device)), torch.full((1,), 2.0, device=device))
    # A replay would not append (docs/design.md, "Python state"): the capture saw the change, so
    # every call runs its Python, as eagerly; the capture call's own replay is its result.
    assert len(seen) == 5
    assert states(f) == [("eager", 5, 4, 1)]
    (message,) = autograph_warnings(caught)
    assert "(seen: length 1 -> 2)" in message
    assert f.stats()[0].fallback_reason in message


def test_python_side_effects_the_call_cannot_reach_happen_at_capture_not_at_replay(device, capsys):
    log_run = python_run_log()  # a function in another module: no state of the call's

    @autograph.graphed
    def f(x):
        log_run(tuple(x.shape))
        print("ran on", tuple(x.shape))
        return x

    for _ in range(5):
        f(torch.zeros(1, device=device))
    assert log_run.runs == [(1,), (1,)]  # warmup and capture (docs/design.md, "Python state")
    assert capsys.readouterr().out == "ran on (1,)\n" * 2
    assert states(f) == [("graphed", 5, 1, 4)]


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
    rows = Scaler.forward.stats()  # instances are numbered in order of first call
    assert len({r.function for r in rows}) == 2
    assert all(r.function.startswith("Scaler.forward#") for r in rows)
    assert states(Scaler.forward) == [("graphed", 4, 1, 3), ("graphed", 4, 1, 3)]
    # one instance's rows, by the instance or by its bound method
    (a_row,) = autograph.stats(a)
    assert autograph.stats(a.forward) == rows and a_row in rows
    assert autograph.stats(b)[0].function != a_row.function


def test_the_cache_keeps_no_instance_alive(device):
    engine = Scaler.forward._self_engine
    model = Scaler(2.0).to(device)
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(2, 4, device=device))
    (row,) = autograph.stats(model)
    assert (row.state, row.calls, row.eager_calls, row.replays) == ("graphed", 3, 1, 2)
    assert row in Scaler.forward.stats()
    cache = engine.instance_caches[model]
    cache_ref, graph_ref = weakref.ref(cache), weakref.ref(next(iter(cache.entries.values())).graph)
    del cache
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
    # the instance's cache, its graph and its rows went with it (instance numbers are never
    # reused, so no other instance's row can carry this name)
    assert cache_ref() is None and graph_ref() is None
    assert all(r.function != row.function for r in Scaler.forward.stats())
    assert all(r.function != row.function for r in autograph.stats())


class Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("offset", torch.ones(4))
        self.log_run = python_run_log()  # the forward's Python runs at warmup and capture only

    @property
    def python_runs(self):
        return len(self.log_run.runs)

    def forward(self, x):
        self.log_run()
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
    assert sorted(
        (r.key, r.state, r.calls, r.eager_calls, r.replays) for r in graphed.forward.stats()
    ) == [
        (f"x: f32[3, 4] {device_label(device)} (no_grad, {mode})", "graphed", calls, 1, calls - 1)
        for mode, calls in (("eval", 3), ("train", 6))
    ]
    assert autograph.stats(graphed) == graphed.forward.stats()
    assert is_label_of(graphed.forward.stats()[0].function, Plain)
    assert model.python_runs == 4  # warmup and capture of each key
    ref = weakref.ref(model)
    del model, graphed
    gc.collect()
    assert ref() is None


def test_replaced_parameters_are_captured_again(device):
    model = autograph.graphed(Plain().to(device))

    def check(offset):
        x = torch.randn(2, 4, device=device)
        expected = torch.nn.functional.gelu(model.linear(x)) + offset
        assert torch.equal(model(x), expected)

    with torch.no_grad():
        for _ in range(3):
            check(1.0)
        assert states(model) == [("graphed", 3, 1, 2)] and model.python_runs == 2
        model.linear.weight.data = torch.randn(4, 4, device=device)
        model.offset = torch.full((4,), 5.0, device=device)  # a buffer replaced by assignment
        for _ in range(2):
            check(5.0)
        # the first call after the change captured again (the forward's Python ran once
        # more), and both calls replayed
        assert states(model) == [("graphed", 5, 1, 4)] and model.python_runs == 3
        model.to(torch.float64).to(torch.float32)  # every parameter and buffer: new memory
        model.linear.weight.mul_(0)  # and an update in place must show
        for _ in range(2):
            check(5.0)
        assert states(model) == [("graphed", 7, 1, 6)] and model.python_runs == 4


def test_calls_that_need_gradients_are_graphed_with_their_backward(device, caught):
    model, twin = autograph.graphed(Plain().to(device)), Plain().to(device)
    twin.load_state_dict(model.state_dict())
    for _ in range(3):
        x = torch.randn(2, 4, device=device)
        out = model(x)
        assert out.requires_grad and torch.equal(out, twin(x))
        out.sum().backward()
        twin(x).sum().backward()
    assert torch.equal(model.linear.weight.grad, twin.linear.weight.grad)
    assert states(model) == [("graphed", 3, 1, 2)]
    assert model.python_runs == 2  # warmup and capture; the replays run no Python
    assert autograph_warnings(caught) == []


def test_closed_over_parameters_that_need_gradients_are_found_at_warmup(device, caught):
    weight = torch.randn(3, requires_grad=True, device=device)

    @autograph.graphed
    def f(x):
        return x * weight

    for _ in range(3):
        out = f(torch.ones(3, device=device))
        assert out.requires_grad
        out.sum().backward()
    assert torch.equal(weight.grad, torch.full((3,), 3.0, device=device))
    assert states(f) == [("graphed", 3, 1, 2)]
    assert autograph_warnings(caught) == []


def test_max_graphs_bounds_the_graphs_and_says_so_once(device, caught):
    @autograph.graphed(max_graphs=2)
    def f(x):
        return x + 1

    for n in range(1, 6):
        for _ in range(2):
            assert torch.equal(f(torch.zeros(n, device=device)), torch.ones(n, device=device))
    assert states(f) == [("graphed", 2, 1, 1)] * 2 + [("eager", 2, 2, 0)] * 3
    messages = autograph_warnings(caught)
    assert len(messages) == 1 and "max_graphs=2" in messages[0]


def test_reset_drops_graphs_and_starts_over(device):
    @autograph.graphed
    def f(x):
        return x * 3

    for _ in range(3):
        f(torch.ones(2, device=device))
    assert states(f) == [("graphed", 3, 1, 2)]
    f.reset()
    assert f.stats() == []
    assert torch.equal(f(torch.ones(2, device=device)), torch.full((2,), 3.0, device=device))
    assert states(f) == [("warmup", 1, 1, 0)]


def test_reset_frees_a_graph_that_a_reference_cycle_holds(device):
    # The warmup leaves a cycle holding its frame, whose caller frames hold the key's life
    # (torch's own first import of torch._dynamo inside a call left one): reset collects it.
    cycles = []

    @autograph.graphed
    def f(x):
        if not cycles:
            cycle = [sys._getframe()]
            cycle.append(cycle)
            cycles.append(True)
        return x * 3

    gc.disable()
    try:
        for _ in range(3):
            f(torch.ones(2, device=device))
        assert states(f) == [("graphed", 3, 1, 2)]
        graphs = [weakref.ref(life.graph) for life in f._self_engine.cache.entries.values()]
        assert graphs and cycles
        f.reset()
        assert [g for g in graphs if g() is not None] == []
    finally:
        gc.enable()


def test_unsafe_operation_falls_back_once_with_the_users_line(device, caught):
    @autograph.graphed
    def f(x):
        if x.sum() > 0:
            return x * 2
        return x

    assert torch.equal(f(torch.ones(2, device=device)), torch.full((2,), 2.0, device=device))
    assert autograph_warnings(caught) == []  # the warmup ran as written, the guard watching
    for _ in range(2):  # the capture stops at the unsafe line; this call and later run eagerly
        assert torch.equal(f(torch.ones(2, device=device)), torch.full((2,), 2.0, device=device))
    assert states(f) == [("eager", 3, 3, 0)]
    messages = autograph_warnings(caught)
    line = f.__wrapped__.__code__.co_firstlineno + 2
    assert messages == [
        f"test_unsafe_operation_falls_back_once_with_the_users_line"
        f".<locals>.f(x: f32[2] {device_label(device)}) runs eagerly: "
        f"a tensor used as a Python "
        f"condition at test_graphed.py:{line} synchronises with the host, and "
        f"{host_read_fix('a tensor used as a Python condition')}"
    ]
    assert f.stats()[0].fallback_reason == messages[0].split("runs eagerly: ")[1]


def test_unsafe_operation_only_on_the_capture_path_is_stopped(device, caught):
    read_on_host = [False]

    @autograph.graphed
    def f(x):
        if read_on_host[0]:
            return x.sum().item() + x
        return x + 1

    outs = [f(torch.zeros(1, device=device))]
    read_on_host[0] = True  # the warmup did not take this path; the capture does
    outs += [f(torch.zeros(1, device=device)) for _ in range(3)]
    assert [o.item() for o in outs] == [1.0, 0.0, 0.0, 0.0]
    assert states(f) == [("eager", 4, 4, 0)]
    messages = autograph_warnings(caught)
    assert len(messages) == 1 and ".item()" in messages[0]


@pytest.mark.parametrize("how", ["strict=True", "AUTOGRAPH_STRICT=1"])
def test_strict_raises_instead_of_falling_back(device, how, monkeypatch, caught):
    if how == "strict=True":
        strict = autograph.graphed(strict=True)
    else:
        monkeypatch.setattr(_config, "ENV", _config.Environment(strict=True))
        strict = autograph.graphed

    def f(x):
        return x * x.sum().item()

    def g(x):
        return x * 2

    f_strict, g_strict = strict(f), strict(g)
    f_lenient = autograph.graphed(strict=False)(f)  # the function's own option wins
    twos = torch.full((2,), 2.0, device=device)
    assert torch.equal(f_strict(torch.ones(2, device=device)), twos)  # warmup: runs as written
    line = f.__code__.co_firstlineno + 1
    call = f"{f.__qualname__}(x: f32[2] {device_label(device)})"
    reason = (
        f".item() at test_graphed.py:{line} synchronises with the host, and "
        f"{host_read_fix('.item()')}"
    )
    message = f"{call} runs eagerly: {reason}"
    for _ in range(3):  # the capture found it, then every later call raises too
        with pytest.raises(autograph.CaptureError) as raised:
            f_strict(torch.ones(2, device=device))
        # It raises: its words say so, not that it runs eagerly.
        assert str(raised.value) == (
            f"{call} cannot be graphed, and strict mode raises instead "
            f"of running it eagerly: {reason}"
        )
    assert states(f_strict) == [("eager", 4, 1, 0)]
    for _ in range(4):
        assert torch.equal(f_lenient(torch.ones(2, device=device)), twos)
        assert torch.equal(g_strict(torch.ones(2, device=device)), twos)
    assert states(f_lenient) == [("eager", 4, 4, 0)]
    assert states(g_strict) == [("graphed", 4, 1, 3)]  # strict changes nothing that graphs
    assert autograph_warnings(caught) == [message]  # the lenient one's, once


def test_users_own_exception_propagates_in_every_phase_and_the_key_recovers(device, caught):
    counter = torch.zeros((), device=device)
    fail = set()

    @autograph.graphed
    def f(x, phase):
        counter.add_(1)
        if phase in fail:
            raise ValueError(f"bad input in {phase}")
        if phase == "eager":
            x.sum().item()  # this key falls back at its capture
        return x + counter

    def call(phase, failing=False):
        if failing:
            fail.add(phase)
        try:
            return f(torch.zeros(1, device=device), phase).item()
        finally:
            fail.clear()

    def raises(phase):
        with pytest.raises(ValueError, match=f"bad input in {phase}") as raised:
            call(phase, failing=True)
        assert raised.traceback[-1].name == "f"

    raises("graphed")  # at warmup
    assert call("graphed") == 2  # warmup
    raises("graphed")  # at capture
    assert counter.item() == 3  # the work before the raise ran, once, as in eager mode
    assert call("graphed") == 4  # captured now
    assert call("graphed") == 5  # replayed
    assert call("eager") == 6  # warmup
    assert call("eager") == 7  # the capture stopped at .item(): eager, once
    raises("eager")  # in a key that runs eagerly
    assert counter.item() == 8
    assert call("graphed") == 9  # the graph still replays
    rows = {
        r.key.split("phase=")[1]: (r.state, r.calls, r.eager_calls, r.replays) for r in f.stats()
    }
    # the call that raised during capture is neither an eager call nor a replay
    assert rows == {"'graphed'": ("graphed", 6, 2, 3), "'eager'": ("eager", 3, 3, 0)}
    messages = autograph_warnings(caught)
    assert len(messages) == 1 and ".item()" in messages[0]


def test_a_graphed_function_inside_another_becomes_part_of_its_graph(device):
    log_inner_run = python_run_log()

    @autograph.graphed
    def inner(x):
        log_inner_run()
        return x * 2

    @autograph.graphed
    def outer(x):
        return inner(x) + 1

    for _ in range(4):
        x = torch.randn(3, device=device)
        assert torch.equal(outer(x), x * 2 + 1)
    assert states(outer) == [("graphed", 4, 1, 3)]
    assert len(log_inner_run.runs) == 2  # at the outer warmup and capture; replays are outer's
    # inner's own engine saw only the outer warmup's call: inside a capture it steps aside
    assert states(inner) == [("warmup", 1, 1, 0)]


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
    (row,) = autograph.stats(f)
    assert row in autograph.stats() and row.function.endswith("<locals>.f")
    assert (row.key, row.state, row.calls, row.replays, row.eager_calls, row.fallback_reason) == (
        f"x: f32[2] {device_label(device)}",
        "graphed",
        3,
        2,
        1,
        None,
    )
    assert row.capture_seconds is not None and row.capture_seconds > 0
    autograph.report()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [
        "function",
        "key",
        "state",
        "calls",
        "replays",
        "eager",
        "capture",
        "ms",
        "MiB",
        "padding",
        "fallback",
        "reason",
    ]
    line = next(line for line in lines if line.startswith(row.function))
    assert line.split()[1:8] == ["x:", "f32[2]", device_label(device), "graphed", "3", "2", "1"]


def test_expanded_and_strided_arguments(device):
    @autograph.graphed
    def f(bias, x):
        return x + bias

    for _ in range(4):
        bias = torch.randn(8, device=device).expand(4, 8)  # stride 0 in the first dimension
        x = torch.randn(8, 4, device=device).t()  # not contiguous
        assert torch.equal(f(bias, x), x + bias)
    (row,) = f.stats()
    assert "strides=(0, 1)" in row.key
    assert states(f) == [("graphed", 4, 1, 3)]


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
    assert states(f) == [("graphed", 4, 1, 3)]


def test_calls_that_cannot_be_graphed_whatever_their_key_run_eagerly_in_silence(caught):
    # No emulation: CPU tensors have no graph (and this machine may have no GPU at all)
    @autograph.graphed
    def add(x, y):
        return x + y

    ones = torch.ones(3)
    for _ in range(3):
        assert torch.equal(add(ones, ones), ones * 2)
    assert torch.equal(add(ones, y=ones), ones * 2)
    rows = add.stats()
    if torch.cuda.is_available():  # CPU tensors: a keyword argument takes the keyed path
        assert [(r.key == "every call", r.state, r.calls, r.eager_calls) for r in rows] == [
            (False, "eager", 1, 1),
            (True, "eager", 3, 3),
        ]
        assert {r.fallback_reason for r in rows} == {
            "its tensors are on the CPU; CUDA graphs replay GPU work only"
        }
    else:  # no GPU at all; the call with a keyword argument is keyed
        assert [
            (r.key == "every call", r.state, r.calls, r.eager_calls, r.fallback_reason)
            for r in rows
        ] == [
            (False, "eager", 1, 1, "CUDA is not available"),
            (True, "eager", 3, 3, "CUDA is not available"),
        ]

    @autograph.graphed
    def scale(x, cfg):
        return x * len(cfg)

    # An unhashable argument: the call is still made, eagerly (and silently: no GPU to graph on)
    assert torch.equal(scale(ones, bytearray(b"x")), ones)
    assert autograph_warnings(caught) == []
    add.reset()
    assert add.stats() == []
