"""Options and environment variables (docs/design.md, "Options")."""

import os
import subprocess
import sys

import pytest
import torch

import autograph
from autograph._config import Environment

from conftest import states

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)


@pytest.mark.parametrize(
    "bad",
    [
        {"warmup": 0},
        {"warmup": 1.5},
        {"warmup": True},
        {"outputs": "clone"},
        {"max_graphs": -1},
        {"strict": "yes"},
    ],
)
def test_invalid_options_are_rejected_with_the_value(bad):
    ((name, value),) = bad.items()
    with pytest.raises(ValueError, match=f"{name}={value!r}"):
        autograph.graphed(**bad)


def test_unknown_option_names_the_known_ones():
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['warmups'\].*'warmup'"):
        autograph.graphed(warmups=2)


def test_decorator_works_bare_and_with_options(device):
    def f(x):
        return x * 2

    bare, with_options = autograph.graphed(f), autograph.graphed(warmup=2)(f)
    assert bare.__name__ == with_options.__name__ == "f" and bare.__wrapped__ is f
    for i in range(4):
        x = torch.full((3,), float(i), device=device)
        assert torch.equal(bare(x), x * 2) and torch.equal(with_options(x), x * 2)
    assert states(bare) == [("graphed", 4, 1, 3)]
    assert states(with_options) == [("graphed", 4, 2, 2)]


def test_non_callable_is_refused():
    with pytest.raises(TypeError, match="expects a function, a method or an nn.Module"):
        autograph.graphed(42)


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, Environment()),
        ({"AUTOGRAPH_DISABLE": "1"}, Environment(disable=True)),
        ({"AUTOGRAPH_DISABLE": "true", "AUTOGRAPH_STRICT": "on"}, Environment(True, True)),
        ({"AUTOGRAPH_DISABLE": "0", "AUTOGRAPH_LOG": "debug"}, Environment(log_level=10)),
    ],
)
def test_environment_is_parsed(env, expected):
    assert Environment.read(env) == expected


@pytest.mark.parametrize(
    "env", [{"AUTOGRAPH_DISABLE": "2"}, {"AUTOGRAPH_STRICT": "maybe"}, {"AUTOGRAPH_LOG": "verbose"}]
)
def test_unknown_environment_values_are_errors(env):
    with pytest.raises(ValueError, match=next(iter(env))):
        Environment.read(env)


def _run(code, **env):
    path = os.pathsep.join([ROOT, TESTS])  # TESTS: conftest's helpers
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": path, **env},
        timeout=120,
    )


def test_bad_environment_fails_at_import():
    result = _run("import autograph", AUTOGRAPH_LOG="loud")
    assert result.returncode != 0 and "AUTOGRAPH_LOG='loud' is not understood" in result.stderr


DISABLED_PROGRAM = """
import torch, autograph
from autograph.backends._cpu_graphs import emulate_graphs_on_cpu
from conftest import python_run_log
log_run = python_run_log()
@autograph.graphed
def f(x):
    log_run()
    return x + 1
with emulate_graphs_on_cpu():
    for _ in range(5):
        assert torch.equal(f(torch.zeros(3)), torch.ones(3))
print(len(log_run.runs), [(s.state, s.calls, s.eager_calls, s.replays) for s in autograph.stats()])
"""


def test_disable_variable_makes_every_call_eager_with_no_capture():
    # Read from the real environment at import. Python runs once per call only when nothing
    # is captured or replayed. (The engine's side, for functions, graphed modules and regions:
    # test_region.py::test_disabled_runs_every_call_eagerly_and_records_nothing.)
    result = _run(DISABLED_PROGRAM, AUTOGRAPH_DISABLE="1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "5 []"
    enabled = _run(DISABLED_PROGRAM, AUTOGRAPH_DISABLE="0")
    assert enabled.stdout.strip() == "2 [('graphed', 5, 1, 4)]", enabled.stderr


def test_log_variable_reports_captures():
    result = _run(DISABLED_PROGRAM, AUTOGRAPH_LOG="info")
    assert "autograph INFO: captured f(x: f32[3] cpu)" in result.stderr
