r"""The analytic APRIL attack (Lu et al., CVPR 2022): first-layer tokens from gradients, then the image.

Notation (row-major, one image): ``z0 [T, D]`` the first-layer tokens, ``T = 1 + N`` (class token, then the
``N`` patches); the first block's only consumer of ``z0`` is ``qkv = z0 W^T + 1 b^T`` with ``W [3D, D]``
(:class:`~mjp_fast.privacy.model.PrivacyViT` with ``attack_layout=True``: no LayerNorm before the attention
and no residual around it). With ``G = dL/dqkv [T, 3D]``, the chain rule gives

    dL/dW  = G^T z0          [3D, D]        (sent by the client)
    dL/dz0 = G W             [T, D]         (z0 has no other consumer)

so ``W^T dL/dW = W^T G^T z0 = (G W)^T z0``, that is

    (dL/dz0)^T z0 = W^T dL/dW                                                            (1)

This is the supplementary's eq. (1) (there written per projection: ``W^T dL/dW`` is the sum of the q, k and v
terms). ``dL/dz0`` is in the gradients too: ``z0[1 + n] = E p_n + b + pos_embed[n]`` and ``pos_embed[n]`` is
used nowhere else, so ``dL/dpos_embed[n] = dL/dz0[1 + n]``; likewise ``dL/dcls_token = dL/dz0[0]``. Eq. (1) is
then a linear system of ``D`` equations in the ``T`` unknown rows for each of the ``D`` columns of ``z0``; it
determines ``z0`` when ``dL/dz0`` has rank ``T`` (so ``D >= T``), and :func:`solve_tokens` solves it by least
squares. The patches follow from the supplementary's eq. (2): ``p_n = E^+ (z0[1 + n] - pos_embed[n] - b)`` with
``E = weight.reshape(D, C*P*P)``, exact when ``E`` has full column rank (``D >= C*P*P``).

Why MJP defeats it. With a jigsaw and the UNK embedding, a masked position ``n`` gets ``unk_embed`` instead of
``pos_embed[n]``, so row ``n`` of ``dL/dpos_embed`` is zero: the attacker's matrix ``dL/dz0`` loses the masked
rows, while the right-hand side ``W^T dL/dW = sum over all rows of dL/dz0[t]^T z0[t]`` keeps their terms. Least
squares cannot reach the masked tokens (they come out as the minimum-norm zero) and their terms leak into the
visible ones: ``z_visible = z_visible_true + (A_v^T A_v)^-1 A_v^T A_masked z_masked`` with ``A = dL/dz0``.
Nor does any other gradient tell where the masked patches went: attention and the token-wise MLP are
permutation-equivariant, the class token's output is invariant, and every parameter gradient is a sum over
tokens, so all gradients are the same whatever the permutation of the masked patches. Shuffled without UNK,
every row of ``dL/dpos_embed`` is there and the attack recovers the shuffled image exactly.

Numerics. In a freshly initialised model the attention is near-uniform, so the rows of ``dL/dz0`` are nearly
parallel and eq. (1) is badly conditioned. Compute the client's gradients in float64 (the model in float64);
this module solves in float64 with an SVD-based least squares (LAPACK ``gelsd``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mjp_fast.privacy.model import PrivacyViT


def solve_tokens(
    grad_tokens: torch.Tensor, qkv_weight: torch.Tensor, grad_qkv_weight: torch.Tensor, *, rcond: float | None = None
) -> torch.Tensor:
    """Solves eq. (1), ``(dL/dz0)^T z0 = W^T dL/dW``, for the first-layer tokens ``z0`` by least squares.

    Args:
        grad_tokens: ``dL/dz0 [T, D]`` (the class token's and the position embedding's gradients, stacked).
        qkv_weight: the first qkv projection ``W [3D, D]``.
        grad_qkv_weight: its gradient ``dL/dW [3D, D]``.
        rcond: singular values below ``rcond * largest`` count as zero (default: float64 epsilon times
            ``max(D, T)``).

    Returns:
        ``z0 [T, D]`` in float64: the tokens where ``dL/dz0`` has rank ``T``, else the minimum-norm solution.
    """
    for name, tensor in (
        ("grad_tokens", grad_tokens),
        ("qkv_weight", qkv_weight),
        ("grad_qkv_weight", grad_qkv_weight),
    ):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2:
            raise ValueError(f"{name} must be a 2-D tensor, got {getattr(tensor, 'shape', type(tensor).__name__)}")
    dim = grad_tokens.shape[1]
    if qkv_weight.shape[1] != dim or qkv_weight.shape != grad_qkv_weight.shape:
        raise ValueError(
            f"qkv_weight and grad_qkv_weight must both be [3D, D] with D = {dim} (grad_tokens [T, D]), got "
            f"{list(qkv_weight.shape)} and {list(grad_qkv_weight.shape)}"
        )
    matrix = grad_tokens.detach().double().t()  # [D, T]
    rhs = qkv_weight.detach().double().t() @ grad_qkv_weight.detach().double()  # [D, D]
    return torch.linalg.lstsq(matrix.cpu(), rhs.cpu(), rcond=rcond, driver="gelsd").solution.to(grad_tokens.device)


def invert_patch_embed(
    patch_tokens: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    pos_embed: torch.Tensor,
    grid_size: tuple[int, int],
) -> torch.Tensor:
    """Eq. (2): the image whose patch embedding plus ``pos_embed`` gives ``patch_tokens``.

    Args:
        patch_tokens: ``[N, D]``, the patch rows of ``z0``.
        weight: the patch embedding's Conv2d weight ``[D, C, P, P]``.
        bias: ``[D]`` or None.
        pos_embed: ``[N, D]`` or ``[1, N, D]``, subtracted at every position (the attacker's assumption).
        grid_size: ``(rows, cols)`` with ``rows * cols = N``.

    Returns:
        ``[1, C, rows * P, cols * P]`` in float64 (not clipped).
    """
    dim, channels, patch, _ = weight.shape
    rows, cols = grid_size
    if patch_tokens.shape != (rows * cols, dim):
        raise ValueError(f"patch_tokens must be [N, D] = [{rows * cols}, {dim}], got {list(patch_tokens.shape)}")
    centered = patch_tokens.double() - pos_embed.detach().double().reshape(rows * cols, dim)
    if bias is not None:
        centered = centered - bias.detach().double()
    embedding = weight.detach().double().reshape(dim, channels * patch * patch).cpu()
    patches = torch.linalg.lstsq(embedding, centered.t().cpu(), driver="gelsd").solution.t()  # [N, C*P*P]
    image = patches.reshape(rows, cols, channels, patch, patch).permute(2, 0, 3, 1, 4)
    return image.reshape(1, channels, rows * patch, cols * patch).to(patch_tokens.device)


def april_attack(model: PrivacyViT, gradients: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Reconstructs the client image from its gradients on ``model`` (first block in the attack layout).

    Args:
        model: a :class:`PrivacyViT` built with ``attack_layout=True``; the attacker knows its parameters.
        gradients: ``{parameter name: gradient}`` from :func:`~mjp_fast.privacy.model.client_gradients`, best
            computed in float64. Uses ``cls_token``, ``pos_embed`` and ``blocks.0.attn.qkv.weight``.

    Returns:
        The reconstruction ``[1, C, H, W]`` in float64, not clipped to [0, 1].
    """
    if not isinstance(model, PrivacyViT) or not model.blocks[0].attack_layout:
        raise ValueError(
            "model must be a PrivacyViT built with attack_layout=True: the analytic attack needs a first block "
            "whose qkv projection is the only consumer of the tokens (no pre-norm, no residual around attention)"
        )
    names = ("cls_token", "pos_embed", "blocks.0.attn.qkv.weight")
    missing = [name for name in names if name not in gradients]
    if missing:
        raise KeyError(f"gradients lack {missing}; pass the output of client_gradients")
    dim = model.pos_embed.shape[-1]
    grad_tokens = torch.cat([gradients["cls_token"].reshape(1, dim), gradients["pos_embed"].reshape(-1, dim)])
    qkv = model.blocks[0].attn.qkv.weight
    tokens = solve_tokens(grad_tokens, qkv, gradients["blocks.0.attn.qkv.weight"])
    grid = (model.grid_size, model.grid_size)
    return invert_patch_embed(tokens[1:], model.patch_embed.weight, model.patch_embed.bias, model.pos_embed, grid)
