"""One dispatch mode for every watcher (``_modes.OpWatch``), and the watched warmup without the
guard (``_guard.LibraryUse``).

Without the guard in the warmup nothing takes composite ops apart there, so under
``torch.inference_mode`` every observer of the warmup (``UndoWrites`` in ``capture()``,
``LibraryUse``, ``CallWatch``) sees ``aten.batch_norm`` and ``aten.instance_norm`` whole. Their
schemas do not mark the running statistics as written, and ``instance_norm``'s name does not say
cuDNN. Each failed before its fix (composite norms in ``_reads._UPDATES_RUNNING_STATS`` and
``_unsafe_ops._CUDNN_OPS``); the others guard fragile points that held.
"""

import threading

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import autograph
from autograph.watch._guard import LibraryUse, UnsafeOpDetector

from conftest import states
from helpers.modes import modes_on_the_stack


def lives_of(fn):
    return list(fn._self_engine.cache.entries.values())


# ---- capture() takes its warmups' writes back (UndoWrites) -------------------------------


def running_stats(module):
    return [
        module.running_mean.clone(),
        module.running_var.clone(),
        module.num_batches_tracked.clone(),
    ]


NORMS = {
    "BatchNorm1d": lambda: torch.nn.BatchNorm1d(4),
    "InstanceNorm1d": lambda: torch.nn.InstanceNorm1d(4, track_running_stats=True),
}


def _capture_ahead_keeps_running_stats(device, norm, inference):
    module = NORMS[norm]().to(device).train()
    before = running_stats(module)
    graphed = autograph.graphed(module)
    x = torch.randn(3, 4, 5, device=device) + 3
    with torch.inference_mode(inference), torch.no_grad():
        graphed.forward.capture(x)
    assert states(graphed) == [("graphed", 0, 0, 0)]
    for kept, now in zip(before, running_stats(module)):
        torch.testing.assert_close(now, kept, rtol=0, atol=0)


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_capture_ahead_under_no_grad_takes_back_running_stats(device, norm):
    _capture_ahead_keeps_running_stats(device, norm, inference=False)


# Regression of 348c09f (held at 4099a33 with the default warmup=1): the watched warmup ran the
# guard, which took aten.batch_norm apart under inference_mode, and UndoWrites (PARTS) saw the
# part native_batch_norm, whose running stats _reads.written_tensors knows are written in
# training. Now the warmup runs LibraryUse and CallWatch only: UndoWrites sees aten.batch_norm
# (or aten.instance_norm) whole, whose schema marks nothing written, and the running stats
# keep the warmup's update after capture(). With warmup >= 2 the earlier, unwatched warmups
# had the same hole before (they ran under UndoWrites alone).
@pytest.mark.parametrize("norm", sorted(NORMS))
def test_capture_ahead_under_inference_mode_takes_back_running_stats(device, norm):
    _capture_ahead_keeps_running_stats(device, norm, inference=True)


idx = [0, 2]
COMPOSITE_WRITES = {
    "index_copy_": lambda s, i: s.index_copy_(0, i, torch.ones(2, 4, device=s.device)),
    "index_fill_": lambda s, i: s.index_fill_(1, i, -1.0),
    "masked_fill_": lambda s, i: s.masked_fill_(s > 5, 0.0),
    # A tensor made on the device: with a Python number, index_put_ copies it from the host,
    # which a CUDA capture refuses (the guard makes that key eager: test_guard_cuda.py).
    "x[idx] = v": lambda s, i: s.__setitem__(i, s.new_full((), 7.0)),
    "matmul(out=)": lambda s, i: torch.matmul(
        torch.ones(3, 2, device=s.device), torch.ones(2, 4, device=s.device), out=s
    ),
    "copy_ through a view": lambda s, i: s.t()[1:3].copy_(torch.zeros(2, 3, device=s.device)),
    "fill_diagonal_": lambda s, i: s.fill_diagonal_(5.0),
    "index_put_ accumulate": lambda s, i: s.index_put_(
        (i,), torch.ones(2, 4, device=s.device), accumulate=True
    ),
}


