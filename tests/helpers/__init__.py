"""Scaffolding that several test files share, each kind in one module: tiny models and their
decode loops (``models``), training helpers (``training``), dispatch-mode probes (``modes``),
functions that raise at a chosen phase of a capture (``raising``) and a count of the watched
warmups (``watched``).

Imported as ``from helpers.models import llama``: ``tests/`` is on the path (its conftest.py).
"""
