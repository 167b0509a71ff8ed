"""Graph one decode step of an HF transformers Llama with a StaticCache.

    python examples/decode.py     # needs a CUDA GPU and transformers:
                                  # pip install -e ".[examples]"

The model (random weights, 8 layers, hidden 512) is graphed whole: each decode step of the same
shape replays one CUDA graph. The cache object is a keyword argument: autograph keys it by
identity and its tensors are updated in place by the graph.
"""

import time

import torch
from _needs import needs

import autograph


def main():
    transformers = needs(__file__, cuda=True, transformers=True)
    config = transformers.LlamaConfig(
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=1024,
        max_position_embeddings=256,
    )
    model = transformers.LlamaForCausalLM(config).cuda().to(torch.bfloat16).eval()
    model = autograph.graphed(model)
    cache = transformers.StaticCache(config=config, max_cache_len=256)
    ids = torch.randint(0, 1024, (1, 8), device="cuda")
    with torch.inference_mode():
        logits = model(
            input_ids=ids,
            past_key_values=cache,
            use_cache=True,
            cache_position=torch.arange(8, device="cuda"),
        ).logits
        token = logits[:, -1:].argmax(-1)
        position = torch.tensor([7], device="cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(100):
            position += 1  # stays on the GPU: no host synchronisation per step
            logits = model(
                input_ids=token, past_key_values=cache, use_cache=True, cache_position=position
            ).logits
            token = logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
    print(f"100 greedy decode steps: {(time.perf_counter() - start) * 1e3:.1f} ms")
    autograph.report()


if __name__ == "__main__":
    main()
