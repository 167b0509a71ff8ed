"""Warm restarts (issue 38): ``fn.save_plan(path)`` writes the keys a process captured, and a new
process's ``fn.capture(plan=path, **objects)`` captures them all ahead of time, so that its
first real call is a replay; a plan from another torch or device is refused (docs/design.md,
"Capture ahead"; docs/guide/serving.md, "Warm restarts")."""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

import autograph

from conftest import requires_cuda

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Run twice, in two fresh processes: "save" makes real calls and saves the plans, "restart"
# builds the same functions, captures from the plans, and makes its first real calls.
SCRIPT = textwrap.dedent(
    """
    import contextlib, dataclasses, json, sys
    import torch
    import autograph
    from autograph.testing import emulate_graphs_on_cpu

    phase, folder, device = sys.argv[1], sys.argv[2], sys.argv[3]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()).to(device)
    w = torch.randn(8, 8, device=device)

    def decode(x, cache):  # one cache per bucket, used by address
        cache.add_(x)
        return model(x) + cache

    step = autograph.graphed(decode, buckets=[2, 4, 8], static_argnames=("cache",))

    @autograph.graphed
    def scale(x, w, k=2.0):
        return (x @ w) * k

    head = torch.nn.Sequential(torch.nn.Linear(8, 3), torch.nn.Dropout(0.5)).to(device)
    head = autograph.graphed(head)
    caches = {b: torch.zeros(b, 8, device=device) for b in (2, 4, 8)}

    def rows(fn):
        return [dataclasses.asdict(r) for r in autograph.stats(fn)]

    with emulate_graphs_on_cpu() if device == "cpu" else contextlib.nullcontext():
        if phase == "save":
            head.eval()
            with torch.inference_mode():
                for _ in range(3):
                    step(torch.randn(3, 8, device=device), caches[4])
                    step(torch.randn(2, 8, device=device), caches[2])
                    scale(torch.randn(5, 8, device=device), w, k=3.0)
                    head(torch.randn(4, 8, device=device))
            saved = [
                step.save_plan(folder + "/step.json"),
                scale.save_plan(folder + "/scale.json"),
                head.forward.save_plan(folder + "/head.json"),
            ]
            print(json.dumps({"saved": saved, "stats": rows(step) + rows(scale) + rows(head)}))
            sys.exit()
        # A new process: nothing called yet. The head is in training mode here; its plan's
        # key was captured in eval mode, which capture(plan=) enters and leaves.
        captured = step.capture(plan=folder + "/step.json", cache=autograph.per_bucket(caches))
        captured += scale.capture(plan=folder + "/scale.json")
        captured += head.forward.capture(plan=folder + "/head.json")
        out = {"captured": [r.state for r in captured], "head_trains": head.training}
        out["before"] = rows(step) + rows(scale) + rows(head)
        head.eval()
        with torch.inference_mode():
            x = torch.randn(3, 8, device=device)
            y = torch.randn(5, 8, device=device)
            z = torch.randn(4, 8, device=device)
            cache = caches[4].clone()
            padded = torch.cat([x, x.new_zeros(1, 8)])
            expected = (model(padded) + cache.add_(padded))[:3]
            out["step_equal"] = torch.allclose(step(x, caches[4]), expected)
            out["cache_equal"] = torch.equal(caches[4], cache)
            out["scale_equal"] = torch.allclose(scale(y, w, k=3.0), (y @ w) * 3.0)
            eager = head[1](head[0](z))
            out["head_equal"] = torch.allclose(head(z), eager)
        out["after"] = rows(step) + rows(scale) + rows(head)
        print(json.dumps(out))
    """
)


def _run(script, phase, folder, device):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AUTOGRAPH_LOG": ""}
    done = subprocess.run(
        [sys.executable, str(script), phase, str(folder), device],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, requires_cuda])]
)
def test_a_plan_saved_in_one_process_makes_a_fresh_process_first_call_a_replay(tmp_path, device):
    """On CPU through the emulation, on the GPU with real graphs: each in two fresh processes."""
    script = tmp_path / "serve.py"
    script.write_text(SCRIPT)
    saved = _run(script, "save", tmp_path, device)
    assert saved["saved"] == [2, 1, 1]  # buckets 4 and 2 of step; scale; the head
    assert all(r["state"] == "graphed" and r["eager_calls"] == 1 for r in saved["stats"])

    restarted = _run(script, "restart", tmp_path, device)
    assert restarted["captured"] == ["graphed"] * 4
    assert restarted["head_trains"] is True  # its training flag put back after capture
    # Captured ahead, not called: no key has run yet.
    before = {(r["function"], r["key"]): r for r in restarted["before"]}
    assert set(before) == {(r["function"], r["key"]) for r in saved["stats"]}
    assert all(r["state"] == "graphed" and r["calls"] == 0 for r in before.values())
    # The first real call of each function is a replay, and its values are eager's.
    first = {r["function"]: r for r in restarted["after"] if r["calls"]}
    assert set(first) == {"decode", "scale", "Sequential"}
    for row in first.values():
        assert row["state"] == "graphed", row
        assert row["calls"] == 1 and row["eager_calls"] == 0 and row["replays"] >= 1, row
    assert first["decode"]["bucket"] == 4
    assert restarted["step_equal"] and restarted["cache_equal"]
    assert restarted["scale_equal"] and restarted["head_equal"]


