"""torch.compile and autograph, in either order (CPU: the emulation and Dynamo backends
whose ops go through the dispatcher; the CUDA tests also use Inductor)."""

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

import autograph
from autograph.backends._cpu_graphs import CpuGraphs

from conftest import requires_cuda
from helpers.torch_versions import compiles_per_mode_stack


def step(x, acc):
    acc.add_(x.mean(0))
    return torch.nn.functional.gelu(x) * 2 + acc


class CountingBackend:
    """Compiles with ``inner`` and counts compiles and runs of the compiled graphs."""

    def __init__(self, inner="eager"):
        self.inner, self.compiles, self.runs = inner, 0, 0

    def __call__(self, gm, example_inputs):
        self.compiles += 1
        compiled = (
            gm.forward
            if self.inner == "eager"
            else torch._dynamo.backends.registry.lookup_backend(self.inner)(gm, example_inputs)
        )

        def run(*args):
            self.runs += 1
            return compiled(*args)

        return run


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _calls(fn, reference, device, n=5, mode=torch.no_grad):
    acc, acc_ref = torch.zeros(16, device=device), torch.zeros(16, device=device)
    with mode():
        for _ in range(n):
            x = torch.randn(8, 16, device=device)
            torch.testing.assert_close(fn(x, acc), reference(x, acc_ref))
    torch.testing.assert_close(acc, acc_ref)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_graphed_compiled_function_compiles_and_captures_the_compiled_code(device, backend, mode):
    counting = CountingBackend(backend)
    compiled = torch.compile(step, backend=counting)
    graphed = autograph.graphed(compiled)
    _calls(graphed, step, device, mode=mode)
    (stats,) = graphed.stats()
    assert (stats.state, stats.replays) == ("graphed", 4)
    # Compiled under the guard (warmup), then run inside the capture; never re-run by replays.
    # inference_mode: the static copies are normal tensors (for their version counters), so
    # the capture compiles once more; so does torch < 2.10 for the capture's modes.
    again = mode is torch.inference_mode or (device == "cpu" and compiles_per_mode_stack())
    assert counting.compiles == (2 if again else 1)
    assert counting.runs == 2


def test_compiled_function_keeps_compiling_after_autograph(device):
    counter = CompileCounter()
    compiled = torch.compile(step, backend=counter)
    _calls(autograph.graphed(compiled), step, device)
    # torch < 2.10 compiles again under the emulation's recorder (another mode stack).
    compiles = 2 if device == "cpu" and compiles_per_mode_stack() else 1
    assert counter.frame_count == compiles
    _calls(compiled, step, device)  # called directly: the cached code, no new compile
    assert counter.frame_count == compiles
    assert counters["frames"]["total"] == counters["frames"]["ok"]


def test_emulated_capture_records_the_compiled_graphs_ops(emulated, monkeypatch):
    recorded = []
    capture = CpuGraphs.capture

    def recording(self, run, *args, **kwargs):
        result = capture(self, run, *args, **kwargs)
        recorded.append([op.func.overloadpacket.__name__ for op in result.graph.ops])
        return result

    monkeypatch.setattr(CpuGraphs, "capture", recording)
    _calls(autograph.graphed(torch.compile(step, backend="aot_eager")), step, "cpu")
    # AOTAutograd's functional graph: out-of-place add, then copy_ into the argument.
    assert recorded == [["mean", "add", "gelu", "mul", "add", "copy_"]]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_around_graphed_function_steps_aside(device, backend):
    counting = CountingBackend(backend)
    graphed = autograph.graphed(step)
    _calls(torch.compile(graphed, backend=counting), step, device)
    assert counting.compiles == 1  # the user's function, inlined in one graph
    assert not counters["graph_break"]
    assert counters["frames"]["total"] <= 2  # GraphedFunction.__call__ (skipped), the engine
    assert graphed.stats() == []  # autograph stepped aside: no key, no graph


def test_graphed_module_inside_compiled_model_fullgraph(device):
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = autograph.graphed(torch.nn.Linear(16, 16))
            self.head = torch.nn.Linear(16, 4)

        def forward(self, x):
            return self.head(torch.relu(self.block(x)))

    model = Model().to(device).eval()
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(2, 16, device=device)
            expected = model.head(
                torch.relu(torch.nn.functional.linear(x, model.block.weight, model.block.bias))
            )
            torch.testing.assert_close(compiled(x), expected)
    assert counter.frame_count == 1


def test_item_in_compiled_function_falls_back_with_the_users_line(device, caught):
    def scaled(x):
        return x / x.abs().max().item() + 1

    graphed = autograph.graphed(torch.compile(scaled, backend="eager"))
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(8, device=device)
            torch.testing.assert_close(graphed(x), scaled(x))
    (stats,) = graphed.stats()
    assert stats.state == "eager" and ".item()" in stats.fallback_reason
    assert "test_compile.py" in stats.fallback_reason


@requires_cuda
@pytest.mark.cuda
def test_graphed_inductor_function_captures_triton_kernels():
    from torch._inductor.runtime import triton_heuristics

    launches = []
    run = triton_heuristics.CachingAutotuner.run

    def counting(self, *args, **kwargs):
        launches.append(torch.cuda.is_current_stream_capturing())
        return run(self, *args, **kwargs)

    triton_heuristics.CachingAutotuner.run = counting
    try:
        graphed = autograph.graphed(torch.compile(step))
        _calls(graphed, step, "cuda")
    finally:
        triton_heuristics.CachingAutotuner.run = run
    (stats,) = graphed.stats()
    assert stats.state == "graphed", stats.fallback_reason  # Inductor's autotuning syncs ignored
    assert any(launches) and not all(launches)  # Triton kernels launched inside the capture


@requires_cuda
@pytest.mark.cuda
def test_a_compiled_function_of_a_changing_float_stays_graphed():
    # torch.compile passes a float argument that changes as a CPU scalar its compiled code
    # reads back on the host; the key went eager with "computing with a CPU tensor" at the
    # user's line, though the float is already part of the key.
    graphed = autograph.graphed(torch.compile(lambda x, y: x + y))
    x = torch.randn(256, device="cuda")
    for y in [1.0, 2.0, 3.0, 4.0] * 4:
        torch.testing.assert_close(graphed(x, y), x + y)
    rows = graphed.stats()
    assert len(rows) == 4 and all(r.state == "graphed" and r.replays >= 1 for r in rows), rows


def _inductor_works_on_cpu():
    try:
        torch.compile(lambda t: t + 1)(torch.zeros(1))
        return True
    except Exception:  # no C++ compiler on this machine
        return False


def test_emulation_refuses_inductor_kernels_it_cannot_record(emulated, caught):
    if not _inductor_works_on_cpu():
        pytest.skip("Inductor cannot compile for the CPU here")
    graphed = autograph.graphed(torch.compile(step))
    _calls(graphed, step, "cpu")  # right results: the key runs eagerly, said loudly
    (stats,) = graphed.stats()
    assert stats.state == "eager" and "Inductor" in stats.fallback_reason
