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
    case.LINEAR: [1.1, 2.0, 1.05],
    case.FAST: [1.0, 2.0, 1.02],
    0.5: [1.04, 2.0, 1.01],
    1.0: [1.1, 2.0, 1.05],
}
ISOLATED_S = {0.5: 0.002, 1.0: 0.004}
# the isolated work's GPU busy time (measured on a GPU only); FAST: the fused embedding's against timm's
ISOLATED_GPU_S = {0.5: 50e-6, 1.0: 90e-6, case.FAST: -20e-6}
# the isolated work's kernels per variant (GPU runs), most time first
KERNELS = {0.5: [["sample_jigsaw_kernel", 20e-6], ["dal_forward", 10e-6]], case.FAST: [["gemm", 300e-6]]}
# Steady state: seconds per block of STEADY_STEPS steps, per variant, one per block (block 0 runs the variants in
# order, block 1 reversed). Against the fast embedding, MJP prob=0.5 costs +10% and +0% per block (median +5%).
STEADY_STEPS = 3
STEADY_S = {
    None: [1.0, 1.25],
    case.LINEAR: [1.2, 1.2],
    case.FAST: [1.0, 1.0],
    0.5: [1.1, 1.0],
    1.0: [1.0, 1.0],
}


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
    blocks = [order if index % 2 == 0 else order[::-1] for index in range(2)]
    steady_script = iter(STEADY_S[variant][index] for index, variants in enumerate(blocks) for variant in variants)

    class ScriptedTimer:
        def __init__(self, device):
            pass

        def __call__(self, function):
            function()
            return next(script)

    class ScriptedBlockTimer:
        def __init__(self, device):
            pass

        def __call__(self, function, steps):
            assert steps == STEADY_STEPS
            function()
            return next(steady_script)

    monkeypatch.setattr(case, "_models", lambda *_, **__: {variant: torch.nn.Identity() for variant in order})
    monkeypatch.setattr(case, "Trainer", _Trainer)
    monkeypatch.setattr(case, "StepTimer", ScriptedTimer)
    monkeypatch.setattr(case, "BlockTimer", ScriptedBlockTimer)
    monkeypatch.setattr(case, "_isolated", lambda *_, **__: (ISOLATED_S, ISOLATED_GPU_S, KERNELS))
    options = dict(batch=2, image_size=32, pairs=3, max_seconds=None, warmup=0, device="cpu", compile_model=False)
    options |= dict(steady_blocks=2, steady_steps=STEADY_STEPS)
    rows = case.run_model("deit_tiny_patch16_224", smoke=True, backend="cuda", **options)
    assert next(script, None) is None and next(steady_script, None) is None  # every scripted step taken, once
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
    linear = rows[case.LINEAR]
    assert linear["overhead_vs_linear_median_pct"] is None and linear["overhead_vs_fast_median_pct"] is None
    assert rows[None]["overhead_vs_linear_median_pct"] is None


def test_the_linear_embedding_is_timed_against_plain_and_the_others_against_it(rows):
    plain, linear = np.asarray(TIMES[None]), np.asarray(TIMES[case.LINEAR])
    row = rows[case.LINEAR]
    assert row["implementation"] == "plain + linear embed" and row["pairs"] == 3
    assert row["overhead_median_pct"] == pytest.approx(np.median(100.0 * (linear / plain - 1.0)))
    assert row["overhead_of_medians_pct"] == pytest.approx(100.0 * (np.median(linear) / np.median(plain) - 1.0))
    assert row["isolated_gpu_extra_s"] is None  # the fast embedding's busy time is its own
    for variant in (case.FAST, *case.MJP_PROBS):
        against = 100.0 * (np.asarray(TIMES[variant]) / linear - 1.0)
        assert rows[variant]["overhead_vs_linear_median_pct"] == pytest.approx(np.median(against))
        assert rows[variant]["overhead_vs_linear_p20_pct"] == pytest.approx(np.percentile(against, 20))
    printed = case.table([rows[0.5]])
    assert "overhead vs linear embed" in printed and f"{rows[0.5]['overhead_vs_linear_median_pct']:+.2f}%" in printed


