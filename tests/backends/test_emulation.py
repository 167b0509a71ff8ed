"""The CPU emulation of CUDA graphs, tested directly on its backend (no engine).

Each test captures a ``run`` closure with ``CPU.capture`` and replays the graph, checking what a
CUDA graph would do: no effect left by the capture, every effect on every replay, fresh random
numbers per replay, nothing kept alive that a CUDA graph would not keep; and, through the
engine, HF code that asks whether the current stream is capturing.
"""

import copy
import dataclasses
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

import autograph
import autograph.testing
from autograph.backends._cpu_graphs import CPU, CpuGraph, emulate_graphs_on_cpu, is_emulating
from autograph.testing import emulate_graphs_on_cpu as public_emulate_graphs_on_cpu

from conftest import autograph_warnings


def capture(run, generators=()):
    result = CPU.capture(run, -1, CPU.new_pool(-1), False, generators)
    assert result.error is None and result.hard_error is None, result.error
    assert isinstance(result.graph, CpuGraph)
    return result


def test_user_exception_goes_to_error_and_the_part_before_it_replays():
    state = torch.zeros(3)

    def run():
        state.add_(1)
        raise ValueError("boom")

    result = CPU.capture(run, -1, CPU.new_pool(-1))
    assert isinstance(result.error, ValueError) and result.outputs is None
    assert torch.equal(state, torch.zeros(3))  # the write before the exception is undone
    result.graph.replay()
    assert torch.equal(state, torch.ones(3))


def test_in_place_writes_are_undone_by_the_capture_and_redone_by_every_replay():
    state = torch.zeros(2, 3)
    counter = torch.zeros(())

    def run():
        state[0].add_(1)  # two views of one storage: both writes must be undone
        state[1].mul_(5).add_(2)
        counter.add_(1)
        return state.sum() + counter

    result = capture(run)
    assert torch.equal(state, torch.zeros(2, 3)) and counter.item() == 0
    assert result.outputs.item() == 3 + 6 + 1  # the capture's result, as computed
    result.graph.replay()
    assert state.tolist() == [[1, 1, 1], [2, 2, 2]] and counter.item() == 1
    assert result.outputs.item() == 3 + 6 + 1
    result.graph.replay()
    assert state.tolist() == [[2, 2, 2], [12, 12, 12]] and counter.item() == 2
    assert result.outputs.item() == 6 + 36 + 2  # the graph rewrites its own output


def test_replays_read_current_contents_of_preexisting_tensors():
    x = torch.ones(4)
    weight = torch.full((4,), 2.0)
    result = capture(lambda: x * weight)
    x.fill_(3)
    weight.fill_(10)
    result.graph.replay()
    assert torch.equal(result.outputs, torch.full((4,), 30.0))


def through_module(bn, x):
    return bn(x)


def through_functional(bn, x):
    return F.batch_norm(x, bn.running_mean, bn.running_var, training=True, momentum=0.1)


@pytest.mark.parametrize("forward", [through_module, through_functional])
def test_batch_norm_running_stats_are_updated_once_per_replay_as_eagerly(forward):
    torch.manual_seed(0)
    x = torch.randn(8, 3) * 4 + 1
    graphed_bn, eager_bn = torch.nn.BatchNorm1d(3), torch.nn.BatchNorm1d(3)
    with torch.no_grad():
        result = capture(lambda: forward(graphed_bn, x))
        assert torch.equal(graphed_bn.running_mean, torch.zeros(3))  # capture: no effect
        assert torch.equal(graphed_bn.running_var, torch.ones(3))
        assert graphed_bn.num_batches_tracked.item() == 0
        for _ in range(3):
            expected = forward(eager_bn, x)
            result.graph.replay()
            assert torch.allclose(result.outputs, expected)
            assert torch.allclose(graphed_bn.running_mean, eager_bn.running_mean)
            assert torch.allclose(graphed_bn.running_var, eager_bn.running_var)
            assert torch.equal(graphed_bn.num_batches_tracked, eager_bn.num_batches_tracked)


