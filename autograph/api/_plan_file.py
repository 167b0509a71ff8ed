"""A plan file: the keys a process captured, for a new process to capture ahead of time
(``fn.save_plan(path)``, ``fn.capture(plan=path)``; docs/design.md, "Capture ahead").

>>> step.save_plan("step.plan.json")            # -> 7: one entry per graphed key
>>> plan = read_plan("step", "step.plan.json")  # ValueError: another torch, GPU or format

One JSON file: the format and its version, torch's version, the device the graphs were made
on (``torch.cuda.get_device_name``, or ``cpu-emulation``), the function's name, its options
that shape keys, and one entry per graphed key: its readable key and the record of the call
that captured it (``capture._call_record``). No tensor is written; keys not graphed are left
out. A graph replays kernels chosen for one torch and one GPU, so a plan from another is
refused, with what differs and the fix.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Union

import torch

from .._config import Options
from ..backends import _devices
from ..engine._key_cache import KeyCache
from ..engine._key_life import GRAPHED, KeyLife

FORMAT, VERSION = "autograph-plan", 1
EMULATION = "cpu-emulation"
Path = Union[str, "os.PathLike[str]"]


def device_name(life: KeyLife) -> str:
    """The device a key's graph runs on, as a plan names it."""
    if getattr(life.backend, "device_type", None) == "cpu":
        return EMULATION
    return torch.cuda.get_device_name(life.device)


def _here() -> List[str]:
    """The devices this process can graph on, as a plan names them."""
    names = [EMULATION] if _devices.emulation() is not None else []
    if _devices.cuda_available():
        names += [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return names


def key_options(options: Options) -> Dict[str, Any]:
    """The options that shape a function's keys, as JSON values."""
    chosen = {
        "buckets": options.buckets,
        "bucket_args": options.bucket_args,
        "static_argnames": options.static_argnames,
        "static_argnums": options.static_argnums,
    }
    return json.loads(json.dumps(chosen, default=repr))


def plan_of(name: str, options: Options, cache: KeyCache) -> Dict[str, Any]:
    """The plan of one cache's graphed keys."""
    with cache.lock:
        lives = [life for life in cache.entries.values() if life.phase == GRAPHED]
    entries = [
        {"key": life.label, "device": device_name(life), "call": life.example}
        for life in lives
        if life.example is not None and life.options == options
    ]
    left_out = [
        {"key": life.label, "reason": "captured in a region with other options"}
        for life in lives
        if life.options != options
    ]
    return {
        "format": FORMAT,
        "version": VERSION,
        "torch": torch.__version__,
        "device": sorted({e["device"] for e in entries}),
        "function": name,
        "options": key_options(options),
        "entries": entries,
        "left_out": left_out,
    }


def save_plan(name: str, options: Options, cache: KeyCache, path: Path) -> int:
    """Write the plan of ``cache``'s graphed keys to ``path``; return its number of entries."""
    plan = plan_of(name, options, cache)
    with open(path, "w", encoding="utf-8") as file:
        json.dump(plan, file, indent=1)
    return len(plan["entries"])


def _refused(name: str, path: Path, what: str) -> ValueError:
    return ValueError(
        f"{name}.capture(plan={os.fspath(path)!r}): {what}. Its graphs would replay kernels "
        f"chosen for another setup: capture in this process (let the first calls capture, or "
        f"{name}.capture(example...)) and save a new plan with {name}.save_plan(path)."
    )


def read_plan(name: str, path: Path, options: Options) -> Dict[str, Any]:
    """The plan in ``path``, checked: its format, torch's version, the device and the options
    that shape keys must be this process's and this function's (else ``ValueError``)."""
    with open(path, encoding="utf-8") as file:
        try:
            plan = json.load(file)
        except json.JSONDecodeError as error:
            raise _refused(name, path, f"the file is not JSON ({error})") from None
    if not isinstance(plan, dict) or plan.get("format") != FORMAT:
        raise _refused(name, path, "the file is not an autograph plan (fn.save_plan writes one)")
    if plan.get("version") != VERSION:
        raise _refused(
            name,
            path,
            f"the plan's format version is {plan.get('version')!r} and this autograph reads "
            f"version {VERSION}",
        )
    if plan["torch"] != torch.__version__:
        raise _refused(
            name,
            path,
            f"the plan was saved by torch {plan['torch']} and this process runs torch "
            f"{torch.__version__}",
        )
    here = _here()
    missing = [d for d in plan["device"] if d not in here]
    if missing:
        raise _refused(
            name,
            path,
            f"the plan was saved on {', '.join(missing)} and this process has "
            f"{', '.join(here) or 'no GPU (and no autograph.testing emulation)'}",
        )
    _check_options(name, path, plan, options)
    return plan


def _check_options(name: str, path: Path, plan: Dict[str, Any], options: Options) -> None:
    ours = key_options(options)
    differ = [k for k in ours if plan["options"].get(k) != ours[k]]
    if differ:
        shown = "; ".join(f"{k}: plan {plan['options'].get(k)!r}, now {ours[k]!r}" for k in differ)
        raise ValueError(
            f"{name}.capture(plan={os.fspath(path)!r}): the plan was saved with other options "
            f"that shape keys ({shown}), so its keys are not the keys {name}'s calls make now. "
            f"Graph {name} with the plan's options, or save a new plan with {name}.save_plan()."
        )
