"""MJP for timm's Gemma 4 vision models (``gemma4_vit_*``: ``Gemma4VitClassifier`` and its ``Gemma4VitEncoder``, and
the ``*_enc`` encoders on their own): the jigsaw and the unknown embedding on the learned position table of
``Gemma4PatchEmbed``, for image input and for NaFlex's pre-patchified input with a grid of its own per sample.

The table. ``patch_embed.position_embedding_table`` ``[2, S, D]`` (S = 10240 positions per axis) is factorized: the
position term of the patch at ``(y, x)`` is ``table[0, x] + table[1, y]``, looked up by timm with one-hot matrix
products (exact: a one-hot product picks a row). There is no resampling: a position's term is the same whatever the
input's grid, so the table of a ``rows x cols`` grid is the top-left corner of one composed table. MJP's table is
that corner for the input's grid, ``[1, rows * cols, D]`` in row-major order, and DAL regresses its rows (each
position's whole term, so both factors learn) to their grid coordinates, which mean the same for every input size
(raw coordinates, the default; ``dal_normalize=True`` scales them per grid). ``model.mjp``'s grid is the one of the
input size the model's config names (768 px: 48x48 at patch 16), the default of ``mjp_aux_loss`` before any forward.

Where MJP hooks in: the patch embedding (``model.encoder.patch_embed``, or ``model.patch_embed`` of an encoder) owns
all of Gemma 4's input dispatch (images, ``[B, N, P*P*C]`` or ``[B, N, P, P, C]`` patches with ``patch_coord`` and
``patch_valid``, or a dict of them) and adds the position term last. It is class-swapped: in eval mode outside
``mjp_eval`` its ``forward`` is timm's own (the model is timm's, exactly); while ``model.mjp`` is engaged it runs
timm's own ``forward`` with a zero position term (its ``_position_embeddings`` hook returns 0: ``x + 0`` is ``x``, and
timm's dispatch, which changed between timm 1.0.29 and 1.0.31, is followed as it is), then applies MJP's step to the
embedded tokens. Each token is a linear map of its own patch, so moving tokens is moving patches.

- Image input (``[B, C, H, W]`` without ``patch_coord``): one grid for the batch, MJP's step on the composed table of
  that grid (the tokens moved, ``unk_embed`` at the masked positions, the other positions' terms), the DAL loss
  attached to the tokens.
- Pre-patchified input, or images with ``patch_coord``: each sample's grid is its largest coordinates plus one, and
  its jigsaw is drawn on that grid and carried to the sequence through ``patch_coord``
  (:func:`mjp_fast.timm.naflexvit.naflex_jigsaw`: samples grouped by grid, one sampler call per grid); padding
  tokens (``patch_valid`` False, or timm's ``-1`` coordinates) are never moved, masked or counted. The valid patches
  of a sample must hold each position of its grid exactly once (a ValueError naming the sample otherwise). DAL
  regresses the composed table of the batch's bounding grid, each row weighted by the samples that hold it unmasked.

The rest of the model reads the ``position_ids`` the embedding returns, which stay those of the sequence slots: the
2-D RoPE of every block and ``encoder_pool='soft'``'s k x k pooler see a moved token at the slot it lands in, as in
the pixel-space jigsaw of a relative-position model; MJP replaces the absolute term only.

Not covered: FX. timm's Gemma 4 does not trace symbolically (its forward branches on the input's rank and type, in
``_assert_raw_img_conformant`` and the patch embedding's dispatch), the plain model included. No fused path (the
projection is a Linear on patches laid out by timm's dispatch): ``fused_patch_embed=True`` is refused.
"""

from __future__ import annotations

import torch
from timm.models.gemma4_vit import Gemma4PatchEmbed, Gemma4VitClassifier, Gemma4VitEncoder
from torch import nn

