"""One argument per bucket for ``capture()`` (docs/design.md, "Capture ahead"): the state each
bucket holds its own of (a KV cache passed with ``static_argnames``), given to one example call.

>>> step.capture(ids, pos, autograph.per_bucket(caches))       # caches = {1: c1, 2: c2, ...}
>>> step.capture(ids, pos, cache=autograph.per_bucket(lambda size: caches[size]))

``capture()`` resizes the example to every bucket and swaps each marker for that bucket's value
(``for_bucket``), so every bucket's key is the key its real calls make. A marker is nothing but
that: a real call that keys it raises, and so does ``capture()`` of a function without buckets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, List, Sequence, Tuple, Union

from ..capture._outputs import flatten_arguments

Values = Union[Mapping, Callable[[int], Any]]


class PerBucket:
    """Stands, in ``capture()``'s example call, for one value per bucket size."""

    __slots__ = ("values",)

    def __init__(self, values: Values):
        if not isinstance(values, Mapping) and not callable(values):
            raise TypeError(
                f"autograph.per_bucket(values): values is a {type(values).__name__}; give a "
                f"mapping {{bucket size: value}} or a callable size -> value."
            )
        self.values = values

    def value_for(self, size: int) -> Any:
        if isinstance(self.values, Mapping):
            return self.values[size]
        return self.values(size)

    def missing(self, sizes: Sequence[int]) -> List[int]:
        """The sizes a mapping has no value for (a callable answers every size)."""
        if not isinstance(self.values, Mapping):
            return []
        return [size for size in sizes if size not in self.values]

    def __repr__(self) -> str:
        if isinstance(self.values, Mapping):
            sizes = ", ".join(f"{size}: ..." for size in self.values)
            return f"autograph.per_bucket({{{sizes}}})"
        return f"autograph.per_bucket({getattr(self.values, '__name__', 'callable')})"

    def __hash__(self) -> int:
        # A real call keys its non-tensor arguments by hash: this is where a marker given to a
        # call, not to capture(), is caught, at no cost to calls without one. ValueError, not
        # TypeError, which the keying reads as "unhashable" and words otherwise.
        raise ValueError(
            f"{self!r} was given to a call of a graphed function; it stands for one value per "
            f"bucket and only fn.capture(...) takes it. Give a call its bucket's own value "
            f"(caches[4] for a call of 3 rows with buckets [1, 2, 4, 8])."
        )


def per_bucket(values: Values) -> PerBucket:
    """One argument per bucket for ``fn.capture()``: ``values`` maps each bucket size to its
    value, or is a callable ``size -> value``.

    >>> step = autograph.graphed(decode, buckets=[1, 2, 4, 8], bucket_args={"ids": 0},
    ...                          static_argnames=("cache",))
    >>> caches = {b: StaticCache(config=config, max_cache_len=256) for b in [1, 2, 4, 8]}
    >>> step.capture(ids, pos, autograph.per_bucket(caches))   # bucket 4 captured with caches[4]
    >>> step(ids[:3], pos, caches[4])                          # a replay

    Positional or keyword, at any depth of an argument (a tuple, a dict). Each bucket's
    example is the example resized to that size with every marker swapped for the bucket's
    value, keyed as a real call of that size with that value is. ``capture()`` raises
    ``ValueError`` for a mapping without a value for some bucket, or a function without
    ``buckets=``; a real call given a marker raises ``ValueError`` too.
    """
    return PerBucket(values)


def marked_arguments(
    names: Sequence[str], args: tuple, kwargs: dict
) -> List[Tuple[str, PerBucket]]:
    """(the top-level argument's name, the marker) for every marker in the call."""
    found = []
    named = [(names[i] if i < len(names) else f"args[{i}]", a) for i, a in enumerate(args)]
    for name, value in named + list(kwargs.items()):
        found += [(name, leaf) for leaf in flatten_arguments(value)[0] if type(leaf) is PerBucket]
    return found


def for_bucket(args: tuple, kwargs: dict, size: int) -> Tuple[tuple, dict]:
    """The call's arguments with every marker swapped for its value at ``size``."""
    leaves, rebuild = flatten_arguments((args, kwargs))
    if not any(type(leaf) is PerBucket for leaf in leaves):
        return args, kwargs
    return rebuild([leaf.value_for(size) if type(leaf) is PerBucket else leaf for leaf in leaves])


def check_markers(
    function: str,
    names: Sequence[str],
    args: tuple,
    kwargs: dict,
    buckets: Any,
    sizes: Any = None,
) -> None:
    """Raise ``ValueError`` for markers ``capture()`` cannot use: a function without buckets,
    a mapping without a value for some bucket (of ``sizes``, those captured, if given)."""
    marked = marked_arguments(names, args, kwargs)
    if marked and buckets is None:
        raise ValueError(
            f"{function}.capture(): autograph.per_bucket(...) given for {marked[0][0]}, but "
            f"{function} has no buckets=: there is one key to capture, not one per bucket. "
            f"Pass the value itself, or graph {function} with buckets=[...]."
        )
    for name, marker in marked:
        missing = marker.missing(buckets if sizes is None else sizes)
        if missing:
            raise ValueError(
                f"{function}.capture(): autograph.per_bucket(...) for {name} has no value "
                f"for bucket{'s' if len(missing) > 1 else ''} {missing} of "
                f"buckets={list(buckets)}; give a value for every bucket (or a callable "
                f"size -> value)."
            )
