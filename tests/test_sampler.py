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
