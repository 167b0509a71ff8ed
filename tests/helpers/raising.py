"""Functions that raise at a chosen phase of a capture, and a probe of whether one is under way."""

import torch


def capturing():
    try:
        return torch.cuda.is_current_stream_capturing()  # the emulation says True too
    except RuntimeError:  # a CPU-only build of torch, outside a recording
        return False


def raising_backward_at_capture(make_error):
    """An autograd Function doubling its input whose backward raises ``make_error()`` while
    a capture runs it (and only then)."""

    class RaisingBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            if capturing():
                raise make_error()
            return grad * 2

    return RaisingBackward
