"""Buckets: a call of size B replays the graph of the smallest capture size >= B.

Padding rules, the runs of a bucketed key, which output dims follow the batch, and whether a
graph mixes rows.

May import: policy, capture, backends, distributed, watch and the shared leaves; not training.
"""
