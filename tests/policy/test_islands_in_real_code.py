"""Islands in real code: a key that runs eagerly still graphs the module calls inside it, with
eager's results (functions, methods, nested graphed functions, strict mode, threads, autograd).
"""

import copy
import threading

import pytest
import torch

import autograph

from conftest import states
from helpers.models import gelu_mlp

pytestmark = pytest.mark.usefixtures("caught")


def _islands(target):
    return [s for s in autograph.stats(target) if " > " in s.function]


def _host_read(m):
    def f(x):
        y = m(x)
        if y.sum() > 0:
            y = y * 2
        return m(y)

    return f


def test_island_function_in_region_and_not(device):
    m = gelu_mlp(device)
    plain = _host_read(m)
    xs = [torch.randn(4, 8, device=device) * (1 if i % 2 else -1) for i in range(8)]
    f = autograph.graphed(_host_read(m))
    with torch.no_grad():
        for x in xs:
            torch.testing.assert_close(f(x), plain(x), rtol=0, atol=0)
    assert states(f)[0][0] == "eager"
    assert sum(s.replays for s in _islands(f)) >= 10
    g = autograph.graphed(_host_read(m))
    with torch.no_grad(), autograph.region() as r:
        for x in xs:
            torch.testing.assert_close(g(x), plain(x), rtol=0, atol=0)
    assert states(g)[0][0] == "eager"
    island_replays = sum(s.replays for s in autograph.stats(g) if " > " in s.function)
    region_replays = sum(s.replays for s in r.stats().keys if " > " not in s.function)
    assert island_replays + region_replays >= 10, (autograph.stats(g), r.stats())


def test_island_nested_graphed_functions(device):
    m = gelu_mlp(device)
    inner = autograph.graphed(_host_read(m))
    outer = autograph.graphed(lambda x: inner(x) + 1)
    plain = _host_read(m)
    xs = [torch.randn(4, 8, device=device) * (1 if i % 2 else -1) for i in range(8)]
    with torch.no_grad():
        for x in xs:
            torch.testing.assert_close(outer(x), plain(x) + 1, rtol=0, atol=0)
    all_rows = autograph.stats(outer) + autograph.stats(inner)
    assert sum(s.replays for s in all_rows) >= 10, all_rows


def test_island_method(device):
    class Holder:
        def __init__(self):
            self.m = gelu_mlp(device)

        @autograph.graphed
        def run(self, x):
            return _host_read(self.m)(x)

    h = Holder()
    plain = _host_read(h.m)
    xs = [torch.randn(4, 8, device=device) * (1 if i % 2 else -1) for i in range(8)]
    with torch.no_grad():
        for x in xs:
            torch.testing.assert_close(h.run(x), plain(x), rtol=0, atol=0)
    rows = autograph.stats(h.run)
    assert rows[0].state == "eager"
    assert sum(s.replays for s in rows if " > " in s.function) >= 10, rows


def test_island_strict_raises_for_the_function(device):
    m = gelu_mlp(device)
    f = autograph.graphed(_host_read(m), strict=True)
    with torch.no_grad():
        f(torch.randn(4, 8, device=device))
        with pytest.raises(autograph.CaptureError):
            f(torch.randn(4, 8, device=device))


def test_island_submodule_that_itself_falls_back(device):
    class Inner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            y = self.lin(x)
            return y * 2 if y.sum() > 0 else y

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()
            self.tail = torch.nn.Linear(8, 8)

        def forward(self, x):
            y = self.inner(x)
            if y.mean() > 100:
                y = -y
            return self.tail(y)

    torch.manual_seed(0)
    ref = Outer().to(device)
    m = copy.deepcopy(ref)
    g = autograph.graphed(m)
    xs = [torch.randn(4, 8, device=device) * (1 if i % 2 else -1) for i in range(8)]
    with torch.no_grad():
        for x in xs:
            torch.testing.assert_close(g(x), ref(x), rtol=0, atol=0)
    rows = autograph.stats(g)
    assert rows[0].state == "eager"
    islands = [s for s in rows if " > " in s.function]
    assert any(s.replays for s in islands), rows  # the tail at least


def test_island_threads(device):
    m = gelu_mlp(device)
    plain = _host_read(m)
    f = autograph.graphed(_host_read(m))
    errors = []
    xs = [torch.randn(4, 8, device=device) * (1 if i % 2 else -1) for i in range(8)]
    want = [plain(x).detach() for x in xs]

    def work():
        try:
            with torch.no_grad():
                for _ in range(3):
                    for x, w in zip(xs, want):
                        torch.testing.assert_close(f(x), w, rtol=0, atol=0)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sum(s.replays for s in _islands(f)) > 0


def test_island_under_autograd_gives_eager_grads(device):
    m = gelu_mlp(device)
    ref = copy.deepcopy(m)
    f = autograph.graphed(_host_read(m))
    plain = _host_read(ref)
    for i in range(6):
        x = torch.randn(4, 8, device=device) * (1 if i % 2 else -1)
        out, want = f(x), plain(x)
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
        out.square().sum().backward()
        want.square().sum().backward()
        for p, q in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)
    assert states(f)[0][0] == "eager"
    assert sum(s.replays for s in _islands(f)) > 0, autograph.stats(f)
