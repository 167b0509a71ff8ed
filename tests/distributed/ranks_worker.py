"""Runs graphed functions with collectives in several processes, one rank each, and writes what
each rank saw as JSON (for test_ranks.py, which starts it in a subprocess with a time limit).

    python ranks_worker.py gloo 2 PORT OUT_DIR      # CPU processes, the CPU emulation
    python ranks_worker.py nccl 1 PORT OUT_DIR      # one GPU: NCCL captured, then torn down
"""

import contextlib
import datetime
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import autograph
from autograph.backends._cuda_graphs import CudaGraphs
from autograph.testing import emulate_graphs_on_cpu

# As conftest does for the tests: keys keep their graphs whatever their measured timings
# (check_payoff), so that what each rank saw is the same on every run.
CudaGraphs.payoff_clock = staticmethod(lambda device: None)


def states(graphed):
    """Each key's (state, calls, eager calls, replays, fallback reason)."""
    return [
        (s.state, s.calls, s.eager_calls, s.replays, s.fallback_reason)
        for s in autograph.stats(graphed)
    ]


def scenarios(rank, device):
    """Every scenario runs on every rank, in the same order: collectives must match."""
    seen = {}

    @autograph.graphed
    def reduced(x):
        y = x * 2
        dist.all_reduce(y)
        return y + 1

    seen["reduced"] = [
        reduced(torch.full((4,), float(i + rank), device=device)).tolist() for i in range(4)
    ]
    seen["reduced_states"] = states(reduced)

    @autograph.graphed
    def only_rank_1_reads(x):
        y = x * 2
        dist.all_reduce(y)
        if rank == 1:
            y.sum().item()  # a host read on one rank only
        return y + 1

    seen["diverging"] = [
        only_rank_1_reads(torch.full((4,), float(i + rank), device=device)).tolist()
        for i in range(4)
    ]
    seen["diverging_states"] = states(only_rank_1_reads)

    @autograph.graphed
    def reduce_argument(x):
        dist.all_reduce(x)  # writes into the caller's tensor
        return x * 2

    arguments = [torch.full((3,), float(i + rank), device=device) for i in range(4)]
    seen["argument_outputs"] = [reduce_argument(x).tolist() for x in arguments]
    seen["arguments_after"] = [x.tolist() for x in arguments]
    seen["argument_states"] = states(reduce_argument)

    @autograph.graphed(strict=True)
    def strict_diverging(x):
        y = x + 1
        dist.all_reduce(y)
        if rank == 1:
            y.sum().item()
        return y

    raised = []
    for i in range(3):
        try:
            strict_diverging(torch.full((2,), float(i), device=device))
        except autograph.CaptureError as error:
            raised.append(str(error))
    seen["strict_raised"] = raised
    seen["unmatched_vote"] = unmatched_vote(rank, device)
    eager, graphed = ddp_training(rank, device, False), ddp_training(rank, device, True)
    seen["ddp_same_as_eager"] = eager[:2] == graphed[:2]
    seen["ddp_states"] = graphed[2]
    return seen


def unmatched_vote(rank, device):
    """Rank 0 votes on a capture that rank 1 never makes, then both run a collective: the vote
    (in the store) times out on rank 0 and pairs with nothing, and the collective is right."""
    from autograph.distributed import _ranks

    before, _ranks.VOTE_TIMEOUT = _ranks.VOTE_TIMEOUT, datetime.timedelta(seconds=2)
    try:
        failure = _ranks.agreed_failure([dist.group.WORLD], None) if rank == 0 else None
    finally:
        _ranks.VOTE_TIMEOUT = before
    value = torch.full((2,), float(rank + 1), device=device)
    dist.all_reduce(value)
    return {"failure": failure, "reduced": value.tolist()}


def ddp_training(rank, device, graph):
    """Five DDP steps of a small model, each rank on its own data: (losses, parameters,
    the graphed module's states)."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1)).to(
        device
    )
    if graph:
        model = autograph.graphed(model)
    on_gpu = device.startswith("cuda")
    # DDP keeps its parameters' AccumulateGrad nodes: build it on autograph's stream
    with torch.cuda.stream(autograph.capture_stream()) if on_gpu else contextlib.nullcontext():
        ddp = DistributedDataParallel(model, device_ids=[rank] if on_gpu else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    torch.manual_seed(1 + rank)
    losses = []
    for _ in range(5):
        x = torch.randn(16, 8, device=device)
        optimizer.zero_grad()
        loss = ddp(x).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    parameters = [p.detach().cpu().tolist() for p in ddp.parameters()]
    return losses, parameters, states(model) if graph else None


def run(rank, backend, world, port, out):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        NCCL_NVLS_ENABLE="0",
        TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
    )
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group(backend, rank=rank, world_size=world)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if backend == "gloo":
            with emulate_graphs_on_cpu():
                seen = scenarios(rank, device)
        else:
            seen = scenarios(rank, device)
    seen["warnings"] = [
        str(w.message) for w in caught if issubclass(w.category, autograph.AutographWarning)
    ]
    # The teardown order docs/guide/several-gpus.md gives: graphs first, then the process group.
    autograph.reset()
    dist.destroy_process_group()
    seen["destroyed"] = True
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    backend, world, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    mp.spawn(run, args=(backend, world, port, out), nprocs=world)
