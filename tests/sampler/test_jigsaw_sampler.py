import pytest
import torch

import mjp_fast


def test_training_calls_advance_the_stream():
    sampler = mjp_fast.JigsawSampler((4, 5), ratio=0.5, prob=1.0, seed=9, min_block=2)
    first, second = sampler(3, torch.device("cpu")), sampler(2, torch.device("cpu"))
    assert sampler.samples_seen == 5
    expected = mjp_fast.sample_jigsaw(5, (4, 5), 0.5, seed=9, min_block=2)
    assert torch.equal(torch.cat((first.mask, second.mask)), expected.mask)
    assert torch.equal(torch.cat((first.perm, second.perm)), expected.perm)


def test_settings_changed_between_steps_take_effect():
    # The sampler keeps its plan between steps; a changed setting (the loop sets prob per epoch), backend or dtype
    # move makes it again, so each call draws what sample_jigsaw draws with the settings of that call.
    sampler = mjp_fast.JigsawSampler((4, 5), ratio=0.5, prob=1.0, seed=9, min_block=2)
    cpu = torch.device("cpu")
    calls = [dict(), dict(prob=0.5), dict(ratio=0.25, seed=4), dict(backend="torch"), dict(backend=None)]
    seen = 0
    for changes in calls:
        for name, value in changes.items():
            setattr(sampler, name, value)
        if changes.get("backend") is None and "backend" in changes:
            sampler.double()  # an nn.Module conversion: the buffers the plan holds are replaced
        jigsaw = sampler(3, cpu)
        expected = mjp_fast.sample_jigsaw(
            3, (4, 5), sampler.ratio, seed=sampler.seed, offset=seen, prob=sampler.prob, min_block=2
        )
        assert torch.equal(jigsaw.mask, expected.mask) and torch.equal(jigsaw.perm, expected.perm), changes
        seen += 3
    assert sampler.samples_seen == seen


def test_min_aspect_changed_between_steps_takes_effect():
    # min_aspect shapes the sampler's tables (made in __init__) and its plan: set on the module, the next call draws
    # with it, in training and inside jigsaw_eval.
    sampler = mjp_fast.JigsawSampler((6, 7), ratio=0.5, prob=1.0, seed=9, min_block=2)
    cpu = torch.device("cpu")
    seen = 0
    for min_aspect in (0.3, 0.9, 0.3):
        sampler.min_aspect = min_aspect
        jigsaw = sampler(4, cpu)
        expected = mjp_fast.sample_jigsaw(4, (6, 7), 0.5, seed=9, offset=seen, min_block=2, min_aspect=min_aspect)
        assert torch.equal(jigsaw.mask, expected.mask) and torch.equal(jigsaw.perm, expected.perm), min_aspect
        seen += 4
    different = mjp_fast.sample_jigsaw(4, (6, 7), 0.5, seed=9, offset=0, min_block=2, min_aspect=0.9)
    first = mjp_fast.sample_jigsaw(4, (6, 7), 0.5, seed=9, offset=0, min_block=2, min_aspect=0.3)
    assert not torch.equal(different.mask, first.mask)  # the setting matters for these draws
    sampler.eval()
    sampler.min_aspect = 0.9
    with sampler.jigsaw_eval(ratio=0.5, seed=9):
        jigsaw = sampler(4, cpu)
    assert torch.equal(jigsaw.mask, different.mask) and torch.equal(jigsaw.perm, different.perm)


def test_eval_mode_is_plain_unless_asked():
    sampler = mjp_fast.JigsawSampler(4, ratio=0.5, prob=1.0).eval()
    assert sampler(2, torch.device("cpu")) is None
    with sampler.jigsaw_eval(ratio=0.5, seed=3):
        a = sampler(2, torch.device("cpu"))
    with sampler.jigsaw_eval(ratio=0.5, seed=3):
        b = sampler(2, torch.device("cpu"))
    assert torch.equal(a.perm, b.perm) and a.mask.any()
    assert sampler.samples_seen == 0  # eval draws do not move the training stream


def test_eval_stream_continues_across_entries_with_start():
    sampler = mjp_fast.JigsawSampler((4, 5), ratio=0.5, prob=1.0, min_block=2).eval()
    with sampler.jigsaw_eval(ratio=0.5, seed=11):
        whole = sampler(5, torch.device("cpu"))
    parts = []
    for start, batch in ((0, 2), (2, 3)):
        with sampler.jigsaw_eval(ratio=0.5, seed=11, start=start):
            parts.append(sampler(batch, torch.device("cpu")))
    assert torch.equal(torch.cat([part.perm for part in parts]), whole.perm)
    assert torch.equal(torch.cat([part.mask for part in parts]), whole.mask)
    with pytest.raises(ValueError, match="start"):
        with sampler.jigsaw_eval(start=-1):
            pass


def test_other_grids_and_inactive_settings():
    sampler = mjp_fast.JigsawSampler(4, ratio=0.5, prob=1.0, min_block=2)
    assert sampler(2, torch.device("cpu"), grid_size=(3, 6)).mask.shape == (2, 18)
    assert mjp_fast.JigsawSampler(4, ratio=0.0)(2, torch.device("cpu")) is None
    assert mjp_fast.JigsawSampler(4, prob=0.0)(2, torch.device("cpu")) is None


def test_counter_is_checkpointed():
    sampler = mjp_fast.JigsawSampler(4, ratio=0.5, prob=1.0)
    sampler(7, torch.device("cpu"))
    restored = mjp_fast.JigsawSampler(4, ratio=0.5, prob=1.0)
    restored.load_state_dict(sampler.state_dict())
    assert restored.samples_seen == 7
    assert set(sampler.state_dict()) == {"sample_counter"}


@pytest.mark.parametrize(
    "kwargs, error", [(dict(ratio=1.5), ValueError), (dict(seed=-2), ValueError), (dict(shared="yes"), TypeError)]
)
def test_bad_settings(kwargs, error):
    with pytest.raises(error):
        mjp_fast.JigsawSampler(4, **kwargs)


def test_an_index_less_cuda_device_means_the_current_one(monkeypatch):
    from mjp_fast._validate import canonical_device, to_device

    assert canonical_device(torch.device("cpu")) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert canonical_device(torch.device("cuda")) == torch.device("cuda:1")
    assert canonical_device(torch.device("cuda:0")) == torch.device("cuda:0")
    assert to_device("cuda") == torch.device("cuda:1") and to_device(None) == torch.device("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("name", ["cuda", "cuda:0"])
def test_cuda_offset_and_sampler_with_and_without_an_index(name):
    with torch.cuda.device(0):
        offset = torch.tensor(7, device="cuda:0")
        jigsaw = mjp_fast.sample_jigsaw(4, 14, 0.3, seed=2, offset=offset, device=name)
        expected = mjp_fast.sample_jigsaw(4, 14, 0.3, seed=2, offset=7)
        assert torch.equal(jigsaw.perm.cpu(), expected.perm) and torch.equal(jigsaw.mask.cpu(), expected.mask)
        sampler = mjp_fast.JigsawSampler(14, 0.3, prob=1.0, seed=2).to("cuda:0")
        drawn = sampler(4, torch.device(name))
        assert drawn.perm.device == torch.device("cuda:0")
