"""Seeing what the graphs do (issue 12; docs/design.md, "Seeing what happened"): named profiler
ranges, the capture and fallback log lines with a summary at exit, and ``report()`` readable in a
terminal and as data.
"""

import dataclasses
import io
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import autograph
from autograph._profile import profile_range
from autograph._stats import KeyStats, format_table
from autograph.api._report import EMULATED
from autograph.watch._guard import host_read_fix

from conftest import device_label

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def item(x):
    return x + x.sum().item()


# ---- profiler ranges ----


def test_warmup_capture_replay_and_eager_calls_are_named_ranges(device, caught):
    @autograph.graphed
    def f(x):
        return x * 2

    g = autograph.graphed(item)
    x = torch.ones(4, device=device)
    with torch.profiler.profile() as prof:
        for _ in range(3):
            f(x), g(x)
    names = {event.key for event in prof.key_averages()}
    key = f"(x: f32[4] {device_label(device)})"
    for what in ("warmup", "capture", "replay"):
        assert f"autograph.{what} {f.__qualname__}{key}" in names, what
    assert f"autograph.eager item{key}" in names
    replays = [e for e in prof.key_averages() if e.key == f"autograph.replay {f.__qualname__}{key}"]
    assert replays[0].count == 2  # the capture call's replay, then the hot path's


def test_a_verified_replay_shows_its_eager_check(device):
    @autograph.graphed(verify=1)
    def f(x):
        return x * 2

    x = torch.ones(4, device=device)
    f(x), f(x)
    with torch.profiler.profile() as prof:
        f(x)
    names = {event.key for event in prof.key_averages()}
    key = f"{f.__qualname__}(x: f32[4] {device_label(device)})"
    assert {f"autograph.verify {key}", f"autograph.replay {key}"} <= names


def test_without_a_profiler_there_are_no_ranges():
    # One shared no-op: nothing is built, named or recorded.
    assert profile_range("replay", "f", "x") is profile_range("eager", "g", "y")


# ---- logs ----

PROGRAM = """
import torch, autograph
from autograph.testing import emulate_graphs_on_cpu

@autograph.graphed
def fine(x):
    return x + 1

@autograph.graphed
def host(x):
    return x + x.sum().item()

with emulate_graphs_on_cpu():
    for _ in range(4):
        fine(torch.zeros(3))
        if {with_fallback}:
            host(torch.zeros(3))
"""


