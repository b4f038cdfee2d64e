import math
import random

import numpy as np
import pytest
import torch

import mjp_fast
from mjp_fast import backend as backend_module
from mjp_fast.sampler import sample_jigsaw_ref
from mjp_fast.sampler.reference import philox_ref
from tests.harness.paper_sampler import block_mask_python


def assert_valid_jigsaw(jigsaw, batch, num_positions, target):
    mask, perm = jigsaw
    assert mask.dtype == torch.bool and perm.dtype == torch.int64
    assert mask.shape == perm.shape == (batch, num_positions)
    positions = torch.arange(num_positions, device=perm.device)
    assert bool((perm[~mask] == positions.expand_as(perm)[~mask]).all())
    for b in range(batch):
        masked = torch.nonzero(mask[b]).flatten()
        assert sorted(perm[b, masked].tolist()) == masked.tolist()
    assert int(mask.sum(1).max()) <= target if batch else True


# -- generator ---------------------------------------------------------------------------------------------------


def test_philox_known_answers():
    # Random123's known-answer vectors for philox4x32-10.
    assert [int(v) for v in philox_ref(0, 0, 0, 0, 0)] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    ones = 0xFFFFFFFF
    expected = [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    assert [int(v) for v in philox_ref(2**64 - 1, ones, ones, ones, ones)] == expected


def test_philox_matches_triton_reference_formula():
    triton_random = pytest.importorskip("triton.language.random")
    assert int(triton_random.N_ROUNDS_DEFAULT.value) == 10  # the round count our definition assumes


# -- invariants --------------------------------------------------------------------------------------------------

PARAMETER_SETS = [
    dict(batch_size=5, grid_size=14, ratio=0.1, seed=0),
    dict(batch_size=3, grid_size=(3, 5), ratio=0.5, seed=7, min_block=2),
    dict(batch_size=4, grid_size=(7, 13), ratio=0.3, seed=2**64 - 1, offset=2**32 + 5),
    dict(batch_size=2, grid_size=(1, 7), ratio=1.0, seed=3, min_block=1),
    dict(batch_size=3, grid_size=1, ratio=1.0, seed=3),
    dict(batch_size=6, grid_size=14, ratio=0.0, seed=1),
    dict(batch_size=6, grid_size=14, ratio=1.0, seed=1),
    dict(batch_size=1, grid_size=(2, 2), ratio=0.75, seed=11, min_block=1),
    dict(batch_size=8, grid_size=14, ratio=0.5, seed=5, prob=0.5),
    dict(batch_size=4, grid_size=(5, 9), ratio=0.4, seed=5, shared=True),
    dict(batch_size=4, grid_size=14, ratio=0.5, seed=9, min_aspect=1.0),
    dict(batch_size=0, grid_size=14, ratio=0.5, seed=9),
]


# The oracle's output for each parameter set, as the digest of csrc/tests/test_sampler.cpp computes it (FNV-1a 64 over
# perm * 2 + mask, sample after sample): a statement of the spec that does not come from the oracle's code, so that
# the oracle cannot drift with the backends that are compared with it. Recorded when the compiled cpu backend (its own
# code, C++) gave the same jigsaws bit for bit; a change of any of these is a change of the sampler's definition.
ORACLE_DIGESTS = [
    0xE087702E2A5295C0,
    0xC4A0934DC7B930A8,
    0x48C6747E5DBE0B13,
    0x9A3A0D1D9D28D38B,
    0xA944454F3A925281,
    0x16D0ECE9726AB5D3,
    0xE873BB0A3C95ED20,
    0x42B4CEA0907DB0FB,
    0xC225BBF1FE60E880,
    0xC7386FF2BD243683,
    0x35B5BFC355E03B51,
    0x14650FB0739D0383,  # batch 0: nothing hashed, the start value
]


def jigsaw_digest(jigsaw) -> int:
    """FNV-1a 64 over ``perm * 2 + mask``, row-major, with csrc/tests/test_sampler.cpp's constants (its start value
    is 1469598103934665603, not FNV's usual 14695981039346656037: the same as the C++ test's, whatever its origin)."""
    digest = 1469598103934665603
    for value in (jigsaw.perm * 2 + jigsaw.mask).flatten().tolist():
        digest = ((digest ^ value) * 1099511628211) % 2**64
    return digest


@pytest.mark.parametrize("params, digest", list(zip(PARAMETER_SETS, ORACLE_DIGESTS, strict=True)))
def test_every_backend_equals_the_oracle(params, digest, backend_device):
    backend, device = backend_device
    got = mjp_fast.sample_jigsaw(**params, device=device, backend=backend)
    rows, cols = (params["grid_size"],) * 2 if isinstance(params["grid_size"], int) else params["grid_size"]
    assert_valid_jigsaw(got, params["batch_size"], rows * cols, math.floor(params["ratio"] * rows * cols))
    if backend == "torch":  # the oracle itself (sample_jigsaw_ref is this call): against the recorded digest
        assert jigsaw_digest(got) == digest, hex(jigsaw_digest(got))
        return
    expected = sample_jigsaw_ref(**params, device=device)
    assert torch.equal(got.mask, expected.mask)
    assert torch.equal(got.perm, expected.perm)


def test_one_by_one_grid_and_ratio_edges():
    # BEiT's rectangles must be smaller than the grid, so a 1x1 grid is never masked.
    jigsaw = mjp_fast.sample_jigsaw(4, 1, 1.0, seed=0)
    assert not jigsaw.mask.any() and jigsaw.perm.eq(0).all()
    empty = mjp_fast.sample_jigsaw(4, 14, 0.0, seed=0)
    assert not empty.mask.any()
    full = mjp_fast.sample_jigsaw(64, 14, 1.0, seed=0)
    assert full.mask.sum(1).float().mean() > 0.5 * 196


@pytest.mark.slow
def test_samples_are_functions_of_seed_and_stream_index(backend_device):
    backend, device = backend_device
    whole = mjp_fast.sample_jigsaw(12, (6, 9), 0.4, seed=42, offset=100, device=device, backend=backend)
    tail = mjp_fast.sample_jigsaw(5, (6, 9), 0.4, seed=42, offset=107, device=device, backend=backend)
    assert torch.equal(whole.mask[7:], tail.mask) and torch.equal(whole.perm[7:], tail.perm)
    other_seed = mjp_fast.sample_jigsaw(12, (6, 9), 0.4, seed=43, offset=100, device=device, backend=backend)
    assert not torch.equal(whole.mask, other_seed.mask)
    # distinct samples get distinct masks
    assert len({tuple(row.tolist()) for row in whole.mask}) > 6


def test_shared_gives_the_jigsaw_of_stream_offset():
    shared = mjp_fast.sample_jigsaw(6, 14, 0.3, seed=1, offset=9, shared=True)
    single = mjp_fast.sample_jigsaw(1, 14, 0.3, seed=1, offset=9)
    assert torch.equal(shared.mask, single.mask.expand(6, -1))
    assert torch.equal(shared.perm, single.perm.expand(6, -1))


def test_prob_jigsaws_that_fraction_of_samples():
    jigsaw = mjp_fast.sample_jigsaw(4000, 8, 0.5, seed=3, prob=0.3)
    fraction = jigsaw.mask.any(1).float().mean().item()
    assert abs(fraction - 0.3) < 0.03  # 4000 Bernoulli(0.3): standard deviation 0.007
    assert not mjp_fast.sample_jigsaw(50, 8, 0.5, seed=3, prob=0.0).mask.any()
    assert mjp_fast.sample_jigsaw(50, 8, 0.5, seed=3, prob=1.0).mask.any(1).all()


# -- distribution: the same as the paper code's Python loop -----------------------------------------------------


def _neighbour_fraction(masks: np.ndarray) -> float:
    """Mean, over masked cells, of the share of their in-grid 4-neighbours that are masked.

    About the ratio for independently masked cells; much higher for blocks.
    """
    padded = np.pad(masks, ((0, 0), (1, 1), (1, 1))).astype(np.int32)
    inside = np.pad(np.ones_like(masks), ((0, 0), (1, 1), (1, 1))).astype(np.int32)

    def around(a):
        return a[:, :-2, 1:-1] + a[:, 2:, 1:-1] + a[:, 1:-1, :-2] + a[:, 1:-1, 2:]

    share = around(padded) / np.maximum(around(inside), 1)
    return float(share[masks].mean()) if masks.any() else 0.0


@pytest.mark.parametrize("ratio", [0.03, 0.1, 0.27, 0.5])
def test_mask_statistics_match_the_python_loop(ratio):
    samples = 3000
    ours = mjp_fast.sample_jigsaw(samples, 14, ratio, seed=123).mask.view(samples, 14, 14).numpy()
    rng = random.Random(321)
    theirs = np.stack([block_mask_python(14, ratio, rng=rng) for _ in range(samples)])
    our_counts, their_counts = ours.sum((1, 2)), theirs.sum((1, 2))
    spread = math.sqrt(our_counts.var() / samples + their_counts.var() / samples) + 1e-9
    assert abs(our_counts.mean() - their_counts.mean()) < 5 * spread
    assert abs(our_counts.std() - their_counts.std()) < 0.15 * their_counts.std() + 0.05
    assert abs(_neighbour_fraction(ours) - _neighbour_fraction(theirs)) < 0.03
    # and both are far more clustered than independent masking at the same count
    flat = np.zeros((samples, 196), dtype=bool)
    rng_np = np.random.default_rng(0)
    for row, count in zip(flat, our_counts):
        row[rng_np.choice(196, size=count, replace=False)] = True
    assert _neighbour_fraction(ours) > _neighbour_fraction(flat.reshape(samples, 14, 14)) + 0.2


def test_paper_ratio_003_ends_short_of_target_as_beit_does():
    counts = mjp_fast.sample_jigsaw(4000, 14, 0.03, seed=0).mask.sum(1).float()
    # target 5 cells; BEiT's loop averages about 3.9 (docs/design.md section 1)
    assert 3.5 < counts.mean().item() < 4.3


def test_permutation_is_uniform():
    jigsaw = mjp_fast.sample_jigsaw(6000, 6, 0.5, seed=17)
    orders = {}
    fixed_points = []
    for mask, perm in zip(jigsaw.mask, jigsaw.perm):
        masked = torch.nonzero(mask).flatten()
        if masked.numel() < 3:
            continue
        fixed_points.append(int((perm[masked] == masked).sum()))
        first_three = perm[masked[:3]].tolist()
        order = tuple(sorted(range(3), key=first_three.__getitem__))
        orders[order] = orders.get(order, 0) + 1
    total = sum(orders.values())
    assert len(orders) == 6
    chi_square = sum((count - total / 6) ** 2 / (total / 6) for count in orders.values())
    assert chi_square < 25.7  # 99.99th percentile of chi-square with 5 degrees of freedom
    # a uniform permutation has one fixed point on average
    mean_fixed = float(np.mean(fixed_points))
    assert abs(mean_fixed - 1.0) < 0.1


# -- bad input ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(ratio=-0.1), ValueError, "ratio"),
        (dict(ratio=1.5), ValueError, "ratio"),
        (dict(ratio=float("nan")), ValueError, "ratio"),
        (dict(ratio="0.1"), TypeError, "ratio"),
        (dict(prob=1.2), ValueError, "prob"),
        (dict(batch_size=-1), ValueError, "batch_size"),
        (dict(batch_size=2.0), TypeError, "batch_size"),
        (dict(batch_size=True), TypeError, "batch_size"),
        (dict(grid_size=0), ValueError, "grid_size"),
        (dict(grid_size=(3, 0)), ValueError, "grid_size"),
        (dict(grid_size=(3, 4, 5)), ValueError, "grid_size"),
        (dict(seed=-1), ValueError, "seed"),
        (dict(seed=2**64), ValueError, "seed"),
        (dict(offset=-3), ValueError, "offset"),
        (dict(min_block=0), ValueError, "min_block"),
        (dict(min_aspect=0.0), ValueError, "min_aspect"),
        (dict(shared=1), TypeError, "shared"),
        (dict(backend="bogus"), ValueError, "backend"),
        (dict(device="nonsense"), ValueError, "device"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, words):
    arguments = dict(batch_size=2, grid_size=14, ratio=0.1, seed=0)
    arguments.update(kwargs)
    with pytest.raises(error, match=words):
        mjp_fast.sample_jigsaw(**arguments)


@pytest.mark.parametrize("device", ["cpu:0", torch.device("cpu", 0), "cpu"], ids=repr)
def test_an_offset_tensor_on_the_cpu_is_on_cpu_0(device):
    """Issue 42 item 9: ``cpu:0`` is the CPU, where ``torch.tensor(3)`` lives (it said the offset was not there)."""
    for backend in [
        name for name in mjp_fast.available_backends() if backend_module.runs_on(name, torch.device("cpu"))
    ]:
        jigsaw = mjp_fast.sample_jigsaw(4, 6, 0.5, seed=1, offset=torch.tensor(3), device=device, backend=backend)
        expected = mjp_fast.sample_jigsaw(4, 6, 0.5, seed=1, offset=3, backend=backend)
        assert jigsaw.perm.device == torch.device("cpu") and jigsaw.mask.device == torch.device("cpu")
        assert torch.equal(jigsaw.perm, expected.perm) and torch.equal(jigsaw.mask, expected.mask)
    sampler = mjp_fast.JigsawSampler(6, 0.5, prob=1.0, seed=1)
    assert sampler(2, device).perm.device == torch.device("cpu")


def test_an_offset_on_another_device_is_still_refused():
    with pytest.raises(ValueError, match="offset is on cpu but the jigsaw is made on meta"):
        mjp_fast.sample_jigsaw(2, 6, 0.5, seed=1, offset=torch.tensor(3), device="meta")


def test_backend_that_cannot_run_here_is_refused():
    # On CPU tensors (the default device) the cuda backend is refused on every machine, for the reason that holds
    # there: without a GPU or a CUDA build it is not available; with them it cannot run on CPU tensors.
    if "cuda" in mjp_fast.available_backends():
        reason = "cannot run on tensors on device cpu"
    else:
        reason = "is not available on this machine"
    with pytest.raises(ValueError, match=f"backend='cuda' {reason}"):
        mjp_fast.sample_jigsaw(2, 14, 0.1, seed=0, backend="cuda")
    if torch.cuda.is_available() and "cpu" in mjp_fast.available_backends():
        with pytest.raises(ValueError, match="backend='cpu' cannot run on tensors on device cuda"):
            mjp_fast.sample_jigsaw(2, 14, 0.1, seed=0, backend="cpu", device="cuda")


def test_environment_variable_chooses_the_backend(monkeypatch):
    if "cpu" not in mjp_fast.available_backends():
        pytest.skip("needs the compiled extension")

    class UnusableExtension:
        def __getattr__(self, name):
            raise RuntimeError(f"the extension was used ({name})")

    # Every backend gives the same jigsaw, so the route is seen through the extension: MJP_FAST_BACKEND=torch must
    # not touch it, MJP_FAST_BACKEND=cpu must.
    monkeypatch.setattr(backend_module, "extension", UnusableExtension)
    monkeypatch.setenv("MJP_FAST_BACKEND", "torch")
    jigsaw = mjp_fast.sample_jigsaw(2, 4, 0.5, seed=0, min_block=1)
    expected = sample_jigsaw_ref(2, 4, 0.5, seed=0, min_block=1)
    assert torch.equal(jigsaw.mask, expected.mask) and torch.equal(jigsaw.perm, expected.perm)
    monkeypatch.setenv("MJP_FAST_BACKEND", "cpu")
    with pytest.raises(RuntimeError, match="the extension was used"):
        mjp_fast.sample_jigsaw(2, 4, 0.5, seed=0, min_block=1)
    monkeypatch.setenv("MJP_FAST_BACKEND", "fastest-please")
    with pytest.raises(ValueError, match="MJP_FAST_BACKEND"):
        mjp_fast.sample_jigsaw(2, 4, 0.5, seed=0)
