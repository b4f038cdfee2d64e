// CUDA kernels of the MJP patch embedding: gather-im2col, the fused epilogue, the patch scatter of the image
// gradient, and the deterministic (fixed-order, atomic-free) reductions of the embedding gradients. The GEMMs
// are cuBLAS, called through at::mm in cuda_ops.cpp.
#include <algorithm>
#include <type_traits>

#include "cuda_grid.cuh"
#include "cuda_kernels.h"

namespace mjp {
namespace cuda {
namespace {

// The patch copies (gather and scatter) move each patch row, `patch` pixels contiguous in the image and in the
// im2col row, in chunks of kBytes: 16-byte loads and stores where the sizes and addresses allow (a bf16 16-pixel row
// is two chunks), else smaller ones. One thread per chunk, its indices in 32-bit arithmetic when the tensors allow:
// the first version, one thread per element with five 64-bit divisions each, took 0.8 ms for DeiT-S's batch of 256
// on an H100, about 15 times the time its 154 MB of traffic need.
template <int kBytes>
using Chunk = std::conditional_t<
    kBytes == 16, uint4, std::conditional_t<kBytes == 8, uint2, std::conditional_t<kBytes == 4, uint32_t, uint16_t>>>;

// Where chunk q of the im2col matrix comes from: its image element offset, or -1 for a row no patch fills (a prefix
// row, or an out-of-range perm entry). Chunk q covers the im2col elements [q * elements, (q + 1) * elements),
// elements = kBytes / sizeof(scalar_t); a patch row holds chunks_per_row of them.
template <typename index_t>
__device__ __forceinline__ int64_t chunk_source(const PatchLayout& l, const int64_t* __restrict__ perm, index_t q,
                                                index_t elements, index_t chunks_per_row, index_t rows_per_patch) {
  const index_t segment = q / chunks_per_row;  // (b * (P + N) + t) * C * patch + c * patch + py
  const index_t px = (q - segment * chunks_per_row) * elements;
  const index_t row = segment / rows_per_patch;  // b * (P + N) + t
  const index_t within = segment - row * rows_per_patch;
  const index_t c = within / static_cast<index_t>(l.patch);
  const index_t py = within - c * static_cast<index_t>(l.patch);
  const index_t rows_per_sample = static_cast<index_t>(l.row_prefix + l.positions);
  const index_t b = row / rows_per_sample;
  const index_t t = row - b * rows_per_sample;
  if (t < static_cast<index_t>(l.row_prefix)) return -1;
  const index_t n = t - static_cast<index_t>(l.row_prefix);
  const int64_t m = perm == nullptr ? static_cast<int64_t>(n) : perm[static_cast<int64_t>(b) * l.positions + n];
  if (m < 0 || m >= l.positions) return -1;
  const index_t grid_row = static_cast<index_t>(m) / static_cast<index_t>(l.cols);
  const index_t grid_col = static_cast<index_t>(m) - grid_row * static_cast<index_t>(l.cols);
  return static_cast<int64_t>(b) * l.batch_stride + static_cast<int64_t>(c) * l.channel_stride +
         (static_cast<int64_t>(grid_row) * l.patch + py) * l.height_stride +
         static_cast<int64_t>(grid_col) * l.patch + px;
}

// kGather: columns [B * (P + N), K] (to) from the images (from), zero rows where no patch is shown; else grad_images
// (to) from grad_columns (from), writing nothing for those rows.
template <typename scalar_t, int kBytes, typename index_t, bool kGather>
__global__ void copy_patches_kernel(PatchLayout l, index_t chunks, index_t chunks_per_row, index_t rows_per_patch,
                                    const scalar_t* __restrict__ from, const int64_t* __restrict__ perm,
                                    scalar_t* __restrict__ to) {
  using chunk_t = Chunk<kBytes>;
  constexpr index_t elements = kBytes / sizeof(scalar_t);
  MJP_GRID_STRIDE_LOOP_AS(index_t, q, chunks) {
    const int64_t offset = chunk_source(l, perm, q, elements, chunks_per_row, rows_per_patch);
    const int64_t column = static_cast<int64_t>(q) * elements;
    if constexpr (kGather) {
      chunk_t value{};  // zeros for an out-of-range perm entry
      if (offset >= 0) value = *reinterpret_cast<const chunk_t*>(from + offset);
      *reinterpret_cast<chunk_t*>(to + column) = value;
    } else {
      if (offset >= 0) *reinterpret_cast<chunk_t*>(to + offset) = *reinterpret_cast<const chunk_t*>(from + column);
    }
  }
}

template <typename scalar_t, int kBytes, bool kGather>
cudaError_t launch_copy_chunks(const PatchLayout& l, const scalar_t* from, const int64_t* perm, scalar_t* to,
                               cudaStream_t stream) {
  constexpr int64_t elements = kBytes / static_cast<int64_t>(sizeof(scalar_t));
  const int64_t total = l.batch * (l.row_prefix + l.positions) * l.patch_size;
  const int64_t chunks = total / elements, chunks_per_row = l.patch / elements, rows_per_patch = l.patch_size / l.patch;
  // chunk_source's arithmetic reaches at most the element count, N or a grid size
  with_index_type(total, [&](auto zero) {
    using index_t = decltype(zero);
    MJP_LAUNCH(blocks_for(chunks), kThreads, 0, stream, copy_patches_kernel<scalar_t, kBytes, index_t, kGather>)(
        l, static_cast<index_t>(chunks), static_cast<index_t>(chunks_per_row), static_cast<index_t>(rows_per_patch),
        from, perm, to);
  });
  return cudaGetLastError();
}

// The widest chunk (16 bytes down to one element) that divides a patch row and every image stride, and that both
// base addresses (the images' and the im2col matrix's) are aligned to.
template <typename scalar_t>
int64_t chunk_bytes(const PatchLayout& l, const void* from, const void* to) {
  const int64_t size = static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t bytes = 16; bytes > size; bytes /= 2) {
    const auto divides = [&](int64_t elements) { return elements * size % bytes == 0; };
    if (divides(l.patch) && divides(l.batch_stride) && divides(l.channel_stride) && divides(l.height_stride) &&
        reinterpret_cast<uintptr_t>(from) % bytes == 0 && reinterpret_cast<uintptr_t>(to) % bytes == 0) {
      return bytes;
    }
  }
  return size;
}

template <typename scalar_t, bool kGather>
cudaError_t launch_copy_patches(const PatchLayout& l, const scalar_t* from, const int64_t* perm, scalar_t* to,
                                cudaStream_t stream) {
  if (l.batch * (l.row_prefix + l.positions) * l.patch_size == 0) return cudaSuccess;
  constexpr int64_t size = sizeof(scalar_t);
  switch (chunk_bytes<scalar_t>(l, from, to)) {
    case 16:
      return launch_copy_chunks<scalar_t, 16, kGather>(l, from, perm, to, stream);
    case 8:
      if constexpr (size <= 8) return launch_copy_chunks<scalar_t, 8, kGather>(l, from, perm, to, stream);
      break;
    case 4:
      if constexpr (size <= 4) return launch_copy_chunks<scalar_t, 4, kGather>(l, from, perm, to, stream);
      break;
    default:
      break;
  }
  return launch_copy_chunks<scalar_t, size, kGather>(l, from, perm, to, stream);
}

// One thread per V elements (a chunk) of out [B, P + N, D]: a prefix row t < P gets prefix[t, d] + (pos[t, d] if t <
// Q), a patch row P + n gets tokens[b * N + n, d] + bias[d] + (unk[d] if mask[b, n] else pos[Q + n, d]); in
// accumulate_t, rounded once. tokens and out may be the same memory (P = 0: each chunk is read and written by one
// thread), so no __restrict__ on them. V = 16 bytes of elements where D and every pointer allow (cuda_ops.cpp's
// choice), and 32-bit indices below 2**31 elements: the first version, one element per thread with two 64-bit
// divisions, took 146 us for DeiT-S's bf16 batch of 256 on an H100, about five times its traffic's time.
template <typename scalar_t, int V, typename index_t>
__global__ void add_embeddings_kernel(index_t chunks, index_t chunks_per_row, index_t positions, index_t prefix_rows,
                                      index_t prefix_positions, const scalar_t* tokens,
                                      const scalar_t* __restrict__ bias, const scalar_t* __restrict__ pos,
                                      const scalar_t* __restrict__ unk, const bool* __restrict__ mask,
                                      const scalar_t* __restrict__ prefix, scalar_t* out) {
  using acc = accumulate_t<scalar_t>;
  using pack = Pack<scalar_t, V>;
  const index_t rows_per_sample = prefix_rows + positions;
  const auto load = [](const scalar_t* from, int64_t row, index_t chunk, int64_t chunks_in_row) {
    return reinterpret_cast<const pack*>(from)[row * chunks_in_row + chunk];
  };
  MJP_GRID_STRIDE_LOOP_AS(index_t, q, chunks) {
    const auto [row, chunk, b, t] = place_of(q, chunks_per_row, rows_per_sample);  // row = b * (P + N) + t
    acc value[V];
    const auto start = [&](const pack& term) {
#pragma unroll
      for (int j = 0; j < V; ++j) value[j] = static_cast<acc>(term.v[j]);
    };
    const auto add = [&](const pack& term) {
#pragma unroll
      for (int j = 0; j < V; ++j) value[j] += static_cast<acc>(term.v[j]);
    };
    if (t < prefix_rows) {
      start(load(prefix, t, chunk, chunks_per_row));
      if (t < prefix_positions) add(load(pos, t, chunk, chunks_per_row));
    } else {
      const index_t n = t - prefix_rows;
      const int64_t token_row = static_cast<int64_t>(b) * positions + n;
      start(load(tokens, token_row, chunk, chunks_per_row));
      if (bias != nullptr) add(load(bias, 0, chunk, chunks_per_row));
      if (mask != nullptr && mask[token_row]) {
        if (unk != nullptr) add(load(unk, 0, chunk, chunks_per_row));
      } else {
        add(load(pos, prefix_positions + n, chunk, chunks_per_row));
      }
    }
    pack result;
#pragma unroll
    for (int j = 0; j < V; ++j) result.v[j] = static_cast<scalar_t>(value[j]);
    reinterpret_cast<pack*>(out)[static_cast<int64_t>(q)] = result;
  }
}

// Pass 1, one thread per (n, d), summing over b in order (sample b's rows at grad + b * sample_stride): grad_pos[n, d]
// (unmasked tokens), and the partial sums over b of masked tokens (unk_partial) and of all tokens (bias_partial) for
// pass 2. Null outputs are skipped.
template <typename scalar_t>
__global__ void reduce_over_batch_kernel(int64_t batch, int64_t positions, int64_t dim,
                                         const scalar_t* __restrict__ grad, int64_t sample_stride,
                                         const bool* __restrict__ mask,
                                         scalar_t* __restrict__ grad_pos,
                                         accumulate_t<scalar_t>* __restrict__ unk_partial,
                                         accumulate_t<scalar_t>* __restrict__ bias_partial) {
  using acc = accumulate_t<scalar_t>;
  const int64_t cells = positions * dim;
  MJP_GRID_STRIDE_LOOP(index, cells) {
    const int64_t n = index / dim;
    acc pos_sum = 0, unk_sum = 0;
    split_sum_in_order(
        batch, [&](int64_t b) { return static_cast<acc>(grad[b * sample_stride + index]); },
        [&](int64_t b) { return mask != nullptr && mask[b * positions + n]; }, pos_sum, unk_sum);
    if (grad_pos != nullptr) grad_pos[index] = static_cast<scalar_t>(pos_sum);
    if (unk_partial != nullptr) unk_partial[index] = unk_sum;
    if (bias_partial != nullptr) bias_partial[index] = pos_sum + unk_sum;
  }
}

// Pass 2, one thread per d, summing pass 1's partials over n in order: both sums in one loop, its loads first.
template <typename scalar_t>
__global__ void reduce_over_positions_kernel(int64_t positions, int64_t dim,
                                             const accumulate_t<scalar_t>* __restrict__ unk_partial,
                                             const accumulate_t<scalar_t>* __restrict__ bias_partial,
                                             scalar_t* __restrict__ grad_unk, scalar_t* __restrict__ grad_bias) {
  using acc = accumulate_t<scalar_t>;
  constexpr int kUnroll = 8;
  MJP_GRID_STRIDE_LOOP(d, dim) {
    acc unk_sum = 0, bias_sum = 0;
    int64_t n = 0;
    for (; n + kUnroll <= positions; n += kUnroll) {
      acc unk_values[kUnroll], bias_values[kUnroll];
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        unk_values[j] = grad_unk != nullptr ? unk_partial[(n + j) * dim + d] : acc(0);
        bias_values[j] = grad_bias != nullptr ? bias_partial[(n + j) * dim + d] : acc(0);
      }
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        unk_sum += unk_values[j];
        bias_sum += bias_values[j];
      }
    }
    for (; n < positions; ++n) {
      if (grad_unk != nullptr) unk_sum += unk_partial[n * dim + d];
      if (grad_bias != nullptr) bias_sum += bias_partial[n * dim + d];
    }
    if (grad_unk != nullptr) grad_unk[d] = static_cast<scalar_t>(unk_sum);
    if (grad_bias != nullptr) grad_bias[d] = static_cast<scalar_t>(bias_sum);
  }
}

