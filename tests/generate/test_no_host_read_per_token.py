"""The host reads a value of the device only every check_every tokens: the decode loop's host
reads grow by one per check, not per token (on the CPU, counted as calls that read a tensor's
value: .item(), bool(t), int(t)...; on the GPU, by torch's sync debug mode)."""

import warnings

import pytest
import torch

import autograph

from conftest import requires_cuda
from helpers.generation import HostReads, assert_graphed, left_padded
from helpers.models import tiny_decoder


def host_reads(model, ids, mask, new_tokens, check_every):
    options = dict(max_new_tokens=new_tokens, do_sample=False, eos_token_id=[3], pad_token_id=0)
    with HostReads() as reads:
        tokens = autograph.generate(
            model, ids, attention_mask=mask, check_every=check_every, **options
        )
    assert tokens.shape[1] == ids.shape[1] + new_tokens  # no row ended: every step ran
    return reads.count


@pytest.mark.parametrize("check_every", [4, 8])
def test_host_reads_grow_by_one_per_check_not_per_token(check_every, emulated):
    _, _, model = tiny_decoder("llama")
    model.generation_config.eos_token_id = None
    ids, mask = left_padded()
    for _ in range(3):  # warms up and captures the step and the prompt's prefill
        host_reads(model, ids, mask, 9, check_every)
    short, long = (host_reads(model, ids, mask, n, check_every) for n in (9, 41))
    # 8 and 40 decode steps: a check after each chunk of check_every but the last.
    assert long - short == 40 // check_every - 1 - (8 // check_every - 1)
    assert_graphed()


@pytest.mark.cuda
@requires_cuda
def test_the_decode_loop_makes_no_synchronising_call_per_token_on_cuda():
    _, _, model = tiny_decoder("llama")
    model = model.cuda()
    ids, mask = (t.cuda() for t in left_padded())
    options = dict(do_sample=False, eos_token_id=[3], pad_token_id=0)

    def syncs(new_tokens):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as records:
                warnings.simplefilter("always")
                autograph.generate(
                    model, ids, attention_mask=mask, max_new_tokens=new_tokens, **options
                )
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(r.message) for r in records)

    syncs(9)
    # 8 more checks for 64 more tokens at most (one event wait each); never one per token.
    assert syncs(73) - syncs(9) <= 8
    assert_graphed()
