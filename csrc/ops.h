// The tensor-level operations behind the bindings (bindings.cpp) and the dispatcher operators, for the CPU and, when
// compiled, CUDA.
//
// Their callers (bindings.cpp, the operators' kernels) check every argument (shapes, dtypes, devices, ranges) and
// make tensors contiguous where a kernel needs it; the functions here assume that. Headers are kept narrow (no
// ATen/ATen.h, no torch/extension.h): compile time on small CI machines is dominated by them.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

// The dtypes of the patch embedding: float32, float16, bfloat16 (and float64, for gradcheck).
#define MJP_DISPATCH_FLOATING_TYPES(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, TYPE, NAME, __VA_ARGS__)

namespace mjp {

// Geometry of one patch-embedding call, derived from images [B, C, H, W] and weight [D, C, P, P], and the prefix
// (class and register) tokens written in front of each sample's patch tokens.
struct PatchGeometry {
  int64_t batch = 0;       // B
  int64_t channels = 0;    // C
  int64_t patch = 0;       // P
  int64_t rows = 0;        // gh = H / P
  int64_t cols = 0;        // gw = W / P
  int64_t positions = 0;   // N = gh * gw
  int64_t patch_size = 0;  // K = C * P * P, the length of one im2col row
  int64_t dim = 0;         // D
  int64_t prefix_rows = 0;       // P: prefix (class, register) tokens written in front of each sample's patch tokens
  int64_t prefix_positions = 0;  // Q: 0 or P, the position-table rows of the prefix tokens, in front of the N others

