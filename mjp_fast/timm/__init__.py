"""MJP for timm: registered MJP models and ``convert()`` for existing ones, keeping their weights.

Importing this package, which ``import mjp_fast`` does, registers ``mjp_deit_tiny_patch16_224``,
``mjp_deit_small_patch16_224``, ``mjp_deit_base_patch16_224``, ``mjp_vit_small_patch16_224`` and
``mjp_vit_base_patch16_224`` with timm (``mjp_fast.convert`` and ``mjp_fast.fast_patch_embed`` are this package's)::

    model = timm.create_model("mjp_deit_small_patch16_224", mjp_ratio=0.1, mjp_prob=0.5, mjp_dal="nonlinear")

One core, :class:`MJPState` (``model.mjp``: the package's :class:`mjp_fast.core.MJPCore`, whose sampler,
``unk_embed``, DAL regressor and backend ``MJPPatchEmbed`` shares, plus the DAL weight and the timm step), and one
front end per timm family, which :func:`convert` picks (docs/timm-coverage.md lists the models):

- ``vit.py``: ``VisionTransformer`` and its subclasses (the distilled DeiT: any number of prefix tokens). In training
  the patch tokens of masked positions are permuted among themselves and get ``unk_embed`` instead of their row
  of ``pos_embed`` (with ``unk=False``, the row of where they land); the prefix tokens keep theirs. Moving the
  tokens after timm's patch embedding equals moving the patches before it where each token is a function of its own
  patch (one linear map, an optional per-token norm): class token or not, register tokens, ``no_embed_class``,
  ``dynamic_img_size``, ``set_input_size``. A hybrid ViT's CNN stem sees across the patches' borders, so its input
  images are jigsawed instead, one block of pixels per token, and the masked positions get ``unk_embed``.
- ``eva.py``: ``Eva`` (EVA-02, DINOv3, PE, the RoPE ViTs): ``unk_embed`` on the table where there is one, no rotation
  at the shuffled positions, and ``unk_embed`` added to the shuffled tokens where there is no table.
- ``inline_table.py``: ``Cait`` and ``ConVit`` (with its table; its GPSA blocks' relative terms are left as they are),
  which add ``pos_embed`` inline after the patch embedding: ``unk_embed`` on the table and DAL, applied in a
  class-swapped patch embedding (fused with the position term where it is timm's ``PatchEmbed``).
- ``hiera.py``, ``pit.py``: ``Hiera`` and PiT, whose stems overlap the patches' borders: the images are jigsawed
  before the stem, one block of its stride per token, and the masked positions get ``unk_embed`` on the table.
- ``tnt.py``: ``TNT``: the images are jigsawed per patch (inner and outer tokens move together), ``unk_embed`` on
  ``patch_pos``.
- ``crossvit.py``: ``CrossVit``: both branches, one jigsaw per image carried from the coarser grid to the finer,
  ``model.mjp`` branch 0's state and ``model.mjp.branch_1`` branch 1's.
- ``naflexvit.py``: ``NaFlexVit``: learned and factorized tables, images and NaFlex dicts with a grid per sample.
- ``nest.py``, ``visformer.py``, ``volo.py``: ``Nest`` (level 0's table, mapped from its blocks to the grid; tokens
  moved), ``Visformer`` (``pos_embed1``; images jigsawed before the stem), ``VOLO`` (the table added at 1/16 after
  the outlooker; images jigsawed before the stem in 16-pixel blocks); their later, pooled tables stay as they are.
- ``hieradet.py``, ``gemma4_vit.py``, ``qwen3_vit.py``: SAM 2's ``HieraDet`` (images jigsawed before the stem),
  Gemma 4's (its factorized one-hot table; images and NaFlex patches) and Qwen3's (the resampled table) vision
  classifiers and encoders.
- ``samvit.py``: ``VisionTransformerSAM`` with a table: ``unk_embed`` on its NHWC table (resampled as timm does).
- ``front_end.py``: the contract of these token-path front ends (``convert.TOKEN_FRONT_ENDS``).
- ``pixel.py``: models without an absolute table (ResNet, Swin, ConvNeXt, the relative-position ViTs, BEiT) get the
  pixel-space jigsaw of their input, as the paper's ResNet-50 + MJP and Swin-T + MJP rows.

In eval mode a model is the plain timm model, unless inside ``model.mjp_eval(...)``.

Where the patch embedding is timm's standard one (a ``PatchEmbed`` whose ``proj`` is a Conv2d with stride equal
to its square kernel, no norm; a fixed image size, flattened output, or timm's ``dynamic_img_size``, whose table is
resampled to each batch's grid) and the model has an absolute table, the
embedding, the jigsaw and the position term run as one :func:`mjp_fast.mjp_patch_embed` call
(``convert(..., fused_patch_embed=None)``, automatic): the ``patch_embed`` module then passes the images through and
the model's ``_pos_embed`` embeds them, reading the same ``patch_embed.proj`` weights. Outputs equal timm's Conv2d
path within float tolerance (the GEMM sums in another order), in training and in eval mode; under autocast the op
runs in the autocast dtype, as timm's Conv2d would, and returns the dtype of timm's sum. Under FX the fused call is
one node: ``mjp`` when it jigsaws, else a ``fused_patch_embed`` call (there is no ``patch_embed.proj`` node).
:func:`fast_patch_embed` does the same for a plain timm ViT or Eva.

timm's conventions carry over: ``features_only=True`` (timm's feature wrappers around the MJP model),
``forward_intermediates``, FX tracing in eval and training mode (MJP is one ``call_module`` node of the graph),
and ``mjp_<base>`` shares its base's pretrained configs, so ``pretrained=True`` loads the base's weights.

All MJP state lives in ``model.mjp`` (``unk_embed``, the DAL regressor, the sampler and its counter), so a plain
timm state dict loads with ``strict=False`` (only ``mjp.*`` keys missing), and an MJP state dict loads back into
the plain model the same way (only ``mjp.*`` keys unexpected).

DAL trains in any loop: a training forward computes the DAL loss and attaches it to the tokens at
``model.mjp_dal_weight`` (default 0.01; :class:`DALWeightSchedule` decays it as the paper does), so a backward of the
output alone (timm's ``train.py``: ``criterion(model(x), y).backward()``) gives every parameter its gradient, the
regressor's included (DDP needs no ``find_unused_parameters``). ``model.mjp_aux_loss()`` stays for loops that add
``w * loss`` themselves: its weight then replaces the attached one.
"""

