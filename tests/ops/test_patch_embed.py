import pytest
import torch

import mjp_fast
from mjp_fast.ops.patch_embed import mjp_patch_embed_ref
from tests.conftest import backends_for

# (batch, channels, patch, rows, cols, dim): awkward on purpose
SHAPES = [
    (2, 3, 4, 3, 5, 7),
    (1, 1, 1, 1, 1, 1),
    (3, 5, 3, 2, 7, 9),
    (1, 3, 2, 1, 6, 4),
    (4, 2, 5, 4, 4, 16),
]

TOLERANCES = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float64: dict(atol=1e-10, rtol=1e-10)}


def make_inputs(shape, dtype=torch.float32, device="cpu", *, seed=0, bias=True, ratio=0.5, requires_grad=False):
    batch, channels, patch, rows, cols, dim = shape
    generator = torch.Generator().manual_seed(seed)

    def randn(*size):
        return torch.randn(*size, generator=generator).to(dtype=dtype, device=device).requires_grad_(requires_grad)

    images = randn(batch, channels, rows * patch, cols * patch)
    weight = randn(dim, channels, patch, patch)
    bias_tensor = randn(dim) if bias else None
    pos_embed = randn(rows * cols, dim)
    unk_embed = randn(dim)
    jigsaw = mjp_fast.sample_jigsaw(batch, (rows, cols), ratio, seed=seed, min_block=1, device=device)
    return images, weight, bias_tensor, pos_embed, unk_embed, jigsaw


def relative_error(value, reference):
    return ((value.float() - reference.float()).abs().max() / reference.float().abs().max().clamp_min(1e-6)).item()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_jigsaw", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_forward_matches_the_oracle(shape, with_jigsaw, bias, backend_device):
    backend, device = backend_device
    images, weight, bias_t, pos, unk, jigsaw = make_inputs(shape, device=device, bias=bias)
    jigsaw = jigsaw if with_jigsaw else None
    expected = mjp_patch_embed_ref(images, weight, bias_t, pos, unk, jigsaw)
    got = mjp_fast.mjp_patch_embed(images, weight, bias_t, pos, unk, jigsaw, backend=backend)
    assert got.shape == (shape[0], shape[3] * shape[4], shape[5])
    torch.testing.assert_close(got, expected, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("shape", SHAPES)
def test_gradients_match_the_oracle(shape, backend_device):
    backend, device = backend_device
    inputs = make_inputs(shape, device=device, requires_grad=True)
    *tensors, jigsaw = inputs
    grad_out = torch.randn(shape[0], shape[3] * shape[4], shape[5], device=device)

    def grads(function, **kwargs):
        out = function(*tensors, jigsaw, **kwargs)
        return torch.autograd.grad(out, tensors, grad_out)

    expected = grads(mjp_patch_embed_ref)
    got = grads(mjp_fast.mjp_patch_embed, backend=backend)
    for name, g, e in zip(["images", "weight", "bias", "pos_embed", "unk_embed"], got, expected):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4, msg=lambda m, name=name: f"grad of {name}: {m}")


def test_gradcheck_in_double(backend_device):
    backend, device = backend_device
    *tensors, jigsaw = make_inputs((2, 2, 2, 2, 3, 3), dtype=torch.float64, device=device, requires_grad=True)
    if backend == "triton":  # tl.dot has no float64: refused clearly, checked in float32 by the tests above
        with pytest.raises(TypeError, match="float64"):
            mjp_fast.mjp_patch_embed(*tensors, jigsaw, backend=backend)
        return

    def function(*args):
        return mjp_fast.mjp_patch_embed(*args, jigsaw, backend=backend)

    assert torch.autograd.gradcheck(function, tuple(tensors))


def test_only_requested_gradients_flow(backend_device):
    backend, device = backend_device
    images, weight, bias, pos, unk, jigsaw = make_inputs(SHAPES[0], device=device)
    weight.requires_grad_(True)
    out = mjp_fast.mjp_patch_embed(images, weight, bias, pos, unk, jigsaw, backend=backend)
    out.sum().backward()
    assert weight.grad is not None and images.grad is None and pos.grad is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_within_twice_the_torch_error(dtype, backend_device):
    backend, device = backend_device
    shape = (2, 3, 4, 3, 5, 32)
    *tensors, jigsaw = make_inputs(shape, dtype=dtype, device=device, requires_grad=True)
    grad_out = torch.randn(shape[0], 15, shape[5], device=device).to(dtype)
    reference_out = mjp_patch_embed_ref(*tensors, jigsaw, upcast=True)
    reference_grads = torch.autograd.grad(reference_out, tensors, grad_out)
    torch_out = mjp_patch_embed_ref(*tensors, jigsaw)
    torch_grads = torch.autograd.grad(torch_out, tensors, grad_out)
    got = mjp_fast.mjp_patch_embed(*tensors, jigsaw, backend=backend)
    got_grads = torch.autograd.grad(got, tensors, grad_out)
    assert got.dtype == dtype
    floor = torch.finfo(dtype).eps  # both errors can be tiny: allow one rounding step of the dtype
    assert relative_error(got, reference_out) <= 2 * relative_error(torch_out, reference_out) + floor
    for g, t, r in zip(got_grads, torch_grads, reference_grads):
        assert g.dtype == dtype
        assert relative_error(g, r) <= 2 * relative_error(t, r) + floor


