"""Warm restarts: ``fn.capture(plan=path, **objects)`` captures ahead of time every key a plan
file lists (``_plan_file``), so that a new process's first real call is a replay
(docs/design.md, "Capture ahead").

>>> step.save_plan("step.plan.json")                                 # the serving process
>>> step.capture(plan="step.plan.json", cache=autograph.per_bucket(caches))  # the next one

Each entry's example call is rebuilt from its record (``capture._call_record``: zeros of each
tensor's spec, its plain values, and the caller's ``objects`` by argument name for what the plan
cannot hold), and captured by ``capture()``'s own path (``_ahead.capture_ahead``) under the
recorded execution state. A bucketed function's entries that differ only in their bucket are
one family: one ``capture_ahead`` of the largest entry's example at the plan's sizes, as
``capture()`` would capture them. Every entry whose key did not come out graphed is said in
one warning, naming it; the stats rows tell why.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional

import torch

from .. import _config
from .._scope import current_region
from .._stats import KeyStats
from .._warn import warn_user
from ..capture._call_record import entered_state, placeholders, rebuilt_call
from ..engine._key_life import GRAPHED
from ._ahead import capture_ahead
from ._plan_file import Path, read_plan


def capture_from_plan(
    engine: Any, call: Callable, instance: Any, path: Path, objects: Mapping[str, Any]
) -> List[KeyStats]:
    """Capture every key of the plan in ``path`` for ``engine``'s function; its stats rows."""
    if _config.ENV.disable:
        return []
    options, cache, _, _ = engine.call_options(instance, current_region())
    plan = read_plan(engine.name, path, options)
    records = [entry["call"] for entry in plan["entries"]]
    _check_objects(engine.name, path, records, objects)
    rows: List[KeyStats] = []
    for family in _families(records).values():
        example = max(family, key=lambda record: record["bucket"] or 0)
        args, kwargs = rebuilt_call(example, objects)
        sizes = None if example["bucket"] is None else sorted({r["bucket"] for r in family})
        with entered_state(example["state"]), _training(instance, example["state"]["training"]):
            rows += capture_ahead(engine, call, instance, args, kwargs, sizes)
    with cache.lock:
        graphed = {_text(life.example) for life in cache.entries.values() if life.phase == GRAPHED}
    missed = [e["key"] for e in plan["entries"] if _text(e["call"]) not in graphed]
    if missed:
        warn_user(
            f"{engine.name}.capture(plan={os.fspath(path)!r}): {len(missed)} of the plan's "
            f"{len(records)} keys did not come out graphed: {'; '.join(missed[:3])}"
            f"{'; ...' if len(missed) > 3 else ''}. Their stats() rows say why (a fallback "
            f"reason, or another key: an object given of another shape or type than the "
            f"plan's process passed)."
        )
    return rows


def _text(record: Optional[dict]) -> str:
    return json.dumps(record, sort_keys=True)


def _families(records: List[dict]) -> Dict[str, List[dict]]:
    """The records by family: equal but for their bucket and the bucket's padded dims."""

    def masked(value: Any) -> Any:
        if isinstance(value, list):
            return [masked(v) for v in value]
        if not isinstance(value, dict):
            return value
        spec = value.get("tensor")
        if isinstance(spec, dict) and spec.get("padded") is not None:
            shape = list(spec["shape"])
            shape[spec["padded"]] = None
            return {"tensor": {**spec, "shape": shape}}
        return {k: masked(v) for k, v in value.items() if k != "bucket"}

    families: Dict[str, List[dict]] = {}
    for record in records:
        families.setdefault(_text(masked(record)), []).append(record)
    return families


def _check_objects(name: str, path: Path, records: List[dict], objects: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` for an object the plan's keys need and were not given, or one
    given that none of them takes."""
    needed = sorted({n for record in records for n in placeholders(record)})
    where = f"{name}.capture(plan={os.fspath(path)!r})"
    missing = [n for n in needed if n not in objects]
    if missing:
        raise ValueError(
            f"{where}: the plan's keys take {', '.join(missing)} by identity or by address "
            f"(an object or a tensor a plan file cannot hold); pass "
            f"{', '.join(f'{n}=...' for n in missing)}, the object the real calls will pass, "
            f"or {missing[0]}=autograph.per_bucket({{size: value}}) for one per bucket."
        )
    extra = [n for n in objects if n not in needed]
    if extra:
        raise ValueError(
            f"{where}: {', '.join(extra)} given, but no key of the plan takes "
            f"{'it' if len(extra) == 1 else 'them'} as an object"
            f"{' (it takes ' + ', '.join(needed) + ')' if needed else ''}: the plan rebuilds "
            f"every other argument itself. Leave {'it' if len(extra) == 1 else 'them'} out."
        )


@contextlib.contextmanager
def _training(instance: Any, training: Optional[bool]) -> Iterator[None]:
    """A module's ``training`` flag as the plan's key had it, each submodule's put back after."""
    if training is None or not isinstance(instance, torch.nn.Module):
        yield
        return
    flags = [(module, module.training) for module in instance.modules()]
    instance.train(training)
    try:
        yield
    finally:
        for module, flag in flags:
            module.training = flag
