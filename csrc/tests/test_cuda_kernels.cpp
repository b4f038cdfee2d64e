// The CUDA kernels of sampler_cuda.cu, patch_embed_cuda.cu, pos_embed_cuda.cu and dal_loss_cuda.cu, run through their
// own launchers on host threads (cuda_on_threads.h: every CUDA thread a std::thread, barriers for __syncthreads and
// the warp operations), against plain loops: the sampler against sample_jigsaw_row, bit for bit; the patch copies,
// the epilogue, the position step and the reductions against the same sums in the same order, bit for bit; the DAL
// loss against a float64 reference. So a kernel's indexing, synchronisation and launch choices are tested here,
// without a GPU; what only a GPU shows (speed, the real memory model, the compiler's device code) stays with
// tests/test_gpu.py on a lent one.
#include "cuda_on_threads.h"  // first: it defines the launch macros and the CUDA names the sources use

#include "../dal_loss_cuda.cu"
#include "../patch_embed_cuda.cu"
#include "../pos_embed_cuda.cu"
#include "../sampler_cuda.cu"
#include "test_support.h"

#include <limits>
#include <random>
#include <type_traits>

namespace {

using mjp_emulation::blocks_run;

// ---- Sampler: both kernels (one warp a sample up to 1024 positions, one thread a sample beyond) and both stream
// sources (host values, and a counter with its params in "device" memory).
void test_sampler() {
  struct Case {
    int64_t batch, rows, cols;
    double ratio;
    int64_t min_block;
    bool shared, from_counter;
    int64_t prob_threshold;
  };
  const Case cases[] = {
      {6, 14, 14, 0.5, 16, false, false, int64_t(1) << 32},
      {5, 14, 14, 0.1, 4, false, true, int64_t(1) << 31},  // half the samples jigsawed
      {4, 7, 13, 0.97, 1, false, true, int64_t(1) << 32},
      {3, 32, 32, 0.75, 50, false, false, int64_t(1) << 32},  // the lanes path's largest grid
      {2, 16, 64, 0.5, 8, false, false, int64_t(1) << 32},  // 1024 positions, not square
      {3, 33, 33, 0.5, 16, false, true, int64_t(1) << 32},  // 1089 positions: one thread a sample
      {4, 5, 9, 0.4, 2, true, false, int64_t(1) << 32},      // shared: every sample the stream offset's jigsaw
      {3, 14, 14, 0.0, 16, false, false, int64_t(1) << 32},  // nothing to mask
  };
  for (const Case& c : cases) {
    std::vector<int64_t> h, w;
    mjp_tests::build_tables(c.rows, c.cols, 0.3, h, w);
    const int64_t positions = c.rows * c.cols, target = static_cast<int64_t>(std::floor(c.ratio * positions));
    const uint64_t seed = 0x9E3779B97F4A7C15ull * (c.batch + positions), offset = (uint64_t(1) << 32) - 3;
    mjp::cuda::SamplerStream source;
    const int64_t counter = 7, params[2] = {static_cast<int64_t>(seed), c.prob_threshold};
    const uint64_t scale = 16;
    if (c.from_counter) {  // stream = counter * scale + shift, as the sampler module's step reads it
      source.counter = &counter;
      source.params = params;
      source.counter_scale = scale;
      source.stream_shift = offset;
    } else {
      source.stream_shift = offset;
      source.seed = seed;
      source.prob_threshold = c.prob_threshold;
    }
    const uint64_t first = c.from_counter ? 7 * scale + offset : offset;
    std::vector<uint8_t> mask(c.batch * positions, 0xAB);
    std::vector<int64_t> perm(c.batch * positions, -7);
    const cudaError_t status = mjp::cuda::launch_sample_jigsaw(
        c.batch, c.rows, c.cols, target, c.min_block, source, c.shared, h.data(), w.data(),
        reinterpret_cast<bool*>(mask.data()), perm.data(), nullptr);
    CHECK(status == cudaSuccess, "launch failed");
    int64_t masked = 0;
    for (int64_t i = 0; i < c.batch; ++i) {
      std::vector<uint8_t> want_mask(positions);
      std::vector<int64_t> want_perm(positions);
      mjp::sample_jigsaw_row(c.rows, c.cols, target, c.min_block, seed, c.shared ? first : first + i,
                             c.prob_threshold, h.data(), w.data(), reinterpret_cast<bool*>(want_mask.data()),
                             want_perm.data());
      const bool same = std::equal(want_mask.begin(), want_mask.end(), mask.begin() + i * positions) &&
                        std::equal(want_perm.begin(), want_perm.end(), perm.begin() + i * positions);
      CHECK(same, "sampler: grid %lldx%lld ratio %.2f sample %lld differs from sample_jigsaw_row",
            (long long)c.rows, (long long)c.cols, c.ratio, (long long)i);
      for (const uint8_t byte : want_mask) masked += byte;
    }
    CHECK(c.ratio == 0.0 || masked > 0, "sampler: grid %lldx%lld masked nothing", (long long)c.rows,
          (long long)c.cols);
  }
}

// ---- Patch copies: the im2col gather and the gradient scatter, at each chunk width, with prefix rows.

struct Images {
  int64_t batch, channels, rows, cols, patch, pad;  // pad: extra elements after each image row (a wider stride)
  int64_t offset;                                   // elements before the first (a misaligned base)
  int64_t height() const { return rows * patch; }
  int64_t width() const { return cols * patch; }
  int64_t height_stride() const { return width() + pad; }
  int64_t channel_stride() const { return height() * height_stride(); }
  int64_t batch_stride() const { return channels * channel_stride(); }
  int64_t elements() const { return offset + batch * batch_stride(); }
  mjp::cuda::PatchLayout layout(int64_t row_prefix) const {
    mjp::cuda::PatchLayout l{batch, rows * cols, channels * patch * patch, patch, cols, 8,
                             batch_stride(), channel_stride(), height_stride()};
    l.row_prefix = row_prefix;
    return l;
  }
  // Element k = (c, py, px) of the patch at position m of sample b, in the buffer (the images start at `offset`).
  int64_t at(int64_t b, int64_t m, int64_t k) const {
    const int64_t area = patch * patch, c = k / area, py = k % area / patch, px = k % patch;
    return offset + b * batch_stride() + c * channel_stride() + (m / cols * patch + py) * height_stride() +
           m % cols * patch + px;
  }
};

// perm [B, N]: a permutation per sample, with (invalid) an entry out of range in sample 0.
std::vector<int64_t> shuffled_perm(int64_t batch, int64_t positions, bool invalid, std::mt19937_64& rng) {
  std::vector<int64_t> perm(batch * positions);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t n = 0; n < positions; ++n) perm[b * positions + n] = n;
    std::shuffle(perm.begin() + b * positions, perm.begin() + (b + 1) * positions, rng);
  }
  if (invalid) perm[positions - 1] = positions + 2;
  return perm;
}

