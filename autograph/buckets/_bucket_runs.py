"""The runs of a bucketed key (docs/design.md, "Buckets"): which arguments its function sees, which
output dims come back sliced, and the probe of its graph's first replay with pad rows.

>>> outputs = run_call(life, c)                        # a warmup or eager run of the key
>>> outputs, kept = capture_replay(life, c, graph)     # the capture call's replay, probed

A key with per-bucket state (an argument used by address, an object keyed by identity: each
bucket's own KV cache) runs its function on the padded arguments in every phase, so that the
state always meets arguments of its own size; its outputs are sliced back to the call's rows
and the real rows of the arguments it wrote copied back. Any other key runs its warmups and
eager calls as called: the user's own call, always right, and evidence of its output shapes at
a second size. Every run notes its output shapes in the family's ``BatchShapes``
(``_batch_dims``), which decides the dims that follow the batch; a function whose outputs
cannot be sliced back is refused and runs eagerly, as called, from then on.

A graph's first replay at each row count with pad rows is replayed once more with other pad
rows (``_row_mixing``): if its real rows change, the function mixes rows (a mean over the
batch), its effects are taken back, and the key runs eagerly; a key without per-bucket state
also has that replay checked against an eager run of the call's own rows. Until then, calls
with pad rows at that count do not replay (``KeyLife.serve`` checks ``graph.rows_checked``).
A Python number the function computes from the size (``x * x.shape[0]``) changes no pad row:
runs at two sizes note their ops' numbers (``_size_reads``), and one that differs makes the
key eager. Under ``verify=n`` the capture call's result is checked against an eager run as
well.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Dict, List, Tuple

import torch

from .._profile import profile_range
from ..capture._outputs import flatten_output, real_rows
from ..policy._verify import verified_replay
from ..watch._reads import storage_ptr
from ..watch._size_reads import NumbersOf, size_read
from ._buckets import padded_arguments
from ._fake_evidence import at_the_calls_rows, noted_fake_evidence, refused_by, run_on_fake
from ._row_mixing import SavedState, mixes_rows

Tensor = torch.Tensor


def run_call(life: Any, c: Any, watched: bool = False) -> Any:
    """Run the function of ``life``'s key (``_key_life.KeyLife``) for the call ``c`` as its
    warmups and eager calls do: padded where it has per-bucket state, else as called.
    ``watched``: note the Python numbers its ops get at the size it runs at (``_size_reads``)."""
    padding = c.padding
    if padding is None:
        return c.call(*c.args, **c.kwargs)
    if padding.stateful and life.padded_runs and padding.rows != padding.bucket:
        refused = padding.shapes.decide(padding.rows, padding.bucket).refused
        shapes_at = None
        if refused is None:
            # Normal tensors even under inference_mode: their version counters show what it
            # wrote.
            with torch.inference_mode(False):
                padded_call = padded_arguments(c.args, c.kwargs, c.tensors, padding, padding.bucket)
            shapes_at = _fake_run_first(life, c, padded_call)
            refused = refused_by(padding, shapes_at)
        if refused is None:
            return _padded_run(life, c, padded_call, shapes_at, watched)
        # Its family's runs at other sizes, or its run on fake tensors, refused it: as called.
        # Said before the padded run, whose writes to the per-bucket state could not be undone.
        refuse(life, refused)
    with _numbers_of(padding, padding.rows, watched):
        outputs = c.call(*c.args, **c.kwargs)
    padding.shapes.note(padding.rows, flatten_output(outputs)[0])
    refused = padding.shapes.decide(padding.rows, padding.bucket).refused
    if refused is not None and life.reason is None:
        refuse(life, refused)
    return outputs


def _numbers_of(padding: Any, size: int, watched: bool) -> ContextManager[Any]:
    """Note a run's numbers at ``size`` unless unwatched or its family has that size's."""
    if not watched or size in padding.shapes.numbers:
        return contextlib.nullcontext()
    return NumbersOf(padding.shapes.numbers, size)


def capture_call(c: Any) -> Callable[..., Any]:
    """The callable a capture of the call ``c`` records: for a bucket, one that notes the
    Python numbers its ops get at the bucket's size (``_size_reads``)."""
    padding = c.padding
    if padding is None or padding.bucket in padding.shapes.numbers:
        return c.call

    def noted(*args: Any, **kwargs: Any) -> Any:
        with NumbersOf(padding.shapes.numbers, padding.bucket):
            return c.call(*args, **kwargs)

    return noted


