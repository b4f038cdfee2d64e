"""The MJP-aware analytic attack: each claim of its derivation checked numerically on a small model (float64).

Model: 16x16 images in 2-pixel patches (N = 64 positions, K = 12 values a patch), width D = 80 >= N + 1, two
blocks, the first in the attack layout. Images: the real photos of the shared fixture, averaged down to 16x16; the
rank and direction checks use uniform noise instead, whose patches are in general position (a smooth photo's
masked patches have singular values down to 1e-11 of the largest, below the float64 noise of eq. (3)'s projection,
which is about 1e-5 of the largest: the gradient rows are nearly parallel).
"""

import pytest
import torch
import torch.nn.functional as F

from mjp_fast.privacy import PrivacyViT, april_attack, client_gradients
from mjp_fast.privacy.adaptive import (
    adaptive_attack,
    complete_patches,
    fit_patch_prior,
    mjp_system,
    patch_term,
    read_mask,
)
from mjp_fast.privacy.jigsaw_solver import image_patches
from mjp_fast.privacy.metrics import psnr
from mjp_fast.sampler import Jigsaw

GRID, PATCH, WIDTH = 8, 2, 80
K = 3 * PATCH * PATCH


@pytest.fixture(scope="module")
def small_model() -> PrivacyViT:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return PrivacyViT(img_size=GRID * PATCH, patch_size=PATCH, embed_dim=WIDTH, depth=2, num_heads=4).double()


