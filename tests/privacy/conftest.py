"""Shared fixtures of the privacy tests: real photos at 64x64, the attacked model, one thread per worker."""

from pathlib import Path

import pytest
import torch

from mjp_fast.privacy import PrivacyViT, load_images
from mjp_fast.privacy.settings import SAMPLE_PHOTOS, square_picture

IMAGENET_SAMPLES = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "imagenet-samples"


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    # The matrices are small: with two xdist workers on two cores, more threads only contend.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def photos() -> tuple[list[str], torch.Tensor]:
    """Three of scikit-image's sample photos and, when ../shared/data is there, two ImageNet images."""
    names = ["astronaut", "chelsea", "coffee"]
    pictures = [square_picture(SAMPLE_PHOTOS[name](), 64) for name in names]
    if IMAGENET_SAMPLES.is_dir():
        imagenet_names, imagenet = load_images(IMAGENET_SAMPLES, 64, max_images=2)
        names += imagenet_names
        pictures += list(imagenet)
    return names, torch.stack(pictures)


@pytest.fixture(scope="session")
def attack_model() -> PrivacyViT:
    """The small model of ``mjp attack``, first block in the attack layout, in float64."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return PrivacyViT(img_size=64, patch_size=8, embed_dim=256, depth=4, num_heads=4, num_classes=10).double()