def _padded_run(
    life: Any,
    c: Any,
    padded_call: Tuple[tuple, dict, Dict[int, Tensor]],
    shapes_at: Any,
    watched: bool,
) -> Any:
    """The call run on its arguments padded to the bucket (``padded_call``: the arguments, and
    the padded tensors by index), its outputs sliced back. ``shapes_at``: the outputs of the
    run on fake tensors made before it, if one was (``_fake_run_first``)."""
    padding = c.padding
    rows, bucket = padding.rows, padding.bucket
    args, kwargs, padded = padded_call
    versions = {i: t._version for i, t in padded.items()}
    try:
        with _numbers_of(padding, bucket, watched):
            outputs = c.call(*args, **kwargs)
    except Exception as error:
        _say_it_ran_padded(life, error, rows, bucket)
        raise
    leaves, rebuild = flatten_output(outputs)
    padding.shapes.note(bucket, leaves)
    decision = padding.shapes.decide(rows, bucket)
    if decision.undecided is not None:
        if shapes_at is None:
            shapes_at = _fake_run(life, c, args, kwargs, padded)
        if noted_fake_evidence(padding, shapes_at):
            decision = padding.shapes.decide(rows, bucket)
    at_rows = None
    if decision.dims is None and decision.refused is not None:
        refuse(life, decision.refused)
        at_rows = at_the_calls_rows(padding, leaves, shapes_at)
    if decision.dims is None and at_rows is None:
        raise ValueError(
            f"{life.function.name}({life.label}): a call of {rows} rows ran padded to its "
            f"bucket of {bucket}, as every run of a key with per-bucket state (an argument "
            f"used by address or by identity, such as a KV cache) does, and its outputs "
            f"cannot be sliced back to {rows} rows: "
            + (
                f"{decision.refused}. It now runs eagerly on the arguments as given."
                if decision.refused is not None
                else f"{decision.undecided}. Name the output dims that follow the batch with "
                f"bucket_outputs= (bucket_outputs=0: dim 0 of every tensor output), or run "
                f"{life.function.name}.capture(...) at start-up, whose runs at every "
                f"bucket's size show them."
            )
        )
    with torch.no_grad():
        for i, t in padded.items():
            if t._version != versions[i]:
                c.tensors[i].copy_(t.narrow(padding.dims[i][0], 0, rows))
    if at_rows is not None:
        return rebuild(at_rows)
    return rebuild(
        [
            real_rows(leaf, dims, rows) if isinstance(leaf, Tensor) else leaf
            for leaf, dims in zip(leaves, decision.dims)
        ]
    )


def _fake_run_first(life: Any, c: Any, padded_call: Tuple[tuple, dict, Dict[int, Tensor]]) -> Any:
    """The run on fake tensors (``_fake_run``) before the real padded run, where the family has
    run at the bucket's size only and could not decide the output dims (after ``capture()`` of
    one bucket, or a call of the bucket's rows): that run, showing the same size again, could
    not either, and the fake run would follow it. Made first, a Python value that changes with
    the batch size refuses the key before its per-bucket state is written. A family with no
    run yet runs padded first, as its run may decide alone (a function returning nothing)."""
    padding = c.padding
    shapes = padding.shapes
    if shapes.named is not None or set(shapes.runs) != {padding.bucket}:
        return None
    if shapes.decide(padding.rows, padding.bucket).undecided is None:
        return None
    return _fake_run(life, c, *padded_call)


