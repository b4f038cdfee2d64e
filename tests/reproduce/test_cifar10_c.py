"""``mjp reproduce --cifar10-c DIR``: the folder is checked before any training, every run is measured on it (a run
reused from before is measured then), and the report gives each variant's numbers."""

import json

import numpy as np
import pytest

from mjp_fast.cli import main
from mjp_fast.reproduce import run as run_module
from tests.evaluate.corruption_helpers import cifar_pictures, write_cifar10_c


@pytest.fixture(scope="module")
def cifar10_c(cifar_sample, tmp_path_factory):
    return write_cifar10_c(tmp_path_factory.mktemp("cifar10c") / "CIFAR-10-C", cifar_pictures())


def test_a_bad_folder_is_one_line_before_any_training(cifar_sample, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(run_module, "train", lambda *args, **kwargs: pytest.fail("trained before checking"))
    (tmp_path / "c").mkdir()
    np.save(tmp_path / "c" / "fog.npy", np.zeros((20, 32, 32, 3), np.uint8))
    arguments = ["reproduce", "--preset", "smoke", "--data", str(cifar_sample), "--output", str(tmp_path / "runs")]
    assert main([*arguments, "--cifar10-c", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"mjp reproduce: error: --cifar10-c: {str(tmp_path / 'c' / 'labels.npy')!r} is missing: CIFAR-10-C's labels "
        "come in it, beside the corruption files\n"
    )


@pytest.mark.slow
def test_runs_are_measured_and_the_report_compares_them_with_row_a(cifar_sample, cifar10_c, tmp_path, capsys):
    runs = tmp_path / "runs"
    arguments = ["reproduce", "--preset", "smoke", "--data", str(cifar_sample), "--output", str(runs)]
    arguments += ["--rows", "A,J", "--sweep", "none"]
    assert main(arguments) == 0  # first without CIFAR-10-C: nothing measured on it
    assert json.loads((runs / "reproduction.json").read_text())["cifar10_c"] is None
    assert "## CIFAR-10-C" not in (runs / "reproduction.md").read_text()
    capsys.readouterr()

    assert main([*arguments, "--cifar10-c", str(cifar10_c)]) == 0  # the runs are reused, and measured now
    data = json.loads((runs / "reproduction.json").read_text())
    assert all(run["reused"] for run in data["runs"])
    by_id = {run["id"]: run for run in data["runs"]}
    for run in by_id.values():
        assert run["cifar10_c"]["dir"] == str(cifar10_c)
        assert list(run["cifar10_c"]["error"]) == ["gaussian_noise", "fog"]
        for errors in run["cifar10_c"]["error"].values():  # 4 images a severity: errors are multiples of 25%
            assert len(errors) == 5 and all(error in (0.0, 25.0, 50.0, 75.0, 100.0) for error in errors)
    baseline_errors, mjp_errors = by_id["A-seed0"]["cifar10_c"]["error"], by_id["J-seed0"]["cifar10_c"]["error"]
    rows = {row["key"]: row for row in data["cifar10_c"]["variants"]}
    assert rows["A"]["mean_corruption_error"] == pytest.approx(
        np.mean([np.mean(errors) for errors in baseline_errors.values()])
    )
    assert rows["A"]["mce_vs_baseline"] is None
    expected = np.mean([100 * sum(mjp_errors[c]) / sum(baseline_errors[c]) for c in ("gaussian_noise", "fog")])
    assert rows["J"]["mce_vs_baseline"] == pytest.approx(expected)
    assert rows["J"]["runs"] == 1
    assert rows["J"]["family_error"] == pytest.approx(
        {"noise": np.mean(mjp_errors["gaussian_noise"]), "weather": np.mean(mjp_errors["fog"])}
    )
    text = (runs / "reproduction.md").read_text()
    assert "## CIFAR-10-C" in text and f"({cifar10_c}; Hendrycks and Dietterich, ICLR 2019)" in text
    assert f"| J ({rows['J']['title']}) | 1 | {rows['J']['mean_corruption_error']:.2f} | " in text
    assert f"--cifar10-c {cifar10_c}" in data["environment"]["command"]
