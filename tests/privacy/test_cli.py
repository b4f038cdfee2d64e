"""``mjp attack`` end to end on a folder of photos; its outputs: the folder it writes into
(``runs/attack-<date>-<time>`` by default), the options that put one file elsewhere, ``--grid`` as ``--png``."""

import json

import pytest
from PIL import Image

from mjp_fast.cli import main
from mjp_fast.privacy import METRICS, SETTINGS
from mjp_fast.privacy.cli import OUTPUT_NAMES

ONE_IMAGE = ["--max-images", "1", "--ratio", "0.5"]  # one of scikit-image's photos: a second or two per run
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_mjp_attack_command(tmp_path, photos, capsys):
    names, images = photos
    folder = tmp_path / "photos"
    folder.mkdir()
    for name, image in zip(names[:2], images[:2], strict=True):
        array = (image.permute(1, 2, 0).numpy() * 255).round().astype("uint8")
        Image.fromarray(array).save(folder / f"{name}.png")
    (folder / "notes.txt").write_text("not an image")
    output = tmp_path / "out"
    status = main(["attack", "--images", str(folder), "--ratio", "0.5", "--output", str(output)])
    assert status == 0
    result = json.loads((output / "attack.json").read_text())
    assert set(result) == set(SETTINGS)
    assert all(set(row) == set(METRICS) for row in result.values())
    assert result["a"]["psnr"] > 60 and result["no_unk_b"]["psnr"] > 60
    assert result["b"]["psnr"] < 15 and result["c"]["psnr"] < 15
    assert (output / "attack.png").read_bytes()[:8] == PNG_SIGNATURE
    printed = capsys.readouterr().out
    assert "| `no_unk_c` |" in printed and "jigsaw ratio 0.5" in printed


@pytest.mark.parametrize(
    ("arguments", "message"),
    [(["--ratio", "1.5"], "ratio must be in"), (["--images", "/nonexistent/folder"], "not a folder")],
)
def test_mjp_attack_rejects_bad_arguments(arguments, message, tmp_path, capsys):
    status = main(["attack", "--output", str(tmp_path / "out"), *arguments])
    assert status == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_default_output_is_a_new_folder_under_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["attack", *ONE_IMAGE]) == 0
    (folder,) = (tmp_path / "runs").iterdir()
    assert folder.name.startswith("attack-") and [path.name for path in tmp_path.iterdir()] == ["runs"]
    assert sorted(path.name for path in folder.iterdir()) == sorted(OUTPUT_NAMES.values())
    assert set(json.loads((folder / "attack.json").read_text())) == set(SETTINGS)
    assert (folder / "attack.png").read_bytes()[:8] == PNG_SIGNATURE
    printed = capsys.readouterr().out
    assert (folder / "attack.md").read_text() in printed  # the table it printed
    assert f"wrote {folder.relative_to(tmp_path) / 'attack.json'}" in printed


def test_output_folder_and_the_options_that_put_one_file_elsewhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    output, elsewhere = tmp_path / "out" / "nested", tmp_path / "elsewhere"
    arguments = ["--output", str(output), "--json", str(elsewhere / "r.json"), "--grid", str(elsewhere / "g.png")]
    assert main(["attack", *ONE_IMAGE, *arguments]) == 0
    assert [path.name for path in output.iterdir()] == ["attack.md"]
    assert sorted(path.name for path in elsewhere.iterdir()) == ["g.png", "r.json"]  # --grid is --png
    assert (elsewhere / "g.png").read_bytes()[:8] == PNG_SIGNATURE
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--png", "grid.jpg"], "--png must be a .png path, got 'grid.jpg'"),
        (["--output", "{file}/sub"], "cannot make the folder"),
    ],
)
def test_bad_output_paths_fail_before_the_attacks(arguments, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("a file, not a folder")
    arguments = [argument.format(file=tmp_path / "file") for argument in arguments]
    assert main(["attack", *ONE_IMAGE, *arguments]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""  # nothing attacked, nothing printed
    assert sorted(path.name for path in tmp_path.iterdir()) == ["file"]
