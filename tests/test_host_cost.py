"""What MJP's part of a training step dispatches, counted (no GPU needed): a guard against host-cost regressions.

The harness (tests/harness/host_cost.py, which the host-cost benchmark times too): a timm ViT at tiny sizes, the
position step forward and backward, plain against MJP (sampler, move, position term, DAL attached to the tokens;
``mjp explicit``: with ``mjp_aux_loss()`` added by the loop too). Each dispatched operator is one trip through Python
and the dispatcher, and on a GPU most are one kernel launch: on the H200's slow host, each cost tens of microseconds.
Issue 11 aims at 25 for the MJP step; the ceilings below are what this code reaches (the plain step: 11), so an
added operation fails here. On the ``triton`` backend (the GPU default where the extension has no CUDA kernels),
the kernel launches of the same steps are counted in the interpreter.
"""

import pytest
import torch

from tests.harness.host_cost import (
    count_ops,
    count_ops_without_kernels,
    count_triton_launches,
    position_steps,
    sampler_steps,
    tiny_models,
)

from .conftest import backends_for

pytestmark = pytest.mark.skipif("cpu" not in __import__("mjp_fast").available_backends(), reason="needs mjp_fast._C")

# Measured 2026-11-26 (cpu backend): the MJP part's own operators are one each way for the position step (or the
# fused embedding) and the DAL loss, and the sampler's two output allocations (the extension samples and advances
# the counter in one call); the rest is autograd's bookkeeping (a detach per parameter that gets a gradient, the
# sum of pos_embed's two gradients). The DAL loss attached to the tokens (so that the tokens' backward trains DAL
# in any loop) adds one view forward: mjp 15 -> 16, mjp fused embed 16 -> 17. A loop that also adds mjp_aux_loss()
# pays 3 more (the explicit loss's view, its backward's subtraction of the attached weight, the add of the loss's
# two gradients): 19.
CEILINGS = {"plain": 11, "mjp": 16, "mjp explicit": 19, "plain embed": 17, "mjp fused embed": 17, "sampler": 2}
# Triton launches per step: sampler 1; position step 1 forward, 2 backward (partial sums, their reduction); DAL 2
# forward, 1 backward; the fused embedding adds its weight gradient.
LAUNCH_CEILINGS = {"mjp": 7, "mjp explicit": 7, "mjp fused embed": 8, "sampler": 1}
# Operators the triton backend dispatches around its launches (counted with the kernels not run: what a GPU's host
# dispatches; the H200 counted 31 and 47 at commit 0de0904, 47 with autocast's 6 casts). Measured 2026-11-27: the
# sampler's two outputs and its counter's add_; the position step's output, its gradients (tokens, table, unk,
# class token) and float32 partials; DAL's loss, one buffer for what its backward needs (predictions, weights,
# hidden layer), its partials, and the regressor's four gradients, its table gradient added into the step's (one
# node for both: no add); a detach per leaf that gets a gradient (8) and the attached loss's view: 25. The explicit
# loss adds its view, the subtraction of the attached weight and the add of the loss's two gradients: 28. The fused
# embedding: its output, weight partials and their sum (and a view), an empty placeholder for the images' gradient,
# no inverse move, and DAL's own node (its table gradient added by autograd): 32.
# The fused embedding and its DAL loss are one node (DAL's table gradient added in its pass: no add, no tensor of
# its own), and its backward allocates nothing for the images' gradient and takes the weight partials' sum as it
# is (no view): 28.
# The float32 partial sums that a call's kernels write and read back (the position gradient's, the weight
# gradient's, the DAL forward's) are scratch buffers kept from one step to the next (common.scratch), not a
# torch.empty each step: mjp 23, explicit 26, the fused embedding 25.
TRITON_OP_CEILINGS = {"mjp": 23, "mjp explicit": 26, "mjp fused embed": 25, "sampler": 3}
# Under autocast, as a GPU's training step runs (bfloat16 tokens; the CPU's autocast dispatches the same
# operators). The plain embedding: timm's convolution gets its images, weight and bias cast and its weight and bias
# gradients cast back, the position add its output: 24 (17 + 7 casts). The triton fused embedding rounds the float32
# images and weight in its loads (compute_dtype) and returns float32 gradients: no cast, as without autocast (the
# H100 counted 39 at commit 869c34c: 6 casts, a promote_types, and the two nodes). The extension's operators
# convert the weight, bias, table, unk, prefix and output, and the gradients back, inside (compute_dtype, out_dtype):
# only the images' cast is left in Python (autograd keeps the cast images for the weight gradient), 18 (the H100
# counted 32 at 869c34c: 13 casts).
AUTOCAST_CEILINGS = {"plain embed": 24, "mjp fused embed": 18, "mjp": 16}
TRITON_AUTOCAST_OP_CEILINGS = {"mjp": 23, "mjp fused embed": 25}


