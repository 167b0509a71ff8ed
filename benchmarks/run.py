"""Eager against autograph against the references, each case in a fresh process on one GPU.

    PYTHONPATH=$PWD python3 benchmarks/run.py                      # every case, print the table
    PYTHONPATH=$PWD python3 benchmarks/run.py --cases de --write   # run (d), (e); merge, render
    PYTHONPATH=$PWD python3 benchmarks/run.py --render             # RESULTS.md, chart, README

Cases (letters for --cases; estimated wall time on an H200, process start included):
  a  MLP 32x512 bf16 at batch 1                                      ~20 s
  b  HF Llama decode step (8x512, StaticCache), batch 1             ~45 s
  c  one kernel of four small tensors                                 ~10 s
  d  the wrapper's own cost: N-sweep, and the disabled paths          ~30 s
  e  HF BERT serving over batch sizes 1..32: buckets, memory          ~2-3 min
  f  HF Llama decode at batch 1..64 with buckets, P50/P99 latency     ~60-90 s
  g  torch.compile stacked with autograph on the decode step of (b)   ~2-3 min
  t  training (benchmarks/case_training.py, when present)
  n  never slower: HF generate() in a region (3 caches), a GPU-bound MLP  ~60-90 s
  i  islands: autograph.graphed(model.generate) beside generate() in a region  ~30-60 s
  h  HF generate end to end: eager, region, compiled, autograph.generate  ~60-90 s
  s  serving: padding share with suggested buckets, memory under a budget  ~30-60 s

Each case module ``benchmarks/case_*.py`` has a function ``case_x(rows, with_compile)`` that
appends rows (dicts: case, variant, value, unit, note, kind, and for line charts series and
x; see ``autograph.cli._bench``). Figures are medians; ratios are measured side by side in the
same process. Each row is printed as it is measured (stderr, flushed), so a run cut off by a
time limit still shows where it was.

``--write`` saves each case's rows as ``benchmarks/results/case_<letter>.json`` (with the date,
GPU, torch and Python of its run; a later run of a case replaces its file), then renders
``benchmarks/RESULTS.md``, ``benchmarks/results.png`` and README.md's table of figures
(``benchmarks/headline.py``) from every JSON file there, so several invocations (one per
10-minute device call) merge. With ``--results-dir DIR``, RESULTS.md and results.png are
written in DIR instead, and README.md is left alone. ``--out DIR`` also copies the JSON files,
RESULTS.md and the chart into DIR as they are written (a device run's $OUT). The chart needs
matplotlib (a benchmark-only dependency, imported when drawing); without it the chart is
skipped with a note. ``notes.md`` next to the JSON files, when there, is written under the
run's date line: where the runs were made (commits, device calls) and what moves between them.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import importlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(1, ROOT)  # autograph from this checkout

from autograph.cli._bench import (  # noqa: E402 (after the path to this checkout)
    SMOKE,
    Rows,
    add_row,
    failure,
    figure,
    format_rows,
    infer_kind,
    progress,
)

RESULTS_DIR = os.path.join(HERE, "results")
RESULTS_MD = os.path.join(HERE, "RESULTS.md")
CHART = os.path.join(HERE, "results.png")

# letter: (module, function, estimated seconds on an H200, title)
CASES = {
    "a": ("case_mlp", "case_mlp", 20, "MLP 32x512, batch 1"),
    "b": ("case_llama", "case_llama", 45, "HF Llama decode, batch 1"),
    "c": ("case_small", "case_small", 10, "one kernel, four small tensors"),
    "d": ("case_overhead", "case_overhead", 30, "wrapper cost, N-sweep, disabled paths"),
    "e": ("case_bert", "case_bert", 180, "HF BERT serving, buckets"),
    "f": ("case_decode", "case_decode", 90, "HF Llama decode, batch 1..64, buckets"),
    "g": ("case_compile", "case_compile", 180, "torch.compile and autograph"),
    "t": ("case_training", "case_training", 120, "training"),
    "n": (
        "case_never_slower",
        "case_never_slower",
        90,
        "never slower: generate() in a region, GPU-bound MLP",
    ),
    "i": ("case_islands", "case_islands", 60, "islands: graphed(model.generate)"),
    "h": (
        "case_generate",
        "case_generate",
        90,
        "HF generate end to end: eager, region, compiled, autograph.generate",
    ),
    "s": ("case_serving", "case_serving", 60, "serving: padding, budget, capture()"),
}
DEFAULT_CASES = "abcdefgtnihs"


# ---- one case, in its own process ----


def environment():
    import torch

    if SMOKE or not torch.cuda.is_available():
        gpu = "no GPU (CPU smoke run)" if SMOKE else "no GPU"
    else:
        gpu = torch.cuda.get_device_name()
    env = {
        "date": datetime.date.today().isoformat(),
        "gpu": gpu,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    return env


def load_case(letter):
    module_name, function, _, _ = CASES[letter]
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    return getattr(importlib.import_module(module_name), function)


def run_case(letter, with_compile, rows_out):
    """One case in this process: its rows go to ``rows_out`` as they are measured."""
    import contextlib

    import autograph

    with open(rows_out + ".env", "w") as fh:
        json.dump(environment(), fh)
    rows = Rows(rows_out)
    rows.save()
    progress(f"case ({letter}) starts: {CASES[letter][3]}")
    start = time.perf_counter()
    emulation = autograph.testing.emulate_graphs_on_cpu() if SMOKE else contextlib.nullcontext()
    name = f"({letter}) {CASES[letter][3]}"
    try:
        case = load_case(letter)
        with emulation:
            case(rows, with_compile)
    except BaseException as error:
        if isinstance(error, ModuleNotFoundError) and error.name == CASES[letter][0]:
            add_row(
                rows,
                name,
                "(case not available)",
                None,
                note=f"benchmarks/{CASES[letter][0]}.py is not there",
            )
            return 0
        traceback.print_exc()
        sys.stderr.flush()
        add_row(rows, name, "(case failed)", None, note=failure(error))
        return 1
    progress(f"case ({letter}) done in {time.perf_counter() - start:.0f} s")
    return 0


# ---- results: JSON per case, RESULTS.md and the chart ----


def case_path(results_dir, letter):
    return os.path.join(results_dir, f"case_{letter}.json")


def load_results(results_dir):
    """Every case's latest result in ``results_dir``, in case order."""
    found = []
    for path in glob.glob(os.path.join(results_dir, "case_*.json")):
        try:
            with open(path) as fh:
                found.append(json.load(fh))
        except (OSError, ValueError) as error:
            print(f"skipping {path}: {error}", file=sys.stderr)
    order = {letter: i for i, letter in enumerate(DEFAULT_CASES)}
    return sorted(found, key=lambda r: (order.get(r.get("letter"), 99), r.get("letter", "")))


