"""``autograph.region()``: scoping, options, threads, clean exit, pools and lifetimes.

Run on CPU tensors through the CPU emulation of CUDA graphs, and on a GPU where there is one.
"""

import contextlib
import functools
import gc
import json
import threading
import time
import weakref

import pytest
import torch

import autograph
from autograph import _config, _scope
from autograph.api import _region
from autograph.testing import emulate_graphs_on_cpu

from conftest import autograph_warnings, is_label_of, python_run_log, states


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)
        self.log_call = python_run_log()  # Python runs at warmup and capture only, once graphed

    @property
    def calls(self):
        return len(self.log_call.runs)

    def forward(self, x):
        self.log_call()
        return torch.relu(self.inner(x))


def test_top_level_module_calls_are_graphed_inside_and_only_inside(device):
    model = Block().to(device)
    x = torch.randn(2, 4, device=device)
    with torch.no_grad():
        expected = torch.relu(model.inner(x))
        with autograph.region() as region:
            for _ in range(4):
                assert torch.equal(model(x), expected)
        assert model.calls == 3  # a plain call, a watched warmup, a capture; a replay
        model(x)
        assert model.calls == 4  # outside: plain eager
    assert states(region) == [("graphed", 4, 2, 2)]  # one key: none for the Linear
    (row,) = region.stats().keys
    assert is_label_of(row.function, Block)
    assert autograph.stats(model) == [row]  # the call outside was not counted
    assert autograph.stats(model.inner) == []
    stats = region.stats()
    assert (stats.captures, stats.replays, stats.eager_calls) == (1, 2, 2)


def test_plain_functions_run_as_written_and_decorated_ones_take_region_options(device):
    log_run = python_run_log()

    def plain(x):
        log_run("plain")
        return x + 1

    @autograph.graphed
    def decorated(x):
        log_run("decorated")
        return x + 1

    @autograph.graphed(warmup=1)
    def own(x):
        log_run("own")
        return x + 1

    with autograph.region(warmup=3) as region:
        for _ in range(6):
            x = torch.zeros(1, device=device)
            plain(x), decorated(x), own(x)
    python_runs = {name: log_run.runs.count(name) for name in ("plain", "decorated", "own")}
    assert python_runs == {"plain": 6, "decorated": 4, "own": 2}  # 3 warmups + capture; 1 + 1
    assert states(decorated) == [("graphed", 6, 3, 3)]
    assert states(own) == [("graphed", 6, 1, 5)]
    stats = region.stats()
    assert (stats.captures, stats.replays, stats.eager_calls) == (2, 8, 4)


def test_regions_nest_and_the_inner_one_wins(device):
    log_run = python_run_log()
    runs = log_run.runs

    @autograph.graphed
    def f(x):
        log_run()
        return x

    with autograph.region(warmup=2):
        with autograph.region(enabled=False):
            for _ in range(3):
                f(torch.zeros(1, device=device))
            assert len(runs) == 3 and f.stats() == []  # eager, and not even counted
            with autograph.region(warmup=1):
                for _ in range(3):
                    f(torch.zeros(1, device=device))
            assert len(runs) == 5  # warmup=1, not the outer 2
            f(torch.zeros(1, device=device))  # the disabled region is the innermost again
            assert len(runs) == 6 and states(f) == [("graphed", 3, 1, 2)]
        f(torch.zeros(1, device=device))  # the outer region's again: keyed, its own options
        assert len(runs) == 7
    assert sorted(states(f)) == [("graphed", 3, 1, 2), ("warmup", 1, 1, 0)]


@pytest.mark.parametrize(
    "how", ["AUTOGRAPH_DISABLE=1", "region(enabled=False)", "AUTOGRAPH_DISABLE=1 in a region"]
)
def test_disabled_runs_every_call_eagerly_and_records_nothing(device, how, monkeypatch):
    if how.startswith("AUTOGRAPH_DISABLE"):
        monkeypatch.setattr(_config, "ENV", _config.Environment(disable=True))
    scope = {
        "AUTOGRAPH_DISABLE=1": contextlib.nullcontext(),
        "region(enabled=False)": autograph.region(enabled=False),
        "AUTOGRAPH_DISABLE=1 in a region": autograph.region(),
    }[how]
    log_run = python_run_log()
    runs = log_run.runs

    @autograph.graphed
    def f(x):
        log_run()
        return x + 1

    graphed_model, region_model = autograph.graphed(Block().to(device)), Block().to(device)
    with torch.no_grad(), scope:
        for _ in range(4):  # checked on every call: Python runs every time
            x = torch.randn(2, 4, device=device)
            assert torch.equal(f(x), x + 1)
            assert torch.equal(graphed_model(x), torch.relu(graphed_model.inner(x)))
            assert torch.equal(region_model(x), torch.relu(region_model.inner(x)))
    assert (len(runs), graphed_model.calls, region_model.calls) == (4, 4, 4)
    assert f.stats() == [] and autograph.stats(graphed_model) == []
    assert autograph.stats(region_model) == []
    if isinstance(scope, autograph.Region):
        assert scope.stats() == autograph.RegionStats(0, 0, 0, [])


