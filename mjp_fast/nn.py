"""Modules: ``MJPPatchEmbed`` (patch embedding, position embeddings and the jigsaw in one module) and
``DALRegressor`` (the position regressor of the DAL loss)."""

from __future__ import annotations

import torch
from torch import nn

from mjp_fast._validate import check_grid_size, check_int
from mjp_fast.ops.dal_loss import DAL_REDUCTIONS, dal_loss
from mjp_fast.ops.patch_embed import mjp_patch_embed
from mjp_fast.sampler import JigsawSampler
from mjp_fast.sampler.jigsaw import Jigsaw, check_jigsaw

DAL_KINDS = ("nonlinear", "linear", "pca")


class DALRegressor(nn.Module):
    """Maps position embeddings ``[N, D]`` to grid coordinates ``[N, 2]`` for the DAL loss.

    Args:
        dim: D.
        kind: ``"nonlinear"`` (Linear-ReLU-Linear, the paper's best), ``"linear"``, or ``"pca"``: the
            embeddings' projection on their two principal directions (recomputed, differentiably, at every call;
            signs fixed so that position 0 projects to a coordinate <= 0) followed by a learned 2x2 affine map.
        hidden_dim: width of the nonlinear regressor's hidden layer (default ``dim``).
    """

    def __init__(self, dim: int, kind: str = "nonlinear", hidden_dim: int | None = None) -> None:
        super().__init__()
        dim = check_int("dim", dim, minimum=1)
        if kind not in DAL_KINDS:
            raise ValueError(f"kind must be one of {', '.join(DAL_KINDS)}, got {kind!r}")
        self.dim, self.kind = dim, kind
        if kind == "nonlinear":
            hidden_dim = check_int("hidden_dim", hidden_dim if hidden_dim is not None else dim, minimum=1)
            self.net = nn.Sequential(nn.Linear(dim, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 2))
        elif kind == "linear":
            self.net = nn.Linear(dim, 2)
        else:
            self.net = nn.Linear(2, 2)

    def fused_layers(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor | None] | None:
        """``(w1 [H, D], b1 [H], w2 [2, H], b2 [2])`` of the nonlinear regressor, ``(None, None, w2 [2, D], b2 [2])``
        of the linear one: what the fused DAL kernels compute (:func:`mjp_fast.dal_loss`). None for ``pca``, and for a
        subclass with its own ``forward``: those run as modules."""
        if type(self).forward is not DALRegressor.forward:
            return None
        # The modules' and parameters' dicts, not attribute lookups (nn.Module.__getattr__): this runs every step.
        # A parametrized weight (torch.nn.utils.parametrize) is no entry there: the regressor then runs as a module.
        net = self._modules["net"]
        if self.kind == "nonlinear":
            first, last = net._modules["0"]._parameters, net._modules["2"]._parameters
            if "weight" not in first or "weight" not in last:
                return None
            return first["weight"], first.get("bias"), last["weight"], last.get("bias")
        if self.kind == "linear":
            parameters = net._parameters
            return (None, None, parameters["weight"], parameters.get("bias")) if "weight" in parameters else None
        return None

    def forward(self, pos_embed: torch.Tensor) -> torch.Tensor:
        """``[N, D]`` -> ``[N, 2]``."""
        if pos_embed.shape[-1] != self.dim:
            raise ValueError(f"pos_embed must end in D = {self.dim}, got shape {list(pos_embed.shape)}")
        if self.kind != "pca":
            return self.net(pos_embed)
        centered = pos_embed.float() - pos_embed.float().mean(0, keepdim=True)
        _, _, right = torch.linalg.svd(centered, full_matrices=False)
        directions = right[:2]
        if directions.shape[0] < 2:  # fewer than two positions or dimensions: pad with a zero direction
            directions = torch.cat((directions, directions.new_zeros(2 - directions.shape[0], self.dim)))
        # SVD's signs are arbitrary; fix them by the data (position 0 projects to a coordinate <= 0), so the
        # affine map sees the same axes from step to step, whatever rotation the embedding space takes.
        projection = centered @ directions.t()
        projection = projection * torch.where(projection[:1] > 0, -1.0, 1.0)
        return self.net(projection).to(pos_embed.dtype)


