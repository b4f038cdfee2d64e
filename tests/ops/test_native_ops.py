"""Tests of the dispatcher operators that ``mjp_fast._C`` registers from C++.

``torch.ops.mjp_fast.pos_embed_extension`` / ``pos_embed_extension_backward`` (CPU and Meta kernels) and
``torch.ops.mjp_fast.dal_loss_extension`` / ``dal_loss_extension_backward`` (CompositeExplicitAutograd and Meta),
each against the straightforward torch formula written here (autograd of it gives the reference gradients) and
against the package's oracles, ``mjp_pos_embed_ref`` and ``dal_loss_ref``. The position term is exact in every
dtype (each element is one add, rounded once); sums are float32-tight, and in float16 / bfloat16 at most twice the
error of the same torch computation run in that dtype (STYLE.md), both measured against float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

_C = pytest.importorskip("mjp_fast._C", reason="the compiled extension mjp_fast._C is not built")

import mjp_fast  # noqa: E402
from mjp_fast.ops.dal_loss import dal_loss_ref, grid_coordinates  # noqa: E402
from mjp_fast.ops.pos_embed import mjp_pos_embed_ref  # noqa: E402

ops = torch.ops.mjp_fast
LOW_PRECISION = (torch.float16, torch.bfloat16)


def _jigsaw(batch, rows, cols, kind, seed=0):
    """mask bool [B, N] and perm int64 [B, N]: ``random`` (sample_jigsaw at ratio 0.5), ``none`` (nothing masked)
    or ``all`` (every position masked and shuffled)."""
    ratio = {"random": 0.5, "none": 0.0, "all": 1.0}[kind]
    jigsaw = mjp_fast.sample_jigsaw(batch, (rows, cols), ratio, seed=seed, min_block=1)
    if kind == "all":  # BEiT's blocks may end short of every position: mask the rest too, shuffle all
        generator = torch.Generator().manual_seed(seed)
        perm = torch.rand(batch, rows * cols, generator=generator).argsort(1)
        return torch.ones(batch, rows * cols, dtype=torch.bool), perm
    return jigsaw.mask, jigsaw.perm


def _assert_matches(actual, expected, expected_float64):
    """float32 / float64: assert_close's tolerances. float16 / bfloat16: at most twice the error of ``expected`` (the
    torch computation in that dtype) against float64, plus one unit in the last place of the largest value."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype not in LOW_PRECISION:
        torch.testing.assert_close(actual, expected)
        return
    reference = expected_float64.double()
    error = (actual.double() - reference).abs().max().item() if actual.numel() else 0.0
    torch_error = (expected.double() - reference).abs().max().item() if actual.numel() else 0.0
    ulp = torch.finfo(actual.dtype).eps * (reference.abs().max().item() if actual.numel() else 0.0)
    assert error <= 2 * torch_error + ulp, f"error {error} > 2 * torch's {torch_error} + {ulp}"


# ----------------------------------------------------------------------------------------------------------------
# pos_embed_extension
# ----------------------------------------------------------------------------------------------------------------


def _pos_embed_formula(tokens, perm, mask, pos_embed, unk_embed, out_dtype):
    """out[b, n] = tokens[b, perm[b, n]] + (unk_embed if mask[b, n] else pos_embed[n]), in out_dtype."""
    moved = tokens.gather(1, perm[..., None].expand_as(tokens)).to(out_dtype)
    return moved + torch.where(mask[..., None], unk_embed.to(out_dtype), pos_embed.to(out_dtype))


