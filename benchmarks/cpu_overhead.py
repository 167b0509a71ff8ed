"""A call's own cost on a CPU, for tuning the replay path and the disabled paths (issue 23).

>>> PYTHONPATH=. python benchmarks/cpu_overhead.py   # about 30 s; us per call, best of 7

Rows: the bare call; each path that does not graph, minus the bare call (AUTOGRAPH_DISABLE
for a graphed function and a graphed module, ``region(enabled=False)``, CPU tensors without
the emulation, i.e. "no CUDA" on this machine); and the emulated steady-state replay of a
plain function of N = 1, 4, 16 tensors, minus a hand-written loop over the same emulated graph
(``_foreach_copy_`` into its statics, its replay, a clone of its output), the emulated
replay itself made a no-op for both: what is left is the engine's Python, which a CUDA replay
pays too. Not a test: timings vary with the machine.
"""

from __future__ import annotations

import dataclasses
import time
import timeit

import torch

import autograph
from autograph import _config
from autograph.testing import emulate_graphs_on_cpu

CALLS = 20000
ROUNDS = 7


def catn(*tensors):
    return torch.cat(tensors)


class Cat(torch.nn.Module):
    def forward(self, *tensors):
        return torch.cat(tensors)


def best_us(calls: dict) -> dict:
    """us per call of each callable, best of ROUNDS interleaved rounds."""
    best = {name: float("inf") for name in calls}
    for _ in range(ROUNDS):
        for name, call in calls.items():
            # CPU time of this thread: the machine may be shared, and waiting is not cost.
            seconds = timeit.timeit(call, number=CALLS, timer=time.thread_time)
            best[name] = min(best[name], seconds / CALLS * 1e6)
    return best


def disabled_paths() -> dict:
    tensors = [torch.randn(64) for _ in range(4)]
    step = autograph.graphed(catn)
    module = autograph.graphed(Cat())
    plain_module = Cat()
    before = _config.ENV
    disabled = dataclasses.replace(before, disable=True)
    region_off = autograph.region(enabled=False)

    def under_disable(call):
        def run():
            _config.ENV = disabled
            try:
                call()
            finally:
                _config.ENV = before

        return run

    def in_region_off():
        with region_off:
            step(*tensors)

    def bare_in_region_off():
        with region_off:
            catn(*tensors)

    def bare_under_disable():
        _config.ENV = disabled
        try:
            catn(*tensors)
        finally:
            _config.ENV = before

    us = best_us(
        {
            "bare": lambda: catn(*tensors),
            "bare module": lambda: plain_module(*tensors),
            "bare, disable toggled": bare_under_disable,
            "AUTOGRAPH_DISABLE, graphed function": under_disable(lambda: step(*tensors)),
            "AUTOGRAPH_DISABLE, graphed module": under_disable(lambda: module(*tensors)),
            "bare, region entered": bare_in_region_off,
            "region(enabled=False), graphed function": in_region_off,
            "no CUDA (CPU tensors), graphed function": lambda: step(*tensors),
        }
    )
    return {
        "bare": us["bare"],
        "AUTOGRAPH_DISABLE, graphed function": us["AUTOGRAPH_DISABLE, graphed function"]
        - us["bare, disable toggled"],
        "AUTOGRAPH_DISABLE, graphed module": us["AUTOGRAPH_DISABLE, graphed module"]
        - us["bare, disable toggled"]
        - (us["bare module"] - us["bare"]),
        "region(enabled=False), graphed function": us["region(enabled=False), graphed function"]
        - us["bare, region entered"],
        "no CUDA (CPU tensors), graphed function": us["no CUDA (CPU tensors), graphed function"]
        - us["bare"],
    }


def emulated_replays() -> dict:
    figures = {}
    with torch.no_grad(), emulate_graphs_on_cpu():
        for n in (1, 4, 16):
            tensors = [torch.randn(64) for _ in range(n)]
            step = autograph.graphed(catn, check_payoff=False)
            for _ in range(5):
                step(*tensors)
            before = step.stats()[0].replays
            [life] = step._self_engine.cache.entries.values()
            graph = life.graph
            # The emulated replay (tens of us, noisy) stands still for both: only the Python
            # around it is measured.
            graph.graph.replay = replay = lambda: None
            statics, out = graph.inputs.statics, graph.outputs.owned[0]

            def hand():
                torch._foreach_copy_(statics, tensors)
                replay()
                return out.clone()

            us = best_us({"hand": hand, "autograph": lambda: step(*tensors)})
            assert step.stats()[0].replays > before, "not replayed"
            figures[f"N={n}: hand loop"] = us["hand"]
            figures[f"N={n}: autograph over the hand loop"] = us["autograph"] - us["hand"]
    return figures


if __name__ == "__main__":
    print(f"torch {torch.__version__}, us per call, best of {ROUNDS} x {CALLS}")
    for name, us in {**disabled_paths(), **emulated_replays()}.items():
        print(f"{name:48s} {us:7.3f}")
