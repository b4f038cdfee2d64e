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

# Module constants that choose which launch path runs, or how many programs a launch has, not how a kernel
# compiles: every path's variants are among _variants() whatever they hold (the weight gradient gathering the
# patches, HAS_PERM, or the gradient's rows by the inverse, INVERSE; the position gradient's batch chunks, a grid
# size and a runtime argument, unless the plan also changes its tiles, which then compile as changed variants).
LAUNCH_CONSTANTS = {
    "mjp_fast.triton.patch_embed.WEIGHT_GRADIENT_BY_INVERSE",
    "mjp_fast.triton.common.PROGRAMS_PER_SM",
    "mjp_fast.triton.common.MAX_PARTIAL_SHARE",
}


def _variants() -> list[tuple[str, object, dict[str, str], dict[str, object], dict[str, int]]]:
    """(name, kernel, signature, constexprs, options) of each launch to compile."""
    from mjp_fast.sampler import triton_kernel as sampler
    from mjp_fast.triton import common, dal_loss, patch_embed, pos_embed

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
                {"num_warps": sampler.SAMPLER_WARPS},
            )
        )

    image_ints = {name: "i32" for name in ("stride_b", "stride_c", "stride_h", "stride_w")}
    import torch

    # Prefix rows (class and register tokens): a ViT's class token with its row in the table, P = Q = 1, which a
    # launch makes constexpr (an int argument equal to 1); none (P = 0, HAS_PREFIX off: the kernels as they were
    # before prefix rows); and registers (P = 5, int32 arguments).
    prefix_cases = (
        ("P=1", {"HAS_PREFIX": True, "prefix_count": 1, "prefix_positions": 1}),
        ("P=0", {"HAS_PREFIX": False}),
        ("P=5", {"HAS_PREFIX": True}),
    )

    def with_prefix(case: dict, signature: dict) -> tuple[dict, dict]:
        """The case's constexprs among the kernel's arguments: (signature entries, values)."""
        present = {name: value for name, value in case.items() if name in signature}
        return dict.fromkeys(present, "constexpr"), present

    # The tiles that the launchers choose on a GPU at DeiT-S's sizes (D = 384, K = 3 * 16 * 16)
    weight_tiles = dict(zip(("BLOCK_M", "BLOCK_D", "BLOCK_K"), patch_embed._grad_weight_tiles(384, 768)))
    pos_embed_tiles = dict(zip(("BLOCK_R", "BLOCK_D"), pos_embed._forward_tiles(384)))

    for dtype, precision in (("bf16", "tf32"), ("fp32", "ieee")):
        torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        flags = {"PATCH": 16, "HAS_PERM": True, "PRECISION": precision, "UPCAST": False, "ROUND": patch_embed.KEEP}
        forward = {
            **{name: f"*{dtype}" for name in ("images_ptr", "weight_ptr", "bias_ptr", "pos_ptr", "unk_ptr")},
            "prefix_ptr": f"*{dtype}",
            "perm_ptr": "*i64",
            "mask_ptr": "*i1",
            "out_ptr": f"*{dtype}",
            **dict.fromkeys(("total_tokens", "total_prefix", "num_positions", "prefix_count"), "i32"),
            **dict.fromkeys(("prefix_positions", "cols", "K", "D"), "i32"),
            **image_ints,
            "token_bucket": "i32",  # the autotuning key, never read
            "HAS_PREFIX": "i1",  # replaced by each case's constexpr
        }
        grad_images = {
            "grad_ptr": f"*{dtype}",
            "weight_ptr": f"*{dtype}",
            "perm_ptr": "*i64",
            "grad_images_ptr": f"*{dtype}",
            **dict.fromkeys(("total_tokens", "num_positions", "prefix_count", "cols", "K", "D"), "i32"),
            **image_ints,
            "token_bucket": "i32",
            "HAS_PREFIX": "i1",
        }
        grad_weight = {
            "grad_ptr": f"*{dtype}",
            "images_ptr": f"*{dtype}",
            "perm_ptr": "*i64",
            "inverse_ptr": "*i32",
            "partial_ptr": "*fp32",
            **dict.fromkeys(("total_tokens", "num_positions", "prefix_count", "cols", "K", "D"), "i32"),
            "tokens_per_split": "i32",
            **image_ints,
            "HAS_PREFIX": "i1",
        }
        for index, (m, d, k, warps, stages) in enumerate(patch_embed.GPU_GEMM_SHAPES[:2]):
            tiles = {"BLOCK_M": m, "BLOCK_D": d, "BLOCK_K": k}
            options = {"num_warps": warps, "num_stages": stages}
            forward_flags = {**flags, "HAS_BIAS": True, "HAS_MASK": True, **tiles}
            for prefix, case in prefix_cases:
                if prefix == "P=5" and index:
                    continue  # the int32 prefix arguments with one tile per dtype
                kinds, values = with_prefix(case, forward)
                variants.append(
                    (
                        f"patch_embed forward {dtype} {m}x{d}x{k} {prefix}",
                        patch_embed._forward_kernel.fn,  # the autotuner's kernel
                        {**forward, **kinds, **dict.fromkeys(forward_flags, "constexpr")},
                        {**forward_flags, **values},
                        options,
                    )
                )
                kinds, values = with_prefix(case, grad_images)
                variants.append(
                    (
                        f"patch_embed grad_images {dtype} {m}x{d}x{k} {prefix}",
                        patch_embed._grad_images_kernel.fn,
                        {**grad_images, **kinds, **dict.fromkeys((*flags, *tiles), "constexpr")},
                        {**flags, **tiles, **values},
                        options,
                    )
                )
        tiles = weight_tiles
        # the weight gradient's launch with a perm (HAS_PERM) on a GPU with a large shared memory; and with the
        # perm's inverse instead (INVERSE: a permutation, the training step's)
        weight_options = {"num_stages": patch_embed.GRAD_WEIGHT_PERM_STAGES}
        weight_flags = {**flags, "INVERSE": False}
        inverse_flags = {**flags, "HAS_PERM": False, "INVERSE": True}
        for prefix, case in prefix_cases:
            kinds, values = with_prefix(case, grad_weight)
            for name, kernel_flags in (("", weight_flags), (" inverse", inverse_flags)):
                variants.append(
                    (
                        f"patch_embed grad_weight{name} {dtype} {prefix}",
                        patch_embed._grad_weight_kernel,
                        {**grad_weight, **kinds, **dict.fromkeys((*kernel_flags, *tiles), "constexpr")},
                        {**kernel_flags, **tiles, **values},
                        weight_options,
                    )
                )
        if dtype == "bf16":
            # Mixed operand dtypes (bfloat16 activations or gradients, a float32 weight or images): _dot multiplies
            # in float32 (UPCAST), the only branch that may compile, since tl.dot refuses bf16 x fp32.
            m, d, k, warps, stages = patch_embed.GPU_GEMM_SHAPES[1]
            tiles = {"BLOCK_M": m, "BLOCK_D": d, "BLOCK_K": k}
            mixed = {**flags, "PRECISION": "ieee", "UPCAST": True}
            options = {"num_warps": warps, "num_stages": stages}
            kinds, values = with_prefix(prefix_cases[0][1], forward)
            variants.append(
                (
                    "patch_embed forward bf16 images x fp32 weight (upcast)",
                    patch_embed._forward_kernel.fn,
                    {
                        **forward,
                        "weight_ptr": "*fp32",
                        **kinds,
                        **dict.fromkeys((*mixed, "HAS_BIAS", "HAS_MASK", *tiles), "constexpr"),
                    },
                    {**mixed, "HAS_BIAS": True, "HAS_MASK": True, **tiles, **values},
                    options,
                )
            )
            kinds, values = with_prefix(prefix_cases[0][1], grad_images)
            variants.append(
                (
                    "patch_embed grad_images bf16 grad x fp32 weight (upcast)",
                    patch_embed._grad_images_kernel.fn,
                    {**grad_images, "weight_ptr": "*fp32", **kinds, **dict.fromkeys((*mixed, *tiles), "constexpr")},
                    {**mixed, **tiles, **values},
                    options,
                )
            )
            # A float32 gradient (the output is float32) against bfloat16 images and weight, rounded to bfloat16 and
            # multiplied on the tensor cores (ROUND).
            rounded = {**flags, "UPCAST": patch_embed.SAME_DTYPE, "ROUND": patch_embed.TO_BFLOAT16}
            variants.append(
                (
                    "patch_embed grad_images fp32 grad x bf16 weight (round the gradient)",
                    patch_embed._grad_images_kernel.fn,
                    {**grad_images, "grad_ptr": "*fp32", **kinds, **dict.fromkeys((*rounded, *tiles), "constexpr")},
                    {**rounded, **tiles, **values},
                    options,
                )
            )
            tiles = weight_tiles
            kinds, values = with_prefix(prefix_cases[0][1], grad_weight)
            mixed_weight, rounded_weight = {**mixed, "INVERSE": False}, {**rounded, "INVERSE": False}
            variants.append(
                (
                    "patch_embed grad_weight bf16 grad x fp32 images (upcast)",
                    patch_embed._grad_weight_kernel,
                    {
                        **grad_weight,
                        "images_ptr": "*fp32",
                        **kinds,
                        **dict.fromkeys((*mixed_weight, *tiles), "constexpr"),
                    },
                    {**mixed_weight, **tiles, **values},
                    weight_options,
                )
            )
            variants.append(
                (
                    "patch_embed grad_weight fp32 grad x bf16 images (round the gradient)",
                    patch_embed._grad_weight_kernel,
                    {
                        **grad_weight,
                        "grad_ptr": "*fp32",
                        **kinds,
                        **dict.fromkeys((*rounded_weight, *tiles), "constexpr"),
                    },
                    {**rounded_weight, **tiles, **values},
                    weight_options,
                )
            )
            # Autocast's training step (compute_dtype bfloat16): the float32 images, weight and gradient as they
            # are, each tile rounded to bfloat16 as it is loaded.
            fp32 = dict.fromkeys(("images_ptr", "weight_ptr", "grad_ptr"), "*fp32")
            autocast = {**rounded, "PRECISION": "tf32"}
            m, d, k, warps, stages = patch_embed.GPU_GEMM_SHAPES[0]
            gemm_tiles = {"BLOCK_M": m, "BLOCK_D": d, "BLOCK_K": k}
            gemm_options = {"num_warps": warps, "num_stages": stages}
            kinds, values = with_prefix(prefix_cases[0][1], forward)
            forward_flags = {**autocast, "HAS_BIAS": True, "HAS_MASK": True, **gemm_tiles}
            fp32_forward = {name: kind for name, kind in fp32.items() if name in forward}
            fp32_forward.update(dict.fromkeys(("bias_ptr", "pos_ptr", "unk_ptr", "prefix_ptr", "out_ptr"), "*fp32"))
            variants.append(
                (
                    "patch_embed forward autocast: fp32 images x fp32 weight rounded to bf16",
                    patch_embed._forward_kernel.fn,
                    {**forward, **fp32_forward, **kinds, **dict.fromkeys(forward_flags, "constexpr")},
                    {**forward_flags, **values},
                    gemm_options,
                )
            )
            for name, kernel, signature, tile_values, kernel_options, kernel_flags in (
                ("grad_images", patch_embed._grad_images_kernel.fn, grad_images, gemm_tiles, gemm_options, autocast),
                ("grad_weight", patch_embed._grad_weight_kernel, grad_weight, tiles, weight_options,
                 {**autocast, "INVERSE": False}),
                ("grad_weight inverse", patch_embed._grad_weight_kernel, grad_weight, tiles, weight_options,
                 {**autocast, "HAS_PERM": False, "INVERSE": True}),
            ):  # fmt: skip
                kinds, values = with_prefix(prefix_cases[0][1], signature)
                typed = {argument: kind for argument, kind in fp32.items() if argument in signature}
                if name == "grad_images":
                    typed["grad_images_ptr"] = "*fp32"
                other = "weight" if name == "grad_images" else "images"
                variants.append(
                    (
                        f"patch_embed {name} autocast: fp32 grad x fp32 {other} rounded to bf16",
                        kernel,
                        {**signature, **typed, **kinds, **dict.fromkeys((*kernel_flags, *tile_values), "constexpr")},
                        {**kernel_flags, **tile_values, **values},
                        kernel_options,
                    )
                )
        # The position gradient's tiles as position_gradient_plan gives them on an H100 at DeiT-S's sizes with a
        # class token (256 x (1 + 196) x 384): mjp_pos_embed's backward (inverse move, grad_prefix, no bias) and
        # the patch embedding's (bias, no move).
        position_variants = []
        # ZERO_UNSHOWN: the eager mjp_pos_embed backward, which reads the forward's witness (int32); without it (the
        # patch embedding's, or the compiled operator's) the argument is grad's pointer, never read.
        # (HAS_MASK, SCATTER, ZERO_UNSHOWN, INVERSE): the patch embedding's backward with a jigsaw and without (the
        # plain model's), and with a jigsaw known to be a permutation (its inverse written for the weight gradient);
        # mjp_pos_embed's without the witness and with it
        for has_mask, scatter, zero_unshown, inverse in ((True, False, False, False), (False, False, False, False),
                                                         (True, False, False, True), (True, True, False, False),
                                                         (True, True, True, False)):  # fmt: skip
            plan = common.position_gradient_plan(
                256, 197, 384, torch_dtype, 132, False, scatter=scatter, has_bias=not scatter, prefix_count=1,
                prefix_positions=1,
            )  # fmt: skip
            partials = {
                "grad_ptr": f"*{dtype}",
                "mask_ptr": "*i1",
                "perm_ptr": "*i64",
                "grad_tokens_ptr": f"*{dtype}",
                "partial_ptr": "*fp32",
                **dict.fromkeys(("batch", "num_positions", "prefix_count", "D", "samples_per_chunk"), "i32"),
                "witness_ptr": "*i32" if zero_unshown else f"*{dtype}",
                "inverse_ptr": "*i32" if inverse else f"*{dtype}",
                "HAS_PREFIX": "i1",
            }
            partial_flags = {
                "HAS_MASK": has_mask,
                "SCATTER": scatter,
                "HAS_BIAS": not scatter,
                "ZERO_UNSHOWN": zero_unshown,
                "INVERSE": inverse,
                "BLOCK_B": plan.block_b,
                "BLOCK_N": plan.block_n,
                "BLOCK_D": plan.block_d,
                "NUM_STAGES": plan.num_stages,
            }
            reduce = {
                "partial_ptr": "*fp32",
                **{name: f"*{dtype}" for name in ("grad_pos_ptr", "grad_unk_ptr", "grad_bias_ptr", "grad_prefix_ptr")},
                **dict.fromkeys(("chunks", "num_positions", "prefix_count", "prefix_positions", "D"), "i32"),
                "small_rows": "i32",
            }
            for prefix, case in prefix_cases:
                kinds, values = with_prefix(case, partials)
                position_variants.append(
                    (
                        f"grad_position partials {dtype} mask={has_mask} scatter={scatter} witness={zero_unshown}"
                        f"{' inverse' if inverse else ''} {prefix}",
                        common._position_partials_kernel,
                        {**partials, **kinds, **dict.fromkeys(partial_flags, "constexpr")},
                        {**partial_flags, **values},
                        {},
                    )
                )
                if not has_mask or inverse:  # the reduction reads no mask nor perm: the masked case's variants
                    continue
                reduce_flags = {
                    "HAS_BIAS": not scatter,
                    "WRITE_PREFIX": scatter and case["HAS_PREFIX"],
                    "BLOCK_N": plan.reduce_block_n,
                    "BLOCK_D": plan.reduce_block_d,
                    "BLOCK_S": plan.reduce_block_s,
                }
                kinds, values = with_prefix(case, reduce)
                position_variants.append(
                    (
                        f"grad_position reduce {dtype} bias={not scatter} {prefix}",
                        common._position_reduce_kernel,
                        {**reduce, **kinds, **dict.fromkeys(reduce_flags, "constexpr")},
                        {**reduce_flags, **values},
                        {},
                    )
                )
        variants.extend(position_variants)
        if dtype == "fp32":  # a launch turns an int argument equal to 1 into a constexpr: B = N = D = 1, one chunk
            sizes = ("batch", "num_positions", "D", "samples_per_chunk", "chunks", "small_rows")
            for name, kernel, signature, constexprs, options in position_variants:
                if name.endswith("P=0"):
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
        for witness in (True, False):  # eager (writes the witness) and the compiled operator (perm's pointer)
            pos_forward = {
                "tokens_ptr": f"*{dtype}",
                "perm_ptr": "*i64",
                "mask_ptr": "*i1",
                "pos_ptr": f"*{dtype}",
                "unk_ptr": f"*{dtype}",
                "prefix_ptr": f"*{dtype}",
                "out_ptr": f"*{dtype}",
                **dict.fromkeys(
                    ("total", "total_prefix", "num_positions", "prefix_count", "prefix_positions", "D"), "i32"
                ),
                "witness_ptr": "*i32" if witness else "*i64",
                "HAS_PREFIX": "i1",
            }
            for prefix, case in prefix_cases:
                kinds, values = with_prefix(case, pos_forward)
                variants.append(
                    (
                        f"pos_embed forward {dtype} witness={witness} {prefix}",
                        pos_embed._forward_kernel,
                        {**pos_forward, **kinds, **dict.fromkeys(("HAS_WITNESS", "BLOCK_R", "BLOCK_D"), "constexpr")},
                        {**pos_embed_tiles, **values, "HAS_WITNESS": witness},
                        {},
                    )
                )
    variants.extend(_dal_loss_variants(dal_loss))
    variants.extend(_gathered_patch_embed_variants())
    return variants


