"""The guard's detection on CPU tensors (the CPU emulation graphs "cpu" work)."""

import numpy as np
import pytest
import torch

import autograph
from autograph.watch._guard import Finding, GuardError, UnsafeOpDetector, classify_capture_error

from conftest import autograph_warnings, states


def observe(fn, *args):
    with UnsafeOpDetector("cpu", raise_on_unsafe=False) as detector:
        fn(*args)
    return detector.finding


def item(x):
    return x.sum().item()


def condition(x):
    if x.sum() > 0:
        return x
    return -x


def as_bool(x):
    return bool(x.any())


def nonzero(x):
    return torch.nonzero(x)


def one_argument_where(x):
    return torch.where(x > 0)


def masked_select(x):
    return torch.masked_select(x, x > 0)


def mask_index(x):
    return x[x > 0]


def mask_assign(x):
    x[x > 0] = 0
    return x


def unique(x):
    return torch.unique(x)


def equal(x):
    return torch.equal(x, x)


UNSAFE = [
    (item, ".item()", "synchronises with the host"),
    (condition, "a tensor used as a Python condition", "synchronises"),
    (as_bool, "bool(tensor)", "synchronises"),
    (nonzero, "torch.nonzero", "depends on the data"),
    (one_argument_where, "torch.nonzero", "depends on the data"),
    (masked_select, "torch.masked_select", "depends on the data"),
    (mask_index, "boolean-mask indexing", "depends on the data"),
    (mask_assign, "boolean-mask assignment", "depends on the data"),
    (unique, "torch.unique", "depends on the data"),
    (equal, "reading a tensor's value in Python", "synchronises"),
]


@pytest.mark.parametrize("fn, operation, consequence", UNSAFE, ids=[u[0].__name__ for u in UNSAFE])
def test_unsafe_operation_is_found_at_the_users_line(fn, operation, consequence):
    finding = observe(fn, torch.randn(8))
    assert finding is not None
    assert finding.operation.startswith(operation)
    assert consequence in finding.consequence
    line = fn.__code__.co_firstlineno + 1
    assert finding.location in (f"test_guard.py:{line}", f"test_guard.py:{line + 1}")


def graph_safe(x):
    idx = torch.tensor([0, 2])
    y = x[idx] + x[1:3] * 2  # integer and slice indexing
    y = torch.where(y > 0, y, -y)  # three-argument where
    y = torch.nn.functional.dropout(y, 0.5)  # RNG
    cache = torch.zeros(4, 2)
    cache.index_copy_(0, torch.tensor([1]), y[None])  # KV-cache style write
    return torch.repeat_interleave(y, 2, output_size=4), cache @ torch.ones(2, 2)


def test_graph_safe_code_is_not_flagged():
    assert observe(graph_safe, torch.randn(8)) is None


def test_raise_mode_stops_at_the_first_unsafe_operation():
    with pytest.raises(GuardError, match=r"\.item\(\) at test_guard.py:\d+"):
        with UnsafeOpDetector("cpu", raise_on_unsafe=True):
            item(torch.ones(2))


def test_synchronize_and_stream_waits_are_caught_and_patches_removed():
    originals = (
        torch.cuda.synchronize,
        torch.cuda.Stream.synchronize,
        torch.cuda.Event.synchronize,
        torch.cuda.Event.query,
    )
    for call, name in [
        (lambda: torch.cuda.synchronize(), "torch.cuda.synchronize()"),
        (lambda: torch.cuda.Event.query(None), "Event.query()"),
        (lambda: torch.cuda.Stream.synchronize(None), "Stream.synchronize()"),
    ]:
        with pytest.raises(GuardError, match=name.replace("(", r"\(").replace(")", r"\)")):
            with UnsafeOpDetector("cpu", raise_on_unsafe=True):
                call()
    assert originals == (
        torch.cuda.synchronize,
        torch.cuda.Stream.synchronize,
        torch.cuda.Event.synchronize,
        torch.cuda.Event.query,
    )


def test_other_threads_and_cpu_constants_are_not_watched():
    import threading

    results = []
    with UnsafeOpDetector("cuda", raise_on_unsafe=True):
        results.append(torch.tensor([2.0]))  # a constant is not computing on the CPU
        worker = threading.Thread(
            target=lambda: results.append(observe_free(lambda: torch.ones(1).add(1).item()))
        )
        worker.start()
        worker.join()
    assert results[1:] == [2.0]


def test_computing_on_the_cpu_is_flagged_when_graphing_the_gpu():
    with pytest.raises(GuardError, match="computing with a CPU tensor at test_guard.py"):
        with UnsafeOpDetector("cuda", raise_on_unsafe=True):
            torch.arange(4) * 2


