"""MJP for timm's ``CrossVit``: two branches, each with its own patch embedding (``patch_embed[b]``, on the input
resized or cropped to ``img_size_scaled[b]`` by ``scale_image``), its own class token ``cls_token_b`` and its own
learned absolute table ``pos_embed_b`` ``[1, 1 + N_b, D_b]`` (the class row first), added inline
(``x = cat(cls_token_b, patch_embed[b](x_b)) + pos_embed_b``) in ``forward_features`` (timm 1.0.29) or ``_embed``
(timm 1.0.31, shared by ``forward_features`` and ``forward_intermediates``).

Where MJP hooks in: as for CaiT and ConViT (:mod:`mjp_fast.timm.inline_table`), each branch's patch embedding is
class-swapped. While MJP is engaged (training, or inside ``mjp_eval``) it returns the patch rows of MJP's step minus
the table's patch rows, so that timm's own ``cat`` and ``+ pos_embed_b`` give MJP's tokens (within one float rounding
of ``(y - p) + p``; the gradient is exact): the branch's patch tokens jigsawed, that branch's ``unk_embed`` at its
masked positions, its table's rows elsewhere, and the DAL loss of its table (its patch rows only) attached. timm's
``forward_features``, ``forward_intermediates``, ``features_only`` wrapper and FX tracing run unchanged; in eval mode,
outside ``mjp_eval``, the embeddings are timm's own and the model is timm's, exactly.

The state: ``model.mjp`` (an :class:`mjp_fast.timm.MJPState`) is branch 0's: its ``unk_embed`` ``[D_0]``, its DAL
regressor, and the model's one sampler (``model.mjp.sampler``: seeds, ``prob``, ``ratio``, ``mjp_eval``, the
backend). Branch 1's ``unk_embed`` ``[D_1]`` and DAL regressor are a second ``MJPState``, ``model.mjp.branch_1``: a
child, so the state dict (``mjp.branch_1.*``), ``.to()``, train/eval and ``no_weight_decay`` treat it as the rest of
the state; its sampler draws nothing of its own (below). ``mjp_aux_loss()`` is the sum of both branches' DAL losses;
``model.mjp_dal_weight`` sets both branches' weight.

The two branches' jigsaws correspond: one draw per image, carried to both grids by image region. Why: the branches
see the same image, and CrossViT's cross-attention lets each branch's class token read the other branch's patch
tokens in every block. Independent jigsaws would let the layout of a region that one branch shuffles be read off the
other branch, where that region most likely keeps its place and its position rows: of a ratio ``r`` of each
branch's tokens, only about ``r**2`` of the image would be hidden from both. Carried, the same regions are shuffled
and marked unknown in both branches, the ratio the sampler was given; and one stream of jigsaws, on
``model.mjp.sampler``, is what ``seed``, ``prob`` (a warm-up), ``mjp_eval`` and a resumed run's counter control.

How it is carried: the jigsaw is drawn on the grid of the branch whose tokens cover the largest image regions (the
coarser: branch 1's 16-pixel patches in timm's models), where each token is an image region of the other branch too,
or most of one. A token of the other branch is masked where the centre of its region lies in a masked cell of the
draw; it then shows the patch of its own grid nearest to where its cell's content came from (its centre moved by
the draw's displacement of its cell), and these are made a permutation of the masked positions by rank (the masked
tokens ordered by that source, row-major, take the masked patches in their order). Where the coarse grid's cells are
whole blocks of the fine grid's (the same image region, one grid dividing the other: CrossViT's default ``patch_size``
``(8, 16)`` at ``img_scale`` ``(1, 1)``), that is exact: each coarse cell's block of fine tokens moves as one to where
the coarse cell moves. Where they are not (timm's registered models: 12-pixel patches on the input, 16-pixel ones on
the input resized to 224/240 of it, a 20x20 and a 14x14 grid), the masked regions agree up to the border tokens and
the fine grid's moves follow the coarse ones to the nearest token. With ``unk`` (the default) a masked token carries
no position, so which masked patch lands where changes nothing but a spatial feature map; the mask is what matters.
With ``crop_scale=True`` the regions are those of an input of the model's ``img_size`` (a branch's crop is centred in
it).

Multi-conv embeddings (the ``*_dagger_*`` models: three overlapping convolutions) see across the patches' borders:
each branch's images, at that branch's own size (the embedding gets them after ``scale_image``), are jigsawed in pixel
space before its embedding, one block of ``patch_size[b]`` pixels per token, with that branch's carried jigsaw, and
its masked positions get its ``unk_embed`` (as a hybrid ViT). Where a branch's embedding is timm's plain one (one
``Conv2d`` with stride equal to its square kernel: CrossViT's own ``PatchEmbed``, at its fixed size), the embedding,
jigsaw and position term of a training step run fused (``MJPState`` given the projection's weight and bias).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from timm.models.crossvit import CrossVit
from timm.models.crossvit import PatchEmbed as CrossVitPatchEmbed
from torch import nn

from mjp_fast.ops.dal_loss import DAL_REDUCTIONS
from mjp_fast.sampler.jigsaw import Jigsaw
from mjp_fast.sampler.module import JigsawSampler
from mjp_fast.timm.base import MJPModel, mjp_class_of
from mjp_fast.timm.front_end import TokenFrontEnd, TokenLayout
from mjp_fast.timm.fused import original_class
from mjp_fast.timm.schedule import check_dal_weight
from mjp_fast.timm.state import MJPState

MAX_BRANCHES = 2
"""timm's ``CrossVit`` adds ``pos_embed_1`` and ``cls_token_1`` to every branch after the first (hard-coded for
TorchScript): it runs one or two branches."""


class BranchGeometry(NamedTuple):
    """Where a branch's token grid lies on the input image, in units of the input's height and width: token
    ``(i, j)`` covers ``[origin[0] + i * step[0], origin[0] + (i + 1) * step[0])`` by the same in width."""

    grid: tuple[int, int]
    origin: tuple[float, float]
    step: tuple[float, float]


def branch_geometry(model: nn.Module, branch: int) -> BranchGeometry:
    """The geometry of ``model``'s branch ``branch`` (a CrossVit's): its grid ``img_size_scaled[b] // patch_size[b]``
    (timm floors it), on its image, which is the input resized to ``img_size_scaled[b]`` (the whole input), or with
    ``crop_scale`` a centred crop of an input of the model's ``img_size``, as ``scale_image`` cuts it."""
    embed = model.patch_embed[branch]
    (height, width), (scaled_h, scaled_w) = model.img_size, model.img_size_scaled[branch]
    patch_h, patch_w = embed.patch_size
    grid = (scaled_h // patch_h, scaled_w // patch_w)
    if model.crop_scale and scaled_h <= height and scaled_w <= width:
        # scale_image's crop: int(round((H - h) / 2)) pixels off the top (and left) of the input, pixel for pixel
        top, left = int(round((height - scaled_h) / 2.0)), int(round((width - scaled_w) / 2.0))
        return BranchGeometry(grid, (top / height, left / width), (patch_h / height, patch_w / width))
    # interpolated: the branch's image spans the whole input
    return BranchGeometry(grid, (0.0, 0.0), (patch_h / scaled_h, patch_w / scaled_w))


def draw_branch(geometries: list[BranchGeometry]) -> int:
    """The branch whose grid the jigsaw is drawn on: the one whose tokens cover the largest regions (the first of
    equals)."""
    areas = [geometry.step[0] * geometry.step[1] for geometry in geometries]
    return max(range(len(areas)), key=lambda branch: (areas[branch], -branch))


_CARRY_TABLES: dict[tuple, tuple[torch.Tensor, ...]] = {}


def _carry_tables(source: BranchGeometry, target: BranchGeometry, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The fixed part of a carry from ``source``'s grid to ``target``'s, made once per pair and device: for each
    target token (row-major), the source cell its centre lies in (-1: outside the source's grid), and its row and
    column (float64, for the moves)."""
    key = (source, target, str(device))
    tables = _CARRY_TABLES.get(key)
    if tables is None:
        (rows, cols), (source_rows, source_cols) = target.grid, source.grid
        cells = []
        for i in range(rows):
            centre_y = target.origin[0] + (i + 0.5) * target.step[0]
            cell_row = math.floor((centre_y - source.origin[0]) / source.step[0])
            for j in range(cols):
                centre_x = target.origin[1] + (j + 0.5) * target.step[1]
                cell_col = math.floor((centre_x - source.origin[1]) / source.step[1])
                inside = 0 <= cell_row < source_rows and 0 <= cell_col < source_cols
                cells.append(cell_row * source_cols + cell_col if inside else -1)
        positions = torch.arange(rows * cols, device=device)
        tables = (
            torch.tensor(cells, dtype=torch.int64, device=device),
            torch.div(positions, cols, rounding_mode="floor").to(torch.float64),
            (positions % cols).to(torch.float64),
        )
        _CARRY_TABLES[key] = tables
    return tables


def carry_jigsaw(jigsaw: Jigsaw, source: BranchGeometry, target: BranchGeometry) -> Jigsaw:
    """``jigsaw`` (drawn on ``source``'s grid: mask and perm ``[B, N_s]``) carried to ``target``'s grid by image
    region (module docstring): ``Jigsaw(mask [B, N_t], perm [B, N_t])``, ``perm`` a permutation of the masked
    positions and the identity elsewhere. ``jigsaw`` itself where the geometries are the same. No host sync."""
    if source == target:
        return jigsaw
    mask, perm = jigsaw
    batch = mask.shape[0]
    cells, rows, cols = _carry_tables(source, target, mask.device)
    (target_rows, target_cols), source_cols = target.grid, source.grid[1]
    num_positions = target_rows * target_cols
    inside = cells >= 0
    cell = cells.clamp(min=0).expand(batch, -1)
    carried = mask.gather(1, cell) & inside
    # The draw's displacement of each token's cell (perm[c]: the cell whose content shows at c), in target tokens
    came_from = perm.gather(1, cell)
    shift_rows = torch.div(came_from, source_cols, rounding_mode="floor") - torch.div(
        cell, source_cols, rounding_mode="floor"
    )
    shift_cols = came_from % source_cols - cell % source_cols
    source_row = (rows + shift_rows * (source.step[0] / target.step[0])).round().clamp(0, target_rows - 1)
    source_col = (cols + shift_cols * (source.step[1] / target.step[1])).round().clamp(0, target_cols - 1)
    nearest = (source_row * target_cols + source_col).to(torch.int64)
    # A permutation of the masked positions by rank: the masked tokens ordered by the patch they should show (ties
    # by position) take the masked patches in position order; the unmasked ones sort last, in order, onto themselves.
    positions = torch.arange(num_positions, device=mask.device)
    wanted = torch.where(carried, nearest * num_positions + positions, num_positions * num_positions + positions)
    available = torch.where(carried, positions, num_positions + positions)
    moved = torch.empty_like(available).scatter_(1, wanted.argsort(dim=1), available.argsort(dim=1))
    return Jigsaw(carried, moved)


class CrossVitDrawSampler(JigsawSampler):
    """``model.mjp.sampler`` of a CrossViT: the model's one :class:`mjp_fast.JigsawSampler` (settings, stream,
    ``jigsaw_eval``), drawing each batch's jigsaws on the draw grid (its ``grid_size``), keeping the draw for the
    other branch's step of the same forward, and returning it carried to branch 0's grid (module docstring)."""

    def __init__(self, draw: BranchGeometry, own: BranchGeometry, **settings: object) -> None:
        super().__init__(draw.grid, **settings)
        self.draw_geometry, self.own_geometry = draw, own
        self._kept: dict[str, Jigsaw | None] = {"draw": None}

    def forward(self, batch: int, device: torch.device, grid_size: tuple[int, int] | None = None) -> Jigsaw | None:
        """The next ``batch`` jigsaws, for branch 0's grid (``grid_size``, if given, must be it); None when
        inactive."""
        _check_grid("grid_size", grid_size, self.own_geometry)
        draw = super().forward(batch, device, None)
        self._kept["draw"] = draw
        return None if draw is None else carry_jigsaw(draw, self.draw_geometry, self.own_geometry)

    def take_draw(self, batch: int) -> Jigsaw:
        """The draw of this forward's branch-0 step, for the other branch (handed out once)."""
        draw, self._kept["draw"] = self._kept["draw"], None
        if draw is None or draw.mask.shape[0] != batch:
            raise RuntimeError(
                "CrossViT MJP: branch 1's jigsaw is carried from the draw of branch 0's step in the same forward "
                "(timm's forward_features and forward_intermediates embed branch 0 first); call the model, not "
                "patch_embed[1] on its own"
            )
        return draw

    def __getstate__(self) -> dict:
        """Copies and pickles take no draw (it belongs to the forward that made it)."""
        state = dict(super().__getstate__())
        state["_kept"] = {"draw": None}
        return state


class CarriedJigsawSampler(nn.Module):
    """The sampler of ``model.mjp.branch_1``: draws nothing; active when the model's sampler is, and returns that
    sampler's draw of this forward carried to branch 1's grid. Its backend is the model's sampler's. No state dict
    entries (the model's sampler is kept in ``__dict__``, not as a child)."""

    def __init__(self, source: CrossVitDrawSampler, geometry: BranchGeometry) -> None:
        super().__init__()
        self.__dict__["_source"] = source
        self.geometry = geometry
        self.grid_size = geometry.grid

    @property
    def source(self) -> CrossVitDrawSampler:
        return self.__dict__["_source"]

    @property
    def active(self) -> bool:
        return self.source.active

    @property
    def backend(self) -> str | None:
        return self.source.backend

    @backend.setter
    def backend(self, backend: str | None) -> None:
        self.source.backend = backend

    def backend_for(self, device: torch.device) -> str:
        return self.source.backend_for(device)

    def forward(self, batch: int, device: torch.device, grid_size: tuple[int, int] | None = None) -> Jigsaw | None:
        """This forward's draw carried to branch 1's grid (``grid_size``, if given, must be it); None when the
        model's sampler is inactive."""
        _check_grid("grid_size", grid_size, self.geometry)
        if not self.active:
            return None
        source = self.source
        return carry_jigsaw(source.take_draw(batch), source.draw_geometry, self.geometry)


def _check_grid(name: str, grid: tuple[int, int] | None, geometry: BranchGeometry) -> None:
    if grid is not None and tuple(grid) != geometry.grid:
        raise ValueError(f"{name}: a CrossViT branch's jigsaw is of its grid {geometry.grid}, got {tuple(grid)}")


def branch_states(model: nn.Module) -> list[MJPState]:
    """The MJP state of each branch of a converted CrossViT: ``model.mjp``, then ``model.mjp.branch_1``."""
    state = model.mjp
    return [state] if model.num_branches == 1 else [state, state.branch_1]


class _CrossVitBranchEmbed:
    """Mixed into a CrossViT branch's patch embedding (class swap): while the branch's ``MJPState`` is engaged it
    returns MJP's patch tokens minus the table's patch rows ``[B, N_b, D_b]``, which timm's ``cat`` with the class
    token and ``+ pos_embed_b`` turn into MJP's tokens; otherwise timm's own embedding. The model is kept in
    ``__dict__`` (not a child: no second copy in the state dict, no cycle), and its table read at each call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: the branch's images ``[B, C, H_b, W_b]`` (after ``scale_image``). Returns ``[B, N_b, D_b]``."""
        model, branch = self.__dict__["_mjp_model"], self.__dict__["_mjp_branch"]
        state = branch_states(model)[branch]
        if not state.engaged:  # MJP off (eval mode): timm's embedding, so the model is timm's exactly
            state.record_jigsaw(None)
            return super().forward(x)
        # timm's hard-coded names (two branches at most)
        table = model.pos_embed_0 if branch == 0 else model.pos_embed_1
        cls_token = model.cls_token_0 if branch == 0 else model.cls_token_1
        grid = self.__dict__["_mjp_grid"]
        # The class token goes in as the prefix (the kernels take the class row of the table with it); its output
        # row is dropped, since timm puts the class token in front itself.
        if self.__dict__.get("_mjp_fused", False):
            height, width = x.shape[-2:]
            torch._assert(
                height == self.img_size[0], f"Input height ({height}) doesn't match model ({self.img_size[0]})."
            )
            torch._assert(width == self.img_size[1], f"Input width ({width}) doesn't match model ({self.img_size[1]}).")
            proj = self.proj
            tokens = state(x, table, grid, proj.weight, proj.bias, prefix=cls_token, prefix_positions=1)
        elif self.__dict__.get("_mjp_pixels", False):
            # Multi-conv: the convolutions see across the patches' borders, so the images are jigsawed before them
            # (one FX node); the tokens, in jigsaw order already, get unk_embed at the masked positions.
            tokens = super().forward(state(x))
            tokens = state(tokens, table, grid, prefix=cls_token, prefix_positions=1, pixels_jigsawed=True)
        else:  # one linear map per patch: moving the tokens is moving the patches
            tokens = state(super().forward(x), table, grid, prefix=cls_token, prefix_positions=1)
        return tokens[:, 1:] - table[:, 1:]


class CrossVitMJPPatchEmbed(_CrossVitBranchEmbed, CrossVitPatchEmbed):
    """timm's CrossViT ``PatchEmbed`` (one Conv2d, or the multi-conv stem) with MJP on its branch's table."""


class MJPCrossVit(MJPModel, CrossVit):
    """A timm ``CrossVit`` with MJP on both branches' position tables (made by :func:`mjp_fast.timm.convert`):
    ``model.mjp`` is branch 0's state and the model's sampler, ``model.mjp.branch_1`` branch 1's (module docstring).
    ``forward``, ``forward_features`` and ``forward_intermediates`` are timm's (the patch embeddings apply MJP)."""

    def mjp_aux_loss(self) -> torch.Tensor:
        """The sum of the branches' DAL losses (each of its table's patch rows, over its unmasked positions); zero
        without DAL. As :meth:`mjp_fast.timm.MJPModel.mjp_aux_loss` (the losses the last forward attached are handed
        out once)."""
        total = self.pos_embed_0.new_zeros((), dtype=torch.float32)
        for branch, state in enumerate(branch_states(self)):
            if state.dal_regressor is not None:
                table = self.pos_embed_0 if branch == 0 else self.pos_embed_1
                total = total + state.aux_loss(table, self.patch_embed[branch].__dict__["_mjp_grid"], 1)
        return total

    def no_weight_decay(self) -> set[str]:
        names = set()
        for name, state in zip(("mjp.unk_embed", "mjp.branch_1.unk_embed"), branch_states(self)):
            if state.unk_embed is not None:
                names.add(name)
        return set(super().no_weight_decay()) | names

    @property
    def mjp_dal_weight(self) -> float:
        """As :attr:`mjp_fast.timm.MJPModel.mjp_dal_weight`, for both branches: setting it sets each branch's
        state's ``dal_weight`` buffer (reading it reads branch 0's)."""
        return self.mjp.get_dal_weight()

    @mjp_dal_weight.setter
    def mjp_dal_weight(self, value: float) -> None:
        value = check_dal_weight("mjp_dal_weight", value)
        for state in branch_states(self):
            state.set_dal_weight(value)


def is_crossvit(model: nn.Module) -> bool:
    """Whether ``model`` is this front end's: a timm ``CrossVit``."""
    return isinstance(model, CrossVit)


def _is_multi_conv(embed: nn.Module) -> bool:
    return isinstance(embed.proj, nn.Sequential)


def unfusable_embed_reason(model: nn.Module) -> str | None:
    """None where every branch's embedding can run fused with its position term: CrossViT's own ``PatchEmbed``
    (``forward`` not overridden; it checks a fixed image size), one Conv2d with stride equal to its square kernel,
    no padding, dilation or groups; else why not, naming the branch."""
    for branch, embed in enumerate(model.patch_embed):
        where = f"patch_embed[{branch}]"
        embed_class = original_class(type(embed))
        if not issubclass(embed_class, CrossVitPatchEmbed) or embed_class.forward is not CrossVitPatchEmbed.forward:
            return f"{where} is a {embed_class.__name__}, not CrossViT's PatchEmbed"
        proj = embed.proj
        if _is_multi_conv(embed):
            return (
                f"{where} is a multi-conv embedding (multi_conv=True: overlapping convolutions, which the fused op, "
                "one non-overlapping projection per patch, cannot compute)"
            )
        if not isinstance(proj, nn.Conv2d) or type(proj).forward is not nn.Conv2d.forward:
            return f"{where}.proj is a {type(proj).__name__}, not an nn.Conv2d"
        if proj.kernel_size[0] != proj.kernel_size[1] or tuple(proj.stride) != tuple(proj.kernel_size):
            return f"{where}.proj has kernel {tuple(proj.kernel_size)} and stride {tuple(proj.stride)}, not one square"
        if proj.padding not in ("valid", (0, 0)) or tuple(proj.dilation) != (1, 1) or proj.groups != 1:
            return f"{where}.proj has padding {proj.padding}, dilation {tuple(proj.dilation)}, groups {proj.groups}"
    return None


def crossvit_layout(model: nn.Module, fused_patch_embed: bool | None) -> TokenLayout:
    """:func:`mjp_fast.timm.convert`'s layout of a CrossViT: ``model.mjp`` is branch 0's (its grid, width and patch;
    the pixel block: its patch, for a multi-conv embedding, else None).

    Raises:
        ValueError: more than two branches; a table whose rows are not its class row and its branch's grid; a
            multi-conv branch whose image size is not whole patches (the pixel jigsaw cuts it into patches);
            ``fused_patch_embed=True`` where a branch's embedding cannot run fused (the message says why).
    """
    branches = model.num_branches
    if branches > MAX_BRANCHES:
        raise ValueError(
            f"model: a CrossVit with {branches} branches; timm's CrossVit adds pos_embed_1 and cls_token_1 to every "
            f"branch after the first, so it runs at most {MAX_BRANCHES}"
        )
    for branch in range(branches):
        geometry, embed = branch_geometry(model, branch), model.patch_embed[branch]
        rows, cols = geometry.grid
        table = getattr(model, f"pos_embed_{branch}")
        if table.shape[1] != 1 + rows * cols:
            raise ValueError(
                f"model: pos_embed_{branch} has {table.shape[1]} rows, not the class row and the {rows}x{cols} grid "
                f"of patch_embed[{branch}] (so timm's own forward cannot add it either)"
            )
        size = model.img_size_scaled[branch]
        if _is_multi_conv(embed) and (size[0] % embed.patch_size[0] or size[1] % embed.patch_size[1]):
            raise ValueError(
                f"model: branch {branch}'s images are {size[0]}x{size[1]} pixels, not whole {embed.patch_size[0]}-"
                "pixel patches, which its multi-conv embedding's pixel-space jigsaw needs"
            )
    reason = unfusable_embed_reason(model) if fused_patch_embed is not False else None
    if fused_patch_embed and reason is not None:
        raise ValueError(f"fused_patch_embed=True: {reason}")
    embed = model.patch_embed[0]
    patch = int(embed.patch_size[0])
    new_class = mjp_class_of(original_class(type(model)), CrossVit, MJPCrossVit)
    fuse = fused_patch_embed is not False and reason is None
    pixel_block = patch if _is_multi_conv(embed) else None
    return TokenLayout(new_class, branch_geometry(model, 0).grid, model.embed_dim[0], patch, fuse, pixel_block)


def runs_fused(model: nn.Module) -> bool:
    """Whether a converted CrossViT's branch embeddings were installed fused with their position terms."""
    embed = model.patch_embed[0]
    return isinstance(embed, _CrossVitBranchEmbed) and bool(embed.__dict__.get("_mjp_fused", False))


def install_crossvit(model: nn.Module, layout: TokenLayout) -> None:
    """Wires MJP into a converted CrossViT holding ``model.mjp`` (branch 0's state, made by convert): the model's
    sampler drawing on the draw grid, branch 1's state ``model.mjp.branch_1`` (the same settings, its own width and
    grid, on the model's device and dtype), and each branch's embedding swapped."""
    state = model.mjp
    geometries = [branch_geometry(model, branch) for branch in range(model.num_branches)]
    draw = geometries[draw_branch(geometries)]
    old = state.sampler
    sampler = CrossVitDrawSampler(
        draw, geometries[0], ratio=old.ratio, prob=old.prob, seed=old.seed, min_block=old.min_block,
        min_aspect=old.min_aspect, shared=old.shared, backend=old.backend,
    )  # fmt: skip
    sampler.to(old.sample_counter.device)
    sampler.sample_counter.copy_(old.sample_counter)
    sampler.train(old.training)
    state.sampler = sampler
    if model.num_branches > 1:
        state.branch_1 = _branch_state(model, state, sampler, geometries[1])
    multi_conv = layout.pixel_block is not None
    for branch, embed in enumerate(model.patch_embed):
        embed_class = original_class(type(embed))
        named = CrossVitMJPPatchEmbed if embed_class is CrossVitPatchEmbed else None
        embed.__class__ = named if named is not None else mjp_class_of(embed_class, None, _CrossVitBranchEmbed)
        embed.__dict__["_mjp_model"] = model
        embed.__dict__["_mjp_branch"] = branch
        embed.__dict__["_mjp_grid"] = geometries[branch].grid
        embed.__dict__["_mjp_fused"] = layout.fuse
        embed.__dict__["_mjp_pixels"] = multi_conv


def _branch_state(
    model: nn.Module, state: MJPState, sampler: CrossVitDrawSampler, geometry: BranchGeometry
) -> MJPState:
    """Branch 1's ``MJPState``: branch 0's settings at its own width, grid and patch; its sampler carries the model's
    draw."""
    regressor = state.dal_regressor
    reduction = next(name for name, scale in DAL_REDUCTIONS.items() if scale == state.dal_scale)
    branch = MJPState(
        geometry.grid, model.embed_dim[1], patch_size=int(model.patch_embed[1].patch_size[0]),
        ratio=sampler.ratio, prob=sampler.prob, seed=sampler.seed,
        dal=regressor.kind if regressor is not None else None, min_block=sampler.min_block,
        min_aspect=sampler.min_aspect, shared=sampler.shared, backend=sampler.backend,
        dal_normalize=state.dal_normalize, dal_reduction=reduction, unk=state.use_unk,
    )  # fmt: skip
    branch.sampler = CarriedJigsawSampler(sampler, geometry)
    # On the model's device and dtype, as convert puts model.mjp (the DAL regressor stays float32)
    branch.to(device=state.dal_coordinates.device)
    with torch.no_grad():  # branch 0's weight, copied on the device (no read back: a meta model converts too)
        branch.dal_weight.copy_(state.dal_weight)
    table = model.pos_embed_1
    if branch.unk_embed is not None:
        branch.unk_embed.data = branch.unk_embed.data.to(device=table.device, dtype=table.dtype)
    if hasattr(branch, "unused_unk_row"):
        branch.unused_unk_row = branch.unused_unk_row.to(device=table.device, dtype=table.dtype)
    branch.train(state.training)
    return branch


FRONT_END = TokenFrontEnd(is_crossvit, crossvit_layout, install_crossvit, runs_fused, names=("CrossVit",))
"""CrossViT (both branches), for :func:`mjp_fast.timm.convert`."""
