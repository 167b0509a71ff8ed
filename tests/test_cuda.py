"""The CUDA suite: real graphs on a real GPU. Skipped, with the reason, where there is none."""
import copy
import threading

import pytest
import torch

import autograph
from conftest import autograph_warnings, requires_cuda

pytestmark = [pytest.mark.cuda, requires_cuda]


def mlp(layers=32, width=512, dtype=torch.bfloat16):
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*blocks).cuda().to(dtype).eval()


def test_mlp_equals_eager_bitwise():
    model = mlp()
    graphed = autograph.graphed(copy.deepcopy(model))
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
            assert torch.equal(graphed(x), model(x))
    row, = graphed.forward.stats()
    assert (row.state, row.calls, row.eager_calls, row.replays) == ("graphed", 6, 1, 5)
    assert row.graph_bytes >= 0 and row.capture_seconds < 5


def test_pytree_inputs_and_outputs():
    @autograph.graphed
    def f(batch, scale):
        h = batch["x"] @ batch["w"][0]
        return {"h": h * scale, "parts": (h.sum(), [h.mean(-1)])}

    for _ in range(5):
        batch = {"x": torch.randn(4, 8, device="cuda"), "w": [torch.randn(8, 8, device="cuda")]}
        out = f(batch, 2.0)
        h = batch["x"] @ batch["w"][0]
        assert torch.equal(out["h"], h * 2.0)
        assert torch.equal(out["parts"][0], h.sum())
        assert torch.equal(out["parts"][1][0], h.mean(-1))
    assert f.stats()[0].state == "graphed"


def test_several_shapes_and_kept_outputs():
    @autograph.graphed
    def f(x):
        return torch.tanh(x) * 2

    kept = []
    for _ in range(4):
        for n in (1, 7, 64):
            x = torch.randn(n, 16, device="cuda")
            kept.append((x, f(x)))
    for x, out in kept:  # every output still holds its own call's value
        assert torch.equal(out, torch.tanh(x) * 2)
    assert sorted(s.state for s in f.stats()) == ["graphed"] * 3


def test_static_outputs_are_fast_and_stale_ones_raise():
    @autograph.graphed(outputs="static")
    def f(x):
        return x * 3

    first = None
    for i in range(4):
        out = f(torch.full((4,), float(i), device="cuda"))
        assert torch.equal(out, torch.full((4,), 3.0 * i, device="cuda"))
        if i == 2:
            first, view = out, out[1:]
    f(torch.zeros(4, device="cuda"))
    with pytest.raises(RuntimeError, match="was overwritten by a later call"):
        first.sum()
    with pytest.raises(RuntimeError, match="was overwritten by a later call"):
        view.sum()


def test_in_place_argument_writes_and_aliased_outputs():
    @autograph.graphed
    def f(total, x):
        total.add_(x)
        return total, total[:2], total.sum()

    total = torch.zeros(4, device="cuda")
    for i in range(5):
        same, head, s = f(total, torch.ones(4, device="cuda"))
        assert same is total and torch.equal(total, torch.full((4,), i + 1.0, device="cuda"))
        assert head.data_ptr() == total.data_ptr() and s.item() == 4 * (i + 1)