@pytest.fixture(scope="module")
def models():
    return tiny_models("cpu")


@pytest.fixture(scope="module")
def steps(models):
    return {**position_steps(models, "cpu"), **sampler_steps(models, "cpu")}


@pytest.mark.parametrize("name", list(CEILINGS))
def test_dispatched_operations(steps, name):
    counter = count_ops(steps[name])
    assert counter.total <= CEILINGS[name], f"{name}: {counter.total} ops: {dict(counter.counts)}"


@pytest.mark.parametrize("name", ["mjp", "mjp explicit"])
def test_the_mjp_step_runs_one_fused_operator_each_way(steps, name):
    counts = count_ops(steps[name]).counts
    for operator in ("pos_embed_extension", "pos_embed_extension_backward", "dal_loss_extension"):
        assert counts[operator] == 1, operator
    assert counts["dal_loss_extension_backward"] == 1
    # no host read of a device tensor beyond the CPU sampler's counter, and no copy or cast of a whole tensor
    assert counts["_local_scalar_dense"] <= 1
    assert counts["_to_copy"] == 0 and counts["clone"] <= 1


@pytest.fixture(scope="module")
def triton_steps():
    if "triton" not in backends_for("cpu"):
        pytest.skip("needs the Triton interpreter")
    models = tiny_models("cpu", backend="triton")
    return {**position_steps(models, "cpu"), **sampler_steps(models, "cpu")}


@pytest.mark.parametrize("name", list(LAUNCH_CEILINGS))
def test_triton_kernel_launches(triton_steps, name):
    launches = count_triton_launches(triton_steps[name])
    assert sum(launches.values()) <= LAUNCH_CEILINGS[name], dict(launches)


@pytest.mark.parametrize("name", list(TRITON_OP_CEILINGS))
def test_triton_dispatched_operations(triton_steps, name):
    counter = count_ops_without_kernels(triton_steps[name])
    assert counter.total <= TRITON_OP_CEILINGS[name], f"{name}: {counter.total} ops: {dict(counter.counts)}"


def test_the_sampler_advances_its_counter_in_place(models, steps):
    sampler = models["mjp"].mjp.sampler
    counter = sampler.sample_counter
    before, version = int(counter), counter._version
    first = steps["sampler"]()
    assert sampler.sample_counter is counter and int(counter) == before + first.mask.shape[0]
    assert counter._version > version  # written in place, as add_ would: autograd's checks see the change
    second = steps["sampler"]()
    assert not torch.equal(first.perm, second.perm)  # the next samples of the stream
    counts = count_ops(steps["sampler"])
    assert counts.total <= CEILINGS["sampler"], dict(counts.counts)


@pytest.mark.parametrize("name", list(AUTOCAST_CEILINGS))
def test_dispatched_operations_under_autocast(models, name):
    counter = count_ops(position_steps(models, "cpu", autocast=True)[name])
    assert counter.total <= AUTOCAST_CEILINGS[name], f"{name}: {counter.total} ops: {dict(counter.counts)}"


@pytest.mark.parametrize("name", list(TRITON_AUTOCAST_OP_CEILINGS))
def test_triton_dispatched_operations_under_autocast(name):
    if "triton" not in backends_for("cpu"):
        pytest.skip("needs the Triton interpreter")
    steps = position_steps(tiny_models("cpu", backend="triton"), "cpu", autocast=True)
    counter = count_ops_without_kernels(steps[name])
    assert counter.total <= TRITON_AUTOCAST_OP_CEILINGS[name], f"{name}: {counter.total} ops: {dict(counter.counts)}"
    assert counter.counts["_to_copy"] == 0 and counter.counts["promote_types"] == 0  # no cast, no dtype query
