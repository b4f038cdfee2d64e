"""DDP under torchrun: two CPU processes (gloo) train one model; rank 0 writes; each rank draws its own jigsaws."""

import json
import subprocess
import sys

import pytest

from mjp_fast.train.checkpoint import load_checkpoint
from tests.train.helpers import REPO_ROOT, tiny_overrides


@pytest.mark.slow
def test_two_processes_under_torchrun(cifar_tree, tmp_path):
    output = tmp_path / "ddp"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "-m", "mjp_fast.cli", "train", "--data", str(cifar_tree), "--output", str(output),
        *tiny_overrides(repeated_aug=False, mixup=0.0, cutmix=0.0, warmup_epochs=0),
    ]  # fmt: skip
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    # rank 0 alone prints: the epoch's record, and its log line after the first batch (progress off: no bar)
    assert result.stdout.count("epoch   1/2  loss ") == 1 and result.stdout.count("epoch   1/2  batch 1/3 ") == 1
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    # 48 images over 2 ranks of batch 8: 3 steps per epoch; the loss is averaged over both ranks' samples
    assert [record["step"] for record in records] == [3, 6]
    checkpoint = load_checkpoint(output / "last.pt")
    # each rank's sampler counted its own samples: 2 epochs x 3 steps x 8
    assert int(checkpoint["state_dict"]["mjp.sampler.sample_counter"]) == 48
    assert checkpoint["config"]["batch_size"] == 8 and checkpoint["config"]["lr"] == 1e-3
