"""Compiles every Triton kernel of mjp_fast down to a GPU binary (cubin), with no GPU present.

The tests run the kernels in the Triton interpreter, which checks what they compute but not that they compile
for a GPU: the interpreter takes constructs that the compiler refuses, and skips layouts, shared memory and
register allocation. Triton compiles for a named target without a device, so this script compiles each kernel
with the argument types, tile sizes and warps of its launches on a GPU, for Ampere (sm_80) and Hopper (sm_90).

Run without TRITON_INTERPRET (tests/triton/test_compile_for_gpu.py starts it in a subprocess):

    python tests/triton/compile_for_gpu.py [--arch 80,90]

Prints one line per kernel and variant; exits 1 if any fails to compile.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

# Shared memory one block may use (opt-in maximum), by compute capability: A100, H100/H200.
MAX_SHARED_BYTES = {80: 166912, 90: 232448}


def _variants() -> list[tuple[str, object, dict[str, str], dict[str, object], dict[str, int]]]:
    """(name, kernel, signature, constexprs, options) of each launch to compile."""
    from mjp_fast.triton import dal_loss, patch_embed, pos_embed, sampler

    variants = []
    sampler_signature = {
        "mask_ptr": "*i1",
        "perm_ptr": "*i64",
        "h_thresholds_ptr": "*i64",
        "w_thresholds_ptr": "*i64",
        "counter_ptr": "*i64",
        "params_ptr": "*i64",
        "counter_scale": "i32",
        "stream_shift": "i32",
        "rows": "i32",
        "cols": "i32",
        "target": "i32",
        "min_block": "i32",
        "SHARED": "constexpr",
        "BLOCK_N": "constexpr",
        "BLOCK_G": "constexpr",
    }
    for shared in (False, True):
        variants.append(
            (
                f"sampler 14x14 shared={shared}",
                sampler._sample_jigsaw_kernel,
                sampler_signature,
                {"SHARED": shared, "BLOCK_N": 256, "BLOCK_G": 16},
                {},
            )
        )

    image_ints = {name: "i32" for name in ("stride_b", "stride_c", "stride_h", "stride_w")}
    import torch

    for dtype, precision in (("bf16", "tf32"), ("fp32", "ieee")):
        torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        flags = {"PATCH": 16, "HAS_PERM": True, "PRECISION": precision, "UPCAST": False}
        for m, d, k, warps, stages in patch_embed.GPU_GEMM_SHAPES[:2]:
            tiles = {"BLOCK_M": m, "BLOCK_D": d, "BLOCK_K": k}
            options = {"num_warps": warps, "num_stages": stages}
            forward = {
                "images_ptr": f"*{dtype}",
                "weight_ptr": f"*{dtype}",
                "bias_ptr": f"*{dtype}",
                "pos_ptr": f"*{dtype}",
                "unk_ptr": f"*{dtype}",
                "perm_ptr": "*i64",
                "mask_ptr": "*i1",
                "out_ptr": f"*{dtype}",
                **{name: "i32" for name in ("total_tokens", "num_positions", "cols", "K", "D")},
                **image_ints,
            }
            variants.append(
                (
                    f"patch_embed forward {dtype} {m}x{d}x{k}",
                    patch_embed._forward_kernel.fn,  # the autotuner's kernel
                    {**forward, **dict.fromkeys((*flags, "HAS_BIAS", "HAS_MASK", *tiles), "constexpr")},
                    {**flags, "HAS_BIAS": True, "HAS_MASK": True, **tiles},
                    options,
                )
            )
            grad_images = {
                "grad_ptr": f"*{dtype}",
                "weight_ptr": f"*{dtype}",
                "perm_ptr": "*i64",
                "grad_images_ptr": f"*{dtype}",
                **{name: "i32" for name in ("total_tokens", "num_positions", "cols", "K", "D")},
                **image_ints,
            }
            variants.append(
                (
                    f"patch_embed grad_images {dtype} {m}x{d}x{k}",
                    patch_embed._grad_images_kernel.fn,
                    {**grad_images, **dict.fromkeys((*flags, *tiles), "constexpr")},
                    {**flags, **tiles},
                    options,
                )
            )
        grad_weight = {
            "grad_ptr": f"*{dtype}",
            "images_ptr": f"*{dtype}",
            "perm_ptr": "*i64",
            "partial_ptr": "*fp32",
            **{name: "i32" for name in ("total_tokens", "num_positions", "cols", "K", "D", "tokens_per_split")},
            **image_ints,
        }
        tiles = {"BLOCK_M": 64, "BLOCK_D": 128, "BLOCK_K": 64}  # _grad_weight_tiles on DeiT shapes
        variants.append(
            (
                f"patch_embed grad_weight {dtype}",
                patch_embed._grad_weight_kernel,
                {**grad_weight, **dict.fromkeys((*flags, *tiles), "constexpr")},
                {**flags, **tiles},
                {},
            )
        )
        # The position gradient's tiles as position_gradient_plan gives them on an H100 at DeiT-S's sizes:
        # mjp_pos_embed's backward (inverse move, no bias) and the patch embedding's (bias, no move).
        for scatter in (False, True):
            plan = patch_embed.position_gradient_plan(
                256, 196, 384, torch_dtype, 132, False, scatter=scatter, has_bias=not scatter
            )
            variants.append(
                (
                    f"grad_position partials {dtype} scatter={scatter}",
                    patch_embed._position_partials_kernel,
                    {
                        "grad_ptr": f"*{dtype}",
                        "mask_ptr": "*i1",
                        "perm_ptr": "*i64",
                        "grad_tokens_ptr": f"*{dtype}",
                        "partial_ptr": "*fp32",
                        **{name: "i32" for name in ("batch", "num_positions", "D", "samples_per_chunk")},
                        **dict.fromkeys(
                            ("HAS_MASK", "SCATTER", "HAS_BIAS", "BLOCK_B", "BLOCK_N", "BLOCK_D"), "constexpr"
                        ),
                    },
                    {
                        "HAS_MASK": True,
                        "SCATTER": scatter,
                        "HAS_BIAS": not scatter,
                        "BLOCK_B": plan.block_b,
                        "BLOCK_N": plan.block_n,
                        "BLOCK_D": plan.block_d,
                    },
                    {},
                )
            )
            variants.append(
                (
                    f"grad_position reduce {dtype} bias={not scatter}",
                    patch_embed._position_reduce_kernel,
                    {
                        "partial_ptr": "*fp32",
                        "grad_pos_ptr": f"*{dtype}",
                        "grad_unk_ptr": f"*{dtype}",
                        "grad_bias_ptr": f"*{dtype}",
                        **{name: "i32" for name in ("chunks", "num_positions", "D", "small_rows")},
                        **dict.fromkeys(("HAS_BIAS", "BLOCK_N", "BLOCK_D", "BLOCK_S"), "constexpr"),
                    },
                    {
                        "HAS_BIAS": not scatter,
                        "BLOCK_N": plan.reduce_block_n,
                        "BLOCK_D": plan.reduce_block_d,
                        "BLOCK_S": plan.reduce_block_s,
                    },
                    {},
                )
            )
        if dtype == "fp32":  # a launch turns an int argument equal to 1 into a constexpr: B = N = D = 1, one chunk
            sizes = ("batch", "num_positions", "D", "samples_per_chunk", "chunks", "small_rows")
            for name, kernel, signature, constexprs, options in variants[-4:]:
                ones = [size for size in sizes if size in signature]
                variants.append(
                    (
                        f"{name} sizes=1",
                        kernel,
                        {**signature, **dict.fromkeys(ones, "constexpr")},
                        {**constexprs, **dict.fromkeys(ones, 1)},
                        options,
                    )
                )
        variants.append(
            (
                f"pos_embed forward {dtype}",
                pos_embed._forward_kernel,
                {
                    "tokens_ptr": f"*{dtype}",
                    "perm_ptr": "*i64",
                    "mask_ptr": "*i1",
                    "pos_ptr": f"*{dtype}",
                    "unk_ptr": f"*{dtype}",
                    "out_ptr": f"*{dtype}",
                    **{name: "i32" for name in ("total", "num_positions", "D")},
                    **dict.fromkeys(("BLOCK_R", "BLOCK_D"), "constexpr"),
                },
                {"BLOCK_R": 32, "BLOCK_D": 128},
                {},
            )
        )
    variants.extend(_dal_loss_variants(dal_loss))
    return variants


def _dal_loss_variants(dal_loss) -> list[tuple[str, object, dict[str, str], dict[str, object], dict[str, int]]]:
    """The DAL loss's kernels with the tiles of their GPU launches: nonlinear and linear, float32 and bfloat16."""
    variants = []
    for dtype, weight_dtype, nonlinear in (
        ("fp32", "fp32", True),
        ("bf16", "bf16", True),
        ("bf16", "fp32", True),  # bfloat16 positions, float32 regressor: both tiles upcast
        ("fp32", "fp32", False),
        ("bf16", "bf16", False),
    ):
        upcast = dtype != weight_dtype
        kind = f"{'nonlinear' if nonlinear else 'linear'} {dtype}/{weight_dtype}"
        flags = {
            "NONLINEAR": nonlinear,
            "HAS_B1": nonlinear,
            "HAS_MASK": True,
            "PRECISION": "ieee" if dtype == "fp32" or upcast else "tf32",
            "UPCAST": upcast,
        }
        partial = {
            "pos_ptr": f"*{dtype}",
            "w1_ptr": f"*{weight_dtype}",
            "b1_ptr": f"*{weight_dtype}",
            "w2_ptr": f"*{weight_dtype}",
            "mask_ptr": "*i1",
            "hidden_ptr": "*fp32",
            "partial_pred_ptr": "*fp32",
            "partial_kept_ptr": "*i32",
            **{name: "i32" for name in ("N", "D", "K", "B", "tiles_per_split", "samples_per_split")},
        }
        variants.append(
            (
                f"dal_loss forward_partial {kind}",
                dal_loss._forward_partial_kernel,
                {**partial, **dict.fromkeys((*flags, *dal_loss.FORWARD_TILES), "constexpr")},
                {**flags, **dal_loss.FORWARD_TILES},
                {"num_warps": dal_loss.FORWARD_WARPS},
            )
        )
        backward = {
            "grad_ptr": "*fp32",
            "pos_ptr": f"*{dtype}",
            "w1_ptr": f"*{weight_dtype}",
            "w2_ptr": f"*{weight_dtype}",
            **{name: "*fp32" for name in ("coords_ptr", "pred_ptr", "hidden_ptr", "weights_ptr")},
            "grad_pos_ptr": f"*{dtype}",
            **{name: f"*{weight_dtype}" for name in ("grad_w1_ptr", "grad_b1_ptr", "grad_w2_ptr", "grad_b2_ptr")},
            **{name: "i32" for name in ("N", "D", "H")},
            "scale": "fp32",
            "weight_programs": "i32",
        }
        backward_flags = {"NONLINEAR": nonlinear, "HAS_B1": nonlinear, "HAS_B2": True}
        variants.append(
            (
                f"dal_loss backward {kind}",
                dal_loss._backward_kernel,
                {**backward, **dict.fromkeys((*backward_flags, *dal_loss.BACKWARD_TILES), "constexpr")},
                {**backward_flags, **dal_loss.BACKWARD_TILES},
                {"num_warps": dal_loss.BACKWARD_WARPS},
            )
        )
    for has_mask in (False, True):
        variants.append(
            (
                f"dal_loss forward_finish mask={has_mask}",
                dal_loss._forward_finish_kernel,
                {
                    "partial_pred_ptr": "*fp32",
                    "partial_kept_ptr": "*i32",
                    "b2_ptr": "*fp32",
                    **{name: "*fp32" for name in ("coords_ptr", "pred_ptr", "weights_ptr", "loss_ptr")},
                    "N": "i32",
                    "splits": "i32",
                    "scale": "fp32",
                    **dict.fromkeys(("HAS_B2", "HAS_MASK", "BLOCK"), "constexpr"),
                },
                {"HAS_B2": True, "HAS_MASK": has_mask, "BLOCK": 256},
                {"num_warps": dal_loss.FINISH_WARPS},
            )
        )
    # A launch turns an int argument equal to 1 into a constexpr: one position, one sample, one split, one program
    # of weights (the linear regressor with D <= 64). Compile those specializations too.
    sizes = ("N", "B", "tiles_per_split", "samples_per_split", "splits", "weight_programs")
    for name, kernel, signature, constexprs, options in list(variants):
        if "fp32/fp32" in name or "mask=True" in name:
            ones = [size for size in sizes if size in signature]
            variants.append(
                (
                    f"{name} sizes=1",
                    kernel,
                    {**signature, **dict.fromkeys(ones, "constexpr")},
                    {**constexprs, **dict.fromkeys(ones, 1)},
                    options,
                )
            )
    return variants


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="80,90", help="compute capabilities, comma-separated")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("unset TRITON_INTERPRET: the interpreter replaces the kernels that this script compiles")
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    failures = 0
    for arch in (int(part) for part in args.arch.split(",")):
        target = GPUTarget("cuda", arch, 32)
        for name, kernel, signature, constexprs, options in _variants():
            start = time.perf_counter()
            try:
                source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
                compiled = triton.compile(source, target=target, options=options or None)
                shared = compiled.metadata.shared
                detail = f"cubin {len(compiled.asm['cubin'])} bytes, shared {shared} bytes"
                if shared > MAX_SHARED_BYTES.get(arch, shared):
                    # Not a failure: launching raises OutOfResources, and the autotuner drops the config.
                    detail += f" (over sm_{arch}'s {MAX_SHARED_BYTES[arch]}: the autotuner will skip this tile)"
                print(f"ok   sm_{arch} {name}: {detail} ({time.perf_counter() - start:.1f} s)", flush=True)
            except Exception:  # noqa: BLE001 - report every kernel, then fail
                failures += 1
                print(f"FAIL sm_{arch} {name}:\n{traceback.format_exc()}", flush=True)
    print(f"{failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