def test_batch_norm_in_eval_mode_writes_nothing():
    bn = torch.nn.BatchNorm1d(3).eval()
    bn.running_mean.fill_(1)
    x = torch.randn(4, 3)
    with torch.no_grad():
        result = capture(lambda: bn(x))
        x.mul_(2)
        result.graph.replay()
    assert torch.equal(bn.running_mean, torch.ones(3)) and bn.num_batches_tracked.item() == 0
    assert torch.equal(bn.running_var, torch.ones(3))
    assert torch.allclose(result.outputs, (x - 1) / (1 + bn.eps) ** 0.5)


def random_step(x, generator):
    noise = torch.randn(x.shape)
    kept = F.dropout(x, 0.5, training=True)
    uniform = torch.rand(x.shape, generator=generator)
    return noise + kept + uniform


def test_random_draws_match_eager_call_for_call_under_a_seed():
    x = torch.ones(16)
    generator = torch.Generator()

    torch.manual_seed(0)
    generator.manual_seed(1)
    eager = [random_step(x, generator) for _ in range(3)]
    eager_default_state = torch.get_rng_state()
    eager_explicit_state = generator.get_state()

    torch.manual_seed(0)
    generator.manual_seed(1)
    before_default, before_explicit = torch.get_rng_state(), generator.get_state()
    result = capture(lambda: random_step(x, generator), [generator])  # registered, as on CUDA
    assert torch.equal(torch.get_rng_state(), before_default)  # the capture drew nothing
    assert torch.equal(generator.get_state(), before_explicit)
    graphed = []
    for _ in range(3):
        result.graph.replay()
        graphed.append(result.outputs.clone())

    for e, g in zip(eager, graphed):
        assert torch.equal(e, g)
    assert not torch.equal(graphed[0], graphed[1])  # fresh numbers per replay
    assert torch.equal(torch.get_rng_state(), eager_default_state)
    assert torch.equal(generator.get_state(), eager_explicit_state)


def test_the_capture_result_is_what_the_first_replay_computes():
    torch.manual_seed(0)
    result = capture(lambda: torch.randn(5))
    captured = result.outputs.clone()
    result.graph.replay()
    assert torch.equal(result.outputs, captured)


def test_preexisting_tensors_are_held_weakly_and_a_replay_after_their_death_raises():
    linear = torch.nn.Linear(4, 4)
    cache = torch.zeros(4)
    x = torch.randn(2, 4)

    # The closure's cells are emptied by the del below (F821): nothing but the graph is left
    # to hold the tensors.
    def run():
        cache.add_(1)  # noqa: F821
        return linear(x) + cache  # noqa: F821

    with torch.no_grad():
        result = capture(run)
        result.graph.replay()
    weight, held_cache = weakref.ref(linear.weight), weakref.ref(cache)
    del linear, cache
    gc.collect()
    assert weight() is None and held_cache() is None
    with pytest.raises(RuntimeError, match="freed since capture.*on CUDA this would read freed"):
        result.graph.replay()


def test_a_failed_replay_writes_nothing():
    state = torch.zeros(3)
    doomed = torch.ones(3)
    result = capture(lambda: (state.add_(1), doomed * 2))  # noqa: F821 (its cell is emptied)
    del doomed
    gc.collect()
    with pytest.raises(RuntimeError, match="freed since capture"):
        result.graph.replay()
    assert torch.equal(state, torch.zeros(3))


def test_replacing_a_parameter_s_memory_is_detected():
    linear = torch.nn.Linear(3, 3)
    x = torch.randn(1, 3)
    with torch.no_grad():
        result = capture(lambda: linear(x))
        linear.weight.data = torch.zeros(3, 3)  # the old memory is freed
    with pytest.raises(RuntimeError, match="freed since capture"):
        result.graph.replay()


def test_memory_that_moved_is_detected():
    buffer = torch.ones(4)
    result = capture(lambda: buffer * 2)
    buffer.resize_(1 << 16)  # reallocates: the graph's address is stale
    with pytest.raises(RuntimeError, match="moved since capture"):
        result.graph.replay()


def test_memory_made_during_the_capture_is_held_by_the_graph():
    x = torch.randn(3)

    def run():
        hidden = x * 2  # pool memory that only the graph references
        return hidden + torch.tensor([1.0, 2.0, 3.0])  # a constant made by torch.tensor

    result = capture(run)
    output = weakref.ref(result.outputs)
    result.outputs = None
    gc.collect()
    assert output() is None
    result.graph.replay()  # reads pool memory, which the graph keeps alive
    assert result.memory_bytes > 0


