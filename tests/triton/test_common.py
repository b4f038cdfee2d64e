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


def test_triton_interpret_is_read_once_at_import(monkeypatch):
    # the operators were registered from it at import (custom_op or triton_op): a later change of the environment
    # must not move the launches, tiles or plans to the other side of that choice
    assert common.INTERPRETING is mjp_fast.backend.triton_interpreting()
    assert common.interpreting() is common.INTERPRETING
    monkeypatch.setenv("TRITON_INTERPRET", "0" if common.INTERPRETING else "1")
    assert common.interpreting() is common.INTERPRETING
    assert (common.tile_size(64) == common.INTERPRETER_TILE) is common.INTERPRETING


def test_only_the_shared_module_reads_the_interpreter_switch():
    # the kernel files ask common.interpreting() (one value, which tests may replace as common.INTERPRETING), never
    # the backend's function, which reads the environment
    for path in sorted(TRITON_PACKAGE.glob("*.py")):
        if path.name == "common.py":
            continue
        names = [name for _, names in _imported_modules(path) for name in names]
        assert "triton_interpreting" not in names and "INTERPRETING" not in names, path.name


def test_the_package_reexports_the_shared_launch_helpers():
    # code outside mjp_fast/triton (the sampler's kernel) imports these from mjp_fast.triton
    assert mjp_fast.triton.interpreting is common.interpreting
    assert mjp_fast.triton.launcher is common.launcher
    assert mjp_fast.triton.operator is common.operator
    assert mjp_fast.triton.define_operator is common.define_operator


def test_tiles_and_warps_follow_the_interpreter(monkeypatch):
    monkeypatch.setattr(common, "INTERPRETING", True)
    assert (common.tile_size(64), common.warp_count(4)) == (common.INTERPRETER_TILE, common.INTERPRETER_WARPS)
    assert pos_embed._forward_tiles(384) == (common.INTERPRETER_TILE,) * 2
    assert patch_embed._grad_weight_tiles(384, 768) == (common.INTERPRETER_TILE,) * 3
    monkeypatch.setattr(common, "INTERPRETING", False)
    assert (common.tile_size(64), common.warp_count(4)) == (64, 4)
    assert pos_embed._forward_tiles(384) == (common.ROW_TILE, common.MAX_CHANNEL_TILE)


@pytest.mark.parametrize("size", [1, 5, 15, 16, 17, 100, 128, 129, 384, 1000])
def test_gpu_tiles_are_powers_of_two_that_tl_dot_takes(size, monkeypatch):
    monkeypatch.setattr(common, "INTERPRETING", False)
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


def test_define_operator_takes_the_launch_signature():
    calls, fakes = [], []

    def shifted_launch(
        x: torch.Tensor, scale: float, shift: float = 0.0, repeats: int = 1, *, traced: bool = False
    ) -> torch.Tensor:
        calls.append(traced)
        return x * scale + shift * repeats

    def shifted_fake(x, repeats, **_):
        fakes.append(repeats)
        return torch.empty_like(x)

    shifted = common.define_operator("mjp_fast_tests::shifted", shifted_launch, fake=shifted_fake, required=("shift",))
    # the launch's positional parameters, types and defaults (but shift's), without its keyword-only ``traced``
    assert str(torch.ops.mjp_fast_tests.shifted.default._schema) == (
        "mjp_fast_tests::shifted(Tensor x, float scale, float shift, SymInt repeats=1) -> Tensor"
    )
    assert torch.equal(shifted(torch.ones(3), 2.0, 1.0), torch.full((3,), 3.0))
    assert calls == [True]  # the operator launches as traced
    assert shifted(torch.ones(3, device="meta"), 2.0, 1.0).device.type == "meta"
    assert fakes == [1]  # the fake is called by name, with the defaults filled in
    with pytest.raises(ValueError, match=r"required must name positional parameters of shifted_launch.*'traced'"):
        common.define_operator("mjp_fast_tests::unused", shifted_launch, fake=shifted_fake, required=("traced",))


