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

A key ``new_key`` does not expect to repeat (one that grew by one, ``growing > 0``, or the one
whose count starts a pass-through) runs its first call unwatched, as a plain call; the engine
reads this right after ``new_key`` (``KeyLife.watch_later``). Its second call, if one comes,
is its watched warmup, and ends a pass-through episode as a replay would (``met_again``).

A key whose identity-keyed object died before it replayed (``key_died``) could never have
replayed: its function is handed a new object per call (HF ``generate(cache_implementation=
"static")`` builds a new StaticCache each time, and the prefill's key holds it). ``orphans``
such keys in a row, with no replay between them, pass through at once: the window's wait, each
new key watched op by op, would cost about ten eager calls per call for 16 calls.

The pass-through costs one attribute test and a decrement per call; everything else runs at
new keys, which cost a warmup anyway. The test is ``> 0``, not truthiness: two threads may
both decrement the last count, and a negative count must end the pass-through, not extend it.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, List, Optional, Sequence

from .._stats import KeyStats

# New keys in a row, none of them graphed, before calls pass through. HF generate() with a
# DynamicCache makes two per generate() call (the prefill, and a decode step whose graph
# reads the growing cache), one per step when the attention mask is passed and grows. Not
# fewer: a server that calls a model at N batch sizes in turn makes N new keys before any
# repeats (and is captured on its second round); 16 lets N reach 15 (max_graphs' default).
WINDOW = 16
# Keys in a row whose identity-keyed object died before they replayed: two are a pattern (a new
# object per call), and a third new key then passes through.
ORPHANS = 2
# New keys in a row, each one element longer than the last along one dim of one argument
# while another tensor argument keeps its shape (HF generate() with a DynamicCache and its
# attention mask of length n, n+1, n+2 while input_ids stays [B, 1]): such a family never
# repeats within a sequence, so after 3 of its keys (2 steps of growth) calls pass through,
# instead of watching 16 of them op by op. A server's sweep over batch sizes 1, 2, 3 changes
# every batched argument at once, so it is not taken for one.
GROWTH = 2
# Calls passed through before the first look; each look that meets a new key doubles it.
FIRST_PASS = 16
LONGEST_PASS = 1024


class Churn:
    """The pass-through policy of one key cache (see the module docstring)."""

    __slots__ = (
        "function",
        "window",
        "orphans",
        "growth",
        "first",
        "longest",
        "left",
        "length",
        "streak",
        "growing",
        "died_unused",
        "replays_seen",
        "passed",
        "looks",
        "last_parts",
        "last_change",
        "numbers",
    )

    def __init__(
        self,
        function: str,
        window: int = WINDOW,
        first: int = FIRST_PASS,
        longest: int = LONGEST_PASS,
        orphans: int = ORPHANS,
        growth: int = GROWTH,
    ):
        self.function = function
        self.window, self.orphans, self.first, self.longest = window, orphans, first, longest
        self.growth = growth
        self.left = 0  # calls still to pass through: the engine's hot-path test
        self.length = 0  # the current (or last) pass-through's length; 0: never passed
        self.streak = 0  # new keys since a graph last replayed
        self.growing = 0  # of those, the last ones in a row that grew by one (``_grows``)
        self.died_unused = 0  # of those, keys whose identity-keyed object died first
        self.replays_seen = 0  # replays of graphed keys, summed when the last key was made
        self.passed = 0  # calls passed through in finished pass-throughs
        self.looks = 0  # pass-throughs that ended in a look
        self.last_parts: Sequence[str] = ()  # the readable pieces of the last new key
        self.last_change: Optional[str] = None  # what differed between the last two new keys
        self.numbers: List[str] = []  # the Python number arguments among those differences

    def new_key(self, entries: Iterable[Any], parts: Sequence[str] = ()) -> bool:
        """Note a new key of the cache; True if the calls after this one pass through.

        ``entries``: the cache's entries (each with ``replays``, ``graph`` and ``calls``);
        ``parts``: the readable pieces of the new key, to say what keeps changing.
        """
        entries = list(entries)
        replays = sum(e.replays for e in entries if e.graph is not None)
        if replays != self.replays_seen:  # a graph replayed since the last new key: it pays
            self.replays_seen = replays
            self._paid()
        self.streak += 1
        # After a pass-through that growth started, a family still growing by one has grown
        # by one per call passed through: the look's key is that much longer. A key called
        # more than once means the family repeats (a server's sweep over batch sizes 1, 2, 3,
        # a cycle of lengths), which the window serves: growth no longer counts.
        step = self.length + 1 if self.growing >= self.growth else 1
        repeats = any(e.calls > 1 for e in entries)
        grows = not repeats and _grows(self.last_parts, parts, step)
        self.growing = self.growing + 1 if grows else 0
        change = _what_changed(self.last_parts, parts)
        if change:
            self.last_change, self.numbers = change, _changed_numbers(self.last_parts, parts)
        self.last_parts = parts
        if (
            self.streak < self.window
            and self.died_unused < self.orphans
            and self.growing < self.growth
        ):
            return False
        self.passed = self.calls_passed()
        if self.length:
            self.looks += 1
        self.length = self.first if not self.length else min(2 * self.length, self.longest)
        self.left = self.length
        return True

    def key_died(self, entry: Any) -> None:
        """A key whose identity-keyed object died (``entry``: its ``graph``, ``calls`` and
        ``replays``). One with a graph that replayed paid, as ``new_key`` counts replays: its
        replays leave the cache with it, before the next new key could see them (a
        request-scoped cache and its decode step; a graph captured ahead). One that was called
        and never replayed counts towards ``orphans`` (the next ``new_key`` decides); one
        captured ahead and never called, or gone eager because its calls free what they read
        (``frees_reads``: a DynamicCache's decode step, seen by its watched warmups or by its
        capture), neither."""
        if entry.graph is not None and entry.replays:
            self._paid()
        elif entry.calls and not entry.replays and not entry.frees_reads:
            self.died_unused += 1

    def met_again(self) -> None:
        """A key whose first call ran unwatched (it was not expected to repeat) is called
        again: the family repeats. Before, a look that met such a key captured it and its
        replay ended the episode; now the key's second call is its watched warmup, so the
        meeting ends the episode itself, else the next new key would pass through at once and
        the key's capture wait for another look (a sweep over sizes 1..31, repeated, first
        replayed in its 33rd round instead of its 8th)."""
        self._paid()

    def _paid(self) -> None:
        """A graph replayed: the count starts over, and a pass-through episode ends (its calls
        kept for the report), at once if it was still passing calls through (a key that
        replayed died meanwhile)."""
        self.passed, self.left = self.calls_passed(), 0
        self.streak = self.growing = self.died_unused = self.length = 0

    def calls_passed(self) -> int:
        return self.passed + self.length - max(self.left, 0)

    def stats(self) -> Optional[KeyStats]:
        """The cache's pass-through row for ``report()``, or None if it never passed."""
        if not self.length and not self.passed:
            return None
        passed = self.calls_passed()
        return KeyStats(
            function=self.function,
            key="calls passed through (keys churn)",
            state="eager",
            calls=passed,
            eager_calls=passed,
            replays=0,
            capture_seconds=None,
            graph_bytes=0,
            fallback_reason=self._why(),
        )

    def _why(self) -> str:
        if not self.length:
            return (
                f"calls ran as plain calls while its keys churned; that ended when a graph "
                f"replayed ({self.looks} look(s) before)"
            )
        now = (
            f"passing through, next look in {self.left} calls"
            if self.left > 0
            else f"keying again since a look (the next new key passes through "
            f"{min(2 * self.length, self.longest)} calls)"
        )
        changing = f"; from one key to the next: {self.last_change}" if self.last_change else ""
        if self.died_unused:
            changing += (
                f"; {self.died_unused} of them died before they were called again "
                f"(an argument is a new object on each call)"
            )
        return (
            f"{self.streak} new keys in a row were never graphed{changing}, so calls run "
            f"as plain calls, unkeyed and unwatched; {self.looks} look(s) so far, "
            f"{now}. {self.advice()}"
        )

    def warning(self, label: str) -> str:
        """What is said once, when calls start to pass through; ``label``: the new key's."""
        what = self.last_change or (
            f"the same readable key, {label}" if self.died_unused else f"the key became {label}"
        )
        if self.died_unused:
            what += (
                f" ({self.died_unused} of those keys died before they were called again: "
                f"an argument is a new object on each call)"
            )
        return (
            f"{self.function}: {self.streak} new keys, and no graph replayed since the "
            f"first of them (a key is captured once it repeats). From one key to the next: "
            f"{what}. Its calls now run as plain calls, unkeyed and unwatched, looking again "
            f"now and then (report() has a row). {self.advice()}, or call it outside "
            f"autograph."
        )

    def advice(self) -> str:
        """What to change for the calls to be graphed."""
        if self.died_unused:
            return (
                "Pass the same object on every call, updated in place (for a KV cache, one "
                "StaticCache, reset between sequences), to have it graphed"
            )
        if self.numbers:
            names = " and ".join(self.numbers)
            return (
                f"A Python number is part of the key, so each new value of {names} is a new "
                f"key: pass it as a tensor on the function's device (torch.tensor(value, "
                f"device=...), updated in place with .fill_()), which a graph reads on "
                f"every replay, to have it graphed"
            )
        return (
            "Give that argument a fixed size (pad it; for a KV cache use a fixed-size one "
            "such as transformers' StaticCache) to have it graphed"
        )

    def reset(self) -> None:
        self.left = self.length = self.streak = self.growing = self.died_unused = 0
        self.replays_seen = 0
        self.passed = self.looks = 0
        self.last_parts, self.last_change, self.numbers = (), None, []


def _what_changed(before: Sequence[str], after: Sequence[str]) -> str:
    if not before or len(before) != len(after):
        return ""
    changes: List[str] = [f"{b} became {a}" for b, a in zip(before, after) if b != a]
    return "; ".join(changes[:3])


# A key's part for a tensor argument: ``name: dtype[sizes] device...`` (watch/_names.py).
_TENSOR = re.compile(r"^(.+?): (\w+)\[([\d, ]*)\](.*)$")


def _grows(before: Sequence[str], after: Sequence[str], step: int = 1) -> bool:
    """Whether the key ``after`` is the key ``before`` with one tensor argument ``step``
    elements longer along one dim, and every other part the same (a tensor argument among
    them).

    >>> _grows(["ids: i64[1, 1] cuda:0", "mask: i64[1, 9] cuda:0"],
    ...        ["ids: i64[1, 1] cuda:0", "mask: i64[1, 10] cuda:0"])
    True
    """
    if not before or len(before) != len(after):
        return False
    changed = [(b, a) for b, a in zip(before, after) if b != a]
    kept_a_tensor = any(_TENSOR.match(b) for b, a in zip(before, after) if b == a)
    if len(changed) != 1 or not kept_a_tensor:
        return False
    old, new = (_TENSOR.match(part) for part in changed[0])
    if old is None or new is None or old.group(1, 2, 4) != new.group(1, 2, 4):
        return False
    old_sizes, new_sizes = (
        [int(n) for n in m.group(3).split(",") if n.strip()] for m in (old, new)
    )
    if len(old_sizes) != len(new_sizes):
        return False
    steps = [n - o for o, n in zip(old_sizes, new_sizes) if n != o]
    return steps == [step]


# A key's part for a Python number argument: ``name=repr(value)`` (capture/_keys.py).
_NUMBER = re.compile(r"^(.+?)=[-+]?(?:\d+\.?\d*(?:e[-+]?\d+)?|inf|nan)$")


def _changed_numbers(before: Sequence[str], after: Sequence[str]) -> List[str]:
    """The names of the Python number arguments whose value differs between two keys."""
    if len(before) != len(after):
        return []
    names = []
    for b, a in zip(before, after):
        old, new = _NUMBER.match(b), _NUMBER.match(a)
        if b != a and old and new and old.group(1) == new.group(1):
            names.append(new.group(1))
    return names
