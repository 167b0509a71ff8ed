"""The command line (python -m autograph) and the figures its bench command prints."""

import pytest
import torch

import autograph
from autograph import _config
from autograph.__main__ import main
from autograph.cli import _bench, _demo

from helpers.torch_versions import torch_at_least

no_cuda = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU demo runs only on a machine without CUDA"
)


def test_help_is_plain_text_with_each_command_and_an_example(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    text = capsys.readouterr().out
    assert exit_.value.code == 0
    assert "``" not in text and ":func:" not in text
    for command in ("doctor", "bench"):
        assert f"example: python -m autograph {command}" in text


def test_no_command_prints_the_help(capsys):
    assert main([]) == 0
    assert "example: python -m autograph doctor" in capsys.readouterr().out


def test_version_names_autograph_torch_and_python(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    text = capsys.readouterr().out
    assert exit_.value.code == 0
    assert f"autograph {autograph.__version__}, torch {torch.__version__}, Python" in text


def test_doctor_starts_with_the_versions(capsys):
    main(["doctor"])
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"autograph {autograph.__version__}, torch {torch.__version__}")


def test_doctor_says_what_this_torch_gives(capsys):
    main(["doctor"])
    rows = capsys.readouterr().out.splitlines()
    assert "what each torch gives (floor: torch 2.9)" in rows[2]

    def here(feature):
        row = next(r for r in rows if r.startswith(feature + " "))
        return row[len(feature) :].split()[1]

    compiles_once = "a compiled function compiles once under autograph"
    assert here(compiles_once) == ("yes" if torch_at_least(2, 10) else "no")
    assert here("a failed capture ends its pool's routing") == (
        "yes" if torch_at_least(2, 14) else "no"
    )


def test_a_torch_older_than_the_floor_is_refused_with_the_fix():
    with pytest.raises(
        ImportError,
        match=r"needs torch >= 2\.9, and this is torch 2\.8\.0.*"
        r"pip install 'torch>=2\.9'",
    ):
        _config.check_torch("2.8.0")
    _config.check_torch("2.9.0")
    _config.check_torch("2.10.0a0+git1234")


def test_compare_calls_a_difference_real_only_when_every_round_agrees():
    assert _bench.compare({"a": [10, 11, 12], "b": [13, 14, 15]}, "a", "b") == (3, True)
    assert _bench.compare({"a": [10, 11, 12], "b": [9, 10, 11]}, "a", "b") == (-1, True)
    assert _bench.compare({"a": [10, 11, 12], "b": [13, 9, 15]}, "a", "b") == (2, False)
    assert _bench.compare({"a": [10], "b": [20]}, "a", "b") == (10, False)  # one round


def two_layer_mlp(mlp=_bench.mlp, **kwargs):
    return mlp(layers=2, **kwargs)


@no_cuda
def test_the_cpu_demo_says_the_calls_ran_eagerly_and_why(capsys, monkeypatch):
    monkeypatch.setattr(_demo, "mlp", two_layer_mlp)
    _demo.demo()
    text = capsys.readouterr().out
    assert "so autograph ran the MLP eagerly" in text and "CUDA is not available" in text
    assert "rounds, fastest to slowest" in text


@no_cuda
@pytest.mark.parametrize(
    "graphed_us, says",
    [
        ([20.0, 21.0, 22.0], "autograph adds about 10.0 us per call"),
        ([5.0, 6.0, 7.0], "within this machine's noise"),  # faster: not a cost
        ([5.0, 30.0, 7.0], "within this machine's noise"),  # rounds disagree
    ],
)
def test_the_cpu_demo_calls_only_a_consistent_slowdown_autographs_cost(
    capsys, monkeypatch, graphed_us, says
):
    timed = _bench.interleaved_us

    def made_up_figures(variants, **kwargs):
        timed(variants, calls=1, rounds=1, warmup=1)  # the calls happen, the stats fill
        return {"eager": [10.0, 11.0, 12.0], "autograph.graphed": graphed_us}

    monkeypatch.setattr(_demo, "mlp", two_layer_mlp)
    monkeypatch.setattr(_demo, "interleaved_us", made_up_figures)
    _demo.demo()
    text = capsys.readouterr().out
    assert says in text
    assert text.count("adds about") == (1 if "adds about" in says else 0)


@pytest.mark.parametrize(
    "command, says",
    [("doctor", "Checks this machine for autograph"), ("bench", "Times a 32-layer MLP at batch 1")],
)
def test_each_command_has_its_own_help(capsys, command, says):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    text = capsys.readouterr().out
    assert exit_.value.code == 0
    assert text.startswith(f"usage: python -m autograph {command}\n")
    assert says in text and f"example: python -m autograph {command}" in text
    assert "commands:" not in text  # not the top-level help


def test_doctor_on_a_cpu_build_points_to_the_emulation_and_the_test_fixture(capsys, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    assert main(["doctor"]) == 0
    text = capsys.readouterr().out
    assert "torch is a CPU build: every graphed call runs eagerly" in text
    assert "from autograph.testing import emulate_graphs_on_cpu" in text
    assert "@pytest.fixture" in text and "with emulate_graphs_on_cpu():" in text