class MJPPatchEmbed(nn.Module):
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
        dal: None (then :meth:`dal_loss` is zero), or the kind of :class:`DALRegressor` that :meth:`dal_loss` uses.
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
        if dal_reduction not in DAL_REDUCTIONS:
            raise ValueError(f"dal_reduction must be one of {', '.join(DAL_REDUCTIONS)}, got {dal_reduction!r}")
        if not isinstance(unk, bool):
            raise TypeError(f"unk must be a bool, got {type(unk).__name__}")
        self.dal_reduction = dal_reduction
        self.img_size = check_grid_size(img_size, "img_size")  # (height, width), an int for a square
        self.patch_size = check_int("patch_size", patch_size, minimum=1)
        if self.img_size[0] % self.patch_size or self.img_size[1] % self.patch_size:
            raise ValueError(f"img_size {self.img_size} must be a multiple of patch_size {self.patch_size}")
        self.grid_size = (self.img_size[0] // self.patch_size, self.img_size[1] // self.patch_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        in_chans = check_int("in_chans", in_chans, minimum=1)
        self.embed_dim = check_int("embed_dim", embed_dim, minimum=1)
        self.backend = backend
        self.dal_normalize = bool(dal_normalize)
        self.sampler = JigsawSampler(
            self.grid_size,
            ratio,
            prob,
            seed,
            min_block=min_block,
            min_aspect=min_aspect,
            shared=shared,
            backend=backend,
        )
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=self.patch_size, stride=self.patch_size, bias=bias)
        self.pos_embed = nn.Parameter(torch.empty(1, self.num_patches, embed_dim))
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        if unk:
            self.unk_embed = nn.Parameter(torch.empty(embed_dim))
            nn.init.trunc_normal_(self.unk_embed, std=0.02)
        else:
            self.unk_embed = None
            # The op takes a [D] row for masked positions whenever a jigsaw is given; none is masked here: a zero
            # row made once, moved with the module, never saved.
            self.register_buffer("unused_unk_row", torch.zeros(embed_dim), persistent=False)
        self.dal_regressor = DALRegressor(embed_dim, dal) if dal is not None else None
        self.last_jigsaw: Jigsaw | None = None

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
        validate = jigsaw is not None
        if jigsaw is None and isinstance(images, torch.Tensor) and images.dim() == 4:
            jigsaw = self.sampler(images.shape[0], images.device)
        unk_embed = self.unk_embed
        if jigsaw is not None and unk_embed is None and isinstance(images, torch.Tensor) and images.dim() == 4:
            if validate:  # the caller's jigsaw, checked as given (the op below sees it with no mask bit set)
                jigsaw = check_jigsaw(jigsaw, images.shape[0], self.num_patches, images.device, validate=True)
                validate = False
            self.last_jigsaw = jigsaw  # the real mask: dal_loss leaves those positions out
            # The naive shuffle: the same moves, each position its own pos_embed[n] (no position is "masked").
            jigsaw = Jigsaw(torch.zeros_like(jigsaw.mask), jigsaw.perm)
            unk_embed = self.unused_unk_row
        else:
            self.last_jigsaw = jigsaw
        return mjp_patch_embed(
            images,
            self.proj.weight,
            self.proj.bias,
            self.pos_embed,
            unk_embed,
            jigsaw,
            backend=self.backend,
            validate=validate,
        )

    def dal_loss(self) -> torch.Tensor:
        """The DAL loss over the positions the last forward left unmasked (all of them if it had no jigsaw): a
        float32 scalar, unweighted. Built with ``dal=None``, a float32 zero on the module's device, as a timm MJP
        model's ``mjp_aux_loss()`` without DAL: a training loop adds it either way."""
        if self.dal_regressor is None:
            return self.pos_embed.new_zeros((), dtype=torch.float32)
        mask = self.last_jigsaw.mask if self.last_jigsaw is not None else None
        return dal_loss(
            self.pos_embed,
            self.dal_regressor,
            self.grid_size,
            mask,
            normalize=self.dal_normalize,
            reduction=self.dal_reduction,
            backend=self.backend,
        )

    def extra_repr(self) -> str:
        return f"img_size={self.img_size}, patch_size={self.patch_size}, embed_dim={self.embed_dim}"
