"""Accuracy, consistency and diff-norm against hand-computed values, and the two jigsaw protocols."""

import pytest
import timm
import torch

import mjp_fast.timm as mjp_timm
from mjp_fast.evaluate.metrics import (
    ClassificationMeter,
    accuracy,
    consistency,
    diff_norm,
    evaluate_model,
    feature_distances,
    resolve_jigsaw_mode,
    topk_correct,
)
from mjp_fast.sampler import sample_jigsaw

LOGITS = torch.tensor(
    [
        [0.1, 0.9, 0.0, 0.0, 0.0, 0.0],  # predicts 1
        [0.5, 0.1, 0.2, 0.3, 0.4, 0.0],  # order 0, 4, 3, 2, 1, 5
        [0.0, 0.0, 0.0, 0.0, 0.1, 0.2],  # predicts 5, then 4
        [1.0, 2.0, 3.0, 4.0, 5.0, 6.0],  # order 5, 4, 3, 2, 1, 0
    ]
)
TARGETS = torch.tensor([1, 1, 4, 0])


def test_topk_by_hand():
    # sample 0: top-1 hit; 1: label 1 is 5th -> top-5 hit only; 2: label 4 is 2nd -> top-5; 3: label 0 is 6th -> miss
    assert topk_correct(LOGITS, TARGETS, (1, 2, 5)) == {1: 1, 2: 2, 5: 3}
    assert accuracy(LOGITS, TARGETS, (1, 5)) == {1: 25.0, 5: 75.0}
    # k larger than the number of classes counts every sample
    assert topk_correct(LOGITS[:, :3], torch.tensor([0, 0, 2, 1]), (1, 5)) == {1: 1, 5: 4}


def test_consistency_and_diff_norm_by_hand():
    jigsawed = LOGITS.clone()
    jigsawed[0] = torch.tensor([0.9, 0.1, 0, 0, 0, 0])  # prediction 1 -> 0 changes
    jigsawed[3] = torch.tensor([6.0, 5, 4, 3, 2, 1])  # 5 -> 0 changes
    assert consistency(LOGITS, jigsawed) == 50.0
    features = torch.tensor([[0.0, 0.0], [1.0, 1.0], [2.0, 0.0]])
    shifted = torch.tensor([[3.0, 4.0], [1.0, 1.0], [2.0, 1.0]])  # distances 5, 0, 1
    assert feature_distances(features, shifted).tolist() == [5.0, 0.0, 1.0]
    assert diff_norm(features, shifted) == pytest.approx(2.0)


def test_meter_sums_batches():
    meter = ClassificationMeter()
    meter.update(LOGITS[:2], TARGETS[:2], loss_sum=1.0, logits_jigsawed=LOGITS[:2], features=torch.zeros(2, 3),
                 features_jigsawed=torch.ones(2, 3))  # fmt: skip
    meter.update(LOGITS[2:], TARGETS[2:], loss_sum=3.0)  # no jigsawed forward for this batch
    result = meter.result()
    assert result["top1"] == 25.0 and result["top5"] == 75.0 and result["loss"] == 1.0 and result["images"] == 4
    assert result["consistency"] == 100.0
    assert result["diff_norm"] == pytest.approx(3**0.5)


def _loader(count=12, size=16, batch=5, seed=0):
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (count, 3, size, size), dtype=torch.uint8, generator=generator)
    targets = torch.randint(0, 4, (count,), generator=generator)
    return [(images[i : i + batch], targets[i : i + batch]) for i in range(0, count, batch)]


def _vit(**kwargs):
    torch.manual_seed(0)
    defaults = dict(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, num_classes=4)
    return timm.create_model("vit_tiny_patch16_224", **{**defaults, **kwargs}).eval()


MEAN, STD = torch.full((3,), 0.5), torch.full((3,), 0.25)


def test_a_model_blind_to_positions_is_fully_consistent():
    # no position embedding, no class token, average pooling: a jigsaw of the patches changes nothing
    model = _vit(pos_embed="none", class_token=False, global_pool="avg")
    result = evaluate_model(model, _loader(), device="cpu", mean=MEAN, std=STD, ratio=0.5, jigsaw="pixel")
    assert result["consistency"] == 100.0
    assert result["diff_norm"] == pytest.approx(0.0, abs=1e-5)


def test_results_match_a_direct_computation():
    model = _vit()
    loader = _loader()
    result = evaluate_model(model, loader, device="cpu", mean=MEAN, std=STD, ratio=0.5, seed=3, jigsaw="pixel")
    images = torch.cat([batch for batch, _ in loader]).float() / 255
    targets = torch.cat([target for _, target in loader])
    normalized = (images - 0.5) / 0.25
    with torch.no_grad():
        logits = model(normalized)
        # the same jigsaws, drawn in one go: sample i of the pass gets the stream's index i
        jigsaw = sample_jigsaw(len(images), (4, 4), 0.5, seed=3, offset=0, prob=1.0)
        shuffled = mjp_fast_jigsaw(normalized, jigsaw)
        logits_jigsawed = model(shuffled)
        features = model.forward_head(model.forward_features(normalized), pre_logits=True)
        features_jigsawed = model.forward_head(model.forward_features(shuffled), pre_logits=True)
    assert result["top1"] == pytest.approx(accuracy(logits, targets, (1,))[1])
    assert result["consistency"] == pytest.approx(consistency(logits, logits_jigsawed))
    assert result["diff_norm"] == pytest.approx(diff_norm(features, features_jigsawed), rel=1e-5)
    assert result["images"] == 12


def mjp_fast_jigsaw(images, jigsaw):
    from mjp_fast import jigsaw_images

    return jigsaw_images(images, jigsaw, 4)


def test_unk_protocol_uses_the_same_jigsaws_as_the_pixel_protocol():
    model = mjp_timm.convert(_vit(), ratio=0.1, prob=0.5, dal=None).eval()
    seen = []
    original = model.mjp.sampler.forward

    def record(*args, **kwargs):
        jigsaw = original(*args, **kwargs)
        seen.append(jigsaw)
        return jigsaw

    model.mjp.sampler.forward = record
    loader = _loader()
    result = evaluate_model(model, loader, device="cpu", mean=MEAN, std=STD, ratio=0.5, seed=7, jigsaw="unk")
    drawn = [jigsaw for jigsaw in seen if jigsaw is not None]
    assert [len(jigsaw.mask) for jigsaw in drawn] == [5, 5, 2]  # one jigsawed forward per batch, none plain
    expected = sample_jigsaw(12, (4, 4), 0.5, seed=7, offset=0, prob=1.0)
    torch.testing.assert_close(torch.cat([jigsaw.mask for jigsaw in drawn]), expected.mask)
    torch.testing.assert_close(torch.cat([jigsaw.perm for jigsaw in drawn]), expected.perm)
    assert 0.0 <= result["consistency"] <= 100.0 and result["diff_norm"] > 0
    # the model's training stream was not touched
    assert int(model.mjp.sampler.sample_counter) == 0


def test_jigsaw_mode_resolution():
    plain = _vit()
    converted = mjp_timm.convert(_vit(), dal=None)
    assert resolve_jigsaw_mode(plain, "auto") == "pixel"
    assert resolve_jigsaw_mode(converted, "auto") == "unk"
    assert resolve_jigsaw_mode(converted, "pixel") == "pixel"
    with pytest.raises(ValueError, match="needs an MJP ViT"):
        resolve_jigsaw_mode(plain, "unk")
    with pytest.raises(ValueError, match="jigsaw must be one of"):
        resolve_jigsaw_mode(plain, "random")
