"""One token per row from the model's logits, and the end-of-sequence bookkeeping, on the device.

>>> choose(state, logits, recipe)     # after the prefill (eagerly), and in every decode step

The same ops as transformers' ``_sample`` loop, in its order, at a fixed shape and with no host
read (docs/design.md, "Decoding"):

- the last position's logits as float32, processed by the recipe;
- greedy: ``argmax``; sampling: ``softmax``, then the draw ``torch.multinomial(probs, 1)``
  makes for one sample (``argmax(probs / q)`` with ``q`` an ``exponential_(1)`` draw of the
  probabilities' shape), written out because multinomial reads its input on the host to check
  it. From the same generator state the draws, and so the tokens, are multinomial's;
- a finished row gets the pad id; ``count`` grows by one while any row was unfinished before
  this token (the tokens ``model.generate`` returns: its loop stops once every row is done);
- the token goes to ``generated[:, index]``, to ``token`` (the next step's input) and to the
  repetition mask; a row whose token is an eos id is finished; ``alive`` says whether any row
  is not, for the host's check every few tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from ._recipe import Recipe


def choose(state: Any, logits: torch.Tensor, recipe: Recipe) -> None:
    scores = logits[:, -1].to(copy=True, dtype=torch.float32)
    scores = recipe.process(scores, state)
    if recipe.sample:
        probs = torch.nn.functional.softmax(scores, dim=-1)
        draws = torch.empty_like(probs).exponential_(1)
        tokens = probs.div(draws).argmax(dim=-1)
    else:
        tokens = torch.argmax(scores, dim=-1)
    unfinished = state.unfinished
    if recipe.ends:
        tokens = tokens * unfinished + state.pad * (1 - unfinished)
    state.count.add_(unfinished.amax())
    state.generated.index_copy_(1, state.index, tokens[:, None])
    state.index.add_(1)
    state.token.copy_(tokens[:, None])
    if recipe.penalises:
        state.seen.scatter_(1, tokens[:, None].clamp(max=state.seen.shape[-1] - 1), True)
    if recipe.ends:
        unfinished.copy_(unfinished & ~state.eos_mask[tokens])
        state.alive.copy_(unfinished.amax())
