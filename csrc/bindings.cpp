// Python bindings of mjp_fast._C: argument checks, then dispatch to the CPU or the CUDA implementation (the
// sampler); the patch embedding's bindings are thin wrappers of its dispatcher operators, which check their own.
//
// The Python layer (mjp_fast/ops/) validates user input and words the errors; the checks here guard the kernels
// (shapes, dtypes, devices, ranges) so that a wrong call raises RuntimeError instead of touching bad memory.
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <utility>
#include <vector>

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

// The checks every entry of the sampler makes: the sizes, and the tables (int64 [1024, rows] and [1024, cols], on one
// device). `op` names the entry in the messages.
void check_sampler_arguments(const char* op, int64_t batch_size, int64_t rows, int64_t cols, int64_t target,
                             int64_t min_block, const at::Tensor& h_thresholds, const at::Tensor& w_thresholds) {
  TORCH_CHECK(batch_size >= 0, op, ": batch_size must be >= 0, got ", batch_size);
  TORCH_CHECK(rows >= 1 && cols >= 1, op, ": grid must be at least 1x1, got ", rows, "x", cols);
  TORCH_CHECK(rows <= kMaxGridPositions && cols <= kMaxGridPositions && rows * cols <= kMaxGridPositions, op,
              ": at most 2**30 grid positions, got ", rows, "x", cols);
  const int64_t num_positions = rows * cols;
  TORCH_CHECK(target >= 0 && target <= num_positions, op, ": target must be in [0, ", num_positions, "], got ",
              target);
  // As sample_jigsaw in Python: BEiT's smallest block is at least one cell.
  TORCH_CHECK(min_block >= 1 && min_block <= kMaxGridPositions, op, ": min_block must be in [1, 2**30], got ",
              min_block);
  TORCH_CHECK(h_thresholds.scalar_type() == at::kLong && w_thresholds.scalar_type() == at::kLong, op,
              ": threshold tables must be int64, got ", h_thresholds.scalar_type(), " and ",
              w_thresholds.scalar_type());
  TORCH_CHECK(h_thresholds.dim() == 2 && h_thresholds.size(0) == 1024 && h_thresholds.size(1) == rows, op,
              ": h_thresholds must have shape [1024, ", rows, "], got ", h_thresholds.sizes());
  TORCH_CHECK(w_thresholds.dim() == 2 && w_thresholds.size(0) == 1024 && w_thresholds.size(1) == cols, op,
              ": w_thresholds must have shape [1024, ", cols, "], got ", w_thresholds.sizes());
  TORCH_CHECK(h_thresholds.device() == w_thresholds.device(), op, ": threshold tables on different devices (",
              h_thresholds.device(), ", ", w_thresholds.device(), ")");
  TORCH_CHECK(h_thresholds.is_cpu() || h_thresholds.is_cuda(), op, ": tables must be on the CPU or a CUDA device, got ",
              h_thresholds.device());
#ifndef MJP_WITH_CUDA
  if (h_thresholds.is_cuda()) fail_no_cuda(op);
#endif
}

bool valid_prob_threshold(int64_t prob_threshold) {
  return prob_threshold >= 0 && prob_threshold <= (int64_t(1) << 32);
}

// The sampler with its stream position, seed and prob threshold as host integers: sample i uses stream offset + i
// (offset when shared). What sample_jigsaw(offset=int) calls: the values are kernel arguments, nothing is copied.
std::tuple<at::Tensor, at::Tensor> sample_jigsaw(int64_t batch_size, int64_t rows, int64_t cols, int64_t target,
                                                 int64_t min_block, uint64_t seed, uint64_t offset, bool shared,
                                                 int64_t prob_threshold, const at::Tensor& h_thresholds,
                                                 const at::Tensor& w_thresholds) {
  check_sampler_arguments("sample_jigsaw", batch_size, rows, cols, target, min_block, h_thresholds, w_thresholds);
  TORCH_CHECK(valid_prob_threshold(prob_threshold), "sample_jigsaw: prob_threshold must be in [0, 2**32], got ",
              prob_threshold);
  const auto h = h_thresholds.contiguous();
  const auto w = w_thresholds.contiguous();
#ifdef MJP_WITH_CUDA
  if (h.is_cuda()) {
    return sample_jigsaw_cuda(batch_size, rows, cols, target, min_block, seed, offset, shared, prob_threshold, h, w);
  }
#endif
  return sample_jigsaw_cpu(batch_size, rows, cols, target, min_block, seed, offset, shared, prob_threshold, h, w);
}