from mjp_fast.ops.aux_loss import keep_in_graph
from mjp_fast.sampler.jigsaw import Jigsaw
from mjp_fast.timm.base import MJPModel, mjp_class_of
from mjp_fast.timm.front_end import TokenFrontEnd, TokenLayout
from mjp_fast.timm.fused import original_class
from mjp_fast.timm.naflexvit import moved_tokens_ref, naflex_jigsaw
from mjp_fast.timm.pixel import model_input_size
from mjp_fast.timm.state import MJPState

GEMMA4_CLASSES: tuple[type, ...] = (Gemma4VitClassifier, Gemma4VitEncoder)
"""The timm classes of this front end: the classifier (its ``encoder``) and the encoder on its own."""


def composed_table(embed: Gemma4PatchEmbed, grid: tuple[int, int]) -> torch.Tensor:
    """The position terms of a ``grid`` ``(rows, cols)``, ``[1, rows * cols, D]`` in row-major order: row
    ``y * cols + x`` is ``table[0, x] + table[1, y]``, what timm's one-hot lookup gives the patch at ``(y, x)``."""
    table = embed.position_embedding_table
    rows, cols = grid
    term = table[0, :cols].unsqueeze(0) + table[1, :rows].unsqueeze(1)
    return term.reshape(1, rows * cols, table.shape[-1])


