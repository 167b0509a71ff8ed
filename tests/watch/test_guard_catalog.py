"""The guard's newer catalog entries, tested on the guard alone: reseeding a random generator,
an optimizer that cannot be captured, and host reads under ``torch.inference_mode()``.

Each catalog function holds its unsafe call on the line after its ``def``.
"""

import os
import sys
import threading
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import autograph
from autograph.backends._cuda_graphs import CUDA
from autograph.watch._guard import (
    GuardError,
    UnsafeOpDetector,
    classify_capture_error,
    host_read_fix,
    optimizer_running,
)

from conftest import requires_cuda

MODES = [torch.no_grad, torch.inference_mode]


def observe(fn, *args, device_type="cpu"):
    with UnsafeOpDetector(device_type, raise_on_unsafe=False) as detector:
        fn(*args)
    return detector.finding


def unsafe_line(fn):
    return f"test_guard_catalog.py:{fn.__code__.co_firstlineno + 1}"


@pytest.fixture(autouse=True)
def _restore_random_state():
    """Seeding tests really reseed (with raise_on_unsafe=False the call runs as written)."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    yield
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def cuda_state():
    """A CUDA generator state; without CUDA, torch.cuda's setters only queue their call."""
    return (
        torch.cuda.get_rng_state()
        if torch.cuda.is_available()
        else torch.zeros(16, dtype=torch.uint8)
    )


# --- reseeding ---------------------------------------------------------------------------


def manual_seed():
    torch.manual_seed(1)


def seed():
    torch.seed()


def set_rng_state(state):
    torch.set_rng_state(state)


def random_manual_seed():
    torch.random.manual_seed(1)


def random_seed():
    torch.random.seed()


def random_set_rng_state(state):
    torch.random.set_rng_state(state)


def cuda_manual_seed():
    torch.cuda.manual_seed(1)


def cuda_manual_seed_all():
    torch.cuda.manual_seed_all(1)


def cuda_seed():
    torch.cuda.seed()


def cuda_seed_all():
    torch.cuda.seed_all()


def cuda_set_rng_state():
    torch.cuda.set_rng_state(cuda_state())


def cuda_set_rng_state_all():
    torch.cuda.set_rng_state_all([cuda_state()])


def fork_rng():
    with torch.random.fork_rng(devices=[]):
        return torch.rand(2)


RESEEDS = "reseeds the random generator, which a graph does only at capture"
SETS_STATE = "sets the random generator's state, which a graph does only at capture"
SEEDING = [
    (manual_seed, "torch.manual_seed()", RESEEDS),
    (seed, "torch.seed()", RESEEDS),
    (set_rng_state, "torch.set_rng_state()", SETS_STATE),
    (random_manual_seed, "torch.random.manual_seed()", RESEEDS),
    (random_seed, "torch.random.seed()", RESEEDS),
    (random_set_rng_state, "torch.random.set_rng_state()", SETS_STATE),
    (cuda_manual_seed, "torch.cuda.manual_seed()", RESEEDS),
    (cuda_manual_seed_all, "torch.cuda.manual_seed_all()", RESEEDS),
    (cuda_seed, "torch.cuda.seed()", RESEEDS),
    (cuda_seed_all, "torch.cuda.seed_all()", RESEEDS),
    (cuda_set_rng_state, "torch.cuda.set_rng_state()", SETS_STATE),
    (cuda_set_rng_state_all, "torch.cuda.set_rng_state_all()", SETS_STATE),
    (fork_rng, "torch.random.fork_rng()", "restores the random generator's state on exit"),
]
SEEDING_IDS = [s[0].__name__ for s in SEEDING]


def seeding_args(fn):
    return (torch.get_rng_state(),) if fn in (set_rng_state, random_set_rng_state) else ()


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("fn, operation, consequence", SEEDING, ids=SEEDING_IDS)
def test_seeding_is_found_once_at_the_users_line(fn, operation, consequence, device_type):
    finding = observe(fn, *seeding_args(fn), device_type=device_type)
    assert finding is not None
    assert finding.operation == operation  # the outermost call, not torch's inner ones
    assert finding.consequence.startswith(consequence)
    assert finding.location == unsafe_line(fn)


