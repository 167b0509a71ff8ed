"""Environment variables, per-function options, and the oldest torch autograph runs on.

The environment is read once, at import, so a typo fails loudly before any model runs:

>>> import os; os.environ["AUTOGRAPH_LOG"] = "verbose"; import autograph
ValueError: AUTOGRAPH_LOG='verbose' is not understood: use one of info, debug, warning ...
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import re
from typing import Any, Callable, Mapping, Optional, Tuple

import torch

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}
_LOG_LEVELS = {"": None, "warning": logging.WARNING, "info": logging.INFO, "debug": logging.DEBUG}

logger = logging.getLogger("autograph")

# The oldest torch autograph is right on (README, "What each torch gives"; setup.cfg says it too).
TORCH_FLOOR = (2, 9)


def check_torch(version: str) -> None:
    """Refuse a torch older than the floor, at import, with the reason and the fix.

    >>> check_torch("2.4.1")
    ImportError: autograph needs torch >= 2.9, and this is torch 2.4.1: ...
    """
    if tuple(int(part) for part in version.split(".")[:2]) < TORCH_FLOOR:
        raise ImportError(
            f"autograph needs torch >= {'.'.join(map(str, TORCH_FLOOR))}, and this is torch "
            f"{version}: older Dynamo cannot compile around autograph's watch (torch.compile'd "
            f"code under it was skipped for good, or recompiled on every watched call), and "
            f"older torch lacks APIs autograph uses. Upgrade it: pip install 'torch>=2.9'"
        )


check_torch(torch.__version__)


def _flag(environ: Mapping[str, str], name: str) -> bool:
    raw = environ.get(name, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(
        f"{name}={raw!r} is not understood: use 1 to turn it on or 0 (or leave it unset) "
        f"to turn it off."
    )


def _count(environ: Mapping[str, str], name: str) -> int:
    raw = environ.get(name, "")
    if not raw.strip():
        return 0
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(
            f"{name}={raw!r} is not understood: use a whole number >= 0 (or leave it unset)."
        )
    return value


@dataclasses.dataclass(frozen=True)
class Environment:
    """What the AUTOGRAPH_* variables asked for."""

    disable: bool = False
    strict: bool = False
    log_level: Optional[int] = None
    verify: int = 0

    @classmethod
    def read(cls, environ: Mapping[str, str]) -> "Environment":
        raw_log = environ.get("AUTOGRAPH_LOG", "")
        if raw_log.strip().lower() not in _LOG_LEVELS:
            raise ValueError(
                f"AUTOGRAPH_LOG={raw_log!r} is not understood: use one of info, debug, warning "
                f"(or leave it unset)."
            )
        return cls(
            disable=_flag(environ, "AUTOGRAPH_DISABLE"),
            strict=_flag(environ, "AUTOGRAPH_STRICT"),
            log_level=_LOG_LEVELS[raw_log.strip().lower()],
            verify=_count(environ, "AUTOGRAPH_VERIFY"),
        )


ENV = Environment.read(os.environ)

if ENV.log_level is not None:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("autograph %(levelname)s: %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(ENV.log_level)

_OUTPUT_POLICIES = ("copy", "static")

# The default warmup of the module calls a region graphs of itself (a graphed function's or
# module's is 1, in a region too): a region graphs every top-level module call of a whole
# program, many of whose keys never repeat (HF generate()'s prefill and its growing decode
# steps), so a new key's first call runs as a plain call and only a key that comes back is
# watched, at its second call (docs/design.md, "Regions").
REGION_WARMUP = 2


@dataclasses.dataclass(frozen=True)
class Options:
    """The options of one graphed function (docs/design.md, "Options"), validated on
    construction."""

    warmup: int = 1
    outputs: str = "copy"
    max_graphs: int = 16
    strict: Optional[bool] = None
    buckets: Optional[Tuple[int, ...]] = None
    bucket_args: Optional[Tuple[Tuple[str, int, Any], ...]] = None
    bucket_outputs: Any = None  # an int, or one entry per output leaf: int, ints or None
    static_argnames: Tuple[str, ...] = ()
    static_argnums: Tuple[int, ...] = ()
    verify: Optional[int] = None
    islands: bool = True
    check_payoff: bool = True
    max_graph_memory: Optional[int] = None  # bytes; given as an int or "512MiB"

    def __post_init__(self) -> None:
        # Stored hashable and normalised: options are part of a key inside regions.
        set_ = functools.partial(object.__setattr__, self)
        set_("buckets", _buckets(self.buckets))
        set_("bucket_args", _bucket_args(self.bucket_args))
        set_("bucket_outputs", _bucket_outputs(self.bucket_outputs))
        set_("static_argnames", _names(self.static_argnames, "static_argnames"))
        set_("static_argnums", _numbers(self.static_argnums, "static_argnums"))
        set_("max_graph_memory", _bytes(self.max_graph_memory))
        if self.verify is not None and (
            isinstance(self.verify, bool) or not isinstance(self.verify, int) or self.verify < 0
        ):
            raise ValueError(
                f"verify={self.verify!r}: it must be an int >= 0, the number of "
                f"replays of each key checked against an eager run."
            )
        if self.bucket_args is not None and self.buckets is None:
            raise ValueError(
                f"bucket_args={dict((n, (d, p)) for n, d, p in self.bucket_args)!r}"
                f" needs buckets=[...]: the sizes to pad to."
            )
        if self.bucket_outputs is not None and self.buckets is None:
            raise ValueError(
                f"bucket_outputs={self.bucket_outputs!r} needs buckets=[...]: it "
                f"names the output dims that follow the padded batch."
            )
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 1:
            raise ValueError(
                f"warmup={self.warmup!r}: it must be an int >= 1, because the first call of a "
                f"new key runs eagerly to initialise lazy state (cuBLAS handles, caches) before "
                f"capture."
            )
        if self.outputs not in _OUTPUT_POLICIES:
            raise ValueError(
                f"outputs={self.outputs!r}: use 'copy' (the caller owns the outputs, the default) "
                f"or 'static' (the graph's own buffers, valid until the next call)."
            )
        if (
            isinstance(self.max_graphs, bool)
            or not isinstance(self.max_graphs, int)
            or self.max_graphs < 0
        ):
            raise ValueError(
                f"max_graphs={self.max_graphs!r}: it must be an int >= 0 (0 captures nothing)."
            )
        if not isinstance(self.islands, bool):
            raise ValueError(
                f"islands={self.islands!r}: it must be True (a key that runs "
                f"eagerly still graphs the module calls inside it) or False."
            )
        if not isinstance(self.check_payoff, bool):
            raise ValueError(
                f"check_payoff={self.check_payoff!r}: it must be True (a key whose "
                f"graph is slower than its eager run goes eager) or False."
            )
        if self.strict is not None and not isinstance(self.strict, bool):
            raise ValueError(f"strict={self.strict!r}: it must be True, False or None.")

    @property
    def raises_on_fallback(self) -> bool:
        return ENV.strict if self.strict is None else self.strict

    @property
    def replays_to_verify(self) -> int:
        return ENV.verify if self.verify is None else self.verify

    @property
    def by_address(self) -> bool:
        return bool(self.static_argnames or self.static_argnums)


_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def _bytes(value: Any) -> Optional[int]:
    """``max_graph_memory``: None, an int of bytes >= 0, or a string such as "512MiB", "1.5GB"."""
    if value is None:
        return None
    number, unit = value, ""
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        number, unit = (float(match.group(1)), match.group(2).upper()) if match else (None, "?")
    if (
        isinstance(number, bool)
        or not isinstance(number, (int, float))
        or number < 0
        or unit not in _UNITS
    ):
        raise ValueError(
            f"max_graph_memory={value!r}: give a number of bytes >= 0, or a string "
            f'with a unit, e.g. max_graph_memory="512MiB" or "2GB" (units: '
            f"B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)."
        )
    return int(number * _UNITS[unit])


def _buckets(value: Any) -> Optional[Tuple[int, ...]]:
    if value is None:
        return None
    sizes = tuple(value) if isinstance(value, (list, tuple, range)) else None
    if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
        raise ValueError(
            f"buckets={value!r}: give the capture sizes as a list of ints >= 1, "
            f"e.g. buckets=[1, 2, 4, 8, 16, 32]."
        )
    return tuple(sorted(set(sizes)))


def _bucket_args(value: Any) -> Optional[Tuple[Tuple[str, int, Any], ...]]:
    if value is None or isinstance(value, tuple):
        return value
    if not isinstance(value, Mapping) or not value:
        raise ValueError(
            f"bucket_args={value!r}: give a dict of argument name to dim, or to "
            f"(dim, pad value), e.g. bucket_args={{'ids': 0, 'mask': (0, 0)}}."
        )
    specs = []
    for name, spec in value.items():
        dim, pad = (
            (spec, 0)
            if isinstance(spec, int)
            else (tuple(spec) + (0,))[:2]
            if isinstance(spec, (tuple, list))
            else (None, None)
        )
        if (
            not isinstance(name, str)
            or isinstance(dim, bool)
            or not isinstance(dim, int)
            or not isinstance(pad, (int, float, bool))
        ):
            raise ValueError(
                f"bucket_args[{name!r}]={spec!r}: give a dim (an int) or (dim, "
                f"pad value), e.g. 0 or (0, -100)."
            )
        specs.append((name, dim, pad))
    return tuple(specs)


def _bucket_outputs(value: Any) -> Any:
    """None, an int (that dim of every tensor output), or a tuple with one entry per output
    leaf: None (returned whole), an int or a tuple of ints (its dims that follow the batch)."""

    def is_dim(n: Any) -> bool:
        return isinstance(n, int) and not isinstance(n, bool)

    if value is None or is_dim(value):
        return value
    entries = list(value) if isinstance(value, (list, tuple)) else None
    if entries is not None:
        entries = [
            e
            if e is None or is_dim(e)
            else tuple(e)
            if isinstance(e, (list, tuple)) and all(map(is_dim, e))
            else ...
            for e in entries
        ]
    if not entries or any(e is ... for e in entries):
        raise ValueError(
            f"bucket_outputs={value!r}: give the output dim that follows the batch "
            f"(an int, e.g. 0), or one entry per output: an int, a tuple of ints, "
            f"or None for an output returned whole, e.g. [0, None]."
        )
    return tuple(entries)


def _names(value: Any, option: str) -> Tuple[str, ...]:
    names = (value,) if isinstance(value, str) else tuple(value or ())
    if not all(isinstance(n, str) for n in names):
        raise ValueError(f"{option}={value!r}: give argument names (strings).")
    return names


def _numbers(value: Any, option: str) -> Tuple[int, ...]:
    numbers = (value,) if isinstance(value, int) else tuple(value or ())
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in numbers):
        raise ValueError(f"{option}={value!r}: give argument positions (ints >= 0).")
    return numbers


def check_option_names(options: Mapping[str, object], where: str) -> None:
    """Refuse unknown option names, listing the known ones."""
    known = {f.name for f in dataclasses.fields(Options)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(
            f"{where} got unknown option(s) {unknown}; the options are {sorted(known)}."
        )


def check_static_arguments(options: Options, function: Callable, name: str, bound: bool) -> None:
    """Refuse ``static_argnames`` that name no parameter of ``function`` and
    ``static_argnums`` past its last positional parameter (``bound``: its first parameter,
    ``self`` or ``cls``, is not counted). A ``**kwargs`` function takes any name, a
    ``*args`` function any position.

    >>> check_static_arguments(Options(static_argnames=("cach",)), step, "step", False)
    TypeError: autograph.graphed(static_argnames=('cach',)): step has no parameter 'cach'; ...
    """
    if not options.by_address:
        return
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check against
        return
    kinds = {p.kind for p in parameters}
    named = [p for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if bound and named and named[0].kind is not inspect.Parameter.KEYWORD_ONLY:
        named = named[1:]
    positional = [p.name for p in named if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    listed = ", ".join(str(p) for p in named) or "none"
    if inspect.Parameter.VAR_KEYWORD not in kinds:
        unknown = [n for n in options.static_argnames if n not in {p.name for p in named}]
        if unknown:
            raise TypeError(
                f"autograph.graphed(static_argnames={options.static_argnames!r}): {name} has "
                f"no parameter {', '.join(map(repr, unknown))}; its parameters are ({listed}). "
                f"Name the parameters whose tensors are used by address."
            )
    if inspect.Parameter.VAR_POSITIONAL not in kinds:
        beyond = [i for i in options.static_argnums if i >= len(positional)]
        if beyond:
            raise TypeError(
                f"autograph.graphed(static_argnums={options.static_argnums!r}): {name} takes "
                f"{len(positional)} positional argument(s) ({', '.join(positional) or 'none'}),"
                f" so position(s) {', '.join(map(str, beyond))} do not exist. Count from 0"
                f"{', without self' if bound else ''}."
            )
