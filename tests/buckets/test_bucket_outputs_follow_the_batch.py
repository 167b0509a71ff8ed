"""Bucketed outputs come back with the caller's rows only where they follow the batch: stateless
functions at several sizes, constant outputs beside batch outputs, bucket_outputs=, a dim equal
to the bucket by chance, reductions and flips over the batch, in-place writes, sizes read in
Python, verify of the capture call.
"""

import pytest
import torch

import autograph

pytestmark = pytest.mark.usefixtures("caught")


def test_bucket_stateless_function_at_3_5_8(device):
    @autograph.graphed(buckets=[4, 8])
    def f(x):
        return torch.relu(x) * 2 + 1

    for n in (3, 5, 8) * 4:
        x = torch.randn(n, 6, device=device)
        out = f(x)
        assert out.shape == (n, 6)
        torch.testing.assert_close(out, torch.relu(x) * 2 + 1, rtol=0, atol=0)
    rows = autograph.stats(f)
    assert {r.bucket for r in rows} == {4, 8}, rows
    assert all(r.state == "graphed" and r.replays >= 3 for r in rows), rows


def test_bucket_tuple_of_batch_output_and_constant_output(device):
    w = torch.randn(6, 6, device=device)

    @autograph.graphed(buckets=[4, 8])
    def f(x):
        return x @ w, w.sum(0)

    for n in (3, 5, 8, 2, 7, 4) * 2:
        x = torch.randn(n, 6, device=device)
        a, b = f(x)
        assert a.shape == (n, 6) and b.shape == (6,)
        torch.testing.assert_close(a, x @ w, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(b, w.sum(0), rtol=0, atol=0)
    rows = autograph.stats(f)
    assert sum(r.replays for r in rows) >= 6 and all(r.state == "graphed" for r in rows), rows


def test_bucket_outputs_given(device):
    w = torch.randn(6, 6, device=device)

    @autograph.graphed(buckets=[4, 8], bucket_outputs=[0, None])
    def f(x):
        return x @ w, w[:4].sum(1)

    for n in (3, 3, 3, 6, 6, 6):
        x = torch.randn(n, 6, device=device)
        a, b = f(x)
        assert a.shape == (n, 6) and b.shape == (4,)
        torch.testing.assert_close(a, x @ w, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(b, w[:4].sum(1), rtol=0, atol=0)
    rows = autograph.stats(f)
    assert sum(r.replays for r in rows) >= 4 and all(r.state == "graphed" for r in rows), rows


def test_bucket_output_dim0_equal_to_bucket_by_chance(device):
    w = torch.randn(4, 6, device=device)  # 4 rows: the bucket size

    @autograph.graphed(buckets=[4, 8])
    def f(x):
        return x * 2, w * 3

    for n in (3, 3, 3, 7, 7, 7, 3, 7):
        x = torch.randn(n, 6, device=device)
        a, b = f(x)
        assert a.shape == (n, 6)
        assert b.shape == (4, 6), b.shape
        torch.testing.assert_close(b, w * 3, rtol=0, atol=0)
        torch.testing.assert_close(a, x * 2, rtol=0, atol=0)
    rows = autograph.stats(f)
    assert sum(r.replays for r in rows) >= 4, rows


def test_bucket_mean_over_batch_goes_eager_with_reason(device):
    @autograph.graphed(buckets=[4, 8])
    def f(x):
        return x - x.mean(0)

    for n in (3, 3, 3, 3, 5, 5, 5):
        x = torch.randn(n, 6, device=device)
        torch.testing.assert_close(f(x), x - x.mean(0), rtol=1e-6, atol=1e-6)
    rows = autograph.stats(f)
    assert any(r.state == "eager" and r.fallback_reason for r in rows), rows
    assert all(r.state == "eager" for r in rows if r.bucket == 4), rows
    reason = [r.fallback_reason for r in rows if r.state == "eager"][0]
    assert "pad" in reason or "batch" in reason or "rows" in reason, reason


def test_bucket_flip_over_the_batch_is_caught(device):
    @autograph.graphed(buckets=[4, 8])
    def f(x):
        return x.flip(0) * 2

    for n in (3, 3, 3, 3, 6, 6, 6):
        x = torch.randn(n, 5, device=device)
        torch.testing.assert_close(f(x), x.flip(0) * 2, rtol=0, atol=0)


def test_bucket_sum_over_the_batch_to_a_vector(device):
    @autograph.graphed(buckets=[4, 8])
    def f(x):
        return x.sum(0), x + 1

    for n in (3, 3, 3, 3, 6, 6, 6, 4, 4, 4):
        x = torch.randn(n, 5, device=device)
        a, b = f(x)
        torch.testing.assert_close(a, x.sum(0), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(b, x + 1, rtol=0, atol=0)


def test_bucket_writes_its_argument_in_place(device):
    @autograph.graphed(buckets=[4, 8])
    def f(x):
        x.mul_(2)
        return x + 1

    for n in (3, 3, 3, 3, 6, 6, 6):
        x = torch.randn(n, 5, device=device)
        want_x = x * 2
        out = f(x)
        torch.testing.assert_close(x, want_x, rtol=0, atol=0)
        torch.testing.assert_close(out, want_x + 1, rtol=0, atol=0)
    rows = autograph.stats(f)
    assert sum(r.replays for r in rows) >= 3, rows


def test_bucket_size_read_in_python_gives_eagers_result(device):
    @autograph.graphed(buckets=[4, 8])
    def f(x):
        return x * x.shape[0]

    for n in (3, 3, 3, 3, 6, 6, 6):
        x = torch.randn(n, 5, device=device)
        torch.testing.assert_close(f(x), x * n, rtol=0, atol=0)


def test_bucket_verify_checks_the_capture_call_too(device):
    @autograph.graphed(buckets=[4, 8], verify=3)
    def f(x):
        return x * x.shape[0]

    for n in (3, 3, 3, 3):
        x = torch.randn(n, 5, device=device)
        torch.testing.assert_close(f(x), x * n, rtol=0, atol=0)
    assert autograph.stats(f)[0].state == "eager"
