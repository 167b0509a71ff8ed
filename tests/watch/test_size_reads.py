"""A Python number computed from a bucketed call's size (issue 22, part 3; docs/design.md,
"Buckets"): a bucket's graph bakes the bucket's number, so such a key runs eagerly with the op
named, while the size used as a shape stays graphed; verify checks the capture call's result.

The positives and the verify tests failed before ``_size_reads`` and ``_verified_capture``
(the graph of 4 returned x * 4 for 3 rows, silently)."""

import pytest
import torch

import autograph

from conftest import autograph_warnings, states


def _served(fn, sizes, make, reference):
    for n in sizes:
        x = make(n)
        torch.testing.assert_close(fn(x), reference(x), rtol=0, atol=0)


# ---- the size as a shape: no finding, graphed ----


@pytest.mark.parametrize("shape_use", ["reshape", "view", "zeros"])
def test_the_batch_size_used_as_a_shape_stays_graphed(device, caught, shape_use):
    def reference(x):
        if shape_use == "reshape":
            return x.reshape(x.shape[0], -1) * 2
        if shape_use == "view":
            return x.view(x.shape[0], 2, -1) + 1
        return torch.cat([x, torch.zeros(x.shape[0], 3, device=x.device)], 1) * 3

    fn = autograph.graphed(reference, buckets=[4, 8])
    _served(fn, (3, 3, 3, 3, 6, 6, 6, 6), lambda n: torch.randn(n, 6, device=device), reference)
    assert autograph_warnings(caught) == []
    assert states(fn) == [("graphed", 4, 1, 3), ("graphed", 4, 1, 3)]


# ---- the size as a value: eager with the op named, every result eager's ----

POSITIVES = {
    "x * x.shape[0]": lambda x: x * x.shape[0],
    "x * (1.0 / x.shape[0])": lambda x: x * (1.0 / x.shape[0]),
    "x.sum(0) / x.shape[0]": lambda x: x.sum(0) / x.shape[0],
    "torch.full((k,), x.shape[0])": lambda x: (
        x[:, :2] + torch.full((2,), x.shape[0], device=x.device)
    ),
    "x.clamp(max=x.shape[0])": lambda x: (x * 10).clamp(max=x.shape[0]),
}


@pytest.mark.parametrize("name", sorted(POSITIVES))
def test_a_number_read_from_the_batch_size_runs_eagerly_with_the_op_named(device, caught, name):
    reference = POSITIVES[name]
    fn = autograph.graphed(reference, buckets=[4, 8])
    _served(fn, (3, 3, 3, 3), lambda n: torch.randn(n, 5, device=device), reference)
    (row,) = fn.stats()
    assert (row.state, row.calls, row.replays) == ("eager", 4, 0)
    assert (
        "Python number 3 at 3 rows and 4 at 4 rows" in row.fallback_reason
        or "Python number 0.333" in row.fallback_reason
    ), row.fallback_reason
    assert "aten." in row.fallback_reason and "tensor argument" in row.fallback_reason
    assert len(autograph_warnings(caught)) == 1


def test_a_first_call_at_the_buckets_size_is_found_at_the_first_padded_call(device, caught):
    # Warmup and capture at 4 rows show one size only: the first call of 3 rows runs as called
    # (no replay), and its numbers differ from the graph's.
    fn = autograph.graphed(lambda x: x * x.shape[0], buckets=[4])
    _served(
        fn, (4, 4, 4, 3, 3, 3), lambda n: torch.randn(n, 5, device=device), lambda x: x * x.shape[0]
    )
    (row,) = fn.stats()
    assert (row.state, row.calls, row.replays) == ("eager", 6, 2)
    assert "4 at 4 rows" in row.fallback_reason and "3 at 3 rows" in row.fallback_reason


def test_the_same_call_at_the_buckets_size_only_stays_graphed(device, caught):
    fn = autograph.graphed(lambda x: x * x.shape[0], buckets=[4])
    _served(fn, (4, 4, 4, 4), lambda n: torch.randn(n, 5, device=device), lambda x: x * x.shape[0])
    assert states(fn) == [("graphed", 4, 1, 3)]


def test_captured_buckets_show_the_size_read_before_any_request(device, caught):
    fn = autograph.graphed(lambda x: x * x.shape[0], buckets=[4, 8])
    fn.capture(torch.randn(8, 5, device=device))
    _served(fn, (3, 3, 6, 6), lambda n: torch.randn(n, 5, device=device), lambda x: x * x.shape[0])
    assert [row.state for row in fn.stats()] == ["eager", "eager"]
    assert all("Python number" in row.fallback_reason for row in fn.stats())


def test_a_row_wise_function_with_constants_stays_graphed_after_capture(device, caught):
    fn = autograph.graphed(lambda x: (x * 3 + 0.5).clamp(max=2.0), buckets=[4, 8])
    fn.capture(torch.randn(8, 5, device=device))
    _served(
        fn,
        (3, 3, 6, 6),
        lambda n: torch.randn(n, 5, device=device),
        lambda x: (x * 3 + 0.5).clamp(max=2.0),
    )
    assert [(row.state, row.replays) for row in fn.stats()] == [("graphed", 2), ("graphed", 2)]


# ---- verify checks the capture call's own result ----


def test_verify_checks_the_capture_call_of_a_branch_on_the_size(device, caught):
    # Another op, not another number: the numbers' comparison stops where the ops part, and
    # only verify sees it. Without verify this key is silently wrong (docs/guide/limits.md).
    def branch(x):
        return x + 1 if x.shape[0] == 3 else x - 1

    fn = autograph.graphed(branch, buckets=[4], verify=1)
    _served(fn, (3, 3, 3), lambda n: torch.randn(n, 5, device=device), branch)
    (row,) = fn.stats()
    assert (row.state, row.replays, row.verified) == ("eager", 0, 0)
    assert row.fallback_reason.startswith("verify: ")


def test_verify_counts_the_capture_call_it_checked(device, caught):
    fn = autograph.graphed(lambda x: x * 2, buckets=[4], verify=2)
    _served(fn, (3, 3, 3, 3, 3), lambda n: torch.randn(n, 5, device=device), lambda x: x * 2)
    (row,) = fn.stats()
    assert (row.state, row.replays, row.verified) == ("graphed", 4, 3)
    assert autograph_warnings(caught) == []


def test_verify_of_a_key_with_per_bucket_state_runs_its_eager_check_padded(device):
    # A cache of the bucket's rows, used by address: every run of the key is padded, and so
    # must verify's eager check be (before: it ran on the caller's 3 rows, and the copy into
    # the 4-row cache failed)
    cache = torch.zeros(4, 5, device=device)

    @autograph.graphed(buckets=[4], static_argnames=("cache",), bucket_outputs=0, verify=3)
    def step(x, cache):
        cache.copy_(x)
        return x * 2

    for i in range(5):
        x = torch.full((3, 5), float(i), device=device)
        torch.testing.assert_close(step(x, cache), x * 2, rtol=0, atol=0)
        torch.testing.assert_close(cache[:3], x, rtol=0, atol=0)
    (row,) = autograph.stats(step)
    assert row.state == "graphed" and row.replays >= 3 and row.verified >= 3
