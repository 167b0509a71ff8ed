"""``autograph.region()`` on a real GPU: an HF decode loop. The region's other tests run on
the GPU too, in test_region.py."""

import copy
import threading

import pytest
import torch

import autograph

from conftest import autograph_warnings, is_label_of, requires_cuda, states
from helpers.models import llama, static_decode

pytestmark = [pytest.mark.cuda, requires_cuda]


def test_hf_llama_decode_loop_in_a_region_matches_eager(caught):
    transformers, config, model = llama()
    region_model = copy.deepcopy(model)
    prompt = torch.randint(0, 1024, (1, 8), device="cuda")
    tokens = torch.randint(0, 1024, (20, 1, 1), device="cuda")

    expected = static_decode(model, transformers, config, prompt, tokens)
    with autograph.region() as region:
        got = static_decode(region_model, transformers, config, prompt, tokens)
    for step, (a, b) in enumerate(zip(expected, got)):
        assert torch.equal(a, b), f"decode step {step} differs"
    stats = region.stats()
    assert (stats.captures, stats.replays) == (1, 18)
    # the prefill (a key of its own, one plain call) and the decode's first two steps: a
    # plain call and the watched warmup (the region's warmup=2)
    assert stats.eager_calls == 3
    # the prefill stays in warmup (one call), the decode step is graphed: nothing else, no
    # key for the model's submodules
    assert states(region) == [("warmup", 1, 1, 0), ("graphed", 20, 2, 18)]
    assert autograph.stats(region_model) == stats.keys
    assert all(is_label_of(r.function, type(region_model)) for r in stats.keys)
    assert autograph.stats(model) == []  # the eager reference was not graphed
    assert autograph_warnings(caught) == []


class _Scale(torch.nn.Module):
    """``x * k``: one kernel, whose output a capture takes from the pool's free memory."""

    def __init__(self, k):
        super().__init__()
        self.k = k

    def forward(self, x):
        return x * self.k


class _ScaleThenShift(_Scale):
    """An intermediate the size of its input, freed at the end of its capture."""

    def forward(self, x):
        return x * self.k + 1


@pytest.mark.parametrize("own_streams", [False, True], ids=["one-stream", "a-stream-each"])
def test_one_region_entered_by_two_threads_keeps_each_calls_outputs(own_streams):
    # Graphs captured in one region share its pool: the second module's output may sit in the
    # memory of the first one's intermediate. Two threads calling them through one region
    # object must not replay one graph between another's replay and the copy of its output.
    region = autograph.region(check_payoff=False, warmup=1)
    first, second = _ScaleThenShift(3.0), _Scale(5.0)
    x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    with torch.no_grad(), region:
        for _ in range(3):
            first(x)  # captured first: its intermediate goes back to the pool
        for _ in range(3):
            second(x)
    want = {first: x * 3.0 + 1, second: x * 5.0}
    wrong = []

    def work(module):
        stream = torch.cuda.Stream() if own_streams else torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(stream):
            outs = []
            for _ in range(300):
                with region:
                    outs.append(module(x))
            stream.synchronize()
        wrong.extend(i for i, out in enumerate(outs) if not torch.equal(out, want[module]))

    threads = [threading.Thread(target=work, args=(m,)) for m in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []
    stats = region.stats()
    assert stats.captures == 2 and stats.replays >= 600, stats