def _gathered_patch_embed_variants() -> list[tuple[str, object, dict[str, str], dict[str, object], dict[str, int]]]:
    """The gathered (NaFlex) patch embedding's kernels with the tiles of their GPU launches, at NaFlex-B's sizes
    (D = 768, K = 16 * 16 * 3): forward with 0, 1 and 5 prefix rows, the patches' and weight's gradients, and the
    per-sample position gradient; bfloat16 and float32."""
    from mjp_fast.triton import gathered_patch_embed as gathered

    variants = []
    weight_tiles = dict(zip(("BLOCK_M", "BLOCK_D", "BLOCK_K"), gathered._grad_weight_tiles(768, 768)))
    block_r, block_d, _ = gathered._sample_position_tiles(768)
    for dtype, precision in (("bf16", "tf32"), ("fp32", "ieee")):
        forward = {
            **{name: f"*{dtype}" for name in ("patches_ptr", "weight_ptr", "bias_ptr", "pos_ptr", "unk_ptr")},
            "prefix_ptr": f"*{dtype}",
            "perm_ptr": "*i64",
            "mask_ptr": "*i1",
            "out_ptr": f"*{dtype}",
            **dict.fromkeys(("total_tokens", "num_positions", "K", "D", "stride_pb", "stride_pn"), "i32"),
            **dict.fromkeys(("stride_pk", "stride_pos_b", "total_prefix", "prefix_count", "token_bucket"), "i32"),
        }
        grad_patches = {
            "grad_ptr": f"*{dtype}",
            "weight_ptr": f"*{dtype}",
            "perm_ptr": "*i64",
            "grad_patches_ptr": f"*{dtype}",
            **dict.fromkeys(("total_tokens", "num_positions", "K", "D", "prefix_count", "token_bucket"), "i32"),
        }
        grad_weight = {
            "grad_ptr": f"*{dtype}",
            "patches_ptr": f"*{dtype}",
            "perm_ptr": "*i64",
            "partial_ptr": "*fp32",
            **dict.fromkeys(("total_tokens", "num_positions", "K", "D", "tokens_per_split", "prefix_count"), "i32"),
            **dict.fromkeys(("stride_pb", "stride_pn", "stride_pk"), "i32"),
        }
        sample_position = {
            "grad_ptr": f"*{dtype}",
            "mask_ptr": "*i1",
            "grad_pos_ptr": f"*{dtype}",
            "partial_ptr": "*fp32",
            **dict.fromkeys(("total_tokens", "num_positions", "D", "rows_per_program", "prefix_count"), "i32"),
        }
        dot = {"PRECISION": precision, "UPCAST": False}
        for index, (m, d, k, warps, stages) in enumerate(gathered.GPU_GEMM_SHAPES[:2]):
            tiles = {"BLOCK_M": m, "BLOCK_D": d, "BLOCK_K": k}
            options = {"num_warps": warps, "num_stages": stages}
            for prefix, has_prefix in (("P=0", False), ("P=1", True), ("P=5", True)):
                if prefix == "P=5" and index:
                    continue
                flags = {"HAS_BIAS": True, "HAS_PERM": True, "HAS_MASK": True, "HAS_PREFIX": has_prefix, **dot}
                values = {**flags, **tiles}
                signature = {**forward, **dict.fromkeys(values, "constexpr")}
                if prefix == "P=1":  # a launch makes an int argument equal to 1 a constexpr: one class token
                    signature["prefix_count"] = "constexpr"
                    values["prefix_count"] = 1
                variants.append(
                    (
                        f"gathered_patch_embed forward {dtype} {m}x{d}x{k} {prefix}",
                        gathered._forward_kernel.fn,
                        signature,
                        values,
                        options,
                    )
                )
                backward_flags = {"HAS_PERM": True, "HAS_PREFIX": has_prefix, **dot}
                variants.append(
                    (
                        f"gathered_patch_embed grad_patches {dtype} {m}x{d}x{k} {prefix}",
                        gathered._grad_patches_kernel.fn,
                        {**grad_patches, **dict.fromkeys({**backward_flags, **tiles}, "constexpr")},
                        {**backward_flags, **tiles},
                        options,
                    )
                )
                if index == 0:
                    variants.append(
                        (
                            f"gathered_patch_embed grad_weight {dtype} {prefix}",
                            gathered._grad_weight_kernel,
                            {**grad_weight, **dict.fromkeys({**backward_flags, **weight_tiles}, "constexpr")},
                            {**backward_flags, **weight_tiles},
                            {},
                        )
                    )
                    position_flags = {
                        "HAS_MASK": True,
                        "HAS_PREFIX": has_prefix,
                        "WRITE_POS": True,
                        "BLOCK_R": block_r,
                        "BLOCK_D": block_d,
                    }
                    variants.append(
                        (
                            f"gathered_patch_embed sample_position {dtype} {prefix}",
                            gathered._sample_position_kernel,
                            {**sample_position, **dict.fromkeys(position_flags, "constexpr")},
                            position_flags,
                            {},
                        )
                    )
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
            "saved_ptr": "*fp32",
            "partials_ptr": "*fp32",
            **{name: "i32" for name in ("N", "skip_rows", "D", "K", "B", "tiles_per_split", "samples_per_split")},
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
            **{name: "*fp32" for name in ("coords_ptr", "saved_ptr")},
            "grad_pos_ptr": f"*{dtype}",
            **{name: f"*{weight_dtype}" for name in ("grad_w1_ptr", "grad_b1_ptr", "grad_w2_ptr", "grad_b2_ptr")},
            **{name: "i32" for name in ("N", "skip_rows", "D", "H")},
            "scale": "fp32",
            "weight_programs": "i32",
        }
        # ACCUMULATE (the fused MJP step's) with the nonlinear regressor, a new gradient with the linear: both compile
        backward_flags = {"NONLINEAR": nonlinear, "HAS_B1": nonlinear, "HAS_B2": True, "ACCUMULATE": nonlinear}
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
                    "partials_ptr": "*fp32",
                    "b2_ptr": "*fp32",
                    **{name: "*fp32" for name in ("coords_ptr", "saved_ptr", "loss_ptr")},
                    "N": "i32",
                    "H": "i32",
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
    sizes = ("N", "skip_rows", "B", "tiles_per_split", "samples_per_split", "splits", "weight_programs")
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
    # Under torch.compile, inductor launches these kernels itself and types a Python float argument as fp64 (torch
    # 2.11's triton_utils.signature_of), where an eager launch passes fp32: the H100's first compiled step failed so.
    for name, kernel, signature, constexprs, options in list(variants):
        if signature.get("scale") == "fp32" and ("fp32/fp32" in name or "bf16/bf16" in name or "mask=True" in name):
            if "sizes=1" not in name:
                variants.append((f"{name} scale=fp64", kernel, {**signature, "scale": "fp64"}, constexprs, options))
    # A ViT's full table, its class token's row first: skip_rows = 1 alone a constexpr.
    for name, kernel, signature, constexprs, options in list(variants):
        if "nonlinear bf16/bf16" in name:
            variants.append(
                (
                    f"{name} skip_rows=1",
                    kernel,
                    {**signature, "skip_rows": "constexpr"},
                    {**constexprs, "skip_rows": 1},
                    options,
                )
            )
    return variants


