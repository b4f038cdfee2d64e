"""MJP for timm: registered MJP models and ``convert()`` for existing ones, keeping their weights.

``import mjp_fast.timm`` registers ``mjp_deit_tiny_patch16_224``, ``mjp_deit_small_patch16_224``,
``mjp_deit_base_patch16_224``, ``mjp_vit_small_patch16_224`` and ``mjp_vit_base_patch16_224``::

    model = timm.create_model("mjp_deit_small_patch16_224", mjp_ratio=0.1, mjp_prob=0.5, mjp_dal="nonlinear")

A converted ViT jigsaws its patch tokens in training mode: the tokens of masked positions are permuted among
themselves and get the unknown position embedding ``mjp.unk_embed`` (with ``unk=False``, the position embedding of
where they land); the class and register tokens keep theirs.
Shuffling the tokens after timm's patch embedding equals shuffling the patches before it (the embedding is one
linear map, and its optional norm one per-token function, applied to each patch alone), so every timm variant
works: class token or not, register tokens, ``no_embed_class``, ``dynamic_img_size``, ``set_input_size``.
In eval mode the model is the plain timm model, unless inside ``model.mjp_eval(...)``.

Where the patch embedding is timm's standard one (a ``PatchEmbed`` whose ``proj`` is a Conv2d with stride equal
to its square kernel, no norm, flattened output, a fixed image size), the embedding, the jigsaw and the position
term run as one :func:`mjp_fast.mjp_patch_embed` call (``convert(..., fused_patch_embed=None)``, automatic): the
``patch_embed`` module then passes the images through and the model's ``_pos_embed`` embeds them, reading the
same ``patch_embed.proj`` weights. Outputs equal timm's Conv2d path within float tolerance (the GEMM sums in
another order), in training and in eval mode; under autocast the op runs in the autocast dtype, as timm's Conv2d
would, and returns the dtype of timm's sum. Under FX the fused call is one node: ``mjp`` when it jigsaws, else a
``_fused_patch_embed`` call (there is no ``patch_embed.proj`` node). :func:`fast_patch_embed` does the same for a
plain timm ViT.

Models without absolute position embeddings (timm ResNet, Swin, ConvNeXt) get the pixel-space jigsaw of their
input only, as the paper's ResNet-50 + MJP and Swin-T + MJP rows.

timm's conventions carry over: ``features_only=True`` (timm's feature wrappers around the MJP model),
``forward_intermediates``, FX tracing in eval and training mode (MJP is one ``call_module`` node of the graph),
and ``mjp_<base>`` shares its base's pretrained configs, so ``pretrained=True`` loads the base's weights.

All MJP state lives in ``model.mjp`` (``unk_embed``, the DAL regressor, the sampler and its counter), so a plain
timm state dict loads with ``strict=False`` (only ``mjp.*`` keys missing), and an MJP state dict loads back into
the plain model the same way (only ``mjp.*`` keys unexpected).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator

import timm
import torch
import torch.fx
from timm.layers import PatchEmbed, register_notrace_module, resample_abs_pos_embed
from timm.models import DefaultCfg, get_arch_pretrained_cfgs, register_model
from timm.models._features import FeatureDictNet, FeatureGetterNet
from timm.models.convnext import ConvNeXt
from timm.models.resnet import ResNet
from timm.models.swin_transformer import SwinTransformer
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from mjp_fast._validate import check_int
from mjp_fast.backend import KNOWN_BACKENDS, resolve_backend
from mjp_fast.nn import DAL_KINDS, DALRegressor
from mjp_fast.ops.dal_loss import DAL_REDUCTIONS, dal_loss_unchecked, dal_scale, grid_coordinates
from mjp_fast.ops.jigsaw_images import jigsaw_images
from mjp_fast.ops.patch_embed import patch_embed_step
from mjp_fast.ops.pos_embed import mjp_position_dal_step, mjp_position_step, prepend_prefix
from mjp_fast.sampler import JigsawSampler
from mjp_fast.sampler.jigsaw import Jigsaw

REGISTERED_BASES = (
    "deit_tiny_patch16_224",
    "deit_small_patch16_224",
    "deit_base_patch16_224",
    "vit_small_patch16_224",
    "vit_base_patch16_224",
)


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


def _autocast_like_conv(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    # Autocast casts the floating inputs of a convolution to its dtype, float64 aside.
    if tensor is None or not tensor.is_floating_point() or tensor.dtype == torch.float64:
        return tensor
    return tensor.to(dtype)


@torch.fx.wrap  # one call_function node under FX tracing (torch.fx and timm's create_feature_extractor)
def _fused_patch_embed(
    images: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    pos_table: torch.Tensor,
    unk_embed: torch.Tensor | None,
    jigsaw: Jigsaw | None,
    backend: str | None,
    prefix: torch.Tensor | None,
    prefix_positions: int,
) -> torch.Tensor:
    """timm's ``PatchEmbed``, the prefix tokens and the position add as one :func:`patch_embed_step`, in the dtypes
    timm computes them in.

    Args:
        images: ``[B, C, H, W]``; weight ``[D, C, P, P]`` and bias ``[D]`` (or None): ``patch_embed.proj``'s.
        pos_table: the model's ``pos_embed`` ``[1, Q + N, D]``, its first Q (``prefix_positions``) rows the prefix
            tokens'. prefix: the class and register tokens (numel ``P * D``), or None.
        unk_embed: ``[D]``, or None without a jigsaw. jigsaw: ``Jigsaw(mask [B, N], perm [B, N])`` or None.
        backend: as :func:`mjp_fast.mjp_patch_embed`.

    Returns:
        ``[B, P + N, D]``, in the dtype of timm's ``cat(prefix, proj(images)) + pos_embed``.
    """
    device_type = images.device.type
    chosen = resolve_backend(backend, images.device)
    if not torch.is_autocast_enabled(device_type):
        return patch_embed_step(images, weight, bias, pos_table, unk_embed, jigsaw, chosen, prefix, prefix_positions)
    # Under autocast timm's Conv2d runs in the autocast dtype and the add of the float32 table promotes its output:
    # the fused op gets what autocast gives the convolution, adds the float32 position terms in its epilogue and
    # writes the promoted dtype.
    dtype = torch.get_autocast_dtype(device_type)
    images, weight, bias = (_autocast_like_conv(tensor, dtype) for tensor in (images, weight, bias))
    with torch.autocast(device_type, enabled=False):  # the torch backend's conv: already in the right dtype
        return patch_embed_step(
            images, weight, bias, pos_table, unk_embed, jigsaw, chosen, prefix, prefix_positions,
            out_dtype=torch.promote_types(dtype, pos_table.dtype),
        )  # fmt: skip


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


# --- The fused patch embedding: timm's PatchEmbed + position add as one mjp_patch_embed call ----------------------


class _ImagesThroughPatchEmbed:
    """Mixed into a timm ``PatchEmbed`` (class swap) whose embedding the model's ``_pos_embed`` runs fused with
    the position term: ``forward`` checks the image size as timm's does and returns the images ``[B, C, H, W]``.

    timm's ``forward_features`` and ``forward_intermediates`` call ``_pos_embed`` right after ``patch_embed``, so
    they run unchanged. ``proj`` (and every parameter and state dict key) stays where it was.
    """

    fused_backend: str | None = None  # the backend of the fused op; None: automatic

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, _, height, width = x.shape
        torch._assert(height == self.img_size[0], f"Input height ({height}) doesn't match model ({self.img_size[0]}).")
        torch._assert(width == self.img_size[1], f"Input width ({width}) doesn't match model ({self.img_size[1]}).")
        return x


class FusedPatchEmbed(_ImagesThroughPatchEmbed, PatchEmbed):
    """timm's ``PatchEmbed`` whose embedding runs in the model's ``_pos_embed``, fused with the position add."""


_FUSED_EMBED_CLASSES: dict[type, type] = {PatchEmbed: FusedPatchEmbed}


def _is_fused(patch_embed: nn.Module) -> bool:
    return isinstance(patch_embed, _ImagesThroughPatchEmbed)


def _original_class(cls: type) -> type:
    """The class before this module's class swaps (MJP, fused): the first of ``cls``'s MRO not defined here."""
    return next(base for base in cls.__mro__ if base.__module__ != __name__)


def _unfusable_reason(model: nn.Module) -> str | None:
    """None when the model's patch embedding plus position add can run as one fused op, else why not.

    The fused op computes a square, non-overlapping Conv2d patch embedding of a fixed image size, flattened to
    ``[B, N, D]``, plus ``pos_embed``: timm's standard ``PatchEmbed`` of a ``VisionTransformer``.
    """
    if not isinstance(model, VisionTransformer):
        return f"the model is a {type(model).__name__}, not a timm VisionTransformer"
    if model.pos_embed is None:
        return "the model has no absolute position embeddings (pos_embed is None)"
    timm_class = _original_class(type(model))
    for name in ("_pos_embed", "forward_features", "forward_intermediates"):
        if getattr(timm_class, name) is not getattr(VisionTransformer, name):
            return f"{timm_class.__name__} overrides VisionTransformer.{name}, which the fused path relies on"
    if model.dynamic_img_size:
        return "the model has dynamic_img_size=True (the fused op needs a fixed image size)"
    embed = model.patch_embed
    embed_class = _original_class(type(embed))
    if not issubclass(embed_class, PatchEmbed):
        return f"patch_embed is a {embed_class.__name__}, not timm's PatchEmbed"
    if embed_class.forward is not PatchEmbed.forward:
        return f"patch_embed is a {embed_class.__name__}, which overrides PatchEmbed.forward"
    proj = embed.proj
    if not isinstance(proj, nn.Conv2d) or type(proj).forward is not nn.Conv2d.forward:
        return f"patch_embed.proj is a {type(proj).__name__}, not an nn.Conv2d"
    if proj.kernel_size[0] != proj.kernel_size[1]:
        return f"patch_embed.proj has a non-square kernel {tuple(proj.kernel_size)}"
    if tuple(proj.stride) != tuple(proj.kernel_size):
        return f"patch_embed.proj has stride {tuple(proj.stride)} != kernel size {tuple(proj.kernel_size)}"
    if proj.padding not in ("valid", (0, 0)) or tuple(proj.dilation) != (1, 1) or proj.groups != 1:
        return (
            f"patch_embed.proj has padding {proj.padding}, dilation {tuple(proj.dilation)}, groups {proj.groups} "
            "(the fused op needs 0, 1 and 1)"
        )
    if not isinstance(embed.norm, nn.Identity):
        return f"patch_embed has a norm layer ({type(embed.norm).__name__}) after its projection"
    if not embed.flatten:
        return f"patch_embed outputs {embed.output_fmt.value} feature maps, not flattened [B, N, D] tokens"
    if embed.img_size is None:
        return "patch_embed has no fixed img_size"
    if embed.dynamic_img_pad:
        return "patch_embed has dynamic_img_pad=True (the fused op needs a fixed image size)"
    if not embed.strict_img_size:
        return "patch_embed has strict_img_size=False (the fused op needs a fixed image size)"
    prefix_positions = 0 if model.no_embed_class else model.num_prefix_tokens
    if model.pos_embed.shape[1] - prefix_positions != embed.num_patches:
        return f"pos_embed has {model.pos_embed.shape[1]} positions, not {prefix_positions} + {embed.num_patches}"
    return None


def _check_backend(backend: str | None) -> str | None:
    if backend is not None and backend not in KNOWN_BACKENDS:
        raise ValueError(f"backend must be None or one of {', '.join(KNOWN_BACKENDS)}, got {backend!r}")
    return backend


def _fuse_patch_embed(patch_embed: nn.Module, backend: str | None) -> None:
    """Switches a standard ``PatchEmbed`` (checked by the caller) to pass the images through."""
    embed_class = _original_class(type(patch_embed))
    if embed_class not in _FUSED_EMBED_CLASSES:
        _FUSED_EMBED_CLASSES[embed_class] = type(
            f"Fused{embed_class.__name__}", (_ImagesThroughPatchEmbed, embed_class), {"__module__": __name__}
        )
    patch_embed.__class__ = _FUSED_EMBED_CLASSES[embed_class]
    patch_embed.fused_backend = backend


def _unfuse_patch_embed(patch_embed: nn.Module) -> None:
    if _is_fused(patch_embed):
        patch_embed.__class__ = _original_class(type(patch_embed))
        del patch_embed.fused_backend


def _prefix_tokens(model: VisionTransformer) -> torch.Tensor | None:
    """The class and register tokens as one ``[1, P, D]`` tensor (timm's ``cls_token`` itself when it is the only
    one: no copy), or None."""
    cls_token, reg_token = model.cls_token, model.reg_token
    if cls_token is None or reg_token is None:
        return cls_token if reg_token is None else reg_token
    return torch.cat((cls_token, reg_token), dim=1)


def _prefix_positions(model: VisionTransformer) -> int:
    """How many leading rows of ``pos_embed`` are the prefix tokens' (0 with ``no_embed_class``)."""
    return 0 if model.no_embed_class else model.num_prefix_tokens


