"""The counts of stats() add up with verify, buckets and capture() ahead."""

import torch

import autograph

from conftest import states


def test_counts_add_up_with_verify_buckets_and_capture_ahead(device):
    w = torch.randn(5, 5, device=device)

    def step(x):
        return torch.tanh(x @ w) + 1

    fn = autograph.graphed(step, buckets=[4, 8], verify=2)
    fn.capture(torch.randn(8, 5, device=device))
    rows = [3, 3, 4, 2, 3, 7, 8, 5, 5, 1, 6, 8]
    for r in rows:
        x = torch.randn(r, 5, device=device)
        torch.testing.assert_close(fn(x), step(x))
    stats = {s.bucket: s for s in fn.stats()}
    assert sorted(stats) == [4, 8]
    for bucket, s in stats.items():
        assert s.state == "graphed" and s.eager_calls == 0
        assert (
            s.calls == s.replays == sum(1 for r in rows if r <= bucket and (bucket == 4 or r > 4))
        )
        assert s.verified >= 2  # verify=2 checked its first two, the padded checks aside
    assert [st for st, *_ in states(fn)] == ["graphed", "graphed"]
