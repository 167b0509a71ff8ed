"""One model's decoding at one batch size: its StaticCache, the decode state and the graphed step.

>>> decoder = decoder_for(model, plan, rows=8, compile=None)    # made once, then reused
>>> decoder.start(plan); decoder.step(plan.recipe); tokens = decoder.result(plan)

The decode step (forward, logits processing, the choice of the token, the end-of-sequence
bookkeeping) is one function graphed by ``autograph.graphed``: its first call is a warmup, its
second is captured, every later one, in this call and in later calls, a replay. Its state lives
in a ``DecodeState`` and in the cache, both updated in place and reset in place per call, so the
graph's addresses hold across calls (docs/design.md, "Decoding").

The cache autograph makes has full-length layers only: transformers' sliding-window layer keeps
a Python counter that decides its branch and the mask's offset at every step, which a replay
cannot follow, so the window is applied by the model's mask over a full-length layer instead
(the same attention; the tokens compared equal across the models of tests/generate). Its length
is the prompt plus ``max_new_tokens`` rounded up to a power of two (at least 64), so prompts of
other lengths reuse it and its graph; a call that needs more makes a larger one.
"""

from __future__ import annotations

import inspect
import weakref
from collections import OrderedDict
from typing import Any, Callable, Dict, Optional, Set, Tuple, Union

import torch

from .._scope import nested_calls
from ..api._graphed import graphed
from ._choose import choose
from ._loop import FinishedFlags
from ._recipe import Recipe
from ._state import DecodeState

# Decoders kept per model, the least recently used dropped first (each holds a cache).
KEPT_PER_MODEL = 4
_own: "weakref.WeakKeyDictionary[Any, OrderedDict]" = weakref.WeakKeyDictionary()
_given: "weakref.WeakKeyDictionary[Any, Decoder]" = weakref.WeakKeyDictionary()


class ModelCall:
    """The model's call as model.generate makes it: which keywords its forward takes."""

    def __init__(self, model: Any):
        parameters = inspect.signature(model.forward).parameters
        self.cache_name = "cache" if "cache" in parameters else "past_key_values"
        self.keeps_logits = "logits_to_keep" in parameters
        self.takes_positions = "position_ids" in parameters

    def __call__(
        self,
        model: Any,
        cache: Any,
        ids: torch.Tensor,
        mask: Optional[torch.Tensor],
        positions: Optional[torch.Tensor],
    ) -> torch.Tensor:
        kwargs: Dict[str, Any] = {self.cache_name: cache, "use_cache": True, "return_dict": True}
        if positions is not None and self.takes_positions:
            kwargs["position_ids"] = positions
        if self.keeps_logits:
            kwargs["logits_to_keep"] = 1
        return model(input_ids=ids, attention_mask=mask, **kwargs).logits


def decode_step_of(forward: ModelCall, state: DecodeState, name: str) -> Callable[..., None]:
    """The function the graph is captured from. The model and the cache are its arguments
    (keyed by identity, held weakly, and surveyed for Python state as a call's arguments are);
    its closure holds the state and the forward's keywords, never the graphed function's own
    engine (whose counters change on every call). ``token`` is the state's own, passed by
    address (``static_argnames``) so that the graph is made on its device. It always passes
    the mask over the whole cache: with a StaticCache a decode step's mask is built whether or
    not one is given (transformers never skips it for a compileable cache at one query), so an
    all-ones mask computes what none does, and models that would size a mask of their own
    from the cache's length (OPT) are spared a host read."""

    def decode_step(model: Any, cache: Any, token: torch.Tensor, recipe: Recipe) -> None:
        state.position.add_(1)
        logits = forward(model, cache, token, state.mask, state.position)
        choose(state, logits, recipe)

    decode_step.__qualname__ = decode_step.__name__ = name
    return decode_step


