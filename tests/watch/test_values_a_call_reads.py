"""Python values a call reads, changed between calls: a flag on a cache object reset by the caller,
a stateful callable a module holds, a full deque, a dict of more than 256 entries, a class-level
counter, a class attribute, torch's default dtype. Each gives eager's values; where the graph can
stay right, a graph replays (docs/design.md, "What a replay assumes").
"""

import collections

import pytest
import torch

import autograph

from conftest import states

pytestmark = pytest.mark.usefixtures("caught")


class _Cache:
    """The minimal shape of transformers' EncoderDecoderCache: a flag says whether the
    cross-attention K/V are computed or read."""

    def __init__(self, device):
        self.kv = torch.zeros(4, device=device)
        self.flag = False

    def reset(self):
        self.kv.zero_()
        self.flag = False


def _cached_step(x, enc, cache):
    if not cache.flag:
        cache.kv.copy_(enc * 2)
        cache.flag = True
    return x + cache.kv


def test_a_flag_the_caller_resets_on_a_cache_object_is_read_again(device):
    g = autograph.graphed(_cached_step)
    cache, eager_cache = _Cache(device), _Cache(device)
    for _ in range(3):  # three inputs, the cache reset before each, as the README advises
        cache.reset(), eager_cache.reset()
        enc = torch.randn(4, device=device)
        for _ in range(4):  # the first step computes the K/V, the others read them
            x = torch.randn(4, device=device)
            torch.testing.assert_close(
                g(x, enc, cache), _cached_step(x, enc, eager_cache), rtol=0, atol=0
            )
    # The first input's first step warms up, its second captures; from then on only each
    # input's first step (the flag that reset() cleared) runs eagerly, and the graph stays.
    assert states(g) == [("graphed", 12, 1 + 2, 9)]


def test_a_global_flag_changed_between_calls_is_read_again(device):
    global _DOUBLE
    _DOUBLE = False

    @autograph.graphed
    def f(x):
        return x * 2 if _DOUBLE else x + 1

    x = torch.randn(4, device=device)
    for _ in range(3):
        f(x)
    _DOUBLE = True
    torch.testing.assert_close(f(x), x * 2, rtol=0, atol=0)
    _DOUBLE = False
    torch.testing.assert_close(f(x), x + 1, rtol=0, atol=0)
    assert states(f)[0][0] == "graphed" and states(f)[0][3] >= 2, states(f)


class _Config:
    scale = 1.0
    calls = 0  # named nowhere in the function: not read


def test_a_class_attribute_the_function_names_changed_between_calls_is_read_again(device):
    @autograph.graphed
    def f(x):
        return x * _Config.scale

    x = torch.randn(4, device=device)
    for scale in (1.0, 1.0, 1.0, 3.0, 1.0, 3.0):
        _Config.scale = scale
        _Config.calls += 1
        torch.testing.assert_close(f(x), x * scale, rtol=0, atol=0)
    _Config.scale = 1.0
    # A warmup and a capture at 1.0; the calls at 3.0 run eagerly, those at 1.0 replay (the
    # counter the function does not name changes at every call and sends none of them eagerly).
    assert states(f) == [("graphed", 6, 1 + 2, 3)], states(f)


_DOUBLE = False
_SCALE = 2.0


def test_a_number_made_into_a_tensor_in_the_call_stays_graphed_and_right(device):
    # torch.tensor(number) in the call is a CPU scalar made anew each call (and freed after
    # it): on CUDA it was taken for state read by address and rebound, and the key went eager.
    global _SCALE

    @autograph.graphed
    def scaled(x):
        return x * torch.tensor(_SCALE) + torch.tensor(1.0)

    x = torch.randn(4, device=device)
    for scale in (2.0, 2.0, 2.0, 3.0, 3.0, 2.0):
        _SCALE = scale
        torch.testing.assert_close(scaled(x), x * scale + 1, rtol=0, atol=0)
    _SCALE = 2.0
    assert [row[0] for row in states(scaled)] == ["graphed"], states(scaled)
    assert states(scaled)[0][3] >= 3, states(scaled)


