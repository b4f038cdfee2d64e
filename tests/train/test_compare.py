"""``compare=true``: the comparison's curves of both runs, and what Ctrl-C in either run says and keeps."""

import json

import pytest
from PIL import Image

from mjp_fast.cli import main
from mjp_fast.train import compare
from tests.train.helpers import tiny_overrides
from tests.train.test_loop import _interrupt_line, _killed_after

STEPS_PER_RUN = 6  # the tiny CIFAR tree's 48 images in batches of 8, one epoch


def _compare_arguments(cifar_tree, output) -> list[str]:
    overrides = tiny_overrides(compare=True, epochs=1, warmup_epochs=0)
    return ["train", "--data", str(cifar_tree), "--output", str(output), *overrides]


def test_ctrl_c_in_the_second_run_keeps_the_first_and_resume_finishes_the_comparison(
    cifar_tree, tmp_path, capsys, monkeypatch
):
    output = tmp_path / "compare"
    with _killed_after(STEPS_PER_RUN + 2, KeyboardInterrupt):  # the baseline done, the MJP run at its third step
        assert main(_compare_arguments(cifar_tree, output)) == 130
    err = capsys.readouterr().err
    assert _interrupt_line(err) == (
        f"mjp train: interrupted in the mjp run of the comparison in {output} (baseline: last.pt, the finished run; "
        f"mjp: no checkpoint yet); continue with mjp train --output {output} --resume"
    )
    assert not (output / "curves.png").exists()

    drawn = []
    original = compare.write_curves

    def recording(histories, path, title=""):
        drawn.append((path, histories))
        return original(histories, path, title)

    monkeypatch.setattr(compare, "write_curves", recording)
    assert main(["train", "--output", str(output), "--resume"]) == 0
    assert "finished already" in capsys.readouterr().out  # the baseline's
    # both runs' records on the same axes, in the comparison's folder
    ((path, histories),) = drawn
    assert path == output / "curves.png" and list(histories) == ["baseline", "mjp"]
    for name, history in histories.items():
        records = [json.loads(line) for line in (output / name / "metrics.jsonl").read_text().splitlines()]
        assert history == records and len(records) == 1
        assert (output / name / "curves.png").is_file()  # and each run's own
    with Image.open(path) as image:
        image.load()
        assert image.format == "PNG"


@pytest.mark.parametrize("checkpoint_steps", [0, 2])
def test_ctrl_c_in_the_first_run_says_whether_anything_was_saved(cifar_tree, tmp_path, capsys, checkpoint_steps):
    output = tmp_path / "compare"
    arguments = _compare_arguments(cifar_tree, output) + [f"checkpoint_steps={checkpoint_steps}"]
    with _killed_after(3, KeyboardInterrupt):
        assert main(arguments) == 130
    err = capsys.readouterr().err
    resume = f"mjp train --output {output} --resume"
    if checkpoint_steps:
        assert _interrupt_line(err) == (
            f"mjp train: interrupted in the baseline run of the comparison in {output} (baseline: last.pt, resumes at "
            f"epoch 1, batch 2; mjp: not started); continue with {resume}"
        )
    else:
        assert _interrupt_line(err) == (
            f"mjp train: interrupted in the baseline run of the comparison in {output} (baseline: no checkpoint yet; "
            f"mjp: not started); nothing to resume yet: {resume} starts the comparison over (checkpoints are written "
            "at the end of each epoch, and with checkpoint_steps=N also every N optimizer steps within one)"
        )
    # either way the advised command works
    assert main(["train", "--output", str(output), "--resume"]) == 0
    assert (output / "summary.json").is_file()
