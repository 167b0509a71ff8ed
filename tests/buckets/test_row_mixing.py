"""Whether a bucket's graph mixes rows (autograph/buckets/_row_mixing.py), probed by a second replay
whose pad rows hold copies of the real rows; a plain function on static tensors stands in for
the replay of a graph here."""

import torch

from autograph.buckets._row_mixing import mixes_rows


def probe(fn, x, rows, written=()):
    """Run ``fn`` on the static ``x`` as the call's replay did, then probe."""
    first = [o.clone() for o in fn(x)]
    return mixes_rows(
        lambda: fn(x),
        [(x, 0)],
        rows,
        list(written),
        first,
        [(0,) if o.dim() and o.shape[0] == x.shape[0] else () for o in first],
    )


def padded(rows, bucket, width=5):
    x = torch.zeros(bucket, width)
    x[:rows] = torch.randn(rows, width)
    return x


def test_a_function_of_each_row_on_its_own_does_not_mix_rows():
    w = torch.randn(5, 3)
    x = padded(3, 8)
    before = x.clone()
    assert probe(lambda s: [torch.relu(s @ w), w.sum(0)], x, 3) is None
    assert torch.equal(x, before)  # the pad rows are back to the pad value


def test_a_mean_over_the_batch_mixes_rows():
    finding = probe(lambda s: [s - s.mean(0)], padded(3, 4), 3)
    assert "output 0 (its real rows) changed" in finding and "mixes rows" in finding


def test_batch_norm_in_training_mixes_rows_and_its_running_statistics_are_restored():
    norm = torch.nn.BatchNorm1d(5).train()
    with torch.no_grad():
        norm.running_mean.uniform_()
    x = padded(3, 4)
    with torch.no_grad():
        first = [norm(x).clone()]  # the call's own replay
        after_the_call = {k: v.clone() for k, v in norm.state_dict().items()}
        finding = mixes_rows(lambda: [norm(x)], [(x, 0)], 3, list(norm.buffers()), first, [(0,)])
    assert "mixes rows" in finding
    assert all(torch.equal(v, after_the_call[k]) for k, v in norm.state_dict().items())


def test_a_written_cache_is_restored_after_the_probe():
    cache = torch.zeros(4, 5)

    def store(s):
        cache.copy_(s * 2)
        return [s + 1]

    x = padded(3, 4)
    store(x)
    after_the_call = cache.clone()
    assert probe(store, x, 3, written=[cache]) is None
    assert torch.equal(cache, after_the_call)


def test_a_call_of_the_buckets_own_size_has_nothing_to_probe():
    calls = []
    x = padded(4, 4)
    assert (
        mixes_rows(lambda: calls.append(1) or [x.mean(0)], [(x, 0)], 4, [], [x.mean(0)], [()])
        is None
    )
    assert not calls


def test_more_pad_rows_than_real_rows_are_filled_by_cycling_the_real_rows():
    seen = []
    x = padded(2, 7)

    def record(s):
        seen.append(s.clone())
        return [s * 2]

    assert probe(record, x, 2) is None
    probe_input = seen[-1]
    assert torch.equal(probe_input[2:4], probe_input[:2])
    assert torch.equal(probe_input[6], probe_input[0])
