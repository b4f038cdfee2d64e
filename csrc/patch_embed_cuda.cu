// CUDA kernels of the MJP patch embedding: gather-im2col, the fused epilogue, the patch scatter of the image
// gradient, and the deterministic (fixed-order, atomic-free) reductions of the embedding gradients. The GEMMs
// are cuBLAS, called through at::mm in cuda_ops.cpp.
#include <algorithm>

#include "cuda_grid.cuh"
#include "cuda_kernels.h"

namespace mjp {
namespace cuda {
namespace {

// Image offset of element k = (c, py, px) of the patch that im2col row `row` (= b * N + n) shows, or -1 for an
// out-of-range perm entry.
__device__ __forceinline__ int64_t image_offset(const PatchLayout& l, const int64_t* __restrict__ perm, int64_t row,
                                                int64_t k) {
  const int64_t b = row / l.positions;
  const int64_t n = row - b * l.positions;
  const int64_t m = perm == nullptr ? n : perm[row];
  if (m < 0 || m >= l.positions) return -1;
  const int64_t grid_row = m / l.cols, grid_col = m - grid_row * l.cols;
  const int64_t area = l.patch * l.patch;
  const int64_t c = k / area;
  const int64_t within = k - c * area;
  const int64_t py = within / l.patch, px = within - py * l.patch;
  return b * l.batch_stride + c * l.channel_stride + (grid_row * l.patch + py) * l.height_stride +
         grid_col * l.patch + px;
}

template <typename scalar_t>
__global__ void gather_patches_kernel(PatchLayout l, int64_t total, const scalar_t* __restrict__ images,
                                      const int64_t* __restrict__ perm, scalar_t* __restrict__ columns) {
  MJP_GRID_STRIDE_LOOP(index, total) {
    const int64_t row = index / l.patch_size;
    const int64_t offset = image_offset(l, perm, row, index - row * l.patch_size);
    columns[index] = offset < 0 ? static_cast<scalar_t>(0.0f) : images[offset];
  }
}

template <typename scalar_t>
__global__ void scatter_patches_kernel(PatchLayout l, int64_t total, const scalar_t* __restrict__ grad_columns,
                                       const int64_t* __restrict__ perm, scalar_t* __restrict__ grad_images) {
  MJP_GRID_STRIDE_LOOP(index, total) {
    const int64_t row = index / l.patch_size;
    const int64_t offset = image_offset(l, perm, row, index - row * l.patch_size);
    if (offset >= 0) grad_images[offset] = grad_columns[index];
  }
}

// One thread per element of out [B, P + N, D]: a prefix row t < P gets prefix[t, d] + (pos[t, d] if t < Q), a patch
// row P + n gets tokens[b * N + n, d] + bias[d] + (unk[d] if mask[b, n] else pos[Q + n, d]); in accumulate_t, rounded
// once. tokens and out may be the same memory (P = 0): no __restrict__ on them.
template <typename scalar_t>
__global__ void add_embeddings_kernel(int64_t total, int64_t positions, int64_t dim, int64_t prefix_rows,
                                      int64_t prefix_positions, const scalar_t* tokens,
                                      const scalar_t* __restrict__ bias, const scalar_t* __restrict__ pos,
                                      const scalar_t* __restrict__ unk, const bool* __restrict__ mask,
                                      const scalar_t* __restrict__ prefix, scalar_t* out) {
  using acc = accumulate_t<scalar_t>;
  const int64_t rows_per_sample = prefix_rows + positions;
  MJP_GRID_STRIDE_LOOP(index, total) {
    const int64_t row = index / dim;  // b * (P + N) + t
    const int64_t d = index - row * dim;
    const int64_t b = row / rows_per_sample;
    const int64_t t = row - b * rows_per_sample;
    acc value;
    if (t < prefix_rows) {
      value = static_cast<acc>(prefix[t * dim + d]);
      if (t < prefix_positions) value += static_cast<acc>(pos[t * dim + d]);
    } else {
      const int64_t n = t - prefix_rows;
      const int64_t token_row = b * positions + n;
      value = static_cast<acc>(tokens[token_row * dim + d]);
      if (bias != nullptr) value += static_cast<acc>(bias[d]);
      if (mask != nullptr && mask[token_row]) {
        if (unk != nullptr) value += static_cast<acc>(unk[d]);
      } else {
        value += static_cast<acc>(pos[(prefix_positions + n) * dim + d]);
      }
    }
    out[index] = static_cast<scalar_t>(value);
  }
}

// Pass 1, one thread per (n, d), summing over b in order: grad_pos[n, d] (unmasked tokens), and the partial sums
// over b of masked tokens (unk_partial) and of all tokens (bias_partial) for pass 2. Null outputs are skipped.
template <typename scalar_t>
__global__ void reduce_over_batch_kernel(int64_t batch, int64_t positions, int64_t dim,
                                         const scalar_t* __restrict__ grad, const bool* __restrict__ mask,
                                         scalar_t* __restrict__ grad_pos,
                                         accumulate_t<scalar_t>* __restrict__ unk_partial,
                                         accumulate_t<scalar_t>* __restrict__ bias_partial) {
  using acc = accumulate_t<scalar_t>;
  MJP_GRID_STRIDE_LOOP(index, positions * dim) {
    const int64_t n = index / dim;
    acc pos_sum = 0, unk_sum = 0;
    for (int64_t b = 0; b < batch; ++b) {
      const acc value = static_cast<acc>(grad[b * positions * dim + index]);
      if (mask != nullptr && mask[b * positions + n]) {
        unk_sum += value;
      } else {
        pos_sum += value;
      }
    }
    if (grad_pos != nullptr) grad_pos[index] = static_cast<scalar_t>(pos_sum);
    if (unk_partial != nullptr) unk_partial[index] = unk_sum;
    if (bias_partial != nullptr) bias_partial[index] = pos_sum + unk_sum;
  }
}

// Pass 2, one thread per d, summing pass 1's partials over n in order.
template <typename scalar_t>
__global__ void reduce_over_positions_kernel(int64_t positions, int64_t dim,
                                             const accumulate_t<scalar_t>* __restrict__ unk_partial,
                                             const accumulate_t<scalar_t>* __restrict__ bias_partial,
                                             scalar_t* __restrict__ grad_unk, scalar_t* __restrict__ grad_bias) {
  using acc = accumulate_t<scalar_t>;
  MJP_GRID_STRIDE_LOOP(d, dim) {
    if (grad_unk != nullptr) {
      acc sum = 0;
      for (int64_t n = 0; n < positions; ++n) sum += unk_partial[n * dim + d];
      grad_unk[d] = static_cast<scalar_t>(sum);
    }
    if (grad_bias != nullptr) {
      acc sum = 0;
      for (int64_t n = 0; n < positions; ++n) sum += bias_partial[n * dim + d];
      grad_bias[d] = static_cast<scalar_t>(sum);
    }
  }
}

}  // namespace

template <typename scalar_t>
cudaError_t launch_gather_patches(const PatchLayout& layout, const scalar_t* images, const int64_t* perm,
                                  scalar_t* columns, cudaStream_t stream) {
  const int64_t total = layout.batch * layout.positions * layout.patch_size;
  if (total == 0) return cudaSuccess;
  gather_patches_kernel<scalar_t><<<blocks_for(total), kThreads, 0, stream>>>(layout, total, images, perm, columns);
  return cudaGetLastError();
}

template <typename scalar_t>
cudaError_t launch_scatter_patches(const PatchLayout& layout, const scalar_t* grad_columns, const int64_t* perm,
                                   scalar_t* grad_images, cudaStream_t stream) {
  const int64_t total = layout.batch * layout.positions * layout.patch_size;
  if (total == 0) return cudaSuccess;
  scatter_patches_kernel<scalar_t>
      <<<blocks_for(total), kThreads, 0, stream>>>(layout, total, grad_columns, perm, grad_images);
  return cudaGetLastError();
}

template <typename scalar_t>
cudaError_t launch_add_embeddings(const PatchLayout& layout, const scalar_t* tokens, const scalar_t* bias,
                                  const scalar_t* pos, const scalar_t* unk, const bool* mask, const scalar_t* prefix,
                                  int64_t prefix_rows, int64_t prefix_positions, scalar_t* out, cudaStream_t stream) {
  const int64_t total = layout.batch * (prefix_rows + layout.positions) * layout.dim;
  if (total == 0) return cudaSuccess;
  add_embeddings_kernel<scalar_t><<<blocks_for(total), kThreads, 0, stream>>>(
      total, layout.positions, layout.dim, prefix_rows, prefix_positions, tokens, bias, pos, unk, mask, prefix, out);
  return cudaGetLastError();
}

template <typename scalar_t>
cudaError_t launch_reduce_embedding_grads(const PatchLayout& layout, const scalar_t* grad, const bool* mask,
                                          scalar_t* grad_pos, scalar_t* grad_unk, scalar_t* grad_bias,
                                          accumulate_t<scalar_t>* unk_partial, accumulate_t<scalar_t>* bias_partial,
                                          cudaStream_t stream) {
  const int64_t cells = layout.positions * layout.dim;
  if (cells > 0) {
    reduce_over_batch_kernel<scalar_t><<<blocks_for(cells), kThreads, 0, stream>>>(
        layout.batch, layout.positions, layout.dim, grad, mask, grad_pos, grad_unk != nullptr ? unk_partial : nullptr,
        grad_bias != nullptr ? bias_partial : nullptr);
    const cudaError_t status = cudaGetLastError();
    if (status != cudaSuccess) return status;
  }
  if ((grad_unk != nullptr || grad_bias != nullptr) && layout.dim > 0) {
    reduce_over_positions_kernel<scalar_t><<<blocks_for(layout.dim), kThreads, 0, stream>>>(
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
      const PatchLayout&, const scalar_t*, const bool*, scalar_t*, scalar_t*, scalar_t*, accumulate_t<scalar_t>*,    \
      accumulate_t<scalar_t>*, cudaStream_t);

MJP_INSTANTIATE_PATCH_EMBED_LAUNCHERS(float)
MJP_INSTANTIATE_PATCH_EMBED_LAUNCHERS(double)
MJP_INSTANTIATE_PATCH_EMBED_LAUNCHERS(c10::Half)
MJP_INSTANTIATE_PATCH_EMBED_LAUNCHERS(c10::BFloat16)

}  // namespace cuda
}  // namespace mjp
