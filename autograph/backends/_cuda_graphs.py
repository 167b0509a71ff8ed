"""The CUDA backend: capture and replay with ``torch.cuda.CUDAGraph``, and the clean-up that
keeps a failed capture harmless.

>>> capture = CUDA.capture(lambda: step(*static_args), device=0, pool=CUDA.new_pool(0))
>>> capture.graph.replay()

One capture stream per device, reused by every capture: a fresh stream per capture would cost
a cuBLAS workspace and allocator segments each time. ``capture_error_mode="thread_local"`` so
other threads' allocations and kernels do not invalidate the capture; one capture at a time in
the process. A capture that CUDA rejects (a "hard" failure) is cleaned up as
measured on torch 2.11 (docs/design.md, "Failed captures"): restore the caller's stream,
end the allocator's routing and release the pool's reference (torch < 2.14 leaks both), and run
one empty capture to reset the default generator (torch < 2.12 leaves it "capturing").
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from typing import Any, Callable, ContextManager, List, Sequence, Set, Union

import torch

from .._config import logger
from ._backend import Capture
from ._collector import collector_paused
from ._streams import on_stream

_capture_lock = threading.RLock()
_streams: dict = {}


def _capture_stream(device: int) -> "torch.cuda.Stream":
    stream = _streams.get(device)
    if stream is None:
        stream = _streams[device] = torch.cuda.Stream(device)
    return stream


def capture_stream(device: Union[int, str, "torch.device", None] = None) -> "torch.cuda.Stream":
    """The stream autograph captures on for one GPU (default: the current one), on which the
    eager calls of training keys run and their backward replays.

    >>> with torch.cuda.stream(autograph.capture_stream()):
    ...     model = torch.nn.parallel.DistributedDataParallel(autograph.graphed(model))

    Autograd accumulates a parameter's gradient on the stream its ``AccumulateGrad`` node was
    made on (torch >= 2.9). DDP makes and keeps those nodes when it is built: built under this
    stream, the graphed backward of the module inside hands it gradients without making the
    default stream wait on a capture, which CUDA refuses.
    """
    if device is None or isinstance(device, int):
        index = torch.cuda.current_device() if device is None else device
    else:
        index = torch.device(device).index
        index = torch.cuda.current_device() if index is None else index
    return _capture_stream(index)


class _HandlesMade(threading.local):
    def __init__(self) -> None:
        self.made: Set[tuple] = set()


_handles_made = _HandlesMade()
# Backward runs in autograd's own thread for the device, one per process: made once.
_backward_handles_made: Set[tuple] = set()


def make_library_handles(device: int, cudnn: bool, *, backward: bool = False) -> None:
    """Create the cuBLAS and cuBLASLt (and, if asked, cuDNN) handles that a capture on
    ``device`` needs: this thread's, or with ``backward`` those of autograd's thread.

    >>> make_library_handles(0, cudnn=False)                 # before a forward capture
    >>> make_library_handles(0, cudnn=True, backward=True)   # before a backward capture

    Handles are per thread, and creating one inside a capture fails
    (CUBLAS_STATUS_NOT_INITIALIZED): the warmup may have run in another thread, and on CUDA a
    backward runs in autograd's thread, on the stream its forward ran on (the capture stream).
    A cuDNN handle costs a noticeable start (a fraction of a second), so only keys whose warmup
    used cuDNN ops ask for it.
    """
    made = _backward_handles_made if backward else _handles_made.made
    wanted = [(device, "cublas")] + ([(device, "cudnn")] if cudnn else [])
    if all(w in made for w in wanted):
        return
    with (
        torch.cuda.device(device),
        on_stream(_capture_stream(device)),
        torch.autograd.set_grad_enabled(backward),
        torch.autocast("cuda", enabled=False),
    ):
        for dtype in (torch.float32, torch.bfloat16):
            a = torch.ones(8, 8, device=device, dtype=dtype, requires_grad=backward)
            out = torch.nn.functional.linear(a, a, a[0]) + a @ a
            if backward:
                torch.autograd.grad(out.sum(), a)
        if cudnn and torch.backends.cudnn.is_available():
            x = torch.ones(1, 1, 8, device=device, requires_grad=backward)
            out = torch.nn.functional.conv1d(x, torch.ones(1, 1, 3, device=device))
            if backward:
                torch.autograd.grad(out.sum(), x)
    # The handles were made on the capture stream: the caller's stream waits for them.
    torch.cuda.current_stream(device).wait_stream(_capture_stream(device))
    made.update(wanted)


_WHERE_IT_IS = contextlib.nullcontext()


class _OnCaptureStream(on_stream):
    """``on_stream(capture stream)``, ordered after the caller's stream on the way in and
    before it on the way out. A class, not a generator: an eager call's exception passes
    through it, and ``contextlib.contextmanager`` sets ``__traceback__`` on that exception,
    which one that takes no attribute (a frozen dataclass) refuses, replacing the
    function's own exception with ``FrozenInstanceError``."""

    __slots__ = ("caller",)

    def __enter__(self) -> "torch.cuda.Stream":
        self.caller = caller = super().__enter__()
        self.stream.wait_stream(caller)
        return caller

    def __exit__(self, *exc: Any) -> None:
        self.caller.wait_stream(self.stream)
        super().__exit__(*exc)


