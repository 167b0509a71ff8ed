"""What a type checker sees of ``autograph.graphed``: the decorated function's own signature,
bare and with options, and a graphed module's own type (``py.typed`` ships with the package)."""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

USER_CODE = textwrap.dedent("""
    import torch
    import autograph

    @autograph.graphed
    def step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w

    ok: torch.Tensor = step(torch.ones(2, 2), torch.ones(2, 2))
    step(torch.ones(2, 2))                      # line 10: a missing argument

    @autograph.graphed(warmup=2, buckets=[1, 2], bucket_outputs=0)
    def rows(x: torch.Tensor) -> int:
        return x.shape[0]

    wrong: str = rows(torch.ones(1))            # line 16: an int is not a str
    linear = autograph.graphed(torch.nn.Linear(2, 2))
    weight: torch.Tensor = linear.weight        # a graphed module keeps its type
""")


def test_a_type_checker_sees_the_decorated_functions_signature(tmp_path):
    pytest.importorskip("mypy", reason="mypy is installed by .ci/run and the 'lint' extra")
    path = tmp_path / "user.py"
    path.write_text(USER_CODE)
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--follow-imports=silent", "--no-incremental", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
        timeout=300,
    )
    errors = [line.split(":")[1] for line in out.stdout.splitlines() if ": error:" in line]
    assert errors == ["10", "16"], out.stdout
