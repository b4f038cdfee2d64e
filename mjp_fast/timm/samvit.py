"""MJP for timm's ``VisionTransformerSAM`` (SAM's image encoder as a timm ViT: ``samvit_base_patch16``, ...): a learned
absolute position table ``pos_embed`` ``[1, H, W, D]`` added in NHWC right after the patch embedding
(``x = patch_embed(x); x = x + resample_abs_pos_embed_nhwc(pos_embed, x.shape[1:3])`` in both ``forward_features``
and ``forward_intermediates``), resampled to the input's grid where the images are of another size than the table's
(the embedding is not strict about the image size).

Where MJP hooks in, without copying timm's two methods: as for CaiT, the patch embedding is class-swapped. SAM's is
timm's ``PatchEmbed`` with NHWC output (a Conv2d whose stride is its kernel: each token a function of its own patch,
so moving the tokens is moving the patches). While MJP is engaged the embedding returns MJP's tokens (moved,
``unk_embed`` at the masked positions, the table's row elsewhere, resampled to the input's grid by timm's own
``resample_abs_pos_embed_nhwc``, the DAL loss attached in training) minus that same table, ``[B, H, W, D]``; timm's
``+ resample_abs_pos_embed_nhwc(pos_embed, ...)`` then gives MJP's tokens back (within one float rounding; the
gradient is exact). In eval mode outside ``mjp_eval`` the embedding is timm's: the model is timm's, exactly.

DAL regresses the stored table's ``H * W`` rows in row-major order (NHWC flattened: the grid's own order), also when
the input's grid is another (the resampled table is a function of them, not a parameter).

Fused where the embedding is timm's standard ``PatchEmbed`` (a square Conv2d, stride equal to its kernel, no norm):
the fused op writes the tokens ``[B, N, D]`` in row-major grid order, which is NHWC flattened, so its output is
unflattened to ``[B, H, W, D]`` as is. A SAM ViT without a table (``use_abs_pos=False``: ``samvit_base_patch16_224``,
relative positions or RoPE in its attention) is not this front end's: :func:`mjp_fast.timm.convert` gives it the
pixel-space jigsaw, as every relative-position model.
"""

from __future__ import annotations

import torch
import torch.fx
from timm.layers import Format, PatchEmbed, resample_abs_pos_embed_nhwc
from timm.models.vision_transformer_sam import VisionTransformerSAM
from torch import nn

from mjp_fast.timm.base import MJPModel, mjp_class_of
from mjp_fast.timm.front_end import KeptTableRows, TokenFrontEnd, TokenLayout
from mjp_fast.timm.fused import checked_images, original_class, projection_reason


def _table_grid(table: torch.Tensor, embed: nn.Module) -> tuple[int, int]:
    """The grid ``(H, W)`` of the stored table ``[1, H, W, D]``; while FX traces (the table a proxy), the patch
    embedding's ``grid_size``, which timm builds the table at."""
    if isinstance(table, torch.fx.Proxy):
        return tuple(embed.grid_size)
    return tuple(table.shape[1:3])


