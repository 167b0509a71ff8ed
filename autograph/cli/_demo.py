"""The demo behind ``python -m autograph bench``: a 32-layer MLP at batch 1, eager against a
hand-written graph against ``autograph.graphed``, timed side by side.

>>> demo()      # on a GPU: the table and autograph.report(); without one, why calls ran eagerly

Without a GPU it shows that the calls ran eagerly and why, and autograph's own cost on that
path, with the spread that says what the figures mean.
"""

from __future__ import annotations

import contextlib
import statistics

import torch

from ._bench import (
    SMOKE,
    compare,
    device,
    format_rows,
    hand_written,
    interleaved_us,
    mlp,
    spread_table,
)


def _cpu_demo() -> None:
    """What ``python -m autograph bench`` can show without a GPU: the calls ran eagerly and
    why, and autograph's cost on that path, with the spread that says what the figures mean."""
    import autograph

    model = mlp(device="cpu", dtype=torch.float32)
    step = autograph.graphed(mlp(device="cpu", dtype=torch.float32))
    step.load_state_dict(model.state_dict())
    x = torch.randn(1, 512)
    one = torch.zeros(1)

    def add_one(t: torch.Tensor) -> torch.Tensor:
        return t + 1

    graphed_add_one = autograph.graphed(add_one)
    rounds = 7
    with torch.no_grad():
        mlp_us = interleaved_us(
            {"eager": lambda: model(x), "autograph.graphed": lambda: step(x)},
            calls=5,
            rounds=rounds,
            warmup=2,
        )
        tiny_us = interleaved_us(
            {"eager": lambda: add_one(one), "autograph.graphed": lambda: graphed_add_one(one)},
            calls=2000,
            rounds=rounds,
            warmup=20,
        )
    row = step.forward.stats()[0]  # type: ignore[attr-defined]
    build = (
        "a CPU build of torch"
        if torch.version.cuda is None
        else f"torch built for CUDA {torch.version.cuda}, but no GPU visible"
    )
    print(
        f"No CUDA GPU here ({build}, torch {torch.__version__}), so autograph ran the MLP "
        f"eagerly, as it should: {row.calls} calls, {row.eager_calls} eager, {row.replays} "
        f"replayed, {'no graph' if row.state == 'eager' else row.state}. The reason it "
        f"recorded (autograph.report() and .stats() show it): {row.fallback_reason!r}.\n"
    )
    print(
        f"32-layer Linear(512)+GELU MLP, batch 1, float32 on the CPU; {rounds} rounds of 5 "
        f"calls, eager and autograph interleaved:\n"
    )
    print(spread_table(mlp_us))
    difference, apart = compare(mlp_us, "eager", "autograph.graphed")
    if apart:
        print(
            f"\nThe medians differ by {difference:+.0f} us, the same way in every round. "
            f"autograph adds only a key lookup to an eager call (measured below), so a gap "
            f"this size comes from this machine (other processes, threads, clock speed), "
            f"not from autograph's cost or a speed-up."
        )
    else:
        print(
            f"\nThe medians differ by {difference:+.0f} us, but not the same way in every "
            f"round: on this machine eager and autograph cannot be told apart at this size."
        )
    print(
        f"\nautograph's own cost on the eager path, on a function that adds 1 to a "
        f"one-element tensor; {rounds} rounds of 2000 calls, interleaved:\n"
    )
    print(spread_table(tiny_us))
    print("\n" + cost_words(*compare(tiny_us, "eager", "autograph.graphed")))
    print(
        "\nOn a CUDA GPU the same command captures the MLP into a CUDA graph and times it "
        "against eager and a hand-written capture/replay loop. To watch capture and replay "
        "on this CPU, autograph.testing.emulate_graphs_on_cpu() runs the engine on CPU "
        "tensors (its timings mean nothing); python examples/why_eager.py uses it."
    )


def cost_words(overhead: float, apart: bool) -> str:
    """What ``bench`` says of autograph's cost per call on the eager path: a figure only when
    it is positive in every round; a negative one is this machine's noise, and said so.

    >>> cost_words(-761.0, False)
    "autograph's own cost per call is within this machine's noise here: ..."
    """
    if apart and overhead > 0:
        return (
            f"autograph adds about {overhead:.1f} us per call here (keying the call and "
            f"choosing the eager path)."
        )
    why = (
        "the wrapped calls came out faster in every round, which only noise can make"
        if apart
        else "the rounds do not agree on which is faster"
    )
    return (
        f"autograph's own cost per call is within this machine's noise here ({why}): "
        f"smaller than what can be measured on it now. On a quiet machine it is about a "
        f"microsecond."
    )


def demo() -> None:
    """Eager against a hand-written graph against autograph for a 32-layer MLP at batch 1, or,
    without a GPU, why the calls ran eagerly and what autograph costs on that path."""
    import autograph

    if not torch.cuda.is_available() and not SMOKE:
        _cpu_demo()
        return
    dev = device()  # "cpu" only in a smoke run of this code (AUTOGRAPH_BENCH_SMOKE=1)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    model = mlp(device=dev, dtype=dtype)
    step = autograph.graphed(mlp(device=dev, dtype=dtype))
    step.load_state_dict(model.state_dict())
    x = torch.randn(1, 512, device=dev, dtype=dtype)
    emulation = (
        autograph.testing.emulate_graphs_on_cpu() if dev != "cuda" else contextlib.nullcontext()
    )
    with torch.no_grad(), emulation:
        hand = hand_written(model, [x])
        samples = interleaved_us(
            {
                "eager": lambda: model(x),
                "hand-written capture/replay": lambda: hand(x),
                "autograph.graphed": lambda: step(x),
            }
        )
        same = torch.equal(step(x), model(x))
    us = {name: statistics.median(values) for name, values in samples.items()}
    eager = us["eager"]
    rows = [
        {
            "variant": name,
            "us/call": f"{us[name]:.1f}",
            "speedup": f"{eager / us[name]:.2f}x",
            "rounds, fastest to slowest": f"{min(values):.1f} to {max(values):.1f}",
        }
        for name, values in samples.items()
    ]
    where = torch.cuda.get_device_name() if dev == "cuda" else "the CPU (smoke run)"
    print(
        f"32-layer Linear(512)+GELU MLP, batch 1, {str(dtype).replace('torch.', '')}, on "
        f"{where} (torch {torch.__version__}); us per call, median of 7 interleaved runs "
        f"of 200 calls:\n"
    )
    print(format_rows(rows, ["variant", "us/call", "speedup", "rounds, fastest to slowest"]))
    difference, apart = compare(samples, "hand-written capture/replay", "autograph.graphed")
    ratio = us["autograph.graphed"] / us["hand-written capture/replay"]
    if dev != "cuda":
        print("\nA smoke run (CUDA graphs emulated on the CPU): these figures mean nothing.")
    elif not apart:
        print(
            f"\nautograph against the hand-written loop: {difference:+.1f} us per call "
            f"({ratio:.3f}x), not the same way in every round: the two cannot be told apart "
            f"here."
        )
    elif difference > 0:
        print(
            f"\nautograph's own cost over the hand-written loop: {difference:+.1f} us per "
            f"call ({ratio:.3f}x), the same in every round."
        )
    else:
        print(
            f"\nautograph took {ratio:.3f}x the hand-written loop's time, less in every "
            f"round: its own cost is within the noise of this measurement."
        )
    print(f"autograph's output equals eager bitwise: {same}.\n")
    autograph.report()