template <typename T>
void check_patch_copies(const Images& im, int64_t row_prefix, bool with_perm, bool invalid, std::mt19937_64& rng) {
  const int64_t positions = im.rows * im.cols, k_count = im.channels * im.patch * im.patch;
  const int64_t rows_per_sample = row_prefix + positions;
  std::vector<T> images(im.elements());
  for (size_t i = 0; i < images.size(); ++i) images[i] = static_cast<T>(i % 9973) + T(0.25);
  const auto perm = shuffled_perm(im.batch, positions, invalid, rng);
  const int64_t* perm_data = with_perm ? perm.data() : nullptr;
  const auto layout = im.layout(row_prefix);
  // source(b, n): the patch that row n of sample b shows, or -1 (none: out of range).
  const auto source = [&](int64_t b, int64_t n) {
    const int64_t m = with_perm ? perm[b * positions + n] : n;
    return m >= 0 && m < positions ? m : -1;
  };

  std::vector<T> columns(im.batch * rows_per_sample * k_count, T(-1));
  CHECK(mjp::cuda::launch_gather_patches<T>(layout, images.data() + im.offset, perm_data, columns.data(), nullptr) ==
            cudaSuccess,
        "gather launch");
  bool gather_ok = true;
  for (int64_t b = 0; b < im.batch; ++b) {
    for (int64_t t = 0; t < rows_per_sample; ++t) {
      const int64_t m = t < row_prefix ? -1 : source(b, t - row_prefix);
      for (int64_t k = 0; k < k_count; ++k) {
        const T want = m < 0 ? T(0) : images[im.at(b, m, k)];
        gather_ok &= columns[(b * rows_per_sample + t) * k_count + k] == want;
      }
    }
  }
  CHECK(gather_ok, "gather: %d-byte elements, patch %lld offset %lld pad %lld prefix %lld perm %d invalid %d",
        static_cast<int>(sizeof(T)), (long long)im.patch, (long long)im.offset, (long long)im.pad,
        (long long)row_prefix, with_perm, invalid);

  // The scatter into a zero-filled gradient: each shown patch gets its row's values, the rest stays zero.
  std::vector<T> grad_columns(columns.size());
  for (size_t i = 0; i < grad_columns.size(); ++i) grad_columns[i] = static_cast<T>(i % 7919) + T(0.5);
  std::vector<T> grad_images(images.size(), T(0)), want(images.size(), T(0));
  for (int64_t b = 0; b < im.batch; ++b) {
    for (int64_t n = 0; n < positions; ++n) {
      const int64_t m = source(b, n);
      if (m < 0) continue;
      for (int64_t k = 0; k < k_count; ++k) {
        want[im.at(b, m, k)] = grad_columns[(b * rows_per_sample + row_prefix + n) * k_count + k];
      }
    }
  }
  CHECK(mjp::cuda::launch_scatter_patches<T>(layout, grad_columns.data(), perm_data, grad_images.data() + im.offset,
                                             nullptr) == cudaSuccess,
        "scatter launch");
  CHECK(grad_images == want, "scatter: %d-byte elements, patch %lld offset %lld pad %lld prefix %lld perm %d bad %d",
        static_cast<int>(sizeof(T)), (long long)im.patch, (long long)im.offset, (long long)im.pad,
        (long long)row_prefix, with_perm, invalid);
}