def _end_quietly(graph: "torch.cuda.CUDAGraph") -> None:
    # An empty graph (a function with no GPU work) makes torch warn that capture probably
    # happened on the wrong stream; for us it is a legitimate, if useless, graph.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        graph.capture_end()


def _recover_from_hard_failure(
    device: int, pool: Any, stream: "torch.cuda.Stream", began: bool
) -> None:
    # The routing is ended whatever happened (ending none raises, and is ignored), but the
    # pool released only after a capture that began: a capture_begin that raised may not
    # have retained it, and a release then drives its use count below zero (torch 2.11
    # decrements, then asserts; a later empty_cache() asserts again).
    if torch.__version__ < "2.14":
        try:
            torch._C._cuda_endAllocateToPool(device, pool)
        except RuntimeError:
            pass  # torch >= 2.12 may have ended the routing already
        if began:
            try:
                torch._C._cuda_releasePool(device, pool)
            except RuntimeError:
                # Released already (torch decremented, then asserted "uc >= 0"): the
                # generator reset below must happen regardless, or every later draw fails.
                logger.debug("the pool of a failed capture on cuda:%d was released already", device)
    if torch.__version__ < "2.12":
        reset = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            reset.capture_begin(capture_error_mode="thread_local")
            _end_quietly(reset)
        del reset


def _register(graph: "torch.cuda.CUDAGraph", generators: Sequence[Any], device: int) -> None:
    """Register the private CUDA generators the call draws from with ``graph``, before its
    capture begins (``CUDAGraph.register_generator_state``, torch >= 2.4).

    A capture records a draw from a registered generator as "at the generator's offset when
    the replay starts, plus the draws before it in the graph", and a replay advances the
    offset by all of its draws: replays draw what eager calls would, and advance the generator
    as they do. torch registers the default generator itself. An unregistered private one
    makes torch refuse the capture ("CUDA generator ... not in capture mode"), which the guard
    turns into an eager key whose reason names the generator: torch < 2.4, or a generator the
    warmup did not draw from. Newer torch registers a generator at its first draw in a capture
    and deprecates the call (pytorch/pytorch#176753): its warning is silenced here, and where
    the call is gone nothing needs it.
    """
    register = getattr(graph, "register_generator_state", None)
    if register is None:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        for generator in generators:  # those of the capture's GPU (another's is no use)
            if generator.device.type == "cuda" and generator.device.index in (None, device):
                register(generator)