def _pos_embed_inputs(batch, rows, cols, dim, kind, tokens_dtype, out_dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    mask, perm = _jigsaw(batch, rows, cols, kind, seed)
    positions = rows * cols
    tokens = torch.randn(batch, positions, dim, generator=generator, dtype=torch.float64)
    pos_embed = torch.randn(positions, dim, generator=generator, dtype=torch.float64)
    unk_embed = torch.randn(dim, generator=generator, dtype=torch.float64)
    grad = torch.randn(batch, positions, dim, generator=generator, dtype=torch.float64)
    return tokens.to(tokens_dtype), perm, mask, pos_embed.to(out_dtype), unk_embed.to(out_dtype), grad.to(out_dtype)


SHAPES = [(1, 1, 1, 1), (1, 3, 5, 7), (4, 4, 4, 33), (3, 7, 3, 1), (6, 6, 6, 48), (2, 1, 9, 16), (0, 2, 3, 5)]
KINDS = ["random", "none", "all"]
# (tokens dtype, output = table dtype): the same dtype, and bfloat16 / float16 tokens with a float32 table (autocast).
DTYPE_PAIRS = [
    (torch.float32, torch.float32),
    (torch.float64, torch.float64),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
]


@pytest.mark.parametrize("dtypes", DTYPE_PAIRS, ids=lambda p: f"{str(p[0])[6:]}-{str(p[1])[6:]}")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_pos_embed_equals_formula(shape, kind, dtypes):
    tokens_dtype, out_dtype = dtypes
    tokens, perm, mask, pos_embed, unk_embed, grad = _pos_embed_inputs(*shape, kind, tokens_dtype, out_dtype)
    out = ops.pos_embed_extension(tokens, perm, mask, pos_embed, unk_embed)
    assert out.dtype == out_dtype and out.shape == tokens.shape
    # One add per element, in float32 (float64), rounded once: exactly torch's add.
    assert torch.equal(out, _pos_embed_formula(tokens, perm, mask, pos_embed, unk_embed, out_dtype))

    grad_tokens, grad_pos, grad_unk = ops.pos_embed_extension_backward(
        grad, perm, mask, tokens_dtype, out_dtype, out_dtype
    )
    leaves = [t.detach().requires_grad_() for t in (tokens, pos_embed, unk_embed)]
    expected = torch.autograd.grad(_pos_embed_formula(leaves[0], perm, mask, *leaves[1:], out_dtype), leaves, grad)
    leaves64 = [t.detach().double().requires_grad_() for t in (tokens, pos_embed, unk_embed)]
    out64 = _pos_embed_formula(leaves64[0], perm, mask, *leaves64[1:], torch.float64)
    expected64 = torch.autograd.grad(out64, leaves64, grad.double())
    assert torch.equal(grad_tokens, expected[0])  # the inverse move: exact
    _assert_matches(grad_pos, expected[1], expected64[1])
    _assert_matches(grad_unk, expected[2], expected64[2])


@pytest.mark.parametrize(
    "dtypes",
    [
        (torch.float32, torch.bfloat16, torch.float16),  # gradients rounded to the tables' own dtypes
        (torch.bfloat16, torch.float64, torch.float32),
        (torch.float64, torch.float32, torch.float32),
    ],
    ids=str,
)
def test_pos_embed_backward_to_other_dtypes(dtypes):
    tokens_dtype, pos_dtype, unk_dtype = dtypes
    tokens, perm, mask, _, _, grad = _pos_embed_inputs(5, 4, 6, 24, "random", tokens_dtype, torch.float32, seed=3)
    grad_tokens, grad_pos, grad_unk = ops.pos_embed_extension_backward(
        grad, perm, mask, tokens_dtype, pos_dtype, unk_dtype
    )
    assert (grad_tokens.dtype, grad_pos.dtype, grad_unk.dtype) == dtypes
    expected_tokens = torch.zeros_like(grad).scatter_(1, perm[..., None].expand_as(grad), grad).to(tokens_dtype)
    assert torch.equal(grad_tokens, expected_tokens)
    unmasked = (~mask)[..., None].double()
    expected_pos = (grad.double() * unmasked).sum(0)
    expected_unk = (grad.double() * (1 - unmasked)).sum((0, 1))
    # Summed in float32 (float64 when a table is float64), rounded once to the table's dtype.
    for actual, expected in ((grad_pos, expected_pos), (grad_unk, expected_unk)):
        torch.testing.assert_close(actual.double(), expected.to(actual.dtype).double(), atol=2e-5, rtol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("kind", KINDS)
def test_pos_embed_equals_package_oracle(kind, dtype):
    # The operator as the package calls it: the table and unk_embed rounded to the output dtype first. With a
    # float32 table and bfloat16 tokens, as under autocast.
    tokens, perm, mask, pos_embed, unk_embed, grad = _pos_embed_inputs(3, 5, 7, 20, kind, dtype, torch.float32, 1)
    jigsaw = mjp_fast.Jigsaw(mask, perm)
    leaves = [t.detach().requires_grad_() for t in (tokens, pos_embed, unk_embed)]
    expected = mjp_pos_embed_ref(*leaves, jigsaw)
    out_dtype = expected.dtype
    out = ops.pos_embed_extension(tokens, perm, mask, pos_embed.to(out_dtype), unk_embed.to(out_dtype))
    assert torch.equal(out, expected.detach())
    grads = ops.pos_embed_extension_backward(
        grad.to(out_dtype), perm, mask, tokens.dtype, pos_embed.dtype, unk_embed.dtype
    )
    expected_grads = torch.autograd.grad(expected, leaves, grad.to(out_dtype))
    assert torch.equal(grads[0], expected_grads[0])
    for actual, reference in zip(grads[1:], expected_grads[1:]):
        torch.testing.assert_close(actual, reference)


def test_pos_embed_non_contiguous_inputs():
    inputs = _pos_embed_inputs(4, 3, 5, 12, "random", torch.float32, torch.float32)
    tokens, perm, mask, pos_embed, unk_embed, grad = inputs
    strided_tokens = tokens.transpose(0, 1).contiguous().transpose(0, 1)
    strided_pos = pos_embed.t().contiguous().t()
    strided_unk = torch.stack((unk_embed, unk_embed), 1)[:, 0]
    strided_perm, strided_mask = perm.t().contiguous().t(), mask.t().contiguous().t()
    assert not strided_tokens.is_contiguous() and not strided_pos.is_contiguous() and not strided_perm.is_contiguous()
    out = ops.pos_embed_extension(strided_tokens, strided_perm, strided_mask, strided_pos, strided_unk)
    assert torch.equal(out, ops.pos_embed_extension(tokens, perm, mask, pos_embed, unk_embed))
    strided_grad = grad.transpose(0, 1).contiguous().transpose(0, 1)
    dtypes = (torch.float32, torch.float32, torch.float32)
    for actual, expected in zip(
        ops.pos_embed_extension_backward(strided_grad, strided_perm, strided_mask, *dtypes),
        ops.pos_embed_extension_backward(grad, perm, mask, *dtypes),
    ):
        assert torch.equal(actual, expected)


def test_pos_embed_is_deterministic_across_runs_and_thread_counts():
    tokens, perm, mask, pos_embed, unk_embed, grad = _pos_embed_inputs(
        16, 14, 14, 64, "random", torch.bfloat16, torch.float32, seed=7
    )
    dtypes = (torch.bfloat16, torch.bfloat16, torch.bfloat16)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (max(2, threads), max(2, threads), 1):
            torch.set_num_threads(count)
            out = ops.pos_embed_extension(tokens, perm, mask, pos_embed, unk_embed)
            results.append((out, *ops.pos_embed_extension_backward(grad.bfloat16(), perm, mask, *dtypes)))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for first, second in zip(results[0], other):
            assert torch.equal(first, second)


def test_pos_embed_rejects_bad_arguments():
    inputs = _pos_embed_inputs(2, 3, 4, 5, "random", torch.float32, torch.float32)
    tokens, perm, mask, pos_embed, unk_embed, grad = inputs
    good = dict(tokens=tokens, perm=perm, mask=mask, pos_embed=pos_embed, unk_embed=unk_embed)
    ops.pos_embed_extension(**good)
    out_of_range, negative = perm.clone(), perm.clone()
    out_of_range[1, 3] = 12
    negative[0, 0] = -1
    shape_and_dtype_cases = [
        dict(tokens=tokens[0]),
        dict(tokens=tokens[:, :-1]),
        dict(tokens=tokens.int()),
        dict(pos_embed=pos_embed[:-1]),
        dict(pos_embed=pos_embed[None]),
        dict(unk_embed=unk_embed[:-1]),
        dict(unk_embed=unk_embed.double()),  # not the table's dtype
        dict(perm=perm.int()),
        dict(perm=perm[:1]),
        dict(mask=mask.to(torch.uint8)),
        dict(mask=mask[:, :-1]),
    ]
    for bad in [*shape_and_dtype_cases, dict(perm=out_of_range), dict(perm=negative)]:
        with pytest.raises(RuntimeError):
            ops.pos_embed_extension(**{**good, **bad})
    for bad in shape_and_dtype_cases:  # the Meta kernel (FakeTensor, torch.compile) checks them too
        with pytest.raises(RuntimeError):
            ops.pos_embed_extension(**{name: value.to("meta") for name, value in {**good, **bad}.items()})

    dtypes = dict(tokens_dtype=torch.float32, pos_dtype=torch.float32, unk_dtype=torch.float32)
    good = dict(grad_out=grad, perm=perm, mask=mask, **dtypes)
    ops.pos_embed_extension_backward(**good)
    duplicate = perm.clone()
    duplicate[0] = 0  # in range, but not a permutation
    bad_cases = [
        dict(grad_out=grad[0]),
        dict(grad_out=grad.int()),
        dict(perm=out_of_range),
        dict(perm=negative),
        dict(perm=duplicate),
        dict(perm=perm[:, :-1]),
        dict(mask=mask.float()),
        dict(tokens_dtype=torch.int32),
        dict(pos_dtype=torch.int64),
        dict(unk_dtype=torch.bool),
    ]
    for bad in bad_cases:
        with pytest.raises(RuntimeError):
            ops.pos_embed_extension_backward(**{**good, **bad})


@pytest.mark.parametrize("kind", ["random", "all"])
def test_pos_embed_opcheck(kind):
    tokens, perm, mask, pos_embed, unk_embed, grad = _pos_embed_inputs(3, 4, 5, 6, kind, torch.bfloat16, torch.float32)
    torch.library.opcheck(ops.pos_embed_extension.default, (tokens, perm, mask, pos_embed, unk_embed))
    torch.library.opcheck(
        ops.pos_embed_extension_backward.default, (grad, perm, mask, torch.bfloat16, torch.float32, torch.float16)
    )


# ----------------------------------------------------------------------------------------------------------------
# dal_loss_extension
# ----------------------------------------------------------------------------------------------------------------


def _dal_formula(pos, w1, b1, w2, b2, coords, mask, scale):
    """(loss, pred, weights) of the DAL loss, in float32 (float64 for float64 pos)."""
    dtype = torch.float64 if pos.dtype == torch.float64 else torch.float32
    cast = lambda t: None if t is None else t.to(dtype)
    features = pos.to(dtype)
    if w1 is not None:
        features = torch.relu(F.linear(features, cast(w1), cast(b1)))
    pred = F.linear(features, cast(w2), cast(b2))
    if mask is None:
        kept = torch.ones(pos.shape[0], dtype=dtype, device=pos.device)
    else:
        kept = (~mask).sum(0).to(dtype)
    weights = kept / kept.sum().clamp_min(1)
    loss = scale * (weights * (pred - coords.to(dtype)).abs().sum(1)).sum()
    return loss, pred, weights


class DalCase:
    """Parameters of one DAL problem (float64 masters, cast to the dtypes asked)."""

    def __init__(self, rows, cols, dim, hidden, *, kind, mask_kind, batch=4, bias=True, seed=0):
        generator = torch.Generator().manual_seed(seed)
        randn = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float64)
        positions = rows * cols
        self.positions, self.grid = positions, (rows, cols)
        self.pos = randn(positions, dim)
        self.w1 = randn(hidden, dim) / dim**0.5 if kind == "nonlinear" else None
        self.b1 = randn(hidden) if kind == "nonlinear" and bias else None
        width = hidden if kind == "nonlinear" else dim
        self.w2 = randn(2, width) / width**0.5
        self.b2 = randn(2) + positions / 2 if bias else None
        self.coords = grid_coordinates((rows, cols))
        self.mask = None if mask_kind is None else _jigsaw(batch, rows, cols, mask_kind, seed)[0]

    def args(self, pos_dtype, param_dtype):
        cast = lambda t, dtype: None if t is None else t.to(dtype)
        pos = self.pos.to(pos_dtype)
        params = [cast(t, param_dtype) for t in (self.w1, self.b1, self.w2, self.b2)]
        return pos, *params, self.coords, self.mask


DAL_SHAPES = [  # rows, cols, D, H
    (1, 1, 1, 1),
    (1, 1, 5, 3),
    (3, 5, 7, 11),
    (4, 4, 16, 16),
    (7, 3, 1, 4),
    (14, 14, 48, 24),
]
MASK_KINDS = [None, "none", "all", "random"]
DAL_DTYPES = [  # (pos, regressor parameters)
    (torch.float32, torch.float32),
    (torch.float64, torch.float64),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.bfloat16),
]