class _SamTableEmbed:
    """Mixed into a SAM ViT's patch embedding (class swap): while ``model.mjp`` is engaged it returns MJP's tokens
    minus the position table on the input's grid, ``[B, H, W, D]``, which timm's ``+ resample_abs_pos_embed_nhwc``
    turns into MJP's tokens; otherwise timm's own embedding. The model is kept in ``__dict__``, out of the module's
    children (no second copy in the state dict, no cycle in ``modules()``): copies and pickles keep pointing at their
    own, and the table is read from the model at each call (``load_state_dict(assign=True)`` may replace it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: the images ``[B, C, H', W']``. Returns the tokens ``[B, H, W, D]`` that timm adds the table to."""
        model = self.__dict__["_mjp_model"]
        state = model.mjp
        if not state.engaged:  # MJP off (eval mode): timm's embedding, so the model is timm's exactly
            state.record_jigsaw(None)
            return super().forward(x)
        table = model.pos_embed  # [1, H0, W0, D]
        stored_rows = table.flatten(1, 2)  # [1, H0 * W0, D], row-major: the rows DAL regresses
        self.__dict__["_mjp_kept_rows"].keep(table, stored_rows)
        fused = self.__dict__["_mjp_fused"]
        if fused:
            x = checked_images(self, x)  # timm's checks (and padding) of the image size
            grid = (x.shape[-2] // self.patch_size[0], x.shape[-1] // self.patch_size[1])
        else:
            tokens = super().forward(x)  # [B, H, W, D]
            grid = tokens.shape[1:3]
        # timm's own call, as its forward makes it after this one: the same values, so `- rows` and timm's `+` meet
        resampled = resample_abs_pos_embed_nhwc(table, grid)
        # Unresampled, the step's table is the very rows DAL regresses (the step computes both in one operation).
        rows = stored_rows if resampled is table else resampled.flatten(1, 2)
        if not isinstance(grid, torch.fx.Proxy):
            grid = tuple(grid)
        dal = dict(dal_table=stored_rows, dal_grid=_table_grid(table, self))
        if fused:
            proj = self.proj
            stepped = state(x, rows, grid, proj.weight, proj.bias, prefix=None, prefix_positions=0, **dal)
        else:
            stepped = state(tokens.flatten(1, 2), rows, grid, prefix=None, prefix_positions=0, **dal)
        return (stepped - rows).unflatten(1, grid)


class SamPatchEmbed(_SamTableEmbed, PatchEmbed):
    """timm's ``PatchEmbed`` of a SAM ViT with MJP on its position table."""


class MJPVisionTransformerSAM(MJPModel, VisionTransformerSAM):
    """A timm ``VisionTransformerSAM`` with MJP on its position table (made by :func:`mjp_fast.timm.convert`):
    ``mjp_aux_loss`` (the DAL loss of the table's ``H * W`` rows) and ``mjp.unk_embed`` among the parameters without
    weight decay. ``forward``, ``forward_features`` and ``forward_intermediates`` are timm's (the patch embedding
    applies MJP)."""

    def mjp_aux_loss(self) -> torch.Tensor:
        state, table, embed = self.mjp, self.pos_embed, self.patch_embed
        if state.dal_regressor is None:
            return table.new_zeros((), dtype=torch.float32)
        rows = embed.__dict__["_mjp_kept_rows"].rows_of(table, table.flatten(1, 2))
        return state.aux_loss(rows, _table_grid(table, embed), 0)

    def no_weight_decay(self) -> set[str]:
        extra = {"mjp.unk_embed"} if self.mjp.unk_embed is not None else set()
        return set(super().no_weight_decay()) | extra


def covers(model: nn.Module) -> bool:
    """Whether ``model`` is this front end's: a timm ``VisionTransformerSAM`` with a table (``use_abs_pos``)."""
    return isinstance(model, VisionTransformerSAM) and getattr(model, "pos_embed", None) is not None


def _unfit_reason(model: nn.Module) -> str | None:
    """None where the patch embedding writes NHWC tokens, each of its own patch (MJP moves them), over the table's
    grid, else why not."""
    embed = model.patch_embed
    proj = getattr(embed, "proj", None)
    if not isinstance(proj, nn.Conv2d) or not hasattr(embed, "grid_size"):
        return f"its patch embedding ({type(embed).__name__}) is not a Conv2d projection with a grid_size"
    if tuple(proj.stride) != tuple(proj.kernel_size) or proj.padding not in ("valid", (0, 0)):
        return (
            f"its patch embedding's kernel {tuple(proj.kernel_size)}, stride {tuple(proj.stride)} and padding "
            f"{proj.padding} overlap the patches (a token per patch needs the stride equal to the kernel, no padding)"
        )
    if getattr(embed, "flatten", False) or getattr(embed, "output_fmt", None) != Format.NHWC:
        return "its patch embedding does not write NHWC tokens [B, H, W, D] (the layout timm adds the table in)"
    table = model.pos_embed
    if table.dim() != 4 or table.shape[-1] != proj.out_channels:
        return f"pos_embed {tuple(table.shape)} is not a [1, H, W, {proj.out_channels}] table"
    return None


def samvit_layout(model: nn.Module, fused_patch_embed: bool | None) -> TokenLayout:
    """:func:`mjp_fast.timm.convert`'s layout of a SAM ViT with a table: the table's grid, the embedding width, the
    patch size; fused where the embedding is timm's standard ``PatchEmbed`` (unless ``fused_patch_embed=False``);
    the tokens are moved (no pixel block).

    Raises:
        ValueError: a patch embedding whose tokens are not each of its own patch, in NHWC, over a ``[1, H, W, D]``
            table (the message says why); ``fused_patch_embed=True`` where the embedding cannot run fused.
    """
    reason = _unfit_reason(model)
    if reason is not None:
        raise ValueError(f"model: {type(model).__name__}: {reason}")
    embed = model.patch_embed
    fuse_reason = projection_reason(embed) if fused_patch_embed is not False else None
    if fused_patch_embed and fuse_reason is not None:
        raise ValueError(f"fused_patch_embed=True: {fuse_reason}")
    table = model.pos_embed
    new_class = mjp_class_of(original_class(type(model)), VisionTransformerSAM, MJPVisionTransformerSAM)
    fuse = fused_patch_embed is not False and fuse_reason is None
    grid = (int(table.shape[1]), int(table.shape[2]))
    return TokenLayout(new_class, grid, int(table.shape[-1]), int(embed.patch_size[0]), fuse, None)


def install_samvit(model: nn.Module, layout: TokenLayout) -> None:
    """Swaps the patch embedding of a converted SAM ViT (holding ``model.mjp`` already) to apply MJP on its table,
    fused where ``layout.fuse`` (checked by :func:`samvit_layout`)."""
    embed = model.patch_embed
    embed_class = original_class(type(embed))
    embed.__class__ = SamPatchEmbed if embed_class is PatchEmbed else mjp_class_of(embed_class, None, _SamTableEmbed)
    embed.__dict__["_mjp_model"] = model
    embed.__dict__["_mjp_fused"] = layout.fuse
    embed.__dict__["_mjp_kept_rows"] = KeptTableRows()


def runs_fused(model: nn.Module) -> bool:
    """Whether a converted SAM ViT's MJP embedding was installed fused with its position term."""
    embed = model.patch_embed
    return isinstance(embed, _SamTableEmbed) and bool(embed.__dict__.get("_mjp_fused", False))


FRONT_END = TokenFrontEnd(covers, samvit_layout, install_samvit, runs_fused, names=("VisionTransformerSAM",))
"""SAM's ViT (``VisionTransformerSAM`` with a table), for :func:`mjp_fast.timm.convert`."""
