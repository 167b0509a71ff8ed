"""Warnings at the user's line: the first frame outside autograph and torch.

>>> warn_user("step(x: f32[8] cuda:0) runs eagerly: .item() at model.py:42 synchronises ...")

A graphed module's forward is called from ``nn.Module.__call__``, a function from autograph's
wrapper: the warning names the line that called them, where the user can act.
"""

from __future__ import annotations

import os
import sys
import warnings
from types import FrameType
from typing import Optional

import torch

from ._errors import AutographWarning

# autograph's own files and torch's: the frames a user's line is looked for outside of. This
# module sits at the package's top, so its folder is the whole package's.
_SKIPPED_DIRS = (
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
)


def warn_user(message: str) -> None:
    frame: Optional[FrameType] = sys._getframe(1)
    level = 2
    while frame is not None and not is_user_file(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, AutographWarning, stacklevel=level)


def is_user_file(filename: str) -> bool:
    # "<eval_with_key>.N": code that torch.fx generates for a compiled graph.
    return not filename.startswith(_SKIPPED_DIRS) and not filename.startswith("<")