def _compile_as_launched(kernel, signature, constexprs, options, target):
    """The kernel compiled as a GPU launch specializes it: an int argument equal to 1 becomes a constexpr (the images'
    width stride), pointers and the ints that are multiples of 16 at DeiT-S's sizes are marked divisible by 16
    (without those marks the loads are not vectorized, nor pipelined the same way)."""
    import triton
    from triton.compiler import ASTSource

    signature = {argument: signature[argument] for argument in kernel.arg_names}
    if "stride_w" in signature:
        signature["stride_w"] = "constexpr"
        constexprs = {**constexprs, "stride_w": 1}
    multiples_of_16 = ("D", "K", "stride_b", "stride_c", "stride_h", "total_tokens", "tokens_per_split")
    attrs = {
        (index,): [["tt.divisibility", 16]]
        for index, argument in enumerate(kernel.arg_names)
        if signature[argument].startswith("*") or argument in multiples_of_16
    }
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=target, options=options or None)


def _tile_buffers(kernel, signature, constexprs, options, target) -> list[int]:
    """How many buffers the software pipeliner gives each tile that the kernel stages in shared memory, compiled as a
    GPU launch specializes it (:func:`_compile_as_launched`)."""
    import re

    ttgir = _compile_as_launched(kernel, signature, constexprs, options, target).asm["ttgir"]
    # a tile's buffers: the leading dim of a rank-3 shared allocation (a multi-buffered 2-D tile)
    shapes = re.findall(r"ttg\.local_alloc[^\n]*?-> !ttg\.memdesc<(\d+)x\d+x\d+x", ttgir)
    return sorted(int(buffers) for buffers in shapes)


