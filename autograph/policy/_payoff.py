"""Keys that do not pay stay eager (docs/design.md, "Never slower"): a key's first calls after its
capture take turns between its graph and its eager run, each timed on the GPU clock, and the key
keeps its graph only if the replay beats eager.

>>> payoff = Payoff()                         # one per key, made at its capture
>>> run = payoff.next_run()                   # "replay" or "eager": they take turns
>>> timing = clock.start(); outputs = ...; payoff.add(run, clock.stop(timing))
>>> payoff.verdict                            # None while undecided, then GRAPH or EAGER
>>> payoff.figures()
'replay 0.93 ms, eager 0.92 ms (medians of 4 calls each, GPU clock)'
>>> life.payoff = measurement(life)           # the engine: at a key's capture
>>> timed_call(life, call)                    # its calls until the verdict

Both sides are timed the same way: from before the copy of the arguments in to after the
copy of the outputs out for a replay, around the call for an eager run. A replay that is
``margin`` faster than eager wins, one ``margin`` slower loses; in between, more samples are
taken, up to ``most``, and then the plain medians decide. ``CudaClock`` reads CUDA events
without synchronising: a timing is read once its end event has passed (``ready``), so a
decision comes a few calls after its last sample. Tests give a ``Payoff`` plain numbers.
"""

from __future__ import annotations

import statistics
from typing import Any, List, Optional

from ._islands import NO_ISLAND

REPLAY, EAGER_RUN = "replay", "eager"
GRAPH, EAGER = "graph", "eager"


class Payoff:
    """The measurement and verdict of one key (see the module docstring)."""

    __slots__ = ("least", "most", "margin", "replays", "eagers", "verdict", "_turn")

    def __init__(self, least: int = 4, most: int = 16, margin: float = 0.03):
        if not 1 <= least <= most:
            raise ValueError(f"Payoff: need 1 <= least ({least}) <= most ({most}).")
        self.least, self.most, self.margin = least, most, margin
        self.replays: List[float] = []
        self.eagers: List[float] = []
        self.verdict: Optional[str] = None
        self._turn = 0

    def next_run(self) -> str:
        """Which way the next measured call runs: replays and eager runs take turns."""
        self._turn += 1
        return REPLAY if self._turn % 2 else EAGER_RUN

    def add(self, run: str, seconds: float) -> Optional[str]:
        """Record one timed call; returns the verdict once there is one (later timings are
        not kept: the figures are those the verdict was made on)."""
        if self.verdict is not None:
            return self.verdict
        (self.replays if run == REPLAY else self.eagers).append(seconds)
        n = min(len(self.replays), len(self.eagers))
        if n < self.least:
            return self.verdict
        replay, eager = self.medians()
        if replay <= eager * (1 - self.margin):
            self.verdict = GRAPH
        elif replay >= eager * (1 + self.margin):
            self.verdict = EAGER
        elif n >= self.most:  # within the noise after every sample: the medians decide
            self.verdict = GRAPH if replay < eager else EAGER
        return self.verdict

    def medians(self) -> tuple:
        return statistics.median(self.replays), statistics.median(self.eagers)

    def gain(self) -> Optional[float]:
        """Eager's time over the replay's: 1.8 means the graph runs 1.8x as fast."""
        if not self.replays or not self.eagers:
            return None
        replay, eager = self.medians()
        return eager / replay if replay > 0 else None

    def figures(self) -> str:
        replay, eager = self.medians()
        return (
            f"replay {_time(replay)}, eager {_time(eager)} (medians of "
            f"{min(len(self.replays), len(self.eagers))} calls each, GPU clock)"
        )

    def reason(self) -> str:
        """The fallback reason of a key whose graph does not pay."""
        return (
            f"its graph does not beat its eager run: {self.figures()}; the copies of "
            f"arguments and outputs cost more than the launches the graph saves. "
            f"check_payoff=False keeps the graph anyway"
        )


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.3g} us"


class PendingTimings:
    """Timings of a key whose end events may not have passed yet: ``collect`` hands the
    finished ones to the key's ``Payoff`` in order, on a later call, without waiting."""

    __slots__ = ("clock", "pending")

    def __init__(self, clock: Any):
        self.clock = clock
        self.pending: List[tuple] = []

    def add(self, run: str, timing: Any) -> None:
        self.pending.append((run, timing))

    def collect(self, payoff: Payoff) -> Optional[str]:
        while self.pending and self.clock.ready(self.pending[0][1]):
            run, timing = self.pending.pop(0)
            payoff.add(run, self.clock.seconds(timing))
        return payoff.verdict


def measurement(life: Any) -> Optional[tuple]:
    """What measures a key's payoff from its capture on (``_key_life.KeyLife.adopt``): a
    ``Payoff`` and its ``PendingTimings``, or None where it is not measured (the option off,
    a training key, a key measured before, a backend without a clock)."""
    if life.trains or not life.options.check_payoff or life.gain is not None:
        return None
    clock = life.backend.payoff_clock(life.device)
    return None if clock is None else (Payoff(), PendingTimings(clock))


def timed_call(life: Any, c: Any, graph: Any) -> Any:
    """A call of a key whose payoff is measured: replays and eager runs take turns, each
    timed on the stream the call runs on; once the timings decide, the key keeps its graph
    or runs eagerly, said once per function with the figures."""
    payoff, pending = life.payoff
    verdict = pending.collect(payoff)
    if verdict is not None:
        life.payoff, life.gain = None, payoff.gain()
        if verdict == EAGER:
            said = "payoff" in c.cache.said
            c.cache.said.add("payoff")
            life.fall_back(payoff.reason(), warn=not said, strict=False)
            life.island = NO_ISLAND
            return life.run_eagerly(c)
        return life.run(c)
    run = payoff.next_run()
    timing = pending.clock.start()
    if run == REPLAY:
        life.replays += 1
        c.note(life, "replays")
        outputs = graph.replay(c.tensors, c.padding)
    else:
        outputs = life.run_eagerly(c)
    pending.add(run, pending.clock.stop(timing))
    return outputs
