"""The decode step's buffers: every value it reads or writes, on the device, at a fixed shape.

>>> state = DecodeState(rows=8, length=128, vocab=1024, device="cuda")
>>> state.start(plan)        # per call, in place: the graph keeps reading the same addresses

The graph of the decode step reads these by address and updates them in place, so nothing of
the loop lives on the host: the last token, its position, the attention mask over the whole
cache (the prompt's, then ones: the causal mask hides what is not written yet), which rows are
unfinished, the tokens made so far and their count (docs/design.md, "Decoding").
"""

from __future__ import annotations

from typing import Any

import torch

from ._recipe import LANES, seen_in_prompt


class DecodeState:
    """Buffers for ``rows`` rows over a cache of ``length`` positions (which holds the prompt
    and every token but the last: ``generated`` has room for one more)."""

    def __init__(self, rows: int, length: int, vocab: int, device: torch.device):
        def longs(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        self.rows = rows
        self.token = longs(rows, 1)  # the next forward's input: the last choice
        self.position = longs(rows, 1)  # its position id, advanced before the forward
        self.mask = longs(rows, length)  # the attention mask the decode step passes
        self.unfinished = longs(rows)  # 1 while a row has not met an eos id
        self.generated = longs(rows, length + 1)  # the tokens chosen, in order
        self.index = longs(1)  # tokens chosen so far (where the next goes)
        self.count = longs()  # tokens model.generate would return
        self.alive = longs()  # whether any row is unfinished
        self.thresholds = longs(len(LANES))  # eos blocked while index < these
        self.pad = longs()
        self.eos_mask = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.seen = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=device)

    def start(self, plan: Any) -> None:
        """Fill the buffers for a call: its rows first, the bucket's spare rows after (they
        copy row 0 and are finished from the start, so they never hold the loop back)."""
        real, length = plan.prompt.shape
        self.mask.fill_(1)
        self.mask[:real, :length].copy_(plan.mask)
        self.mask[real:, :length].copy_(plan.mask[:1])
        if plan.positions is not None:
            self.position.copy_(self.spread(plan.positions[:, -1:]))
        self.unfinished.zero_()
        self.unfinished[:real].fill_(1)
        self.index.zero_()
        self.count.zero_()
        self.alive.fill_(1)
        self.thresholds.copy_(torch.tensor([plan.eos_blocked_until.get(n, 0) for n in LANES]))
        self.pad.fill_(0)
        self.eos_mask.zero_()
        if plan.eos is not None:  # the mask transformers' min-length processors build
            vocab = torch.arange(len(self.eos_mask), device=self.eos_mask.device)
            self.eos_mask.copy_(torch.isin(vocab, plan.eos.to(vocab.device)))
        if plan.pad is not None:
            self.pad.copy_(plan.pad)
        if plan.recipe.penalises:
            seen_in_prompt(self.seen, plan.prompt, plan.repetition_ignored)

    def spread(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` ([real, ...]) with row 0 repeated up to this state's rows."""
        spare = self.rows - rows.shape[0]
        return torch.cat([rows, rows[:1].expand(spare, *rows.shape[1:])]) if spare else rows