class CudaGraphs:
    """The real backend: ``torch.cuda.CUDAGraph`` on one capture stream per device."""

    device_type = "cuda"

    @staticmethod
    def prepare_backward(device: int, cudnn: bool) -> None:
        make_library_handles(device, cudnn, backward=True)

    def new_pool(self, device: int) -> Any:
        return torch.cuda.graph_pool_handle()

    def reserved_bytes(self, device: int) -> int:
        return torch.cuda.memory_reserved(device)

    def eager_stream(self, device: int) -> ContextManager[Any]:
        """Run an eager call (a warmup, a fallback) that may build an autograd graph on the
        capture stream.

        >>> with CUDA.eager_stream(0):
        ...     loss = model(x).sum()         # its parameters' AccumulateGrad nodes: stream S

        Autograd accumulates a parameter's gradient on the stream its AccumulateGrad node was
        made on (torch >= 2.9), and a training loop keeps that node alive from call to call
        (the previous loss still holds it while the next forward runs). Made on the default
        stream, it would make the backward's capture wait on the default stream, which CUDA
        refuses; made here, the capture and the replays' backward (``autograd_stream``) use
        it without a cross-stream wait, and so do eager calls of the same parameters. Without
        grad mode no node is made: the call runs where it is.
        """
        if not torch.is_grad_enabled():
            return _WHERE_IT_IS
        return _OnCaptureStream(_capture_stream(device))

    def autograd_stream(self, device: int) -> "torch.cuda.Stream":
        """The stream that training graphs' autograd nodes belong to: the capture stream, on
        which their backward replays and their parameters' gradients accumulate."""
        return _capture_stream(device)

    def capture(
        self,
        run: Callable[[], Any],
        device: int,
        pool: Any,
        uses_cudnn: bool = False,
        generators: Sequence[Any] = (),
    ) -> Capture:
        graph = torch.cuda.CUDAGraph()
        result = Capture(graph)
        _register(graph, generators, device)
        with _capture_lock, torch.cuda.device(device), collector_paused():
            caller = torch.cuda.current_stream(device)
            stream = _capture_stream(device)
            stream.wait_stream(caller)
            make_library_handles(device, uses_cudnn)
            reserved_before = self.reserved_bytes(device)
            started = time.perf_counter()
            # Autocast's weight cache would hand the graph casts made before capture, which
            # die when the autocast block ends; without the cache the casts are captured.
            # Only under autocast: the flag is in torch.compile's global-state guard, and
            # changing it needlessly recompiles a compiled function inside the capture.
            cache_enabled = torch.is_autocast_cache_enabled()
            torch.set_autocast_cache_enabled(
                cache_enabled and not torch.is_autocast_enabled("cuda")
            )
            try:
                with torch.cuda.stream(stream):
                    began = False
                    try:
                        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                        began = True
                    except RuntimeError as error:
                        result.hard_error = error
                    else:
                        try:
                            result.outputs = run()
                        except BaseException as error:  # noqa: B902 - re-raised by the caller
                            result.error = error
                        finally:
                            try:
                                _end_quietly(graph)
                            except RuntimeError as error:
                                result.hard_error = error
                if result.hard_error is not None:
                    _recover_from_hard_failure(device, pool, stream, began)
                    logger.debug("cleaned up after a failed capture on cuda:%d", device)
            finally:
                torch.set_autocast_cache_enabled(cache_enabled)
                caller.wait_stream(stream)
            result.seconds = time.perf_counter() - started
            result.memory_bytes = max(0, self.reserved_bytes(device) - reserved_before)
        return result

    def allocated_in_pool(self, pool: Any, device: int, addresses: List[int]) -> Set[int]:
        """Which of these addresses lie in the memory of ``pool`` (from the allocator's
        snapshot: a capture-time cost, taken only when there are addresses to sort)."""
        if not addresses:
            return set()
        try:
            segments = [
                (s["address"], s["address"] + s["total_size"])
                for s in torch.cuda.memory_snapshot()
                if tuple(s.get("segment_pool_id", ())) == tuple(pool)
            ]
        except (RuntimeError, KeyError, TypeError):  # a snapshot format this code does not know
            return set()
        return {a for a in addresses if any(lo <= a < hi for lo, hi in segments)}

    @staticmethod
    def payoff_clock(device: int) -> Any:
        return CudaClock()

    def free(self, device: int) -> None:
        """Wait for replays in flight, then give freed graph memory back to the device."""
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


CUDA = CudaGraphs()


class CudaClock:
    """Times stretches of one CUDA stream with events, each from the stream idle; the end is
    read without synchronising the host.

    >>> clock = CudaClock(); timing = clock.start(stream); ...; clock.stop(timing, stream)
    >>> clock.ready(timing)        # False until the GPU has passed the end event
    >>> clock.seconds(timing)
    """

    def start(self, stream: Any = None) -> Any:
        import torch

        # The stream's earlier work drained first: when the host runs ahead (a decode loop
        # that never reads a value back, a training loop), an eager run's kernels would be
        # queued before the GPU reached them, and timed back to back without the launch gaps
        # that a graph saves; a graph that pays in wall time then looked useless and was
        # dropped. From an idle stream, each side's time includes its own launches. It costs
        # one wait per measured call, at most 32 per key, once.
        (torch.cuda.current_stream() if stream is None else stream).synchronize()
        begin = torch.cuda.Event(enable_timing=True)
        begin.record(stream)
        return [begin, None]

    def stop(self, timing: Any, stream: Any = None) -> Any:
        import torch

        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        timing[1] = end
        return timing

    @staticmethod
    def ready(timing: Any) -> bool:
        return timing[1] is not None and timing[1].query()

    @staticmethod
    def seconds(timing: Any) -> float:
        return timing[0].elapsed_time(timing[1]) / 1e3