void test_patch_copies() {
  std::mt19937_64 rng(3);
  // patch 4 float: 16-byte chunks; 2: 8 bytes; 3: one element; offset 1: one element (a misaligned base); pad 2
  // (float, patch 4): 8-byte chunks (the row stride is 8-byte aligned only). double patch 2: 16 bytes; 1: 8 bytes.
  const Images shapes[] = {
      {2, 3, 3, 5, 4, 0, 0}, {2, 2, 2, 3, 2, 0, 0}, {3, 3, 2, 2, 3, 0, 0},
      {2, 3, 3, 4, 4, 0, 1}, {2, 3, 3, 4, 4, 2, 0}, {1, 1, 1, 1, 1, 0, 0},
  };
  for (const Images& im : shapes) {
    for (int64_t row_prefix : {0, 1, 3}) {
      for (int kind = 0; kind < 3; ++kind) {  // no perm; a permutation; one entry out of range
        check_patch_copies<float>(im, row_prefix, kind > 0, kind == 2, rng);
        check_patch_copies<double>(im, row_prefix, kind > 0, kind == 2, rng);
        check_patch_copies<c10::BFloat16>(im, row_prefix, kind > 0, kind == 2, rng);  // 2-byte chunks too
      }
    }
  }
  // 16-byte chunks on the rows: how many element chunks the widest case needs, as chunk_bytes decides it.
  const mjp::cuda::PatchLayout wide = shapes[0].layout(0);
  alignas(16) float aligned[8];
  CHECK(mjp::cuda::chunk_bytes<float>(wide, aligned, aligned) == 16, "16-byte chunks expected");
  CHECK(mjp::cuda::chunk_bytes<float>(wide, aligned + 1, aligned) == 4, "a misaligned base: one element");
  CHECK(mjp::cuda::chunk_bytes<float>(shapes[4].layout(0), aligned, aligned) == 8, "a padded row: 8 bytes");
}

// ---- The epilogue (add_embeddings) and the gradient reductions, against the same sums in the same order.