def _check_dal(case, pos_dtype, param_dtype, scale, device="cpu"):
    pos, w1, b1, w2, b2, coords, mask = [None if t is None else t.to(device) for t in case.args(pos_dtype, param_dtype)]
    loss, pred, hidden, weights = ops.dal_loss_extension(pos, w1, b1, w2, b2, coords, mask, scale)
    compute = torch.float64 if pos_dtype == torch.float64 else torch.float32
    assert loss.shape == () and loss.dtype == pred.dtype == hidden.dtype == weights.dtype == compute
    assert hidden.shape == (case.positions, 0 if w1 is None else w1.shape[0])

    leaves = [None if t is None else t.detach().requires_grad_() for t in (pos, w1, b1, w2, b2)]
    expected_loss, expected_pred, expected_weights = _dal_formula(*leaves, coords, mask, scale)
    torch.testing.assert_close(loss, expected_loss.detach())
    torch.testing.assert_close(pred, expected_pred.detach())
    torch.testing.assert_close(weights, expected_weights)

    grad = torch.tensor(0.75, dtype=compute, device=device)
    grads = ops.dal_loss_extension_backward(
        grad, pos, w1, w2, coords, pred, hidden, weights, scale, b1 is not None, b2 is not None
    )
    present = [t for t in leaves if t is not None]
    expected_grads = dict(zip(map(id, present), torch.autograd.grad(expected_loss, present, grad)))
    leaves64 = [None if t is None else t.detach().double().requires_grad_() for t in (pos, w1, b1, w2, b2)]
    loss64 = _dal_formula(*leaves64, coords, mask, scale)[0]
    present64 = [t for t in leaves64 if t is not None]
    expected64 = dict(zip(map(id, present), torch.autograd.grad(loss64, present64, grad.double())))
    for actual, leaf in zip(grads, leaves):
        if leaf is None:
            assert actual.shape == (0,)
            continue
        assert actual.dtype == leaf.dtype and actual.shape == leaf.shape
        _assert_matches(actual, expected_grads[id(leaf)], expected64[id(leaf)])


