"""MJP for timm's ``VisionTransformer`` and its subclasses: the jigsaw and the unknown embedding on the absolute
position table, fused with the patch embedding where it is timm's standard one."""

from __future__ import annotations

import torch
from timm.layers import resample_abs_pos_embed
from timm.models.vision_transformer import VisionTransformer

from mjp_fast.ops.dal_loss import dal_loss_unchecked
from mjp_fast.timm.base import _MJPMixin
from mjp_fast.timm.fused import _fused_pos_embed, _is_fused, _prefix_positions, _prefix_tokens


class MJPVisionTransformer(_MJPMixin, VisionTransformer):
    """A timm ``VisionTransformer`` with MJP position embeddings (made by :func:`convert`)."""

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        state, patch_embed, pos_embed = self.mjp, self.patch_embed, self.pos_embed
        if _is_fused(patch_embed):  # x: the images, passed through by patch_embed
            return _fused_pos_embed(self, x, state)
        if pos_embed is None or not state.engaged:
            state.last_jigsaw = None
            return super()._pos_embed(x)
        grid = patch_embed.grid_size  # the model's (set_input_size may have changed it since the sampler was made)
        dal_table = dal_grid = None  # DAL regresses the stored table, not one resampled for another input size
        if self.dynamic_img_size:
            batch, rows, cols, dim = x.shape
            grid = (rows, cols)
            pos_embed = resample_abs_pos_embed(
                pos_embed, new_size=grid, old_size=patch_embed.grid_size, num_prefix_tokens=_prefix_positions(self)
            )
            x = x.reshape(batch, rows * cols, dim)
            dal_table, dal_grid = self.pos_embed, patch_embed.grid_size
        # The whole table and the prefix tokens go in: the kernels write [B, P + N, D] at once (no slice, no cat).
        prefix, prefix_positions = _prefix_tokens(self), _prefix_positions(self)
        x = state(
            x, pos_embed, grid, prefix=prefix, prefix_positions=prefix_positions, dal_table=dal_table, dal_grid=dal_grid
        )
        return self.pos_drop(x)

    def mjp_aux_loss(self) -> torch.Tensor:
        state, pos_embed = self.mjp, self.pos_embed
        regressor = state.dal_regressor
        if regressor is None or pos_embed is None:
            anchor = pos_embed if pos_embed is not None else state.unk_embed
            return anchor.new_zeros((), dtype=torch.float32)
        attached = state.claim_dal(pos_embed)  # the loss the last forward attached, counted at the loop's weight
        if attached is not None:
            return attached
        # Computed here: the last forward attached nothing (eval mode, no grad), or its loss was handed out already.
        coords, jigsaw = state.dal_coordinates_for(self.patch_embed.grid_size), state.last_jigsaw
        mask = jigsaw.mask if jigsaw is not None else None
        if mask is not None and mask.shape[1] != coords.shape[0]:
            mask = None  # the last input had another grid (dynamic size): regress every stored position
        # The whole table: its prefix rows are skipped by the kernels, so nothing is sliced here.
        return dal_loss_unchecked(
            pos_embed,
            regressor,
            coords,
            mask,
            state.backend_for(coords.device),
            _prefix_positions(self),
            state.dal_scale,
        )

    def no_weight_decay(self) -> set[str]:
        extra = {"mjp.unk_embed"} if self.mjp.unk_embed is not None else set()
        return set(super().no_weight_decay()) | extra