def test_non_contiguous_and_batched_pos_embed(backend_device):
    backend, device = backend_device
    images, weight, bias, pos, unk, jigsaw = make_inputs((2, 3, 4, 3, 5, 7), device=device)
    wide = torch.randn(2, 3, 12, 40, device=device)
    strided = wide[:, :, :, ::2]  # non-contiguous view
    assert not strided.is_contiguous()
    expected = mjp_patch_embed_ref(strided.contiguous(), weight, bias, pos, unk, jigsaw)
    got = mjp_fast.mjp_patch_embed(strided, weight, bias, pos[None], unk, jigsaw, backend=backend)
    torch.testing.assert_close(got, expected, **TOLERANCES[torch.float32])
    channels_last = strided.contiguous(memory_format=torch.channels_last)
    got = mjp_fast.mjp_patch_embed(channels_last, weight, bias, pos, unk, jigsaw, backend=backend)
    torch.testing.assert_close(got, expected, **TOLERANCES[torch.float32])


def test_no_jigsaw_equals_timm_patch_embed_plus_position(backend_device):
    timm_layers = pytest.importorskip("timm.layers")
    backend, device = backend_device
    layer = timm_layers.PatchEmbed(img_size=32, patch_size=8, in_chans=3, embed_dim=24).to(device)
    pos = torch.randn(1, 16, 24, device=device)
    images = torch.randn(3, 3, 32, 32, device=device)
    expected = layer(images) + pos
    got = mjp_fast.mjp_patch_embed(images, layer.proj.weight, layer.proj.bias, pos, None, backend=backend)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_masked_tokens_carry_unk_and_shuffled_patches():
    images, weight, bias, pos, unk, jigsaw = make_inputs((3, 3, 4, 4, 4, 5), ratio=0.5)
    tokens = mjp_fast.mjp_patch_embed(images, weight, bias, pos, unk, jigsaw, backend="torch")
    plain = mjp_fast.mjp_patch_embed(images, weight, bias, pos, unk, None, backend="torch")
    content = plain - pos  # the patch term of each original position
    for b in range(3):
        for n in range(16):
            source = jigsaw.perm[b, n]
            position_term = unk if jigsaw.mask[b, n] else pos[n]
            torch.testing.assert_close(tokens[b, n], content[b, source] + position_term)


# -- bad input ---------------------------------------------------------------------------------------------------


def _call(**overrides):
    images, weight, bias, pos, unk, jigsaw = make_inputs((2, 3, 4, 3, 5, 7))
    arguments = dict(images=images, weight=weight, bias=bias, pos_embed=pos, unk_embed=unk, jigsaw=jigsaw)
    arguments.update(overrides)
    return mjp_fast.mjp_patch_embed(**arguments)


def _bad_perm(kind):
    images, weight, bias, pos, unk, jigsaw = make_inputs((2, 3, 4, 3, 5, 7), ratio=0.6)
    mask, perm = jigsaw.mask.clone(), jigsaw.perm.clone()
    masked = torch.nonzero(mask[0]).flatten()
    unmasked = torch.nonzero(~mask[0]).flatten()
    if kind == "repeat":
        perm[0, masked[0]] = perm[0, masked[1]]
    elif kind == "moves_unmasked":
        perm[0, unmasked[0]], perm[0, masked[0]] = masked[0], unmasked[0]
    else:
        perm[0, masked[0]] = 15
    return mjp_fast.Jigsaw(mask, perm)


@pytest.mark.parametrize(
    "overrides, error, words",
    [
        (dict(images=torch.randn(2, 3, 13, 20)), ValueError, "multiple"),
        (dict(images=torch.randn(2, 4, 12, 20)), ValueError, "channels"),
        (dict(images=torch.randn(3, 12, 20)), ValueError, "images"),
        (dict(images=torch.zeros(2, 3, 12, 20, dtype=torch.int64)), TypeError, "images"),
        (dict(images=[[1.0]]), TypeError, "images"),
        (dict(weight=torch.randn(7, 3, 4, 3)), ValueError, "weight"),
        (dict(bias=torch.randn(6)), ValueError, "bias"),
        (dict(pos_embed=torch.randn(16, 7)), ValueError, "pos_embed"),
        (dict(pos_embed=torch.randn(2, 15, 7)), ValueError, "pos_embed"),
        (dict(unk_embed=torch.randn(8)), ValueError, "unk_embed"),
        (dict(unk_embed=None), ValueError, "unk_embed"),
        (dict(pos_embed=torch.randn(15, 7, dtype=torch.float64)), TypeError, "pos_embed"),
        (dict(jigsaw=(torch.zeros(2, 15, dtype=torch.bool),)), TypeError, "jigsaw"),
        (
            dict(jigsaw=mjp_fast.Jigsaw(torch.zeros(3, 15, dtype=torch.bool), torch.zeros(3, 15).long())),
            ValueError,
            "jigsaw.mask",
        ),
        (dict(jigsaw=mjp_fast.Jigsaw(torch.zeros(2, 15), torch.arange(15).repeat(2, 1))), TypeError, "jigsaw.mask"),
        (
            dict(jigsaw=mjp_fast.Jigsaw(torch.zeros(2, 15, dtype=torch.bool), torch.zeros(2, 15))),
            TypeError,
            "jigsaw.perm",
        ),
        (dict(jigsaw=_bad_perm("repeat")), ValueError, "permutation"),
        (dict(jigsaw=_bad_perm("moves_unmasked")), ValueError, "identity"),
        (dict(jigsaw=_bad_perm("out_of_range")), ValueError, "outside"),
        (dict(backend="nope"), ValueError, "backend"),
    ],
)
def test_bad_arguments_are_named(overrides, error, words):
    with pytest.raises(error, match=words):
        _call(**overrides)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_mixed_devices_are_refused():
    with pytest.raises(ValueError, match="mixed devices"):
        _call(pos_embed=torch.randn(15, 7, device="cuda"))