def row_value(row):
    """A row's figure as a number (older rows keep it as text under "us/call"), or None."""
    value = row.get("value")
    if value is None:
        try:
            value = float(row.get("us/call", ""))
        except ValueError:
            return None
    return value


def row_ratio(row):
    if row.get("ratio") is not None:
        return row["ratio"]
    found = re.search(r"(\d+\.\d+)x hand-written", row.get("note", ""))
    return float(found.group(1)) if found else None


def describe_env(env):
    text = f"{env.get('date', '?')}, {env.get('gpu', '?')}, torch {env.get('torch', '?')}"
    if env.get("python"):
        text += f", Python {env['python']}"
    if env.get("transformers"):
        text += f", transformers {env['transformers']}"
    return text


def render_markdown(results, chart_note, notes=""):
    envs = {}
    for result in results:
        envs.setdefault(describe_env(result.get("env", {})), []).append(result)
    if len(envs) == 1:
        header = next(iter(envs))
    else:
        header = "Runs:\n\n" + "\n".join(
            "- " + ", ".join(f"({r['letter']})" for r in group) + f": {env}"
            for env, group in envs.items()
        )
    times = ", ".join(
        f"({r['letter']}) {r['seconds']:.0f} s"
        + (f" [{r['status']}]" if r.get("status", "complete") != "complete" else "")
        for r in results
        if r.get("seconds") is not None
    )
    rows = [{**row, "figure": figure(row)} for result in results for row in result["rows"]]
    table = format_rows(rows, ["case", "variant", "figure", "note"]) if rows else "(no rows)"
    return (
        "# Benchmark results\n\n"
        "Written by `benchmarks/run.py --write` from the per-case results in "
        "`benchmarks/results/` (the latest run of each case). Figures are microseconds per "
        "call unless a unit is given: medians of repeated runs of many back-to-back calls, the "
        "GPU synchronised around each run; variants compared by a ratio are timed side by side "
        "in one process. Each case runs in a fresh process, torch.compile last within it.\n\n"
        + header
        + "\n\n"
        + (notes.strip() + "\n\n" if notes.strip() else "")
        + (f"Wall time per case: {times}.\n\n" if times else "")
        + chart_note
        + "\n\n"
        + table
        + "\n"
    )


