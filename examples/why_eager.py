"""Functions autograph runs eagerly, and the warnings that say why.

    python examples/why_eager.py        # needs only torch

On a CUDA GPU the functions run on real CUDA graphs. Without one they run on the CPU emulation
of CUDA graphs (autograph.testing), which runs the same engine and guard on CPU tensors, so the
same warnings appear.
"""

import contextlib
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
    if torch.cuda.is_available():
        device, graphs = "cuda", contextlib.nullcontext()
    else:
        print(
            "No CUDA GPU here: running on the CPU emulation of CUDA graphs "
            "(autograph.testing.emulate_graphs_on_cpu()).\n"
        )
        device, graphs = "cpu", autograph.testing.emulate_graphs_on_cpu()
    model = autograph.graphed(torch.nn.Linear(512, 512).to(device))
    x = torch.randn(8, 512, device=device)
    warnings.simplefilter("always", autograph.AutographWarning)
    with graphs:
        for _ in range(3):
            normalise(x), positives(x), clip(x), model(x)
        with torch.no_grad():
            for _ in range(3):
                model(x)
    autograph.report()


if __name__ == "__main__":
    main()
