// Launchers of the CUDA kernels (sampler_cuda.cu, patch_embed_cuda.cu, pos_embed_cuda.cu, dal_loss_cuda.cu) on raw
// pointers.
//
// No ATen here: nvcc then compiles small translation units, and the tensor-level glue (allocation, cuBLAS through
// at::mm, device guards) lives in cuda_ops.cpp, compiled by the host compiler. Each launcher returns the launch
// status (cudaGetLastError) for the caller to check.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#ifndef MJP_CUDA_ON_HOST_THREADS  // csrc/tests/cuda_on_threads.h gives its own
#include <cuda_runtime_api.h>
#endif

#include <cstdint>

namespace mjp {
namespace cuda {

// The type sums and products are computed in: float, or double for double (at::opmath_type, without ATen).
template <typename scalar_t>
struct Accumulate {
  using type = float;
};
template <>
struct Accumulate<double> {
  using type = double;
};
template <typename scalar_t>
using accumulate_t = typename Accumulate<scalar_t>::type;

// Where a sampler launch finds sample 0's stream index, the seed and the prob threshold. With `counter` set, in device
// memory, read by the kernel as the Triton kernel reads them (no host sync, and a CUDA graph replays the stream
// position of each step): stream counter[0] * counter_scale + stream_shift (mod 2**64), seed bits params[0], threshold
// params[1]. Without, the host's values below: stream `stream_shift`, `seed`, `prob_threshold`.
struct SamplerStream {
  const int64_t* counter = nullptr;  // one element, or null
  const int64_t* params = nullptr;   // two contiguous elements when counter is set
  uint64_t counter_scale = 1;
  uint64_t stream_shift = 0;
  uint64_t seed = 0;
  int64_t prob_threshold = 0;
};

// mask bool [B, N], perm int64 [B, N]; tables int64 [1024, rows] / [1024, cols]; all device pointers. Sample i uses
// stream (sample 0's) + i, or sample 0's when shared.
cudaError_t launch_sample_jigsaw(int64_t batch_size, int64_t rows, int64_t cols, int64_t target, int64_t min_block,
                                 const SamplerStream& source, bool shared, const int64_t* h_thresholds,
                                 const int64_t* w_thresholds, bool* mask, int64_t* perm, cudaStream_t stream);

// Sizes and image strides of a patch-embedding call (see PatchGeometry in ops.h).
struct PatchLayout {
  int64_t batch, positions, patch_size, patch, cols, dim;
  int64_t batch_stride, channel_stride, height_stride;  // of images [B, C, H, W]; the width stride is 1
  // Rows of the im2col matrix in front of each sample's N patch rows, that no patch fills: the gather writes zeros
  // there and the scatter skips them. The backward's GEMMs then take the gradient [B * (P + N), D] with its P prefix
  // rows as it is, instead of a copy of its patch rows.
  int64_t row_prefix = 0;
};

// columns [B * (row_prefix + N), K] = the patches of images in perm order (perm null: identity), zeros in each
// sample's row_prefix first rows. An out-of-range perm entry gives a zero row (the Python layer never passes one;
// checking would need a host synchronisation).
template <typename scalar_t>
cudaError_t launch_gather_patches(const PatchLayout& layout, const scalar_t* images, const int64_t* perm,
                                  scalar_t* columns, cudaStream_t stream);

// grad_images (zero-filled, layout's strides) receives grad_columns [B * (row_prefix + N), K] at the patches perm
// points to (each sample's row_prefix first rows are not read).
template <typename scalar_t>
cudaError_t launch_scatter_patches(const PatchLayout& layout, const scalar_t* grad_columns, const int64_t* perm,
                                   scalar_t* grad_images, cudaStream_t stream);

// out [B, P + N, D] from the GEMM's tokens [B * N, D]: out[b, t] = prefix[t] + (pos[t] if t < Q) for the P prefix
// rows t < prefix_rows (Q = prefix_positions), then out[b, P + n] = tokens[b * N + n] + bias + (unk if mask[b, n] else
// pos[Q + n]). pos: the whole table [Q + N, D]. bias, unk, mask may be null, prefix when P = 0; out may be tokens
// itself when P = 0 (each element is read and written by one thread).
template <typename scalar_t>
cudaError_t launch_add_embeddings(const PatchLayout& layout, const scalar_t* tokens, const scalar_t* bias,
                                  const scalar_t* pos, const scalar_t* unk, const bool* mask, const scalar_t* prefix,
                                  int64_t prefix_rows, int64_t prefix_positions, scalar_t* out, cudaStream_t stream);

// Deterministic sums of grad (B samples of N rows of D, sample b's at grad + b * sample_stride): grad_pos [N, D] over
// unmasked tokens, grad_unk [D] over masked ones, grad_bias [D] over all (null: not wanted). unk_partial /
// bias_partial: accumulate_t [N, D] scratch, needed (non-null) when grad_unk / grad_bias are.
template <typename scalar_t>
cudaError_t launch_reduce_embedding_grads(const PatchLayout& layout, const scalar_t* grad, int64_t sample_stride,
                                          const bool* mask,
                                          scalar_t* grad_pos, scalar_t* grad_unk, scalar_t* grad_bias,
                                          accumulate_t<scalar_t>* unk_partial, accumulate_t<scalar_t>* bias_partial,
                                          cudaStream_t stream);

// ---- The position step on embedded tokens (pos_embed_cuda.cu; the row layout of pos_embed_cpu.cpp).

// B, N, D, P (prefix rows in front of each sample's N patch rows) and Q (0 or P: the table rows of the prefix).
struct PositionLayout {
  int64_t batch, positions, dim, prefix_rows, prefix_positions;
};

// out [B, P + N, D]: out[b, t] = prefix[t] + (pos[t] if t < Q) for t < P; out[b, P + n] = tokens[b, perm[b, n]] +
// (unk if mask[b, n] else pos[Q + n]), the term alone where perm[b, n] is outside [0, N). tokens [B, N, D], perm and
// mask [B, N], pos the whole table [Q + N, D], unk [D], prefix [P, D] (null when P = 0). Each sum in float (double
// when either side is), rounded once.
template <typename token_t, typename out_t>
cudaError_t launch_position_forward(const PositionLayout& layout, const token_t* tokens, const int64_t* perm,
                                    const bool* mask, const out_t* pos, const out_t* unk, const out_t* prefix,
                                    out_t* out, cudaStream_t stream);

// grad_tokens [B, N, D] from grad [B, P + N, D]: row m of sample b gets the gradient of the patch row that showed it
// (zeros where none did; the in-order sum where several did). inverse: int32 [B, N] scratch (N < 2**31).
template <typename grad_t, typename token_t>
cudaError_t launch_position_move_back(const PositionLayout& layout, const grad_t* grad, const int64_t* perm,
                                      int32_t* inverse, token_t* grad_tokens, cudaStream_t stream);

// Deterministic sums of grad [B, P + N, D] over b, in order: table [Q + N, D] (a prefix row's sum, then each
// position's over its unmasked samples), unk [D] (the masked ones', through unk_partial [N, D] scratch, summed over
// n in order) and prefix_sum [P, D]; null outputs are not computed (unk_partial is needed with unk).
template <typename grad_t, typename acc_t>
cudaError_t launch_position_reduce(const PositionLayout& layout, const grad_t* grad, const bool* mask, acc_t* table,
                                   acc_t* unk_partial, acc_t* unk, acc_t* prefix_sum, cudaStream_t stream);

// ---- The DAL loss with the nonlinear regressor (dal_loss_cuda.cu; dal_loss.cpp's contract), in T = float or double.

// N regressed positions of D features, H hidden units, B samples in the mask (0 without one).
struct DalShape {
  int64_t positions, dim, hidden, batch;
};

// pos: the regressed rows [N, D]; w1 [H, D], b1 [H] (or null), w2 [2, H], b2 [2] (or null), coords [N, 2], mask bool
// [B, N] (or null); all contiguous. Writes loss [], pred [N, 2], hidden [N, H] and weights [N].
template <typename T>
cudaError_t launch_dal_forward(const DalShape& shape, const T* pos, const T* w1, const T* b1, const T* w2,
                               const T* b2, const T* coords, const bool* mask, double scale, T* loss, T* pred,
                               T* hidden, T* weights, cudaStream_t stream);

// grad: the loss's gradient, one element in device memory (read by the kernel: no host sync); pred, hidden and
// weights: the forward's. Writes grad_table [skip_rows + N, D] (zeros in the skipped rows), grad_w1 [H, D], grad_b1
// [H] (null: not wanted), grad_w2 [2, H], grad_b2 [2] (null: not wanted), through d_hidden [N, H] scratch.
template <typename T>
cudaError_t launch_dal_backward(const DalShape& shape, int64_t skip_rows, const T* grad, double scale, const T* pos,
                                const T* w1, const T* w2, const T* coords, const T* pred, const T* hidden,
                                const T* weights, T* d_hidden, T* grad_table, T* grad_w1, T* grad_b1, T* grad_w2,
                                T* grad_b2, cudaStream_t stream);

}  // namespace cuda
}  // namespace mjp
