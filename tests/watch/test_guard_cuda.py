"""The guard on a real GPU: one test per catalog entry, recovery, and no false positives.

Each catalog function marks its unsafe line with ``# <- unsafe``; the test checks that the
key falls back to eager with results equal to eager, one warning, and that line named.
"""

import contextlib
import gc
import inspect
import io

import pytest
import torch

import autograph

from conftest import autograph_warnings, requires_cuda

pytestmark = [pytest.mark.cuda, requires_cuda]


def item(x):
    s = x.sum().item()  # <- unsafe
    return x * s


def tolist(x):
    values = x.tolist()  # <- unsafe
    return x * len(values)


def cpu(x):
    host = x.cpu()  # <- unsafe
    return x + host.shape[0]


def to_cpu(x):
    host = x.to("cpu")  # <- unsafe
    return x + host.shape[0]


def print_tensor(x):
    print(x)  # <- unsafe
    return x * 2


def repr_tensor(x):
    text = repr(x)  # <- unsafe
    return x * len(text)


def bool_tensor(x):
    positive = bool(x.sum() > 0)  # <- unsafe
    return x * 2 if positive else x


def if_tensor(x):
    if x.sum() > 0:  # <- unsafe
        return x * 2
    return x


def cuda_synchronize(x):
    y = x * 2
    torch.cuda.synchronize()  # <- unsafe
    return y


def stream_synchronize(x):
    y = x * 2
    torch.cuda.current_stream().synchronize()  # <- unsafe
    return y


def event_synchronize(x):
    event = torch.cuda.Event()
    event.record()
    event.synchronize()  # <- unsafe
    return x * 2


EVENT = None


def event_query(x):
    EVENT.query()  # <- unsafe
    return x * 2


def nonzero(x):
    return x.sum() + torch.nonzero(x > 0).sum()  # <- unsafe


def where_one_argument(x):
    return x.sum() + torch.where(x > 0)[0].sum()  # <- unsafe


def masked_select(x):
    return torch.masked_select(x, x > 0).sum()  # <- unsafe


def mask_index(x):
    return x[x > 0].sum()  # <- unsafe


def unique(x):
    return torch.unique((x > 0).int()).sum() + x  # <- unsafe


def cpu_compute(x):
    scale = torch.arange(8.0).sum()  # <- unsafe
    return x * scale


def pageable_copy(x):
    return x + torch.ones(8).to("cuda")  # <- unsafe


INDEX = None  # made on the GPU by the test, before the function runs


def number_by_index(x):
    y = x.clone()
    y[INDEX] = 7.0  # <- unsafe
    return y


def number_by_mask(x):
    y = x.clone()
    y[y > 0] = 0.0  # <- unsafe
    return y


def empty_cache(x):
    torch.cuda.empty_cache()  # <- unsafe
    return x * 2


# Reaches CUDA without passing any patch or mode (absent from CPU builds of torch).
RAW_SYNC = getattr(torch._C, "_cuda_synchronize", None)


def raw_cuda_call(x):
    y = x * 2
    RAW_SYNC()  # <- unsafe
    return y


CATALOG = [
    (item, ".item() at"),
    (tolist, ".tolist()"),
    (cpu, ".cpu()"),
    (to_cpu, ".to('cpu')"),
    (print_tensor, "print() or repr() of a GPU tensor at"),
    (repr_tensor, "print() or repr()"),
    (bool_tensor, "bool(tensor) at"),
    (if_tensor, "a tensor used as a Python condition at"),
    (cuda_synchronize, "torch.cuda.synchronize() at"),
    (stream_synchronize, "Stream.synchronize() at"),
    (event_synchronize, "Event.synchronize() at"),
    (event_query, "Event.query() at"),
    (nonzero, "torch.nonzero"),
    (where_one_argument, "torch.nonzero"),
    (masked_select, "torch.masked_select at"),
    (mask_index, "boolean-mask indexing at"),
    (unique, "torch.unique at"),
    (cpu_compute, "computing with a CPU tensor at"),
    (pageable_copy, "a copy from pageable host memory to the GPU at"),
    (number_by_index, "x[index] = number at"),
    (number_by_mask, "x[mask] = number at"),
    (empty_cache, "torch.cuda.empty_cache() at"),
    (raw_cuda_call, "a CUDA call (CUDA error: operation not permitted when stream is capturing)"),
]


