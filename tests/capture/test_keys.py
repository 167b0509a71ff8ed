"""Keys (docs/design.md, "Keys"): what makes two calls share a graph, and how a key reads in
messages."""

import collections
import dataclasses
import enum

import pytest
import torch

import autograph
from autograph.capture._keys import call_key, describe_call, execution_state, unkeyable_reason
from autograph.capture._outputs import flatten_output

from conftest import states


def key(*args, **kwargs):
    return call_key(args, kwargs, execution_state(None))[0]


def test_same_shapes_share_a_key_and_values_do_not_matter():
    assert key(torch.zeros(2, 3), torch.ones(3)) == key(torch.randn(2, 3), torch.randn(3))


@pytest.mark.parametrize(
    "other",
    [
        torch.zeros(2, 4),  # shape
        torch.zeros(2, 3, dtype=torch.float64),  # dtype
        torch.zeros(3, 2).t(),  # strides
        torch.zeros(2, 3, requires_grad=True),  # requires_grad
    ],
)
def test_shape_dtype_strides_and_requires_grad_change_the_key(other):
    assert key(torch.zeros(2, 3)) != key(other)


def test_execution_state_changes_the_key():
    x = torch.zeros(2)
    base = key(x)
    with torch.no_grad():
        assert key(x) != base
    with torch.inference_mode():
        assert key(x) != base
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert key(x) != base
    training = call_key((x,), {}, execution_state(True))[0]
    evaluating = call_key((x,), {}, execution_state(False))[0]
    assert training != evaluating


def test_fast_path_returns_the_tensors_in_order():
    a, b = torch.zeros(1), torch.ones(2)
    _, tensors, keep_alive, *_ = call_key((a, b), {}, execution_state(None))
    assert tensors[0] is a and tensors[1] is b and keep_alive == []


class Mode(enum.Enum):
    FAST = 1
    SLOW = 2


@dataclasses.dataclass
class Batch:
    ids: torch.Tensor
    mask: torch.Tensor
    note: str = "x"


Pair = collections.namedtuple("Pair", "left right")


def test_pytrees_are_flattened_with_tensors_in_order():
    t = [torch.zeros(i + 1) for i in range(6)]
    args = ((t[0], [t[1], {"k": t[2]}]), Batch(t[3], t[4]), Pair(t[5], 3))
    kwargs = {"mode": Mode.FAST, "dtype": torch.float16}
    k, tensors, *_ = call_key(args, kwargs, execution_state(None))
    assert [x.numel() for x in tensors] == [1, 2, 3, 4, 5, 6]
    assert k == key(*args, mode=Mode.FAST, dtype=torch.float16)
    assert k != key(*args, mode=Mode.SLOW, dtype=torch.float16)
    assert k != key(*args, mode=Mode.FAST, dtype=torch.float32)


def test_constants_are_keyed_by_value_and_type():
    x = torch.zeros(1)
    assert key(x, 3) == key(x, 3)
    assert key(x, 3) != key(x, 4)
    assert key(x, 1) != key(x, True)
    assert key(x, n=1) != key(x, 1)


def test_a_set_is_keyed_by_value_and_other_unhashables_by_their_place():
    assert key(torch.zeros(1), {1, 2}) == key(torch.zeros(1), {2, 1})
    assert key(torch.zeros(1), {1}) != key(torch.zeros(1), {True})
    assert unkeyable_reason(key(torch.zeros(1), {1, 2})) is None
    assert key(torch.zeros(1), bytearray(b"x")) == key(torch.zeros(1), bytearray(b"y"))
    assert unkeyable_reason(key(torch.zeros(1), [bytearray(b"x")])) == (
        "its argument args[1][0] is an unhashable bytearray, which autograph can key neither by "
        "value nor by identity. Pass it as a tensor or a tuple, or bind it outside the graphed "
        "function, to graph these calls"
    )


def test_objects_hashed_by_identity_are_kept_alive():
    class Cache:
        pass

    cache = Cache()
    k, _, keep_alive, *_ = call_key((torch.zeros(1), cache), {}, execution_state(None))
    assert keep_alive == [cache]
    assert k != key(torch.zeros(1), Cache())


def test_describe_reads_like_the_spec():
    x, w = torch.zeros(8, 512), torch.zeros(512, 512, dtype=torch.bfloat16)
    text = describe_call(["x", "w"], (x, w), {"n": 3}, execution_state(None))
    assert text == "x: f32[8, 512] cpu, w: bf16[512, 512] cpu, n=3"
    with torch.no_grad():
        assert describe_call(["x"], (x,), {}, execution_state(False)).endswith("(no_grad, eval)")
    nested = describe_call(
        ["batch"], ({"ids": torch.zeros(2, dtype=torch.int64)},), {}, execution_state(None)
    )
    assert nested == "batch['ids']: i64[2] cpu"


def test_output_flatten_and_rebuild_round_trip():
    t = [torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)]
    out = {"a": (t[0], [t[1]]), "b": Batch(t[2], t[0], "note"), "c": Pair(1, None)}
    leaves, rebuild = flatten_output(out)
    again = rebuild(leaves)
    assert again["a"][0] is t[0] and again["a"][1][0] is t[1]
    assert isinstance(again["b"], Batch) and again["b"].ids is t[2] and again["b"].note == "note"
    assert again["c"] == Pair(1, None)


def test_a_dict_argument_whose_first_key_is_address_is_keyed_as_a_dict(device):
    # Issue 20: key parts were tuples told apart by a string tag, and ``("address", ...)``
    # marked a tensor used by address. A user's dict whose first key is "address" was taken
    # for one: a tensor of another size then went into the first graph, broadcast (x * 35
    # where eager gives x * 7). Typed parts (``_keys.AtAddress``) cannot be mistaken.
    @autograph.graphed(buckets=[4, 8], bucket_args={"x": 0})
    def f(m, x):
        return x * m["address"].sum()

    x = torch.randn(3, 2, device=device)
    ones = {"address": torch.ones(5, device=device), "u": 1, "v": 2}
    for _ in range(3):
        assert torch.equal(f(ones, x), x * 5)
    sevens = {"address": torch.full((1,), 7.0, device=device), "u": 1, "v": 2}
    for _ in range(3):
        out = f(sevens, x)
        assert out.shape == (3, 2) and torch.equal(out, x * 7)  # what eager gives
    # Two keys, each warmed up once, captured, and replayed: graphs served both.
    assert states(f) == [("graphed", 3, 1, 2), ("graphed", 3, 1, 2)]
    keys = [row.key for row in f.stats()]
    assert keys[0].startswith("m['address']: f32[5]") and keys[1].startswith("m['address']: f32[1]")
