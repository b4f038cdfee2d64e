"""Tests of the dispatcher operators that ``mjp_fast._C`` registers from C++.

``torch.ops.mjp_fast.pos_embed_extension`` / ``pos_embed_extension_backward`` (CPU and Meta kernels) and
``torch.ops.mjp_fast.dal_loss_extension`` / ``dal_loss_extension_backward`` (CompositeExplicitAutograd and Meta),
each against the straightforward torch formula written here (autograd of it gives the reference gradients) and
against the package's oracles, ``mjp_pos_embed_ref`` and ``dal_loss_ref``. The position operator writes the prefix
(class and register) tokens in front of the patch tokens and reads the model's whole position table; the DAL operator
reads the whole table too and skips its prefix rows. The position term is exact in every
dtype (each element is one add, rounded once); sums are float32-tight, and in float16 / bfloat16 at most twice the
error of the same torch computation run in that dtype (STYLE.md), both measured against float64.

``torch.ops.mjp_fast.patch_embed_extension`` / ``patch_embed_extension_backward`` (CPU, CUDA when compiled, and
Meta kernels; autograd registered from Python) run the kernels that test_extension.py checks through the bindings:
here, that the operators equal the bindings, and their opcheck, Meta kernels, autograd and torch.compile.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounter

_C = pytest.importorskip("mjp_fast._C", reason="the compiled extension mjp_fast._C is not built")

import mjp_fast  # noqa: E402
from mjp_fast.ops.dal_loss import dal_loss_ref, dal_scale, grid_coordinates  # noqa: E402
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


def _pos_embed_formula(tokens, perm, mask, pos_embed, unk_embed, out_dtype, prefix=None, prefix_positions=0):
    """The operator's output by torch operations: ``cat`` of the prefix rows (plus their position rows) and the moved
    tokens plus their position terms. pos_embed is the whole table (last two dims [Q + N, D]), prefix P * D elements.

    out[b, t] = prefix[t] + (pos_embed[t] if t < Q else 0) for t < P, summed in float32 (float64) and rounded once;
    out[b, P + n] = tokens[b, perm[b, n]] + (unk_embed if mask[b, n] else pos_embed[Q + n]), in out_dtype.
    """
    batch, _, dim = tokens.shape
    table = pos_embed.reshape(-1, dim)
    moved = tokens.gather(1, perm[..., None].expand_as(tokens)).to(out_dtype)
    patches = moved + torch.where(mask[..., None], unk_embed.to(out_dtype), table[prefix_positions:].to(out_dtype))
    if prefix is None:
        return patches
    rows = prefix.reshape(-1, dim)
    acc = torch.float64 if torch.float64 in (rows.dtype, table.dtype) else torch.float32
    head = rows.to(acc) + F.pad(table[:prefix_positions].to(acc), (0, 0, 0, rows.shape[0] - prefix_positions))
    return torch.cat((head.to(out_dtype).expand(batch, -1, -1), patches), 1)


def _pos_embed_inputs(batch, rows, cols, dim, kind, tokens_dtype, out_dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    mask, perm = _jigsaw(batch, rows, cols, kind, seed)
    positions = rows * cols
    tokens = torch.randn(batch, positions, dim, generator=generator, dtype=torch.float64)
    pos_embed = torch.randn(positions, dim, generator=generator, dtype=torch.float64)
    unk_embed = torch.randn(dim, generator=generator, dtype=torch.float64)
    grad = torch.randn(batch, positions, dim, generator=generator, dtype=torch.float64)
    return tokens.to(tokens_dtype), perm, mask, pos_embed.to(out_dtype), unk_embed.to(out_dtype), grad.to(out_dtype)


def _forward(tokens, perm, mask, pos_embed, unk_embed, prefix=None, prefix_positions=0):
    return ops.pos_embed_extension(tokens, perm, mask, pos_embed, unk_embed, prefix, prefix_positions)


def _backward(grad, perm, mask, tokens_dtype, pos_dtype, unk_dtype, *, pos_shape=None, prefix=None, prefix_positions=0):
    """The backward operator, without a prefix unless one (a tensor, for its shape and dtype) is given."""
    pos_shape = list(grad.shape[1:]) if pos_shape is None else list(pos_shape)
    prefix_count = 0 if prefix is None else prefix.numel() // grad.shape[-1]
    prefix_shape = [] if prefix is None else list(prefix.shape)
    prefix_dtype = pos_dtype if prefix is None else prefix.dtype
    return ops.pos_embed_extension_backward(
        grad, perm, mask, prefix_count, prefix_positions, pos_shape, prefix_shape, tokens_dtype, pos_dtype, unk_dtype,
        prefix_dtype,
    )  # fmt: skip


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
    out = _forward(tokens, perm, mask, pos_embed, unk_embed)
    assert out.dtype == out_dtype and out.shape == tokens.shape
    # One add per element, in float32 (float64), rounded once: exactly torch's add.
    assert torch.equal(out, _pos_embed_formula(tokens, perm, mask, pos_embed, unk_embed, out_dtype))

    grad_tokens, grad_pos, grad_unk, grad_prefix = _backward(grad, perm, mask, tokens_dtype, out_dtype, out_dtype)
    assert grad_prefix.shape == (0,)
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
    grad_tokens, grad_pos, grad_unk, _ = _backward(grad, perm, mask, tokens_dtype, pos_dtype, unk_dtype)
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
    out = _forward(tokens, perm, mask, pos_embed.to(out_dtype), unk_embed.to(out_dtype))
    assert torch.equal(out, expected.detach())
    grads = _backward(grad.to(out_dtype), perm, mask, tokens.dtype, pos_embed.dtype, unk_embed.dtype)
    expected_grads = torch.autograd.grad(expected, leaves, grad.to(out_dtype))
    assert torch.equal(grads[0], expected_grads[0])
    for actual, reference in zip(grads[1:3], expected_grads[1:], strict=True):
        torch.testing.assert_close(actual, reference)


def test_pos_embed_non_contiguous_inputs():
    inputs = _pos_embed_inputs(4, 3, 5, 12, "random", torch.float32, torch.float32)
    tokens, perm, mask, pos_embed, unk_embed, grad = inputs
    strided_tokens = tokens.transpose(0, 1).contiguous().transpose(0, 1)
    strided_pos = pos_embed.t().contiguous().t()
    strided_unk = torch.stack((unk_embed, unk_embed), 1)[:, 0]
    strided_perm, strided_mask = perm.t().contiguous().t(), mask.t().contiguous().t()
    assert not strided_tokens.is_contiguous() and not strided_pos.is_contiguous() and not strided_perm.is_contiguous()
    out = _forward(strided_tokens, strided_perm, strided_mask, strided_pos, strided_unk)
    assert torch.equal(out, _forward(tokens, perm, mask, pos_embed, unk_embed))
    strided_grad = grad.transpose(0, 1).contiguous().transpose(0, 1)
    dtypes = (torch.float32, torch.float32, torch.float32)
    for actual, expected in zip(
        _backward(strided_grad, strided_perm, strided_mask, *dtypes), _backward(grad, perm, mask, *dtypes), strict=True
    ):
        assert torch.equal(actual, expected)
    # A strided prefix and table (3 prefix tokens, with position rows).
    table = torch.cat((torch.randn(3, 12), pos_embed))
    strided_prefix = torch.randn(12, 3).t()[None]
    strided_table = table.t().contiguous().t()
    assert not strided_prefix.is_contiguous() and not strided_table.is_contiguous()
    assert torch.equal(
        _forward(tokens, perm, mask, strided_table, unk_embed, strided_prefix, 3),
        _forward(tokens, perm, mask, table, unk_embed, strided_prefix.contiguous(), 3),
    )


def test_pos_embed_is_deterministic_across_runs_and_thread_counts():
    tokens, perm, mask, pos_embed, unk_embed, grad = _pos_embed_inputs(
        16, 14, 14, 64, "random", torch.bfloat16, torch.float32, seed=7
    )
    dtypes = (torch.bfloat16, torch.bfloat16, torch.bfloat16)
    prefix = torch.randn(1, 5, 64)  # a class token and four registers, with position rows
    table = torch.cat((torch.randn(5, 64), pos_embed))[None]
    prefix_grad = torch.randn(16, 5, 64)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (max(2, threads), max(2, threads), 1):
            torch.set_num_threads(count)
            out = _forward(tokens, perm, mask, pos_embed, unk_embed)
            results.append((out, *_backward(grad.bfloat16(), perm, mask, *dtypes)))
            out = _forward(tokens, perm, mask, table, unk_embed, prefix, 5)
            full_grad = torch.cat((prefix_grad, grad), 1)
            options = dict(pos_shape=table.shape, prefix=prefix, prefix_positions=5)
            results.append((out, *_backward(full_grad, perm, mask, *dtypes, **options)))
    finally:
        torch.set_num_threads(threads)
    for index, outputs in enumerate(results[2:]):
        for first, second in zip(results[index % 2], outputs, strict=True):
            assert torch.equal(first, second)


# Prefix layouts: (P, Q, prefix shape, table shape) with P prefix tokens, Q of them with position rows, the shapes
# as timm holds them ([1, P, D] cls_token, [1, Q + N, D] pos_embed) or flat ([P, D], [Q + N, D]).
PREFIX_LAYOUTS = [(0, 0, None, table) for table in ("3d", "2d")] + [
    (prefix, positions, prefix_shape, table)
    for prefix in (1, 3)
    for positions in (0, prefix)
    for prefix_shape in ("3d", "2d")
    for table in ("3d", "2d")
]


def _layout_id(layout):
    prefix, positions, prefix_shape, table = layout
    return f"P{prefix}-Q{positions}-prefix{prefix_shape}-table{table}"


def _prefix_inputs(tokens, pos_embed, layout, seed=0):
    """(prefix or None, the whole table) for a layout: Q random position rows in front of pos_embed [N, D]."""
    prefix_count, positions, prefix_shape, table_shape = layout
    generator = torch.Generator().manual_seed(seed + 100)
    dim = tokens.shape[-1]
    rows = torch.randn(positions, dim, generator=generator, dtype=torch.float64).to(pos_embed.dtype)
    table = torch.cat((rows, pos_embed))
    table = table[None] if table_shape == "3d" else table
    if prefix_count == 0:
        return None, table
    prefix = torch.randn(prefix_count, dim, generator=generator, dtype=torch.float64).to(pos_embed.dtype)
    return (prefix[None] if prefix_shape == "3d" else prefix), table


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("layout", PREFIX_LAYOUTS, ids=_layout_id)
def test_pos_embed_with_prefix_equals_formula(layout, batch, kind, dtype):
    # Odd N (3 x 5) and D (7).
    tokens, perm, mask, pos_embed, unk_embed, _ = _pos_embed_inputs(batch, 3, 5, 7, kind, dtype, dtype, seed=batch)
    prefix, table = _prefix_inputs(tokens, pos_embed, layout, seed=batch)
    prefix_count, positions = layout[0], layout[1]
    out = _forward(tokens, perm, mask, table, unk_embed, prefix, positions)
    assert out.dtype == dtype and out.shape == (batch, prefix_count + 15, 7)
    expected = _pos_embed_formula(tokens, perm, mask, table, unk_embed, dtype, prefix, positions)
    assert torch.equal(out, expected)  # one add per element, rounded once: exact

    generator = torch.Generator().manual_seed(7)
    grad = torch.randn(out.shape, generator=generator, dtype=torch.float64).to(dtype)
    grads = _backward(
        grad, perm, mask, dtype, dtype, dtype, pos_shape=table.shape, prefix=prefix, prefix_positions=positions
    )
    inputs = [t for t in (tokens, table, unk_embed, prefix) if t is not None]
    leaves = [t.detach().requires_grad_() for t in inputs]
    leaves64 = [t.detach().double().requires_grad_() for t in inputs]

    def formula(tokens, table, unk, prefix=None, out_dtype=dtype):
        return _pos_embed_formula(tokens, perm, mask, table, unk, out_dtype, prefix, positions)

    expected = torch.autograd.grad(formula(*leaves), leaves, grad)
    expected64 = torch.autograd.grad(formula(*leaves64, out_dtype=torch.float64), leaves64, grad.double())
    if prefix is None:
        assert grads[3].shape == (0,)
    assert torch.equal(grads[0], expected[0])  # the inverse move: exact
    for actual, reference, reference64 in zip(grads[1:], expected[1:], expected64[1:]):
        _assert_matches(actual, reference, reference64)  # in the shapes and dtypes of the inputs


@pytest.mark.parametrize(
    "dtypes",
    [
        (torch.bfloat16, torch.float32, torch.float32),  # autocast: bfloat16 tokens, float32 table and prefix
        (torch.bfloat16, torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.bfloat16, torch.float32),  # a float32 prefix rounded once into a bfloat16 output
        (torch.float32, torch.float32, torch.float64),
    ],
    ids=str,
)
def test_pos_embed_prefix_in_another_dtype(dtypes):
    tokens_dtype, table_dtype, prefix_dtype = dtypes
    tokens, perm, mask, pos_embed, unk_embed, _ = _pos_embed_inputs(3, 3, 3, 9, "random", tokens_dtype, table_dtype)
    prefix, table = _prefix_inputs(tokens, pos_embed.double(), (2, 2, "3d", "3d"))
    prefix, table = prefix.to(prefix_dtype), table.to(table_dtype)
    out = _forward(tokens, perm, mask, table, unk_embed, prefix, 2)
    assert out.dtype == table_dtype
    assert torch.equal(out, _pos_embed_formula(tokens, perm, mask, table, unk_embed, table_dtype, prefix, 2))
    grad = torch.randn(out.shape, dtype=torch.float64).to(table_dtype)
    _, grad_pos, _, grad_prefix = _backward(
        grad,
        perm,
        mask,
        tokens_dtype,
        table_dtype,
        table_dtype,
        pos_shape=table.shape,
        prefix=prefix,
        prefix_positions=2,
    )
    assert grad_prefix.dtype == prefix_dtype and grad_prefix.shape == prefix.shape
    assert grad_pos.dtype == table_dtype and grad_pos.shape == table.shape
    # Summed in float32 (float64 when a dtype is float64), rounded once to each input's dtype.
    sums = grad.double()[:, :2].sum(0)
    torch.testing.assert_close(grad_prefix.double(), sums.to(prefix_dtype).double()[None], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad_pos[0, :2].double(), sums.to(table_dtype).double(), atol=1e-5, rtol=1e-5)


def test_pos_embed_rejects_bad_arguments():
    inputs = _pos_embed_inputs(2, 3, 4, 5, "random", torch.float32, torch.float32)
    tokens, perm, mask, pos_embed, unk_embed, grad = inputs
    good = dict(
        tokens=tokens, perm=perm, mask=mask, pos_embed=pos_embed, unk_embed=unk_embed, prefix=None, prefix_positions=0
    )
    ops.pos_embed_extension(**good)
    prefix, table = torch.randn(1, 2, 5), torch.randn(1, 14, 5)  # P = Q = 2
    with_prefix = {**good, "prefix": prefix, "pos_embed": table, "prefix_positions": 2}
    ops.pos_embed_extension(**with_prefix)
    ops.pos_embed_extension(**{**with_prefix, "pos_embed": pos_embed, "prefix_positions": 0})
    out_of_range, negative = perm.clone(), perm.clone()
    out_of_range[1, 3] = 12
    negative[0, 0] = -1
    shape_and_dtype_cases = [
        dict(tokens=tokens[0]),
        dict(tokens=tokens[:, :-1]),
        dict(tokens=tokens.int()),
        dict(pos_embed=pos_embed[:-1]),
        dict(pos_embed=pos_embed[0]),  # not a table
        dict(pos_embed=torch.randn(2, 12, 5)),  # rows beyond [N, D]
        dict(unk_embed=unk_embed[:-1]),
        dict(unk_embed=unk_embed.double()),  # not the table's dtype
        dict(perm=perm.int()),
        dict(perm=perm[:1]),
        dict(mask=mask.to(torch.uint8)),
        dict(mask=mask[:, :-1]),
        dict(prefix_positions=1),  # Q not in {0, P} (P = 0)
        dict(prefix=torch.randn(7)),  # numel not a multiple of D
        dict(prefix=prefix.int()),
        {**with_prefix, "prefix_positions": 1},  # Q not in {0, P}
        {**with_prefix, "prefix_positions": 3},
        {**with_prefix, "pos_embed": table[:, 1:]},  # Q + N - 1 rows
        {**with_prefix, "pos_embed": torch.randn(1, 15, 5)},  # Q + N + 1 rows
        {**with_prefix, "prefix_positions": 0},  # then the table must have N rows
        {**with_prefix, "pos_embed": pos_embed},  # ... and with Q = 2, Q + N
        {**with_prefix, "prefix": torch.randn(1, 2, 4)},
    ]
    for bad in shape_and_dtype_cases:
        with pytest.raises(RuntimeError):
            ops.pos_embed_extension(**{**good, **bad})
    to_meta = lambda value: value.to("meta") if isinstance(value, torch.Tensor) else value  # noqa: E731
    for bad in shape_and_dtype_cases:  # the Meta kernel (FakeTensor, torch.compile) checks them too
        with pytest.raises(RuntimeError):
            ops.pos_embed_extension(**{name: to_meta(value) for name, value in {**good, **bad}.items()})

    dtypes = dict(tokens_dtype=torch.float32, pos_dtype=torch.float32, unk_dtype=torch.float32)
    good_forward = good
    good = dict(
        grad_out=grad,
        perm=perm,
        mask=mask,
        prefix_count=0,
        prefix_positions=0,
        pos_shape=[12, 5],
        prefix_shape=[],
        **dtypes,
        prefix_dtype=torch.float32,
    )
    ops.pos_embed_extension_backward(**good)
    full_grad = torch.randn(2, 14, 5)
    with_prefix = {
        **good,
        "grad_out": full_grad,
        "prefix_count": 2,
        "prefix_positions": 2,
        "pos_shape": [1, 14, 5],
        "prefix_shape": [1, 2, 5],
    }
    grads = ops.pos_embed_extension_backward(**with_prefix)
    assert grads[1].shape == (1, 14, 5) and grads[3].shape == (1, 2, 5)
    duplicate = perm.clone()
    duplicate[0] = 0  # in range, but not a permutation
    bad_cases = [
        dict(grad_out=grad[0]),
        dict(grad_out=grad.int()),
        dict(perm=perm[:, :-1]),
        dict(mask=mask.float()),
        dict(tokens_dtype=torch.int32),
        dict(pos_dtype=torch.int64),
        dict(unk_dtype=torch.bool),
        dict(prefix_dtype=torch.int32),
        dict(pos_shape=[13, 5]),
        dict(pos_shape=[12]),
        dict(pos_shape=[2, 12, 5]),
        dict(prefix_positions=1),
        dict(prefix_count=-1),
        dict(prefix_count=2),  # grad_out has no prefix rows
        {**with_prefix, "grad_out": grad},
        {**with_prefix, "prefix_positions": 1},
        {**with_prefix, "pos_shape": [1, 12, 5]},  # Q = 2: the table has Q + N rows
        {**with_prefix, "prefix_shape": [1, 3, 5]},
    ]
    for bad in bad_cases:
        with pytest.raises(RuntimeError):
            ops.pos_embed_extension_backward(**{**good, **bad})
    # The values of perm are not checked by the operator (mjp_fast/_validate.py): an entry outside [0, N) moves a
    # zero token and takes no gradient; a perm that is not a permutation gets the gather's exact gradient.
    for values in (out_of_range, negative, duplicate):
        out = ops.pos_embed_extension(**{**good_forward, "perm": values})
        valid = (values >= 0) & (values < perm.shape[1])
        moved = tokens.gather(1, values.clamp(0, perm.shape[1] - 1)[..., None].expand_as(tokens)) * valid[..., None]
        torch.testing.assert_close(out, moved + torch.where(mask[..., None], unk_embed, pos_embed))
        grad_tokens = ops.pos_embed_extension_backward(**{**good, "perm": values})[0]
        expected = torch.zeros_like(grad).index_put_(
            (torch.arange(2)[:, None].expand_as(values)[valid], values[valid]), grad[valid], accumulate=True
        )
        torch.testing.assert_close(grad_tokens, expected)


@pytest.mark.parametrize("kind", ["random", "all"])
def test_pos_embed_opcheck(kind):
    tokens, perm, mask, pos_embed, unk_embed, grad = _pos_embed_inputs(3, 4, 5, 6, kind, torch.bfloat16, torch.float32)
    torch.library.opcheck(ops.pos_embed_extension.default, (tokens, perm, mask, pos_embed, unk_embed, None, 0))
    torch.library.opcheck(
        ops.pos_embed_extension_backward.default,
        (grad, perm, mask, 0, 0, [20, 6], [], torch.bfloat16, torch.float32, torch.float16, torch.float32),
    )
    prefix, table = _prefix_inputs(tokens, pos_embed, (3, 3, "3d", "3d"))
    torch.library.opcheck(ops.pos_embed_extension.default, (tokens, perm, mask, table, unk_embed, prefix, 3))
    full_grad = torch.randn(3, 23, 6)
    backward_args = (
        full_grad,
        perm,
        mask,
        3,
        3,
        [1, 23, 6],
        [1, 3, 6],
        torch.bfloat16,
        torch.float32,
        torch.float16,
        torch.bfloat16,
    )
    torch.library.opcheck(ops.pos_embed_extension_backward.default, backward_args)
    torch.library.opcheck(ops.pos_embed_extension.default, (tokens, perm, mask, pos_embed, unk_embed, prefix[0], 0))


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
        self.prefix_rows = randn(2, dim)  # the table's rows of prefix tokens, not regressed

    def args(self, pos_dtype, param_dtype, skip_rows=0, table="2d"):
        """The operator's arguments (pos, skip_rows, w1, b1, w2, b2, coords, mask): pos the whole table, skip_rows
        rows of prefix positions in front of the N regressed rows, [1, skip_rows + N, D] (``3d``) or flat."""
        cast = lambda t, dtype: None if t is None else t.to(dtype)
        pos = torch.cat((self.prefix_rows[:skip_rows], self.pos)).to(pos_dtype)
        pos = pos[None] if table == "3d" else pos
        params = [cast(t, param_dtype) for t in (self.w1, self.b1, self.w2, self.b2)]
        return pos, skip_rows, *params, self.coords, self.mask


# rows, cols, D, H. The CPU kernels run their GEMMs as loops up to N * H * D = 2**21 (kLoopGemmLimit in
# csrc/dal_loss.cpp) and through ATen above: the last shape takes the second path.
DAL_SHAPES = [
    (1, 1, 1, 1),
    (1, 1, 5, 3),
    (3, 5, 7, 11),
    (4, 4, 16, 16),
    (7, 3, 1, 4),
    (14, 14, 48, 24),
    (16, 16, 96, 96),
]
MASK_KINDS = [None, "none", "all", "random"]
DAL_DTYPES = [  # (pos, regressor parameters)
    (torch.float32, torch.float32),
    (torch.float64, torch.float64),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.bfloat16),
]


def _regressed(table, skip_rows):
    """The rows of a position table that the DAL loss regresses: [N, D] after the skip_rows prefix rows."""
    return table.reshape(-1, table.shape[-1])[skip_rows:]


def _check_dal(case, pos_dtype, param_dtype, scale, device="cpu", skip_rows=0, table="2d"):
    pos, skip_rows, *args = case.args(pos_dtype, param_dtype, skip_rows, table)
    pos, w1, b1, w2, b2, coords, mask = [None if t is None else t.to(device) for t in (pos, *args)]
    loss, pred, hidden, weights = ops.dal_loss_extension(pos, skip_rows, w1, b1, w2, b2, coords, mask, scale)
    compute = torch.float64 if pos_dtype == torch.float64 else torch.float32
    assert loss.shape == () and loss.dtype == pred.dtype == hidden.dtype == weights.dtype == compute
    assert hidden.shape == (case.positions, 0 if w1 is None else w1.shape[0])

    leaves = [None if t is None else t.detach().requires_grad_() for t in (pos, w1, b1, w2, b2)]
    expected_loss, expected_pred, expected_weights = _dal_formula(
        _regressed(leaves[0], skip_rows), *leaves[1:], coords, mask, scale
    )
    torch.testing.assert_close(loss, expected_loss.detach())
    torch.testing.assert_close(weights, expected_weights)
    # A position every sample masks (weight 0) is out of the loss: the kernels do not read its row, so its pred is
    # left unspecified (the CPU loops give b2 there, the composite path relu(b1) W2^T + b2). Every other row is exact.
    in_loss = expected_weights > 0
    torch.testing.assert_close(pred[in_loss], expected_pred.detach()[in_loss])

    grad = torch.tensor(0.75, dtype=compute, device=device)
    grads = ops.dal_loss_extension_backward(
        grad, pos, skip_rows, w1, w2, coords, pred, hidden, weights, scale, b1 is not None, b2 is not None
    )
    present = [t for t in leaves if t is not None]
    expected_grads = dict(zip(map(id, present), torch.autograd.grad(expected_loss, present, grad)))
    leaves64 = [None if t is None else t.detach().double().requires_grad_() for t in (pos, w1, b1, w2, b2)]
    loss64 = _dal_formula(_regressed(leaves64[0], skip_rows), *leaves64[1:], coords, mask, scale)[0]
    present64 = [t for t in leaves64 if t is not None]
    expected64 = dict(zip(map(id, present), torch.autograd.grad(loss64, present64, grad.double())))
    for actual, leaf in zip(grads, leaves):
        if leaf is None:
            assert actual.shape == (0,)
            continue
        assert actual.dtype == leaf.dtype and actual.shape == leaf.shape
        _assert_matches(actual, expected_grads[id(leaf)], expected64[id(leaf)])
    # The skipped rows get exactly zero.
    assert not _regressed(grads[0], 0)[:skip_rows].any()


@pytest.mark.parametrize("dtypes", DAL_DTYPES, ids=lambda p: f"{str(p[0])[6:]}-{str(p[1])[6:]}")
@pytest.mark.parametrize("mask_kind", [None, "random"], ids=str)
@pytest.mark.parametrize("kind", ["nonlinear", "linear"])
@pytest.mark.parametrize("shape", [(1, 1, 5, 3), (3, 5, 7, 11), (16, 16, 96, 96)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize(("skip_rows", "table"), [(0, "3d"), (2, "2d"), (2, "3d")], ids=str)
def test_dal_loss_on_the_whole_table(skip_rows, table, shape, kind, mask_kind, dtypes):
    # The model's table [1, skip_rows + N, D] (or flat): the prefix rows are not regressed, their gradient is zero.
    case = DalCase(*shape, kind=kind, mask_kind=mask_kind, seed=3)
    _check_dal(case, *dtypes, scale=1.0, skip_rows=skip_rows, table=table)


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)], ids=str)
@pytest.mark.parametrize("kind", ["nonlinear", "linear"])
@pytest.mark.parametrize("skip_rows", [0, 2])
def test_dal_loss_ignores_autocast(skip_rows, kind, dtypes):
    # The regressor computes in float32 as specified: under autocast the results are those without it, bit for bit.
    case = DalCase(4, 5, 24, 16, kind=kind, mask_kind="random", seed=6)
    args = case.args(*dtypes, skip_rows, "3d")
    forward = ops.dal_loss_extension(*args, 1.5)
    pos, _, w1, b1, w2, b2, coords, _ = args
    backward_args = (torch.tensor(0.5), pos, skip_rows, w1, w2, coords, *forward[1:], 1.5, b1 is not None, True)
    backward = ops.dal_loss_extension_backward(*backward_args)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.mm(coords, coords.t()).dtype == torch.bfloat16  # autocast is on
        under_autocast = ops.dal_loss_extension(*args, 1.5), ops.dal_loss_extension_backward(*backward_args)
    for actual, expected in zip((*under_autocast[0], *under_autocast[1]), (*forward, *backward), strict=True):
        assert actual.dtype == expected.dtype and torch.equal(actual, expected)


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


# On a GPU: the nonlinear regressor's CUDA kernels (csrc/dal_loss_cuda.cu; their logic also runs on host threads in
# csrc/tests/test_cuda_kernels.cpp) on every shape above and DeiT-S's (N = 196, D = H = 384), with and without skipped
# rows; a few cases of the autocast dtypes and of the linear regressor (the composite). Lean: the device check's GPU
# tests share one stage of a few minutes.
GPU_DAL_SHAPES = [*DAL_SHAPES, (14, 14, 384, 384)]
GPU_DAL_CASES = [
    *[
        (shape, "nonlinear", mask_kind, dtypes, layout)
        for shape in GPU_DAL_SHAPES
        for mask_kind in MASK_KINDS
        for dtypes in DAL_DTYPES[:2]
        for layout in [(0, "2d"), (1, "3d")]
    ],
    *[((14, 14, 384, 384), "nonlinear", mask_kind, DAL_DTYPES[2], (1, "3d")) for mask_kind in (None, "random")],
    *[((14, 14, 48, 24), "linear", mask_kind, DAL_DTYPES[0], (1, "3d")) for mask_kind in (None, "random")],
]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible")
@pytest.mark.parametrize(
    ("shape", "kind", "mask_kind", "dtypes", "layout"),
    GPU_DAL_CASES,
    ids=[
        f"{'x'.join(map(str, shape))}-{kind}-{mask}-{str(dtypes[0])[6:]}-{str(dtypes[1])[6:]}-skip{layout[0]}"
        for shape, kind, mask, dtypes, layout in GPU_DAL_CASES
    ],
)
def test_dal_loss_on_gpu(shape, kind, mask_kind, dtypes, layout):
    case = DalCase(*shape, kind=kind, mask_kind=mask_kind, batch=256 if shape[0] == 14 else 4, seed=5)
    _check_dal(case, *dtypes, scale=0.5, device="cuda", skip_rows=layout[0], table=layout[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible")
def test_dal_loss_on_gpu_is_deterministic_and_leaves_out_masked_rows():
    case = DalCase(14, 14, 64, 48, kind="nonlinear", mask_kind="random", batch=32, seed=4)
    pos, skip_rows, w1, b1, w2, b2, coords, mask = (
        t.cuda() if isinstance(t, torch.Tensor) else t for t in case.args(torch.float32, torch.float32, skip_rows=1)
    )
    mask[:, 5] = True  # every sample masks position 5: out of the loss, even as inf or NaN
    first = ops.dal_loss_extension(pos, skip_rows, w1, b1, w2, b2, coords, mask, 1.0)
    backward_args = (torch.ones((), device="cuda"), pos, skip_rows, w1, w2, coords, *first[1:], 1.0, True, True)
    first_grads = ops.dal_loss_extension_backward(*backward_args)
    for again, before in zip(ops.dal_loss_extension(pos, skip_rows, w1, b1, w2, b2, coords, mask, 1.0), first):
        assert torch.equal(again, before)
    for again, before in zip(ops.dal_loss_extension_backward(*backward_args), first_grads):
        assert torch.equal(again, before)
    poisoned = pos.clone()
    poisoned[skip_rows + 5] = float("nan")
    poisoned[skip_rows + 5, 0] = float("inf")
    forward = ops.dal_loss_extension(poisoned, skip_rows, w1, b1, w2, b2, coords, mask, 1.0)
    grads = ops.dal_loss_extension_backward(
        *backward_args[:1], poisoned, *backward_args[2:6], *forward[1:], 1.0, True, True
    )
    assert torch.equal(forward[0], first[0])
    for got, want in zip(grads, first_grads):
        assert torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible")
@pytest.mark.parametrize("kind", ["nonlinear", "linear"])
def test_dal_loss_opcheck_on_gpu(kind):
    case = DalCase(3, 5, 8, 6, kind=kind, mask_kind="random")
    args = [t.cuda() if isinstance(t, torch.Tensor) else t for t in case.args(torch.float32, torch.float32, 1, "3d")]
    torch.library.opcheck(ops.dal_loss_extension.default, (*args, 2.0))
    _, pred, hidden, weights = ops.dal_loss_extension(*args, 2.0)
    pos, _, w1, b1, w2, b2, coords, _ = args
    grad = torch.tensor(0.5, device="cuda")
    backward_args = (grad, pos, 1, w1, w2, coords, pred, hidden, weights, 2.0, b1 is not None, True)
    torch.library.opcheck(ops.dal_loss_extension_backward.default, backward_args)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("mask_kind", MASK_KINDS, ids=str)
@pytest.mark.parametrize("kind", ["nonlinear", "linear"])
def test_dal_loss_equals_package_oracle(kind, mask_kind, reduction):
    rows, cols, dim = 5, 6, 24
    torch.manual_seed(0)
    regressor = mjp_fast.DALRegressor(dim, kind)
    pos_embed = torch.randn(1, rows * cols, dim, requires_grad=True)
    mask = None if mask_kind is None else _jigsaw(6, rows, cols, mask_kind)[0]
    expected = dal_loss_ref(pos_embed, regressor, (rows, cols), mask, reduction=reduction)
    scale = dal_scale(reduction)
    params = list(regressor.parameters())
    expected_grads = torch.autograd.grad(expected, [pos_embed, *params])

    layers = (regressor.net[0], regressor.net[2]) if kind == "nonlinear" else (None, regressor.net)
    w1, b1 = (layers[0].weight, layers[0].bias) if layers[0] is not None else (None, None)
    w2, b2 = layers[1].weight, layers[1].bias
    pos = pos_embed.detach()  # the table as the model holds it, [1, N, D]
    coords = grid_coordinates((rows, cols))
    with torch.no_grad():
        loss, pred, hidden, weights = ops.dal_loss_extension(pos, 0, w1, b1, w2, b2, coords, mask, scale)
        grads = ops.dal_loss_extension_backward(
            torch.ones(()), pos, 0, w1, w2, coords, pred, hidden, weights, scale, b1 is not None, b2 is not None
        )
    torch.testing.assert_close(loss, expected.detach())
    torch.testing.assert_close(grads[0], expected_grads[0])
    actual_param_grads = [g for g in grads[1:] if g.numel()]  # w1, b1, w2, b2 as they exist
    for actual, reference in zip(actual_param_grads, expected_grads[1:], strict=True):
        torch.testing.assert_close(actual, reference)


def test_dal_loss_is_deterministic():
    case = DalCase(14, 14, 64, 64, kind="nonlinear", mask_kind="random", batch=32, seed=4)
    args = case.args(torch.float32, torch.float32, skip_rows=1)
    first = ops.dal_loss_extension(*args, 1.0)
    second = ops.dal_loss_extension(*args, 1.0)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    backward_args = (torch.ones(()), args[0], args[1], args[2], args[4], args[6], *first[1:], 1.0, True, True)
    for a, b in zip(ops.dal_loss_extension_backward(*backward_args), ops.dal_loss_extension_backward(*backward_args)):
        assert torch.equal(a, b)


def test_dal_loss_rejects_bad_arguments():
    case = DalCase(3, 4, 6, 5, kind="nonlinear", mask_kind="random")
    pos, _, w1, b1, w2, b2, coords, mask = case.args(torch.float32, torch.float32)
    table = case.args(torch.float32, torch.float32, skip_rows=2, table="3d")[0]  # [1, 2 + N, D]
    good = dict(pos=pos, skip_rows=0, w1=w1, b1=b1, w2=w2, b2=b2, coords=coords, mask=mask, scale=1.0)
    ops.dal_loss_extension(**good)
    ops.dal_loss_extension(**{**good, "pos": table, "skip_rows": 2})
    table_cases = [
        dict(pos=pos[0]),
        dict(pos=table, skip_rows=1),  # rows != skip_rows + N
        dict(pos=table, skip_rows=3),
        dict(pos=table),
        dict(skip_rows=-1),
        dict(pos=torch.cat((table, table))),  # leading dims other than 1: not one table
    ]
    bad_cases = [
        *table_cases,
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
        dict(coords=coords[0]),
        dict(mask=mask.int()),
        dict(mask=mask[:, :-1]),
        dict(mask=mask[0]),
    ]
    for bad in bad_cases:
        with pytest.raises(RuntimeError):
            ops.dal_loss_extension(**{**good, **bad})
    to_meta = lambda value: value.to("meta") if isinstance(value, torch.Tensor) else value  # noqa: E731
    for bad in table_cases:  # the Meta kernel (FakeTensor, torch.compile) checks them too
        with pytest.raises(RuntimeError):
            ops.dal_loss_extension(**{name: to_meta(value) for name, value in {**good, **bad}.items()})
    _, pred, hidden, weights = ops.dal_loss_extension(**good)
    good = dict(
        grad=torch.ones(()), pos=pos, skip_rows=0, w1=w1, w2=w2, coords=coords, pred=pred, hidden=hidden,
        weights=weights, scale=1.0, has_b1=True, has_b2=True,
    )  # fmt: skip
    ops.dal_loss_extension_backward(**good)
    assert ops.dal_loss_extension_backward(**{**good, "pos": table, "skip_rows": 2})[0].shape == table.shape
    bad_cases = [
        *table_cases,
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


@pytest.mark.parametrize("skip_rows", [0, 2])
@pytest.mark.parametrize("mask_kind", [None, "random"], ids=str)
@pytest.mark.parametrize("kind", ["nonlinear", "linear"])
def test_dal_loss_opcheck(kind, mask_kind, skip_rows):
    case = DalCase(3, 5, 8, 6, kind=kind, mask_kind=mask_kind)
    args = case.args(torch.bfloat16, torch.float32, skip_rows, "3d" if skip_rows else "2d")
    torch.library.opcheck(ops.dal_loss_extension.default, (*args, 2.0))
    _, pred, hidden, weights = ops.dal_loss_extension(*args, 2.0)
    pos, _, w1, b1, w2, b2, coords, _ = args
    backward_args = (
        torch.tensor(0.5),
        pos,
        skip_rows,
        w1,
        w2,
        coords,
        pred,
        hidden,
        weights,
        2.0,
        b1 is not None,
        True,
    )
    torch.library.opcheck(ops.dal_loss_extension_backward.default, backward_args)


# ----------------------------------------------------------------------------------------------------------------
# pos_embed_extension_autograd, dal_loss_extension_autograd: the same kernels with their autograd in C++


@pytest.mark.parametrize("prefix_layout", [None, (1, 1, "3d", "3d"), (3, 0, "2d", "3d")], ids=str)
def test_pos_embed_autograd_operator_gradcheck(prefix_layout):
    tokens, perm, mask, pos_embed, unk_embed, _ = _pos_embed_inputs(3, 2, 3, 4, "random", *[torch.float64] * 2)
    prefix, table, positions = None, pos_embed, 0
    if prefix_layout is not None:
        prefix, table = _prefix_inputs(tokens, pos_embed, prefix_layout)
        positions = prefix_layout[1]
    leaves = [t.detach().requires_grad_() for t in (tokens, table, unk_embed)]
    prefix_leaf = None if prefix is None else prefix.detach().requires_grad_()

    def call(tokens, table, unk_embed, prefix):
        return ops.pos_embed_extension_autograd(tokens, perm, mask, table, unk_embed, prefix, positions)

    assert torch.autograd.gradcheck(call, (*leaves, prefix_leaf))
    out = call(*leaves, prefix_leaf)
    expected = ops.pos_embed_extension(*(t.detach() for t in (tokens, perm, mask, table, unk_embed)), prefix, positions)
    assert torch.equal(out, expected) and out.grad_fn is not None
    out.backward(torch.ones_like(out))
    assert all(leaf.grad is not None and leaf.grad.shape == leaf.shape for leaf in leaves)
    assert prefix_leaf is None or prefix_leaf.grad.shape == prefix_leaf.shape


@pytest.mark.parametrize("mask_kind", [None, "random"], ids=str)
@pytest.mark.parametrize("kind", ["nonlinear", "linear"])
@pytest.mark.parametrize("bias", [True, False])
def test_dal_loss_autograd_operator_gradcheck(kind, mask_kind, bias):
    case = DalCase(3, 4, 5, 6, kind=kind, mask_kind=mask_kind, bias=bias, seed=2)
    pos, skip_rows, *params, coords, mask = case.args(torch.float64, torch.float64, skip_rows=1, table="3d")
    leaves = [None if t is None else t.detach().requires_grad_() for t in (pos, *params)]

    def call(pos, w1, b1, w2, b2):
        return ops.dal_loss_extension_autograd(pos, skip_rows, w1, b1, w2, b2, coords, mask, 0.5)

    assert torch.autograd.gradcheck(call, leaves)
    loss = call(*leaves)
    assert torch.equal(loss, ops.dal_loss_extension(pos, skip_rows, *params, coords, mask, 0.5)[0])
    loss.backward()
    assert not leaves[0].grad[0, :skip_rows].any()  # the prefix rows are not regressed


def test_autograd_operators_without_autograd():
    # Inference mode skips the Autograd key: the CompositeExplicitAutograd kernels give the same values, no graph.
    tokens, perm, mask, pos_embed, unk_embed, _ = _pos_embed_inputs(2, 3, 3, 4, "random", *[torch.float32] * 2)
    case = DalCase(3, 3, 4, 5, kind="nonlinear", mask_kind="random")
    dal_args = (*case.args(torch.float32, torch.float32), 0.5)
    pos_args = (tokens, perm, mask, pos_embed.requires_grad_(), unk_embed, None, 0)
    with torch.inference_mode():
        out = ops.pos_embed_extension_autograd(*pos_args)
        loss = ops.dal_loss_extension_autograd(*dal_args)
    assert out.grad_fn is None and loss.grad_fn is None
    assert torch.equal(out, ops.pos_embed_extension(*pos_args))
    assert torch.equal(loss, ops.dal_loss_extension(*dal_args)[0])


@pytest.mark.parametrize("kind", ["nonlinear", "linear"])
def test_autograd_operators_opcheck(kind):
    tokens, perm, mask, pos_embed, unk_embed, _ = _pos_embed_inputs(3, 2, 3, 4, "random", *[torch.float32] * 2)
    prefix, table = _prefix_inputs(tokens, pos_embed, (1, 1, "3d", "3d"))
    pos_args = [t.requires_grad_() for t in (tokens, table, unk_embed, prefix)]
    torch.library.opcheck(
        ops.pos_embed_extension_autograd.default, (pos_args[0], perm, mask, pos_args[1], pos_args[2], pos_args[3], 1)
    )
    case = DalCase(3, 4, 5, 6, kind=kind, mask_kind="random")
    pos, skip_rows, *params, coords, dal_mask = case.args(torch.float32, torch.float32, skip_rows=1, table="3d")
    leaves = [None if t is None else t.requires_grad_() for t in (pos, *params)]
    torch.library.opcheck(
        ops.dal_loss_extension_autograd.default, (leaves[0], skip_rows, *leaves[1:], coords, dal_mask, 0.5)
    )


def test_operators_compile_in_one_graph():
    # The Meta kernels give torch.compile the shapes (dynamic ones too) with no Python registration: no graph break;
    # and the shapes that the backward takes as arguments stay symbolic: one graph for every N.
    case = DalCase(4, 5, 6, 7, kind="nonlinear", mask_kind="random")
    pos, _, w1, b1, w2, b2, coords, dal_mask = case.args(torch.float32, torch.float32, skip_rows=1, table="3d")
    prefix = torch.randn(1, 1, 6)  # a class token, with a position row

    def step(tokens, perm, mask, table, unk_embed, grad):
        out = ops.pos_embed_extension(tokens, perm, mask, table, unk_embed, prefix, 1)
        grads = ops.pos_embed_extension_backward(
            grad, perm, mask, 1, 1, table.shape, prefix.shape, *[torch.float32] * 4
        )
        plain = ops.pos_embed_extension(tokens, perm, mask, table[0, 1:], unk_embed, None, 0)
        loss, pred, hidden, weights = ops.dal_loss_extension(pos, 1, w1, b1, w2, b2, coords, dal_mask, 0.5)
        dal_grads = ops.dal_loss_extension_backward(
            loss, pos, 1, w1, w2, coords, pred, hidden, weights, 0.5, True, True
        )
        return out, *grads, plain, loss, *dal_grads

    counter = CompileCounter()
    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    for rows, cols in ((3, 4), (3, 3), (5, 7)):  # N differs from the DAL case's (duck sizing would tie them)
        tokens, perm, mask, pos_embed, unk_embed, grad = _pos_embed_inputs(
            3, rows, cols, 6, "random", *[torch.float32] * 2
        )
        table = torch.cat((torch.randn(1, 6), pos_embed))[None]
        grad = torch.cat((torch.randn(3, 1, 6), grad), 1)
        inputs = (tokens, perm, mask, table, unk_embed, grad)
        for actual, expected in zip(compiled(*inputs), step(*inputs), strict=True):
            assert torch.equal(actual, expected)
    assert counter.frame_count == 1


def test_operators_are_registered_with_their_schemas():
    schemas = {name: str(getattr(ops, name).default._schema) for name in (
        "pos_embed_extension", "pos_embed_extension_backward", "dal_loss_extension", "dal_loss_extension_backward"
    )}  # fmt: skip
    assert schemas["pos_embed_extension"] == (
        "mjp_fast::pos_embed_extension(Tensor tokens, Tensor perm, Tensor mask, Tensor pos_embed, Tensor unk_embed, "
        "Tensor? prefix, int prefix_positions) -> Tensor"
    )
    assert schemas["pos_embed_extension_backward"] == (
        "mjp_fast::pos_embed_extension_backward(Tensor grad_out, Tensor perm, Tensor mask, int prefix_count, "
        "int prefix_positions, SymInt[] pos_shape, SymInt[] prefix_shape, ScalarType tokens_dtype, "
        "ScalarType pos_dtype, ScalarType unk_dtype, ScalarType prefix_dtype) -> (Tensor grad_tokens, "
        "Tensor grad_pos, Tensor grad_unk, Tensor grad_prefix)"
    )
    assert schemas["dal_loss_extension"] == (
        "mjp_fast::dal_loss_extension(Tensor pos, int skip_rows, Tensor? w1, Tensor? b1, Tensor w2, Tensor? b2, "
        "Tensor coords, Tensor? mask, float scale) -> (Tensor loss, Tensor pred, Tensor hidden, Tensor weights)"
    )
    assert schemas["dal_loss_extension_backward"] == (
        "mjp_fast::dal_loss_extension_backward(Tensor grad, Tensor pos, int skip_rows, Tensor? w1, Tensor w2, "
        "Tensor coords, Tensor pred, Tensor hidden, Tensor weights, float scale, bool has_b1, bool has_b2) -> "
        "(Tensor grad_pos, Tensor grad_w1, Tensor grad_b1, Tensor grad_w2, Tensor grad_b2)"
    )
    for name in ("pos_embed_extension", "pos_embed_extension_backward"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"mjp_fast::{name}", "CPU")
    for name in schemas:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"mjp_fast::{name}", "Meta")


# ----------------------------------------------------------------------------------------------------------------
# patch_embed_extension
# ----------------------------------------------------------------------------------------------------------------
# The kernels are the ones behind _C.patch_embed_forward / _backward, tested against the formula in test_extension.py;
# here: the operators (the bindings are thin wrappers of them), their Meta kernels, autograd and torch.compile.


def _patch_embed_args(rows=2, cols=3, *, batch=2, prefix_count=1, prefix_positions=1, dtype=torch.float32, seed=0):
    """The forward operator's arguments: images [B, 3, 4 rows, 4 cols], weight [5, 3, 4, 4], bias, the whole table
    [1, Q + N, 5], unk_embed, perm, mask, prefix [1, P, 5] (None when P = 0), Q."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)

    mask, perm = _jigsaw(batch, rows, cols, "random", seed)
    prefix = randn(1, prefix_count, 5) if prefix_count else None
    return (
        randn(batch, 3, 4 * rows, 4 * cols), randn(5, 3, 4, 4), randn(5), randn(1, prefix_positions + rows * cols, 5),
        randn(5), perm, mask, prefix, prefix_positions,
    )  # fmt: skip


