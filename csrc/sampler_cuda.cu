// CUDA path of the jigsaw sampler: sampler.h, one thread per sample.
#include "cuda_kernels.h"
#include "sampler.h"

namespace mjp {
namespace cuda {
namespace {

__global__ void sample_jigsaw_kernel(int64_t batch_size, int64_t rows, int64_t cols, int64_t target,
                                     int64_t min_block, SamplerStream source, bool shared,
                                     const int64_t* __restrict__ h_thresholds,
                                     const int64_t* __restrict__ w_thresholds, bool* __restrict__ mask,
                                     int64_t* __restrict__ perm) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= batch_size) return;
  const int64_t num_positions = rows * cols;
  uint64_t offset = source.stream_shift;
  uint64_t seed = source.seed;
  int64_t prob_threshold = source.prob_threshold;
  if (source.counter != nullptr) {
    // The same three words for every thread: broadcast loads. The kernel only reads the counter; the step's
    // increment is the next launch on the stream, so no block can see it.
    offset += static_cast<uint64_t>(__ldg(source.counter)) * source.counter_scale;
    seed = static_cast<uint64_t>(__ldg(source.params));
    prob_threshold = __ldg(source.params + 1);
  }
  const uint64_t stream = shared ? offset : offset + static_cast<uint64_t>(i);
  sample_jigsaw_row(rows, cols, target, min_block, seed, stream, prob_threshold, h_thresholds, w_thresholds,
                    mask + i * num_positions, perm + i * num_positions);
}

}  // namespace

cudaError_t launch_sample_jigsaw(int64_t batch_size, int64_t rows, int64_t cols, int64_t target, int64_t min_block,
                                 const SamplerStream& source, bool shared, const int64_t* h_thresholds,
                                 const int64_t* w_thresholds, bool* mask, int64_t* perm, cudaStream_t stream) {
  if (batch_size <= 0) return cudaSuccess;
  // Small blocks: a thread's work varies with its mask, and batches are often only a few hundred samples.
  constexpr int threads = 64;
  const int64_t blocks = (batch_size + threads - 1) / threads;
  if (blocks > 0x7FFFFFFF) return cudaErrorInvalidConfiguration;
  sample_jigsaw_kernel<<<static_cast<unsigned int>(blocks), threads, 0, stream>>>(
      batch_size, rows, cols, target, min_block, source, shared, h_thresholds, w_thresholds, mask, perm);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace mjp
