"""The MJP patch embedding of pre-patchified input (timm's NaFlex): a linear embedding of gathered patch rows plus the
unknown-or-given position term, the prefix tokens in front.

``out[b, P + n] = W @ patches[b, perm[b, n]] + bias + (unk_embed if mask[b, n] else pos[b, n])``, ``out[b, t] =
prefix[t]`` for the ``P`` prefix tokens (class and register tokens: NaFlex gives them no position term).

Where the image embedding (:mod:`mjp_fast.ops.patch_embed`) cuts patches out of images, here they come as rows
``patches [B, N, K]`` (``K = P*P*C`` in timm's NaFlex layout), and the position term is a tensor the caller computes:
``[B, N, D]`` when each sample has its own (NaFlex resamples its table to each sample's grid, or samples it at each
patch's coordinates with ``grid_sample``: no shared table and index reproduces the latter), or ``[N, D]`` shared by the
batch (image input, one grid).

In this file, in order: argument checks, the oracle ``mjp_gathered_patch_embed_ref`` (gathers the patches, then
embeds them), the ``torch`` backend (embeds, then gathers the tokens: ``P(XW) = (PX)W``, D values moved per token
instead of K), the Triton kernels as one autograd node, registered with torch.library with their autograd, and the
public ``mjp_gathered_patch_embed``.

Backends: ``triton`` (one GEMM whose loads gather the patch rows, its epilogue adding the bias and the position term
in float32 and writing the prefix rows too; see :mod:`mjp_fast.triton.gathered_patch_embed`) and ``torch``. There is
no compiled kernel of this op: ``cpu`` and ``cuda`` (the extension's backends) run the ``torch`` backend's
computation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mjp_fast import backend as backend_module
from mjp_fast._validate import check_float_dtype, check_same_device, check_same_dtype, check_tensor
from mjp_fast.ops.pos_embed import check_unk_embed
from mjp_fast.sampler.jigsaw import Jigsaw, check_jigsaw

# The backends with kernels of their own for this op; the others run the torch backend's computation.
KERNEL_BACKENDS = frozenset({"torch", "triton"})

# The dtypes of the Triton kernels' GEMM; float64 runs the torch backend's computation.
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_gathered_patch_embed_args(
    patches: object, weight: object, bias: object, pos: object, unk_embed: object, jigsaw: object, prefix: object, *,
    validate: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, Jigsaw | None, torch.Tensor | None]:  # fmt: skip
    """Validates the arguments of :func:`mjp_gathered_patch_embed`.

    Returns:
        ``pos`` as ``[B, N, D]`` or ``[N, D]``, ``unk_embed`` as ``[D]`` (or None), the jigsaw (int64 perm), and the
        prefix as ``[P, D]`` (or None).
    """
    patches = check_tensor("patches", patches, ndims=(3,))
    weight = check_tensor("weight", weight, ndims=(2,))
    check_float_dtype("patches", patches)
    batch, num_positions, k = patches.shape
    dim = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"weight must be [D, K] with K = {k} (patches [B, N, K]), got shape {list(weight.shape)}")
    if bias is not None:
        bias = check_tensor("bias", bias, ndims=(1,))
        if bias.shape[0] != dim:
            raise ValueError(f"bias must be [D] = [{dim}], got shape {list(bias.shape)}")
    pos = check_tensor("pos", pos, ndims=(2, 3))
    shared = tuple(pos.shape[-2:]) == (num_positions, dim) and (pos.dim() == 2 or pos.shape[0] == 1)
    if not shared and tuple(pos.shape) != (batch, num_positions, dim):
        raise ValueError(
            f"pos must be [B, N, D] = {[batch, num_positions, dim]} (each sample's) or [N, D] / [1, N, D] (the "
            f"batch's), got shape {list(pos.shape)}"
        )
    pos = pos.reshape(num_positions, dim) if shared else pos
    unk_embed = check_unk_embed(unk_embed, dim, jigsaw)
    if prefix is not None:
        prefix = check_tensor("prefix", prefix, ndims=(2, 3))
        if prefix.shape[-1] != dim or (prefix.dim() == 3 and prefix.shape[0] != 1):
            raise ValueError(f"prefix must be [P, D] or [1, P, D] with D = {dim}, got shape {list(prefix.shape)}")
        prefix = prefix.reshape(-1, dim)
    floats = {"patches": patches, "weight": weight, "bias": bias, "pos": pos, "unk_embed": unk_embed, "prefix": prefix}
    check_same_dtype("patches", **floats)
    device = check_same_device(**floats)
    jigsaw = check_jigsaw(jigsaw, batch, num_positions, device, validate=validate)
    return pos, unk_embed, jigsaw, prefix


# ----------------------------------------------------------------------------------------------------------------
# Oracle
# ----------------------------------------------------------------------------------------------------------------


def mjp_gathered_patch_embed_ref(
    patches: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    pos: torch.Tensor,
    unk_embed: torch.Tensor | None,
    jigsaw: Jigsaw | None = None,
    *,
    prefix: torch.Tensor | None = None,
    upcast: bool = False,
) -> torch.Tensor:
    """The definition, step by step: gather the patch rows, embed them, add the position term, put the prefix in front.

    Args:
        patches: ``[B, N, K]``; weight ``[D, K]``; bias ``[D]`` or None; pos ``[B, N, D]``, ``[N, D]`` or ``[1, N, D]``;
            unk_embed ``[D]``; jigsaw ``Jigsaw(mask [B, N], perm [B, N])`` or None; prefix ``[P, D]`` / ``[1, P, D]``
            or None.
        upcast: compute in float32 and cast the result back (the accuracy reference for half precision).

    Returns:
        ``[B, P + N, D]`` in the dtype of ``patches``.
    """
    pos, unk_embed, jigsaw, prefix = check_gathered_patch_embed_args(
        patches, weight, bias, pos, unk_embed, jigsaw, prefix, validate=False
    )
    out_dtype = patches.dtype
    if upcast:
        patches, weight, pos = patches.float(), weight.float(), pos.float()
        bias, unk_embed, prefix = (t.float() if t is not None else None for t in (bias, unk_embed, prefix))
    if jigsaw is not None:
        patches = patches.gather(1, jigsaw.perm[..., None].expand_as(patches))
    tokens = patches @ weight.t()
    if bias is not None:
        tokens = tokens + bias
    term = pos if jigsaw is None else torch.where(jigsaw.mask[..., None], unk_embed, pos)
    tokens = (tokens + term).to(out_dtype)
    if prefix is None:
        return tokens
    return torch.cat((prefix.to(out_dtype).expand(tokens.shape[0], -1, -1), tokens), dim=1)


# ----------------------------------------------------------------------------------------------------------------
# torch backend
# ----------------------------------------------------------------------------------------------------------------


def _gathered_patch_embed_torch(
    patches: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pos: torch.Tensor,
    unk_embed: torch.Tensor | None, jigsaw: Jigsaw | None, prefix: torch.Tensor | None, permutation: bool,
) -> torch.Tensor:  # fmt: skip
    # Embedding first and moving tokens after is exact (each token is one linear map of one row) and moves D values
    # per token instead of K. With a perm known to be a permutation (or none) the bias is the projection's, as timm's
    # nn.Linear adds it: the NaFlex front end's fused step then equals its unfused one bit for bit on this backend.
    # Otherwise (validate=False) the bias rides on the position term: an out-of-range entry moves a zero token, whose
    # output is the bias and the position term, as the kernels give.
    trusted = jigsaw is None or permutation
    tokens = F.linear(patches, weight, bias if trusted else None)
    if jigsaw is not None:
        perm = jigsaw.perm
        if not permutation:
            in_range = (perm >= 0) & (perm < patches.shape[1])
            perm = torch.where(in_range, perm, 0)
        tokens = tokens.gather(1, perm[..., None].expand_as(tokens))
        if not permutation:
            tokens = tokens * in_range[..., None].to(tokens.dtype)
        term = torch.where(jigsaw.mask[..., None], unk_embed.to(pos.dtype), pos)
    else:
        term = pos
    if bias is not None and not trusted:
        term = term + bias
    tokens = tokens + term
    if prefix is None:
        return tokens
    prefix = prefix.reshape(1, -1, tokens.shape[-1]).to(tokens.dtype)
    return torch.cat((prefix.expand(tokens.shape[0], -1, -1), tokens), 1)


# ----------------------------------------------------------------------------------------------------------------
# Triton backend: the kernels as one autograd node, and the operators' own autograd
# ----------------------------------------------------------------------------------------------------------------

if backend_module.triton_usable():
    from mjp_fast.triton import gathered_patch_embed as _triton_kernels


def _setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
    """What the backward keeps, for both ways in: :class:`_GatheredPatchEmbedTriton` and the operator's autograd.
    ``inputs``: ``(patches, weight, bias, pos, unk_embed, perm, mask, prefix)``, the operator's order. The patches
    are saved, not the gathered rows (nothing of size ``B*N*K`` is made)."""
    patches, weight, bias, pos, unk_embed, perm, mask, prefix = inputs[:8]
    ctx.num_inputs = len(inputs)
    ctx.save_for_backward(patches, weight, perm, mask)
    ctx.dtypes = (
        pos.dtype,
        unk_embed.dtype if unk_embed is not None else None,
        prefix.dtype if prefix is not None else None,
    )
    prefix_count = prefix.numel() // weight.shape[0] if prefix is not None and weight.shape[0] else 0
    ctx.layout = (prefix_count, list(pos.shape), list(prefix.shape) if prefix is not None else [0])
    ctx.present = (bias is not None, unk_embed is not None, prefix is not None)
    ctx.permutation = False  # the node below sets it
    ctx.launch_directly = False


def _backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """The gradients of the inputs :func:`_setup_context` saw: the backward launcher (eager node) or its operator."""
    patches, weight, perm, mask = ctx.saved_tensors
    needs = ctx.needs_input_grad
    has_bias, has_unk, has_prefix = ctx.present
    wanted = (needs[0], needs[1], needs[2] and has_bias, needs[3], needs[4] and has_unk, needs[7] and has_prefix)
    direct = ctx.launch_directly and not torch.compiler.is_compiling()
    backward = (
        _triton_kernels.gathered_patch_embed_backward_launch
        if direct
        else torch.ops.mjp_fast.gathered_patch_embed_triton_backward
    )
    grads = backward(grad.contiguous(), patches, weight, perm, mask, *wanted, *ctx.layout, *ctx.dtypes, ctx.permutation)
    grads = [g if want else None for g, want in zip(grads, wanted)]
    return (*grads[:5], None, None, grads[5], None)[: ctx.num_inputs]


class _GatheredPatchEmbedTriton(torch.autograd.Function):
    """The Triton kernels as one autograd node, forward and backward each one call: the launchers directly when eager
    (the operator wrappers cost host time), the operators under torch.compile. Inputs: the operator's, then
    ``permutation`` (each row of ``perm`` known to be a permutation: the patches' gradient then needs no zero fill)."""

    @staticmethod
    def forward(ctx, patches, weight, bias, pos, unk_embed, perm, mask, prefix, permutation):  # type: ignore[override]
        arguments = (patches, weight, bias, pos, unk_embed, perm, mask, prefix)
        _setup_context(ctx, (*arguments, permutation), None)
        ctx.permutation = permutation
        ctx.launch_directly = True
        if torch.compiler.is_compiling():
            return torch.ops.mjp_fast.gathered_patch_embed_triton(*arguments)
        return _triton_kernels.gathered_patch_embed_forward_launch(*arguments)

    backward = staticmethod(_backward)


if backend_module.triton_usable():
    torch.library.register_autograd(
        _triton_kernels.gathered_patch_embed_forward_triton, _backward, setup_context=_setup_context
    )


def gathered_patch_embed_step(
    patches: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pos: torch.Tensor,
    unk_embed: torch.Tensor | None, jigsaw: Jigsaw | None, backend: str, prefix: torch.Tensor | None = None,
    permutation: bool = False,
) -> torch.Tensor:  # fmt: skip
    """The embedding, jigsaw, position term and prefix in one operation each way, for callers that checked the
    arguments and resolved the backend (the NaFlexVit front end's per-step path): no check, no sync.

    Args:
        patches: ``[B, N, K]``; weight ``[D, K]``; bias ``[D]`` or None (one dtype).
        pos: ``[B, N, D]`` or ``[N, D]``; unk_embed ``[D]`` (None without a jigsaw); jigsaw: the batch's, or None.
        backend: a resolved backend; ``cpu`` and ``cuda`` run the ``torch`` computation (no compiled kernel), and so
            does ``triton`` for float64 patches or weight (no float64 GEMM in its kernels).
        prefix: ``[P, D]`` / ``[1, P, D]`` (numel ``P * D``), or None.
        permutation: each row of ``jigsaw.perm`` is known to be a permutation (a validated jigsaw, or a sampler's).
            Never set it for a jigsaw that was not checked: an unchecked perm's patches' gradient would keep
            uninitialised rows.

    Returns:
        ``[B, P + N, D]`` in ``patches``' dtype.
    """
    if backend != "triton" or patches.dtype not in TRITON_DTYPES or weight.dtype not in TRITON_DTYPES:
        return _gathered_patch_embed_torch(patches, weight, bias, pos, unk_embed, jigsaw, prefix, permutation)
    perm, mask = (None, None) if jigsaw is None else (jigsaw.perm.contiguous(), jigsaw.mask.contiguous())
    prefix = prefix.contiguous() if prefix is not None else None
    return _GatheredPatchEmbedTriton.apply(
        patches, weight, bias, pos.contiguous(), unk_embed, perm, mask, prefix, permutation
    )


# ----------------------------------------------------------------------------------------------------------------
# Public function
# ----------------------------------------------------------------------------------------------------------------


def mjp_gathered_patch_embed(
    patches: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    pos: torch.Tensor,
    unk_embed: torch.Tensor | None,
    jigsaw: Jigsaw | None = None,
    *,
    prefix: torch.Tensor | None = None,
    backend: str | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """MJP patch embedding of pre-patchified input: the linear embedding of the jigsawed patch rows plus the position
    term, the prefix tokens in front.

    ``out[b, P + n] = W @ patches[b, perm[b, n]] + bias + (unk_embed if mask[b, n] else pos[b, n])`` and ``out[b, t] =
    prefix[t]``. Without a jigsaw: ``cat(prefix, F.linear(patches, W, bias) + pos)`` (timm's ``NaFlexEmbeds`` with a
    linear projection, no norm). Differentiable in patches, weight, bias, pos, unk_embed and prefix.

    Args:
        patches: ``[B, N, K]``, float32, float16 or bfloat16 (float64 on ``torch``), any strides.
        weight: ``nn.Linear``'s ``[D, K]``. bias: ``[D]`` or None.
        pos: the position term, ``[B, N, D]`` (each sample's) or ``[N, D]`` / ``[1, N, D]`` (the batch's).
        unk_embed: ``[D]``, the unknown position embedding (required with a jigsaw; may be None without one).
        jigsaw: ``Jigsaw(mask [B, N], perm [B, N])``, ``perm[b]`` permuting sample b's masked rows (identity
            elsewhere), or None.
        prefix: the class and register tokens, ``[P, D]`` or ``[1, P, D]``, or None.
        backend: ``torch`` or ``triton``; ``cpu`` and ``cuda`` (the compiled extension's backends, which have no
            kernel of this op) run the ``torch`` backend's computation. Default ``MJP_FAST_BACKEND``, else the
            automatic choice for the device (:func:`mjp_fast.backend.resolve_backend`).
        validate: check that ``jigsaw.perm`` permutes exactly the masked positions (a host sync on a GPU). With
            ``validate=False`` a perm entry outside ``[0, N)`` shows a zero row (the output is the bias and the
            position term) on every backend; see :mod:`mjp_fast._validate`.

    Returns:
        ``[B, P + N, D]`` in the dtype of ``patches``.

    Raises:
        TypeError/ValueError: a bad argument, named; ``backend='triton'`` with float64 patches.
    """
    pos, unk_embed, jigsaw, prefix = check_gathered_patch_embed_args(
        patches, weight, bias, pos, unk_embed, jigsaw, prefix, validate=validate
    )
    chosen = backend_module.resolve_backend(backend, patches.device)
    if chosen == "triton" and patches.dtype == torch.float64:
        raise TypeError(
            "patches: the triton backend supports float32, float16 and bfloat16, got float64; float64 runs on "
            "backend='torch'"
        )
    if chosen not in KERNEL_BACKENDS:
        chosen = "torch"
    return gathered_patch_embed_step(
        patches, weight, bias, pos, unk_embed, jigsaw, chosen, prefix, permutation=validate and jigsaw is not None
    )
