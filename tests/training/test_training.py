"""Graphed training (docs/design.md, "Training graphs"): forward and backward graphs per key, and
the whole step."""

import contextlib

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import autograph

from conftest import autograph_warnings, requires_cuda, states
from helpers.training import batches, grads_of, mlp, same

# ---- forward and backward graphs per key ----


def test_a_graphed_module_trains_bitwise_as_eager(device, caught):
    def train(wrap):
        model = wrap(mlp(device, dropout=0.25))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        data = batches(device, 8, requires_grad=True)
        torch.manual_seed(2)  # dropout masks: the same seed, the same masks
        record = []
        for x in data:
            optimizer.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            optimizer.step()
            record.append((loss.detach(), x.grad, grads_of(model)))
        return model, record

    _, eager = train(lambda m: m)
    model, graphed = train(autograph.graphed)
    for (loss_e, x_e, g_e), (loss_g, x_g, g_g) in zip(eager, graphed):
        assert torch.equal(loss_e, loss_g) and torch.equal(x_e, x_g) and same(g_e, g_g)
    assert states(model) == [("graphed", 8, 1, 7)]
    (row,) = autograph.stats(model)
    assert "requires_grad (train)" in row.key and row.capture_seconds > 0
    assert autograph_warnings(caught) == []


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradients_accumulate_over_several_backward_passes(device, set_to_none):
    def train(wrap):
        model = wrap(mlp(device))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        data = batches(device, 12)
        record = []
        for step in range(4):
            optimizer.zero_grad(set_to_none=set_to_none)
            for x in data[3 * step : 3 * step + 3]:  # three micro-batches per step
                (model(x).square().mean() / 3).backward()
                record.append(grads_of(model))
            optimizer.step()
        return model, record

    _, eager = train(lambda m: m)
    model, graphed = train(autograph.graphed)
    assert all(same(e, g) for e, g in zip(eager, graphed))
    assert states(model) == [("graphed", 12, 1, 11)]


def test_gradients_reach_inputs_computed_with_gradients(device):
    def run(wrap):
        torch.manual_seed(0)
        embed = torch.nn.Embedding(10, 8).to(device)
        body = wrap(mlp(device))
        ids = torch.arange(16, device=device) % 10
        for _ in range(3):
            body(embed(ids)).sum().backward()
        return body, embed.weight.grad, grads_of(body)

    _, embed_e, body_e = run(lambda m: m)
    body, embed_g, body_g = run(autograph.graphed)
    assert torch.equal(embed_e, embed_g) and same(body_e, body_g)
    assert states(body) == [("graphed", 3, 1, 2)]


def test_a_decorated_function_trains_its_closed_over_weights(device):
    def run(wrap):
        torch.manual_seed(0)
        w1 = torch.randn(8, 16, device=device, requires_grad=True)
        w2 = torch.randn(16, 1, device=device, requires_grad=True)

        def step(x, scale):
            return torch.tanh(x @ w1) @ w2 * scale

        step = wrap(step)
        inputs = batches(device, 4, requires_grad=True)
        for x in inputs:
            step(x, 0.5).sum().backward()
        return step, [w1.grad, w2.grad] + [x.grad for x in inputs]

    _, eager = run(lambda f: f)
    step, graphed = run(autograph.graphed)
    assert same(eager, graphed)
    assert states(step) == [("graphed", 4, 1, 3)]


class Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 4)

    @autograph.graphed
    def forward(self, x):
        return torch.log_softmax(self.linear(x), -1)


def test_a_graphed_method_trains_each_instance(device):
    torch.manual_seed(0)
    heads = [Head().to(device), Head().to(device)]
    twins = [Head().to(device), Head().to(device)]
    for head, twin in zip(heads, twins):
        twin.load_state_dict(head.state_dict())
    for x in batches(device, 3):
        for head, twin in zip(heads, twins):
            head(x).sum().backward()
            with autograph.region(enabled=False):
                twin(x).sum().backward()
    for head, twin in zip(heads, twins):
        assert same(grads_of(head), grads_of(twin))
    assert states(Head.forward) == [("graphed", 3, 1, 2), ("graphed", 3, 1, 2)]