def _patch_embed_backward_args(forward_args, needs=(True,) * 6, shapes=True):
    """The backward operator's arguments for the forward's, a random grad_out [B, P + N, D]."""
    images, weight, _, table, _, perm, mask, prefix, prefix_positions = forward_args
    prefix_count = 0 if prefix is None else prefix.shape[1]
    grad = torch.randn(images.shape[0], table.shape[1] - prefix_positions + prefix_count, 5, dtype=images.dtype)
    pos_shape = list(table.shape) if shapes else None
    prefix_shape = list(prefix.shape) if shapes and prefix is not None else None
    return (grad, images, weight, perm, mask, *needs, prefix_count, prefix_positions, pos_shape, prefix_shape)


LAYOUTS = [(0, 0), (1, 1), (2, 0)]  # (P, Q): no prefix; a class token with a position row; two tokens without


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda p: f"P{p[0]}Q{p[1]}")
def test_patch_embed_operators_equal_the_bindings(layout):
    args = _patch_embed_args(prefix_count=layout[0], prefix_positions=layout[1])
    assert torch.equal(ops.patch_embed_extension(*args), _C.patch_embed_forward(*args))
    needs = (True, False, True, True, False, layout[0] > 0)
    backward_args = _patch_embed_backward_args(args, needs)
    grads = ops.patch_embed_extension_backward(*backward_args)
    bound = _C.patch_embed_backward(*backward_args)
    assert len(grads) == len(bound) == 6
    for grad, binding, need in zip(grads, bound, needs, strict=True):
        if need:
            assert torch.equal(grad, binding)
        else:  # the operator returns an empty tensor where the binding returns None
            assert binding is None and grad.shape == (0,) and grad.dtype == args[0].dtype


