"""bench/bench_train_step.py's arithmetic, on step times given by the test: the overheads come from the interleaved
pairs as its docstring says (per pair ``t_mjp / t_plain - 1``, then the median), not from the medians' ratio."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # `bench` is a folder of the checkout, not an installed package
    sys.path.insert(0, str(REPO_ROOT))

from bench import bench_train_step as case  # noqa: E402

# Step times per variant, one per round (three pairs), in the order the rounds run them. The plain step's second
# round was slowed down by something else: per pair, MJP prob=1 costs +10%, 0% and +5% (median +5%), while the
# ratio of the medians says +10%.
TIMES = {
    None: [1.0, 2.0, 1.0],
    case.FAST: [1.0, 2.0, 1.02],
    0.5: [1.04, 2.0, 1.01],
    1.0: [1.1, 2.0, 1.05],
}
ISOLATED_S = {0.5: 0.002, 1.0: 0.004}
# the isolated work's GPU busy time (measured on a GPU only); FAST: the fused embedding's against timm's
ISOLATED_GPU_S = {0.5: 50e-6, 1.0: 90e-6, case.FAST: -20e-6}
# the isolated work's kernels per variant (GPU runs), most time first
KERNELS = {0.5: [["sample_jigsaw_kernel", 20e-6], ["dal_forward", 10e-6]], case.FAST: [["gemm", 300e-6]]}


class _Trainer:
    """Stands for a model's training step: the scripted timer below gives its time."""

    def __init__(self, model, **_):
        self.model = model

    def step(self, images, targets):
        pass


@pytest.fixture
def rows(monkeypatch):
    order = list(TIMES)  # the variants in the order run_model makes them: plain, fast, then each prob
    rounds = [order if index % 2 == 0 else order[::-1] for index in range(3)]
    script = iter(TIMES[variant][index] for index, variants in enumerate(rounds) for variant in variants)

    class ScriptedTimer:
        def __init__(self, device):
            pass

        def __call__(self, function):
            function()
            return next(script)

    monkeypatch.setattr(case, "_models", lambda *_, **__: {variant: torch.nn.Identity() for variant in order})
    monkeypatch.setattr(case, "Trainer", _Trainer)
    monkeypatch.setattr(case, "StepTimer", ScriptedTimer)
    monkeypatch.setattr(case, "_isolated", lambda *_, **__: (ISOLATED_S, ISOLATED_GPU_S, KERNELS))
    options = dict(batch=2, image_size=32, pairs=3, max_seconds=None, warmup=0, device="cpu", compile_model=False)
    rows = case.run_model("deit_tiny_patch16_224", smoke=True, backend="cuda", **options)
    assert next(script, None) is None  # every scripted step was taken, once
    return {row["prob"]: row for row in rows}


def test_overheads_are_the_median_over_the_pairs(rows):
    plain = np.asarray(TIMES[None])
    for prob in case.MJP_PROBS:
        row, times = rows[prob], np.asarray(TIMES[prob])
        per_pair = 100.0 * (times / plain - 1.0)
        assert row["pairs"] == row["samples"] == 3
        assert row["overhead_median_pct"] == pytest.approx(np.median(per_pair))
        assert row["overhead_p20_pct"] == pytest.approx(np.percentile(per_pair, 20))
        assert row["overhead_p80_pct"] == pytest.approx(np.percentile(per_pair, 80))
        assert row["overhead_of_medians_pct"] == pytest.approx(100.0 * (np.median(times) / np.median(plain) - 1.0))
        against_fast = 100.0 * (times / np.asarray(TIMES[case.FAST]) - 1.0)
        assert row["overhead_vs_fast_median_pct"] == pytest.approx(np.median(against_fast))
        assert row["isolated_overhead_pct"] == pytest.approx(100.0 * ISOLATED_S[prob] / np.median(plain))
        assert row["overhead_ci95_low_pct"] <= row["overhead_median_pct"] <= row["overhead_ci95_high_pct"]
    # the example's point: one slow plain step moves the ratio of medians, not the median over the pairs
    assert rows[1.0]["overhead_median_pct"] == pytest.approx(5.0)
    assert rows[1.0]["overhead_of_medians_pct"] == pytest.approx(10.0)


def test_quiet_pairs_leave_out_the_slowed_round(rows):
    # quiet: both steps of a pair within QUIET_MARGIN of the fastest step measured (1.0 s): not the 2 s round
    assert rows[1.0]["quiet_pairs"] == 2
    assert rows[1.0]["quiet_overhead_median_pct"] == pytest.approx(np.median([10.0, 5.0]))


def test_the_baselines_have_no_overhead_against_themselves(rows):
    assert rows[None]["overhead_median_pct"] is None and rows[None]["isolated_overhead_pct"] is None
    fast = rows[case.FAST]  # against plain timm, but no MJP work to isolate
    assert fast["overhead_median_pct"] == pytest.approx(np.median([0.0, 0.0, 2.0]))
    assert fast["isolated_overhead_pct"] is None and fast["overhead_vs_fast_median_pct"] is None


def test_the_gpu_work_aim_judges_the_busy_time_of_deit_small_at_batch_256(rows):
    measured = [dict(row, model="deit_small_patch16_224", batch=256) for row in rows.values()]
    aims = case._gpu_work_aims(measured, smoke=False, device="cuda", gpu="NVIDIA H200", dtype="bfloat16")
    assert [(aim["measured"], aim["verdict"]) for aim in aims] == [
        (pytest.approx(50.0), "PASS"),
        (pytest.approx(90.0), "FAIL"),
    ]
    # elsewhere, or another configuration: not judged
    for where in (dict(device="cpu", gpu=None), dict(device="cuda", gpu="NVIDIA A100")):
        assert {aim["verdict"] for aim in case._gpu_work_aims(measured, smoke=False, dtype="bfloat16", **where)} == {
            "NOT RUN"
        }
    other = case._gpu_work_aims(list(rows.values()), smoke=False, device="cuda", gpu="NVIDIA H200", dtype="bfloat16")
    assert {aim["verdict"] for aim in other} == {"NOT RUN"}


