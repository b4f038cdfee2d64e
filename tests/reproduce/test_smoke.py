"""``mjp reproduce --preset smoke`` end to end on real CIFAR-10 images: the report, its JSON, the PNGs, the claims
and the attack are all computed; a second invocation reuses the finished runs."""

import json
import re

import pytest

from mjp_fast.cli import main
from mjp_fast.reproduce.claims import VERDICTS


@pytest.mark.slow
def test_smoke_preset_end_to_end(cifar_sample, tmp_path, capsys):
    runs = tmp_path / "runs"
    arguments = ["reproduce", "--preset", "smoke", "--data", str(cifar_sample), "--output", str(runs)]
    assert main(arguments) == 0
    report = runs / "reproduction.md"
    text = report.read_text()
    data = json.loads((runs / "reproduction.json").read_text())

    claim_lines = [line for line in text.splitlines() if re.match(r"^[1-5]\. \*\*", line)]
    assert len(claim_lines) == 5
    for line in claim_lines:
        verdict = re.search(r"\*\*: \*\*(.+?)\*\*\.", line).group(1)
        assert verdict in VERDICTS, line
        assert re.search(r"\d+\.\d", line), f"no numbers beside the verdict: {line}"
    assert [claim["verdict"] in VERDICTS for claim in data["claims"]] == [True] * 5

    assert [run["id"] for run in data["runs"]] == ["A-seed0", "E-seed0", "G-seed0", "J-seed0", "J-ratio0.27-seed0"]
    for run in data["runs"]:
        assert run["seed"] == 0 and run["config"]["seed"] == 0 and run["wall_seconds"] > 0
        assert run["device"] and run["test_images"] == 40 and run["epochs"] == 1
        assert run["images_per_second"] > 0
        # the per-image hits the bootstrap uses agree with the training loop's own evaluation
        assert run["hits_top1"] == pytest.approx(run["top1"])
    assert data["runs"][3]["variants"] == ["J", "J@0.03"]
    assert data["runs"][1]["config"]["mjp_unk"] is False
    versions = data["environment"]["versions"]
    assert {"mjp_fast", "torch", "timm"} <= set(versions) and all(versions[key] for key in ("mjp_fast", "torch"))
    assert data["data"] == {"root": str(cifar_sample), "train_images": 40, "test_images": 40}
    masks = {row["ratio"]: row for row in data["mask_statistics"]}
    assert set(masks) == {0.03, 0.27, 0.5} and masks[0.03]["grid"] == [14, 14]
    assert 0 < masks[0.03]["mean_fraction"] < 0.03 < masks[0.27]["mean_fraction"] < 0.27 + 1e-9

    attack = data["attack"]
    assert attack["mode"] == "fresh" and attack["image_size"] == 32 and len(attack["images"]) == 2
    assert set(attack["ratios"]) == {"0.03", "0.5"}
    # the analytic attack is exact through the plain model and lost through UNK
    first = attack["ratios"]["0.03"]["summary"]
    assert first["a"]["psnr"] > 40 and first["c"]["psnr"] < 20
    for name in ("reproduction-similarity.png", "reproduction-attack.png"):
        assert (runs / name).stat().st_size > 1000
    assert "![position-embedding similarity](reproduction-similarity.png)" in text
    assert "## Mask-ratio sweep of J" in text and "4.39 (0.21)" in text

    # again: every run is reused, the report rebuilt
    capsys.readouterr()
    assert main(arguments) == 0
    assert all(run["reused"] for run in json.loads((runs / "reproduction.json").read_text())["runs"])


def test_a_runs_folder_of_another_config_is_refused(cifar_sample, tmp_path, capsys):
    runs = tmp_path / "runs"
    arguments = ["reproduce", "--preset", "smoke", "--data", str(cifar_sample), "--output", str(runs)]
    assert main([*arguments, "--rows", "A", "--sweep", "none"]) == 0
    capsys.readouterr()
    assert main([*arguments, "--rows", "A", "--sweep", "none", "lr=0.002"]) == 2
    assert "holds a run of another config (it differs in lr)" in capsys.readouterr().err
