"""Probes of the dispatch-mode stack: which modes are on it, and which ops a mode saw."""

import torch

from autograph.watch._modes import WHOLE, Observer


def modes_on_the_stack():
    return torch._C._len_torch_dispatch_stack()


class Names(Observer):
    """Notes the name of every op it is shown."""

    def __init__(self, sees=WHOLE):
        self.sees, self.names = sees, []

    def before(self, func, args, kwargs, tensors):
        self.names.append(func.overloadpacket.__name__)