def _fake_run(life: Any, c: Any, args: tuple, kwargs: dict, padded: Dict[int, Tensor]) -> Any:
    """The outputs of a run of the function on fake tensors whose batch dim is a symbol
    (``_symbolic_batch``), as a function of the size; once per family, None where it could
    not run. Only its shapes are kept: the Python state the call reaches and the random
    generators are put back after it. Raises ``RuntimeError``, the key made eager, if the run
    left fake values where nothing could put them back: that state is no longer what the
    caller's program made it, and saying so is all that is left to do."""
    padding = c.padding
    run = run_on_fake(life, c, args, kwargs, padded)
    if run is None:
        return None
    if run.left:
        padding.shapes.refused = (
            f"its run on fake tensors left fake values in {', '.join(run.left)}: its family "
            f"runs eagerly, as called"
        )
        refuse(life, padding.shapes.refused)
        raise RuntimeError(
            f"{life.function.name}({life.label}): the run on fake tensors that decides which "
            f"output dims of a key with per-bucket state follow the batch left fake values in "
            f"{', '.join(run.left)}, where autograph could not put back what was there (it "
            f"puts back the state the key reaches, module globals, and the attributes of the "
            f"classes and objects among them). That state is no longer what "
            f"your program made it. Name the dims with bucket_outputs= (bucket_outputs=0: dim "
            f"0 of every tensor output), which makes no such run, or keep that state out of "
            f"the function; the key runs eagerly from now on."
        )
    return run.shapes_at


def _say_it_ran_padded(life: Any, error: Exception, rows: int, bucket: int) -> None:
    """Add to the exception of a padded run that it ran padded, and the usual cause (Python
    >= 3.11 prints an exception's notes; on 3.10 ``add_note`` is missing and nothing is added).
    Not run as called instead: its writes to the per-bucket state up to the error are not
    known to be undone."""
    cause = (
        "bucket_args= names the padded arguments"
        if life.options.bucket_args is not None
        else "an argument whose dim 0 equals the rows by chance (a weight) is padded "
        "too: name the batched arguments with bucket_args="
    )
    note = (
        f"autograph: {life.function.name}({life.label}) ran on its arguments padded from "
        f"{rows} to {bucket} rows, as every run of a key with per-bucket state (an argument "
        f"used by address or by identity, such as a KV cache) does; {cause}"
    )
    # Once per exception object (one raised again at each call), and never in the way of the
    # function's own exception: one that takes no note (a frozen dataclass) is raised as is.
    if note not in getattr(error, "__notes__", ()):
        try:
            error.add_note(note)
        except Exception:  # noqa: BLE001 - the note is a courtesy
            pass


def refuse(life: Any, reason: str) -> None:
    """Run ``life``'s key eagerly, as called, from now on: padding would make it wrong."""
    life.padded_runs = False
    life.fall_back(reason, raise_now=False)


def slices_unknown(padding: Any) -> bool:
    """Whether a capture call with pad rows should run eagerly instead: its bucket's size has
    run already, and which output dims to slice back is still unknown (its run shows it)."""
    return (
        padding.rows != padding.bucket
        and padding.bucket in padding.shapes.runs
        and padding.shapes.decide(padding.rows, padding.bucket).dims is None
    )


def state_written(c: Any, watch: Any) -> List[Tensor]:
    """The tensors a watched run (``_reads.CallWatch``) wrote that are not copied into a
    graph's statics: state read by address, arguments used by address."""
    copied = {storage_ptr(t) for i, t in enumerate(c.tensors) if i not in c.addressed}
    addressed = [c.tensors[i] for i in c.addressed if storage_ptr(c.tensors[i]) in watch.written]
    return addressed + [
        t for ptr, t in watch.external.items() if ptr in watch.written and ptr not in copied
    ]