template <typename T>
void check_epilogue_and_reductions(int64_t batch, int64_t positions, int64_t dim, int64_t prefix_rows,
                                   int64_t prefix_positions, bool bias_on, bool masked, bool misaligned,
                                   std::mt19937_64& rng) {
  std::normal_distribution<double> normal;
  const auto randoms = [&](int64_t count) {
    std::vector<T> values(count + 1);  // one spare in front, for a misaligned start
    for (auto& v : values) v = static_cast<T>(normal(rng));
    return values;
  };
  const int64_t shift = misaligned ? 1 : 0, rows_per_sample = prefix_rows + positions;
  auto tokens = randoms(batch * positions * dim), bias = randoms(dim), unk = randoms(dim);
  auto pos = randoms((prefix_positions + positions) * dim), prefix = randoms(prefix_rows * dim);
  std::vector<uint8_t> mask(batch * positions);
  for (auto& m : mask) m = rng() % 3 == 0;
  const bool* mask_data = masked ? reinterpret_cast<const bool*>(mask.data()) : nullptr;
  const T* bias_data = bias_on ? bias.data() + shift : nullptr;
  mjp::cuda::PatchLayout layout{batch, positions, 0, 1, 1, dim, 0, 0, 0};
  std::vector<T> out(batch * rows_per_sample * dim + 1, T(-99));
  CHECK(mjp::cuda::launch_add_embeddings<T>(layout, tokens.data() + shift, bias_data, pos.data() + shift,
                                            unk.data() + shift, mask_data, prefix.data() + shift, prefix_rows,
                                            prefix_positions, out.data() + shift, nullptr) == cudaSuccess,
        "epilogue launch");
  using acc = mjp::cuda::accumulate_t<T>;
  bool epilogue_ok = true;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t < rows_per_sample; ++t) {
      for (int64_t d = 0; d < dim; ++d) {
        acc value;
        if (t < prefix_rows) {
          value = static_cast<acc>(prefix[shift + t * dim + d]);
          if (t < prefix_positions) value += static_cast<acc>(pos[shift + t * dim + d]);
        } else {
          const int64_t n = t - prefix_rows, row = b * positions + n;
          value = static_cast<acc>(tokens[shift + row * dim + d]);
          if (bias_on) value += static_cast<acc>(bias[shift + d]);
          if (masked && mask[row]) {
            value += static_cast<acc>(unk[shift + d]);
          } else {
            value += static_cast<acc>(pos[shift + (prefix_positions + n) * dim + d]);
          }
        }
        epilogue_ok &= out[shift + (b * rows_per_sample + t) * dim + d] == static_cast<T>(value);
      }
    }
  }
  CHECK(epilogue_ok, "epilogue: D %lld P %lld Q %lld bias %d mask %d misaligned %d", (long long)dim,
        (long long)prefix_rows, (long long)prefix_positions, bias_on, masked, misaligned);

  // The reductions read the patch rows of grad [B, P + N, D] in place: sample stride (P + N) * D.
  const auto grad = randoms(batch * rows_per_sample * dim);
  std::vector<T> grad_pos(positions * dim), grad_unk(dim), grad_bias(dim);
  std::vector<acc> unk_partial(positions * dim), bias_partial(positions * dim);
  CHECK(mjp::cuda::launch_reduce_embedding_grads<T>(layout, grad.data() + prefix_rows * dim, rows_per_sample * dim,
                                                    mask_data, grad_pos.data(), grad_unk.data(), grad_bias.data(),
                                                    unk_partial.data(), bias_partial.data(), nullptr) == cudaSuccess,
        "reduction launch");
  bool reduce_ok = true;
  std::vector<acc> unk_sums(positions * dim), all_sums(positions * dim);
  for (int64_t n = 0; n < positions; ++n) {
    for (int64_t d = 0; d < dim; ++d) {
      acc kept = 0, shuffled = 0;
      for (int64_t b = 0; b < batch; ++b) {
        const acc value = static_cast<acc>(grad[(b * rows_per_sample + prefix_rows + n) * dim + d]);
        if (masked && mask[b * positions + n]) {
          shuffled += value;
        } else {
          kept += value;
        }
      }
      reduce_ok &= grad_pos[n * dim + d] == static_cast<T>(kept);
      unk_sums[n * dim + d] = shuffled;
      all_sums[n * dim + d] = kept + shuffled;
    }
  }
  for (int64_t d = 0; d < dim; ++d) {
    acc unk_total = 0, bias_total = 0;
    for (int64_t n = 0; n < positions; ++n) {
      unk_total += unk_sums[n * dim + d];
      bias_total += all_sums[n * dim + d];
    }
    reduce_ok &= grad_unk[d] == static_cast<T>(unk_total) && grad_bias[d] == static_cast<T>(bias_total);
  }
  CHECK(reduce_ok, "reductions: B %lld N %lld D %lld P %lld mask %d", (long long)batch, (long long)positions,
        (long long)dim, (long long)prefix_rows, masked);
}

void test_epilogue_and_reductions() {
  std::mt19937_64 rng(5);
  // D 8 (float: 16-byte packs), 6 (one element), 4 (double: 16-byte packs); batch 11 (the reduction's unrolled loop
  // and its tail); prefix layouts (0, 0), (1, 1), (2, 0).
  for (int64_t dim : {8, 6, 4}) {
    for (auto [prefix_rows, prefix_positions] : {std::pair<int64_t, int64_t>{0, 0}, {1, 1}, {2, 0}}) {
      for (int variant = 0; variant < 4; ++variant) {
        const bool bias_on = variant & 1, masked = variant & 2;
        check_epilogue_and_reductions<float>(11, 5, dim, prefix_rows, prefix_positions, bias_on, masked, false, rng);
        check_epilogue_and_reductions<double>(11, 5, dim, prefix_rows, prefix_positions, bias_on, masked, false, rng);
      }
      check_epilogue_and_reductions<float>(3, 4, dim, prefix_rows, prefix_positions, true, true, true, rng);
    }
  }
}

// ---- The position step on embedded tokens (pos_embed_cuda.cu): forward, the inverse move (with validate=False's
// duplicates and gaps), the ordered sums.

