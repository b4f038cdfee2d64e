"""MJP for timm's ``Eva`` (EVA, EVA-02, DINOv3, PE, the ``vit_*_rope_*`` models): the jigsaw, the unknown embedding
on the absolute position table where there is one, and the identity rotation on the rotary table.

``Eva._pos_embed`` returns ``(tokens, rope)``. In training (or inside ``mjp_eval``) this front end

- moves the patch tokens by the jigsaw through :class:`MJPState`, and the masked positions get ``unk_embed``: with
  an absolute table in place of their row, as a plain ViT (fused with the patch embedding where it is timm's
  standard one); without a table (RoPE only) added to the moved tokens, the one learned marker of a position the
  model must not know (after timm's own convolution);
- gives the shuffled positions no rotation: each sample's rotary table is :func:`mjp_fast.ops.rope_identity.
  rope_identity` of timm's, batched as timm's patch-dropout path batches it (``[B, 1, N, E]``; a mixed rope's
  ``[depth, B, H, N, E]``). With ``unk=False`` (the naive shuffle) every position keeps its rotation (and its row).

Under ``torch.fx`` the jigsaw is one node (the ``mjp`` module), and the rotary table of the sampled jigsaw one more
(``_jigsaw_rope``): both run when the graph runs.
"""

from __future__ import annotations

import torch
import torch.fx
from timm.layers import resample_abs_pos_embed
from timm.layers.pos_embed_sincos import apply_keep_indices_nlc
from timm.models.eva import Eva

from mjp_fast.ops.rope_identity import rope_identity
from mjp_fast.timm.base import MJPModel
from mjp_fast.timm.fused import fused_grid, fused_pos_embed, is_fused, prefix_positions_of, prefix_tokens_of
from mjp_fast.timm.state import MJPState
from mjp_fast.timm.vit import MJPVisionTransformer