def learn_state_written(life: Any, c: Any, graph: Any) -> None:
    """Add to what ``life``'s runs write by address (``state_written``) what its capture of
    ``graph`` wrote, before the graph's watch forgets it: state its watched warmup made itself
    (transformers' StaticCache moves its write position to the GPU at its first update), and
    all of it where the last warmup ran unwatched (a later bucket of a family in
    ``capture()``). The pad-row probe puts it back before its second replay."""
    written = graph.written_storages
    captured = [c.tensors[i] for i in c.addressed if storage_ptr(c.tensors[i]) in written]
    captured += [t for ptr, t in graph.watched_external().items() if ptr in written]
    seen = {storage_ptr(t) for t in life.state_written}
    life.state_written = life.state_written + [t for t in captured if storage_ptr(t) not in seen]


def capture_replay(life: Any, c: Any, graph: Any) -> Tuple[Any, bool]:
    """The capture call's own replay of ``graph``: (outputs, whether the graph is kept). For a
    bucket, the captured output shapes and Python numbers are checked first, a replay with pad
    rows probed, and under ``verify=n`` the result checked against an eager run."""
    padding = c.padding
    if padding is not None and not note_capture(life, graph, padding):
        return life.run_eagerly(c), False
    checked = padding is not None and (life.options.replays_to_verify or padding.runs_as_called)
    return _first_replay_at_rows(life, c, graph, False, checked)


def _first_replay_at_rows(
    life: Any, c: Any, graph: Any, copy_in: bool, checked: bool
) -> Tuple[Any, bool]:
    """The first replay of ``graph`` at the call's row count: (outputs, whether the graph is
    kept), ``checked`` against an eager run of the call. Checked once per row count where the
    call runs as called (``Padding.runs_as_called``): a value made from the size may agree at
    one count and not another, and that run shows what neither the numbers its ops get nor
    the pad-row probe can (a tensor made from the size, ``torch.linspace(0, 1, x.shape[0])``,
    then reduced)."""
    outputs, kept = (_verified_capture if checked else _replay_once)(life, c, graph, copy_in)
    if kept and c.padding is not None:
        graph.rows_checked.add(c.padding.rows)
    return outputs, kept


def _replay_once(life: Any, c: Any, graph: Any, copy_in: bool) -> Tuple[Any, bool]:
    padding = c.padding
    if padding is not None and padding.rows != padding.bucket:
        return probed_replay(life, c, graph, copy_in)
    life.replays += 1
    with profile_range("replay", life.function.name, life.label):
        return graph.replay(c.tensors, padding, copy_in), True


def _verified_capture(life: Any, c: Any, graph: Any, copy_in: bool) -> Tuple[Any, bool]:
    """A replay (the capture call's, or a key's first with pad rows) checked against an eager
    run of the call on its real rows (``_verify``), as verify checks the replays after it; a
    mismatch makes the key eager."""
    kept = [True]

    def replay() -> Any:
        outputs, kept[0] = _replay_once(life, c, graph, copy_in)
        return outputs

    padding = c.padding
    # Checked because padded, not by verify=: then the causes to name are the padding's.
    explain = (
        {}
        if life.options.replays_to_verify
        else {
            "loose": True,
            "explain": lambda d: (
                f"padded from {padding.rows} rows to its bucket of {padding.bucket}, its result "
                f"differs from an eager run of its own rows: {d}. It computes something "
                f"from the batch size (a value or a tensor made from x.shape[0]) or mixes rows: "
                f"leave it out of buckets=, or pass what it computes from the size as an argument"
            ),
        }
    )
    outputs, mismatch = verified_replay(
        replay,
        c,
        life.function.name,
        life.label,
        lambda: life.function.roots(c),
        eager=lambda: run_call(life, c),
        **explain,
    )
    if not kept[0]:  # the probe found mixed rows: the call ran eagerly, the key is eager
        return outputs, False
    if mismatch is not None:
        life.replays -= 1  # taken back: the caller gets the eager run's outputs and effects
        life.eager_calls += 1
        c.note(life, "eager_calls")
        graph.release()
        refuse(life, mismatch)
        return outputs, False
    life.verified += bool(life.options.replays_to_verify)
    return outputs, True


