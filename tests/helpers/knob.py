"""A Python value kept where a replay does not read it again: verify's planted faults.

>>> scale = Knob(1.0)
>>> scale[0] = 2.0        # between calls; a graph captured with 1.0 still multiplies by 1.0

A replay reads again the atoms of the objects a call is keyed on, of its containers, globals
and closure cells (``autograph/watch/_values_read.py``), so a planted fault there would be
caught before verify compares anything. A module's plain attributes are not read again (a
documented limit): that is where verify's tests plant theirs.
"""

import torch


class Knob(torch.nn.Module):
    """One value, read and set as ``knob[0]``, on a module."""

    def __init__(self, value):
        super().__init__()
        self.value = value

    def __getitem__(self, index):
        return self.value

    def __setitem__(self, index, value):
        self.value = value
