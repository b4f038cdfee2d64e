"""``mjp_pos_embed``: MJP on tokens that are already embedded: move them by the jigsaw, add the position term.

``out[b, n] = tokens[b, perm[b, n]] + (unk_embed if mask[b, n] else pos_embed[n])``

This is how the timm models of :mod:`mjp_fast.timm` apply MJP after timm's own patch embedding: moving the
embedded tokens is moving the patches, since each token is one linear map of one patch.

It is one autograd node rather than the composition of the oracle (a gather, ``torch.where``, an add), whose
backward materialises the ``where`` gradient twice at ``[B, N, D]`` and reduces each. Here:

- the forward looks the position term up row by row in ``[pos_embed; unk_embed]`` (the same values as the
  oracle's ``where``, so the sum is exact);
- the backward moves the gradient back (:func:`~mjp_fast.ops.permute.move_rows_back`, the gather's exact gradient
  for any ``perm``: see :mod:`mjp_fast._validate` for what ``validate=False`` promises);
- one batched matmul ``[N, 2, B] @ [N, B, D]`` (over a transposed copy of the gradient) gives, per position,
  the gradient summed over the samples where it is unmasked (``pos_embed``'s) and where it is masked (summed
  over positions: ``unk_embed``'s). The matmul accumulates both sums as the oracle's reductions do, so half
  precision loses nothing to a difference of large sums.

On 2 CPU cores at DeiT-Tiny's shapes (batch 32, ratio 0.1) forward + backward take about 3.5 ms against the
composition's 5.5 ms.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from mjp_fast import backend as backend_module
from mjp_fast._eager_cache import eager_cache
from mjp_fast._validate import check_float_dtype, check_position_table, check_same_device, check_tensor
from mjp_fast.ops.aux_loss import keep_in_graph
from mjp_fast.ops.dal_regressor import fused_layers
from mjp_fast.ops.permute import move_rows, move_rows_back
from mjp_fast.sampler.jigsaw import Jigsaw, check_jigsaw


def check_unk_embed(unk_embed: object, dim: int, jigsaw: object) -> torch.Tensor | None:
    """``unk_embed`` ``[D]`` (or ``[1, 1, D]``), returned as ``[D]``; required when a jigsaw is given."""
    if unk_embed is None:
        if jigsaw is not None:
            raise ValueError(
                "unk_embed must be given when a jigsaw is given (it replaces pos_embed at masked positions)"
            )
        return None
    unk_embed = check_tensor("unk_embed", unk_embed)
    if unk_embed.dim() == 0 or unk_embed.numel() != dim or unk_embed.shape[-1] != dim:
        raise ValueError(f"unk_embed must be [D] = [{dim}] (or [1, 1, D]), got shape {list(unk_embed.shape)}")
    return unk_embed.reshape(dim)


def position_term(pos_embed: torch.Tensor, unk_embed: torch.Tensor | None, jigsaw: Jigsaw | None) -> torch.Tensor:
    """The oracles' position term: ``pos_embed`` ``[N, D]`` without a jigsaw; with one, ``[B, N, D]``
    ``torch.where(mask, unk_embed, pos_embed)`` in the table's dtype."""
    if jigsaw is None:
        return pos_embed
    return torch.where(jigsaw.mask[..., None], unk_embed.to(pos_embed.dtype), pos_embed)


def plain_positions(tokens: torch.Tensor, pos_embed: torch.Tensor, unk_embed: torch.Tensor | None) -> torch.Tensor:
    """``tokens + pos_embed`` (no jigsaw), with a zero gradient for a given ``unk_embed`` that requires one.

    Without a jigsaw nothing uses ``unk_embed``, and its gradient is zeros on every backend and in the modules, never
    None: the kernels take it as an input and give zeros, and a parameter with no gradient would need DDP's
    ``find_unused_parameters`` and let the optimizer skip it in the steps where the jigsaw is off (eval, ``prob=0``).
    """
    out = tokens + pos_embed
    if unk_embed is not None and unk_embed.requires_grad and torch.is_grad_enabled():
        out = keep_in_graph(out, unk_embed)
    return out


