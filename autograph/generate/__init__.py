"""Text generation with Hugging Face models, each decode step one graph replay.

>>> tokens = autograph.generate(model, input_ids, attention_mask=mask, max_new_tokens=64)

``generate`` (``_generate``) reads the call as ``model.generate`` would (``_plan``), turns the
logits processors it would build into device ops (``_recipe``), and decodes over a decoder kept
per model and batch size (``_decoder``: the StaticCache, the buffers of ``_state`` and the
graphed step, whose token choice is ``_choose``), the host checking for the end only every few
tokens (``_loop``). transformers is imported when a call needs it, never by ``import autograph``.

May import: the front door (``api``) and everything below it (docs/design.md, "Layers").
"""

from ._generate import generate

__all__ = ["generate"]