@pytest.mark.parametrize("fn, operation, consequence", SEEDING, ids=SEEDING_IDS)
def test_seeding_stops_a_capture_before_it_reseeds(fn, operation, consequence):
    before = torch.get_rng_state()
    with pytest.raises(GuardError) as raised:
        with UnsafeOpDetector("cpu", raise_on_unsafe=True):
            fn(*seeding_args(fn))
    assert raised.value.finding.message().startswith(f"{operation} at {unsafe_line(fn)} ")
    assert torch.equal(torch.get_rng_state(), before)


def draws(x, generator):
    y = x + torch.rand(4) + torch.randn_like(x) + torch.randint(0, 5, (4,))
    y = y + torch.rand(4, generator=generator) + torch.empty(4).normal_() + torch.bernoulli(x)
    return torch.nn.functional.dropout(y, 0.5), torch.randperm(4), torch.multinomial(x, 2)


def test_drawing_random_numbers_is_not_flagged():
    for mode in MODES:
        with mode():
            assert observe(draws, torch.rand(4), torch.Generator()) is None


SEEDING_ATTRIBUTES = [
    (torch, "manual_seed"),
    (torch, "seed"),
    (torch, "set_rng_state"),
    (torch.random, "manual_seed"),
    (torch.random, "seed"),
    (torch.random, "set_rng_state"),
    (torch.random, "fork_rng"),
    (torch.cuda, "manual_seed"),
    (torch.cuda, "manual_seed_all"),
    (torch.cuda, "seed"),
    (torch.cuda, "seed_all"),
    (torch.cuda, "set_rng_state"),
    (torch.cuda, "set_rng_state_all"),
]


def test_patches_are_removed_after_the_detector_exits():
    originals = [getattr(owner, name) for owner, name in SEEDING_ATTRIBUTES]
    original = torch.manual_seed
    with UnsafeOpDetector("cpu", raise_on_unsafe=False):
        assert torch.manual_seed is not original
        with UnsafeOpDetector("cpu", raise_on_unsafe=False):  # nested: still patched after
            pass
        assert torch.manual_seed is not original
    assert torch.manual_seed is original
    with pytest.raises(GuardError):
        with UnsafeOpDetector("cpu", raise_on_unsafe=True):
            manual_seed()
    assert torch.manual_seed is original
    assert [getattr(owner, name) for owner, name in SEEDING_ATTRIBUTES] == originals


def test_another_threads_seeding_is_not_reported():
    seen = []

    def reseed():
        torch.manual_seed(5)
        seen.append(torch.initial_seed())

    with UnsafeOpDetector("cpu", raise_on_unsafe=True) as detector:
        worker = threading.Thread(target=reseed)
        worker.start()
        worker.join()
    assert detector.finding is None and seen == [5]  # the worker's call ran, unreported

    original, findings = torch.manual_seed, []
    entered, seeded = threading.Event(), threading.Event()

    def watch():
        with UnsafeOpDetector("cpu", raise_on_unsafe=True) as watching:
            entered.set()
            seeded.wait(10)
        findings.append(watching.finding)

    worker = threading.Thread(target=watch)
    worker.start()
    assert entered.wait(10)
    assert torch.manual_seed is not original  # patched by the worker's detector
    torch.manual_seed(6)
    seeded.set()
    worker.join()
    assert findings == [None] and torch.initial_seed() == 6


# --- errors that slip past the guard -----------------------------------------------------


def outside_user_code(error):
    """A callable that raises ``error`` from a frame that is not the user's, as C++ would."""
    namespace = {}
    source = "def raise_(*args, **kwargs):\n    raise ERROR\n"
    filename = os.path.join(os.path.dirname(torch.__file__), "_guard_test_stand_in.py")
    exec(compile(source, filename, "exec"), {"ERROR": error}, namespace)
    return namespace["raise_"]


