"""README.md is a landing page that stays true: its figures are the benchmark results, its
quick start runs as written, its commands are the ones CI runs, and its words and the docs'
are a user's, not the project's history."""

import pathlib
import re
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"
sys.path.insert(0, str(ROOT / "benchmarks"))
import headline  # noqa: E402  (benchmarks/headline.py: the README's table from the results)


def code_block(text, language, after):
    """The first ``language`` code block after the heading ``after``."""
    found = re.search(re.escape(after) + r".*?```" + language + r"\n(.*?)```", text, re.S)
    assert found, f"no {language} block after {after!r}"
    return found.group(1)


def test_readme_is_a_landing_page():
    assert len(README.splitlines()) <= 250


def test_readme_figures_are_the_benchmark_results():
    # benchmarks/run.py --render writes the table; one edited by hand, or results renewed
    # without rendering, fails here.
    expected = headline.render_headline(headline.load_results(headline.RESULTS_DIR))
    assert headline.readme_table(README) == expected


def test_the_headline_rows_exist_in_the_results():
    rows = headline.headline_rows(headline.load_results(headline.RESULTS_DIR))
    assert len(rows) == len(headline.HEADLINE)
    assert all(row["eager"] and row["autograph"] for row in rows)


def test_the_first_commands_install_the_right_torch_then_autograph():
    install = code_block(README, "bash", "## Install")
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in install
    assert "\npip install torch " in install  # the CUDA build, from PyPI
    assert README.index("download.pytorch.org/whl/cpu") < README.index('pip install -e ".[test]"')


def test_ci_runs_the_readme_test_command():
    setup = code_block(README, "bash", "Then install autograph")
    install_and_demo, tests = [line.split("#")[0].strip() for line in setup.strip().splitlines()]
    assert install_and_demo == 'pip install -e ".[test]" && python -m autograph bench'
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests == "python -m pytest -q tests" and f"\n{tests}\n" in ci
    assert re.search(r'pip install -q -e "\.\[test[],]', ci)  # the test extra, as here


def test_getting_started_shows_the_same_quick_start():
    quick_start = code_block(README, "python", "## Quick start")
    assert quick_start in (DOCS / "getting-started.md").read_text()


def test_the_quick_start_runs_as_written_and_says_what_happened(tmp_path):
    # A user's script: a fresh process, their own directory. Checked after it: the model was
    # captured and replayed (on the CPU through the emulation, on a GPU for real), and the
    # function that reads the host ran eagerly, said with its line and the fix.
    check = (
        "\nrows = autograph.stats(model)\n"
        "print('CHECK', rows[0].state, rows[0].replays, normalise.stats()[0].state)\n"
    )
    script = tmp_path / "quick_start.py"
    script.write_text(code_block(README, "python", "## Quick start") + check)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    # On a GPU the payoff check times one of the calls after capture eagerly: 3 or 4 replays.
    checked = re.search(r"CHECK graphed ([34]) eager", done.stdout)
    assert checked, done.stdout
    assert "Sequential" in done.stdout and "normalise" in done.stdout  # report()'s table
    assert "normalise(x: f32[32, 10]" in done.stderr and ".item() at quick_start.py:" in done.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.cuda
def test_the_quick_start_graphs_on_the_gpu(tmp_path):
    test_the_quick_start_runs_as_written_and_says_what_happened(tmp_path)


# Words about how the project was made, which a user cannot know: a round of work, a review,
# an issue of this project's tracker, a session, a benchmark's case letter used as a name.
INTERNAL = re.compile(
    r"\bround \d|\(round|\brounds?\b of work|\breviews? \d|\bissue \d+|"
    r"\bthis session|\bprevious session|\b(?:case|benchmark) \([a-z]\)|"
    r"\btaken back\b",
    re.I,
)


def user_pages():
    # design.md is the design (its history is the point); the changelog is the log.
    return [ROOT / "README.md"] + [p for p in sorted(DOCS.rglob("*.md")) if p.name != "design.md"]


@pytest.mark.parametrize("page", user_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_user_pages_speak_of_the_product_not_its_making(page):
    found = [m.group(0) for m in INTERNAL.finditer(page.read_text())]
    assert not found, f"{page.relative_to(ROOT)}: {found}"


def test_ratios_in_the_guides_are_measured_ones():
    # A figure such as 1.023x in a guide must be one that the benchmark results hold, so that
    # renewed results with other figures show up here instead of going stale in prose.
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    for page in [DOCS / "when-it-helps.md", *sorted((DOCS / "guide").glob("*.md"))]:
        text = page.read_text()
        stale = [r for r in re.findall(r"\b\d\.\d{3}x", text) if r not in results]
        assert not stale, f"{page.name}: {stale} are not in benchmarks/RESULTS.md"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the docs show the CPU emulation's run")
def test_the_sample_messages_in_the_docs_are_what_the_example_prints():
    done = subprocess.run(
        [sys.executable, "why_eager.py"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT / "examples",
    )
    assert done.returncode == 0, done.stderr
    printed = done.stderr.replace(str(ROOT / "examples") + "/", "")
    shown = code_block((DOCS / "guide" / "why-eager.md").read_text(), "", "## The messages")
    assert shown.strip() and all(line in printed for line in shown.strip().splitlines())
    table = code_block((DOCS / "guide" / "seeing.md").read_text(), "", "examples/why_eager.py")
    assert all(line in done.stdout for line in table.strip().splitlines()[2:] if "eager" in line)
