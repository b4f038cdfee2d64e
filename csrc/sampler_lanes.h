// The jigsaw sampler of sampler.h for one sample, computed by a group of 32 cooperating lanes: on a GPU, one warp
// per sample (sampler_cuda.cu), where sample_jigsaw_row would give the whole sample to one thread.
//
// The one-thread path runs every step of a sample in sequence on global memory: on an H100 it took 160-180 us for
// a batch of 256 samples of a 14x14 grid, against 19 us for the Triton kernel. Here the same values come from
// parallel steps on shared memory:
// - each round of the block-wise mask draws its kAttemptsPerRound attempts in parallel, one lane each, and counts
//   their fresh cells against the same mask (the mask only changes once a round has its first success); the first
//   attempt that succeeds, in attempt order, is the one the sequential loop takes;
// - the mask is a bit set, so a rectangle's row is counted with a popcount or two;
// - the permutation ranks the masked positions' sort keys by counting (the keys are distinct), O(M^2 / 32) per lane
//   for M masked positions, instead of sorting them.
// The outputs equal sample_jigsaw_row's bit for bit (csrc/tests/test_sampler.cpp compares them on the host, through
// SerialLanes below; tests/test_gpu.py on a GPU).
//
// The group is a template parameter with three operations, so that the host can run the same code lane after lane:
//   lanes.each(f)    calls f(lane) on every lane, then synchronises the group (a phase);
//   lanes.ballot(f)  the bits of the lanes whose f(lane) is true (also a synchronisation point);
//   lanes.sync()     synchronises the group.
// Rules for the code below (a lane body runs concurrently with the other lanes' on a GPU, in sequence on the host):
// a lane body writes only shared scratch or the output rows, never a captured local, and never memory that another
// lane reads in the same phase; everything outside lane bodies is computed alike by every lane.
#pragma once

#include <cstdint>

#include "sampler.h"

