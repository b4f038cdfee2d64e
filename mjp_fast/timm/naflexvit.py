"""MJP for timm's ``NaFlexVit`` (NaFlex ViT: SigLIP-2 NaFlex, RADIO): the jigsaw and the unknown embedding on its
learned (``pos_embed`` ``[1, H, W, D]``) or factorized (``pos_embed_y`` ``[1, H, D]``, ``pos_embed_x`` ``[1, W, D]``)
position table, for image input and for NaFlex's pre-patchified input with a grid of its own per sample.

Where MJP hooks in: NaFlexVit keeps its whole embedding (projection, position term, prefix tokens, dropout) in one
module, ``model.embeds`` (timm's ``NaFlexEmbeds``), which ``forward_features``, ``forward_intermediates`` (and so the
``features_only`` wrapper) all call, and which timm's FX tracer keeps as one leaf call. That module is class-swapped:
in eval mode outside ``mjp_eval`` its ``forward`` is timm's own (the model is timm's, exactly); while
``model.mjp`` is engaged (training, or inside ``mjp_eval``) it embeds the patches as timm does, then applies MJP's
step. Parameters and state dict keys stay timm's; ``model.mjp`` adds MJP's own.

The step. Each sample's patches form a grid: the batch's one grid for image input, or for pre-patchified input
(``patch_coord`` ``[B, N, 2]`` (y, x), ``patch_valid`` ``[B, N]``) the grid of the sample's largest coordinates, as
timm computes it. The position term of each token is timm's own (computed by ``NaFlexEmbeds``' methods: the table
resampled to the sample's grid, learned or factorized, by interpolation or ``grid_sample``). MJP's sampler draws the
block masks and permutations of each sample on that sample's own grid: samples are grouped by grid and each group
drawn with one sampler call (so a sample's mask is what the sampler would draw on its grid, at the configured ratio;
sampling once on the batch's largest grid and cropping would leave small images with few or no masked positions).
The grid positions are then mapped to the sequence through ``patch_coord``: the token at a masked position shows the
patch of the position the permutation names, and gets ``model.mjp.unk_embed`` in place of its position term; the
other tokens, and every padding token (``patch_valid`` False), keep their own patch and position term. The valid
patches of a sample must hold each position of its grid exactly once (as timm's NaFlex collator lays them out),
else a ValueError names the sample.

DAL regresses the stored table's rows to their grid coordinates (the table's grid, ``pos_embed_grid_size``), over
the rows that the samples whose grid is the table's left unmasked (each row weighted by how many samples kept it; a
sample of another grid keeps every row, its resampled rows being no row of the table). Padding tokens map to no row
and are never counted. A factorized table's position embedding of ``(y, x)`` is ``pos_embed_y[y] + pos_embed_x[x]``:
DAL regresses that sum, the ``H * W`` rows of the composed table, so both factors learn from it.

Not covered: a NaFlexVit without an absolute table (``pos_embed='none'``, RoPE only) gets :func:`convert`'s
pixel-space jigsaw of its images (no dict input there). With RoPE as well as a table, a moved token keeps the
rotation of the sequence slot it lands in (the rotary table is made by the model, outside ``embeds``).

Fusion. Where the embedding is a plain linear projection (``embed_proj_type='linear'``, a ``nn.Linear`` with no
input norm before it and no norm after it: :func:`unfusable_reason`), a step (training, or inside ``mjp_eval``)
embeds the patch rows, moves them, adds the position term and puts the prefix tokens in front in one operation,
:func:`mjp_fast.ops.gathered_patch_embed.gathered_patch_embed_step` (a GEMM whose loads gather the rows, on the
``triton`` backend; the other backends run its torch computation, the same arithmetic as the unfused step's): the
patch rows are gathered, not the embedded tokens moved after. Image input is patchified as timm does first. The
position term is timm's, computed as above (``[B, N, D]`` per sample, ``[N, D]`` for image input). Variable-size
patches (5-D input with timm's patch interpolator) are embedded unfused. Eval outside ``mjp_eval`` is timm's either
way. ``fused_patch_embed=False`` keeps the unfused step; True refuses an embedding that cannot fuse, saying why.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from timm.layers import _assert
from timm.models.naflexvit import NaFlexEmbeds, NaFlexVit, batch_patchify, calculate_naflex_grid_sizes
from torch import nn

from mjp_fast.ops.aux_loss import keep_in_graph
from mjp_fast.ops.gathered_patch_embed import gathered_patch_embed_step
from mjp_fast.ops.patch_embed import autocast_like_conv
from mjp_fast.ops.pos_embed import mjp_position_step
from mjp_fast.sampler.jigsaw import Jigsaw
from mjp_fast.timm.base import MJPModel, mjp_class_of
from mjp_fast.timm.front_end import TokenFrontEnd, TokenLayout
from mjp_fast.timm.fused import original_class
from mjp_fast.timm.state import MJPState

TABLE_TYPES = ("learned", "factorized")
"""``NaFlexEmbeds.pos_embed_type`` values with an absolute table: the ones this front end covers."""


def table_grid(embeds: NaFlexEmbeds) -> tuple[int, int]:
    """The grid ``(H, W)`` of a NaFlex embedding's stored table (learned ``[1, H, W, D]``, or factorized
    ``[1, H, D]`` and ``[1, W, D]``): ``model.mjp``'s grid and DAL's."""
    if embeds.pos_embed_type == "learned":
        return int(embeds.pos_embed.shape[1]), int(embeds.pos_embed.shape[2])
    return int(embeds.pos_embed_y.shape[1]), int(embeds.pos_embed_x.shape[1])


def dal_table(embeds: NaFlexEmbeds) -> torch.Tensor:
    """The table DAL regresses, ``[1, H * W, D]`` in row-major grid order: a view of the learned ``pos_embed``, or
    the factorized table composed (``pos_embed_y[y] + pos_embed_x[x]``, the position embedding of ``(y, x)``)."""
    if embeds.pos_embed_type == "learned":
        table = embeds.pos_embed
        return table.reshape(1, table.shape[1] * table.shape[2], table.shape[3])
    rows, cols = embeds.pos_embed_y, embeds.pos_embed_x
    return (rows.unsqueeze(2) + cols.unsqueeze(1)).reshape(1, rows.shape[1] * cols.shape[1], rows.shape[2])


class MJPNaFlexEmbeds(NaFlexEmbeds):
    """timm's ``NaFlexEmbeds`` with MJP (class swap): while the model's ``MJPState`` is engaged, the patch tokens are
    jigsawed per sample on its own grid and the masked ones get ``unk_embed`` in place of their position term (module
    docstring); otherwise timm's own ``forward``. The model is kept out of the module's children (no second copy in
    the state dict, no cycle in ``modules()``), in ``__dict__``, which copies and pickles of the model keep pointing
    at themselves."""

    def forward(
        self, x: torch.Tensor, patch_coord: torch.Tensor | None = None, patch_valid: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, tuple[int, int] | None]:
        """timm's signature: ``x`` images ``[B, C, H, W]``, or patches ``[B, N, P*P*C]`` (``[B, N, Ph, Pw, C]``) with
        ``patch_coord`` ``[B, N, 2]`` integer (y, x) and ``patch_valid`` ``[B, N]`` bool (None: all valid). Returns
        ``(tokens [B, Q + N, D], grid)``: Q prefix tokens (class, registers) in front; ``grid`` the batch's grid for
        image input, None for patches."""
        state: MJPState = self.__dict__["_mjp_model"].mjp
        self.__dict__["_mjp_dal_mask"] = None
        if not state.engaged:  # MJP off (eval mode): timm's embedding, so the model is timm's exactly
            state.record_jigsaw(None)
            return super().forward(x, patch_coord=patch_coord, patch_valid=patch_valid)
        rows = self._fused_rows(x, patch_coord) if self.__dict__.get("_mjp_fused", False) else None
        if rows is not None:  # the projection runs inside the step, fused
            patches, grid = rows
            return self.pos_drop(self._mjp_step(state, patches, grid, patch_coord, patch_valid, fused=True)), grid
        tokens, grid = self._patch_tokens(x, patch_coord)
        tokens = self._mjp_step(state, tokens, grid, patch_coord, patch_valid)
        return self.pos_drop(tokens), grid

    def _fused_rows(
        self, x: torch.Tensor, patch_coord: torch.Tensor | None
    ) -> tuple[torch.Tensor, tuple[int, int] | None] | None:
        """The patch rows ``[B, N, P*P*C]`` that timm's linear path projects, and the batch's grid (None for
        pre-patchified input); None where that path does not project them plainly (variable-size 5-D patches through
        timm's patch interpolator: the unfused step then). Only for an embedding that :func:`unfusable_reason`
        accepts; timm's input checks."""
        grid: tuple[int, int] | None = None
        if patch_coord is None:
            _assert(x.ndim == 4, "Expecting 2D image input with input ndim == 4")
            x, grid = batch_patchify(x, self.patch_size, pad=self.dynamic_img_pad, channels_last=self.channels_last)
        else:
            _assert(x.ndim == 5 or x.ndim == 3, "Expecting patchified input with ndim == 3 or 5.")
            if self.enable_patch_interpolator and x.ndim == 5:
                return None
        return x.flatten(2), grid

    def _patch_tokens(
        self, x: torch.Tensor, patch_coord: torch.Tensor | None
    ) -> tuple[torch.Tensor, tuple[int, int] | None]:
        """timm's ``NaFlexEmbeds.forward`` up to its position term: the embedded patch tokens ``[B, N, D]`` (after the
        projection and its norm) and the batch's grid (None for pre-patchified input). The same code as timm's
        (1.0.29 to 1.0.31), so that MJP embeds exactly what timm embeds."""
        grid: tuple[int, int] | None = None
        if self.is_linear:
            if patch_coord is None:
                _assert(x.ndim == 4, "Expecting 2D image input with input ndim == 4")
                x, grid = batch_patchify(x, self.patch_size, pad=self.dynamic_img_pad, channels_last=self.channels_last)
            else:
                _assert(x.ndim == 5 or x.ndim == 3, "Expecting patchified input with ndim == 3 or 5.")
            if self.enable_patch_interpolator and x.ndim == 5:
                _assert(self.norm_input is None, "input norm not supported with patch resizing")
                patch_hw = tuple(x.shape[2:4] if self.channels_last else x.shape[3:5])
                x = self.patch_interpolator(x, self.proj.weight, self.proj.bias, patch_size=patch_hw, is_linear=True)
            else:
                x = x.flatten(2)
                if self.norm_input is not None:
                    x = self.norm_input(x)
                x = self.proj(x)
        else:
            _assert(x.ndim == 4, "Convolutional input must be 4D")
            if self.dynamic_img_pad:
                height, width = x.shape[-2:]
                pad_h = (self.patch_size[0] - height % self.patch_size[0]) % self.patch_size[0]
                pad_w = (self.patch_size[1] - width % self.patch_size[1]) % self.patch_size[1]
                x = F.pad(x, (0, pad_w, 0, pad_h))
            x = self.proj(x)
            grid = x.shape[-2:]
            if self.flatten:
                x = x.flatten(2).transpose(1, 2)
        return self.norm(x), grid

    def _position_term(
        self, shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device, grid: tuple[int, int] | None,
        patch_coord: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        """timm's position term of tokens of ``shape`` ``[B, N, D]`` and ``dtype``: ``[1, N, D]`` for the batch's
        ``grid`` (image input), else ``[B, N, D]`` for each sample's grid from ``patch_coord`` (zero rows where timm
        adds none: its padding). Computed by timm's own methods, added to zeros (exact: ``0 + p`` is ``p``)."""
        if grid is not None:
            term = torch.zeros((1, shape[1], shape[2]), dtype=dtype, device=device)
            if self.pos_embed_type == "learned":
                self._apply_learned_pos_embed(term, grid_size=grid)
            else:
                self._apply_factorized_pos_embed(term, grid_size=grid)
            return term
        term = torch.zeros(shape, dtype=dtype, device=device)
        if self.pos_embed_type == "learned":
            if self.pos_embed_use_grid_sample:
                self._apply_learned_naflex_pos_embed_grid_sample(term, patch_coord=patch_coord)
            else:
                self._apply_learned_naflex_pos_embed(term, patch_coord=patch_coord)
        elif self.pos_embed_use_grid_sample:
            self._apply_factorized_naflex_pos_embed_grid_sample(term, patch_coord=patch_coord)
        else:
            self._apply_factorized_naflex_pos_embed(term, patch_coord=patch_coord)
        return term

    def _prefix(self) -> torch.Tensor | None:
        """The class and register tokens ``[1, Q, D]`` in timm's order, or None."""
        tokens = [token for token in (self.cls_token, self.reg_token) if token is not None]
        if len(tokens) <= 1:
            return tokens[0] if tokens else None
        return torch.cat(tokens, dim=1)

    def _mjp_step(
        self,
        state: MJPState,
        tokens: torch.Tensor,
        grid: tuple[int, int] | None,
        patch_coord: torch.Tensor | None,
        patch_valid: torch.Tensor | None,
        fused: bool = False,
    ) -> torch.Tensor:
        """MJP's step on the patch tokens ``[B, N, D]`` (``fused``: on the patch rows ``[B, N, P*P*C]``, which it
        embeds in the same operation): the jigsaw (while the sampler is active), ``unk_embed`` at the masked
        positions, timm's position term elsewhere, the prefix tokens in front; in training with a DAL regressor and
        grad enabled, the DAL loss of the stored table attached. Returns ``[B, Q + N, D]``."""
        if grid is None:
            patch_coord, patch_valid = _checked_naflex_input(tokens, patch_coord, patch_valid)
        else:
            grid = (int(grid[0]), int(grid[1]))
        own_grid = table_grid(self)
        if fused:
            patches, weight, bias = _projection_operands(tokens, self.proj)
            dtype = _linear_dtype(patches, weight)
            shape = (tokens.shape[0], tokens.shape[1], weight.shape[0])
        else:
            dtype, shape = tokens.dtype, tuple(tokens.shape)
        position = self._position_term(shape, dtype, tokens.device, grid, patch_coord)
        prefix = self._prefix()
        sampler = state.sampler
        sampled = dal_mask = None
        if sampler.active and grid is not None:  # one grid: one draw, in sequence order already
            sampled = sampler.forward(tokens.shape[0], tokens.device, grid)
            dal_mask = sampled.mask if grid == own_grid else None
        elif sampler.active:
            sampled, dal_mask = naflex_jigsaw(sampler, patch_coord, patch_valid, own_grid)
        state.record_jigsaw(sampled)  # also forgets the last forward's DAL loss
        jigsaw, unk_row = state.position_jigsaw(sampled)  # the naive shuffle (unk=False) masks no position
        if fused:
            out = _fused_embedding(state, patches, weight, bias, position, unk_row, jigsaw, prefix)
        elif jigsaw is None:
            out = _prepend(tokens + position, prefix)
        elif position.shape[0] == 1:  # one position term for the batch: the step's kernels
            backend = state.backend_for(tokens.device)
            out = mjp_position_step(tokens, position, unk_row, jigsaw, backend, prefix, 0, permutation=True)
        else:
            out = _prepend(moved_tokens_ref(tokens, position, unk_row, jigsaw), prefix)
        training = state.training and torch.is_grad_enabled()
        unk = state.unk_embed
        if jigsaw is None and unk is not None and training and unk.requires_grad:
            out = keep_in_graph(out, unk)  # a zero gradient through the output: every parameter gets one
        if not training or state.dal_regressor is None:
            return out
        self.__dict__["_mjp_dal_mask"] = dal_mask
        table = dal_table(self)
        loss = state.dal_loss_of(table, own_grid, _mask_only(dal_mask), 0)
        return state._attach_dal(out, loss, table, own_grid, sampled, 0)


def _prepend(tokens: torch.Tensor, prefix: torch.Tensor | None) -> torch.Tensor:
    """timm's ``cat(prefix tokens, tokens)``: ``[B, Q + N, D]``."""
    if prefix is None:
        return tokens
    return torch.cat((prefix.expand(tokens.shape[0], -1, -1), tokens), dim=1)


def _projection_operands(
    patches: torch.Tensor, proj: nn.Linear
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(patches, weight, bias)`` as timm's ``nn.Linear`` multiplies them: under autocast, each cast to its dtype as
    autocast casts a linear layer's inputs (float64 kept); otherwise as they are."""
    device_type = patches.device.type
    if not torch.is_autocast_enabled(device_type):
        return patches, proj.weight, proj.bias
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(autocast_like_conv(tensor, dtype) for tensor in (patches, proj.weight, proj.bias))  # type: ignore[return-value]


def _linear_dtype(patches: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype of timm's projection output (``F.linear`` of the operands :func:`_projection_operands` gives)."""
    return torch.promote_types(patches.dtype, weight.dtype)


def _fused_embedding(
    state: MJPState, patches: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, position: torch.Tensor,
    unk_row: torch.Tensor | None, jigsaw: Jigsaw | None, prefix: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """The fused step's tokens ``[B, Q + N, D]``: ``patches`` ``[B, N, K]`` embedded by ``weight``/``bias``, moved by
    ``jigsaw``, plus ``unk_row`` or ``position`` (``[1, N, D]`` shared or ``[B, N, D]``), the prefix in front, in the
    dtype of timm's ``cat(prefix, proj(x) + position)``.

    The op writes the prefix rows itself where they have the tokens' dtype; a prefix of another dtype (a float32
    class token under autocast) is put in front by ``cat`` instead, which promotes the tokens, as timm's does."""
    dtype = position.dtype
    fused_prefix = prefix if prefix is None or prefix.dtype == dtype else None
    unk = unk_row.to(dtype) if jigsaw is not None and unk_row is not None else None
    pos = position[0] if position.shape[0] == 1 else position
    with torch.autocast(patches.device.type, enabled=False):  # the operands are cast already (autocast's casts)
        out = gathered_patch_embed_step(
            patches, weight, bias, pos, unk, jigsaw, state.backend_for(patches.device), fused_prefix, permutation=True
        )
    if prefix is not None and fused_prefix is None:
        out = _prepend(out, prefix)  # cat promotes the tokens to the prefix dtype, as timm's does
    return out


def _mask_only(mask: torch.Tensor | None) -> Jigsaw | None:
    """A ``Jigsaw`` carrying a DAL mask ``[B, H * W]`` (what :meth:`MJPCore.dal_loss_of` reads; the perm unused)."""
    return None if mask is None else Jigsaw(mask, mask)


def moved_tokens_ref(
    tokens: torch.Tensor, position: torch.Tensor, unk_embed: torch.Tensor, jigsaw: Jigsaw
) -> torch.Tensor:
    """The jigsaw with a position term of each sample's own: ``out[b, n] = tokens[b, perm[b, n]] + (unk_embed if
    mask[b, n] else position[b, n])``. ``tokens``, ``position`` ``[B, N, D]``; ``unk_embed`` ``[D]``; ``jigsaw``
    ``[B, N]`` each. Returns ``[B, N, D]`` in ``tokens``' dtype."""
    index = jigsaw.perm.unsqueeze(-1).expand(-1, -1, tokens.shape[-1])
    moved = tokens.gather(1, index)
    return moved + torch.where(jigsaw.mask.unsqueeze(-1), unk_embed.to(position.dtype), position)


def _checked_naflex_input(
    tokens: torch.Tensor, patch_coord: object, patch_valid: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """``patch_coord`` (integer ``[B, N, 2]``) and ``patch_valid`` (bool ``[B, N]``; None: every token valid), checked
    against the tokens ``[B, N, D]``; a ValueError or TypeError naming the argument."""
    batch, length = tokens.shape[0], tokens.shape[1]
    if not isinstance(patch_coord, torch.Tensor):
        raise TypeError(f"patch_coord must be a tensor [B, N, 2], got {type(patch_coord).__name__}")
    if patch_coord.dtype.is_floating_point or patch_coord.dtype.is_complex or patch_coord.dtype == torch.bool:
        raise TypeError(f"patch_coord must be an integer tensor, got {patch_coord.dtype}")
    if tuple(patch_coord.shape) != (batch, length, 2):
        raise ValueError(f"patch_coord must have shape [B, N, 2] = {[batch, length, 2]}, got {list(patch_coord.shape)}")
    if patch_valid is None:
        patch_valid = torch.ones((batch, length), dtype=torch.bool, device=tokens.device)
    if not isinstance(patch_valid, torch.Tensor):
        raise TypeError(f"patch_valid must be a bool tensor [B, N] or None, got {type(patch_valid).__name__}")
    if patch_valid.dtype != torch.bool:
        raise TypeError(f"patch_valid must be a bool tensor, got {patch_valid.dtype}")
    if tuple(patch_valid.shape) != (batch, length):
        raise ValueError(f"patch_valid must have shape [B, N] = {[batch, length]}, got {list(patch_valid.shape)}")
    return patch_coord.to(device=tokens.device, dtype=torch.int64), patch_valid.to(tokens.device)


def naflex_jigsaw(
    sampler: nn.Module, patch_coord: torch.Tensor, patch_valid: torch.Tensor, table_grid: tuple[int, int]
) -> tuple[Jigsaw, torch.Tensor | None]:
    """The jigsaws of a NaFlex batch, each sample's drawn on its own grid, in sequence order.

    Each sample's grid is timm's (its largest ``patch_coord`` plus one); the samples of one grid are drawn with one
    call of ``sampler`` (a :class:`mjp_fast.JigsawSampler`, active), in batch order; a sample without a valid patch
    draws nothing. The grid's jigsaw is carried to the tokens through their coordinates: a valid token at a masked
    position is masked, and shows the token that holds the position its permutation names; padding tokens are never
    masked and stay where they are.

    Cost: a few host reads of small tensors per step (the grids, as timm's own NaFlex position term reads them; the
    coordinate checks) and one sampler call per distinct grid. Under data parallelism each group's draw takes its
    stream indices as a batch of its own (the sampler's ``counter * world + rank * group size``): distinct across
    ranks where the ranks' groups have equal sizes; otherwise two samples on two ranks may share a jigsaw.

    Args:
        patch_coord: int64 ``[B, N, 2]`` (y, x). patch_valid: bool ``[B, N]``.
        table_grid: the stored table's grid: the samples of that grid give DAL its mask.

    Returns:
        ``(jigsaw, dal_mask)``: ``Jigsaw(mask, perm)`` ``[B, N]`` over the sequence (a permutation of the masked
        valid tokens in each row); ``dal_mask`` bool ``[B, H * W]`` of ``table_grid`` (the masks of its samples, all
        False for the others), or None where no sample is of that grid.

    Raises:
        ValueError: ``patch_coord``: a negative coordinate of a valid patch, or a sample whose valid patches do not
        hold each position of its grid exactly once (the message names the sample).
    """
    batch, length = patch_valid.shape
    device = patch_coord.device
    if bool(((patch_coord < 0) & patch_valid.unsqueeze(-1)).any()):
        raise ValueError("patch_coord: the valid patches' coordinates must be >= 0")
    grids = calculate_naflex_grid_sizes(patch_coord)  # timm's (a host read, as timm's own position term)
    has_valid = patch_valid.any(1).tolist()
    cols = torch.tensor([cols for _, cols in grids], device=device)
    cells = torch.tensor([rows * cols for rows, cols in grids], device=device)
    spare = max(rows * cols for rows, cols in grids)  # the column that padding tokens point at
    # The grid cell of each valid token (row-major in its own grid); padding points at the spare column.
    cell = torch.where(patch_valid, patch_coord[..., 0] * cols[:, None] + patch_coord[..., 1], spare)
    held = torch.zeros((batch, spare + 1), dtype=torch.int64, device=device)
    held.scatter_add_(1, cell, patch_valid.to(torch.int64))
    own_cells = torch.arange(spare, device=device) < cells[:, None]
    expected = own_cells & torch.tensor(has_valid, device=device)[:, None]
    wrong = (held[:, :spare] != expected.to(torch.int64)).any(1).nonzero().flatten().tolist()
    if wrong:
        sample = wrong[0]
        raise ValueError(
            f"patch_coord: the valid patches of sample {sample} do not hold each position of its {grids[sample][0]}x"
            f"{grids[sample][1]} grid (its largest coordinates plus one) exactly once, as MJP's jigsaw needs (samples "
            f"{wrong} in all)"
        )
    groups: dict[tuple[int, int], list[int]] = {}
    for index, (grid, valid) in enumerate(zip(grids, has_valid, strict=True)):
        if valid:
            groups.setdefault(grid, []).append(index)
    grid_mask = torch.zeros((batch, spare + 1), dtype=torch.bool, device=device)
    grid_perm = torch.arange(spare + 1, device=device).repeat(batch, 1)
    dal_mask = None
    for grid, members in groups.items():
        drawn = sampler.forward(len(members), device, grid)
        rows = torch.tensor(members, device=device)
        grid_mask[rows, : grid[0] * grid[1]] = drawn.mask
        grid_perm[rows, : grid[0] * grid[1]] = drawn.perm
        if grid == tuple(table_grid):
            dal_mask = torch.zeros((batch, grid[0] * grid[1]), dtype=torch.bool, device=device)
            dal_mask[rows] = drawn.mask
    # Which token holds each cell (padding tokens all write the spare column, never read).
    positions = torch.arange(length, device=device).expand(batch, -1)
    holder = torch.zeros((batch, spare + 1), dtype=torch.int64, device=device).scatter_(1, cell, positions)
    mask = grid_mask.gather(1, cell)  # padding reads the spare column: never masked
    source = holder.gather(1, grid_perm.gather(1, cell))
    perm = torch.where(mask, source, positions)
    return Jigsaw(mask, perm), dal_mask


class MJPNaFlexVit(MJPModel, NaFlexVit):
    """A timm ``NaFlexVit`` with MJP on its learned or factorized position table (made by
    :func:`mjp_fast.timm.convert`): ``mjp_aux_loss`` (DAL of the stored table, module docstring) and
    ``mjp.unk_embed`` among the parameters without weight decay. ``forward``, ``forward_features`` and
    ``forward_intermediates`` are timm's (the embedding module applies MJP)."""

    def mjp_aux_loss(self) -> torch.Tensor:
        state = self.mjp
        if state.dal_regressor is None:
            return dal_table(self.embeds).new_zeros((), dtype=torch.float32)
        # The loss the last forward attached, handed out once: its table is the one that forward composed.
        stash = state.__dict__.get("_dal_stash")
        claim = stash.get("unclaimed") if stash is not None else None
        if claim is not None:
            attached = state.claim_dal(claim[0])
            if attached is not None:
                return attached
        embeds = self.embeds
        mask = embeds.__dict__.get("_mjp_dal_mask")
        return state.dal_loss_of(dal_table(embeds), table_grid(embeds), _mask_only(mask), 0)

    def no_weight_decay(self) -> set[str]:
        extra = {"mjp.unk_embed"} if self.mjp.unk_embed is not None else set()
        return set(super().no_weight_decay()) | extra


def has_naflex_table(model: nn.Module) -> bool:
    """Whether ``model`` is this front end's: a ``NaFlexVit`` with a learned or factorized position table."""
    embeds = getattr(model, "embeds", None)
    return isinstance(model, NaFlexVit) and getattr(embeds, "pos_embed_type", None) in TABLE_TYPES


def unfusable_reason(embeds: NaFlexEmbeds) -> str | None:
    """None where a NaFlex embedding's step can run fused (the linear projection of patch rows, nothing between it
    and the position term), else why not."""
    if not embeds.is_linear:
        return (
            "embeds.proj is a Conv2d over images (embed_proj_type='conv'); the fused NaFlex op embeds patch rows with "
            "a linear projection"
        )
    if type(embeds.proj) is not nn.Linear:
        return f"embeds.proj is a {type(embeds.proj).__name__}, not a plain nn.Linear"
    if embeds.norm_input is not None:
        return f"embeds has an input norm ({type(embeds.norm_input).__name__}) before its projection"
    if not isinstance(embeds.norm, nn.Identity):
        return f"embeds has a norm layer ({type(embeds.norm).__name__}) after its projection"
    return None


def naflex_layout(model: nn.Module, fused_patch_embed: bool | None) -> TokenLayout:
    """:func:`mjp_fast.timm.convert`'s layout of a NaFlexVit with a table: ``model.mjp`` on the table's grid, the
    embedding fused where :func:`unfusable_reason` allows it and ``fused_patch_embed`` is not False.

    Raises:
        ValueError: ``fused_patch_embed=True`` for an embedding that cannot fuse (the message says why).
        TypeError: an embedding module that is not timm's ``NaFlexEmbeds``.
    """
    embeds = model.embeds
    if not isinstance(embeds, NaFlexEmbeds):
        raise TypeError(f"model: its embedding module is {type(embeds).__name__}, not timm's NaFlexEmbeds")
    reason = unfusable_reason(embeds) if fused_patch_embed is not False else None
    if fused_patch_embed and reason is not None:
        raise ValueError(f"fused_patch_embed=True: {reason}")
    new_class = mjp_class_of(original_class(type(model)), NaFlexVit, MJPNaFlexVit)
    # The jigsaw moves tokens: the patch size is the patches' height, kept for reference (NaFlex patches are square).
    patch = int(embeds.patch_size[0])
    fuse = fused_patch_embed is not False and reason is None
    return TokenLayout(new_class, table_grid(embeds), model.embed_dim, patch, fuse, None)


def install_naflex(model: nn.Module, layout: TokenLayout) -> None:
    """Swaps the embedding module of a converted NaFlexVit (holding ``model.mjp`` already) to apply MJP, fused where
    ``layout.fuse`` (checked by :func:`naflex_layout`)."""
    embeds = model.embeds
    embeds.__class__ = mjp_class_of(original_class(type(embeds)), NaFlexEmbeds, MJPNaFlexEmbeds)
    embeds.__dict__["_mjp_model"] = model
    embeds.__dict__["_mjp_dal_mask"] = None
    embeds.__dict__["_mjp_fused"] = layout.fuse


def runs_fused(model: nn.Module) -> bool:
    """Whether a converted NaFlexVit's MJP step embeds its patch rows fused (see the module docstring; 5-D
    variable-size patches through timm's patch interpolator excepted)."""
    embeds = getattr(model, "embeds", None)
    return isinstance(embeds, MJPNaFlexEmbeds) and bool(embeds.__dict__.get("_mjp_fused", False))


FRONT_END = TokenFrontEnd(has_naflex_table, naflex_layout, install_naflex, runs_fused, names=("NaFlexVit",))
"""NaFlexVit with a learned or factorized table, for :func:`mjp_fast.timm.convert`."""
