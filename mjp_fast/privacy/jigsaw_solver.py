"""A jigsaw solver: puts candidate patches into the holes of a partly known patch grid by edge compatibility.

The attacker's situation after a gradient attack on MJP: the image's patch grid ``[N, C, P, P]`` is known at some
positions (the visible ones), and a set of candidate patches must go into the remaining positions (the holes),
in an unknown order. Each hole is scored against each candidate by the squared differences between the
candidate's border pixels and the facing border pixels of the hole's known neighbours (up, down, left, right),
and the candidates are assigned to holes by an optimal assignment on that cost (``scipy.optimize
.linear_sum_assignment``; a greedy assignment when scipy is missing).

A hole with no known neighbour has no evidence, so the holes are filled in layers: first the holes with at least
one known neighbour (one optimal assignment over them and all remaining candidates), then those that now have a
placed neighbour, and so on (a block of masked positions is solved from its border inwards).

:func:`suspect_positions` finds where patches were probably moved when nothing says which (the ablation without
UNK, where the attack recovers the shuffled image exactly but no gradient marks the shuffled positions): the
positions whose borders agree least with their neighbours'.

Positions are row-major, ``n = row * cols + col``; patches ``[C, P, P]`` as in :func:`image_patches`.
"""

from __future__ import annotations

import torch

# (row step, col step, this patch's edge, the neighbour's facing edge): edges as (dim, index) of a [C, P, P] patch
_NEIGHBOURS = (
    (-1, 0, (1, 0), (1, -1)),  # up: my top row against its bottom row
    (1, 0, (1, -1), (1, 0)),  # down
    (0, -1, (2, 0), (2, -1)),  # left: my left column against its right column
    (0, 1, (2, -1), (2, 0)),  # right
)


def image_patches(image: torch.Tensor, patch_size: int) -> torch.Tensor:
    """``[C, H, W]`` -> ``[N, C, P, P]``, row-major positions."""
    if image.dim() != 3:
        raise ValueError(f"image must be [C, H, W], got {list(image.shape)}")
    channels, height, width = image.shape
    if patch_size < 1 or height % patch_size or width % patch_size:
        raise ValueError(f"patch_size must divide the image's sides {height}x{width}, got {patch_size}")
    rows, cols = height // patch_size, width // patch_size
    patches = image.reshape(channels, rows, patch_size, cols, patch_size).permute(1, 3, 0, 2, 4)
    return patches.reshape(rows * cols, channels, patch_size, patch_size)


def patches_image(patches: torch.Tensor, grid_size: tuple[int, int]) -> torch.Tensor:
    """``[N, C, P, P]`` -> ``[C, rows * P, cols * P]`` (the inverse of :func:`image_patches`)."""
    rows, cols = grid_size
    if patches.dim() != 4 or patches.shape[0] != rows * cols:
        raise ValueError(f"patches must be [rows * cols = {rows * cols}, C, P, P], got {list(patches.shape)}")
    _, channels, patch, _ = patches.shape
    image = patches.reshape(rows, cols, channels, patch, patch).permute(2, 0, 3, 1, 4)
    return image.reshape(channels, rows * patch, cols * patch)


def _edge(patches: torch.Tensor, where: tuple[int, int]) -> torch.Tensor:
    dim, index = where
    return patches.select(dim + 1, index if index >= 0 else patches.shape[dim + 1] + index)  # [..., C, P]