def check_pos_embed_args(
    tokens: object, pos_embed: object, unk_embed: object, jigsaw: object, *, validate: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Jigsaw | None]:
    """Validates the arguments of :func:`mjp_pos_embed`.

    Returns:
        ``tokens`` ``[B, N, D]``, ``pos_embed`` as ``[N, D]``, ``unk_embed`` as ``[D]`` (or None), the jigsaw.
    """
    tokens = check_tensor("tokens", tokens, ndims=(3,))
    check_float_dtype("tokens", tokens)
    batch, num_positions, dim = tokens.shape
    positions = f"the tokens' N = {num_positions} (patch positions only, no class token)"
    pos_embed = check_position_table(pos_embed, num_positions, dim, positions)
    check_float_dtype("pos_embed", pos_embed)
    unk_embed = check_unk_embed(unk_embed, dim, jigsaw)
    if unk_embed is not None:
        check_float_dtype("unk_embed", unk_embed)
    device = check_same_device(tokens=tokens, pos_embed=pos_embed, unk_embed=unk_embed)
    jigsaw = check_jigsaw(jigsaw, batch, num_positions, device, validate=validate)
    return tokens, pos_embed, unk_embed, jigsaw


def mjp_pos_embed_ref(
    tokens: torch.Tensor, pos_embed: torch.Tensor, unk_embed: torch.Tensor | None, jigsaw: Jigsaw | None = None
) -> torch.Tensor:
    """Oracle: ``tokens`` gathered along the positions, plus ``torch.where(mask, unk_embed, pos_embed)``.

    Shapes as :func:`mjp_pos_embed`; the result has the dtype ``tokens + pos_embed`` promotes to.
    """
    tokens, pos_embed, unk_embed, jigsaw = check_pos_embed_args(tokens, pos_embed, unk_embed, jigsaw, validate=False)
    if jigsaw is None:
        return tokens + pos_embed
    moved = tokens.gather(1, jigsaw.perm[..., None].expand_as(tokens))
    return moved + position_term(pos_embed, unk_embed, jigsaw)


class _MJPPosEmbed(torch.autograd.Function):
    """tokens ``[B, N, D]``, perm int64 ``[B, N]``, mask bool ``[B, N]``, pos_embed ``[N, D]``, unk ``[D]``."""

    @staticmethod
    def forward(ctx, tokens, perm, mask, pos_embed, unk_embed):  # type: ignore[override]
        # The dtype of `tokens + pos_embed`, as timm's own add (under autocast: bfloat16 tokens, float32 table).
        dtype = torch.promote_types(tokens.dtype, pos_embed.dtype)
        out = move_rows(tokens, perm).to(dtype)  # a fresh tensor (the move gathers): the add goes in place
        # The position term as a row lookup in [pos_embed; unk_embed] (row N is unk_embed): the oracle's values,
        # copied row by row (several times faster on the CPU than where's broadcast; pos + mask * (unk - pos)
        # would round twice).
        num_positions = pos_embed.shape[0]
        table = torch.cat((pos_embed.to(dtype), unk_embed.to(pos_embed.dtype).to(dtype).unsqueeze(0)))
        rows = torch.where(mask, num_positions, torch.arange(num_positions, device=mask.device))
        out.add_(F.embedding(rows, table))
        ctx.save_for_backward(perm, mask)
        ctx.dtypes = (tokens.dtype, pos_embed.dtype, unk_embed.dtype)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        perm, mask = ctx.saved_tensors
        tokens_dtype, pos_dtype, unk_dtype = ctx.dtypes
        need_tokens, _, _, need_pos, need_unk = ctx.needs_input_grad
        grad = grad.contiguous()
        grad_tokens = grad_pos = grad_unk = None
        if need_tokens:
            grad_tokens = move_rows_back(grad, perm).to(tokens_dtype)
        if need_pos or need_unk:
            # weights[n, 0, b] = not masked, weights[n, 1, b] = masked: sums[n] = [pos_embed's, unk's share].
            # The matmul wants the batch of each position contiguous: one transposed copy of the gradient.
            weights = torch.stack((~mask, mask)).permute(2, 0, 1).to(grad.dtype).contiguous()  # [N, 2, B]
            sums = torch.bmm(weights, grad.transpose(0, 1).contiguous())  # [N, 2, D]
            if need_pos:
                grad_pos = sums[:, 0].to(pos_dtype)
            if need_unk:
                grad_unk = sums[:, 1].sum(0).to(unk_dtype)
        return grad_tokens, None, None, grad_pos, grad_unk