def test_patch_embed_optional_arguments_and_defaults():
    images, weight, bias, table, unk, perm, mask, _, _ = _patch_embed_args(prefix_count=0, prefix_positions=0)
    plain = ops.patch_embed_extension(images, weight, None, table, None, None, None)
    expected = F.conv2d(images, weight, stride=4).flatten(2).transpose(1, 2) + table
    torch.testing.assert_close(plain, expected)
    grad = torch.randn_like(plain)
    grads = ops.patch_embed_extension_backward(grad, images, weight, None, None, True, True, True, True, True)
    assert [tuple(g.shape) for g in grads] == [tuple(images.shape), tuple(weight.shape), (5,), (6, 5), (5,), (0,)]
    # a prefix gradient asked for without prefix tokens is an empty tensor
    grads = ops.patch_embed_extension_backward(grad, images, weight, None, None, *[False] * 5, True)
    assert all(g.shape == (0,) for g in grads)


def _cast_case(layout, compute):
    """Autocast's call of the operators: the images cast by the caller, the float32 weight, bias, table, unk and
    prefix as they are, compute_dtype and a float32 out_dtype; and the same call with every tensor cast first."""
    args = list(_patch_embed_args(prefix_count=layout[0], prefix_positions=layout[1]))
    args[0] = args[0].to(compute)
    cast = [arg.to(compute) if isinstance(arg, torch.Tensor) and arg.is_floating_point() else arg for arg in args]
    return args, cast