def error_of(fn, *args):
    try:
        fn(*args)
    except Exception as error:  # noqa: B902 - the error under test
        return error
    raise AssertionError("no error")


SEED_ERROR = (
    "CUDAGeneratorImpl::set_current_seed can be called during stream capture only "
    "if new seed is the same as the original seed."
)
NEW_SEED_ERROR = (
    "Cannot call CUDAGeneratorImpl::seed during CUDA graph capture. If you need "
    "this call to be captured, please file an issue. Current "
    "cudaStreamCaptureStatus: cudaStreamCaptureStatusActive"
)
NOT_PERMITTED = (
    "CUDA error: operation not permitted when stream is capturing\nCUDA kernel "
    "errors might be asynchronously reported at some other API call"
)


def generator_reseed(generator):
    generator.manual_seed(7)


def generator_new_seed(generator):
    generator.seed()


def test_a_generators_reseed_during_capture_is_classified():
    generator = types.SimpleNamespace(
        manual_seed=outside_user_code(RuntimeError(SEED_ERROR)),
        seed=outside_user_code(RuntimeError(NEW_SEED_ERROR)),
    )
    finding = classify_capture_error(error_of(generator_reseed, generator))
    assert finding.message().startswith(
        f"generator.manual_seed() at {unsafe_line(generator_reseed)} {RESEEDS}"
    )
    finding = classify_capture_error(error_of(generator_new_seed, generator))
    assert finding.message().startswith(
        f"generator.seed() at {unsafe_line(generator_new_seed)} {RESEEDS}"
    )
    bare = classify_capture_error(RuntimeError(SEED_ERROR))
    assert bare.operation == "reseeding a random generator" and bare.consequence.startswith(RESEEDS)


def host_condition(read):
    if read() > 0:
        return 1
    return 0


def host_item(x):
    return x.item()


def host_bool(read):
    return bool(read())


def host_int(read):
    return int(read())


@pytest.mark.parametrize(
    "fn, operation",
    [
        (host_condition, "a tensor used as a Python condition"),
        (host_bool, "bool(tensor)"),
        (host_int, "int(tensor)"),
        (host_item, ".item()"),
    ],
)
def test_a_host_read_that_cuda_rejected_is_named_from_the_users_line(fn, operation):
    raising = outside_user_code(RuntimeError(NOT_PERMITTED))
    argument = types.SimpleNamespace(item=raising) if fn is host_item else raising
    finding = classify_capture_error(error_of(fn, argument))
    assert finding.operation == operation and finding.location == unsafe_line(fn)
    assert finding.consequence.startswith("synchronises with the host: CUDA stopped")


def not_a_host_read(call):
    call()


def test_other_not_permitted_errors_keep_quoting_cuda():
    finding = classify_capture_error(
        error_of(not_a_host_read, outside_user_code(RuntimeError(NOT_PERMITTED)))
    )
    assert finding.operation.startswith("a CUDA call (CUDA error: operation not permitted")
    assert finding.location == unsafe_line(not_a_host_read)


def optimizer_step(optimizer):
    optimizer.step()


def test_an_optimizer_that_torch_refuses_to_capture_is_named():
    refused = RuntimeError(
        "Attempting CUDA graph capture of step() for an instance of AdamW "
        "but param_groups' capturable is False."
    )
    optimizer = types.SimpleNamespace(step=outside_user_code(refused))
    finding = classify_capture_error(error_of(optimizer_step, optimizer))
    assert finding.message() == (
        f"AdamW.step() with capturable=False at {unsafe_line(optimizer_step)} cannot be "
        "captured: create it with AdamW(..., capturable=True)"
    )
    # Where CUDA is present, torch refuses the emulation's capture the same way.
    emulated = classify_capture_error(error_of(optimizer_step, optimizer), "cpu")
    assert emulated.consequence == (
        "cannot be captured: on CUDA, create it with AdamW(..., capturable=True); in the CPU "
        "emulation, step it outside the graphed function"
    )