template <typename scalar_t, int V>
cudaError_t launch_add_embeddings_packed(const PatchLayout& layout, const scalar_t* tokens, const scalar_t* bias,
                                         const scalar_t* pos, const scalar_t* unk, const bool* mask,
                                         const scalar_t* prefix, int64_t prefix_rows, int64_t prefix_positions,
                                         scalar_t* out, cudaStream_t stream) {
  const int64_t total = layout.batch * (prefix_rows + layout.positions) * layout.dim;
  const int64_t chunks = total / V, chunks_per_row = layout.dim / V;
  with_index_type(total, [&](auto zero) {
    using index_t = decltype(zero);
    MJP_LAUNCH(blocks_for(chunks), kThreads, 0, stream, add_embeddings_kernel<scalar_t, V, index_t>)(
        static_cast<index_t>(chunks), static_cast<index_t>(chunks_per_row), static_cast<index_t>(layout.positions),
        static_cast<index_t>(prefix_rows), static_cast<index_t>(prefix_positions), tokens, bias, pos, unk, mask,
        prefix, out);
  });
  return cudaGetLastError();
}

}  // namespace

template <typename scalar_t>
cudaError_t launch_gather_patches(const PatchLayout& layout, const scalar_t* images, const int64_t* perm,
                                  scalar_t* columns, cudaStream_t stream) {
  return launch_copy_patches<scalar_t, true>(layout, images, perm, columns, stream);
}

