"""Training scaffolding: a small MLP, batches of it, its gradients, and comparing them."""

import torch


def mlp(device, dropout=0.0, seed=0, activation=torch.nn.SiLU):
    # SiLU's backward kernel reaches dispatch modes whole, and the CPU emulation must record it
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32),
        torch.nn.GELU(),
        torch.nn.Dropout(dropout),
        torch.nn.Linear(32, 32),
        activation(),
        torch.nn.Linear(32, 1),
    ).to(device)


def batches(device, n, rows=16, requires_grad=False, seed=1):
    torch.manual_seed(seed)
    return [torch.randn(rows, 8, device=device, requires_grad=requires_grad) for _ in range(n)]


def grads_of(model):
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def same(a, b):
    return len(a) == len(b) and all(
        (x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b)
    )
