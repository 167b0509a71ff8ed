"""The logits processing transformers would apply, as ops on the device at a fixed shape.

>>> recipe, blocked, ignored = recipe_of(processors, criteria, config, prompt_length)
>>> scores = recipe.process(scores, state)          # inside the decode step's graph

``model.generate`` builds a list of logits processors per call; some read the growing
``input_ids`` (their length decides in Python whether eos is blocked; the repetition penalty
gathers over every id so far). Here each becomes an op over the decode state's fixed-shape
buffers, in the list's order, computing the same values (docs/design.md, "Decoding"):

- temperature, top-k, top-p and min-p are transformers' own classes, rebuilt from their
  attributes inside the step (they read only the scores);
- min_length and min_new_tokens put -inf on the eos ids while the tokens made so far (a device
  counter) are under a threshold held on the device, so one graph serves every prompt length;
- the repetition penalty keeps a [rows, vocab + 1] mask of the ids seen (the prompt's, then
  each token chosen), and penalises where it is set, as transformers' gather and scatter do.

A ``Recipe`` is hashable: the decode step takes it as an argument, so it is part of the key,
and a new temperature is a new graph (a Python float is a constant of the kernels, as it is in
transformers' ops). Any other processor or stopping criterion is named, and the call runs
``model.generate`` as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple, Union

import torch

_WARPERS = ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper")
_EOS_BLOCKERS = {
    "MinLengthLogitsProcessor": "min_length",
    "MinNewTokensLengthLogitsProcessor": "min_new_tokens",
}
_CRITERIA = ("MaxLengthCriteria", "EosTokenCriteria")
LANES = ("min_length", "min_new_tokens")  # the thresholds held on the device, in this order


@dataclass(frozen=True)
class Recipe:
    """What the decode step applies to a row's scores, and how it chooses."""

    steps: Tuple[Tuple[Any, ...], ...]  # ("warp", class, attributes) | ("eos", lane) | ...
    sample: bool
    ends: bool  # eos ids are set: rows end, and are padded after

    @property
    def penalises(self) -> bool:
        return any(step[0] == "repetition" for step in self.steps)

    def process(self, scores: torch.Tensor, state: Any) -> torch.Tensor:
        for step in self.steps:
            if step[0] == "warp":
                scores = _rebuilt(step[1], step[2])(None, scores)
            elif step[0] == "eos":
                blocked = state.eos_mask & (state.index < state.thresholds[LANES.index(step[1])])
                scores = torch.where(blocked, -math.inf, scores)
            else:  # ("repetition", penalty)
                penalised = torch.where(scores < 0, scores * step[1], scores / step[1])
                scores = torch.where(state.seen[:, : scores.shape[-1]], penalised, scores)
        return scores


def recipe_of(
    processors: Any, criteria: Any, config: Any, length: int
) -> Union[Tuple[Recipe, Dict[str, int], Any], str]:
    """(recipe, eos thresholds by lane, the repetition penalty's prompt_ignore_length), or the
    name of the processor or criterion the decode step does not apply."""
    steps: List[Tuple[Any, ...]] = []
    blocked: Dict[str, int] = {}
    ignored = None
    for processor in processors:
        name = type(processor).__name__
        if name in _WARPERS:
            attributes = tuple(sorted(vars(processor).items()))
            if not all(isinstance(v, (int, float, bool, type(None))) for _, v in attributes):
                return f"{name} with non-scalar attributes"
            steps.append(("warp", type(processor), attributes))
        elif name in _EOS_BLOCKERS:
            lane = _EOS_BLOCKERS[name]
            until = (
                processor.min_length
                if lane == "min_length"
                else processor.prompt_length_to_skip + processor.min_new_tokens
            )
            blocked[lane] = until - length
            steps.append(("eos", lane))
        elif (
            name == "RepetitionPenaltyLogitsProcessor"
            and getattr(processor, "logits_indices", None) is None
        ):
            ignored = getattr(processor, "prompt_ignore_length", None)
            steps.append(("repetition", processor.penalty))
        else:
            return f"a logits processor autograph.generate does not apply ({name})"
    for criterion in criteria:
        if type(criterion).__name__ not in _CRITERIA:
            return (
                f"a stopping criterion autograph.generate does not apply "
                f"({type(criterion).__name__})"
            )
    recipe = Recipe(
        steps=tuple(steps), sample=bool(config.do_sample), ends=config._eos_token_tensor is not None
    )
    return recipe, blocked, ignored


def _rebuilt(cls: Any, attributes: Tuple[Tuple[str, Any], ...]) -> Any:
    """A transformers warper with these attributes, as the one generate() built."""
    warper = cls.__new__(cls)
    warper.__dict__.update(attributes)
    return warper


def seen_in_prompt(seen: torch.Tensor, prompt: torch.Tensor, ignored: Any) -> None:
    """Mark the prompt's ids in ``seen`` ([rows, vocab + 1]) as the repetition processor reads
    them: ids past the vocabulary in the last column, the positions it ignores left out."""
    vocab = seen.shape[-1] - 1
    ids = prompt.clamp(max=vocab)
    if isinstance(ignored, int) and ignored:
        ids = ids[:, ignored:]
    elif isinstance(ignored, torch.Tensor):
        positions = torch.arange(ids.shape[1], device=ids.device)
        ignored = ignored.to(ids.device)
        ids = ids.masked_fill(positions[None, :] < ignored[: ids.shape[0], None], vocab)
    seen.zero_()
    seen[: ids.shape[0]].scatter_(1, ids, True)
