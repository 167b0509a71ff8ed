"""The README's table of measured figures, drawn from ``benchmarks/results/`` as RESULTS.md is.

    PYTHONPATH=$PWD python3 benchmarks/run.py --render    # RESULTS.md, the chart and this table

>>> print(render_headline(load_results(RESULTS_DIR)))    # the table as README.md holds it

Each line of the table names one case's autograph row and the eager row it is measured
against; the figures and the comparison come from the results, never from hand-written text,
so the README cannot drift from RESULTS.md (tests/test_readme.py checks that it has not).
"""

from __future__ import annotations

import os
import re

# Re-exported for tests/test_readme.py: the results the README is checked against.
from run import RESULTS_DIR, describe_env, figure, format_rows, load_results  # noqa: F401

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
BEGIN = "<!-- benchmark table: written by benchmarks/run.py --render; do not edit by hand -->"
END = "<!-- end of the benchmark table -->"

# (case letter, what it shows, the autograph row, the eager row, the reference): the last
# column is the autograph row's ratio, measured side by side with the reference (the
# hand-written equivalent), or the row's note where there is no reference (a key that ran
# eagerly; a cost in microseconds).
HEADLINE = [
    (
        "b",
        "LLM decode step (HF Llama 8x512), one token",
        "autograph.graphed(model)",
        "eager",
        "a hand-written capture/replay",
    ),
    (
        "e",
        "serving HF BERT at batch sizes 1 to 32",
        "autograph.graphed(model, buckets=[1..32])",
        "eager",
        "one graph per exact size",
    ),
    (
        "t",
        "training step (MLP 16x512), graphed whole",
        "autograph.graphed(whole step)",
        "eager",
        "a hand-written whole-step capture",
    ),
    (
        "g",
        "decode step on top of torch.compile",
        "autograph.graphed(torch.compile(step))",
        "eager",
        'torch.compile(mode="reduce-overhead")',
    ),
    ("n", "a GPU-bound MLP (8x4096, batch 2048)", "autograph.graphed(model)", "eager", None),
    ("d", "one tiny kernel: autograph's own cost", "N=1: autograph.graphed", "N=1: eager", None),
]
COLUMNS = ["workload", "eager", "autograph", "autograph against the reference"]


def _with_unit(row: dict) -> str:
    text = figure(row)
    return text + " us" if row.get("unit", "us/call") == "us/call" else text


def _row(result: dict, variant: str) -> dict:
    """The first row of ``variant`` in a case's result (a case lists its first model first)."""
    for row in result["rows"]:
        if row.get("variant") == variant:
            return row
    raise KeyError(f"case ({result['letter']}) has no row {variant!r}")


def headline_rows(results: list) -> list:
    by_letter = {result["letter"]: result for result in results}
    rows = []
    for letter, workload, graphed, eager, reference in HEADLINE:
        if letter not in by_letter:
            continue
        mine, theirs = _row(by_letter[letter], graphed), _row(by_letter[letter], eager)
        against = mine.get("note", "")
        if reference and mine.get("ratio") is not None:
            against = f"{mine['ratio']:.3f}x the time of {reference}"
        rows.append(dict(zip(COLUMNS, [workload, _with_unit(theirs), _with_unit(mine), against])))
    return rows


def render_headline(results: list) -> str:
    envs = sorted(
        {
            describe_env(r.get("env", {}))
            for r in results
            if r["letter"] in {line[0] for line in HEADLINE}
        }
    )
    table = format_rows(headline_rows(results), COLUMNS)
    return f"Measured on {'; '.join(envs)}:\n\n{table}"


SPAN = re.compile(re.escape(BEGIN) + r"\n(.*?)" + re.escape(END), re.S)


def readme_table(text: str) -> str:
    """The table between README's markers (what ``write_readme`` put there)."""
    found = SPAN.search(text)
    if not found:
        raise ValueError(f"README.md has no benchmark table between {BEGIN!r} and {END!r}")
    return found.group(1).rstrip("\n")


def write_readme(results: list, path: str = README) -> None:
    with open(path) as fh:
        text = fh.read()
    readme_table(text)  # the markers are there
    table = render_headline(results)
    with open(path, "w") as fh:
        fh.write(SPAN.sub(lambda _: f"{BEGIN}\n{table}\n{END}", text, count=1))