def test_the_steady_state_comes_from_the_alternating_blocks(rows):
    steps, batch = STEADY_STEPS, 2

    def ips(variant):
        return batch * steps / np.asarray(STEADY_S[variant])

    for variant, row in rows.items():
        assert row["steady_blocks"] == 2 and row["steady_steps"] == steps
        assert row["steady_images_per_s_blocks"] == pytest.approx(ips(variant).tolist())
        assert row["steady_images_per_s"] == pytest.approx(np.median(ips(variant)))
    assert rows[None]["steady_overhead_median_pct"] is None  # the baseline
    mjp = rows[0.5]
    assert mjp["steady_overhead_vs_fast_blocks_pct"] == pytest.approx([10.0, 0.0])  # per block, in time
    assert mjp["steady_overhead_vs_fast_median_pct"] == pytest.approx(5.0)
    assert mjp["steady_overhead_median_pct"] == pytest.approx(np.median([10.0, -20.0]))
    assert mjp["steady_overhead_vs_linear_median_pct"] == pytest.approx(
        np.median(100 * (np.array([1.1, 1.0]) / 1.2 - 1))
    )
    assert rows[case.FAST]["steady_overhead_vs_fast_median_pct"] is None
    assert rows[case.FAST]["steady_overhead_vs_linear_median_pct"] == pytest.approx(100 * (1.0 / 1.2 - 1))
    assert rows[case.LINEAR]["steady_overhead_median_pct"] == pytest.approx(np.median([20.0, -4.0]))
    assert rows[case.LINEAR]["steady_overhead_vs_linear_median_pct"] is None
    printed = case.steady_table(list(rows.values()))
    cells = [[cell.strip() for cell in line.split("|")[1:-1]] for line in printed.splitlines()[2:]]
    assert [cell[2] for cell in cells] == [case.variant_name(variant) for variant in TIMES]
    assert cells[3][4:] == ["2 x 3", "-5.00%", "+5.00%", "-12.50%"]  # mjp prob=0.5


def test_no_steady_state_without_blocks():
    fields = case._steady_fields(0.5, {}, 3, 0.0)
    assert fields["steady_blocks"] == 0 and fields["steady_images_per_s"] is None
    assert fields["steady_overhead_vs_fast_median_pct"] is None
    assert case.steady_table([{"model": "m", "batch": 1, **fields}]) == ""
    with pytest.raises(ValueError, match="steady_steps at least 1"):
        case.collect(smoke=True, device="cpu", steady_steps=0)


@pytest.mark.parametrize("steady_blocks, expected_pairs", [(0, 8), (2, case.MIN_PAIRS)])
def test_the_seconds_budget_leaves_room_for_the_steady_state(monkeypatch, steady_blocks, expected_pairs):
    # Every step "takes" 1 s (scripted; the wall clock barely moves): 2 blocks x 3 steps x 5 variants need 30 s,
    # more than the 20 s budget, so the pairs stop at the fewest allowed; without blocks all 8 pairs run.
    variants = list(TIMES)
    monkeypatch.setattr(case, "_models", lambda *_, **__: {variant: torch.nn.Identity() for variant in variants})
    monkeypatch.setattr(case, "Trainer", _Trainer)
    monkeypatch.setattr(case, "StepTimer", lambda device: lambda function: function() or 1.0)
    monkeypatch.setattr(case, "BlockTimer", lambda device: lambda function, steps: function() or float(steps))
    monkeypatch.setattr(case, "_isolated", lambda *_, **__: (ISOLATED_S, {}, {}))
    options = dict(batch=2, image_size=32, pairs=8, max_seconds=20.0, warmup=0, device="cpu", compile_model=False)
    rows = case.run_model("deit_tiny_patch16_224", smoke=True, steady_blocks=steady_blocks, steady_steps=3, **options)
    assert {row["pairs"] for row in rows} == {expected_pairs}
    assert {row["steady_blocks"] for row in rows} == {steady_blocks}


def test_the_gpu_aims_are_judged_on_the_steady_state_too(rows):
    measured = [dict(row, model="deit_small_patch16_224", batch=256, image_size=224) for row in rows.values()]
    aims = case._overhead_aims(
        measured, "", smoke=False, device="cuda", gpu="NVIDIA H200", dtype="bfloat16", compiled=False
    )
    deit_s = [aim for aim in aims if "DeiT-Small" in aim["aim"]]
    steady = [aim for aim in deit_s if "steady state" in aim["aim"]]
    pairs = [aim for aim in deit_s if "steady state" not in aim["aim"]]
    assert len(steady) == len(pairs) == 2  # the same aims, one per prob, on each figure
    assert [aim["threshold"] for aim in steady] == [aim["threshold"] for aim in pairs] == [0.25, 0.25]
    # steady: prob 0.5 at +5% (FAIL), prob 1.0 at 0% (PASS); the note gives the blocks and their spread
    assert [(aim["measured"], aim["verdict"]) for aim in steady] == [(pytest.approx(5.0), "FAIL"), (0.0, "PASS")]
    assert "median over 2 blocks of 3 steps, per block +0.00% to +10.00%" in steady[0]["note"]
    # a run without the steady state: its aims say so, not judged
    unmeasured = [dict(row, steady_overhead_vs_fast_median_pct=None) for row in measured]
    again = case._overhead_aims(
        unmeasured, "", smoke=False, device="cuda", gpu="NVIDIA H200", dtype="bfloat16", compiled=False
    )
    assert {aim["verdict"] for aim in again if "steady state" in aim["aim"]} == {"NOT RUN"}
    # on the CPU: the CPU aim on the pairs alone; the GPU's (pairs and steady) not run
    on_cpu = case._overhead_aims(measured, "", smoke=False, device="cpu", gpu=None, dtype="float32", compiled=False)
    assert not any("steady state" in aim["aim"] and aim["verdict"] != "NOT RUN" for aim in on_cpu)
    assert not any("on the CPU" in aim["aim"] and "steady state" in aim["aim"] for aim in on_cpu)


