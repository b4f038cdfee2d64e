"""The variants are plain mjp train configs; the plan merges equal ones; bad input gets a clear error."""

import pytest

from mjp_fast.cli import main
from mjp_fast.reproduce.run import parse_override_values, plan_runs
from mjp_fast.reproduce.variants import PRESETS, ROWS, get_preset, preset_variants, sweep_variant
from mjp_fast.train.config import ConfigError, build_config


@pytest.fixture
def data_dir(tmp_path):
    for split in ("train", "test"):
        (tmp_path / "data" / split / "cat").mkdir(parents=True)
    return tmp_path / "data"


def test_rows_are_the_issue_table():
    assert {key: dict(row.overrides) for key, row in ROWS.items()} == {
        "A": {"mjp": False},
        "B": {"mjp": False, "pos_embed": "none"},
        "D": {"mjp": True, "mjp_ratio": 0.0, "mjp_dal": "nonlinear", "mjp_unk": False},
        "E": {"mjp": True, "mjp_unk": False, "mjp_dal": "none"},
        "G": {"mjp": True, "mjp_dal": "none"},
        "I": {"mjp": True, "mjp_dal": "linear"},
        "J": {"mjp": True, "mjp_dal": "nonlinear"},
    }
    assert (ROWS["A"].paper.top1, ROWS["J"].paper.consistency) == (79.8, 82.9)
    swept = sweep_variant(0.09)
    assert swept.key == "J@0.09" and dict(swept.overrides)["mjp_ratio"] == 0.09 and swept.paper.consistency == 88.1
    with pytest.raises(ValueError, match="ratio must be in"):
        sweep_variant(1.5)


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_variant_of_every_preset_is_a_valid_train_config(name):
    preset = get_preset(name)
    for variant in preset_variants(preset):
        config = build_config({**preset.config, **variant.overrides, "data": "somewhere"})
        for key, value in variant.overrides.items():
            assert getattr(config, key) == value
        if name != "smoke":  # the grid the paper's ratios are defined on, or finer
            assert config.img_size // config.patch_size >= 14


def test_gpu_plan_merges_equal_configs(data_dir, tmp_path):
    plan = plan_runs(get_preset("gpu"), data=data_dir, runs_dir=tmp_path / "runs")
    ids = {run.run_id: run.variants for run in plan.runs}
    assert ids["J-seed0"] == ["J", "J@0.03"] and ids["D-seed0"] == ["D", "J@0"]
    assert ids["A-seed1"] == ["A"] and ids["J-seed1"] == ["J"]  # the sweep runs one seed
    assert len(plan.runs) == 12  # A x2, B, D, E, G, I, J x2, J at 0.09, 0.15, 0.27
    assert all(run.config.output == str(tmp_path / "runs" / run.run_id) for run in plan.runs)
    assert [run.seed for run in plan.runs_of("J")] == [0, 1]


def test_overrides_reach_every_run_but_a_variant_keeps_its_own(data_dir, tmp_path):
    preset = get_preset("smoke")
    plan = plan_runs(
        preset, data=data_dir, runs_dir=tmp_path, overrides={"epochs": 3, "mjp_dal": "linear"}, seeds=(4, 5),
        rows=("A", "J"), sweep=(),
    )  # fmt: skip
    assert [(run.run_id, run.config.epochs, run.config.eval_interval) for run in plan.runs] == [
        ("A-seed4", 3, 3),
        ("A-seed5", 3, 3),
        ("J-seed4", 3, 3),
        ("J-seed5", 3, 3),
    ]  # one evaluation, after the last epoch
    assert all(run.config.mjp_dal == "nonlinear" for run in plan.runs_of("J"))
    assert plan.notes == ["J keeps its own mjp_dal=nonlinear over the command line's"]


def test_bad_input_names_the_argument(data_dir, tmp_path):
    preset = get_preset("smoke")
    with pytest.raises(ConfigError, match="--data: folder .*nowhere.* does not exist"):
        plan_runs(preset, data=tmp_path / "nowhere", runs_dir=tmp_path)
    with pytest.raises(ConfigError, match="unknown config key 'epochz'"):
        parse_override_values(["epochz=3"])
    with pytest.raises(ConfigError, match="override seed= is not allowed here: use --seeds"):
        parse_override_values(["seed=3"])
    with pytest.raises(ConfigError, match="overrides are key=value"):
        parse_override_values(["epochs"])
    with pytest.raises(ConfigError, match="variant A: lr must be > 0"):
        plan_runs(preset, data=data_dir, runs_dir=tmp_path, overrides={"lr": -1.0})
    with pytest.raises(ConfigError, match="rows must be among"):
        plan_runs(preset, data=data_dir, runs_dir=tmp_path, rows=("Z",))
    with pytest.raises(ValueError, match="preset must be one of smoke, cpu, gpu, got 'nope'"):
        get_preset("nope")


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--preset", "nope"], "argument --preset: invalid choice: 'nope'"),
        (["--preset", "smoke", "--data", "NOWHERE"], "--data: folder 'NOWHERE' does not exist"),
        (["--preset", "smoke", "--data", "DATA", "epochz=3"], "unknown config key 'epochz'"),
        (["--preset", "smoke", "--data", "DATA", "--rows", "A,Q"], "argument --rows: expected row letters"),
        (["--preset", "smoke", "--data", "DATA", "--seeds", "0,0"], "argument --seeds: expected distinct seeds"),
        (["--preset", "smoke", "--data", "DATA", "--report", "x.txt"], "--report must name a .md file"),
    ],
)
def test_command_line_errors(arguments, message, data_dir, tmp_path, capsys):
    arguments = [str(data_dir) if item == "DATA" else item for item in arguments]
    if "--data" not in arguments:
        arguments += ["--data", str(data_dir)]
    status = main(["reproduce", *arguments, "--output", str(tmp_path / "runs")])
    assert status == 2
    assert message in capsys.readouterr().err


def test_readme_reproduce_lines_parse():
    import shlex
    from pathlib import Path

    from mjp_fast.cli import build_parser

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    lines = [shlex.split(line, comments=True) for line in readme.splitlines() if line.startswith("mjp reproduce")]
    assert {line[line.index("--preset") + 1] for line in lines} == set(PRESETS)
    for line in lines:
        args = build_parser().parse_args(line[1:])
        assert args.data == "../shared/data/cifar10" and args.handler is not None