def test_regions_are_per_thread(device):
    model = Block().to(device)
    entered, done = threading.Event(), threading.Event()
    # Drawn before the worker captures: while any thread captures, torch holds the device's
    # default generator in capture mode, and a draw from it in another thread raises
    # (docs/guide/limits.md, "Thread safety").
    ours = [torch.randn(2, 4, device=device) for _ in range(5)]

    def inside():
        with torch.no_grad(), autograph.region():
            entered.set()
            for _ in range(4):  # a plain call, a watched warmup, a capture and a replay
                model(torch.randn(2, 4, device=device))
            done.wait(10)

    worker = threading.Thread(target=inside)
    worker.start()
    try:
        entered.wait(10)
        with torch.no_grad():
            for x in ours:  # another thread: the region does not apply
                model(x)
    finally:  # a failure here must not leave the worker's region open for the next test
        done.set()
        worker.join()
    assert states(model) == [("graphed", 4, 2, 2)]
    assert model.calls == 3 + 5


def test_threads_sharing_a_region_take_turns_from_replay_to_output_copy(monkeypatch):
    # Graphs of one region share a pool (on a GPU, one graph's output may sit in another's
    # scratch): each replay, from its start to the copy of its outputs, is one step of the
    # pool's order, although the two modules' calls go through two caches and their locks.
    # The emulation gives each graph memory of its own, so the order itself is checked.
    from autograph.backends._cpu_graphs import CpuGraph
    from autograph.capture._plan import OutputPlan

    events = []
    replay, produce = CpuGraph.replay, OutputPlan.produce

    def slow_replay(self):
        events.append(("replay", threading.get_ident()))
        time.sleep(0.002)  # the GIL goes to the other thread here, as a CUDA launch lets it
        replay(self)

    def recorded_produce(self, *args, **kwargs):
        events.append(("copy", threading.get_ident()))
        return produce(self, *args, **kwargs)

    with emulate_graphs_on_cpu(), torch.no_grad():
        region = autograph.region(check_payoff=False, warmup=1)
        modules, x = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)], torch.randn(2, 4)
        with region:
            for m in modules:
                for _ in range(3):
                    m(x)
        monkeypatch.setattr(CpuGraph, "replay", slow_replay)
        monkeypatch.setattr(OutputPlan, "produce", recorded_produce)

        def work(module):
            with torch.no_grad():  # grad mode is per thread
                for _ in range(20):
                    with region:
                        module(x)

        threads = [threading.Thread(target=work, args=(m,)) for m in modules]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(events) == 2 * 2 * 20 and len({thread for _, thread in events}) == 2
    # each replay followed by its own copy, before any other replay
    assert all(
        (first[0], second[0], first[1]) == ("replay", "copy", second[1])
        for first, second in zip(events[::2], events[1::2])
    ), events
    assert [states(m) for m in modules] == [[("graphed", 23, 1, 22)]] * 2


def global_state():
    return (
        torch.nn.Module.__call__,
        dict(torch.nn.modules.module._global_forward_hooks),
        dict(torch.nn.modules.module._global_forward_pre_hooks),
        torch._C._len_torch_dispatch_stack(),
        torch._C._len_torch_function_stack(),
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        torch.is_autocast_enabled("cpu"),
        torch.cuda.is_available() and torch.cuda.is_current_stream_capturing(),
        list(getattr(_scope.thread, "regions", [])),  # a copy: the stack is mutated
        getattr(_scope.thread, "depth", 0),
    )


class Failing(Block):
    def __init__(self):
        super().__init__()
        self.fail = False

    def forward(self, x):
        if self.fail:
            raise KeyError("boom")
        return super().forward(x)


def test_leaving_a_region_leaves_no_trace_even_on_exception(device):
    before = global_state()
    model = Failing().to(device)
    with torch.no_grad(), autograph.region():
        for _ in range(4):  # a plain call, a watched warmup, a capture and a replay inside
            model(torch.randn(2, 4, device=device))
        assert torch.nn.Module.__call__ is not before[0]
    assert states(model) == [("graphed", 4, 2, 2)]
    assert global_state() == before
    other = Failing().to(device)
    with pytest.raises(KeyError):
        with torch.no_grad(), autograph.region(), autograph.region(warmup=2):
            for _ in range(2):
                other(torch.randn(2, 4, device=device))
            other.fail = True  # raised from inside the capture
            other(torch.randn(2, 4, device=device))
    assert other.calls == 2 and states(other) == [("warmup", 3, 2, 0)]
    assert global_state() == before