template <typename scalar_t>
cudaError_t launch_scatter_patches(const PatchLayout& layout, const scalar_t* grad_columns, const int64_t* perm,
                                   scalar_t* grad_images, cudaStream_t stream) {
  return launch_copy_patches<scalar_t, false>(layout, grad_columns, perm, grad_images, stream);
}

template <typename scalar_t>
cudaError_t launch_add_embeddings(const PatchLayout& layout, const scalar_t* tokens, const scalar_t* bias,
                                  const scalar_t* pos, const scalar_t* unk, const bool* mask, const scalar_t* prefix,
                                  int64_t prefix_rows, int64_t prefix_positions, scalar_t* out, cudaStream_t stream) {
  if (layout.batch * (prefix_rows + layout.positions) * layout.dim == 0) return cudaSuccess;
  // 16-byte packs when D fills them and every row of every tensor starts on a 16-byte boundary.
  constexpr int kPack = 16 / sizeof(scalar_t);
  if (layout.dim % kPack == 0 && aligned_16(tokens, bias, pos, unk, prefix, out)) {
    return launch_add_embeddings_packed<scalar_t, kPack>(layout, tokens, bias, pos, unk, mask, prefix, prefix_rows,
                                                         prefix_positions, out, stream);
  }
  return launch_add_embeddings_packed<scalar_t, 1>(layout, tokens, bias, pos, unk, mask, prefix, prefix_rows,
                                                   prefix_positions, out, stream);
}

