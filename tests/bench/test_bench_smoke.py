"""The benchmark scripts run (``--smoke``: tiny sizes) and record their results as JSON."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import argparse
import importlib
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # `bench` is a folder of the checkout, not an installed package
    sys.path.insert(0, str(REPO_ROOT))

from tests.bench.test_bench_kernels import check_kernels_values  # noqa: E402 - the kernels case's own checks

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


# ---------------------------------------------------------------------------------------------------------------
# Values that must hold in any run, whatever the timings: the rows' derived fields against the timings they come
# from, and what each case checks of the outputs
# ---------------------------------------------------------------------------------------------------------------


def _groups(rows: list[dict], *keys: str) -> dict[tuple, dict[str, dict]]:
    """The rows grouped by ``keys`` (one configuration each): key values -> implementation -> row."""
    groups: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        groups.setdefault(tuple(row[key] for key in keys), {})[row["implementation"]] = row
    return groups


def _check_sampler_values(section: dict) -> None:
    """Every backend draws the oracle's jigsaws (so the same masked counts); no mask goes past its target, and
    with a ratio above 0 some positions are masked; speedups and per-mask times are the timings' ratios."""
    from bench.bench_sampler import PYTHON_LOOP

    rows, num_positions = section["results"], math.prod(section["config"]["grid"])
    for (batch, ratio), group in _groups(rows, "batch", "ratio").items():
        assert set(group) == {PYTHON_LOOP, *section["backends"]}
        oracle, python = group["torch"], group[PYTHON_LOOP]
        if ratio > 0:
            assert oracle["mean_masked"] > 0
        for name, row in group.items():
            assert row["target"] == math.floor(ratio * num_positions)
            assert 0 <= row["mean_masked"] <= row["target"]  # BEiT's loop may end short of it, never past it
            assert row["speedup_vs_python"] == pytest.approx(python["median_s"] / row["median_s"])
            assert row["per_mask_median_s"] == pytest.approx(row["median_s"] / batch)
            if name not in (PYTHON_LOOP, "torch"):
                assert row["matches_oracle"] is True, (name, batch, ratio)
                assert row["mean_masked"] == oracle["mean_masked"]
            else:
                assert row["matches_oracle"] is None  # the loop draws other masks; the oracle is the reference


def _check_patch_embed_values(section: dict) -> None:
    """Each row's ratios are its median over timm's and over the linear baseline's in the same mode and batch; the
    fast paths agree with the oracle, the linear baseline with timm."""
    from bench.bench_patch_embed import BASELINE, LINEAR

    for (mode, batch), group in _groups(section["results"], "mode", "batch").items():
        for row in group.values():
            assert row["ratio_vs_timm"] == pytest.approx(row["median_s"] / group[BASELINE]["median_s"])
            assert row["ratio_vs_linear"] == pytest.approx(row["median_s"] / group[LINEAR]["median_s"])
            assert row["images_per_s"] == pytest.approx(batch / row["median_s"])
            if mode == "forward" and row["backend"] is not None:
                assert row["max_abs_error_vs_ref"] is not None and row["max_abs_error_vs_ref"] < 1e-4
        linear = group[LINEAR]
        if mode == "forward":  # checked once per batch, against timm's output
            assert linear["matches_timm"] is True and linear["max_abs_error_vs_timm"] < 1e-4
        else:
            assert linear["matches_timm"] is None and linear["max_abs_error_vs_ref"] is None
    assert not [name for name in section.get("errors", {}) if name.startswith(LINEAR)]


def _check_jigsaw_apply_values(section: dict) -> None:
    """A pixel pipeline's jigsaw cost is its time; a token pipeline's, its time minus the plain embedding's; both
    over the plain embedding's time."""
    from bench.bench_jigsaw_apply import PLAIN

    for group in _groups(section["results"], "ratio").values():
        plain = group[PLAIN]["median_s"]
        for name, row in group.items():
            if name == PLAIN:
                assert row["jigsaw_cost_s"] is None
                continue
            cost = row["median_s"] - (plain if row["output"] == "tokens" else 0.0)
            assert row["jigsaw_cost_s"] == pytest.approx(cost)
            assert row["jigsaw_cost_vs_plain_embedding"] == pytest.approx(cost / plain)


