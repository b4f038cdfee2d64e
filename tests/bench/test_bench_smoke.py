"""The benchmark scripts run (``--smoke``: tiny sizes) and record their results as JSON."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import importlib
import json
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # `bench` is a folder of the checkout, not an installed package
    sys.path.insert(0, str(REPO_ROOT))

TOP_KEYS = {"benchmark", "smoke", "date", "device", "config", "backends", "results", "aims"}
DEVICE_KEYS = {"device", "cpu", "torch_threads", "platform", "python", "torch", "backends", "extension_loaded", "gpu"}
TIMING_KEYS = {"implementation", "median_s", "p20_s", "p80_s", "min_s", "samples", "calls_per_sample"}
VERDICTS = {"PASS", "FAIL", "NOT RUN", "NOT JUDGED"}


def _run_smoke(module_name: str, tmp_path: Path, capsys) -> tuple[dict, str]:
    module = importlib.import_module(module_name)
    assert module.main(["--smoke", "--out", str(tmp_path), "--device", "cpu"]) == 0
    files = sorted(tmp_path.glob("*.json"))
    assert len(files) == 1, files
    assert files[0].name.endswith(f"-{module.NAME}-smoke.json")
    assert not [path for path in tmp_path.iterdir() if path.suffix != ".json"]  # no temporary file left
    return json.loads(files[0].read_text()), capsys.readouterr().out


def _check_common(payload: dict, printed: str) -> None:
    assert payload.keys() >= TOP_KEYS
    assert payload["smoke"] is True
    assert payload["device"].keys() >= DEVICE_KEYS
    assert "torch" in payload["backends"]
    assert payload["results"]
    for row in payload["results"]:
        assert row.keys() >= TIMING_KEYS
        assert 0 < row["p20_s"] <= row["median_s"] <= row["p80_s"]
    for aim in payload["aims"]:
        assert {"aim", "threshold", "measured", "verdict"} <= aim.keys()
        assert aim["verdict"] in VERDICTS
    assert "| implementation" in printed or "implementation |" in printed
    assert "results: " in printed


@pytest.mark.timeout(120)
def test_sampler_benchmark_smoke(tmp_path, capsys):
    payload, printed = _run_smoke("bench.bench_sampler", tmp_path, capsys)
    _check_common(payload, printed)
    assert payload["benchmark"] == "sampler"
    implementations = {row["implementation"] for row in payload["results"]}
    assert implementations == {"python loop", *payload["backends"]}
    for row in payload["results"]:
        assert {"batch", "ratio", "per_mask_median_s", "speedup_vs_python", "mean_masked"} <= row.keys()
        assert row["matches_oracle"] in (None, True)  # every backend bit-identical to the oracle


@pytest.mark.timeout(120)
def test_patch_embed_benchmark_smoke(tmp_path, capsys):
    payload, printed = _run_smoke("bench.bench_patch_embed", tmp_path, capsys)
    _check_common(payload, printed)
    assert payload["benchmark"] == "patch_embed"
    modes = {(row["mode"], row["implementation"]) for row in payload["results"]}
    for backend in payload["backends"]:
        assert ("forward", f"mjp[{backend}]") in modes
        assert ("forward+backward", f"mjp[{backend}]") in modes
    assert ("forward+backward", "timm") in modes
    for row in payload["results"]:
        assert "ratio_vs_timm" in row
        if row["max_abs_error_vs_ref"] is not None:
            assert row["max_abs_error_vs_ref"] < 1e-4