@pytest.mark.parametrize("write", sorted(COMPOSITE_WRITES))
def test_capture_ahead_under_inference_mode_takes_back_composite_writes(device, write):
    state = torch.arange(12.0, device=device).reshape(3, 4)
    kept = state.clone()
    index = torch.tensor(idx, device=device)

    @autograph.graphed
    def step(x):
        COMPOSITE_WRITES[write](state, index)
        return x * 2

    with torch.inference_mode():
        step.capture(torch.ones(3, device=device))
        assert states(step) == [("graphed", 0, 0, 0)]
        torch.testing.assert_close(state, kept, rtol=0, atol=0)
        # The first real call replays and writes, as eager would.
        step(torch.ones(3, device=device))
    assert states(step) == [("graphed", 1, 0, 1)]
    expected = kept.clone()
    COMPOSITE_WRITES[write](expected, index)
    torch.testing.assert_close(state, expected, rtol=0, atol=0)


# ---- what the warmup notes for the capture (LibraryUse) ----------------------------------


def instance_norm(x):
    return F.instance_norm(
        x, weight=torch.ones(3, device=x.device), bias=torch.zeros(3, device=x.device)
    )


def test_the_warmup_notes_cudnn_as_the_guard_does_without_inference_mode():
    x = torch.randn(2, 3, 4, 4)
    with LibraryUse() as uses:
        instance_norm(x)
    assert uses.uses_cudnn


# Regression of 348c09f: the guard took aten.instance_norm apart under inference_mode and saw
# its part aten.batch_norm ("batch_norm" names a cuDNN op); LibraryUse sees instance_norm whole
# and notes no cuDNN. A key whose capture runs on another thread than its warmup then makes no
# cuDNN handle before it (_key_life._record), and creating one inside a capture fails
# (_cuda_graphs.make_library_handles): on CUDA the capture fails and the key runs eagerly with
# a capture error for a reason. The same holds on CUDA for grid_sample / affine_grid
# (cudnn_grid_sampler, cudnn_affine_grid_generator) and ctc_loss (_cudnn_ctc_loss), whose
# CPU parts name no cuDNN op.
def test_the_warmup_notes_cudnn_under_inference_mode(device):
    @autograph.graphed
    def step(x):
        return instance_norm(x) * 2

    with torch.inference_mode():
        x = torch.randn(2, 3, 4, 4, device=device)
        with UnsafeOpDetector(device, raise_on_unsafe=False) as guard:
            instance_norm(x)
        assert guard.uses_cudnn  # what the warmup noted before 348c09f
        step(x)
    assert states(step) == [("warmup", 1, 1, 0)]  # watched: the next call captures
    (life,) = lives_of(step)
    assert life.uses_cudnn


# ---- running stats passed as arguments, and verify, under inference_mode ------------------


# Not a regression (4099a33 did the same), found here: the read/write watch (CallWatch, WHOLE)
# sees aten.batch_norm whole under inference_mode, and _reads.written_tensors knows the running
# stats are written only for native_batch_norm / cudnn_batch_norm / miopen_batch_norm. The
# arguments rm, rv are not noted as written, so a replay updates the graph's static copies and
# never copies them back: the caller's running stats stay at the warmup's value, silently.
def test_running_stats_passed_as_arguments_are_updated_by_every_call(device):
    @autograph.graphed
    def step(x, running_mean, running_var):
        return F.batch_norm(x, running_mean, running_var, training=True)

    rm, rv = torch.zeros(4, device=device), torch.ones(4, device=device)
    expected_rm, expected_rv = rm.clone(), rv.clone()
    torch.manual_seed(0)
    with torch.inference_mode():
        for _ in range(3):
            x = torch.randn(2, 4, 3, device=device) + 5
            torch.testing.assert_close(
                step(x, rm, rv), F.batch_norm(x, expected_rm, expected_rv, training=True)
            )
    assert states(step) == [("graphed", 3, 1, 2)]
    torch.testing.assert_close(rm, expected_rm)
    torch.testing.assert_close(rv, expected_rv)


