"""Threads racing the engine's bookkeeping: a key's graph dropped by another thread's capture
(a region's memory budget), the watch of parameter slots added while the last one drops, an
identity-keyed object dying while another thread resets. Each race is made deterministic by
pausing one thread inside the window (``threading.Event``); on the CPU emulation, which runs
the engine itself."""

import gc
import threading
import weakref

import torch
from torch.utils.hooks import RemovableHandle

import autograph
from autograph.engine import _key_life
from autograph.testing import emulate_graphs_on_cpu
from autograph.watch._slots import Registrations


def _one_and_a_half_graphs(x):
    """A memory budget for one graph of ``Linear(64, 64)`` at ``x``, not two."""
    sizer = autograph.graphed(torch.nn.Linear(64, 64).to(x.device), warmup=1)
    with torch.no_grad():
        sizer(x), sizer(x)
    return int(autograph.stats(sizer)[0].graph_bytes * 1.5)


def _second_dropped_while_called(region, first, second, x, paused, go_on, before=lambda: None):
    """Call ``second(x)`` in ``region`` in a new thread until it pauses (``paused``); capture
    ``first`` meanwhile, which drops second's graph for the budget; let the thread go on. Its
    call must give second's result, not an error."""
    errors, outputs = [], []

    def call():
        before()
        try:
            with torch.no_grad(), region:
                outputs.append(second(x))
        except Exception as error:  # noqa: BLE001 - asserted below
            errors.append(error)

    worker = threading.Thread(target=call)
    worker.start()
    try:
        assert paused.wait(10)
        with torch.no_grad(), region:
            first(x), first(x)
    finally:
        go_on.set()
        worker.join(10)
    assert errors == []
    expected = torch.nn.functional.linear(x, second.weight, second.bias)
    torch.testing.assert_close(outputs[0], expected)


def test_a_call_capturing_again_survives_another_threads_eviction_of_its_graph(monkeypatch):
    with emulate_graphs_on_cpu(), torch.no_grad():
        x = torch.randn(32, 64)
        first, second = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
        region = autograph.region(
            warmup=1, check_payoff=False, max_graph_memory=_one_and_a_half_graphs(x)
        )
        with region:
            second(x), second(x)
        kept = second.weight  # held elsewhere (an optimizer): the replaced slot tells
        second.weight = torch.nn.Parameter(torch.randn(64, 64))
        entered, go_on = threading.Event(), threading.Event()
        invalidate, caller = _key_life._invalidate, threading.current_thread()

        def paused(*args):  # between the call's check of its graph and its drop
            if threading.current_thread() is not caller:
                entered.set()
                go_on.wait(10)
            return invalidate(*args)

        monkeypatch.setattr(_key_life, "_invalidate", paused)
        _second_dropped_while_called(region, first, second, x, entered, go_on)
        del kept
    autograph.reset()


def test_a_watch_added_while_the_last_one_drops_keeps_seeing_data_swaps(monkeypatch):
    with emulate_graphs_on_cpu(), torch.no_grad():
        assert Registrations._watches == 0
        torch.manual_seed(0)
        dropped, watched, ema = (torch.nn.Linear(8, 8) for _ in range(3))
        a, b = autograph.graphed(dropped, warmup=1), autograph.graphed(watched, warmup=1)
        x = torch.randn(4, 8)
        for _ in range(3):
            a(x)
        entered, go_on = threading.Event(), threading.Event()
        remove = RemovableHandle.remove
        dropping = []

        def paused_remove(self):  # inside the drop of the last watch
            if threading.get_ident() in dropping and not entered.is_set():
                entered.set()
                go_on.wait(10)
            return remove(self)

        def drop_a():
            dropping.append(threading.get_ident())
            autograph.reset(a)
            gc.collect()

        def capture_b():
            with torch.no_grad():
                for _ in range(3):
                    b(x)  # its graph adopted: a watch added

        monkeypatch.setattr(RemovableHandle, "remove", paused_remove)
        dropper, capturer = threading.Thread(target=drop_a), threading.Thread(target=capture_b)
        dropper.start()
        try:
            assert entered.wait(10)
            capturer.start()
            capturer.join(0.3)  # it waits for the drop, or (unlocked) runs inside it
        finally:
            go_on.set()
            dropper.join(10)
            capturer.join(10)
        monkeypatch.undo()
        assert autograph.stats(b)[0].state == "graphed"
        for p, e in zip(watched.parameters(), ema.parameters()):
            p.data, e.data = e.data, p.data  # an EMA swap, both memories alive
        torch.testing.assert_close(
            b(x), torch.nn.functional.linear(x, watched.weight, watched.bias)
        )
    autograph.reset()


class _Box:  # keyed by identity, as a request's cache object is
    def __init__(self):
        self.scale = torch.ones(4)


def test_reset_while_an_identity_keyed_object_dies_in_another_thread(monkeypatch):
    def step(x, box):
        return x * box.scale

    with emulate_graphs_on_cpu():
        graphed = autograph.graphed(step, warmup=1)
        x = torch.randn(4)
        boxes = [_Box() for _ in range(3)]
        for box in boxes:
            graphed(x, box)
        del box
        entered, go_on = threading.Event(), threading.Event()
        detach = weakref.finalize.detach

        def paused_detach(self):  # inside reset's walk over the objects' finalizers
            if threading.current_thread() is resetter and not entered.is_set():
                entered.set()
                go_on.wait(10)
            return detach(self)

        errors = []

        def reset():
            try:
                autograph.reset(graphed)
            except Exception as error:  # noqa: BLE001 - reported below
                errors.append(error)

        monkeypatch.setattr(weakref.finalize, "detach", paused_detach)
        resetter = threading.Thread(target=reset)
        resetter.start()
        try:
            assert entered.wait(10)
            del boxes[2]  # a request ends in this thread: its object dies
            gc.collect()
        finally:
            go_on.set()
            resetter.join(10)
        assert errors == []
        assert graphed.stats() == []


def test_a_region_call_finishes_its_checked_replay_when_another_thread_drops_its_graph(device):
    # In a region the budget spans the modules' caches: one module's capture drops another's
    # graph without that module's lock, while another thread is in the middle of a verified
    # call of it (between the check and the replay). That call replays the graph it checked.
    entered, go_on = threading.Event(), threading.Event()
    pause = threading.local()

    class Paused(torch.nn.Linear):
        def forward(self, x):
            if getattr(pause, "here", False):  # inside the verify's eager run
                pause.here = False
                entered.set()
                go_on.wait(10)
            return super().forward(x)

    # 16 MiB an output: CUDA's allocator puts requests under 10 MiB into 20 MiB segments,
    # which small graphs of one pool share, so that the budget would never bind.
    x = torch.randn(65536, 64, device=device)
    first, second = torch.nn.Linear(64, 64).to(device), Paused(64, 64).to(device)
    region = autograph.region(
        warmup=1, check_payoff=False, verify=3, max_graph_memory=_one_and_a_half_graphs(x)
    )
    with torch.no_grad(), region:
        second(x), second(x)  # its warmup, then its capture; verify checks its next replays
    _second_dropped_while_called(
        region, first, second, x, entered, go_on, before=lambda: setattr(pause, "here", True)
    )
    assert autograph.stats(second)[0].evictions == 1
