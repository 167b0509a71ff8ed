"""``autograph.generate``: Hugging Face decoding with each decode step one graph replay.

See ``generate``'s docstring; docs/design.md, "Generation" says how it is built.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch

from .._warn import warn_user
from ._decoder import decoder_for
from ._loop import CHECK_EVERY, decode
from ._plan import plan_of


def generate(model: Any, input_ids: Optional[torch.Tensor] = None,
             attention_mask: Optional[torch.Tensor] = None, *,
             buckets: Optional[Sequence[int]] = None,
             compile: Union[bool, Dict[str, Any]] = False,
             check_every: int = CHECK_EVERY, **generation_kwargs: Any) -> Any:
    """``model.generate(input_ids, attention_mask=..., **generation_kwargs)``, with each decode
    step (forward, logits processing, the choice of the next token, end-of-sequence
    bookkeeping) one CUDA graph replay and no host read per token.

    >>> import torch, transformers, autograph
    >>> config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, vocab_size=256,
    ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    >>> model = transformers.LlamaForCausalLM(config).eval()     # .cuda() for real graphs
    >>> ids = torch.randint(0, 256, (2, 8))
    >>> tokens = autograph.generate(model, ids, max_new_tokens=16, do_sample=False)
    >>> torch.equal(tokens, model.generate(ids, max_new_tokens=16, do_sample=False))
    True

    It returns what ``model.generate`` returns for the options it serves: greedy decoding and
    sampling (``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``min_p``,
    ``repetition_penalty``), ``max_new_tokens``/``max_length``, ``min_new_tokens``/
    ``min_length``, ``eos_token_id`` (one or several) and ``pad_token_id``, the model's
    ``generation_config`` defaults, batches with left padding and an attention mask (rows end
    on their own and are padded after their end), and a ``past_key_values`` StaticCache of the
    caller's (empty: ``cache.reset()`` it between calls; it is left as model.generate leaves it).

    - Greedy tokens equal ``model.generate``'s (the same model, eager kernels). Sampling draws
      from the default generator exactly as ``torch.multinomial`` does, one draw per token of
      every row, so from the same seed (``torch.manual_seed``) the tokens are transformers';
      only the steps after the end draw more, so the generator ends up further along.
    - The prompt's prefill runs eagerly; then each step is a replay of one graph of the step,
      captured at the second step of the first call and kept for later calls. The host looks
      at "every row finished" only every ``check_every`` tokens (8), one check behind, so the
      CPU runs ahead of the GPU; the up to ``2 * check_every - 1`` steps run after the end are
      never in the result.
    - The StaticCache is made by autograph (the prompt plus ``max_new_tokens`` rounded up to a
      power of two, at least 64; full-length layers: a sliding window is applied by the mask)
      and reused across calls, reset in place; a decoder is kept per model, batch size and
      mode (the 4 most recent).
    - ``buckets=[1, 2, 4, 8]``: a batch of B rows runs in the decoder of the smallest bucket
      >= B (spare rows copy row 0 and are finished from the start), so a server's batch
      sizes share a few graphs; above the largest bucket it runs at its own size. The real
      rows then run in kernels chosen for the bucket's size, which may round differently from
      those of B rows, and sampling draws for the bucket's rows: the tokens are the bucket's.
    - ``compile=True`` graphs ``torch.compile(step)``: fused kernels, so the tokens are not
      bit-equal to eager's. Its first call compiles the step (about 15-20 s for an 8-layer
      Llama on an H200; then the capture, 0.2 s). A dict is torch.compile's options
      (``compile={"backend": "aot_eager"}``, ``{"mode": "max-autotune-no-cudagraphs"}``).

    Anything else (beam search, assisted decoding, streamers, custom logits processors or
    stopping criteria, ``output_scores``, ``return_dict_in_generate``, ``num_return_sequences``,
    encoder-decoder models, a cache other than an empty StaticCache of full-length layers...)
    runs ``model.generate`` as it is, with one ``autograph.AutographWarning`` naming it.
    """
    if transformers_major() < 5:
        reason = "transformers < 5 (its StaticCache does not count its own positions)"
        return _as_transformers_does(model, input_ids, attention_mask, generation_kwargs, reason)
    rows = _rows_for(input_ids, buckets)
    _check_every_is_valid(check_every)
    with torch.no_grad():
        plan = plan_of(model, input_ids, attention_mask, generation_kwargs)
        decoder = plan if isinstance(plan, str) else \
            decoder_for(model, plan, max(rows, plan.prompt.shape[0]), _compiled(compile))
        if isinstance(decoder, str):
            return _as_transformers_does(model, input_ids, attention_mask, generation_kwargs,
                                         decoder)
        decoder.start(plan)
        decode(decoder, plan, check_every)
        return decoder.result(plan)


def transformers_major() -> int:
    try:
        import transformers
    except ImportError as error:
        raise ImportError("autograph.generate needs Hugging Face transformers: pip install "
                          "transformers (or torch-autograph[examples])") from error
    return int(transformers.__version__.split(".")[0])


def _as_transformers_does(model: Any, input_ids: Any, attention_mask: Any,
                          kwargs: Any, reason: str) -> Any:
    warn_user(f"autograph.generate({type(model).__name__}): {reason} is not served by the "
              f"graphed decode loop, so this call runs model.generate as it is")
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
    if not sizes or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0
                            for b in sizes):
        raise ValueError(f"autograph.generate: buckets={list(buckets)!r}; give batch sizes, "
                         f"positive ints, such as [1, 2, 4, 8].")
    return next((b for b in sizes if b >= rows), rows)


def _compiled(compile: Union[bool, Dict[str, Any]]) -> Optional[Tuple[Tuple[str, Any], ...]]:
    """torch.compile's options as sorted pairs (hashable: part of the decoder's key), or None."""
    if compile is False:
        return None
    if compile is True:
        return ()
    if isinstance(compile, dict):
        return tuple(sorted(compile.items()))
    raise TypeError(f"autograph.generate: compile={compile!r}; give True, False or a dict of "
                    f"torch.compile's options.")


def _check_every_is_valid(check_every: int) -> None:
    if not isinstance(check_every, int) or isinstance(check_every, bool) or check_every < 1:
        raise ValueError(f"autograph.generate: check_every={check_every!r}; give the number of "
                         f"tokens between the host's looks at 'every row finished' (>= 1).")
