"""The words a user reads: each message names the function, the key, the cause, the user's line
and the fix (docs/guide/why-eager.md, "What a message tells you"), and says nothing untrue of
this machine (a CPU tensor is not a GPU tensor; a call that raises does not run eagerly)."""

import warnings

import pytest
import torch

import autograph
from autograph import _config
from autograph.api._report import DISABLED, EMULATED
from autograph.cli._demo import cost_words

from conftest import states


def graphed_warnings(record):
    return [w for w in record if issubclass(w.category, autograph.AutographWarning)]


def test_a_python_float_that_changes_on_every_call_is_told_to_be_a_tensor(emulated):
    @autograph.graphed
    def scaled(x, temperature):
        return x / temperature

    x = torch.randn(4)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for step in range(20):
            scaled(x, 0.5 + step)
    said = graphed_warnings(record)
    assert len(said) == 1 and said[0].filename == __file__  # the user's line
    message = str(said[0].message)
    assert message.startswith(f"{scaled.__qualname__}: 16 new keys")  # the function
    assert "temperature=14.5 became temperature=15.5" in message  # the key, what changes
    assert "A Python number is part of the key" in message  # the cause
    assert "pass it as a tensor" in message and "fixed size" not in message  # the fix
    rows = scaled.stats()
    assert rows[-1].key == "calls passed through (keys churn)"
    assert "pass it as a tensor" in rows[-1].fallback_reason


def test_a_shape_that_changes_on_every_call_is_told_to_be_padded(emulated):
    @autograph.graphed
    def double(x):
        return x * 2

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for n in range(1, 21):
            double(torch.randn(n))
    message = str(graphed_warnings(record)[0].message)
    assert "Give that argument a fixed size (pad it" in message
    assert "Python number" not in message


def test_print_of_a_cpu_tensor_under_the_emulation_is_not_called_a_gpu_tensor(emulated):
    @autograph.graphed
    def shown(x):
        print(x)
        return x + 1

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            shown(torch.ones(2))
    assert states(shown) == [("eager", 3, 3, 0)]
    reason = shown.stats()[0].fallback_reason
    assert reason.startswith("print() or repr() of a CPU tensor at test_messages.py:")
    assert "GPU" not in reason and "synchronises" not in reason
    assert "print outside the graphed function" in reason
    assert reason in str(graphed_warnings(record)[0].message)


def test_item_says_how_to_keep_the_value_on_the_device(emulated):
    @autograph.graphed
    def normalise(x):
        return x / x.abs().max().item()

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            normalise(torch.ones(2))
    assert states(normalise) == [("eager", 3, 3, 0)]
    message = str(graphed_warnings(record)[0].message)
    assert message.startswith(
        f"{normalise.__qualname__}(x: f32[2] cpu) runs eagerly: .item() at test_messages.py:"
    )
    assert message.endswith(
        "keep it a tensor (without .item()), or read it outside the graphed function"
    )


def test_a_strict_error_says_it_raised_not_that_the_call_runs_eagerly(emulated):
    @autograph.graphed(strict=True)
    def normalise(x):
        return x / x.abs().max().item()

    normalise(torch.ones(2))  # the warmup runs as written
    with pytest.raises(autograph.CaptureError) as raised:
        normalise(torch.ones(2))
    text = str(raised.value)
    assert text.startswith(
        f"{normalise.__qualname__}(x: f32[2] cpu) cannot be graphed, and strict mode raises"
    )
    assert "runs eagerly" not in text and ".item() at test_messages.py:" in text


def test_report_under_autograph_disable_says_autograph_is_disabled(monkeypatch, capsys):
    monkeypatch.setattr(_config, "ENV", _config.Environment(disable=True))

    @autograph.graphed
    def add_one(x):
        return x + 1

    add_one(torch.ones(2))
    autograph.report(add_one)
    autograph.report()
    text = capsys.readouterr().out
    assert text == f"{DISABLED}\n{DISABLED}\n"
    assert "autograph is disabled (AUTOGRAPH_DISABLE=1" in DISABLED
    assert "no graphed function has been called" not in text


def test_an_emulated_report_says_its_capture_times_and_memory_mean_nothing(emulated, capsys):
    @autograph.graphed
    def add_one(x):
        return x + 1

    for _ in range(3):
        add_one(torch.ones(2))
    assert states(add_one) == [("graphed", 3, 1, 2)]
    autograph.report(add_one)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == EMULATED
    assert "capture times and memory" in EMULATED and "mean nothing" in EMULATED


@pytest.mark.parametrize("every_round", [True, False])
def test_bench_never_gives_a_negative_cost_as_a_figure(every_round):
    text = cost_words(-761.0, every_round)
    assert "761" not in text and "-" not in text.replace("per call", "")
    assert "within this machine's noise" in text
    assert cost_words(2.5, True).startswith("autograph adds about 2.5 us per call")
    assert "within this machine's noise" in cost_words(2.5, False)  # rounds disagree
