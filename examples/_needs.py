"""What an example needs, checked before it starts, with what to install when it is missing.

>>> transformers = needs(__file__, cuda=True, transformers=True)   # exits, saying what to do
"""

import importlib
import os
import sys
from types import ModuleType
from typing import Optional

import torch


def needs(example: str, cuda: bool = False, transformers: bool = False) -> Optional[ModuleType]:
    """Exit with one message naming everything the example ``example`` (its ``__file__``)
    needs and this machine lacks; return the transformers module when it was asked for."""
    missing, module = [], None
    if transformers:
        try:
            module = importlib.import_module("transformers")
        except ImportError:
            missing.append(
                "transformers: pip install transformers (or, in a clone of this "
                'repository, pip install -e ".[examples]")'
            )
    if cuda and not torch.cuda.is_available():
        missing.append(
            f"a CUDA GPU (torch {torch.__version__} sees none): on this machine, "
            f"python examples/why_eager.py runs on the CPU emulation of CUDA graphs"
        )
    if missing:
        sys.exit(f"examples/{os.path.basename(example)} needs " + "; and ".join(missing) + ".")
    return module