def prefill_of(forward: ModelCall, name: str) -> Callable[..., torch.Tensor]:
    """The function a prompt's prefill is captured from: the forward over the prompt, which
    writes the cache's first positions, giving the last position's logits. The first token is
    chosen from them outside the graph, so that the recipe (sampling options) is no part of
    the prefill's key: a length has one key per mask and positions, whatever the options."""

    def prefill(
        model: Any,
        cache: Any,
        prompt: torch.Tensor,
        mask: Optional[torch.Tensor],
        positions: Optional[torch.Tensor],
    ) -> torch.Tensor:
        return forward(model, cache, prompt, mask, positions)

    prefill.__qualname__ = prefill.__name__ = name
    return prefill


# Prompt lengths whose prefill a decoder graphs: a length from its second call on (its third
# replays), the first lengths to repeat; others prefill eagerly. A length has a key for each
# way a call gives its mask and positions (two at most), hence max_graphs=2x.
PREFILL_GRAPHS = 8


class Decoder:
    """The decode state, the cache and the graphed step of one model at one batch size. The
    model is held weakly, and so is a cache of the caller's: they go when the caller drops
    them (a decoder is found through them, in weak dictionaries)."""

    def __init__(
        self,
        model: Any,
        cache: Any,
        own: bool,
        rows: int,
        length: int,
        compile: Any,
        key: Tuple[Any, ...] = (),
    ):
        self.key = key
        self.length = length
        self.model = weakref.ref(model)
        self._cache = weakref.ref(cache)
        self.own_cache = cache if own else None
        self.forward = ModelCall(model)
        device = next(model.parameters()).device
        self.state = DecodeState(rows, length, _vocabulary(model), device)
        self.flags = FinishedFlags(self.state.alive)
        step = decode_step_of(
            self.forward, self.state, f"generate_decode_step[{type(model).__name__}, {rows} rows]"
        )
        if compile is not None:  # torch.compile's options, as sorted (name, value) pairs
            step = torch.compile(step, **dict(compile))
        # buckets=None: a region's buckets would pad the state's own token (its rows are the
        # decoder's already); its other options apply as to any graphed function.
        self._step = graphed(static_argnames=("token",), buckets=None)(step)
        name = f"generate_prefill[{type(model).__name__}, {rows} rows]"
        self._eager_prefill = prefill_of(self.forward, name)
        self._prefill = graphed(buckets=None, max_graphs=2 * PREFILL_GRAPHS)(self._eager_prefill)
        self.prompt_lengths: Dict[int, int] = {}  # calls seen per prompt length
        self.graphed_lengths: Set[int] = set()  # the lengths chosen, at most PREFILL_GRAPHS

    @property
    def cache(self) -> Any:
        return self._cache()

    def step(self, recipe: Recipe) -> None:
        """One decode step: a replay of its graph, from the third on."""
        self._step(self.model(), self.cache, self.state.token, recipe)

    def start(self, plan: Any) -> None:
        """Reset the cache and the state in place, prefill the prompt and choose the first
        token from its logits: eagerly, or a graphed call for a prompt length that repeats
        (``_graphs_prefill``)."""
        if self.own_cache is not None:
            self.own_cache.reset()
        state = self.state
        state.start(plan)
        spread = state.spread
        positions = None if plan.positions is None else spread(plan.positions)
        arguments = (
            self.model(),
            self.cache,
            spread(plan.prompt),
            spread(plan.mask) if plan.padded else None,
            positions,
        )
        if self._graphs_prefill(plan.prompt.shape[1]):
            logits = self._prefill(*arguments)
        else:
            with nested_calls():  # an enclosing region's: this call is autograph.generate's own
                logits = self._eager_prefill(*arguments)
        choose(state, logits, plan.recipe)

    def _graphs_prefill(self, length: int) -> bool:
        """Whether the prefill of a prompt of ``length`` tokens is a graphed call: from the
        second call of that length, for the first ``PREFILL_GRAPHS`` lengths to repeat (those
        stay chosen). A length seen once stays eager, so prompts of ever new lengths cost no
        warmups; past 32 such lengths they are forgotten (a workload that cycles through more
        lengths than that prefills eagerly)."""
        if length in self.graphed_lengths:
            return True
        seen = self.prompt_lengths
        calls = seen[length] = seen.get(length, 0) + 1
        if calls == 1 and len(seen) > 4 * PREFILL_GRAPHS:  # forget lengths seen once
            for other in [n for n, c in seen.items() if c == 1 and n != length]:
                del seen[other]
        if calls > 1 and len(self.graphed_lengths) < PREFILL_GRAPHS:
            self.graphed_lengths.add(length)
            return True
        return False

    def result(self, plan: Any) -> torch.Tensor:
        """The prompt and the tokens model.generate would return (one host read: their count);
        a caller's cache is left holding what model.generate would have left in it."""
        rows, length = plan.prompt.shape
        count = int(self.state.count)
        if self.own_cache is None:
            self._trim_cache(length + count - 1, length + int(self.state.index) - 1)
        return torch.cat([plan.prompt, self.state.generated[:rows, :count]], dim=1)

    def _trim_cache(self, kept: int, written: int) -> None:
        """Forget the steps run after the end: the write position back to ``kept``."""
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(kept)
            if written > kept:
                layer.keys[:, :, kept:written].zero_()
                layer.values[:, :, kept:written].zero_()


