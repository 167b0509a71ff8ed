"""autograph: automatic CUDA graphs for PyTorch.

>>> import autograph
>>> @autograph.graphed
... def step(x, w):
...     return torch.relu(x @ w).sum(-1)
>>> with autograph.region():          # or: graph every top-level module call in a block
...     logits = model(ids)

Each call is keyed on its inputs and execution state; a key is warmed up eagerly, captured
once into a CUDA graph, then replayed. What cannot be graphed runs eagerly, with a warning that
says why and where. The guides are in docs/ (README.md links them), and docs/design.md says
how it is built.
"""

import typing as _typing

from . import _config as _config  # first: it refuses a torch older than the floor
from ._errors import AutographWarning, CaptureError
from ._stats import KeyStats
from .api._graphed import BoundGraphedFunction, GraphedForward, GraphedFunction, graphed
from .api._per_bucket import per_bucket
from .api._region import Region, RegionStats, region
from .api._report import report, reset, stats
from .backends._cuda_graphs import capture_stream
from .buckets._suggest import BucketSuggestion
from .generate import generate
from .policy._verify import VERIFY_TOLERANCES

__version__ = "0.2.0.dev0"

__all__ = [
    "AutographWarning",
    "BoundGraphedFunction",
    "BucketSuggestion",
    "CaptureError",
    "GraphedForward",
    "GraphedFunction",
    "KeyStats",
    "Region",
    "RegionStats",
    "VERIFY_TOLERANCES",
    "capture_stream",
    "generate",
    "graphed",
    "per_bucket",
    "region",
    "report",
    "reset",
    "stats",
    "testing",
]


def __getattr__(name: str) -> _typing.Any:
    # ``autograph.testing`` (the CPU emulation) is imported on first use: an ordinary graphed
    # program never loads it.
    if name == "testing":
        import importlib

        return importlib.import_module(".testing", __name__)
    raise AttributeError(f"module 'autograph' has no attribute {name!r}")


def __dir__() -> list:
    # The public names only: the subpackages and what the package imports are not API.
    return sorted([*__all__, "__version__"])
