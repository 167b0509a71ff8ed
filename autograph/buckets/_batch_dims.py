"""Which output dims follow the batch of a bucketed function, from evidence that cannot be a
coincidence: its runs at different batch sizes, or the user's word.

>>> shapes = BatchShapes()
>>> shapes.note(4, [torch.empty(2, 4, 5), torch.empty(4), 4])       # a run of bucket 4
>>> shapes.decide(rows=3, bucket=4).undecided                          # one size: can't tell
'dim 1 of output 0 has the size of the only run so far (4 at 4 rows): whether it ...'
>>> shapes.note(8, [torch.empty(2, 8, 5), torch.empty(4), 8])       # a run of bucket 8
>>> shapes.decide(rows=3, bucket=4).refused                            # output 2 is the size
'output 2 is a Python value that changes with the batch size (4 at 4 rows, 8 at 8 rows), ...'

Every run of a bucketed key runs at its padded size, so one run shows each output's shape at
one size only, and a dim whose size equals the bucket may follow the batch or equal it by
chance (a hidden size of 4, ``w.sum(0)``). Runs of the same function at other sizes (other
buckets' keys, the buckets that ``capture()`` warms up, a call run unpadded while undecided)
settle it: a dim follows the batch when its size is the run's size in every run, at two sizes
at least. A dim that keeps one size does not follow; one that changes but is not the batch's
size (the batch flattened into another dim), outputs that change in number or rank, and a
Python value that changes with the size are refused: that function runs eagerly, said with
the output named. The user can name the dims (``bucket_outputs``), checked against each run.

One ``BatchShapes`` serves a family of keys: those equal but for the padded size and the
objects used by address (each bucket has its own KV cache), see ``_buckets.family_key``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

Tensor = torch.Tensor

# Per output leaf: the dims sliced back to the call's rows (empty: returned whole).
Dims = Tuple[Tuple[int, ...], ...]

# A run's outputs as evidence, per leaf: ("tensor", shape), ("value", a plain value it
# returned: an int may be the size, a float made from it, 1.0 / x.shape[0], a bool or a str
# too, x.shape[0] > 4, f"rows={x.shape[0]}"), or ("other", its type).
_Leaf = Tuple[str, Any]


def as_evidence(leaf: Any) -> _Leaf:
    if isinstance(leaf, Tensor):
        return ("tensor", tuple(leaf.shape))
    if type(leaf) in (int, float, bool, str):  # compared between sizes; a bool is no size
        return ("value", leaf)
    return ("other", type(leaf))


@dataclasses.dataclass(frozen=True)
class Decision:
    """What to do with a call of ``rows`` rows of a bucket: slice ``dims`` (decided), or the
    reason none can be given yet (``undecided``: a run at another size would tell), or the
    reason there never will be one (``refused``: the key runs eagerly).

    >>> Decision(dims=((0,), ()), undecided=None, refused=None).dims
    ((0,), ())
    """

    dims: Optional[Dims]
    undecided: Optional[str]
    refused: Optional[str]


def named_dims(spec: Any, leaves: Sequence[Any]) -> Dims:
    """The dims the user named with ``bucket_outputs``, per output leaf.

    >>> named_dims(0, [torch.empty(3, 2), 7])            # dim 0 of every tensor output
    ((0,), ())
    >>> named_dims([1, None], [torch.empty(2, 3), torch.empty(5)])
    ((1,), ())
    """
    if isinstance(spec, int) and not isinstance(spec, bool):
        return tuple(
            ((spec % leaf.dim(),) if isinstance(leaf, Tensor) and leaf.dim() else ())
            for leaf in leaves
        )
    if not isinstance(spec, (list, tuple)) or len(spec) != len(leaves):
        raise ValueError(
            f"bucket_outputs={spec!r}: give one dim for every tensor output (an int), or one "
            f"entry per output ({len(leaves)} here: an int, a tuple of ints, or None)"
        )
    dims = []
    for i, (entry, leaf) in enumerate(zip(spec, leaves)):
        entry = () if entry is None else (entry,) if isinstance(entry, int) else tuple(entry)
        if entry and not isinstance(leaf, Tensor):
            raise ValueError(
                f"bucket_outputs[{i}]={spec[i]!r} names a dim of output {i}, "
                f"which is a {type(leaf).__name__}, not a tensor"
            )
        if any(not -leaf.dim() <= d < leaf.dim() for d in entry):
            raise ValueError(f"bucket_outputs[{i}]={spec[i]!r}: output {i} has {leaf.dim()} dims")
        dims.append(tuple(sorted(d % leaf.dim() for d in entry)))
    return tuple(dims)


class BatchShapes:
    """The output shapes of one family of bucketed keys, by the size each run ran at."""

    def __init__(self, named: Any = None):
        self.named = named  # bucket_outputs, or None
        self.runs: Dict[int, List[_Leaf]] = {}
        self.numbers: Dict[int, list] = {}  # the Python numbers its ops got, by size (_size_reads)
        # Whether a run on fake tensors was tried for a second size (_symbolic_batch): once.
        self.fake_run_tried = False
        # Why the whole family runs eagerly, where no output shows it (its fake run's leak).
        self.refused: Optional[str] = None
        self._decided: Optional[Dims] = None

    def note(self, size: int, leaves: Sequence[Any]) -> None:
        """Note the flattened outputs of one run whose padded dims had ``size`` rows."""
        if size not in self.runs:
            self.runs[size] = [as_evidence(leaf) for leaf in leaves]
            self._decided = None

    @property
    def decided(self) -> Optional[Dims]:
        """The dims that follow the batch, once a ``decide`` found them."""
        return self._decided

    def decide(self, rows: int, bucket: int) -> Decision:
        """Which dims to slice back to ``rows`` on a call replayed at ``bucket``."""
        refused = self._refusal()
        if refused is not None:
            return Decision(None, None, refused)
        if not self.runs:
            return Decision(None, "no run of it has been seen yet", None)
        if self._decided is None:
            dims, undecided = self._dims(bucket)
            if undecided is not None:
                if rows == bucket:  # nothing to slice: any choice is right
                    return Decision(tuple(() for _ in self._first()), None, None)
                return Decision(None, undecided, None)
            self._decided = dims
        return Decision(self._decided, None, None)

    def _first(self) -> List[_Leaf]:
        return next(iter(self.runs.values()))

    def _refusal(self) -> Optional[str]:
        if self.refused is not None or not self.runs:
            return self.refused
        sizes = sorted(self.runs)
        first = self.runs[sizes[0]]
        for size in sizes[1:]:
            other = self.runs[size]
            if len(other) != len(first) or any(
                a[0] != b[0]
                or (a[0] == "tensor" and len(a[1]) != len(b[1]))
                or (a[0] == "other" and a[1] is not b[1])
                for a, b in zip(first, other)
            ):
                return (
                    f"its outputs change in number or rank with the batch size ({sizes[0]} "
                    f"and {size} rows): it reads the size in Python, and padding changes "
                    f"what it does"
                )
        for i, (kind, _) in enumerate(first):
            if kind == "value":
                values = {s: self.runs[s][i][1] for s in sizes}
                if len({repr(v) for v in values.values()}) > 1:  # repr: NaN equals NaN
                    seen = ", ".join(f"{v} at {s} rows" for s, v in values.items())
                    return (
                        f"output {i} is a Python value that changes with the batch size "
                        f"({seen}), such as x.shape[0] or 1.0 / x.shape[0]: padded, it would be "
                        f"the bucket's; "
                        f"return a tensor, or compute it outside the function"
                    )
        if self.named is not None:
            return self._named_refusal(sizes)
        for i, (kind, shape) in enumerate(first):
            if kind != "tensor":
                continue
            for d in range(len(shape)):
                seen = {s: self.runs[s][i][1][d] for s in sizes}
                if len(set(seen.values())) > 1 and any(n != s for s, n in seen.items()):
                    shown = ", ".join(f"{n} at {s} rows" for s, n in seen.items())
                    return (
                        f"dim {d} of output {i} changes with the batch size but is not the "
                        f"batch ({shown}; the batch flattened with another dim?): it "
                        f"cannot be sliced back to a call's rows. Return it with the batch "
                        f"as a dim of its own"
                    )
        return None

    def _named_refusal(self, sizes: Sequence[int]) -> Optional[str]:
        for size in sizes:
            leaves = self.runs[size]
            for i, leaf_dims in enumerate(named_dims(self.named, _stand_ins(leaves))):
                for d in leaf_dims:
                    if leaves[i][1][d] != size:
                        return (
                            f"bucket_outputs names dim {d} of output {i}, whose size is "
                            f"{leaves[i][1][d]} in a run of {size} rows: it does not "
                            f"follow the batch"
                        )
        return None

    def _dims(self, bucket: int) -> Tuple[Dims, Optional[str]]:
        sizes = sorted(self.runs)
        first = self.runs[sizes[0]]
        if self.named is not None:
            return named_dims(self.named, _stand_ins(first)), None
        dims: List[Tuple[int, ...]] = []
        for i, (kind, what) in enumerate(first):
            if kind == "value" and len(sizes) == 1 and type(what) is int and what == sizes[0]:
                return (), (
                    f"output {i} is the Python value {what}, the size of the only run "
                    f"so far: it may be the batch size read in Python"
                )
            if kind != "tensor":
                dims.append(())
                continue
            follows = []
            for d in range(len(what)):
                seen = [(s, self.runs[s][i][1][d]) for s in sizes]
                if len(sizes) > 1:
                    if all(n == s for s, n in seen):
                        follows.append(d)
                    continue
                ((size, n),) = seen
                if n % size == 0:  # at size 1 every dim: any may be the batch
                    what = "the" if n == size else f"{n // size}x the"
                    return (), (
                        f"dim {d} of output {i} has {what} size of the only run so far "
                        f"({n} at {size} rows): whether it follows the batch shows at "
                        f"another size"
                    )
            dims.append(tuple(follows))
        return tuple(dims), None


def _stand_ins(leaves: Sequence[_Leaf]) -> List[Any]:
    """Meta tensors of the recorded shapes (and the other leaves as they are), for
    ``named_dims``."""
    return [torch.empty(what, device="meta") if kind == "tensor" else what for kind, what in leaves]