def test_outputs_without_gradients_and_non_tensor_outputs_pass_through(device):
    def step(x, w):
        y = x @ w
        return {
            "y": y,
            "z": y.sin(),
            "top": y.argmax(-1),
            "kind": "scores",
            "frozen": y.detach() * 2,
        }

    graphed = autograph.graphed(step)
    for fn in (step, graphed):
        torch.manual_seed(0)
        w = torch.randn(8, 3, device=device, requires_grad=True)
        for x in batches(device, 3):
            out = fn(x, w)
            assert out["kind"] == "scores" and not out["top"].requires_grad
            assert out["y"].requires_grad and not out["frozen"].requires_grad
            out["y"].sum().backward()  # "z" gets no gradient: zeros in the graph
        if fn is step:
            eager = (w.grad.clone(), out["top"], out["frozen"])
    assert torch.equal(w.grad, eager[0]) and torch.equal(out["top"], eager[1])
    assert torch.equal(out["frozen"], eager[2])
    assert states(graphed) == [("graphed", 3, 1, 2)]


def test_retain_graph_and_autograd_grad_work(device):
    def run(wrap):
        model = wrap(mlp(device))
        x = batches(device, 1, requires_grad=True)[0]
        out = model(x)  # warmup
        out.sum().backward()
        out = model(x)  # capture
        out.sum().backward(retain_graph=True)
        again = model(x)  # runs eagerly: out's backward may run again
        out.sum().backward()
        (dx,) = torch.autograd.grad(again.square().sum(), x)
        later = model(x)  # nothing pending: replays
        (dx_later,) = torch.autograd.grad(later.square().sum(), x)
        return model, grads_of(model), x.grad, dx, dx_later

    eager = run(lambda m: m)
    graphed = run(autograph.graphed)
    assert same(eager[1], graphed[1])
    assert all(torch.equal(a, b) for a, b in zip(eager[2:], graphed[2:]))
    assert states(graphed[0]) == [("graphed", 4, 2, 2)]


@pytest.mark.cuda
@requires_cuda
def test_a_loop_that_keeps_the_last_loss_while_the_next_forward_runs_is_graphed():
    # The previous loss keeps its autograd graph, and so the parameters' AccumulateGrad
    # nodes, alive during the next forward: the nodes made at warmup are the ones the
    # capture and every replay meet (torch >= 2.9 accumulates on a node's own stream).
    def train(wrap):
        model = wrap(mlp("cuda"))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        for x in batches("cuda", 6):
            optimizer.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            optimizer.step()
            losses.append(loss)  # kept, with its autograd graph
        return model, losses, [p.detach().clone() for p in model.parameters()]

    _, eager_losses, eager_params = train(lambda m: m)
    model, losses, params = train(autograph.graphed)
    assert all(torch.equal(a, b) for a, b in zip(eager_losses, losses))
    assert all(torch.equal(a, b) for a, b in zip(eager_params, params))
    assert states(model) == [("graphed", 6, 1, 5)]


@pytest.mark.cuda
@requires_cuda
def test_an_autograd_graph_kept_from_before_autograph_is_named_with_the_fix(caught):
    model = mlp("cuda")
    x = batches("cuda", 1)[0]
    kept = model(x).sum()  # eager, before autograph: its graph holds the parameters' nodes
    graphed = autograph.graphed(model)
    twin = mlp("cuda")
    for _ in range(3):
        graphed(x).sum().backward()
        twin(x).sum().backward()
    assert same(grads_of(model), grads_of(twin))
    row = autograph.stats(graphed)[0]  # its own key (its island's rows follow)
    # torch >= 2.9 accumulates a gradient on its node's own stream (and says so in a warning
    # that this setter silences); before, the kept graph did not matter
    if hasattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch"):
        assert "del loss" in row.fallback_reason and "default stream" in row.fallback_reason
        assert states(graphed) == [("eager", 3, 3, 0)]
    else:
        assert states(graphed) == [("graphed", 3, 1, 2)]
    del kept


