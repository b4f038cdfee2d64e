"""The small ViT that the privacy evaluation attacks, and the gradients one client image produces on it.

:class:`PrivacyViT` is a plain-PyTorch ViT (class token, learned position embedding, pre-norm blocks) with MJP on
its input side through :func:`mjp_fast.mjp_patch_embed` on the ``torch`` backend, so it runs in float64 and is
twice differentiable (the optimization attack differentiates the gradients).

Tokens (``N`` patches, width ``D``)::

    z0[0]     = cls_token
    z0[1 + n] = E patch(x, perm[n]) + b + (unk_embed if mask[n] else pos_embed[n])     n < N

``cls_token`` carries the class token's position too (MJP never touches it). Without a jigsaw ``perm[n] = n`` and
``mask[n]`` is False. "Shuffled without UNK" (the paper's ablation) is the jigsawed image embedded with
``pos_embed`` at every position.

``attack_layout=True`` builds the first block as the analytic attack needs it: ``z1 = Attention(z0)``, then
``z1 + MLP(LayerNorm(z1))``: no LayerNorm before the attention and no residual around it, so the qkv projection
is the only consumer of ``z0``. The other blocks are standard pre-norm blocks. With ``attack_layout=False`` all
blocks are standard; only the optimization attack applies to that model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from mjp_fast.ops import jigsaw_images, mjp_patch_embed
from mjp_fast.sampler import Jigsaw


class Attention(nn.Module):
    """Multi-head self-attention with one ``qkv`` projection ``[3D, D]`` (timm's parameter layout)."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed_dim must be a multiple of num_heads, got {dim} and {num_heads}")
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        batch, length, dim = tokens.shape
        head_dim = dim // self.num_heads
        qkv = self.qkv(tokens).reshape(batch, length, 3, self.num_heads, head_dim).permute(2, 0, 3, 1, 4)
        query, key, value = qkv.unbind(0)  # [B, heads, T, head_dim] each
        # Written out rather than F.scaled_dot_product_attention: the optimization attack needs double backward.
        weights = torch.softmax(query @ key.transpose(-2, -1) / math.sqrt(head_dim), dim=-1)
        out = (weights @ value).transpose(1, 2).reshape(batch, length, dim)
        return self.proj(out)


class Block(nn.Module):
    """A transformer block: pre-norm (``x + attn(norm1(x))``) or, with ``attack_layout``, ``attn(x)``."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, *, attack_layout: bool = False) -> None:
        super().__init__()
        self.attack_layout = attack_layout
        self.norm1 = nn.Identity() if attack_layout else nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.attack_layout:
            tokens = self.attn(tokens)
        else:
            tokens = tokens + self.attn(self.norm1(tokens))
        return tokens + self.mlp(self.norm2(tokens))


class PrivacyViT(nn.Module):
    """A small ViT with MJP inputs, for gradient-inversion experiments.

    Args:
        img_size: the side of the square input images.
        patch_size: P; ``img_size`` must be a multiple of it.
        in_chans: C.
        embed_dim: D. The analytic attack needs ``D >= N + 1`` (the token system) and ``D >= C * P * P`` (to
            invert the patch embedding).
        depth: the number of blocks.
        num_heads: heads per attention.
        mlp_ratio: the MLP's hidden width over D.
        num_classes: outputs of the classification head.
        attack_layout: build the first block without pre-norm and without the residual around attention.

    Parameters (names as in timm where timm has them): ``patch_embed.weight [D, C, P, P]``, ``patch_embed.bias
    [D]``, ``cls_token [1, 1, D]``, ``pos_embed [1, N, D]`` (patches only), ``unk_embed [D]``, ``blocks.*``,
    ``norm``, ``head``.
    """

    def __init__(
        self,
        img_size: int = 64,
        patch_size: int = 8,
        in_chans: int = 3,
        embed_dim: int = 256,
        depth: int = 4,
        num_heads: int = 4,
        mlp_ratio: float = 4.0,
        num_classes: int = 10,
        *,
        attack_layout: bool = True,
    ) -> None:
        super().__init__()
        if img_size % patch_size:
            raise ValueError(f"img_size must be a multiple of patch_size, got {img_size} and {patch_size}")
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        self.img_size = img_size
        self.patch_size = patch_size
        self.grid_size = img_size // patch_size
        self.num_patches = self.grid_size**2
        self.attack_layout = attack_layout
        self.patch_embed = nn.Conv2d(in_chans, embed_dim, patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_patches, embed_dim))
        self.unk_embed = nn.Parameter(torch.zeros(embed_dim))
        self.blocks = nn.ModuleList(
            Block(embed_dim, num_heads, mlp_ratio, attack_layout=attack_layout and index == 0) for index in range(depth)
        )
        self.norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """timm's ViT initialisation: truncated normal (std 0.02) for linear layers and position embeddings."""
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.unk_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def tokens(self, images: torch.Tensor, jigsaw: Jigsaw | None = None, *, use_unk: bool = True) -> torch.Tensor:
        """The first-layer tokens ``z0 [B, 1 + N, D]``.

        Args:
            images: ``[B, C, H, W]`` in the model's dtype.
            jigsaw: ``Jigsaw(mask [B, N], perm [B, N])`` or None for the plain image.
            use_unk: with a jigsaw, give masked positions ``unk_embed`` (MJP); False embeds the jigsawed image
                with ``pos_embed`` everywhere (the ablation "shuffled without UNK").
        """
        weight, bias = self.patch_embed.weight, self.patch_embed.bias
        if jigsaw is not None and not use_unk:
            images, jigsaw = jigsaw_images(images, jigsaw, self.patch_size), None
        unk = self.unk_embed if jigsaw is not None else None
        patches = mjp_patch_embed(images, weight, bias, self.pos_embed, unk, jigsaw, backend="torch")
        return torch.cat([self.cls_token.expand(patches.shape[0], -1, -1), patches], dim=1)

    def forward(self, images: torch.Tensor, jigsaw: Jigsaw | None = None, *, use_unk: bool = True) -> torch.Tensor:
        """Logits ``[B, num_classes]`` from the class token."""
        tokens = self.tokens(images, jigsaw, use_unk=use_unk)
        for block in self.blocks:
            tokens = block(tokens)
        return self.head(self.norm(tokens[:, 0]))


def client_gradients(
    model: nn.Module,
    image: torch.Tensor,
    label: int | torch.Tensor,
    jigsaw: Jigsaw | None = None,
    *,
    use_unk: bool = True,
    create_graph: bool = False,
) -> dict[str, torch.Tensor]:
    """The gradients of the cross-entropy loss of one image, as a federated client would send them.

    Args:
        model: a :class:`PrivacyViT` (or any module whose ``forward(images, jigsaw, use_unk=...)`` gives logits;
            without a jigsaw, any ``forward(images)``).
        image: ``[1, C, H, W]`` or ``[C, H, W]``, cast to the model's dtype (use float64 for the analytic attack).
        label: the class index.
        jigsaw: for a batch of one, or None.
        use_unk: see :meth:`PrivacyViT.tokens`.
        create_graph: keep the graph of the gradients (the optimization attack differentiates them).

    Returns:
        ``{parameter name: gradient}`` for every parameter that requires grad; zeros for those the loss does
        not reach (``unk_embed`` without a jigsaw).
    """
    parameters = {name: p for name, p in model.named_parameters() if p.requires_grad}
    first = next(iter(parameters.values()))
    if image.dim() == 3:
        image = image[None]
    if image.dim() != 4 or image.shape[0] != 1:
        raise ValueError(f"image must be [C, H, W] or [1, C, H, W] (one client image), got {list(image.shape)}")
    image = image.to(device=first.device, dtype=first.dtype)
    target = torch.as_tensor(label, device=first.device).reshape(1).long()
    logits = model(image) if jigsaw is None else model(image, jigsaw, use_unk=use_unk)
    loss = F.cross_entropy(logits, target)
    grads = torch.autograd.grad(loss, list(parameters.values()), create_graph=create_graph, allow_unused=True)
    return {
        name: torch.zeros_like(p) if g is None else g for (name, p), g in zip(parameters.items(), grads, strict=True)
    }


def infer_label(gradients: Mapping[str, torch.Tensor], head_bias: str = "head.bias") -> int:
    """The label of a single-image cross-entropy gradient: the only negative entry of the head's bias gradient.

    ``dL/db_k = softmax_k - [k == label]``, so the label's entry is the only negative one (iDLG's observation).
    """
    if head_bias not in gradients:
        raise KeyError(f"gradients has no {head_bias!r}; pass the name of the classifier's bias as head_bias")
    return int(gradients[head_bias].argmin())