def test_operator_schemas_come_from_the_launchers():
    # the schemas that the ops' callers and the compiled graphs rely on, inferred from the launchers' signatures
    from mjp_fast.triton import dal_loss  # noqa: F401  (registers its operators)

    expected = {
        "dal_loss_triton": "(Tensor pos, SymInt skip_rows, Tensor? w1, Tensor? b1, Tensor w2, Tensor? b2, "
        "Tensor coords, Tensor? mask, float scale) -> (Tensor, Tensor)",
        "dal_loss_triton_backward": "(Tensor grad, Tensor pos, SymInt skip_rows, Tensor? w1, Tensor w2, "
        "Tensor coords, Tensor saved, float scale, bool has_b1, bool has_b2) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor)",
        "patch_embed_triton": "(Tensor images, Tensor weight, Tensor? bias, Tensor pos_embed, Tensor? unk_embed, "
        "Tensor? perm, Tensor? mask, Tensor? prefix, SymInt prefix_positions, ScalarType? out_dtype=None, "
        "ScalarType? compute_dtype=None) -> Tensor",
        "patch_embed_triton_backward": "(Tensor grad_out, Tensor images, Tensor weight, Tensor? perm, Tensor? mask, "
        "bool need_images, bool need_weight, bool need_bias, bool need_pos, bool need_unk, bool need_prefix, "
        "SymInt prefix_count, SymInt prefix_positions, SymInt[] pos_shape, SymInt[] prefix_shape, "
        "ScalarType? pos_dtype=None, ScalarType? unk_dtype=None, ScalarType? prefix_dtype=None, "
        "ScalarType? compute_dtype=None, bool permutation=False) -> Tensor[]",
        "pos_embed_triton": "(Tensor tokens, Tensor perm, Tensor mask, Tensor pos_embed, Tensor unk_embed, "
        "Tensor? prefix, SymInt prefix_positions) -> Tensor",
        "pos_embed_triton_backward": "(Tensor grad_out, Tensor perm, Tensor mask, SymInt prefix_count, "
        "SymInt prefix_positions, SymInt[] pos_shape, SymInt[] prefix_shape, ScalarType tokens_dtype, "
        "ScalarType pos_dtype, ScalarType unk_dtype, ScalarType prefix_dtype) -> Tensor[]",
    }
    for name, schema in expected.items():
        assert str(getattr(torch.ops.mjp_fast, name).default._schema) == f"mjp_fast::{name}{schema}"


@pytest.mark.parametrize("value", [-5, -1, 0, 1, 2, 3, 4, 15, 16, 17, 255, 1000, 2**31 + 1, 2**45 - 3])
def test_host_arithmetic_equals_tritons(value):
    import triton

    assert common.next_power_of_2(value) == triton.next_power_of_2(value)
    for denominator in (1, 3, 16, 64):
        assert common.cdiv(value, denominator) == triton.cdiv(value, denominator)


def test_host_arithmetic_traces_symbolic_sizes():
    # under torch.compile a triton_op's launcher runs on SymInts: both helpers must trace, not force a value
    def grid(x):
        return x.new_zeros(common.cdiv(x.shape[0], 16) + common.next_power_of_2(x.shape[0]))

    compiled = torch.compile(grid, backend="eager", dynamic=True, fullgraph=True)
    for size in (5, 37):
        assert compiled(torch.empty(size)).shape[0] == (size + 15) // 16 + (1 << (size - 1).bit_length())


def test_launchers_use_the_host_arithmetic():
    # triton.cdiv and triton.next_power_of_2 are constexpr functions: about 2 us a call from host code
    for path in [*TRITON_PACKAGE.glob("*.py"), PACKAGE / "sampler" / "triton_kernel.py"]:
        source = path.read_text()
        if path.name == "common.py":
            source = source.replace("return triton.next_power_of_2(size)  # a SymInt", "")
        assert "triton.cdiv(" not in source and "triton.next_power_of_2(" not in source, path.name


# -- scratch buffers ---------------------------------------------------------------------------------------------

CPU = torch.device("cpu")


def test_scratch_is_one_buffer_per_role_shape_dtype_and_device():
    common.clear_scratch()
    first = common.scratch("partials", (3, 4), CPU, False)
    assert first.dtype == torch.float32 and tuple(first.shape) == (3, 4) and first.device == CPU
    assert common.scratch("partials", (3, 4), CPU, False) is first
    assert common.scratch("other partials", (3, 4), CPU, False) is not first
    assert common.scratch("partials", (4, 3), CPU, False) is not first
    # another dtype (the int32 inverse of a perm): a buffer of its own, never the float32 one reinterpreted
    indices = common.scratch("partials", (3, 4), CPU, False, torch.int32)
    assert indices.dtype == torch.int32 and indices is not first
    assert common.scratch("partials", (3, 4), CPU, False, torch.int32) is indices
    # traced (inside a torch operator): a fresh tensor every time, since torch.compile owns the memory of its graphs
    traced = common.scratch("partials", (3, 4), CPU, True, torch.int32)
    assert traced.dtype == torch.int32 and common.scratch("partials", (3, 4), CPU, True) is not first
    assert len(common._scratch.buffers) == 4
    common.clear_scratch()
    assert not common._scratch.buffers and common.scratch("partials", (3, 4), CPU, False) is not first


