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

#define MJP_GRID_STRIDE_LOOP(index, count)                                                          \
  for (int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; index < (count); \
       index += static_cast<int64_t>(blockDim.x) * gridDim.x)
