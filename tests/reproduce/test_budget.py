"""Epochs from a training budget (the gpu preset's way): measured throughput -> the same epochs for every run."""

import dataclasses
import json

from mjp_fast.reproduce.run import THROUGHPUT_RECORD, choose_epochs, plan_runs
from mjp_fast.reproduce.variants import get_preset


def _budget_preset(budget: float):
    smoke = get_preset("smoke")
    config = {key: value for key, value in smoke.config.items() if key != "epochs"}
    return dataclasses.replace(smoke, config=config, training_budget_s=budget, epoch_bounds=(1, 4))


def test_epochs_come_from_the_measured_throughput(cifar_sample, tmp_path, monkeypatch):
    plan = plan_runs(_budget_preset(1e6), data=cifar_sample, runs_dir=tmp_path, rows=("A", "J"), sweep=())
    choice = choose_epochs(plan)
    assert choice["images_per_second"] > 0 and choice["runs"] == 2 and choice["train_images"] == 40
    assert choice["epochs"] == 4  # a huge budget: the upper bound
    assert [(run.config.epochs, run.config.eval_interval) for run in plan.runs] == [(4, 4), (4, 4)]
    record = json.loads((tmp_path / THROUGHPUT_RECORD).read_text())
    assert record["images_per_second"] == choice["images_per_second"]

    # the same probe config again: the recorded throughput is reused (train is not called)
    import mjp_fast.reproduce.run as run_module

    monkeypatch.setattr(run_module, "train", lambda config: (_ for _ in ()).throw(AssertionError("trained again")))
    tight = plan_runs(_budget_preset(1e-3), data=cifar_sample, runs_dir=tmp_path, rows=("A", "J"), sweep=())
    assert choose_epochs(tight)["epochs"] == 1  # a tiny budget: the lower bound
    fixed = plan_runs(
        _budget_preset(1e-3), data=cifar_sample, runs_dir=tmp_path, rows=("A",), sweep=(), overrides={"epochs": 2}
    )
    assert choose_epochs(fixed) is None and fixed.runs[0].config.epochs == 2


def test_each_runs_overhead_comes_out_of_the_budget(cifar_sample, tmp_path, monkeypatch):
    """The gpu preset's way: a budget of B seconds for R runs with an overhead of O s each leaves B - R*O for the
    epochs. The throughput is recorded, not measured, so the arithmetic is exact."""
    import mjp_fast.reproduce.run as run_module

    preset = dataclasses.replace(_budget_preset(100.0), epoch_bounds=(1, 1000))
    plan = plan_runs(preset, data=cifar_sample, runs_dir=tmp_path, rows=("A", "J"), sweep=())
    monkeypatch.setattr(run_module, "train", lambda config: (_ for _ in ()).throw(AssertionError("measured")))
    probe = plan.runs_of("J")[0].config.replace(
        max_train_samples=run_module.PROBE_IMAGES, max_val_samples=1000, epochs=2, warmup_epochs=0, eval_interval=2,
        output=str(tmp_path / "throughput-probe"),
    )  # fmt: skip
    # 40 training images at 8 images/s: one epoch of one run is 5 s
    (tmp_path / THROUGHPUT_RECORD).write_text(json.dumps({"config": probe.to_dict(), "images_per_second": 8.0}))
    assert choose_epochs(plan)["epochs"] == 10  # 100 s / (2 runs x 5 s)
    with_overhead = dataclasses.replace(preset, run_overhead_s=20.0)
    plan = plan_runs(with_overhead, data=cifar_sample, runs_dir=tmp_path, rows=("A", "J"), sweep=())
    choice = choose_epochs(plan)
    assert choice["epochs"] == 6 and choice["run_overhead_seconds"] == 20.0  # (100 - 2 x 20) / (2 x 5)
    assert [run.config.epochs for run in plan.runs] == [6, 6]
    swamped = dataclasses.replace(preset, run_overhead_s=80.0)  # the overhead alone overruns: the lower bound
    plan = plan_runs(swamped, data=cifar_sample, runs_dir=tmp_path, rows=("A", "J"), sweep=())
    assert choose_epochs(plan)["epochs"] == 1
