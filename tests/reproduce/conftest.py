import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
CIFAR10 = REPO_ROOT.parent / "shared" / "data" / "cifar10"


@pytest.fixture(scope="session")
def cifar_sample(tmp_path_factory):
    """All ten classes, 5 training and 4 test images each, linked from the real CIFAR-10 (nothing copied)."""
    if not CIFAR10.is_dir():
        pytest.skip(f"real CIFAR-10 not found at {CIFAR10} (the repository's ../shared/data/cifar10)")
    root = tmp_path_factory.mktemp("cifar")
    for split, count in (("train", 5), ("test", 4)):
        for folder in sorted((CIFAR10 / split).iterdir()):
            target = root / split / folder.name
            target.mkdir(parents=True)
            for image in sorted(folder.iterdir())[:count]:
                os.symlink(image, target / image.name)
    return root
