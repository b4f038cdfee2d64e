// CPU path of the jigsaw sampler: sampler.h run over the samples in parallel.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstring>

#include "ops.h"
#include "sampler.h"

namespace mjp {

constexpr int64_t kTorchGrainSize = 32768;  // at::internal::GRAIN_SIZE (ATen/TensorIterator.h)

std::tuple<at::Tensor, at::Tensor> sample_jigsaw_cpu(int64_t batch_size, int64_t rows, int64_t cols, int64_t target,
                                                     int64_t min_block, uint64_t seed, uint64_t offset, bool shared,
                                                     int64_t prob_threshold, const at::Tensor& h_thresholds,
                                                     const at::Tensor& w_thresholds) {
  const int64_t num_positions = rows * cols;
  auto mask = at::empty({batch_size, num_positions}, h_thresholds.options().dtype(at::kBool));
  auto perm = at::empty({batch_size, num_positions}, h_thresholds.options().dtype(at::kLong));
  if (batch_size == 0) return {mask, perm};
  bool* mask_data = mask.data_ptr<bool>();
  int64_t* perm_data = perm.data_ptr<int64_t>();
  const int64_t* h_data = h_thresholds.data_ptr<int64_t>();
  const int64_t* w_data = w_thresholds.data_ptr<int64_t>();

  if (shared) {
    // One jigsaw (stream `offset`) for the whole batch: sample it once, copy it.
    sample_jigsaw_row(rows, cols, target, min_block, seed, offset, prob_threshold, h_data, w_data, mask_data,
                      perm_data);
    at::parallel_for(1, batch_size, std::max<int64_t>(1, 65536 / std::max<int64_t>(1, num_positions)),
                     [&](int64_t begin, int64_t end) {
                       for (int64_t i = begin; i < end; ++i) {
                         std::memcpy(mask_data + i * num_positions, mask_data, num_positions * sizeof(bool));
                         std::memcpy(perm_data + i * num_positions, perm_data, num_positions * sizeof(int64_t));
                       }
                     });
    return {mask, perm};
  }
  // A sample costs about as much as 4 * num_positions of the cheap element steps that torch's own threshold,
  // at::internal::GRAIN_SIZE = 32768, counts: so a batch of 64 on a 14x14 grid (about 60 microseconds) is split.
  // at::parallel_for, like every torch operator, waits for its whole thread team: when another process holds a
  // core, a team thread can start late and the call takes longer than on one thread (seen in the benchmarks);
  // torch.set_num_threads(1) is the remedy there, as for the rest of torch. (A helper that sleeps between calls
  // instead took 60-160 microseconds to wake on these virtual machines, more than the batch it would help with.)
  const int64_t grain = std::max<int64_t>(1, kTorchGrainSize / (4 * std::max<int64_t>(1, num_positions)));
  at::parallel_for(0, batch_size, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      sample_jigsaw_row(rows, cols, target, min_block, seed, offset + static_cast<uint64_t>(i), prob_threshold,
                        h_data, w_data, mask_data + i * num_positions, perm_data + i * num_positions);
    }
  });
  return {mask, perm};
}

}  // namespace mjp