def mjp_pos_embed_torch(
    tokens: torch.Tensor, pos_embed: torch.Tensor, unk_embed: torch.Tensor, jigsaw: Jigsaw
) -> torch.Tensor:
    """The ``torch`` backend's MJP step on checked arguments, one autograd node: ``tokens`` ``[B, N, D]`` moved by
    ``jigsaw`` (``[B, N]`` each), plus ``unk_embed`` ``[D]`` at its masked positions and ``pos_embed`` ``[N, D]``
    elsewhere. Returns ``[B, N, D]`` in the dtype ``tokens + pos_embed`` promotes to."""
    return _MJPPosEmbed.apply(tokens, jigsaw.perm, jigsaw.mask, pos_embed, unk_embed)


# ----------------------------------------------------------------------------------------------------------------
# Kernels: the compiled extension (cpu: its operator carries its own autograd, in C++) and Triton (one autograd
# node here)
# ----------------------------------------------------------------------------------------------------------------


if backend_module.triton_usable():
    from mjp_fast.triton import dal_loss as _triton_dal_kernels
    from mjp_fast.triton import pos_embed as _triton_kernels


@eager_cache()
def _extension_operator() -> Callable[..., torch.Tensor]:
    """``pos_embed_extension_autograd`` (the extension's CPU or CUDA kernels with their autograd in C++), looked up
    once: each attribute of ``torch.ops`` is a Python lookup, and this runs every step."""
    return torch.ops.mjp_fast.pos_embed_extension_autograd.default


class _PosEmbedTriton(torch.autograd.Function):
    """The ``triton`` kernels as one autograd node: one pass forward, one pass backward.

    Eager calls launch the kernels directly (the operator wrapper costs host time that a training step feels on a
    GPU); under torch.compile the same kernels are called through their operators, which Inductor sees. (The
    ``cpu`` backend needs no node here: ``pos_embed_extension_autograd`` is differentiable by itself.)

    tokens ``[B, N, D]``, perm int64 and mask bool ``[B, N]`` (contiguous); pos_embed: the table, contiguous, its
    last two dims ``[Q + N, D]`` (the model's whole table: no slicing); unk_embed ``[D]``; prefix: the class and
    register tokens (numel ``P * D``) or None; Q (``prefix_positions``) is 0 or P. All in the output dtype. The
    output is ``[B, P + N, D]``: the prefix tokens (plus their rows of the table), then the patch tokens.
    ``permutation``: each row of ``perm`` is known to be a permutation (validated, or sampled by the model).
    """

    @staticmethod
    def forward(ctx, tokens, perm, mask, pos_embed, unk_embed, prefix, prefix_positions, permutation):  # type: ignore[override]
        _keep_position_layout(ctx, tokens, pos_embed, unk_embed, prefix, prefix_positions, permutation)
        arguments = (tokens, perm, mask, pos_embed, unk_embed, prefix, prefix_positions)
        if torch.compiler.is_compiling():
            ctx.save_for_backward(perm, mask)
            return torch.ops.mjp_fast.pos_embed_triton(*arguments)
        witness = _witness(perm, permutation)
        ctx.save_for_backward(perm, mask, *(() if witness is None else (witness,)))
        return _triton_kernels.pos_embed_forward_launch(*arguments, witness=witness)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        perm, mask, *witness = ctx.saved_tensors
        arguments = (grad.contiguous(), perm, mask, *ctx.layout, *ctx.dtypes)
        if torch.compiler.is_compiling() or not (witness or ctx.permutation):
            grads = torch.ops.mjp_fast.pos_embed_triton_backward(*arguments)  # zero-fills the tokens' gradient
        else:
            witness = witness[0] if witness else None
            grads = _triton_kernels.pos_embed_backward_launch(*arguments, witness=witness, permutation=ctx.permutation)
        grad_tokens, grad_pos, grad_unk, grad_prefix = grads
        return grad_tokens, None, None, grad_pos, grad_unk, grad_prefix if ctx.layout[0] else None, None, None


