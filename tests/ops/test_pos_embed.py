import functools
import os

import pytest
import torch

import mjp_fast
from mjp_fast import Jigsaw, mjp_pos_embed, sample_jigsaw
from mjp_fast.ops import pos_embed as pos_embed_module
from mjp_fast.ops.pos_embed import mjp_pos_embed_ref
from tests.conftest import backends_for

BACKENDS = backends_for("cpu")  # torch; cpu (the extension's kernels); triton in the interpreter

# Per output dtype: the node sums the position gradients with one matmul, the oracle with reductions.
TOLERANCES = {
    torch.float64: dict(atol=1e-12, rtol=1e-12),
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=6e-2, rtol=2e-2),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
}

# (batch, rows, cols, dim): a single position, odd sizes, batch 1, a ViT-like grid.
SHAPES = [(1, 1, 1, 1), (3, 1, 7, 5), (1, 3, 4, 16), (4, 5, 3, 9), (2, 14, 14, 24)]


def _inputs(batch, rows, cols, dim, dtype, *, ratio=0.5, prob=1.0, seed=0, pos_dtype=None, pos_3d=False):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randn(batch, rows * cols, dim, generator=generator).to(dtype).requires_grad_()
    pos_shape = (1, rows * cols, dim) if pos_3d else (rows * cols, dim)
    pos = torch.randn(*pos_shape, generator=generator).to(pos_dtype or dtype).requires_grad_()
    unk = torch.randn(dim, generator=generator).to(pos_dtype or dtype).requires_grad_()
    jigsaw = sample_jigsaw(batch, (rows, cols), ratio, seed=seed, prob=prob, min_block=1)
    grad = torch.randn(batch, rows * cols, dim, generator=generator)
    return tokens, pos, unk, jigsaw, grad


def _forward_backward(function, tokens, pos, unk, jigsaw, grad):
    out = function(tokens, pos, unk, jigsaw)
    grads = torch.autograd.grad(out, (tokens, pos, unk), grad.to(out.dtype), allow_unused=True)
    return out, grads


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("ratio", [0.0, 0.3, 1.0])
def test_equals_oracle_with_gradients(shape, ratio, dtype, backend):
    tokens, pos, unk, jigsaw, grad = _inputs(*shape, dtype, ratio=ratio, pos_3d=shape[0] == 4)
    function = functools.partial(mjp_pos_embed, backend=backend)
    out, grads = _forward_backward(function, tokens, pos, unk, jigsaw, grad)
    expected, expected_grads = _forward_backward(mjp_pos_embed_ref, tokens, pos, unk, jigsaw, grad)
    assert out.dtype == expected.dtype == dtype and out.shape == tokens.shape
    # The forward adds the same two terms in float32 and rounds once, as torch does: exact. Except that the Triton
    # interpreter (numpy has no bfloat16) truncates when it stores bfloat16: one unit in the last place there.
    interpreted_bfloat16 = backend == "triton" and dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
    exact = dict(atol=1e-6, rtol=2**-7) if interpreted_bfloat16 else dict(atol=0, rtol=0)
    torch.testing.assert_close(out, expected, **exact)
    for name, got, want, leaf in zip(("tokens", "pos_embed", "unk_embed"), grads, expected_grads, (tokens, pos, unk)):
        assert got.dtype == leaf.dtype and got.shape == leaf.shape, name
        torch.testing.assert_close(got, want, **TOLERANCES[dtype], msg=lambda m, name=name: f"grad of {name}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_table_with_half_tokens_promotes_as_timm_does(backend):
    # Under autocast the patch embedding gives bfloat16 tokens and the position table stays float32.
    tokens, pos, unk, jigsaw, grad = _inputs(3, 4, 4, 8, torch.bfloat16, pos_dtype=torch.float32, pos_3d=True)
    function = functools.partial(mjp_pos_embed, backend=backend)
    out, grads = _forward_backward(function, tokens, pos, unk, jigsaw, grad)
    expected, expected_grads = _forward_backward(mjp_pos_embed_ref, tokens, pos, unk, jigsaw, grad)
    assert out.dtype == torch.float32 == (tokens + pos).dtype
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    assert [g.dtype for g in grads] == [torch.bfloat16, torch.float32, torch.float32]
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, **TOLERANCES[got.dtype])


def test_gradcheck_float64():
    tokens, pos, unk, jigsaw, _ = _inputs(3, 2, 3, 4, torch.float64, ratio=0.5)
    assert jigsaw.mask.any() and not jigsaw.mask.all()
    assert torch.autograd.gradcheck(lambda t, p, u: mjp_pos_embed(t, p, u, jigsaw), (tokens, pos, unk))