def test_other_capture_errors_still_classified():
    offset = classify_capture_error(RuntimeError("Offset increment outside graph capture"))
    assert offset.consequence == "left the CUDA random generator unusable"
    assert classify_capture_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None


# --- host reads under inference_mode -----------------------------------------------------


def condition(t):
    if t:
        return 1
    return 0


def as_bool(t):
    return bool(t)


def item(t):
    return t.item()


def as_int(t):
    return int(t)


def as_float(t):
    return float(t)


def loop_condition(t):
    while t:
        t = t - 1


HOST_READS = [
    (condition, "a tensor used as a Python condition"),
    (as_bool, "bool(tensor)"),
    (item, ".item()"),
    (as_int, "int(tensor)"),
    (as_float, "float(tensor)"),
    (loop_condition, "a tensor used as a Python condition"),
]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.__name__)
@pytest.mark.parametrize("fn, operation", HOST_READS, ids=[h[0].__name__ for h in HOST_READS])
def test_host_reads_are_named_the_same_under_inference_mode(fn, operation, mode):
    with mode():
        t = torch.ones(())
        finding = observe(fn, t)
        with pytest.raises(GuardError) as raised:
            with UnsafeOpDetector("cpu", raise_on_unsafe=True):
                fn(t)
    assert finding is not None
    assert finding.message() == (
        f"{operation} at {unsafe_line(fn)} synchronises with the host, "
        f"and {host_read_fix(operation)}"
    )
    assert raised.value.finding == finding


def one_argument_where(x):
    return torch.where(x > 0)


def argwhere(x):
    return torch.argwhere(x)


def to_host(x):
    return x.cpu()


def to_host_by_name(x):
    return x.to("cpu")


def pageable_to_device(x):
    return torch.ones(3).to(x.device) + x


# "meta" stands in for the GPU: the guard raises before the copy, which meta cannot make.
COMPOSITES = [
    (one_argument_where, "cpu", "torch.nonzero (or one-argument torch.where) at"),
    (argwhere, "cpu", "torch.nonzero (or one-argument torch.where) at"),
    (to_host, "meta", ".cpu() / .tolist() / .to('cpu') at"),
    (to_host_by_name, "meta", ".cpu() / .tolist() / .to('cpu') at"),
    (pageable_to_device, "meta", "a copy from pageable host memory to the GPU at"),
]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.__name__)
@pytest.mark.parametrize(
    "fn, device_type, operation", COMPOSITES, ids=[c[0].__name__ for c in COMPOSITES]
)
def test_composite_ops_are_seen_the_same_under_inference_mode(fn, device_type, operation, mode):
    with mode():
        x = torch.randn(3, device=device_type)
        with pytest.raises(GuardError) as raised:
            with UnsafeOpDetector(device_type, raise_on_unsafe=True):
                fn(x)
    assert raised.value.finding.message().startswith(f"{operation} {unsafe_line(fn)} ")


def composite_heavy(x, w):
    y = torch.nn.functional.linear(x, w).reshape(4, -1).flatten()
    y = torch.nn.functional.layer_norm(y, y.shape) @ torch.ones(y.shape[0])
    z = torch.softmax(x @ w.t(), -1).to(torch.float64).float()
    return torch.where(z > 0.1, z, 0.0), y, x.chunk(2, 0), torch.flatten(x).sum(0)


def test_seeing_composite_parts_changes_no_result():
    x, w = torch.randn(4, 3), torch.randn(5, 3)
    with torch.inference_mode():
        expected = composite_heavy(x, w)
        with UnsafeOpDetector("cpu", raise_on_unsafe=True) as detector:
            seen = composite_heavy(x, w)
        assert detector.finding is None
        with UnsafeOpDetector("cpu", raise_on_unsafe=False) as detector:
            torch.nn.functional.conv1d(torch.ones(1, 1, 8), torch.ones(1, 1, 3))
        assert detector.uses_cudnn
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves(expected), tree_leaves(seen)))


