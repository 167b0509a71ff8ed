"""``autograph.generate``: Hugging Face decoding with each decode step one graph replay.

See ``generate``'s docstring; docs/design.md, "Decoding" says how it is built.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch

from .._warn import warn_user
from ._decoder import decoder_for
from ._loop import CHECK_EVERY, decode
from ._plan import plan_of


def generate(
    model: Any,
    input_ids: Optional[torch.Tensor] = None,
    attention_mask: Optional[torch.Tensor] = None,
    *,
    buckets: Optional[Sequence[int]] = None,
    compile: Union[bool, Dict[str, Any]] = False,
    check_every: int = CHECK_EVERY,
    **generation_kwargs: Any,
) -> Any:
    """``model.generate(input_ids, attention_mask=..., **generation_kwargs)``, each decode step
    (forward, logits processing, choice of the token, end bookkeeping) one graph replay.

    >>> import torch, transformers, autograph
    >>> config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, vocab_size=256,
    ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    >>> model = transformers.LlamaForCausalLM(config).eval()     # .cuda() for real graphs
    >>> ids = torch.randint(0, 256, (2, 8))
    >>> tokens = autograph.generate(model, ids, max_new_tokens=16, do_sample=False)
    >>> torch.equal(tokens, model.generate(ids, max_new_tokens=16, do_sample=False))
    True

    Served: greedy and sampling (``temperature``, ``top_k``, ``top_p``, ``min_p``,
    ``repetition_penalty``), ``max_new_tokens``/``max_length``, ``min_new_tokens``/
    ``min_length``, ``eos_token_id`` (one or several), ``pad_token_id``, the model's
    ``generation_config`` defaults, left-padded batches (rows end on their own, padded after),
    and an empty ``past_key_values`` StaticCache of the caller's. Greedy tokens equal
    ``model.generate``'s over a StaticCache of the same length (the same ops; its default
    DynamicCache may use another attention kernel on the GPU, which in bf16 can round a
    near-tie otherwise; on the CPU they matched across 12 model families). Sampling draws as
    ``torch.multinomial`` does, so from the same ``torch.manual_seed`` the tokens are
    transformers' (steps after the end draw too: the generator ends further along). The
    prefill runs eagerly, or from a graph for a prompt length that repeats (from its second
    call); each decode step replays one graph, kept for later calls with its
    StaticCache (reset in place; full-length layers; the prompt plus ``max_new_tokens``
    rounded up to a power of two, >= 64). The host checks "every row finished" every
    ``check_every`` tokens (8), one check behind, so the CPU runs ahead; the steps run after
    the end never show in the result.

    ``buckets=[1, 2, 4, 8]``: a batch runs in the decoder of the smallest bucket that holds
    it (spare rows finished from the start), so its tokens are the bucket's kernels' and draws.
    ``compile=True`` graphs ``torch.compile(step)`` (or a dict of torch.compile's options):
    fused kernels, so tokens are not bit-equal to eager's; its first call compiles the step,
    about 15-20 s for an 8-layer Llama on an H200, then captures it (0.2 s).

    Anything else (beam search, assisted decoding, streamers, custom logits processors or
    stopping criteria, ``output_scores``, ``return_dict_in_generate``, encoder-decoder models,
    other caches...) runs ``model.generate`` as it is, with one ``AutographWarning`` naming it.
    """
    if transformers_major() < 5:
        reason = "transformers < 5 (its StaticCache does not count its own positions)"
        return _as_transformers_does(model, input_ids, attention_mask, generation_kwargs, reason)
    rows = _rows_for(input_ids, buckets)
    _check_every_is_valid(check_every)
    compiled = _compiled(compile)
    with torch.no_grad():
        plan = plan_of(model, input_ids, attention_mask, generation_kwargs)
        decoder = (
            plan
            if isinstance(plan, str)
            else decoder_for(model, plan, max(rows, plan.prompt.shape[0]), compiled)
        )
        if isinstance(decoder, str):
            return _as_transformers_does(
                model, input_ids, attention_mask, generation_kwargs, decoder
            )
        decoder.start(plan)
        decode(decoder, plan, check_every)
        return decoder.result(plan)


def transformers_major() -> int:
    try:
        import transformers
    except ImportError as error:
        raise ImportError(
            "autograph.generate needs Hugging Face transformers: pip install "
            "transformers (or torch-autograph[examples])"
        ) from error
    return int(transformers.__version__.split(".")[0])


def _as_transformers_does(
    model: Any, input_ids: Any, attention_mask: Any, kwargs: Any, reason: str
) -> Any:
    warn_user(
        f"autograph.generate({type(model).__name__}): {reason} is not served by the "
        f"graphed decode loop, so this call runs model.generate as it is"
    )
    if attention_mask is not None:
        kwargs = {**kwargs, "attention_mask": attention_mask}
    return model.generate(input_ids, **kwargs)


def _rows_for(input_ids: Any, buckets: Optional[Sequence[int]]) -> int:
    """The rows the decoder runs at: the smallest bucket that holds the batch, else the batch's
    own size."""
    rows = input_ids.shape[0] if isinstance(input_ids, torch.Tensor) and input_ids.dim() else 1
    if buckets is None:
        return rows
    sizes = sorted(buckets)
    if not sizes or not all(
        isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in sizes
    ):
        raise ValueError(
            f"autograph.generate: buckets={list(buckets)!r}; give batch sizes, "
            f"positive ints, such as [1, 2, 4, 8]."
        )
    return next((b for b in sizes if b >= rows), rows)


def _compiled(compile: Union[bool, Dict[str, Any]]) -> Optional[Tuple[Tuple[str, Any], ...]]:
    """torch.compile's options as sorted pairs (hashable: part of the decoder's key), or None."""
    if compile is False:
        return None
    if compile is True:
        return ()
    if isinstance(compile, dict):
        return tuple(sorted(compile.items()))
    raise TypeError(
        f"autograph.generate: compile={compile!r}; give True, False or a dict of "
        f"torch.compile's options."
    )


def _check_every_is_valid(check_every: int) -> None:
    if not isinstance(check_every, int) or isinstance(check_every, bool) or check_every < 1:
        raise ValueError(
            f"autograph.generate: check_every={check_every!r}; give the number of "
            f"tokens between the host's looks at 'every row finished' (>= 1)."
        )