template <typename token_t, typename out_t>
void check_position_step(int64_t batch, int64_t positions, int64_t dim, int64_t prefix_rows, int64_t prefix_positions,
                         bool invalid, std::mt19937_64& rng) {
  using acc = mjp::cuda::sum_t<token_t, out_t>;
  std::normal_distribution<double> normal;
  const auto randoms = [&](auto zero, int64_t count) {
    std::vector<decltype(zero)> values(count);
    for (auto& v : values) v = static_cast<decltype(zero)>(normal(rng));
    return values;
  };
  const int64_t rows_per_sample = prefix_rows + positions;
  const auto tokens = randoms(token_t(0), batch * positions * dim);
  const auto pos = randoms(out_t(0), (prefix_positions + positions) * dim), unk = randoms(out_t(0), dim),
             prefix = randoms(out_t(0), std::max<int64_t>(prefix_rows * dim, 1));
  auto perm = shuffled_perm(batch, positions, false, rng);
  if (invalid && positions > 2) {  // a token shown twice, one never, an entry out of range
    perm[0] = perm[1];
    perm[positions - 1] = -4;
  }
  std::vector<uint8_t> mask(batch * positions);
  for (auto& m : mask) m = rng() % 3 == 0;
  const mjp::cuda::PositionLayout layout{batch, positions, dim, prefix_rows, prefix_positions};
  std::vector<out_t> out(batch * rows_per_sample * dim);
  // (each launch's status through a variable: a template argument list's comma would split CHECK's argument)
  cudaError_t status = mjp::cuda::launch_position_forward<token_t, out_t>(
      layout, tokens.data(), perm.data(), reinterpret_cast<const bool*>(mask.data()), pos.data(), unk.data(),
      prefix.data(), out.data(), nullptr);
  CHECK(status == cudaSuccess, "position forward launch");
  bool forward_ok = true;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t < rows_per_sample; ++t) {
      for (int64_t d = 0; d < dim; ++d) {
        out_t want;
        if (t < prefix_rows) {
          want = t < prefix_positions ? static_cast<out_t>(static_cast<acc>(prefix[t * dim + d]) +
                                                           static_cast<acc>(pos[t * dim + d]))
                                      : prefix[t * dim + d];
        } else {
          const int64_t n = t - prefix_rows, flat = b * positions + n, source = perm[flat];
          const out_t term = mask[flat] ? unk[d] : pos[(prefix_positions + n) * dim + d];
          want = source < 0 || source >= positions
                     ? term
                     : static_cast<out_t>(static_cast<acc>(tokens[(b * positions + source) * dim + d]) +
                                          static_cast<acc>(term));
        }
        forward_ok &= out[(b * rows_per_sample + t) * dim + d] == want;
      }
    }
  }

  const auto grad = randoms(out_t(0), batch * rows_per_sample * dim);
  std::vector<int32_t> inverse(batch * positions);
  std::vector<token_t> grad_tokens(batch * positions * dim);
  status = mjp::cuda::launch_position_move_back<out_t, token_t>(layout, grad.data(), perm.data(), inverse.data(),
                                                                grad_tokens.data(), nullptr);
  CHECK(status == cudaSuccess, "position move-back launch");
  bool move_ok = true;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t m = 0; m < positions; ++m) {
      int64_t shown = 0;
      for (int64_t n = 0; n < positions; ++n) shown += perm[b * positions + n] == m;
      for (int64_t d = 0; d < dim; ++d) {
        using move_acc = mjp::cuda::sum_t<out_t, token_t>;
        move_acc sum = 0;
        out_t only = out_t(0);
        for (int64_t n = 0; n < positions; ++n) {
          if (perm[b * positions + n] != m) continue;
          const out_t value = grad[(b * rows_per_sample + prefix_rows + n) * dim + d];
          sum += static_cast<move_acc>(value);
          only = value;
        }
        const token_t want = shown == 1 ? static_cast<token_t>(only) : static_cast<token_t>(sum);
        move_ok &= grad_tokens[(b * positions + m) * dim + d] == want;
      }
    }
  }

  using sum_type = std::conditional_t<std::is_same_v<out_t, double>, double, float>;
  std::vector<sum_type> table((prefix_positions + positions) * dim, sum_type(-1)), unk_partial(positions * dim),
      unk_sum(dim), prefix_sum(std::max<int64_t>(prefix_rows * dim, 1));
  status = mjp::cuda::launch_position_reduce<out_t, sum_type>(
      layout, grad.data(), reinterpret_cast<const bool*>(mask.data()), table.data(), unk_partial.data(),
      unk_sum.data(), prefix_rows > 0 ? prefix_sum.data() : nullptr, nullptr);
  CHECK(status == cudaSuccess, "position reduce launch");
  bool reduce_ok = true;
  std::vector<sum_type> unk_parts(positions * dim, 0);
  for (int64_t t = 0; t < rows_per_sample; ++t) {
    for (int64_t d = 0; d < dim; ++d) {
      sum_type kept = 0, masked = 0;
      for (int64_t b = 0; b < batch; ++b) {
        const sum_type value = static_cast<sum_type>(grad[(b * rows_per_sample + t) * dim + d]);
        if (t >= prefix_rows && mask[b * positions + t - prefix_rows]) {
          masked += value;
        } else {
          kept += value;
        }
      }
      if (t < prefix_rows) {
        reduce_ok &= prefix_sum[t * dim + d] == kept;
        if (t < prefix_positions) reduce_ok &= table[t * dim + d] == kept;
      } else {
        reduce_ok &= table[(prefix_positions + t - prefix_rows) * dim + d] == kept;
        unk_parts[(t - prefix_rows) * dim + d] = masked;
      }
    }
  }
  for (int64_t d = 0; d < dim; ++d) {
    sum_type total = 0;
    for (int64_t n = 0; n < positions; ++n) total += unk_parts[n * dim + d];
    reduce_ok &= unk_sum[d] == total;
  }
  CHECK(forward_ok && move_ok && reduce_ok,
        "position step: B %lld N %lld D %lld P %lld Q %lld invalid %d: forward %d, move back %d, sums %d",
        (long long)batch, (long long)positions, (long long)dim, (long long)prefix_rows, (long long)prefix_positions,
        invalid, forward_ok, move_ok, reduce_ok);
}