KIND_COLORS = {
    "eager": "#9e9e9e",
    "hand": "#4c72b0",
    "autograph": "#dd8452",
    "compile": "#55a868",
    "other": "#8172b2",
}


def chart_groups(results):
    """Per case name: ("lines", unit, {series: [(x, y)]}) or ("bars", unit, [(label, y, kind)])."""
    groups = {}
    for result in results:
        for row in result["rows"]:
            value = row_value(row)
            if value is None or value <= 0:
                continue
            groups.setdefault(row.get("case", "?"), []).append((row, value))
    charts = []
    for name, items in groups.items():
        lines = [
            (row, value) for row, value in items if row.get("x") is not None and row.get("series")
        ]
        if lines:
            series = {}
            for row, value in lines:
                series.setdefault(row["series"], []).append((row["x"], value))
            charts.append((name, "lines", lines[0][0].get("unit", "us/call"), series))
            continue
        kinds = [
            (row, value)
            for row, value in items
            if row.get("kind", infer_kind(row.get("variant", ""))) in KIND_COLORS
        ]
        units = [row.get("unit", "us/call") for row, _ in kinds]
        if not units:
            continue
        unit = "us/call" if "us/call" in units else max(set(units), key=units.count)
        bars = [
            (row.get("variant", ""), value, row.get("kind", infer_kind(row.get("variant", ""))))
            for row, value in kinds
            if row.get("unit", "us/call") == unit
        ]
        charts.append((name, "bars", unit, bars))
    return charts