@pytest.mark.parametrize("compute", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda p: f"P{p[0]}Q{p[1]}")
def test_patch_embed_operators_convert_to_compute_dtype_inside(layout, compute):
    # compute_dtype: the weight, bias, table, unk and prefix converted inside the operator, the output to out_dtype,
    # the gradients back to their inputs' dtypes: the values of the Python casts around the operator that it
    # replaces (12 dispatches under autocast), bit for bit.
    args, cast = _cast_case(layout, compute)
    out = ops.patch_embed_extension(*args, torch.float32, compute)
    assert out.dtype == torch.float32
    assert torch.equal(out, ops.patch_embed_extension(*cast).float())
    images, weight, _, table, unk, perm, mask, prefix, prefix_positions = args
    prefix_count = 0 if prefix is None else prefix.shape[1]
    grad = torch.randn(out.shape, dtype=torch.float32, generator=torch.Generator().manual_seed(3))
    shapes = (prefix_count, prefix_positions, list(table.shape), list(prefix.shape) if prefix is not None else None)
    needs = (True, True, True, True, True, prefix_count > 0)
    dtypes = (torch.float32, torch.float32, torch.float32 if prefix is not None else None)
    grads = ops.patch_embed_extension_backward(grad, images, weight, perm, mask, *needs, *shapes, *dtypes, compute)
    expected = ops.patch_embed_extension_backward(grad.to(compute), images, cast[1], perm, mask, *needs, *shapes)
    wanted = (compute, torch.float32, torch.float32, torch.float32, torch.float32, torch.float32)
    for index, (got, want, dtype) in enumerate(zip(grads, expected, wanted, strict=True)):
        if not needs[index]:
            assert got.shape == (0,)
            continue
        assert got.dtype == dtype and torch.equal(got, want.to(dtype)), index
    # without compute_dtype the operator still wants one dtype, and says which argument has another
    with pytest.raises(RuntimeError, match="weight dtype Float differs from images (BFloat16|Half)"):
        ops.patch_embed_extension(*args[:2], *cast[2:])


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda p: f"P{p[0]}Q{p[1]}")
def test_patch_embed_opcheck_with_compute_dtype(layout):
    # the Meta kernels give the dtypes the kernels return (out_dtype; each gradient its input's)
    args, _ = _cast_case(layout, torch.bfloat16)
    torch.library.opcheck(ops.patch_embed_extension.default, (*args, torch.float32, torch.bfloat16))
    images, weight, _, table, _, perm, mask, prefix, prefix_positions = args
    prefix_count = 0 if prefix is None else prefix.shape[1]
    grad = torch.randn(images.shape[0], table.shape[1] - prefix_positions + prefix_count, 5)
    shapes = (prefix_count, prefix_positions, list(table.shape), list(prefix.shape) if prefix is not None else None)
    dtypes = (torch.float32, torch.float32, torch.float32 if prefix is not None else None)
    backward = (grad, images, weight, perm, mask, *(True,) * 5, prefix_count > 0, *shapes, *dtypes, torch.bfloat16)
    torch.library.opcheck(ops.patch_embed_extension_backward.default, backward)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible")
