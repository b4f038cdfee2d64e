"""``mjp reproduce``: the paper's variants trained side by side on an ImageFolder dataset, and one report of its
claims (Markdown, JSON, PNGs).

- :mod:`~mjp_fast.reproduce.variants`: the rows and the mask-ratio sweep as plain ``mjp train`` configs, the paper's
  numbers, the presets (smoke, cpu, gpu);
- :mod:`~mjp_fast.reproduce.run`: the plan of runs, each run's training and measurements, the whole command;
- :mod:`~mjp_fast.reproduce.claims`: bootstrap intervals and the verdict rules of the five claims;
- :mod:`~mjp_fast.reproduce.attack`: the analytic gradient-inversion attack through the trained models;
- :mod:`~mjp_fast.reproduce.report`: the report's data, its Markdown and the similarity figure;
- :mod:`~mjp_fast.reproduce.cli`: the command's arguments.

    from mjp_fast.reproduce import get_preset, plan_runs, reproduce
    plan = plan_runs(get_preset("smoke"), data="../shared/data/cifar10", runs_dir="runs/reproduce-smoke")
    report = reproduce(plan, report_path="runs/reproduce-smoke/reproduction.md")
"""

from mjp_fast.reproduce.claims import VERDICTS, bootstrap_interval, direction_verdict, paired_difference
from mjp_fast.reproduce.run import plan_runs, reproduce
from mjp_fast.reproduce.variants import PRESETS, ROWS, Preset, Variant, get_preset, sweep_variant

__all__ = [
    "PRESETS",
    "ROWS",
    "VERDICTS",
    "Preset",
    "Variant",
    "bootstrap_interval",
    "direction_verdict",
    "get_preset",
    "paired_difference",
    "plan_runs",
    "reproduce",
    "sweep_variant",
]