def render_chart(results, path):
    """Draw the chart; returns the line RESULTS.md shows for it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return (
            "Chart not drawn: matplotlib is not installed where this was rendered "
            "(`pip install matplotlib`, then `python benchmarks/run.py --render`)."
        )
    import textwrap

    charts = chart_groups(results)
    if not charts:
        return "Chart not drawn: no figures yet."
    columns = 2
    rows_n = (len(charts) + columns - 1) // columns
    fig, axes = plt.subplots(rows_n, columns, figsize=(14, 4.6 * rows_n), squeeze=False)
    for ax in axes.flat[len(charts) :]:
        ax.axis("off")
    for ax, (name, style, unit, data) in zip(axes.flat, charts):
        ax.set_title(textwrap.fill(name, 60), fontsize=10)
        ax.set_ylabel(unit)
        if style == "lines":
            values = [y for points in data.values() for _, y in points]
            xs = sorted({x for points in data.values() for x, _ in points})
            for series, points in data.items():
                points.sort()
                ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=series)
            if xs and xs[-1] / max(xs[0], 1e-9) > 8:
                ax.set_xscale("log", base=2)
                ax.set_xticks(xs)
                ax.set_xticklabels([str(x) for x in xs])
            ax.legend(fontsize=8)
        else:
            values = [v for _, v, _ in data]
            positions = range(len(data))
            ax.bar(positions, values, color=[KIND_COLORS[k] for _, _, k in data])
            ax.set_xticks(list(positions))
            ax.set_xticklabels(
                [textwrap.fill(label, 18) for label, _, _ in data],
                fontsize=7,
                rotation=30,
                ha="right",
            )
            for x, v in zip(positions, values):
                ax.annotate(f"{v:.3g}", (x, v), ha="center", va="bottom", fontsize=7)
        if values and max(values) / min(values) > 10:
            ax.set_yscale("log")
        ax.grid(axis="y", alpha=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in KIND_COLORS.values()]
    fig.legend(
        handles,
        ["eager", "hand-written", "autograph", "torch.compile", "other"],
        loc="upper center",
        ncol=5,
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return f"![Benchmark chart: each case's variants]({os.path.basename(path)})"


def render(results_dir, markdown_path, chart_path, out=None):
    results = load_results(results_dir)
    chart_note = render_chart(results, chart_path)
    notes_path = os.path.join(results_dir, "notes.md")
    notes = open(notes_path).read() if os.path.exists(notes_path) else ""
    with open(markdown_path, "w") as fh:
        fh.write(render_markdown(results, chart_note, notes))
    if os.path.abspath(results_dir) == RESULTS_DIR:  # README's table: these results only
        from headline import write_readme

        write_readme(results)
    print(
        f"wrote {markdown_path} ({sum(len(r['rows']) for r in results)} rows from "
        f"{len(results)} case(s)); {chart_note}",
        file=sys.stderr,
    )
    if out:
        for path in (markdown_path, chart_path):
            if os.path.exists(path):
                shutil.copy(path, out)


def compare_ratios(previous, result):
    """Lines comparing this run's ratios with those of the file it replaces."""
    if not previous:
        return []
    old = {row.get("variant"): row_ratio(row) for row in previous.get("rows", [])}
    lines = []
    for row in result["rows"]:
        before, now = old.get(row.get("variant")), row_ratio(row)
        if before and now:
            change = now / before - 1
            flag = "  <-- more than 3% worse" if change > 0.03 else ""
            lines.append(f"  {row['variant']}: {before:.3f}x -> {now:.3f}x ({change:+.1%}){flag}")
    return lines


# ---- the driver ----


