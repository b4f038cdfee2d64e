// The launch shape of the elementwise CUDA kernels (patch_embed_cuda.cu, pos_embed_cuda.cu): blocks of kThreads
// threads, each thread striding over the work, so one launch covers any size with a bounded grid; and the launch
// macros of the .cu files. For nvcc, and for csrc/tests/cuda_on_threads.h, which runs the same sources on host
// threads (it defines the macros below first).
#pragma once

#include <algorithm>
#include <cstdint>

namespace mjp {
namespace cuda {

constexpr int kThreads = 256;

// Grid-stride launches: enough blocks to fill any GPU, never more than the work.
inline unsigned int blocks_for(int64_t work) {
  const int64_t blocks = (work + kThreads - 1) / kThreads;
  return static_cast<unsigned int>(std::max<int64_t>(1, std::min<int64_t>(blocks, int64_t(1) << 20)));
}

// V contiguous elements, aligned to their size: one 16-byte load or store for 16 bytes.
template <typename scalar_t, int V>
struct alignas(sizeof(scalar_t) * V) Pack {
  scalar_t v[V];
};

// Where chunk q of a row-major [rows, chunks_per_row] array lies, its rows grouped rows_per_sample to a sample: its
// row, its chunk in the row, its sample and its row within the sample.
template <typename index_t>
struct ChunkPlace {
  index_t row, chunk, sample, within;
};

template <typename index_t>
__device__ __forceinline__ ChunkPlace<index_t> place_of(index_t q, index_t chunks_per_row, index_t rows_per_sample) {
  ChunkPlace<index_t> place;
  place.row = q / chunks_per_row;
  place.chunk = q - place.row * chunks_per_row;
  place.sample = place.row / rows_per_sample;
  place.within = place.row - place.sample * rows_per_sample;
  return place;
}

// Calls launch(index_t{}) with index_t = uint32_t when every index the kernel computes stays below `largest` < 2**31
// (its grid-stride step then stays below 2**32), else int64_t: 32-bit divisions are several times cheaper.
template <typename Launch>
void with_index_type(int64_t largest, Launch&& launch) {
  if (largest < (int64_t(1) << 31)) {
    launch(uint32_t{0});
  } else {
    launch(int64_t{0});
  }
}

// Adds value(b) for b = 0, 1, ..., batch - 1, in that order, to `shuffled` where masked(b), else to `kept`; the loop
// unrolled with its loads first (value and mask), so that a thread has several in flight while its sums add in order.
template <typename acc_t, typename Value, typename Masked>
__device__ __forceinline__ void split_sum_in_order(int64_t batch, Value&& value, Masked&& masked, acc_t& kept,
                                                   acc_t& shuffled) {
  constexpr int kUnroll = 8;
  int64_t b = 0;
  for (; b + kUnroll <= batch; b += kUnroll) {
    acc_t values[kUnroll];
    bool flags[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      values[j] = value(b + j);
      flags[j] = masked(b + j);
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      if (flags[j]) {
        shuffled += values[j];
      } else {
        kept += values[j];
      }
    }
  }
  for (; b < batch; ++b) {
    const acc_t one = value(b);
    if (masked(b)) {
      shuffled += one;
    } else {
      kept += one;
    }
  }
}

// Whether every pointer given (null ones aside) starts on a 16-byte boundary.
template <typename... Pointers>
bool aligned_16(const Pointers*... pointers) {
  return ((reinterpret_cast<uintptr_t>(pointers) % 16 == 0) && ...);
}

}  // namespace cuda
}  // namespace mjp

// MJP_LAUNCH(grid, block, shared_bytes, stream, kernel)(arguments...): the launch kernel<<<...>>>(arguments...),
// the kernel last so that a template argument list's commas stay inside it.
#ifndef MJP_LAUNCH
#define MJP_LAUNCH(grid, block, shared_bytes, stream, ...) __VA_ARGS__<<<grid, block, shared_bytes, stream>>>
#endif
// A kernel's dynamic shared memory, as an array `name` of `type`.
#ifndef MJP_DYNAMIC_SHARED
#define MJP_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif

// The same loop with an index of type index_t: 32 bits where the launcher can (the kernels' divisions are then
// 32-bit, several times cheaper than 64-bit ones).
#define MJP_GRID_STRIDE_LOOP_AS(index_t, index, count)                                                            \
  for (index_t index = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; index < (count);             \
       index += static_cast<index_t>(blockDim.x) * gridDim.x)

#define MJP_GRID_STRIDE_LOOP(index, count)                                                          \
  for (int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; index < (count); \
       index += static_cast<int64_t>(blockDim.x) * gridDim.x)
