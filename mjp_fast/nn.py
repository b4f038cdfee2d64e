"""``MJPPatchEmbed``: patch embedding, position embeddings and the jigsaw in one module, a front end over
:class:`mjp_fast.core.MJPCore`. ``DALRegressor`` (the position regressor of the DAL loss) is
:mod:`mjp_fast.ops.dal_regressor`'s, kept importable from here."""

from __future__ import annotations

import torch
from torch import nn

from mjp_fast._validate import check_grid_size, check_int
from mjp_fast.core import MJPCore, check_dal_reduction, check_unk
from mjp_fast.ops.dal_regressor import DAL_KINDS, DALRegressor
from mjp_fast.ops.patch_embed import embed_patches, mjp_patch_embed
from mjp_fast.sampler.jigsaw import Jigsaw, check_jigsaw

__all__ = ["DAL_KINDS", "DALRegressor", "MJPPatchEmbed"]


class MJPPatchEmbed(MJPCore):
    """Patch embedding with Masked Jigsaw Puzzle position embeddings.

    Owns ``proj`` (a Conv2d, so timm checkpoints load), ``pos_embed`` ``[1, N, D]`` (patch positions only),
    ``unk_embed`` ``[D]`` (unless ``unk=False``), an optional ``dal_regressor``, and a :class:`JigsawSampler` whose
    sample counter feeds the sampler's ``offset``: each sample of a run gets its own jigsaw, distinct across DDP
    ranks, and a resumed run (the counter is in the state dict) continues the same stream.

    In training mode each batch is jigsawed (per sample, with probability ``prob``); in eval mode the embedding
    is plain, unless inside :meth:`jigsaw_eval`.

    Args:
        img_size, patch_size, in_chans, embed_dim: as timm's ``PatchEmbed``.
        ratio, prob, seed, min_block, min_aspect, shared: as :func:`mjp_fast.sample_jigsaw`.
        bias: whether ``proj`` has a bias.
        dal: None (default; then :meth:`dal_loss` is zero), or the kind of :class:`DALRegressor` that
            :meth:`dal_loss` uses. The default differs from the timm models' (``"nonlinear"`` where they have a
            table) on purpose: this module's DAL loss trains only when the loop adds :meth:`dal_loss` itself, so a
            regressor made by default would sit untrained (and, under DDP, unused) in every loop that does not;
            the timm models attach the loss to their output, which trains it in any loop.
        dal_normalize: regress coordinates scaled to [0, 1] instead of raw integers.
        dal_reduction: :meth:`dal_loss`'s reduction over the two coordinates: ``"mean"`` (default, the paper's
            code) or ``"sum"`` (the paper's formula, twice the mean); see :func:`mjp_fast.dal_loss`.
        unk: masked positions get ``unk_embed`` (MJP, default). False: the patches of the masked positions are
            still permuted among themselves, but every position keeps its own ``pos_embed[n]`` (the paper's naive
            shuffle); there is then no ``unk_embed`` parameter (``unk_embed`` is None, no state dict key), and
            :meth:`dal_loss` still leaves the masked positions out.
        backend: forced backend for the sampler, the embedding and the DAL loss, default automatic.

    Shapes: ``forward`` takes images ``[B, C, H, W]`` and returns tokens ``[B, N, D]``.
    """

    dal_reduction: str = "mean"  # class-level default: a module pickled before the option existed reads it here

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        embed_dim: int = 768,
        ratio: float = 0.1,
        prob: float = 0.5,
        seed: int = 0,
        *,
        min_block: int = 8,
        min_aspect: float = 0.3,
        shared: bool = False,
        bias: bool = True,
        dal: str | None = None,
        dal_normalize: bool = False,
        dal_reduction: str = "mean",
        unk: bool = True,
        backend: str | None = None,
    ) -> None:
        super().__init__()
        check_dal_reduction(dal_reduction)  # checked first, as before the core existed
        check_unk(unk)
        self.dal_reduction = dal_reduction
        self.img_size = check_grid_size(img_size, "img_size")  # (height, width), an int for a square
        self.patch_size = check_int("patch_size", patch_size, minimum=1)
        if self.img_size[0] % self.patch_size or self.img_size[1] % self.patch_size:
            raise ValueError(f"img_size {self.img_size} must be a multiple of patch_size {self.patch_size}")
        self.grid_size = (self.img_size[0] // self.patch_size, self.img_size[1] // self.patch_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        in_chans = check_int("in_chans", in_chans, minimum=1)
        self.embed_dim = check_int("embed_dim", embed_dim, minimum=1)
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=self.patch_size, stride=self.patch_size, bias=bias)
        self.pos_embed = nn.Parameter(torch.empty(1, self.num_patches, embed_dim))
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        # The sampler, unk_embed (or unused_unk_row) and the regressor, after proj and pos_embed: the parameters'
        # order (which optimizer checkpoints index) and the initialisation's random draws stay as they were.
        self._init_core(
            self.grid_size, self.embed_dim, ratio=ratio, prob=prob, seed=seed, dal=dal, min_block=min_block,
            min_aspect=min_aspect, shared=shared, backend=backend, dal_normalize=dal_normalize,
            dal_reduction=dal_reduction, unk=unk,
        )  # fmt: skip

    @property
    def samples_seen(self) -> int:
        """How many training samples this module has embedded on this rank."""
        return self.sampler.samples_seen

    def no_weight_decay(self) -> set[str]:
        return {"pos_embed", "unk_embed"} if self.unk_embed is not None else {"pos_embed"}

    def jigsaw_eval(self, ratio: float = 0.5, seed: int = 0, prob: float = 1.0, start: int = 0):
        """Within this context, eval mode jigsaws its input too: the same jigsaws for the same seed.

        The paper's consistency protocol compares predictions on ``x`` and on ``x`` jigsawed at ratio 0.5.
        ``start``: samples of the stream drawn before (see :meth:`JigsawSampler.jigsaw_eval`).
        """
        return self.sampler.jigsaw_eval(ratio=ratio, seed=seed, prob=prob, start=start)

    def forward(self, images: torch.Tensor, jigsaw: Jigsaw | None = None) -> torch.Tensor:
        """images ``[B, C, H, W]`` -> tokens ``[B, N, D]``; ``jigsaw`` overrides the module's own sampling."""
        weight, bias = self.proj.weight, self.proj.bias
        if not isinstance(images, torch.Tensor) or images.dim() != 4:  # the operation says what is wrong
            return mjp_patch_embed(images, weight, bias, self.pos_embed, self.unk_embed, jigsaw, backend=self.backend)
        validate = jigsaw is not None
        if jigsaw is None:
            jigsaw = self.sampler(images.shape[0], images.device)
        elif self.unk_embed is None:  # the caller's jigsaw, checked as given (the op sees it with no mask bit set)
            jigsaw = check_jigsaw(jigsaw, images.shape[0], self.num_patches, images.device, validate=True)
            validate = False
        self.record_jigsaw(jigsaw)  # the real mask: dal_loss leaves those positions out
        position_jigsaw, unk_row = self.position_jigsaw(jigsaw)
        backend = self.backend_for(images.device)
        # The jigsaw is this module's sampler's, or a caller's that is validated (here or by the op): a permutation.
        return embed_patches(
            images, weight, bias, self.pos_embed, unk_row, position_jigsaw, backend=backend, validate=validate,
            permutation=True,
        )  # fmt: skip

    def dal_loss(self) -> torch.Tensor:
        """The DAL loss over the positions the last forward left unmasked (all of them if it had no jigsaw): a
        float32 scalar, unweighted. Built with ``dal=None``, a float32 zero on the module's device, as a timm MJP
        model's ``mjp_aux_loss()`` without DAL: a training loop adds it either way."""
        if self.dal_regressor is None:
            return self.pos_embed.new_zeros((), dtype=torch.float32)
        return self.dal_loss_of(self.pos_embed, None, self.last_jigsaw, 0)

    def extra_repr(self) -> str:
        return f"img_size={self.img_size}, patch_size={self.patch_size}, embed_dim={self.embed_dim}"
