"""``autograph.region()``: scoping, options, threads, clean exit and lifetimes (on CPU)."""
import gc
import threading
import weakref

import pytest
import torch

import autograph
from autograph import _region
from conftest import autograph_warnings

pytestmark = pytest.mark.usefixtures("emulated")


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1           # Python runs at warmup and capture only, once graphed
        return torch.relu(self.inner(x))


def rows(stats):
    return sorted((r.function, r.state, r.calls, r.replays, r.eager_calls) for r in stats)


def test_top_level_module_calls_are_graphed_inside_and_only_inside():
    model = Block()
    x = torch.randn(2, 4)
    with torch.no_grad():
        expected = torch.relu(model.inner(x))
        with autograph.region() as region:
            for _ in range(4):
                assert torch.equal(model(x), expected)
        assert model.calls == 2                     # warmup + capture; two replays
        model(x)
        assert model.calls == 3                     # outside: plain eager
    assert rows(region.stats().keys) == [("Block", "graphed", 4, 3, 1)]  # none for the Linear
    stats = region.stats()
    assert (stats.captures, stats.replays, stats.eager_calls) == (1, 3, 1)


def test_plain_functions_run_as_written_and_decorated_ones_take_region_options():
    python_runs = {"plain": 0, "decorated": 0, "own": 0}

    def plain(x):
        python_runs["plain"] += 1
        return x + 1

    @autograph.graphed
    def decorated(x):
        python_runs["decorated"] += 1
        return x + 1

    @autograph.graphed(warmup=1)
    def own(x):
        python_runs["own"] += 1
        return x + 1

    with autograph.region(warmup=3):
        for _ in range(6):
            plain(torch.zeros(1)), decorated(torch.zeros(1)), own(torch.zeros(1))
    assert python_runs == {"plain": 6, "decorated": 4, "own": 2}  # 3 warmups + capture; 1 + 1


def test_regions_nest_and_the_inner_one_wins():
    runs = []

    @autograph.graphed
    def f(x):
        runs.append(1)
        return x

    with autograph.region(warmup=1):
        with autograph.region(enabled=False):
            for _ in range(3):
                f(torch.zeros(1))
            assert len(runs) == 3 and f.stats() == []   # eager, and not even counted
            with autograph.region():
                for _ in range(3):
                    f(torch.zeros(1))
    assert len(runs) == 5 and f.stats()[0].state == "graphed"


def test_disabled_region_makes_modules_eager():
    model = Block()
    with torch.no_grad(), autograph.region(enabled=False):
        for _ in range(3):
            model(torch.randn(2, 4))
    assert model.calls == 3 and not [r for r in autograph.stats() if r.function == "Block"]


def test_environment_variable_beats_every_region(monkeypatch):
    from autograph import _config
    monkeypatch.setattr(_config, "ENV", _config.Environment(disable=True))
    model = Block()
    with torch.no_grad(), autograph.region():
        for _ in range(3):
            model(torch.randn(2, 4))
    assert model.calls == 3


def test_regions_are_per_thread():
    model = Block()
    entered, done = threading.Event(), threading.Event()

    def inside():
        with torch.no_grad(), autograph.region():
            entered.set()
            for _ in range(3):
                model(torch.randn(2, 4))
            done.wait(10)

    worker = threading.Thread(target=inside)
    worker.start()
    entered.wait(10)
    with torch.no_grad():
        for _ in range(5):                   # another thread: the region does not apply
            model(torch.randn(2, 4))
    done.set()
    worker.join()
    row, = [r for r in autograph.stats() if r.function == "Block"]
    assert row.calls == 3


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
        getattr(_region._thread, "stack", []),
        getattr(_region._thread, "depth", 0),
    )


def test_leaving_a_region_leaves_no_trace_even_on_exception():
    before = global_state()
    model = Block()
    with torch.no_grad(), autograph.region():
        model(torch.randn(2, 4))
        assert torch.nn.Module.__call__ is not before[0]
    assert global_state() == before
    with pytest.raises(KeyError):
        with torch.no_grad(), autograph.region(), autograph.region(warmup=2):
            model(torch.randn(2, 4))
            raise KeyError("boom")
    assert global_state() == before


def test_graphs_are_kept_for_the_next_region_and_released_with_the_module():
    model = Block()
    x = torch.randn(2, 4)
    with torch.no_grad():
        with autograph.region():
            for _ in range(3):
                model(x)
        with autograph.region() as second:
            model(x)
    assert model.calls == 2
    assert (second.stats().captures, second.stats().replays) == (0, 1)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
    assert not [r for r in autograph.stats() if r.function == "Block"]


def test_graphs_captured_in_one_region_share_one_pool():
    a, b = Block(), Block()
    with torch.no_grad(), autograph.region() as region:
        for _ in range(3):
            a(torch.randn(2, 4)), b(torch.randn(3, 4))
    graphs = [e.graph for e in region._touched.values()]
    assert len(graphs) == 2 and all(g.pool is region.pools[-1] for g in graphs)


def test_a_training_loop_in_a_region_trains_as_in_eager(caught):
    def train(use_region):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss_fn = torch.nn.MSELoss()
        data = torch.randn(32, 8)
        target = data.sum(-1, keepdim=True)
        losses = []
        with (autograph.region() if use_region else torch.enable_grad()):
            for _ in range(20):
                optimizer.zero_grad()
                loss = loss_fn(model(data), target)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
        return losses

    eager, graphed = train(False), train(True)
    assert graphed == eager and graphed[-1] < graphed[0] / 2
    messages = autograph_warnings(caught)
    assert len(messages) == 2  # the model and the loss module, once each
    assert all("its outputs need gradients" in m for m in messages)


def test_unknown_region_option_is_an_error():
    with pytest.raises(TypeError, match="autograph.region got unknown option"):
        autograph.region(warmups=1)
    with pytest.raises(ValueError, match="outputs='clone'"):
        autograph.region(outputs="clone")
