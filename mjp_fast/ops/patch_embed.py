"""The MJP patch embedding: patch embedding of the jigsawed image plus the unknown-or-learned position embedding.

``tokens[b, n] = W @ patch(images[b], perm[b, n]) + bias + (unk_embed if mask[b, n] else pos_embed[n])``

In this file, in order: argument checks, the oracle ``mjp_patch_embed_ref`` (shuffles the patches, then embeds
them), the ``torch`` backend (embeds with a convolution, then shuffles the tokens: ``P(XW) = (PX)W``), the
operators over the compiled kernels (``cpu``, ``cuda``) and the Triton kernels (``triton``), registered with
torch.library with their autograd (the gather happens inside the patch extraction, the position term in the
GEMM's epilogue), and the public ``mjp_patch_embed``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mjp_fast import backend as backend_module
from mjp_fast._validate import check_float_dtype, check_same_device, check_tensor
from mjp_fast.ops.pos_embed import _MJPPosEmbed, check_position_table, check_unk_embed, position_term
from mjp_fast.ops.sample_jigsaw import Jigsaw, check_jigsaw


@dataclass(frozen=True)
class PatchGeometry:
    batch: int
    channels: int
    patch_size: int
    rows: int
    cols: int
    dim: int

    @property
    def num_positions(self) -> int:
        return self.rows * self.cols


def check_patch_embed_args(
    images: object,
    weight: object,
    bias: object,
    pos_embed: object,
    unk_embed: object,
    jigsaw: object,
    *,
    validate: bool,
) -> tuple[PatchGeometry, torch.Tensor, torch.Tensor | None, Jigsaw | None]:
    """Validates the arguments of :func:`mjp_patch_embed`.

    Returns:
        The geometry, ``pos_embed`` as ``[N, D]``, ``unk_embed`` as ``[D]`` (or None), and the jigsaw.
    """
    images = check_tensor("images", images, ndims=(4,))
    weight = check_tensor("weight", weight, ndims=(4,))
    check_float_dtype("images", images)
    dim, channels, patch_h, patch_w = weight.shape
    if patch_h != patch_w:
        raise ValueError(f"weight must be a square Conv2d kernel [D, C, P, P], got shape {list(weight.shape)}")
    patch = patch_h
    if patch < 1 or dim < 1:
        raise ValueError(f"weight must have D >= 1 and P >= 1, got shape {list(weight.shape)}")
    batch, image_channels, height, width = images.shape
    if image_channels != channels:
        raise ValueError(f"images have {image_channels} channels but weight expects {channels} (weight [D, C, P, P])")
    if height % patch or width % patch or height == 0 or width == 0:
        raise ValueError(
            f"images: height {height} and width {width} must be positive multiples of the patch size {patch}"
        )
    rows, cols = height // patch, width // patch
    geometry = PatchGeometry(batch, channels, patch, rows, cols, dim)
    num_positions = rows * cols

    positions = f"N = {rows}x{cols} = {num_positions} patch positions (no class token)"
    pos_embed = check_position_table(pos_embed, num_positions, dim, positions)
    if bias is not None:
        bias = check_tensor("bias", bias, ndims=(1,))
        if bias.shape[0] != dim:
            raise ValueError(f"bias must be [D] = [{dim}], got shape {list(bias.shape)}")
    unk_embed = check_unk_embed(unk_embed, dim, jigsaw)

    floats = {"images": images, "weight": weight, "bias": bias, "pos_embed": pos_embed, "unk_embed": unk_embed}
    for name, tensor in floats.items():
        if tensor is not None and tensor.dtype != images.dtype:
            raise TypeError(f"{name} has dtype {tensor.dtype} but images have {images.dtype}; use one dtype")
    device = check_same_device(**floats)
    jigsaw = check_jigsaw(jigsaw, batch, num_positions, device, validate=validate)
    return geometry, pos_embed, unk_embed, jigsaw


# ----------------------------------------------------------------------------------------------------------------
# Oracle
# ----------------------------------------------------------------------------------------------------------------


def mjp_patch_embed_ref(
    images: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    pos_embed: torch.Tensor,
    unk_embed: torch.Tensor | None,
    jigsaw: Jigsaw | None = None,
    *,
    upcast: bool = False,
) -> torch.Tensor:
    """The definition, step by step: cut the patches, shuffle them, embed them, add the position term.

    Args:
        images: ``[B, C, H, W]``; weight ``[D, C, P, P]``; bias ``[D]`` or None; pos_embed ``[N, D]`` or
            ``[1, N, D]``; unk_embed ``[D]``; jigsaw ``Jigsaw(mask [B, N], perm [B, N])`` or None.
        upcast: compute in float32 and cast the result back (the accuracy reference for half precision).

    Returns:
        tokens ``[B, N, D]`` in the dtype of ``images``.
    """
    geometry, pos_embed, unk_embed, jigsaw = check_patch_embed_args(
        images, weight, bias, pos_embed, unk_embed, jigsaw, validate=False
    )
    out_dtype = images.dtype
    if upcast:
        images, weight, pos_embed = images.float(), weight.float(), pos_embed.float()
        bias = bias.float() if bias is not None else None
        unk_embed = unk_embed.float() if unk_embed is not None else None
    batch, channels, patch = geometry.batch, geometry.channels, geometry.patch_size
    patches = images.reshape(batch, channels, geometry.rows, patch, geometry.cols, patch)
    patches = patches.permute(0, 2, 4, 1, 3, 5).reshape(batch, geometry.num_positions, channels * patch * patch)
    if jigsaw is not None:
        patches = patches.gather(1, jigsaw.perm[..., None].expand_as(patches))
    tokens = patches @ weight.reshape(geometry.dim, -1).t()
    if bias is not None:
        tokens = tokens + bias
    return (tokens + position_term(pos_embed, unk_embed, jigsaw)).to(out_dtype)


# ----------------------------------------------------------------------------------------------------------------
# torch backend
# ----------------------------------------------------------------------------------------------------------------


def _mjp_patch_embed_torch(
    images: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    pos_embed: torch.Tensor,
    unk_embed: torch.Tensor | None,
    jigsaw: Jigsaw | None,
    geometry: PatchGeometry,
) -> torch.Tensor:
    # Embedding first and shuffling tokens after is exact (each token is one linear map of one patch) and
    # moves D values per token instead of C*P*P.
    tokens = F.conv2d(images, weight, bias, stride=geometry.patch_size).flatten(2).transpose(1, 2)
    if jigsaw is None:
        return tokens + pos_embed
    return _MJPPosEmbed.apply(tokens, jigsaw.perm, jigsaw.mask, pos_embed, unk_embed)


# ----------------------------------------------------------------------------------------------------------------
# Compiled (cpu, cuda) and Triton backends: torch.library operators with registered autograd
# ----------------------------------------------------------------------------------------------------------------


@torch.library.custom_op("mjp_fast::patch_embed_extension", mutates_args=())
def _patch_embed_extension(
    images: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    pos_embed: torch.Tensor,
    unk_embed: torch.Tensor | None,
    perm: torch.Tensor | None,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """The compiled kernels: gather fused into the patch extraction, GEMM, one epilogue pass."""
    return backend_module.extension().patch_embed_forward(
        images.contiguous(),
        weight.contiguous(),
        None if bias is None else bias.contiguous(),
        pos_embed.contiguous(),
        None if unk_embed is None else unk_embed.contiguous(),
        perm,
        mask,
    )


@torch.library.custom_op("mjp_fast::patch_embed_extension_backward", mutates_args=())
def _patch_embed_extension_backward(
    grad_out: torch.Tensor,
    images: torch.Tensor,
    weight: torch.Tensor,
    perm: torch.Tensor | None,
    mask: torch.Tensor | None,
    need_images: bool,
    need_weight: bool,
    need_bias: bool,
    need_pos: bool,
    need_unk: bool,
) -> list[torch.Tensor]:
    """``[grad_images, grad_weight, grad_bias, grad_pos, grad_unk]``; an empty tensor where not asked for."""
    grads = backend_module.extension().patch_embed_backward(
        grad_out.contiguous(),
        images.contiguous(),
        weight.contiguous(),
        perm,
        mask,
        need_images,
        need_weight,
        need_bias,
        need_pos,
        need_unk,
    )
    return [grad if grad is not None else grad_out.new_empty(0) for grad in grads]


def _forward_fake(images, weight, bias, pos_embed, unk_embed, perm, mask):
    batch, _, height, width = images.shape
    dim, _, patch, _ = weight.shape
    return images.new_empty(batch, (height // patch) * (width // patch), dim)


def _backward_fake(grad_out, images, weight, perm, mask, need_images, need_weight, need_bias, need_pos, need_unk):
    dim = weight.shape[0]
    shapes = [images.shape, weight.shape, (dim,), (grad_out.shape[1], dim), (dim,)]
    needs = [need_images, need_weight, need_bias, need_pos, need_unk]
    return [images.new_empty(shape) if need else images.new_empty(0) for shape, need in zip(shapes, needs)]


def _register_autograd(forward_op, backward_op) -> None:
    """Autograd for a forward operator with the signature of ``mjp_patch_embed``'s kernels.

    The backward re-gathers the patches from the saved images: nothing of size ``B*N*C*P*P`` is kept.
    """

    def setup_context(ctx, inputs, output):
        images, weight, bias, pos_embed, unk_embed, perm, mask = inputs
        ctx.save_for_backward(images, weight, perm, mask)
        ctx.has_bias, ctx.has_unk = bias is not None, unk_embed is not None

    def backward(ctx, grad_out):
        images, weight, perm, mask = ctx.saved_tensors
        needs = ctx.needs_input_grad
        wanted = [needs[0], needs[1], needs[2] and ctx.has_bias, needs[3], needs[4] and ctx.has_unk]
        grads = backward_op(grad_out, images, weight, perm, mask, *wanted)
        return (*(grad if want else None for grad, want in zip(grads, wanted)), None, None)

    forward_op.register_autograd(backward, setup_context=setup_context)


_patch_embed_extension.register_fake(_forward_fake)
_patch_embed_extension_backward.register_fake(_backward_fake)
_register_autograd(_patch_embed_extension, _patch_embed_extension_backward)


if backend_module.triton_importable():
    from mjp_fast.triton.patch_embed import patch_embed_backward_triton, patch_embed_forward_triton

    # Explicit shapes: triton_op traces kernel launches by itself on a GPU, not under the CPU interpreter.
    patch_embed_forward_triton.register_fake(_forward_fake)
    patch_embed_backward_triton.register_fake(_backward_fake)
    _register_autograd(patch_embed_forward_triton, patch_embed_backward_triton)


# ----------------------------------------------------------------------------------------------------------------
# Public function
# ----------------------------------------------------------------------------------------------------------------


def mjp_patch_embed(
    images: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    pos_embed: torch.Tensor,
    unk_embed: torch.Tensor | None,
    jigsaw: Jigsaw | None = None,
    *,
    backend: str | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """MJP patch embedding: the patch embedding of the jigsawed image plus the position term.

    ``tokens[b, n] = conv_patch(images[b], perm[b, n]) + bias + (unk_embed if mask[b, n] else pos_embed[n])``.
    Without a jigsaw it is the plain patch embedding plus ``pos_embed`` (timm's ``PatchEmbed`` followed by the
    position-embedding add). Differentiable in images, weight, bias, pos_embed and unk_embed.

    Args:
        images: ``[B, C, H, W]``, float32, float16 or bfloat16; ``H`` and ``W`` multiples of ``P``.
        weight: the Conv2d weight ``[D, C, P, P]`` (timm's ``patch_embed.proj.weight``).
        bias: ``[D]`` or None.
        pos_embed: ``[N, D]`` or ``[1, N, D]``, the patch positions only (no class token), ``N = (H/P)(W/P)``.
        unk_embed: ``[D]``, the unknown position embedding (may be None without a jigsaw).
        jigsaw: from :func:`sample_jigsaw`, or None for the plain embedding.
        backend: ``torch``, ``cpu``, ``cuda`` or ``triton``; default ``MJP_FAST_BACKEND``, else the fastest for
            the device.
        validate: check that ``jigsaw.perm`` permutes exactly the masked positions. This costs a host sync on a
            GPU; :class:`mjp_fast.MJPPatchEmbed` turns it off for the jigsaws it samples itself.

    Returns:
        tokens ``[B, N, D]`` in the dtype of ``images``.
    """
    geometry, pos_embed, unk_embed, jigsaw = check_patch_embed_args(
        images, weight, bias, pos_embed, unk_embed, jigsaw, validate=validate
    )
    chosen = backend_module.resolve_backend(backend, images.device)
    if chosen == "torch":
        return _mjp_patch_embed_torch(images, weight, bias, pos_embed, unk_embed, jigsaw, geometry)
    perm, mask = (None, None) if jigsaw is None else (jigsaw.perm.contiguous(), jigsaw.mask.contiguous())
    if chosen == "triton":
        if images.dtype == torch.float64:
            raise TypeError("images: the triton backend supports float32, float16 and bfloat16, got float64")
        return patch_embed_forward_triton(images, weight, bias, pos_embed.contiguous(), unk_embed, perm, mask)
    return _patch_embed_extension(images, weight, bias, pos_embed, unk_embed, perm, mask)
