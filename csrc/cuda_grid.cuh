// The launch shape of the elementwise CUDA kernels (patch_embed_cuda.cu, pos_embed_cuda.cu): blocks of kThreads
// threads, each thread striding over the work, so one launch covers any size with a bounded grid. For nvcc only.
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

}  // namespace cuda
}  // namespace mjp

#define MJP_GRID_STRIDE_LOOP(index, count)                                                          \
  for (int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; index < (count); \
       index += static_cast<int64_t>(blockDim.x) * gridDim.x)