def check_position_partials_pipelining(target) -> bool:
    """The position gradient's partials kernel, as a GPU plan launches it (NUM_STAGES > 1), copies its gradient tiles
    to shared memory ahead of the steps that add them (asynchronous copies), within the 48 KiB that a block gets
    without opt-in. Without the pipeline, ptxas issued a step's loads in pairs between the adds that consume them
    (sm_90 SASS): two to four memory round trips a step."""
    every_ok = True
    for name, kernel, signature, constexprs, options in _variants():
        if not name.startswith("grad_position partials") or name.endswith("sizes=1"):
            continue
        compiled = _compile_as_launched(kernel, signature, constexprs, options, target)
        copies = compiled.asm["ttgir"].count("ttg.async_copy_global_to_local")
        shared = compiled.metadata.shared
        ok = constexprs["NUM_STAGES"] > 1 and copies >= 1 and shared <= 48 * 1024
        every_ok = every_ok and ok
        verdict = "ok  " if ok else "FAIL"
        print(f"{verdict} sm_{target.arch} pipelining of the {name.removeprefix('grad_position ')}: "
              f"{constexprs['NUM_STAGES']} stages, {copies} asynchronous copies, {shared} bytes of shared memory",
              flush=True)  # fmt: skip
    return every_ok


def check_weight_gradient_pipelining(target) -> bool:
    """With a perm, or with its inverse, the weight gradient at GRAD_WEIGHT_PERM_STAGES pipelines its tiles as deep
    as without one at the default stages (see patch_embed.GRAD_WEIGHT_PERM_STAGES): either way an index is loaded
    before the tile it addresses. Autocast's variants: a float32 gradient against bfloat16 images, and against
    float32 images (both rounded to bfloat16 as they are loaded: the training step's)."""
    from mjp_fast.triton import patch_embed

    names = (
        "patch_embed grad_weight fp32 grad x bf16 images (round the gradient)",
        "patch_embed grad_weight autocast: fp32 grad x fp32 images rounded to bf16",
    )
    every_ok = True
    for name in names:
        _, kernel, signature, constexprs, _ = next(variant for variant in _variants() if variant[0] == name)
        plain = _tile_buffers(
            kernel, signature, {**constexprs, "HAS_PERM": False}, {"num_stages": patch_embed.GRAD_WEIGHT_STAGES}, target
        )
        stages = {"num_stages": patch_embed.GRAD_WEIGHT_PERM_STAGES}
        for index_name, index_flags in (("a perm", {"HAS_PERM": True}), ("the inverse", {"INVERSE": True})):
            jigsaw = _tile_buffers(kernel, signature, {**constexprs, "HAS_PERM": False, **index_flags}, stages, target)
            ok = jigsaw == plain and min(plain, default=0) >= 2
            every_ok = every_ok and ok
            verdict = "ok  " if ok else "FAIL"
            print(f"{verdict} sm_{target.arch} pipelining of the weight gradient ({name.split(': ')[-1]}): tile "
                  f"buffers {jigsaw} with {index_name}, {plain} without", flush=True)  # fmt: skip
    return every_ok