def unsafe_line(fn):
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if "# <- unsafe" in line)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("fn, expected", CATALOG, ids=[c[0].__name__ for c in CATALOG])
def test_catalog_entry_falls_back_once_at_the_users_line(fn, expected, mode, caught):
    global EVENT, INDEX
    INDEX = torch.tensor([0, 2], device="cuda")
    EVENT = torch.cuda.Event()
    EVENT.record()
    graphed = autograph.graphed(fn)
    with contextlib.redirect_stdout(io.StringIO()), mode():
        for _ in range(4):
            x = torch.randn(8, device="cuda")
            assert torch.equal(graphed(x), fn(x))
    messages = autograph_warnings(caught)
    assert len(messages) == 1, messages
    assert expected in messages[0]
    assert f"test_guard_cuda.py:{unsafe_line(fn)}" in messages[0]
    (row,) = graphed.stats()
    assert row.state == "eager" and row.fallback_reason in messages[0]
    assert not torch.cuda.is_current_stream_capturing()
    torch.randn(2, device="cuda")  # the random generator still works


def test_strict_mode_raises_capture_error_with_the_message():
    graphed = autograph.graphed(strict=True)(item)
    x = torch.randn(8, device="cuda")
    assert torch.equal(graphed(x), item(x))  # the warmup runs as written
    with pytest.raises(
        autograph.CaptureError,
        match=r"strict mode raises instead of running it eagerly: \.item\(\) at "
        r"test_guard_cuda",
    ):
        graphed(x)  # the capture finds it


def _memory():
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


def new_generator(x):
    y = x @ x.t()
    big = torch.empty(1 << 24, device="cuda").fill_(1)  # 64 MiB from the graph's pool
    generator = torch.Generator(device="cuda")  # PyTorch refuses this in a capture
    return y + big[:1] + torch.rand(x.shape, device="cuda", generator=generator)


def raw_sync(x):
    y = x @ x.t()
    big = torch.empty(1 << 24, device="cuda").fill_(1)
    RAW_SYNC()  # CUDA invalidates the capture
    return y + big[:1]


@pytest.mark.parametrize(
    "fn, kind",
    [(new_generator, "PyTorch"), (raw_sync, "CUDA")],
    ids=["caught-by-pytorch", "invalidated-in-the-driver"],
)
def test_a_failed_capture_leaves_no_trace(fn, kind, caught):
    x = torch.randn(64, 64, device="cuda")
    graphed = autograph.graphed(fn)
    graphed(x)  # warmup: the guard sees nothing wrong
    before = _memory()
    graphed(x)  # capture fails, the call runs eagerly
    assert graphed.stats()[0].state == "eager"
    assert len(autograph_warnings(caught)) == 1
    assert _memory() == before, "the failed capture's memory was not given back"
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    torch.randn(4, device="cuda")
    torch.nn.functional.dropout(torch.ones(16, device="cuda"), 0.5)

    @autograph.graphed
    def later(x):
        return torch.nn.functional.dropout(x @ x, 0.1)

    for _ in range(3):
        later(x)
    assert later.stats()[0].state == "graphed"


def test_users_exception_propagates_in_every_phase(caught):
    fail = {"warmup": True}

    @autograph.graphed
    def f(x, phase):
        if fail.get(phase):
            raise ValueError(f"bad input in {phase}")
        if phase == "eager":
            x.sum().item()
        return x * 2

    x = torch.ones(2, device="cuda")
    with pytest.raises(ValueError, match="bad input in warmup") as raised:
        f(x, "warmup")
    assert raised.traceback[-1].name == "f"
    fail.clear()
    f(x, "warmup")
    fail["warmup"] = True
    with pytest.raises(ValueError, match="bad input in warmup"):  # the capture call
        f(x, "warmup")
    fail.clear()
    f(x, "eager")  # warmup: .item() seen, the capture decides
    f(x, "eager")  # capture: the guard stops it at .item()
    fail["eager"] = True
    with pytest.raises(ValueError, match="bad input in eager"):  # an eager fallback call
        f(x, "eager")
    fail.clear()
    for _ in range(2):
        assert torch.equal(f(x, "warmup"), x * 2)
    states = {r.key.split("phase=")[1]: r.state for r in f.stats()}
    assert states == {"'warmup'": "graphed", "'eager'": "eager"}


def test_no_false_positive_on_an_mlp_with_dropout(caught):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[
            layer
            for _ in range(4)
            for layer in (torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Dropout(0.2))
        ]
    ).cuda()
    graphed = autograph.graphed(model)
    with torch.no_grad():
        outs = [graphed(torch.ones(4, 64, device="cuda")) for _ in range(5)]
    assert autograph_warnings(caught) == []
    assert graphed.forward.stats()[0].state == "graphed"
    assert len({o.sum().item() for o in outs}) == 5  # fresh dropout masks per call
