"""Churn passes through (docs/design.md, "Never slower"): a function whose calls keep making keys
that are never graphed stops being keyed and watched, and runs as a plain call, looking again now
and then.

>>> churn = Churn("LlamaForCausalLM")
>>> if churn.left > 0:             # the engine's check, before any keying: passing through
...     churn.left -= 1
...     return call(*args, **kwargs)
>>> churn.new_key(cache.entries.values(), entry.parts)   # on each new key (the slow path)

A new key is expensive: its warmup is watched op by op, and its capture may be thrown away
(a DynamicCache read by address fails its first replay). ``new_key`` counts the new keys made
since a graph last replayed: a graph that replays resets the count, so a function with a
graphed decode step and prefills of new lengths never passes through. After ``window`` of
them the next ``left`` calls pass through: the engine neither keys nor watches them. Then
calls are keyed again (a look); the first new key after a look passes through again at once,
for twice as many calls (up to ``longest``); a look that meets known keys lets them warm up,
capture and replay as usual, and the first replay seen at a new key ends the episode.

The pass-through costs one attribute test and a decrement per call; everything else runs at
new keys, which cost a warmup anyway. The test is ``> 0``, not truthiness: two threads may
both decrement the last count, and a negative count must end the pass-through, not extend it.
"""
from __future__ import annotations

from typing import Any, Iterable, List, Optional, Sequence

from ._stats import KeyStats

# New keys in a row, none of them graphed, before calls pass through. HF generate() with a
# DynamicCache makes two per generate() call (the prefill, and a decode step whose graph
# reads the growing cache), one per step when the attention mask is passed and grows. Not
# fewer: a server that calls a model at N batch sizes in turn makes N new keys before any
# repeats (and is captured on its second round); 16 lets N reach 15 (max_graphs' default).
WINDOW = 16
# Calls passed through before the first look; each look that meets a new key doubles it.
FIRST_PASS = 16
LONGEST_PASS = 1024


class Churn:
    """The pass-through policy of one key cache (see the module docstring)."""

    __slots__ = ("function", "window", "first", "longest", "left", "length", "streak",
                 "replays_seen", "passed", "looks", "last_parts", "last_change")

    def __init__(self, function: str, window: int = WINDOW, first: int = FIRST_PASS,
                 longest: int = LONGEST_PASS):
        self.function = function
        self.window, self.first, self.longest = window, first, longest
        self.left = 0  # calls still to pass through: the engine's hot-path test
        self.length = 0  # the current (or last) pass-through's length; 0: never passed
        self.streak = 0  # new keys since a graph last replayed
        self.replays_seen = 0  # replays of graphed keys, summed when the last key was made
        self.passed = 0  # calls passed through in finished pass-throughs
        self.looks = 0  # pass-throughs that ended in a look
        self.last_parts: Sequence[str] = ()  # the readable pieces of the last new key
        self.last_change: Optional[str] = None  # what differed between the last two new keys

    def new_key(self, entries: Iterable[Any], parts: Sequence[str] = ()) -> bool:
        """Note a new key of the cache; True if the calls after this one pass through.

        ``entries``: the cache's entries (each with ``replays`` and ``graph``); ``parts``:
        the readable pieces of the new key, to say what keeps changing.
        """
        replays = sum(e.replays for e in entries if e.graph is not None)
        if replays != self.replays_seen:  # a graph replayed since the last new key: it pays
            self.replays_seen = replays
            self.streak, self.length = 0, 0
        self.streak += 1
        change = _what_changed(self.last_parts, parts)
        self.last_parts = parts
        if change:
            self.last_change = change
        if self.streak < self.window:
            return False
        self.passed += self.length - max(self.left, 0)
        if self.length:
            self.looks += 1
        self.length = self.first if not self.length else min(2 * self.length, self.longest)
        self.left = self.length
        return True

    def calls_passed(self) -> int:
        return self.passed + self.length - max(self.left, 0)

    def stats(self) -> Optional[KeyStats]:
        """The cache's pass-through row for ``report()``, or None if it never passed."""
        if not self.length:
            return None
        passed = self.calls_passed()
        now = (f"passing through, next look in {self.left} calls" if self.left > 0 else
               f"keying again since a look (the next new key passes through "
               f"{min(2 * self.length, self.longest)} calls)")
        changing = f"; from one key to the next: {self.last_change}" if self.last_change else ""
        return KeyStats(
            function=self.function, key="calls passed through (keys churn)", state="eager",
            calls=passed, eager_calls=passed, replays=0, capture_seconds=None, graph_bytes=0,
            fallback_reason=(
                f"{self.streak} new keys in a row were never graphed{changing}, so calls run "
                f"as plain calls, unkeyed and unwatched; {self.looks} look(s) so far, "
                f"{now}. Give that argument a fixed size (for a KV cache, transformers' "
                f"StaticCache) to have it graphed"))

    def reset(self) -> None:
        self.left = self.length = self.streak = self.replays_seen = 0
        self.passed = self.looks = 0
        self.last_parts, self.last_change = (), None


def _what_changed(before: Sequence[str], after: Sequence[str]) -> str:
    if not before or len(before) != len(after):
        return ""
    changes: List[str] = [f"{b} became {a}" for b, a in zip(before, after) if b != a]
    return "; ".join(changes[:3])