def _check_host_cost_values(section: dict) -> None:
    """Counts add up, ratios are the timings' (each backend's rows against their own baselines), and only the
    triton backend launches Triton kernels."""
    assert list(dict.fromkeys(row["backend"] for row in section["results"])) == section["backends"]
    for backend in section["backends"]:
        rows = {row["implementation"]: row for row in section["results"] if row["backend"] == backend}
        for row in rows.values():
            assert row["ops"] == sum(row["op_counts"].values()) > 0
            assert row["triton_launches"] == sum(row["triton_kernels"].values())
            assert row["ratio"] == pytest.approx(row["median_s"] / rows[row["baseline"]]["median_s"])
            if backend != "triton":
                assert row["triton_launches"] == 0
        assert rows["mjp"]["ops"] > rows["plain"]["ops"]  # MJP's own operators are counted


@pytest.mark.timeout(120)
def test_host_cost_compares_the_backends_asked_for():
    """A run of several backends (on a GPU: triton and cuda) measures a set of rows per backend and judges each."""
    from bench import bench_host_cost

    section = bench_host_cost.collect(smoke=True, device="cpu", repeats=1, backends=["cpu", "torch"])
    assert section["backends"] == ["cpu", "torch"]
    _check_host_cost_values(section)
    by_backend = {
        backend: [row for row in section["results"] if row["backend"] == backend] for backend in ("cpu", "torch")
    }
    assert [row["implementation"] for row in by_backend["cpu"]] == [
        row["implementation"] for row in by_backend["torch"]
    ]
    # the torch backend moves tokens with torch operations: more of them than the extension's one operator
    ops = {
        backend: next(row["ops"] for row in rows if row["implementation"] == "mjp")
        for backend, rows in by_backend.items()
    }
    assert ops["torch"] > ops["cpu"]
    assert sum("(backend cpu)" in aim["aim"] for aim in section["aims"]) == 3
    assert sum("(backend torch)" in aim["aim"] for aim in section["aims"]) == 3
    header = bench_host_cost.table(section["results"]).splitlines()[0]
    assert [cell.strip() for cell in header.split("|")[1:4]] == ["step", "backend", "against"]


def _check_train_step_values(section: dict) -> None:
    """The overheads as the module documents them, from each model's plain step: the median of the per-pair
    overheads lies within their p20 and p80 and its 95% interval; the ratio of medians and the isolated work's share
    are over the plain median."""
    from bench.bench_train_step import PLAIN

    for group in _groups(section["results"], "model").values():
        plain = group[PLAIN]
        assert plain["overhead_median_pct"] is None  # the baseline has no overhead
        for name, row in group.items():
            assert row["pairs"] == row["samples"] == plain["pairs"]
            if row["overhead_median_pct"] is None:
                continue
            assert row["overhead_p20_pct"] <= row["overhead_median_pct"] <= row["overhead_p80_pct"]
            expected = 100.0 * (row["median_s"] / plain["median_s"] - 1.0)
            assert row["overhead_of_medians_pct"] == pytest.approx(expected)
            if name.startswith("mjp"):
                assert row["overhead_ci95_low_pct"] <= row["overhead_median_pct"] <= row["overhead_ci95_high_pct"]
                assert 0 <= row["quiet_pairs"] <= row["pairs"]
                expected = 100.0 * row["isolated_extra_s"] / plain["median_s"]
                assert row["isolated_overhead_pct"] == pytest.approx(expected)
        # the steady state: images/s per block, the overheads from them (in time) per block, their median
        for name, row in group.items():
            blocks = np.asarray(row["steady_images_per_s_blocks"])
            assert row["steady_blocks"] == blocks.size > 0
            assert row["steady_images_per_s"] == pytest.approx(float(np.median(blocks)))
            if name != PLAIN:
                against_plain = 100.0 * (np.asarray(plain["steady_images_per_s_blocks"]) / blocks - 1.0)
                assert row["steady_overhead_median_pct"] == pytest.approx(float(np.median(against_plain)))