def test_scratch_keeps_no_fake_tensor_nor_inference_tensor():
    # A later call in another mode gets the buffer: a fake one has no memory, and torch refuses in-place ops on an
    # inference tensor outside inference_mode.
    from torch._subclasses.fake_tensor import FakeTensorMode

    common.clear_scratch()
    with FakeTensorMode():
        fake = common.scratch("partials", (3,), CPU, False)
    with torch.inference_mode():
        inference = common.scratch("partials", (3,), CPU, False)
        assert inference.is_inference()
    assert not common._scratch.buffers
    kept = common.scratch("partials", (3,), CPU, False)
    assert kept is not fake and kept is not inference and type(kept) is torch.Tensor
    kept.zero_()  # outside inference_mode, as the weight gradient zeroes an empty batch's partials


def test_scratch_keeps_the_most_recently_used_buffers():
    common.clear_scratch()
    kept = common.scratch("kept", (1,), CPU, False)
    dropped = common.scratch("role 0", (1,), CPU, False)
    for index in range(1, common.SCRATCH_BUFFERS):
        assert common.scratch("kept", (1,), CPU, False) is kept  # used again: the most recent
        common.scratch(f"role {index}", (1,), CPU, False)
    assert len(common._scratch.buffers) == common.SCRATCH_BUFFERS
    assert common.scratch("kept", (1,), CPU, False) is kept
    assert common.scratch("role 0", (1,), CPU, False) is not dropped  # the least recently used went first
    assert len(common._scratch.buffers) == common.SCRATCH_BUFFERS


def test_scratch_is_per_thread():
    # Two threads on one stream could each queue a write between the other's write and read: each has its own.
    import threading

    common.clear_scratch()
    mine = common.scratch("partials", (2,), CPU, False)
    theirs = []
    thread = threading.Thread(target=lambda: theirs.append(common.scratch("partials", (2,), CPU, False)))
    thread.start()
    thread.join()
    assert theirs[0] is not mine and common.scratch("partials", (2,), CPU, False) is mine


def _scratch_users() -> dict:
    """The launches that take scratch buffers, on small inputs: name -> a call returning its outputs."""
    from mjp_fast.triton import dal_loss
    from tests.triton.helpers import random_jigsaw

    generator = torch.Generator().manual_seed(0)
    batch, grid, dim, patch = 5, (3, 4), 24, 4
    positions = grid[0] * grid[1]
    mask, perm = random_jigsaw(batch, positions, "some", generator)
    grad = torch.randn(batch, 1 + positions, dim, generator=generator)  # a class token's row first
    layout = dict(prefix_count=1, prefix_positions=1)
    plan = common.position_gradient_plan(
        batch, 1 + positions, dim, grad.dtype, 132, False, chunks=3, scatter=False, has_bias=True, **layout
    )
    images = torch.randn(batch, 3, grid[0] * patch, grid[1] * patch, generator=generator)
    weight = torch.randn(dim, 3, patch, patch, generator=generator)
    hidden = 16
    dal_inputs = dict(
        pos=torch.randn(1 + positions, dim, generator=generator),
        skip_rows=1,
        w1=torch.randn(hidden, dim, generator=generator),
        b1=torch.randn(hidden, generator=generator),
        w2=torch.randn(2, hidden, generator=generator),
        b2=torch.randn(2, generator=generator),
        coords=torch.randn(positions, 2, generator=generator),
        mask=mask,
        scale=0.5,
    )
    dtypes = dict.fromkeys(("pos_dtype", "unk_dtype", "bias_dtype", "prefix_dtype"), torch.float32)
    return {
        "position gradient": lambda: common.launch_position_gradient(
            grad, mask, None, tokens_dtype=None, plan=plan, **dtypes, **layout
        ),
        "weight gradient": lambda: (patch_embed._grad_weight_launch(grad, images, perm, weight, 1, None, False),),
        "DAL forward": lambda: dal_loss.dal_forward_launch(**dal_inputs),
    }


@pytest.mark.parametrize("user", ["position gradient", "weight gradient", "DAL forward"])
def test_every_scratch_user_writes_all_it_reads(user):
    # A scratch buffer holds what its last use left: a kernel that read an element it did not write would give
    # other results over a buffer poisoned with NaN or 1e30 than over a fresh one.
    run = _scratch_users()[user]
    common.clear_scratch()
    fresh = [output.clone() for output in run() if output is not None]
    (buffer,) = common._scratch.buffers.values()  # one scratch buffer per user
    for poison in (float("nan"), 1e30):
        buffer.fill_(poison)
        again = [output for output in run() if output is not None]
        assert list(common._scratch.buffers.values()) == [buffer]  # reused, not made again
        for got, want in zip(again, fresh, strict=True):
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, want, atol=0, rtol=0)