def _keep_position_layout(ctx, tokens, pos_embed, unk_embed, prefix, prefix_positions, permutation) -> None:
    """What the ``triton`` position step's backward needs besides tensors, on ``ctx``: the row layout (P, Q, the
    table's and the prefix's shapes), the gradients' dtypes and whether ``perm`` is known to be a permutation."""
    prefix_shape = list(prefix.shape) if prefix is not None else [0]
    prefix_count = prefix.numel() // tokens.shape[2] if prefix is not None else 0
    ctx.layout = (prefix_count, prefix_positions, list(pos_embed.shape), prefix_shape)
    prefix_dtype = prefix.dtype if prefix is not None else pos_embed.dtype
    ctx.dtypes = (tokens.dtype, pos_embed.dtype, unk_embed.dtype, prefix_dtype)
    ctx.permutation = permutation


def _witness(perm: torch.Tensor, permutation: bool) -> torch.Tensor | None:
    """int32 ``[B, N]`` for the forward launch to write where each token came from, so that the backward zeroes, in
    its own pass, the gradient rows no token came from (only a perm that is not a permutation has any: no fill, no
    launch of its own); None for a known permutation, whose inverse move writes every row."""
    return None if permutation else torch.empty(perm.shape, dtype=torch.int32, device=perm.device)