namespace mjp {

constexpr int kSamplerLanes = 32;
// Grids up to this many positions run on one warp's shared memory (12.3 KiB at the limit); larger ones take the
// one-thread path.
constexpr int64_t kLanesSamplerMaxPositions = 1024;

MJP_HOST_DEVICE MJP_FORCE_INLINE int popcount32(uint32_t word) {
#if defined(__CUDA_ARCH__)
  return __popc(word);
#else
  return __builtin_popcount(word);
#endif
}

// Bits [offset, offset + count) of a 32-bit word set, 0 <= offset, 1 <= count, offset + count <= 32.
MJP_HOST_DEVICE MJP_FORCE_INLINE uint32_t bit_range(int64_t offset, int64_t count) {
  return (count >= 32 ? ~0u : ((1u << count) - 1u)) << offset;
}

// How many of the bits [start, start + length) of the bit set `bits` are set.
MJP_HOST_DEVICE MJP_FORCE_INLINE int64_t count_set_bits(const uint32_t* bits, int64_t start, int64_t length) {
  int64_t total = 0;
  for (const int64_t end = start + length; start < end;) {
    const int64_t offset = start & 31;
    const int64_t take = (32 - offset) < (end - start) ? (32 - offset) : (end - start);
    total += popcount32(bits[start >> 5] & bit_range(offset, take));
    start += take;
  }
  return total;
}

// Sets the bits [start, start + length) of `bits`.
MJP_HOST_DEVICE MJP_FORCE_INLINE void set_bits(uint32_t* bits, int64_t start, int64_t length) {
  for (const int64_t end = start + length; start < end;) {
    const int64_t offset = start & 31;
    const int64_t take = (32 - offset) < (end - start) ? (32 - offset) : (end - start);
    bits[start >> 5] |= bit_range(offset, take);
    start += take;
  }
}

// How many cells of rectangle r of a grid with `cols` columns are not yet masked.
MJP_HOST_DEVICE MJP_FORCE_INLINE int64_t fresh_cells(const uint32_t* bits, int64_t cols, const Rectangle& r) {
  int64_t set = 0;
  for (int64_t row = r.top; row < r.top + r.height; ++row) set += count_set_bits(bits, row * cols + r.left, r.width);
  return r.height * r.width - set;
}

// Shared scratch of one sample of N <= kLanesSamplerMaxPositions positions: `bits` and `word_starts` hold
// ceil(N / 32) words, `ascending` and `keys` N entries.
struct LanesScratch {
  int64_t* keys;          // the masked positions' sort keys, by ascending position
  int32_t* ascending;     // the masked positions, ascending
  uint32_t* bits;         // the mask, bit n = position n
  uint32_t* word_starts;  // masked positions before each word of `bits`
};

// Bytes of LanesScratch for N positions, laid out in its order (keys first: 8-byte aligned).
MJP_HOST_DEVICE MJP_FORCE_INLINE int64_t lanes_scratch_bytes(int64_t num_positions) {
  const int64_t words = (num_positions + 31) / 32;
  return num_positions * static_cast<int64_t>(sizeof(int64_t) + sizeof(int32_t)) +
         2 * words * static_cast<int64_t>(sizeof(uint32_t));
}

MJP_HOST_DEVICE MJP_FORCE_INLINE LanesScratch lanes_scratch_at(void* memory, int64_t num_positions) {
  LanesScratch s;
  s.keys = static_cast<int64_t*>(memory);
  s.ascending = reinterpret_cast<int32_t*>(s.keys + num_positions);
  s.bits = reinterpret_cast<uint32_t*>(s.ascending + num_positions);
  s.word_starts = s.bits + (num_positions + 31) / 32;
  return s;
}

// sample_jigsaw_row's jigsaw (same arguments, N = rows * cols <= kLanesSamplerMaxPositions), by the lanes of
// `lanes` with the shared scratch `s`. mask_row and perm_row are written, never read.
template <typename Lanes>
MJP_HOST_DEVICE inline void sample_jigsaw_lanes(const Lanes& lanes, int64_t rows, int64_t cols, int64_t target,
                                                int64_t min_block, uint64_t seed, uint64_t stream,
                                                int64_t prob_threshold, const int64_t* h_thresholds,
                                                const int64_t* w_thresholds, const LanesScratch& s, bool* mask_row,
                                                int64_t* perm_row) {
  const int64_t num_positions = rows * cols;
  const int64_t words = (num_positions + 31) / 32;
  const uint32_t c1 = static_cast<uint32_t>(stream);
  const uint32_t c2 = static_cast<uint32_t>(stream >> 32);

  const uint32_t coin = philox4x32_10(seed, 0, c1, c2, kTagCoin).o0;
  if (!(static_cast<int64_t>(coin) < prob_threshold) || target <= 0) {
    lanes.each([&](int lane) {
      for (int64_t n = lane; n < num_positions; n += kSamplerLanes) {
        mask_row[n] = false;
        perm_row[n] = n;
      }
    });
    return;
  }

  // ---- Block-wise mask: sample_jigsaw_row's rounds, the attempts of a round in parallel.
  lanes.each([&](int lane) {
    for (int64_t w = lane; w < words; w += kSamplerLanes) s.bits[w] = 0;
  });
  int64_t count = 0;
  for (uint32_t round = 0; count < target; ++round) {
    const int64_t remaining = target - count;
    int64_t low, high;
    round_area_bounds(target, count, min_block, low, high);
    const uint32_t successes = lanes.ballot([&](int lane) {
      if (lane >= kAttemptsPerRound) return false;
      Rectangle r;
      if (!draw_rectangle(seed, c1, c2, round * kAttemptsPerRound + static_cast<uint32_t>(lane), low, high, rows,
                          cols, h_thresholds, w_thresholds, r)) {
        return false;
      }
      const int64_t fresh = fresh_cells(s.bits, cols, r);
      return fresh > 0 && fresh <= remaining;
    });
    if (successes == 0) break;  // no attempt of the round succeeded: the sequential loop stops there too
    // The first success, redrawn by every lane (a draw is a pure function of its counter).
    uint32_t first = 0;
    while (!((successes >> first) & 1u)) ++first;
    Rectangle r{0, 0, 0, 0};
    draw_rectangle(seed, c1, c2, round * kAttemptsPerRound + first, low, high, rows, cols, h_thresholds,
                   w_thresholds, r);
    count += fresh_cells(s.bits, cols, r);
    lanes.sync();  // every lane has read the bits before lane 0 sets the rectangle's
    lanes.each([&](int lane) {
      if (lane != 0) return;
      for (int64_t row = r.top; row < r.top + r.height; ++row) set_bits(s.bits, row * cols + r.left, r.width);
    });
  }

  // ---- Permutation of the masked positions: perm_row[m_i] = s_i (sample_jigsaw_row's permute_masked).
  lanes.each([&](int lane) {
    if (lane != 0) return;
    uint32_t before = 0;
    for (int64_t w = 0; w < words; ++w) {
      s.word_starts[w] = before;
      before += static_cast<uint32_t>(popcount32(s.bits[w]));
    }
  });
  // Each masked position's index a among the masked ones, ascending: ascending[a] = n, keys[a] = its sort key.
  lanes.each([&](int lane) {
    for (int64_t n = lane; n < num_positions; n += kSamplerLanes) {
      const uint32_t word = s.bits[n >> 5];
      const bool masked = (word >> (n & 31)) & 1u;
      mask_row[n] = masked;
      if (masked) {
        const int64_t a = s.word_starts[n >> 5] + popcount32(word & ((1u << (n & 31)) - 1u));  // bits below n
        s.ascending[a] = static_cast<int32_t>(n);
        s.keys[a] = perm_sort_key(seed, n, c1, c2);
      } else {
        perm_row[n] = n;
      }
    }
  });
  // The position whose key has rank r goes to the r-th masked position: s_r = ascending[i], m_r = ascending[r].
  lanes.each([&](int lane) {
    for (int64_t i = lane; i < count; i += kSamplerLanes) {
      const int64_t key = s.keys[i];
      int64_t rank = 0;
      for (int64_t j = 0; j < count; ++j) rank += s.keys[j] < key;
      perm_row[s.ascending[rank]] = s.ascending[i];
    }
  });
}

}  // namespace mjp