template <typename scalar_t>
cudaError_t launch_reduce_embedding_grads(const PatchLayout& layout, const scalar_t* grad, int64_t sample_stride,
                                          const bool* mask,
                                          scalar_t* grad_pos, scalar_t* grad_unk, scalar_t* grad_bias,
                                          accumulate_t<scalar_t>* unk_partial, accumulate_t<scalar_t>* bias_partial,
                                          cudaStream_t stream) {
  const int64_t cells = layout.positions * layout.dim;
  if (cells > 0) {
    MJP_LAUNCH(blocks_for(cells), kThreads, 0, stream, reduce_over_batch_kernel<scalar_t>)(
        layout.batch, layout.positions, layout.dim, grad, sample_stride, mask, grad_pos,
        grad_unk != nullptr ? unk_partial : nullptr,
        grad_bias != nullptr ? bias_partial : nullptr);
    const cudaError_t status = cudaGetLastError();
    if (status != cudaSuccess) return status;
  }
  if ((grad_unk != nullptr || grad_bias != nullptr) && layout.dim > 0) {
    MJP_LAUNCH(blocks_for(layout.dim), kThreads, 0, stream, reduce_over_positions_kernel<scalar_t>)(
        layout.positions, layout.dim, unk_partial, bias_partial, grad_unk, grad_bias);
    return cudaGetLastError();
  }
  return cudaSuccess;
}

