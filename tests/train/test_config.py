"""TrainConfig: the recipe's defaults, typed overrides, YAML files, and errors that name the key."""

import pytest

from mjp_fast.train.config import (
    FIELDS,
    PRESETS,
    ConfigError,
    TrainConfig,
    help_table,
    load_config,
    parse_overrides,
    read_config_file,
    save_config,
)


def test_defaults_are_the_paper_recipe():
    config = TrainConfig().validate()
    assert (config.opt, config.lr, config.lr_base, config.weight_decay) == ("adamw", None, 5e-4, 0.05)
    assert (config.sched, config.epochs, config.warmup_epochs) == ("cosine", 300, 20)
    assert config.smoothing == 0.1 and config.auto_augment == "rand-m9-mstd0.5-inc1"
    assert (config.mixup, config.cutmix, config.reprob) == (0.8, 1.0, 0.25)
    assert config.repeated_aug and config.clip_grad is not None
    assert (config.mjp, config.mjp_ratio, config.mjp_prob, config.mjp_dal) == (True, 0.1, 0.5, "nonlinear")
    assert (config.dal_weight, config.dal_weight_end) == (0.01, 0.005)
    assert config.mjp_from_epoch is None  # = warmup_epochs: the jigsaw starts after warm-up
    assert config.eval_ratio == 0.5


def test_overrides_are_typed():
    values = parse_overrides(
        ["epochs=3", "lr=1e-3", "mjp=false", "auto_augment=none", "scale=[0.5, 1]", "mean=0.5,0.5,0.5", "opt=sgd"]
    )
    assert values == {
        "epochs": 3,
        "lr": 1e-3,
        "mjp": False,
        "auto_augment": None,
        "scale": [0.5, 1.0],
        "mean": [0.5, 0.5, 0.5],
        "opt": "sgd",
    }
    assert type(values["epochs"]) is int and type(values["lr"]) is float
    config = load_config(None, ["epochs=30", "mjp-ratio=0.2"])  # dashes work as underscores
    assert config.epochs == 30 and config.mjp_ratio == 0.2


@pytest.mark.parametrize(
    "override, message",
    [
        ("epoch=3", "unknown config key 'epoch'; did you mean epochs"),
        ("zzz=1", "unknown config key 'zzz'"),
        ("epochs=three", "epochs must be an integer, got 'three'"),
        ("lr=fast", "lr must be a number"),
        ("lr=nan", "lr must be a finite number"),
        ("mjp=maybe", "mjp must be true or false"),
        ("mjp_ratio=1.5", "mjp_ratio must be in [0, 1], got 1.5"),
        ("amp=fp8", "amp must be one of auto, none, bf16, fp16"),
        ("epochs=0", "epochs must be >= 1"),
        ("epochs=none", "epochs cannot be none"),
        ("scale=[0.9, 0.1]", "scale must be [min, max]"),
        ("batch_size=7", "batch_size must be even when mixup or cutmix is on"),
        ("warmup_epochs=400", "warmup_epochs (400) must be <= epochs (300)"),
        ("dataset=folder", "dataset=folder needs data=DIR"),
        ("novalue", "overrides are key=value"),
    ],
)
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, [override])
    assert message in str(error.value)


def test_yaml_file_with_sections_and_flat_keys(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: deit_tiny_patch16_224\nmjp:\n  mjp_ratio: 0.2\noptimization:\n  lr: 1e-3\nepochs: 50\n")
    config = load_config(path, ["epochs=70"])
    assert (config.model, config.mjp_ratio, config.lr, config.epochs) == ("deit_tiny_patch16_224", 0.2, 1e-3, 70)


@pytest.mark.parametrize(
    "text, message",
    [
        ("epochs: [1, 2\n", "is not valid YAML at line"),
        ("- 1\n- 2\n", "must hold a mapping"),
        ("epochs: many\n", "epochs must be an integer"),
        ("learning_rate: 0.1\n", "unknown config key 'learning_rate'"),
    ],
)
def test_bad_yaml_files(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        read_config_file(path) if "mapping" in message or "YAML" in message else load_config(path)
    assert message in str(error.value)


def test_missing_config_file():
    with pytest.raises(ConfigError, match="config file 'no/such.yaml' does not exist"):
        load_config("no/such.yaml")


def test_saved_config_loads_back_identically(tmp_path):
    config = load_config("digits", ["epochs=4", "mean=[0.1,0.2,0.3]", "auto_augment=none", "clip_grad=none"])
    save_config(config, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == config


def test_digits_preset_and_help_table_cover_every_key():
    config = load_config("digits")
    assert config.dataset_kind == "digits" and config.compare
    assert set(PRESETS["digits"]) <= set(FIELDS)
    table = help_table()
    for name in FIELDS:
        assert f"  {name}=" in table


def test_the_ablation_variants_keys():
    defaults = TrainConfig().validate()
    assert (defaults.pos_embed, defaults.mjp_unk, defaults.dal_reduction) == ("learned", True, "mean")
    for section, names in (("model", ["pos_embed"]), ("mjp", ["mjp_unk", "dal_reduction"])):
        assert all(FIELDS[name].metadata["section"] == section for name in names)
    # the paper's rows as plain overrides
    assert load_config(None, ["mjp=false", "pos_embed=none"]).pos_embed == "none"  # B
    assert load_config(None, ["pos_embed=null", "mjp_dal=none"]).pos_embed == "none"  # with the jigsaw, no DAL
    d_row = load_config(None, ["mjp_ratio=0", "mjp_dal=nonlinear"])  # D
    assert d_row.mjp_ratio == 0.0 and d_row.mjp_dal == "nonlinear"
    assert load_config(None, ["mjp_unk=false"]).mjp_unk is False  # E
    assert load_config(None, ["dal_reduction=sum"]).dal_reduction == "sum"
    text = help_table()
    for name in ("pos_embed=learned", "mjp_unk=True", "dal_reduction=mean"):
        assert f"  {name}  " in text


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["pos_embed=rope"], "pos_embed must be one of learned, none, got 'rope'"),
        (["mjp_unk=maybe"], "mjp_unk must be true or false, got 'maybe'"),
        (["dal_reduction=median"], "dal_reduction must be one of mean, sum, got 'median'"),
        (["pos_embed=none"], "mjp_dal=nonlinear regresses the position embeddings, which pos_embed=none removes"),
        (["pos_embed=none", "mjp=false", "compare=true", "mjp_dal=linear"], "set mjp_dal=none"),
    ],
)
def test_the_ablation_keys_bad_values_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    assert message in str(error.value)