class _StepWithDALTriton(torch.autograd.Function):
    """The ``triton`` position step and the DAL loss of the same table as one autograd node (eager only): three
    launches forward, four backward, as the two nodes would, but one node's bookkeeping, and the DAL backward adds
    its share of the table's gradient into the position step's in the same pass (no second tensor, no add).

    The position step's arguments as :class:`_PosEmbedTriton` (the table in its own dtype: no cast), then the
    regressor's layers ``w1, b1, w2, b2`` (``w1`` and ``b1`` None for the linear one), ``coords`` float32 ``[N,
    2]``, ``dal_mask`` bool ``[B, N]``, ``scale`` and ``permutation``. Outputs ``(out [B, P + N, D], loss [])``:
    DAL skips the table's first ``prefix_positions`` rows.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, tokens, perm, mask, pos_embed, unk_embed, prefix, prefix_positions, w1, b1, w2, b2, coords, dal_mask,
        scale, permutation,
    ):  # fmt: skip
        _keep_position_layout(ctx, tokens, pos_embed, unk_embed, prefix, prefix_positions, permutation)
        ctx.scale, ctx.has_bias = scale, (b1 is not None, b2 is not None)
        witness = _witness(perm, permutation)
        out = _triton_kernels.pos_embed_forward_launch(
            tokens, perm, mask, pos_embed, unk_embed, prefix, prefix_positions, witness=witness
        )
        loss, saved = _triton_dal_kernels.dal_forward_launch(
            pos_embed, prefix_positions, w1, b1, w2, b2, coords, dal_mask, scale
        )
        ctx.save_for_backward(perm, mask, pos_embed, w1, w2, coords, saved, *(() if witness is None else (witness,)))
        return out, loss

    @staticmethod
    def backward(ctx, grad_out, grad_loss):  # type: ignore[override]
        perm, mask, pos_embed, w1, w2, coords, saved, *witness = ctx.saved_tensors
        grad_tokens, grad_pos, grad_unk, grad_prefix = _triton_kernels.pos_embed_backward_launch(
            grad_out.contiguous(), perm, mask, *ctx.layout, *ctx.dtypes,
            witness=witness[0] if witness else None, permutation=ctx.permutation,
        )  # fmt: skip
        _, grad_w1, grad_b1, grad_w2, grad_b2 = _triton_dal_kernels.dal_backward_launch(
            grad_loss, pos_embed, ctx.layout[1], w1, w2, coords, saved, ctx.scale, *ctx.has_bias,
            grad_pos=grad_pos,
        )  # fmt: skip
        has_b1, has_b2 = ctx.has_bias
        return (
            grad_tokens, None, None, grad_pos, grad_unk, grad_prefix if ctx.layout[0] else None, None,
            grad_w1 if w1 is not None else None, grad_b1 if has_b1 else None, grad_w2, grad_b2 if has_b2 else None,
            None, None, None, None,
        )  # fmt: skip


def has_kernels(backend: str, dtype: torch.dtype) -> bool:
    """Whether ``backend`` has kernels of its own for this operation in ``dtype`` (else the torch node runs)."""
    if backend == "triton":
        return dtype != torch.float64
    return _extension_backend(backend)


def _extension_backend(backend: str) -> bool:
    """Whether ``backend`` runs the compiled extension's operators (``cpu``: its CPU kernels; ``cuda``: its CUDA
    kernels, pos_embed_cuda.cu), whose autograd is in C++."""
    return backend == "cpu" or backend == "cuda"


# The backends whose position step computes the DAL loss of the same table in the same operation
# (:func:`mjp_position_dal_step`): the extension's and the Triton kernels'.
STEP_WITH_DAL_BACKENDS = frozenset({"cpu", "cuda", "triton"})


_PROMOTED: dict[tuple[torch.dtype, torch.dtype], torch.dtype] = {}


def promoted_dtype(first: torch.dtype, second: torch.dtype) -> torch.dtype:
    """``torch.promote_types``, remembered: the function is a dispatched operator, and this runs every step."""
    key = (first, second)
    if key not in _PROMOTED:
        _PROMOTED[key] = torch.promote_types(first, second)
    return _PROMOTED[key]


def prepend_prefix(
    tokens: torch.Tensor, pos_embed: torch.Tensor, prefix: torch.Tensor | None, prefix_positions: int
) -> torch.Tensor:
    """The row layout of the kernels with torch operations, for the paths without them: the prefix tokens (plus
    their Q = ``prefix_positions`` rows of the table ``[..., Q + N, D]``) in front of ``tokens`` ``[B, N, D]``, in
    ``tokens``' dtype. Returns ``[B, P + N, D]`` (``tokens`` itself without a prefix)."""
    if prefix is None:
        return tokens
    dim = tokens.shape[-1]
    prefix = prefix.reshape(1, -1, dim).expand(tokens.shape[0], -1, -1)
    if prefix_positions:
        prefix = prefix + pos_embed[..., :prefix_positions, :].reshape(1, -1, dim)
    return torch.cat((prefix.to(tokens.dtype), tokens), dim=1)


