"""What one ``autograph.generate`` call asks for, read the way ``model.generate`` reads it.

>>> plan = plan_of(model, input_ids, attention_mask, {"max_new_tokens": 64})
>>> plan.max_new_tokens, plan.recipe.sample           # or a str: the option it cannot serve

transformers' own preparation runs (the generation config with the model's defaults, special
tokens, the inferred attention mask and positions, the lengths, the logits processors and
stopping criteria it would build), so the defaults, warnings and errors are transformers'. What
it builds is then checked against what the decode step does on the device (``_recipe``): any
processor, stopping criterion, mode or model argument outside that set is named, and the call
runs ``model.generate`` as it is (docs/design.md, "Decoding").
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Dict, Optional, Union

import torch

from ._recipe import Recipe, recipe_of

# Arguments of model.generate that change the decoding loop itself: never served here.
_LOOP_ARGUMENTS = {
    "logits_processor": "a custom logits_processor",
    "stopping_criteria": "custom stopping_criteria",
    "prefix_allowed_tokens_fn": "prefix_allowed_tokens_fn",
    "assistant_model": "assisted decoding",
    "streamer": "a streamer",
    "negative_prompt_ids": "negative_prompt_ids",
    "negative_prompt_attention_mask": "negative_prompt_attention_mask",
    "custom_generate": "custom_generate",
    "synced_gpus": "synced_gpus",
    "inputs_embeds": "inputs_embeds",
    "assistant_tokenizer": "assisted decoding",
}
# Generation-config fields whose effect is not a logits processor or a stopping criterion.
_LOOP_FIELDS = (
    "return_dict_in_generate",
    "output_scores",
    "output_logits",
    "output_attentions",
    "output_hidden_states",
    "prefill_chunk_size",
    "token_healing",
)
_CACHES = ("cache", "past_key_values")  # transformers >= 5.18 says cache
_SERVED_CACHE_IMPLEMENTATIONS = (None, "static", "dynamic")


@dataclass
class Plan:
    """One call, prepared: the prompt and what the decode step needs to know of it."""

    prompt: torch.Tensor  # [rows, length] token ids
    mask: torch.Tensor  # [rows, length] attention mask, given or inferred
    padded: bool  # the model gets the mask (transformers drops all-ones)
    positions: Optional[torch.Tensor]  # [rows, length], when the model takes position_ids
    max_new_tokens: int
    recipe: Recipe
    eos: Optional[torch.Tensor]  # 1-D ids, or None: rows never end before max_new_tokens
    pad: Optional[torch.Tensor]  # 0-d id written after a row's end
    eos_blocked_until: Dict[str, int]  # min-length processors: tokens before eos may come
    repetition_ignored: Any  # the repetition processor's prompt_ignore_length
    cache: Any  # the caller's StaticCache, or None


def plan_of(
    model: Any, input_ids: Any, attention_mask: Optional[torch.Tensor], kwargs: Dict[str, Any]
) -> Union[Plan, str]:
    """The call prepared, or the name of the first thing in it this path does not serve."""
    reason = _unserved_call(model, input_ids, kwargs)
    if reason:
        return reason
    kwargs = dict(kwargs)
    tokenizer = kwargs.pop("tokenizer", None)
    given_config = kwargs.pop("generation_config", None)
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    defaults = _default_lengths(model, given_config, kwargs)
    config, model_kwargs = model._prepare_generation_config(given_config, **kwargs)
    reason = _unserved_config(model, config, model_kwargs)
    if reason:
        return reason
    rows, length = input_ids.shape
    model._prepare_special_tokens(
        config, attention_mask is not None, device=input_ids.device, batch_size=rows
    )
    mask, positions, padded = _mask_and_positions(model, config, input_ids, attention_mask)
    model._prepare_generated_length(
        generation_config=config,
        has_default_max_length=defaults[0],
        has_default_min_length=defaults[1],
        model_input_name="input_ids",
        inputs_tensor=input_ids,
        input_ids_length=length,
    )
    model._validate_generated_length(config, length, defaults[0])
    recipe = _processing(model, config, input_ids, mask if padded else None, tokenizer)
    if isinstance(recipe, str):
        return recipe
    recipe, blocked, ignored = recipe
    return Plan(
        prompt=input_ids,
        mask=mask,
        padded=padded,
        positions=positions,
        max_new_tokens=config.max_length - length,
        recipe=recipe,
        eos=config._eos_token_tensor,
        pad=config._pad_token_tensor,
        eos_blocked_until=blocked,
        repetition_ignored=ignored,
        cache=_given_cache(model_kwargs),
    )


def _mask_and_positions(
    model: Any, config: Any, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]
) -> Any:
    """(mask, positions, whether the model gets the mask), as model.generate makes them: a
    mask inferred from pad ids when none is given, positions from the mask's cumulative sum,
    and an all-ones mask dropped (kept for flash attention)."""
    mask = (
        attention_mask
        if attention_mask is not None
        else model._prepare_attention_mask_for_generation(input_ids, config, {})
    )
    positions = None
    if "position_ids" in _parameters(model):
        positions = model._prepare_position_ids_for_generation(input_ids, {"attention_mask": mask})
    padded = "flash" in str(getattr(model.config, "_attn_implementation", "")) or not bool(
        (mask == 1).all()
    )
    return mask, positions, padded


def _processing(
    model: Any, config: Any, input_ids: torch.Tensor, mask: Optional[torch.Tensor], tokenizer: Any
) -> Any:
    """The recipe of the logits processors and stopping criteria model.generate would build
    for this call (``recipe_of``), or the name of one it does not apply."""
    from transformers.generation import LogitsProcessorList, StoppingCriteriaList

    processors = model._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=input_ids.shape[1],
        encoder_input_ids=input_ids,
        prefix_allowed_tokens_fn=None,
        logits_processor=LogitsProcessorList(),
        device=input_ids.device,
        model_kwargs={"attention_mask": mask},
        negative_prompt_ids=None,
        negative_prompt_attention_mask=None,
    )
    criteria = model._get_stopping_criteria(
        generation_config=config, stopping_criteria=StoppingCriteriaList(), tokenizer=tokenizer
    )
    return recipe_of(processors, criteria, config, input_ids.shape[1])


def _parameters(model: Any) -> Any:
    return inspect.signature(model.forward).parameters


def _unserved_call(model: Any, input_ids: Any, kwargs: Dict[str, Any]) -> Optional[str]:
    for name, what in _LOOP_ARGUMENTS.items():
        value = kwargs.get(name)
        unset = value is None or value is False or isinstance(value, list) and not value
        if not unset:
            return f"{name}= ({what})"
    if getattr(model.config, "is_encoder_decoder", False):
        return f"an encoder-decoder model ({type(model).__name__})"
    if (
        not isinstance(input_ids, torch.Tensor)
        or input_ids.dim() != 2
        or input_ids.dtype not in (torch.long, torch.int)
    ):
        return "input_ids that are not a 2-D tensor of token ids"
    weights = next(model.parameters(), None)
    if weights is not None and weights.device != input_ids.device:
        return f"input_ids on {input_ids.device}, the model on {weights.device} (move them)"
    if "attention_mask" not in _parameters(model):
        return f"a model whose forward takes no attention_mask ({type(model).__name__})"
    return None


def _default_lengths(model: Any, given: Any, kwargs: Dict[str, Any]) -> "tuple[bool, bool]":
    """Whether max_length and min_length come from nowhere: as model.generate decides it."""
    return tuple(  # type: ignore[return-value]
        kwargs.get(name) is None
        and (given is None or getattr(given, name) is None)
        and getattr(model.generation_config, name) is None
        for name in ("max_length", "min_length")
    )


def _unserved_config(model: Any, config: Any, model_kwargs: Dict[str, Any]) -> Optional[str]:
    mode = config.get_generation_mode(None)
    if mode.name not in ("GREEDY_SEARCH", "SAMPLE"):
        return f"{mode.value.replace('_', ' ')} (num_beams={config.num_beams})"
    if (config.num_return_sequences or 1) > 1:
        return f"num_return_sequences={config.num_return_sequences}"
    for field in _LOOP_FIELDS:
        if getattr(config, field, None):
            return f"{field}={getattr(config, field)!r}"
    if config.use_cache is False:
        return "use_cache=False"
    if config.cache_implementation not in _SERVED_CACHE_IMPLEMENTATIONS:
        return f"cache_implementation={config.cache_implementation!r}"
    for name, value in model_kwargs.items():
        if name in ("attention_mask", "use_cache") or name in _CACHES and value is None:
            continue
        if name in _CACHES:
            return _unserved_cache(value, name)
        if name not in ("output_attentions", "output_hidden_states") or value:
            return f"{name}= (a model argument)"
    return None


def _unserved_cache(cache: Any, name: str) -> Optional[str]:
    from transformers.cache_utils import StaticCache, StaticLayer

    if not isinstance(cache, StaticCache):
        return f"{name}= a {type(cache).__name__} (pass a StaticCache, or none)"
    kinds = {type(layer).__name__ for layer in cache.layers if type(layer) is not StaticLayer}
    if kinds:
        return (
            f"{name}= a StaticCache with {', '.join(sorted(kinds))} layers, which keep a "
            f"Python counter (leave {name} out: autograph.generate then makes a cache of "
            f"full-length layers, the sliding window applied by the mask)"
        )
    layers: Any = cache.layers
    if any(layer.is_initialized and int(layer.cumulative_length) != 0 for layer in layers):
        return f"{name}= a StaticCache that holds tokens already (cache.reset() starts it anew)"
    return None


def _given_cache(model_kwargs: Dict[str, Any]) -> Any:
    return next((model_kwargs[n] for n in _CACHES if model_kwargs.get(n) is not None), None)
