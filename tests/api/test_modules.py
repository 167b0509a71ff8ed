"""``autograph.graphed(module)`` graphs the forward that module's own calls would run (issue 14):
the class's method, a forward set on the instance, a compiled module's forward; and a graphed
module's stats, reset and labels are in one documented place."""

import torch

import autograph


def rows(target):
    return [(s.state, s.calls, s.eager_calls, s.replays) for s in autograph.stats(target)]


def test_a_forward_set_on_the_instance_is_the_one_graphed(device):
    lin = torch.nn.Linear(3, 4).to(device)
    lin.forward = lambda i: i * 2
    x = torch.randn(10, 3, device=device)
    graphed = autograph.graphed(lin)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(graphed(x), x * 2)
    assert rows(lin) == [("graphed", 3, 1, 2)]
    assert autograph.stats(lin)[0].key.startswith("i: f32[10, 3]")


def test_a_compiled_module_is_graphed_with_its_compiled_forward(device):
    torch._dynamo.reset()
    lin = torch.nn.Linear(3, 4).to(device)
    compiled = torch.compile(lin, backend="eager")
    x = torch.randn(10, 3, device=device)
    graphed = autograph.graphed(compiled)
    assert graphed is compiled
    with torch.no_grad():
        expected = lin(x)
        for _ in range(3):
            assert torch.allclose(graphed(x), expected)
    assert rows(compiled) == [("graphed", 3, 1, 2)]
    assert autograph.stats(compiled)[0].key.startswith("input: f32[10, 3]")


def test_graphing_again_takes_the_new_options(device):
    model = autograph.graphed(torch.nn.Linear(3, 3).to(device))
    x = torch.randn(2, 3, device=device)
    with torch.no_grad():
        for _ in range(3):
            model(x)
        autograph.graphed(model, warmup=2)
        outs = [model(x) for _ in range(4)]
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert rows(model) == [("graphed", 4, 2, 2)]


def test_stats_reset_and_report_of_a_graphed_module_in_one_place(device, capsys):
    a = autograph.graphed(torch.nn.Linear(3, 3).to(device))
    b = autograph.graphed(torch.nn.Linear(3, 3).to(device))
    x = torch.randn(2, 3, device=device)
    with torch.no_grad():
        for _ in range(3):
            a(x), b(x)
    assert a.forward.stats() == autograph.stats(a) and len(autograph.stats(a)) == 1
    names = {autograph.stats(a)[0].function, autograph.stats(b)[0].function}
    assert len(names) == 2 and all(n.startswith("Linear") for n in names)
    autograph.report(a)
    assert autograph.stats(a)[0].function in capsys.readouterr().out
    autograph.reset(a)
    assert autograph.stats(a) == [] and len(autograph.stats(b)) == 1


def test_a_forward_replaced_after_graphing_runs_as_set(device):
    model = autograph.graphed(torch.nn.Linear(3, 3).to(device))
    model.forward = lambda i: i + 1  # replaces the graphed forward, as it says
    x = torch.randn(2, 3, device=device)
    with torch.no_grad():
        assert torch.equal(model(x), x + 1)
    assert autograph.stats(model) == []


def test_a_graphed_module_in_a_region_graphs_itself_once(device):
    model = autograph.graphed(torch.nn.Linear(3, 3).to(device))
    x = torch.randn(2, 3, device=device)
    with torch.no_grad(), autograph.region() as region:
        for _ in range(3):
            model(x)
    # its own engine and options (warmup 1), not a region one's (a region's own module calls
    # warm up with 2)
    assert rows(model) == [("graphed", 3, 1, 2)]
    assert [r.function for r in region.stats().keys] == [autograph.stats(model)[0].function]
