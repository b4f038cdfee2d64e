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

// The elementwise kernels (forward, move back) take V elements of a row per thread (16 bytes of the wider dtype
// where D and every pointer allow, cuda_ops.cpp's launchers decide) and index in 32 bits below 2**31 elements: the
// patch embedding's epilogue, written as one element per thread with 64-bit divisions, took five times its traffic's
// time on an H100, and these were written the same way.

// One thread per V elements of out [B, P + N, D]. A prefix row t < P: prefix[t] + pos[t] when t < Q, else prefix[t];
// a patch row P + n: tokens[b, perm[b, n]] + (unk if mask[b, n] else pos[Q + n]), or the term alone when perm[b, n] is
// outside [0, N) (validate=False only); each sum rounded once.
template <typename token_t, typename out_t, int V, typename index_t>
__global__ void position_forward_kernel(PositionLayout l, index_t chunks, index_t chunks_per_row,
                                        const token_t* __restrict__ tokens, const int64_t* __restrict__ perm,
                                        const bool* __restrict__ mask, const out_t* __restrict__ pos,
                                        const out_t* __restrict__ unk, const out_t* __restrict__ prefix,
                                        out_t* __restrict__ out) {
  using acc = sum_t<token_t, out_t>;
  using out_pack = Pack<out_t, V>;
  using token_pack = Pack<token_t, V>;
  const index_t positions = static_cast<index_t>(l.positions), prefix_rows = static_cast<index_t>(l.prefix_rows);
  const index_t rows_per_sample = prefix_rows + positions;
  const auto* pos_packs = reinterpret_cast<const out_pack*>(pos);
  MJP_GRID_STRIDE_LOOP_AS(index_t, q, chunks) {
    const auto [row, chunk, b, t] = place_of(q, chunks_per_row, rows_per_sample);  // row = b * (P + N) + t
    out_pack result;
    if (t < prefix_rows) {
      result = reinterpret_cast<const out_pack*>(prefix)[static_cast<int64_t>(t) * chunks_per_row + chunk];
      if (t < static_cast<index_t>(l.prefix_positions)) {
        const out_pack row_pos = pos_packs[static_cast<int64_t>(t) * chunks_per_row + chunk];
#pragma unroll
        for (int j = 0; j < V; ++j) {
          result.v[j] = static_cast<out_t>(static_cast<acc>(result.v[j]) + static_cast<acc>(row_pos.v[j]));
        }
      }
    } else {
      const int64_t flat = static_cast<int64_t>(b) * positions + (t - prefix_rows);  // b * N + n
      const out_pack term =
          mask[flat] ? reinterpret_cast<const out_pack*>(unk)[chunk]
                     : pos_packs[(l.prefix_positions + static_cast<int64_t>(t - prefix_rows)) * chunks_per_row + chunk];
      const int64_t source = perm[flat];
      if (source < 0 || source >= l.positions) {
        result = term;
      } else {
        const token_pack token = reinterpret_cast<const token_pack*>(
            tokens)[(static_cast<int64_t>(b) * positions + source) * chunks_per_row + chunk];
#pragma unroll
        for (int j = 0; j < V; ++j) {
          result.v[j] = static_cast<out_t>(static_cast<acc>(token.v[j]) + static_cast<acc>(term.v[j]));
        }
      }
    }
    reinterpret_cast<out_pack*>(out)[static_cast<int64_t>(q)] = result;
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

// One thread per V elements of grad_tokens [B, N, D]: the gradient of the patch row that showed token m, zero where
// no row did, and where several did (validate=False only) the sum of theirs, positions in order.
template <typename grad_t, typename token_t, int V, typename index_t>
__global__ void position_move_back_kernel(PositionLayout l, index_t chunks, index_t chunks_per_row,
                                          const grad_t* __restrict__ grad, const int64_t* __restrict__ perm,
                                          const int32_t* __restrict__ inverse, token_t* __restrict__ grad_tokens) {
  using acc = sum_t<grad_t, token_t>;
  using grad_pack = Pack<grad_t, V>;
  using token_pack = Pack<token_t, V>;
  const index_t positions = static_cast<index_t>(l.positions);
  MJP_GRID_STRIDE_LOOP_AS(index_t, q, chunks) {
    const auto [row, chunk, b, m] = place_of(q, chunks_per_row, positions);  // row = b * N + m
    // sample b's patch rows, in packs: row n of them at sample[n * chunks_per_row]
    const grad_pack* sample = reinterpret_cast<const grad_pack*>(grad) +
                              (static_cast<int64_t>(b) * (l.prefix_rows + l.positions) + l.prefix_rows) *
                                  chunks_per_row + chunk;
    const int32_t n = inverse[row];
    token_pack result;
    if (n >= 0) {
      const grad_pack value = sample[static_cast<int64_t>(n) * chunks_per_row];
#pragma unroll
      for (int j = 0; j < V; ++j) result.v[j] = static_cast<token_t>(value.v[j]);
    } else if (n == -1) {
#pragma unroll
      for (int j = 0; j < V; ++j) result.v[j] = static_cast<token_t>(0.0f);
    } else {
      acc sums[V];
#pragma unroll
      for (int j = 0; j < V; ++j) sums[j] = 0;
      for (int64_t k = 0; k < l.positions; ++k) {
        if (perm[static_cast<int64_t>(b) * positions + k] != m) continue;
        const grad_pack value = sample[k * chunks_per_row];
#pragma unroll
        for (int j = 0; j < V; ++j) sums[j] += static_cast<acc>(value.v[j]);
      }
#pragma unroll
      for (int j = 0; j < V; ++j) result.v[j] = static_cast<token_t>(sums[j]);
    }
    reinterpret_cast<token_pack*>(grad_tokens)[static_cast<int64_t>(q)] = result;
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
    split_sum_in_order(
        l.batch, [&](int64_t b) { return static_cast<acc_t>(grad[b * rows_per_sample * l.dim + index]); },
        [&](int64_t b) { return mask[b * l.positions + n]; }, kept, masked);
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
#pragma unroll 8
    for (int64_t n = 0; n < positions; ++n) sum += unk_partial[n * dim + d];
    unk[d] = sum;
  }
}

}  // namespace

// The pack width of two dtypes: 16 bytes of the wider one.
template <typename first_t, typename second_t>
constexpr int pack_of() {
  return 16 / static_cast<int>(sizeof(first_t) > sizeof(second_t) ? sizeof(first_t) : sizeof(second_t));
}

template <typename token_t, typename out_t, int V>
cudaError_t launch_position_forward_packed(const PositionLayout& layout, const token_t* tokens, const int64_t* perm,
                                           const bool* mask, const out_t* pos, const out_t* unk, const out_t* prefix,
                                           out_t* out, cudaStream_t stream) {
  const int64_t total = layout.batch * (layout.prefix_rows + layout.positions) * layout.dim;
  const int64_t chunks = total / V, chunks_per_row = layout.dim / V;
  with_index_type(total, [&](auto zero) {
    using index_t = decltype(zero);
    MJP_LAUNCH(blocks_for(chunks), kThreads, 0, stream, position_forward_kernel<token_t, out_t, V, index_t>)(
        layout, static_cast<index_t>(chunks), static_cast<index_t>(chunks_per_row), tokens, perm, mask, pos, unk,
        prefix, out);
  });
  return cudaGetLastError();
}

template <typename token_t, typename out_t>
cudaError_t launch_position_forward(const PositionLayout& layout, const token_t* tokens, const int64_t* perm,
                                    const bool* mask, const out_t* pos, const out_t* unk, const out_t* prefix,
                                    out_t* out, cudaStream_t stream) {
  const int64_t total = layout.batch * (layout.prefix_rows + layout.positions) * layout.dim;
  if (total == 0) return cudaSuccess;
  constexpr int kPack = pack_of<token_t, out_t>();
  if (layout.dim % kPack == 0 && aligned_16(tokens, pos, unk, prefix, out)) {
    return launch_position_forward_packed<token_t, out_t, kPack>(layout, tokens, perm, mask, pos, unk, prefix, out,
                                                                  stream);
  }
  return launch_position_forward_packed<token_t, out_t, 1>(layout, tokens, perm, mask, pos, unk, prefix, out, stream);
}

template <typename grad_t, typename token_t, int V>
cudaError_t launch_move_back_packed(const PositionLayout& layout, const grad_t* grad, const int64_t* perm,
                                    const int32_t* inverse, token_t* grad_tokens, cudaStream_t stream) {
  const int64_t total = layout.batch * layout.positions * layout.dim;
  const int64_t chunks = total / V, chunks_per_row = layout.dim / V;
  // the chunk index, and the rows of grad [B, P + N, D] (its element count may exceed the tokens')
  with_index_type(layout.batch * (layout.prefix_rows + layout.positions) * layout.dim, [&](auto zero) {
    using index_t = decltype(zero);
    MJP_LAUNCH(blocks_for(chunks), kThreads, 0, stream, position_move_back_kernel<grad_t, token_t, V, index_t>)(
        layout, static_cast<index_t>(chunks), static_cast<index_t>(chunks_per_row), grad, perm, inverse,
        grad_tokens);
  });
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
  constexpr int kPack = pack_of<grad_t, token_t>();
  if (layout.dim % kPack == 0 && aligned_16(grad, grad_tokens)) {
    return launch_move_back_packed<grad_t, token_t, kPack>(layout, grad, perm, inverse, grad_tokens, stream);
  }
  return launch_move_back_packed<grad_t, token_t, 1>(layout, grad, perm, inverse, grad_tokens, stream);
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