def test_graphs_are_kept_for_the_next_region_and_released_with_the_module(device):
    model = Block().to(device)
    x = torch.randn(2, 4, device=device)
    with torch.no_grad():
        with autograph.region():
            for _ in range(3):
                model(x)
        with autograph.region() as second:
            model(x)
    assert model.calls == 3  # a plain call, a watched warmup and a capture in the first
    assert (second.stats().captures, second.stats().replays) == (0, 1)
    assert states(model) == [("graphed", 4, 2, 2)]
    (row,) = autograph.stats(model)
    engine = _region.engine_of(model)
    engine_ref = weakref.ref(engine)
    graph_ref = weakref.ref(next(iter(engine.cache.entries.values())).graph)
    ref = weakref.ref(model)
    del model, engine
    gc.collect()
    assert ref() is None and engine_ref() is None and graph_ref() is None
    assert all(r.function != row.function for r in autograph.stats())
    assert second.stats().keys == []


def test_graphs_captured_in_one_region_share_one_pool(device):
    a, b = Block().to(device), Block().to(device)
    with torch.no_grad(), autograph.region() as region:
        for _ in range(4):  # a plain call, a watched warmup, a capture and a replay per key
            b(a(torch.randn(2, 4, device=device))), b(torch.randn(3, 4, device=device))
    assert sorted(states(region)) == [("graphed", 4, 2, 2)] * 3
    entries = list(region._touched.values())
    backend = entries[0].backend
    pool = region.pools.get(backend, entries[0].device)
    assert len(entries) == 3 and all(e.graph.pool is pool for e in entries)
    if device == "cuda":
        assert pool.handle is not None
    # outside a region, each graphed module has a pool of its own
    c, d = autograph.graphed(Block().to(device)), autograph.graphed(Block().to(device))
    with torch.no_grad():
        for _ in range(3):
            c(torch.randn(2, 4, device=device)), d(torch.randn(2, 4, device=device))
    own = [next(iter(m.forward._self_engine.cache.entries.values())).graph.pool for m in (c, d)]
    assert own[0] is not own[1] and pool not in own


def test_a_training_loop_in_a_region_trains_as_in_eager(device, caught):
    def train(use_region):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1)
        ).to(device)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        loss_fn = torch.nn.MSELoss()
        data = torch.randn(64, 8, device=device)
        target = data.sum(-1, keepdim=True)
        losses, evaluations = [], []
        with autograph.region() if use_region else contextlib.nullcontext():
            for _ in range(30):
                optimizer.zero_grad()
                loss = loss_fn(model(data), target)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
            with torch.no_grad():  # evaluation inside the region is graphed
                for _ in range(4):
                    evaluations.append(model(data))
        return losses, evaluations, model, loss_fn

    eager_losses, eager_evaluations, _, _ = train(False)
    losses, evaluations, model, loss_fn = train(True)
    assert losses == eager_losses and losses[-1] < losses[0] / 4
    assert all(torch.equal(a, b) for a, b in zip(evaluations, eager_evaluations))
    # training: forward and backward graphed per module; evaluation: graphed too
    assert states(model) == [("graphed", 30, 2, 28), ("graphed", 4, 2, 2)]
    assert states(loss_fn) == [("graphed", 30, 2, 28)]
    assert autograph_warnings(caught) == []


def test_unknown_region_option_is_an_error():
    with pytest.raises(TypeError, match="autograph.region got unknown option"):
        autograph.region(warmups=1)
    with pytest.raises(ValueError, match="outputs='clone'"):
        autograph.region(outputs="clone")


def test_a_module_taking_a_module_keyword_is_called_in_a_region(emulated):
    class Scaled(torch.nn.Module):
        def forward(self, x, module=1):
            return x * module

    model = Scaled()
    with torch.no_grad(), autograph.region():
        for _ in range(3):
            assert torch.equal(model(torch.ones(2), module=3), torch.full((2,), 3.0))
    assert [r.state for r in autograph.stats(model)] == ["graphed"]


def test_a_region_left_in_another_thread_still_restores_module_call():
    original = torch.nn.Module.__call__
    region = autograph.region()
    region.__enter__()
    errors = []
    leaving = threading.Thread(target=lambda: errors.append(_exit_catching(region)))
    leaving.start()
    leaving.join()
    assert torch.nn.Module.__call__ is original
    assert errors and errors[0] is not None  # leaving from another thread is an error
    _scope.thread.regions.remove(region)  # this thread's stack, tidied by hand


