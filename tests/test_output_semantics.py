"""Outputs come back with eager's view, alias, dtype and autograd semantics (issue 35, section 3):
a detached output stays detached, a view of a module's buffer is a view of that buffer, and a
view of an argument as another dtype has that dtype and those bytes."""

import torch

import autograph

from conftest import states


def test_a_detached_output_is_detached_and_sends_no_gradient(device):
    @autograph.graphed
    def f(x):
        return x * 2, x.detach()

    for _ in range(4):
        x = torch.randn(4, device=device, requires_grad=True)
        y, d = f(x)
        assert not d.requires_grad and d.grad_fn is None
        assert d.data_ptr() == x.data_ptr()  # eager: a view of x's data
        (y.sum() + d.sum()).backward()
        torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))
    assert states(f) == [("graphed", 4, 1, 3)]


def test_a_detached_argument_view_in_no_grad_calls_is_still_a_view(device):
    @autograph.graphed
    def f(x):
        return x.detach()[1:], x + 1

    x = torch.randn(4, device=device, requires_grad=True)
    for _ in range(4):
        with torch.no_grad():
            view, _ = f(x)
        assert not view.requires_grad
        view.fill_(5.0)
        assert torch.equal(x[1:].detach(), torch.full((3,), 5.0, device=device))
    assert states(f) == [("graphed", 4, 1, 3)]


class _Ring(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("ring", torch.zeros(6))

    def forward(self, x):
        self.ring[:4].add_(x)
        return x * 2, self.ring[:2], self.ring.view(2, 3).t()


def test_a_view_of_a_module_buffer_comes_back_as_a_view_of_it(device):
    module = _Ring().to(device)
    reference = _Ring().to(device)
    model = autograph.graphed(module)
    for step in range(4):
        x = torch.full((4,), float(step + 1), device=device)
        _, head, transposed = model(x)
        _, eager_head, eager_transposed = reference(x)
        torch.testing.assert_close(transposed, eager_transposed)
        assert head.data_ptr() == module.ring.data_ptr()
        head.fill_(-1.0)  # lands in the buffer, as eager's write does
        eager_head.fill_(-1.0)
        torch.testing.assert_close(module.ring, reference.ring)
    assert states(model) == [("graphed", 4, 1, 3)]


def test_views_of_an_argument_as_another_dtype_keep_their_dtype_and_bytes(device):
    @autograph.graphed
    def f(x):
        return x.view(torch.int32), x.view(torch.float64), x[2:].view(torch.int16), x + 1

    for _ in range(4):
        x = torch.randn(8, device=device)
        as_int, as_double, tail_as_short, _ = f(x)
        for got, want in (
            (as_int, x.view(torch.int32)),
            (as_double, x.view(torch.float64)),
            (tail_as_short, x[2:].view(torch.int16)),
        ):
            assert got.dtype == want.dtype and torch.equal(got, want)
            assert got.data_ptr() == want.data_ptr()
    assert states(f) == [("graphed", 4, 1, 3)]


def test_view_as_real_of_an_argument_is_its_real_view_with_gradients(device):
    @autograph.graphed
    def f(z):
        return torch.view_as_real(z), (z * 2).abs()

    for _ in range(4):
        z = torch.randn(4, dtype=torch.complex64, device=device, requires_grad=True)
        eager_z = z.detach().clone().requires_grad_()
        real, magnitude = f(z)
        assert real.dtype == torch.float32 and real.data_ptr() == z.data_ptr()
        torch.testing.assert_close(real, torch.view_as_real(z))
        (real.sum() + magnitude.sum()).backward()
        eager_real, eager_magnitude = f.__wrapped__(eager_z)
        (eager_real.sum() + eager_magnitude.sum()).backward()
        torch.testing.assert_close(z.grad, eager_z.grad)
    assert states(f) == [("graphed", 4, 1, 3)]
