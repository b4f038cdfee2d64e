// CUDA kernels of the DAL loss with the nonlinear regressor (dal_loss.cpp's dal_loss_extension and its backward):
// two launches forward and two backward, where the ATen composite of dal_loss.cpp dispatches about 13 operations
// forward and 15-18 backward. On a GPU whose host is slow, each dispatch costs more host time than its kernel's GPU
// time (the H100's host: about 17 us an operation), so the composite made the cuda backend's DAL step cost more host
// time than the Triton backend's seven launches.
//
// Everything in T (float, or double for a float64 table), every sum in a fixed order (deterministic from run to run):
// - forward 1 (grid): hidden = relu(pos @ w1^T + b1), 32x32 tiles over [N, H], each output summed over D in order;
// - forward 2 (one block): the weights from the mask, the rows of weight 0 of hidden set to zeros (out of the loss:
//   their table rows, even inf or NaN, reach nothing), pred = hidden @ w2^T + b2 (one warp a row), and the loss;
// - backward 1 (grid, 4 threads per hidden unit k): d_hidden[:, k] into scratch, grad_w2[:, k], grad_b1[k] and
//   grad_b2, each a sum over n in a fixed order;
// - backward 2 (grid): grad_w1 = d_hidden^T pos and the table's gradient d_hidden @ w1 (zeros in its skipped rows),
//   both in 32x32 tiles.
// Sizes are small (DeiT-S: N = 196, D = H = 384), so these are plain shared-memory tiles, not tensor-core GEMMs: about
// 30 million multiply-adds a pass.
#include <cstdint>

#include "cuda_grid.cuh"
#include "cuda_kernels.h"