def test_double_backward_through_a_graphed_call_says_how_to_run_it_eagerly(device):
    model = autograph.graphed(mlp(device))
    x = batches(device, 1, requires_grad=True)[0]
    model(x).sum().backward()
    out = model(x)
    with pytest.raises(RuntimeError, match=r"create_graph=True.*region\(enabled=False\)"):
        torch.autograd.grad(out.sum(), x, create_graph=True)
    with autograph.region(enabled=False):
        (dx,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
    assert dx.requires_grad
    assert states(model)[0][0] == "graphed"


def test_a_call_made_before_the_previous_backward_runs_eagerly(device):
    def run(wrap):
        model = wrap(mlp(device, dropout=0.5))
        data = list(zip(batches(device, 4), batches(device, 4, seed=2)))
        torch.manual_seed(3)  # dropout masks
        for x, y in data:
            loss = model(x).mean() + model(y).mean()  # two forwards, one backward
            loss.backward()
        return model, grads_of(model)

    _, eager = run(lambda m: m)
    model, graphed = run(autograph.graphed)
    assert same(eager, graphed)
    # the first call warms up and the second is captured; then in each step the first call
    # replays and the second finds the first's backward still to run
    assert states(model) == [("graphed", 8, 4, 4)]


def test_train_and_eval_are_separate_keys_and_dropout_follows(device):
    def run(wrap):
        model = wrap(mlp(device, dropout=0.5))
        data = batches(device, 3)
        torch.manual_seed(4)  # dropout masks
        record = []
        for x in data:
            model.train()
            model(x).sum().backward()
            model.eval()
            with torch.no_grad():
                record.append(model(x))
        return model, record, grads_of(model)

    _, eager_out, eager_grads = run(lambda m: m)
    model, outs, grads = run(autograph.graphed)
    assert all(torch.equal(a, b) for a, b in zip(eager_out, outs)) and same(eager_grads, grads)
    keys = [row.key for row in autograph.stats(model)]
    assert "(train)" in keys[0] and "(no_grad, eval)" in keys[1]
    assert states(model) == [("graphed", 3, 1, 2), ("graphed", 3, 1, 2)]


def test_batch_norm_statistics_and_gradients_as_eager(device):
    def run(wrap):
        torch.manual_seed(0)
        model = wrap(
            torch.nn.Sequential(
                torch.nn.Linear(8, 16),
                torch.nn.BatchNorm1d(16),
                torch.nn.ReLU(),
                torch.nn.Linear(16, 1),
            ).to(device)
        )
        for x in batches(device, 4):
            model(x).sum().backward()
        return model, grads_of(model), [b.clone() for b in model.buffers()]

    _, eager_grads, eager_buffers = run(lambda m: m)
    model, grads, buffers = run(autograph.graphed)
    assert same(eager_grads, grads) and same(eager_buffers, buffers)
    assert states(model) == [("graphed", 4, 1, 3)]


def test_a_conv_net_trains_as_eager(device):
    def run(wrap):
        torch.manual_seed(0)
        model = wrap(
            torch.nn.Sequential(
                torch.nn.Conv2d(3, 8, 3, padding=1),
                torch.nn.ReLU(),
                torch.nn.Flatten(),
                torch.nn.Linear(8 * 36, 2),
            ).to(device)
        )
        torch.manual_seed(1)
        for _ in range(3):
            model(torch.randn(4, 3, 6, 6, device=device)).sum().backward()
        return model, grads_of(model)

    _, eager = run(lambda m: m)
    model, graphed = run(autograph.graphed)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(eager, graphed))
    assert states(model) == [("graphed", 3, 1, 2)]


def test_autocast_with_a_grad_scaler_trains_as_eager(device):
    dtype = torch.float16 if device == "cuda" else torch.bfloat16

    def train(wrap):
        model = wrap(mlp(device))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler(device, init_scale=1024.0)
        losses = []
        for x in batches(device, 5):
            optimizer.zero_grad()
            with torch.autocast(device, dtype=dtype):
                loss = model(x).float().square().mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            losses.append(loss.detach())
        return model, losses, [p.detach().clone() for p in model.parameters()]

    _, eager_losses, eager_params = train(lambda m: m)
    model, losses, params = train(autograph.graphed)
    assert all(torch.equal(a, b) for a, b in zip(eager_losses, losses))
    assert all(torch.equal(a, b) for a, b in zip(eager_params, params))
    (row,) = autograph.stats(model)
    assert "autocast" in row.key and states(model) == [("graphed", 5, 1, 4)]


