"""Shared fixtures: the CPU emulation of CUDA graphs, and the CUDA marker."""
import gc
import warnings

import pytest
import torch

import autograph
from autograph._cpu_graphs import emulate_graphs_on_cpu

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                   reason="needs a CUDA GPU (run on the device machine)")


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU; skipped on machines without one")


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
