"""Tests of the compiled extension ``mjp_fast._C`` called directly (the public ops are tested in their own files).

The sampler must equal the PyTorch oracle bit for bit; the patch embedding (with the prefix tokens in front of the
patch tokens, and the model's whole position table) is compared with a plain unfold + gather + matmul written here:
float32 and float64 tightly, float16 / bfloat16 with the error budget of STYLE.md (at most twice the error of the same
torch computation run in that dtype).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

_C = pytest.importorskip("mjp_fast._C", reason="the compiled extension mjp_fast._C is not built")

from mjp_fast.sampler import sample_jigsaw_ref  # noqa: E402
from mjp_fast.sampler.reference import sampler_tables  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and _C.has_cuda() else [])
LOW_PRECISION = [torch.float16, torch.bfloat16]


# ----------------------------------------------------------------------------------------------------------------
# Sampler
# ----------------------------------------------------------------------------------------------------------------


def _extension_jigsaw(
    batch_size, rows, cols, ratio, *, seed, offset=0, shared=False, prob=1.0, min_block=8, min_aspect=0.3, device="cpu"
):
    h_thresholds, w_thresholds = sampler_tables(rows, cols, min_aspect, device)
    target = math.floor(ratio * rows * cols)  # docs/sampler.md: as Python computes it
    prob_threshold = math.floor(prob * 2**32)
    return _C.sample_jigsaw(
        batch_size, rows, cols, target, min_block, seed, offset, shared, prob_threshold, h_thresholds, w_thresholds
    )


def _assert_same_as_oracle(batch_size, grid, ratio, device="cpu", **kwargs):
    mask, perm = _extension_jigsaw(batch_size, *grid, ratio, device=device, **kwargs)
    expected = sample_jigsaw_ref(batch_size, grid, ratio, device=device, **kwargs)
    assert mask.dtype == torch.bool and perm.dtype == torch.int64
    assert mask.shape == perm.shape == (batch_size, grid[0] * grid[1])
    assert mask.device.type == perm.device.type == torch.device(device).type
    assert torch.equal(mask.cpu(), expected.mask.cpu()), f"mask differs: grid={grid} ratio={ratio} {kwargs}"
    assert torch.equal(perm.cpu(), expected.perm.cpu()), f"perm differs: grid={grid} ratio={ratio} {kwargs}"


# Seeds and stream offsets at the edges of their ranges: high words of both, carries across 2**32.
STREAMS = [
    dict(seed=0, offset=0),
    dict(seed=2**64 - 1, offset=2**32 - 3),  # sample indices cross the 2**32 boundary of the counter
    dict(seed=0x1234_5678_9ABC_DEF0, offset=2**40 + 7),
    dict(seed=2**63 + 11, offset=2**62),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ratio", [0.0, 0.03, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("grid", [(1, 1), (1, 7), (3, 5), (14, 14), (7, 13)], ids=lambda g: f"{g[0]}x{g[1]}")
def test_sample_jigsaw_equals_oracle(grid, ratio, device):
    for index, stream in enumerate(STREAMS):
        prob = (1.0, 0.5, 0.0, 1.0)[index]
        _assert_same_as_oracle(6, grid, ratio, device=device, prob=prob, **stream)
    _assert_same_as_oracle(5, grid, ratio, device=device, shared=True, seed=77, offset=2**33 + 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(min_block=1),
        dict(min_block=30),
        dict(min_aspect=0.1),
        dict(min_aspect=1.0),
        dict(prob=0.25, seed=3),
    ],
    ids=lambda k: ",".join(f"{key}={value}" for key, value in k.items()),
)
def test_sample_jigsaw_other_parameters_equal_oracle(kwargs, device):
    kwargs = {"seed": 12345, "offset": 99, **kwargs}
    for grid, ratio in [((14, 14), 0.3), ((6, 17), 0.75), ((32, 32), 0.5), ((16, 9), 0.51)]:
        _assert_same_as_oracle(4, grid, ratio, device=device, **kwargs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("grid", "ratio"),
    [((8, 8), 0.19), ((23, 23), 0.97), ((32, 32), 0.9), ((24, 40), 0.6)],
    ids=["12of64", "about490of529", "about870of1024", "576of960"],
)
def test_sample_jigsaw_permutation_paths_equal_oracle(grid, ratio, device):
    # The host sorts up to 512 masked positions in a stack buffer and more in place; the AVX2 keys come four at a
    # time with a scalar tail. Counts around those edges, each against the oracle.
    _assert_same_as_oracle(3, grid, ratio, device=device, seed=2024, offset=7, min_block=1)


def test_sample_jigsaw_structure_and_batching():
    mask, perm = _extension_jigsaw(64, 14, 14, 0.5, seed=5, offset=1000)
    positions = torch.arange(196).expand(64, -1)
    assert torch.equal(perm.sort(dim=1).values, positions)  # a permutation per sample
    assert torch.equal(perm[~mask], positions[~mask])  # identity where unmasked
    assert bool(mask.gather(1, perm)[mask].all())  # masked tokens show masked patches
    assert int(mask.sum(1).max()) <= 98
    # Sample i is a function of (seed, offset + i) alone: any split of the batch gives the same rows.
    tail_mask, tail_perm = _extension_jigsaw(14, 14, 14, 0.5, seed=5, offset=1050)
    assert torch.equal(tail_mask, mask[50:]) and torch.equal(tail_perm, perm[50:])
    shared_mask, shared_perm = _extension_jigsaw(3, 14, 14, 0.5, seed=5, offset=1007, shared=True)
    assert torch.equal(shared_mask, mask[7:8].expand(3, -1)) and torch.equal(shared_perm, perm[7:8].expand(3, -1))
    empty_mask, empty_perm = _extension_jigsaw(0, 14, 14, 0.5, seed=5)
    assert empty_mask.shape == empty_perm.shape == (0, 196)


def test_sample_jigsaw_is_deterministic_across_thread_counts():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _extension_jigsaw(300, 14, 14, 0.4, seed=9)
        torch.set_num_threads(max(2, threads))
        many = _extension_jigsaw(300, 14, 14, 0.4, seed=9)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], many[0]) and torch.equal(one[1], many[1])


def test_sample_jigsaw_rejects_bad_arguments():
    h, w = sampler_tables(4, 5, 0.3, "cpu")
    good = dict(
        batch_size=2,
        gh=4,
        gw=5,
        target=3,
        min_block=8,
        seed=1,
        offset=0,
        shared=False,
        prob_threshold=2**32,
        h_thresholds=h,
        w_thresholds=w,
    )
    _C.sample_jigsaw(**good)
    bad_cases = [
        dict(target=21),
        dict(target=-1),
        dict(batch_size=-1),
        dict(gh=0),
        dict(gh=5),  # tables are for 4 rows
        dict(prob_threshold=2**32 + 1),
        dict(min_block=-1),
        dict(min_block=0),  # refused as sample_jigsaw refuses it in Python
        dict(h_thresholds=h.to(torch.int32)),
        dict(w_thresholds=w[:, :4]),
    ]
    for bad in bad_cases:
        with pytest.raises(RuntimeError):
            _C.sample_jigsaw(**{**good, **bad})


@pytest.mark.parametrize("stream", [dict(counter=0, scale=1, shift=0), dict(counter=2**31 + 5, scale=3, shift=7)])
def test_sample_jigsaw_step_samples_then_advances_the_counter(stream):
    # JigsawSampler's CPU step: the samples of stream position counter * scale + shift, then counter += batch.
    h, w = sampler_tables(4, 5, 0.3, "cpu")
    counter = torch.tensor(stream["counter"], dtype=torch.int64)
    version = counter._version
    mask, perm = _C.sample_jigsaw_step(counter, stream["scale"], stream["shift"], 6, 4, 5, 8, 2, 9, False, 2**31, h, w)
    offset = stream["counter"] * stream["scale"] + stream["shift"]
    expected = _C.sample_jigsaw(6, 4, 5, 8, 2, 9, offset, False, 2**31, h, w)
    assert torch.equal(mask, expected[0]) and torch.equal(perm, expected[1])
    assert counter.item() == stream["counter"] + 6 and counter._version > version


def test_sample_jigsaw_step_rejects_bad_counters():
    h, w = sampler_tables(4, 5, 0.3, "cpu")
    arguments = (1, 0, 2, 4, 5, 3, 8, 1, False, 2**32, h, w)
    for bad in (torch.zeros((), dtype=torch.int32), torch.zeros(2, dtype=torch.int64), torch.zeros(())):
        with pytest.raises(RuntimeError, match="counter"):
            _C.sample_jigsaw_step(bad, *arguments)
    with pytest.raises(RuntimeError, match="counter_scale"):
        _C.sample_jigsaw_step(torch.zeros((), dtype=torch.int64), -1, *arguments[1:])


def test_min_block_zero_is_refused_by_both_entry_points_and_the_counter_stays():
    h, w = sampler_tables(4, 5, 0.3, "cpu")
    with pytest.raises(RuntimeError, match=r"min_block must be in \[1, 2\*\*30\], got 0"):
        _C.sample_jigsaw(2, 4, 5, 8, 0, 1, 0, False, 2**32, h, w)
    counter = torch.tensor(7, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="min_block"):
        _C.sample_jigsaw_step(counter, 1, 0, 2, 4, 5, 8, 0, 1, False, 2**32, h, w)
    assert counter.item() == 7  # nothing sampled, nothing advanced


# ----------------------------------------------------------------------------------------------------------------
# Patch embedding
# ----------------------------------------------------------------------------------------------------------------


def _reference_tokens(images, weight, bias, pos_embed, unk_embed, perm, mask, prefix=None, prefix_positions=0):
    """[B, P + N, D] in the inputs' dtype: the P prefix rows ``prefix[t] + (pos_embed[t] if t < Q)`` (prefix: P * D
    elements, Q = prefix_positions), then the tokens by unfold + gather + matmul plus pos_embed[Q + n] (or unk_embed
    where masked). pos_embed: the whole table, last two dims [Q + N, D]."""
    dim, _, patch, _ = weight.shape
    rows, cols = images.shape[2] // patch, images.shape[3] // patch
    patches = F.unfold(images[:, :, : rows * patch, : cols * patch], patch, stride=patch).transpose(1, 2)
    if perm is not None:
        patches = patches.gather(1, perm[..., None].expand(-1, -1, patches.shape[-1]))
    tokens = patches @ weight.reshape(dim, -1).t()
    if bias is not None:
        tokens = tokens + bias
    table = pos_embed.reshape(-1, dim)
    patch_rows = table[prefix_positions:]
    if mask is not None:
        tokens = tokens + torch.where(mask[..., None], unk_embed, patch_rows)
    else:
        tokens = tokens + patch_rows
    if prefix is None:
        return tokens
    prefix_rows = prefix.reshape(-1, dim)
    head = prefix_rows + F.pad(table[:prefix_positions], (0, 0, 0, prefix_rows.shape[0] - prefix_positions))
    return torch.cat((head.expand(tokens.shape[0], -1, -1), tokens), 1)


def _random_jigsaw(batch, positions, generator, device):
    """A mask and a permutation of the masked positions among themselves, per sample."""
    mask = torch.rand(batch, positions, generator=generator) < 0.4
    perm = torch.arange(positions).repeat(batch, 1)
    for b in range(batch):
        masked = mask[b].nonzero().flatten()
        perm[b, masked] = masked[torch.randperm(len(masked), generator=generator)]
    return mask.to(device), perm.to(device)


class Case:
    """One patch-embedding problem: float64 master copies of every input."""

    def __init__(
        self, batch, channels, height, width, patch, dim, *, jigsaw=True, bias=True, unk=True, seed=0, device="cpu"
    ):
        g = torch.Generator().manual_seed(seed)
        self.patch, self.dim = patch, dim
        self.positions = (height // patch) * (width // patch)
        self.images = torch.randn(batch, channels, height, width, generator=g, dtype=torch.float64).to(device)
        self.weight = torch.randn(dim, channels, patch, patch, generator=g, dtype=torch.float64).to(device)
        self.weight /= math.sqrt(channels * patch * patch)
        self.bias = torch.randn(dim, generator=g, dtype=torch.float64).to(device) if bias else None
        self.pos = torch.randn(self.positions, dim, generator=g, dtype=torch.float64).to(device)
        self.unk = torch.randn(dim, generator=g, dtype=torch.float64).to(device) if unk else None
        self.mask, self.perm = _random_jigsaw(batch, self.positions, g, device) if jigsaw else (None, None)
        self.grad = torch.randn(batch, self.positions, dim, generator=g, dtype=torch.float64).to(device)

    def inputs(self, dtype):
        cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
        return cast(self.images), cast(self.weight), cast(self.bias), cast(self.pos), cast(self.unk)

    def forward(self, dtype, images=None):
        x, w, b, p, u = self.inputs(dtype)
        return _C.patch_embed_forward(x if images is None else images, w, b, p, u, self.perm, self.mask)

    def backward(self, dtype, needs=(True, True, True, True, True)):
        x, w, *_ = self.inputs(dtype)
        return _C.patch_embed_backward(self.grad.to(dtype), x, w, self.perm, self.mask, *needs)

    def reference(self, dtype):
        """(tokens, [grad_images, grad_weight, grad_bias, grad_pos, grad_unk]) by autograd in ``dtype``."""
        leaves = [None if t is None else t.detach().clone().requires_grad_() for t in self.inputs(dtype)]
        tokens = _reference_tokens(*leaves, self.perm, self.mask)
        tokens.backward(self.grad.to(dtype))
        grads = [None if t is None else t.grad for t in leaves]
        if grads[4] is None and self.unk is not None:
            grads[4] = torch.zeros_like(leaves[4])
        return tokens.detach(), grads


SHAPES = [
    # batch, channels, height, width, patch, dim
    (2, 3, 12, 9, 3, 7),  # 4x3 grid, odd dim
    (1, 1, 5, 5, 1, 4),  # P=1, C=1, batch 1
    (3, 5, 8, 8, 8, 16),  # 1x1 grid, C=5
    (2, 2, 7, 11, 3, 5),  # H, W not multiples of P: trailing pixels are not patches
    (2, 3, 32, 48, 16, 24),  # 2x3 grid, ViT-sized patches
    (3, 4, 6, 30, 3, 9),  # 2x10 grid
    (4, 3, 32, 32, 4, 384),  # B*N*K*D above 2**22: the float32 weight gradient through convolution_backward
]
SHAPE_IDS = ["grid4x3", "P1C1B1", "grid1x1", "ragged", "P16", "grid2x10", "conv-weight-grad"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("jigsaw", [True, False], ids=["jigsaw", "plain"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_patch_embed_float32_matches_reference(shape, jigsaw, device):
    case = Case(*shape, jigsaw=jigsaw, seed=sum(shape), device=device)
    expected, expected_grads = case.reference(torch.float64)
    tokens = case.forward(torch.float32)
    assert tokens.dtype == torch.float32 and tokens.shape == (shape[0], case.positions, shape[5])
    torch.testing.assert_close(tokens.double(), expected, rtol=1e-5, atol=1e-5)
    grads = case.backward(torch.float32)
    assert len(grads) == 6 and grads[5] is None  # no grad_prefix asked for
    names = ["grad_images", "grad_weight", "grad_bias", "grad_pos", "grad_unk"]
    for name, grad, want in zip(names, grads, expected_grads):
        assert grad is not None and grad.dtype == torch.float32, name
        assert grad.shape == want.shape, name
        torch.testing.assert_close(grad.double(), want, rtol=1e-5, atol=1e-4, msg=name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[3]], ids=[SHAPE_IDS[0], SHAPE_IDS[3]])
def test_patch_embed_float64_matches_reference(shape, device):
    case = Case(*shape, seed=5, device=device)
    expected, expected_grads = case.reference(torch.float64)
    torch.testing.assert_close(case.forward(torch.float64), expected, rtol=1e-12, atol=1e-12)
    for grad, want in zip(case.backward(torch.float64), expected_grads, strict=False):
        assert grad.dtype == torch.float64
        torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2], SHAPES[4]], ids=[SHAPE_IDS[0], SHAPE_IDS[2], SHAPE_IDS[4]])
def test_patch_embed_low_precision_within_twice_torch_error(shape, dtype, device):
    case = Case(*shape, seed=7, device=device)
    exact, exact_grads = case.reference(torch.float64)
    in_dtype, in_dtype_grads = case.reference(dtype)
    tokens, grads = case.forward(dtype), case.backward(dtype)[:5]
    assert tokens.dtype == dtype and all(g.dtype == dtype for g in grads)

    def error(value, want):
        return (value.double() - want).abs().max().item()

    # One ulp of the result's magnitude as a floor: torch may be exact by luck on tiny problems.
    ulp = torch.finfo(dtype).eps
    assert error(tokens, exact) <= 2 * error(in_dtype, exact) + ulp * exact.abs().max().item()
    for name, grad, torch_grad, want in zip(
        ["images", "weight", "bias", "pos", "unk"], grads, in_dtype_grads, exact_grads
    ):
        budget = 2 * error(torch_grad, want) + ulp * want.abs().max().item()
        assert error(grad, want) <= budget, f"grad_{name}"


@pytest.mark.parametrize("device", DEVICES)
def test_patch_embed_optional_inputs_and_requested_grads(device):
    case = Case(2, 3, 12, 9, 3, 7, bias=False, device=device)
    x, w, _, p, u = case.inputs(torch.float32)
    expected = _reference_tokens(
        *[t.double() if t is not None else None for t in (x, w, None, p, u)], case.perm, case.mask
    )
    torch.testing.assert_close(
        _C.patch_embed_forward(x, w, None, p, u, case.perm, case.mask).double(), expected, rtol=1e-5, atol=1e-5
    )
    # perm without mask: shuffled patches, position embeddings everywhere.
    expected = _reference_tokens(x.double(), w.double(), None, p.double(), None, case.perm, None)
    torch.testing.assert_close(
        _C.patch_embed_forward(x, w, None, p, None, case.perm, None).double(), expected, rtol=1e-5, atol=1e-5
    )
    # Only what is asked for comes back.
    for needs in [(False,) * 5, (True, False, False, False, False), (False, False, True, False, True)]:
        grads = case.backward(torch.float32, needs)
        assert [g is not None for g in grads] == [*needs, False]


@pytest.mark.parametrize("device", DEVICES)
def test_patch_embed_strided_images(device):
    case = Case(2, 3, 12, 9, 3, 7, device=device)
    images = case.images.float()
    expected = case.forward(torch.float32)
    padded = torch.zeros(2, 3, 14, 12, device=device)
    padded[:, :, 1:13, 2:11] = images
    views = {
        "cropped view": padded[:, :, 1:13, 2:11],
        "channels_last": images.contiguous(memory_format=torch.channels_last),
        "transposed twice": images.transpose(2, 3).contiguous().transpose(2, 3),
    }
    for name, view in views.items():
        assert not view.is_contiguous(), name
        torch.testing.assert_close(case.forward(torch.float32, images=view), expected, rtol=0, atol=0, msg=name)
        _, w, *_ = case.inputs(torch.float32)
        weight_grad = _C.patch_embed_backward(
            case.grad.float(), view, w, case.perm, case.mask, False, True, False, False, False
        )[1]
        torch.testing.assert_close(weight_grad, case.backward(torch.float32)[1], rtol=1e-6, atol=1e-6, msg=name)


def test_patch_embed_gradient_sums_are_deterministic():
    case = Case(16, 3, 32, 32, 4, 40, seed=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = case.backward(torch.float32, (False, False, True, True, True))
        torch.set_num_threads(max(2, threads))
        many = case.backward(torch.float32, (False, False, True, True, True))
        again = case.backward(torch.float32, (False, False, True, True, True))
    finally:
        torch.set_num_threads(threads)
    for a, b, c in zip(one[2:5], many[2:5], again[2:5]):
        assert torch.equal(a, b) and torch.equal(b, c)


def test_patch_embed_empty_batch():
    case = Case(1, 3, 12, 9, 3, 7)
    x, w, b, p, u = case.inputs(torch.float32)
    tokens = _C.patch_embed_forward(x[:0], w, b, p, u, None, None)
    assert tokens.shape == (0, 12, 7)
    grads = _C.patch_embed_backward(tokens, x[:0], w, None, None, True, True, True, True, True)
    assert grads[0].shape == (0, 3, 12, 9)
    assert bool((grads[1] == 0).all()) and bool((grads[2] == 0).all()) and bool((grads[3] == 0).all())


def test_patch_embed_rejects_bad_arguments():
    case = Case(2, 3, 12, 9, 3, 7)
    x, w, b, p, u = case.inputs(torch.float32)
    good = (x, w, b, p, u, case.perm, case.mask)
    _C.patch_embed_forward(*good)
    bad_cases = {
        "3-d images": (x[0], w, b, p, u, case.perm, case.mask),
        "channel mismatch": (x[:, :2], w, b, p, u, case.perm, case.mask),
        "non-square kernel": (x, w[:, :, :, :2], b, p, u, case.perm, case.mask),
        "int images": (x.int(), w.int(), b.int(), p.int(), u.int(), case.perm, case.mask),
        "mixed dtypes": (x, w.half(), b, p, u, case.perm, case.mask),
        "pos too short": (x, w, b, p[:-1], u, case.perm, case.mask),
        "bias wrong size": (x, w, b[:-1], p, u, case.perm, case.mask),
        "perm int32": (x, w, b, p, u, case.perm.int(), case.mask),
        "perm wrong size": (x, w, b, p, u, case.perm[:1], case.mask),
        "mask not bool": (x, w, b, p, u, case.perm, case.mask.int()),
    }
    for name, args in bad_cases.items():
        with pytest.raises(RuntimeError):
            _C.patch_embed_forward(*args)
            pytest.fail(name)
    grad = case.grad.float()
    with pytest.raises(RuntimeError):
        _C.patch_embed_backward(grad[:, :-1], x, w, case.perm, case.mask, True, True, True, True, True)


@pytest.mark.parametrize("shift", [100, -100])
def test_patch_embed_out_of_range_perm_moves_nothing(shift):
    """perm values are not checked by the kernels (that would need a sync on a GPU): an entry outside [0, N) shows a
    zero patch and gets no gradient, as every backend does (mjp_fast/_validate.py); it never touches other memory."""
    case = Case(2, 3, 12, 9, 3, 7)
    x, w, b, p, u = case.inputs(torch.float32)
    tokens = _C.patch_embed_forward(x, w, b, p, u, case.perm + shift, case.mask)
    expected = b + torch.where(case.mask[..., None], u, p.reshape(-1, 7))
    torch.testing.assert_close(tokens, expected)
    grads = _C.patch_embed_backward(
        case.grad.float(), x, w, case.perm + shift, case.mask, True, True, False, False, False
    )
    assert not grads[0].any() and not grads[1].any()


# ----------------------------------------------------------------------------------------------------------------
# Patch embedding with prefix tokens
# ----------------------------------------------------------------------------------------------------------------


class PrefixCase(Case):
    """A patch-embedding problem with P prefix (class, register) tokens written in front of each sample's patch
    tokens, Q of them (0 or P) with rows of their own in front of the position table: the prefix shaped [1, P, D]
    (``3d``, timm's cls_token) or [P, D], the table [1, Q + N, D] or [Q + N, D]. mask_kind: ``none`` (no jigsaw),
    ``some`` (a random jigsaw) or ``all`` (every position masked, all shuffled)."""

    def __init__(
        self,
        *shape,
        prefix_count,
        prefix_positions,
        prefix_shape="3d",
        table="3d",
        mask_kind="some",
        seed=0,
        device="cpu",
    ):
        super().__init__(*shape, jigsaw=mask_kind != "none", seed=seed, device=device)
        batch, dim = shape[0], shape[5]
        g = torch.Generator().manual_seed(seed + 1)
        self.prefix_count, self.prefix_positions = prefix_count, prefix_positions
        self.table = torch.cat(
            (torch.randn(prefix_positions, dim, generator=g, dtype=torch.float64).to(device), self.pos)
        )
        self.table = self.table[None] if table == "3d" else self.table
        self.prefix = None
        if prefix_count:
            self.prefix = torch.randn(prefix_count, dim, generator=g, dtype=torch.float64).to(device)
            self.prefix = self.prefix[None] if prefix_shape == "3d" else self.prefix
        if mask_kind == "all":
            self.mask = torch.ones(batch, self.positions, dtype=torch.bool, device=device)
            self.perm = torch.rand(batch, self.positions, generator=g).argsort(1).to(device)
        self.grad = torch.randn(batch, prefix_count + self.positions, dim, generator=g, dtype=torch.float64).to(device)

    def inputs(self, dtype):
        """images, weight, bias, the whole table, unk_embed, prefix (or None), in ``dtype``."""
        cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
        return tuple(cast(t) for t in (self.images, self.weight, self.bias, self.table, self.unk, self.prefix))

    def forward(self, dtype):
        x, w, b, table, u, prefix = self.inputs(dtype)
        return _C.patch_embed_forward(x, w, b, table, u, self.perm, self.mask, prefix, self.prefix_positions)

    def backward(self, dtype, needs=(True,) * 6, shapes=True):
        x, w, *_ = self.inputs(dtype)
        pos_shape = list(self.table.shape) if shapes else None
        prefix_shape = list(self.prefix.shape) if shapes and self.prefix is not None else None
        return _C.patch_embed_backward(
            self.grad.to(dtype),
            x,
            w,
            self.perm,
            self.mask,
            *needs,
            self.prefix_count,
            self.prefix_positions,
            pos_shape,
            prefix_shape,
        )

    def reference(self, dtype):
        """(out, [grad_images, grad_weight, grad_bias, grad_pos, grad_unk, grad_prefix]) by autograd in ``dtype``."""
        leaves = [None if t is None else t.detach().clone().requires_grad_() for t in self.inputs(dtype)]
        x, w, b, table, u, prefix = leaves
        out = _reference_tokens(x, w, b, table, u, self.perm, self.mask, prefix, self.prefix_positions)
        out.backward(self.grad.to(dtype))
        grads = [None if t is None else t.grad for t in leaves]
        if grads[4] is None and self.unk is not None:
            grads[4] = torch.zeros_like(leaves[4])
        return out.detach(), grads


# (P, Q, prefix shape, table shape)
PREFIX_LAYOUTS = [(0, 0, None, table) for table in ("3d", "2d")] + [
    (prefix, positions, prefix_shape, table)
    for prefix in (1, 3)
    for positions in (0, prefix)
    for prefix_shape in ("3d", "2d")
    for table in ("3d", "2d")
]
# batch, channels, height, width, patch, dim: odd N (3x5, 1x3) and D
# Batch 4: B*N*K*D above 2**22, where the float32 weight gradient goes through convolution_backward.
PREFIX_SHAPES = {1: (1, 2, 9, 15, 3, 7), 3: (3, 3, 3, 9, 3, 5), 4: (4, 3, 32, 32, 4, 384)}


def _layout_id(layout):
    prefix, positions, prefix_shape, table = layout
    return f"P{prefix}-Q{positions}-prefix{prefix_shape}-table{table}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mask_kind", ["none", "some", "all"])
@pytest.mark.parametrize("batch", [1, 3, 4])
@pytest.mark.parametrize("layout", PREFIX_LAYOUTS, ids=_layout_id)
def test_patch_embed_with_prefix_matches_reference(layout, batch, mask_kind, dtype, device):
    prefix_count, positions, prefix_shape, table = layout
    case = PrefixCase(
        *PREFIX_SHAPES[batch],
        prefix_count=prefix_count,
        prefix_positions=positions,
        prefix_shape=prefix_shape,
        table=table,
        mask_kind=mask_kind,
        seed=batch,
        device=device,
    )
    exact, exact_grads = case.reference(torch.float64)
    out, grads = case.forward(dtype), case.backward(dtype)
    assert out.dtype == dtype and out.shape == (batch, prefix_count + case.positions, case.dim)
    if prefix_count == 0:
        assert grads[5].shape == (0,)
        grads, exact_grads = grads[:5], exact_grads[:5]
    names = ["images", "weight", "bias", "pos", "unk", "prefix"]
    for name, grad, want in zip(names, grads, exact_grads):
        # The gradients come in the inputs' own shapes (the whole table, the prefix as given) and dtype.
        assert grad.dtype == dtype and grad.shape == want.shape, name
    if dtype == torch.float64:
        torch.testing.assert_close(out, exact, rtol=1e-12, atol=1e-12)
        for name, grad, want in zip(names, grads, exact_grads):
            torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-12, msg=f"grad_{name}")
    elif dtype == torch.float32:
        torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5)
        for name, grad, want in zip(names, grads, exact_grads):
            torch.testing.assert_close(grad.double(), want, rtol=1e-5, atol=1e-4, msg=f"grad_{name}")
    else:
        in_dtype, in_dtype_grads = case.reference(dtype)
        ulp = torch.finfo(dtype).eps

        def within_budget(value, torch_value, want):
            error = lambda v: (v.double() - want).abs().max().item() if want.numel() else 0.0  # noqa: E731
            return error(value) <= 2 * error(torch_value) + ulp * (want.abs().max().item() if want.numel() else 0.0)

        assert within_budget(out, in_dtype, exact)
        for name, grad, torch_grad, want in zip(names, grads, in_dtype_grads, exact_grads):
            assert within_budget(grad, torch_grad, want), f"grad_{name}"
    # The prefix rows are the prefix plus its position rows (exact), the same in every sample.
    if prefix_count:
        head = case.prefix.reshape(prefix_count, -1).to(dtype)
        head = head + F.pad(case.table.reshape(-1, case.dim)[:positions].to(dtype), (0, 0, 0, prefix_count - positions))
        assert torch.equal(out[:, :prefix_count], head.expand(batch, -1, -1))


@pytest.mark.parametrize("device", DEVICES)
def test_patch_embed_prefix_requested_grads_and_default_shapes(device):
    case = PrefixCase(3, 3, 9, 6, 3, 5, prefix_count=3, prefix_positions=3, device=device, seed=4)
    full = case.backward(torch.float64)
    # Only what is asked for comes back, and each part alone equals the same part of the full backward.
    for index in range(6):
        needs = [index == other for other in range(6)]
        grads = case.backward(torch.float64, needs)
        assert [g is not None for g in grads] == needs
        torch.testing.assert_close(grads[index], full[index], rtol=1e-12, atol=1e-12)
    # Without the shapes: grad_pos [Q + N, D], grad_prefix [P, D].
    grads = case.backward(torch.float64, shapes=False)
    assert grads[3].shape == (3 + case.positions, case.dim) and grads[5].shape == (3, case.dim)
    torch.testing.assert_close(grads[3], full[3][0])
    torch.testing.assert_close(grads[5], full[5][0])
    # The old calls (no prefix arguments) keep working, and a prefix gradient asked for without prefix tokens is empty.
    plain = Case(3, 3, 9, 6, 3, 5, seed=4, device=device)
    x, w, b, p, u = plain.inputs(torch.float32)
    assert _C.patch_embed_forward(x, w, b, p, u, plain.perm, plain.mask).shape == (3, plain.positions, 5)
    grads = _C.patch_embed_backward(
        plain.grad.float(), x, w, plain.perm, plain.mask, True, True, True, True, True, True
    )
    assert len(grads) == 6 and grads[5].shape == (0,)


def test_patch_embed_prefix_gradient_sums_are_deterministic():
    case = PrefixCase(16, 3, 32, 32, 4, 40, prefix_count=5, prefix_positions=5, seed=3)
    needs = (False, False, True, True, True, True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = case.backward(torch.float32, needs)
        torch.set_num_threads(max(2, threads))
        many = case.backward(torch.float32, needs)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one[2:], many[2:]):
        assert torch.equal(a, b)


def test_patch_embed_rejects_bad_prefix_arguments():
    case = PrefixCase(2, 3, 12, 9, 3, 7, prefix_count=2, prefix_positions=2)
    x, w, b, table, u, prefix = case.inputs(torch.float32)
    good = dict(
        images=x,
        weight=w,
        bias=b,
        pos_embed=table,
        unk_embed=u,
        perm=case.perm,
        mask=case.mask,
        prefix=prefix,
        prefix_positions=2,
    )
    _C.patch_embed_forward(**good)
    _C.patch_embed_forward(**{**good, "pos_embed": table[:, 2:], "prefix_positions": 0})
    bad_cases = {
        "prefix numel not a multiple of D": dict(prefix=torch.randn(1, 2, 6)),
        "prefix dtype": dict(prefix=prefix.double()),
        "Q not in {0, P}": dict(prefix_positions=1),
        "Q > P": dict(prefix_positions=3),
        "Q without prefix": dict(prefix=None),
        "table rows Q + N - 1": dict(pos_embed=table[:, 1:]),
        "table rows Q + N + 1": dict(pos_embed=torch.randn(1, 15, 7)),
        "table rows N with Q = P": dict(pos_embed=table[:, 2:]),
        "two tables": dict(pos_embed=torch.cat((table, table))),
        "flat table": dict(pos_embed=table.flatten()),
    }
    for name, bad in bad_cases.items():
        with pytest.raises(RuntimeError):
            _C.patch_embed_forward(**{**good, **bad})
            pytest.fail(name)
    grad = case.grad.float()
    good = dict(
        grad_out=grad,
        images=x,
        weight=w,
        perm=case.perm,
        mask=case.mask,
        need_images=True,
        need_weight=True,
        need_bias=True,
        need_pos=True,
        need_unk=True,
        need_prefix=True,
        prefix_count=2,
        prefix_positions=2,
        pos_shape=list(table.shape),
        prefix_shape=list(prefix.shape),
    )
    _C.patch_embed_backward(**good)
    bad_cases = {
        "grad_out without prefix rows": dict(grad_out=grad[:, 2:]),
        "prefix_count": dict(prefix_count=3),
        "negative prefix_count": dict(prefix_count=-1),
        "Q not in {0, P}": dict(prefix_positions=1),
        "pos_shape rows": dict(pos_shape=[1, 13, 7]),
        "pos_shape 1-d": dict(pos_shape=[14 * 7]),
        "pos_shape two tables": dict(pos_shape=[2, 14, 7]),
        "prefix_shape": dict(prefix_shape=[1, 3, 7]),
    }
    for name, bad in bad_cases.items():
        with pytest.raises(RuntimeError):
            _C.patch_embed_backward(**{**good, **bad})
            pytest.fail(name)


def test_has_cuda_reports_a_bool():
    assert isinstance(_C.has_cuda(), bool)