def decoder_for(model: Any, plan: Any, rows: int, compile: Any) -> Union[Decoder, str]:
    """The decoder this call runs on: the caller's cache's, or one kept for the model at this
    batch size and mode with a cache long enough; else a new one. A str: why there is none."""
    needed = plan.prompt.shape[1] + plan.max_new_tokens
    if plan.cache is not None:
        return _given_decoder(model, plan.cache, rows, needed, compile)
    device = next(model.parameters()).device
    key = (rows, device, next(model.parameters()).dtype, torch.is_inference_mode_enabled(), compile)
    kept = _own.setdefault(model, OrderedDict())
    decoder = kept.get(key)
    if decoder is not None and decoder.length >= needed:
        kept.move_to_end(key)
        return decoder
    kept.pop(key, None)
    length = max(64, 1 << (needed - 1).bit_length())
    cache = full_length_cache(model, length)
    if isinstance(cache, str):
        return cache
    kept[key] = Decoder(model, cache, True, rows, length, compile)
    while len(kept) > KEPT_PER_MODEL:
        kept.popitem(last=False)
    return kept[key]


def _given_decoder(
    model: Any, cache: Any, rows: int, needed: int, compile: Any
) -> Union[Decoder, str]:
    held = min(layer.max_cache_len for layer in cache.layers)
    if held < needed - 1:
        return (
            f"a StaticCache of {held} positions, fewer than the prompt and max_new_tokens "
            f"need ({needed - 1})"
        )
    decoder = _given.get(cache)
    key: Tuple[Any, ...] = (rows, torch.is_inference_mode_enabled(), compile)
    if decoder is None or decoder.model() is not model or decoder.key != key:
        decoder = _given[cache] = Decoder(model, cache, False, rows, held, compile, key)
    return decoder


def full_length_cache(model: Any, length: int) -> Any:
    """A StaticCache for ``model`` whose layers are all full-length StaticLayers, or why not."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    cache = StaticCache(config=model.config, max_cache_len=length)
    for i, layer in enumerate(cache.layers):
        if type(layer) is StaticSlidingWindowLayer:
            cache.layers[i] = StaticLayer(max_cache_len=length)
        elif type(layer) is not StaticLayer:
            return f"a model whose cache has {type(layer).__name__} layers"
    return cache


def _vocabulary(model: Any) -> int:
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor):
        return int(weight.shape[0])
    return int(model.config.get_text_config().vocab_size)