@pytest.fixture(scope="module")
def small_images(photos) -> torch.Tensor:
    _, images = photos
    return F.avg_pool2d(images, 64 // (GRID * PATCH))  # [B, 3, 16, 16]


@pytest.fixture(scope="module")
def noise_image() -> torch.Tensor:
    return torch.rand(1, 3, GRID * PATCH, GRID * PATCH, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def jigsaw_of(positions: list[int]) -> Jigsaw:
    """A jigsaw masking ``positions``, each masked position receiving the next one's patch (a cycle)."""
    mask = torch.zeros(1, GRID * GRID, dtype=torch.bool)
    perm = torch.arange(GRID * GRID)[None].clone()
    mask[0, positions] = True
    for index, position in enumerate(positions):
        perm[0, position] = positions[(index + 1) % len(positions)]
    return Jigsaw(mask, perm)


def token_gradients(model: PrivacyViT, image: torch.Tensor, label: int, jigsaw: Jigsaw | None) -> torch.Tensor:
    """The true ``dL/dz0 [T, D]`` (what the attacker does not see at masked positions)."""
    tokens = model.tokens(image, jigsaw).detach().requires_grad_(True)
    hidden = tokens
    for block in model.blocks:
        hidden = block(hidden)
    loss = F.cross_entropy(model.head(model.norm(hidden[:, 0])), torch.tensor([label]))
    (grad,) = torch.autograd.grad(loss, tokens)
    return grad[0]


def token_patches(image: torch.Tensor, jigsaw: Jigsaw) -> torch.Tensor:
    """``[N, K]``: the patch each position's token carries (position ``n`` carries patch ``perm[n]``)."""
    return image_patches(image[0], PATCH).flatten(1)[jigsaw.perm[0]]


def test_plain_model_gives_april_exact_recovery(small_model, small_images):
    for index in range(small_images.shape[0]):
        image = small_images[index : index + 1]
        gradients = client_gradients(small_model, image, index % 10)
        recovered = adaptive_attack(small_model, gradients)
        assert float(psnr(recovered.clamp(0, 1), image)) >= 60
        assert float(psnr(april_attack(small_model, gradients).clamp(0, 1), image)) >= 60  # APRIL: as exact


def test_standard_model_is_attacked_through_the_patch_embedding_gradient(small_images):
    # no attack layout (pre-norm, residual): APRIL's eq. (1) is gone, dL/dpatch_embed.weight still gives Bp
    with torch.random.fork_rng():
        torch.manual_seed(1)
        standard = PrivacyViT(img_size=16, patch_size=2, embed_dim=WIDTH, depth=2, attack_layout=False).double()
    image = small_images[:1]
    assert float(psnr(adaptive_attack(standard, client_gradients(standard, image, 2)).clamp(0, 1), image)) >= 60
    gradients = client_gradients(standard, image, 2, jigsaw_of([9, 10, 17, 18]))
    assert torch.equal(mjp_system(standard, gradients).mask, jigsaw_of([9, 10, 17, 18]).mask[0])


def test_mjp_model_with_no_masked_position_is_exact(small_model, small_images):
    empty = Jigsaw(torch.zeros(1, GRID * GRID, dtype=torch.bool), torch.arange(GRID * GRID)[None])
    for index in range(small_images.shape[0]):
        image = small_images[index : index + 1]
        gradients = client_gradients(small_model, image, 3, empty)
        assert not bool(read_mask(gradients["pos_embed"]).any())
        assert float(psnr(adaptive_attack(small_model, gradients).clamp(0, 1), image)) >= 60


def test_one_masked_position_is_exact(small_model, small_images):
    # M = 1: dL/dunk_embed is that token's own gradient row, so nothing is lost
    image = small_images[:1]
    gradients = client_gradients(small_model, image, 1, jigsaw_of([27]))
    system = mjp_system(small_model, gradients)
    assert system.masked_count == 1 and system.directions.shape == (K, 0)
    assert float(psnr(adaptive_attack(small_model, gradients).clamp(0, 1), image)) >= 60


@pytest.mark.parametrize("positions", [[0], [9, 10, 17, 18], list(range(20, 36))])
def test_mask_is_read_from_the_zero_rows(small_model, small_images, positions):
    jigsaw = jigsaw_of(positions)
    gradients = client_gradients(small_model, small_images[1:2], 4, jigsaw)
    assert torch.equal(read_mask(gradients["pos_embed"]), jigsaw.mask[0])
    plain = client_gradients(small_model, small_images[1:2], 4)
    assert not bool(read_mask(plain["pos_embed"]).any())  # a visible row is never exactly zero


def test_patch_term_is_the_patch_embedding_gradient(small_model, small_images):
    # eq. (1) minus the known terms is Bp = sum_t a_t p_t^T, which is dL/dpatch_embed.weight itself
    jigsaw = jigsaw_of([9, 10, 17, 18, 19])
    gradients = client_gradients(small_model, small_images[2:3], 5, jigsaw)
    term = patch_term(small_model, gradients, jigsaw.mask[0])
    weight_gradient = gradients["patch_embed.weight"].reshape(WIDTH, K)
    assert float((term - weight_gradient).norm() / weight_gradient.norm()) < 1e-9


@pytest.mark.parametrize("count", [2, 5, 11, 16])
def test_masked_term_has_rank_min_m_k(small_model, noise_image, count):
    positions = list(range(8, 8 + count))
    jigsaw = jigsaw_of(positions)
    image = noise_image
    gradients = client_gradients(small_model, image, 6, jigsaw)
    grad_tokens = token_gradients(small_model, image, 6, jigsaw)[1:]  # [N, D]
    patches = token_patches(image, jigsaw)
    mask = jigsaw.mask[0]
    masked_term = grad_tokens[mask].t() @ patches[mask]  # A_m^T P_m [D, K]
    system = mjp_system(small_model, gradients)
    # eq. (3): Bp = A_v^T P_v + A_m^T P_m
    visible_term = grad_tokens[~mask].t() @ patches[~mask]
    torch.testing.assert_close(
        system.patch_term, visible_term + masked_term, rtol=1e-8, atol=1e-8 * masked_term.abs().max()
    )
    expected = min(count, K)
    true_values = torch.linalg.svdvals(masked_term)
    true_values = true_values / true_values[0]
    assert float(true_values[expected - 1]) > 1e-13, true_values  # rank min(M, K): float64 noise is ~1e-17 here
    if expected < K:
        assert float(true_values[expected]) < 1e-15, true_values
    # what the attacker sees of it, F (the masked term outside the visible rows' span), has the same rank; its
    # float64 noise is ~1e-5 of the largest value, so the gap shows where the masked patches' spread is above it
    seen = system.masked_singular_values / system.masked_singular_values[0]
    if count <= 5:
        assert float(seen[expected - 1]) > 10 * float(seen[expected]), seen


@pytest.mark.parametrize("count", [3, 7])
def test_determined_directions(small_model, noise_image, count):
    positions = [9, 10, 11, 17, 18, 19, 25][:count]
    jigsaw = jigsaw_of(positions)
    image = noise_image
    gradients = client_gradients(small_model, image, 7, jigsaw)
    system = mjp_system(small_model, gradients)
    patches = token_patches(image, jigsaw)
    mask = jigsaw.mask[0]
    masked = patches[mask]
    basis = system.directions
    assert basis.shape == (K, count - 1)
    torch.testing.assert_close(basis.t() @ basis, torch.eye(count - 1, dtype=torch.float64), rtol=0, atol=1e-10)
    # the lost directions are the span of the masked patches' differences
    differences = torch.linalg.svd((masked[1:] - masked[:1]).t(), full_matrices=False).U
    assert float(torch.linalg.svdvals(differences.t() @ basis).min()) > 1 - 1e-6
    # the hull point is an affine combination of the masked patches
    system_matrix = torch.cat([masked.t(), torch.ones(1, count, dtype=torch.float64)])
    target = torch.cat([system.hull_point, torch.ones(1, dtype=torch.float64)])
    weights = torch.linalg.lstsq(system_matrix, target[:, None]).solution
    assert float((system_matrix @ weights)[:, 0].sub(target).norm()) < 1e-6 * float(target.norm())
    # every visible patch is exact outside the lost directions, and only there wrong
    error = system.estimates[~mask] - patches[~mask]
    outside = error - error @ basis @ basis.t()
    assert float(outside.norm()) < 1e-6 * float(patches[~mask].norm())
    assert float(error.norm()) > 1e-4 * float(patches[~mask].norm())  # the lost part is really lost


def test_gauge_leaves_every_first_layer_gradient_alone(small_model, small_images):
    # A_m^T -> A_m^T H^-1, P_m -> H P_m with H 1 = 1 keeps Bp and dL/dunk = A_m^T 1: the count's missing equations
    jigsaw = jigsaw_of([9, 10, 17, 18])
    image = small_images[0:1]
    grad_tokens = token_gradients(small_model, image, 2, jigsaw)[1:]
    patches = token_patches(image, jigsaw)
    mask = jigsaw.mask[0]
    rows, masked = grad_tokens[mask], patches[mask]
    generator = torch.Generator().manual_seed(0)
    mixing = torch.eye(4, dtype=torch.float64) + 0.3 * torch.rand(4, 4, generator=generator, dtype=torch.float64)
    mixing = mixing / mixing.sum(1, keepdim=True)  # H 1 = 1
    other_rows = (rows.t() @ torch.linalg.inv(mixing)).t()
    other_patches = mixing @ masked
    assert float((other_patches - masked).abs().max()) > 1e-2
    torch.testing.assert_close(other_rows.t() @ other_patches, rows.t() @ masked, rtol=1e-10, atol=1e-20)
    torch.testing.assert_close(other_rows.sum(0), rows.sum(0), rtol=1e-10, atol=1e-20)


def test_prior_moves_patches_along_the_lost_directions_only(small_model, small_images):
    jigsaw = jigsaw_of([9, 10, 11, 17, 18, 19])
    image = small_images[2:3]
    gradients = client_gradients(small_model, image, 1, jigsaw)
    system = mjp_system(small_model, gradients)
    prior = fit_patch_prior(small_images, PATCH)
    assert prior.mean.shape == (K,) and prior.covariance.shape == (K, K) and prior.boundary_variance > 0
    mask, basis = system.mask, system.directions
    kept, noise = complete_patches(system, prior, (GRID, GRID), 3, PATCH, noise=0.0)
    assert noise == 0.0
    torch.testing.assert_close(kept[~mask], system.estimates[~mask], rtol=0, atol=0)
    free, _ = complete_patches(system, prior, (GRID, GRID), 3, PATCH, noise=float("inf"))
    estimated, noise = complete_patches(system, prior, (GRID, GRID), 3, PATCH)
    assert noise >= 0
    for completed in (kept, free, estimated):
        # every patch moves along the lost directions only; the holes stay on the masked patches' affine hull
        moved = completed - system.estimates
        torch.testing.assert_close(moved, moved @ basis @ basis.t(), rtol=0, atol=1e-10)
        assert float(moved[mask].norm()) > 0
    assert float((free - system.estimates)[~mask].norm()) > 0
    # the estimated noise puts the visible patches between kept (noise 0) and free (noise inf)
    shift = lambda completed: float((completed - system.estimates)[~mask].norm())  # noqa: E731
    assert shift(kept) <= shift(estimated) <= shift(free) + 1e-12
    attacked = adaptive_attack(small_model, gradients, prior=prior)
    assert attacked.shape == image.shape


def test_errors(small_model, small_images):
    gradients = client_gradients(small_model, small_images[:1], 0)
    with pytest.raises(TypeError, match="model"):
        adaptive_attack(torch.nn.Linear(2, 2), gradients)
    with pytest.raises(KeyError, match="unk_embed"):
        adaptive_attack(small_model, {k: v for k, v in gradients.items() if k != "unk_embed"})
    wrong = fit_patch_prior(small_images, 4)
    with pytest.raises(ValueError, match="prior"):
        adaptive_attack(small_model, gradients, prior=wrong)
    with pytest.raises(ValueError, match="grad_pos_embed"):
        read_mask(torch.zeros(4))
