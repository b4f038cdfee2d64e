"""Checkpoints written before the MJP core (``mjp_fast.core``) existed load into today's modules, and the same seeds
make the same modules.

``data/checkpoints_before_core.pt`` was written by the code of commit 0f28575 (before the core), by the ``_models``
below: per model its state dict, the order of its parameters (which optimizer checkpoints index), and its outputs in
training mode (one jigsawed batch) and eval mode on the stored images.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import timm
import torch

import mjp_fast
from mjp_fast import MJPPatchEmbed

SNAPSHOT = Path(__file__).parent / "data" / "checkpoints_before_core.pt"

# The MJP keys each model had then (the rest are timm's own, or MJPPatchEmbed's proj and pos_embed).
MJP_KEYS = {
    "vit_fused": [
        "mjp.unk_embed", "mjp.sampler.sample_counter", "mjp.dal_regressor.net.0.weight", "mjp.dal_regressor.net.0.bias",
        "mjp.dal_regressor.net.2.weight", "mjp.dal_regressor.net.2.bias",
    ],
    "vit_unfused_nounk_linear": [
        "mjp.sampler.sample_counter", "mjp.dal_regressor.net.weight", "mjp.dal_regressor.net.bias",
    ],
    "eva": [
        "mjp.unk_embed", "mjp.sampler.sample_counter", "mjp.dal_regressor.net.0.weight", "mjp.dal_regressor.net.0.bias",
        "mjp.dal_regressor.net.2.weight", "mjp.dal_regressor.net.2.bias",
    ],
    "embed_dal": [
        "pos_embed", "unk_embed", "sampler.sample_counter", "proj.weight", "proj.bias", "dal_regressor.net.0.weight",
        "dal_regressor.net.0.bias", "dal_regressor.net.2.weight", "dal_regressor.net.2.bias",
    ],
    "embed_nounk": [
        "pos_embed", "sampler.sample_counter", "proj.weight", "proj.bias", "dal_regressor.net.weight",
        "dal_regressor.net.bias",
    ],
    "embed_plain": ["pos_embed", "unk_embed", "sampler.sample_counter", "proj.weight", "proj.bias"],
}  # fmt: skip


TINY = dict(img_size=32, patch_size=8, embed_dim=16, depth=1, num_heads=2, num_classes=5)


def _models() -> dict[str, torch.nn.Module]:
    """The models of the snapshot, each made after its own seed (as the script that wrote it did)."""
    jigsaw = dict(ratio=0.3, prob=1.0, seed=3)

    def vit() -> torch.nn.Module:
        return timm.create_model("vit_tiny_patch16_224", **TINY)

    makers = {
        "vit_fused": lambda: mjp_fast.convert(vit(), dal="nonlinear", **jigsaw),
        "vit_unfused_nounk_linear": lambda: mjp_fast.convert(
            vit(), dal="linear", unk=False, fused_patch_embed=False, **jigsaw
        ),
        "eva": lambda: mjp_fast.convert(timm.create_model("vit_pe_core_tiny_patch16_384", **TINY), **jigsaw),
        "embed_dal": lambda: MJPPatchEmbed(32, 8, 3, 16, dal="nonlinear", **jigsaw),
        "embed_nounk": lambda: MJPPatchEmbed(32, 8, 3, 16, unk=False, dal="pca", **jigsaw),
        "embed_plain": lambda: MJPPatchEmbed(32, 8, 3, 16, **jigsaw),
    }
    models = {}
    for seed, (name, make) in enumerate(makers.items()):
        torch.manual_seed(seed + (seed >= 3))  # the script's seeds: 0, 1, 2, then 4, 5, 6
        models[name] = make()
    return models


@pytest.fixture(scope="module")
def snapshot() -> dict:
    return torch.load(SNAPSHOT, weights_only=True)


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    return _models()


@pytest.mark.parametrize("name", list(MJP_KEYS))
def test_an_old_checkpoint_loads_strictly_and_gives_the_old_outputs(name, snapshot, models):
    old, model = snapshot[name], models[name]
    assert [key for key in old["state_dict"] if key in MJP_KEYS[name]] == MJP_KEYS[name]
    assert set(model.state_dict()) == set(old["state_dict"])
    assert [key for key, _ in model.named_parameters()] == old["parameters"]  # optimizer checkpoints index these
    model.load_state_dict(old["state_dict"])  # strict
    sampler = model.mjp.sampler if hasattr(model, "mjp") else model.sampler
    assert int(sampler.sample_counter) == 2  # the counter after the snapshot's training batch
    sampler.sample_counter.zero_()  # the stream where the snapshot's training output was drawn
    model.train()
    with torch.no_grad():
        # float32 rounding only: the snapshot was computed at another torch thread count than a test worker may
        # use (CI runs 2 workers), and a matmul's summation order follows the threads
        torch.testing.assert_close(model(snapshot["images"]), old["train_out"], rtol=1e-5, atol=1e-6)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(snapshot["images"]), old["eval_out"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(MJP_KEYS))
def test_the_same_seed_makes_the_same_weights(name, snapshot, models):
    state = models[name].state_dict()
    for key, value in snapshot[name]["state_dict"].items():
        if key.endswith("sample_counter"):
            continue  # the snapshot's counter is after one training batch; a fresh model's is zero
        torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)
