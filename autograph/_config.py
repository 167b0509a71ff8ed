"""Environment variables and per-function options.

The environment is read once, at import, so a typo fails loudly before any model runs:

>>> import os; os.environ["AUTOGRAPH_LOG"] = "verbose"; import autograph
ValueError: AUTOGRAPH_LOG='verbose' is not understood: use one of info, debug, warning ...
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Mapping, Optional

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}
_LOG_LEVELS = {"": None, "warning": logging.WARNING, "info": logging.INFO, "debug": logging.DEBUG}

logger = logging.getLogger("autograph")


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


@dataclasses.dataclass(frozen=True)
class Environment:
    """What the AUTOGRAPH_* variables asked for."""

    disable: bool = False
    strict: bool = False
    log_level: Optional[int] = None

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
        )


ENV = Environment.read(os.environ)

if ENV.log_level is not None:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("autograph %(levelname)s: %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(ENV.log_level)

_OUTPUT_POLICIES = ("copy", "static")


@dataclasses.dataclass(frozen=True)
class Options:
    """The options of one graphed function (SPEC section 4), validated on construction."""

    warmup: int = 1
    outputs: str = "copy"
    max_graphs: int = 16
    strict: Optional[bool] = None

    def __post_init__(self) -> None:
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
        if self.strict is not None and not isinstance(self.strict, bool):
            raise ValueError(f"strict={self.strict!r}: it must be True, False or None.")

    @property
    def raises_on_fallback(self) -> bool:
        return ENV.strict if self.strict is None else self.strict
