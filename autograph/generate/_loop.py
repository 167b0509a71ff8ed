"""The host's side of decoding: queue decode steps, and look at "every row finished" rarely.

>>> decode(decoder, plan, check_every=CHECK_EVERY)

transformers' loop reads ``unfinished.max() == 0`` on the host after every token, so the CPU
waits for each step before it queues the next. Here the host queues ``check_every`` steps (each
one graph replay), then queues an asynchronous copy of the state's ``alive`` flag into pinned
memory, and reads the copy made at the previous check, which the GPU has finished by then or
soon: the CPU stays up to two checks ahead of the GPU and never waits for the step it just
queued. So up to ``2 * check_every - 1`` steps may run after every row has finished; they write
pad tokens past the end, which the result never shows (the state's ``count`` says where
model.generate would have stopped). On the CPU there is nothing to run ahead of: the flag is
read at each check (docs/design.md, "Decoding").

``CHECK_EVERY = 8``: at the 1 ms decode step of the benchmark's model, a check costs the host
tens of microseconds per 8 ms of GPU work, and an eos wastes at most 15 steps' GPU time.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Deque, Optional, Tuple

import torch

CHECK_EVERY = 8


class FinishedFlags:
    """Whether every row was finished, as the previous check saw it (CUDA), or now (CPU)."""

    def __init__(self, alive: torch.Tensor):
        self.alive = alive
        self.slots: Deque[Tuple[torch.Tensor, Optional[Any]]] = deque(
            (
                torch.empty((), dtype=alive.dtype, pin_memory=alive.is_cuda),
                torch.cuda.Event() if alive.is_cuda else None,
            )
            for _ in range(2)
        )
        self.pending = False

    def restart(self) -> None:
        self.pending = False

    def all_finished(self) -> bool:
        host, event = self.slots[0]
        if event is None:
            return not bool(self.alive)
        host.copy_(self.alive, non_blocking=True)
        event.record()
        self.slots.rotate()
        if not self.pending:  # the first check of a call: nothing queued before it to read
            self.pending = True
            return False
        host, previous = self.slots[0]
        assert previous is not None
        previous.synchronize()
        return not bool(host)


def decode(decoder: Any, plan: Any, check_every: int) -> None:
    """Run the decode steps of one call: ``max_new_tokens - 1`` at most (the prefill chose the
    first token), stopping at the first check that finds every row finished."""
    steps = plan.max_new_tokens - 1
    flags = decoder.flags
    flags.restart()
    done = 0
    while done < steps:
        chunk = min(check_every, steps - done)
        for _ in range(chunk):
            decoder.step(plan.recipe)
        done += chunk
        if plan.recipe.ends and done < steps and flags.all_finished():
            return