@torch.fx.wrap  # one call_function node under FX: it reads the jigsaw the graph's MJP node has just sampled
def _jigsaw_rope(state: MJPState, rope: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """timm's rotary table with the identity rotation at the last jigsaw's shuffled positions, one table per sample.

    ``tokens``: the output of the step that sampled the jigsaw (under FX it orders this node after that one) ``[B,
    ...]``. Returns ``[B, 1, N, E]`` for a ``[N, E]`` table, ``[depth, B, H, N, E]`` for a mixed rope's ``[depth,
    H, N, E]``: the batched shapes either way, so that what follows (patch dropout) is the same code.
    """
    jigsaw = state.last_jigsaw
    if jigsaw is None:  # a graph traced with MJP on, run with it off: every position keeps its rotation
        return _batched(rope, tokens.shape[0])
    return rope_identity(rope, jigsaw.mask, validate=False)


def _batched(rope: torch.Tensor, batch: int) -> torch.Tensor:
    """``rope`` broadcast to :func:`rope_identity`'s output shape (no copy)."""
    if rope.dim() == 4:  # [depth, H, N, E] -> [depth, B, H, N, E]
        return rope.unsqueeze(1).expand(-1, batch, -1, -1, -1)
    return rope.expand(batch, 1, -1, -1) if rope.dim() == 2 else rope.expand(batch, -1, -1, -1)


class MJPEva(MJPModel, Eva):
    """A timm ``Eva`` with MJP position embeddings (made by :func:`mjp_fast.timm.convert`): the jigsawed patch tokens
    get ``unk_embed`` instead of their row of ``pos_embed`` (where the model has one) and no rotation (where it has a
    rotary embedding). In eval mode, outside ``mjp_eval``, it is timm's ``Eva``."""

    def _pos_embed(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        state, fused = self.mjp, is_fused(self.patch_embed)
        if not state.engaged and not fused:  # MJP off (eval mode): timm's own
            state.record_jigsaw(None)
            return super()._pos_embed(x)
        x, grid, pos_table, rope = _patch_tokens_and_tables(self, x)
        if fused:  # x: the images, passed through by patch_embed; the state embeds and jigsaws them (one node)
            x = fused_pos_embed(self, x, state)
        elif pos_table is not None:
            # The whole table and the prefix tokens go in: the kernels write [B, P + N, D] at once. DAL regresses
            # the stored table, not one resampled for another input size.
            resampled = pos_table is not self.pos_embed
            dal_table, dal_grid = (self.pos_embed, self.patch_embed.grid_size) if resampled else (None, None)
            prefix, prefix_positions = prefix_tokens_of(self), prefix_positions_of(self)
            x = state(
                x, pos_table, grid, prefix=prefix, prefix_positions=prefix_positions, dal_table=dal_table,
                dal_grid=dal_grid,
            )  # fmt: skip
            x = self.pos_drop(x)
        else:
            # No table (RoPE only): the tokens move, the shuffled ones get unk_embed; the prefix tokens go in front.
            x = self.pos_drop(state(x, None, grid, prefix=prefix_tokens_of(self), prefix_positions=0))
        # One table per sample where the jigsaw gives the shuffled positions no rotation (not for the naive shuffle).
        batched = rope is not None and state.sampler.active and state.use_unk
        if batched:
            rope = _jigsaw_rope(state, rope, x)
        return _drop_patches(self, x, rope, batched)

    def mjp_aux_loss(self) -> torch.Tensor:
        if self.pos_embed is None:  # RoPE only: no table to regress (convert gives it no DAL)
            return next(self.parameters()).new_zeros((), dtype=torch.float32)
        return MJPVisionTransformer.mjp_aux_loss(self)  # the same table, prefix rows and jigsaw as a ViT's

    def no_weight_decay(self) -> set[str]:
        extra = {"mjp.unk_embed"} if self.mjp.unk_embed is not None else set()
        return set(super().no_weight_decay()) | extra


def _patch_tokens_and_tables(
    model: Eva, x: torch.Tensor
) -> tuple[torch.Tensor, tuple[int, int], torch.Tensor | None, torch.Tensor | None]:
    """timm's ``_pos_embed`` inputs: the patch tokens ``[B, N, D]`` (the images where the embedding is fused),
    the grid, the position table (resampled to a dynamic size, as timm does) and the rotary table."""
    embed, pos_table, rope = model.patch_embed, model.pos_embed, model.rope
    if model.dynamic_img_size and is_fused(embed):
        # x: the images; fused_pos_embed resamples the table for their grid itself (pos_table: not read)
        grid = fused_grid(embed, x)
        return x, grid, None, rope.get_embed(shape=grid) if rope is not None else None
    if model.dynamic_img_size:
        batch, rows, cols, dim = x.shape
        grid = (rows, cols)
        if pos_table is not None:
            pos_table = resample_abs_pos_embed(
                pos_table, new_size=grid, old_size=embed.grid_size, num_prefix_tokens=prefix_positions_of(model)
            )
        return x.view(batch, -1, dim), grid, pos_table, rope.get_embed(shape=grid) if rope is not None else None
    grid = embed.grid_size  # the model's (set_input_size may have changed it since the sampler was made)
    if rope is not None:
        # RoPE modules without a feat_shape (MRoPE) need the grid, as in timm.
        rope = rope.get_embed() if hasattr(rope, "feat_shape") else rope.get_embed(shape=grid)
    return x, grid, pos_table, rope


def _drop_patches(
    model: Eva, x: torch.Tensor, rope: torch.Tensor | None, batched: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """timm's patch dropout of the tokens and the rotary table; a batched table (``batched``: one per sample)
    keeps the rows of each sample's kept tokens, in timm's shapes."""
    if model.patch_drop is None:
        return x, rope
    x, keep_indices = model.patch_drop(x)
    if rope is None or keep_indices is None:
        return x, rope
    mixed = getattr(model, "rope_mixed", False)
    if batched:  # [B, 1, N, E], or [depth, B, H, N, E] gathered as [B, depth, H, N, E]
        rope = rope.transpose(0, 1) if mixed else rope
        rope = apply_keep_indices_nlc(x, rope, keep_indices, pos_embed_has_batch=True)
        return x, rope.transpose(0, 1) if mixed else rope
    rope = apply_keep_indices_nlc(x, rope, keep_indices)
    return x, rope.transpose(0, 1) if mixed else rope.unsqueeze(1)


class FusedEvaMixin:
    """A plain timm ``Eva`` whose patch embedding and position add run as one fused op (made by
    :func:`mjp_fast.timm.fast_patch_embed`): ``_pos_embed`` receives the images from the pass-through
    ``patch_embed`` and returns timm's ``(tokens, rotary table)``."""

    def _pos_embed(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not is_fused(self.patch_embed):
            return super()._pos_embed(x)
        x, _, _, rope = _patch_tokens_and_tables(self, x)
        return _drop_patches(self, fused_pos_embed(self, x, None), rope, False)


def eva_layout(model: Eva) -> tuple[tuple[int, int], int | None, int]:
    """The state's grid, token width (``unk_embed``'s, with or without a position table) and patch size."""
    embed = model.patch_embed
    patch_size = embed.patch_size
    patch_size = patch_size[0] if isinstance(patch_size, (tuple, list)) else patch_size
    return tuple(embed.grid_size), model.embed_dim, patch_size