def _plain_position_step(
    x: torch.Tensor, pos_table: torch.Tensor, prefix: torch.Tensor | None, prefix_positions: int
) -> torch.Tensor:
    """Without a jigsaw: timm's ``_pos_embed`` arithmetic. ``x`` ``[B, N, D]`` plus its rows of ``pos_table``
    ``[1, Q + N, D]``, after the prefix tokens plus theirs. Returns ``[B, P + N, D]``."""
    return prepend_prefix(x + pos_table[:, prefix_positions:], pos_table, prefix, prefix_positions)


def _fused_pos_embed(model: VisionTransformer, images: torch.Tensor, state: MJPState | None) -> torch.Tensor:
    """timm's ``patch_embed`` + ``_pos_embed`` of a fused model, from the images ``[B, C, H, W]``.

    With MJP (``state``) active, ``state`` embeds and jigsaws the images (one FX node); otherwise the plain
    embedding plus the position add, still one fused op. Returns ``[B, prefix + N, D]``.
    """
    embed = model.patch_embed
    proj = embed.proj
    prefix, prefix_positions = _prefix_tokens(model), _prefix_positions(model)
    if state is not None and state.sampler.active:
        grid = tuple(embed.grid_size)
        arguments = (proj.weight, proj.bias, embed.fused_backend, prefix, prefix_positions)
        return model.pos_drop(state(images, model.pos_embed, grid, *arguments))
    if state is not None:
        state.last_jigsaw = None
    arguments = (None, None, embed.fused_backend, prefix, prefix_positions)
    return model.pos_drop(_fused_patch_embed(images, proj.weight, proj.bias, model.pos_embed, *arguments))