# --- optimizers --------------------------------------------------------------------------


def op_frames(fn, *args):
    """The frames a dispatch mode is handed for the ATen ops of ``fn(*args)``, as the guard."""
    frames = []

    class Frames(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            frames.append(sys._getframe(1))
            return func(*args, **(kwargs or {}))

    with Frames():
        fn(*args)
    return frames


def make_optimizer(cls, device="cpu", **options):
    parameter = torch.nn.Parameter(torch.ones(3, device=device))
    parameter.grad = torch.ones(3, device=device)
    return cls([parameter], lr=0.1, **options)


@pytest.mark.parametrize("options", [{}, {"foreach": True}], ids=["single", "foreach"])
def test_the_optimizer_is_named_from_an_op_inside_its_step(options):
    optimizer = make_optimizer(torch.optim.Adam, **options)
    frames = op_frames(optimizer.step)
    assert frames and all(optimizer_running(frame) is optimizer for frame in frames)
    outside = op_frames(torch.nn.functional.layer_norm, torch.ones(2, 3), (3,))
    assert outside and not any(optimizer_running(frame) for frame in outside)
    assert optimizer_running(sys._getframe()) is None
    assert optimizer_running(None) is None


# "meta" parameters stand in for GPU ones: the step counter is a real CPU tensor.
@pytest.mark.parametrize(
    "cls",
    [torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.NAdam],
    ids=lambda c: c.__name__,
)
@pytest.mark.parametrize(
    "options", [{}, {"foreach": False}, {"foreach": True}], ids=["default", "single", "foreach"]
)
def test_a_step_count_on_the_cpu_names_the_optimizer(cls, options):
    optimizer = make_optimizer(cls, "meta", **options)
    finding = observe(optimizer_step, optimizer, device_type="meta")
    name = cls.__name__
    assert finding is not None
    assert finding.message() == (
        f"{name}.step() with capturable=False at {unsafe_line(optimizer_step)} keeps its step "
        f"count on the CPU, which a graph freezes at capture: create it with "
        f"{name}(..., capturable=True)"
    )
    with pytest.raises(GuardError, match=rf"{name}\.step\(\) with capturable=False at"):
        with UnsafeOpDetector("meta", raise_on_unsafe=True):
            optimizer_step(optimizer)


@pytest.mark.parametrize(
    "options", [{}, {"foreach": False}, {"foreach": True}], ids=["default", "single", "foreach"]
)
def test_a_whole_step_on_the_emulation_names_capturable(emulated, options):
    # Graphing the CPU, the step count is read with .item(): the reason was a generic host read.
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, capturable=False, **options)

    @autograph.graphed
    def step(x):
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    match = r"on CUDA, create it with AdamW\(\.\.\., capturable=True\); in the CPU emulation"
    with pytest.warns(autograph.AutographWarning, match=match):
        for _ in range(4):
            step(torch.randn(2, 4))
    reasons = [row.fallback_reason for row in step.stats() if " > " not in row.function]
    assert reasons and all("AdamW.step() with capturable=False" in r for r in reasons)


def test_an_optimizer_without_cpu_state_is_not_flagged():
    optimizer = make_optimizer(torch.optim.SGD, "meta", momentum=0.9)
    assert observe(optimizer_step, optimizer, device_type="meta") is None


def cpu_computation_outside_an_optimizer(x):
    return torch.arange(3) * x


def test_a_number_made_a_cpu_scalar_in_the_run_and_read_back_is_not_cpu_work():
    # What torch.compile's compiled code does with a float argument while graphing CUDA.
    assert observe(lambda: torch.tensor(2.0).item(), device_type="cuda") is None
    assert observe(lambda: float(torch.tensor(2.0)), device_type="cuda") is None


