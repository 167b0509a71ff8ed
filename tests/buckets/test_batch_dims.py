"""Which output dims follow the batch (autograph/buckets/_batch_dims.py), from runs at several
sizes."""

import pytest
import torch

from autograph.buckets._batch_dims import BatchShapes, named_dims
from autograph.buckets._buckets import BucketRule, family_key
from autograph.capture._keys import call_key
from autograph.capture._outputs import real_rows


def shapes_of(runs, named=None):
    shapes = BatchShapes(named)
    for size, outputs in runs:
        shapes.note(size, outputs)
    return shapes


def test_a_dim_of_the_run_size_at_two_sizes_follows_and_one_that_keeps_its_size_does_not():
    shapes = shapes_of(
        [(4, [torch.empty(2, 4, 5), torch.empty(4)]), (8, [torch.empty(2, 8, 5), torch.empty(4)])]
    )
    decision = shapes.decide(rows=3, bucket=4)
    assert decision.dims == ((1,), ()) and not decision.undecided and not decision.refused
    assert shapes.decide(rows=5, bucket=8).dims == ((1,), ())


def test_one_size_cannot_tell_a_dim_of_the_buckets_size():
    shapes = shapes_of([(4, [torch.empty(4, 3), torch.empty(4)])])
    decision = shapes.decide(rows=3, bucket=4)
    assert decision.dims is None and "dim 0 of output 0" in decision.undecided
    assert shapes.decide(rows=4, bucket=4).dims == ((), ())  # nothing to slice


def test_one_size_decides_dims_that_cannot_be_the_batch():
    shapes = shapes_of([(4, [torch.empty(3, 5), torch.empty(()), 7, "tag"])])
    assert shapes.decide(rows=3, bucket=4).dims == ((), (), (), ())


def test_one_size_cannot_tell_a_multiple_of_the_buckets_size():
    decision = shapes_of([(4, [torch.empty(3, 8)])]).decide(rows=3, bucket=4)
    assert decision.dims is None and "2x the size" in decision.undecided


def test_one_run_at_size_1_decides_no_dim():
    shapes = shapes_of([(1, [torch.empty(1, 4, 16), torch.empty(())])])
    assert "dim 0 of output 0" in shapes.decide(rows=1, bucket=4).undecided
    shapes.note(4, [torch.empty(4, 4, 16), torch.empty(())])
    assert shapes.decide(rows=3, bucket=4).dims == ((0,), ())


def test_an_unpadded_run_at_the_callers_size_is_evidence_too():
    shapes = shapes_of(
        [(3, [torch.empty(2, 3, 5), torch.empty(4)]), (4, [torch.empty(2, 4, 5), torch.empty(4)])]
    )
    assert shapes.decide(rows=3, bucket=4).dims == ((1,), ())


def test_the_batch_flattened_into_another_dim_is_refused():
    decision = shapes_of([(4, [torch.empty(8)]), (8, [torch.empty(16)])]).decide(3, 4)
    assert (
        decision.dims is None
        and "dim 0 of output 0 changes with the batch size" in decision.refused
    )


def test_a_python_value_that_follows_the_size_is_refused():
    shapes = shapes_of([(4, [torch.empty(3), 4])])
    assert "Python value 4" in shapes.decide(3, 4).undecided
    shapes.note(8, [torch.empty(3), 8])
    assert "output 1 is a Python value that changes" in shapes.decide(3, 4).refused


def test_outputs_that_change_in_number_or_rank_are_refused():
    assert (
        "number or rank"
        in shapes_of([(4, [torch.empty(4)]), (8, [torch.empty(8, 1)])]).decide(3, 4).refused
    )
    assert (
        "number or rank"
        in shapes_of([(4, [torch.empty(4)]), (8, [torch.empty(8), torch.empty(8)])])
        .decide(3, 4)
        .refused
    )


def test_named_dims_decide_at_one_size_and_are_checked_against_each_run():
    shapes = shapes_of([(4, [torch.empty(2, 4), torch.empty(4)])], named=[1, None])
    assert shapes.decide(3, 4).dims == ((1,), ())
    shapes.note(8, [torch.empty(2, 5), torch.empty(4)])
    assert "bucket_outputs names dim 1 of output 0" in shapes.decide(3, 4).refused


def test_named_dims_spelled_as_an_int_or_per_output():
    leaves = [torch.empty(3, 2), 7, torch.empty(2, 3)]
    assert named_dims(0, leaves) == ((0,), (), (0,))
    assert named_dims([None, None, -1], leaves) == ((), (), (1,))
    with pytest.raises(ValueError, match="one entry per output"):
        named_dims([0], leaves)
    with pytest.raises(ValueError, match="output 1, which is a int"):
        named_dims([0, 0, 0], leaves)
    with pytest.raises(ValueError, match="output 0 has 2 dims"):
        named_dims([2, None, None], leaves)


def test_real_rows_narrows_every_dim_that_follows():
    out = torch.arange(16.0).view(4, 4)
    assert torch.equal(real_rows(out, (0, 1), 3), out[:3, :3])
    assert real_rows(out, (), 3) is out


def test_keys_of_one_function_differ_only_in_their_per_bucket_state_share_a_family():
    def family(x, cache, rows=None):
        rule = BucketRule((4, 8), None)
        keyed = call_key((x, cache), {}, (), ["x", "cache"], ("cache",), ())
        padding, _ = rule.padding(["x", "cache"], (x, cache), {}, keyed.tensors, keyed.addressed)
        return family_key((x, cache), {}, (), ["x", "cache"], ("cache",), (), padding)

    four, eight = torch.zeros(4, 2), torch.zeros(8, 2)
    assert family(torch.ones(3, 2), four) == family(torch.ones(7, 2), eight)
    assert family(torch.ones(3, 2), four)[1] is True  # it has per-bucket state
    assert family(torch.ones(3, 2), four) != family(torch.ones(3, 5), four)  # other width
    assert family(torch.ones(3, 2), four) != family(torch.ones(3, 2, dtype=torch.int64), four)
