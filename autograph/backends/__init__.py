"""Backends that make graphs: CUDA graphs, and the CPU emulation that stands in for them;
memory pools, streams and the choice of backend by device.

May import: distributed, watch and the shared leaves. Only ``autograph.testing`` may import
the emulation (``_cpu_graphs``, ``_cpu_recorder``) on an ordinary path.
"""
