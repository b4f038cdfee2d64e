"""The recipe files bundled in mjp_fast/configs: found by name or path, valid, and stating the paper's numbers."""

import math
from pathlib import Path

import pytest
import timm
import torch
import yaml
from PIL import Image

import mjp_fast
from mjp_fast.cli import build_parser, main
from mjp_fast.train import bundled_configs
from mjp_fast.train.cli import config_from_args
from mjp_fast.train.config import FIELDS, PRESETS, SECTIONS, ConfigError, load_config
from mjp_fast.train.data import eval_transform, train_transform
from mjp_fast.train.models import create_model, model_spec

NAMES = ("cifar10", "deit_s", "deit_ti", "vit_s")
IMAGENET = ("deit_s", "deit_ti", "vit_s")
PACKAGE_CONFIGS = Path(mjp_fast.__file__).resolve().parent / "configs"


def _file_values(path: Path) -> dict[str, dict]:
    """section -> {key: value} as the YAML file writes them, before any type conversion."""
    return yaml.safe_load(path.read_text())


def _parse(*arguments: str):
    return build_parser().parse_args(["train", *arguments])


def test_the_four_recipes_ship_inside_the_package():
    configs = bundled_configs()
    assert tuple(configs) == NAMES  # sorted by name
    for name, path in configs.items():
        assert path == PACKAGE_CONFIGS / f"{name}.yaml" and path.is_file()
    assert not set(configs) & set(PRESETS), "a bundled name equal to a preset would be hidden by it"


@pytest.mark.parametrize("name", NAMES)
def test_a_recipe_is_grouped_by_section_and_loads_the_values_it_states(name):
    path = bundled_configs()[name]
    sections = _file_values(path)
    assert set(sections) <= set(SECTIONS), f"{name}: top-level keys must be sections"
    config = load_config(name)
    stated = 0
    for section, values in sections.items():
        assert isinstance(values, dict), f"{name}: section {section} must be a mapping"
        for key, value in values.items():
            home = FIELDS[key].metadata["section"]
            assert home == section, f"{name}: {key} is in section {section}, belongs in {home}"
            loaded = getattr(config, key)
            if isinstance(value, float) or isinstance(loaded, float):
                assert loaded == pytest.approx(float(value), rel=1e-12), f"{name}: {key}"
            else:
                assert loaded == value, f"{name}: {key}"
            stated += 1
    assert stated >= 30, f"{name} should spell out the recipe, states only {stated} keys"
    # A recipe leaves the data and the run's place to the command line.
    assert config.data is None and config.output is None and "data" not in sections.get("data", {})


