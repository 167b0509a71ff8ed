"""The guard names x[index] = number and x[mask] = number with a fix that does what the assignment
does, keyword arguments included, and leaves an accumulating index_put_ to the generic words.
"""

import torch

from autograph.watch._unsafe_ops import unsafe_op

_aten = torch.ops.aten


def test_number_assigned_takes_keyword_arguments():
    finding = unsafe_op(
        _aten.index_put_.default,
        (torch.zeros(4),),
        {"indices": [torch.tensor([0])], "values": torch.tensor(7.0)},
        "cuda",
    )
    assert finding is not None and finding[0] == "computing with a CPU tensor"


def test_the_fix_named_for_a_row_mask_does_what_the_assignment_does():
    """masked_fill_(mask, number) was named for any mask: masked_fill_ broadcasts
    the mask from the last dim, so for a mask over rows it filled columns. The fix now says
    how to shape the mask, and the shaped mask does what the assignment does."""
    x = torch.arange(16.0).view(4, 4)
    mask = torch.tensor([True, False, False, False])
    assigned = x.clone()
    assigned[mask] = 0.0
    assert torch.equal(x.clone().masked_fill_(mask[..., None], 0.0), assigned)
    target = torch.empty(4, 4, device="meta")
    for given in (mask, mask.to(torch.uint8)):
        _, consequence = unsafe_op(
            _aten.index_put_.default, (target, [given.to("meta")], torch.tensor(0.0)), {}, "cuda"
        )
        assert "bool mask of x's shape" in consequence and "mask[..., None]" in consequence


def test_an_accumulating_index_put_of_a_number_is_not_named_an_assignment():
    target, index = torch.empty(4, device="meta"), torch.tensor([0, 2], device="meta")
    operation, _ = unsafe_op(
        _aten.index_put_.default, (target, [index], torch.tensor(1.0), True), {}, "cuda"
    )
    assert operation == "computing with a CPU tensor"


def test_a_number_assigned_is_named_though_a_python_number_made_it():
    # y[index] = 7.0 makes 7.0 a CPU scalar of Python's (which a GPU op may take as a number)
    # and copies it to the GPU inside index_put_: the guard must still name it.
    number = torch.tensor(7.0)
    target, index = torch.empty(4, device="meta"), torch.tensor([1], device="meta")
    finding = unsafe_op(
        _aten.index_put_.default, (target, [index], number), {}, "cuda", numbers={number}
    )
    assert finding is not None and finding[0] == "x[index] = number"
    assert unsafe_op(_aten.mul.Tensor, (target, number), {}, "cuda", numbers={number}) is None