void test_position_step() {
  std::mt19937_64 rng(7);
  for (auto [prefix_rows, prefix_positions] : {std::pair<int64_t, int64_t>{0, 0}, {1, 1}, {3, 0}}) {
    for (bool invalid : {false, true}) {
      // D that fills the 16-byte packs (8 floats, 4 doubles, 4 bf16 on a float table, 16 bf16) and D that does not
      check_position_step<float, float>(3, 7, 5, prefix_rows, prefix_positions, invalid, rng);
      check_position_step<float, float>(3, 7, 8, prefix_rows, prefix_positions, invalid, rng);
      check_position_step<double, double>(2, 12, 3, prefix_rows, prefix_positions, invalid, rng);
      check_position_step<double, double>(2, 12, 4, prefix_rows, prefix_positions, invalid, rng);
      check_position_step<c10::BFloat16, float>(2, 6, 4, prefix_rows, prefix_positions, invalid, rng);
      check_position_step<c10::BFloat16, c10::BFloat16>(2, 5, 16, prefix_rows, prefix_positions, invalid, rng);
    }
  }
}

// ---- The DAL loss against a float64 reference.

struct DalProblem {
  int64_t positions, dim, hidden, batch, skip_rows;
  std::vector<double> table, w1, b1, w2, b2, coords;  // table: [skip_rows + N, D]
  std::vector<uint8_t> mask;                          // [B, N], empty: no mask
};

struct DalResult {
  double loss;
  std::vector<double> pred, hidden, weights, grad_table, grad_w1, grad_b1, grad_w2, grad_b2;
};