// The sampler with its stream position and random settings in tensors on the tables' device, as the operators
// (dispatch.py's SCHEMA) and the Triton kernel take them: sample i uses stream counter[0] * counter_scale +
// stream_shift + i (mod 2**64; no + i when shared), with the seed's 64 bits and the prob threshold in params[0] and
// params[1]. On a GPU the kernel reads the three values from device memory: no host sync, and a CUDA graph replays
// each step's stream position. There they go unchecked (a check would sync; any value is memory-safe, the
// threshold only decides the coin); on the CPU they are read in place and the threshold is checked.
std::tuple<at::Tensor, at::Tensor> sample_jigsaw_from_counter(const at::Tensor& counter, const at::Tensor& params,
                                                              const at::Tensor& h_thresholds,
                                                              const at::Tensor& w_thresholds, int64_t batch_size,
                                                              int64_t rows, int64_t cols, int64_t target,
                                                              int64_t min_block, int64_t counter_scale,
                                                              int64_t stream_shift, bool shared) {
  constexpr const char* op = "sample_jigsaw_from_counter";
  check_sampler_arguments(op, batch_size, rows, cols, target, min_block, h_thresholds, w_thresholds);
  TORCH_CHECK(counter.scalar_type() == at::kLong && counter.numel() == 1, op,
              ": counter must be a one-element int64 tensor, got ", counter.scalar_type(), " ", counter.sizes());
  TORCH_CHECK(params.scalar_type() == at::kLong && params.numel() == 2, op,
              ": params must be an int64 tensor of 2 elements (the seed's bits, the prob threshold), got ",
              params.scalar_type(), " ", params.sizes());
  TORCH_CHECK(counter.device() == h_thresholds.device(), op, ": counter must be on the tables' device ",
              h_thresholds.device(), ", got ", counter.device());
  TORCH_CHECK(params.device() == h_thresholds.device(), op, ": params must be on the tables' device ",
              h_thresholds.device(), ", got ", params.device());
  TORCH_CHECK(counter_scale >= 0, op, ": counter_scale must be >= 0, got ", counter_scale);
  TORCH_CHECK(stream_shift >= 0, op, ": stream_shift must be >= 0, got ", stream_shift);
  const auto h = h_thresholds.contiguous();
  const auto w = w_thresholds.contiguous();
  const auto settings = params.contiguous();  // a copy only when params is not contiguous (a plan's always is)
#ifdef MJP_WITH_CUDA
  if (h.is_cuda()) {
    return sample_jigsaw_from_counter_cuda(counter, settings, static_cast<uint64_t>(counter_scale),
                                           static_cast<uint64_t>(stream_shift), batch_size, rows, cols, target,
                                           min_block, shared, h, w);
  }
#endif
  const int64_t* values = settings.data_ptr<int64_t>();
  TORCH_CHECK(valid_prob_threshold(values[1]), op, ": params[1], the prob threshold, must be in [0, 2**32], got ",
              values[1]);
  const uint64_t offset = static_cast<uint64_t>(*counter.data_ptr<int64_t>()) * static_cast<uint64_t>(counter_scale) +
                          static_cast<uint64_t>(stream_shift);
  return sample_jigsaw_cpu(batch_size, rows, cols, target, min_block, static_cast<uint64_t>(values[0]), offset,
                           shared, values[1], h, w);
}