@pytest.mark.parametrize("name", NAMES)
def test_a_recipe_loads_alike_by_name_by_file_name_and_by_path(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an empty folder: nothing there shadows the bundled names
    by_name = load_config(name)
    assert load_config(f"{name}.yaml") == by_name
    assert load_config(bundled_configs()[name]) == by_name
    assert load_config(str(bundled_configs()[name])) == by_name
    assert by_name != load_config(None)  # the file changes something from the defaults


@pytest.mark.parametrize("name", NAMES)
def test_a_recipe_builds_its_mjp_model_and_grid(name):
    config = load_config(name)
    assert timm.is_model(config.model)
    model_name, kwargs = model_spec(config, num_classes=10)
    model = create_model(model_name, kwargs)
    grid = tuple(model.patch_embed.grid_size)
    assert grid == ((8, 8) if name == "cifar10" else (14, 14))
    # The jigsaw must move something: at least two masked cells per image on average.
    assert math.floor(config.mjp_ratio * grid[0] * grid[1]) >= 2
    images = torch.randn(2, 3, config.img_size, config.img_size)
    model.eval()
    with torch.no_grad():
        assert model(images).shape == (2, 10)


@pytest.mark.parametrize("name", IMAGENET)
def test_imagenet_recipes_state_the_supplementary_table_1(name):
    config = load_config(name)
    # supplementary Section 1 and Table 1
    assert (config.epochs, config.warmup_epochs, config.sched) == (300, 20, "cosine")
    assert (config.opt, config.weight_decay) == ("adamw", 0.05)
    assert config.lr is None and config.lr_base == 5e-4  # lr = 5e-4 x batch / 512
    paper_gpus = 8  # supplementary Section 2: 8 V100s
    global_batch = config.batch_size * paper_gpus * config.accum_steps
    assert global_batch == 1024
    assert config.lr_base * global_batch / 512 == pytest.approx(1e-3)  # "an initial learning rate of 0.001"
    assert (config.smoothing, config.auto_augment) == (0.1, "rand-m9-mstd0.5-inc1")
    assert (config.mixup, config.cutmix, config.reprob) == (0.8, 1.0, 0.25)
    assert config.repeated_aug and config.clip_grad is not None
    assert (config.img_size, config.patch_size) == (224, 16)
    # the mask-ratio ablation: 0.03 is the ratio of the reported DeiT-S + MJP (80.5 top-1, 82.9 consistency)
    assert (config.mjp, config.mjp_ratio, config.mjp_prob, config.mjp_dal) == (True, 0.03, 0.5, "nonlinear")
    assert (config.dal_weight, config.dal_weight_end, config.mjp_from_epoch) == (0.01, 0.005, None)
    expected = {
        "deit_s": "deit_small_patch16_224",
        "deit_ti": "deit_tiny_patch16_224",
        "vit_s": "vit_small_patch16_224",
    }
    assert config.model == expected[name]


def test_imagenet_recipes_differ_only_in_the_model():
    deit_s = load_config("deit_s").to_dict()
    for name, model in (("deit_ti", "deit_tiny_patch16_224"), ("vit_s", "vit_small_patch16_224")):
        other = load_config(name).to_dict()
        assert {key for key in deit_s if deit_s[key] != other[key]} == {"model"}
        assert other["model"] == model


def test_cifar10_recipe_is_a_vit_for_32_pixel_images():
    config = load_config("cifar10")
    assert (config.model, config.img_size, config.patch_size) == ("deit_tiny_patch16_224", 32, 4)
    assert (config.epochs, config.warmup_epochs) == (100, 5)
    assert config.lr is None and config.lr_base * config.batch_size / 512 == pytest.approx(1e-3)
    assert config.crop_pct == 1.0 and not config.repeated_aug and config.scale == [0.25, 1.0]
    assert config.mjp_ratio == 0.1 and config.mean == pytest.approx([0.4914, 0.4822, 0.4465])
    # Its augmentations keep a 32x32 image 32x32; evaluation leaves it whole.
    image = Image.new("RGB", (32, 32), (200, 30, 60))
    augmented = train_transform(config, config.img_size, tuple(config.mean), tuple(config.std))(image)
    assert augmented.shape == (3, 32, 32) and augmented.dtype == torch.float32
    evaluated = eval_transform(config.img_size, config.interpolation, config.crop_pct)(image)
    assert torch.equal(evaluated, torch.tensor([200, 30, 60], dtype=torch.uint8).view(3, 1, 1).expand(3, 32, 32))


def test_cifar10_recipe_trains_on_a_cifar_tree(cifar_tree, tmp_path, capsys):
    # The recipe as the CLI reads it, shrunk to a one-block model and one short epoch: its augmentations, mixup and
    # jigsaw all run on real 32x32 CIFAR images.
    small = ["embed_dim=32", "depth=1", "num_heads=2", "batch_size=8", "workers=0", "threads=1", "progress=off"]
    small += ["epochs=2", "warmup_epochs=1", "max_train_samples=32", "max_val_samples=16"]
    arguments = ["train", "--config", "cifar10", "--data", str(cifar_tree), "--output", str(tmp_path / "run")]
    assert main([*arguments, *small]) == 0
    saved = load_config(tmp_path / "run" / "config.yaml")
    assert (saved.model, saved.img_size, saved.patch_size, saved.mjp_ratio) == ("deit_tiny_patch16_224", 32, 4, 0.1)
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize("config_argument", ["deit_s", "deit_s.yaml"])
def test_cli_config_takes_a_bundled_name(config_argument, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = config_from_args(_parse("--config", config_argument, "--data", "/data/imagenet", "epochs=30"))
    assert config == load_config(bundled_configs()["deit_s"], data="/data/imagenet", epochs=30)
    assert (config.model, config.mjp_ratio, config.warmup_epochs) == ("deit_small_patch16_224", 0.03, 20)


@pytest.mark.parametrize("file_name", ["deit_s.yaml", "deit_s"])
def test_an_existing_file_wins_over_a_bundled_name(file_name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path(file_name).write_text("schedule:\n  epochs: 70\n")
    config = config_from_args(_parse("--config", file_name))
    assert config.epochs == 70 and config.model == load_config(None).model and config.mjp_ratio == 0.1
    # the other spelling still names the bundled recipe
    other = "deit_s" if file_name.endswith(".yaml") else "deit_s.yaml"
    assert config_from_args(_parse("--config", other)).epochs == 300


def test_presets_keep_working_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert config_from_args(_parse("--config", "digits")).dataset == "digits"
    assert config_from_args(_parse()).dataset == "digits"  # no --config, no --data: the embedded default


@pytest.mark.parametrize("source", ["deit_b", "deit_b.yaml", "configs/deit_s.yaml", "DEIT_S"])
def test_an_unknown_name_lists_the_choices(source, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as error:
        load_config(source)
    message = str(error.value)
    assert message.startswith(f"config file {source!r} does not exist")
    assert "bundled config (cifar10, deit_s, deit_ti, vit_s)" in message and "preset (digits)" in message


def test_an_unknown_name_suggests_a_close_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="did you mean deit_s"):
        load_config("deit-s")


def test_cli_reports_an_unknown_config_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", "imagenet"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "cifar10, deit_s, deit_ti, vit_s" in error


def test_help_names_the_bundled_recipes(capsys):
    assert main(["train", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "a bundled recipe (cifar10, deit_s, deit_ti, vit_s; NAME or NAME.yaml)" in text
