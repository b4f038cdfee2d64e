"""``MJPState``: what MJP adds to a timm model (sampler, ``unk_embed``, DAL regressor and weight), and the step that
applies it.

Every front end (the ViT, Eva and pixel-space models of this package) holds one ``MJPState`` as ``model.mjp`` and
calls it once per forward where :attr:`MJPState.engaged`, so an FX graph of an MJP model holds MJP as one
``call_module`` node. A training forward computes the DAL loss there and attaches it to the tokens it returns
(:func:`mjp_fast.ops.aux_loss.attach_aux_loss`): whatever loss the loop back-propagates through the output trains
DAL too, at ``dal_weight``.
"""

from __future__ import annotations

import torch
import torch.fx
from timm.layers import register_notrace_module
from torch import nn

from mjp_fast._validate import check_int
from mjp_fast.backend import KNOWN_BACKENDS, resolve_backend
from mjp_fast.nn import DAL_KINDS, DALRegressor
from mjp_fast.ops.aux_loss import attach_aux_loss, explicit_aux_loss, keep_in_graph
from mjp_fast.ops.dal_loss import DAL_REDUCTIONS, _coordinates, dal_loss_unchecked, dal_scale, grid_coordinates
from mjp_fast.ops.jigsaw_images import jigsaw_images
from mjp_fast.ops.pos_embed import mjp_position_dal_step, mjp_position_step
from mjp_fast.sampler import JigsawSampler
from mjp_fast.sampler.jigsaw import Jigsaw
from mjp_fast.timm.fused import _fused_patch_embed, _plain_position_step
from mjp_fast.timm.schedule import DEFAULT_DAL_WEIGHT, check_dal_weight


def _dal_kind(dal: str | None) -> str | None:
    """None for no DAL regressor (``None`` or ``"none"``, since timm's ``create_model`` drops keywords whose value
    is None), else a checked :class:`mjp_fast.DALRegressor` kind."""
    if dal is None or (isinstance(dal, str) and dal.lower() == "none"):
        return None
    if dal not in DAL_KINDS:
        raise ValueError(f"dal must be None, 'none' or one of {', '.join(DAL_KINDS)}, got {dal!r}")
    return dal


def _dal_reduction_scale(dal_reduction: str) -> float:
    """The DAL loss's factor for ``dal_reduction`` (``"mean"``: 0.5, ``"sum"``: 1; see :func:`mjp_fast.dal_loss`)."""
    if dal_reduction not in DAL_REDUCTIONS:
        raise ValueError(f"dal_reduction must be one of {', '.join(DAL_REDUCTIONS)}, got {dal_reduction!r}")
    return dal_scale(dal_reduction)


def _check_unk(unk: bool) -> bool:
    if not isinstance(unk, bool):
        raise TypeError(f"unk must be a bool, got {type(unk).__name__}")
    return unk


def _check_backend(backend: str | None) -> str | None:
    if backend is not None and backend not in KNOWN_BACKENDS:
        raise ValueError(f"backend must be None or one of {', '.join(KNOWN_BACKENDS)}, got {backend!r}")
    return backend


