"""Testing graphed code without a GPU: CUDA graphs emulated on CPU tensors.

>>> import autograph, autograph.testing, torch
>>> @autograph.graphed
... def step(x, w):
...     return torch.relu(x @ w).sum(-1)
>>> def test_step():                                  # runs in CI on a machine without a GPU
...     x, w = torch.randn(8, 4), torch.randn(4, 4)
...     with autograph.testing.emulate_graphs_on_cpu():
...         results = [step(x, w) for _ in range(5)]
...     assert all(torch.allclose(r, torch.relu(x @ w).sum(-1)) for r in results)
...     assert sum(s.replays for s in step.stats()) > 0     # served by the emulated graph

Inside the block, calls on CPU tensors go through the real engine (keys, warmup, capture,
replay, fallbacks) with recorded-op replay standing in for CUDA graphs. Outside it, CPU calls
run eagerly, as they would without emulation. Blocks nest, the setting before comes back on
exit (an exception included), and the function also works as a decorator.

What the emulation models, as a CUDA graph behaves:

- fixed addresses: a replay runs the captured ATen ops, not your Python, on the memory the
  capture used. Its outputs live in memory the graph owns; new Python-side values, branches
  taken differently or tensors created anew are not seen by a replay.
- state read by address: parameters, buffers and other tensors that existed before the capture
  are read, not copied: a replay sees their current contents. The graph does not keep them
  alive; a replay that finds one freed (or its memory moved, e.g. reassigned ``.data``) raises
  ``RuntimeError`` where CUDA would silently read freed memory.
- in-place effects: a capture leaves no effect behind (tensors written are restored), and
  every replay performs the writes again (optimizer steps, caches, ``x.add_(1)``).
- fresh random numbers per replay: each replay draws from the random generator's current state,
  and a capture plus its first replay advance it exactly as one eager call does, so seeded runs
  match eager runs call for call.
- capture-aware code: ``torch.cuda.is_current_stream_capturing()`` says True while a graph is
  recorded, so code that skips host reads during a capture (transformers' padding-mask check,
  a decoder's prompt step) takes the path it takes on CUDA.
- module buffers written by the forward: batch norm's running statistics (and
  ``num_batches_tracked``) are updated once per replay in training mode.

What it does not model: it is not a CUDA graph. No CUDA errors (illegal ops during capture,
pageable-memory copies, syncs) are raised by the emulation itself, there is no memory pool
shared between graphs, the kernels are CPU kernels (numerics may differ from CUDA's), and
timings and memory figures mean nothing. Generators: a private generator reseeded
(``g.manual_seed()``) inside the function is graphed by the emulation, which replays its draws
from the generator's state as it goes on; CUDA refuses that capture (the key runs eagerly). One
made inside the function is refused by both.
"""

from .backends._cpu_graphs import emulate_graphs_on_cpu

__all__ = ["emulate_graphs_on_cpu"]
