"""Autograd and hook state changed after capture (issue 35, section 2): parameters frozen or
unfrozen, module hooks added or removed, weights swapped in with ``p.data``. Each must give
eager's results; where the graph can follow, it is captured again and replays."""

import pytest
import torch

import autograph

from conftest import autograph_warnings, states


def backbone(device, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)).to(
        device
    )


def head(device, seed=1):
    torch.manual_seed(seed)
    return torch.nn.Linear(8, 1).to(device)


def batch(device, seed=2):
    torch.manual_seed(seed)
    return torch.randn(4, 8, device=device)


def grads(*modules):
    return [None if p.grad is None else p.grad.clone() for m in modules for p in m.parameters()]


def close(a, b):
    return len(a) == len(b) and all(
        (x is None and y is None)
        or (x is not None and y is not None and torch.allclose(x, y, rtol=1e-5, atol=1e-6))
        for x, y in zip(a, b)
    )


def same(a, b):
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a, b)
    )


def first_key(target):
    return next(iter(autograph.stats(target)))


# ---- requires_grad flipped after capture ----


@pytest.mark.parametrize("frozen_first", [True, False])
def test_a_backbone_frozen_or_unfrozen_after_capture_gets_eagers_gradients(device, frozen_first):
    graphed, eager = autograph.graphed(backbone(device)), backbone(device)
    heads = head(device), head(device)
    x = batch(device)
    for step in range(6):
        frozen = frozen_first == (step < 3)
        for body, top in zip((graphed, eager), heads):
            body.requires_grad_(not frozen)
            body.zero_grad(set_to_none=True)
            top.zero_grad(set_to_none=True)
            top(body(x)).sum().backward()
        assert same(grads(graphed, heads[0]), grads(eager, heads[1])), step
        assert (graphed[0].weight.grad is None) == frozen
    rows = [(s.state, s.replays) for s in autograph.stats(graphed)]
    assert len(rows) == 1 and rows[0][0] == "graphed" and rows[0][1] >= 2


# ---- forward hooks added or removed after capture ----


def _in_region(region, model, x):
    with region:
        return model(x)


def _as_eagerly_thrice(call, twin, x):
    for _ in range(3):
        assert torch.equal(call(x), twin(x))


def _hooks_added_then_removed(call, twin, x, add):
    """Three calls as captured, three with the hooks ``add()`` registers, three without."""
    with torch.no_grad():
        _as_eagerly_thrice(call, twin, x)
        handles = add()
        try:
            _as_eagerly_thrice(call, twin, x)
        finally:  # a global hook must not outlive the test
            for handle in handles:
                handle.remove()
        _as_eagerly_thrice(call, twin, x)


def _double(module, args, output):
    return output * 2


def _shift_input(module, args):
    return (args[0] + 1,)


@pytest.mark.parametrize("kind", ["forward", "forward_pre"])
def test_a_hook_added_to_a_submodule_after_capture_applies_and_stops_when_removed(device, kind):
    model, twin = autograph.graphed(backbone(device)), backbone(device)
    x = batch(device)
    hook = _double if kind == "forward" else _shift_input
    _hooks_added_then_removed(
        model,
        twin,
        x,
        lambda: [getattr(m[0], f"register_{kind}_hook")(hook) for m in (model, twin)],
    )
    [(state, calls, eager_calls, replays)] = states(model)
    assert (state, calls, eager_calls, replays) == ("graphed", 9, 1, 8)  # twice recaptured


def test_a_hook_added_or_removed_after_capture_in_a_region_applies_as_eagerly(device):
    model, twin = backbone(device), backbone(device)
    region, x = autograph.region(), batch(device)
    _hooks_added_then_removed(
        lambda x: _in_region(region, model, x),
        twin,
        x,
        lambda: [m[2].register_forward_hook(_double) for m in (model, twin)],
    )
    [(state, calls, eager_calls, replays)] = states(model)
    # captured at the third call (the region's warmup=2: a plain call, a watched warmup), then
    # twice recaptured
    assert (state, calls, eager_calls, replays) == ("graphed", 9, 2, 7)


def test_a_top_level_hook_removed_after_capture_in_a_region_stops_applying(device):
    model, twin = backbone(device), backbone(device)
    handles = [m.register_forward_hook(_double) for m in (model, twin)]
    region, x = autograph.region(), batch(device)
    with torch.no_grad():
        _as_eagerly_thrice(lambda x: _in_region(region, model, x), twin, x)
        for handle in handles:
            handle.remove()
        _as_eagerly_thrice(lambda x: _in_region(region, model, x), twin, x)
    [(state, calls, eager_calls, replays)] = states(model)
    # a plain call, a watched warmup, a capture; recaptured once the hook is removed
    assert (state, calls, eager_calls, replays) == ("graphed", 6, 2, 4)