def _exit_catching(region):
    try:
        region.__exit__(None, None, None)
    except Exception as error:  # noqa: BLE001 - the test inspects it
        return error
    return None


def test_a_region_counts_its_calls_that_cannot_be_graphed_and_not_their_submodules():
    """Without CUDA (or with CPU tensors and no emulation) a region's top-level calls run
    eagerly before being keyed: the region still counts them, and their submodules are part
    of them, not top-level calls of their own (issue 25)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with autograph.region() as r:
        for _ in range(3):
            model(torch.ones(2, 4))
    stats = r.stats()
    assert (stats.captures, stats.replays, stats.eager_calls) == (0, 0, 3)
    assert [(row.function, row.key, row.calls) for row in stats.keys] == [
        (autograph.stats(model)[0].function, "every call", 3)
    ]
    assert autograph.stats(model[0]) == autograph.stats(model[1]) == []


def test_a_graphed_function_keeps_its_own_options_and_key_in_a_region(device):
    # The region's own warmup (2) is for the module calls it graphs of itself: a graphed
    # function's key is the same inside and outside (one graph, captured ahead here).
    w = torch.randn(8, 8, device=device)

    @autograph.graphed
    def f(x):
        return torch.tanh(x @ w)

    x = torch.randn(2, 8, device=device)
    with torch.no_grad():
        f.capture(x)
        f(x)
        with autograph.region():
            for _ in range(3):
                torch.testing.assert_close(f(x), torch.tanh(x @ w))
    assert states(f) == [("graphed", 4, 0, 4)]


def test_a_region_entered_again_inside_itself_leaves_the_stack_as_it_was(device):
    # Leaving takes the innermost entry (list.remove took the outer one, and the disabled
    # region between them was then the innermost no more).
    model = Block().to(device)
    outer = autograph.region()
    with torch.no_grad(), outer:
        with autograph.region(enabled=False):
            with outer:
                pass
            for _ in range(4):
                model(torch.randn(2, 4, device=device))
    assert model.calls == 4 and autograph.stats(model) == []  # run as written, uncounted


def test_submodule_calls_in_a_region_run_as_torch_would_call_them(monkeypatch):
    """A submodule's call inside a region's call runs torch's own call inline: its hooks run,
    a compiled submodule (``module.compile()``) runs its compiled call, and a ``__call__``
    that another library put on ``nn.Module`` before the region still sees every call."""
    inner, outer = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    model = torch.nn.Sequential(inner, outer)
    seen = []
    inner.register_forward_pre_hook(lambda module, args: seen.append("pre-hook"))
    outer._compiled_call_impl = lambda *args: seen.append("compiled") or outer._call_impl(*args)
    x = torch.ones(2, 4)
    with autograph.region():
        model(x)
    assert seen == ["pre-hook", "compiled"]
    assert _region.thread.depth == 0

    torch_call = torch.nn.Module.__call__
    called = []

    @functools.wraps(torch_call)  # its names are torch's: autograph must tell it by its code
    def library_call(module, *args, **kwargs):
        called.append(type(module).__name__)
        return torch_call(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "__call__", library_call)
    with autograph.region():
        model(x)
    assert called == ["Sequential", "Linear", "Linear"]
    assert torch.nn.Module.__call__ is library_call


def test_the_profiler_sees_submodule_calls_inside_a_region(tmp_path):
    """torch's profiler finds module calls by the frame of torch's ``__call__`` (``with_stack``,
    ``with_modules``): while it runs, a submodule's call inside a region's call keeps that frame."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with torch.profiler.profile(with_stack=True, with_modules=True) as profiler:
        with autograph.region():
            model(torch.ones(2, 4))
    trace = tmp_path / "trace.json"
    profiler.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    modules = {e["name"] for e in events if e.get("name", "").startswith("nn.Module: ")}
    assert {"nn.Module: Linear_0", "nn.Module: ReLU_0"} <= modules


def test_a_dispatcher_a_library_put_back_after_a_region_does_not_call_itself(monkeypatch):
    """A library that saved ``nn.Module.__call__`` while a region was open (the region's
    dispatcher) and puts it back after: the next region keeps calling torch's call under it."""
    torch_call = torch.nn.Module.__call__
    with autograph.region():
        saved = torch.nn.Module.__call__
    monkeypatch.setattr(torch.nn.Module, "__call__", saved)
    model = torch.nn.Linear(2, 2)
    x = torch.ones(1, 2)
    with autograph.region():
        assert torch.equal(model(x), torch.nn.functional.linear(x, model.weight, model.bias))
    assert torch.equal(model(x), torch.nn.functional.linear(x, model.weight, model.bias))
    assert torch.nn.Module.__call__ is torch_call
