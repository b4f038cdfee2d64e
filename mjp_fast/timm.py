"""MJP for timm: registered MJP models and ``convert()`` for existing ones, keeping their weights.

``import mjp_fast.timm`` registers ``mjp_deit_tiny_patch16_224``, ``mjp_deit_small_patch16_224``,
``mjp_deit_base_patch16_224``, ``mjp_vit_small_patch16_224`` and ``mjp_vit_base_patch16_224``::

    model = timm.create_model("mjp_deit_small_patch16_224", mjp_ratio=0.1, mjp_prob=0.5, mjp_dal="nonlinear")

A converted ViT jigsaws its patch tokens in training mode: the tokens of masked positions are permuted among
themselves and get the unknown position embedding ``mjp.unk_embed``; the class and register tokens keep theirs.
Shuffling the tokens after timm's patch embedding equals shuffling the patches before it (the embedding is one
linear map, and its optional norm one per-token function, applied to each patch alone), so every timm variant
works: class token or not, register tokens, ``no_embed_class``, ``dynamic_img_size``, ``set_input_size``.
In eval mode the model is the plain timm model, unless inside ``model.mjp_eval(...)``.

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
from timm.layers import register_notrace_module, resample_abs_pos_embed
from timm.models import DefaultCfg, get_arch_pretrained_cfgs, register_model
from timm.models._features import FeatureDictNet, FeatureGetterNet
from timm.models.convnext import ConvNeXt
from timm.models.resnet import ResNet
from timm.models.swin_transformer import SwinTransformer
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from mjp_fast._validate import check_int
from mjp_fast.nn import DAL_KINDS, DALRegressor
from mjp_fast.ops.dal_loss import dal_loss
from mjp_fast.ops.jigsaw_images import jigsaw_images
from mjp_fast.ops.pos_embed import mjp_pos_embed
from mjp_fast.ops.sample_jigsaw import Jigsaw
from mjp_fast.sampler import JigsawSampler

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
        The rest: as :class:`mjp_fast.JigsawSampler`.
    """

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
    ) -> None:
        super().__init__()
        dal = _dal_kind(dal)
        if dal is not None and dim is None:
            raise ValueError("dal needs a model with absolute position embeddings; pass dal=None for this model")
        self.sampler = JigsawSampler(
            grid_size, ratio, prob, seed, min_block=min_block, min_aspect=min_aspect, shared=shared, backend=backend
        )
        self.patch_size = check_int("patch_size", patch_size, minimum=1)
        self.dal_normalize = bool(dal_normalize)
        if dim is not None:
            self.unk_embed = nn.Parameter(torch.empty(dim))
            nn.init.trunc_normal_(self.unk_embed, std=0.02)
        else:
            self.unk_embed = None
        self.dal_regressor = DALRegressor(dim, dal) if dal is not None else None
        self.last_jigsaw: Jigsaw | None = None

    def forward(
        self, x: torch.Tensor, patch_pos: torch.Tensor | None = None, grid: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """MJP on one batch, when the sampler is active (training, or inside ``mjp_eval``); else the plain input.

        Args:
            x: with ``patch_pos``, the patch tokens ``[B, N, D]`` of a ViT (``N = grid[0] * grid[1]``); without,
                the images ``[B, C, H, W]`` of a pixel-space model (H and W multiples of ``patch_size``).
            patch_pos: the patch positions' embeddings ``[1, N, D]`` (no prefix tokens), or None.
            grid: the patch grid of ``x`` (default: the sampler's).

        Returns:
            ViT: the jigsawed tokens plus their position term ``[B, N, D]`` (``x + patch_pos`` when inactive).
            Pixel-space: the jigsawed images ``[B, C, H, W]`` (``x`` itself when inactive).
        """
        if isinstance(x, torch.fx.Proxy):
            # Symbolic tracing (torch.fx): the sampler's Python cannot run on proxies, so this call becomes one node
            # that runs the module itself when the graph runs, as a leaf module would.
            tracer = x.tracer
            return tracer.create_proxy("call_module", tracer.path_of_module(self), (x, patch_pos, grid), {})
        sampler = self.sampler
        self.last_jigsaw = None
        if patch_pos is None:
            return self._jigsaw_images(x)
        if not sampler.active:
            return x + patch_pos
        jigsaw = sampler(x.shape[0], x.device, grid)
        self.last_jigsaw = jigsaw
        if jigsaw is None:
            return x + patch_pos
        # P(XW) = (PX)W: moving the embedded tokens is moving the patches. One autograd node for the move and the
        # position term (the sampler's jigsaws need no validation).
        return mjp_pos_embed(x, patch_pos, self.unk_embed, jigsaw, backend=sampler.backend, validate=False)

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
        state = self.mjp
        if self.pos_embed is None or not state.sampler.active:
            state.last_jigsaw = None
            return super()._pos_embed(x)
        if self.dynamic_img_size:
            batch, rows, cols, dim = x.shape
            grid = (rows, cols)
            pos_embed = resample_abs_pos_embed(
                self.pos_embed,
                new_size=grid,
                old_size=self.patch_embed.grid_size,
                num_prefix_tokens=0 if self.no_embed_class else self.num_prefix_tokens,
            )
            x = x.reshape(batch, rows * cols, dim)
        else:
            grid = tuple(self.patch_embed.grid_size)
            pos_embed = self.pos_embed
        prefix_positions = 0 if self.no_embed_class else self.num_prefix_tokens
        x = state(x, pos_embed[:, prefix_positions:], grid)
        prefix = []
        if self.cls_token is not None:
            prefix.append(self.cls_token.expand(x.shape[0], -1, -1))
        if self.reg_token is not None:
            prefix.append(self.reg_token.expand(x.shape[0], -1, -1))
        if prefix:
            prefix_tokens = torch.cat(prefix, dim=1)
            if prefix_positions:
                prefix_tokens = prefix_tokens + pos_embed[:, :prefix_positions]
            x = torch.cat((prefix_tokens, x), dim=1)
        return self.pos_drop(x)

    def mjp_aux_loss(self) -> torch.Tensor:
        state = self.mjp
        if state.dal_regressor is None or self.pos_embed is None:
            anchor = self.pos_embed if self.pos_embed is not None else state.unk_embed
            return anchor.new_zeros((), dtype=torch.float32)
        prefix_positions = 0 if self.no_embed_class else self.num_prefix_tokens
        patch_pos = self.pos_embed[:, prefix_positions:]
        grid = tuple(self.patch_embed.grid_size)
        mask = state.last_jigsaw.mask if state.last_jigsaw is not None else None
        if mask is not None and mask.shape[1] != patch_pos.shape[1]:
            mask = None  # the last input had another grid (dynamic size): regress every stored position
        return dal_loss(patch_pos, state.dal_regressor, grid, mask, normalize=state.dal_normalize)

    def no_weight_decay(self) -> set[str]:
        return set(super().no_weight_decay()) | {"mjp.unk_embed"}


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

    Returns:
        The same model object, now an MJP model: ``mjp_aux_loss()``, ``mjp_eval(...)`` and ``model.mjp``.
        With MJP off (eval mode) its outputs are those of the original model.

    Raises:
        TypeError: not a supported model. ValueError: bad settings, or a model converted already.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a timm model (nn.Module), got {type(model).__name__}")
    if isinstance(model, _MJPMixin):
        raise ValueError(f"model is already an MJP model ({type(model).__name__})")
    dal = _dal_kind(dal)
    sampler_settings = dict(
        ratio=ratio, prob=prob, seed=seed, min_block=min_block, min_aspect=min_aspect, shared=shared, backend=backend
    )
    wrapper_class = next((base for base in _WRAPPER_MIXINS if isinstance(model, base)), None)
    if wrapper_class is FeatureGetterNet:
        convert(model.model, dal=dal, patch_size=patch_size, dal_normalize=dal_normalize, **sampler_settings)
        model.__class__ = _mjp_class(type(model), None, _WRAPPER_MIXINS[wrapper_class])
        return model
    if isinstance(model, VisionTransformer) and model.pos_embed is not None:
        grid, dim = tuple(model.patch_embed.grid_size), model.embed_dim
        patch_size = _first(model.patch_embed.patch_size)
        new_class = _mjp_class(type(model), VisionTransformer, MJPVisionTransformer)
    else:
        if wrapper_class is not None:
            mjp_class, timm_class = _WRAPPER_MIXINS[wrapper_class], None
        else:
            timm_class = next((base for base in _PIXEL_CLASSES if isinstance(model, base)), None)
            if timm_class is None:
                supported = ", ".join(base.__name__ for base in (*_PIXEL_CLASSES, *_WRAPPER_MIXINS))
                raise TypeError(f"model: convert() supports timm {supported}; got {type(model).__name__}")
            mjp_class = _PIXEL_CLASSES[timm_class]
        if dal is not None:
            raise ValueError(f"dal={dal!r} needs absolute position embeddings, which {type(model).__name__} lacks")
        if patch_size is None:
            embed = getattr(model, "patch_embed", None)
            patch_size = _first(getattr(embed, "patch_size", 16) if embed is not None else 16)
        grid, dim = _grid(model, patch_size), None
        new_class = _mjp_class(type(model), timm_class, mjp_class)
    state = MJPState(grid, dim, dal=dal, patch_size=patch_size, dal_normalize=dal_normalize, **sampler_settings)
    reference = next(model.parameters(), None)
    if reference is not None:
        state.to(device=reference.device)
        if state.unk_embed is not None:
            state.unk_embed.data = state.unk_embed.data.to(reference.dtype)
    state.train(model.training)
    model.__class__ = new_class
    model.mjp = state
    if wrapper_class is not None:  # the wrapper runs its entries in order: the jigsaw goes first
        model._modules = dict(mjp=model._modules.pop("mjp"), **model._modules)
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
        **kwargs,
    ) -> nn.Module:
        # The base's own entry point builds the model (and, with features_only, timm's feature wrapper around it)
        # and loads the pretrained weights named by pretrained_cfg/pretrained_cfg_overlay: this name shares the
        # base's pretrained configs. Then MJP's own parameters are added, freshly initialized.
        model = timm.create_model(base, pretrained=pretrained, **kwargs)
        if mjp_dal is None:  # not given (timm drops None-valued keywords, so "none" is how to turn DAL off)
            mjp_dal = "nonlinear" if _has_position_embeddings(model) else "none"
        model = convert(model, ratio=mjp_ratio, prob=mjp_prob, dal=mjp_dal, seed=mjp_seed)
        config = getattr(model, "pretrained_cfg", None)
        if isinstance(config, dict):
            # Name the architecture that was built, as timm does for its own models.
            model.pretrained_cfg = model.default_cfg = {**config, "architecture": name}
        return model

    entrypoint.__name__ = entrypoint.__qualname__ = name
    entrypoint.__module__ = __name__
    entrypoint.__doc__ = (
        f"timm's {base} with MJP (see mjp_fast.timm.convert). mjp_dal: 'nonlinear', 'linear', 'pca' or 'none'; "
        "by default the paper's nonlinear DAL where the model has absolute position embeddings, else none."
    )
    return entrypoint


# What timm's register_model reads to list mjp_<base> with the base's pretrained tags (timm.list_pretrained).
default_cfgs: dict[str, DefaultCfg] = {}


def register(base: str) -> str:
    """Registers ``mjp_<base>`` with timm for any timm model ``base``; returns that name.

    ``timm.create_model("mjp_<base>", mjp_ratio=..., mjp_prob=..., mjp_dal=..., mjp_seed=..., **timm_kwargs)``
    then builds ``base`` (``pretrained``, ``pretrained_cfg_overlay``, ``features_only`` and the other keywords go
    to timm) and converts it with :func:`convert`. ``mjp_<base>`` carries the base's pretrained configs (its tags
    in ``timm.list_pretrained``), so ``pretrained=True`` loads the base's weights; MJP's own parameters start fresh.
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
