// Python bindings of mjp_fast._C: argument checks, then dispatch to the CPU or the CUDA implementation.
//
// The Python layer (mjp_fast/ops/) validates user input and words the errors; the checks here guard the kernels
// (shapes, dtypes, devices, ranges) so that a wrong call raises RuntimeError instead of touching bad memory.
#include <ATen/core/LegacyTypeDispatch.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>

#include "ops.h"

namespace mjp {
namespace {

constexpr int64_t kMaxGridPositions = int64_t(1) << 30;  // keeps Q32 areas and positions inside int64

bool has_cuda() {
#ifdef MJP_WITH_CUDA
  return true;
#else
  return false;
#endif
}

#ifndef MJP_WITH_CUDA
[[noreturn]] void fail_no_cuda(const char* op) {
  TORCH_CHECK(false, "mjp_fast._C.", op, ": tensors are on CUDA but the extension was built without CUDA kernels");
}
#endif

std::tuple<at::Tensor, at::Tensor> sample_jigsaw(int64_t batch_size, int64_t rows, int64_t cols, int64_t target,
                                                 int64_t min_block, uint64_t seed, uint64_t offset, bool shared,
                                                 int64_t prob_threshold, const at::Tensor& h_thresholds,
                                                 const at::Tensor& w_thresholds) {
  TORCH_CHECK(batch_size >= 0, "sample_jigsaw: batch_size must be >= 0, got ", batch_size);
  TORCH_CHECK(rows >= 1 && cols >= 1, "sample_jigsaw: grid must be at least 1x1, got ", rows, "x", cols);
  TORCH_CHECK(rows <= kMaxGridPositions && cols <= kMaxGridPositions && rows * cols <= kMaxGridPositions,
              "sample_jigsaw: at most 2**30 grid positions, got ", rows, "x", cols);
  const int64_t num_positions = rows * cols;
  TORCH_CHECK(target >= 0 && target <= num_positions, "sample_jigsaw: target must be in [0, ", num_positions,
              "], got ", target);
  TORCH_CHECK(min_block >= 0 && min_block <= kMaxGridPositions, "sample_jigsaw: min_block must be in [0, 2**30], got ",
              min_block);
  TORCH_CHECK(prob_threshold >= 0 && prob_threshold <= (int64_t(1) << 32),
              "sample_jigsaw: prob_threshold must be in [0, 2**32], got ", prob_threshold);
  TORCH_CHECK(h_thresholds.scalar_type() == at::kLong && w_thresholds.scalar_type() == at::kLong,
              "sample_jigsaw: threshold tables must be int64, got ", h_thresholds.scalar_type(), " and ",
              w_thresholds.scalar_type());
  TORCH_CHECK(h_thresholds.dim() == 2 && h_thresholds.size(0) == 1024 && h_thresholds.size(1) == rows,
              "sample_jigsaw: h_thresholds must have shape [1024, ", rows, "], got ", h_thresholds.sizes());
  TORCH_CHECK(w_thresholds.dim() == 2 && w_thresholds.size(0) == 1024 && w_thresholds.size(1) == cols,
              "sample_jigsaw: w_thresholds must have shape [1024, ", cols, "], got ", w_thresholds.sizes());
  TORCH_CHECK(h_thresholds.device() == w_thresholds.device(), "sample_jigsaw: threshold tables on different devices (",
              h_thresholds.device(), ", ", w_thresholds.device(), ")");
  const auto h = h_thresholds.contiguous();
  const auto w = w_thresholds.contiguous();
  if (h.is_cuda()) {
#ifdef MJP_WITH_CUDA
    return sample_jigsaw_cuda(batch_size, rows, cols, target, min_block, seed, offset, shared, prob_threshold, h, w);
#else
    fail_no_cuda("sample_jigsaw");
#endif
  }
  TORCH_CHECK(h.is_cpu(), "sample_jigsaw: tables must be on the CPU or a CUDA device, got ", h.device());
  return sample_jigsaw_cpu(batch_size, rows, cols, target, min_block, seed, offset, shared, prob_threshold, h, w);
}

// Checks images / weight and derives the geometry.
PatchGeometry patch_geometry(const char* op, const at::Tensor& images, const at::Tensor& weight) {
  TORCH_CHECK(images.dim() == 4, op, ": images must be [B, C, H, W], got ", images.sizes());
  TORCH_CHECK(weight.dim() == 4 && weight.size(2) == weight.size(3) && weight.size(2) >= 1,
              op, ": weight must be [D, C, P, P], got ", weight.sizes());
  TORCH_CHECK(weight.size(1) == images.size(1), op, ": weight has ", weight.size(1), " input channels, images have ",
              images.size(1));
  const auto dtype = images.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kDouble, op,
              ": images must be float32, float16, bfloat16 or float64, got ", dtype);
  TORCH_CHECK(weight.scalar_type() == dtype, op, ": weight dtype ", weight.scalar_type(), " differs from images ",
              dtype);
  TORCH_CHECK(weight.device() == images.device(), op, ": weight on ", weight.device(), ", images on ",
              images.device());
  PatchGeometry g;
  g.batch = images.size(0);
  g.channels = images.size(1);
  g.patch = weight.size(2);
  g.rows = images.size(2) / g.patch;
  g.cols = images.size(3) / g.patch;
  g.positions = g.rows * g.cols;
  g.patch_size = g.channels * g.patch * g.patch;
  g.dim = weight.size(0);
  return g;
}

void check_vector(const char* op, const char* name, const at::Tensor& tensor, const at::Tensor& like, int64_t size) {
  TORCH_CHECK(tensor.numel() == size, op, ": ", name, " must have ", size, " elements, got shape ", tensor.sizes());
  TORCH_CHECK(tensor.scalar_type() == like.scalar_type(), op, ": ", name, " dtype ", tensor.scalar_type(),
              " differs from images ", like.scalar_type());
  TORCH_CHECK(tensor.device() == like.device(), op, ": ", name, " on ", tensor.device(), ", images on ",
              like.device());
}

// perm int64 / mask bool with B * N elements on the images' device, made contiguous.
std::optional<at::Tensor> index_tensor(const char* op, const char* name, const std::optional<at::Tensor>& tensor,
                                       at::ScalarType dtype, const at::Tensor& images, const PatchGeometry& g) {
  if (!present(tensor)) return std::nullopt;
  TORCH_CHECK(tensor->scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", tensor->scalar_type());
  TORCH_CHECK(tensor->numel() == g.batch * g.positions, op, ": ", name, " must be [", g.batch, ", ", g.positions,
              "], got ", tensor->sizes());
  TORCH_CHECK(tensor->device() == images.device(), op, ": ", name, " on ", tensor->device(), ", images on ",
              images.device());
  return tensor->contiguous();
}

// Images may be strided, but the innermost (width) stride must be 1 for the row copies.
at::Tensor row_contiguous(const at::Tensor& images) {
  return images.size(3) <= 1 || images.stride(3) == 1 ? images : images.contiguous();
}

std::optional<at::Tensor> contiguous_optional(const std::optional<at::Tensor>& tensor) {
  if (!present(tensor)) return std::nullopt;
  return tensor->contiguous();
}

at::Tensor patch_embed_forward(const at::Tensor& images, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, const at::Tensor& pos_embed,
                               const std::optional<at::Tensor>& unk_embed, const std::optional<at::Tensor>& perm,
                               const std::optional<at::Tensor>& mask) {
  constexpr const char* op = "patch_embed_forward";
  // Raw kernels: no autograd recording (the Python layer's autograd Function owns the graph), and out= GEMMs
  // must not see arguments that require grad (a weight that is an nn.Parameter does).
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  const PatchGeometry g = patch_geometry(op, images, weight);
  if (present(bias)) check_vector(op, "bias", *bias, images, g.dim);
  check_vector(op, "pos_embed", pos_embed, images, g.positions * g.dim);
  if (present(unk_embed)) check_vector(op, "unk_embed", *unk_embed, images, g.dim);
  const auto perm_c = index_tensor(op, "perm", perm, at::kLong, images, g);
  const auto mask_c = index_tensor(op, "mask", mask, at::kBool, images, g);
  const auto images_c = row_contiguous(images);
  const auto weight_c = weight.contiguous();
  const auto pos_c = pos_embed.contiguous();
  const auto bias_c = contiguous_optional(bias);
  const auto unk_c = contiguous_optional(unk_embed);
  if (images.is_cuda()) {
#ifdef MJP_WITH_CUDA
    return patch_embed_forward_cuda(g, images_c, weight_c, bias_c, pos_c, unk_c, perm_c, mask_c);
#else
    fail_no_cuda(op);
#endif
  }
  TORCH_CHECK(images.is_cpu(), op, ": tensors must be on the CPU or a CUDA device, got ", images.device());
  return patch_embed_forward_cpu(g, images_c, weight_c, bias_c, pos_c, unk_c, perm_c, mask_c);
}

std::vector<std::optional<at::Tensor>> patch_embed_backward(const at::Tensor& grad_out, const at::Tensor& images,
                                                            const at::Tensor& weight,
                                                            const std::optional<at::Tensor>& perm,
                                                            const std::optional<at::Tensor>& mask, bool need_images,
                                                            bool need_weight, bool need_bias, bool need_pos,
                                                            bool need_unk) {
  constexpr const char* op = "patch_embed_backward";
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  const PatchGeometry g = patch_geometry(op, images, weight);
  TORCH_CHECK(grad_out.dim() == 3 && grad_out.size(0) == g.batch && grad_out.size(1) == g.positions &&
                  grad_out.size(2) == g.dim,
              op, ": grad_out must be [", g.batch, ", ", g.positions, ", ", g.dim, "], got ", grad_out.sizes());
  TORCH_CHECK(grad_out.scalar_type() == images.scalar_type(), op, ": grad_out dtype ", grad_out.scalar_type(),
              " differs from images ", images.scalar_type());
  TORCH_CHECK(grad_out.device() == images.device(), op, ": grad_out on ", grad_out.device(), ", images on ",
              images.device());
  const auto perm_c = index_tensor(op, "perm", perm, at::kLong, images, g);
  const auto mask_c = index_tensor(op, "mask", mask, at::kBool, images, g);
  const auto grad_c = grad_out.contiguous();
  const auto images_c = need_weight ? row_contiguous(images) : images;
  const auto weight_c = weight.contiguous();
  if (images.is_cuda()) {
#ifdef MJP_WITH_CUDA
    return patch_embed_backward_cuda(g, grad_c, images_c, weight_c, perm_c, mask_c, need_images, need_weight,
                                     need_bias, need_pos, need_unk);
#else
    fail_no_cuda(op);
#endif
  }
  TORCH_CHECK(images.is_cpu(), op, ": tensors must be on the CPU or a CUDA device, got ", images.device());
  return patch_embed_backward_cpu(g, grad_c, images_c, weight_c, perm_c, mask_c, need_images, need_weight, need_bias,
                                  need_pos, need_unk);
}

}  // namespace
}  // namespace mjp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.doc() = "mjp_fast compiled kernels: the jigsaw sampler and the fused MJP patch embedding (CPU and CUDA).";
  m.def("has_cuda", &mjp::has_cuda, "Whether the CUDA kernels were compiled in.");
  m.def("sample_jigsaw", &mjp::sample_jigsaw,
        "Samples docs/sampler.md for a batch. Returns (mask bool [B, N], perm int64 [B, N]) on the tables' device.",
        py::arg("batch_size"), py::arg("gh"), py::arg("gw"), py::arg("target"), py::arg("min_block"),
        py::arg("seed"), py::arg("offset"), py::arg("shared"), py::arg("prob_threshold"), py::arg("h_thresholds"),
        py::arg("w_thresholds"));
  m.def("patch_embed_forward", &mjp::patch_embed_forward,
        "tokens [B, N, D] = W @ patch(images[b], perm[b, n]) + bias + (unk if mask[b, n] else pos[n]).",
        py::arg("images"), py::arg("weight"), py::arg("bias"), py::arg("pos_embed"), py::arg("unk_embed"),
        py::arg("perm"), py::arg("mask"));
  m.def("patch_embed_backward", &mjp::patch_embed_backward,
        "[grad_images, grad_weight, grad_bias, grad_pos, grad_unk], None where not requested.", py::arg("grad_out"),
        py::arg("images"), py::arg("weight"), py::arg("perm"), py::arg("mask"), py::arg("need_images"),
        py::arg("need_weight"), py::arg("need_bias"), py::arg("need_pos"), py::arg("need_unk"));
}