def test_the_linear_projection_is_timms_convolution():
    """plain + linear embed computes what plain timm computes: the same tokens, the same weight and bias
    gradients, the same state dict, on an odd grid."""
    from timm.layers import PatchEmbed

    torch.manual_seed(0)
    embed = PatchEmbed(img_size=(12, 20), patch_size=4, in_chans=3, embed_dim=5)
    linear = case.LinearPatchProjection(embed.proj)
    assert linear.weight is embed.proj.weight and linear.bias is embed.proj.bias
    images = torch.randn(3, 3, 12, 20)
    grad = torch.randn(3, 15, 5)
    expected = embed(images)
    expected.backward(grad)
    expected_grads = [embed.proj.weight.grad.clone(), embed.proj.bias.grad.clone()]
    embed.zero_grad(set_to_none=True)
    embed.proj = linear
    got = embed(images)
    assert got.shape == (3, 15, 5) and got.is_contiguous()  # PatchEmbed's flatten + transpose: a view, no copy
    got.backward(grad)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close([embed.proj.weight.grad, embed.proj.bias.grad], expected_grads)
    assert list(embed.state_dict()) == ["proj.weight", "proj.bias"]
    with pytest.raises(ValueError, match="conv must be a patch embedding's Conv2d"):
        case.LinearPatchProjection(torch.nn.Conv2d(3, 5, kernel_size=4, stride=2))


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
            row["steady_overhead_vs_fast_median_pct"] = 0.1
    aims = case._aims(triton + cuda, smoke=False, device="cuda", gpu="NVIDIA H100", dtype="bfloat16")
    deit_s = [aim for aim in aims if "DeiT-Small" in aim["aim"]]
    named = {backend: [aim for aim in deit_s if f"(backend {backend})" in aim["aim"]] for backend in ("triton", "cuda")}
    # 2 probs x (overhead over the pairs, overhead in the steady state, GPU work)
    assert len(named["triton"]) == len(named["cuda"]) == len(deit_s) // 2 == 6
    assert {aim["verdict"] for aim in named["cuda"]} == {"PASS"}
    # triton's (the scripted times): overheads of prob 0.5 and 1.0 (medians 0% and +2.9% against 0.25%), in the
    # steady state (+5% and 0%), then GPU work 50 and 90 us (against 80 us)
    assert [aim["verdict"] for aim in named["triton"]] == ["PASS", "FAIL", "FAIL", "PASS", "PASS", "FAIL"]
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
    # 2 compiled aims (DeiT-S, DeiT-Ti) x 2 probs x (pairs, steady state)
    assert len(aims) == 8 and all(aim["aim"].endswith("(mode reduce-overhead)") for aim in aims)
    default = case._aims(list(rows.values()), smoke=False, device="cuda", gpu="H100", dtype="bfloat16", compiled=True)
    assert not any("(mode" in aim["aim"] for aim in default)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_smoke_run_measures_the_linear_embedding_and_the_steady_state(tmp_path, capsys):
    """The script on tiny real models: a row per variant, the linear embedding's among them, each with its
    steady-state figure, printed in both tables."""
    import json

    assert case.main(["--smoke", "--out", str(tmp_path), "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    (path,) = tmp_path.glob("*.json")
    section = json.loads(path.read_text())
    blocks, steps = case.STEADY["smoke"]
    assert (section["config"]["steady_blocks"], section["config"]["steady_steps"]) == (blocks, steps)
    rows = {row["implementation"]: row for row in section["results"]}
    assert list(rows) == [case.variant_name(key) for key in (None, case.LINEAR, case.FAST, *case.MJP_PROBS)]
    for name, row in rows.items():
        assert row["steady_blocks"] == blocks and len(row["steady_images_per_s_blocks"]) == blocks
        assert row["steady_images_per_s"] == pytest.approx(float(np.median(row["steady_images_per_s_blocks"])))
        assert (row["steady_overhead_median_pct"] is None) == (name == case.PLAIN)
        assert (row["overhead_vs_linear_median_pct"] is None) == (name in (case.PLAIN, "plain + linear embed"))
    for prob in case.MJP_PROBS:
        row = rows[case.variant_name(prob)]
        ratios = np.asarray(rows["plain + fast patch embed"]["steady_images_per_s_blocks"]) / np.asarray(
            row["steady_images_per_s_blocks"]
        )
        assert row["steady_overhead_vs_fast_blocks_pct"] == pytest.approx((100.0 * (ratios - 1.0)).tolist())
    assert rows["plain + linear embed"]["overhead_median_pct"] is not None  # its step against plain timm
    assert "| plain + linear embed" in printed and "steady images/s" in printed
    assert sum("in the steady state" in aim["aim"] for aim in section["aims"]) == 4  # the GPU's, not judged here
    assert {aim["verdict"] for aim in section["aims"]} == {"NOT JUDGED"}
