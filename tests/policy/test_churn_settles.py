"""A function whose keys churn and then settle ends graphed, as a function and in a region."""

import copy

import pytest
import torch

import autograph

from conftest import python_run_log
from helpers.models import gelu_mlp

pytestmark = pytest.mark.usefixtures("caught")


def test_churn_then_settle_ends_graphed(device):
    log_run = python_run_log()

    @autograph.graphed
    def f(x):
        log_run(x.shape[0])
        return x * 2 + 1

    for n in range(1, 21):
        x = torch.randn(n, 3, device=device)
        torch.testing.assert_close(f(x), x * 2 + 1, rtol=0, atol=0)
    for _ in range(200):
        x = torch.randn(7, 3, device=device)
        torch.testing.assert_close(f(x), x * 2 + 1, rtol=0, atol=0)
    rows = [r for r in autograph.stats(f) if "7" in r.key]
    assert any(r.state == "graphed" and r.replays >= 100 for r in rows), autograph.stats(f)


def test_churn_in_a_region_then_settle(device):
    m = gelu_mlp(device)
    ref = copy.deepcopy(m)
    with torch.no_grad(), autograph.region():
        for n in list(range(1, 21)) + [5] * 150:
            x = torch.randn(n, 8, device=device)
            torch.testing.assert_close(m(x), ref(x), rtol=0, atol=0)
    rows = [r for r in autograph.stats(m) if r.key.startswith("x: f32[5,") or "[5, 8]" in r.key]
    assert any(r.state == "graphed" and r.replays >= 50 for r in rows), autograph.stats(m)
