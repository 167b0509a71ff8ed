"""Python state a call changes is caught: counters on attributes and globals, list appends and dict
growth, a counting module in a region; a lazily made cache attribute and a value set to itself
stay graphed.
"""

import copy

import pytest
import torch

import autograph

from conftest import states

pytestmark = pytest.mark.usefixtures("caught")


def _assert_eager_with(f, reason_part):
    rows = autograph.stats(f)
    assert rows[0].state == "eager", rows
    assert reason_part in (rows[0].fallback_reason or ""), rows[0].fallback_reason


COUNT = 0


def test_counter_attribute_is_caught(device):
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.steps = 0

        def forward(self, x):
            self.steps += 1
            return self.lin(x) * self.steps

    torch.manual_seed(0)
    m = M().to(device)
    ref = copy.deepcopy(m)
    g = autograph.graphed(m)
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(2, 4, device=device)
            torch.testing.assert_close(g(x), ref(x), rtol=0, atol=0)
    assert m.steps == ref.steps == 5
    _assert_eager_with(g, "steps")


def test_append_and_dict_growth_and_global_are_caught(device):
    seen, table = [], {}

    @autograph.graphed
    def appends(x):
        seen.append(1)
        return x * len(seen)

    @autograph.graphed
    def grows(x):
        table[len(table)] = 1
        return x * len(table)

    for i in range(1, 5):
        x = torch.randn(3, device=device)
        torch.testing.assert_close(appends(x), x * i, rtol=0, atol=0)
        torch.testing.assert_close(grows(x), x * i, rtol=0, atol=0)
    assert len(seen) == 4 and len(table) == 4
    _assert_eager_with(appends, "")
    _assert_eager_with(grows, "")


def test_global_counter_is_caught(device):
    global COUNT
    COUNT = 0

    @autograph.graphed
    def bump(x):
        global COUNT
        COUNT += 1
        return x * COUNT

    for i in range(1, 5):
        x = torch.randn(3, device=device)
        torch.testing.assert_close(bump(x), x * i, rtol=0, atol=0)
    assert COUNT == 4
    _assert_eager_with(bump, "COUNT")


def test_counter_module_in_a_region_is_caught(device):
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return x + self.calls

    m = M()
    with torch.no_grad(), autograph.region():
        for i in range(1, 6):
            x = torch.randn(3, device=device)
            torch.testing.assert_close(m(x), x + i, rtol=0, atol=0)
    assert states(m)[0][0] == "eager", autograph.stats(m)


def test_lazy_cache_attribute_and_same_value_set_stay_graphed(device):
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self._mask = None
            self.last_rows = None

        def forward(self, x):
            if self._mask is None:
                self._mask = torch.ones(4, device=x.device)
            self.last_rows = x.shape[0]
            return self.lin(x) * self._mask

    torch.manual_seed(0)
    m = M().to(device)
    ref = copy.deepcopy(m)
    g = autograph.graphed(m)
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(2, 4, device=device)
            torch.testing.assert_close(g(x), ref(x), rtol=0, atol=0)
    assert states(g) == [("graphed", 5, 1, 4)], autograph.stats(g)
