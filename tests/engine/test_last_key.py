"""The last key replayed is found by torch's C++ tensor guards before any Python keying
(autograph/engine/_last_key.py): a call that matches it skips ``call_key``; any difference the key
holds (shape, strides, dtype, requires_grad, a tensor subclass, the number of arguments, grad
mode, options) sends the call to the Python key, which finds or makes the right key."""

import pytest
import torch

import autograph
from autograph.engine import _engine, _last_key

from conftest import states

pytestmark = pytest.mark.skipif(
    _last_key._make_guards is None,
    reason="this torch has no usable torch._C._dynamo.guards.TensorGuards: every call is "
    "keyed in Python",
)


@pytest.fixture
def python_keys(monkeypatch):
    """How many calls were keyed in Python."""
    count = [0]
    original = _engine.call_key

    def counting(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(_engine, "call_key", counting)
    return count


def test_torch_2_13_has_the_guards():
    if torch.__version__.startswith("2.13"):
        assert _last_key._make_guards is not None


def test_calls_of_the_last_key_replayed_skip_the_python_key(emulated, python_keys):
    @autograph.graphed
    def f(x, w):
        return x @ w

    x, w = torch.randn(4, 3), torch.randn(3, 2)
    for _ in range(10):
        assert torch.equal(f(x, w), x @ w)
    # warmup, capture, the first replay (found by its Python key), then 7 by the guards
    assert python_keys[0] == 3
    assert states(f) == [("graphed", 10, 1, 9)]


@pytest.mark.parametrize(
    "other",
    [
        lambda x: torch.randn(5, 3),  # shape
        lambda x: torch.randn(3, 4).t(),  # strides
        lambda x: x.double(),  # dtype
        lambda x: x.clone().requires_grad_(),  # requires_grad
        lambda x: torch.nn.Parameter(x.clone()),  # a subclass
    ],
    ids=["shape", "strides", "dtype", "requires_grad", "Parameter"],
)
def test_a_call_the_guards_do_not_pass_gets_its_own_key(emulated, python_keys, other):
    @autograph.graphed
    def f(x):
        return x * 2

    x = torch.randn(4, 3)
    for _ in range(4):
        f(x)
    y = other(x)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(f(y), y * 2)
    rows = autograph.stats(f)
    assert len(rows) == 2 and rows[0].calls == 4 and rows[1].calls == 3


def test_grad_mode_options_and_argument_count_are_part_of_the_check(emulated, python_keys):
    @autograph.graphed
    def f(*xs):
        return sum(xs)

    x = torch.randn(3)
    for _ in range(4):
        f(x)
    with torch.no_grad():
        f(x)
    f(x, x)
    with autograph.region(warmup=2):
        f(x)
    assert [r.calls for r in autograph.stats(f)] == [4, 1, 1, 1]


def test_a_reset_forgets_the_last_key(emulated, python_keys):
    @autograph.graphed
    def f(x):
        return x + 1

    x = torch.randn(3)
    for _ in range(4):
        f(x)
    autograph.reset(f)
    assert torch.equal(f(x), x + 1)
    assert states(f) == [("warmup", 1, 1, 0)]