def test_record_function_inside_the_capture():
    x = torch.randn(4)

    def run():
        with torch.autograd.profiler.record_function("outer"):
            with torch.profiler.record_function("inner"):
                return x.sin()

    result = capture(run)
    result.outputs.zero_()
    result.graph.replay()
    assert torch.equal(result.outputs, x.sin())


@pytest.mark.parametrize("foreach", [False, True])
def test_optimizer_step_is_undone_by_the_capture_and_replayed(foreach):
    torch.manual_seed(0)
    graphed, eager = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    eager.load_state_dict(graphed.state_dict())
    for model in (graphed, eager):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
    graphed_opt = torch.optim.SGD(graphed.parameters(), lr=0.1, momentum=0.9, foreach=foreach)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9, foreach=foreach)
    # The momentum buffers are created by the first step: take it eagerly, as a warmup would.
    graphed_opt.step()
    eager_opt.step()
    before = [p.clone() for p in graphed.parameters()]

    result = capture(graphed_opt.step)
    assert all(torch.equal(p, b) for p, b in zip(graphed.parameters(), before))
    for _ in range(3):
        result.graph.replay()
        eager_opt.step()
        assert all(torch.allclose(g, e) for g, e in zip(graphed.parameters(), eager.parameters()))


def test_rrelu_output_is_produced_on_every_replay():
    x = torch.randn(64)
    torch.manual_seed(0)
    expected = [F.rrelu(x, training=True) for _ in range(2)]

    torch.manual_seed(0)
    result = capture(lambda: F.rrelu(x, training=True))
    result.outputs.zero_()
    for e in expected:
        result.graph.replay()
        assert torch.equal(result.outputs, e)


def test_foreach_ops_returning_lists_and_writing_lists():
    params = [torch.zeros(2), torch.zeros(3)]
    steps = [torch.ones(2), torch.ones(3)]

    def run():
        torch._foreach_add_(params, steps)
        return torch._foreach_mul(params, 2.0)

    result = capture(run)
    assert all(torch.equal(p, torch.zeros_like(p)) for p in params)
    result.graph.replay()
    result.graph.replay()
    assert all(torch.equal(p, torch.full_like(p, 2.0)) for p in params)
    assert all(torch.equal(o, torch.full_like(o, 4.0)) for o in result.outputs)


def test_tuples_of_tensors_and_non_tensor_results():
    x = torch.tensor([[3.0, 1.0], [0.0, 5.0]])

    def run():
        values, indices = torch.max(x, dim=1)
        rows = torch.ops.aten.sym_size.int(x, 0)
        return values * rows, indices

    result = capture(run)
    x.copy_(torch.tensor([[1.0, 9.0], [7.0, 2.0]]))
    result.graph.replay()
    values, indices = result.outputs
    assert values.tolist() == [18.0, 14.0] and indices.tolist() == [1, 0]


def test_in_place_metadata_changes_persist_and_views_share_memory():
    matrix = torch.arange(6.0).reshape(2, 3)
    flat = torch.zeros(6)

    def run():
        matrix.t_()
        flat.view(2, 3)[1].add_(1)  # through a view made during the capture
        return matrix + 0

    result = capture(run)
    assert matrix.shape == (3, 2)  # not undone: CPU-side, as on CUDA
    assert torch.equal(flat, torch.zeros(6))
    result.graph.replay()
    assert torch.equal(result.outputs, torch.arange(6.0).reshape(2, 3).t())
    assert flat.tolist() == [0, 0, 0, 1, 1, 1]


def test_out_variant_writing_a_preexisting_tensor():
    a, b = torch.ones(3), torch.full((3,), 2.0)
    out = torch.zeros(3)
    result = capture(lambda: torch.add(a, b, out=out))
    assert torch.equal(out, torch.zeros(3))
    result.graph.replay()
    assert torch.equal(out, torch.full((3,), 3.0))


def test_conjugate_views_keep_their_meaning():
    a = torch.randn(2, 2, dtype=torch.complex64)
    result = capture(lambda: a.conj() @ a)
    a.mul_(1j)
    result.graph.replay()
    assert torch.allclose(result.outputs, a.conj() @ a)


