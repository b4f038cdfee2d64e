"""``DALRegressor``: the position regressor of the DAL loss, and :func:`fused_layers`, what the fused DAL kernels
read of it.

It sits below both the DAL operation (:mod:`mjp_fast.ops.dal_loss`, which asks :func:`fused_layers` whether its
kernels compute a regressor) and the modules that own one (:mod:`mjp_fast.core`), so neither calls up into the other.
"""

from __future__ import annotations

import torch
from torch import nn

from mjp_fast._validate import check_int

DAL_KINDS = ("nonlinear", "linear", "pca")

# (w1 [H, D], b1 [H], w2 [2, H], b2 [2]) of the nonlinear regressor, (None, None, w2 [2, D], b2 [2]) of the linear one.
FusedLayers = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor | None]


class DALRegressor(nn.Module):
    """Maps position embeddings ``[N, D]`` to grid coordinates ``[N, 2]`` for the DAL loss.

    Args:
        dim: D.
        kind: ``"nonlinear"`` (Linear-ReLU-Linear, the paper's best), ``"linear"``, or ``"pca"``: the
            embeddings' projection on their two principal directions (recomputed, differentiably, at every call;
            signs fixed so that position 0 projects to a coordinate <= 0) followed by a learned 2x2 affine map.
        hidden_dim: width of the nonlinear regressor's hidden layer (default ``dim``). The other kinds have no
            hidden layer: giving it for them is a ValueError.
    """

    def __init__(self, dim: int, kind: str = "nonlinear", hidden_dim: int | None = None) -> None:
        super().__init__()
        dim = check_int("dim", dim, minimum=1)
        if kind not in DAL_KINDS:
            raise ValueError(f"kind must be one of {', '.join(DAL_KINDS)}, got {kind!r}")
        if hidden_dim is not None and kind != "nonlinear":
            raise ValueError(
                f"hidden_dim: the {kind!r} regressor has no hidden layer; pass hidden_dim only with kind='nonlinear', "
                f"got hidden_dim={hidden_dim!r}"
            )
        self.dim, self.kind = dim, kind
        if kind == "nonlinear":
            hidden_dim = check_int("hidden_dim", hidden_dim if hidden_dim is not None else dim, minimum=1)
            self.net = nn.Sequential(nn.Linear(dim, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 2))
        elif kind == "linear":
            self.net = nn.Linear(dim, 2)
        else:
            self.net = nn.Linear(2, 2)

    def fused_layers(self) -> FusedLayers | None:
        """``(w1 [H, D], b1 [H], w2 [2, H], b2 [2])`` of the nonlinear regressor, ``(None, None, w2 [2, D], b2 [2])``
        of the linear one: what the fused DAL kernels compute (:func:`mjp_fast.dal_loss`). None for ``pca``, and for a
        subclass with its own ``forward``: those run as modules."""
        if type(self).forward is not DALRegressor.forward:
            return None
        # The modules' and parameters' dicts, not attribute lookups (nn.Module.__getattr__): this runs every step.
        # A parametrized weight (torch.nn.utils.parametrize) is no entry there: the regressor then runs as a module.
        net = self._modules["net"]
        if self.kind == "nonlinear":
            first, last = net._modules["0"]._parameters, net._modules["2"]._parameters
            if "weight" not in first or "weight" not in last:
                return None
            return first["weight"], first.get("bias"), last["weight"], last.get("bias")
        if self.kind == "linear":
            parameters = net._parameters
            return (None, None, parameters["weight"], parameters.get("bias")) if "weight" in parameters else None
        return None

    def forward(self, pos_embed: torch.Tensor) -> torch.Tensor:
        """``[N, D]`` -> ``[N, 2]``.

        A table in another dtype than the regressor's (a float16 table, a float32 regressor) is mapped in their
        promoted dtype, at least float32, as the fused DAL kernels compute; the result is in that dtype (``pca``:
        in the table's dtype). ``pca`` gives NaN (no error) for a table with a non-finite value: the projection is
        made of every row.
        """
        if pos_embed.shape[-1] != self.dim:
            raise ValueError(f"pos_embed must end in D = {self.dim}, got shape {list(pos_embed.shape)}")
        if self.kind != "pca":
            first = self.net[0] if self.kind == "nonlinear" else self.net
            if pos_embed.dtype == first.weight.dtype:
                return self.net(pos_embed)
            return self._mixed_forward(pos_embed, _promoted(pos_embed.dtype, first.weight.dtype))
        dtype = _promoted(pos_embed.dtype, self.net.weight.dtype)
        centered = pos_embed.to(dtype) - pos_embed.to(dtype).mean(0, keepdim=True)
        # A non-finite table makes linalg.svd raise (on the CPU) or return garbage: decompose a finite stand-in (no
        # host sync to decide) and give NaN instead, as the per-position regressors do.
        finite = torch.isfinite(centered).all()
        decomposed = torch.where(finite, centered, 0)
        # A table whose rows are all equal (one position, say) centres to zero, up to the mean's rounding, which
        # every direction projects to (about) 0; but linalg.svd's backward there is NaN (its singular values
        # coincide), and NaN times the DAL weight, 0 included, poisons the table's gradient. There a stand-in with
        # distinct singular values is decomposed instead (no host sync to decide): the projection is the same
        # rounding-sized values, its gradient finite.
        rows, dim = decomposed.shape
        if rows:  # (a table of no position has nothing to decompose either way)
            scale = pos_embed.detach().to(dtype).abs().amax()
            flat = decomposed.detach().abs().amax() <= 16 * torch.finfo(dtype).eps * scale
            stand_in = torch.eye(rows, dim, dtype=dtype, device=decomposed.device)
            stand_in = stand_in * torch.arange(dim, 0, -1, dtype=dtype, device=decomposed.device)
            decomposed = torch.where(flat, stand_in, decomposed)
        _, _, right = torch.linalg.svd(decomposed, full_matrices=False)
        directions = right[:2]
        if directions.shape[0] < 2:  # fewer than two positions or dimensions: pad with a zero direction
            directions = torch.cat((directions, directions.new_zeros(2 - directions.shape[0], self.dim)))
        # SVD's signs are arbitrary; fix them by the data (position 0 projects to a coordinate <= 0), so the
        # affine map sees the same axes from step to step, whatever rotation the embedding space takes.
        projection = centered @ directions.t()
        projection = projection * torch.where(projection[:1] > 0, -1.0, 1.0)
        projection = torch.where(finite, projection, torch.nan)
        return self._mixed_forward(projection, dtype).to(pos_embed.dtype)

    def _mixed_forward(self, features: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``self.net`` on ``features`` with its parameters cast to ``dtype`` (differentiably)."""
        features = features.to(dtype)
        layers = [m for m in self.net.modules() if isinstance(m, nn.Linear)]
        for index, layer in enumerate(layers):
            bias = layer.bias.to(dtype) if layer.bias is not None else None
            features = nn.functional.linear(features, layer.weight.to(dtype), bias)
            if index < len(layers) - 1:
                features = torch.relu(features)
        return features


def _promoted(table: torch.dtype, weights: torch.dtype) -> torch.dtype:
    """The dtype a table and the regressor's weights compute in: their promotion, at least float32."""
    return torch.promote_types(torch.promote_types(table, weights), torch.float32)


def fused_layers(regressor: object) -> FusedLayers | None:
    """The layers of ``regressor`` that the fused DAL kernels compute, or None: any module without them (a ``pca``
    regressor, a subclass with its own ``forward``, a user's module) runs as itself. The protocol is a
    ``fused_layers()`` method returning :data:`FusedLayers` or None, as :meth:`DALRegressor.fused_layers`."""
    layers = getattr(regressor, "fused_layers", None)
    return layers() if callable(layers) else None
