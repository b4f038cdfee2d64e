"""mjp_fast/ops/gathered_patch_embed.py: the gathered (pre-patchified, NaFlex) patch embedding against its oracle, on
every backend (``cpu`` and ``cuda`` run the ``torch`` computation), forward and every gradient, awkward shapes,
per-sample and shared position terms, all / some / no positions masked, padding rows, prefix rows, half precision,
``validate=False``'s out-of-range rows, the operator's registration, and bad input."""

from __future__ import annotations

import pytest
import torch

from mjp_fast import Jigsaw
from mjp_fast.ops.gathered_patch_embed import mjp_gathered_patch_embed, mjp_gathered_patch_embed_ref
from tests.conftest import backends_for

# (batch, N, K, D, prefix P): N, K and D off the kernels' tiles (16 in the interpreter) on purpose
SHAPES = [
    (2, 7, 12, 9, 0),
    (1, 1, 1, 1, 0),
    (3, 19, 33, 17, 1),
    (1, 23, 48, 40, 5),
    (4, 5, 20, 16, 4),
]
NAMES = ["patches", "weight", "bias", "pos", "unk_embed", "prefix"]
TOLERANCE = dict(atol=1e-4, rtol=1e-4)
TRITON_ON_CPU = "triton" in backends_for("cpu")


def naflex_jigsaw(batch: int, length: int, masked: str, *, seed: int, valid: list[int] | None = None) -> Jigsaw | None:
    """A jigsaw as the NaFlex front end makes them: in each sample, of its first ``valid[b]`` rows (the rest padding:
    never masked nor moved) ``masked`` ones ("some": about half, "all", "none") are masked and permuted among
    themselves at random; "no jigsaw": None."""
    if masked == "no jigsaw":
        return None
    generator = torch.Generator().manual_seed(seed)
    valid = valid if valid is not None else [length] * batch
    mask = torch.zeros(batch, length, dtype=torch.bool)
    perm = torch.arange(length).repeat(batch, 1)
    for sample in range(batch):
        count = valid[sample]
        if masked == "all":
            chosen = torch.arange(count)
        elif masked == "some":
            chosen = torch.nonzero(torch.rand(count, generator=generator) < 0.5).flatten()
        else:
            chosen = torch.arange(0)
        mask[sample, chosen] = True
        perm[sample, chosen] = chosen[torch.randperm(len(chosen), generator=generator)]
    return Jigsaw(mask, perm)


def make_inputs(shape, *, per_sample=True, dtype=torch.float32, device="cpu", bias=True, seed=0, requires_grad=False):
    batch, length, k, dim, prefix_count = shape
    generator = torch.Generator().manual_seed(seed)

    def randn(*size):
        return torch.randn(*size, generator=generator).to(dtype=dtype, device=device).requires_grad_(requires_grad)

    pos = randn(batch, length, dim) if per_sample else randn(length, dim)
    prefix = randn(1, prefix_count, dim) if prefix_count else None
    return randn(batch, length, k), randn(dim, k), randn(dim) if bias else None, pos, randn(dim), prefix


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value.float() - reference.float()).abs().max() / reference.float().abs().max().clamp_min(1e-6)).item()


def _present(tensors):
    return [tensor for tensor in tensors if tensor is not None]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("per_sample", [True, False], ids=["per-sample pos", "shared pos"])
@pytest.mark.parametrize("masked", ["some", "all", "none", "no jigsaw"])
def test_forward_matches_the_oracle(shape, per_sample, masked, backend_device):
    backend, device = backend_device
    patches, weight, bias, pos, unk, prefix = make_inputs(shape, per_sample=per_sample, bias=shape[0] != 4)
    jigsaw = naflex_jigsaw(shape[0], shape[1], masked, seed=shape[1])
    expected = mjp_gathered_patch_embed_ref(patches, weight, bias, pos, unk, jigsaw, prefix=prefix)
    got = mjp_gathered_patch_embed(patches, weight, bias, pos, unk, jigsaw, prefix=prefix, backend=backend)
    assert got.shape == (shape[0], shape[4] + shape[1], shape[3]) and got.dtype == patches.dtype
    torch.testing.assert_close(got, expected, **TOLERANCE)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("per_sample", [True, False], ids=["per-sample pos", "shared pos"])