def edge_costs(
    patches: torch.Tensor,
    known: torch.Tensor,
    holes: torch.Tensor,
    candidates: torch.Tensor,
    grid_size: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cost of putting each candidate into each hole: summed squared edge differences with known neighbours.

    Args:
        patches: the grid ``[N, C, P, P]``; only the entries where ``known`` is True are read.
        known: bool ``[N]``.
        holes: int64 ``[H]``, positions to fill.
        candidates: ``[M, C, P, P]``.
        grid_size: ``(rows, cols)``.

    Returns:
        ``cost [H, M]`` (float64) and ``evidence [H]`` (int64): how many known neighbours each hole has.
    """
    rows, cols = grid_size
    cost = torch.zeros(holes.numel(), candidates.shape[0], dtype=torch.float64)
    evidence = torch.zeros(holes.numel(), dtype=torch.int64)
    row, col = holes // cols, holes % cols
    candidates = candidates.double()
    for d_row, d_col, mine, theirs in _NEIGHBOURS:
        n_row, n_col = row + d_row, col + d_col
        inside = (n_row >= 0) & (n_row < rows) & (n_col >= 0) & (n_col < cols)
        neighbour = (n_row * cols + n_col).clamp(0, rows * cols - 1)
        usable = inside & known[neighbour]
        if not bool(usable.any()):
            continue
        facing = _edge(patches[neighbour[usable]].double(), theirs).flatten(1)  # [h, C*P]
        edges = _edge(candidates, mine).flatten(1)  # [M, C*P]
        cost[usable] += torch.cdist(facing, edges).square()
        evidence += usable.long()
    return cost, evidence


def assign(cost: torch.Tensor) -> torch.Tensor:
    """The minimum-cost assignment of rows to distinct columns (``rows <= columns``): the column of each row.

    ``scipy.optimize.linear_sum_assignment`` (optimal); without scipy, a greedy assignment (cheapest pair first).
    """
    if cost.dim() != 2 or cost.shape[0] > cost.shape[1]:
        raise ValueError(f"cost must be [rows, columns] with rows <= columns, got {list(cost.shape)}")
    try:
        from scipy.optimize import linear_sum_assignment
    except ImportError:  # pragma: no cover - scipy is a dependency of the privacy extra
        return _greedy_assign(cost)
    row_index, col_index = linear_sum_assignment(cost.detach().cpu().numpy())
    columns = torch.empty(cost.shape[0], dtype=torch.int64)
    columns[torch.from_numpy(row_index)] = torch.from_numpy(col_index).long()
    return columns


def _greedy_assign(cost: torch.Tensor) -> torch.Tensor:
    order = torch.argsort(cost.flatten())
    columns = torch.full((cost.shape[0],), -1, dtype=torch.int64)
    used = torch.zeros(cost.shape[1], dtype=torch.bool)
    for flat in order.tolist():
        r, c = divmod(flat, cost.shape[1])
        if columns[r] < 0 and not used[c]:
            columns[r], used[c] = c, True
    return columns


def place_patches(
    patches: torch.Tensor,
    known: torch.Tensor,
    candidates: torch.Tensor,
    grid_size: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fills every unknown position of the grid with a distinct candidate, in layers from the known border inwards.

    Args:
        patches: ``[N, C, P, P]``; the entries where ``known`` is False are ignored.
        known: bool ``[N]``.
        candidates: ``[M, C, P, P]`` with ``M >= number of holes`` (extra candidates are left over).
        grid_size: ``(rows, cols)``.

    Returns:
        The filled grid ``[N, C, P, P]`` and ``chosen [N]`` (int64): the candidate placed at each position, -1 where
        the position was known.
    """
    if patches.dim() != 4 or candidates.dim() != 4 or patches.shape[1:] != candidates.shape[1:]:
        raise ValueError(
            f"patches and candidates must be [N, C, P, P] and [M, C, P, P], got {list(patches.shape)} and "
            f"{list(candidates.shape)}"
        )
    if known.shape != (patches.shape[0],) or known.dtype != torch.bool:
        raise ValueError(f"known must be bool [N] = [{patches.shape[0]}], got {known.dtype} {list(known.shape)}")
    holes_left = torch.nonzero(~known).flatten()
    if holes_left.numel() > candidates.shape[0]:
        raise ValueError(f"candidates: {candidates.shape[0]} for {holes_left.numel()} holes; need at least one each")
    filled = patches.clone()
    known = known.clone()
    chosen = torch.full((patches.shape[0],), -1, dtype=torch.int64)
    free = torch.ones(candidates.shape[0], dtype=torch.bool)
    while holes_left.numel():
        remaining = torch.nonzero(free).flatten()
        cost, evidence = edge_costs(filled, known, holes_left, candidates[remaining], grid_size)
        layer = evidence > 0
        if not bool(layer.any()):
            layer = torch.ones_like(layer)  # nothing known around any hole: no evidence, any order will do
        columns = assign(cost[layer])
        positions, picks = holes_left[layer], remaining[columns]
        filled[positions] = candidates[picks].to(filled.dtype)
        chosen[positions] = picks
        known[positions] = True
        free[picks] = False
        holes_left = holes_left[~layer]
    return filled, chosen


def edge_energy(patches: torch.Tensor, grid_size: tuple[int, int]) -> float:
    """The sum over all adjacent pairs of the squared differences between facing edges (``patches [N, C, P, P]``)."""
    rows, cols = grid_size
    grid = patches.double().reshape(rows, cols, *patches.shape[1:])  # [rows, cols, C, P, P]
    across = grid[:, 1:, :, :, 0] - grid[:, :-1, :, :, -1]  # left column vs the left neighbour's right column
    down = grid[1:, :, :, 0, :] - grid[:-1, :, :, -1, :]
    return float(across.square().sum() + down.square().sum())


def suspect_positions(patches: torch.Tensor, grid_size: tuple[int, int], count: int) -> torch.Tensor:
    """The ``count`` positions whose borders agree least with their neighbours' (int64 ``[count]``, sorted).

    Score of a position: the mean over its neighbours of the squared difference between facing edges. A patch
    moved to a wrong place disagrees with every neighbour; its new neighbours each disagree with it on one side
    only, so the moved patch scores highest.
    """
    rows, cols = grid_size
    if not 0 <= count <= rows * cols:
        raise ValueError(f"count must be in [0, {rows * cols}], got {count}")
    total = torch.zeros(rows * cols, dtype=torch.float64)
    sides = torch.zeros(rows * cols, dtype=torch.float64)
    positions = torch.arange(rows * cols)
    row, col = positions // cols, positions % cols
    for d_row, d_col, mine, theirs in _NEIGHBOURS:
        n_row, n_col = row + d_row, col + d_col
        inside = (n_row >= 0) & (n_row < rows) & (n_col >= 0) & (n_col < cols)
        neighbour = (n_row * cols + n_col)[inside]
        difference = _edge(patches[inside].double(), mine) - _edge(patches[neighbour].double(), theirs)
        total[inside] += difference.square().flatten(1).sum(1)
        sides[inside] += 1
    score = total / sides
    return torch.sort(torch.topk(score, count).indices).values
