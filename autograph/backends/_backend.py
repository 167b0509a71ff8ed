"""What a backend that makes graphs offers the engine: one small interface, two implementations.

>>> capture = backend.capture(run, device=0, pool=backend.new_pool(0))
>>> capture.graph.replay()

The real backend is CUDA graphs (``_cuda_graphs.CUDA``); the other is the CPU emulation
(``_cpu_graphs.CPU``), which ``autograph.testing`` registers while it is on (``_devices``). The
engine, the graphs and the pools speak only this interface (docs/design.md, "Backends").
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ContextManager, List, Optional, Sequence, Set

try:
    from typing import Protocol
except ImportError:  # pragma: no cover - Python < 3.8
    Protocol = object  # type: ignore[assignment,misc]


@dataclasses.dataclass
class Capture:
    """What one capture attempt produced."""

    graph: Any
    outputs: Any = None
    error: Optional[BaseException] = None  # raised by the captured function
    hard_error: Optional[BaseException] = None  # raised by the backend when ending the capture
    seconds: float = 0.0
    memory_bytes: int = 0


class Backend(Protocol):
    """A way to capture and replay graphs on one kind of device."""

    device_type: str

    def new_pool(self, device: int) -> Any:
        """A new memory pool handle for graphs on ``device``."""

    def capture(
        self,
        run: Callable[[], Any],
        device: int,
        pool: Any,
        uses_cudnn: bool = False,
        generators: Sequence[Any] = (),
    ) -> Capture:
        """Record ``run()`` into a graph; its exception goes to ``Capture.error``.
        ``generators``: the private random generators ``run()`` draws from (its warmup saw
        them), which replays must advance as eager calls do."""

    def is_capturing(self) -> bool:
        """Whether this thread is inside a capture of this backend (a call made then is part
        of the enclosing graph). Asked of the emulation; CUDA's own capture state is read
        inline by ``_devices.why_not_keyed``, on every call, without a backend method."""

    def eager_stream(self, device: int) -> ContextManager[Any]:
        """Where an eager call that may build an autograd graph runs."""

    def autograd_stream(self, device: int) -> Any:
        """The stream training graphs' autograd nodes belong to, or None."""

    def prepare_backward(self, device: int, cudnn: bool) -> None:
        """Make what a backward capture needs in autograd's thread (library handles)."""

    def allocated_in_pool(self, pool: Any, device: int, addresses: List[int]) -> Set[int]:
        """Which of these addresses lie in the pool's own memory."""

    def free(self, device: int) -> None:
        """Give the memory of released graphs back to the device."""

    def payoff_clock(self, device: int) -> Any:
        """What times a key's replays and eager runs on the stream they run on
        (``_cuda_graphs.CudaClock``'s interface), or None where timings mean nothing."""
