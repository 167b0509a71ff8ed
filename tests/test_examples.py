"""The examples run, or say what they need and how to install it."""

import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def run_example(name, block_transformers=False):
    block = "sys.modules['transformers'] = None; " if block_transformers else ""
    code = (
        f"import runpy, sys; {block}sys.path.insert(0, {str(EXAMPLES)!r}); "
        f"runpy.run_path({str(EXAMPLES / name)!r}, run_name='__main__')"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=EXAMPLES.parent,
    )


def test_why_eager_shows_its_warnings_on_any_machine():
    done = run_example("why_eager.py")
    assert done.returncode == 0, done.stderr
    for name, cause in (
        ("normalise", ".item()"),
        ("positives", "boolean-mask indexing"),
        ("clip", "a tensor used as a Python condition"),
    ):
        assert f"{name}(x: f32[8, 512]" in done.stderr and cause in done.stderr
    assert "graphed" in done.stdout  # the Linear's keys were captured and replayed


@pytest.mark.parametrize("name", ["decode.py", "serving.py"])
def test_the_transformers_examples_say_how_to_install_it(name):
    done = run_example(name, block_transformers=True)
    assert done.returncode == 1
    assert f"examples/{name} needs transformers: pip install transformers" in done.stderr
    assert "Traceback" not in done.stderr
