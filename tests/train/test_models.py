"""How ``mjp train`` names and builds its models."""

import pytest
import torch

from mjp_fast.train.config import ConfigError, load_config
from mjp_fast.train.models import VIT_SHAPE_KEYS, create_model, keywords_taken, model_spec
from tests.train.helpers import tiny_overrides


def _build(*overrides: str):
    config = load_config(overrides=[*tiny_overrides(), *overrides])
    name, kwargs = model_spec(config, num_classes=3, mjp=True)
    return create_model(name, kwargs), kwargs


def test_mjp_dal_none_trains_no_regressor():
    model, kwargs = _build("mjp_dal=none")
    assert kwargs["mjp_dal"] == "none"  # a string: timm's create_model would drop None and build the default DAL
    assert model.mjp.dal_regressor is None
    assert not any("dal_regressor" in name for name, _ in model.named_parameters())
    assert float(model.mjp_aux_loss()) == 0.0


def test_mjp_dal_kinds_reach_the_model():
    for kind in ("nonlinear", "linear"):
        model, _ = _build(f"mjp_dal={kind}")
        assert model.mjp.dal_regressor.kind == kind


def test_checkpoints_that_wrote_none_for_no_dal_still_load():
    model, kwargs = _build("mjp_dal=none")
    rebuilt = create_model("mjp_vit_tiny_patch16_224", {**kwargs, "mjp_dal": None})
    assert rebuilt.mjp.dal_regressor is None
    rebuilt.load_state_dict(model.state_dict())  # strict: the same keys
    assert torch.equal(rebuilt.pos_embed, model.pos_embed)


def test_mjp_dal_none_on_the_command_line_and_in_yaml(tmp_path):
    assert load_config(overrides=["mjp_dal=none"]).mjp_dal == "none"
    assert load_config(overrides=["mjp_dal=null"]).mjp_dal == "none"
    path = tmp_path / "recipe.yaml"
    path.write_text("mjp:\n  mjp_dal: null\n")
    assert load_config(path).mjp_dal == "none"


def test_the_ablation_keys_reach_the_model():
    model, kwargs = _build("mjp_unk=false", "dal_reduction=sum")
    assert kwargs["mjp_unk"] is False and kwargs["mjp_dal_reduction"] == "sum" and "pos_embed" not in kwargs
    assert model.mjp.unk_embed is None and model.mjp.dal_scale == 1.0
    default, kwargs = _build()
    assert kwargs["mjp_unk"] is True and default.mjp.unk_embed is not None and default.mjp.dal_scale == 0.5


def test_pos_embed_none_builds_both_models_without_position_embeddings():
    config = load_config(overrides=[*tiny_overrides(), "pos_embed=none", "mjp_dal=none"])
    for use_mjp in (False, True):
        name, kwargs = model_spec(config, num_classes=3, mjp=use_mjp)
        assert kwargs["pos_embed"] == "none"
        model = create_model(name, kwargs)
        assert model.pos_embed is None and model.cls_token is not None  # timm's: the class token stays
        assert ("mjp" in dict(model.named_children())) == use_mjp
    config = load_config(overrides=["pos_embed=none", "mjp=false", "model=resnet18"])
    name, kwargs = model_spec(config, num_classes=3)
    with pytest.raises(ConfigError, match="pos_embed=none needs a timm VisionTransformer"):
        create_model(name, kwargs)


def test_checkpoints_written_before_the_ablation_keys_still_load():
    model, kwargs = _build()
    old_kwargs = {key: value for key, value in kwargs.items() if key not in ("mjp_unk", "mjp_dal_reduction")}
    rebuilt = create_model("mjp_vit_tiny_patch16_224", old_kwargs)
    rebuilt.load_state_dict(model.state_dict())  # strict: the same keys
    assert rebuilt.mjp.unk_embed is not None and rebuilt.mjp.dal_scale == 0.5


def test_keywords_taken_follow_kwargs_up_the_class_tree():
    from timm.models.deit import VisionTransformerDistilled
    from timm.models.resnet import ResNet
    from timm.models.swin_transformer import SwinTransformer
    from timm.models.vision_transformer import VisionTransformer

    assert set(VIT_SHAPE_KEYS) <= keywords_taken(VisionTransformer)
    # VisionTransformerDistilled.__init__(*args, **kwargs) hands everything to VisionTransformer's
    assert keywords_taken(VisionTransformerDistilled) == keywords_taken(VisionTransformer)
    assert not set(VIT_SHAPE_KEYS) & keywords_taken(ResNet) and "num_classes" in keywords_taken(ResNet)
    assert set(VIT_SHAPE_KEYS) - keywords_taken(SwinTransformer) == {"depth"}  # depths, per stage
    assert "self" not in keywords_taken(ResNet)