def check_benchmark_settings(target) -> bool:
    """Each setting that bench/bench_kernels.py times on a GPU compiles there: under each, the variants whose tiles,
    stages or warps it changes, compiled as a launch specializes them, within the block's shared memory. A setting
    that changes no variant fails (it would measure the default twice)."""
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    if root not in sys.path:  # `bench` is a folder of the checkout
        sys.path.insert(0, root)
    from bench.bench_kernels import DEFAULT, SETTINGS, applied

    default = {name: (constexprs, options) for name, _, _, constexprs, options in _variants()}
    every_ok = True
    for setting_name, setting in SETTINGS.items():
        if setting_name == DEFAULT:
            continue
        with applied(setting):
            changed = [variant for variant in _variants() if (variant[3], variant[4]) != default.get(variant[0])]
            for name, kernel, signature, constexprs, options in changed:
                try:
                    compiled = _compile_as_launched(kernel, signature, constexprs, options, target)
                    shared = compiled.metadata.shared
                    ok = shared <= MAX_SHARED_BYTES.get(target.arch, shared)
                    detail = f"shared {shared} bytes"
                except Exception:  # noqa: BLE001 - report every variant, then fail
                    ok, detail = False, traceback.format_exc()
                every_ok = every_ok and ok
                verdict = "ok  " if ok else "FAIL"
                print(f"{verdict} sm_{target.arch} setting {setting_name}: {name}: {detail}", flush=True)
        if not changed and set(setting) <= LAUNCH_CONSTANTS:
            print(f"ok   sm_{target.arch} setting {setting_name}: chooses launch paths or grids whose variants are "
                  "compiled above", flush=True)  # fmt: skip
        elif not changed:
            every_ok = False
            print(f"FAIL sm_{target.arch} setting {setting_name}: changes no kernel variant", flush=True)
    return every_ok


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
                if sorted(signature) != sorted(kernel.arg_names):
                    raise TypeError(f"signature {sorted(signature)} != the kernel's arguments {kernel.arg_names}")
                # in the kernel's order, whatever order the variant lists them in
                signature = {argument: signature[argument] for argument in kernel.arg_names}
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
        if arch >= 90:  # the pipeliner of Hopper's TTGIR, where it was measured
            failures += not check_weight_gradient_pipelining(target)
        failures += not check_position_partials_pipelining(target)
        failures += not check_benchmark_settings(target)
    print(f"{failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