DalResult dal_reference(const DalProblem& p, double grad, double scale) {
  const int64_t n_count = p.positions, d_count = p.dim, h_count = p.hidden;
  DalResult r;
  r.weights.assign(n_count, 0.0);
  double total = 0;
  for (int64_t n = 0; n < n_count; ++n) {
    double kept = 1;
    if (!p.mask.empty()) {
      kept = 0;
      for (int64_t b = 0; b < p.batch; ++b) kept += p.mask[b * n_count + n] ? 0 : 1;
    }
    r.weights[n] = kept;
    total += kept;
  }
  for (auto& w : r.weights) w = p.mask.empty() ? 1.0 / std::max<int64_t>(n_count, 1) : w / std::max(total, 1.0);
  const auto row = [&](int64_t n) { return p.table.data() + (p.skip_rows + n) * d_count; };
  r.hidden.assign(n_count * h_count, 0.0);
  r.pred.assign(n_count * 2, 0.0);
  r.loss = 0;
  for (int64_t n = 0; n < n_count; ++n) {
    const bool kept = r.weights[n] != 0;
    for (int64_t k = 0; k < h_count && kept; ++k) {
      double sum = p.b1.empty() ? 0 : p.b1[k];
      for (int64_t d = 0; d < d_count; ++d) sum += row(n)[d] * p.w1[k * d_count + d];
      r.hidden[n * h_count + k] = std::max(sum, 0.0);
    }
    for (int j = 0; j < 2; ++j) {
      double sum = p.b2.empty() ? 0 : p.b2[j];
      for (int64_t k = 0; k < h_count; ++k) sum += r.hidden[n * h_count + k] * p.w2[j * h_count + k];
      r.pred[n * 2 + j] = sum;
    }
    if (kept) {
      r.loss += r.weights[n] * (std::fabs(r.pred[n * 2] - p.coords[n * 2]) +
                                std::fabs(r.pred[n * 2 + 1] - p.coords[n * 2 + 1]));
    }
  }
  r.loss *= scale;
  r.grad_table.assign((p.skip_rows + n_count) * d_count, 0.0);
  r.grad_w1.assign(h_count * d_count, 0.0);
  r.grad_b1.assign(h_count, 0.0);
  r.grad_w2.assign(2 * h_count, 0.0);
  r.grad_b2.assign(2, 0.0);
  for (int64_t n = 0; n < n_count; ++n) {
    if (r.weights[n] == 0) continue;
    double g[2];
    for (int j = 0; j < 2; ++j) {
      const double difference = r.pred[n * 2 + j] - p.coords[n * 2 + j];
      g[j] = grad * scale * r.weights[n] * ((difference > 0) - (difference < 0));
      r.grad_b2[j] += g[j];
    }
    for (int64_t k = 0; k < h_count; ++k) {
      const double h = r.hidden[n * h_count + k];
      r.grad_w2[k] += g[0] * h;
      r.grad_w2[h_count + k] += g[1] * h;
      const double dh = h > 0 ? g[0] * p.w2[k] + g[1] * p.w2[h_count + k] : 0.0;
      r.grad_b1[k] += dh;
      for (int64_t d = 0; d < d_count; ++d) {
        r.grad_w1[k * d_count + d] += dh * row(n)[d];
        r.grad_table[(p.skip_rows + n) * d_count + d] += dh * p.w1[k * d_count + d];
      }
    }
  }
  return r;
}

DalProblem dal_problem(int64_t positions, int64_t dim, int64_t hidden, int64_t batch, int64_t skip_rows, bool biases,
                       std::mt19937_64& rng) {
  std::normal_distribution<double> normal;
  DalProblem p{positions, dim, hidden, batch, skip_rows, {}, {}, {}, {}, {}, {}, {}};
  const auto randoms = [&](int64_t count, double scale) {
    std::vector<double> values(count);
    for (auto& v : values) v = normal(rng) * scale;
    return values;
  };
  p.table = randoms((skip_rows + positions) * dim, 1.0);
  p.w1 = randoms(hidden * dim, 1.0 / std::sqrt(static_cast<double>(dim)));
  p.w2 = randoms(2 * hidden, 1.0 / std::sqrt(static_cast<double>(hidden)));
  if (biases) {
    p.b1 = randoms(hidden, 1.0);
    p.b2 = randoms(2, 1.0);
    p.b2[0] += positions / 2.0;
  }
  for (int64_t n = 0; n < positions; ++n) {
    p.coords.push_back(static_cast<double>(n / 7));
    p.coords.push_back(static_cast<double>(n % 7));
  }
  if (batch > 0) {
    p.mask.resize(batch * positions);
    for (auto& m : p.mask) m = rng() % 2;
    for (int64_t b = 0; b < batch && positions > 2; ++b) p.mask[b * positions + 2] = 1;  // out of the loss
  }
  return p;
}

// |got - want| <= tolerance * (1 + max |want|) over a vector.
template <typename T>
bool close(const std::vector<T>& got, const std::vector<double>& want, double tolerance) {
  if (got.size() != want.size()) return false;
  double largest = 0;
  for (double w : want) largest = std::max(largest, std::fabs(w));
  for (size_t i = 0; i < got.size(); ++i) {
    if (!(std::fabs(static_cast<double>(got[i]) - want[i]) <= tolerance * (1 + largest))) return false;
  }
  return true;
}

template <typename T>
std::vector<T> as(const std::vector<double>& values) {
  return std::vector<T>(values.begin(), values.end());
}

