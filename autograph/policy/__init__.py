"""Policies: whether a key's graph is worth it, and what to do when it is not.

Churn (a function whose keys never repeat runs as a plain call), payoff (a graph that does not
beat eager is dropped), islands (an eager key still graphs the modules inside it), verify
(replays checked against eager runs).

May import: capture, backends, distributed, watch and the shared leaves.
"""