class Affine(torch.nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.linear = torch.nn.Linear(32, 32)
        self.scale = scale

    @autograph.graphed
    def forward(self, x):
        return self.linear(x) * self.scale


def test_methods_on_two_instances():
    a, b = Affine(1.0).cuda(), Affine(2.0).cuda()
    with torch.inference_mode():
        for _ in range(4):
            x = torch.randn(3, 32, device="cuda")
            assert torch.equal(a(x), a.linear(x) * 1.0)
            assert torch.equal(b(x), b.linear(x) * 2.0)
    assert sorted(r.state for r in Affine.forward.stats()) == ["graphed", "graphed"]


def test_autocast_on_and_off_get_their_own_graphs():
    model = mlp(layers=4, dtype=torch.float32)
    graphed = autograph.graphed(copy.deepcopy(model))
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 512, device="cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                assert torch.equal(graphed(x), model(x))
            assert torch.equal(graphed(x), model(x))
    keys = sorted(r.key for r in graphed.forward.stats())
    assert keys == ["input: f32[2, 512] cuda:0 (no_grad, autocast cuda bf16, eval)",
                    "input: f32[2, 512] cuda:0 (no_grad, eval)"]
    assert all(r.state == "graphed" for r in graphed.forward.stats())


def test_counter_is_incremented_once_per_call_in_every_phase():
    counter = torch.zeros((), dtype=torch.int64, device="cuda")

    @autograph.graphed(warmup=3)
    def bump(x):
        counter.add_(1)
        return x + counter

    for n in range(1, 10):
        assert torch.equal(bump(torch.zeros(2, device="cuda")),
                           torch.full((2,), float(n), device="cuda"))
        assert counter.item() == n


def test_item_falls_back_to_eager_once_naming_the_line(caught):
    @autograph.graphed
    def f(x):
        scale = x.abs().max().item()
        return x / scale

    for _ in range(4):
        x = torch.randn(8, device="cuda")
        assert torch.equal(f(x), x / x.abs().max().item())
    messages = autograph_warnings(caught)
    line = f.__wrapped__.__code__.co_firstlineno + 2
    assert len(messages) == 1
    assert messages[0].endswith(f"(x: f32[8] cuda:0) runs eagerly: .item() at "
                                f"test_cuda.py:{line} synchronises with the host")


def test_synchronize_falls_back_and_the_process_stays_healthy(caught):
    @autograph.graphed
    def f(x):
        y = x * 2
        torch.cuda.synchronize()
        return y

    for _ in range(3):
        x = torch.randn(4, device="cuda")
        assert torch.equal(f(x), x * 2)
    assert "torch.cuda.synchronize() at test_cuda.py:" in autograph_warnings(caught)[0]


def test_users_exception_during_capture_propagates_and_the_key_recovers():
    counter = torch.zeros((), device="cuda")
    fail = [False]

    @autograph.graphed
    def f(x):
        counter.add_(1)
        if fail[0]:
            raise ValueError("bad input")
        return x + counter

    f(torch.zeros(1, device="cuda"))
    fail[0] = True
    with pytest.raises(ValueError, match="bad input"):
        f(torch.zeros(1, device="cuda"))
    assert counter.item() == 2
    fail[0] = False
    assert f(torch.zeros(1, device="cuda")).item() == 3
    assert f(torch.zeros(1, device="cuda")).item() == 4
    assert f.stats()[0].state == "graphed"


def test_random_ops_are_fresh_per_replay_and_follow_the_seed():
    @autograph.graphed
    def noisy(x):
        return torch.nn.functional.dropout(x, 0.5) + torch.rand_like(x)

    def run():
        torch.manual_seed(0)
        return [noisy(torch.ones(64, device="cuda")) for _ in range(6)]

    first = run()
    assert noisy.stats()[0].state == "graphed"
    assert len({tuple(t.tolist()) for t in first}) == 6
    second = run()
    assert all(torch.equal(a, b) for a, b in zip(first[2:], second[2:]))


def test_nested_graphed_function_is_part_of_the_outer_graph():
    @autograph.graphed
    def inner(x):
        return x * 2

    @autograph.graphed
    def outer(x):
        return inner(x) + 1

    for _ in range(4):
        x = torch.randn(3, device="cuda")
        assert torch.equal(outer(x), x * 2 + 1)
    assert outer.stats()[0].state == "graphed"


def test_two_threads_get_correct_results():
    @autograph.graphed
    def f(x, w):
        return torch.relu(x @ w)

    w = torch.randn(64, 64, device="cuda")
    errors = []

    def worker(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        for _ in range(100):
            x = torch.randn(8, 64, device="cuda", generator=g)
            if not torch.equal(f(x, w), torch.relu(x @ w)):
                errors.append(seed)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and f.stats()[0].replays == 199


def test_replay_on_another_stream_is_ordered():
    @autograph.graphed
    def f(x):
        return torch.sin(x) * 2 + x.flip(0)

    side = torch.cuda.Stream()
    for i in range(6):
        x = torch.randn(1 << 22, device="cuda")
        stream = side if i % 2 else torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            out = f(x)
        torch.cuda.current_stream().wait_stream(stream)
        assert torch.equal(out, torch.sin(x) * 2 + x.flip(0))


def test_replaced_parameters_are_captured_again():
    model = autograph.graphed(mlp(layers=2, dtype=torch.float32))
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(1, 512, device="cuda"))
        model.to(torch.float64).to(torch.float32)  # every parameter gets new memory
        model[0].weight.mul_(0)                     # and an in-place update must show
        x = torch.randn(1, 512, device="cuda")
        reference = x
        for layer in model:
            reference = layer(reference)
        assert torch.equal(model(x), reference)


def test_reset_gives_the_memory_back():
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()

    @autograph.graphed
    def f(x):
        return (x @ x.t()).relu() @ x

    for _ in range(3):
        f(torch.randn(1024, 1024, device="cuda"))
    assert torch.cuda.memory_reserved() > base
    f.reset()
    assert torch.cuda.memory_reserved() <= base + (2 << 20)


def test_max_graphs_is_respected(caught):
    @autograph.graphed(max_graphs=1)
    def f(x):
        return x + 1

    for n in (1, 2, 3):
        for _ in range(3):
            assert torch.equal(f(torch.zeros(n, device="cuda")), torch.ones(n, device="cuda"))
    assert sorted(s.state for s in f.stats()) == ["eager", "eager", "graphed"]
    assert len(autograph_warnings(caught)) == 1


def llama(layers=8, hidden=512):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=8, vocab_size=1024,
        max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).cuda().to(torch.bfloat16).eval()
    return transformers, config, model


def static_cache(transformers, config, length=64):
    return transformers.StaticCache(config=config, max_cache_len=length)


def test_hf_llama_decode_with_static_cache_matches_eager(caught):
    transformers, config, model = llama()
    eager_model, graphed_model = model, autograph.graphed(copy.deepcopy(model))
    prompt = torch.randint(0, 1024, (1, 8), device="cuda")
    tokens = torch.randint(0, 1024, (20, 1, 1), device="cuda")

    def decode(m):
        cache = static_cache(transformers, config)
        logits = []
        with torch.inference_mode():
            m(input_ids=prompt, past_key_values=cache, use_cache=True,
              cache_position=torch.arange(8, device="cuda"))
            for step in range(20):
                position = torch.tensor([8 + step], device="cuda")
                out = m(input_ids=tokens[step], past_key_values=cache, use_cache=True,
                        cache_position=position)
                logits.append(out.logits)
        return logits

    expected, got = decode(eager_model), decode(graphed_model)
    for step, (a, b) in enumerate(zip(expected, got)):
        assert torch.equal(a, b), f"decode step {step} differs"
    decode_row, = [r for r in graphed_model.forward.stats() if "[1, 1]" in r.key]
    assert decode_row.state == "graphed", decode_row.fallback_reason
    assert decode_row.replays == 19 and decode_row.eager_calls == 1
    assert autograph_warnings(caught) == []
