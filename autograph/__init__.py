"""autograph: automatic CUDA graphs for PyTorch.

>>> import autograph
>>> @autograph.graphed
... def step(x, w):
...     return torch.relu(x @ w).sum(-1)
>>> with autograph.region():          # or: graph every top-level module call in a block
...     logits = model(ids)

Each call is keyed on its inputs and execution state; a key is warmed up eagerly, captured
once into a CUDA graph, then replayed. What cannot be graphed runs eagerly, with a warning that
says why and where. See the README and SPEC.md for the contract.
"""
from ._errors import AutographWarning, CaptureError
from ._graphed import BoundGraphedMethod, GraphedFunction, graphed
from ._region import Region, RegionStats, region
from ._stats import KeyStats, report, reset, stats

__version__ = "0.1.0"

__all__ = [
    "AutographWarning",
    "BoundGraphedMethod",
    "CaptureError",
    "GraphedFunction",
    "KeyStats",
    "Region",
    "RegionStats",
    "graphed",
    "region",
    "report",
    "reset",
    "stats",
]