template <typename T>
void check_dal(const DalProblem& p, double tolerance, bool poison) {
  const double scale = 0.5, grad_value = 0.75;
  auto table = as<T>(p.table);
  if (poison && !p.mask.empty() && p.positions > 2) {  // position 2: every sample masks it
    for (int64_t d = 0; d < p.dim; ++d) table[(p.skip_rows + 2) * p.dim + d] = std::numeric_limits<T>::quiet_NaN();
    table[(p.skip_rows + 2) * p.dim] = std::numeric_limits<T>::infinity();
  }
  const auto w1 = as<T>(p.w1), b1 = as<T>(p.b1), w2 = as<T>(p.w2), b2 = as<T>(p.b2), coords = as<T>(p.coords);
  const mjp::cuda::DalShape shape{p.positions, p.dim, p.hidden, p.mask.empty() ? 0 : p.batch};
  T loss = T(-1);
  std::vector<T> pred(p.positions * 2), hidden(p.positions * p.hidden), weights(p.positions);
  const bool* mask = p.mask.empty() ? nullptr : reinterpret_cast<const bool*>(p.mask.data());
  CHECK(mjp::cuda::launch_dal_forward<T>(shape, table.data() + p.skip_rows * p.dim, w1.data(),
                                         b1.empty() ? nullptr : b1.data(), w2.data(), b2.empty() ? nullptr : b2.data(),
                                         coords.data(), mask, scale, &loss, pred.data(), hidden.data(),
                                         weights.data(), nullptr) == cudaSuccess,
        "DAL forward launch");
  const DalResult want = dal_reference(p, grad_value, scale);
  const T grad = static_cast<T>(grad_value);
  std::vector<T> d_hidden(p.positions * p.hidden), grad_table((p.skip_rows + p.positions) * p.dim, T(-5)),
      grad_w1(p.hidden * p.dim), grad_b1(p.hidden), grad_w2(2 * p.hidden), grad_b2(2);
  CHECK(mjp::cuda::launch_dal_backward<T>(shape, p.skip_rows, &grad, scale, table.data() + p.skip_rows * p.dim,
                                          w1.data(), w2.data(), coords.data(), pred.data(), hidden.data(),
                                          weights.data(), d_hidden.data(), grad_table.data(), grad_w1.data(),
                                          grad_b1.data(), grad_w2.data(), grad_b2.data(), nullptr) == cudaSuccess,
        "DAL backward launch");
  // pred of a row out of the loss is b2 (its hidden row zeros); the reference leaves it as its formula gives it.
  std::vector<double> want_pred = want.pred;
  const bool ok = close(std::vector<T>{loss}, {want.loss}, tolerance) && close(weights, want.weights, tolerance) &&
                  close(hidden, want.hidden, tolerance) && close(pred, want_pred, tolerance) &&
                  close(grad_table, want.grad_table, tolerance) && close(grad_w1, want.grad_w1, tolerance) &&
                  close(grad_b1, want.grad_b1, tolerance) && close(grad_w2, want.grad_w2, tolerance) &&
                  close(grad_b2, want.grad_b2, tolerance);
  CHECK(ok, "DAL: %s N %lld D %lld H %lld B %lld skip %lld biases %d poison %d", sizeof(T) == 4 ? "float" : "double",
        (long long)p.positions, (long long)p.dim, (long long)p.hidden, (long long)p.batch, (long long)p.skip_rows,
        !p.b1.empty(), poison);
}

void test_dal() {
  std::mt19937_64 rng(9);
  struct Shape {
    int64_t positions, dim, hidden, batch, skip_rows;
    bool biases;
  };
  // Tiles' edges (32), a single position, no mask (batch 0), prefix rows, no biases; DeiT-S's N at a small D; more
  // positions than the loss kernel's threads (its mask count's other path).
  const Shape shapes[] = {{7, 5, 3, 4, 0, true},     {1, 1, 1, 0, 0, true},      {20, 40, 33, 6, 1, true},
                          {33, 32, 31, 3, 2, false}, {196, 48, 40, 16, 1, true}, {12, 9, 65, 0, 1, true},
                          {600, 4, 3, 5, 1, true}};
  for (const Shape& s : shapes) {
    const DalProblem p = dal_problem(s.positions, s.dim, s.hidden, s.batch, s.skip_rows, s.biases, rng);
    check_dal<float>(p, 2e-5, false);
    check_dal<double>(p, 1e-12, false);
    if (s.batch > 0) check_dal<float>(p, 2e-5, true);  // NaN and inf where every sample masks: out of everything
  }
}

}  // namespace

int main() {
  test_sampler();
  test_patch_copies();
  test_epilogue_and_reductions();
  test_position_step();
  test_dal();
  std::printf("%d checks, %d failures (%lld blocks run on host threads)\n", mjp_tests::checks, mjp_tests::failures,
              static_cast<long long>(blocks_run.load()));
  return mjp_tests::failures == 0 ? 0 : 1;
}