@pytest.mark.skipif(not _C.has_cuda(), reason="the extension was built without its CUDA kernels")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda p: f"P{p[0]}Q{p[1]}")
def test_patch_embed_operators_on_gpu_equal_the_cpu_kernels(layout, dtype):
    # The CUDA kernels (patch_embed_cuda.cu) against the CPU ones, every gradient, each prefix layout: the backward
    # reads the prefix rows of the gradient in place and runs its GEMMs over them against zero im2col rows.
    args = _patch_embed_args(3, 5, batch=3, prefix_count=layout[0], prefix_positions=layout[1], dtype=dtype)
    backward_args = _patch_embed_backward_args(args, (True,) * 6)
    on_gpu = lambda values: [v.cuda() if isinstance(v, torch.Tensor) else v for v in values]  # noqa: E731
    tolerance = dict(atol=1e-12, rtol=1e-12) if dtype == torch.float64 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ops.patch_embed_extension(*on_gpu(args)).cpu(), ops.patch_embed_extension(*args))
    gpu_grads = ops.patch_embed_extension_backward(*on_gpu(backward_args))
    for got, want in zip(gpu_grads, ops.patch_embed_extension_backward(*backward_args), strict=True):
        torch.testing.assert_close(got.cpu(), want, **tolerance)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible")