from __future__ import annotations

from mjp_fast.timm.base import MJPModel
from mjp_fast.timm.convert import convert, fast_patch_embed
from mjp_fast.timm.eva import MJPEva
from mjp_fast.timm.fused import FusedPatchEmbed, FusedVisionTransformer, is_fused
from mjp_fast.timm.pixel import (
    MJPBeit,
    MJPConvNeXt,
    MJPPixelModel,
    MJPPixelVisionTransformer,
    MJPResNet,
    MJPSwinTransformer,
    MJPVisionTransformerRelPos,
)
from mjp_fast.timm.registry import REGISTERED_BASES, register
from mjp_fast.timm.schedule import DALWeightSchedule
from mjp_fast.timm.state import MJPState
from mjp_fast.timm.vit import MJPVisionTransformer

__all__ = [
    "REGISTERED_BASES",
    "DALWeightSchedule",
    "FusedPatchEmbed",
    "FusedVisionTransformer",
    "MJPBeit",
    "MJPConvNeXt",
    "MJPEva",
    "MJPModel",
    "MJPPixelModel",
    "MJPPixelVisionTransformer",
    "MJPResNet",
    "MJPState",
    "MJPSwinTransformer",
    "MJPVisionTransformer",
    "MJPVisionTransformerRelPos",
    "convert",
    "fast_patch_embed",
    "is_fused",
    "register",
]