# A training step's key: its plan is saved after real steps, and a new process's first step
# (forward and backward) replays and gives eager's gradients.
TRAINING_SCRIPT = textwrap.dedent(
    """
    import contextlib, json, sys
    import torch
    import autograph
    from autograph.testing import emulate_graphs_on_cpu

    phase, folder, device = sys.argv[1], sys.argv[2], sys.argv[3]
    torch.manual_seed(0)
    def mlp():
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model, reference = mlp().to(device), mlp().to(device)
    reference.load_state_dict(model.state_dict())
    trained = autograph.graphed(model)

    def rows():
        return [(r.state, r.calls, r.eager_calls, r.replays) for r in autograph.stats(trained)]

    with emulate_graphs_on_cpu() if device == "cpu" else contextlib.nullcontext():
        if phase == "save":
            for _ in range(3):
                trained(torch.randn(4, 8, device=device)).sum().backward()
            print(json.dumps({"saved": trained.forward.save_plan(folder + "/t.json")}))
            sys.exit()
        captured = [r.state for r in trained.forward.capture(plan=folder + "/t.json")]
        before = rows()
        x = torch.randn(4, 8, device=device)
        trained(x).sum().backward()
        reference(x).sum().backward()
        grads = zip(model.parameters(), reference.parameters())
        equal = all(torch.allclose(a.grad, b.grad) for a, b in grads)
        print(json.dumps({"captured": captured, "before": before, "after": rows(), "equal": equal}))
    """
)


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, requires_cuda])]
)
def test_a_training_plan_makes_a_fresh_process_first_step_a_replay(tmp_path, device):
    script = tmp_path / "train.py"
    script.write_text(TRAINING_SCRIPT)
    assert _run(script, "save", tmp_path, device) == {"saved": 1}
    restarted = _run(script, "restart", tmp_path, device)
    assert restarted["captured"] == ["graphed"]
    assert restarted["before"] == [["graphed", 0, 0, 0]]
    assert restarted["after"] == [["graphed", 1, 0, 1]]
    assert restarted["equal"]


def _saved_plan(tmp_path, **options):
    """A graphed function called until graphed, its plan saved and its graphs dropped."""

    @autograph.graphed(**options)
    def scale(x, k=2.0):
        return x * k

    with torch.inference_mode():
        for _ in range(2):
            scale(torch.ones(4, 3), k=3.0)
    path = tmp_path / "scale.json"
    assert scale.save_plan(path) == 1
    scale.reset()
    return scale, path


def test_a_plan_captures_in_this_process_too_with_its_recorded_mode_and_values(emulated, tmp_path):
    scale, path = _saved_plan(tmp_path)
    rows = scale.capture(plan=path)  # outside inference mode: the plan's mode is entered
    assert [(r.state, r.calls) for r in rows] == [("graphed", 0)]
    assert torch.is_inference_mode_enabled() is False
    with torch.inference_mode():
        x = torch.randn(4, 3)
        assert torch.equal(scale(x, k=3.0), x * 3.0)
    assert [(r.state, r.calls, r.eager_calls, r.replays) for r in scale.stats()] == [
        ("graphed", 1, 0, 1)
    ]


def _edited(path, **fields):
    plan = json.loads(path.read_text())
    plan.update(fields)
    path.write_text(json.dumps(plan))


def test_a_plan_from_another_torch_is_refused_with_what_differs_and_the_fix(emulated, tmp_path):
    scale, path = _saved_plan(tmp_path)
    _edited(path, torch="2.0.0")
    with pytest.raises(ValueError) as raised:
        scale.capture(plan=path)
    message = str(raised.value)
    assert "scale.capture(plan=" in message and str(path) in message
    assert "torch 2.0.0" in message and f"torch {torch.__version__}" in message
    assert "save a new plan with" in message and "scale.save_plan(path)" in message
    assert scale.stats() == []