@pytest.mark.skipif(not _C.has_cuda(), reason="the extension was built without its CUDA kernels")
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda p: f"P{p[0]}Q{p[1]}")
def test_patch_embed_compute_dtype_on_gpu_equals_the_cpu(layout):
    # Autocast's call on the CUDA kernels: the conversions inside the operator, on the GPU, as on the CPU (the sums
    # in other orders: within bfloat16's rounding)
    args, _ = _cast_case(layout, torch.bfloat16)
    on_gpu = lambda values: [v.cuda() if isinstance(v, torch.Tensor) else v for v in values]  # noqa: E731
    dtypes = (torch.float32, torch.bfloat16)
    out = ops.patch_embed_extension(*on_gpu(args), *dtypes)
    expected = ops.patch_embed_extension(*args, *dtypes)
    assert out.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), expected, atol=2e-2, rtol=2e-2)
    images, weight, _, table, _, perm, mask, prefix, prefix_positions = args
    prefix_count = 0 if prefix is None else prefix.shape[1]
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    shapes = (prefix_count, prefix_positions, list(table.shape), list(prefix.shape) if prefix is not None else None)
    grad_dtypes = (torch.float32, torch.float32, torch.float32 if prefix is not None else None)
    backward = (grad, images, weight, perm, mask, *(True,) * 5, prefix_count > 0, *shapes, *grad_dtypes, dtypes[1])
    expected_grads = ops.patch_embed_extension_backward(*backward)
    for got, want in zip(ops.patch_embed_extension_backward(*on_gpu(backward)), expected_grads, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got.cpu(), want, atol=5e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda p: f"P{p[0]}Q{p[1]}")