@pytest.mark.parametrize("backend", BACKENDS)
def test_only_some_inputs_need_gradients(backend):
    tokens, pos, unk, jigsaw, grad = _inputs(2, 3, 3, 4, torch.float32)
    frozen_tokens = tokens.detach()
    out = mjp_pos_embed(frozen_tokens, pos, unk.detach(), jigsaw, backend=backend)
    (grad_pos,) = torch.autograd.grad(out, (pos,), grad)
    expected = mjp_pos_embed_ref(frozen_tokens, pos, unk.detach(), jigsaw)
    torch.testing.assert_close(grad_pos, torch.autograd.grad(expected, (pos,), grad)[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend):
    tokens, pos, unk, jigsaw, _ = _inputs(0, 2, 3, 4, torch.float32)
    out = mjp_pos_embed(tokens, pos, unk, jigsaw, backend=backend)
    out.sum().backward()
    assert out.shape == (0, 6, 4) and not pos.grad.any() and not unk.grad.any()


def test_triton_refuses_float64():
    if "triton" not in BACKENDS:
        pytest.skip("needs the triton backend (the interpreter here)")
    tokens, pos, unk, jigsaw, _ = _inputs(1, 2, 2, 3, torch.float64)
    with pytest.raises(TypeError, match="triton backend supports float32, float16 and bfloat16"):
        mjp_pos_embed(tokens, pos, unk, jigsaw, backend="triton")


def test_cuda_runs_the_extension_operator(monkeypatch):
    """The ``cuda`` backend runs the extension's operator (its CUDA kernels on CUDA tensors, pos_embed_cuda.cu; on a
    GPU tests/test_gpu.py holds them to the CPU kernels bit for bit). Asked for by name where it cannot run, it is
    refused with the reason."""
    tokens, pos, unk, jigsaw, grad = _inputs(2, 2, 3, 4, torch.float32)
    if "cuda" not in mjp_fast.available_backends():
        with pytest.raises(ValueError, match=r"backend='cuda' is not available on this machine"):
            mjp_pos_embed(tokens, pos, unk, jigsaw, backend="cuda")
    if pos_embed_module.backend_module.extension() is None:
        pytest.skip("needs mjp_fast._C")
    # Resolved to cuda (a GPU without Triton, or MJP_FAST_BACKEND=cuda): the extension's operator, which dispatches
    # on the tensors' device (here its CPU kernel), not the torch node.
    monkeypatch.setattr(pos_embed_module.backend_module, "resolve_backend", lambda backend, device: "cuda")
    calls = []
    operator = pos_embed_module._extension_operator()
    monkeypatch.setattr(
        pos_embed_module, "_extension_operator", lambda: lambda *args: calls.append(1) or operator(*args)
    )
    out, grads = _forward_backward(mjp_pos_embed, tokens, pos, unk, jigsaw, grad)
    expected, expected_grads = _forward_backward(mjp_pos_embed_ref, tokens, pos, unk, jigsaw, grad)
    assert calls == [1]
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, **TOLERANCES[torch.float32])


def test_without_jigsaw_is_the_plain_add():
    tokens, pos, unk, _, _ = _inputs(2, 3, 5, 6, torch.float32, pos_3d=True)
    torch.testing.assert_close(mjp_pos_embed(tokens, pos, None), tokens + pos, atol=0, rtol=0)
    torch.testing.assert_close(mjp_pos_embed(tokens, pos, unk, None), tokens + pos, atol=0, rtol=0)


def test_agrees_with_the_fused_patch_embedding():
    from mjp_fast import mjp_patch_embed

    torch.manual_seed(0)
    images, weight, bias = torch.randn(2, 3, 16, 24), torch.randn(8, 3, 4, 4), torch.randn(8)
    pos, unk = torch.randn(24, 8), torch.randn(8)
    jigsaw = sample_jigsaw(2, (4, 6), 0.5, seed=3, min_block=2)
    tokens = torch.nn.functional.conv2d(images, weight, bias, stride=4).flatten(2).transpose(1, 2)
    expected = mjp_patch_embed(images, weight, bias, pos, unk, jigsaw, backend="torch")
    torch.testing.assert_close(mjp_pos_embed(tokens, pos, unk, jigsaw), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("change", "error", "words"),
    [
        (dict(tokens=torch.zeros(2, 6)), ValueError, "tokens must have 3 dimensions"),
        (dict(tokens=torch.zeros(2, 6, 4, dtype=torch.int64)), TypeError, "tokens must be float32"),
        (dict(pos=torch.zeros(5, 4)), ValueError, "pos_embed must be [N, D] or [1, N, D]"),
        (dict(pos=torch.zeros(2, 6, 4)), ValueError, "pos_embed must be [N, D] or [1, N, D]"),
        (dict(unk=torch.zeros(3)), ValueError, "unk_embed must be [D] = [4]"),
        (dict(unk=None), ValueError, "unk_embed must be given when a jigsaw is given"),
        (dict(jigsaw="mask"), TypeError, "jigsaw must be a Jigsaw"),
        (
            dict(jigsaw=Jigsaw(torch.zeros(2, 5, dtype=torch.bool), torch.zeros(2, 5, dtype=torch.long))),
            ValueError,
            "jigsaw.mask must have shape [batch, N] = [2, 6]",
        ),
        (
            dict(perm=torch.tensor([[1, 0, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]])),
            ValueError,
            "identity where jigsaw.mask is False",
        ),
        (
            dict(perm=torch.tensor([[1, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]]), masked=True),
            ValueError,
            "not a permutation",
        ),
        (dict(pos=torch.zeros(6, 4, device="meta")), ValueError, "mixed devices"),
    ],
    ids=lambda value: value if isinstance(value, str) else None,
)
def test_bad_inputs_are_named(change, error, words):
    tokens, pos, unk = torch.zeros(2, 6, 4), torch.zeros(6, 4), torch.zeros(4)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    if change.pop("masked", False):
        mask[0, :2] = True
    jigsaw = Jigsaw(mask, change.pop("perm", torch.arange(6).repeat(2, 1)))
    arguments = dict(tokens=tokens, pos=pos, unk=unk, jigsaw=jigsaw) | change
    with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]")):
        mjp_pos_embed(arguments["tokens"], arguments["pos"], arguments["unk"], arguments["jigsaw"])