class Checkpointed(torch.nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.inner, self.outer, self.reentrant = (
            torch.nn.Linear(8, 8),
            torch.nn.Linear(8, 1),
            reentrant,
        )

    def forward(self, x):
        hidden = checkpoint(
            lambda t: torch.nn.functional.dropout(self.inner(t).relu(), 0.5),
            x,
            use_reentrant=self.reentrant,
        )
        return self.outer(hidden)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_inside_the_module_runs_eagerly_with_the_reason(
    device, caught, reentrant
):
    def run(wrap):
        torch.manual_seed(0)
        model = wrap(Checkpointed(reentrant).to(device))
        torch.manual_seed(1)
        for x in batches(device, 3, requires_grad=True):
            model(x).sum().backward()
        return model, grads_of(model)

    _, eager = run(lambda m: m)
    model, graphed = run(autograph.graphed)
    assert same(eager, graphed)
    assert states(model) == [("eager", 3, 3, 0)]
    (message,) = autograph_warnings(caught)
    if reentrant:
        assert "its backward at test_training.py:" in message
        assert "use_reentrant=True, torch.utils.checkpoint is incompatible" in message
    else:
        assert "saved-tensor hooks inside (torch.utils.checkpoint" in message


def test_saved_tensor_hooks_around_the_call_run_it_eagerly(device, caught):
    model = autograph.graphed(mlp(device))
    twin = mlp(device)
    for x in batches(device, 3):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t * 1, lambda t: t):
            model(x).sum().backward()
        twin(x).sum().backward()
    assert same(grads_of(model), grads_of(twin))
    assert states(model) == [("eager", 3, 3, 0)]
    assert "saved-tensor hooks are active around the call" in autograph_warnings(caught)[0]


class ItemInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        scale = grad.abs().max().item()  # the line the warning names
        return grad * 2 + scale * 0


def test_the_guard_holds_in_a_custom_backward(device, caught):
    @autograph.graphed
    def double(x):
        return ItemInBackward.apply(x)

    for _ in range(3):
        x = torch.ones(4, device=device, requires_grad=True)
        double(x).sum().backward()
        assert torch.equal(x.grad, torch.full((4,), 2.0, device=device))
    assert states(double) == [("eager", 3, 3, 0)]
    (message,) = autograph_warnings(caught)
    assert "runs eagerly: .item() at test_training.py:" in message
    assert "synchronises with the host" in message


def test_bucketed_calls_that_need_gradients_run_eagerly_with_the_reason(device, caught):
    model, twin = autograph.graphed(buckets=[8, 16])(mlp(device)), mlp(device)
    for x in batches(device, 3, rows=5):
        model(x).sum().backward()
        twin(x).sum().backward()
    assert same(grads_of(model), grads_of(twin))
    assert states(model) == [("eager", 3, 3, 0)]
    (message,) = autograph_warnings(caught)
    assert "a bucketed call does not get a graphed backward" in message


def test_reading_a_tensor_computed_with_gradients_outside_runs_eagerly(device, caught):
    def run(wrap):
        torch.manual_seed(0)
        weight = torch.randn(8, 8, device=device, requires_grad=True)
        scaled = weight * 2  # read by the function, not passed to it

        def project(x):
            return x @ scaled

        project = wrap(project)
        for x in batches(device, 3):
            project(x).sum().backward(retain_graph=True)
        return project, weight.grad

    _, eager = run(lambda f: f)
    project, graphed = run(autograph.graphed)
    assert torch.equal(eager, graphed)
    assert states(project) == [("eager", 3, 3, 0)]
    assert (
        "it reads scaled, which was computed with gradients outside the call"
        in autograph_warnings(caught)[0]
    )


