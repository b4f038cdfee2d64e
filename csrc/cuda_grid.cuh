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
