"""Training graphs: a captured forward and backward per key for calls whose outputs need
gradients, gradients handed to autograd, and backward hooks run as often as eagerly.

May import: policy, capture, backends, distributed, watch and the shared leaves; not buckets.
"""
