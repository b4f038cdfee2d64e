// CUDA kernels of the MJP position step on embedded tokens (the layout of pos_embed_cpu.cpp): the move of the tokens
// plus their position term, the prefix rows in front; backward, the inverse move and the deterministic
// (fixed-order, atomic-free) sums of the position gradients. Each sum runs in the order the CPU kernel takes it
// (samples in order, then positions in order), in the same accumulation type, so the two backends agree bit for bit
// in float32. The tensor-level glue is in cuda_ops.cpp.
#include <type_traits>

#include "cuda_grid.cuh"
#include "cuda_kernels.h"

namespace mjp {
namespace cuda {
namespace {

// The type two values of types A and B are added in: double when either is, float otherwise (as the CPU kernel).
template <typename A, typename B>
using sum_t = std::conditional_t<std::is_same_v<A, double> || std::is_same_v<B, double>, double, float>;

// One thread per element of out [B, P + N, D]. A prefix row t < P: prefix[t] + pos[t] when t < Q, else prefix[t]; a
// patch row P + n: tokens[b, perm[b, n]] + (unk if mask[b, n] else pos[Q + n]), or the term alone when perm[b, n] is
// outside [0, N) (validate=False only); each sum rounded once.
template <typename token_t, typename out_t>
__global__ void position_forward_kernel(PositionLayout l, int64_t total, const token_t* __restrict__ tokens,
                                        const int64_t* __restrict__ perm, const bool* __restrict__ mask,
                                        const out_t* __restrict__ pos, const out_t* __restrict__ unk,
                                        const out_t* __restrict__ prefix, out_t* __restrict__ out) {
  using acc = sum_t<token_t, out_t>;
  const int64_t rows_per_sample = l.prefix_rows + l.positions;
  MJP_GRID_STRIDE_LOOP(index, total) {
    const int64_t row = index / l.dim;  // b * (P + N) + t
    const int64_t d = index - row * l.dim;
    const int64_t b = row / rows_per_sample;
    const int64_t t = row - b * rows_per_sample;
    if (t < l.prefix_rows) {
      const out_t value = prefix[t * l.dim + d];
      out[index] = t < l.prefix_positions
                       ? static_cast<out_t>(static_cast<acc>(value) + static_cast<acc>(pos[t * l.dim + d]))
                       : value;
      continue;
    }
    const int64_t flat = b * l.positions + (t - l.prefix_rows);  // b * N + n
    const out_t term = mask[flat] ? unk[d] : pos[(l.prefix_positions + t - l.prefix_rows) * l.dim + d];
    const int64_t source = perm[flat];
    if (source < 0 || source >= l.positions) {
      out[index] = term;
      continue;
    }
    const token_t token = tokens[(b * l.positions + source) * l.dim + d];
    out[index] = static_cast<out_t>(static_cast<acc>(token) + static_cast<acc>(term));
  }
}

// One thread per (b, n): inverse[b, perm[b, n]] = n when it is the only such n, -2 when there are several. Starts
// from -1 everywhere (no n). A later writer finds the slot taken (not -1) and marks it -2; nothing turns -2 back.
__global__ void inverse_perm_kernel(int64_t total, int64_t positions, const int64_t* __restrict__ perm,
                                    int32_t* __restrict__ inverse) {
  MJP_GRID_STRIDE_LOOP(row, total) {
    const int64_t source = perm[row];
    if (source < 0 || source >= positions) continue;
    const int64_t b = row / positions;
    int32_t* slot = inverse + b * positions + source;
    if (atomicCAS(slot, -1, static_cast<int32_t>(row - b * positions)) != -1) atomicExch(slot, -2);
  }
}

// One thread per element of grad_tokens [B, N, D]: the gradient of the patch row that showed token m, zero where no
// row did, and where several did (validate=False only) the sum of theirs, positions in order.
template <typename grad_t, typename token_t>
__global__ void position_move_back_kernel(PositionLayout l, int64_t total, const grad_t* __restrict__ grad,
                                          const int64_t* __restrict__ perm, const int32_t* __restrict__ inverse,
                                          token_t* __restrict__ grad_tokens) {
  using acc = sum_t<grad_t, token_t>;
  MJP_GRID_STRIDE_LOOP(index, total) {
    const int64_t row = index / l.dim;  // b * N + m
    const int64_t d = index - row * l.dim;
    const int64_t b = row / l.positions;
    const int64_t m = row - b * l.positions;
    const grad_t* sample = grad + (b * (l.prefix_rows + l.positions) + l.prefix_rows) * l.dim + d;
    const int32_t n = inverse[row];
    if (n >= 0) {
      grad_tokens[index] = static_cast<token_t>(sample[n * l.dim]);
    } else if (n == -1) {
      grad_tokens[index] = static_cast<token_t>(0.0f);
    } else {
      acc sum = 0;
      for (int64_t k = 0; k < l.positions; ++k) {
        if (perm[b * l.positions + k] == m) sum += static_cast<acc>(sample[k * l.dim]);
      }
      grad_tokens[index] = static_cast<token_t>(sum);
    }
  }
}

// Pass 1, one thread per (t, d) of a sample's P + N rows, summing over b in order: a prefix row's sum into
// prefix_sum[t] (and table[t] when t < Q); a patch row's unmasked samples into table[Q + n], its masked ones into
// unk_partial[n] (pass 2 sums those over n).
template <typename grad_t, typename acc_t>
__global__ void position_reduce_kernel(PositionLayout l, const grad_t* __restrict__ grad,
                                       const bool* __restrict__ mask, acc_t* __restrict__ table,
                                       acc_t* __restrict__ unk_partial, acc_t* __restrict__ prefix_sum) {
  const int64_t rows_per_sample = l.prefix_rows + l.positions;
  MJP_GRID_STRIDE_LOOP(index, rows_per_sample * l.dim) {
    const int64_t t = index / l.dim;
    const int64_t d = index - t * l.dim;
    acc_t kept = 0, masked = 0;
    if (t < l.prefix_rows) {
      for (int64_t b = 0; b < l.batch; ++b) kept += static_cast<acc_t>(grad[b * rows_per_sample * l.dim + index]);
      if (prefix_sum != nullptr) prefix_sum[index] = kept;
      if (table != nullptr && t < l.prefix_positions) table[index] = kept;
      continue;
    }
    const int64_t n = t - l.prefix_rows;
    for (int64_t b = 0; b < l.batch; ++b) {
      const acc_t value = static_cast<acc_t>(grad[b * rows_per_sample * l.dim + index]);
      if (mask[b * l.positions + n]) {
        masked += value;
      } else {
        kept += value;
      }
    }
    if (table != nullptr) table[(l.prefix_positions + n) * l.dim + d] = kept;
    if (unk_partial != nullptr) unk_partial[n * l.dim + d] = masked;
  }
}

// Pass 2, one thread per d: unk[d] = the sum over n of unk_partial[n, d], in order.
template <typename acc_t>
__global__ void sum_over_positions_kernel(int64_t positions, int64_t dim, const acc_t* __restrict__ unk_partial,
                                          acc_t* __restrict__ unk) {
  MJP_GRID_STRIDE_LOOP(d, dim) {
    acc_t sum = 0;
    for (int64_t n = 0; n < positions; ++n) sum += unk_partial[n * dim + d];
    unk[d] = sum;
  }
}

}  // namespace

template <typename token_t, typename out_t>
cudaError_t launch_position_forward(const PositionLayout& layout, const token_t* tokens, const int64_t* perm,
                                    const bool* mask, const out_t* pos, const out_t* unk, const out_t* prefix,
                                    out_t* out, cudaStream_t stream) {
  const int64_t total = layout.batch * (layout.prefix_rows + layout.positions) * layout.dim;
  if (total == 0) return cudaSuccess;
  MJP_LAUNCH(blocks_for(total), kThreads, 0, stream, position_forward_kernel<token_t, out_t>)(
      layout, total, tokens, perm, mask, pos, unk, prefix, out);
  return cudaGetLastError();
}

template <typename grad_t, typename token_t>
cudaError_t launch_position_move_back(const PositionLayout& layout, const grad_t* grad, const int64_t* perm,
                                      int32_t* inverse, token_t* grad_tokens, cudaStream_t stream) {
  const int64_t rows = layout.batch * layout.positions;
  if (rows == 0 || layout.dim == 0) return cudaSuccess;
  // Every byte 0xFF: -1 in each int32, "no position shows this token".
  cudaError_t status = cudaMemsetAsync(inverse, 0xFF, rows * sizeof(int32_t), stream);
  if (status != cudaSuccess) return status;
  MJP_LAUNCH(blocks_for(rows), kThreads, 0, stream, inverse_perm_kernel)(rows, layout.positions, perm, inverse);
  status = cudaGetLastError();
  if (status != cudaSuccess) return status;
  const int64_t total = rows * layout.dim;
  MJP_LAUNCH(blocks_for(total), kThreads, 0, stream, position_move_back_kernel<grad_t, token_t>)(
      layout, total, grad, perm, inverse, grad_tokens);
  return cudaGetLastError();
}

template <typename grad_t, typename acc_t>
cudaError_t launch_position_reduce(const PositionLayout& layout, const grad_t* grad, const bool* mask, acc_t* table,
                                   acc_t* unk_partial, acc_t* unk, acc_t* prefix_sum, cudaStream_t stream) {
  const int64_t cells = (layout.prefix_rows + layout.positions) * layout.dim;
  if (cells > 0) {
    MJP_LAUNCH(blocks_for(cells), kThreads, 0, stream, position_reduce_kernel<grad_t, acc_t>)(
        layout, grad, mask, table, unk != nullptr ? unk_partial : nullptr, prefix_sum);
    const cudaError_t status = cudaGetLastError();
    if (status != cudaSuccess) return status;
  }
  if (unk != nullptr && layout.dim > 0) {
    MJP_LAUNCH(blocks_for(layout.dim), kThreads, 0, stream, sum_over_positions_kernel<acc_t>)(
        layout.positions, layout.dim, unk_partial, unk);
    return cudaGetLastError();
  }
  return cudaSuccess;
}

#define MJP_INSTANTIATE_POSITION_PAIR(first_t, second_t)                                                           \
  template cudaError_t launch_position_forward<first_t, second_t>(const PositionLayout&, const first_t*,           \
                                                                  const int64_t*, const bool*, const second_t*,    \
                                                                  const second_t*, const second_t*, second_t*,     \
                                                                  cudaStream_t);                                   \
  template cudaError_t launch_position_move_back<first_t, second_t>(const PositionLayout&, const first_t*,         \
                                                                    const int64_t*, int32_t*, second_t*,           \
                                                                    cudaStream_t);

#define MJP_INSTANTIATE_POSITION_LAUNCHERS(first_t)      \
  MJP_INSTANTIATE_POSITION_PAIR(first_t, float)          \
  MJP_INSTANTIATE_POSITION_PAIR(first_t, double)         \
  MJP_INSTANTIATE_POSITION_PAIR(first_t, c10::Half)      \
  MJP_INSTANTIATE_POSITION_PAIR(first_t, c10::BFloat16)  \
  template cudaError_t launch_position_reduce<first_t, float>(const PositionLayout&, const first_t*, const bool*,  \
                                                              float*, float*, float*, float*, cudaStream_t);      \
  template cudaError_t launch_position_reduce<first_t, double>(const PositionLayout&, const first_t*, const bool*, \
                                                               double*, double*, double*, double*, cudaStream_t);

MJP_INSTANTIATE_POSITION_LAUNCHERS(float)
MJP_INSTANTIATE_POSITION_LAUNCHERS(double)
MJP_INSTANTIATE_POSITION_LAUNCHERS(c10::Half)
MJP_INSTANTIATE_POSITION_LAUNCHERS(c10::BFloat16)

}  // namespace cuda
}  // namespace mjp
