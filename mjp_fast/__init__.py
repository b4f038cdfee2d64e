"""mjp_fast: fast, exact Masked Jigsaw Puzzle position embeddings for Vision Transformers (CVPR 2023)."""

from mjp_fast.backend import available_backends
from mjp_fast.nn import DALRegressor, MJPPatchEmbed
from mjp_fast.ops import Jigsaw, dal_loss, jigsaw_images, mjp_patch_embed, mjp_pos_embed, sample_jigsaw
from mjp_fast.sampler import JigsawSampler

__version__ = "0.1.0"

__all__ = [
    "DALRegressor",
    "Jigsaw",
    "JigsawSampler",
    "MJPPatchEmbed",
    "available_backends",
    "dal_loss",
    "jigsaw_images",
    "mjp_patch_embed",
    "mjp_pos_embed",
    "sample_jigsaw",
]
