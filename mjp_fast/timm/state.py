"""``MJPState``: what MJP adds to a timm model (sampler, ``unk_embed``, DAL regressor), and the step that applies it.

Every front end (the ViT, Eva and pixel-space models of this package) holds one ``MJPState`` as ``model.mjp`` and
calls it once per forward, so an FX graph of an MJP model holds MJP as one ``call_module`` node.
"""

from __future__ import annotations

import torch
import torch.fx
from timm.layers import register_notrace_module
from torch import nn

from mjp_fast._validate import check_int
from mjp_fast.backend import KNOWN_BACKENDS, resolve_backend
from mjp_fast.nn import DAL_KINDS, DALRegressor
from mjp_fast.ops.dal_loss import DAL_REDUCTIONS, dal_scale, grid_coordinates
from mjp_fast.ops.jigsaw_images import jigsaw_images
from mjp_fast.ops.pos_embed import mjp_position_dal_step, mjp_position_step
from mjp_fast.sampler import JigsawSampler
from mjp_fast.sampler.jigsaw import Jigsaw
from mjp_fast.timm.fused import _fused_patch_embed, _plain_position_step


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
    ) -> None:
        super().__init__()
        dal = _dal_kind(dal)
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
        self.last_jigsaw: Jigsaw | None = None
        self._backends: dict[tuple[str | None, torch.device], str] = {}  # see backend_for
        # The DAL loss computed by the last training forward with its position step (see dal_of_step); a plain dict,
        # so that storing it costs no nn.Module.__setattr__ per step.
        self._dal_stash: dict[str, tuple[torch.Tensor, torch.Tensor, Jigsaw]] = {}
        # The DAL loss's targets, made once (not saved: they follow from the grid).
        self.register_buffer(
            "dal_coordinates", grid_coordinates(grid_size, normalize=self.dal_normalize), persistent=False
        )

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
    ) -> torch.Tensor:
        """MJP on one batch, when the sampler is active (training, or inside ``mjp_eval``); else the plain input.

        Args:
            x: with ``pos_table``, the patch tokens ``[B, N, D]`` of a ViT (``N = grid[0] * grid[1]``), or its
                images ``[B, C, H, W]`` when ``weight`` is given; without ``pos_table``, the images
                ``[B, C, H, W]`` of a pixel-space model (H and W multiples of ``patch_size``).
            pos_table: the model's position table ``[1, Q + N, D]``: the first Q (``prefix_positions``) rows are the
                prefix tokens', the others the patch positions'.
            grid: the patch grid of ``x`` (default: the sampler's).
            weight, bias: the patch projection (timm's ``patch_embed.proj``: Conv2d weight ``[D, C, P, P]``, bias
                ``[D]`` or None) when ``x`` is images to embed, jigsaw and position in one fused op.
            backend: the fused embedding's backend (as :func:`mjp_fast.mjp_patch_embed`).
            prefix: the class and register tokens to put in front (numel ``P * D``; timm's ``cls_token``), or None;
                ``prefix_positions`` is 0 or P.

        Returns:
            ViT: ``[B, P + N, D]``: the prefix tokens plus their position rows, then the jigsawed patch tokens plus
            their position terms (with ``weight``: the embedded, jigsawed images).
            Pixel-space: the jigsawed images ``[B, C, H, W]`` (``x`` itself when inactive).
        """
        if isinstance(x, torch.fx.Proxy):
            # Symbolic tracing (torch.fx): the sampler's Python cannot run on proxies, so this call becomes one node
            # that runs the module itself when the graph runs, as a leaf module would.
            tracer = x.tracer
            args = (x, pos_table, grid, weight, bias, backend, prefix, prefix_positions)
            return tracer.create_proxy("call_module", tracer.path_of_module(self), args, {})
        if pos_table is None:
            return self._jigsaw_images(x)
        sampler = self.sampler
        # The sampler's forward, not its __call__: a submodule of ours, with no hooks to run (a step's host time).
        sampled = jigsaw = sampler.forward(x.shape[0], x.device, grid) if sampler.active else None
        self.last_jigsaw = sampled  # the sampled mask, with or without unk: the DAL loss and evaluation read it
        unk_embed = self.unk_embed
        if jigsaw is not None and not self.use_unk:
            # The naive shuffle: the same moves, but no position is "masked" for the position term, so each one
            # gets its own pos_embed[n] where the moved patch lands.
            jigsaw = Jigsaw(torch.zeros_like(jigsaw.mask), jigsaw.perm)
            unk_embed = self.unused_unk_row
        if weight is not None:
            # The jigsaw is applied where the patches are cut, the position terms in the GEMM's epilogue.
            unk_embed = unk_embed if jigsaw is not None else None
            return _fused_patch_embed(x, weight, bias, pos_table, unk_embed, jigsaw, backend, prefix, prefix_positions)
        if jigsaw is None:
            return _plain_position_step(x, pos_table, prefix, prefix_positions)
        # P(XW) = (PX)W: moving the embedded tokens is moving the patches. One autograd node for the move, the
        # position terms and the prefix tokens; the arguments are the model's own and the sampler's jigsaws need
        # no validation.
        backend = self.backend_for(x.device, sampler)
        regressor, stash = self.dal_regressor, self.__dict__.get("_dal_stash")
        if regressor is not None and backend == "cpu" and stash is not None and torch.is_grad_enabled():
            coords = self.dal_coordinates
            if sampled.mask.shape[1] == coords.shape[0]:  # not another grid (dynamic size: DAL takes the stored one)
                # The DAL loss of this step from the same operator and node (mjp_aux_loss hands it out).
                stepped = mjp_position_dal_step(
                    x, pos_table, unk_embed, jigsaw, prefix, prefix_positions, regressor, coords, sampled.mask,
                    self.dal_scale,
                )  # fmt: skip
                if stepped is not None:
                    stash["step"] = (stepped[1], pos_table, sampled)
                    return stepped[0]
        return mjp_position_step(x, pos_table, unk_embed, jigsaw, backend, prefix, prefix_positions)

    def dal_of_step(self, pos_table: torch.Tensor) -> torch.Tensor | None:
        """The DAL loss the last forward computed with its position step (one operator for both, on the ``cpu``
        backend), if it was of ``pos_table`` and of the last jigsaw; else None (compute it). Handed out once."""
        stash = self.__dict__.get("_dal_stash")
        stepped = stash.pop("step", None) if stash is not None else None
        if stepped is None or stepped[1] is not pos_table or stepped[2] is not self.last_jigsaw:
            return None
        return stepped[0]

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


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    return type(value).__name__