def _check_train_loop_values(section: dict) -> None:
    """Ratios of median images/s, and per round, against timm's and MJP-off rows of the same data."""
    from bench.bench_train_loop import MJP_FALSE, TIMM

    for group in _groups(section["results"], "data").values():
        for row in group.values():
            assert row["images_per_s"] > 0
            for field, base_name in (("ratio_vs_timm", TIMM), ("ratio_vs_mjp_false", MJP_FALSE)):
                if row[field] is None:
                    continue
                base = group[base_name]
                assert row[field] == pytest.approx(row["images_per_s"] / base["images_per_s"])
                runs = zip(row["images_per_s_runs"], base["images_per_s_runs"], strict=True)
                assert row[field + "_runs"] == pytest.approx([mine / theirs for mine, theirs in runs])


def _check_gathered_patch_embed_values(section: dict) -> None:
    """Both groups (the op, the NaFlexVit front end) in both modes, each row's ratio to its group's baseline in the
    same mode."""
    rows = section["results"]
    assert {(row["group"], row["mode"]) for row in rows} == {
        (group, mode) for group in ("op", "front end") for mode in ("forward", "forward+backward")
    }
    baselines = {"op": "gather+linear", "front end": "front end unfused"}
    for row in rows:
        base = next(
            other
            for other in rows
            if (other["group"], other["mode"]) == (row["group"], row["mode"])
            and other["implementation"] == baselines[row["group"]]
        )
        assert row["ratio_vs_baseline"] == pytest.approx(row["median_s"] / base["median_s"])


VALUE_CHECKS = {
    "sampler": _check_sampler_values,
    "gathered_patch_embed": _check_gathered_patch_embed_values,
    "patch_embed": _check_patch_embed_values,
    "jigsaw_apply": _check_jigsaw_apply_values,
    "host_cost": _check_host_cost_values,
    "train_step": _check_train_step_values,
    "kernels": check_kernels_values,
    "train_loop": _check_train_loop_values,
}


@pytest.mark.timeout(120)
def test_sampler_benchmark_smoke(tmp_path, capsys):
    payload, printed = _run_smoke("bench.bench_sampler", tmp_path, capsys)
    _check_common(payload, printed)
    assert payload["benchmark"] == "sampler"
    implementations = {row["implementation"] for row in payload["results"]}
    assert implementations == {"python loop", *payload["backends"]}
    for row in payload["results"]:
        assert {"batch", "ratio", "per_mask_median_s", "speedup_vs_python", "mean_masked"} <= row.keys()
    _check_sampler_values(payload)


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
    assert {("forward", "linear"), ("forward+backward", "linear")} <= modes
    _check_patch_embed_values(payload)
    # the batch sweep: every implementation in both modes at each batch, each row naming its batch
    from bench import bench_patch_embed

    config = payload["config"]
    assert config["batches"] == list(bench_patch_embed.SMOKE_BATCHES) and config["batch"] in config["batches"]
    assert {row["batch"] for row in payload["results"]} == set(config["batches"])
    per_batch = [
        {(row["mode"], row["implementation"]) for row in payload["results"] if row["batch"] == batch}
        for batch in config["batches"]
    ]
    assert all(implementations == modes for implementations in per_batch)
    for row in payload["results"]:
        assert row["images_per_s"] == pytest.approx(row["batch"] / row["median_s"])
    aim, gpu_aim = payload["aims"]
    assert aim["batch"] == config["batch"] and f"batch {config['batch']}" in aim["aim"]
    # the GPU aim: not judged on the CPU, and the note says why
    assert gpu_aim["verdict"] == "NOT JUDGED" and gpu_aim["measured"] is None and "GPU only" in gpu_aim["note"]
    assert gpu_aim["batch"] == bench_patch_embed.GPU_AIM_BATCH and config["gpu_aim_backend"] is None
    assert "| batch |" in printed and "| vs linear |" in printed


