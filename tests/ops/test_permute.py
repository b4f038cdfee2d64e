import torch

from mjp_fast.ops.permute import permute_rows, permute_rows_ref


def test_matches_gather_forward_and_backward():
    torch.manual_seed(0)
    perm = torch.stack([torch.randperm(7) for _ in range(3)])
    for shape in [(3, 7), (3, 7, 5), (3, 7, 2, 4)]:
        x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
        grad = torch.randn(*shape, dtype=torch.float64)
        got = permute_rows(x, perm)
        expected = permute_rows_ref(x, perm)
        assert torch.equal(got, expected)
        assert torch.equal(torch.autograd.grad(got, x, grad)[0], torch.autograd.grad(expected, x, grad)[0])
    x = torch.randn(3, 7, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: permute_rows(t, perm), (x,))


def test_uint8_and_identity():
    x = torch.randint(0, 255, (2, 4, 3), dtype=torch.uint8)
    identity = torch.arange(4).repeat(2, 1)
    assert torch.equal(permute_rows(x, identity), x)


def test_empty_batch():
    x = torch.randn(0, 5, 3, requires_grad=True)
    out = permute_rows(x, torch.zeros(0, 5, dtype=torch.int64))
    out.sum().backward()
    assert out.shape == (0, 5, 3) and x.grad.shape == (0, 5, 3)
