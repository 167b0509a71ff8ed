"""What the tests of ``autograph.generate`` share: prompts, the decode step's and the prefill's
stats rows, and a
count of the host reads a call makes."""

import torch
from torch.overrides import TorchFunctionMode

import autograph


def left_padded(rows=3, length=6, vocab=256, seed=1):
    """(ids, mask): ``rows`` prompts of ``length`` ids, row i left-padded by 2 * i positions
    (at most length - 1), the pad positions holding id 0."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, length), generator=generator)
    mask = torch.ones_like(ids)
    for row in range(rows):
        mask[row, : min(2 * row, length - 1)] = 0
    return ids.masked_fill(mask == 0, 0), mask


def decode_steps():
    """The stats rows of every live ``autograph.generate`` decode step."""
    return [row for row in autograph.stats() if row.function.startswith("generate_decode_step[")]


def prefills():
    """The stats rows of every live ``autograph.generate`` prefill graphed."""
    return [row for row in autograph.stats() if row.function.startswith("generate_prefill[")]


def replays():
    return sum(row.replays for row in decode_steps())


def assert_graphed(rows=None):
    """Every decode step's key was captured and replayed (none ran eagerly)."""
    rows = decode_steps() if rows is None else rows
    assert rows, "no decode step was graphed"
    for row in rows:
        assert row.state == "graphed" and row.replays > 0, row


class HostReads(TorchFunctionMode):
    """Counts the calls that read a tensor's value on the host (``.item()``, ``bool(t)``,
    ``.tolist()``, ``int(t)``...) while it is on."""

    READS = {"item", "__bool__", "tolist", "__int__", "__float__", "__index__", "numpy", "cpu"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS:
            self.count += 1
        return func(*args, **(kwargs or {}))
