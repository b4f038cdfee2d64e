"""The report's claims from run records: synthetic records of a plan's runs fed to :func:`build_report` (nothing is
trained), so that each claim is judged on the comparison it names."""

import numpy as np
import pytest

from mjp_fast.reproduce import report as report_module
from mjp_fast.reproduce.claims import NOT_MEASURED, VERDICTS
from mjp_fast.reproduce.run import pack_hits, plan_runs
from mjp_fast.reproduce.variants import get_preset

TEST_IMAGES = 400
# Consistency % and diff-norm by training mask ratio of J, and for the rows that are not J: A's consistency is the
# highest, so a claim that took A for J at ratio 0 would say "disagrees".
J_AT_RATIO = {0.0: (64.0, 16.0), 0.03: (80.0, 9.0), 0.27: (93.0, 4.0)}
OTHER_ROWS = {"A": (95.0, 2.0), "E": (70.0, 12.0), "G": (85.0, 8.0)}


@pytest.fixture
def data_dir(tmp_path):
    for split in ("train", "test"):
        (tmp_path / "data" / split / "cat").mkdir(parents=True)
    return tmp_path / "data"


def _record(spec, generator) -> dict:
    config = spec.config
    key = spec.variants[0]
    consistency, diff_norm = (
        OTHER_ROWS[key] if key in OTHER_ROWS else J_AT_RATIO[float(config.mjp_ratio) if config.mjp else 0.0]
    )
    hits = generator.random(TEST_IMAGES) < 0.5
    return {
        "id": spec.run_id,
        "variants": list(spec.variants),
        "seed": spec.seed,
        "device": "cpu",
        "top1": 100.0 * float(hits.mean()),
        "consistency": consistency,
        "diff_norm": diff_norm,
        "images_per_second": 100.0,
        "test_images": TEST_IMAGES,
        "hits": pack_hits(hits),
        "position_regression": None,
        "position_chance": None,
    }


def _claims(data_dir, tmp_path, rows, sweep, seeds=(0,)) -> list[dict]:
    plan = plan_runs(get_preset("cpu"), data=data_dir, runs_dir=tmp_path / "runs", rows=rows, sweep=sweep, seeds=seeds)
    generator = np.random.default_rng(0)
    records = {spec.run_id: _record(spec, generator) for spec in plan.runs}
    report = report_module.build_report(
        plan,
        records,
        masks=[],
        attack=None,
        environment={"versions": {}, "command": "mjp reproduce"},
        started="now",
        wall_seconds=1.0,
        paths={"markdown": tmp_path / "reproduction.md", "json": tmp_path / "reproduction.json"},
    )
    return report["claims"]


def test_row_a_is_not_j_at_ratio_zero(data_dir, tmp_path):
    # mjp reproduce --preset cpu --rows A,J --seeds 2 --sweep none: one ratio of J, so claim 3 is not measured
    trend = _claims(data_dir, tmp_path, ("A", "J"), (), seeds=(2,))[2]
    assert trend["number"] == 3 and trend["verdict"] == NOT_MEASURED
    assert "J only at ratio 0.03" in trend["evidence"] and "A is not J at ratio 0" in trend["evidence"]
    assert trend["numbers"] == {}


@pytest.mark.parametrize(
    ("rows", "sweep", "ratios", "labels"),
    [
        (("A", "J"), (0.27,), [0.03, 0.27], ["J", "J@0.27"]),
        (("A", "J"), (0.03, 0.27), [0.03, 0.27], ["J@0.03", "J@0.27"]),  # J and J@0.03 share a run: one point
        (("A", "D", "J"), (), [0.0, 0.03], ["D", "J"]),  # D is J's config at ratio 0 (no jigsaw, so no UNK)
        (("A", "D", "J"), (0.0,), [0.0, 0.03], ["J@0", "J"]),
    ],
)
def test_the_trend_is_judged_on_the_runs_of_j_alone(data_dir, tmp_path, rows, sweep, ratios, labels):
    trend = _claims(data_dir, tmp_path, rows, sweep)[2]
    points = trend["numbers"]["points"]
    assert [point["ratio"] for point in points] == ratios
    assert [point["label"] for point in points] == labels
    assert [point["consistency"] for point in points] == [J_AT_RATIO[ratio][0] for ratio in ratios]
    assert trend["verdict"] in VERDICTS
    assert "A (" not in trend["evidence"]


@pytest.mark.parametrize(("rows", "words"), [(("A", "G", "J"), "J only at ratio 0.03"), (("A", "E"), "no run of J")])
def test_rows_that_are_not_j_never_count_as_a_ratio(data_dir, tmp_path, rows, words):
    trend = _claims(data_dir, tmp_path, rows, ())[2]
    assert trend["verdict"] == NOT_MEASURED and words in trend["evidence"]


def test_similarity_sheet_captions_are_legible(data_dir, tmp_path):
    # A's panel from its plot, J's without position embeddings; each under a caption naming its variants.
    from PIL import Image

    plan = plan_runs(get_preset("cpu"), data=data_dir, runs_dir=tmp_path / "runs", rows=("A", "J"), sweep=(0.03,))
    plot = tmp_path / "a.png"
    Image.new("RGB", (900, 1000), (40, 90, 160)).save(plot)
    records = {"A-seed0": {"id": "A-seed0", "similarity_plot": str(plot)}}
    records.update({spec.run_id: {"id": spec.run_id, "similarity_plot": None} for spec in plan.runs[1:]})
    path = report_module.similarity_figure(plan, records, tmp_path / "sheet.png")
    with Image.open(path) as opened:
        sheet = np.asarray(opened.convert("L"))
    panel = report_module.PANEL_WIDTH
    assert sheet.shape[1] == 2 * (panel + 12) + 12  # A; J = J@0.03 (one run, one panel)
    for column in range(2):
        left = 12 + column * (panel + 12)
        caption = sheet[12 : 12 + report_module.CAPTION, left : left + panel] < 128
        inked_rows = np.flatnonzero(caption.any(axis=1))
        assert inked_rows.size and inked_rows[-1] - inked_rows[0] + 1 >= 12  # a capital letter 12 px or taller
    # A's plot fills its panel's height, below the caption
    assert sheet[12 + report_module.CAPTION + panel // 2, 12 + 10] < 200
