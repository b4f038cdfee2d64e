"""mjp_fast/train/build.py: what wraps the model for training (``compile=true`` and its ``compile_mode``)."""

import pytest
import torch

from mjp_fast.train import build
from mjp_fast.train.config import ConfigError, load_config
from mjp_fast.train.distributed import Distributed


@pytest.mark.parametrize("mode", ["default", "reduce-overhead", "max-autotune-no-cudagraphs"])
def test_compile_mode_reaches_torch_compile(monkeypatch, mode):
    calls = []
    monkeypatch.setattr(build.torch, "compile", lambda model, **options: calls.append(options) or model)
    model = torch.nn.Linear(2, 2)
    config = load_config("digits", ["compile=true", f"compile_mode={mode}"])
    assert build._wrap_for_training(model, config, Distributed()) is model
    assert calls == [{"mode": mode}]
    calls.clear()
    build._wrap_for_training(model, load_config("digits", [f"compile_mode={mode}"]), Distributed())
    assert calls == []  # compile=false: the mode alone compiles nothing


def test_an_unknown_compile_mode_is_refused_by_name():
    with pytest.raises(ConfigError, match="compile_mode must be one of default, reduce-overhead"):
        load_config("digits", ["compile_mode=fast"])