class _Schedule:
    """A schedule object: each call returns the next value."""

    def __init__(self):
        self.step = 0

    def __call__(self):
        self.step += 1
        return 0.5**self.step


def test_a_stateful_callable_a_module_holds_is_its_state(device):
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.schedule = _Schedule()

        def forward(self, x):
            return x * self.schedule()

    m, ref = Scaled(), Scaled()
    g = autograph.graphed(m)
    x = torch.randn(4, device=device)
    for _ in range(5):
        torch.testing.assert_close(g(x), ref(x), rtol=0, atol=0)
    [row] = autograph.stats(g)
    assert row.state == "eager" and "schedule.step" in row.fallback_reason, row


def test_a_full_deque_appended_to_is_its_state(device):
    recent, eager_recent = collections.deque(maxlen=2), collections.deque(maxlen=2)

    def keep(x, into):
        y = x * 2
        into.append(y)
        return y

    @autograph.graphed
    def f(x):
        return keep(x, recent)

    recent.extend([torch.zeros(4, device=device)] * 2)  # full before the first call
    eager_recent.extend([torch.zeros(4, device=device)] * 2)
    for _ in range(5):
        x = torch.randn(4, device=device)
        torch.testing.assert_close(f(x), keep(x, eager_recent), rtol=0, atol=0)
        for a, b in zip(recent, eager_recent):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    [row] = autograph.stats(f)
    assert row.state == "eager" and "recent" in row.fallback_reason, row


def test_a_dict_of_more_than_256_entries_gaining_keys_is_its_state(device):
    table = {i: i for i in range(300)}

    @autograph.graphed
    def f(x):
        table[len(table)] = 1
        return x * len(table)

    for _ in range(5):
        x = torch.randn(4, device=device)
        before = len(table)
        torch.testing.assert_close(f(x), x * (before + 1), rtol=0, atol=0)
    assert len(table) == 305
    [row] = autograph.stats(f)
    assert row.state == "eager" and "table" in row.fallback_reason, row


def test_a_class_level_counter_is_its_state(device):
    class Counted(torch.nn.Module):
        n = 0

        def forward(self, x):
            type(self).n += 1
            return x * type(self).n

    m = Counted()
    g = autograph.graphed(m)
    x = torch.randn(4, device=device)
    for i in range(1, 6):
        torch.testing.assert_close(g(x), x * i, rtol=0, atol=0)
    assert Counted.n == 5
    [row] = autograph.stats(g)
    assert row.state == "eager" and ".n" in row.fallback_reason, row


def test_the_default_dtype_is_part_of_the_key(device):
    @autograph.graphed
    def f(x):
        return x + torch.full((4,), 0.1, device=x.device)

    x = torch.randn(4, device=device, dtype=torch.float64)
    for _ in range(3):
        assert f(x).dtype == torch.float64
    before = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        for _ in range(3):
            out = f(x)
        eager = x + torch.full((4,), 0.1, device=device)
    finally:
        torch.set_default_dtype(before)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    assert [s[0] for s in states(f)] == ["graphed", "graphed"], states(f)
    assert all(replays >= 1 for *_, replays in states(f)), states(f)


def test_a_flag_the_caller_resets_is_read_again_in_a_region(device):
    class Step(torch.nn.Module):
        def forward(self, x, enc, cache):
            return _cached_step(x, enc, cache)

    step, cache, eager_cache = Step(), _Cache(device), _Cache(device)
    with autograph.region() as region:
        for _ in range(3):
            cache.reset(), eager_cache.reset()
            enc = torch.randn(4, device=device)
            for _ in range(4):
                x = torch.randn(4, device=device)
                torch.testing.assert_close(
                    step(x, enc, cache), _cached_step(x, enc, eager_cache), rtol=0, atol=0
                )
    # The first input's first step is a plain call, its second the watched warmup (the
    # region's warmup=2), its third the capture; then each input's first step runs eagerly.
    assert states(region) == [("graphed", 12, 2 + 2, 8)]
