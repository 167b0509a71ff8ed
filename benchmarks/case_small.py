"""(c) One kernel (torch.cat) of four small tensors, where the wrapper's own cost shows fully:
eager, a hand-written loop (one copy_ per argument), make_graphed_callables, autograph and
torch.compile(mode="reduce-overhead"). About 10 s on an H200 (compile 2 s of it)."""

from __future__ import annotations

import torch
from case_mlp import compiled

import autograph
from autograph.cli._bench import device, hand_written, progress, timed, with_ratio

NAME = "(c) one kernel, four small tensors"


def cat4(a, b, c, d):
    return torch.cat((a, b, c, d))


def case_small(rows, with_compile):
    dev = device()
    tensors = [torch.randn(64, device=dev) for _ in range(4)]
    with torch.no_grad():
        timed(rows, NAME, "eager", lambda: cat4(*tensors), kind="eager")
        hand = hand_written(cat4, tensors)
        hand_us = timed(
            rows, NAME, "hand-written capture/replay", lambda: hand(*tensors), kind="hand"
        )
        if dev == "cuda":
            mgc = torch.cuda.make_graphed_callables(cat4, tuple(t.clone() for t in tensors))
            timed(rows, NAME, "make_graphed_callables", lambda: mgc(*tensors), kind="hand")
        # The wrapper's cost against the hand loop: no payoff check, which may send a
        # one-kernel key to eager (right for a user; not what this measures).
        step = autograph.graphed(cat4, check_payoff=False)
        us = timed(rows, NAME, "autograph.graphed", lambda: step(*tensors), kind="autograph")
        with_ratio(rows, us, hand_us)
        assert torch.equal(step(*tensors), cat4(*tensors))
        if with_compile:
            progress("compiling (reduce-overhead)")
            fn, seconds = compiled(cat4, tensors)
            timed(
                rows,
                NAME,
                'torch.compile("reduce-overhead")',
                lambda: fn(*tensors),
                note=f"first 3 calls {seconds:.1f} s",
                kind="compile",
            )