def test_a_cpu_scalar_not_made_in_the_run_read_back_is_still_cpu_work():
    step_count = torch.tensor(3.0)  # state: its value changes between calls
    for fn in (lambda: step_count.item(), lambda: torch.zeros(()).item()):
        assert observe(fn, device_type="cuda").operation == "computing with a CPU tensor"
    # Computed from Python numbers alone, it is a Python number too (as 2.0 * 3 would be);
    # written in place, it is a count kept as state (an optimizer's first step).
    computed = lambda: (torch.tensor(2.0) * 3).item()  # noqa: E731
    assert observe(computed, device_type="cuda") is None

    def counted():
        count = torch.tensor(0.0)
        count += 1
        return count.item()

    assert observe(counted, device_type="cuda").operation == "computing with a CPU tensor"


def test_other_cpu_computations_keep_their_name():
    finding = observe(cpu_computation_outside_an_optimizer, 2, device_type="meta")
    assert finding.operation == "computing with a CPU tensor"


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize(
    "options", [{}, {"foreach": True}, {"foreach": False}], ids=["default", "foreach", "single"]
)
def test_an_optimizer_with_its_step_count_on_the_cpu_is_named_on_the_gpu(options):
    optimizer = make_optimizer(torch.optim.AdamW, "cuda", **options)
    optimizer_step(optimizer)
    finding = observe(optimizer_step, optimizer, device_type="cuda")
    assert finding is not None and finding.operation == "AdamW.step() with capturable=False"
    assert finding.location == unsafe_line(optimizer_step)
    assert "create it with AdamW(..., capturable=True)" in finding.consequence
    capturable = make_optimizer(torch.optim.AdamW, "cuda", capturable=True, **options)
    optimizer_step(capturable)
    assert observe(optimizer_step, capturable, device_type="cuda") is None


def capture_error(fn, *args):
    """The exception ``fn`` raises inside a real CUDA graph capture (the engine's backend,
    which cleans up after a capture that CUDA rejected)."""
    capture = CUDA.capture(lambda: fn(*args), 0, CUDA.new_pool(0))
    assert torch.ones(2, device="cuda").sum().item() == 2  # CUDA is healthy after
    return capture.error


def guarded(fn, *args):
    with UnsafeOpDetector("cuda", raise_on_unsafe=True):
        return fn(*args)


@pytest.mark.cuda
@requires_cuda
def test_real_capture_errors_are_named_on_the_gpu():
    fused = make_optimizer(torch.optim.Adam, "cuda", fused=True)
    optimizer_step(fused)
    assert observe(optimizer_step, fused, device_type="cuda") is None  # its step is on the GPU
    finding = classify_capture_error(capture_error(optimizer_step, fused))
    assert finding.message().startswith(
        f"Adam.step() with capturable=False at {unsafe_line(optimizer_step)} cannot be captured"
    )

    generator = torch.Generator("cuda")
    for fn in (generator_reseed, generator_new_seed):
        finding = classify_capture_error(capture_error(fn, generator))
        assert finding.location == unsafe_line(fn) and finding.consequence.startswith(RESEEDS)

    with torch.inference_mode():  # no guard: CUDA itself rejects the read
        finding = classify_capture_error(capture_error(condition, torch.ones((), device="cuda")))
    assert finding.operation == "a tensor used as a Python condition"
    assert finding.location == unsafe_line(condition)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.__name__)
@pytest.mark.parametrize("fn, operation", HOST_READS, ids=[h[0].__name__ for h in HOST_READS])
def test_host_reads_are_named_the_same_under_inference_mode_on_the_gpu(fn, operation, mode):
    with mode():
        error = capture_error(guarded, fn, torch.ones((), device="cuda"))
    assert isinstance(error, GuardError)  # stopped before CUDA saw the read
    assert error.finding.message() == (
        f"{operation} at {unsafe_line(fn)} synchronises with the "
        f"host, and {host_read_fix(operation)}"
    )