def test_a_plan_from_another_device_is_refused_with_what_differs_and_the_fix(emulated, tmp_path):
    scale, path = _saved_plan(tmp_path)
    _edited(path, device=["NVIDIA A100-SXM4-80GB"])
    with pytest.raises(ValueError) as raised:
        scale.capture(plan=path)
    message = str(raised.value)
    assert "scale.capture(plan=" in message and str(path) in message
    assert "saved on NVIDIA A100-SXM4-80GB" in message and "cpu-emulation" in message
    assert "save a new plan with" in message and "scale.save_plan(path)" in message
    assert scale.stats() == []


def test_a_plan_of_another_format_or_other_key_options_is_refused(emulated, tmp_path):
    scale, path = _saved_plan(tmp_path, buckets=[2, 4])
    _edited(path, version=99)
    with pytest.raises(ValueError, match=r"scale.capture\(plan=.*format version is 99"):
        scale.capture(plan=path)

    other, path = _saved_plan(tmp_path, buckets=[2, 4])
    again = autograph.graphed(other.__wrapped__, buckets=[2, 4, 8])
    with pytest.raises(ValueError, match=r"buckets: plan \[2, 4\], now \[2, 4, 8\]"):
        again.capture(plan=path)


def test_an_object_the_plan_cannot_hold_must_be_given_by_name(emulated, tmp_path):
    @autograph.graphed(buckets=[2, 4, 8], static_argnames=("cache",))
    def store(x, cache):
        cache.add_(x)
        return x * 2

    caches = {b: torch.zeros(b, 3) for b in (2, 4, 8)}
    for _ in range(2):
        store(torch.ones(3, 3), caches[4])
        store(torch.ones(1, 3), caches[2])
    path = tmp_path / "store.json"
    assert store.save_plan(path) == 2
    store.reset()
    with pytest.raises(ValueError, match=r"store.capture\(plan=.*take cache by identity.*per_b"):
        store.capture(plan=path)
    with pytest.raises(ValueError, match=r"cahce given, but no key of the plan takes it"):
        store.capture(plan=path, cache=caches[4], cahce=caches[4])
    before = {b: c.clone() for b, c in caches.items()}
    # A mapping for the plan's buckets only: bucket 8, which no call used, is not captured.
    rows = store.capture(plan=path, cache=autograph.per_bucket({4: caches[4], 2: caches[2]}))
    assert [(r.bucket, r.state) for r in rows] == [(4, "graphed"), (2, "graphed")]
    assert all(torch.equal(caches[b], before[b]) for b in caches)  # the warmups' writes undone
    x = torch.randn(3, 3)
    assert torch.equal(store(x, caches[4]), x * 2)
    assert torch.equal(caches[4][:3], before[4][:3] + x)
    assert sorted((r.bucket, r.state, r.eager_calls, r.replays) for r in store.stats()) == [
        (2, "graphed", 0, 0),
        (4, "graphed", 0, 1),
    ]


def test_keys_not_graphed_are_left_out_of_the_plan(emulated, tmp_path):
    @autograph.graphed
    def halve(x):
        if x.sum().item() > 0:  # a host read: runs eagerly
            return x / 2
        return x

    with pytest.warns(autograph.AutographWarning, match="runs eagerly"):
        for _ in range(3):
            halve(torch.ones(2))
    assert [r.state for r in halve.stats()] == ["eager"]
    path = tmp_path / "halve.json"
    assert halve.save_plan(path) == 0
    assert json.loads(path.read_text())["entries"] == []


def test_a_key_of_the_plan_that_does_not_come_out_graphed_is_said(emulated, tmp_path):
    @autograph.graphed(static_argnames=("cache",))
    def shift(x, cache):
        return x + cache.sum()

    cache = torch.ones(5)
    for _ in range(2):
        shift(torch.ones(2), cache)
    path = tmp_path / "shift.json"
    assert shift.save_plan(path) == 1
    shift.reset()
    other = torch.ones(7)  # not the cache the plan's calls passed: another key
    with pytest.warns(
        autograph.AutographWarning,
        match=r"1 of the plan's 1 keys did not come out graphed: x: f32\[2\] cpu, cache: f32\[5\]",
    ):
        rows = shift.capture(plan=path, cache=other)
    assert [(r.key, r.state) for r in rows] == [("x: f32[2] cpu, cache: f32[7] cpu", "graphed")]
