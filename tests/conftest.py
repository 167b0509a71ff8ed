"""Shared fixtures: the CPU emulation of CUDA graphs, and the CUDA marker."""

import gc
import re
import warnings

import pytest
import torch

import autograph
from autograph.testing import emulate_graphs_on_cpu

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU; skipped on machines without one")
    config.addinivalue_line(
        "markers",
        "payoff: keeps the CUDA payoff clock (check_payoff): "
        "its keys may go eager on measured timings",
    )


def pytest_collection_finish(session):
    # Every test ends with gc.collect() (graphs in reference cycles must be freed before the
    # next test measures memory). Scanning torch's and the test modules' objects took 0.2 s a
    # test; frozen, they are skipped, and what tests make is still collected.
    gc.collect()
    gc.freeze()


@pytest.fixture
def emulated():
    """Run the real engine on CPU tensors, with recorded-op replay standing in for CUDA graphs."""
    with emulate_graphs_on_cpu():
        yield
    autograph.reset()


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, requires_cuda])])
def device(request):
    """Run a test twice: on CPU tensors through the emulation, and on the GPU with real graphs."""
    if request.param == "cpu":
        with emulate_graphs_on_cpu():
            yield "cpu"
    else:
        yield "cuda"


def device_label(device):
    """How a key names the device: ``cpu`` or ``cuda:0``."""
    return "cuda:0" if device == "cuda" else "cpu"


def states(target):
    """``(state, calls, eager_calls, replays)`` of each key of ``target`` (a graphed function
    or module, a module called in a region, a region), in the order the keys were made.

    A test of graph behaviour asserts these: values alone would also be right if every call
    ran eagerly. The rows of a key's islands (module calls graphed inside its eager calls,
    ``function > Module``) are left out: tests of islands read ``stats()`` themselves."""
    return [
        (s.state, s.calls, s.eager_calls, s.replays)
        for s in autograph.stats(target)
        if " > " not in s.function
    ]


def python_run_log():
    """``log_run = python_run_log()``; ``log_run(x.shape[0])`` (or ``log_run()``) in the
    Python of a graphed function; then ``log_run.runs == [4, 4]``: what each run of that
    Python logged, in order. Warmups and captures run it; replays run none.

    Tests count runs of a function's Python through this, never through a list, an int or an
    attribute the function can reach (a closure, a global, an argument, the module): a call
    that changes Python state it reaches makes its key eager (docs/design.md, "Python state";
    ``autograph/watch/_python_state.py``), which would turn a test of graphs into a test of that
    rule. Functions are never walked as a call's state, so what this logs is out of the call's
    reach, as a print is."""

    def log_run(value=1):
        log_run.runs.append(value)

    log_run.runs = []
    return log_run


def is_label_of(label, cls):
    """Module labels are ``Name`` for the first module of a class graphed in the process, then
    ``Name#2``, ``Name#3``... (a process-wide counter: never assert the number)."""
    return re.fullmatch(rf"{cls.__name__}(#[2-9]|#[1-9][0-9]+)?", label) is not None


@pytest.fixture(autouse=True)
def _no_payoff_timings(request, monkeypatch):
    """On CUDA, keys are judged by their measured replay and eager times (check_payoff), which
    vary from run to run: a tiny test function's graph may well lose to its one eager kernel.
    Tests of graph behaviour need every key to keep its graph, so the CUDA clock is off
    except in tests marked ``payoff`` (the emulation has none unless a test sets one)."""
    if request.node.get_closest_marker("payoff") is None:
        from autograph.backends._cuda_graphs import CudaGraphs

        monkeypatch.setattr(CudaGraphs, "payoff_clock", staticmethod(lambda device: None))


@pytest.fixture(autouse=True)
def _clean_state():
    yield
    autograph.reset()
    gc.collect()


@pytest.fixture
def caught():
    """Every warning raised in the test, kept in a list."""
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        yield records


def autograph_warnings(records):
    return [str(r.message) for r in records if issubclass(r.category, autograph.AutographWarning)]