  int64_t rows_per_sample() const { return prefix_rows + positions; }  // output rows of a sample
};

inline bool present(const std::optional<at::Tensor>& tensor) { return tensor.has_value() && tensor->defined(); }

template <typename T>
const T* optional_data(const std::optional<at::Tensor>& tensor) {
  return present(tensor) ? tensor->data_ptr<T>() : nullptr;
}

// ---- CPU (sampler_cpu.cpp, patch_embed_cpu.cpp)

// mask bool [B, N] and perm int64 [B, N] on the CPU; the tables are contiguous int64 CPU tensors.
std::tuple<at::Tensor, at::Tensor> sample_jigsaw_cpu(int64_t batch_size, int64_t rows, int64_t cols, int64_t target,
                                                     int64_t min_block, uint64_t seed, uint64_t offset, bool shared,
                                                     int64_t prob_threshold, const at::Tensor& h_thresholds,
                                                     const at::Tensor& w_thresholds);

// out [B, P + N, D] (P = geometry.prefix_rows, Q = geometry.prefix_positions): out[b, t] = prefix[t] + (pos[t] if
// t < Q) for t < P, then the patch tokens out[b, P + n] = W @ patch(images[b], perm[b, n]) + bias + (unk if mask[b, n]
// else pos[Q + n]). images [B, C, H, W] with stride(3) == 1; weight, bias [D], pos_embed (the whole table,
// (Q + N) * D elements), unk_embed [D], perm [B, N], mask [B, N], prefix (P * D elements, absent when P = 0)
// contiguous (the optional ones may be absent). A masked token without unk_embed gets no position term.
at::Tensor patch_embed_forward_cpu(const PatchGeometry& geometry, const at::Tensor& images, const at::Tensor& weight,
                                   const std::optional<at::Tensor>& bias, const at::Tensor& pos_embed,
                                   const std::optional<at::Tensor>& unk_embed, const std::optional<at::Tensor>& perm,
                                   const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& prefix);

// {grad_images, grad_weight, grad_bias, grad_pos, grad_unk, grad_prefix}, each absent unless requested; grad_pos in
// pos_shape ((Q + N) * D elements), grad_prefix in prefix_shape (P * D elements). grad_out [B, P + N, D] contiguous;
// the weight, bias, image gradients come from its patch rows P.. alone. images need stride(3) == 1 only when
// need_weight.
std::vector<std::optional<at::Tensor>> patch_embed_backward_cpu(
    const PatchGeometry& geometry, const at::Tensor& grad_out, const at::Tensor& images, const at::Tensor& weight,
    const std::optional<at::Tensor>& perm, const std::optional<at::Tensor>& mask, bool need_images,
    bool need_weight, bool need_bias, bool need_pos, bool need_unk, bool need_prefix, at::IntArrayRef pos_shape,
    at::IntArrayRef prefix_shape);

// ---- Dispatcher operators (patch_embed_cpu.cpp, pos_embed_cpu.cpp, dal_loss.cpp, autograd_ops.cpp):
// torch.ops.mjp_fast.patch_embed_extension[_backward] (CPU, CUDA when compiled, and Meta kernels),
// torch.ops.mjp_fast.pos_embed_extension[_backward] (CPU, CUDA when compiled, and Meta),
// torch.ops.mjp_fast.dal_loss_extension[_backward]
// (CompositeExplicitAutograd and Meta), and the differentiable forms of the last two with their autograd in C++
// (pos_embed_extension_autograd, dal_loss_extension_autograd). They register themselves with the dispatcher from
// static initialisers and are called through it, never by name. A linker drops the object file of a static library
// (CMake's mjp_kernels) that nothing references, and its registrations with it: every translation unit that includes
// this header references one symbol of each file, so the operators come with any of the kernels.
extern const int kPatchEmbedOperators;
extern const int kPosEmbedOperators;
extern const int kDalLossOperators;
extern const int kAutogradOperators;
[[maybe_unused, gnu::used]] static const int* const kOperatorAnchors[] = {&kPatchEmbedOperators, &kPosEmbedOperators,
                                                                          &kDalLossOperators, &kAutogradOperators};

#ifdef MJP_WITH_CUDA
// ---- CUDA (cuda_ops.cpp over the kernels of sampler_cuda.cu, patch_embed_cuda.cu, pos_embed_cuda.cu and
// dal_loss_cuda.cu): same contracts, all tensors on one CUDA device, work queued on its current stream.

std::tuple<at::Tensor, at::Tensor> sample_jigsaw_cuda(int64_t batch_size, int64_t rows, int64_t cols, int64_t target,
                                                      int64_t min_block, uint64_t seed, uint64_t offset, bool shared,
                                                      int64_t prob_threshold, const at::Tensor& h_thresholds,
                                                      const at::Tensor& w_thresholds);

// The same, with sample 0's stream counter[0] * counter_scale + stream_shift and the seed bits and the prob threshold
// params[0], params[1], read by the kernel from device memory (counter: int64, one element; params: int64, two
// contiguous elements; both on the tables' device): the host neither syncs nor needs the values.
std::tuple<at::Tensor, at::Tensor> sample_jigsaw_from_counter_cuda(const at::Tensor& counter, const at::Tensor& params,
                                                                   uint64_t counter_scale, uint64_t stream_shift,
                                                                   int64_t batch_size, int64_t rows, int64_t cols,
                                                                   int64_t target, int64_t min_block, bool shared,
                                                                   const at::Tensor& h_thresholds,
                                                                   const at::Tensor& w_thresholds);

at::Tensor patch_embed_forward_cuda(const PatchGeometry& geometry, const at::Tensor& images, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias, const at::Tensor& pos_embed,
                                    const std::optional<at::Tensor>& unk_embed, const std::optional<at::Tensor>& perm,
                                    const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& prefix);

std::vector<std::optional<at::Tensor>> patch_embed_backward_cuda(
    const PatchGeometry& geometry, const at::Tensor& grad_out, const at::Tensor& images, const at::Tensor& weight,
    const std::optional<at::Tensor>& perm, const std::optional<at::Tensor>& mask, bool need_images,
    bool need_weight, bool need_bias, bool need_pos, bool need_unk, bool need_prefix, at::IntArrayRef pos_shape,
    at::IntArrayRef prefix_shape);

// pos_embed_extension's forward on CUDA (pos_embed_cpu.cpp's contract and checks): out [B, P + N, D] in pos_embed's
// dtype. tokens [B, N, D], perm, mask [B, N], pos_embed ((Q + N) * D elements), unk_embed [D] contiguous; prefix
// (prefix_rows * D elements, contiguous) absent when prefix_rows is 0.
at::Tensor pos_embed_forward_cuda(const at::Tensor& tokens, const at::Tensor& perm, const at::Tensor& mask,
                                  const at::Tensor& pos_embed, const at::Tensor& unk_embed,
                                  const std::optional<at::Tensor>& prefix, int64_t prefix_rows,
                                  int64_t prefix_positions);

// pos_embed_extension_backward on CUDA: {grad_tokens, grad_pos, grad_unk, grad_prefix} in the given shapes and dtypes
// (grad_prefix an empty [0] tensor when prefix_count is 0). grad_out [B, P + N, D], perm, mask [B, N] contiguous.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> pos_embed_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& perm, const at::Tensor& mask, int64_t prefix_count,
    int64_t prefix_positions, at::IntArrayRef pos_shape, at::IntArrayRef prefix_shape, at::ScalarType tokens_dtype,
    at::ScalarType pos_dtype, at::ScalarType unk_dtype, at::ScalarType prefix_dtype);

// dal_loss_extension's forward with the nonlinear regressor on CUDA (dal_loss.cpp's contract and checks): table (the
// whole position table as [skip_rows + N, D]), w1, b1, w2, b2 and coords contiguous in the computation dtype (float32
// or float64); mask bool [B, N] contiguous. {loss, pred, hidden, weights} in that dtype.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> dal_loss_forward_cuda(
    const at::Tensor& table, int64_t skip_rows, const at::Tensor& w1, const std::optional<at::Tensor>& b1,
    const at::Tensor& w2, const std::optional<at::Tensor>& b2, const at::Tensor& coords,
    const std::optional<at::Tensor>& mask, double scale);

// Its backward, the same tensors (grad: 0-d) in the computation dtype: {grad_table [skip_rows + N, D] (zeros in the
// skipped rows), grad_w1, grad_b1 ([0] without b1), grad_w2, grad_b2 ([0] without b2)} in that dtype.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> dal_loss_backward_cuda(
    const at::Tensor& grad, const at::Tensor& table, int64_t skip_rows, const at::Tensor& w1, const at::Tensor& w2,
    const at::Tensor& coords, const at::Tensor& pred, const at::Tensor& hidden, const at::Tensor& weights,
    double scale, bool has_b1, bool has_b2);
#endif

}  // namespace mjp
