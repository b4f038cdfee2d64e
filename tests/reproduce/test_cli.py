"""``mjp reproduce``'s arguments: where the report goes (beside the runs unless --report names a file), without
training: the command's ``reproduce`` is replaced by one that records what it was asked to write."""

from pathlib import Path

import pytest

from mjp_fast.cli import main
from mjp_fast.reproduce import run as run_module


@pytest.fixture
def data_dir(tmp_path):
    for split in ("train", "test"):
        (tmp_path / "data" / split / "cat").mkdir(parents=True)
    return tmp_path / "data"


@pytest.fixture
def asked(monkeypatch):
    """The report paths and commands that ``reproduce`` was called with (nothing is trained)."""
    calls = []

    def record(plan, *, report_path, command=None, **_):
        calls.append({"report": Path(report_path), "runs_dir": plan.runs_dir, "command": command})
        return {}

    monkeypatch.setattr(run_module, "reproduce", record)
    return calls


@pytest.mark.parametrize("preset", ["smoke", "cpu", "gpu"])
def test_the_report_goes_beside_the_runs_by_default(preset, data_dir, tmp_path, monkeypatch, asked):
    # Run from a checkout: its committed docs/reproduction.md must not be the default target.
    checkout = tmp_path / "checkout"
    (checkout / "docs").mkdir(parents=True)
    monkeypatch.chdir(checkout)
    assert main(["reproduce", "--preset", preset, "--data", str(data_dir), "--output", str(tmp_path / "out")]) == 0
    assert asked[-1]["report"] == tmp_path / "out" / "reproduction.md"
    assert main(["reproduce", "--preset", preset, "--data", str(data_dir)]) == 0
    assert asked[-1]["report"] == Path("runs") / f"reproduce-{preset}" / "reproduction.md"
    assert asked[-1]["runs_dir"] == Path("runs") / f"reproduce-{preset}"


def test_report_option_names_the_committed_report_deliberately(data_dir, tmp_path, asked):
    arguments = ["reproduce", "--preset", "cpu", "--data", str(data_dir), "--output", str(tmp_path / "runs")]
    assert main([*arguments, "--report", "docs/reproduction.md"]) == 0
    assert asked[-1]["report"] == Path("docs/reproduction.md")
    # the report says how it was made, --report included, so the same command rebuilds it
    assert "--report docs/reproduction.md" in asked[-1]["command"]