def test_writing_in_place_to_an_input_that_requires_grad_runs_eagerly(device, caught):
    @autograph.graphed
    def scale_in_place(x):
        return x.mul_(2).sum()

    for _ in range(3):
        leaf = torch.ones(4, device=device, requires_grad=True)
        scale_in_place(leaf * 1).backward()
        assert torch.equal(leaf.grad, torch.full((4,), 2.0, device=device))
    assert states(scale_in_place) == [("eager", 3, 3, 0)]
    assert "writes in place to an argument that requires grad" in autograph_warnings(caught)[0]


def test_unfreezing_a_parameter_recaptures_and_freezing_one_drops_its_gradient(device):
    model, twin = autograph.graphed(mlp(device)), mlp(device)
    first = model[0].weight
    for frozen in (True, True, False, False, True, True):
        for m in (model, twin):
            m[0].weight.requires_grad_(not frozen)
            m.zero_grad(set_to_none=True)
            m(batches(device, 1)[0]).sum().backward()
        assert same(grads_of(model), grads_of(twin))
        assert (first.grad is None) == frozen
    # captured frozen; unfreezing captured again (its gradient was not in the graph);
    # freezing again replays that graph, whose gradient for it autograd drops
    assert states(model) == [("graphed", 6, 1, 5)]
    assert model.forward._self_engine.cache.entries.popitem()[1].recaptures == 1


def test_an_output_that_views_an_input_needs_no_backward_graph(device):
    @autograph.graphed
    def first_row_and_top(x):
        return x[0], x.argmax(-1)

    for _ in range(3):
        x = torch.randn(4, 8, device=device, requires_grad=True)
        row, top = first_row_and_top(x)
        assert torch.equal(top, x.argmax(-1)) and not top.requires_grad
        (row * 3).sum().backward()
        assert torch.equal(x.grad[0], torch.full((8,), 3.0, device=device))
        assert not x.grad[1:].any()
    assert states(first_row_and_top) == [("graphed", 3, 1, 2)]


def test_capture_ahead_records_both_graphs_without_running_them(device):
    model, twin = autograph.graphed(mlp(device)), mlp(device)
    x = batches(device, 1)[0]
    rows = model.forward.capture(x)
    assert [r.state for r in rows] == ["graphed"] and model[0].weight.grad is None
    for m in (model, twin):
        m(x).sum().backward()
    assert same(grads_of(model), grads_of(twin))
    assert states(model) == [("graphed", 1, 0, 1)]


def test_capture_ahead_finds_closed_over_weights_that_need_gradients(device):
    torch.manual_seed(0)
    weight = torch.randn(8, 1, device=device, requires_grad=True)

    @autograph.graphed
    def project(x):
        return x @ weight

    x = batches(device, 1)[0]
    assert [r.state for r in project.capture(x)] == ["graphed"] and weight.grad is None
    for _ in range(3):
        project(x).sum().backward()
    assert torch.allclose(weight.grad, 3 * x.sum(0)[:, None])
    assert states(project) == [("graphed", 3, 0, 3)]


def test_a_region_graphs_forward_and_backward_of_each_module(device, caught):
    def train(use_region):
        model = mlp(device)
        loss_fn = torch.nn.MSELoss()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, capturable=device == "cuda")
        data = batches(device, 1)[0]
        target = data.sum(-1, keepdim=True)
        losses = []
        with autograph.region() if use_region else contextlib.nullcontext() as region:
            for _ in range(10):
                optimizer.zero_grad()
                loss = loss_fn(model(data), target)
                loss.backward()
                optimizer.step()
                losses.append(loss.detach())
        return model, loss_fn, losses, region

    _, _, eager, _ = train(False)
    model, loss_fn, losses, region = train(True)
    assert all(torch.equal(a, b) for a, b in zip(eager, losses))
    # per module: a plain call and a watched warmup (the region's warmup=2), then a capture
    assert states(model) == [("graphed", 10, 2, 8)]
    assert states(loss_fn) == [("graphed", 10, 2, 8)]
    assert (region.stats().captures, region.stats().replays) == (2, 16)
    assert autograph_warnings(caught) == []


# ---- the whole step as one graph ----


