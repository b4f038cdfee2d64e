"""``MJPState``: the timm front ends' :class:`mjp_fast.core.MJPCore` (``model.mjp``): the core's sampler,
``unk_embed`` and DAL regressor, plus the DAL weight and the step of a timm model.

Every front end (the ViT, Eva and pixel-space models of this package) holds one ``MJPState`` as ``model.mjp`` and
calls it once per forward where :attr:`MJPState.engaged`, so an FX graph of an MJP model holds MJP as one
``call_module`` node. A training forward computes the DAL loss there and attaches it to the tokens it returns
(:func:`mjp_fast.ops.aux_loss.attach_aux_loss`): whatever loss the loop back-propagates through the output trains
DAL too, at ``dal_weight``. The loss is kept (the core's ``_dal_stash``) for one reader, :meth:`MJPState.aux_loss`
(a model's ``mjp_aux_loss``), which hands it out once or computes it again.
"""

from __future__ import annotations

from typing import Unpack

import torch
import torch.fx
from timm.layers import register_notrace_module

from mjp_fast._validate import check_int
from mjp_fast.core import MJPCore, MJPSettings
from mjp_fast.ops.aux_loss import attach_aux_loss, explicit_aux_loss, keep_in_graph
from mjp_fast.ops.jigsaw_images import jigsaw_images
from mjp_fast.ops.patch_embed import EMBED_WITH_DAL_BACKENDS
from mjp_fast.ops.pos_embed import STEP_WITH_DAL_BACKENDS, mjp_position_dal_step, mjp_position_step
from mjp_fast.sampler.jigsaw import Jigsaw
from mjp_fast.timm.fused import fused_patch_embed, fused_patch_embed_with_dal, plain_position_step
from mjp_fast.timm.schedule import DEFAULT_DAL_WEIGHT, check_dal_weight


