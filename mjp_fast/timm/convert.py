"""``convert()`` and ``fast_patch_embed()``: a timm model made an MJP model (or given the fused embedding) in
place, keeping its weights."""

from __future__ import annotations

import warnings
from typing import NamedTuple

from timm.models._features import FeatureGetterNet, FeatureHookNet
from timm.models.eva import Eva
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from mjp_fast.core import check_backend, check_dal_kind, check_dal_reduction, check_unk
from mjp_fast.timm import (
    crossvit,
    gemma4_vit,
    hiera,
    hieradet,
    inline_table,
    naflexvit,
    nest,
    pit,
    qwen3_vit,
    samvit,
    tnt,
    visformer,
    volo,
)
from mjp_fast.timm.base import MJPModel, mjp_class_of
from mjp_fast.timm.eva import FusedEvaMixin, MJPEva, eva_layout
from mjp_fast.timm.features import WRAPPER_MIXINS, MJPFeatureHookBodyMixin
from mjp_fast.timm.front_end import TokenFrontEnd
from mjp_fast.timm.fused import (
    FusedViTMixin,
    fuse_patch_embed,
    fused_model_class,
    is_fused,
    original_class,
    unfusable_reason,
    unfuse_patch_embed,
)
from mjp_fast.timm.pixel import (
    PIXEL_CLASSES,
    absolute_position_tables,
    first_downsampling_stride,
    first_stage_stride,
    legacy_patch_size,
    model_input_size,
    pixel_class,
    wraps_a_legacy_class,
)
from mjp_fast.timm.schedule import DEFAULT_DAL_WEIGHT, check_dal_weight
from mjp_fast.timm.state import MJPState
from mjp_fast.timm.vit import MJPVisionTransformer, hybrid_pixel_block, jigsaw_pixels_before

TOKEN_FRONT_ENDS: tuple[TokenFrontEnd, ...] = (
    inline_table.FRONT_END,
    hiera.FRONT_END,
    pit.FRONT_END,
    tnt.FRONT_END,
    naflexvit.FRONT_END,
    crossvit.FRONT_END,
    hieradet.FRONT_END,
    gemma4_vit.FRONT_END,
    qwen3_vit.FRONT_END,
    nest.FRONT_END,
    visformer.FRONT_END,
    volo.FRONT_END,
    samvit.FRONT_END,
)
"""The token-path front ends of the families whose table is added outside the ViT's ``_pos_embed`` hook, each in
its own module (see :mod:`mjp_fast.timm.front_end`), tried in order before the ViT and Eva front ends."""


def _token_front_end(model: nn.Module) -> TokenFrontEnd | None:
    return next((front_end for front_end in TOKEN_FRONT_ENDS if front_end.covers(model)), None)


def runs_fused(model: nn.Module) -> bool:
    """Whether a converted model runs its patch embedding fused with its position term."""
    front_end = _token_front_end(model)
    if front_end is not None:
        return front_end.runs_fused(model)
    return hasattr(model, "patch_embed") and is_fused(model.patch_embed)


