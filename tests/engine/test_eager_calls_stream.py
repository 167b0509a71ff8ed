"""Where an eager call runs: on the capture stream (``Backend.eager_stream``) where it may make
autograd nodes, on the caller's stream where its key's watched warmup read nothing that needs
gradients, and back on the capture stream once a call of it made a graph after all. Seen here
through the calls of the emulation's ``eager_stream``; on CUDA, through the stream itself
(tests/backends/test_cuda.py)."""

import contextlib

import torch

import autograph
from autograph.backends._cpu_graphs import CpuGraphs


def test_an_eager_call_that_makes_a_graph_its_warmup_did_not_goes_back_to_the_capture_stream(
    monkeypatch, emulated
):
    # Found by a hostile review: a key is eager because it reads the host, so the branch its
    # warmup took shows nothing of later calls; one that reads a parameter later made its
    # AccumulateGrad node on the caller's stream at every call.
    entered = []

    def eager_stream(self, device):
        entered.append(len(calls))
        return contextlib.nullcontext()

    monkeypatch.setattr(CpuGraphs, "eager_stream", eager_stream)
    w = torch.randn(4, 4, requires_grad=True)
    calls = []

    def step(x):
        calls.append(None)
        if x.sum() > 0:  # a host read: the key runs eagerly; the branch reads w
            return x @ w
        return x * 2

    f = autograph.graphed(step)
    negative = -torch.ones(2, 4)
    for _ in range(4):
        torch.testing.assert_close(f(negative), negative * 2)
    before = len(entered)  # the warmups' (they run where nodes belong)
    for _ in range(4):
        torch.testing.assert_close(f(negative), negative * 2)
    assert len(entered) == before  # nothing needs gradients: the caller's stream
    positive = torch.ones(2, 4)
    out = f(positive)
    out.sum().backward()
    torch.testing.assert_close(w.grad, positive.T @ torch.ones(2, 4))
    assert len(entered) == before  # this call made its graph where it was
    for _ in range(2):
        f(positive)
    assert len(entered) == before + 2  # from now on, where autograd nodes belong
    (row,) = f.stats()
    assert row.state == "eager" and row.replays == 0