class _FusedViTMixin:
    """A plain timm ``VisionTransformer`` whose patch embedding and position add run as one fused op (made by
    :func:`fast_patch_embed`); ``_pos_embed`` receives the images from the pass-through ``patch_embed``."""

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        if not _is_fused(self.patch_embed):
            return super()._pos_embed(x)
        return _fused_pos_embed(self, x, None)


class FusedVisionTransformer(_FusedViTMixin, VisionTransformer):
    """A timm ``VisionTransformer`` with its patch embedding and position add fused (see :func:`fast_patch_embed`)."""


_FUSED_MODEL_CLASSES: dict[type, type] = {VisionTransformer: FusedVisionTransformer}


def _fused_model_class(model_class: type) -> type:
    if model_class not in _FUSED_MODEL_CLASSES:
        _FUSED_MODEL_CLASSES[model_class] = type(
            f"Fused{model_class.__name__}", (_FusedViTMixin, model_class), {"__module__": __name__}
        )
    return _FUSED_MODEL_CLASSES[model_class]


class _MJPMixin:
    """Methods every converted model has."""

    mjp: MJPState

    @contextlib.contextmanager
    def mjp_eval(self, ratio: float = 0.5, seed: int = 0, prob: float = 1.0, start: int = 0) -> Iterator[nn.Module]:
        """Eval mode on jigsawed input (with the UNK embedding), the same jigsaws for the same seed.

        The paper's consistency protocol: compare ``model(x)`` in eval mode with the output inside this context.
        The model's training mode is restored on exit. ``start``: samples of the stream this rank drew before, for
        a pass that enters once per batch (see :meth:`mjp_fast.JigsawSampler.jigsaw_eval`).
        """
        was_training = self.training
        self.eval()
        try:
            with self.mjp.sampler.jigsaw_eval(ratio=ratio, seed=seed, prob=prob, start=start):
                yield self
        finally:
            self.train(was_training)

    def mjp_aux_loss(self) -> torch.Tensor:
        """The DAL loss of the last forward, unweighted (the training loop applies its weight); zero when DAL is
        off. No host sync."""
        raise NotImplementedError


