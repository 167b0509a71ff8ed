"""Several processes (docs/design.md, "Ranks"): collectives inside graphed functions, every rank
deciding alike.

CPU processes with the gloo backend run the real engine through the CPU emulation; the NCCL
test captures collectives on one GPU. Tests on two or more GPUs are in the multi-GPU suite
(they need a machine with several GPUs).
"""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch.distributed as dist

from conftest import requires_cuda

WORKER = os.path.join(os.path.dirname(__file__), "ranks_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="needs torch.distributed with the gloo backend",
)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(tmp_path, backend, world):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, WORKER, backend, str(world), str(free_port()), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(world)]


def reduced_values(world, first):
    """What ``reduced`` returns on every rank: the sum over ranks of 2 * (i + rank), plus 1."""
    return [[float(sum(2 * (i + r) for r in range(world)) + 1)] * 4 for i in range(first)]


@needs_gloo
def test_ranks_replay_collectives_and_decide_alike(tmp_path):
    rank0, rank1 = run_ranks(tmp_path, "gloo", 2)
    for seen in (rank0, rank1):
        # a collective in the graph: replayed on both ranks, values as eager
        assert seen["reduced"] == reduced_values(2, 4)
        assert [s[:4] for s in seen["reduced_states"]] == [["graphed", 4, 1, 3]]
        # a host read on rank 1 only: rank 1's capture fails, and rank 0 runs eagerly too
        assert seen["diverging"] == reduced_values(2, 4)
        assert [s[:4] for s in seen["diverging_states"]] == [["eager", 4, 4, 0]]
        # a collective that writes an argument: the write reaches the caller's tensor
        sums = [float(2 * i + 1) for i in range(4)]
        assert seen["arguments_after"] == [[s] * 3 for s in sums]
        assert seen["argument_outputs"] == [[2 * s] * 3 for s in sums]
        assert [s[:4] for s in seen["argument_states"]] == [["graphed", 4, 1, 3]]
        assert seen["destroyed"]
    assert ".item()" in rank1["diverging_states"][0][4]
    assert "rank 1" in rank0["diverging_states"][0][4]
    assert any("rank 1" in w and "decide alike" in w for w in rank0["warnings"])
    for seen in (rank0, rank1):  # DDP around a graphed module: forward and backward graphed
        assert seen["ddp_same_as_eager"]
        assert [s[:4] for s in seen["ddp_states"]] == [["graphed", 5, 1, 4]]
    # a vote that another rank never casts times out (votes go through the store, so it
    # pairs with no collective); the collective after it is right
    assert "rank 1" in rank0["unmatched_vote"]["failure"]
    assert rank0["unmatched_vote"]["reduced"] == rank1["unmatched_vote"]["reduced"] == [3.0] * 2
    # strict: both ranks raise (rank 0 because rank 1 could not graph it); neither waits
    assert rank1["strict_raised"] and ".item()" in rank1["strict_raised"][0]
    assert rank0["strict_raised"] and "rank 1" in rank0["strict_raised"][0]


@pytest.mark.cuda
@requires_cuda
@pytest.mark.skipif(
    not (dist.is_available() and dist.is_nccl_available()),
    reason="needs torch.distributed with NCCL",
)
def test_nccl_collectives_are_captured_and_the_process_group_tears_down(tmp_path):
    (seen,) = run_ranks(tmp_path, "nccl", 1)
    assert seen["reduced"] == reduced_values(1, 4)
    assert [s[:4] for s in seen["reduced_states"]] == [["graphed", 4, 1, 3]]
    assert [s[:4] for s in seen["argument_states"]] == [["graphed", 4, 1, 3]]
    assert seen["arguments_after"] == [[float(i)] * 3 for i in range(4)]
    assert seen["ddp_same_as_eager"]
    assert [s[:4] for s in seen["ddp_states"]] == [["graphed", 5, 1, 4]]
    assert seen["destroyed"]