def test_captured_under_inference_mode_replays_outside_it():
    x = torch.randn(3)

    def run():
        buffer = torch.zeros(3)
        buffer.add_(x)
        return buffer

    with torch.inference_mode():
        result = capture(run)
    x.fill_(2)
    result.graph.replay()
    assert torch.equal(result.outputs, torch.full((3,), 2.0))


def test_sparse_tensors_are_refused_not_held():
    # Held strongly, a sparse tensor rebound after capture replayed the old one.
    sparse = torch.eye(3).to_sparse()
    result = CPU.capture(
        lambda: torch.sparse.mm(sparse, torch.randn(3, 2)), -1, CPU.new_pool(-1), False, ()
    )
    assert "sparse_coo tensor" in str(result.error)


def test_emulation_setting_is_scoped_nests_and_survives_exceptions():
    assert autograph.testing.emulate_graphs_on_cpu is emulate_graphs_on_cpu
    assert public_emulate_graphs_on_cpu is emulate_graphs_on_cpu
    assert not is_emulating()
    with emulate_graphs_on_cpu():
        assert is_emulating()
        with emulate_graphs_on_cpu():
            assert is_emulating()
        assert is_emulating()
    assert not is_emulating()
    with pytest.raises(ValueError):
        with emulate_graphs_on_cpu():
            raise ValueError
    assert not is_emulating()

    @emulate_graphs_on_cpu()
    def decorated():
        return is_emulating()

    assert decorated() and decorated() and not is_emulating()


@dataclasses.dataclass(frozen=True)
class _FrozenError(Exception):
    what: str


def test_the_emulation_setting_passes_any_exception_through_and_a_decorator_may_recurse():
    with pytest.raises(_FrozenError):  # a generator context manager raised FrozenInstanceError
        with emulate_graphs_on_cpu():
            raise _FrozenError("takes no __traceback__")
    assert not is_emulating()

    @emulate_graphs_on_cpu()
    def nested(depth):
        return [is_emulating()] + (nested(depth - 1) if depth else [])

    assert nested(2) == [True, True, True] and not is_emulating()
    with emulate_graphs_on_cpu():  # the setting before (on) comes back after the decorated call
        assert nested(1) == [True, True] and is_emulating()
    assert not is_emulating()


def test_a_recording_says_the_current_stream_is_capturing_as_cuda_does():
    def capturing():
        try:
            return torch.cuda.is_current_stream_capturing()
        except RuntimeError:  # a CPU-only build of torch: no CUDA to ask
            return False

    outside = capturing()
    assert capture(capturing).outputs is True
    assert capturing() is outside  # only while recording


def test_hf_bert_skips_its_padding_mask_read_while_recording_and_is_graphed(emulated, caught):
    """As tests/test_correctness_cuda.py's BERT test on CUDA: transformers reads the padding
    mask on the host (a sync the guard stops) unless a stream is capturing."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=256,
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    graphed = autograph.graphed(copy.deepcopy(model))
    ids = torch.randint(0, 256, (4, 16))
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[1, 10:] = 0
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).last_hidden_state
        for _ in range(4):
            got = graphed(ids, attention_mask=mask).last_hidden_state
            assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    (row,) = autograph.stats(graphed)
    assert (row.state, row.replays) == ("graphed", 3), row.fallback_reason
    assert autograph_warnings(caught) == []


def test_a_generator_not_registered_with_the_capture_is_refused_as_cuda_refuses_it():
    x = torch.ones(16)
    generator = torch.Generator().manual_seed(1)
    result = CPU.capture(lambda: random_step(x, generator), -1, CPU.new_pool(-1))
    assert isinstance(result.error, RuntimeError)
    assert "unregistered CUDA generator" in str(result.error)


def test_capturing_said_in_overlapping_threads_holds_in_each_and_is_undone_after():
    # Two blocks overlapping in two threads (a buckets fake run and an emulated recording):
    # the first to leave took the patch away from the other, and the last left a wrapper.
    import threading

    from autograph.backends._as_if_capturing import as_if_capturing

    original = torch.cuda.is_current_stream_capturing
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = []

    def first():
        with as_if_capturing():
            first_in.set()
            second_in.wait()
        first_out.set()

    def second():
        first_in.wait()
        with as_if_capturing():
            second_in.set()
            first_out.wait()
            seen.append(torch.cuda.is_current_stream_capturing())

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == [True]
    assert torch.cuda.is_current_stream_capturing is original