@register_notrace_module  # timm's FX tracer (create_feature_extractor) keeps it as one call
class MJPState(nn.Module):
    """What MJP adds to a model: the sampler, ``unk_embed`` (ViTs), the DAL regressor, the last jigsaw.

    Calling it applies MJP in training mode (see :meth:`forward`); the models call it once per forward, so a
    ``torch.fx`` graph of an MJP model holds MJP as a single ``call_module`` node, whatever the tracer.

    Args:
        grid_size: the patch grid of the model's input size.
        dim: the token width D, or None for the pixel-space variant (no position embeddings to replace).
        dal: None (or ``"none"``) or a :class:`mjp_fast.DALRegressor` kind.
        patch_size: the jigsaw's patch size in pixels.
        unk: give the masked positions the learned unknown embedding ``unk_embed`` ``[D]`` (MJP). False: the
            patches of the masked positions are still permuted among themselves, but every position keeps its own
            ``pos_embed[n]`` (the paper's "naive shuffle" ablation row); no ``unk_embed`` parameter is created, so
            the state dict has no ``mjp.unk_embed`` key, and ``unk_embed`` is None. ``last_jigsaw`` keeps the
            sampled mask either way (the DAL loss leaves those positions out). Pixel-space models: no effect.
        dal_reduction: the DAL loss's reduction over the two coordinates (:func:`mjp_fast.dal_loss`): ``"mean"``
            (the paper's code) or ``"sum"`` (the paper's formula, twice the mean). Stored as ``dal_scale``, a plain
            attribute (not in the state dict).
        dal_weight: the weight at which a training forward attaches the DAL loss to the tokens (finite, >= 0;
            default 0.01, the paper's starting weight). Held in ``dal_weight``, a 0-d float32 buffer, not in the
            state dict; change it with :meth:`set_dal_weight` (a model's ``mjp_dal_weight``).
        The rest: as :class:`mjp_fast.JigsawSampler`.
    """

    # Class-level defaults: a model pickled before these attributes existed reads them from here.
    use_unk: bool = True
    dal_scale: float = DAL_REDUCTIONS["mean"]

    def __init__(
        self,
        grid_size: tuple[int, int],
        dim: int | None,
        *,
        ratio: float,
        prob: float,
        seed: int,
        dal: str | None,
        patch_size: int,
        min_block: int = 8,
        min_aspect: float = 0.3,
        shared: bool = False,
        backend: str | None = None,
        dal_normalize: bool = False,
        unk: bool = True,
        dal_reduction: str = "mean",
        dal_weight: float = DEFAULT_DAL_WEIGHT,
    ) -> None:
        super().__init__()
        dal = _dal_kind(dal)
        dal_weight = check_dal_weight("dal_weight", dal_weight)
        if dal is not None and dim is None:
            raise ValueError("dal needs a model with absolute position embeddings; pass dal=None for this model")
        self.dal_scale = _dal_reduction_scale(dal_reduction)
        self.use_unk = _check_unk(unk)
        self.sampler = JigsawSampler(
            grid_size, ratio, prob, seed, min_block=min_block, min_aspect=min_aspect, shared=shared, backend=backend
        )
        self.patch_size = check_int("patch_size", patch_size, minimum=1)
        self.dal_normalize = bool(dal_normalize)
        if dim is not None and unk:
            self.unk_embed = nn.Parameter(torch.empty(dim))
            nn.init.trunc_normal_(self.unk_embed, std=0.02)
        else:
            self.unk_embed = None
        if dim is not None and not unk:
            # The position kernels take a [D] row for the masked positions even when no mask bit is set (they load
            # it unconditionally): a zero row made once, moved and cast with the model, never saved.
            self.register_buffer("unused_unk_row", torch.zeros(dim), persistent=False)
        self.dal_regressor = DALRegressor(dim, dal) if dal is not None else None
        # The DAL loss of the last training forward (see _attach_dal); a plain dict, so that storing it costs no
        # nn.Module.__setattr__ per step. "loss": the loss; "unclaimed": (its table, the forward's jigsaw) until
        # mjp_aux_loss hands the loss out (claim_dal). Its keys never change: a compiled forward guards on them.
        self._dal_stash: dict[str, object] = {"loss": None, "unclaimed": None}
        self.last_jigsaw = None
        self._backends: dict[tuple[str | None, torch.device], str] = {}  # see backend_for
        # Read by the attached loss's backward, filled in place (compiled and captured graphs keep reading it).
        self.register_buffer("dal_weight", torch.tensor(dal_weight, dtype=torch.float32), persistent=False)
        # The DAL loss's targets, made once for the grid (not saved: they follow from it).
        self.coordinates_grid = tuple(self.sampler.grid_size)
        self.register_buffer(
            "dal_coordinates", grid_coordinates(grid_size, normalize=self.dal_normalize), persistent=False
        )

    def __getstate__(self) -> dict:
        """The state that copies and pickles take (``copy.deepcopy`` of a model mid-training, ``torch.save(model)``):
        without the kept DAL loss, which belongs to this model's last graph (and a tensor with a graph cannot be
        deep-copied)."""
        state = super().__getstate__()  # a copy of __dict__
        state["_dal_stash"] = {"loss": None, "unclaimed": None}
        return state

    @property
    def last_jigsaw(self) -> Jigsaw | None:
        """The jigsaw the last forward sampled (with or without unk: the DAL loss and evaluation read its mask), or
        None. A front end that skips this module sets it to None, which also forgets the DAL loss kept for
        ``mjp_aux_loss`` (that loss is not of the last forward any more)."""
        return self.__dict__.get("_last_jigsaw")

    @last_jigsaw.setter
    def last_jigsaw(self, jigsaw: Jigsaw | None) -> None:
        self.__dict__["_last_jigsaw"] = jigsaw
        stash = self.__dict__.get("_dal_stash")
        if stash is not None:
            stash["loss"] = stash["unclaimed"] = None

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
        backend: str | None = None,
        prefix: torch.Tensor | None = None,
        prefix_positions: int = 0,
        dal_table: torch.Tensor | None = None,
        dal_grid: tuple[int, int] | None = None,
        pixels_jigsawed: bool = False,
    ) -> torch.Tensor:
        """MJP on one batch: the jigsaw when the sampler is active (training, or inside ``mjp_eval``), else the plain
        step; in training with a DAL regressor and grad enabled, the DAL loss attached to the result.

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
            backend: the fused embedding's backend (as :func:`mjp_fast.mjp_patch_embed`).
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
            args = (x, pos_table, grid, weight, bias, backend, prefix, prefix_positions, dal_table, dal_grid)
            args += (pixels_jigsawed,)
            return tracer.create_proxy("call_module", tracer.path_of_module(self), args, {})
        if pos_table is None:
            if x.dim() != 3:
                return self._jigsaw_images(x)
            # Tokens without a position table (a RoPE-only Eva): the same step with a table of zeros, so the tokens
            # move and the shuffled ones get unk_embed, the one learned marker of an unknown position.
            pos_table = x.new_zeros((1, x.shape[1], x.shape[2]))
        sampler = self.sampler
        # The sampler's forward, not its __call__: a submodule of ours, with no hooks to run (a step's host time).
        if not sampler.active:
            sampled = jigsaw = None
        elif pixels_jigsawed:  # the images' jigsaw, sampled by this module's pixel step of the same forward
            sampled = self.last_jigsaw
            jigsaw = Jigsaw(sampled.mask, _identity_perm(sampled.perm))
        else:
            sampled = jigsaw = sampler.forward(x.shape[0], x.device, grid)
        self.last_jigsaw = sampled  # also forgets the last forward's DAL loss
        # The DAL loss rides on the tokens in training only; the regressor's forward is not needed otherwise.
        training = self.training and torch.is_grad_enabled()
        regressor = self.dal_regressor if training else None
        if dal_table is None:
            dal_table, dal_grid = pos_table, grid
        unk_embed = self.unk_embed
        if jigsaw is not None and not self.use_unk:
            # The naive shuffle: the same moves, but no position is "masked" for the position term, so each one
            # gets its own pos_embed[n] where the moved patch lands.
            jigsaw = Jigsaw(torch.zeros_like(jigsaw.mask), jigsaw.perm)
            unk_embed = self.unused_unk_row
        loss = None
        if weight is not None:
            # The jigsaw is applied where the patches are cut, the position terms in the GEMM's epilogue.
            unk_embed = unk_embed if jigsaw is not None else None
            out = _fused_patch_embed(x, weight, bias, pos_table, unk_embed, jigsaw, backend, prefix, prefix_positions)
        elif jigsaw is None:
            out = _plain_position_step(x, pos_table, prefix, prefix_positions)
        else:
            # P(XW) = (PX)W: moving the embedded tokens is moving the patches. One autograd node for the move, the
            # position terms and the prefix tokens; the arguments are the model's own and the sampler's jigsaws need
            # no validation.
            backend = self.backend_for(x.device, sampler)
            out = None
            if regressor is not None and backend == "cpu" and dal_table is pos_table:
                coords = self.dal_coordinates_for(dal_grid)
                if sampled.mask.shape[1] == coords.shape[0]:  # the mask is of the DAL table's grid
                    # The DAL loss of this step from the same operator and node.
                    stepped = mjp_position_dal_step(
                        x, pos_table, unk_embed, jigsaw, prefix, prefix_positions, regressor, coords, sampled.mask,
                        self.dal_scale,
                    )  # fmt: skip
                    if stepped is not None:
                        out, loss = stepped
            if out is None:
                out = mjp_position_step(x, pos_table, unk_embed, jigsaw, backend, prefix, prefix_positions)
        unk = self.unk_embed
        if jigsaw is None and unk is not None and training and unk.requires_grad:
            # The jigsaw is off, so nothing uses unk_embed: its gradient is zero, given through the output, so that
            # every parameter gets one from the output (DDP needs no find_unused_parameters).
            out = keep_in_graph(out, unk)
        if regressor is None:
            return out
        return self._attach_dal(out, loss, dal_table, dal_grid, sampled, prefix_positions)

    def dal_loss(
        self, table: torch.Tensor, grid: tuple[int, int] | None, jigsaw: Jigsaw | None, prefix_positions: int
    ) -> torch.Tensor:
        """The DAL loss (0-d float32) of ``table`` ``[1, Q + N, D]`` (its first ``prefix_positions`` rows skipped),
        whose positions form ``grid`` (None: the state's), over the positions ``jigsaw`` left unmasked (every one
        without a jigsaw, or when its mask is of another grid: an input of another size)."""
        coords = self.dal_coordinates_for(grid)
        mask = jigsaw.mask if jigsaw is not None else None
        if mask is not None and mask.shape[1] != coords.shape[0]:
            mask = None  # the input had another grid (dynamic size): regress every stored position
        # The whole table: its prefix rows are skipped by the kernels, so nothing is sliced here.
        backend = self.backend_for(coords.device)
        return dal_loss_unchecked(table, self.dal_regressor, coords, mask, backend, prefix_positions, self.dal_scale)

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
        ``dal_weight``; the loss is kept for ``mjp_aux_loss`` and ``last_dal_loss``."""
        if loss is None:
            loss = self.dal_loss(table, grid, sampled, prefix_positions)
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

    def dal_coordinates_for(self, grid: tuple[int, int] | None) -> torch.Tensor:
        """The DAL loss's targets float32 ``[N, 2]`` for ``grid`` (None: the state's own): the buffer for the grid
        the state was made for, else made once per grid (a model whose input size changed: ``set_input_size``)."""
        coords = self.dal_coordinates
        if grid is None or tuple(grid) == getattr(self, "coordinates_grid", None):
            return coords
        return _coordinates(int(grid[0]), int(grid[1]), self.dal_normalize, str(coords.device))

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

    def backend_for(self, device: torch.device, sampler: JigsawSampler | None = None) -> str:
        """The backend of the position step and the DAL loss on ``device``: the sampler's choice, resolved once per
        device (and again if ``sampler.backend`` changes), not every step."""
        key = ((sampler if sampler is not None else self.sampler).backend, device)
        if torch.compiler.is_compiling():  # traced once; storing would change state the graph's guards read
            return resolve_backend(*key)
        cache = getattr(self, "_backends", None)
        if cache is None:  # a model pickled before this cache existed
            cache = self._backends = {}
        if key not in cache:
            cache[key] = resolve_backend(*key)
        return cache[key]

    def _jigsaw_images(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sampler.active:
            return x
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"x: a pixel-space MJP model takes images [B, C, H, W], got {_describe(x)}")
        patch = self.patch_size
        if x.shape[-2] % patch or x.shape[-1] % patch:
            raise ValueError(
                f"images: height {x.shape[-2]} and width {x.shape[-1]} must be multiples of the jigsaw patch "
                f"size {patch}"
            )
        jigsaw = self.sampler(x.shape[0], x.device, (x.shape[-2] // patch, x.shape[-1] // patch))
        self.last_jigsaw = jigsaw
        return x if jigsaw is None else jigsaw_images(x, jigsaw, patch, validate=False)


def _identity_perm(perm: torch.Tensor) -> torch.Tensor:
    """``[B, N]`` int64: every token stays where it is (``perm``'s shape and device)."""
    return torch.arange(perm.shape[1], device=perm.device).expand(perm.shape[0], -1).contiguous()


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    return type(value).__name__