@pytest.mark.parametrize("masked", ["some", "all", "no jigsaw"])
def test_every_gradient_matches_the_oracle(shape, per_sample, masked, backend_device):
    backend, device = backend_device
    inputs = make_inputs(shape, per_sample=per_sample, requires_grad=True)
    patches, weight, bias, pos, unk, prefix = inputs
    jigsaw = naflex_jigsaw(shape[0], shape[1], masked, seed=shape[0])
    grad_out = torch.randn(shape[0], shape[4] + shape[1], shape[3], generator=torch.Generator().manual_seed(1))
    tensors = _present(inputs)
    # without a jigsaw the oracle leaves unk_embed out of its graph: its gradient is zeros
    expected = torch.autograd.grad(
        mjp_gathered_patch_embed_ref(*inputs[:5], jigsaw, prefix=prefix), tensors, grad_out, allow_unused=True
    )
    expected = [torch.zeros_like(t) if e is None else e for e, t in zip(expected, tensors)]
    got = torch.autograd.grad(
        mjp_gathered_patch_embed(*inputs[:5], jigsaw, prefix=prefix, backend=backend), tensors, grad_out,
        allow_unused=True,
    )  # fmt: skip
    got = [torch.zeros_like(t) if g is None else g for g, t in zip(got, tensors)]
    names = [name for name, tensor in zip(NAMES, inputs) if tensor is not None]
    for name, g, e in zip(names, got, expected):
        assert g.shape == e.shape, name
        torch.testing.assert_close(g, e, **TOLERANCE, msg=lambda m, name=name: f"grad of {name}: {m}")


@pytest.mark.parametrize("per_sample", [True, False], ids=["per-sample pos", "shared pos"])
def test_padding_rows_keep_their_row_and_position_and_masked_positions_get_no_position_gradient(
    per_sample, backend_device
):
    """NaFlex batches: samples with padding rows (never masked nor moved); the gradient of ``pos`` is zero at every
    masked position and ``unk_embed``'s is the sum of the output's gradient there."""
    backend, device = backend_device
    shape = (3, 18, 12, 24, 1)
    inputs = make_inputs(shape, per_sample=per_sample, requires_grad=True)
    patches, weight, bias, pos, unk, prefix = inputs
    jigsaw = naflex_jigsaw(3, 18, "some", seed=4, valid=[18, 7, 11])
    out = mjp_gathered_patch_embed(*inputs[:5], jigsaw, prefix=prefix, backend=backend)
    plain = mjp_gathered_patch_embed(*inputs[:5], None, prefix=prefix, backend=backend)
    for sample, count in enumerate([18, 7, 11]):
        torch.testing.assert_close(out[sample, 1 + count :], plain[sample, 1 + count :], rtol=0, atol=0)
    grad_out = torch.randn_like(out)
    grad_pos, grad_unk = torch.autograd.grad(out, (pos, unk), grad_out)
    patch_grads = grad_out[:, 1:]
    if per_sample:
        assert torch.equal(grad_pos[jigsaw.mask], torch.zeros_like(grad_pos[jigsaw.mask]))
        torch.testing.assert_close(grad_pos[~jigsaw.mask], patch_grads[~jigsaw.mask], rtol=0, atol=0)
    else:
        expected = (patch_grads * (~jigsaw.mask)[..., None]).sum(0)
        torch.testing.assert_close(grad_pos, expected, **TOLERANCE)
    torch.testing.assert_close(grad_unk, patch_grads[jigsaw.mask].sum(0), **TOLERANCE)