class MJPVisionTransformer(_MJPMixin, VisionTransformer):
    """A timm ``VisionTransformer`` with MJP position embeddings (made by :func:`convert`)."""

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        state, patch_embed, pos_embed = self.mjp, self.patch_embed, self.pos_embed
        if _is_fused(patch_embed):  # x: the images, passed through by patch_embed
            return _fused_pos_embed(self, x, state)
        if pos_embed is None or not state.sampler.active:
            state.last_jigsaw = None
            return super()._pos_embed(x)
        grid = patch_embed.grid_size  # the model's (set_input_size may have changed it since the sampler was made)
        if self.dynamic_img_size:
            batch, rows, cols, dim = x.shape
            grid = (rows, cols)
            pos_embed = resample_abs_pos_embed(
                pos_embed, new_size=grid, old_size=patch_embed.grid_size, num_prefix_tokens=_prefix_positions(self)
            )
            x = x.reshape(batch, rows * cols, dim)
        # The whole table and the prefix tokens go in: the kernels write [B, P + N, D] at once (no slice, no cat).
        x = state(x, pos_embed, grid, prefix=_prefix_tokens(self), prefix_positions=_prefix_positions(self))
        return self.pos_drop(x)

    def mjp_aux_loss(self) -> torch.Tensor:
        state, pos_embed = self.mjp, self.pos_embed
        regressor = state.dal_regressor
        if regressor is None or pos_embed is None:
            anchor = pos_embed if pos_embed is not None else state.unk_embed
            return anchor.new_zeros((), dtype=torch.float32)
        stepped = state.dal_of_step(pos_embed)
        if stepped is not None:
            return stepped
        coords, jigsaw = state.dal_coordinates, state.last_jigsaw
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