def test_a_global_forward_hook_added_after_capture_applies_and_stops_when_removed(device):
    model, twin = autograph.graphed(backbone(device)), backbone(device)
    x = batch(device)

    def double_gelus(module, args, output):  # every GELU's output doubled, both models'
        return output * 2 if isinstance(module, torch.nn.GELU) else None

    _hooks_added_then_removed(
        model, twin, x, lambda: [torch.nn.modules.module.register_module_forward_hook(double_gelus)]
    )
    [(state, calls, eager_calls, replays)] = states(model)
    assert (state, calls, eager_calls, replays) == ("graphed", 9, 1, 8)


# ---- a module backward hook added after a training capture ----


def test_a_backward_pre_hook_added_after_a_training_capture_makes_the_key_eager(device, caught):
    model = autograph.graphed(backbone(device))
    x = batch(device)
    for _ in range(3):
        model(x).sum().backward()
    seen = []
    model[2].register_full_backward_pre_hook(lambda m, grad: seen.append(1))
    for _ in range(2):
        model(x).sum().backward()
    assert len(seen) == 2
    [(state, calls, eager_calls, replays)] = states(model)
    assert (state, calls, replays) == ("eager", 5, 2)  # the capture's replay, one more
    assert "backward hook" in first_key(model).fallback_reason
    assert any("backward hook" in w for w in autograph_warnings(caught))


# ---- weights swapped in with p.data ----


def _swap(model, ema):
    for p, e in zip(model.parameters(), ema.parameters()):
        p.data, e.data = e.data, p.data


def test_ema_weights_swapped_in_with_data_are_used_by_inference_replays(device):
    model, ema = autograph.graphed(backbone(device)), backbone(device, seed=5)
    twin, twin_ema = backbone(device), backbone(device, seed=5)
    x = batch(device)
    with torch.no_grad():
        for step in range(8):
            if step in (3, 6):
                _swap(model, ema)
                _swap(twin, twin_ema)
            assert torch.equal(model(x), twin(x)), step
    [(state, calls, eager_calls, replays)] = states(model)
    assert (state, calls) == ("graphed", 8) and replays >= 4


def test_ema_weights_swapped_in_with_data_are_used_by_training_replays(device):
    model, ema = autograph.graphed(backbone(device)), backbone(device, seed=5)
    twin, twin_ema = backbone(device), backbone(device, seed=5)
    x = batch(device)
    for step in range(8):
        if step in (3, 6):
            _swap(model, ema)
            _swap(twin, twin_ema)
        for m in (model, twin):
            m.zero_grad(set_to_none=True)
            out = m(x)
            out.sum().backward()
        assert torch.equal(model(x).detach(), twin(x).detach()), step
        # A captured backward may pick other kernels than eager's on a GPU: equal to rounding.
        assert close(grads(model), grads(twin)), step
    rows = [(s.state, s.replays) for s in autograph.stats(model)]
    assert len(rows) == 1 and rows[0][0] == "graphed" and rows[0][1] >= 4


def test_a_hook_registered_anew_for_every_call_ends_eager_with_the_reason(device, caught):
    model, twin = autograph.graphed(backbone(device)), backbone(device)
    x = batch(device)
    with torch.no_grad():
        for _ in range(8):
            handles = [m[0].register_forward_hook(_double) for m in (model, twin)]
            assert torch.equal(model(x), twin(x))
            for handle in handles:
                handle.remove()
    [(state, calls, eager_calls, replays)] = states(model)
    assert (state, calls) == ("eager", 8)
    reason = first_key(model).fallback_reason
    assert "the hooks of a Linear module it reaches" in reason
    assert "again after 2 captures" in reason
    assert len(autograph_warnings(caught)) == 1


def test_a_frozen_backbone_unfrozen_after_capture_in_a_region_gets_its_gradient(device):
    body, twin = backbone(device), backbone(device)
    tops = head(device), head(device)
    region, x = autograph.region(), batch(device)
    for step in range(6):
        for b, top in zip((body, twin), tops):
            b.requires_grad_(step >= 3)
            b.zero_grad(set_to_none=True)
            top.zero_grad(set_to_none=True)
        tops[0](_in_region(region, body, x)).sum().backward()
        tops[1](twin(x)).sum().backward()
        assert same(grads(body, tops[0]), grads(twin, tops[1])), step
    rows = [(s.state, s.replays) for s in autograph.stats(body)]
    assert len(rows) == 1 and rows[0][0] == "graphed" and rows[0][1] >= 2


def test_ema_weights_swapped_in_with_data_are_used_by_replays_in_a_region(device):
    model, ema = backbone(device), backbone(device, seed=5)
    twin, twin_ema = backbone(device), backbone(device, seed=5)
    region, x = autograph.region(), batch(device)
    with torch.no_grad():
        for step in range(6):
            if step == 3:
                _swap(model, ema)
                _swap(twin, twin_ema)
            assert torch.equal(_in_region(region, model, x), twin(x)), step
    [(state, calls, eager_calls, replays)] = states(model)
    # a plain call, a watched warmup, a capture (the third call), captured again once
    assert (state, calls, eager_calls, replays) == ("graphed", 6, 2, 4)