# -- triton: the position gradients with the batch split into chunks ---------------------------------------------

TRITON_ON_CPU = "triton" in backends_for("cpu")


def _force_batch_chunks(monkeypatch, chunks=3):
    """The triton backward plans with the GPU's tiles and ``chunks`` batch chunks (the interpreter's plan has one)."""
    from mjp_fast.triton import common as kernels

    def plan(grad, **flags):
        batch, num_positions, dim = grad.shape
        return kernels.position_gradient_plan(batch, num_positions, dim, grad.dtype, 132, False, chunks=chunks, **flags)

    monkeypatch.setattr(kernels, "_position_plan", plan)


def _with_masking(jigsaw, masked, seed):
    """The jigsaw as sampled ("some"), none (None), or every position masked and permuted at random ("all")."""
    if masked == "some":
        return jigsaw
    if masked == "no jigsaw":
        return None
    batch, num_positions = jigsaw.mask.shape
    generator = torch.Generator().manual_seed(seed)
    perm = torch.stack([torch.randperm(num_positions, generator=generator) for _ in range(batch)])
    return mjp_fast.Jigsaw(torch.ones(batch, num_positions, dtype=torch.bool), perm)


@pytest.mark.skipif(not TRITON_ON_CPU, reason="needs the triton backend (the interpreter here)")
@pytest.mark.parametrize("masked", ["some", "all", "no jigsaw"])
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[2], (10, 2, 2, 3, 5, 24)])
def test_triton_position_gradients_in_batch_chunks_match_the_oracle(shape, masked, monkeypatch):
    _force_batch_chunks(monkeypatch)
    *tensors, jigsaw = make_inputs(shape, requires_grad=True)
    jigsaw = _with_masking(jigsaw, masked, seed=shape[0])
    grad_out = torch.randn(shape[0], shape[3] * shape[4], shape[5], generator=torch.Generator().manual_seed(1))
    # without a jigsaw the oracle does not use unk_embed: its gradient is zero
    expected = torch.autograd.grad(mjp_patch_embed_ref(*tensors, jigsaw), tensors, grad_out, allow_unused=True)
    expected = [torch.zeros_like(t) if e is None else e for e, t in zip(expected, tensors)]
    got = torch.autograd.grad(mjp_fast.mjp_patch_embed(*tensors, jigsaw, backend="triton"), tensors, grad_out)
    for name, g, e in zip(["images", "weight", "bias", "pos_embed", "unk_embed"], got, expected):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4, msg=lambda m, name=name: f"grad of {name}: {m}")


@pytest.mark.skipif(not TRITON_ON_CPU, reason="needs the triton backend (the interpreter here)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_half_precision_position_gradients_in_batch_chunks(dtype, monkeypatch):
    _force_batch_chunks(monkeypatch)
    shape = (10, 3, 4, 3, 5, 32)
    *tensors, jigsaw = make_inputs(shape, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(shape[0], 15, shape[5], generator=torch.Generator().manual_seed(2)).to(dtype)
    reference = torch.autograd.grad(mjp_patch_embed_ref(*tensors, jigsaw, upcast=True), tensors, grad_out)
    torch_grads = torch.autograd.grad(mjp_patch_embed_ref(*tensors, jigsaw), tensors, grad_out)
    got = torch.autograd.grad(mjp_fast.mjp_patch_embed(*tensors, jigsaw, backend="triton"), tensors, grad_out)
    floor = torch.finfo(dtype).eps
    for g, t, r in list(zip(got, torch_grads, reference))[2:]:  # bias, pos_embed, unk_embed
        assert g.dtype == dtype
        assert relative_error(g, r) <= 2 * relative_error(t, r) + floor
    first = torch.autograd.grad(mjp_fast.mjp_patch_embed(*tensors, jigsaw, backend="triton"), tensors, grad_out)
    for g, again in zip(got, first):
        assert torch.equal(g, again)  # deterministic