class _MJPNoDALMixin(_MJPMixin):
    """MJP without position embeddings to regress: the DAL loss is always zero."""

    def mjp_aux_loss(self) -> torch.Tensor:
        reference = next(self.parameters())
        return reference.new_zeros((), dtype=torch.float32)


class _MJPPixelMixin(_MJPNoDALMixin):
    """Pixel-space MJP for models without absolute position embeddings: the input is jigsawed in training."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return super().forward(self.mjp(x), *args, **kwargs)


class _MJPPixelModelMixin(_MJPPixelMixin):
    """Pixel-space MJP for a timm model: ``forward_intermediates`` (what timm's ``FeatureGetterNet`` calls) jigsaws
    its input too. Neither entry calls the other in timm's models, so an input is jigsawed once."""

    def forward_intermediates(self, x: torch.Tensor, *args, **kwargs):
        return super().forward_intermediates(self.mjp(x), *args, **kwargs)


class MJPResNet(_MJPPixelModelMixin, ResNet):
    """A timm ``ResNet`` trained on jigsawed inputs (pixel-space MJP)."""


class MJPSwinTransformer(_MJPPixelModelMixin, SwinTransformer):
    """A timm ``SwinTransformer`` trained on jigsawed inputs (pixel-space MJP)."""


class MJPConvNeXt(_MJPPixelModelMixin, ConvNeXt):
    """A timm ``ConvNeXt`` trained on jigsawed inputs (pixel-space MJP)."""


class MJPPixelVisionTransformer(_MJPPixelModelMixin, VisionTransformer):
    """A timm ``VisionTransformer`` without absolute position embeddings, trained on jigsawed inputs."""


class _MJPFeatureGetterMixin(_MJPMixin):
    """timm's ``FeatureGetterNet`` (``features_only=True`` for ViTs) around an MJP model: the wrapped model's
    ``forward_intermediates`` applies MJP, and MJP's methods and state are the wrapped model's."""

    @property
    def mjp(self) -> MJPState:
        return self.model.mjp

    def mjp_aux_loss(self) -> torch.Tensor:
        return self.model.mjp_aux_loss()


class _MJPFeatureModulesMixin(_MJPNoDALMixin):
    """timm's ``FeatureListNet``/``FeatureDictNet`` (``features_only=True`` for CNNs and Swin). They are module
    dicts that run their entries in order, not the model's ``forward``: :func:`convert` puts ``mjp`` first, so
    the input is jigsawed (pixel-space MJP) before the first layer."""


# timm class -> its MJP class, for the pixel-space variant and the feature wrappers
_PIXEL_CLASSES = {
    ResNet: MJPResNet,
    SwinTransformer: MJPSwinTransformer,
    ConvNeXt: MJPConvNeXt,
    VisionTransformer: MJPPixelVisionTransformer,
}
_WRAPPER_MIXINS = {FeatureGetterNet: _MJPFeatureGetterMixin, FeatureDictNet: _MJPFeatureModulesMixin}
_SUBCLASSES: dict[tuple[type, type], type] = {}


def _mjp_class(model_class: type, timm_class: type | None, mjp_class: type) -> type:
    """The MJP class of ``model_class``: ``mjp_class`` for timm's own class, else a generated subclass of both
    (timm subclasses, and the feature wrappers, whose ``mjp_class`` is a mixin: ``timm_class`` None)."""
    if model_class is timm_class:
        return mjp_class
    key = (model_class, mjp_class)
    if key not in _SUBCLASSES:
        _SUBCLASSES[key] = type(f"MJP{model_class.__name__}", (mjp_class, model_class), {"__module__": __name__})
    return _SUBCLASSES[key]


def _grid(model: nn.Module, patch_size: int) -> tuple[int, int]:
    img_size = getattr(getattr(model, "pretrained_cfg", {}) or {}, "get", lambda *_: None)("input_size")
    if img_size is not None:
        return img_size[-2] // patch_size, img_size[-1] // patch_size
    return 224 // patch_size, 224 // patch_size


def _first(value: int | tuple[int, ...] | list[int]) -> int:
    return value[0] if isinstance(value, (tuple, list)) else value


def convert(
    model: nn.Module,
    ratio: float = 0.1,
    prob: float = 0.5,
    dal: str | None = "nonlinear",
    seed: int = 0,
    *,
    min_block: int = 8,
    min_aspect: float = 0.3,
    shared: bool = False,
    backend: str | None = None,
    patch_size: int | None = None,
    dal_normalize: bool = False,
    fused_patch_embed: bool | None = None,
    unk: bool = True,
    dal_reduction: str = "mean",
) -> nn.Module:
    """Turns a timm model into its MJP version in place, keeping its weights; returns it.

    Args:
        model: a timm ``VisionTransformer`` (any size; class token or not; register tokens; ``no_embed_class``),
            or a timm ``ResNet``, ``SwinTransformer`` or ``ConvNeXt`` (pixel-space jigsaw only), or timm's
            ``features_only`` wrapper of one of them (``FeatureGetterNet``: the wrapped model is converted;
            ``FeatureListNet``/``FeatureDictNet``: their input is jigsawed).
        ratio, prob, seed, min_block, min_aspect, shared, backend: as :class:`mjp_fast.JigsawSampler`.
        dal: the DAL regressor's kind (``"nonlinear"``, ``"linear"``, ``"pca"``), or None or ``"none"`` (timm's
            ``create_model`` drops None-valued keywords, so ``mjp_dal="none"`` is how to say it there). ViTs only.
        patch_size: the jigsaw's patch size for pixel-space models (default: the model's patch embedding's, else
            16); ViTs use their own.
        dal_normalize: regress coordinates scaled to [0, 1] instead of raw integers.
        unk: masked positions get the learned unknown embedding ``mjp.unk_embed`` (MJP, default). False: the
            patches of the masked positions are still permuted among themselves, but every position keeps its own
            ``pos_embed[n]`` (the paper's "naive shuffle" ablation); no ``mjp.unk_embed`` parameter is created (not in
            the state dict; ``model.mjp.unk_embed`` is None), and the DAL loss still leaves the masked positions
            out. Models without position embeddings: no effect.
        dal_reduction: ``"mean"`` (default, the paper's code: ``F.l1_loss``) or ``"sum"`` (the paper's formula,
            twice the mean) over the two coordinates in ``mjp_aux_loss()`` (see :func:`mjp_fast.dal_loss`).
        fused_patch_embed: run the ViT's patch embedding, jigsaw and position term as one
            :func:`mjp_fast.mjp_patch_embed` call (``backend`` chooses its backend). None: wherever the patch
            embedding is timm's standard one (``PatchEmbed``, a Conv2d with stride equal to its square kernel, no
            norm, flattened output, a fixed image size); True: that, or a ValueError saying why not; False: timm's
            own embedding, then the tokens are moved.

    Returns:
        The same model object, now an MJP model: ``mjp_aux_loss()``, ``mjp_eval(...)`` and ``model.mjp``.
        With MJP off (eval mode) its outputs are those of the original model (within float tolerance where the
        patch embedding is fused: the GEMM sums in another order).

    Raises:
        TypeError: not a supported model. ValueError: bad settings, a model converted already, or
        ``fused_patch_embed=True`` for a patch embedding the fused op cannot compute.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a timm model (nn.Module), got {type(model).__name__}")
    if isinstance(model, _MJPMixin):
        raise ValueError(f"model is already an MJP model ({type(model).__name__})")
    if fused_patch_embed is not None and not isinstance(fused_patch_embed, bool):
        raise TypeError(f"fused_patch_embed must be a bool or None, got {type(fused_patch_embed).__name__}")
    _check_backend(backend)
    dal = _dal_kind(dal)
    _check_unk(unk)
    _dal_reduction_scale(dal_reduction)  # checked before anything changes
    sampler_settings = dict(
        ratio=ratio, prob=prob, seed=seed, min_block=min_block, min_aspect=min_aspect, shared=shared, backend=backend
    )
    wrapper_class = next((base for base in _WRAPPER_MIXINS if isinstance(model, base)), None)
    if wrapper_class is FeatureGetterNet:
        convert(
            model.model,
            dal=dal,
            patch_size=patch_size,
            dal_normalize=dal_normalize,
            fused_patch_embed=fused_patch_embed,
            unk=unk,
            dal_reduction=dal_reduction,
            **sampler_settings,
        )
        model.__class__ = _mjp_class(type(model), None, _WRAPPER_MIXINS[wrapper_class])
        return model
    fuse = False
    if isinstance(model, VisionTransformer) and model.pos_embed is not None:
        grid, dim = tuple(model.patch_embed.grid_size), model.embed_dim
        patch_size = _first(model.patch_embed.patch_size)
        # A plain model fused by fast_patch_embed becomes the MJP version of its timm class.
        new_class = _mjp_class(_original_class(type(model)), VisionTransformer, MJPVisionTransformer)
        reason = _unfusable_reason(model) if fused_patch_embed is not False else None
        if fused_patch_embed and reason is not None:
            raise ValueError(f"fused_patch_embed=True: {reason}")
        fuse = fused_patch_embed is not False and reason is None
    else:
        if wrapper_class is not None:
            mjp_class, timm_class = _WRAPPER_MIXINS[wrapper_class], None
        else:
            timm_class = next((base for base in _PIXEL_CLASSES if isinstance(model, base)), None)
            if timm_class is None:
                supported = ", ".join(base.__name__ for base in (*_PIXEL_CLASSES, *_WRAPPER_MIXINS))
                raise TypeError(f"model: convert() supports timm {supported}; got {type(model).__name__}")
            mjp_class = _PIXEL_CLASSES[timm_class]
        if fused_patch_embed:
            raise ValueError(f"fused_patch_embed=True: {_unfusable_reason(model)}")
        if dal is not None:
            raise ValueError(f"dal={dal!r} needs absolute position embeddings, which {type(model).__name__} lacks")
        if patch_size is None:
            embed = getattr(model, "patch_embed", None)
            patch_size = _first(getattr(embed, "patch_size", 16) if embed is not None else 16)
        grid, dim = _grid(model, patch_size), None
        new_class = _mjp_class(type(model), timm_class, mjp_class)
    state = MJPState(
        grid,
        dim,
        dal=dal,
        patch_size=patch_size,
        dal_normalize=dal_normalize,
        unk=unk,
        dal_reduction=dal_reduction,
        **sampler_settings,
    )
    reference = next(model.parameters(), None)
    if reference is not None:
        state.to(device=reference.device)
        if state.unk_embed is not None:
            state.unk_embed.data = state.unk_embed.data.to(reference.dtype)
        if hasattr(state, "unused_unk_row"):
            state.unused_unk_row = state.unused_unk_row.to(reference.dtype)
    state.train(model.training)
    model.__class__ = new_class
    model.mjp = state
    if fuse:
        _fuse_patch_embed(model.patch_embed, backend)
    elif isinstance(model, VisionTransformer):
        _unfuse_patch_embed(model.patch_embed)
    if wrapper_class is not None:  # the wrapper runs its entries in order: the jigsaw goes first
        model._modules = dict(mjp=model._modules.pop("mjp"), **model._modules)
    return model


def fast_patch_embed(model: nn.Module, *, backend: str | None = None) -> nn.Module:
    """Runs a timm ViT's patch embedding and position add as one fused :func:`mjp_fast.mjp_patch_embed` call, in
    place; returns the model.

    Outputs equal timm's Conv2d path within float tolerance (the GEMM sums in another order; under autocast the
    op runs in the autocast dtype, as timm's Conv2d does, and returns the dtype of timm's sum). Parameters, state
    dict keys and checkpoints stay as they are: the op reads ``patch_embed.proj``'s weight and bias. On an MJP
    model (:func:`convert`) it turns the fused path on, jigsaw included. Calling it again changes nothing (but
    the backend).

    Args:
        model: a timm ``VisionTransformer`` with absolute position embeddings and timm's standard patch
            embedding (``PatchEmbed``; a Conv2d with stride equal to its square kernel; no norm; flattened output;
            a fixed image size: no ``dynamic_img_size``, ``dynamic_img_pad`` or ``strict_img_size=False``), an MJP
            version of one, or timm's ``features_only`` wrapper (``FeatureGetterNet``) of one.
        backend: the fused op's backend (as :func:`mjp_fast.mjp_patch_embed`); default automatic, or an MJP
            model's own (``convert``'s ``backend``).

    Raises:
        TypeError: not a timm VisionTransformer. ValueError: a patch embedding the fused op cannot compute (the
        message says why), or an unknown backend.
    """
    target = model.model if isinstance(model, FeatureGetterNet) else model
    if not isinstance(target, VisionTransformer):
        raise TypeError(f"model must be a timm VisionTransformer (or its FeatureGetterNet), got {type(model).__name__}")
    reason = _unfusable_reason(target)
    if reason is not None:
        raise ValueError(f"model: its patch embedding cannot be fused: {reason}")
    _check_backend(backend)
    if isinstance(target, _MJPMixin):
        backend = backend if backend is not None else target.mjp.sampler.backend
    elif not isinstance(target, _FusedViTMixin):
        target.__class__ = _fused_model_class(type(target))
    _fuse_patch_embed(target.patch_embed, backend)
    return model


def _has_position_embeddings(model: nn.Module) -> bool:
    """Whether ``model`` (or the model in timm's ``FeatureGetterNet``) is a ViT with absolute position embeddings."""
    inner = model.model if isinstance(model, FeatureGetterNet) else model
    return isinstance(inner, VisionTransformer) and inner.pos_embed is not None


def _make_entrypoint(base: str):
    name = f"mjp_{base}"

    def entrypoint(
        pretrained: bool = False,
        mjp_ratio: float = 0.1,
        mjp_prob: float = 0.5,
        mjp_dal: str | None = None,
        mjp_seed: int = 0,
        mjp_fused_patch_embed: bool | None = None,
        mjp_unk: bool = True,
        mjp_dal_reduction: str = "mean",
        **kwargs,
    ) -> nn.Module:
        # The base's own entry point builds the model (and, with features_only, timm's feature wrapper around it)
        # and loads the pretrained weights named by pretrained_cfg/pretrained_cfg_overlay: this name shares the
        # base's pretrained configs. Then MJP's own parameters are added, freshly initialized.
        model = timm.create_model(base, pretrained=pretrained, **kwargs)
        if mjp_dal is None:  # not given (timm drops None-valued keywords, so "none" is how to turn DAL off)
            mjp_dal = "nonlinear" if _has_position_embeddings(model) else "none"
        model = convert(
            model,
            ratio=mjp_ratio,
            prob=mjp_prob,
            dal=mjp_dal,
            seed=mjp_seed,
            fused_patch_embed=mjp_fused_patch_embed,
            unk=mjp_unk,
            dal_reduction=mjp_dal_reduction,
        )
        config = getattr(model, "pretrained_cfg", None)
        if isinstance(config, dict):
            # Name the architecture that was built, as timm does for its own models.
            model.pretrained_cfg = model.default_cfg = {**config, "architecture": name}
        return model

    entrypoint.__name__ = entrypoint.__qualname__ = name
    entrypoint.__module__ = __name__
    entrypoint.__doc__ = (
        f"timm's {base} with MJP (see mjp_fast.timm.convert). mjp_dal: 'nonlinear', 'linear', 'pca' or 'none'; "
        "by default the paper's nonlinear DAL where the model has absolute position embeddings, else none. "
        "mjp_fused_patch_embed: as convert's fused_patch_embed (default: fused where the patch embedding is standard). "
        "mjp_unk, mjp_dal_reduction: as convert's unk (False: shuffled patches keep the position embeddings of where "
        "they land; no mjp.unk_embed) and dal_reduction ('mean' or 'sum')."
    )
    return entrypoint


# What timm's register_model reads to list mjp_<base> with the base's pretrained tags (timm.list_pretrained).
default_cfgs: dict[str, DefaultCfg] = {}


def register(base: str) -> str:
    """Registers ``mjp_<base>`` with timm for any timm model ``base``; returns that name.

    ``timm.create_model("mjp_<base>", mjp_ratio=..., mjp_prob=..., mjp_dal=..., mjp_seed=..., mjp_unk=...,
    mjp_dal_reduction=..., mjp_fused_patch_embed=..., **timm_kwargs)`` then builds ``base`` (``pretrained``,
    ``pretrained_cfg_overlay``, ``features_only`` and the other keywords go to timm) and converts it with
    :func:`convert`. ``mjp_<base>`` carries the base's pretrained configs (its tags in ``timm.list_pretrained``), so
    ``pretrained=True`` loads the base's weights; MJP's own parameters start fresh.
    Registering a name twice is a no-op.

    Raises:
        ValueError: ``base`` is not a timm model name.
    """
    if not isinstance(base, str):
        raise TypeError(f"base must be a timm model name (str), got {type(base).__name__}")
    name = f"mjp_{base}"
    if timm.is_model(name):
        return name
    if not timm.is_model(base):
        raise ValueError(f"base must be a timm model name, got {base!r} (timm.list_models() lists them)")
    base_cfgs = get_arch_pretrained_cfgs(base)  # "base.tag" -> PretrainedCfg, the default tag first
    if base_cfgs:
        tags = [key.partition(".")[2] for key in base_cfgs]
        default_cfgs[name] = DefaultCfg(tags=deque(tags), cfgs=dict(zip(tags, base_cfgs.values())))
    entrypoint = _make_entrypoint(base)
    globals()[entrypoint.__name__] = register_model(entrypoint)
    return name


for _base in REGISTERED_BASES:
    register(_base)
