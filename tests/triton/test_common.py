"""What the Triton operations share (mjp_fast/triton/common.py): one home for the interpreter switch, launches,
operators and tile settings, and the kernel files' imports kept to it."""

import ast
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import mjp_fast.triton  # noqa: E402
from mjp_fast.triton import common, patch_embed, pos_embed  # noqa: E402

PACKAGE = Path(mjp_fast.__file__).parent
TRITON_PACKAGE = PACKAGE / "triton"
SHARED = {"__init__.py", "common.py"}


def _imported_modules(path: Path) -> list[tuple[str, list[str]]]:
    """``(module, names)`` of each import in the file (names empty for ``import module``)."""
    imports = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            imports.append((module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            imports.extend((alias.name, []) for alias in node.names)
    return imports


def test_kernel_files_import_from_the_shared_module_only():
    kernel_files = sorted(path for path in TRITON_PACKAGE.glob("*.py") if path.name not in SHARED)
    assert {"dal_loss.py", "patch_embed.py", "pos_embed.py"} <= {path.name for path in kernel_files}
    for path in kernel_files:
        for module, names in _imported_modules(path):
            if module.startswith(".") or module.split(".")[0] == "mjp_fast":
                assert module == "mjp_fast.triton.common", f"{path.name} imports from {module}: only from common"
                private = [name for name in names if name.startswith("_")]
                assert not private, f"{path.name} imports private names {private} from {module}"


def test_triton_interpret_is_read_in_one_place():
    readers = sorted(
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if any(
            isinstance(node, ast.Constant) and node.value == "TRITON_INTERPRET"
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
        )
    )
    assert readers == ["backend.py"]


def test_the_package_reexports_the_shared_launch_helpers():
    # code outside mjp_fast/triton (the sampler's kernel) imports these from mjp_fast.triton
    assert mjp_fast.triton.interpreting is common.interpreting is mjp_fast.backend.triton_interpreting
    assert mjp_fast.triton.launcher is common.launcher
    assert mjp_fast.triton.operator is common.operator


def test_tiles_and_warps_follow_the_interpreter(monkeypatch):
    monkeypatch.setattr(common, "interpreting", lambda: True)
    assert (common.tile_size(64), common.warp_count(4)) == (common.INTERPRETER_TILE, common.INTERPRETER_WARPS)
    assert pos_embed._forward_tiles(384) == (common.INTERPRETER_TILE,) * 2
    assert patch_embed._grad_weight_tiles(384, 768) == (common.INTERPRETER_TILE,) * 3
    monkeypatch.setattr(common, "interpreting", lambda: False)
    assert (common.tile_size(64), common.warp_count(4)) == (64, 4)
    assert pos_embed._forward_tiles(384) == (common.ROW_TILE, common.MAX_CHANNEL_TILE)


@pytest.mark.parametrize("size", [1, 5, 15, 16, 17, 100, 128, 129, 384, 1000])
def test_gpu_tiles_are_powers_of_two_that_tl_dot_takes(size, monkeypatch):
    monkeypatch.setattr(common, "interpreting", lambda: False)
    block_m, block_d, block_k = patch_embed._grad_weight_tiles(size, size)
    for side in (block_m, block_d, block_k):
        assert side >= 16 and side & (side - 1) == 0, (size, side)
    assert block_d <= common.MAX_CHANNEL_TILE and block_k <= 64
    assert block_d >= min(size, common.MAX_CHANNEL_TILE) and block_k >= min(size, 64)  # they cover the size
    block_r, block_d = pos_embed._forward_tiles(size)
    assert block_d == min(common.MAX_CHANNEL_TILE, 1 << (size - 1).bit_length())


def test_operator_takes_a_schema():
    scaled = common.operator("mjp_fast_tests::scaled", schema="(Tensor x, float scale) -> Tensor")(
        lambda x, scale: x * scale
    )
    assert str(torch.ops.mjp_fast_tests.scaled.default._schema) == (
        "mjp_fast_tests::scaled(Tensor x, float scale) -> Tensor"
    )
    assert torch.equal(scaled(torch.ones(3), 2.0), torch.full((3,), 2.0))