def test_python_numbers_made_into_cpu_scalars_are_not_cpu_work():
    # x * torch.tensor(scale) on CUDA went eager with "computing with a CPU tensor": the
    # graph freezes the number, as it freezes a Python number, which the key covers.
    counter = torch.zeros(())  # CPU state made before the run: its value is not Python's
    with UnsafeOpDetector("cuda", raise_on_unsafe=True) as detector:
        scale = torch.tensor(2.0)
        root = scale.sqrt()  # computed from numbers alone: a number too
        assert (scale * 3).item() == 6.0 and float(root) == pytest.approx(2**0.5)
        assert root in detector.constants and counter not in detector.constants
        with pytest.raises(GuardError, match="computing with a CPU tensor"):
            counter * root
        drawn = torch.bernoulli(torch.tensor(0.5))  # a draw, which a graph would freeze
        with pytest.raises(GuardError, match="computing with a CPU tensor"):
            drawn * 1
    with pytest.raises(GuardError, match="a copy from pageable host memory"):
        with UnsafeOpDetector("cuda", raise_on_unsafe=True):
            torch.ops.aten._to_copy.default(torch.tensor([2.0]), device=torch.device("cuda"))


def _not_numbers():
    """CPU scalars that hold no Python number of the run's: a numpy array's memory (the
    caller's), and a number that state was written into through a view."""
    array, state = np.array(5.0), torch.tensor(5.0)

    def written_through_a_view():
        number = torch.tensor(0.0)
        number.view(1).copy_(state.view(1))
        return number

    return [
        lambda: torch.as_tensor(array),
        lambda: torch.from_numpy(array),
        lambda: torch.tensor(array),
        lambda: torch.as_tensor(state.numpy()),
        written_through_a_view,
        lambda: torch.tensor(0.0).detach().copy_(state),
    ]


@pytest.mark.parametrize("index", range(6))
def test_cpu_scalars_of_the_callers_memory_or_state_are_cpu_work(index):
    x = torch.ones(3, device="meta")  # stands for a GPU tensor
    with UnsafeOpDetector("meta", raise_on_unsafe=False) as detector:
        x * _not_numbers()[index]()
    assert detector.finding is not None
    assert detector.finding.operation == "computing with a CPU tensor"


def test_a_numpy_scalar_the_caller_changes_is_read_again(device, caught):
    array = np.array(5.0)

    @autograph.graphed
    def scaled(x):
        return x * (torch.from_numpy(array) * 1).item()

    x = torch.ones(2, device=device)
    for value in (5.0, 6.0, 7.0, 8.0, 9.0):
        array[...] = value
        torch.testing.assert_close(scaled(x), x * value)
    assert states(scaled)[0][0] == "eager"  # CPU work on the caller's memory, read back
    reason = "computing with a CPU tensor" if device == "cuda" else ".item()"
    assert any(reason in m for m in autograph_warnings(caught)), autograph_warnings(caught)


def observe_free(fn):
    return fn()


def test_pageable_copy_to_the_device_is_flagged():
    from autograph.watch._unsafe_ops import unsafe_op

    x = torch.ones(3)
    op = torch.ops.aten._to_copy.default
    assert unsafe_op(op, (x,), {"device": torch.device("cuda")}, "cuda")[0].startswith(
        "a copy from pageable host memory"
    )
    assert unsafe_op(op, (x,), {"dtype": torch.float16}, "cuda") is None


@pytest.mark.parametrize(
    "message, expected",
    [
        (
            "CUDA error: operation not permitted when stream is capturing",
            "made a CUDA call that stream capture does not allow",
        ),
        (
            "CUDA error: operation failed due to a previous error during capture",
            "invalidated the capture",
        ),
        ("called a synchronizing CUDA operation", "synchronises with the host"),
        (
            "Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU "
            "tensor is pinned.",
            "pageable host memory",
        ),
    ],
)
def test_capture_errors_are_classified(message, expected):
    finding = classify_capture_error(RuntimeError(message))
    assert isinstance(finding, Finding) and expected in finding.consequence


def test_users_own_errors_are_not_capture_errors():
    assert classify_capture_error(ValueError("bad shape")) is None
    assert classify_capture_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None


def test_the_detector_notes_ops_that_need_a_cudnn_handle():
    with UnsafeOpDetector("cpu", raise_on_unsafe=False) as detector:
        torch.relu(torch.ones(2))
    assert not detector.uses_cudnn
    with UnsafeOpDetector("cpu", raise_on_unsafe=False) as detector:
        torch.nn.functional.conv1d(torch.ones(1, 1, 8), torch.ones(1, 1, 3))
    assert detector.uses_cudnn