def test_the_jigsaw_moves_rows():
    """The definition, by hand: a masked token shows the row its perm names, plus unk_embed."""
    patches, weight, bias, pos, unk, _ = make_inputs((2, 9, 6, 5, 0))
    jigsaw = naflex_jigsaw(2, 9, "some", seed=3)
    assert jigsaw.mask.any() and not torch.equal(jigsaw.perm, torch.arange(9).repeat(2, 1))
    out = mjp_gathered_patch_embed(patches, weight, bias, pos, unk, jigsaw, backend="torch")
    for sample in range(2):
        for row in range(9):
            source = jigsaw.perm[sample, row]
            term = unk if jigsaw.mask[sample, row] else pos[sample, row]
            torch.testing.assert_close(out[sample, row], weight @ patches[sample, source] + bias + term)


def test_gradcheck_in_double(backend_device):
    backend, device = backend_device
    inputs = make_inputs((2, 5, 4, 3, 2), dtype=torch.float64, requires_grad=True)
    jigsaw = naflex_jigsaw(2, 5, "some", seed=1)
    if backend == "triton":  # no float64 GEMM in the kernels: refused by name, checked in float32 above
        with pytest.raises(TypeError, match="patches: the triton backend supports"):
            mjp_gathered_patch_embed(*inputs[:5], jigsaw, prefix=inputs[5], backend=backend)
        return

    def function(patches, weight, bias, pos, unk, prefix):
        return mjp_gathered_patch_embed(patches, weight, bias, pos, unk, jigsaw, prefix=prefix, backend=backend)

    assert torch.autograd.gradcheck(function, inputs)


def test_only_requested_gradients_flow(backend_device):
    backend, device = backend_device
    patches, weight, bias, pos, unk, prefix = make_inputs(SHAPES[2])
    weight.requires_grad_(True)
    out = mjp_gathered_patch_embed(
        patches, weight, bias, pos, unk, naflex_jigsaw(3, 19, "some", seed=0), prefix=prefix, backend=backend
    )
    out.sum().backward()
    assert weight.grad is not None and patches.grad is None and pos.grad is None and prefix.grad is None


def test_non_contiguous_patches(backend_device):
    backend, device = backend_device
    patches, weight, bias, pos, unk, prefix = make_inputs((2, 7, 12, 9, 1))
    wide = torch.randn(2, 24, 7).transpose(1, 2)  # [2, 7, 24] with K strided
    strided = wide[:, :, ::2]
    assert not strided.is_contiguous()
    jigsaw = naflex_jigsaw(2, 7, "some", seed=2)
    expected = mjp_gathered_patch_embed_ref(strided.contiguous(), weight, bias, pos, unk, jigsaw, prefix=prefix)
    got = mjp_gathered_patch_embed(strided, weight, bias, pos[None, 0], unk, jigsaw, prefix=prefix, backend=backend)
    expected_shared = mjp_gathered_patch_embed_ref(strided, weight, bias, pos[0], unk, jigsaw, prefix=prefix)
    torch.testing.assert_close(got, expected_shared, **TOLERANCE)
    got = mjp_gathered_patch_embed(strided, weight, bias, pos, unk, jigsaw, prefix=prefix, backend=backend)
    torch.testing.assert_close(got, expected, **TOLERANCE)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("per_sample", [True, False], ids=["per-sample pos", "shared pos"])
