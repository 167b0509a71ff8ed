"""Dynamo compiling inside a region (transformers compiles a static cache's decode step there):
it traces a module's call as a call of its forward, as it does outside one, so the compiled
code's guards, checked at each of its calls, are no more than outside; code that names
``nn.Module.__call__`` itself compiles at most once for each side, not at every call."""

import math
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch._dynamo
from torch._dynamo.variables import nn_module as dynamo_modules

import autograph
from autograph.api import _region


class Recorder:
    """A Dynamo backend that counts compiles and keeps the files in the traced nodes' stacks."""

    def __init__(self):
        self.compiles, self.stacks = 0, []

    def __call__(self, gm, example_inputs):
        self.compiles += 1
        self.stacks += [n.meta.get("stack_trace") or "" for n in gm.graph.nodes]
        return gm.forward


def _model(layer=torch.nn.Linear):
    return torch.nn.Sequential(layer(8, 8), torch.nn.ReLU(), layer(8, 8))


class CallsSuper(torch.nn.Linear):
    """Calls ``nn.Module.__call__`` by name, as transformers' decoder layers do."""

    def __call__(self, *args, **kwargs):
        return super().__call__(*args, **kwargs)


def test_dynamo_traces_a_module_call_in_a_region_as_a_call_of_its_forward():
    torch._dynamo.reset()
    model, x, recorder = _model(), torch.randn(2, 8), Recorder()
    compiled = torch.compile(lambda x: model(x), backend=recorder)
    with torch.no_grad(), autograph.region():
        out = compiled(x)
    torch.testing.assert_close(out, model(x))
    traced = [s for s in recorder.stacks if s]
    assert traced and not [s for s in traced if "autograph" in s]  # no dispatcher frame
    torch._dynamo.reset()


def test_dynamo_takes_the_dispatcher_for_torchs_call_only_while_a_region_is_open():
    with autograph.region():
        assert dynamo_modules.unpatched_nn_module_call is _region._region_call
        with autograph.region():
            assert dynamo_modules.unpatched_nn_module_call is _region._region_call
        assert dynamo_modules.unpatched_nn_module_call is _region._region_call
    assert dynamo_modules.unpatched_nn_module_call is torch.nn.Module.__call__


def test_code_compiled_in_a_region_runs_in_and_out_of_regions_without_compiling_again():
    torch._dynamo.reset()
    model, x, recorder = _model(), torch.randn(2, 8), Recorder()
    compiled = torch.compile(lambda x: model(x), backend=recorder)
    with torch.no_grad():
        with autograph.region():
            compiled(x)
        for _ in range(3):
            compiled(x)
            with autograph.region():
                torch.testing.assert_close(compiled(x), model(x))
    assert recorder.compiles == 1
    torch._dynamo.reset()


def test_code_that_names_the_module_call_compiles_at_most_once_for_each_side_of_a_region():
    torch._dynamo.reset()
    model, x, recorder = _model(CallsSuper), torch.randn(2, 8), Recorder()
    compiled = torch.compile(lambda x: model(x), backend=recorder)
    with torch.no_grad():
        for _ in range(4):
            with autograph.region():
                torch.testing.assert_close(compiled(x), model(x))
        assert recorder.compiles == 1
        for _ in range(4):
            compiled(x)
            with autograph.region():
                compiled(x)
    assert recorder.compiles <= 2  # torch 2.13 guards on the call it named, 2.9 does not
    torch._dynamo.reset()


def test_a_region_graphs_its_module_calls_after_a_compile_inside_it(emulated):
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: _model()(x), backend=Recorder())
    graphed_later, x = torch.nn.Linear(8, 8), torch.randn(2, 8)
    with torch.no_grad(), autograph.region(warmup=1) as region:
        compiled(x)
        for _ in range(3):
            graphed_later(x)
    assert (region.stats().captures, region.stats().replays) == (1, 2)
    torch._dynamo.reset()


def test_a_full_backward_hook_runs_for_compiled_code_run_in_a_region():
    # Dynamo breaks its graph at a module with full backward hooks and runs that call itself;
    # starting a compile from a function put in nn.Module.__call__, torch drops the hook.
    torch._dynamo.reset()
    torch.manual_seed(0)
    hooked = torch.nn.Linear(8, 8)
    hooked.register_full_backward_hook(lambda module, grad_in, grad_out: (grad_in[0] * 10,))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), hooked)
    x = torch.randn(2, 8, requires_grad=True)
    compiled = torch.compile(lambda x: model(x), backend="eager")

    def input_grad(call):
        x.grad = None
        call(x).sum().backward()
        return x.grad.clone()

    expected = input_grad(model)
    with autograph.region():
        torch.testing.assert_close(input_grad(compiled), expected)
    torch.testing.assert_close(input_grad(compiled), expected)
    torch._dynamo.reset()


def _module_classes(count):
    """``count`` module classes, each with a forward of its own code (Dynamo's cache is per code
    object; torch.nn's own modules are not compiled as a frame of their own)."""
    classes = []
    for i in range(count):
        namespace = {}
        exec(f"def forward(self, x):\n    return x * {i + 2}", namespace)  # noqa: S102
        classes.append(type(f"Scale{i}", (torch.nn.Module,), {"forward": namespace["forward"]}))
    return classes


def test_a_compiled_container_of_many_module_classes_stays_compiled_in_a_region():
    # Dynamo does not compile torch.nn's own frames (a Sequential's forward): it runs them and
    # starts compiling at each module call they make, at the module's forward, not at the
    # dispatcher, one frame shared by every module class that would pass Dynamo's recompile
    # limit (8), after which the rest ran uncompiled.
    torch._dynamo.reset()
    model, recorder = torch.nn.Sequential(*[cls() for cls in _module_classes(10)]), Recorder()
    model.compile(backend=recorder)
    x = torch.randn(2, 8)
    with torch.no_grad(), autograph.region():
        for _ in range(2):
            torch.testing.assert_close(model(x), x * math.prod(range(2, 12)))
    assert recorder.compiles == 10
    assert not [s for s in recorder.stacks if "autograph" in s]
    torch._dynamo.reset()


_FIRST_COMPILE_IN_A_REGION = """
import sys, torch, autograph
assert "torch._dynamo" not in sys.modules
torch.manual_seed(0)
hooked = torch.nn.Linear(8, 8)
hooked.register_full_backward_hook(lambda module, grad_in, grad_out: (grad_in[0] * 10,))
model = torch.nn.Sequential(torch.nn.Linear(8, 8), hooked)
x = torch.randn(2, 8, requires_grad=True)
model(x).sum().backward()
expected, x.grad = x.grad.clone(), None
with autograph.region():
    torch.compile(lambda x: model(x), backend="eager")(x).sum().backward()
torch.testing.assert_close(x.grad, expected)
"""


def test_a_first_compile_inside_a_region_keeps_the_backward_hooks():
    # Dynamo imported by torch.compile inside the region: the dispatcher's frame is skipped
    # from the start (set through torch's C extension, which needs no import of Dynamo).
    subprocess.run(
        [sys.executable, "-c", _FIRST_COMPILE_IN_A_REGION],
        check=True,
        env={**os.environ, "PYTHONPATH": str(Path(autograph.__file__).parents[1])},
        timeout=300,
    )