# Not a regression (EagerRun never ran under the guard), found here: verify's eager run
# (_verify.EagerRun, an UndoWrites) sees aten.batch_norm whole under inference_mode and does
# not save the running stats, so take_back() leaves the eager run's update and the replay
# applies it again: each verified call updates the running stats twice, and the comparison
# (which checks the storages it saved) does not see it.
def test_verify_takes_back_its_eager_run_of_a_batch_norm_in_training(device):
    module = torch.nn.BatchNorm1d(4).to(device).train()
    reference = torch.nn.BatchNorm1d(4).to(device).train()
    graphed = autograph.graphed(module, verify=2)
    torch.manual_seed(0)
    with torch.inference_mode():
        for _ in range(3):
            x = torch.randn(2, 4, 3, device=device) + 5
            torch.testing.assert_close(graphed(x), reference(x))
    assert states(graphed) == [("graphed", 3, 1, 2)]
    torch.testing.assert_close(module.running_mean, reference.running_mean)
    torch.testing.assert_close(module.running_var, reference.running_var)


# ---- nesting: other modes inside, errors inside a split op, threads -----------------------


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("inference", [False, True])
@pytest.mark.parametrize("inner", ["own mode", "FlopCounterMode"])
def test_a_mode_the_function_enters_itself_leaves_graphs_and_the_stack_alone(
    device, inner, inference
):
    w = torch.randn(4, 4, device=device)

    def reference(x):
        return F.linear(torch.relu(x @ w), w) + 1

    @autograph.graphed
    def step(x):
        with CountOps() if inner == "own mode" else FlopCounterMode(display=False):
            return reference(x)

    with torch.inference_mode(inference):
        for i in range(4):
            x = torch.full((3, 4), float(i), device=device)
            torch.testing.assert_close(step(x), reference(x))
            assert modes_on_the_stack() == 0
    assert states(step) == [("graphed", 4, 1, 3)]


def test_an_error_inside_a_composite_op_at_capture_leaves_no_mode_behind(device):
    w = torch.randn(4, 4, device=device)

    def run_count():
        run_count.n += 1
        return run_count.n

    run_count.n = 0

    @autograph.graphed
    def step(x):
        y = x @ w
        if run_count() == 2:  # the capture: matmul is composite, its part mm raises
            torch.matmul(y, torch.ones(3, 3, device=device))
        return F.linear(y, w)

    with torch.inference_mode():
        x = torch.ones(3, 4, device=device)
        step(x)
        with pytest.raises(RuntimeError, match="cannot be multiplied"):
            step(x)
        assert modes_on_the_stack() == 0
        for _ in range(3):
            torch.testing.assert_close(step(x), F.linear(x @ w, w))
    assert modes_on_the_stack() == 0
    assert states(step) == [("graphed", 5, 1, 3)]


def test_threads_each_keep_their_own_watch(device):
    w = torch.randn(4, 4, device=device)
    results = {}
    start = threading.Barrier(4)

    def serve(k):
        @autograph.graphed
        def step(x):
            return F.gelu(F.linear(x, w)) * k

        start.wait()
        wrong = 0
        with torch.inference_mode():
            for i in range(30):
                x = torch.full((2, 4), float(i % 3), device=device)
                wrong += not torch.allclose(step(x), F.gelu(F.linear(x, w)) * k)
        results[k] = (wrong, states(step), modes_on_the_stack())

    threads = [threading.Thread(target=serve, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {k: (0, [("graphed", 30, 1, 29)], 0) for k in range(4)}