def test_half_precision_is_within_twice_the_torch_error(dtype, per_sample, backend_device):
    backend, device = backend_device
    shape = (3, 21, 48, 32, 2)
    inputs = make_inputs(shape, per_sample=per_sample, dtype=dtype, requires_grad=True)
    jigsaw = naflex_jigsaw(3, 21, "some", seed=5)
    tensors = _present(inputs)
    grad_out = torch.randn(3, 23, 32, generator=torch.Generator().manual_seed(2)).to(dtype)

    def run(function, **keywords):
        out = function(*inputs[:5], jigsaw, prefix=inputs[5], **keywords)
        return out, torch.autograd.grad(out, tensors, grad_out)

    reference, reference_grads = run(mjp_gathered_patch_embed_ref, upcast=True)
    torch_out, torch_grads = run(mjp_gathered_patch_embed_ref)
    got, got_grads = run(mjp_gathered_patch_embed, backend=backend)
    floor = torch.finfo(dtype).eps  # both errors can be tiny: allow one rounding step of the dtype
    assert got.dtype == dtype
    assert relative_error(got, reference) <= 2 * relative_error(torch_out, reference) + floor
    for name, g, t, r in zip(NAMES, got_grads, torch_grads, reference_grads):
        assert g.dtype == dtype, name
        assert relative_error(g, r) <= 2 * relative_error(t, r) + floor, name


def test_out_of_range_rows_show_a_zero_row_on_every_backend():
    """validate=False: a perm entry outside [0, N) shows no row (bias and position term only) and sends no gradient,
    alike on every backend; in-range entries as the formula."""
    patches, weight, bias, pos, unk, prefix = make_inputs((2, 6, 8, 5, 1), requires_grad=True)
    mask = torch.tensor([[True, True, False, True, False, False], [False] * 6])
    perm = torch.tensor([[1, 7, 2, -3, 4, 5], list(range(6))])
    jigsaw = Jigsaw(mask, perm)
    results = {}
    for backend in backends_for("cpu"):
        out = mjp_gathered_patch_embed(patches, weight, bias, pos, unk, jigsaw, prefix=prefix, backend=backend,
                                       validate=False)  # fmt: skip
        results[backend] = (out, torch.autograd.grad(out.square().sum(), (patches, weight)))
    out, (grad_patches, _) = results["torch"]
    torch.testing.assert_close(out[0, 2], bias + unk, rtol=0, atol=0)  # row 1 (token 1) shows no row
    torch.testing.assert_close(out[0, 1], weight @ patches[0, 1] + bias + unk)
    assert torch.equal(grad_patches[0, 3], torch.zeros(8))  # row 3: shown by no token
    for backend, (other, other_grads) in results.items():
        torch.testing.assert_close(other, out, **TOLERANCE, msg=lambda m, backend=backend: f"{backend}: {m}")
        for g, e in zip(other_grads, results["torch"][1]):
            torch.testing.assert_close(g, e, **TOLERANCE, msg=lambda m, backend=backend: f"{backend}: {m}")


@pytest.mark.skipif(not TRITON_ON_CPU, reason="needs the triton backend (the interpreter here)")
def test_triton_backward_is_deterministic():
    inputs = make_inputs((3, 19, 33, 17, 1), requires_grad=True)
    jigsaw = naflex_jigsaw(3, 19, "some", seed=6)
    grad_out = torch.randn(3, 20, 17, generator=torch.Generator().manual_seed(3))
    tensors = _present(inputs)

    def grads():
        out = mjp_gathered_patch_embed(*inputs[:5], jigsaw, prefix=inputs[5], backend="triton")
        return torch.autograd.grad(out, tensors, grad_out)

    for first, second in zip(grads(), grads()):
        assert torch.equal(first, second)


@pytest.mark.skipif(not TRITON_ON_CPU, reason="needs the triton backend (the interpreter here)")
@pytest.mark.parametrize("per_sample", [True, False], ids=["per-sample pos", "shared pos"])
def test_the_triton_operator_is_registered_with_its_autograd(per_sample):
    """torch.library's checks of the forward operator (schema, fake tensors, autograd registration) and its gradient
    through the operator itself equal to the eager node's."""
    from mjp_fast.triton.gathered_patch_embed import gathered_patch_embed_forward_triton  # noqa: F401

    patches, weight, bias, pos, unk, prefix = make_inputs((2, 6, 8, 5, 2), per_sample=per_sample, requires_grad=True)
    jigsaw = naflex_jigsaw(2, 6, "some", seed=1)
    arguments = (patches, weight, bias, pos, unk, jigsaw.perm, jigsaw.mask, prefix)
    torch.library.opcheck(torch.ops.mjp_fast.gathered_patch_embed_triton.default, arguments)
    out = torch.ops.mjp_fast.gathered_patch_embed_triton(*arguments)
    tensors = (patches, weight, bias, pos, unk, prefix)
    grad_out = torch.randn_like(out)
    got = torch.autograd.grad(out, tensors, grad_out)
    expected = torch.autograd.grad(
        mjp_gathered_patch_embed_ref(patches, weight, bias, pos, unk, jigsaw, prefix=prefix), tensors, grad_out
    )
    for name, g, e in zip(NAMES, got, expected):
        torch.testing.assert_close(g, e, **TOLERANCE, msg=lambda m, name=name: f"grad of {name}: {m}")


