"""Arguments copied into a graph's statics: small ones with one ``_foreach_copy_``, each large
one (``FOREACH_CHUNK`` elements or more) with a ``copy_`` of its own, whose kernel spreads over
the whole GPU (autograph/capture/_plan.py)."""

import pytest
import torch

import autograph
from autograph.capture._plan import FOREACH_CHUNK, copy_all

from conftest import states


@pytest.mark.parametrize("sizes", [(3, FOREACH_CHUNK + 1, 5), (FOREACH_CHUNK,), (2, 3)])
def test_copy_all_copies_small_and_large_tensors(sizes):
    src = [torch.randn(n) for n in sizes]
    dst = [torch.zeros(n) for n in sizes]
    copy_all(dst, src)
    assert all(torch.equal(d, s) for d, s in zip(dst, src))


def test_a_graph_with_a_large_and_a_small_argument_replays_their_new_values(device):
    @autograph.graphed
    def mix(big, small):
        return big.sum(1) + small

    for _ in range(4):
        big = torch.randn(64, 2048, device=device)  # 2 chunks: a copy_ of its own
        small = torch.randn(64, device=device)
        torch.testing.assert_close(mix(big, small), big.sum(1) + small)
    assert states(mix) == [("graphed", 4, 1, 3)]