@pytest.mark.parametrize("dtypes", DAL_DTYPES, ids=lambda p: f"{str(p[0])[6:]}-{str(p[1])[6:]}")
@pytest.mark.parametrize("mask_kind", MASK_KINDS, ids=str)
@pytest.mark.parametrize("kind", ["nonlinear", "linear"])
@pytest.mark.parametrize("shape", DAL_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_dal_loss_equals_formula(shape, kind, mask_kind, dtypes):
    case = DalCase(*shape, kind=kind, mask_kind=mask_kind)
    _check_dal(case, *dtypes, scale=1.0)


@pytest.mark.parametrize("kind", ["nonlinear", "linear"])
@pytest.mark.parametrize("scale", [0.5, 3.0])
def test_dal_loss_without_biases_and_scaled(kind, scale):
    case = DalCase(5, 4, 12, 9, kind=kind, mask_kind="random", bias=False, seed=2)
    _check_dal(case, torch.float32, torch.float32, scale=scale)


def test_dal_loss_gradient_of_an_exact_prediction_is_zero():
    # pred == coords at position 0 (a zero w2 and b2 = coords[0]): sign(0) = 0, as abs's backward.
    case = DalCase(2, 3, 4, 5, kind="nonlinear", mask_kind=None)
    case.w2 = torch.zeros_like(case.w2)
    case.b2 = case.coords[0].double()
    _check_dal(case, torch.float32, torch.float32, scale=1.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible")
@pytest.mark.parametrize("kind", ["nonlinear", "linear"])
def test_dal_loss_on_gpu(kind):
    case = DalCase(14, 14, 64, 64, kind=kind, mask_kind="random", seed=5)
    _check_dal(case, torch.float32, torch.float32, scale=1.0, device="cuda")


@pytest.mark.parametrize("mask_kind", MASK_KINDS, ids=str)
@pytest.mark.parametrize("kind", ["nonlinear", "linear"])
def test_dal_loss_equals_package_oracle(kind, mask_kind):
    rows, cols, dim = 5, 6, 24
    torch.manual_seed(0)
    regressor = mjp_fast.DALRegressor(dim, kind)
    pos_embed = torch.randn(1, rows * cols, dim, requires_grad=True)
    mask = None if mask_kind is None else _jigsaw(6, rows, cols, mask_kind)[0]
    expected = dal_loss_ref(pos_embed, regressor, (rows, cols), mask)
    params = list(regressor.parameters())
    expected_grads = torch.autograd.grad(expected, [pos_embed, *params])

    layers = (regressor.net[0], regressor.net[2]) if kind == "nonlinear" else (None, regressor.net)
    w1, b1 = (layers[0].weight, layers[0].bias) if layers[0] is not None else (None, None)
    w2, b2 = layers[1].weight, layers[1].bias
    pos = pos_embed.detach()[0]
    coords = grid_coordinates((rows, cols))
    with torch.no_grad():
        loss, pred, hidden, weights = ops.dal_loss_extension(pos, w1, b1, w2, b2, coords, mask, 1.0)
        grads = ops.dal_loss_extension_backward(
            torch.ones(()), pos, w1, w2, coords, pred, hidden, weights, 1.0, b1 is not None, b2 is not None
        )
    torch.testing.assert_close(loss, expected.detach())
    torch.testing.assert_close(grads[0], expected_grads[0][0])
    actual_param_grads = [g for g in grads[1:] if g.numel()]  # w1, b1, w2, b2 as they exist
    for actual, reference in zip(actual_param_grads, expected_grads[1:], strict=True):
        torch.testing.assert_close(actual, reference)


def test_dal_loss_is_deterministic():
    case = DalCase(14, 14, 64, 64, kind="nonlinear", mask_kind="random", batch=32, seed=4)
    args = case.args(torch.float32, torch.float32)
    first = ops.dal_loss_extension(*args, 1.0)
    second = ops.dal_loss_extension(*args, 1.0)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    backward_args = (torch.ones(()), args[0], args[1], args[3], args[5], *first[1:], 1.0, True, True)
    for a, b in zip(ops.dal_loss_extension_backward(*backward_args), ops.dal_loss_extension_backward(*backward_args)):
        assert torch.equal(a, b)


def test_dal_loss_rejects_bad_arguments():
    case = DalCase(3, 4, 6, 5, kind="nonlinear", mask_kind="random")
    pos, w1, b1, w2, b2, coords, mask = case.args(torch.float32, torch.float32)
    good = dict(pos=pos, w1=w1, b1=b1, w2=w2, b2=b2, coords=coords, mask=mask, scale=1.0)
    ops.dal_loss_extension(**good)
    bad_cases = [
        dict(pos=pos[0]),
        dict(pos=pos.int()),
        dict(w1=w1[:, :-1]),
        dict(w1=None),  # then w2 must be [2, D]
        dict(w1=None, b1=b1, w2=torch.zeros(2, 6)),  # b1 without w1
        dict(b1=b1[:-1]),
        dict(w2=w2[:1]),
        dict(w2=w2.long()),
        dict(b2=torch.zeros(3)),
        dict(coords=coords[:, :1]),
        dict(coords=coords[:-1]),
        dict(mask=mask.int()),
        dict(mask=mask[:, :-1]),
        dict(mask=mask[0]),
    ]
    for bad in bad_cases:
        with pytest.raises(RuntimeError):
            ops.dal_loss_extension(**{**good, **bad})
    _, pred, hidden, weights = ops.dal_loss_extension(**good)
    good = dict(
        grad=torch.ones(()), pos=pos, w1=w1, w2=w2, coords=coords, pred=pred, hidden=hidden, weights=weights,
        scale=1.0, has_b1=True, has_b2=True,
    )  # fmt: skip
    ops.dal_loss_extension_backward(**good)
    bad_cases = [
        dict(grad=torch.ones(2)),
        dict(pred=pred[:-1]),
        dict(pred=pred.double()),
        dict(hidden=hidden[:, :-1]),
        dict(weights=weights[:-1]),
        dict(w2=w2[:, :-1]),
        dict(w1=None, w2=torch.zeros(2, 6)),  # a linear regressor's hidden is [N, 0]
    ]
    for bad in bad_cases:
        with pytest.raises(RuntimeError):
            ops.dal_loss_extension_backward(**{**good, **bad})


@pytest.mark.parametrize("mask_kind", [None, "random"], ids=str)
@pytest.mark.parametrize("kind", ["nonlinear", "linear"])
def test_dal_loss_opcheck(kind, mask_kind):
    case = DalCase(3, 5, 8, 6, kind=kind, mask_kind=mask_kind)
    args = case.args(torch.bfloat16, torch.float32)
    torch.library.opcheck(ops.dal_loss_extension.default, (*args, 2.0))
    _, pred, hidden, weights = ops.dal_loss_extension(*args, 2.0)
    pos, w1, b1, w2, b2, coords, _ = args
    backward_args = (torch.tensor(0.5), pos, w1, w2, coords, pred, hidden, weights, 2.0, b1 is not None, True)
    torch.library.opcheck(ops.dal_loss_extension_backward.default, backward_args)


def test_operators_compile_in_one_graph():
    # The Meta kernels give torch.compile the shapes (dynamic ones too) with no Python registration: no graph break.
    inputs = _pos_embed_inputs(3, 4, 5, 6, "random", torch.float32, torch.float32)
    tokens, perm, mask, pos_embed, unk_embed, grad = inputs
    case = DalCase(4, 5, 6, 7, kind="nonlinear", mask_kind="random")
    pos, w1, b1, w2, b2, coords, dal_mask = case.args(torch.float32, torch.float32)

    def step(tokens, grad, pos):
        out = ops.pos_embed_extension(tokens, perm, mask, pos_embed, unk_embed)
        grads = ops.pos_embed_extension_backward(grad, perm, mask, torch.float32, torch.float32, torch.float32)
        loss, pred, hidden, weights = ops.dal_loss_extension(pos, w1, b1, w2, b2, coords, dal_mask, 0.5)
        dal_grads = ops.dal_loss_extension_backward(loss, pos, w1, w2, coords, pred, hidden, weights, 0.5, True, True)
        return out, *grads, loss, *dal_grads

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=True)
    for actual, expected in zip(compiled(tokens, grad, pos), step(tokens, grad, pos)):
        assert torch.equal(actual, expected)


def test_operators_are_registered_with_their_schemas():
    schemas = {name: str(getattr(ops, name).default._schema) for name in (
        "pos_embed_extension", "pos_embed_extension_backward", "dal_loss_extension", "dal_loss_extension_backward"
    )}  # fmt: skip
    assert schemas["pos_embed_extension"] == (
        "mjp_fast::pos_embed_extension(Tensor tokens, Tensor perm, Tensor mask, Tensor pos_embed, Tensor unk_embed)"
        " -> Tensor"
    )
    assert schemas["pos_embed_extension_backward"] == (
        "mjp_fast::pos_embed_extension_backward(Tensor grad_out, Tensor perm, Tensor mask, ScalarType tokens_dtype, "
        "ScalarType pos_dtype, ScalarType unk_dtype) -> (Tensor, Tensor, Tensor)"
    )
    assert schemas["dal_loss_extension"] == (
        "mjp_fast::dal_loss_extension(Tensor pos, Tensor? w1, Tensor? b1, Tensor w2, Tensor? b2, Tensor coords, "
        "Tensor? mask, float scale) -> (Tensor loss, Tensor pred, Tensor hidden, Tensor weights)"
    )
    assert schemas["dal_loss_extension_backward"] == (
        "mjp_fast::dal_loss_extension_backward(Tensor grad, Tensor pos, Tensor? w1, Tensor w2, Tensor coords, "
        "Tensor pred, Tensor hidden, Tensor weights, float scale, bool has_b1, bool has_b2) -> (Tensor grad_pos, "
        "Tensor grad_w1, Tensor grad_b1, Tensor grad_w2, Tensor grad_b2)"
    )
    for name in ("pos_embed_extension", "pos_embed_extension_backward"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"mjp_fast::{name}", "CPU")
    for name in schemas:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"mjp_fast::{name}", "Meta")
