"""The current CUDA stream, read and switched for the price of a C call (the replay path's).

>>> with on_stream(side) as caller:       # side is current on its GPU; caller was before
...     graph.replay()                     # launched on side
...     with on_stream(caller):
...         outputs = other.replay()       # back on the caller's stream

``torch.cuda.current_stream()`` builds a new ``Stream`` and resolves the device in Python, and
``torch.cuda.stream()`` does so three times over: about 4 and 9 us on the H200's host CPU, and
a training call switches streams four times. Here the current stream is read as torch's raw
``(stream_id, device_index, device_type)`` triple and a ``Stream`` object is made once per
stream, with the C functions behind ``torch.cuda.current_stream`` and ``torch.cuda.set_stream``
(torch >= 2.0). Making a stream current also makes its GPU the current device; ``on_stream``
gives the caller's current device back, as ``torch.cuda.stream()`` inside
``torch.cuda.device(current)`` would, so that the block sees the device it was called with.
"""

from __future__ import annotations

import functools
from typing import Any, Tuple

import torch

# Private, kept on the replay path (docs/design.md, "Private torch APIs"); absent from CPU-only
# builds of torch, where nothing here is called.
_get_stream = getattr(torch._C, "_cuda_getCurrentStream", None)
_set_stream = getattr(torch._C, "_cuda_setStream", None)
_get_device = getattr(torch._C, "_cuda_getDevice", None)
_set_device = getattr(torch._C, "_cuda_setDevice", None)


@functools.lru_cache(maxsize=256)  # streams come from torch's fixed pools: a few per GPU
def _stream_object(handle: Tuple[int, int, int]) -> "torch.cuda.Stream":
    stream_id, device_index, device_type = handle
    return torch.cuda.Stream(
        stream_id=stream_id, device_index=device_index, device_type=device_type
    )


def current_stream(device: int) -> "torch.cuda.Stream":
    """``torch.cuda.current_stream(device)``, without a new object per call."""
    return _stream_object(tuple(_get_stream(device)))


class on_stream:
    """Make ``stream`` the current stream of its GPU for the block, keeping the current
    device; ``as`` gives the stream that was current on that GPU before."""

    __slots__ = ("stream", "previous", "device")

    def __init__(self, stream: "torch.cuda.Stream"):
        self.stream = stream

    def __enter__(self) -> "torch.cuda.Stream":
        stream = self.stream
        gpu = stream.device_index
        self.previous = tuple(_get_stream(gpu))
        self.device = device = _get_device()
        _set_stream(stream.stream_id, gpu, stream.device_type)
        if device != gpu:
            _set_device(device)
        return _stream_object(self.previous)

    def __exit__(self, *exc: Any) -> None:
        _set_stream(*self.previous)
        if self.device != self.previous[1]:
            _set_device(self.device)