def test_patch_embed_opcheck(layout, dtype):
    args = _patch_embed_args(prefix_count=layout[0], prefix_positions=layout[1], dtype=dtype)
    differentiable = [*args[:5], args[7]]
    for tensor in differentiable:
        if tensor is not None:
            tensor.requires_grad_(True)
    torch.library.opcheck(ops.patch_embed_extension.default, args)
    images, weight, _, table, _, perm, mask, _, prefix_positions = args
    patch_rows = table[:, prefix_positions:].detach().requires_grad_(True)
    torch.library.opcheck(ops.patch_embed_extension.default, (images, weight, None, patch_rows, None, perm, mask))
    detached = [arg.detach() if isinstance(arg, torch.Tensor) else arg for arg in args]
    for needs, shapes in [((True,) * 6, True), ((False, True, False, True, True, False), False)]:
        torch.library.opcheck(
            ops.patch_embed_extension_backward.default, _patch_embed_backward_args(detached, needs, shapes)
        )
    grad = torch.randn(images.shape[0], 6, 5, dtype=dtype)
    plain_args = (grad, images.detach(), weight.detach(), None, None, True, True, True, True, True)
    torch.library.opcheck(ops.patch_embed_extension_backward.default, plain_args)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda p: f"P{p[0]}Q{p[1]}")
