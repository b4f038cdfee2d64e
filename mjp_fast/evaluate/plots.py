"""PNG plots of what a model learned: its position embeddings and its last-layer attention.

- ``position_pca_2d.png`` / ``position_pca_3d.png``: the patch position embeddings projected on their first two /
  three principal components, each point colored by its row and labelled by its column (the paper's Figure 2 uses
  UMAP; ``position_umap.png`` is written too when umap-learn is installed).
- ``position_similarity.png``: for each patch position, the cosine similarity of its embedding with every other
  one, drawn as a small grid at that position (ViT paper, Figure 7); its title is sized to the figure, so that it
  stays legible shrunk (:func:`position_similarity_figure`).
- ``attention.png``: for a few images, the last block's attention from the class token to every patch, one panel
  per head (supplementary Figure 3).
- ``imagenet_c_severity.png`` / ``cifar10_c_severity.png``: top-1 error against severity, one panel per corruption
  family, one line per corruption, the baseline's dashed beside the model's (:func:`plot_corruption_severity`).

matplotlib draws off-screen (the Agg backend); nothing here opens a window.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _principal_components(embeddings: np.ndarray, count: int) -> np.ndarray:
    centered = embeddings - embeddings.mean(axis=0, keepdims=True)
    _, _, right = np.linalg.svd(centered, full_matrices=False)
    projection = centered @ right[:count].T
    if projection.shape[1] < count:
        projection = np.pad(projection, ((0, 0), (0, count - projection.shape[1])))
    return projection


SIMILARITY_DPI = 100
# The similarity plot's title, in points per inch of the figure's width: a grid of 14x14 small plots is 14 inches
# wide and is mostly seen shrunk (the report's panels are 400 px wide: about a quarter of its 1,400), so a title of
# a fixed 12 points would shrink to 3 pixels; 2.2 points per inch keeps it about 12 pixels tall there.
SIMILARITY_TITLE_POINTS_PER_INCH = 2.2
SIMILARITY_TITLE_MIN_POINTS = 12.0


def position_similarity_figure(embeddings: np.ndarray, grid: tuple[int, int], *, title: str = ""):
    """The matplotlib figure of ``position_similarity.png``: for each position of ``grid`` ``(rows, cols)``, the
    cosine similarity of its embedding (a row of ``embeddings`` ``[rows*cols, D]``) with every position's, drawn as
    a small ``rows x cols`` image at that position; ``title`` (e.g. the run's name) heads it, on its own line. The
    caller saves and closes it."""
    plt = _pyplot()
    rows, cols = grid
    normalized = embeddings / np.maximum(np.linalg.norm(embeddings, axis=1, keepdims=True), 1e-12)
    similarity = (normalized @ normalized.T).reshape(rows, cols, rows, cols)
    width, height = min(1.0 * cols, 14), min(1.0 * rows, 14)
    figure, axes = plt.subplots(rows, cols, figsize=(width, height), squeeze=False)
    for r in range(rows):
        for c in range(cols):
            axes[r][c].imshow(similarity[r, c], vmin=-1, vmax=1, cmap="viridis")
            axes[r][c].set_xticks([])
            axes[r][c].set_yticks([])
    text = "cosine similarity of position embeddings"
    text = f"{title.strip()}\n{text}" if title.strip() else text
    size = max(SIMILARITY_TITLE_MIN_POINTS, SIMILARITY_TITLE_POINTS_PER_INCH * width)
    figure.suptitle(text, fontsize=size)
    return figure


def plot_position_embeddings(
    embeddings: np.ndarray, grid: tuple[int, int], out_dir: str | Path, *, title: str = ""
) -> list[Path]:
    """Writes the PCA (2D, 3D), similarity and (with umap-learn) UMAP plots of ``embeddings`` ``[rows*cols, D]``.

    Returns the paths written.
    """
    plt = _pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, cols = grid
    index = np.arange(rows * cols)
    row, col = index // cols, index % cols
    written = []
    label_points = rows * cols <= 256

    projection = _principal_components(embeddings, 3)
    figure, axis = plt.subplots(figsize=(6, 5.5))
    points = axis.scatter(projection[:, 0], projection[:, 1], c=row, cmap="viridis", s=28)
    if label_points:
        for n in index:
            axis.annotate(str(col[n]), projection[n, :2], fontsize=6, ha="center", va="center", color="white")
    figure.colorbar(points, ax=axis, label="row")
    axis.set_xlabel("PC 1")
    axis.set_ylabel("PC 2")
    axis.set_title(f"{title} position embeddings, PCA (color: row, label: column)".strip())
    written.append(out_dir / "position_pca_2d.png")
    figure.savefig(written[-1], dpi=120, bbox_inches="tight")
    plt.close(figure)

    figure = plt.figure(figsize=(6.5, 5.5))
    axis = figure.add_subplot(projection="3d")
    points = axis.scatter(projection[:, 0], projection[:, 1], projection[:, 2], c=row, cmap="viridis", s=20)
    axis.set_xlabel("PC 1")
    axis.set_ylabel("PC 2")
    axis.set_zlabel("PC 3")
    figure.colorbar(points, ax=axis, label="row", shrink=0.7)
    axis.set_title(f"{title} position embeddings, PCA 3D".strip())
    written.append(out_dir / "position_pca_3d.png")
    figure.savefig(written[-1], dpi=120, bbox_inches="tight")
    plt.close(figure)

    figure = position_similarity_figure(embeddings, grid, title=title)
    written.append(out_dir / "position_similarity.png")
    figure.savefig(written[-1], dpi=SIMILARITY_DPI, bbox_inches="tight")
    plt.close(figure)

    try:
        import umap
    except ImportError:
        return written
    neighbors = max(2, min(15, rows * cols - 1))
    reduced = umap.UMAP(n_neighbors=neighbors, random_state=0).fit_transform(embeddings)
    figure, axis = plt.subplots(figsize=(6, 5.5))
    points = axis.scatter(reduced[:, 0], reduced[:, 1], c=row, cmap="viridis", s=28)
    figure.colorbar(points, ax=axis, label="row")
    axis.set_title(f"{title} position embeddings, UMAP".strip())
    written.append(out_dir / "position_umap.png")
    figure.savefig(written[-1], dpi=120, bbox_inches="tight")
    plt.close(figure)
    return written


@torch.no_grad()
def last_layer_attention(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The last block's attention probabilities ``[B, heads, T, T]`` (T tokens, prefix tokens first) of a timm
    ViT on normalized ``images``. The block runs its unfused path for this one forward, so the probabilities exist.
    """
    blocks = getattr(model, "blocks", None)
    if blocks is None or len(blocks) == 0 or not hasattr(blocks[-1], "attn"):
        raise ValueError(f"{type(model).__name__} has no transformer blocks with attention to plot")
    attention = blocks[-1].attn
    if not hasattr(attention, "attn_drop") or not hasattr(attention, "fused_attn"):
        raise ValueError(f"{type(attention).__name__} does not expose its attention probabilities")
    captured: list[torch.Tensor] = []
    handle = attention.attn_drop.register_forward_hook(lambda module, inputs, output: captured.append(output))
    fused = attention.fused_attn
    attention.fused_attn = False
    was_training = model.training
    model.eval()
    try:
        model.forward_features(images)
    finally:
        attention.fused_attn = fused
        handle.remove()
        model.train(was_training)
    if not captured:
        raise ValueError("the last block's attention did not run its unfused path")
    return captured[-1].float()


def plot_attention_maps(
    model: nn.Module, images: torch.Tensor, pictures: torch.Tensor, out_path: str | Path, *, title: str = ""
) -> Path:
    """Writes one row per image: the picture, then the class token's attention to the patches for each head.

    Args:
        images: normalized model input ``[B, 3, H, W]``. pictures: the same images for display, ``[B, 3, H, W]``
            in [0, 1].
    """
    plt = _pyplot()
    probabilities = last_layer_attention(model, images)  # [B, heads, T, T]
    rows, cols = (int(size) for size in model.patch_embed.grid_size)
    prefix = int(getattr(model, "num_prefix_tokens", 1))
    # the class token's row (or, without one, the mean over tokens) to the patch tokens
    query = probabilities[:, :, 0] if prefix > 0 else probabilities.mean(dim=2)
    maps = query[:, :, prefix:].reshape(query.shape[0], query.shape[1], rows, cols).cpu().numpy()
    batch, heads = maps.shape[:2]
    figure, axes = plt.subplots(batch, heads + 1, figsize=(1.6 * (heads + 1), 1.6 * batch), squeeze=False)
    for b in range(batch):
        axes[b][0].imshow(pictures[b].permute(1, 2, 0).clamp(0, 1).cpu().numpy())
        for h in range(heads):
            axes[b][h + 1].imshow(maps[b, h], cmap="inferno")
            if b == 0:
                axes[b][h + 1].set_title(f"head {h + 1}", fontsize=8)
        for axis in axes[b]:
            axis.set_xticks([])
            axis.set_yticks([])
    figure.suptitle(f"{title} last-layer attention of the class token".strip(), fontsize=9)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out_path, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return out_path


def corruption_severity_figure(table: dict, *, title: str = "", labels: tuple[str, str] = ("model", "baseline")):
    """The matplotlib figure of :func:`plot_corruption_severity`: one panel per family of ``table`` (in its order),
    each corruption's top-1 error (%) at severities 1..5 as a solid line, the baseline's (when the table has one)
    as a dashed line of the same color. The caller saves and closes it.

    Args:
        table: :func:`mjp_fast.evaluate.common_corruptions.corruption_table`'s dict (``families``, ``error``,
            ``severities``, optional ``baseline``).
        labels: how the title names the model and the baseline.
    """
    plt = _pyplot()
    families = table["families"]
    severities = table["severities"]
    baseline = (table.get("baseline") or {}).get("error")
    figure, axes = plt.subplots(1, len(families), figsize=(3.6 * len(families), 3.4), squeeze=False, sharey=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for axis, (family, names) in zip(axes[0], families.items(), strict=True):
        for number, name in enumerate(names):
            color = colors[number % len(colors)]
            axis.plot(severities, table["error"][name], marker="o", color=color, label=name.replace("_", " "))
            if baseline is not None:
                axis.plot(severities, baseline[name], marker="x", linestyle="--", color=color)
        axis.set_title(family)
        axis.set_xticks(severities)
        axis.set_xlabel("severity")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7, loc="lower right")
    axes[0][0].set_ylabel("top-1 error (%)")
    style = f"solid: {labels[0]}" + (f", dashed: {labels[1]}" if baseline is not None else "")
    figure.suptitle(f"{title} error against severity ({style})".strip(), fontsize=10)
    figure.tight_layout()
    return figure


def plot_corruption_severity(
    table: dict, out_path: str | Path, *, title: str = "", labels: tuple[str, str] = ("model", "baseline")
) -> Path:
    """Writes the error against severity of a stored-corruption table (ImageNet-C, CIFAR-10-C) as a PNG: one panel
    per corruption family, the baseline beside the model (:func:`corruption_severity_figure`)."""
    plt = _pyplot()
    figure = corruption_severity_figure(table, title=title, labels=labels)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out_path, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return out_path
