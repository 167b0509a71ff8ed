"""Numbers a bucketed function computes from its batch size are never replayed wrong: through a
shape, as a tensor, several of them.
"""

import pytest
import torch

import autograph

from conftest import states

pytestmark = pytest.mark.usefixtures("caught")


SIZE_AS_VALUES = {
    "torch.linspace(0, 1, n)": lambda x: (
        x * torch.linspace(0, 1, x.shape[0], device=x.device).unsqueeze(1)
    ),
    "torch.ones(n).sum()": lambda x: x * torch.ones(x.shape[0], device=x.device).sum(),
    "x.new_ones(n).cumsum(0)[-1]": lambda x: x * x.new_ones(x.shape[0]).cumsum(0)[-1],
}


# Once wrong: the graph of 4 gave 4's values for 3 rows. A stateless key's first replay
# with pad rows is now checked against an eager run of its own rows.
@pytest.mark.parametrize("name", sorted(SIZE_AS_VALUES))
def test_a_value_made_from_the_batch_size_through_a_shape_is_not_replayed_wrong(device, name):
    reference = SIZE_AS_VALUES[name]
    fn = autograph.graphed(reference, buckets=[4, 8])
    for n in (3, 3, 3, 3):
        x = torch.randn(n, 5, device=device)
        torch.testing.assert_close(fn(x), reference(x))
    assert states(fn)[0][0] == "eager"
    assert "padded from 3 rows to its bucket of 4" in autograph.stats(fn)[0].fallback_reason


# Once wrong: on the emulation the graph of 4 replayed 4 for 3 rows; the check of the
# first replay with pad rows against an eager run now makes the key eager.
def test_a_tensor_made_from_the_batch_size_on_the_emulation(emulated):
    def reference(x):
        return x * torch.tensor(x.shape[0])

    fn = autograph.graphed(reference, buckets=[4, 8])
    for n in (3, 3, 3, 3):
        x = torch.randn(n, 5)
        torch.testing.assert_close(fn(x), reference(x))
    assert states(fn)[0][0] == "eager"


@pytest.mark.parametrize("name", ["float(n)", "n ** 2", "x.new_full", "branch", "len(x)"])
def test_more_numbers_read_from_the_batch_size_run_eagerly(device, name):
    reference = {
        "float(n)": lambda x: x * float(x.shape[0]),
        "n ** 2": lambda x: x * x.size(0) ** 2,
        "x.new_full": lambda x: x + x.new_full((1, 5), x.shape[0]),
        "branch": lambda x: x * 2 if x.shape[0] > 3 else x * 3,
        "len(x)": lambda x: x * len(x),
    }[name]
    fn = autograph.graphed(reference, buckets=[4, 8])
    for n in (3, 3, 3, 3, 6, 6):
        x = torch.randn(n, 5, device=device)
        torch.testing.assert_close(fn(x), reference(x), rtol=0, atol=0)
    assert [row[0] for row in states(fn)] == ["eager", "eager"]
