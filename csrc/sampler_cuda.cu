// CUDA path of the jigsaw sampler. Grids of up to kLanesSamplerMaxPositions = 1024 positions (32x32: DeiT's 14x14,
// 24x24 at 384 px): one warp per sample, sampler_lanes.h, on shared memory. Larger grids (DINOv2's 37x37 at 518 px):
// one thread per sample, sampler.h.
#include "cuda_grid.cuh"
#include "cuda_kernels.h"
#include "sampler.h"
#include "sampler_lanes.h"

namespace mjp {
namespace cuda {
namespace {

// sampler_lanes.h's group: the 32 threads of a one-warp block.
struct WarpLanes {
  int lane;
  template <typename Body>
  __device__ __forceinline__ void each(Body&& body) const {
    body(lane);
    __syncwarp();
  }
  template <typename Predicate>
  __device__ __forceinline__ uint32_t ballot(Predicate&& predicate) const {
    return __ballot_sync(0xFFFFFFFFu, predicate(lane));
  }
  __device__ __forceinline__ void sync() const { __syncwarp(); }
};

// Sample 0's stream index, the seed and the prob threshold: from the host's values, or from device memory when the
// source has a counter. The same three words for every thread: broadcast loads. The kernel only reads the counter;
// the step's increment is the next launch on the stream, so no block can see it.
struct StreamStart {
  uint64_t offset, seed;
  int64_t prob_threshold;
};

__device__ __forceinline__ StreamStart stream_start(const SamplerStream& source) {
  StreamStart start{source.stream_shift, source.seed, source.prob_threshold};
  if (source.counter != nullptr) {
    start.offset += static_cast<uint64_t>(__ldg(source.counter)) * source.counter_scale;
    start.seed = static_cast<uint64_t>(__ldg(source.params));
    start.prob_threshold = __ldg(source.params + 1);
  }
  return start;
}

// One block of one warp per sample, the block's dynamic shared memory its LanesScratch.
__global__ void __launch_bounds__(kSamplerLanes)
    sample_jigsaw_lanes_kernel(int64_t rows, int64_t cols, int64_t target, int64_t min_block, SamplerStream source,
                               bool shared, const int64_t* __restrict__ h_thresholds,
                               const int64_t* __restrict__ w_thresholds, bool* __restrict__ mask,
                               int64_t* __restrict__ perm) {
  MJP_DYNAMIC_SHARED(int64_t, scratch_memory);  // int64: LanesScratch's first array is int64
  const int64_t i = blockIdx.x;
  const int64_t num_positions = rows * cols;
  const StreamStart start = stream_start(source);
  const uint64_t stream = shared ? start.offset : start.offset + static_cast<uint64_t>(i);
  sample_jigsaw_lanes(WarpLanes{static_cast<int>(threadIdx.x)}, rows, cols, target, min_block, start.seed, stream,
                      start.prob_threshold, h_thresholds, w_thresholds,
                      lanes_scratch_at(scratch_memory, num_positions), mask + i * num_positions,
                      perm + i * num_positions);
}

// One thread per sample, for grids beyond the lanes path's shared memory.
__global__ void sample_jigsaw_kernel(int64_t batch_size, int64_t rows, int64_t cols, int64_t target,
                                     int64_t min_block, SamplerStream source, bool shared,
                                     const int64_t* __restrict__ h_thresholds,
                                     const int64_t* __restrict__ w_thresholds, bool* __restrict__ mask,
                                     int64_t* __restrict__ perm) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= batch_size) return;
  const int64_t num_positions = rows * cols;
  const StreamStart start = stream_start(source);
  const uint64_t stream = shared ? start.offset : start.offset + static_cast<uint64_t>(i);
  sample_jigsaw_row(rows, cols, target, min_block, start.seed, stream, start.prob_threshold, h_thresholds,
                    w_thresholds, mask + i * num_positions, perm + i * num_positions);
}

}  // namespace

cudaError_t launch_sample_jigsaw(int64_t batch_size, int64_t rows, int64_t cols, int64_t target, int64_t min_block,
                                 const SamplerStream& source, bool shared, const int64_t* h_thresholds,
                                 const int64_t* w_thresholds, bool* mask, int64_t* perm, cudaStream_t stream) {
  if (batch_size <= 0) return cudaSuccess;
  const int64_t num_positions = rows * cols;
  if (num_positions <= kLanesSamplerMaxPositions) {
    if (batch_size > 0x7FFFFFFF) return cudaErrorInvalidConfiguration;
    const size_t scratch = static_cast<size_t>(lanes_scratch_bytes(num_positions));  // <= 12.3 KiB: no opt-in
    MJP_LAUNCH(static_cast<unsigned int>(batch_size), kSamplerLanes, scratch, stream, sample_jigsaw_lanes_kernel)(
        rows, cols, target, min_block, source, shared, h_thresholds, w_thresholds, mask, perm);
    return cudaGetLastError();
  }
  // Small blocks: a thread's work varies with its mask, and batches are often only a few hundred samples.
  constexpr int threads = 64;
  const int64_t blocks = (batch_size + threads - 1) / threads;
  if (blocks > 0x7FFFFFFF) return cudaErrorInvalidConfiguration;
  MJP_LAUNCH(static_cast<unsigned int>(blocks), threads, 0, stream, sample_jigsaw_kernel)(
      batch_size, rows, cols, target, min_block, source, shared, h_thresholds, w_thresholds, mask, perm);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace mjp
