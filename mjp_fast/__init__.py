"""mjp_fast: fast, exact Masked Jigsaw Puzzle position embeddings for Vision Transformers (CVPR 2023)."""

from mjp_fast._versions import check_torch

check_torch()  # before any module below touches torch's newer APIs: an older torch gets one clear ImportError

from mjp_fast.backend import available_backends  # noqa: E402
from mjp_fast.nn import DALRegressor, MJPPatchEmbed  # noqa: E402
from mjp_fast.ops import dal_loss, jigsaw_images, mjp_patch_embed, mjp_pos_embed  # noqa: E402
from mjp_fast.sampler import Jigsaw, JigsawSampler, sample_jigsaw  # noqa: E402

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
