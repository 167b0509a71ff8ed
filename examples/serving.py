"""Serve an HF BERT encoder at mixed batch sizes with buckets, captured ahead of time.

    python examples/serving.py    # needs a CUDA GPU and transformers:
                                  # pip install -e ".[examples]"

Six capture sizes share one memory pool; a request of any size up to 32 replays the graph of
the smallest size that holds it, padded, its outputs sliced back.
"""

import time

import torch
from _needs import needs

import autograph


def main():
    transformers = needs(__file__, cuda=True, transformers=True)
    config = transformers.BertConfig(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=1024,
        vocab_size=1024,
    )
    model = transformers.BertModel(config).cuda().eval()
    model = autograph.graphed(model, buckets=[1, 2, 4, 8, 16, 32])
    seq = 64
    with torch.inference_mode():
        started = time.perf_counter()
        model.forward.capture(
            input_ids=torch.zeros(32, seq, dtype=torch.long, device="cuda"),
            attention_mask=torch.ones(32, seq, dtype=torch.long, device="cuda"),
        )
        print(
            f"captured {len(autograph.stats(model))} sizes in {time.perf_counter() - started:.2f} s"
        )
        for batch in (1, 3, 5, 8, 12, 17, 24, 32) * 4:
            ids = torch.randint(0, 1024, (batch, seq), device="cuda")
            mask = torch.ones(batch, seq, dtype=torch.long, device="cuda")
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
            assert hidden.shape == (batch, seq, 256)
    autograph.report(model)


if __name__ == "__main__":
    main()