class MJPGemma4PatchEmbed(Gemma4PatchEmbed):
    """timm's ``Gemma4PatchEmbed`` with MJP (class swap; module docstring). ``model.mjp`` is kept in ``__dict__``,
    out of the module's children (no second copy in the state dict), where copies and pickles of the model keep
    pointing at it; so is what the last training forward leaves for ``mjp_aux_loss`` (its grid and DAL mask)."""

    def _position_embeddings(self, position_ids: torch.Tensor, padding_positions: torch.Tensor | None) -> torch.Tensor:
        """timm's position term, or while MJP embeds (``forward``) a zero: the tokens come out without it."""
        if self.__dict__.get("_mjp_without_positions", False):
            return self.position_embedding_table.new_zeros(())
        return super()._position_embeddings(position_ids, padding_positions)

    def forward(
        self,
        x: torch.Tensor | dict[str, torch.Tensor],
        patch_coord: torch.Tensor | None = None,
        patch_valid: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """timm's signature: ``x`` images ``[B, C, H, W]``, or patches ``[B, N, P*P*C]`` / ``[B, N, P, P, C]`` with
        ``patch_coord`` ``[B, N, 2]`` (y, x) and ``patch_valid`` ``[B, N]``, or a dict of them. Returns timm's
        ``(tokens [B, N, D], position_ids [B, N, 2] (x, y), padding_positions [B, N] or None)``."""
        state: MJPState = self.__dict__["_mjp_state"]
        self.__dict__["_mjp_grid"] = self.__dict__["_mjp_dal_mask"] = None
        if not state.engaged:  # MJP off (eval mode): timm's embedding, so the model is timm's exactly
            state.record_jigsaw(None)
            return super().forward(x, patch_coord, patch_valid)
        images = not isinstance(x, dict) and x.ndim == 4 and patch_coord is None
        grid = (x.shape[-2] // self.patch_size[0], x.shape[-1] // self.patch_size[1]) if images else None
        self.__dict__["_mjp_without_positions"] = True
        try:
            tokens, position_ids, padding_positions = super().forward(x, patch_coord, patch_valid)
        finally:
            self.__dict__["_mjp_without_positions"] = False
        if grid is not None:
            out = self._image_step(state, tokens, (int(grid[0]), int(grid[1])))
        else:
            out = self._naflex_step(state, tokens, position_ids, padding_positions)
        return out, position_ids, padding_positions

    def _image_step(self, state: MJPState, tokens: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """MJP's step on the tokens ``[B, N, D]`` of images of one ``grid`` (row-major): :class:`MJPState`'s, on the
        composed table of the grid (DAL's too). Returns ``[B, N, D]``."""
        out = state(tokens, composed_table(self, grid), grid, prefix=None, prefix_positions=0)
        jigsaw = state.last_jigsaw
        self.__dict__["_mjp_grid"] = grid
        self.__dict__["_mjp_dal_mask"] = jigsaw.mask if jigsaw is not None else None
        return out

    def _naflex_step(
        self,
        state: MJPState,
        tokens: torch.Tensor,
        position_ids: torch.Tensor,
        padding_positions: torch.Tensor | None,
    ) -> torch.Tensor:
        """MJP's step on NaFlex tokens ``[B, N, D]``, a grid per sample from ``position_ids`` ``[B, N, 2]`` (x, y),
        padding where ``padding_positions`` ``[B, N]`` (None: none); the DAL loss of the bounding grid's composed
        table attached in training. Returns ``[B, N, D]``."""
        coords = position_ids.flip(-1).to(torch.int64)  # timm's external (y, x)
        valid = ~padding_positions if padding_positions is not None else torch.ones_like(coords[..., 0], dtype=bool)
        held = torch.where(valid.unsqueeze(-1), coords, 0)
        bounds = (held.amax(dim=(0, 1)) + 1).tolist()  # a host read, as timm's own grids and pooler make
        grid = (int(bounds[0]), int(bounds[1]))
        sampled = None
        if state.sampler.active:
            sampled, _ = naflex_jigsaw(state.sampler, coords, valid, grid)
        state.record_jigsaw(sampled)  # also forgets the last forward's DAL loss
        jigsaw, unk_row = state.position_jigsaw(sampled)  # the naive shuffle (unk=False) masks no position
        # timm's own lookup (zero rows for padding), not the zero this module's hook gives while embedding
        position = Gemma4PatchEmbed._position_embeddings(self, position_ids, padding_positions).to(tokens.dtype)
        out = tokens + position if jigsaw is None else moved_tokens_ref(tokens, position, unk_row, jigsaw)
        training = state.training and torch.is_grad_enabled()
        unk = state.unk_embed
        if jigsaw is None and unk is not None and training and unk.requires_grad:
            out = keep_in_graph(out, unk)  # a zero gradient through the output: every parameter gets one
        # DAL's mask on the bounding grid: a position is left out of a sample's count where it masked it or does not
        # hold it (a smaller grid, padding).
        cell = torch.where(valid, held[..., 0] * grid[1] + held[..., 1], grid[0] * grid[1])  # padding: a spare column
        masked = jigsaw.mask if sampled is not None else torch.zeros_like(valid)
        left_out = torch.ones((tokens.shape[0], grid[0] * grid[1] + 1), dtype=torch.bool, device=tokens.device)
        left_out = left_out.scatter(1, cell, masked)[:, :-1]
        self.__dict__["_mjp_grid"], self.__dict__["_mjp_dal_mask"] = grid, left_out
        if not training or state.dal_regressor is None:
            return out
        table = composed_table(self, grid)
        loss = state.dal_loss_of(table, grid, Jigsaw(left_out, left_out), 0)
        return state._attach_dal(out, loss, table, grid, sampled, 0)


class _MJPGemma4Model(MJPModel):
    """What a Gemma 4 model with MJP adds to timm's class: ``mjp_aux_loss`` (the DAL loss of the composed table of
    the last forward's grid) and ``mjp.unk_embed`` among the parameters without weight decay. ``forward``,
    ``forward_features`` and ``forward_intermediates`` are timm's (the patch embedding applies MJP)."""

    def _mjp_patch_embed(self) -> MJPGemma4PatchEmbed:
        return self.encoder.patch_embed if isinstance(self, Gemma4VitClassifier) else self.patch_embed

    def mjp_aux_loss(self) -> torch.Tensor:
        state, embed = self.mjp, self._mjp_patch_embed()
        if state.dal_regressor is None:
            return embed.position_embedding_table.new_zeros((), dtype=torch.float32)
        # The loss the last forward attached, handed out once: its table is the one that forward composed.
        stash = state.__dict__.get("_dal_stash")
        claim = stash.get("unclaimed") if stash is not None else None
        if claim is not None:
            attached = state.claim_dal(claim[0])
            if attached is not None:
                return attached
        grid = embed.__dict__.get("_mjp_grid") or tuple(state.sampler.grid_size)
        mask = embed.__dict__.get("_mjp_dal_mask")
        jigsaw = Jigsaw(mask, mask) if mask is not None else None
        return state.dal_loss_of(composed_table(embed, grid), grid, jigsaw, 0)

    def no_weight_decay(self) -> set[str]:
        extra = {"mjp.unk_embed"} if self.mjp.unk_embed is not None else set()
        return set(super().no_weight_decay()) | extra


class MJPGemma4VitClassifier(_MJPGemma4Model, Gemma4VitClassifier):
    """A timm ``Gemma4VitClassifier`` with MJP on its position table (made by :func:`mjp_fast.timm.convert`)."""


class MJPGemma4VitEncoder(_MJPGemma4Model, Gemma4VitEncoder):
    """A timm ``Gemma4VitEncoder`` with MJP on its position table (made by :func:`mjp_fast.timm.convert`)."""


_MJP_CLASSES = {Gemma4VitClassifier: MJPGemma4VitClassifier, Gemma4VitEncoder: MJPGemma4VitEncoder}


def covers(model: nn.Module) -> bool:
    """Whether ``model`` is a timm Gemma 4 classifier or encoder (each has the table)."""
    return isinstance(model, GEMMA4_CLASSES)


def _patch_embed_of(model: nn.Module) -> nn.Module:
    return model.encoder.patch_embed if isinstance(model, Gemma4VitClassifier) else model.patch_embed


def gemma4_layout(model: nn.Module, fused_patch_embed: bool | None) -> TokenLayout:
    """:func:`mjp_fast.timm.convert`'s layout of a Gemma 4 model: the grid of its configured input size, its width,
    its (square) patch, tokens moved, never fused.

    Raises:
        ValueError: ``fused_patch_embed=True``, or a patch that is not square.
        TypeError: a patch embedding that is not timm's ``Gemma4PatchEmbed``.
    """
    embed = _patch_embed_of(model)
    if not isinstance(embed, Gemma4PatchEmbed):
        raise TypeError(f"model: its patch embedding is {type(embed).__name__}, not timm's Gemma4PatchEmbed")
    if fused_patch_embed:
        raise ValueError(
            "fused_patch_embed=True: Gemma 4's patch embedding is a Linear on patches laid out by its input dispatch "
            "(images or NaFlex patches), with a factorized one-hot table: there is no fused MJP op for it"
        )
    rows, cols = embed.patch_size
    if rows != cols:
        raise ValueError(
            f"model: Gemma 4's patch size {tuple(embed.patch_size)} is not square: the jigsaw moves squares"
        )
    size = model_input_size(model) or (768, 768)
    grid = (max(1, size[0] // rows), max(1, size[1] // rows))
    timm_class = next(base for base in GEMMA4_CLASSES if isinstance(model, base))
    new_class = mjp_class_of(original_class(type(model)), timm_class, _MJP_CLASSES[timm_class])
    return TokenLayout(new_class, grid, int(embed.embed_dim), int(rows), False, None)


def install_gemma4(model: nn.Module, layout: TokenLayout) -> None:
    """Swaps the patch embedding of a converted Gemma 4 model (holding ``model.mjp`` already) to apply MJP."""
    embed = _patch_embed_of(model)
    embed.__class__ = mjp_class_of(original_class(type(embed)), Gemma4PatchEmbed, MJPGemma4PatchEmbed)
    embed.__dict__["_mjp_state"] = model.mjp
    embed.__dict__["_mjp_grid"] = embed.__dict__["_mjp_dal_mask"] = None


def runs_fused(model: nn.Module) -> bool:
    """A Gemma 4 model's MJP embedding is never fused."""
    return False


FRONT_END = TokenFrontEnd(
    covers, gemma4_layout, install_gemma4, runs_fused, names=("Gemma4VitClassifier", "Gemma4VitEncoder")
)
"""Gemma 4's vision classifier and encoder, for :func:`mjp_fast.timm.convert`."""
