"""Privacy evaluation: gradient-inversion attacks on ViTs with and without MJP, and the paper's metrics.

- :mod:`~mjp_fast.privacy.model`: :class:`PrivacyViT` (optionally with its first block in the analytic attack's
  layout) and :func:`client_gradients`, the update one client image produces;
- :mod:`~mjp_fast.privacy.april`: the analytic APRIL attack (the derivation is in its docstring);
- :mod:`~mjp_fast.privacy.adaptive`: the analytic attack of an attacker who knows MJP (mask from the zero rows,
  eq. (1) solved as far as it is determined, a patch prior; the derivation and the count are in its docstring);
- :mod:`~mjp_fast.privacy.jigsaw_solver`: puts candidate patches into holes by edge compatibility;
- :mod:`~mjp_fast.privacy.comparison`: APRIL beside the adaptive attack over ratios, masks, UNK, batches;
- :mod:`~mjp_fast.privacy.optimization`: gradient matching for standard models;
- :mod:`~mjp_fast.privacy.metrics`: MSE, PSNR, SSIM, FFT2D, LPIPS (:mod:`~mjp_fast.privacy.lpips`), per image;
- :mod:`~mjp_fast.privacy.settings`: the settings a, b, c and the ablation without UNK;
- :mod:`~mjp_fast.privacy.report`: Markdown table, JSON, image grid; ``mjp attack`` runs it all.
"""

from mjp_fast.privacy.adaptive import PatchPrior, adaptive_attack, fit_patch_prior, mjp_system, read_mask
from mjp_fast.privacy.april import april_attack, invert_patch_embed, solve_tokens
from mjp_fast.privacy.metrics import METRICS, reconstruction_metrics
from mjp_fast.privacy.model import PrivacyViT, client_gradients, infer_label
from mjp_fast.privacy.optimization import OptimizationResult, optimization_attack
from mjp_fast.privacy.report import markdown_table, save_grid, write_json
from mjp_fast.privacy.settings import SETTINGS, ImageAttack, load_images, run_settings, setting_metrics, summarize

__all__ = [
    "METRICS",
    "SETTINGS",
    "ImageAttack",
    "OptimizationResult",
    "PatchPrior",
    "PrivacyViT",
    "adaptive_attack",
    "april_attack",
    "client_gradients",
    "fit_patch_prior",
    "infer_label",
    "invert_patch_embed",
    "load_images",
    "markdown_table",
    "mjp_system",
    "optimization_attack",
    "read_mask",
    "reconstruction_metrics",
    "run_settings",
    "save_grid",
    "setting_metrics",
    "solve_tokens",
    "summarize",
    "write_json",
]