@pytest.mark.timeout(120)
def test_patch_embed_benchmark_sweeps_the_batches_asked_for(tmp_path, capsys):
    from bench import bench_patch_embed

    options = ["--smoke", "--out", str(tmp_path), "--device", "cpu", "--repeats", "1", "--batches", "3,1,3"]
    assert bench_patch_embed.main(options) == 0
    (path,) = tmp_path.glob("*.json")
    payload = json.loads(path.read_text())
    assert payload["config"]["batches"] == [3, 1]  # in the order asked, once each
    assert list(dict.fromkeys(row["batch"] for row in payload["results"])) == [3, 1]  # measured in that order
    assert {row["batch"] for row in payload["results"]} == {1, 3}
    aim, _ = payload["aims"]  # the judged batch (2 in a smoke run) was not measured: nothing to judge
    assert aim["measured"] is None and aim["verdict"] == "NOT RUN" and "not in the sweep" in aim["note"]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        bench_patch_embed.main(["--smoke", "--out", str(tmp_path), "--batches", "0,4"])
    assert "--batches: batches must be positive integers" in capsys.readouterr().err


def test_patch_embed_aim_is_judged_at_its_batch_only():
    from bench.bench_patch_embed import AIM_BATCH, AIM_RATIO, _aims, parse_batches

    def row(batch: int, ratio: float) -> dict:
        return {"mode": "forward+backward", "implementation": "mjp[cpu]", "batch": batch, "ratio_vs_timm": ratio}

    rows = [row(16, 2.0), row(AIM_BATCH, 0.5), row(256, 3.0)]
    aim, _ = _aims(rows, smoke=False, device="cpu", batch=AIM_BATCH)
    assert (aim["measured"], aim["verdict"], aim["batch"], aim["threshold"]) == (0.5, "PASS", AIM_BATCH, AIM_RATIO)
    errors = {"mjp[cpu], batch 16": "RuntimeError: elsewhere"}  # another batch's failure is reported, not judged
    assert _aims(rows, smoke=False, device="cpu", batch=AIM_BATCH, errors=errors)[0]["verdict"] == "PASS"
    errors = {f"mjp[cpu] + sampling, batch {AIM_BATCH}": "RuntimeError: here"}
    assert _aims(rows, smoke=False, device="cpu", batch=AIM_BATCH, errors=errors)[0]["verdict"] == "FAIL"
    assert len(_aims(rows, smoke=False, device="cpu", batch=AIM_BATCH)) == 2  # the CPU's, then the GPU's
    assert parse_batches("16, 64,16") == (16, 64) and parse_batches([8]) == (8,)
    for bad in ("", "0", "-2,4", "a", []):
        with pytest.raises(ValueError, match="batches must be positive integers"):
            parse_batches(bad)


def test_the_linear_baseline_is_timms_convolution():
    """``linear``: reshape into patch rows + F.linear gives timm's PatchEmbed tokens and the same gradients of the
    weight and bias, on an odd grid (3 x 5 patches of 4 x 4, 3 channels, D = 5) and non-contiguous images."""
    import torch
    from timm.layers import PatchEmbed

    from bench.bench_patch_embed import linear_patch_embed

    torch.manual_seed(0)
    embed = PatchEmbed(img_size=(12, 20), patch_size=4, in_chans=3, embed_dim=5).double()
    images = torch.randn(2, 3, 20, 12, dtype=torch.float64).transpose(2, 3)  # [2, 3, 12, 20], not contiguous
    grad = torch.randn(2, 15, 5, dtype=torch.float64)
    expected = embed(images)
    expected.backward(grad)
    expected_grads = [embed.proj.weight.grad.clone(), embed.proj.bias.grad.clone()]
    embed.zero_grad(set_to_none=True)
    got = linear_patch_embed(images, embed.proj.weight, embed.proj.bias)
    got.backward(grad)
    torch.testing.assert_close(got, expected)  # float64: the two sums agree to rounding
    torch.testing.assert_close([embed.proj.weight.grad, embed.proj.bias.grad], expected_grads)
    no_bias = linear_patch_embed(images, embed.proj.weight.detach(), None)
    torch.testing.assert_close(no_bias, expected.detach() - embed.proj.bias.detach())


