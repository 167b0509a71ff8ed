"""Whether a bucket's graph mixes rows: do its real rows change when its pad rows do?

>>> finding = mixes_rows(lambda: graph.replay_leaves(), padded, rows=3,
...                      written=written_tensors, first=outputs_of_the_capture_call,
...                      dims=decision.dims)
>>> finding
'output 0 (real rows) changed when the pad rows did: it mixes rows ...'

A replay runs no Python, so it may be repeated without repeating the function's effects
(docs/design.md, "Buckets"): the graph, captured and replayed once for its call, is replayed once
more with each padded input's pad rows holding copies of the real rows (cycled: values the function
is known to accept, where a constant could be an index out of range), and its real rows compared
with the first replay's. Equal: they do not depend on the pad rows. Different: a mean or sum over
the batch, batch statistics, attention across rows; the key runs eagerly, the output named.
Everything the probe writes (the inputs' pad rows, the storages the graph writes: a KV cache, batch
norm's running statistics) is saved before and restored after, so the call's effects are as if the
probe never ran. With no pad rows (a call of the bucket's own size) there is nothing to probe.

A sum over the batch with the default zero padding is right and still found: the probe
cannot tell a neutral pad value from a lucky one.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

from ..watch._undo import generator_states

Tensor = torch.Tensor


def _fill_pad_with_real_rows(static: Tensor, dim: int, rows: int) -> None:
    size = static.shape[dim]
    for start in range(rows, size, rows):
        length = min(rows, size - start)
        static.narrow(dim, start, length).copy_(static.narrow(dim, 0, length))


class SavedState:
    """Copies of the whole storages of ``tensors`` (each once: views share one) and of the
    random generators' states, to put back with ``restore()``.

    >>> before = SavedState([static, cache])
    >>> before.restore()
    """

    def __init__(self, tensors: Sequence[Tensor]):
        saved: Dict[int, Tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}
        for t in tensors:
            storage = t.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in saved:
                saved[storage.data_ptr()] = (storage, storage.clone())
        self.storages = list(saved.values())
        self.generators = generator_states()

    def restore(self) -> None:
        with torch.no_grad():
            for storage, before in self.storages:
                storage.copy_(before)
        for generator, state in self.generators:
            generator.set_state(state)


def _first_difference(
    first: Sequence[Tensor], second: Sequence[Tensor], dims: Sequence[Tuple[int, ...]], rows: int
) -> Optional[int]:
    for i, (a, b, leaf_dims) in enumerate(zip(first, second, dims)):
        for d in leaf_dims:
            a, b = a.narrow(d, 0, rows), b.narrow(d, 0, rows)
        # Bitwise: the same rows at other positions of one batched kernel compute alike.
        if not torch.equal(a, b) and not (
            a.is_floating_point()
            and torch.equal(a.isnan(), b.isnan())
            and torch.equal(a.nan_to_num(), b.nan_to_num())
        ):
            return i
    return None


def _state_changed(saved: SavedState, tensors: Sequence[Tensor]) -> Optional[str]:
    """The first of ``tensors`` whose storage differs from its copy in ``saved``: state with
    no dim of the bucket's size (not one row per batch row, as a bucket's KV cache is) that
    the pad rows reached."""
    copies = {storage.data_ptr(): before for storage, before in saved.storages}
    for t in tensors:
        before = copies.get(t.untyped_storage().data_ptr())
        if before is not None and not _same_bytes(t.untyped_storage(), before):
            return f"a tensor of shape {list(t.shape)}"
    return None


def _same_bytes(storage: torch.UntypedStorage, other: torch.UntypedStorage) -> bool:
    device = storage.device
    return torch.equal(
        torch.empty(0, dtype=torch.uint8, device=device).set_(storage),
        torch.empty(0, dtype=torch.uint8, device=device).set_(other),
    )


def mixes_rows(
    replay: Callable[[], Sequence[Tensor]],
    padded: Sequence[Tuple[Tensor, int]],
    rows: int,
    written: Sequence[Tensor],
    first: Sequence[Tensor],
    dims: Sequence[Tuple[int, ...]],
    before: Optional[SavedState] = None,
    shared: Sequence[Tensor] = (),
) -> Optional[str]:
    """Why the graph's real rows depend on its pad rows, or None.

    ``replay`` replays the graph and returns its owned outputs (its own buffers); ``padded``
    the static inputs padded to the bucket, with the dim of each; ``written`` the tensors the
    graph writes (static arguments used by address, state read by address and written);
    ``first`` copies of the owned outputs of the call's own replay; ``dims`` per output, those
    that follow the batch; ``before`` the inputs, the written state and the generators as
    they were before that replay (a function that writes its state, or draws random numbers,
    must see them as the first replay did); ``shared`` the written state that is no argument
    (a module's running mean): one with no dim of the bucket's size must not change either.
    """
    if not padded or all(static.shape[dim] <= rows for static, dim in padded):
        return None
    after = SavedState([static for static, _ in padded] + list(written))
    try:
        if before is not None:
            before.restore()
        with torch.no_grad():
            for static, dim in padded:
                _fill_pad_with_real_rows(static, dim, rows)
        second = replay()
        changed = _first_difference(first, second, dims, rows)
        bucket = padded[0][0].shape[padded[0][1]]
        state = _state_changed(after, [t for t in shared if bucket not in t.shape])
    finally:
        after.restore()
    if changed is None and state is None:
        return None
    if changed is None:
        return (
            f"state it writes ({state}) changed when the pad rows did: it counts the pad "
            f"rows (a running mean or a count over the batch), so every call would drift "
            f"it; pass the state each bucket has its own of as an argument, or leave the "
            f"function out of buckets="
        )
    return (
        f"output {changed} (its real rows) changed when the pad rows did: it mixes rows "
        f"of the batch (a mean or sum over it, batch statistics such as BatchNorm in "
        f"training, attention across rows), so the padding would change its result"
    )