namespace mjp {
namespace cuda {
namespace {

constexpr int kTile = 32;
constexpr int kTileThreads = 256;               // 8 rows of 32 threads: 4 outputs each
constexpr int kRowsPerThread = kTile * kTile / kTileThreads;
constexpr int kBlockThreads = 512;              // forward 2: one block

// One 32x32 tile of C = A B, C[i, j] = sum_r A(i, r) B(r, j) over r in [0, R) in order, at rows i0.. and columns
// j0.. of an [M, J] result: store(i, j, value) for each of its elements inside. a(i, r) and b(r, j) load an operand
// element (called only inside the operands' bounds); kAAlongR / kBAlongR say whether consecutive r (else consecutive
// i, or j) are adjacent in memory, so that the tile loads run along it (coalesced).
template <typename T, bool kAAlongR, bool kBAlongR, typename LoadA, typename LoadB, typename Store>
__device__ __forceinline__ void tile_product(int64_t m, int64_t j_count, int64_t r_count, int64_t i0, int64_t j0,
                                             LoadA&& a, LoadB&& b, Store&& store) {
  __shared__ T a_tile[kTile][kTile + 1];  // [i][r]; +1: no bank conflicts down a column
  __shared__ T b_tile[kTile][kTile + 1];  // [r][j]
  const int column = threadIdx.x % kTile, row = threadIdx.x / kTile;
  T sums[kRowsPerThread];
#pragma unroll
  for (int q = 0; q < kRowsPerThread; ++q) sums[q] = T(0);
  for (int64_t r0 = 0; r0 < r_count; r0 += kTile) {
    for (int e = threadIdx.x; e < kTile * kTile; e += kTileThreads) {
      const int outer = e / kTile, inner = e % kTile;
      const int ai = kAAlongR ? outer : inner, ar = kAAlongR ? inner : outer;
      a_tile[ai][ar] = i0 + ai < m && r0 + ar < r_count ? a(i0 + ai, r0 + ar) : T(0);
      const int br = kBAlongR ? inner : outer, bj = kBAlongR ? outer : inner;
      b_tile[br][bj] = r0 + br < r_count && j0 + bj < j_count ? b(r0 + br, j0 + bj) : T(0);
    }
    __syncthreads();
#pragma unroll 8
    for (int r = 0; r < kTile; ++r) {
      const T b_value = b_tile[r][column];
#pragma unroll
      for (int q = 0; q < kRowsPerThread; ++q) sums[q] += a_tile[row + q * (kTileThreads / kTile)][r] * b_value;
    }
    __syncthreads();
  }
#pragma unroll
  for (int q = 0; q < kRowsPerThread; ++q) {
    const int64_t i = i0 + row + q * (kTileThreads / kTile), j = j0 + column;
    if (i < m && j < j_count) store(i, j, sums[q]);
  }
}

__host__ __device__ __forceinline__ int64_t tiles(int64_t size) { return (size + kTile - 1) / kTile; }

// relu as torch's: NaN stays NaN, -0 stays -0.
template <typename T>
__device__ __forceinline__ T relu(T value) {
  return value < T(0) ? T(0) : value;
}

template <typename T>
__device__ __forceinline__ T sign_of(T value) {
  return static_cast<T>((value > T(0)) - (value < T(0)));
}

// The sum of `value` over the block, in a fixed order (lanes, then warps); every thread gets it. `shared`: 32 slots.
template <typename T>
__device__ T block_sum(T value, T* shared) {
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_down_sync(0xFFFFFFFFu, value, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  __syncthreads();  // shared may still be read by a previous call
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  T total = T(0);
  for (int w = 0; w < warps; ++w) total += shared[w];
  return total;
}

// hidden[n, k] = relu(sum_d pos[n, d] w1[k, d] + b1[k]), one 32x32 tile a block.
template <typename T>
__global__ void __launch_bounds__(kTileThreads) dal_hidden_kernel(DalShape s, const T* __restrict__ pos,
                                                                  const T* __restrict__ w1, const T* __restrict__ b1,
                                                                  T* __restrict__ hidden) {
  const int64_t column_tiles = tiles(s.hidden);
  const int64_t i0 = blockIdx.x / column_tiles * kTile, j0 = blockIdx.x % column_tiles * kTile;
  tile_product<T, true, true>(
      s.positions, s.hidden, s.dim, i0, j0, [&](int64_t n, int64_t d) { return pos[n * s.dim + d]; },
      [&](int64_t d, int64_t k) { return w1[k * s.dim + d]; },
      [&](int64_t n, int64_t k, T sum) { hidden[n * s.hidden + k] = relu(sum + (b1 != nullptr ? b1[k] : T(0))); });
}

// One block: weights (u[n] / max(sum u, 1), u[n] the samples keeping n, or 1 / N without a mask), hidden's rows of
// weight 0 zeroed, pred, and loss = scale * sum_n weights[n] |pred[n] - coords[n]|_1 over the rows of weight > 0.
template <typename T>
__global__ void __launch_bounds__(kBlockThreads)
    dal_loss_kernel(DalShape s, const bool* __restrict__ mask, const T* __restrict__ w2, const T* __restrict__ b2,
                    const T* __restrict__ coords, double scale, T* __restrict__ hidden, T* __restrict__ pred,
                    T* __restrict__ weights, T* __restrict__ loss) {
  __shared__ T partials[32];
  __shared__ int64_t counts[kBlockThreads];
  const int64_t n_count = s.positions, h_count = s.hidden;
  if (mask != nullptr) {
    // u[n], the samples keeping n. Up to blockDim positions, every thread counts: `parts` threads a position, each
    // every parts-th sample (for a 14x14 grid, 2 threads a position instead of 196 of the 512 threads working); then
    // a position's parts are added (integers: exact in any order). More positions: one thread a position at a time.
    const int64_t parts = n_count <= blockDim.x && n_count > 0 ? blockDim.x / n_count : 1;
    T kept = T(0);
    if (parts > 1) {
      int64_t count = 0;
      if (threadIdx.x < parts * n_count) {
        const int64_t n = threadIdx.x % n_count;
#pragma unroll 8
        for (int64_t b = threadIdx.x / n_count; b < s.batch; b += parts) count += !mask[b * n_count + n];
      }
      counts[threadIdx.x] = count;
      __syncthreads();
      if (threadIdx.x < n_count) {
        int64_t total = 0;
        for (int64_t part = 0; part < parts; ++part) total += counts[part * n_count + threadIdx.x];
        weights[threadIdx.x] = static_cast<T>(total);
        kept = static_cast<T>(total);
      }
    } else {
      for (int64_t n = threadIdx.x; n < n_count; n += blockDim.x) {
        int64_t count = 0;
#pragma unroll 8
        for (int64_t b = 0; b < s.batch; ++b) count += !mask[b * n_count + n];
        weights[n] = static_cast<T>(count);
        kept += static_cast<T>(count);
      }
    }
    const T total = block_sum(kept, partials);
    const T divisor = total < T(1) ? T(1) : total;
    for (int64_t n = threadIdx.x; n < n_count; n += blockDim.x) weights[n] /= divisor;
  } else {
    const T uniform = static_cast<T>(1.0 / static_cast<double>(n_count > 1 ? n_count : 1));
    for (int64_t n = threadIdx.x; n < n_count; n += blockDim.x) weights[n] = uniform;
  }
  __syncthreads();  // weights written by other threads
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  T loss_part = T(0);  // lane 0's rows, in order
  for (int64_t n = warp; n < n_count; n += warps) {
    T* row = hidden + n * h_count;
    const bool kept = weights[n] != T(0);
    T sum0 = T(0), sum1 = T(0);
    for (int64_t k = lane; k < h_count; k += 32) {
      if (!kept) {
        row[k] = T(0);
        continue;
      }
      sum0 += row[k] * w2[k];
      sum1 += row[k] * w2[h_count + k];
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      sum0 += __shfl_down_sync(0xFFFFFFFFu, sum0, offset);
      sum1 += __shfl_down_sync(0xFFFFFFFFu, sum1, offset);
    }
    if (lane == 0) {
      const T p0 = (b2 != nullptr ? b2[0] : T(0)) + sum0, p1 = (b2 != nullptr ? b2[1] : T(0)) + sum1;
      pred[n * 2] = p0;
      pred[n * 2 + 1] = p1;
      if (kept) loss_part += weights[n] * (fabs(p0 - coords[n * 2]) + fabs(p1 - coords[n * 2 + 1]));
    }
  }
  const T total = block_sum(loss_part, partials);
  if (threadIdx.x == 0) *loss = total * static_cast<T>(scale);
}

// d_pred[n, j] = grad * scale * weights[n] * sign(pred[n, j] - coords[n, j]); sign(0) = 0, as abs's backward.
template <typename T>
__device__ __forceinline__ T d_pred(const T* pred, const T* coords, T factor, T weight, int64_t n, int j) {
  return factor * weight * sign_of(pred[n * 2 + j] - coords[n * 2 + j]);
}

// kSlices threads per hidden unit k, each over every kSlices-th position, then their sums added in slice order:
// d_hidden[:, k] (relu's backward; zeros in rows of weight 0), grad_w2[:, k], grad_b1[k]; block 0's first warp also
// sums grad_b2 (lanes over n, then the warp's shuffles). A thread a unit would leave most of the GPU idle (384
// threads for DeiT-S) and walk all N positions in sequence.
constexpr int kSlices = 4;
constexpr int kUnitsPerBlock = kTileThreads / kSlices;

template <typename T>
__global__ void __launch_bounds__(kTileThreads)
    dal_hidden_grad_kernel(DalShape s, const T* __restrict__ grad, double scale, const T* __restrict__ w2,
                           const T* __restrict__ coords, const T* __restrict__ pred, const T* __restrict__ hidden,
                           const T* __restrict__ weights, T* __restrict__ d_hidden, T* __restrict__ grad_w2,
                           T* __restrict__ grad_b1, T* __restrict__ grad_b2) {
  __shared__ T sums[3][kSlices][kUnitsPerBlock];
  const int64_t h_count = s.hidden;
  const T factor = *grad * static_cast<T>(scale);
  const int unit = threadIdx.x % kUnitsPerBlock, slice = threadIdx.x / kUnitsPerBlock;
  const int64_t k = static_cast<int64_t>(blockIdx.x) * kUnitsPerBlock + unit;
  T sum_w2_0 = T(0), sum_w2_1 = T(0), sum_b1 = T(0);
  if (k < h_count) {
    const T w2_0 = w2[k], w2_1 = w2[h_count + k];
#pragma unroll 4
    for (int64_t n = slice; n < s.positions; n += kSlices) {
      const T weight = weights[n];
      T d = T(0);
      if (weight != T(0)) {
        const T g0 = d_pred(pred, coords, factor, weight, n, 0), g1 = d_pred(pred, coords, factor, weight, n, 1);
        const T value = hidden[n * h_count + k];
        sum_w2_0 += g0 * value;
        sum_w2_1 += g1 * value;
        d = value > T(0) ? g0 * w2_0 + g1 * w2_1 : T(0);
        sum_b1 += d;
      }
      d_hidden[n * h_count + k] = d;
    }
  }
  sums[0][slice][unit] = sum_w2_0;
  sums[1][slice][unit] = sum_w2_1;
  sums[2][slice][unit] = sum_b1;
  __syncthreads();
  if (slice == 0 && k < h_count) {
    T total[3] = {T(0), T(0), T(0)};
    for (int q = 0; q < 3; ++q) {
      for (int part = 0; part < kSlices; ++part) total[q] += sums[q][part][unit];
    }
    grad_w2[k] = total[0];
    grad_w2[h_count + k] = total[1];
    if (grad_b1 != nullptr) grad_b1[k] = total[2];
  }
  if (blockIdx.x == 0 && threadIdx.x < 32 && grad_b2 != nullptr) {
    T b2_0 = T(0), b2_1 = T(0);
    for (int64_t n = threadIdx.x; n < s.positions; n += 32) {
      const T weight = weights[n];
      if (weight == T(0)) continue;
      b2_0 += d_pred(pred, coords, factor, weight, n, 0);
      b2_1 += d_pred(pred, coords, factor, weight, n, 1);
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      b2_0 += __shfl_down_sync(0xFFFFFFFFu, b2_0, offset);
      b2_1 += __shfl_down_sync(0xFFFFFFFFu, b2_1, offset);
    }
    if (threadIdx.x == 0) {
      grad_b2[0] = b2_0;
      grad_b2[1] = b2_1;
    }
  }
}

// Blocks [0, w1_tiles): grad_w1[k, d] = sum_n d_hidden[n, k] pos[n, d] over the rows of weight > 0 (a row of weight 0
// is read as zeros: its values, even inf or NaN, must not reach the gradient). The others: the table's gradient
// [skip_rows + N, D], zeros in the skipped rows, d_hidden @ w1 below them.
template <typename T>
__global__ void __launch_bounds__(kTileThreads)
    dal_weight_and_table_grad_kernel(DalShape s, int64_t skip_rows, const T* __restrict__ pos,
                                     const T* __restrict__ w1, const T* __restrict__ weights,
                                     const T* __restrict__ d_hidden, T* __restrict__ grad_w1,
                                     T* __restrict__ grad_table) {
  const int64_t dim = s.dim, h_count = s.hidden, column_tiles = tiles(dim);
  const int64_t w1_tiles = tiles(h_count) * column_tiles;
  if (blockIdx.x < w1_tiles) {
    const int64_t i0 = blockIdx.x / column_tiles * kTile, j0 = blockIdx.x % column_tiles * kTile;
    tile_product<T, false, false>(
        h_count, dim, s.positions, i0, j0, [&](int64_t k, int64_t n) { return d_hidden[n * h_count + k]; },
        [&](int64_t n, int64_t d) { return weights[n] != T(0) ? pos[n * dim + d] : T(0); },
        [&](int64_t k, int64_t d, T sum) { grad_w1[k * dim + d] = sum; });
    return;
  }
  const int64_t tile = blockIdx.x - w1_tiles;
  const int64_t i0 = tile / column_tiles * kTile, j0 = tile % column_tiles * kTile;
  tile_product<T, true, false>(
      skip_rows + s.positions, dim, h_count, i0, j0,
      [&](int64_t row, int64_t k) { return row < skip_rows ? T(0) : d_hidden[(row - skip_rows) * h_count + k]; },
      [&](int64_t k, int64_t d) { return w1[k * dim + d]; },
      [&](int64_t row, int64_t d, T sum) { grad_table[row * dim + d] = sum; });
}

unsigned int grid_of(int64_t blocks) { return static_cast<unsigned int>(blocks); }

}  // namespace

template <typename T>
cudaError_t launch_dal_forward(const DalShape& s, const T* pos, const T* w1, const T* b1, const T* w2, const T* b2,
                               const T* coords, const bool* mask, double scale, T* loss, T* pred, T* hidden,
                               T* weights, cudaStream_t stream) {
  const int64_t hidden_tiles = tiles(s.positions) * tiles(s.hidden);
  if (hidden_tiles > 0x7FFFFFFF) return cudaErrorInvalidConfiguration;
  if (hidden_tiles > 0) {
    MJP_LAUNCH(grid_of(hidden_tiles), kTileThreads, 0, stream, dal_hidden_kernel<T>)(s, pos, w1, b1, hidden);
    const cudaError_t status = cudaGetLastError();
    if (status != cudaSuccess) return status;
  }
  MJP_LAUNCH(1, kBlockThreads, 0, stream, dal_loss_kernel<T>)(s, mask, w2, b2, coords, scale, hidden, pred, weights,
                                                             loss);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_dal_backward(const DalShape& s, int64_t skip_rows, const T* grad, double scale, const T* pos,
                                const T* w1, const T* w2, const T* coords, const T* pred, const T* hidden,
                                const T* weights, T* d_hidden, T* grad_table, T* grad_w1, T* grad_b1, T* grad_w2,
                                T* grad_b2, cudaStream_t stream) {
  const int64_t unit_blocks = (s.hidden + kUnitsPerBlock - 1) / kUnitsPerBlock;
  MJP_LAUNCH(grid_of(unit_blocks > 0 ? unit_blocks : 1), kTileThreads, 0, stream, dal_hidden_grad_kernel<T>)(
      s, grad, scale, w2, coords, pred, hidden, weights, d_hidden, grad_w2, grad_b1, grad_b2);
  cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) return status;
  const int64_t blocks = (tiles(s.hidden) + tiles(skip_rows + s.positions)) * tiles(s.dim);
  if (blocks > 0x7FFFFFFF) return cudaErrorInvalidConfiguration;
  if (blocks > 0) {
    MJP_LAUNCH(grid_of(blocks), kTileThreads, 0, stream, dal_weight_and_table_grad_kernel<T>)(
        s, skip_rows, pos, w1, weights, d_hidden, grad_w1, grad_table);
    status = cudaGetLastError();
  }
  return status;
}

#define MJP_INSTANTIATE_DAL_LAUNCHERS(T)                                                                           \
  template cudaError_t launch_dal_forward<T>(const DalShape&, const T*, const T*, const T*, const T*, const T*,    \
                                             const T*, const bool*, double, T*, T*, T*, T*, cudaStream_t);         \
  template cudaError_t launch_dal_backward<T>(const DalShape&, int64_t, const T*, double, const T*, const T*,      \
                                              const T*, const T*, const T*, const T*, const T*, T*, T*, T*, T*, T*, \
                                              T*, cudaStream_t);

MJP_INSTANTIATE_DAL_LAUNCHERS(float)
MJP_INSTANTIATE_DAL_LAUNCHERS(double)

}  // namespace cuda
}  // namespace mjp