def test_patch_embed_operator_autograd(layout):
    # The operator's own autograd (register_autograd in mjp_fast/ops/patch_embed.py), against finite differences.
    args = list(_patch_embed_args(1, 2, prefix_count=layout[0], prefix_positions=layout[1], dtype=torch.float64))
    args[0] = torch.randn(2, 3, 5, 8, dtype=torch.float64)  # a pixel row below the 1x2 grid: ignored
    inputs = [index for index in (0, 1, 2, 3, 4, 7) if args[index] is not None]

    def call(*tensors):
        full = list(args)
        for index, tensor in zip(inputs, tensors, strict=True):
            full[index] = tensor
        return ops.patch_embed_extension(*full)

    leaves = [args[index].detach().requires_grad_(True) for index in inputs]
    assert torch.autograd.gradcheck(call, leaves)
    # only what requires grad is computed and returned
    out = ops.patch_embed_extension(args[0], leaves[1], *args[2:])
    (grad_weight,) = torch.autograd.grad(out.sum(), leaves[1])
    assert grad_weight.shape == leaves[1].shape


def test_patch_embed_step_dispatches_one_operator_each_way():
    # What a TorchDispatchMode (bench/bench_host_cost.py) sees: the two operators, and autograd's own detaches.
    from torch.utils._python_dispatch import TorchDispatchMode

    from mjp_fast.ops.patch_embed import patch_embed_step
    from mjp_fast.sampler import Jigsaw

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    images, weight, bias, table, unk, perm, mask, prefix, _ = _patch_embed_args()
    parameters = [tensor.requires_grad_(True) for tensor in (weight, bias, table, unk, prefix)]
    grad = torch.randn(2, 7, 5)
    with Count() as counter:
        out = patch_embed_step(images, weight, bias, table, unk, Jigsaw(mask, perm), "cpu", prefix, 1)
        out.backward(grad)
    names = [name for name in counter.names if name != "detach"]
    assert names == ["patch_embed_extension", "patch_embed_extension_backward"], counter.names
    assert all(parameter.grad is not None for parameter in parameters)


def test_patch_embed_meta_kernels_check_the_arguments():
    args = dict(zip(
        ("images", "weight", "bias", "pos_embed", "unk_embed", "perm", "mask", "prefix", "prefix_positions"),
        _patch_embed_args(prefix_count=2, prefix_positions=2),
    ))  # fmt: skip
    to_meta = lambda value: value.to("meta") if isinstance(value, torch.Tensor) else value  # noqa: E731
    meta = ops.patch_embed_extension(**{name: to_meta(value) for name, value in args.items()})
    assert meta.device.type == "meta" and meta.shape == (2, 8, 5) and meta.dtype == torch.float32
    images, weight, table = args["images"], args["weight"], args["pos_embed"]
    bad_cases = [
        dict(images=images[0]),
        dict(weight=weight[:, :2]),  # channels
        dict(weight=weight[..., :3]),  # not square
        dict(images=images.int(), weight=weight.int()),
        dict(weight=weight.double()),
        dict(bias=args["bias"][:-1]),
        dict(pos_embed=table[:, 1:]),  # Q + N - 1 rows
        dict(pos_embed=torch.cat((table, table))),
        dict(unk_embed=args["unk_embed"].double()),
        dict(perm=args["perm"].int()),
        dict(perm=args["perm"][:1]),
        dict(mask=args["mask"].int()),
        dict(prefix=torch.randn(1, 2, 4)),
        dict(prefix_positions=1),
    ]
    for bad in bad_cases:
        for convert in (lambda value: value, to_meta):  # the CPU kernel, then the Meta kernel
            with pytest.raises(RuntimeError):
                ops.patch_embed_extension(**{name: convert(value) for name, value in {**args, **bad}.items()})
    backward = dict(zip(
        ("grad_out", "images", "weight", "perm", "mask", "need_images", "need_weight", "need_bias", "need_pos",
         "need_unk", "need_prefix", "prefix_count", "prefix_positions", "pos_shape", "prefix_shape"),
        _patch_embed_backward_args(tuple(args.values())),
    ))  # fmt: skip
    metas = ops.patch_embed_extension_backward(**{name: to_meta(value) for name, value in backward.items()})
    assert [tuple(g.shape) for g in metas] == [(2, 3, 8, 12), (5, 3, 4, 4), (5,), (1, 8, 5), (5,), (1, 2, 5)]
    bad_cases = [
        dict(grad_out=backward["grad_out"][:, 1:]),
        dict(grad_out=backward["grad_out"].double()),
        dict(prefix_count=-1),
        dict(prefix_positions=1),
        dict(pos_shape=[1, 7, 5]),
        dict(pos_shape=[40]),
        dict(prefix_shape=[1, 3, 5]),
        dict(perm=backward["perm"][:, :-1]),
    ]
    for bad in bad_cases:
        for convert in (lambda value: value, to_meta):
            with pytest.raises(RuntimeError):
                ops.patch_embed_extension_backward(
                    **{name: convert(value) for name, value in {**backward, **bad}.items()}
                )


def test_patch_embed_operators_compile_in_one_graph():
    # Dynamic shapes: the grid and the prefix layout's shapes stay symbolic; one graph for every grid.
    def step(images, weight, bias, table, unk, perm, mask, prefix, grad):
        out = ops.patch_embed_extension(images, weight, bias, table, unk, perm, mask, prefix, 1)
        grads = ops.patch_embed_extension_backward(
            grad, images, weight, perm, mask, True, True, True, True, True, True, 1, 1, table.shape, prefix.shape
        )
        return out, *grads

    counter = CompileCounter()
    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    for rows, cols in ((2, 3), (3, 3), (4, 2)):
        images, weight, bias, table, unk, perm, mask, prefix, _ = _patch_embed_args(rows, cols)
        grad = torch.randn(2, 1 + rows * cols, 5)
        inputs = (images, weight, bias, table, unk, perm, mask, prefix, grad)
        for actual, expected in zip(compiled(*inputs), step(*inputs), strict=True):
            assert torch.equal(actual, expected)
    assert counter.frame_count == 1


def test_patch_embed_operators_are_registered_with_their_schemas():
    assert str(ops.patch_embed_extension.default._schema) == (
        "mjp_fast::patch_embed_extension(Tensor images, Tensor weight, Tensor? bias, Tensor pos_embed, "
        "Tensor? unk_embed, Tensor? perm, Tensor? mask, Tensor? prefix=None, int prefix_positions=0, "
        "ScalarType? out_dtype=None, ScalarType? compute_dtype=None) -> Tensor"
    )
    assert str(ops.patch_embed_extension_backward.default._schema) == (
        "mjp_fast::patch_embed_extension_backward(Tensor grad_out, Tensor images, Tensor weight, Tensor? perm, "
        "Tensor? mask, bool need_images, bool need_weight, bool need_bias, bool need_pos, bool need_unk, "
        "bool need_prefix=False, int prefix_count=0, int prefix_positions=0, SymInt[]? pos_shape=None, "
        "SymInt[]? prefix_shape=None, ScalarType? pos_dtype=None, ScalarType? unk_dtype=None, "
        "ScalarType? prefix_dtype=None, ScalarType? compute_dtype=None) -> Tensor[]"
    )
    for name in ("patch_embed_extension", "patch_embed_extension_backward"):
        for key in ("CPU", "Meta", *(["CUDA"] if _C.has_cuda() else [])):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"mjp_fast::{name}", key), (name, key)
    # the forward's autograd is registered from Python (mjp_fast/ops/patch_embed.py)
    assert torch._C._dispatch_has_kernel_for_dispatch_key("mjp_fast::patch_embed_extension", "Autograd")
