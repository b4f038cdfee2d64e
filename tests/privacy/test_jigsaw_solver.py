"""The jigsaw solver: edge costs, the assignment, placing shuffled patches back, finding moved patches."""

import itertools
import math

import pytest
import torch

from mjp_fast.privacy.jigsaw_solver import (
    _greedy_assign,
    assign,
    edge_costs,
    edge_energy,
    image_patches,
    patches_image,
    place_patches,
    suspect_positions,
)


def smooth_image(channels: int = 3, size: int = 24, seed: int = 0) -> torch.Tensor:
    """Low-frequency sinusoids: smooth within and across patches, and no two patches alike."""
    generator = torch.Generator().manual_seed(seed)
    axis = torch.linspace(0, 1, size, dtype=torch.float64)
    rows, cols = torch.meshgrid(axis, axis, indexing="ij")
    image = torch.zeros(channels, size, size, dtype=torch.float64)
    for channel in range(channels):
        for _ in range(3):
            fy, fx, phase = torch.rand(3, generator=generator, dtype=torch.float64) * torch.tensor([2.5, 2.5, 6.3])
            image[channel] += torch.sin(2 * math.pi * (fy * rows + fx * cols) + phase)
    return (image - image.min()) / (image.max() - image.min())


def test_patches_round_trip():
    image = smooth_image(size=12)
    patches = image_patches(image, 4)
    assert patches.shape == (9, 3, 4, 4)
    torch.testing.assert_close(patches[5], image[:, 4:8, 8:12])  # position 5 = row 1, col 2
    torch.testing.assert_close(patches_image(patches, (3, 3)), image)


@pytest.mark.parametrize("patch", [2, 4])
def test_places_shuffled_known_patches(patch):
    image = smooth_image(size=24)
    grid = (24 // patch, 24 // patch)
    truth = image_patches(image, patch)
    count = truth.shape[0]
    cols = grid[1]
    # scattered holes, a 2x2 block, and a hole on the border
    holes = torch.tensor([cols + 1, 2 * cols + 4, 3 * cols + 3, 3 * cols + 4, 4 * cols + 3, 4 * cols + 4, cols - 1])
    known = torch.ones(count, dtype=torch.bool)
    known[holes] = False
    order = torch.randperm(holes.numel(), generator=torch.Generator().manual_seed(1))
    candidates = truth[holes[order]]
    garbage = truth.clone()
    garbage[holes] = 0.5  # what sits in the holes must not matter
    filled, chosen = place_patches(garbage, known, candidates, grid)
    torch.testing.assert_close(filled, truth, rtol=0, atol=0)
    assert torch.equal(holes[order][chosen[holes]], holes)
    assert bool((chosen[known] == -1).all())


def test_places_a_block_with_no_known_neighbour_inside():
    # a 4x4 block of holes: its inner 2x2 has no known neighbour until the ring around it is placed
    image = smooth_image(size=24, seed=3)
    truth = image_patches(image, 4)
    block = torch.tensor([r * 6 + c for r in range(1, 5) for c in range(1, 5)])
    known = torch.ones(36, dtype=torch.bool)
    known[block] = False
    candidates = truth[block.flip(0)]
    filled, _ = place_patches(truth, known, candidates, (6, 6))
    # the ring is placed from the known border, the inner 2x2 from the placed ring
    assert float((filled - truth).abs().max()) == 0


def test_edge_costs_count_known_neighbours_and_are_zero_for_the_truth():
    image = smooth_image(size=12)
    truth = image_patches(image, 4)
    known = torch.ones(9, dtype=torch.bool)
    known[[4, 5]] = False
    cost, evidence = edge_costs(truth, known, torch.tensor([4, 5]), truth[[4, 5]], (3, 3))
    assert evidence.tolist() == [3, 2]  # the centre sees up, down, left; the right-middle sees up and down
    assert float(cost[0, 0]) > 0  # a smooth image still changes across an edge
    assert float(cost[0, 0]) < float(cost[0, 1]) and float(cost[1, 1]) < float(cost[1, 0])


def test_assign_is_optimal_and_greedy_is_a_valid_assignment():
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        cost = torch.rand(3, 5, generator=generator, dtype=torch.float64)
        best = min(
            sum(float(cost[r, c]) for r, c in enumerate(columns)) for columns in itertools.permutations(range(5), 3)
        )
        columns = assign(cost)
        assert len(set(columns.tolist())) == 3
        assert math.isclose(float(cost[torch.arange(3), columns].sum()), best, rel_tol=1e-12)
        greedy = _greedy_assign(cost)
        assert len(set(greedy.tolist())) == 3 and bool((greedy >= 0).all())
    diagonal = torch.eye(4, dtype=torch.float64) * -1 + 1
    assert _greedy_assign(diagonal).tolist() == [0, 1, 2, 3]


def test_suspect_positions_finds_swapped_patches():
    image = smooth_image(size=24, seed=5)
    patches = image_patches(image, 4)
    swapped = patches.clone()
    swapped[[7, 28]] = patches[[28, 7]]
    assert suspect_positions(swapped, (6, 6), 2).tolist() == [7, 28]


def test_edge_energy_is_lowest_for_the_true_arrangement():
    image = smooth_image(size=12, seed=2)
    patches = image_patches(image, 4)
    across = (image[:, :, 4::4] - image[:, :, 3:-1:4]).square().sum()
    down = (image[:, 4::4, :] - image[:, 3:-1:4, :]).square().sum()
    assert edge_energy(patches, (3, 3)) == pytest.approx(float(across + down), rel=1e-12)
    swapped = patches.clone()
    swapped[[0, 8]] = patches[[8, 0]]
    assert edge_energy(swapped, (3, 3)) > edge_energy(patches, (3, 3))


def test_errors_name_the_argument():
    truth = image_patches(smooth_image(size=12), 4)
    with pytest.raises(ValueError, match="candidates"):
        place_patches(truth, torch.zeros(9, dtype=torch.bool), truth[:3], (3, 3))
    with pytest.raises(ValueError, match="known"):
        place_patches(truth, torch.zeros(8, dtype=torch.bool), truth, (3, 3))
    with pytest.raises(ValueError, match="cost"):
        assign(torch.zeros(3, 2))
    with pytest.raises(ValueError, match="patch_size"):
        image_patches(torch.zeros(3, 10, 10), 4)
    with pytest.raises(ValueError, match="count"):
        suspect_positions(truth, (3, 3), 10)
