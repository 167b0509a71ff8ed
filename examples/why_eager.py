"""Functions autograph runs eagerly, and the warnings that say why.

    python examples/why_eager.py        # on a CUDA machine
"""
import warnings

import torch

import autograph


@autograph.graphed
def normalise(x):
    scale = x.abs().max().item()
    return x / scale


@autograph.graphed
def positives(x):
    return x[x > 0].sum()


@autograph.graphed
def clip(x):
    if x.max() > 1:
        return x.clamp(max=1)
    return x


def main():
    if not torch.cuda.is_available():
        print("This example needs a CUDA GPU: without one every call runs eagerly, silently.")
        return
    model = autograph.graphed(torch.nn.Linear(512, 512).cuda())
    x = torch.randn(8, 512, device="cuda")
    warnings.simplefilter("always", autograph.AutographWarning)
    for _ in range(3):
        normalise(x), positives(x), clip(x), model(x)
    with torch.no_grad():
        for _ in range(3):
            model(x)
    autograph.report()


if __name__ == "__main__":
    main()