#define MJP_INSTANTIATE_PATCH_EMBED_LAUNCHERS(scalar_t)                                                              \
  template cudaError_t launch_gather_patches<scalar_t>(const PatchLayout&, const scalar_t*, const int64_t*,          \
                                                       scalar_t*, cudaStream_t);                                     \
  template cudaError_t launch_scatter_patches<scalar_t>(const PatchLayout&, const scalar_t*, const int64_t*,         \
                                                        scalar_t*, cudaStream_t);                                    \
  template cudaError_t launch_add_embeddings<scalar_t>(const PatchLayout&, const scalar_t*, const scalar_t*,         \
                                                       const scalar_t*, const scalar_t*, const bool*,                \
                                                       const scalar_t*, int64_t, int64_t, scalar_t*, cudaStream_t);  \
  template cudaError_t launch_reduce_embedding_grads<scalar_t>(                                                      \
      const PatchLayout&, const scalar_t*, int64_t, const bool*, scalar_t*, scalar_t*, scalar_t*,                    \
      accumulate_t<scalar_t>*, accumulate_t<scalar_t>*, cudaStream_t);

MJP_INSTANTIATE_PATCH_EMBED_LAUNCHERS(float)
MJP_INSTANTIATE_PATCH_EMBED_LAUNCHERS(double)
MJP_INSTANTIATE_PATCH_EMBED_LAUNCHERS(c10::Half)
MJP_INSTANTIATE_PATCH_EMBED_LAUNCHERS(c10::BFloat16)

}  // namespace cuda
}  // namespace mjp