def mjp_position_step(
    tokens: torch.Tensor,
    pos_embed: torch.Tensor,
    unk_embed: torch.Tensor,
    jigsaw: Jigsaw,
    backend: str,
    prefix: torch.Tensor | None = None,
    prefix_positions: int = 0,
    permutation: bool = False,
) -> torch.Tensor:
    """A ViT's whole position step with MJP, for callers that checked the arguments and resolved the backend (the
    timm models' per-step path): the class and register tokens in front, then the moved patch tokens, each plus its
    position term, in one operation forward and one backward.

    Args:
        tokens: the patch tokens ``[B, N, D]``.
        pos_embed: the model's whole position table, ``[1, Q + N, D]`` (or ``[Q + N, D]``): its first Q rows are
            the prefix tokens' (``prefix_positions``: 0 or P), the rest the patch positions'.
        unk_embed: ``[D]``. jigsaw: the batch's jigsaw, ``[B, N]`` each.
        prefix: the P prefix tokens (timm's ``cls_token`` ``[1, 1, D]``, or the class and register tokens
            concatenated), or None.
        backend: a resolved backend; ``cpu``, ``cuda`` and ``triton`` have kernels for this, ``torch`` runs torch
            operations.
        permutation: each row of ``jigsaw.perm`` is known to be a permutation (a validated jigsaw, or one the
            model's sampler made): the ``triton`` backward then needs no record of where the tokens came from.

    Returns:
        ``[B, P + N, D]`` in the dtype ``tokens + pos_embed`` promotes to (timm's add under autocast: float32).
    """
    dim = tokens.shape[2]
    dtype = promoted_dtype(tokens.dtype, pos_embed.dtype)  # as timm's own add (autocast: bfloat16 + float32 table)
    if not has_kernels(backend, dtype):
        patch_rows = pos_embed[..., prefix_positions:, :].reshape(tokens.shape[1], dim)  # not -1: D may be 0
        moved = mjp_pos_embed_torch(tokens, patch_rows, unk_embed, jigsaw)
        return prepend_prefix(moved, pos_embed, prefix, prefix_positions)
    inputs = _kernel_inputs(tokens, pos_embed, unk_embed, jigsaw, prefix, prefix_positions, dtype)
    if _extension_backend(backend):
        return _extension_operator()(*inputs)
    return _PosEmbedTriton.apply(*inputs, permutation)


def _kernel_inputs(
    tokens: torch.Tensor, pos_embed: torch.Tensor, unk_embed: torch.Tensor, jigsaw: Jigsaw,
    prefix: torch.Tensor | None, prefix_positions: int, dtype: torch.dtype,
) -> tuple:  # fmt: skip
    """The position-step kernels' arguments, contiguous: the table, unk_embed and the prefix rounded to the output
    ``dtype`` here, as the oracle rounds them (autograd casts their gradients back): no copy at all in the usual case
    (float32 parameters)."""
    return (
        tokens.contiguous(),
        jigsaw.perm,
        jigsaw.mask,
        _as_dtype(pos_embed, dtype).contiguous(),
        _as_dtype(_as_dtype(unk_embed, pos_embed.dtype), dtype).contiguous(),
        _as_dtype(prefix, dtype).contiguous() if prefix is not None else None,
        prefix_positions,
    )


@eager_cache()
def _extension_step_with_dal() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """``mjp_step_extension_autograd``: the extension's position step and DAL loss as one operator (autograd in
    C++), on the ``cpu`` and ``cuda`` backends."""
    return torch.ops.mjp_fast.mjp_step_extension_autograd.default