// One step of a module's sampler (JigsawSampler) on the CPU, in one call: reads the stream position from `counter`
// (int64, one element, CPU), samples from position counter * counter_scale + stream_shift (mod 2**64), then advances
// the counter by batch_size in place. From Python that would be an item() and an add_ around the sampling: host time
// in every training step.
std::tuple<at::Tensor, at::Tensor> sample_jigsaw_step(const at::Tensor& counter, int64_t counter_scale,
                                                      int64_t stream_shift, int64_t batch_size, int64_t rows,
                                                      int64_t cols, int64_t target, int64_t min_block, uint64_t seed,
                                                      bool shared, int64_t prob_threshold,
                                                      const at::Tensor& h_thresholds, const at::Tensor& w_thresholds) {
  TORCH_CHECK(counter.is_cpu() && counter.scalar_type() == at::kLong && counter.numel() == 1,
              "sample_jigsaw_step: counter must be a one-element int64 CPU tensor, got ", counter.scalar_type(), " ",
              counter.sizes(), " on ", counter.device());
  TORCH_CHECK(h_thresholds.is_cpu(), "sample_jigsaw_step: the tables must be on the CPU, got ", h_thresholds.device());
  TORCH_CHECK(counter_scale >= 0 && stream_shift >= 0, "sample_jigsaw_step: counter_scale and stream_shift must be "
              ">= 0, got ", counter_scale, " and ", stream_shift);
  int64_t* position = counter.data_ptr<int64_t>();
  const uint64_t offset = static_cast<uint64_t>(*position) * static_cast<uint64_t>(counter_scale) +
                          static_cast<uint64_t>(stream_shift);
  auto jigsaw =
      sample_jigsaw(batch_size, rows, cols, target, min_block, seed, offset, shared, prob_threshold, h_thresholds,
                    w_thresholds);
  *position += batch_size;
  counter.unsafeGetTensorImpl()->bump_version();  // an in-place write, as add_ would record
  return jigsaw;
}

// The patch embedding: the dispatcher operators mjp_fast::patch_embed_extension[_backward] (patch_embed_cpu.cpp,
// which checks the arguments), called below autograd: raw kernels, no autograd recording whatever requires grad.
// Through the dispatcher, so a TorchDispatchMode sees one operator, as it does when Python calls the operators.

at::Tensor patch_embed_forward(const at::Tensor& images, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, const at::Tensor& pos_embed,
                               const std::optional<at::Tensor>& unk_embed, const std::optional<at::Tensor>& perm,
                               const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& prefix,
                               int64_t prefix_positions) {
#ifndef MJP_WITH_CUDA
  if (images.is_cuda()) fail_no_cuda("patch_embed_forward");
#endif
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mjp_fast::patch_embed_extension", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                            const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                            const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, int64_t,
                            std::optional<at::ScalarType>, std::optional<at::ScalarType>)>();
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(images, weight, bias, pos_embed, unk_embed, perm, mask, prefix, prefix_positions, std::nullopt,
                 std::nullopt);
}

