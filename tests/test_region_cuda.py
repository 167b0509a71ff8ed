"""``autograph.region()`` on a real GPU: an HF decode loop and a training loop."""
import copy

import pytest
import torch

import autograph
from conftest import autograph_warnings, requires_cuda
from test_cuda import llama, static_cache

pytestmark = [pytest.mark.cuda, requires_cuda]


def test_hf_llama_decode_loop_in_a_region_matches_eager(caught):
    transformers, config, model = llama()
    region_model = copy.deepcopy(model)
    prompt = torch.randint(0, 1024, (1, 8), device="cuda")
    tokens = torch.randint(0, 1024, (20, 1, 1), device="cuda")

    def decode(m):
        cache = static_cache(transformers, config)
        logits = []
        m(input_ids=prompt, past_key_values=cache, use_cache=True,
          cache_position=torch.arange(8, device="cuda"))
        for step in range(20):
            out = m(input_ids=tokens[step], past_key_values=cache, use_cache=True,
                    cache_position=torch.tensor([8 + step], device="cuda"))
            logits.append(out.logits)
        return logits

    with torch.inference_mode():
        expected = decode(model)
        with autograph.region() as region:
            got = decode(region_model)
    for step, (a, b) in enumerate(zip(expected, got)):
        assert torch.equal(a, b), f"decode step {step} differs"
    stats = region.stats()
    assert (stats.captures, stats.replays) == (1, 19)
    assert stats.eager_calls == 2   # the prefill (a key of its own) and the decode's warmup
    assert {r.function for r in stats.keys} == {"LlamaForCausalLM"}
    assert autograph_warnings(caught) == []


def test_a_training_loop_in_a_region_still_trains(caught):
    def train(use_region):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                                    torch.nn.Linear(64, 1)).cuda()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        data = torch.randn(256, 32, device="cuda")
        target = data.sum(-1, keepdim=True)
        losses = []
        with (autograph.region() if use_region else torch.enable_grad()):
            for _ in range(30):
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(model(data), target)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
            with torch.no_grad():          # evaluation inside the region is graphed
                for _ in range(3):
                    model(data)
        return losses, model

    eager_losses, _ = train(False)
    region_losses, model = train(True)
    assert region_losses == eager_losses
    assert region_losses[-1] < region_losses[0] / 4
    assert len(autograph_warnings(caught)) == 1
    assert sorted(r.state for r in autograph.stats() if r.function == "Sequential") == \
        ["eager", "graphed"]


def test_graphs_of_one_region_share_one_pool():
    a = torch.nn.Linear(64, 64).cuda()
    b = torch.nn.Linear(64, 32).cuda()
    with torch.no_grad(), autograph.region() as region:
        for _ in range(3):
            b(a(torch.randn(4, 64, device="cuda")))
    graphs = [entry.graph for entry in region._touched.values()]
    assert len(graphs) == 2 and graphs[0].pool == graphs[1].pool == region.pools[0]
