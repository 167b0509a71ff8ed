"""What the torch under test does where torch versions differ, for the tests that count it.

Measured on the CPU with torch 2.9.1, 2.10.0, 2.11.0, 2.12.0 and 2.13.0; the floor is 2.9
(``autograph._config.TORCH_FLOOR``).
"""

import torch


def torch_at_least(major, minor):
    return tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (major, minor)


def detaches_per_adopted_gradient():
    """How many ``detach`` ops AccumulateGrad makes when it adopts a fresh gradient as
    ``.grad``, eagerly as in a replay: two before torch 2.10, one from 2.10 on."""
    return 1 if torch_at_least(2, 10) else 2


def compiles_per_mode_stack():
    """Whether Dynamo compiles a function again for each stack of dispatch modes it runs under
    (before torch 2.10 it guards on the stack even for modes that it compiles around): then a
    compiled function graphed by autograph compiles at the warmup (the guard's mode) and again
    at the capture (the recorder's), though never again when called directly afterwards."""
    return not torch_at_least(2, 10)
