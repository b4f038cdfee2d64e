"""mjp_fast: fast, exact Masked Jigsaw Puzzle position embeddings for Vision Transformers (CVPR 2023).

``import mjp_fast`` also registers the ``mjp_*`` models with timm (``timm.create_model("mjp_deit_small_patch16_224")``)
and exports :func:`convert` and :func:`fast_patch_embed` from :mod:`mjp_fast.timm`.
"""

from mjp_fast._versions import check_torch

check_torch()  # before any module below touches torch's newer APIs: an older torch gets one clear ImportError

from mjp_fast.backend import available_backends  # noqa: E402
from mjp_fast.nn import DALRegressor, MJPPatchEmbed  # noqa: E402
from mjp_fast.ops import dal_loss, jigsaw_images, mjp_patch_embed, mjp_pos_embed  # noqa: E402
from mjp_fast.sampler import Jigsaw, JigsawSampler, sample_jigsaw  # noqa: E402

# Last, as it uses the modules above. timm has no discovery of other packages' models (its registry holds what has
# been imported), so the mjp_* models are registered here. timm is a dependency, and importing it (with torchvision)
# adds about 0.7 s to the package's 4.5 s (medians of 10 runs on 2 CPU cores).
from mjp_fast.timm import convert, fast_patch_embed  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "DALRegressor",
    "Jigsaw",
    "JigsawSampler",
    "MJPPatchEmbed",
    "available_backends",
    "convert",
    "dal_loss",
    "fast_patch_embed",
    "jigsaw_images",
    "mjp_patch_embed",
    "mjp_pos_embed",
    "sample_jigsaw",
]