// The operator's gradients, None where not requested (the operator returns an empty [0] tensor there).
std::vector<std::optional<at::Tensor>> patch_embed_backward(
    const at::Tensor& grad_out, const at::Tensor& images, const at::Tensor& weight,
    const std::optional<at::Tensor>& perm, const std::optional<at::Tensor>& mask, bool need_images, bool need_weight,
    bool need_bias, bool need_pos, bool need_unk, bool need_prefix, int64_t prefix_count, int64_t prefix_positions,
    const std::optional<std::vector<int64_t>>& pos_shape, const std::optional<std::vector<int64_t>>& prefix_shape) {
#ifndef MJP_WITH_CUDA
  if (images.is_cuda()) fail_no_cuda("patch_embed_backward");
#endif
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mjp_fast::patch_embed_extension_backward", "")
          .typed<std::vector<at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, bool, bool,
                                         bool, bool, bool, bool, int64_t, int64_t, at::OptionalSymIntArrayRef,
                                         at::OptionalSymIntArrayRef, std::optional<at::ScalarType>,
                                         std::optional<at::ScalarType>, std::optional<at::ScalarType>,
                                         std::optional<at::ScalarType>)>();
  const auto symbolic = [](const std::optional<std::vector<int64_t>>& shape) -> at::OptionalSymIntArrayRef {
    if (!shape.has_value()) return std::nullopt;
    return c10::fromIntArrayRefSlow(*shape);
  };
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  auto grads = op.call(grad_out, images, weight, perm, mask, need_images, need_weight, need_bias, need_pos, need_unk,
                       need_prefix, prefix_count, prefix_positions, symbolic(pos_shape), symbolic(prefix_shape),
                       std::nullopt, std::nullopt, std::nullopt, std::nullopt);
  const bool needs[] = {need_images, need_weight, need_bias, need_pos, need_unk, need_prefix};
  std::vector<std::optional<at::Tensor>> out(grads.size());
  for (size_t i = 0; i < grads.size(); ++i) {
    if (needs[i]) out[i] = std::move(grads[i]);
  }
  return out;
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
  m.def("sample_jigsaw_from_counter", &mjp::sample_jigsaw_from_counter,
        "sample_jigsaw from stream position counter[0] * counter_scale + stream_shift with (seed bits, prob "
        "threshold) = params: int64 tensors of 1 and 2 elements on the tables' device, read there by the kernel (no "
        "host sync on a GPU). The arguments of the operator mjp_fast::sample_jigsaw_extension.",
        py::arg("counter"), py::arg("params"), py::arg("h_thresholds"), py::arg("w_thresholds"),
        py::arg("batch_size"), py::arg("gh"), py::arg("gw"), py::arg("target"), py::arg("min_block"),
        py::arg("counter_scale"), py::arg("stream_shift"), py::arg("shared"));
  m.def("sample_jigsaw_step", &mjp::sample_jigsaw_step,
        "sample_jigsaw from stream position counter * counter_scale + stream_shift, then counter += batch_size in "
        "place (counter: a one-element int64 CPU tensor; CPU tables).",
        py::arg("counter"), py::arg("counter_scale"), py::arg("stream_shift"), py::arg("batch_size"), py::arg("gh"),
        py::arg("gw"), py::arg("target"), py::arg("min_block"), py::arg("seed"), py::arg("shared"),
        py::arg("prob_threshold"), py::arg("h_thresholds"), py::arg("w_thresholds"));
  m.def("patch_embed_forward", &mjp::patch_embed_forward,
        "out [B, P + N, D]: out[b, t] = prefix[t] + (pos[t] if t < Q) for the P prefix tokens (prefix: P * D "
        "elements, Q = prefix_positions, 0 or P), then out[b, P + n] = W @ patch(images[b], perm[b, n]) + bias + "
        "(unk if mask[b, n] else pos[Q + n]); pos_embed is the whole table, last two dims [Q + N, D].",
        py::arg("images"), py::arg("weight"), py::arg("bias"), py::arg("pos_embed"), py::arg("unk_embed"),
        py::arg("perm"), py::arg("mask"), py::arg("prefix") = py::none(), py::arg("prefix_positions") = 0);
  m.def("patch_embed_backward", &mjp::patch_embed_backward,
        "[grad_images, grad_weight, grad_bias, grad_pos, grad_unk, grad_prefix], None where not requested. grad_out "
        "[B, P + N, D] (P = prefix_count); grad_pos comes in pos_shape (default [Q + N, D]), grad_prefix in "
        "prefix_shape (default [P, D]; an empty [0] tensor when P = 0).",
        py::arg("grad_out"), py::arg("images"), py::arg("weight"), py::arg("perm"), py::arg("mask"),
        py::arg("need_images"), py::arg("need_weight"), py::arg("need_bias"), py::arg("need_pos"),
        py::arg("need_unk"), py::arg("need_prefix") = false, py::arg("prefix_count") = 0,
        py::arg("prefix_positions") = 0, py::arg("pos_shape") = py::none(), py::arg("prefix_shape") = py::none());
}
