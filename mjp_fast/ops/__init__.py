"""The operations that apply a jigsaw, one file each: the pure-PyTorch oracle ``*_ref``, the fast paths, and the
public function. (The jigsaw itself comes from :mod:`mjp_fast.sampler`.)"""

from mjp_fast.ops.dal_loss import dal_loss, dal_loss_ref, grid_coordinates
from mjp_fast.ops.jigsaw_images import jigsaw_images, jigsaw_images_ref
from mjp_fast.ops.patch_embed import mjp_patch_embed, mjp_patch_embed_ref
from mjp_fast.ops.pos_embed import mjp_pos_embed, mjp_pos_embed_ref
from mjp_fast.ops.rope_identity import rope_identity, rope_identity_ref

__all__ = [
    "dal_loss",
    "dal_loss_ref",
    "grid_coordinates",
    "jigsaw_images",
    "jigsaw_images_ref",
    "mjp_patch_embed",
    "mjp_patch_embed_ref",
    "mjp_pos_embed",
    "mjp_pos_embed_ref",
    "rope_identity",
    "rope_identity_ref",
]
