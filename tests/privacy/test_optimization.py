"""The optimization attack runs on a standard (pre-norm) model and lowers its objective (quality not asserted)."""

import pytest
import torch

from mjp_fast.privacy import PrivacyViT, client_gradients, optimization_attack
from mjp_fast.privacy.optimization import gradient_matching_objective, total_variation


@pytest.fixture(scope="module")
def standard_model() -> PrivacyViT:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return PrivacyViT(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, attack_layout=False)


def test_a_few_steps_lower_the_objective(standard_model, photos):
    _, images = photos
    image = torch.nn.functional.interpolate(images[:1].float(), size=32, mode="area")
    target = client_gradients(standard_model, image, 5)
    seen = []
    result = optimization_attack(
        standard_model, target, (3, 32, 32), steps=6, lr=0.1, callback=lambda step, value: seen.append(step)
    )
    assert result.label == 5  # read from the head's bias gradient
    assert seen == list(range(6)) and len(result.objective) == 6
    assert result.objective[-1] < result.objective[0]
    assert result.images.shape == (1, 3, 32, 32)
    assert float(result.images.min()) >= 0 and float(result.images.max()) <= 1
    assert standard_model.training  # the mode is restored


def test_objective_is_zero_for_the_client_image_without_tv(standard_model, photos):
    _, images = photos
    image = torch.nn.functional.interpolate(images[:1].float(), size=32, mode="area")
    target = client_gradients(standard_model, image, 1)
    objective = gradient_matching_objective(target, target, image, tv_weight=0.0)
    assert abs(float(objective)) < 1e-5
    with_tv = gradient_matching_objective(target, target, image, tv_weight=0.5)
    assert float(with_tv) == pytest.approx(float(objective) + 0.5 * float(total_variation(image)), abs=1e-6)
    with pytest.raises(KeyError, match="pos_embed"):
        gradient_matching_objective(target, {"head.bias": target["head.bias"]}, image)
    with pytest.raises(ValueError, match="steps"):
        optimization_attack(standard_model, target, (3, 32, 32), steps=-1)
