"""A progress bar for work a user waits on (``capture()`` of many buckets), on a terminal only.

>>> for size in progress([32, 16, 8], "capturing step"):
...     ...

Uses ``tqdm`` when it is installed and standard error is a terminal; otherwise it is the
plain iterable, and the ``autograph`` logger's lines (``AUTOGRAPH_LOG=info``) tell the story.
"""

from __future__ import annotations

import sys
from typing import Iterable, TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], description: str) -> Iterable[T]:
    if not sys.stderr.isatty():
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=description, unit="graph", leave=False)