def optimizer_for(model, device):
    """Adam with capturable=True on the GPU; on the CPU, where Adam reads its step count into
    Python (the emulation falls back, as CUDA would with capturable=False), SGD."""
    if device == "cuda":
        return torch.optim.Adam(model.parameters(), lr=1e-2, capturable=True)
    return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)


def whole_step(model, optimizer, return_detached=True):
    def step(x, target):
        optimizer.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        optimizer.step()
        return loss.detach() if return_detached else loss

    return step


@pytest.mark.parametrize("return_detached", [True, False])
def test_a_whole_training_step_graphed_as_one_function_matches_eager(
    device, caught, return_detached
):
    def train(wrap):
        model = mlp(device, dropout=0.1, activation=torch.nn.GELU)
        step = wrap(whole_step(model, optimizer_for(model, device), return_detached))
        data = batches(device, 20)
        torch.manual_seed(5)  # dropout masks
        losses = [step(x, x.sum(-1, keepdim=True)) for x in data]
        return step, losses, [p.detach().clone() for p in model.parameters()]

    _, eager_losses, eager_params = train(lambda f: f)
    step, losses, params = train(autograph.graphed)
    assert all(torch.equal(a, b) for a, b in zip(eager_losses, losses))
    assert all(torch.equal(a, b) for a, b in zip(eager_params, params))
    assert losses[-1] < losses[0] and not losses[-1].requires_grad
    assert states(step) == [("graphed", 20, 1, 19)]
    assert autograph_warnings(caught) == []


def test_a_whole_step_records_backward_kernels_that_reach_the_guard_whole(device):
    # silu_backward is composite and has kernels of its own: the guard must let the modes
    # under it (the CPU emulation's recorder) see it whole.
    def train(wrap):
        model = mlp(device)
        step = wrap(whole_step(model, optimizer_for(model, device)))
        return step, [step(x, x.sum(-1, keepdim=True)) for x in batches(device, 4)]

    _, eager = train(lambda f: f)
    step, losses = train(autograph.graphed)
    assert all(torch.equal(a, b) for a, b in zip(eager, losses))
    assert states(step) == [("graphed", 4, 1, 3)]


@pytest.mark.cuda
@requires_cuda
def test_a_whole_step_follows_a_learning_rate_scheduler_on_a_tensor():
    def train(wrap):
        model = mlp("cuda")
        optimizer = torch.optim.Adam(
            model.parameters(), lr=torch.tensor(0.05, device="cuda"), capturable=True
        )
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        step = wrap(whole_step(model, optimizer))
        losses = []
        for x in batches("cuda", 8):
            losses.append(step(x, x.sum(-1, keepdim=True)))
            scheduler.step()  # fills the tensor in place: the graph reads it by address
        return step, losses

    _, eager = train(lambda f: f)
    step, losses = train(autograph.graphed)
    assert all(torch.equal(a, b) for a, b in zip(eager, losses))
    assert states(step) == [("graphed", 8, 1, 7)]


def test_the_capture_call_does_not_keep_its_arguments_alive(device):
    import gc
    import weakref

    model = autograph.graphed(mlp(device))
    refs = []
    for x in batches(device, 3, requires_grad=True):
        model(x).sum().backward()
        refs.append(weakref.ref(x))
    del x
    gc.collect()
    assert [r() for r in refs] == [None, None, None]  # statics are leaves of their own
    assert states(model) == [("graphed", 3, 1, 2)]


@pytest.mark.cuda
@requires_cuda
def test_hf_llama_training_matches_eager(caught):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=1024,
        max_position_embeddings=256,
    )

    def train(wrap):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).cuda().train()
        graphed = wrap(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        torch.manual_seed(1)
        losses = []
        for _ in range(6):
            ids = torch.randint(0, 1024, (8, 128), device="cuda")
            optimizer.zero_grad(set_to_none=True)
            loss = graphed(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        return graphed, losses

    _, eager = train(lambda m: m)
    model, losses = train(autograph.graphed)
    # HF builds an explicit causal mask while a capture runs (is_causal in eager): close,
    # not bitwise
    for a, b in zip(eager, losses):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert states(model) == [("graphed", 6, 1, 5)]
    assert autograph_warnings(caught) == []