def run(program, **env):
    """(exit status, stderr) of ``program`` run with the AUTOGRAPH_* variables of ``env``."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("AUTOGRAPH_")}
    result = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        env={**environment, "PYTHONPATH": ROOT, **env},
        timeout=120,
    )
    return result.returncode, result.stderr


def test_logs_tell_captures_checks_fallbacks_and_sum_up_fallbacks_at_exit():
    status, log = run(
        PROGRAM.format(with_fallback=True), AUTOGRAPH_LOG="info", AUTOGRAPH_VERIFY="2"
    )
    assert status == 0, log
    assert "autograph INFO: captured fine(x: f32[3] cpu) in " in log and " MiB)" in log
    assert (
        "autograph INFO: fine(x: f32[3] cpu): its first 2 replays after capture matched eager runs"
    ) in log
    fallback = log[log.index("autograph INFO: host(x: f32[3] cpu) runs eagerly: ") :]
    reason = fallback.splitlines()[0].split("runs eagerly: ")[1]
    # python -c has no source line to name the read by: the words for an unnamed one.
    assert reason.endswith("synchronises with the host, and " + host_read_fix("a read"))
    summary = log[log.index("autograph INFO: at exit") :].splitlines()
    assert summary == [
        "autograph INFO: at exit, 1 graphed function had keys that ran eagerly:",
        f"  host: 1 key, 4 eager calls: {reason}",
    ]


def test_no_summary_without_fallbacks_or_without_the_log():
    quiet_status, quiet_log = run(PROGRAM.format(with_fallback=True))
    clean_status, clean_log = run(PROGRAM.format(with_fallback=False), AUTOGRAPH_LOG="info")
    assert quiet_status == 0 and "at exit" not in quiet_log
    assert clean_status == 0 and "captured fine" in clean_log and "at exit" not in clean_log


# ---- report() and stats() ----

REASON = (
    ".item() at model.py:42 synchronises with the host. Replay does not re-run Python, "
    "so a value read on the host would be frozen at capture; keep it on the GPU"
)


def row(**changes):
    fields = dict(
        function="normalise",
        key="x: f32[8, 512] cuda:0",
        state="eager",
        calls=3,
        eager_calls=3,
        replays=0,
        capture_seconds=None,
        graph_bytes=0,
        fallback_reason=REASON,
    )
    return KeyStats(**{**fields, **changes})


def test_long_reasons_wrap_to_the_terminal_width():
    rows = [
        row(),
        row(
            function="step",
            state="graphed",
            eager_calls=1,
            replays=2,
            capture_seconds=0.0012,
            graph_bytes=2 << 20,
            fallback_reason=None,
        ),
    ]
    lines = format_table(rows, width=90).splitlines()
    assert max(len(line) for line in lines) <= 90
    assert lines[0].split() == [
        "function",
        "key",
        "state",
        "calls",
        "replays",
        "eager",
        "capture",
        "ms",
        "MiB",
    ]  # empty columns left out
    assert lines[2].startswith("normalise") and lines[-1].startswith("step")
    reason_lines = lines[3:-1]
    assert len(reason_lines) > 1 and all(line.startswith("    ") for line in reason_lines)
    assert " ".join(line.strip() for line in reason_lines) == f"fallback reason: {REASON}"
    assert format_table(rows).splitlines()[2].endswith(REASON)  # no width: one line


def test_a_long_key_wraps_too_when_the_reason_alone_cannot_make_room():
    key = ", ".join(f"arg{i}: f32[8, 512] cuda:0" for i in range(6))
    lines = format_table([row(key=key)], width=90).splitlines()
    assert max(len(line) for line in lines) <= 90
    start, end = lines[0].index("key"), lines[0].index("state")
    reason = next(n for n, line in enumerate(lines) if line.startswith("    fallback reason"))
    key_lines = [line[start:end].strip() for line in lines[2:reason]]
    assert len(key_lines) > 1 and " ".join(key_lines) == key


def test_report_wraps_on_a_terminal_and_not_in_a_file(device, monkeypatch, caught):
    g = autograph.graphed(item)
    for _ in range(2):
        g(torch.ones(4, device=device))

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(shutil, "get_terminal_size", lambda: os.terminal_size((70, 24)))
    terminal, file = Terminal(), io.StringIO()
    autograph.report(g, file=terminal)
    autograph.report(g, file=file)
    assert max(len(line) for line in terminal.getvalue().splitlines()) <= 70
    assert len(file.getvalue().splitlines()) == 3  # header, rule, one key
    assert g.stats()[0].fallback_reason in file.getvalue()


def test_verified_replays_get_a_column_once_verify_ran():
    assert "verified" not in format_table([row()])
    header, _, line = format_table([row(key="x", verified=2, replays=3)]).splitlines()
    assert header.split()[:6] == ["function", "key", "state", "calls", "replays", "verified"]
    assert line.split()[4:7] == ["3", "2", "3"]


def test_stats_rows_are_plain_data_for_scripts(device):
    @autograph.graphed
    def f(x):
        return x + 1

    for _ in range(3):
        f(torch.ones(2, device=device))
    data = json.loads(json.dumps([dataclasses.asdict(r) for r in autograph.stats(f)]))
    assert data[0]["state"] == "graphed" and data[0]["replays"] == 2
    assert data[0]["key"] == f"x: f32[2] {device_label(device)}"


def test_report_of_a_module_in_one_call_whichever_way_it_was_graphed(device, capsys):
    graphed = autograph.graphed(torch.nn.Linear(3, 3).to(device))
    in_region = torch.nn.Linear(3, 3).to(device)
    x = torch.randn(2, 3, device=device)
    with torch.no_grad():
        for _ in range(3):
            graphed(x)
        with autograph.region():
            for _ in range(3):
                in_region(x)
    for module in (graphed, in_region):
        capsys.readouterr()
        autograph.report(module)
        lines = capsys.readouterr().out.splitlines()
        name = autograph.stats(module)[0].function
        assert lines[2].startswith(name) and " graphed " in lines[2]
        assert lines[3].startswith(f"{name}: 1 graph(s) hold ")  # the memory its graphs hold
        # The emulation's capture time and memory are said to mean nothing; real ones are not.
        assert lines[4:] == ([EMULATED] if device == "cpu" else [])


def test_report_of_an_unknown_target_says_what_it_takes():
    with pytest.raises(TypeError, match="is not graphed"):
        autograph.report(len)