# -- triton: the backward with the batch split into chunks --------------------------------------------------------


def _force_batch_chunks(monkeypatch, chunks=3):
    """The triton backward plans with the GPU's tiles and ``chunks`` batch chunks (the interpreter's plan has one)."""
    from mjp_fast.triton import common as kernels

    def plan(grad, **flags):
        batch, num_positions, dim = grad.shape
        return kernels.position_gradient_plan(batch, num_positions, dim, grad.dtype, 132, False, chunks=chunks, **flags)

    monkeypatch.setattr(kernels, "_position_plan", plan)


def _jigsaw_masking(batch, rows, cols, masked, seed):
    """No position masked, some (sample_jigsaw), or all of them (permuted at random)."""
    if masked != "all":
        return sample_jigsaw(batch, (rows, cols), 0.0 if masked == "none" else 0.5, seed=seed, min_block=1)
    generator = torch.Generator().manual_seed(seed)
    perm = torch.stack([torch.randperm(rows * cols, generator=generator) for _ in range(batch)])
    return Jigsaw(torch.ones(batch, rows * cols, dtype=torch.bool), perm)


@pytest.mark.skipif("triton" not in BACKENDS, reason="needs the triton backend (the interpreter here)")
@pytest.mark.parametrize("masked", ["none", "some", "all"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (10, 3, 5, 24), (9, 2, 7, 33)], ids=lambda s: "x".join(map(str, s)))
def test_triton_backward_in_batch_chunks_equals_oracle(shape, dtype, masked, monkeypatch):
    _force_batch_chunks(monkeypatch)
    tokens, pos, unk, _, grad = _inputs(*shape, dtype)
    jigsaw = _jigsaw_masking(*shape[:3], masked, seed=shape[0])
    function = functools.partial(mjp_pos_embed, backend="triton")
    _, grads = _forward_backward(function, tokens, pos, unk, jigsaw, grad)
    _, expected_grads = _forward_backward(mjp_pos_embed_ref, tokens, pos, unk, jigsaw, grad)
    torch.testing.assert_close(grads[0], expected_grads[0], atol=0, rtol=0)  # the inverse move: exact
    for name, got, want, leaf in zip(("pos_embed", "unk_embed"), grads[1:], expected_grads[1:], (pos, unk)):
        assert got.dtype == leaf.dtype and got.shape == leaf.shape, name
        torch.testing.assert_close(got, want, **TOLERANCES[dtype], msg=lambda m, name=name: f"grad of {name}: {m}")


@pytest.mark.skipif("triton" not in BACKENDS, reason="needs the triton backend (the interpreter here)")
def test_triton_backward_is_deterministic(monkeypatch):
    _force_batch_chunks(monkeypatch)
    tokens, pos, unk, jigsaw, grad = _inputs(10, 3, 5, 24, torch.bfloat16, ratio=0.5)
    function = functools.partial(mjp_pos_embed, backend="triton")
    first = _forward_backward(function, tokens, pos, unk, jigsaw, grad)[1]
    second = _forward_backward(function, tokens, pos, unk, jigsaw, grad)[1]
    for got, again in zip(first, second):
        assert torch.equal(got, again)


@pytest.mark.skipif("cpu" not in BACKENDS, reason="needs the compiled extension")
def test_compiled_position_step_traces_no_cache(monkeypatch):
    # The cpu operators are looked up through a cache in eager mode; Dynamo would trace through that cache without
    # consulting it and warn "Silent incorrectness is only a *potential* risk" (once per message: a fresh record, so
    # an earlier test cannot hide it).
    import warnings

    import torch._dynamo.utils

    monkeypatch.setattr(torch._dynamo.utils, "warn_once_cache", set())
    tokens, pos, unk, jigsaw, grad = _inputs(2, 3, 4, 8, torch.float32)
    step = functools.partial(pos_embed_module.mjp_position_step, backend="cpu")
    compiled = torch.compile(lambda t, p, u: step(t, p, u, jigsaw), backend="aot_eager", fullgraph=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compiled(tokens, pos, unk)
    assert not [str(warning.message) for warning in caught if "lru_cache" in str(warning.message)]
    torch.testing.assert_close(out, mjp_pos_embed_ref(tokens, pos, unk, jigsaw), **TOLERANCES[torch.float32])
    out.backward(grad)
    assert pos.grad is not None and unk.grad is not None