def test_the_ablation_keys_round_trip_through_a_saved_config(tmp_path):
    config = load_config(None, ["pos_embed=none", "mjp_dal=none", "mjp_unk=false", "dal_reduction=sum"])
    save_config(config, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert (again.pos_embed, again.mjp_unk, again.dal_reduction) == ("none", False, "sum")


def test_a_warmup_that_was_not_set_is_fitted_to_a_short_run():
    for source, overrides, default in (
        (None, ["epochs=1"], 20),
        ("digits", ["epochs=2"], 3),
        ("deit_s", ["epochs=15"], 20),
    ):
        config = load_config(source, overrides)
        assert config.warmup_epochs == config.epochs // 10 < config.epochs  # a tenth of the run
        (note,) = config.notes
        assert f"warmup_epochs={default} (not set here) does not fit in epochs={config.epochs}" in note
        assert "set warmup_epochs to choose another" in note
    # a warm-up as long as the run would never start the jigsaw (mjp_from_epoch = warmup_epochs): it is fitted too
    assert load_config("digits", ["epochs=3"]).warmup_epochs == 0
    # one that fits is kept, and nothing is said
    config = load_config("digits", ["epochs=10"])
    assert config.warmup_epochs == 3 and config.notes == ()


def test_a_warmup_that_the_user_set_is_never_fitted(tmp_path):
    with pytest.raises(ConfigError, match=r"warmup_epochs \(20\) must be <= epochs \(1\)"):
        load_config(None, ["epochs=1", "warmup_epochs=20"])
    with pytest.raises(ConfigError, match=r"warmup_epochs \(5\) must be <= epochs \(2\)"):
        load_config("digits", ["epochs=2"], warmup_epochs=5)
    path = tmp_path / "mine.yaml"  # the user's own file: its keys are the user's
    path.write_text("warmup_epochs: 5\n")
    with pytest.raises(ConfigError, match=r"warmup_epochs \(5\) must be <= epochs \(2\)"):
        load_config(path, ["epochs=2"])
    assert load_config(None, ["epochs=2", "warmup_epochs=2"]).warmup_epochs == 2  # as long as the run: allowed


def test_explicit_keys_are_the_users_own():
    assert load_config("digits", ["model=resnet18"]).explicit_keys == {"model"}
    assert load_config("deit_s", data="/data").explicit_keys == {"data"}  # a bundled recipe's keys are defaults
    assert load_config(None, ["epochs=3"], data="/d").explicit_keys == {"epochs", "data"}
    assert TrainConfig().explicit_keys is None and TrainConfig().is_explicit("img_size")  # unknown: all
    config = load_config("digits")
    assert config.explicit_keys == frozenset() and not config.is_explicit("img_size")
    changed = config.replace(img_size=32)
    assert changed.is_explicit("img_size") and not config.is_explicit("img_size")
    fitted = config.fitted("a note", img_size=None)
    assert fitted.img_size is None and not fitted.is_explicit("img_size") and fitted.notes == ("a note",)
    assert fitted.replace(epochs=3).notes == ("a note",)  # notes stay through copies
    assert fitted == config.replace(img_size=None)  # not fields: equality, saving and listing ignore them


def test_every_bad_value_is_reported_at_once():
    with pytest.raises(ConfigError) as error:
        load_config(None, ["mjp_ratio=2", "smoothing=1", "epochs=1", "warmup_epochs=3"])
    assert error.value.problems == [
        "mjp_ratio must be in [0, 1], got 2.0",
        "smoothing must be < 1, got 1.0",
        "warmup_epochs (3) must be <= epochs (1)",
    ]
    assert str(error.value) == "3 problems:\n  " + "\n  ".join(error.value.problems)
    assert error.value.config is not None and error.value.config.mjp_ratio == 2.0  # for the caller's own checks
    with pytest.raises(ConfigError) as error:
        load_config(None, ["mjp_ratio=2"])
    assert str(error.value) == "mjp_ratio must be in [0, 1], got 2.0"  # one problem: its line alone
    # a value of the wrong type is reported alone: the range checks need the types
    assert TrainConfig(epochs="many", mjp_ratio=2.0).problems() == ["epochs must be an integer, got 'many'"]