def mjp_position_dal_step(
    tokens: torch.Tensor,
    pos_embed: torch.Tensor,
    unk_embed: torch.Tensor,
    jigsaw: Jigsaw,
    prefix: torch.Tensor | None,
    prefix_positions: int,
    regressor: torch.nn.Module,
    coords: torch.Tensor,
    dal_mask: torch.Tensor,
    scale: float,
    backend: str = "cpu",
    permutation: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`mjp_position_step` and the DAL loss of the same table (:func:`mjp_fast.ops.dal_loss.dal_loss_unchecked`
    with ``skip_rows = prefix_positions``) as one operator (the ``cpu`` and ``cuda`` backends', with its autograd in
    C++) or one autograd node (the ``triton`` backend's): one call for the timm models' training step. Returns
    ``(out, dal_loss)``, or None where that does not apply (then call the two functions): another backend, a
    regressor the fused kernels do not compute, a table the step would cast, a float64 table on ``triton``, or
    torch.compile (which sees the two operators and fuses what it likes).

    ``jigsaw``: the position step's (its mask says which positions get ``unk_embed``); ``dal_mask``: the positions
    the DAL loss leaves out (the sampled mask; they differ without unk). ``coords`` float32 ``[N, 2]``.
    ``permutation``: as for :func:`mjp_position_step` (``triton``: the perm is known to be a permutation).
    """
    if backend not in STEP_WITH_DAL_BACKENDS:
        return None
    layers = fused_layers(regressor)
    if layers is None or torch.compiler.is_compiling():
        return None
    dtype = promoted_dtype(tokens.dtype, pos_embed.dtype)
    if dtype != pos_embed.dtype:  # DAL regresses the table as it is, the step would round it
        return None
    inputs = _kernel_inputs(tokens, pos_embed, unk_embed, jigsaw, prefix, prefix_positions, dtype)
    if _extension_backend(backend):
        return _extension_step_with_dal()(*inputs, *layers, coords, dal_mask, scale)
    if dtype == torch.float64:  # no Triton kernels in float64: the two functions' torch paths
        return None
    return _StepWithDALTriton.apply(*inputs, *layers, coords, dal_mask, scale, permutation)


def _as_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor.to(dtype)`` without the call when it has that dtype already (the usual case, every step)."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


# ----------------------------------------------------------------------------------------------------------------
# Public function
# ----------------------------------------------------------------------------------------------------------------


def mjp_pos_embed(
    tokens: torch.Tensor,
    pos_embed: torch.Tensor,
    unk_embed: torch.Tensor | None,
    jigsaw: Jigsaw | None = None,
    *,
    backend: str | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """MJP on embedded tokens: ``out[b, n] = tokens[b, perm[b, n]] + (unk_embed if mask[b, n] else pos_embed[n])``.

    Without a jigsaw it is ``tokens + pos_embed``. Differentiable in tokens, pos_embed and unk_embed. Use it after
    any patch embedding (timm's ``PatchEmbed``, a norm after it): moving the embedded tokens is moving the
    patches. :func:`mjp_patch_embed` fuses the move into the patch embedding itself instead.

    Args:
        tokens: ``[B, N, D]``, float32, float16 or bfloat16 (float64 too).
        pos_embed: ``[N, D]`` or ``[1, N, D]``, patch positions only (no class token). Its dtype may differ from
            the tokens' (a float32 table under autocast): the result has the promoted dtype, as ``tokens +
            pos_embed`` would.
        unk_embed: ``[D]``, the unknown position embedding (may be None without a jigsaw; given without one, its
            gradient is zeros, on every backend: see :func:`plain_positions`).
        jigsaw: from :func:`sample_jigsaw`, or None.
        backend: ``triton`` runs the Triton kernels, ``cpu`` and ``cuda`` the compiled extension's (CUDA tensors:
            pos_embed_cuda.cu, with the autograd in C++), each one pass forward and one backward; ``torch`` the
            autograd node of torch operations above. Default ``MJP_FAST_BACKEND``, else the fastest for the device
            (``triton`` on a GPU, ``cuda`` on a GPU without Triton, ``cpu`` on the CPU).
        validate: check that ``jigsaw.perm`` permutes exactly the masked positions (a host sync on a GPU; the
            timm models skip it for the jigsaws they sample themselves). What ``validate=False`` still guarantees
            for a jigsaw that is not valid (memory safety, defined results) is written once, in
            :mod:`mjp_fast._validate`.

    Returns:
        ``[B, N, D]``.

    Raises:
        ValueError: a backend that is unknown, not available here or not for the tokens' device.
        TypeError/ValueError: other bad arguments, named.
    """
    tokens, pos_embed, unk_embed, jigsaw = check_pos_embed_args(tokens, pos_embed, unk_embed, jigsaw, validate=validate)
    chosen = backend_module.resolve_backend(backend, tokens.device)
    if jigsaw is None:
        return plain_positions(tokens, pos_embed, unk_embed)
    dtype = torch.promote_types(tokens.dtype, pos_embed.dtype)
    if chosen == "triton" and dtype == torch.float64:
        raise TypeError("tokens: the triton backend supports float32, float16 and bfloat16, got float64")
    perm, mask = jigsaw.perm.contiguous(), jigsaw.mask.contiguous()
    return mjp_position_step(tokens, pos_embed, unk_embed, Jigsaw(mask, perm), chosen, permutation=validate)
