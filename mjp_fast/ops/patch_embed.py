"""The MJP patch embedding: patch embedding of the jigsawed image plus the unknown-or-learned position embedding.

``tokens[b, n] = W @ patch(images[b], perm[b, n]) + bias + (unk_embed if mask[b, n] else pos_embed[n])``

In this file, in order: argument checks, the oracle ``mjp_patch_embed_ref`` (shuffles the patches, then embeds
them), the ``torch`` backend (embeds with a convolution, then shuffles the tokens: ``P(XW) = (PX)W``), the
operators over the compiled kernels (``cpu``, ``cuda``) and the Triton kernels (``triton``), registered with
torch.library with their autograd, and the public ``mjp_patch_embed``.

No backend makes a jigsawed image; where the jigsaw and the position term happen differs:

- ``triton``: one GEMM whose loads gather the permuted patches straight from the images (no im2col matrix); its
  epilogue adds the bias and the position term in float32 and rounds once.
- ``cpu``: the permuted im2col rows are gathered chunk by chunk, each chunk small enough to stay in cache through
  its GEMM and the epilogue that adds the bias and the position term; float accumulation, rounded once.
- ``cuda``: one kernel gathers the whole permuted im2col matrix ``[B*N, C*P*P]`` in the images' dtype, cuBLAS
  multiplies it (its output rounded to that dtype), then a second kernel adds the bias and the position term and
  rounds again: the gather is fused into the im2col, the epilogue is a pass of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from mjp_fast import backend as backend_module
from mjp_fast._validate import (
    check_float_dtype,
    check_position_table,
    check_same_device,
    check_same_dtype,
    check_tensor,
)
from mjp_fast.ops.dal_regressor import fused_layers
from mjp_fast.ops.pos_embed import (
    check_unk_embed,
    mjp_pos_embed_torch,
    plain_positions,
    position_term,
    prepend_prefix,
)
from mjp_fast.sampler.jigsaw import Jigsaw, check_jigsaw


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
    images: object, weight: object, bias: object, pos_embed: object, unk_embed: object, jigsaw: object, *,
    validate: bool,
) -> tuple[PatchGeometry, torch.Tensor, torch.Tensor | None, Jigsaw | None]:  # fmt: skip
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
    check_same_dtype("images", **floats)
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
    images: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pos_embed: torch.Tensor,
    unk_embed: torch.Tensor | None, jigsaw: Jigsaw | None, geometry: PatchGeometry,
) -> torch.Tensor:  # fmt: skip
    # Embedding first and shuffling tokens after is exact (each token is one linear map of one patch) and
    # moves D values per token instead of C*P*P.
    if images.shape[1] == 0:
        # No channels: every patch is empty, each token is the bias alone (conv2d refuses C = 0). The zero product
        # keeps images and weight in the graph, with their (empty) gradients.
        batch, _, height, width = images.shape
        num_positions = (height // geometry.patch_size) * (width // geometry.patch_size)
        tokens = (images.sum() * weight.sum()).expand(batch, num_positions, weight.shape[0])
        if bias is not None:
            tokens = tokens + bias
    elif jigsaw is None:
        tokens = F.conv2d(images, weight, bias, stride=geometry.patch_size).flatten(2).transpose(1, 2)
    else:
        # The bias rides on the position terms, not on the moved tokens: a perm entry outside [0, N) (validate=False)
        # moves a zero token, and the token of a zero patch is the bias (mjp_fast/_validate.py), as the kernels give.
        tokens = F.conv2d(images, weight, None, stride=geometry.patch_size).flatten(2).transpose(1, 2)
        if bias is not None:
            pos_embed, unk_embed = pos_embed + bias, unk_embed + bias
    if jigsaw is None:
        return plain_positions(tokens, pos_embed, unk_embed)
    return mjp_pos_embed_torch(tokens, pos_embed, unk_embed, jigsaw)


# ----------------------------------------------------------------------------------------------------------------
# Compiled (cpu, cuda) and Triton backends: torch.library operators, and one autograd node over them
# ----------------------------------------------------------------------------------------------------------------
#
# Row layout of the kernels: the output is [B, P + N, D], P prefix tokens (class, registers: ``prefix``, P * D
# elements, or None) then the N patch tokens. The position table is the model's whole table, its last two dims
# [Q + N, D] with Q (``prefix_positions``) 0 or P: row t < Q is prefix token t's, row Q + n patch position n's.
# ``out[b, t] = prefix[t] + (pos[t] if t < Q)``; ``out[b, P + n] = W @ patch(images[b], perm[b, n]) + bias +
# (unk if mask[b, n] else pos[Q + n])``. Gradients come back in the shapes of their inputs.


if backend_module.triton_usable():
    from mjp_fast.triton import dal_loss as _triton_dal_kernels
    from mjp_fast.triton import patch_embed as _triton_patch_embed


def _setup_context(
    ctx, inputs: tuple, output: torch.Tensor, kernels: str | None = None, more_saved: tuple = ()
) -> None:
    """What a backward of the kernels keeps, for both ways in: :class:`_PatchEmbedKernels` (``kernels`` None: its
    last input names the backend) and the operators' own autograd (``kernels``: ``"extension"`` or ``"triton"``).

    ``inputs``: ``(images, weight, bias, pos_embed, unk_embed, perm, mask, prefix, prefix_positions, out_dtype,
    compute_dtype, ...)``, the operators' order; a caller of an operator may leave the defaults out. The images are
    saved, not the gathered patches: nothing of size ``B*N*C*P*P`` is kept. ``more_saved``: tensors saved after
    those (a node that also computes the DAL loss).
    """
    images, weight, bias, pos_embed, unk_embed, perm, mask, *layout = inputs
    prefix = layout[0] if layout else None
    prefix_positions = layout[1] if len(layout) > 1 else 0
    ctx.num_inputs = len(inputs)
    ctx.kernels = kernels if kernels is not None else ("triton" if layout[4] == "triton" else "extension")
    ctx.compute_dtype = layout[3] if len(layout) > 3 else None
    # The node's eager backward launches the Triton kernels itself; an operator's autograd calls the backward
    # operator (it may run under tracing: fake tensors have no memory to launch on).
    ctx.launch_directly = kernels is None
    ctx.save_for_backward(images, weight, perm, mask, *more_saved)
    # The position terms and the prefix come in their own dtype (the Triton kernels read them so, the compiled ones'
    # operators convert them): their gradients go back in those dtypes (a float32 table under autocast gets a float32
    # gradient, no cast from Python).
    ctx.dtypes = (
        pos_embed.dtype,
        unk_embed.dtype if unk_embed is not None else None,
        prefix.dtype if prefix is not None else None,
    )
    prefix_count = prefix.numel() // weight.shape[0] if prefix is not None else 0
    prefix_shape = list(prefix.shape) if prefix is not None else [0]
    ctx.layout = (prefix_count, prefix_positions, list(pos_embed.shape), prefix_shape)
    ctx.present = (bias is not None, unk_embed is not None, prefix is not None)
    ctx.permutation = False  # each row of perm known to be a permutation: the nodes below set it


def _backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """The gradients of the inputs :func:`_setup_context` saw, one backward call: the compiled kernels as their C++
    operator; the Triton kernels through their launcher (eager :class:`_PatchEmbedKernels`), else their operator."""
    images, weight, perm, mask = ctx.saved_tensors[:4]
    needs = ctx.needs_input_grad
    has_bias, has_unk, has_prefix = ctx.present
    wanted = (needs[0], needs[1], needs[2] and has_bias, needs[3], needs[4] and has_unk, has_prefix and needs[7])
    arguments = (grad.contiguous(), images, weight, perm, mask, *wanted, *ctx.layout)
    # each gradient in its input's dtype (a float32 table under autocast gets a float32 gradient: no cast after)
    if ctx.kernels == "triton":
        direct = ctx.launch_directly and not torch.compiler.is_compiling()
        launch = _triton_patch_embed.patch_embed_backward_launch if direct else None
        backward = launch or torch.ops.mjp_fast.patch_embed_triton_backward
        grads = backward(*arguments, *ctx.dtypes, ctx.compute_dtype, ctx.permutation)
    else:  # the compiled kernels' weight gradient re-gathers the patches into a matrix: a perm costs it nothing
        grads = torch.ops.mjp_fast.patch_embed_extension_backward(*arguments, *ctx.dtypes, ctx.compute_dtype)
    grads = [grad if want else None for grad, want in zip(grads, wanted)]
    return (*grads[:5], None, None, grads[5], None, None, None, None, None)[: ctx.num_inputs]


class _PatchEmbedKernels(torch.autograd.Function):
    """The ``cpu``, ``cuda`` and ``triton`` kernels as one autograd node, forward and backward each one call.

    The compiled kernels run as their C++ operators, eager or compiled: one dispatcher call each way. The Triton
    kernels run eagerly through their launchers (the Python operator wrappers cost host time a GPU step feels),
    under torch.compile as their operators. Inputs: the operators' (see :func:`_setup_context`), then ``out_dtype``,
    ``compute_dtype``, the backend and ``permutation`` (each row of ``perm`` known to be a permutation: the Triton
    weight gradient's inverse-permutation path). The operators themselves get the same autograd
    (:func:`_setup_context`, :func:`_backward`), for a caller of ``torch.ops.mjp_fast.patch_embed_*``.
    """

    @staticmethod
    def forward(
        ctx, images, weight, bias, pos_embed, unk_embed, perm, mask, prefix, prefix_positions, out_dtype,
        compute_dtype, backend, permutation,
    ):  # type: ignore[override]  # fmt: skip
        arguments = (images, weight, bias, pos_embed, unk_embed, perm, mask, prefix, prefix_positions)
        # The context of the operators' own autograd, set here: a Function with a separate setup_context costs
        # about 0.1 ms more host time per step on the CPU.
        _setup_context(ctx, (*arguments, out_dtype, compute_dtype, backend), None)
        ctx.num_inputs += 1  # permutation
        ctx.permutation = permutation
        if backend == "triton":
            if torch.compiler.is_compiling():
                return torch.ops.mjp_fast.patch_embed_triton(*arguments, out_dtype, compute_dtype)
            return _triton_patch_embed.patch_embed_forward_launch(*arguments, out_dtype, compute_dtype)
        return torch.ops.mjp_fast.patch_embed_extension(*arguments, out_dtype, compute_dtype)

    backward = staticmethod(_backward)


class _PatchEmbedWithDALTriton(torch.autograd.Function):
    """The ``triton`` patch embedding (as :class:`_PatchEmbedKernels`) and the DAL loss of its position table as one
    autograd node (eager only), as :class:`mjp_fast.ops.pos_embed._StepWithDALTriton` is for the token path: the
    same launches as the two nodes, one node's bookkeeping, and the DAL backward adds its share of the table's
    gradient into the embedding's in the same pass (no second tensor, no add).

    Inputs: :class:`_PatchEmbedKernels`'s without the backend, then the regressor's layers ``w1, b1, w2, b2``
    (``w1`` and ``b1`` None for the linear one), ``coords`` float32 ``[N, 2]``, ``dal_mask`` bool ``[B, N]``,
    ``scale`` and ``permutation`` (as :class:`_PatchEmbedKernels`'s). Outputs ``(tokens [B, P + N, D], loss [])``:
    DAL skips the table's first ``prefix_positions`` rows.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, images, weight, bias, pos_embed, unk_embed, perm, mask, prefix, prefix_positions, out_dtype,
        compute_dtype, w1, b1, w2, b2, coords, dal_mask, scale, permutation,
    ):  # fmt: skip
        arguments = (images, weight, bias, pos_embed, unk_embed, perm, mask, prefix, prefix_positions)
        out = _triton_patch_embed.patch_embed_forward_launch(*arguments, out_dtype, compute_dtype)
        loss, saved = _triton_dal_kernels.dal_forward_launch(
            pos_embed, prefix_positions, w1, b1, w2, b2, coords, dal_mask, scale
        )
        inputs = (*arguments, out_dtype, compute_dtype, "triton")
        _setup_context(ctx, inputs, out, more_saved=(pos_embed, w1, w2, coords, saved))
        ctx.num_inputs = len(inputs) - 1  # no backend among this node's inputs
        ctx.permutation = permutation
        ctx.scale, ctx.has_bias = scale, (b1 is not None, b2 is not None)
        return out, loss

    @staticmethod
    def backward(ctx, grad_out, grad_loss):  # type: ignore[override]
        grads = _backward(ctx, grad_out)
        pos_embed, w1, w2, coords, saved = ctx.saved_tensors[4:]
        grad_pos = grads[3]
        _, grad_w1, grad_b1, grad_w2, grad_b2 = _triton_dal_kernels.dal_backward_launch(
            grad_loss, pos_embed, ctx.layout[1], w1, w2, coords, saved, ctx.scale, *ctx.has_bias, grad_pos=grad_pos
        )
        has_b1, has_b2 = ctx.has_bias
        return (
            *grads, grad_w1 if w1 is not None else None, grad_b1 if has_b1 else None, grad_w2,
            grad_b2 if has_b2 else None, None, None, None, None,
        )  # fmt: skip


if backend_module.extension() is not None:
    # mjp_fast._C defines the operators in C++ (schema, CPU, CUDA and Meta kernels); their autograd is Python's.
    torch.library.register_autograd(
        "mjp_fast::patch_embed_extension", _backward, setup_context=partial(_setup_context, kernels="extension")
    )

if backend_module.triton_usable():
    triton_forward = _triton_patch_embed.patch_embed_forward_triton
    torch.library.register_autograd(triton_forward, _backward, setup_context=partial(_setup_context, kernels="triton"))


def patch_embed_step(
    images: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pos_embed: torch.Tensor,
    unk_embed: torch.Tensor | None, jigsaw: Jigsaw | None, backend: str, prefix: torch.Tensor | None = None,
    prefix_positions: int = 0, out_dtype: torch.dtype | None = None, compute_dtype: torch.dtype | None = None,
    permutation: bool = False,
) -> torch.Tensor:  # fmt: skip
    """A ViT's patch embedding and whole position step in one operation each way, for callers that checked the
    arguments and resolved the backend (the timm models' per-step path).

    Those callers skip :func:`check_patch_embed_args`, so the dtypes are settled here (metadata only, no sync): the
    Triton kernels multiply float32, float16 or bfloat16 tiles, and float64 images or weight (a ``model.double()``)
    run the ``torch`` backend's computation instead, as :func:`mjp_fast.ops.pos_embed.mjp_position_step` does for
    float64 tokens (given to the kernels, such a model's tokens were garbage: issue 42).

    Args:
        images: ``[B, C, H, W]``; weight ``[D, C, P, P]``; bias ``[D]`` or None.
        pos_embed: the model's whole table, last two dims ``[Q + N, D]`` (``[1, Q + N, D]`` in timm); its first
            Q = ``prefix_positions`` rows are the prefix tokens'.
        unk_embed: ``[D]`` (None without a jigsaw). jigsaw: the batch's, or None.
        prefix: the class and register tokens (``P * D`` elements, timm's ``cls_token``), or None.
        out_dtype: the output's dtype (default the images'). The Triton kernels add the position terms and the prefix
            in float32 from their own dtype and write it directly; the compiled ones (``cpu``, ``cuda``) take
            everything in the images' dtype and cast the result, inside their operator.
        compute_dtype: autocast's dtype, or None: the patch projection runs in it as timm's convolution would under
            autocast (its floating inputs but float64 ones rounded to it). The Triton kernels take the images,
            weight and bias as they are and round each tile as they load it. The compiled ones get the images cast
            (autograd keeps that copy for the backward's weight gradient: no second cast) and convert the rest, and
            the gradients back, inside their operators. The ``torch`` backend gets the three cast.
        permutation: each row of ``jigsaw.perm`` is known to be a permutation (a validated jigsaw, or one a sampler
            made): the ``triton`` weight gradient then gathers the gradient's rows by the inverse permutation
            instead of the patches by ``perm`` (the same sum in another order). Never set it for a jigsaw that was not
            checked: the weight gradient of any other perm would be wrong.

    Returns:
        ``[B, P + N, D]``.

    Raises:
        TypeError: images of a dtype no backend embeds (uint8 images: normalise them to a float dtype first).
    """
    check_float_dtype("images", images)  # uint8 (unnormalised) images: no backend's arithmetic is timm's for them
    if backend == "triton" and (images.dtype == torch.float64 or weight.dtype == torch.float64):
        backend = "torch"
    if compute_dtype is not None:
        if backend == "cpu" or backend == "cuda":
            images = autocast_like_conv(images, compute_dtype)
        elif backend != "triton" or images.dtype == torch.float64:
            images, weight, bias = (autocast_like_conv(tensor, compute_dtype) for tensor in (images, weight, bias))
            compute_dtype = None
    dtype = images.dtype
    out_dtype = out_dtype or dtype
    perm, mask = (None, None) if jigsaw is None else (jigsaw.perm, jigsaw.mask)
    if backend == "torch":
        dim = weight.shape[0]
        geometry = PatchGeometry(images.shape[0], images.shape[1], weight.shape[-1], 0, 0, dim)
        num_positions = pos_embed.shape[-2] - prefix_positions
        patch_rows = pos_embed[..., prefix_positions:, :].reshape(num_positions, dim).to(dtype)
        tokens = _mjp_patch_embed_torch(images, weight, bias, patch_rows, unk_embed, jigsaw, geometry).to(out_dtype)
        return prepend_prefix(tokens, pos_embed, prefix, prefix_positions)
    if backend == "triton":
        pos_embed, prefix = pos_embed.contiguous(), prefix.contiguous() if prefix is not None else None
        return _PatchEmbedKernels.apply(
            images, weight, bias, pos_embed, unk_embed, perm, mask, prefix, prefix_positions, out_dtype,
            compute_dtype, backend, permutation,
        )  # fmt: skip
    # The compiled kernels take one dtype: the operator converts the weight, bias, table, unk and prefix to the
    # images' (or compute_dtype), and the output to out_dtype, and the gradients back to their inputs' dtypes.
    return _PatchEmbedKernels.apply(
        images, weight, bias, pos_embed, unk_embed, perm, mask, prefix, prefix_positions, out_dtype,
        compute_dtype or dtype, backend, permutation,
    )  # fmt: skip


# The images' dtypes the Triton kernels embed (mjp_fast/triton/patch_embed.py); float64 is the other backends'.
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# The backends whose fused patch embedding computes the DAL loss of its table in the same node
# (:func:`patch_embed_dal_step`).
EMBED_WITH_DAL_BACKENDS = frozenset({"triton"})


def patch_embed_dal_step(
    images: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pos_embed: torch.Tensor,
    unk_embed: torch.Tensor | None, jigsaw: Jigsaw, backend: str, prefix: torch.Tensor | None,
    prefix_positions: int, regressor: torch.nn.Module, coords: torch.Tensor, dal_mask: torch.Tensor, scale: float,
    out_dtype: torch.dtype | None = None, compute_dtype: torch.dtype | None = None, permutation: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
    """:func:`patch_embed_step` and the DAL loss of the same table (``pos_embed``, its first ``prefix_positions``
    rows skipped) as one autograd node, for the timm models' training step: ``(tokens, dal_loss)``, or None where
    that does not apply (then call the two functions): a backend other than ``triton`` (the extension's backends
    run their two operators), a regressor the fused kernels do not compute, float64 or images of no float dtype, or
    torch.compile (which sees the two operators and fuses what it likes).

    The arguments are :func:`patch_embed_step`'s, then the DAL loss's: ``regressor``, ``coords`` float32 ``[N, 2]``,
    ``dal_mask`` bool ``[B, N]`` (the positions the loss leaves out: the sampled mask) and ``scale``; then
    ``out_dtype``, ``compute_dtype`` and ``permutation``, as :func:`patch_embed_step`'s.
    """
    if backend not in EMBED_WITH_DAL_BACKENDS or torch.compiler.is_compiling():
        return None
    # float64 (no Triton kernels in it), or images of no float dtype: patch_embed_step's torch path, or its error
    if images.dtype not in TRITON_DTYPES or torch.float64 in (weight.dtype, pos_embed.dtype):
        return None
    layers = fused_layers(regressor)
    if layers is None:
        return None
    prefix = prefix.contiguous() if prefix is not None else None
    return _PatchEmbedWithDALTriton.apply(
        images, weight, bias, pos_embed.contiguous(), unk_embed, jigsaw.perm, jigsaw.mask, prefix, prefix_positions,
        out_dtype or images.dtype, compute_dtype, *layers, coords, dal_mask, scale, permutation,
    )  # fmt: skip


def autocast_like_conv(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``tensor`` as autocast gives it to a convolution running in ``dtype``: floating tensors but float64 ones
    cast, anything else as it is."""
    if tensor is None or not tensor.is_floating_point() or tensor.dtype in (dtype, torch.float64):
        return tensor
    return tensor.to(dtype)


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
        unk_embed: ``[D]``, the unknown position embedding (may be None without a jigsaw; given without one, its
            gradient is zeros on every backend, never None: see :func:`~mjp_fast.ops.pos_embed.plain_positions`).
        jigsaw: from :func:`sample_jigsaw`, or None for the plain embedding.
        backend: ``torch``, ``cpu``, ``cuda`` or ``triton``; default ``MJP_FAST_BACKEND``, else the fastest for
            the device.
        validate: check that ``jigsaw.perm`` permutes exactly the masked positions. This costs a host sync on a
            GPU; :class:`mjp_fast.MJPPatchEmbed` turns it off for the jigsaws it samples itself. What
            ``validate=False`` still guarantees for a jigsaw that is not valid (memory safety, defined results, the
            same on every backend) is written once, in :mod:`mjp_fast._validate`.

    Returns:
        tokens ``[B, N, D]`` in the dtype of ``images``.
    """
    return embed_patches(
        images, weight, bias, pos_embed, unk_embed, jigsaw, backend=backend, validate=validate, permutation=validate
    )


def embed_patches(
    images: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pos_embed: torch.Tensor,
    unk_embed: torch.Tensor | None, jigsaw: Jigsaw | None, *, backend: str | None, validate: bool, permutation: bool,
) -> torch.Tensor:  # fmt: skip
    """:func:`mjp_patch_embed` for a caller that knows more of its jigsaw: ``permutation``, each row of
    ``jigsaw.perm`` is a permutation (a jigsaw that ``validate`` checks, or that the caller's own sampler made, as
    :class:`mjp_fast.MJPPatchEmbed`'s), which the ``triton`` weight gradient uses (see :func:`patch_embed_step`).
    The other arguments and the result are :func:`mjp_patch_embed`'s."""
    geometry, pos_embed, unk_embed, jigsaw = check_patch_embed_args(
        images, weight, bias, pos_embed, unk_embed, jigsaw, validate=validate
    )
    chosen = backend_module.resolve_backend(backend, images.device)
    if chosen == "torch":
        return _mjp_patch_embed_torch(images, weight, bias, pos_embed, unk_embed, jigsaw, geometry)
    if chosen == "triton" and images.dtype == torch.float64:
        raise TypeError(
            "images: the triton backend supports float32, float16 and bfloat16, got float64; float64 runs on "
            "backend='torch' (or 'cpu' / 'cuda', the compiled extension's)"
        )
    if jigsaw is not None:
        jigsaw = Jigsaw(jigsaw.mask.contiguous(), jigsaw.perm.contiguous())
    return patch_embed_step(images, weight, bias, pos_embed, unk_embed, jigsaw, chosen, permutation=permutation)
