"""Common modules stay graphed and equal eager: Sequential with LayerNorm and dropout, BatchNorm in
eval and train, LSTM, an HF forward in a region, a TransformerEncoderLayer, a train/eval switch.
"""

import copy

import pytest
import torch

import autograph

from conftest import states

pytestmark = pytest.mark.usefixtures("caught")


def _tiny_bert(device):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return transformers.BertModel(cfg).to(device).eval()


def _tiny_llama(device):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(device).eval()


@pytest.mark.parametrize("train", [True, False])
def test_sequential_with_layernorm_dropout_stays_graphed(device, train):
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(8, 8),
        torch.nn.LayerNorm(8),
        torch.nn.Dropout(0.0 if train else 0.5),
        torch.nn.Linear(8, 4),
    ).to(device)
    m.train(train)
    ref = copy.deepcopy(m)
    xs = [torch.randn(3, 8, device=device) for _ in range(5)]
    with torch.no_grad(), autograph.region():
        outs = [m(x) for x in xs]
    for x, o in zip(xs, outs):
        torch.testing.assert_close(o, ref(x).detach(), rtol=0, atol=0)
    # A region's key: a plain call, a watched warmup, then a capture and replays.
    assert states(m) == [("graphed", 5, 2, 3)], autograph.stats(m)


def test_batchnorm_eval_and_train_stay_graphed(device):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)).to(device)
    ref = copy.deepcopy(m)
    g = autograph.graphed(m)
    xs = [torch.randn(6, 8, device=device) for _ in range(5)]
    with torch.no_grad():
        for x in xs:
            torch.testing.assert_close(g(x), ref(x), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(m[1].running_mean, ref[1].running_mean, rtol=1e-6, atol=1e-6)
    assert m[1].num_batches_tracked.item() == ref[1].num_batches_tracked.item()
    assert states(g) == [("graphed", 5, 1, 4)], autograph.stats(g)


def test_lstm_stays_graphed(device):
    torch.manual_seed(0)
    m = torch.nn.LSTM(8, 16, batch_first=True).to(device).eval()
    ref = copy.deepcopy(m)
    g = autograph.graphed(m)
    xs = [torch.randn(2, 5, 8, device=device) for _ in range(4)]
    with torch.no_grad():
        for x in xs:
            out, (h, c) = g(x)
            rout, (rh, rc) = ref(x)
            torch.testing.assert_close(out, rout, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(h, rh, rtol=1e-6, atol=1e-6)
    assert states(g) == [("graphed", 4, 1, 3)], autograph.stats(g)


@pytest.mark.parametrize("make", [_tiny_bert, _tiny_llama])
def test_hf_forward_in_region_stays_graphed(device, make):
    m = make(device)
    ids = [torch.randint(0, 64, (2, 7), device=device) for _ in range(5)]
    with torch.no_grad():
        want = [(m(i, use_cache=False) if make is _tiny_llama else m(i)) for i in ids]
        with autograph.region():
            got = [(m(i, use_cache=False) if make is _tiny_llama else m(i)) for i in ids]
    key = "logits" if make is _tiny_llama else "last_hidden_state"
    for w, g in zip(want, got):
        torch.testing.assert_close(g[key], w[key], rtol=1e-5, atol=1e-5)
    rows = states(m)
    assert rows and rows[0][0] == "graphed" and rows[0][3] >= 3, autograph.stats(m)


def test_transformer_encoder_layer_eval_stays_graphed(device):
    torch.manual_seed(0)
    m = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True).to(device).eval()
    ref = copy.deepcopy(m)
    with torch.no_grad(), autograph.region():
        for _ in range(5):
            x = torch.randn(2, 5, 16, device=device)
            torch.testing.assert_close(m(x), ref(x), rtol=1e-5, atol=1e-5)
    assert states(m)[0][0] == "graphed" and states(m)[0][3] >= 3, autograph.stats(m)


def test_train_eval_switch_of_a_graphed_module(device):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)).to(device)
    ref = copy.deepcopy(m)
    g = autograph.graphed(m)
    with torch.no_grad():
        for mode in (False, True, False, True, False):
            m.train(mode)
            ref.train(mode)
            for _ in range(3):
                x = torch.randn(6, 8, device=device)
                torch.testing.assert_close(g(x), ref(x), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(m[1].running_mean, ref[1].running_mean, rtol=1e-6, atol=1e-6)
    assert sum(s[3] for s in states(g)) >= 8, autograph.stats(g)