@register_notrace_module  # timm's FX tracer (create_feature_extractor) keeps it as one call
class MJPState(MJPCore):
    """What MJP adds to a timm model: the core (sampler, ``unk_embed``, DAL regressor, the last jigsaw, the one
    backend), the jigsaw's patch size and the DAL weight.

    Calling it applies MJP in training mode (see :meth:`forward`); the models call it once per forward, so a
    ``torch.fx`` graph of an MJP model holds MJP as a single ``call_module`` node, whatever the tracer.

    Args:
        grid_size, dim, settings: as :class:`mjp_fast.core.MJPCore` (``settings``: :class:`mjp_fast.core.MJPSettings`,
            ``ratio``, ``prob``, ``seed`` and ``dal`` required). ``dim`` None: the pixel-space variant (no position
            embeddings to replace); ``unk`` then has no effect. ``last_jigsaw`` keeps the sampled mask with or
            without unk (the DAL loss leaves those positions out).
        patch_size: the jigsaw's patch size in pixels.
        border: pixel-space: images whose height or width is not a multiple of ``patch_size`` are jigsawed over
            their largest top-left region of whole patches, the rows and columns past it (fewer than ``patch_size``:
            a border at the bottom and right) left in place (the models built for such a size: Inception's 299 px in
            2-pixel blocks). False (default): such images are a ValueError in training.
        dal_weight: the weight at which a training forward attaches the DAL loss to the tokens (finite, >= 0;
            default 0.01, the paper's starting weight). Held in ``dal_weight``, a 0-d float32 buffer, not in the
            state dict; change it with :meth:`set_dal_weight` (a model's ``mjp_dal_weight``).
    """

    def __init__(
        self,
        grid_size: tuple[int, int],
        dim: int | None,
        *,
        patch_size: int,
        border: bool = False,
        dal_weight: float = DEFAULT_DAL_WEIGHT,
        **settings: Unpack[MJPSettings],
    ) -> None:
        super().__init__()
        dal_weight = check_dal_weight("dal_weight", dal_weight)
        self._init_core(grid_size, dim, **settings)
        self.patch_size = check_int("patch_size", patch_size, minimum=1)
        if not isinstance(border, bool):
            raise TypeError(f"border must be a bool, got {type(border).__name__} {border!r}")
        self.border = border
        # Read by the attached loss's backward, filled in place (compiled and captured graphs keep reading it).
        self.register_buffer("dal_weight", torch.tensor(dal_weight, dtype=torch.float32), persistent=False)

    @property
    def engaged(self) -> bool:
        """Whether the model's forward must call this module: the sampler jigsaws (training, or inside
        ``mjp_eval``), or it trains with a DAL regressor or ``unk_embed`` (the DAL loss is attached to the tokens
        every training forward, and ``unk_embed`` kept in their graph, also while the jigsaw is off: ``prob`` 0 during
        warm-up, ratio 0)."""
        return self.sampler.active or (self.training and (self.dal_regressor is not None or self.unk_embed is not None))

    def get_dal_weight(self) -> float:
        """The ``dal_weight`` buffer's value (a read back: a host sync on a GPU)."""
        return float(self._weight_buffer(self.dal_coordinates.device))

    def set_dal_weight(self, weight: float) -> None:
        """Fills the ``dal_weight`` buffer in place with ``weight`` (checked: finite, >= 0): the tensor stays the one
        compiled and captured graphs read. Set it between steps, before the forward that should apply it."""
        with torch.no_grad():
            self._weight_buffer(self.dal_coordinates.device).fill_(check_dal_weight("dal_weight", weight))

    @property
    def last_dal_loss(self) -> torch.Tensor | None:
        """The DAL loss the last forward attached to its tokens, detached (a 0-d float32 tensor on the model's
        device, for logging: no host sync), or None (no DAL, eval mode, grad disabled, or a front end skipped this
        module)."""
        stash = self.__dict__.get("_dal_stash")
        loss = stash.get("loss") if stash is not None else None
        return loss.detach() if loss is not None else None

    def forward(
        self,
        x: torch.Tensor,
        pos_table: torch.Tensor | None = None,
        grid: tuple[int, int] | None = None,
        weight: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        *,
        prefix: torch.Tensor | None = None,
        prefix_positions: int = 0,
        dal_table: torch.Tensor | None = None,
        dal_grid: tuple[int, int] | None = None,
        pixels_jigsawed: bool = False,
    ) -> torch.Tensor:
        """MJP on one batch: the jigsaw when the sampler is active (training, or inside ``mjp_eval``), else the plain
        step; in training with a DAL regressor and grad enabled, the DAL loss attached to the result. Every part runs
        on the model's one backend (:meth:`backend_for`).

        Args:
            x: with ``pos_table``, the patch tokens ``[B, N, D]`` of a ViT (``N = grid[0] * grid[1]``), or its
                images ``[B, C, H, W]`` when ``weight`` is given; without ``pos_table``, the patch tokens
                ``[B, N, D]`` of a model without a position table (RoPE only: moved, ``unk_embed`` added to the
                shuffled ones), or the images ``[B, C, H, W]`` of a pixel-space model (H and W multiples of
                ``patch_size``).
            pos_table: the model's position table ``[1, Q + N, D]``: the first Q (``prefix_positions``) rows are the
                prefix tokens', the others the patch positions'.
            grid: the patch grid of ``x`` (default: the sampler's).
            weight, bias: the patch projection (timm's ``patch_embed.proj``: Conv2d weight ``[D, C, P, P]``, bias
                ``[D]`` or None) when ``x`` is images to embed, jigsaw and position in one fused op.
            prefix: the class and register tokens to put in front (numel ``P * D``; timm's ``cls_token``), or None;
                ``prefix_positions`` is 0 or P.
            dal_table, dal_grid: the table the DAL loss regresses and its grid, when ``pos_table`` is another (the
                model's own table, resampled for another input size); default ``pos_table`` and ``grid``.
            pixels_jigsawed: ``x`` are the tokens of images this module jigsawed in this forward (a hybrid ViT,
                whose CNN stem sees the jigsawed images): the masked positions get ``unk_embed`` as usual, but the
                tokens are in jigsaw order already and stay where they are.

        Returns:
            ViT: ``[B, P + N, D]``: the prefix tokens plus their position rows, then the (jigsawed) patch tokens plus
            their position terms (with ``weight``: the embedded images); the DAL loss attached in training (see
            :func:`mjp_fast.ops.aux_loss.attach_aux_loss`: the values are the step's, its backward also trains DAL
            at ``dal_weight``).
            Pixel-space: the jigsawed images ``[B, C, H, W]`` (``x`` itself when inactive).
        """
        if isinstance(x, torch.fx.Proxy):
            # Symbolic tracing (torch.fx): the sampler's Python cannot run on proxies, so this call becomes one node
            # that runs the module itself when the graph runs, as a leaf module would.
            tracer = x.tracer
            keywords = dict(prefix=prefix, prefix_positions=prefix_positions, dal_table=dal_table, dal_grid=dal_grid)
            keywords["pixels_jigsawed"] = pixels_jigsawed
            args = (x, pos_table, grid, weight, bias)
            return tracer.create_proxy("call_module", tracer.path_of_module(self), args, keywords)
        if pos_table is None:
            if x.dim() != 3:
                return self._jigsaw_images(x)
            # Tokens without a position table (a RoPE-only Eva): the same step with a table of zeros, so the tokens
            # move and the shuffled ones get unk_embed, the one learned marker of an unknown position.
            pos_table = x.new_zeros((1, x.shape[1], x.shape[2]))
        sampled, jigsaw = self._sample(x, grid, pixels_jigsawed)
        self.record_jigsaw(sampled, grid)  # also forgets the last forward's DAL loss
        # The DAL loss rides on the tokens in training only; the regressor's forward is not needed otherwise.
        training = self.training and torch.is_grad_enabled()
        regressor = self.dal_regressor if training else None
        if dal_table is None:
            dal_table, dal_grid = pos_table, grid
        jigsaw, unk_embed = self.position_jigsaw(jigsaw)  # the naive shuffle masks no position
        loss = None
        if weight is not None:
            # The jigsaw is applied where the patches are cut, the position terms in the GEMM's epilogue.
            unk_embed = unk_embed if jigsaw is not None else None
            embed = (x, weight, bias, pos_table, unk_embed, jigsaw, prefix, prefix_positions)
            stepped = self._embedded_with_dal(*embed, regressor, dal_table, dal_grid, sampled)
            if stepped is None:
                # the sampler's jigsaw (or the identity of images jigsawed already): a permutation
                out = fused_patch_embed(
                    x, weight, bias, pos_table, unk_embed, jigsaw, self, prefix, prefix_positions, permutation=True
                )
            else:
                out, loss = stepped
        elif jigsaw is None:
            out = plain_position_step(x, pos_table, prefix, prefix_positions)
        else:
            dal = (regressor, dal_table, dal_grid, sampled.mask)
            out, loss = self._moved_tokens(x, pos_table, unk_embed, jigsaw, prefix, prefix_positions, *dal)
        unk = self.unk_embed
        if jigsaw is None and unk is not None and training and unk.requires_grad:
            # The jigsaw is off, so nothing uses unk_embed: its gradient is zero, given through the output, so that
            # every parameter gets one from the output (DDP needs no find_unused_parameters).
            out = keep_in_graph(out, unk)
        if regressor is None:
            return out
        return self._attach_dal(out, loss, dal_table, dal_grid, sampled, prefix_positions)

    def _sample(
        self, x: torch.Tensor, grid: tuple[int, int] | None, pixels_jigsawed: bool
    ) -> tuple[Jigsaw | None, ...]:
        """``(sampled, moving)``: the jigsaw this forward samples for ``x`` (None while the sampler is inactive), and
        the one that moves the tokens: the same, or for tokens of images jigsawed already (``pixels_jigsawed``) the
        images' jigsaw with every token left where it is."""
        sampler = self.sampler
        if not sampler.active:
            return None, None
        if pixels_jigsawed:  # the images' jigsaw, sampled by this module's pixel step of the same forward
            sampled = self.last_jigsaw
            return sampled, Jigsaw(sampled.mask, _identity_perm(sampled.perm))
        # The sampler's forward, not its __call__: a submodule of ours, with no hooks to run (a step's host time).
        sampled = sampler.forward(x.shape[0], x.device, grid)
        return sampled, sampled

    def _embedded_with_dal(
        self, images: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pos_table: torch.Tensor,
        unk_embed: torch.Tensor | None, jigsaw: Jigsaw | None, prefix: torch.Tensor | None, prefix_positions: int,
        regressor: torch.nn.Module | None, dal_table: torch.Tensor, dal_grid: tuple[int, int] | None,
        sampled: Jigsaw | None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
        """The fused patch embedding and the DAL loss of its table as one operation, ``(out, loss)``, where the
        backend has one (``triton``) and the step has both (training with a regressor, a jigsaw, DAL regressing the
        position table of the step's grid); else None."""
        if regressor is None or jigsaw is None or sampled is None or dal_table is not pos_table:
            return None
        backend = self.backend_for(images.device)
        if backend not in EMBED_WITH_DAL_BACKENDS:
            return None
        coords = self.dal_coordinates_for(dal_grid, images.device)
        if sampled.mask.shape[1] != coords.shape[0]:  # the mask is of another grid than the DAL table's
            return None
        return fused_patch_embed_with_dal(
            images, weight, bias, pos_table, unk_embed, jigsaw, backend, prefix, prefix_positions, regressor, coords,
            sampled.mask, self.dal_scale, permutation=True,
        )  # fmt: skip

    def _moved_tokens(
        self, x: torch.Tensor, pos_table: torch.Tensor, unk_embed: torch.Tensor, jigsaw: Jigsaw,
        prefix: torch.Tensor | None, prefix_positions: int, regressor: torch.nn.Module | None,
        dal_table: torch.Tensor, dal_grid: tuple[int, int] | None, dal_mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """The position step on embedded tokens ``x`` ``[B, N, D]``: ``P(XW) = (PX)W``, moving the embedded tokens is
        moving the patches. One autograd node for the move, the position terms and the prefix tokens; the arguments
        are the model's own and the sampler's jigsaws need no validation. Returns ``(out [B, P + N, D], loss)``:
        ``loss`` the DAL loss of the table from the same operation (the ``cpu``, ``cuda`` and ``triton`` backends,
        training with a regressor that the fused kernels compute, the table DAL regresses), else None. The
        sampler's perms are permutations (and so is the identity of tokens jigsawed as pixels already)."""
        backend = self.backend_for(x.device)
        if regressor is not None and backend in STEP_WITH_DAL_BACKENDS and dal_table is pos_table:
            coords = self.dal_coordinates_for(dal_grid, x.device)
            if dal_mask.shape[1] == coords.shape[0]:  # the mask is of the DAL table's grid
                stepped = mjp_position_dal_step(
                    x, pos_table, unk_embed, jigsaw, prefix, prefix_positions, regressor, coords, dal_mask,
                    self.dal_scale, backend, permutation=True,
                )  # fmt: skip
                if stepped is not None:
                    return stepped
        step = mjp_position_step(x, pos_table, unk_embed, jigsaw, backend, prefix, prefix_positions, permutation=True)
        return step, None

    def _attach_dal(
        self,
        out: torch.Tensor,
        loss: torch.Tensor | None,
        table: torch.Tensor,
        grid: tuple[int, int] | None,
        sampled: Jigsaw | None,
        prefix_positions: int,
    ) -> torch.Tensor:
        """``out`` with the DAL loss of ``table`` (of ``grid``; ``loss``, or computed here) attached at
        ``dal_weight``; the loss is kept for :meth:`aux_loss` and :attr:`last_dal_loss`."""
        if loss is None:
            loss = self.dal_loss_of(table, grid, sampled, prefix_positions)
        stash = self.__dict__.get("_dal_stash")
        if stash is not None:  # None: a model pickled before the stash existed
            stash["loss"], stash["unclaimed"] = loss, (table, sampled)
        return attach_aux_loss(out, loss, self._weight_buffer(loss.device))

    def _weight_buffer(self, device: torch.device) -> torch.Tensor:
        """The ``dal_weight`` buffer (a dict lookup: cheaper than the module's attribute lookup); made at the default
        weight for a model pickled before it existed."""
        weight = self._buffers.get("dal_weight")
        if weight is None:
            weight = torch.tensor(DEFAULT_DAL_WEIGHT, dtype=torch.float32, device=device)
            self.register_buffer("dal_weight", weight, persistent=False)
        return weight

    def aux_loss(self, table: torch.Tensor, grid: tuple[int, int] | None, prefix_positions: int) -> torch.Tensor:
        """A model's ``mjp_aux_loss()``: the DAL loss of its stored ``table`` ``[1, Q + N, D]`` (of ``grid``, its first
        ``prefix_positions`` rows skipped), the one path that reads the kept loss. The loss the last forward attached,
        if it was of ``table``, as :meth:`claim_dal` hands it out (once); else computed here over the last jigsaw's
        unmasked positions (eval mode, no grad, or handed out already: a loss of its own)."""
        attached = self.claim_dal(table)
        if attached is not None:
            return attached
        return self.dal_loss_of(table, grid, self.last_jigsaw, prefix_positions)

    def claim_dal(self, table: torch.Tensor) -> torch.Tensor | None:
        """The DAL loss the last forward attached, if it was of ``table`` (the model's stored position table), for
        ``mjp_aux_loss``: as :func:`mjp_fast.ops.aux_loss.explicit_aux_loss`, so that a backward through it counts
        the loss at the loop's weight in place of the attached one. Handed out once (a second call gets None:
        compute it again, a loss of its own); None when the last forward attached nothing."""
        stash = self.__dict__.get("_dal_stash")
        claim = stash.get("unclaimed") if stash is not None else None
        if claim is None or claim[0] is not table or claim[1] is not self.last_jigsaw:
            return None
        stash["unclaimed"] = None
        loss = stash["loss"]
        return explicit_aux_loss(loss, self._weight_buffer(loss.device))

    # The name of dal_loss_of before the core existed (MJPPatchEmbed's dal_loss() is its own module's loss).
    dal_loss = MJPCore.dal_loss_of

    def _jigsaw_images(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sampler.active:
            return x
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"x: a pixel-space MJP model takes images [B, C, H, W], got {_describe(x)}")
        patch = self.patch_size
        height, width = x.shape[-2:]
        rows, cols = height // patch, width // patch
        # A state pickled before the border existed has none: the strict check.
        border = self.__dict__.get("border", False) and rows > 0 and cols > 0
        if (height % patch or width % patch) and not border:
            raise ValueError(
                f"images: height {height} and width {width} must be multiples of the jigsaw patch size {patch}"
            )
        jigsaw = self.sampler(x.shape[0], x.device, (rows, cols))
        self.record_jigsaw(jigsaw, (rows, cols))
        if jigsaw is None:
            return x
        if rows * patch == height and cols * patch == width:
            return jigsaw_images(x, jigsaw, patch, validate=False)
        # The whole patches jigsawed, the border (fewer than one patch of rows and columns) glued back in place.
        inner = jigsaw_images(x[..., : rows * patch, : cols * patch], jigsaw, patch, validate=False)
        top = torch.cat((inner, x[..., : rows * patch, cols * patch :]), dim=-1)
        return torch.cat((top, x[..., rows * patch :, :]), dim=-2)


def _identity_perm(perm: torch.Tensor) -> torch.Tensor:
    """``[B, N]`` int64: every token stays where it is (``perm``'s shape and device)."""
    return torch.arange(perm.shape[1], device=perm.device).expand(perm.shape[0], -1).contiguous()


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    return type(value).__name__
