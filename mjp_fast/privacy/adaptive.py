r"""An analytic gradient-inversion attack that knows MJP: what eq. (1) still determines, recovered; the rest, a prior.

APRIL (:mod:`~mjp_fast.privacy.april`) assumes every token carries its own position row. An attacker who knows
MJP reads more from the same batch-1 gradients (model parameters known). Notation as in ``april.py``: tokens
``z_t`` (``t = 0`` the class token, ``t = 1 + n`` position ``n``), ``a_t = dL/dz_t`` (rows of ``A [T, D]``),
patches ``p [K]`` with ``K = C P P`` (the ``[C, P, P]`` patch flattened), ``E = weight.reshape(D, K)``, ``b`` the
patch embedding's bias, ``u = unk_embed``, ``c = cls_token``. Of the ``N`` positions ``M`` are masked, ``V = N - M``
visible.

What the attacker knows:

- the mask: a masked position's ``pos_embed`` row is used nowhere, so its gradient row is exactly zero; a visible
  one's is ``a_{1+n}``, zero only with probability zero (:func:`read_mask`);
- ``a_0 = dL/dcls_token``, ``a_{1+n}`` at visible ``n``, and only the SUM of the masked rows,
  ``s = sum_{masked t} a_t = dL/dunk_embed``;
- every token: ``z_0 = c`` (known), visible ``z_{1+n} = E p_n + b + pos_embed[n]``, masked ``z_t = E p + b + u``
  (which of the masked patches ``p`` sits at which masked position is the unknown permutation).

Removing the known terms. Eq. (1), ``A^T Z = W^T dL/dW =: R [D, D]``, minus ``a_0 c^T``, ``A_v^T (b + pos_v)`` and
``s (b + u)^T`` (all known) leaves ``R' = Bp E^T`` with ``Bp = sum_{t >= 1} a_t p_t^T [D, K]``, so
``Bp = R' E (E^T E)^{-1}`` (``E`` of full column rank, ``D >= K``). ``Bp`` is also ``dL/dpatch_embed.weight``
itself (the tests check the identity), so the attack needs neither the first block's attack layout (a standard
pre-norm ViT is attacked through that gradient: :func:`patch_term`) nor ``D >= K``; it needs ``D >= N + 1``. Then

    Bp = A_v^T P_v + A_m^T P_m                      [D, K]                                         (3)

with ``A_v [V, D]`` known, ``P_v [V, K]``, ``A_m [M, D]`` (only ``A_m^T 1 = s`` known) and ``P_m [M, K]`` unknown.

The count. (3) has ``D K`` equations. Unknowns: ``V K + (M D + M K) - D - (M^2 - M) = N K + (M - 1)(D - M)``:
``P_v``, ``P_m``, ``A_m`` less the ``D`` equations ``A_m^T 1 = s``, less the ``M (M - 1)`` dimensions of a symmetry
that no gradient sees (``A_m^T -> A_m^T H^{-1}``, ``P_m -> H P_m`` for any invertible ``H [M, M]`` with
``H 1 = 1`` leaves ``Bp``, ``s`` and every other first-layer gradient, ``dL/dW`` and ``dL/dqkv.bias`` included,
unchanged). For ``M <= 1`` this is APRIL's count, ``N K <= D K``: determined. For ``M >= 2`` split ``R^D`` into
the span of the visible rows (``V`` dimensions) and its complement (``D - V``). In the span: ``V K`` equations for
``P_v`` (``V K``) and the coordinates ``C = (A_v^T)^+ A_m^T [V, M]`` of the masked rows there, of which
``C 1 = gamma := (A_v^T)^+ s`` is known: ``V (M - 1)`` more unknowns than equations, whatever ``D`` (item 2). In
the complement: ``(D - V) K`` equations for ``X = Pi A_m^T`` and ``P_m``, determined up to ``H`` (item 1). In
the report's model (``D = 272``, ``N = 256``, ``K = 12``) the unknowns exceed the equations from ``M = 2`` on.
What is determined is exactly the following (``D >= N + 1``, gradient rows in general position):

1. Masked patches: only their affine hull. Let ``F = Bp - A_v^T (A_v^T)^+ Bp`` and ``sigma = s - A_v^T
   (A_v^T)^+ s`` (the parts outside the visible rows' span). ``F = X P_m`` with ``X = Pi A_m^T``, ``X 1 = sigma``,
   so ``rank F = min(M, K)`` and ``H P_m`` for every ``H 1 = 1`` fits: the masked patches are known as the
   ``(M - 1)``-dimensional affine hull ``hull_point + span(directions)``, with ``hull_point = sigma^T F / |sigma|^2``
   and ``directions`` the row space of ``F - sigma sigma^T F / |sigma|^2`` (the differences ``p_m - p_m'``).
   ``M = 1``: the hull is the patch (exact); ``M >= K + 1``: the hull is all of ``R^K`` (nothing).
2. Visible patches: ``(A_v^T)^+ Bp = P_v + C P_m`` with ``C = (A_v^T)^+ A_m^T [V, M]`` unknown but ``C 1 = gamma :=
   (A_v^T)^+ s`` known, so ``p_n - (p_hat_n - gamma_n hull_point)`` lies in ``span(directions)``: each visible
   patch is determined in ``K - (M - 1)`` directions (all of them for ``M <= 1``, none for ``M >= K + 1``), and
   the lost directions are the same ``M - 1`` for every patch: those of the masked patches' differences.
3. Where the masked patches went: nothing. Attention and the MLP are permutation-equivariant, every gradient is a
   sum over tokens, and the masked tokens all carry ``u``: the gradients do not depend on the permutation.

So the MJP attacker is exact at ``M <= 1`` and loses ``min(M - 1, K)`` directions of every patch beyond; only the
nonlinear rest of the network (what an optimization attack matches) could say more. The MJP-specific knowledge is
worth it against APRIL because APRIL puts the masked term into the visible patches as ``C P_m`` (unbounded:
``C`` is as ill-conditioned as ``A_v``), while here the error of every visible patch is confined to the
``M - 1`` known directions.

A prior over natural images fills those directions (:func:`complete_patches`, :class:`PatchPrior`): a Gaussian on
patches (mean and covariance of the training set's patches) and a Gaussian on the difference between facing
pixels of adjacent patches (variance from the training set), over every position's coordinates along
``directions``, each masked position constrained to the hull. At a masked position the result is the hull point
that best fits its neighbours' edges and the prior: the jigsaw step. The visible patches' components along
``directions`` are not determined, but neither are they noise: ``p_hat_n - gamma_n hull_point`` is off by
``sum_m (C_nm - gamma_n w_m) p_m``, small when the masked tokens' gradient rows decompose on the visible rows alike
(nearly so in a freshly initialised model, whose rows are nearly parallel). So they enter as an observation whose
noise variance is estimated from the image itself (empirical Bayes, by moments), not chosen by looking at results.
The masked patches themselves are not determined individually for ``M >= 2`` (item 1), so there is nothing to
permute; the assignment solver of :mod:`~mjp_fast.privacy.jigsaw_solver` runs where patches are known one by one:
the ablation without UNK (``unshuffle_ratio``), where APRIL recovers the shuffled image exactly and the solver puts
back the patches whose edges fit worst, keeping its moves only when they lower the image's edge energy.

Measured (``docs/reproduction.md``, ``mjp attack --compare``; 2026-11-28), against the original image: the count
decides. With ``K = 12`` (CIFAR at 32 px in 2-pixel patches, ``N = 256``, fresh model) the attack gets 22.6 dB at
ratio 0.03 (``M`` about 6 < K) where APRIL gets 8.8, 17.0 dB at 0.1, and from 0.27 on (``M`` far above ``K``)
about 13 dB, the level of the prior's blind guess (12.4 dB). With ``K = 192`` (64 px in 8-pixel patches,
``N = 64``, so ``M < K`` at every ratio) it is exact at 0.03 (``M <= 1``) and gets 27.7, 19.9, 17.1 and 15.7 dB at
0.1, 0.27, 0.5 and 0.75 where APRIL gets 7 to 11 and the blind guess 11.8.

Batches above one: every gradient row is then a sum over the batch's images, at every position, so each position
is a group of ``B`` tokens sharing one known gradient row, like the masked group here: by item 2 the ``(B - 1) N``
differences' directions cover all of ``R^K`` once ``(B - 1) N >= K``, and the analytic attack determines nothing,
MJP or not.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from mjp_fast.privacy.jigsaw_solver import (
    edge_energy,
    image_patches,
    patches_image,
    place_patches,
    suspect_positions,
)
from mjp_fast.privacy.model import PrivacyViT


@dataclass
class PatchPrior:
    """Training-set statistics of patches, the attack's prior over natural images.

    Attributes:
        mean: ``[K]``, the mean patch (``K = C P P``, the ``[C, P, P]`` patch flattened).
        covariance: ``[K, K]``.
        boundary_variance: the mean squared difference between facing pixels of adjacent patches.
    """

    mean: torch.Tensor
    covariance: torch.Tensor
    boundary_variance: float


def fit_patch_prior(images: torch.Tensor, patch_size: int, *, shrinkage: float = 1e-4) -> PatchPrior:
    """The :class:`PatchPrior` of ``images`` ``[B, C, H, W]`` in [0, 1] cut in ``patch_size`` patches (float64).

    ``shrinkage`` times the mean variance is added to the covariance's diagonal, so it inverts.
    """
    if images.dim() != 4:
        raise ValueError(f"images must be [B, C, H, W], got {list(images.shape)}")
    images = images.detach().double().cpu()
    patches = torch.cat([image_patches(image, patch_size).flatten(1) for image in images])  # [B N, K]
    mean = patches.mean(0)
    centered = patches - mean
    covariance = centered.t() @ centered / max(1, patches.shape[0] - 1)
    covariance += shrinkage * covariance.diagonal().mean() * torch.eye(covariance.shape[0], dtype=torch.float64)
    across_cols = images[..., patch_size::patch_size] - images[..., patch_size - 1 : -1 : patch_size]
    across_rows = images[..., patch_size::patch_size, :] - images[..., patch_size - 1 : -1 : patch_size, :]
    squares = torch.cat([across_cols.flatten(), across_rows.flatten()]).square()
    boundary = float(squares.mean()) if squares.numel() else float(covariance.diagonal().mean())
    return PatchPrior(mean, covariance, max(boundary, 1e-12))


def read_mask(grad_pos_embed: torch.Tensor) -> torch.Tensor:
    """The masked positions: the rows of ``dL/dpos_embed`` (``[N, D]`` or ``[1, N, D]``) that are exactly zero."""
    if not isinstance(grad_pos_embed, torch.Tensor) or grad_pos_embed.dim() not in (2, 3):
        raise ValueError(f"grad_pos_embed must be [N, D] or [1, N, D], got {getattr(grad_pos_embed, 'shape', None)}")
    rows = grad_pos_embed.reshape(-1, grad_pos_embed.shape[-1])
    return (rows == 0).all(dim=1)


@dataclass
class MJPSystem:
    """What eq. (1) determines about the patches of one client image (module docstring, items 1 and 2).

    Attributes:
        mask: bool ``[N]``, read from the zero rows of ``dL/dpos_embed``.
        patch_term: ``Bp [D, K]``, eq. (3)'s left-hand side.
        estimates: ``[N, K]``: ``p_hat_n - gamma_n hull_point`` at visible positions (the truth up to
            ``directions``), ``hull_point`` at masked ones.
        hull_point: ``[K]``, a point of the masked patches' affine hull (the masked patch itself when ``M = 1``;
            zeros when ``M = 0``).
        directions: ``[K, r]`` orthonormal, ``r = min(M - 1, K)`` (0 when ``M <= 1``): the directions eq. (1)
            leaves undetermined in every patch.
        masked_singular_values: singular values of ``F`` (the masked term outside the visible rows' span), whose
            numerical rank is ``min(M, K)``.
    """

    mask: torch.Tensor
    patch_term: torch.Tensor
    estimates: torch.Tensor
    hull_point: torch.Tensor
    directions: torch.Tensor
    masked_singular_values: torch.Tensor

    @property
    def masked_count(self) -> int:
        return int(self.mask.sum())


def _check_model(model: PrivacyViT) -> None:
    if not isinstance(model, PrivacyViT):
        raise TypeError(f"model must be a PrivacyViT, got {type(model).__name__}")


def patch_term(model: PrivacyViT, gradients: Mapping[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """``Bp = sum_t a_t p_t^T [D, K]`` (float64): eq. (1) with the known terms removed when the model's first block
    is in the attack layout (APRIL's route), else ``dL/dpatch_embed.weight`` (the same matrix, read directly).

    Args:
        model: the attacked :class:`PrivacyViT`.
        gradients: from :func:`~mjp_fast.privacy.model.client_gradients`.
        mask: bool ``[N]``, the masked positions (:func:`read_mask`).
    """
    if not model.blocks[0].attack_layout:
        # Only the attack layout gives eq. (1); the patch embedding's own gradient is Bp in every layout.
        return gradients["patch_embed.weight"].detach().double().cpu().reshape(model.pos_embed.shape[-1], -1)
    dim = model.pos_embed.shape[-1]
    weight = model.patch_embed.weight.detach().double().cpu()
    embedding = weight.reshape(dim, -1)  # E [D, K]
    bias = model.patch_embed.bias
    bias = bias.detach().double().cpu() if bias is not None else torch.zeros(dim, dtype=torch.float64)
    qkv = model.blocks[0].attn.qkv.weight.detach().double().cpu()
    grad = {name: gradients[name].detach().double().cpu() for name in ("cls_token", "pos_embed", "unk_embed")}
    rhs = qkv.t() @ gradients["blocks.0.attn.qkv.weight"].detach().double().cpu()  # R = W^T dL/dW
    grad_pos = grad["pos_embed"].reshape(-1, dim)
    pos = model.pos_embed.detach().double().cpu().reshape(-1, dim)
    visible = ~mask
    known = torch.outer(grad["cls_token"].reshape(dim), model.cls_token.detach().double().cpu().reshape(dim))
    known += grad_pos[visible].t() @ (pos[visible] + bias)
    if bool(mask.any()):
        known += torch.outer(grad["unk_embed"].reshape(dim), bias + model.unk_embed.detach().double().cpu())
    # R' = Bp E^T, so E Bp^T = R'^T: least squares in E (full column rank when D >= K)
    return torch.linalg.lstsq(embedding, (rhs - known).t(), driver="gelsd").solution.t()


def mjp_system(model: PrivacyViT, gradients: Mapping[str, torch.Tensor]) -> MJPSystem:
    """Reads the mask and solves eq. (3) as far as it is determined (module docstring, items 1 and 2).

    Args:
        model: the attacked :class:`PrivacyViT` (attack layout); the attacker knows its parameters.
        gradients: batch-1 gradients from :func:`~mjp_fast.privacy.model.client_gradients`, best in float64.
    """
    _check_model(model)
    needed = ("cls_token", "pos_embed", "unk_embed")
    needed += ("blocks.0.attn.qkv.weight",) if model.blocks[0].attack_layout else ("patch_embed.weight",)
    missing = [name for name in needed if name not in gradients]
    if missing:
        raise KeyError(f"gradients lack {missing}; pass the output of client_gradients")
    dim = model.pos_embed.shape[-1]
    grad_pos = gradients["pos_embed"].detach().double().cpu().reshape(-1, dim)
    mask = read_mask(grad_pos)
    term = patch_term(model, gradients, mask)
    patches = term.shape[1]
    visible_rows = grad_pos[~mask].t()  # A_v^T [D, V]
    unk = gradients["unk_embed"].detach().double().cpu().reshape(dim, 1)
    solution = torch.linalg.lstsq(visible_rows, torch.cat([term, unk], dim=1), driver="gelsd").solution
    visible_estimates, gamma = solution[:, :patches], solution[:, patches]
    residual = torch.cat([term, unk], dim=1) - visible_rows @ solution  # the parts outside span(A_v^T)
    outside, sigma = residual[:, :patches], residual[:, patches]  # F [D, K], sigma [D]
    singular_values = torch.linalg.svdvals(outside)
    count = int(mask.sum())
    hull_point = torch.zeros(patches, dtype=torch.float64)
    directions = torch.zeros(patches, 0, dtype=torch.float64)
    if count:
        hull_point = sigma @ outside / sigma.dot(sigma)
        if count > 1:
            # the differences' span: F with its component along sigma removed, rank min(M - 1, K)
            spread = outside - torch.outer(sigma, hull_point)
            directions = torch.linalg.svd(spread, full_matrices=False).Vh[: min(count - 1, patches)].t()
    estimates = hull_point.expand(mask.numel(), patches).clone()
    estimates[~mask] = visible_estimates - gamma[:, None] * hull_point
    return MJPSystem(mask, term, estimates, hull_point, directions, singular_values)


def _edge_selectors(channels: int, patch: int) -> dict[str, torch.Tensor]:
    """0/1 matrices ``[C P, K]`` picking a patch's top row, bottom row, left and right columns."""
    index = torch.arange(channels * patch * patch).reshape(channels, patch, patch)
    picks = {"top": index[:, 0, :], "bottom": index[:, -1, :], "left": index[:, :, 0], "right": index[:, :, -1]}
    eye = torch.eye(channels * patch * patch, dtype=torch.float64)
    return {name: eye[pick.flatten()] for name, pick in picks.items()}


TRACE_PROBES = 32  # Rademacher probes of the Hutchinson trace in complete_patches' noise estimate


def complete_patches(
    system: MJPSystem,
    prior: PatchPrior,
    grid_size: tuple[int, int],
    channels: int,
    patch_size: int,
    *,
    noise: float | None = None,
) -> tuple[torch.Tensor, float]:
    """Fills the undetermined directions of every patch from the prior (empirical Bayes); ``[N, K]`` float64.

    The coordinates ``c [N, r]`` of every position along ``system.directions`` (patch ``estimates[n] + U c_n``)
    get a Gaussian prior: energy ``sum_n (p_n - mean)^T cov^-1 (p_n - mean) + sum over adjacent pairs |facing edge
    of p - facing edge of p'|^2 / boundary_variance``, one sparse precision matrix ``H`` over ``N r`` unknowns. A
    masked position has no observation of its coordinates (its ``estimates`` is the hull point). A visible one has
    ``estimates[n]``, whose component along the lost directions is not determined by eq. (1) but is not noise
    either (``C_n P_m - gamma_n hull_point``, small when the masked tokens' gradient rows decompose on the visible
    ones as ``sigma`` does): it is read as an observation ``c_n = 0`` with noise variance ``noise`` per coordinate.
    ``noise=None`` estimates it from the data by moments: under the model, the prior-only solution's visible
    coordinates have mean square ``(trace of H^-1 over them + n noise) / n`` (the trace by Hutchinson's estimator).
    ``noise=0`` keeps the visible patches as they are; ``noise=inf`` ignores their lost directions.

    Returns:
        The completed patches ``[N, K]`` and the noise variance used.
    """
    import numpy as np
    import scipy.sparse as sparse
    import scipy.sparse.linalg as sparse_linalg

    estimates, basis = system.estimates, system.directions
    rank = basis.shape[1]
    if rank == 0:
        return estimates.clone(), 0.0
    rows, cols = grid_size
    count = rows * cols
    precision = torch.linalg.inv(prior.covariance.double())
    edge = _edge_selectors(channels, patch_size)
    centered = (estimates - prior.mean.double()).numpy()
    u = basis.numpy()
    block = u.T @ precision.numpy() @ u  # [r, r]
    hessian = sparse.kron(sparse.identity(count), sparse.csr_matrix(block), format="csr")
    gradient = -(centered @ precision.numpy() @ u).reshape(-1)
    flat = estimates.numpy().reshape(-1)
    positions = torch.arange(count).reshape(rows, cols)
    pairs = (
        (positions[:, :-1].flatten(), positions[:, 1:].flatten(), edge["right"], edge["left"]),
        (positions[:-1, :].flatten(), positions[1:, :].flatten(), edge["bottom"], edge["top"]),
    )
    for first, second, first_edge, second_edge in pairs:
        if first.numel() == 0:
            continue
        pick_first = sparse.csr_matrix(
            (np.ones(first.numel()), (np.arange(first.numel()), first.numpy())), shape=(first.numel(), count)
        )
        pick_second = sparse.csr_matrix(
            (np.ones(second.numel()), (np.arange(second.numel()), second.numpy())), shape=(second.numel(), count)
        )
        fe, se = first_edge.numpy(), second_edge.numpy()
        jacobian = sparse.kron(pick_first, fe @ u) - sparse.kron(pick_second, se @ u)
        offset = sparse.kron(pick_first, fe) @ flat - sparse.kron(pick_second, se) @ flat
        hessian = hessian + (jacobian.T @ jacobian) / prior.boundary_variance
        gradient = gradient - (jacobian.T @ offset) / prior.boundary_variance
    hessian = hessian.tocsc()
    observed = (~system.mask).numpy().repeat(rank).astype(np.float64)  # the visible positions' coordinates
    observations = int(observed.sum())
    if noise is None:
        factor = sparse_linalg.splu(hessian)
        prior_only = factor.solve(gradient)
        if observations == 0:
            noise = math.inf
        else:
            probes = np.random.default_rng(0).choice([-1.0, 1.0], size=(count * rank, TRACE_PROBES))
            probes *= observed[:, None]
            trace = float(np.einsum("ij,ij->", probes, factor.solve(probes))) / TRACE_PROBES
            noise = max(float((prior_only**2 * observed).sum()) - trace, 0.0) / observations
    if math.isinf(noise):
        coordinates = sparse_linalg.spsolve(hessian, gradient)
    elif noise == 0:
        # the visible coordinates stay at 0: the energy restricted to the masked positions' coordinates
        moving = observed == 0
        coordinates = np.zeros(count * rank)
        if moving.any():
            coordinates[moving] = sparse_linalg.spsolve(hessian[moving][:, moving], gradient[moving])
    else:
        coordinates = sparse_linalg.spsolve((hessian + sparse.diags(observed / noise)).tocsc(), gradient)
    return estimates + torch.from_numpy(coordinates).reshape(count, rank) @ basis.t(), float(noise)


def adaptive_attack(
    model: PrivacyViT,
    gradients: Mapping[str, torch.Tensor],
    *,
    prior: PatchPrior | None = None,
    unshuffle_ratio: float | None = None,
) -> torch.Tensor:
    """Reconstructs the client image as an attacker who knows MJP (module docstring); ``[1, C, H, W]`` float64.

    With no masked position (a plain model, or MJP with an empty mask) it is APRIL's exact recovery. With ``M = 1``
    it is exact too. With ``M >= 2`` the undetermined directions are filled from ``prior`` by
    :func:`complete_patches` (without a prior they keep the values of ``system.estimates``, and every masked
    position gets the hull point).

    Args:
        model: a :class:`PrivacyViT`; through eq. (1) in the attack layout, else through the patch embedding's
            gradient (:func:`patch_term`).
        gradients: the client's batch-1 gradients (float64 for exactness).
        prior: training-set patch statistics (:func:`fit_patch_prior`) at the model's patch size.
        unshuffle_ratio: when no position reads as masked (the ablation without UNK: the shuffled image is
            recovered exactly), treat the ``ceil(ratio N)`` positions whose edges fit worst as shuffled and put their
            patches back with :func:`~mjp_fast.privacy.jigsaw_solver.place_patches`. None: no unshuffling.
    """
    system = mjp_system(model, gradients)
    channels = model.patch_embed.weight.shape[1]
    grid = (model.grid_size, model.grid_size)
    patch = model.patch_size
    if prior is not None:
        if prior.mean.numel() != system.estimates.shape[1]:
            raise ValueError(
                f"prior is for {prior.mean.numel()}-value patches, the model's are {system.estimates.shape[1]}"
            )
        flat, _ = complete_patches(system, prior, grid, channels, patch)
    else:
        flat = system.estimates
    patches = flat.reshape(-1, channels, patch, patch)
    if unshuffle_ratio is not None and system.masked_count == 0:
        if not 0 <= unshuffle_ratio <= 1:
            raise ValueError(f"unshuffle_ratio must be in [0, 1], got {unshuffle_ratio}")
        suspects = suspect_positions(patches, grid, min(patches.shape[0], math.ceil(unshuffle_ratio * len(patches))))
        known = torch.ones(patches.shape[0], dtype=torch.bool)
        known[suspects] = False
        solved, _ = place_patches(patches, known, patches[suspects], grid)
        # the solver must earn its moves: keep them only when the image's edges agree better than before
        if edge_energy(solved, grid) < edge_energy(patches, grid):
            patches = solved
    return patches_image(patches, grid)[None]