def test_the_linear_check_catches_a_wrong_baseline():
    """:meth:`Problem.check_linear` passes the linear baseline as it is, and fails it when its output is off by
    more than the sums' rounding."""
    import torch

    from bench.bench_patch_embed import Problem

    problem = Problem(2, 16, 4, 8, torch.float32, "cpu")
    check = problem.check_linear()
    assert check["matches"] and check["linear_error"] <= check["tolerance"] and check["timm_error"] == 0.0
    forward = problem.linear_forward
    problem.linear_forward = lambda: forward() + 1e-3
    check = problem.check_linear()
    assert not check["matches"] and check["linear_vs_timm"] == pytest.approx(1e-3, rel=1e-2)


def test_patch_embed_gpu_aim_is_judged_on_a_gpu_only():
    """The default GPU backend's forward+backward against the linear baseline, at batch 256: PASS/FAIL on a GPU;
    on the CPU not judged, with a note."""
    from bench.bench_patch_embed import GPU_AIM_BATCH, GPU_AIM_RATIO, _gpu_aim

    def row(name: str, batch: int, ratio: float, mode: str = "forward+backward") -> dict:
        return {"mode": mode, "implementation": name, "batch": batch, "ratio_vs_linear": ratio}

    rows = [
        row("mjp[cuda]", GPU_AIM_BATCH, 0.8),
        row("mjp[triton]", GPU_AIM_BATCH, 1.3),
        row("mjp[cuda]", 64, 2.0),  # another batch: not judged
        row("mjp[cuda]", GPU_AIM_BATCH, 3.0, mode="forward"),  # another mode: not judged
    ]
    on_gpu = dict(smoke=False, device="cuda", errors={})
    aim = _gpu_aim(rows, backend="cuda", **on_gpu)
    assert (aim["measured"], aim["verdict"], aim["threshold"], aim["backend"]) == (0.8, "PASS", GPU_AIM_RATIO, "cuda")
    assert "(cuda)" in aim["aim"] and f"batch {GPU_AIM_BATCH}" in aim["aim"]
    assert _gpu_aim(rows, backend="triton", **on_gpu)["verdict"] == "FAIL"  # the default backend is the one judged
    for where in (dict(smoke=False, device="cpu"), dict(smoke=True, device="cpu")):
        aim = _gpu_aim(rows, backend=None, errors={}, **where)
        assert aim["verdict"] in ("NOT RUN", "NOT JUDGED") and aim["measured"] is None
        assert "judged on a GPU only" in aim["note"]
    assert _gpu_aim(rows, backend=None, errors={}, smoke=False, device="cpu")["verdict"] == "NOT RUN"
    # the default backend raising at that batch misses the aim; a wrong linear baseline leaves it unjudged
    raised = {f"mjp[cuda] + sampling, batch {GPU_AIM_BATCH}": "RuntimeError: here"}
    assert _gpu_aim(rows, backend="cuda", smoke=False, device="cuda", errors=raised)["verdict"] == "FAIL"
    elsewhere = {"mjp[cuda], batch 64": "RuntimeError: elsewhere"}
    assert _gpu_aim(rows, backend="cuda", smoke=False, device="cuda", errors=elsewhere)["verdict"] == "PASS"
    wrong = {f"linear, batch {GPU_AIM_BATCH}": "check: its forward is 1e-2 from the float32 convolution"}
    aim = _gpu_aim(rows, backend="cuda", smoke=False, device="cuda", errors=wrong)
    assert aim["verdict"] == "NOT RUN" and "linear baseline" in aim["note"]
    aim = _gpu_aim([r for r in rows if r["batch"] != GPU_AIM_BATCH], backend="cuda", **on_gpu)
    assert aim["verdict"] == "NOT RUN" and "not in the sweep" in aim["note"]


# ---------------------------------------------------------------------------------------------------------------
# The whole suite: `mjp bench --smoke`, its one JSON file, and the Markdown page rendered from it
# ---------------------------------------------------------------------------------------------------------------

