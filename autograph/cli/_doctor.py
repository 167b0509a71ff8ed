"""``python -m autograph doctor``: the versions, what this torch gives autograph, the GPU, and
whether a test function is captured into a CUDA graph and replayed on this machine.

>>> doctor()
autograph 0.2.0.dev0, torch 2.11.0+cu130, Python 3.12.3
...
"""

from __future__ import annotations

import platform
import weakref

import torch

import autograph
from autograph import _config

EMULATION = """\
To run graphed code on this machine anyway (to try it, and in tests), use the CPU emulation of
CUDA graphs: the real engine on CPU tensors, with a recorded-op replay standing in for a graph
(its timings mean nothing).

    from autograph.testing import emulate_graphs_on_cpu
    with emulate_graphs_on_cpu():          # also a decorator
        for _ in range(3):
            step(torch.randn(8, 512))      # a warmup, a capture, a replay, as on a GPU

In pytest, a fixture turns it on for the tests that ask for it:

    @pytest.fixture
    def emulated():
        with emulate_graphs_on_cpu():
            yield
        autograph.reset()

docs/guide/testing.md says what it models and what it does not."""


def doctor() -> int:
    print(versions())
    print(
        f"environment: AUTOGRAPH_DISABLE={int(_config.ENV.disable)} "
        f"AUTOGRAPH_STRICT={int(_config.ENV.strict)}"
    )
    print(torch_features())
    if torch.version.cuda is None:
        print(
            "torch is a CPU build: every graphed call runs eagerly. Install a CUDA build of "
            "torch to use CUDA graphs."
        )
        print(EMULATION)
        return 0
    if not torch.cuda.is_available():
        print(
            f"torch is built for CUDA {torch.version.cuda}, but no GPU is visible: every "
            f"graphed call runs eagerly."
        )
        print(EMULATION)
        return 0
    print(
        f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s); cuda:0 is "
        f"{torch.cuda.get_device_name(0)} (compute capability "
        f"{'.'.join(map(str, torch.cuda.get_device_capability(0)))})"
    )

    @autograph.graphed
    def check(x):
        return torch.sin(x) * 2

    x = torch.randn(16, device="cuda")
    ok = all(torch.equal(check(x), torch.sin(x) * 2) for _ in range(3))
    row = check.stats()[0]  # type: ignore[attr-defined]
    if ok and row.state == "graphed":
        print(
            f"capture and replay work: a test graph was captured in "
            f"{row.capture_seconds * 1e3:.1f} ms and replayed."
        )
        return 0
    print(
        f"capture did not work here: state={row.state}, reason={row.fallback_reason}, "
        f"results equal eager: {ok}"
    )
    return 1


def versions() -> str:
    return (
        f"autograph {autograph.__version__}, torch {torch.__version__}, "
        f"Python {platform.python_version()}"
    )


def torch_features() -> str:
    """What each torch gives autograph, and whether this one does (README, "What each torch
    gives"); torch older than the floor is refused at import.

    >>> print(torch_features())
    what each torch gives (floor: torch 2.9)      needs  here  without it
    a compiled function compiles once under ...    2.10   yes   ...
    """

    def at_least(major: int, minor: int) -> bool:
        return tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (major, minor)

    try:
        weakref.ref(torch.Generator())
        generators_weak = True
    except TypeError:
        generators_weak = False
    rows = [
        (
            "Dynamo compiles around autograph's watch",
            "2.9",
            True,
            "refused at import (Dynamo skipped or recompiled compiled code under the watch)",
        ),
        (
            "a compiled function compiles once under autograph",
            "2.10",
            at_least(2, 10),
            "it compiles again per stack of dispatch modes (the warmup's, the capture's)",
        ),
        (
            "weak references to generators",
            "2.12",
            generators_weak,
            "a generator rebound after capture goes unseen (docs/guide/limits.md)",
        ),
        (
            "a failed capture resets the default generator",
            "2.12",
            at_least(2, 12),
            "autograph resets it with one empty capture",
        ),
        (
            "a failed capture ends its pool's routing",
            "2.14",
            at_least(2, 14),
            "autograph ends the routing and releases the pool itself",
        ),
        (
            "stale outputs='static' buffers raise",
            "CUDA build",
            hasattr(torch._C, "_set_storage_data_ptr_access_error_msg"),
            "outputs='static' returns copies",
        ),
    ]
    floor = ".".join(map(str, _config.TORCH_FLOOR))
    lines = [f"{f'what each torch gives (floor: torch {floor})':50} {'needs':10} here  without it"]
    lines += [
        f"{feature:50} {needs:10} {'yes' if here else 'no ':4}  {without}"
        for feature, needs, here, without in rows
    ]
    return "\n".join(lines)