def note_capture(life: Any, graph: Any, padding: Any) -> bool:
    """Note the captured outputs' shapes at the bucket's size; False, the graph released, if
    they show that its outputs cannot be sliced back or the Python numbers its ops got change
    with the size (the key is eager from now on), or if which to slice is still unknown for
    this call's rows (an eager run will show it)."""
    leaves, graph.outputs.captured_leaves = graph.outputs.captured_leaves, None
    padding.shapes.note(padding.bucket, leaves or [])
    decision = padding.shapes.decide(padding.rows, padding.bucket)
    refused = decision.refused or size_read(padding.shapes.numbers, padding.bucket)
    if decision.dims is not None and refused is None:
        return True
    graph.release()
    if refused is not None:
        refuse(life, refused)
    return False


def first_padded_replay(life: Any, c: Any, graph: Any) -> Any:
    """A call with pad rows to a graph that has not replayed with pad rows yet: probed; or
    run eagerly while the dims to slice are unknown, or while a stateless key has run at its
    bucket's size only (its run as called shows them, and the numbers it reads from the size);
    or eagerly for good if those numbers change with the size (``_size_reads``)."""
    padding = c.padding
    numbers = padding.shapes.numbers
    if (
        padding.shapes.decide(padding.rows, padding.bucket).dims is None
        or not padding.stateful
        and all(size == padding.bucket for size in numbers)
    ):
        outputs = life.run_eagerly(c, watched=True)
        read = size_read(numbers, padding.bucket)
        if read is not None and life.reason is None:
            refuse(life, read)
        return outputs
    read = size_read(numbers, padding.bucket)
    if read is not None:
        refuse(life, read)
        return life.run_eagerly(c)
    outputs, kept = _first_replay_at_rows(life, c, graph, True, padding.runs_as_called)
    if kept:
        c.note(life, "replays")
    return outputs


def probed_replay(life: Any, c: Any, graph: Any, copy_in: bool) -> Tuple[Any, bool]:
    """Replay ``graph`` for the call ``c``, then once more with other pad rows: (outputs,
    True); or, if its real rows changed, take the replay back, release the graph and run the
    call eagerly (the key is eager from now on): (outputs, False)."""
    padding = c.padding
    rows, plan = padding.rows, graph.outputs
    plan.slice_dims(padding.shapes.decided)
    with graph.pool.lock:  # its replays and the reads of their outputs, one step of the pool
        if copy_in:
            graph.inputs.copy_in(c.tensors, rows)
        statics = graph.inputs.statics
        padded = [(statics[i], spec[0]) for i, spec in enumerate(padding.dims) if spec is not None]
        written = [statics[i] for i in graph.mutated] + life.state_written
        before = SavedState([s for s, _ in padded] + written)
        callers = SavedState([c.tensors[i] for i in graph.mutated])  # written back by the replay
        life.replays += 1
        with profile_range("replay", life.function.name, life.label):
            outputs = graph.replay(c.tensors, padding, copy_in=False)
        first = [o.clone() for o in plan.owned]

        def replay_owned() -> Any:
            graph.graph.replay()
            return plan.owned

        arguments = {id(c.tensors[i]) for i in c.addressed}
        shared = [t for t in life.state_written if id(t) not in arguments]
        finding = mixes_rows(
            replay_owned, padded, rows, written, first, plan.follows, before, shared
        )
    if finding is None:
        return outputs, True
    before.restore()
    callers.restore()
    life.replays -= 1
    graph.release()
    refuse(life, finding)
    return life.run_eagerly(c), False
