"""bench/bench_kernels.py: its settings reach the launches they name, and are undone after; its smoke run runs every
setting and variant in the interpreter, the jigsaw's kernels in the MJP rows only."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # `bench` is a folder of the checkout, not an installed package
    sys.path.insert(0, str(REPO_ROOT))

from bench import bench_kernels as case  # noqa: E402
from mjp_fast.triton import common, dal_loss, patch_embed  # noqa: E402

H100_SHARED = 227 * 1024


PARTIALS_UNPIPELINED = {"mjp_fast.triton.common.PARTIAL_STAGES": 1}


def _plan_stages() -> int:
    # DeiT-S's float32 gradient on an H100 (132 SMs), compiled (not interpreting): the partials kernel's stages
    return common.position_gradient_plan(256, 197, 384, torch.float32, 132, False, has_mask=True).num_stages


def test_each_setting_reaches_what_it_names_and_is_undone(monkeypatch):
    monkeypatch.setattr(patch_embed, "shared_memory_optin", lambda device: H100_SHARED)
    cuda = torch.device("cuda", 0)  # only asked for its shared memory (the stand-in above)
    default = (_plan_stages(), patch_embed.grad_weight_stages(True, cuda))
    assert default == (2, patch_embed.GRAD_WEIGHT_PERM_STAGES) == (2, 5)
    # the settings the H200 answered (2026-11-28), as a setting names them: the cached plans follow them
    with case.applied(PARTIALS_UNPIPELINED):
        assert common.PARTIAL_STAGES == 1
        assert _plan_stages() == 1  # the cached plan of the default is not handed out again
    with case.applied({"mjp_fast.triton.patch_embed.GRAD_WEIGHT_PERM_STAGES": 3}):
        assert patch_embed.grad_weight_stages(True, cuda) == 3
        assert _plan_stages() == 2
    assert (_plan_stages(), patch_embed.grad_weight_stages(True, cuda)) == default  # restored, plans made again
    assert patch_embed.grad_weight_stages(False, cuda) == patch_embed.GRAD_WEIGHT_STAGES
    # the one still in question: the DAL backward's earlier tiles against the adopted ones
    adopted = dict(dal_loss.BACKWARD_TILES)
    assert adopted == {"BLOCK_N": 32, "BLOCK_H": 32, "BLOCK_D": 32}
    with case.applied(case.SETTINGS["DAL backward, earlier tiles"]):
        assert dal_loss.BACKWARD_TILES == {"BLOCK_N": 16, "BLOCK_H": 32, "BLOCK_D": 64}
    assert dal_loss.BACKWARD_TILES == adopted


def test_a_setting_is_undone_when_its_measurement_raises():
    before = common.PARTIAL_STAGES
    with pytest.raises(RuntimeError, match="measured"), case.applied({"mjp_fast.triton.common.PARTIAL_STAGES": 7}):
        assert common.PARTIAL_STAGES == 7
        raise RuntimeError("measured")
    assert common.PARTIAL_STAGES == before


@pytest.mark.parametrize("path", ["mjp_fast.triton.common.NO_SUCH_CONSTANT", "PARTIAL_STAGES"])
def test_a_setting_naming_no_constant_is_refused(path):
    before = common.PARTIAL_STAGES
    setting = {"mjp_fast.triton.common.PARTIAL_STAGES": 9, path: 1}  # the first is set, then undone
    with pytest.raises(ValueError, match="names no module constant"), case.applied(setting):
        pass
    assert common.PARTIAL_STAGES == before


def test_resolved_launches_records_what_the_launches_chose_and_puts_the_functions_back(monkeypatch):
    plan_of, stages_of = common._position_plan, patch_embed.grad_weight_stages
    weight_of = patch_embed._grad_weight_launch
    monkeypatch.setattr(patch_embed, "shared_memory_optin", lambda device: H100_SHARED)
    grad = torch.zeros(4, 10, 32)
    with case.resolved_launches() as seen:
        plan = common._position_plan(grad)
        common._position_plan(grad)  # the same plan: recorded once
        patch_embed.grad_weight_stages(True, torch.device("cuda", 0))
        patch_embed.grad_weight_stages(False, torch.device("cuda", 0))
        images, weight = torch.zeros(1, 1, 4, 4), torch.zeros(2, 1, 2, 2)
        grad_out, perm = torch.zeros(1, 4, 2), torch.arange(4)[None]
        for index, inverse in ((None, None), (perm, None), (perm, torch.argsort(perm).int())):
            patch_embed._grad_weight_launch(grad_out, images, index, weight, 0, None, False, inverse=inverse)
    assert seen["partials"] == [[plan.num_stages, plan.chunks, plan.block_b, plan.block_n, plan.block_d]]
    assert seen["grad_weight_stages"][:2] == [[True, 5], [False, 3]]
    assert seen["grad_weight_path"] == ["none", "gather", "inverse"]
    assert (common._position_plan, patch_embed.grad_weight_stages) == (plan_of, stages_of)
    assert patch_embed._grad_weight_launch is weight_of


def test_a_cpu_run_that_is_not_a_smoke_run_measures_nothing_and_says_why():
    section = case.collect(smoke=False, device="cpu")
    assert section["results"] == [] and section["aims"] == []
    assert "GPU only" in section["note"]
    info = {"device": "cpu", "cpu": "x", "torch_threads": 2}
    assert "NOT RUN: the Triton kernels run compiled on a GPU only" in case.report(section, info)


def check_kernels_values(section: dict) -> None:
    """Every setting of every model has both variants; MJP's extra is its median over the baseline's of the same
    setting; the jigsaw's kernels (sampler, DAL) launch in the MJP rows only, and the weight gradient resolves
    its perm stages there."""
    rows = section["results"]
    models = [run["model"] for run in section["config"]["runs"]]
    assert [(row["model"], row["setting"]) for row in rows[::2]] == [
        (model, setting) for model in models for setting in case.SETTINGS
    ]
    for plain, mjp in zip(rows[::2], rows[1::2], strict=True):
        assert (plain["implementation"], mjp["implementation"]) == ("plain + fast patch embed", "mjp prob=1")
        assert (plain["setting"], plain["model"]) == (mjp["setting"], mjp["model"])
        assert plain["constants"] == case.SETTINGS[plain["setting"]]
        assert plain["extra_busy_s"] is None
        assert mjp["extra_busy_s"] == pytest.approx(mjp["median_s"] - plain["median_s"])
        assert "_sample_jigsaw_kernel" in mjp["launches"] and "_sample_jigsaw_kernel" not in plain["launches"]
        assert "_forward_partial_kernel" in mjp["launches"]  # DAL
        assert plain["launches"]["_grad_weight_kernel"] == mjp["launches"]["_grad_weight_kernel"] == 1
        assert [perm for perm, _ in plain["resolved"]["grad_weight_stages"]] == [False]
        assert [perm for perm, _ in mjp["resolved"]["grad_weight_stages"]] == [True]
        # the sampler's jigsaw is a permutation: the inverse path, but where the setting turns it off
        gathered = case.SETTINGS[plain["setting"]].get("mjp_fast.triton.patch_embed.WEIGHT_GRADIENT_BY_INVERSE")
        assert plain["resolved"]["grad_weight_path"] == ["none"]
        assert mjp["resolved"]["grad_weight_path"] == ["gather" if gathered is False else "inverse"]
        assert plain["resolved"]["partials"] and mjp["resolved"]["partials"]
        if plain["setting"] == case.DEFAULT:
            assert plain["max_relative_difference"] == mjp["max_relative_difference"] == 0.0


@pytest.mark.timeout(120)
def test_kernels_benchmark_smoke(tmp_path, capsys):
    assert case.main(["--smoke", "--out", str(tmp_path), "--device", "cpu"]) == 0
    (path,) = tmp_path.glob("*.json")
    assert path.name.endswith("-kernels-smoke.json")
    payload = json.loads(path.read_text())
    assert payload["benchmark"] == "kernels" and payload["smoke"] is True and payload["backends"] == ["triton"]
    check_kernels_values(payload)
    for row in payload["results"]:
        assert row["timer"] == "wall clock" and row["kernels"] == []  # the profiler's times are a GPU's
        # The interpreter takes none of the settings' GPU tiles, stages or warps: every setting computes the
        # default's gradients bit for bit, for the same jigsaws (each setting's MJP call draws the stream's first)
        assert row["max_relative_difference"] == 0.0
        assert 0 < row["p20_s"] <= row["median_s"] <= row["p80_s"]
    printed = capsys.readouterr().out
    assert "## Triton kernels of MJP's part of a step" in printed
    assert printed.count("| DeiT-Tiny, batch 2 |") == 2 * len(case.SETTINGS)


@pytest.mark.timeout(120)
def test_a_setting_that_fails_is_reported_and_the_others_still_measured(monkeypatch):
    settings = {case.DEFAULT: {}, "broken": {"mjp_fast.triton.common.NO_SUCH_CONSTANT": 1}}
    monkeypatch.setattr(case, "SETTINGS", {**settings, "pipeline": PARTIALS_UNPIPELINED})
    section = case.collect(smoke=True, device="cpu")
    assert [row["setting"] for row in section["results"]] == [case.DEFAULT] * 2 + ["pipeline"] * 2
    (message,) = section["errors"].values()
    assert list(section["errors"]) == ["DeiT-Tiny, broken"] and message.startswith("ValueError: setting:")
    assert "ERROR DeiT-Tiny, broken: ValueError" in case.report(section, {"gpu": "test"})
    monkeypatch.setattr(case, "SETTINGS", {case.DEFAULT: settings["broken"]})  # the default's error is raised
    with pytest.raises(ValueError, match="names no module constant"):
        case.collect(smoke=True, device="cpu")


@pytest.mark.timeout(120)
def test_an_interrupt_keeps_the_settings_measured_before_it(monkeypatch):
    from bench.common import PartialResults

    measure = case._measure_setting
    calls = []

    def measure_until_the_third(setting, *args, **kwargs):
        calls.append(setting)
        if len(calls) == 3:
            raise KeyboardInterrupt  # a deadline's SIGINT
        return measure(setting, *args, **kwargs)

    monkeypatch.setattr(case, "_measure_setting", measure_until_the_third)
    monkeypatch.setattr(case, "SETTINGS", {**case.SETTINGS, "pipeline": PARTIALS_UNPIPELINED})  # three settings
    with pytest.raises(PartialResults) as stopped:
        case.collect(smoke=True, device="cpu")
    section = stopped.value.section
    settings = list(case.SETTINGS)
    assert [row["setting"] for row in section["results"]] == [settings[0]] * 2 + [settings[1]] * 2
    assert "stopped before every setting" in section["note"]
    assert isinstance(stopped.value, KeyboardInterrupt)  # still the interrupt it was


def test_relative_difference_is_the_worst_gradient_over_its_own_scale():
    expected = {"w": torch.tensor([2.0, -4.0]), "b": torch.tensor([0.5])}
    assert case.relative_difference({name: value.clone() for name, value in expected.items()}, expected) == 0.0
    got = {"w": torch.tensor([2.0, -4.4]), "b": torch.tensor([0.5])}
    assert case.relative_difference(got, expected) == pytest.approx(0.1)  # 0.4 against the largest magnitude 4
    got = {"w": torch.tensor([2.0, -4.0]), "b": torch.tensor([0.75])}
    assert case.relative_difference(got, expected) == pytest.approx(0.5)
    assert case.relative_difference({"w": expected["w"]}, expected) == float("inf")  # a gradient missing
    assert case.relative_difference({**expected, "b": torch.zeros(2)}, expected) == float("inf")
    nan = case.relative_difference({**expected, "b": torch.tensor([float("nan")])}, expected)
    assert nan != nan  # NaN stays NaN: no verdict of "same"
    assert case.relative_difference({"w": torch.ones(1)}, {"w": torch.zeros(1)}) > 1e20  # against a zero gradient
    with pytest.raises(ValueError, match="expected: no gradient"):
        case.relative_difference({}, {})


def test_the_default_setting_comes_first_and_changes_nothing():
    names = list(case.SETTINGS)
    assert names[0] == case.DEFAULT and case.SETTINGS[case.DEFAULT] == {}
    assert all(case.SETTINGS[name] for name in names[1:])


def test_each_setting_gets_a_summary_line_against_the_default():
    def row(setting: str, label: str, busy: float, extra, kernels: list, difference: float = 0.0) -> dict:
        return {
            "model": "deit_small_patch16_224",
            "setting": setting,
            "implementation": label,
            "median_s": busy,
            "extra_busy_s": extra,
            "kernels": kernels,
            "max_relative_difference": difference,
        }

    rows = [
        row("default", "plain + fast patch embed", 1e-3, None, [["a", 500e-6]]),
        row("default", "mjp prob=1", 1.4e-3, 400e-6, [["a", 600e-6], ["b", 200e-6], ["c", 10e-6]]),
        row("x", "plain + fast patch embed", 1e-3, None, [["a", 500e-6]]),
        row("x", "mjp prob=1", 1.3e-3, 300e-6, [["a", 600e-6], ["b", 100e-6], ["d", 5e-6]], 2e-7),
    ]
    (line,) = case.setting_lines(rows)  # the default's rows and the baseline's get none
    assert line.startswith("SETTING x (DeiT-Small): MJP extra 300 us (default 400 us), busy 1.3 ms (default 1.4 ms)")
    assert "gradients 2.0e-07" in line
    # the kernels that moved most, the MJP variant's against the default's: b by 100 us, c and d gone or new
    assert line.endswith("; b 100 us (default 200 us), c not run (default 10 us), d 5 us (default not run)")
    rows[3]["max_relative_difference"] = 0.0
    assert "gradients same" in case.setting_lines(rows)[0]


def test_the_kernel_table_lines_up_each_kernel_under_every_setting():
    def row(setting: str, label: str, kernels: list) -> dict:
        return {"model": "m", "setting": setting, "implementation": label, "kernels": kernels}

    rows = [
        row("default", "plain + fast patch embed", [["_grad_weight_kernel", 260e-6]]),
        row("default", "mjp prob=1", [["_grad_weight_kernel", 300e-6], ["_sample_jigsaw_kernel", 19e-6]]),
        row("x", "plain + fast patch embed", [["_grad_weight_kernel", 250e-6]]),
        row("x", "mjp prob=1", [["_grad_weight_kernel", 430e-6], ["_sample_jigsaw_kernel", 19e-6]]),
    ]
    lines = case.kernel_table(rows, "m").splitlines()
    assert [cell.strip() for cell in lines[0].split("|")[1:-1]] == [
        "kernel",
        "default: plain",
        "default: mjp",
        "x: plain",
        "x: mjp",
    ]
    cells = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]] for line in lines[2:]}
    assert cells["_grad_weight_kernel"] == ["260 us", "300 us", "250 us", "430 us"]
    assert cells["_sample_jigsaw_kernel"] == ["", "19 us", "", "19 us"]
    assert case.kernel_table(rows, "other") == ""