# -- bad input ---------------------------------------------------------------------------------------------------


def _call(**overrides):
    patches, weight, bias, pos, unk, _ = make_inputs((2, 6, 8, 5, 0))
    arguments = dict(
        patches=patches, weight=weight, bias=bias, pos=pos, unk_embed=unk, jigsaw=naflex_jigsaw(2, 6, "some", seed=0)
    )
    arguments.update(overrides)
    return mjp_gathered_patch_embed(**arguments)


def _bad_perm(kind: str) -> Jigsaw:
    jigsaw = naflex_jigsaw(2, 6, "all", seed=0)
    mask, perm = jigsaw.mask.clone(), jigsaw.perm.clone()
    if kind == "repeat":
        perm[0, 0] = perm[0, 1]
    elif kind == "moves_unmasked":
        mask[0, 0] = False
    else:
        perm[0, 0] = 6
    return Jigsaw(mask, perm)


@pytest.mark.parametrize(
    "overrides, error, words",
    [
        (dict(patches=torch.randn(2, 6)), ValueError, "patches must have 3"),
        (dict(patches=torch.zeros(2, 6, 8, dtype=torch.int64)), TypeError, "patches"),
        (dict(patches=[[1.0]]), TypeError, "patches"),
        (dict(weight=torch.randn(5, 7)), ValueError, r"weight must be \[D, K\] with K = 8"),
        (dict(weight=torch.randn(5, 8, 1)), ValueError, "weight must have 2"),
        (dict(bias=torch.randn(6)), ValueError, "bias"),
        (dict(pos=torch.randn(3, 6, 5)), ValueError, r"pos must be \[B, N, D\]"),
        (dict(pos=torch.randn(6, 4)), ValueError, "pos must be"),
        (dict(pos=torch.randn(2, 6, 5, dtype=torch.float64)), TypeError, "pos has dtype"),
        (dict(unk_embed=torch.randn(4)), ValueError, "unk_embed"),
        (dict(unk_embed=None), ValueError, "unk_embed"),
        (dict(prefix=torch.randn(2, 1, 5)), ValueError, "prefix"),
        (dict(prefix=torch.randn(1, 4)), ValueError, "prefix"),
        (dict(jigsaw=(torch.zeros(2, 6, dtype=torch.bool),)), TypeError, "jigsaw"),
        (dict(jigsaw=Jigsaw(torch.zeros(3, 6, dtype=torch.bool), torch.zeros(3, 6).long())), ValueError, "jigsaw.mask"),
        (dict(jigsaw=Jigsaw(torch.zeros(2, 6), torch.arange(6).repeat(2, 1))), TypeError, "jigsaw.mask"),
        (dict(jigsaw=_bad_perm("repeat")), ValueError, "permutation"),
        (dict(jigsaw=_bad_perm("moves_unmasked")), ValueError, "identity"),
        (dict(jigsaw=_bad_perm("out_of_range")), ValueError, "outside"),
        (dict(backend="nope"), ValueError, "backend"),
        (dict(validate=None), TypeError, "validate"),
    ],
)
def test_bad_arguments_are_named(overrides, error, words):
    with pytest.raises(error, match=words):
        _call(**overrides)
