"""MJP for timm's Qwen3 vision models (``qwen3_vit_*``: ``Qwen3VitClassifier`` and its ``Qwen3VitEncoder``, and the
``*_enc`` encoders on their own; timm 1.0.30 and later): the jigsaw and the unknown embedding on the learned absolute
position table, which timm resamples to each input's grid.

The table. ``encoder.pos_embed`` ``[1, G * G, D]`` (G = ``pos_embed_grid_size``, 48 for the released models) is
resampled bilinearly (``align_corners=True``) to the input's grid ``(H, W)`` in the encoder's ``_pos_embed``, timm's
``resample_pos_embed_grid`` (the identity where the grid is G x G). As the ViT front end does for ``dynamic_img_size``:
MJP's step runs on the table resampled to the input's grid (timm's own function), and DAL regresses the stored table,
its G x G rows in row-major order, to their coordinates (over the rows the jigsaw left unmasked where the input's
grid is the table's; every row for an input of another grid, whose masked positions are no row of the table).
``model.mjp``'s grid is the table's.

Where MJP hooks in: the encoder's ``_pos_embed`` (called by ``forward_features`` and ``forward_intermediates`` alike,
on the patch embedding's channels-last tokens ``[B, H, W, D]``) is overridden by a class swap of the encoder: in eval
mode outside ``mjp_eval`` it is timm's own (the model is timm's, exactly); while ``model.mjp`` is engaged it returns
MJP's step instead of ``tokens + table`` (the tokens moved, ``unk_embed`` at the masked positions, the DAL loss
attached), with timm's rotary table. The patch embedding is timm's ``PatchEmbed`` (a Conv2d with stride equal to its
kernel): each token is a function of its own patch, so moving tokens is moving patches. Qwen3's axial 2-D RoPE is
made for the grid's slots: a moved token keeps the rotation of the slot it lands in (as in the pixel-space jigsaw of a
relative-position model); MJP replaces the absolute term only. The ``merge`` pool (``encoder_pool='merge'``, the VLM
projector) merges 2 x 2 slots after the blocks, whatever they hold: it needs nothing of MJP.

timm's FX tracing (``create_feature_extractor``) keeps MJP as one ``mjp`` node and the table's resampling as one call.
No fused path: the tokens come out channels-last at any grid and the table is resampled per input, outside the patch
embedding; ``fused_patch_embed=True`` is refused.

Importing this module never fails: on a timm without ``qwen3_vit`` (1.0.29) the front end covers nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from mjp_fast.timm.base import MJPModel, mjp_class_of
from mjp_fast.timm.front_end import TokenFrontEnd, TokenLayout
from mjp_fast.timm.fused import original_class
from mjp_fast.timm.state import MJPState

try:
    from timm.models.qwen3_vit import Qwen3VitClassifier, Qwen3VitEncoder, resample_pos_embed_grid
except ImportError:  # timm before 1.0.30 has no Qwen3 ViT: nothing for this front end to cover
    Qwen3VitClassifier = Qwen3VitEncoder = resample_pos_embed_grid = None

QWEN3_CLASSES: tuple[type, ...] = tuple(cls for cls in (Qwen3VitClassifier, Qwen3VitEncoder) if cls is not None)
"""The timm classes of this front end (empty where timm has no ``qwen3_vit``)."""


@torch.fx.wrap  # one call in a traced graph: timm's resampling branches on the grid (timm marks its own the same way)
def resampled_table(pos_embed: torch.Tensor, grid_size: int, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """timm's table ``[1, G * G, D]`` resampled to a ``rows x cols`` grid, ``[1, rows * cols, D]`` in ``dtype`` (the
    tokens'), by timm's own ``resample_pos_embed_grid``: ``pos_embed`` itself where nothing changes."""
    return resample_pos_embed_grid(pos_embed, grid_size, (rows, cols)).to(dtype)


class MJPQwen3Encoder:
    """Mixed into a Qwen3 encoder (class swap): ``_pos_embed`` applies MJP while ``model.mjp`` (kept in ``__dict__``
    as ``_mjp_state``, out of the module's children: no second copy in the state dict) is engaged."""

    def _pos_embed(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: the patch tokens ``[B, H, W, D]``. Returns timm's ``(tokens [B, H * W, D], rope)``: the tokens plus
        their position terms, MJP's step while engaged."""
        state: MJPState = self.__dict__["_mjp_state"]
        if not state.engaged:  # eval mode outside mjp_eval: timm's, exactly
            state.record_jigsaw(None)
            return super()._pos_embed(x)
        batch, rows, cols, dim = x.shape
        size = self.pos_embed_grid_size
        table = resampled_table(self.pos_embed, size, rows, cols, x.dtype)
        tokens = x.reshape(batch, rows * cols, dim)
        out = state(
            tokens, table, (rows, cols), prefix=None, prefix_positions=0, dal_table=self.pos_embed,
            dal_grid=(size, size),
        )  # fmt: skip
        return out, self.rope.get_embed(shape=(rows, cols))


class MJPQwen3Model(MJPModel):
    """What a Qwen3 model with MJP adds to timm's class: ``mjp_aux_loss`` (the DAL loss of the stored table) and
    ``mjp.unk_embed`` among the parameters without weight decay; ``forward`` and the rest are timm's."""

    def _mjp_encoder(self) -> nn.Module:
        return self if isinstance(self, MJPQwen3Encoder) else self.encoder

    def mjp_aux_loss(self) -> torch.Tensor:
        state, encoder = self.mjp, self._mjp_encoder()
        if state.dal_regressor is None:
            return encoder.pos_embed.new_zeros((), dtype=torch.float32)
        size = encoder.pos_embed_grid_size
        return state.aux_loss(encoder.pos_embed, (size, size), 0)

    def no_weight_decay(self) -> set[str]:
        extra = {"mjp.unk_embed"} if self.mjp.unk_embed is not None else set()
        return set(super().no_weight_decay()) | extra


class MJPQwen3EncoderModel(MJPQwen3Model, MJPQwen3Encoder):
    """A Qwen3 encoder converted on its own (the ``*_enc`` models): the model and its ``_pos_embed``."""


def covers(model: nn.Module) -> bool:
    """Whether ``model`` is a timm Qwen3 classifier or encoder (each has the table; never on a timm without them)."""
    return bool(QWEN3_CLASSES) and isinstance(model, QWEN3_CLASSES)


def _encoder_of(model: nn.Module) -> nn.Module:
    return model.encoder if isinstance(model, Qwen3VitClassifier) else model


def qwen3_layout(model: nn.Module, fused_patch_embed: bool | None) -> TokenLayout:
    """:func:`mjp_fast.timm.convert`'s layout of a Qwen3 model: the table's grid, its width, its (square) patch,
    tokens moved, never fused.

    Raises:
        ValueError: ``fused_patch_embed=True``, or a patch that is not square.
    """
    encoder = _encoder_of(model)
    if fused_patch_embed:
        raise ValueError(
            "fused_patch_embed=True: Qwen3's patch embedding returns channels-last tokens of any grid and its table "
            "is resampled to each input's grid in the encoder's _pos_embed: the fused op is not wired there"
        )
    rows, cols = encoder.patch_embed.patch_size
    if rows != cols:
        raise ValueError(
            f"model: Qwen3's patch size {tuple(encoder.patch_embed.patch_size)} is not square: the jigsaw moves squares"
        )
    size = int(encoder.pos_embed_grid_size)
    if isinstance(model, Qwen3VitClassifier):
        new_class = mjp_class_of(original_class(type(model)), None, MJPQwen3Model)
    else:
        new_class = mjp_class_of(original_class(type(model)), None, MJPQwen3EncoderModel)
    return TokenLayout(new_class, (size, size), int(encoder.embed_dim), int(rows), False, None)


def install_qwen3(model: nn.Module, layout: TokenLayout) -> None:
    """Makes a converted Qwen3 model's encoder (the model itself for an encoder) apply MJP in ``_pos_embed``."""
    encoder = _encoder_of(model)
    if not isinstance(encoder, MJPQwen3Encoder):
        encoder.__class__ = mjp_class_of(original_class(type(encoder)), None, MJPQwen3Encoder)
    encoder.__dict__["_mjp_state"] = model.mjp


def runs_fused(model: nn.Module) -> bool:
    """A Qwen3 model's MJP embedding is never fused."""
    return False


FRONT_END = TokenFrontEnd(
    covers, qwen3_layout, install_qwen3, runs_fused, names=("Qwen3VitClassifier", "Qwen3VitEncoder")
)
"""Qwen3's vision classifier and encoder, for :func:`mjp_fast.timm.convert`."""