def run_in_subprocess(letter, args, rows_out):
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--one-case",
        letter,
        "--rows-out",
        rows_out,
    ]
    if args.no_compile:
        command.append("--no-compile")
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    start = time.perf_counter()
    status = "complete"
    # stdout and stderr stream through: progress shows even if this call is cut off. The case
    # runs in its own process group, so that a time-out also ends its compile workers.
    child = subprocess.Popen(
        command, env={**os.environ, "PYTHONPATH": path}, start_new_session=True
    )
    try:
        returncode = child.wait(timeout=args.case_timeout)
        if returncode != 0:
            status = f"failed (exit code {returncode})"
    except subprocess.TimeoutExpired:
        status = f"timed out after {args.case_timeout:.0f} s"
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    except BaseException:  # interrupted: do not leave the case running
        os.killpg(child.pid, signal.SIGKILL)
        raise
    seconds = time.perf_counter() - start
    try:
        with open(rows_out) as fh:
            rows = json.load(fh)
    except (OSError, ValueError):
        rows = []
    try:
        with open(rows_out + ".env") as fh:
            env = json.load(fh)
    except (OSError, ValueError):
        env = {"date": datetime.date.today().isoformat()}
    if status != "complete":
        rows.append(
            {
                "case": f"({letter}) {CASES[letter][3]}",
                "variant": f"(case {status})",
                "value": None,
                "unit": "us/call",
                "kind": "other",
                "note": "rows above it were measured before",
            }
        )
    return {
        "letter": letter,
        "title": CASES[letter][3],
        "env": env,
        "rows": rows,
        "seconds": seconds,
        "status": status,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cases",
        default=DEFAULT_CASES,
        help=f"case letters to run, e.g. 'abc' (default {DEFAULT_CASES})",
    )
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile rows")
    parser.add_argument(
        "--write",
        action="store_true",
        help="save each case's JSON, then render RESULTS.md, the chart and README's table",
    )
    parser.add_argument(
        "--render",
        action="store_true",
        help="only render RESULTS.md, the chart and README's table from the JSON files",
    )
    parser.add_argument(
        "--results-dir",
        default=None,
        help="where the per-case JSON files are (default benchmarks/results)",
    )
    parser.add_argument("--markdown", help=argparse.SUPPRESS)
    parser.add_argument("--chart", help=argparse.SUPPRESS)
    parser.add_argument("--out", help="also copy JSON, RESULTS.md and the chart here")
    parser.add_argument(
        "--case-timeout",
        type=float,
        default=420,
        help="seconds one case may run before it is stopped (default 420)",
    )
    parser.add_argument("--one-case", help=argparse.SUPPRESS)
    parser.add_argument("--rows-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one_case:
        return run_case(args.one_case, not args.no_compile, args.rows_out)
    unknown = sorted(set(args.cases) - set(CASES))
    if unknown:
        parser.error(f"unknown case letter(s) {unknown}; the cases are {''.join(CASES)}")
    if SMOKE and (args.write or args.render) and args.results_dir is None:
        parser.error(
            "a smoke run (AUTOGRAPH_BENCH_SMOKE=1) writes only with an explicit "
            "--results-dir, so that it never replaces real results"
        )
    results_dir = args.results_dir or RESULTS_DIR
    # RESULTS.md and the chart sit next to the JSON files they are drawn from, unless those
    # are benchmarks/results/ (then: benchmarks/RESULTS.md and benchmarks/results.png).
    if args.results_dir is not None:
        args.markdown = args.markdown or os.path.join(results_dir, "RESULTS.md")
        args.chart = args.chart or os.path.join(results_dir, "results.png")
    args.markdown, args.chart = args.markdown or RESULTS_MD, args.chart or CHART
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    if args.render:
        render(results_dir, args.markdown, args.chart, args.out)
        return 0
    estimate = sum(CASES[c][2] for c in args.cases)
    progress(f"cases {args.cases}: about {estimate / 60:.1f} min on an H200")
    results, failed = [], False
    scratch = tempfile.mkdtemp(prefix="autograph-bench-")
    for letter in args.cases:
        rows_out = os.path.join(args.out or scratch, f"case_{letter}.partial.json")
        result = run_in_subprocess(letter, args, rows_out)
        results.append(result)
        failed |= result["status"] != "complete"
        previous = None
        if os.path.exists(case_path(results_dir, letter)):
            with open(case_path(results_dir, letter)) as fh:
                previous = json.load(fh)
        changes = compare_ratios(previous, result)
        if changes:
            print(
                f"({letter}) ratios against the last saved run "
                f"({previous.get('env', {}).get('date', '?')}):\n" + "\n".join(changes),
                file=sys.stderr,
                flush=True,
            )
        if args.write:
            os.makedirs(results_dir, exist_ok=True)
            with open(case_path(results_dir, letter), "w") as fh:
                json.dump(result, fh, indent=1)
            if args.out:
                shutil.copy(case_path(results_dir, letter), args.out)
        for suffix in ("", ".env"):
            if os.path.exists(rows_out + suffix):
                os.remove(rows_out + suffix)
    shutil.rmtree(scratch, ignore_errors=True)
    rows = [{**row, "figure": figure(row)} for result in results for row in result["rows"]]
    headers = sorted({describe_env(r["env"]) for r in results})
    print("\n".join(headers) + "\n\n" + format_rows(rows, ["case", "variant", "figure", "note"]))
    if args.write:
        render(results_dir, args.markdown, args.chart, args.out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