def _grid(model: nn.Module, patch_size: int) -> tuple[int, int]:
    """The initial token grid of a pixel-space model at ``patch_size`` (an int >= 1, checked by convert): its
    pretrained config's input size (else 224) in patches, at least 1x1 (the sampler follows the grid of the images
    it gets, which may be larger than the config's)."""
    img_size = getattr(getattr(model, "pretrained_cfg", {}) or {}, "get", lambda *_: None)("input_size")
    height, width = (img_size[-2], img_size[-1]) if img_size is not None else (224, 224)
    return max(1, height // patch_size), max(1, width // patch_size)


def _model_name(model: nn.Module) -> str:
    """timm's architecture name of ``model`` where its pretrained config has one, else its class name."""
    config = getattr(model, "pretrained_cfg", None)
    architecture = config.get("architecture") if isinstance(config, dict) else None
    return f"{architecture} ({type(model).__name__})" if architecture else type(model).__name__


def _without_dal(model: nn.Module, dal: str | None, asked: bool, what_mjp_does: str) -> None:
    """No DAL for a model without an absolute position table; DAL that was asked for (``asked``: not ``"auto"``)
    gets one warning line naming the model. Returns None, the DAL kind of such a model."""
    if dal is not None and asked:
        warnings.warn(
            f"model: {_model_name(model)} has no absolute position table: {what_mjp_does}, and dal={dal!r} is "
            "ignored (no table to regress)",
            stacklevel=4,  # the caller of convert (convert -> _front_end -> here)
        )
    return None


def _first(value: int | tuple[int, ...] | list[int]) -> int:
    return value[0] if isinstance(value, (tuple, list)) else value


def convert(
    model: nn.Module,
    ratio: float = 0.1,
    prob: float = 0.5,
    dal: str | None = "auto",
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
    dal_weight: float = DEFAULT_DAL_WEIGHT,
    pixel_jigsaw: bool = False,
) -> nn.Module:
    """Turns a timm model into its MJP version in place, keeping its weights; returns it.

    Args:
        model: a timm image model. MJP's token path (the unknown embedding on the table, DAL) for a
            ``VisionTransformer`` (a distilled DeiT; a hybrid with a CNN stem: its images are jigsawed), an ``Eva``
            and each family of ``TOKEN_FRONT_ENDS`` (CaiT, ConViT, Hiera, PiT, TNT, CrossViT, NaFlexViT, ...); the
            pixel jigsaw of its images for any model without a learned absolute position table (CNNs, Swin,
            ConvNeXt, BEiT, XCiT, LeViT, ...); or timm's ``features_only`` wrapper of one (the wrapped model
            converted, or a module list's input jigsawed). docs/timm-coverage.md lists what each family gets.
            Refused: a model without timm's ``feature_info`` (not an image model), and one with a learned absolute
            position table that no front end covers (see ``pixel_jigsaw``).
        ratio, prob, seed, min_block, min_aspect, shared, backend: as :class:`mjp_fast.JigsawSampler`.
        dal: the DAL regressor's kind (``"nonlinear"``, ``"linear"``, ``"pca"``), or None or ``"none"`` (timm's
            ``create_model`` drops None-valued keywords, so ``mjp_dal="none"`` is how to say it there), or
            ``"auto"`` (default): ``"nonlinear"`` where the model has an absolute position table, else none. A model
            without a table asked for DAL warns once (naming the model) and trains without it.
        patch_size: the jigsaw's patch size for pixel-space models, an int >= 1. Default: the stride of the model's
            first feature stage that downsamples (its patch embedding's or stem's); ResNet, Swin, ConvNeXt, BEiT and
            the relative-position ViTs keep theirs (the patch embedding's, else 16). Token-path models use their
            own. In training the images' sides must be multiples of it (a ValueError), but for a model built for a
            size it does not divide (Inception's 299 px at 2): its largest top-left region of whole patches is
            jigsawed, the border of fewer than one patch kept in place.
        dal_normalize: regress coordinates scaled to [0, 1] instead of raw integers.
        unk: masked positions get the learned unknown embedding ``mjp.unk_embed`` (MJP, default). False: the
            masked positions' patches are still permuted, but each keeps its own ``pos_embed[n]`` (the paper's
            "naive shuffle" ablation; no ``mjp.unk_embed`` parameter; DAL still leaves the masked positions out).
            Models without position embeddings: no effect.
        dal_reduction: ``"mean"`` (default, the paper's code: ``F.l1_loss``) or ``"sum"`` (the paper's formula,
            twice the mean) over the two coordinates in ``mjp_aux_loss()`` (see :func:`mjp_fast.dal_loss`).
        dal_weight: the weight at which a training forward attaches the DAL loss to the model's output (finite,
            >= 0; default 0.01, the paper's start): any loop that back-propagates the output trains DAL. Change it
            with ``model.mjp_dal_weight`` or :class:`mjp_fast.timm.DALWeightSchedule`. Not in the state dict.
        pixel_jigsaw: True: give a model with a learned absolute position table that MJP's token path does not
            cover (docs/timm-coverage.md names them) the pixel-space jigsaw of its input images; its table is kept
            as it is (a moved patch gets the row of where it lands: the paper's naive shuffle, in pixel space).
            False (default): such a model is refused. No effect on models that get the pixel jigsaw anyway; a
            ValueError for a model with a table that the token path covers.
        fused_patch_embed: run the ViT's patch embedding, jigsaw and position term as one
            :func:`mjp_fast.mjp_patch_embed` call (``backend`` chooses its backend). None: wherever the patch
            embedding is timm's standard one (``PatchEmbed``, a Conv2d with stride equal to its square kernel, no
            norm; a fixed image size, or any with ``dynamic_img_size``, the table resampled to each batch's grid);
            True: that, or a ValueError saying why not; False: timm's own embedding, then the tokens are moved.

    Returns:
        The same model object, now an MJP model: ``mjp_aux_loss()``, ``mjp_eval(...)`` and ``model.mjp``.
        With MJP off (eval mode) its outputs are those of the original model (within float tolerance where the
        patch embedding is fused: the GEMM sums in another order).

    Raises:
        TypeError: not a timm image model, or a model with a learned absolute position table that the token path
        does not cover (without ``pixel_jigsaw=True``); the message says which. ValueError: bad settings, a model
        converted already, ``fused_patch_embed=True`` for a patch embedding the fused op cannot compute, or a
        pixel-space model none of whose stages downsamples (the message says how to choose ``patch_size``).
    """
    _check_model_and_front_end_settings(model, fused_patch_embed, pixel_jigsaw, patch_size)
    check_backend(backend)
    asked_dal = not (isinstance(dal, str) and dal == "auto")
    dal_kind = check_dal_kind(dal) if asked_dal else "nonlinear"  # "auto": where the model has a table to regress
    check_unk(unk)
    check_dal_reduction(dal_reduction)  # checked before anything changes
    dal_weight = check_dal_weight("dal_weight", dal_weight)
    settings = dict(
        ratio=ratio, prob=prob, seed=seed, min_block=min_block, min_aspect=min_aspect, shared=shared, backend=backend,
        dal_normalize=dal_normalize, unk=unk, dal_reduction=dal_reduction, dal_weight=dal_weight,
    )  # fmt: skip
    wrapper_class = next((base for base in WRAPPER_MIXINS if isinstance(model, base)), None)
    inner = _wrapped_model(model, wrapper_class)
    if inner is not None:  # the wrapper runs the whole model's forward: the model is converted
        convert(
            inner, dal=dal, patch_size=patch_size, fused_patch_embed=fused_patch_embed, pixel_jigsaw=pixel_jigsaw,
            **settings,
        )  # fmt: skip
        mixin = WRAPPER_MIXINS[wrapper_class] if wrapper_class is FeatureGetterNet else MJPFeatureHookBodyMixin
        model.__class__ = mjp_class_of(type(model), None, mixin)
        return model
    layout = _front_end(model, wrapper_class, dal_kind, asked_dal, patch_size, fused_patch_embed, pixel_jigsaw)
    state = MJPState(
        layout.grid, layout.dim, dal=layout.dal, patch_size=layout.patch_size, border=layout.border, **settings
    )
    _install(model, state, layout, wrapper_class is not None)
    return model


def _wrapped_model(model: nn.Module, wrapper_class: type | None) -> nn.Module | None:
    """The model inside a ``features_only`` wrapper that runs that model's own forward: a ``FeatureGetterNet``'s, or
    a ``FeatureHookNet`` around a whole token-path model (its one entry ``body``: PiT's ``features_only``, whose
    hooks collect the stages' outputs); None for the other wrappers (module lists: their input is jigsawed)."""
    if wrapper_class is FeatureGetterNet:
        return model.model
    if wrapper_class is FeatureHookNet and list(model.keys()) == ["body"] and _token_front_end(model.body) is not None:
        return model.body
    return None


def _check_model_and_front_end_settings(
    model: object, fused_patch_embed: object, pixel_jigsaw: object, patch_size: object
) -> None:
    """:func:`convert`'s checks of the model and of the settings that choose its front end, before anything
    changes: a TypeError or ValueError naming the argument."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a timm model (nn.Module), got {type(model).__name__}")
    if isinstance(model, MJPModel):
        raise ValueError(f"model is already an MJP model ({type(model).__name__})")
    if fused_patch_embed is not None and not isinstance(fused_patch_embed, bool):
        raise TypeError(f"fused_patch_embed must be a bool or None, got {type(fused_patch_embed).__name__}")
    if not isinstance(pixel_jigsaw, bool):
        raise TypeError(f"pixel_jigsaw must be a bool, got {type(pixel_jigsaw).__name__} {pixel_jigsaw!r}")
    if patch_size is not None:
        if isinstance(patch_size, bool) or not isinstance(patch_size, int):
            raise TypeError(f"patch_size must be an int or None, got {type(patch_size).__name__} {patch_size!r}")
        if patch_size < 1:
            raise ValueError(f"patch_size must be >= 1, got {patch_size}")


class _Layout(NamedTuple):
    """What :func:`convert` makes of a model: its MJP class, the state's grid, token width, patch size and DAL kind,
    whether the patch embedding runs fused, a hybrid ViT's pixel block (None elsewhere), and whether a pixel-space
    jigsaw keeps a border of partial patches in place (MJPState's ``border``)."""

    new_class: type
    grid: tuple[int, int]
    dim: int | None
    patch_size: int
    dal: str | None
    fuse: bool
    pixel_block: int | None
    border: bool = False


def _fusing(model: nn.Module, fused_patch_embed: bool | None) -> bool:
    """Whether a ViT or Eva runs its patch embedding fused: ``fused_patch_embed`` None (where it can), True (or a
    ValueError saying why it cannot), False."""
    reason = unfusable_reason(model) if fused_patch_embed is not False else None
    if fused_patch_embed and reason is not None:
        raise ValueError(f"fused_patch_embed=True: {reason}")
    return fused_patch_embed is not False and reason is None


def _front_end(
    model: nn.Module, wrapper_class: type | None, dal: str | None, asked_dal: bool, patch_size: int | None,
    fused_patch_embed: bool | None, pixel_jigsaw: bool,
) -> _Layout:  # fmt: skip
    """The front end of ``model``'s family (:func:`convert`'s dispatch): ViT, Eva, CaiT and ConViT (with a table),
    else the pixel-space jigsaw."""
    token_front_end = _token_front_end(model)
    if token_front_end is not None:  # a table added outside the ViT's _pos_embed hook: the family's own front end
        _refuse_pixel_jigsaw_for_the_token_path(model, pixel_jigsaw)
        token = token_front_end.layout(model, fused_patch_embed)
        return _Layout(token.new_class, token.grid, token.dim, token.patch_size, dal, token.fuse, token.pixel_block)
    if isinstance(model, VisionTransformer) and model.pos_embed is not None:
        _refuse_pixel_jigsaw_for_the_token_path(model, pixel_jigsaw)
        # A hybrid ViT (CNN stem) jigsaws its images, a block of pixels per token; others move their tokens.
        pixel_block = hybrid_pixel_block(model.patch_embed)
        patch_size = pixel_block or _first(model.patch_embed.patch_size)
        # A plain model fused by fast_patch_embed becomes the MJP version of its timm class.
        new_class = mjp_class_of(original_class(type(model)), VisionTransformer, MJPVisionTransformer)
        grid, dim = tuple(model.patch_embed.grid_size), model.embed_dim
        return _Layout(new_class, grid, dim, patch_size, dal, _fusing(model, fused_patch_embed), pixel_block)
    if isinstance(model, Eva):  # EVA-02, DINOv3, PE, the vit_*_rope_* models: a table, a rotary table, or both
        if model.pos_embed is None:  # RoPE only
            dal = _without_dal(model, dal, asked_dal, "it gets the identity rotation at the shuffled positions")
        else:
            _refuse_pixel_jigsaw_for_the_token_path(model, pixel_jigsaw)
        grid, dim, patch_size = eva_layout(model)
        new_class = mjp_class_of(original_class(type(model)), Eva, MJPEva)
        return _Layout(new_class, grid, dim, patch_size, dal, _fusing(model, fused_patch_embed), None)
    # The pixel-space jigsaw. The classes MJP covered before every family (PIXEL_CLASSES) keep their named MJP
    # class and their patch (the patch embedding's, else 16); every other timm image model gets a class made for
    # it and its first stage's stride.
    if wrapper_class is not None:
        mjp_class: type | None = WRAPPER_MIXINS[wrapper_class]
        timm_class = None
        legacy = wraps_a_legacy_class(model)
        legacy = True if legacy is None else legacy  # a wrapper of unknown origin keeps the patch it always had
    else:
        timm_class = next((base for base in PIXEL_CLASSES if isinstance(model, base)), None)
        legacy = timm_class is not None
        mjp_class = PIXEL_CLASSES[timm_class] if legacy else None
    if not legacy:  # the PIXEL_CLASSES (Swin with its optional absolute_pos_embed too) were never refused
        _refuse_a_table_unless_asked(model, pixel_jigsaw)  # the table first: the more telling reason
        _refuse_unless_an_image_model(model)
    if fused_patch_embed:
        raise ValueError(f"fused_patch_embed=True: {unfusable_reason(model)}")
    if patch_size is None:
        patch_size = legacy_patch_size(model) if legacy else _first_stage_patch(model)
    dal = _without_dal(model, dal, asked_dal, "it gets the pixel-space jigsaw")
    new_class = mjp_class_of(type(model), timm_class, mjp_class) if mjp_class is not None else pixel_class(type(model))
    border = _has_border(model, patch_size)
    return _Layout(new_class, _grid(model, patch_size), None, patch_size, dal, False, None, border)


def _refuse_pixel_jigsaw_for_the_token_path(model: nn.Module, pixel_jigsaw: bool) -> None:
    """``pixel_jigsaw=True`` is for tables the token path does not cover: a ValueError for one it covers."""
    if pixel_jigsaw:
        raise ValueError(
            f"pixel_jigsaw=True: model {_model_name(model)} has an absolute position table that MJP's token path "
            "covers (the unknown embedding on the table, DAL: the paper's method); convert it without pixel_jigsaw"
        )


def _refuse_unless_an_image_model(model: nn.Module) -> None:
    """A TypeError for a model that does not publish timm's ``feature_info`` (every timm image model does): there is
    no image, or no stride, to cut a jigsaw from."""
    if first_stage_stride(model) is None:
        families = (VisionTransformer, Eva, *PIXEL_CLASSES, *WRAPPER_MIXINS)
        supported = ", ".join(dict.fromkeys(base.__name__ for base in families))
        raise TypeError(
            f"model: convert() supports timm image models ({supported}, and with the pixel-space jigsaw every timm "
            f"image model without a learned absolute position table); got {type(model).__name__}, which has no "
            "timm feature_info with the stride of its first stage: not a timm image model"
        )


def _covered_classes() -> str:
    """The timm classes MJP's token path covers, for a message: the ViT's, Eva's and each front end's."""
    names = ["VisionTransformer", "Eva"] + [name for front_end in TOKEN_FRONT_ENDS for name in front_end.names]
    return ", ".join(names)


def _refuse_a_table_unless_asked(model: nn.Module, pixel_jigsaw: bool) -> None:
    """A TypeError for a model with a learned absolute position table that no token-path front end covers, unless
    ``pixel_jigsaw=True`` asked for the pixel jigsaw: never the pixel jigsaw
    silently, which would leave the table's rows where the paper's method replaces them."""
    tables = absolute_position_tables(model)
    if tables and not pixel_jigsaw:
        shown = ", ".join(tables[:3]) + (f" and {len(tables) - 3} more" if len(tables) > 3 else "")
        raise TypeError(
            f"model: {_model_name(model)} has a learned absolute position table ({shown}); MJP's token path (the "
            f"unknown embedding on the table, DAL) covers timm's {_covered_classes()}, and for this model it is not "
            "built yet. convert(model, pixel_jigsaw=True) gives it the pixel-space jigsaw of its input "
            "images instead, the table kept as it is (a moved patch gets the row of where it lands: the naive shuffle)"
        )


def _first_stage_patch(model: nn.Module) -> int:
    """The default jigsaw patch of a pixel-space model outside PIXEL_CLASSES: the stride of its first feature stage
    that downsamples (VGG's and DLA's first stage keeps the input's resolution: their second stage's), refused with a
    ValueError where no stage downsamples (the jigsaw would move single pixels)."""
    stride = first_downsampling_stride(model)
    if stride < 2:
        raise ValueError(
            f"model: {_model_name(model)}: none of its feature stages downsamples (feature_info's reductions are all "
            "1), so its own jigsaw would move single pixels, which keeps no patch's content together; give "
            "patch_size=N (N >= 2) to jigsaw N x N blocks"
        )
    return stride


def _has_border(model: nn.Module, patch_size: int) -> bool:
    """Whether the pixel-space jigsaw of ``model`` keeps a border in place: the input size it was built for is not a
    multiple of ``patch_size`` (Inception's, Xception's 299 px, NASNet's 331 in 2-pixel blocks), so its images are
    jigsawed over their largest region of whole patches (see :class:`mjp_fast.timm.MJPState`'s ``border``)."""
    size = model_input_size(model)
    return size is not None and bool(size[0] % patch_size or size[1] % patch_size)


def _install(model: nn.Module, state: MJPState, layout: _Layout, wrapped: bool) -> None:
    """Makes ``model`` its MJP class holding ``state`` as ``model.mjp``, on the model's device and dtype."""
    reference = next(model.parameters(), None)
    if reference is not None:
        state.to(device=reference.device)
        if state.unk_embed is not None:
            state.unk_embed.data = state.unk_embed.data.to(reference.dtype)
        if hasattr(state, "unused_unk_row"):
            state.unused_unk_row = state.unused_unk_row.to(reference.dtype)
    state.train(model.training)
    token_front_end = _token_front_end(model)  # before the class changes: covers() is asked of timm's model
    model.__class__ = layout.new_class
    model.mjp = state
    if token_front_end is not None:  # fused or not, and a stem's pixel jigsaw: the family's own wiring
        token_front_end.install(model, layout)
    elif layout.fuse:
        fuse_patch_embed(model.patch_embed)  # the backend is the state's, for the whole model
    elif isinstance(model, VisionTransformer):
        unfuse_patch_embed(model.patch_embed)
        if layout.pixel_block is not None:
            jigsaw_pixels_before(model.patch_embed, state)
    if wrapped:  # the wrapper runs its entries in order: the jigsaw goes first
        model._modules = dict(mjp=model._modules.pop("mjp"), **model._modules)


def fast_patch_embed(model: nn.Module, *, backend: str | None = None) -> nn.Module:
    """Runs a timm ViT's patch embedding and position add as one fused :func:`mjp_fast.mjp_patch_embed` call, in
    place; returns the model.

    Outputs equal timm's Conv2d path within float tolerance (the GEMM sums in another order; under autocast the
    op runs in the autocast dtype, as timm's Conv2d does, and returns the dtype of timm's sum). Parameters, state
    dict keys and checkpoints stay as they are: the op reads ``patch_embed.proj``'s weight and bias. On an MJP
    model (:func:`convert`) it turns the fused path on, jigsaw included. Calling it again changes nothing (but
    the backend).

    Args:
        model: a timm ``VisionTransformer`` (a distilled DeiT too) or ``Eva`` (EVA-02, PE, the ``_ape`` RoPE
            models) with absolute position embeddings and timm's standard patch
            embedding (``PatchEmbed``; a Conv2d with stride equal to its square kernel; no norm; a fixed image size,
            or any with ``dynamic_img_size``, the table resampled to each batch's grid as timm does, and the images
            padded as timm pads them with ``dynamic_img_pad``), an MJP version of one, or timm's ``features_only``
            wrapper (``FeatureGetterNet``) of one.
        backend: the fused op's backend (as :func:`mjp_fast.mjp_patch_embed`); default automatic. An MJP model has
            one backend for its sampler, embedding and DAL loss (``model.mjp.backend``, ``convert``'s ``backend``):
            given here, it sets that one; None keeps it.

    Raises:
        TypeError: not a timm VisionTransformer or Eva. ValueError: a patch embedding the fused op cannot compute (the
        message says why), or an unknown backend.
    """
    target = model.model if isinstance(model, FeatureGetterNet) else model
    if not isinstance(target, (VisionTransformer, Eva)):
        raise TypeError(
            f"model must be a timm VisionTransformer or Eva (or its FeatureGetterNet), got {type(model).__name__}"
        )
    reason = unfusable_reason(target)
    if reason is not None:
        raise ValueError(f"model: its patch embedding cannot be fused: {reason}")
    check_backend(backend)
    if isinstance(target, MJPModel):
        # The model's one backend, the core's: a backend given here moves the sampler and the DAL loss too.
        if backend is not None:
            target.mjp.backend = backend
        fuse_patch_embed(target.patch_embed)
        return model
    if not isinstance(target, (FusedViTMixin, FusedEvaMixin)):
        mixin = FusedEvaMixin if isinstance(target, Eva) else FusedViTMixin
        target.__class__ = fused_model_class(type(target), mixin)
    fuse_patch_embed(target.patch_embed, backend)
    return model