CASE_ROW_KEYS = {
    "sampler": {"batch", "ratio", "per_mask_median_s", "speedup_vs_python", "mean_masked", "matches_oracle"},
    "patch_embed": {
        "mode",
        "batch",
        "backend",
        "ratio_vs_timm",
        "ratio_vs_linear",
        "images_per_s",
        "max_abs_error_vs_ref",
        "max_abs_error_vs_timm",
        "matches_timm",
    },
    "gathered_patch_embed": {"group", "mode", "implementation", "median_s", "ratio_vs_baseline"},
    "jigsaw_apply": {"ratio", "output", "backend", "jigsaw_cost_s", "jigsaw_cost_vs_plain_embedding", "check"},
    "host_cost": {"baseline", "ops", "op_counts", "triton_launches", "ratio"},
    "train_step": {
        "model",
        "batch",
        "image_size",
        "prob",
        "pairs",
        "overhead_median_pct",
        "overhead_p20_pct",
        "overhead_p80_pct",
        "overhead_ci95_low_pct",
        "overhead_ci95_high_pct",
        "quiet_pairs",
        "isolated_overhead_pct",
        "overhead_vs_linear_median_pct",
        "steady_blocks",
        "steady_images_per_s",
        "steady_images_per_s_blocks",
        "steady_overhead_median_pct",
        "steady_overhead_vs_fast_median_pct",
        "steady_overhead_vs_linear_median_pct",
    },
    "kernels": {"model", "batch", "setting", "constants", "extra_busy_s", "kernels", "launches", "resolved"},
    "train_loop": {"data", "batch", "steps", "images_per_s", "ratio_vs_timm", "ratio_vs_mjp_false", "eval_s", "wall_s"},
}


def _rendered_as_recorded(tmp_path: Path, payload: dict) -> str:
    """The page rendered from ``payload`` recorded as a real run (render skips smoke runs)."""
    from bench import render

    recorded = tmp_path / "recorded"
    recorded.mkdir()
    (recorded / "cpu-test-2000-01-01.json").write_text(json.dumps({**payload, "smoke": False}))
    return render.render(recorded)