def test_the_row_keeps_the_gpu_busy_time(rows):
    assert rows[0.5]["isolated_gpu_extra_s"] == ISOLATED_GPU_S[0.5] and rows[None]["isolated_gpu_extra_s"] is None
    assert rows[case.FAST]["isolated_gpu_extra_s"] == ISOLATED_GPU_S[case.FAST]
    assert "GPU busy 90" in case.table([rows[1.0]]) and "GPU busy -20" in case.table([rows[case.FAST]])


def test_the_rows_name_their_backend_and_keep_the_kernels(rows):
    assert {row["backend"] for row in rows.values()} == {"cuda"} == {row["sampler_backend"] for row in rows.values()}
    assert rows[0.5]["gpu_kernels"] == KERNELS[0.5] and rows[1.0]["gpu_kernels"] is None
    printed = case.kernel_table(list(rows.values()))
    cells = [[cell.strip() for cell in line.split("|")[1:-1]] for line in printed.splitlines()[2:]]
    assert [cell[2:] for cell in cells] == [
        ["plain + fast patch embed", "300.0", "gemm"],
        ["mjp prob=0.5", "20.0", "sample_jigsaw_kernel"],
        ["mjp prob=0.5", "10.0", "dal_forward"],
    ]
    assert case.kernel_table([dict(row, gpu_kernels=None) for row in rows.values()]) == ""


def test_top_kernels_rank_by_time_and_cut_long_names():
    kernels = {"small": 1e-6, "x" * 200: 5e-6, "big": 9e-6}
    top = case._top_kernels(kernels, count=2)
    assert [seconds for _, seconds in top] == [9e-6, 5e-6]
    assert top[0][0] == "big" and len(top[1][0]) == 120 and top[1][0].endswith("...")


def test_each_backend_is_judged_alone_and_named(rows):
    """A run of two backends (a GPU's triton and cuda): each aim judges one backend's rows and says which."""
    triton = [
        dict(row, model="deit_small_patch16_224", batch=256, image_size=224, backend="triton") for row in rows.values()
    ]
    cuda = [dict(row, model="deit_small_patch16_224", batch=256, image_size=224) for row in rows.values()]
    for row in cuda:  # the cuda backend's MJP rows: half the overhead and GPU work of triton's
        if row["prob"] in case.MJP_PROBS:
            row["overhead_vs_fast_median_pct"] = 0.1
            row["overhead_vs_fast_ci95_low_pct"], row["overhead_vs_fast_ci95_high_pct"] = 0.05, 0.15
            row["isolated_gpu_extra_s"] = 40e-6
    aims = case._aims(triton + cuda, smoke=False, device="cuda", gpu="NVIDIA H100", dtype="bfloat16")
    deit_s = [aim for aim in aims if "DeiT-Small" in aim["aim"]]
    named = {backend: [aim for aim in deit_s if f"(backend {backend})" in aim["aim"]] for backend in ("triton", "cuda")}
    assert len(named["triton"]) == len(named["cuda"]) == len(deit_s) // 2 == 4  # 2 probs x (overhead, GPU work)
    assert {aim["verdict"] for aim in named["cuda"]} == {"PASS"}
    # triton's (the scripted times): overheads of prob 0.5 and 1.0 (medians 0% and +2.9% against 0.25%), then GPU
    # work 50 and 90 us (against 80 us)
    assert [aim["verdict"] for aim in named["triton"]] == ["PASS", "FAIL", "PASS", "FAIL"]
    # one backend: the aims' text stays as before
    assert not any(
        "(backend" in aim["aim"] for aim in case._aims(cuda, smoke=False, device="cuda", gpu="H100", dtype="bfloat16")
    )


def test_collect_measures_each_backend_asked_for(monkeypatch):
    calls = []

    def run_model(name, *, backend, **_):
        calls.append((name, backend))
        return []

    monkeypatch.setattr(case, "run_model", run_model)
    section = case.collect(smoke=True, device="cpu", backends="cpu, torch")
    assert section["backends"] == ["cpu", "torch"]
    assert calls == [(name, backend) for name, *_ in case.SMOKE_RUNS for backend in ("cpu", "torch")]
    calls.clear()
    assert case.collect(smoke=True, device="cpu")["backends"] == ["cpu"]  # the CPU: the automatic choice alone
    assert [backend for _, backend in calls] == ["cpu"]


def test_a_compiled_trainer_passes_its_mode(monkeypatch):
    calls = []
    monkeypatch.setattr(case.torch, "compile", lambda model, **options: calls.append(options) or model)
    model = torch.nn.Linear(2, 2)
    trainer = case.Trainer(model, device=torch.device("cpu"), compile_model=True, compile_mode="reduce-overhead")
    assert trainer.forward is model and calls == [{"mode": "reduce-overhead"}]


def test_a_compiled_run_names_its_mode_in_the_aims(rows):
    aims = case._aims(list(rows.values()), smoke=False, device="cuda", gpu="H100", dtype="bfloat16", compiled=True,
                      compile_mode="reduce-overhead")  # fmt: skip
    assert len(aims) == 4 and all(aim["aim"].endswith("(mode reduce-overhead)") for aim in aims)
    default = case._aims(list(rows.values()), smoke=False, device="cuda", gpu="H100", dtype="bfloat16", compiled=True)
    assert not any("(mode" in aim["aim"] for aim in default)