def _interrupted_suite(tmp_path: Path, cases: str) -> tuple[dict, Path, str]:
    """The suite's smoke run of ``cases`` up to the interrupt that a patched case raises: ``(payload, path,
    printed)`` of the file it left."""
    import io

    from bench.run import run_suite

    printed = io.StringIO()
    with pytest.raises(KeyboardInterrupt):
        run_suite(cases=cases, smoke=True, out_dir=tmp_path, device="cpu", stream=printed)
    (path,) = tmp_path.glob("*.json")
    return json.loads(path.read_text()), path, printed.getvalue()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mjp_bench_smoke_runs_every_case_into_one_json(tmp_path, capsys):
    from bench import render
    from mjp_fast.cli import main

    assert main(["bench", "--smoke", "--out", str(tmp_path), "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    files = sorted(tmp_path.glob("*.json"))
    assert [path.name for path in files] == [files[0].name] and files[0].name.endswith("-smoke.json"), files
    assert files[0].name.startswith("cpu-")
    payload = json.loads(files[0].read_text())

    assert payload.keys() >= {"suite", "smoke", "date", "device", "cases_run", "cases", "aims", "elapsed_s"}
    assert payload["smoke"] is True
    assert payload["device"].keys() >= DEVICE_KEYS
    assert payload["cases_run"] == list(CASE_ROW_KEYS)
    for name, row_keys in CASE_ROW_KEYS.items():
        section = payload["cases"][name]
        assert "error" not in section, section.get("traceback")
        assert section.keys() >= {"config", "backends", "results", "aims", "elapsed_s"}
        assert section["results"], name
        for row in section["results"]:
            assert row.keys() >= TIMING_KEYS | row_keys, (name, row.keys())
            assert 0 < row["p20_s"] <= row["median_s"] <= row["p80_s"]
        VALUE_CHECKS[name](section)
    assert not payload["cases"]["jigsaw_apply"]["errors"]
    checks = [row["check"] for row in payload["cases"]["jigsaw_apply"]["results"] if row["check"] is not None]
    assert checks and all(check is True or check < 1e-4 for check in checks)  # the pipelines compute the same
    variants = {row["implementation"] for row in payload["cases"]["train_step"]["results"]}
    assert variants == {"plain", "plain + linear embed", "plain + fast patch embed", "mjp prob=0.5", "mjp prob=1"}
    assert {aim["case"] for aim in payload["aims"]} == {
        "sampler",
        "patch_embed",
        "gathered_patch_embed",
        "host_cost",
        "train_step",
        "train_loop",
    }
    for aim in payload["aims"]:
        assert aim["verdict"] == "NOT JUDGED"  # a smoke run judges nothing

    titles = (
        "## Jigsaw sampler",
        "## Patch embedding",
        "## Applying the jigsaw",
        "## Host cost",
        "## Training step",
        "## Triton kernels",
        "## Training loop",
    )
    for title in (*titles, "## Aims"):
        assert title in printed
    assert f"results: {files[0]}" in printed

    # The page: render skips smoke runs, so record this one as if it were real.
    page = _rendered_as_recorded(tmp_path, payload)
    assert page.startswith("# Benchmarks")
    assert "## Summary: the aims, newest run of each case per device" in page
    assert "### Training step" in page and "### Applying the jigsaw" in page
    assert payload["device"]["torch"] in page
    assert render.render(tmp_path).count("## cpu-") == 0  # the smoke file itself is left out


def _listing(folder: Path) -> dict[str, tuple[int, int]]:
    return {path.name: (path.stat().st_size, path.stat().st_mtime_ns) for path in folder.iterdir()}


@pytest.mark.timeout(300)
def test_smoke_runs_leave_the_checkout_results_alone(tmp_path, capsys, monkeypatch):
    import tempfile

    from bench import common
    from mjp_fast.cli import main

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the system temp dir, for this test
    before = _listing(common.RESULTS_DIR)
    assert main(["bench", "--smoke", "--cases", "sampler", "--device", "cpu", "--repeats", "1"]) == 0
    assert importlib.import_module("bench.bench_sampler").main(["--smoke", "--device", "cpu", "--repeats", "1"]) == 0
    assert _listing(common.RESULTS_DIR) == before
    smoke_dir = common.smoke_results_dir()
    assert smoke_dir.parent == tmp_path
    names = sorted(path.name for path in smoke_dir.iterdir())
    assert len(names) == 2 and all(name.endswith("-smoke.json") for name in names), names
    assert str(smoke_dir) in capsys.readouterr().out
    # --out still wins, and a real run's default stays the recorded results
    assert common.results_dir(tmp_path / "mine", smoke=True) == tmp_path / "mine"
    assert common.results_dir(None, smoke=False) == common.RESULTS_DIR


def test_git_ignores_smoke_results():
    if not (REPO_ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    probe = "bench/results/cpu-test-2000-01-01-smoke.json"
    ignored = subprocess.run(["git", "check-ignore", "-q", probe], cwd=REPO_ROOT, check=False, timeout=60)
    assert ignored.returncode == 0, f"{probe} is not ignored by git"
    recorded = subprocess.run(
        ["git", "check-ignore", "-q", "bench/results/cpu-test-2000-01-01.json"], cwd=REPO_ROOT, check=False, timeout=60
    )
    assert recorded.returncode == 1  # real results are committed


def test_mjp_bench_rejects_unknown_cases(tmp_path, capsys):
    from mjp_fast.cli import main

    assert main(["bench", "--smoke", "--cases", "sampler,nope", "--out", str(tmp_path)]) == 2
    assert (
        "cases must be a comma-separated subset of "
        "sampler,patch_embed,gathered_patch_embed,jigsaw_apply,host_cost,train_step,kernels,train_loop"
        in capsys.readouterr().err
    )
    assert not list(tmp_path.iterdir())


def test_mjp_bench_explains_when_there_is_no_checkout(tmp_path):
    from mjp_fast.cli import bench_runner

    with pytest.raises(FileNotFoundError, match="run it from the root of a mjp_fast checkout"):
        bench_runner([tmp_path])


def test_mjp_bench_options_match_the_runner():
    from bench import run
    from mjp_fast.cli import build_parser

    suite = argparse.ArgumentParser()
    run.add_arguments(suite)
    parser = build_parser()
    command = parser.parse_args(["bench"])
    assert set(vars(command)) - {"command"} == set(vars(suite.parse_args([])))
    assert run.result_file_name(list(run.CASES), smoke=False, threads=None) == ""
    assert run.result_file_name(["train_step"], smoke=True, threads=None) == "suite-train_step-smoke"


def test_train_step_median_interval_covers_the_median_and_narrows():
    from bench.bench_train_step import _median_interval

    rng = np.random.default_rng(3)
    few, many = rng.normal(1.0, 5.0, 10), rng.normal(1.0, 5.0, 400)
    for values in (few, many):
        low, high = _median_interval(values)
        assert low <= float(np.median(values)) <= high
    assert np.subtract(*_median_interval(many)[::-1]) < np.subtract(*_median_interval(few)[::-1])
    assert _median_interval([2.0] * 7) == (2.0, 2.0)


@pytest.mark.timeout(120)
def test_a_suite_stopped_midway_keeps_the_cases_it_finished(tmp_path, monkeypatch):
    # A lent GPU's deadline stops `bench.run` with SIGINT (KeyboardInterrupt): the cases finished before it are
    # already on disk, and the file names the cases that were not measured.
    import io

    from bench import bench_patch_embed
    from bench.run import run_suite

    def stopped(**_):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_patch_embed, "collect", stopped)
    payload, path, printed = _interrupted_suite(tmp_path, "sampler,patch_embed")
    assert list(payload["cases"]) == ["sampler"] and payload["cases"]["sampler"]["results"]
    assert payload["cases_missing"] == ["patch_embed"] and payload["interrupted"] is True
    assert f"interrupted: the finished cases are in {path}" in printed
    page = _rendered_as_recorded(tmp_path, payload)
    assert "a partial run, stopped before it finished: not measured: patch_embed" in page

    # a finished run has no such keys
    monkeypatch.undo()
    run_suite(cases="sampler", smoke=True, out_dir=tmp_path / "whole", device="cpu", stream=io.StringIO())
    (path,) = (tmp_path / "whole").glob("*.json")
    assert "cases_missing" not in json.loads(path.read_text())


def test_a_case_cut_short_keeps_what_it_measured(tmp_path, monkeypatch):
    # A case that measures in parts (the kernels case, setting by setting) hands what it has to the runner with the
    # interrupt: the file keeps it, marked cut short, and names the cases not measured.
    from bench import bench_kernels
    from bench.common import PartialResults

    config = {"backend": "triton", "prob": 1.0, "image_size": 16, "rounds": 1, "calls_per_round": 1}
    section = {"config": config, "backends": ["triton"], "results": [], "aims": [], "note": "stopped"}

    def stopped(**_):
        raise PartialResults(section)

    monkeypatch.setattr(bench_kernels, "collect", stopped)
    payload, _, _ = _interrupted_suite(tmp_path, "sampler,kernels,patch_embed")
    assert list(payload["cases"]) == ["sampler", "kernels"]
    kept = payload["cases"]["kernels"]
    assert kept["cut_short"] is True and kept["results"] == section["results"] and kept["elapsed_s"] >= 0
    assert payload["cases_cut_short"] == ["kernels"] and payload["cases_missing"] == ["patch_embed"]
    assert payload["interrupted"] is True
    page = _rendered_as_recorded(tmp_path, payload)
    assert "a partial run, stopped before it finished: cut short: kernels; not measured: patch_embed" in page


def test_sampler_aim_on_a_gpu_says_why_it_is_not_judged():
    # On a GPU the cpu backend is not measured: the note must not claim that the extension is missing (the H100 run
    # of 2026-11-26 said so with mjp_fast._C loaded).
    from bench.bench_sampler import _aims

    rows = [{"implementation": "triton", "speedup_vs_python": 500.0}]
    (aim,) = _aims(rows, smoke=False, device="cuda")
    assert aim["verdict"] == "NOT RUN" and "CPU only" in aim["note"]
    (aim,) = _aims(rows, smoke=False, device="cpu")
    assert "not available" in aim["note"]
