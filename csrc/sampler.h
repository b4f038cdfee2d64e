// The jigsaw sampler of docs/sampler.md, written once for the host (C++) and the device (CUDA).
//
// Everything here is integer arithmetic on caller-provided memory (and at most about 5 KiB of stack): no
// allocation, no floating point, no library calls but memcpy, so the CPU path and the CUDA kernel run the same
// definition and give bit-identical results, equal to the PyTorch oracle
// `mjp_fast.sampler.reference.sample_from_tables`. The host adds a few fast paths (below) that compute the same
// values as the portable code.
#pragma once

#include <cstdint>
#include <cstring>

// Host fast paths: the permutation sorted in a stack buffer, mask rows tested and set 8 cells at a time, and on
// x86-64 AVX2 Philox for the permutation's keys (chosen at run time by CPU support). A GPU thread runs the
// portable code, which computes the same values; defining MJP_SAMPLER_PORTABLE makes the host run it too (the
// C++ tests build both).
#if !defined(__CUDA_ARCH__) && !defined(MJP_SAMPLER_PORTABLE)
#define MJP_HOST_FAST_PATHS 1
#else
#define MJP_HOST_FAST_PATHS 0
#endif
#if !defined(__CUDACC__) && !defined(__HIPCC__) && !defined(MJP_SAMPLER_PORTABLE) && defined(__x86_64__) && \
    (defined(__GNUC__) || defined(__clang__))
#define MJP_HOST_X86_SIMD 1
#include <immintrin.h>
#else
#define MJP_HOST_X86_SIMD 0
#endif

#if defined(__CUDACC__) || defined(__HIPCC__)
#define MJP_HOST_DEVICE __host__ __device__
#define MJP_FORCE_INLINE __forceinline__
#elif defined(_MSC_VER)
#define MJP_HOST_DEVICE
#define MJP_FORCE_INLINE __forceinline
#else
#define MJP_HOST_DEVICE
#define MJP_FORCE_INLINE inline __attribute__((always_inline))
#endif

namespace mjp {

constexpr int kAspectBins = 1024;
constexpr int kAspectBinShift = 22;  // 32 - log2(kAspectBins): the bin is the top 10 bits of a uint32
constexpr int kAttemptsPerRound = 10;  // BEiT's number of tries per rectangle
constexpr uint32_t kTagMask = 0;
constexpr uint32_t kTagPerm = 1;
constexpr uint32_t kTagCoin = 2;

constexpr uint32_t kPhiloxRoundA = 0xD2511F53u;
constexpr uint32_t kPhiloxRoundB = 0xCD9E8D57u;
constexpr uint32_t kPhiloxKeyA = 0x9E3779B9u;
constexpr uint32_t kPhiloxKeyB = 0xBB67AE85u;

struct Philox4 {
  uint32_t o0, o1, o2, o3;
};

// Philox4x32-10 as Triton's tl.philox: key (seed low word, seed high word), ten rounds.
MJP_HOST_DEVICE MJP_FORCE_INLINE Philox4 philox4x32_10(uint64_t seed, uint32_t c0, uint32_t c1, uint32_t c2,
                                                       uint32_t c3) {
  uint32_t k0 = static_cast<uint32_t>(seed);
  uint32_t k1 = static_cast<uint32_t>(seed >> 32);
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
#if defined(__CUDA_ARCH__)
    const uint32_t high_b = __umulhi(kPhiloxRoundB, c2), low_b = kPhiloxRoundB * c2;
    const uint32_t high_a = __umulhi(kPhiloxRoundA, c0), low_a = kPhiloxRoundA * c0;
#else
    // One 32x32->64 multiply gives both halves (a separate mul-high and mul-low would double the multiplies).
    const uint64_t product_b = static_cast<uint64_t>(kPhiloxRoundB) * c2;
    const uint64_t product_a = static_cast<uint64_t>(kPhiloxRoundA) * c0;
    const uint32_t high_b = static_cast<uint32_t>(product_b >> 32), low_b = static_cast<uint32_t>(product_b);
    const uint32_t high_a = static_cast<uint32_t>(product_a >> 32), low_a = static_cast<uint32_t>(product_a);
#endif
    c0 = high_b ^ c1 ^ k0;
    c2 = high_a ^ c3 ^ k1;
    c1 = low_b;
    c3 = low_a;
    k0 += kPhiloxKeyA;
    k1 += kPhiloxKeyB;
  }
  return Philox4{c0, c1, c2, c3};
}

// The sort key of masked position `position` (< 2**30): its TAG_PERM draw o0 times 2**31, plus the position. One
// int64 orders the positions by (key, position) and holds the position in its low 31 bits.
MJP_HOST_DEVICE MJP_FORCE_INLINE int64_t perm_sort_key(uint64_t seed, int64_t position, uint32_t c1, uint32_t c2) {
  const uint32_t key = philox4x32_10(seed, static_cast<uint32_t>(position), c1, c2, kTagPerm).o0;
  return (static_cast<int64_t>(key) << 31) | position;
}

constexpr int kSortKeyPositionBits = 31;
constexpr int64_t kSortKeyPositionMask = (int64_t(1) << kSortKeyPositionBits) - 1;

#if MJP_HOST_X86_SIMD
// values[i] = perm_sort_key(seed, values[i], c1, c2) for i < count - count % 4: four Philox streams per 256-bit
// vector, one per 64-bit lane. Only the low 32 bits of a lane carry a Philox word: _mm256_mul_epu32 reads only
// those, so the high halves may hold anything until the final shift drops them.
__attribute__((target("avx2"))) inline void perm_sort_keys_avx2(uint64_t seed, uint32_t c1, uint32_t c2,
                                                                  int64_t* values, int64_t count) {
  const __m256i round_a = _mm256_set1_epi64x(kPhiloxRoundA);
  const __m256i round_b = _mm256_set1_epi64x(kPhiloxRoundB);
  const __m256i counter1 = _mm256_set1_epi64x(c1);
  const __m256i counter2 = _mm256_set1_epi64x(c2);
  const __m256i counter3 = _mm256_set1_epi64x(kTagPerm);
  __m256i key0[10], key1[10];
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round, k0 += kPhiloxKeyA, k1 += kPhiloxKeyB) {
    key0[round] = _mm256_set1_epi64x(k0);
    key1[round] = _mm256_set1_epi64x(k1);
  }
  for (int64_t i = 0; i + 4 <= count; i += 4) {
    const __m256i positions = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + i));
    __m256i x0 = positions, x1 = counter1, x2 = counter2, x3 = counter3;
    for (int round = 0; round < 10; ++round) {
      const __m256i product_b = _mm256_mul_epu32(round_b, x2);
      const __m256i product_a = _mm256_mul_epu32(round_a, x0);
      x0 = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(product_b, 32), x1), key0[round]);
      x2 = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(product_a, 32), x3), key1[round]);
      x1 = product_b;
      x3 = product_a;
    }
    // (o0 << 32) >> 1 == o0 * 2**31 with the lane's high garbage shifted out; then | position.
    const __m256i keys = _mm256_srli_epi64(_mm256_slli_epi64(x0, 32), 1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(values + i), _mm256_or_si256(keys, positions));
  }
}

inline bool host_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}
#endif

// values[i] = perm_sort_key(seed, values[i], c1, c2) for i < count: the sort keys of `count` positions.
MJP_HOST_DEVICE inline void perm_sort_keys(uint64_t seed, uint32_t c1, uint32_t c2, int64_t* values,
                                           int64_t count) {
  int64_t done = 0;
#if MJP_HOST_X86_SIMD
  if (host_has_avx2()) {
    perm_sort_keys_avx2(seed, c1, c2, values, count);
    done = count - count % 4;
  }
#endif
  for (int64_t i = done; i < count; ++i) values[i] = perm_sort_key(seed, values[i], c1, c2);
}

// ---- Sorting distinct non-negative int64 values in place or into a disjoint buffer, without allocation.

constexpr int64_t kSmallSort = 32;     // insertion sort up to this many values (in place, within a bucket)
constexpr int64_t kBucketSortMin = 8;  // bucket sort (out of place) above this many values
constexpr int kMaxBucketBits = 7;      // counting-scatter buckets: at most 128 (int32 counters on the stack)
constexpr int kMaxInPlaceBucketBits = 6;  // in-place bucket pass: at most 64 buckets (two counter arrays)
constexpr int64_t kValuesPerBucketForOnePass = 4;  // up to this many values per bucket: one insertion sort
constexpr int64_t kHostSortBuffer = 512;  // host: permutations of up to this many positions sort on the stack
#if (defined(__BYTE_ORDER__) && defined(__ORDER_LITTLE_ENDIAN__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__) || \
    defined(_MSC_VER)
constexpr bool kLittleEndianHost = true;
#else
constexpr bool kLittleEndianHost = false;
#endif

#if defined(_MSC_VER) && !defined(__CUDA_ARCH__)
#include <intrin.h>
#endif
// Index of the lowest set bit of a nonzero word. Used by host fast paths only; defined for the device too because
// mark_fresh_cells's word callback names it there (it never runs on a GPU).
MJP_HOST_DEVICE inline int trailing_zeros(uint64_t word) {
#if defined(__CUDA_ARCH__)
  return __ffsll(static_cast<long long>(word)) - 1;
#elif defined(_MSC_VER)
  unsigned long index;
  _BitScanForward64(&index, word);
  return static_cast<int>(index);
#else
  return __builtin_ctzll(word);
#endif
}

// Ascending insertion sort of values[0, count): for short or nearly sorted arrays. Each value is first exchanged
// with its predecessor without a branch (select), and only a value smaller than two sorted ones walks further:
// in bucketed random keys the first exchange is a coin flip that a branch would mispredict, the walk is rare.
MJP_HOST_DEVICE inline void insertion_sort(int64_t* values, int64_t count) {
  for (int64_t i = 1; i < count; ++i) {
    const int64_t value = values[i];
    const int64_t previous = values[i - 1];
    const bool exchange = value < previous;
    values[i] = exchange ? previous : value;
    values[i - 1] = exchange ? value : previous;
    // Only an exchanged value below values[i - 2] walks on; the test is false for every value that stayed.
    int64_t j = i - 1;
    for (; j > 0 && values[j - 1] > value; --j) values[j] = values[j - 1];
    values[j] = values[j] < value ? values[j] : value;
  }
}

// Sifts `value` down from `root` into the max-heap values[0, end).
MJP_HOST_DEVICE MJP_FORCE_INLINE void sift_down(int64_t* values, int64_t root, int64_t end, int64_t value) {
  while (true) {
    int64_t child = 2 * root + 1;
    if (child >= end) break;
    if (child + 1 < end && values[child + 1] > values[child]) ++child;
    if (values[child] <= value) break;
    values[root] = values[child];
    root = child;
  }
  values[root] = value;
}

// Ascending in-place heap sort of values[0, count): O(count log count), no recursion, no scratch.
MJP_HOST_DEVICE inline void heap_sort(int64_t* values, int64_t count) {
  for (int64_t root = count / 2 - 1; root >= 0; --root) sift_down(values, root, count, values[root]);
  for (int64_t end = count - 1; end > 0; --end) {
    const int64_t top = values[0];
    sift_down(values, 0, end, values[end]);
    values[end] = top;
  }
}

// Sorts one bucket: insertion sort when short (the usual case), heap sort otherwise (bounds the worst case).
MJP_HOST_DEVICE MJP_FORCE_INLINE void sort_bucket(int64_t* values, int64_t count) {
  if (count <= kSmallSort) {
    insertion_sort(values, count);
  } else {
    heap_sort(values, count);
  }
}

// Enough bucket bits for about one value per bucket, at most max_bits.
MJP_HOST_DEVICE MJP_FORCE_INLINE int bucket_bits_for(int64_t count, int max_bits) {
  int bits = 0;
  while (bits < max_bits && (int64_t(1) << bits) < count) ++bits;
  return bits;
}

// Finishes a bucket sort: values[0, count) holds the buckets in order, bucket b ending at ends[b]. With a few
// values per bucket (the usual case) one insertion sort over the whole array is cheapest: it only moves values
// within their bucket, and its branches are predictable, where a loop over the buckets mispredicts at every
// bucket's size. Crowded buckets (skewed input, or very many values) are sorted one by one.
MJP_HOST_DEVICE MJP_FORCE_INLINE void sort_buckets(int64_t* values, int64_t count, const int32_t* ends, int buckets) {
  if (count <= kValuesPerBucketForOnePass * buckets) {
    insertion_sort(values, count);
    return;
  }
  int64_t start = 0;
  for (int b = 0; b < buckets; ++b) {
    sort_bucket(values + start, ends[b] - start);
    start = ends[b];
  }
}

// Sorts source[0, count) into the disjoint destination[0, count): a counting scatter by the top bits of the
// 63-bit values, then each bucket sorted. Expected O(count) for uniformly random top bits (the permutation's keys
// are), exact for any input.
MJP_HOST_DEVICE inline void bucket_sort_into(const int64_t* source, int64_t count, int64_t* destination) {
  const int bits = bucket_bits_for(count, kMaxBucketBits);
  const int shift = 63 - bits;
  const int buckets = 1 << bits;
  int32_t ends[1 << kMaxBucketBits];
  for (int b = 0; b < buckets; ++b) ends[b] = 0;
  for (int64_t i = 0; i < count; ++i) ++ends[source[i] >> shift];
  int32_t total = 0;
  for (int b = 0; b < buckets; ++b) {  // exclusive prefix sum: ends[b] = where bucket b starts
    const int32_t size = ends[b];
    ends[b] = total;
    total += size;
  }
  for (int64_t i = 0; i < count; ++i) destination[ends[source[i] >> shift]++] = source[i];
  sort_buckets(destination, count, ends, buckets);
}

// Sorts values[0, count) in place: one in-place bucket pass by the top bits ("American flag" cycles), then each
// bucket sorted. For when no scratch space is free.
MJP_HOST_DEVICE inline void bucket_sort_in_place(int64_t* values, int64_t count) {
  const int bits = bucket_bits_for(count, kMaxInPlaceBucketBits);
  const int shift = 63 - bits;
  const int buckets = 1 << bits;
  int32_t next[1 << kMaxInPlaceBucketBits];
  int32_t ends[1 << kMaxInPlaceBucketBits];
  for (int b = 0; b < buckets; ++b) ends[b] = 0;
  for (int64_t i = 0; i < count; ++i) ++ends[values[i] >> shift];
  int32_t total = 0;
  for (int b = 0; b < buckets; ++b) {
    next[b] = total;
    total += ends[b];
    ends[b] = total;
  }
  for (int b = 0; b < buckets; ++b) {
    while (next[b] < ends[b]) {
      // Carry the value at the first unplaced slot of bucket b to its bucket, displacing the value there, until
      // the carried value belongs to bucket b.
      int64_t carried = values[next[b]];
      int target = static_cast<int>(carried >> shift);
      while (target != b) {
        const int64_t displaced = values[next[target]];
        values[next[target]++] = carried;
        carried = displaced;
        target = static_cast<int>(carried >> shift);
      }
      values[next[b]++] = carried;
    }
  }
  sort_buckets(values, count, ends, buckets);
}

// The permutation of docs/sampler.md: perm_row[m_i] = s_i, where m_0 < m_1 < ... are the masked positions and
// s_0, s_1, ... the same positions sorted by their sort keys; perm_row[n] = n elsewhere.
//
// On entry perm_row[N - masked, N) lists the masked positions in any order (the rest of perm_row is free) and
// mask_row is final.
MJP_HOST_DEVICE inline void permute_masked(uint64_t seed, uint32_t c1, uint32_t c2, int64_t num_positions,
                                           int64_t masked, const bool* mask_row, int64_t* perm_row) {
  int64_t* listed = perm_row + (num_positions - masked);
  perm_sort_keys(seed, c1, c2, listed, masked);
#if MJP_HOST_FAST_PATHS
  if (masked <= kHostSortBuffer) {
    // Host: sort into a stack buffer, then write perm_row front to back: the identity, then s_i at the i-th masked
    // position, found a word of 8 mask bytes at a time. (A GPU thread keeps the in-place path below, which needs
    // no per-thread buffer.)
    int64_t sorted[kHostSortBuffer];
    if (masked > kBucketSortMin) {
      bucket_sort_into(listed, masked, sorted);
    } else {
      for (int64_t i = 0; i < masked; ++i) sorted[i] = listed[i];
      insertion_sort(sorted, masked);
    }
    for (int64_t n = 0; n < num_positions; ++n) perm_row[n] = n;
    int64_t next = 0;
    int64_t n = 0;
    for (; kLittleEndianHost && n + 8 <= num_positions; n += 8) {  // big-endian hosts take the tail loop
      uint64_t word;  // byte j is mask_row[n + j], 0 or 1
      memcpy(&word, mask_row + n, sizeof(word));
      for (; word != 0; word &= word - 1) {
        perm_row[n + (trailing_zeros(word) >> 3)] = sorted[next++] & kSortKeyPositionMask;
      }
    }
    for (; n < num_positions; ++n) {
      if (mask_row[n]) perm_row[n] = sorted[next++] & kSortKeyPositionMask;
    }
    return;
  }
#endif
  // Sort into perm_row[0, masked): out of place when the front half is free, else in place after a forward move.
  // The sort keys are distinct, so every sort gives the same order.
  if (masked > kBucketSortMin && 2 * masked <= num_positions) {
    bucket_sort_into(listed, masked, perm_row);
  } else {
    for (int64_t i = 0; i < masked; ++i) perm_row[i] = listed[i];  // forward move; the ranges may overlap
    if (masked > kSmallSort) {
      bucket_sort_in_place(perm_row, masked);
    } else {
      insertion_sort(perm_row, masked);
    }
  }

  // perm[m_i] = s_i with s_i in perm_row[i] and m_i >= i: filling from the end overwrites only slots whose
  // sorted entry was already read. Branch-free per position (the mask is unpredictable), with a fast path for
  // runs of 8 unmasked positions.
  int64_t next = masked - 1;
  int64_t n = num_positions - 1;
  while (n >= 0) {
    if (n >= 7) {
      uint64_t word;
      memcpy(&word, mask_row + (n - 7), sizeof(word));
      if (word == 0) {
        for (int j = 0; j < 8; ++j) perm_row[n - j] = n - j;
        n -= 8;
        continue;
      }
    }
    const bool is_masked = mask_row[n];
    const int64_t sorted = perm_row[next < 0 ? 0 : next] & kSortKeyPositionMask;  // slot 0: a harmless dummy read
    perm_row[n] = is_masked ? sorted : n;
    next -= is_masked;
    --n;
  }
}

// ---- The rectangle of an attempt: rows [top, top + height) x cols [left, left + width) of a mask with `cols`
// columns and num_positions cells. On little-endian hosts a row of at most 8 cells is one 8-byte word (the mask's
// bools are bytes 0 or 1) whenever 8 bytes from its start lie inside the mask; otherwise, and on a GPU, cell by
// cell.

// Bytes [0, width) of a word set, 1 <= width <= 8.
MJP_HOST_DEVICE MJP_FORCE_INLINE uint64_t low_bytes(int64_t width) { return ~uint64_t(0) >> (64 - 8 * width); }

MJP_HOST_DEVICE MJP_FORCE_INLINE bool row_is_one_word(int64_t start, int64_t width, int64_t num_positions) {
  return kLittleEndianHost && width >= 1 && width <= 8 && start + 8 <= num_positions;
}

constexpr uint64_t kByteOnes = 0x0101010101010101ull;

// Visits the rectangle's rows top to bottom: on_word(start, word) for a row that is one word on this host (word:
// the 8 mask bytes from the row's first cell `start`, the row's cells in bytes [0, width)), else on_cell(position)
// for each of the row's cells, columns ascending. Inlined with its callbacks, so the loops compile as if written
// out at each call (the host's machine code is that of the hand-written loops, register choices aside).
template <typename OnWord, typename OnCell>
MJP_HOST_DEVICE MJP_FORCE_INLINE void for_each_rectangle_row(const bool* mask_row, int64_t num_positions,
                                                             int64_t cols, int64_t top, int64_t height, int64_t left,
                                                             int64_t width, OnWord&& on_word, OnCell&& on_cell) {
  for (int64_t row = top; row < top + height; ++row) {
    const int64_t start = row * cols + left;
#if MJP_HOST_FAST_PATHS
    if (row_is_one_word(start, width, num_positions)) {
      uint64_t word;
      memcpy(&word, mask_row + start, sizeof(word));
      on_word(start, word);
      continue;
    }
#endif
    for (int64_t col = 0; col < width; ++col) on_cell(start + col);
  }
}

// How many cells of the rectangle are False.
MJP_HOST_DEVICE MJP_FORCE_INLINE int64_t count_fresh_cells(const bool* mask_row, int64_t num_positions, int64_t cols,
                                                           int64_t top, int64_t height, int64_t left, int64_t width) {
  int64_t fresh = 0;
  for_each_rectangle_row(
      mask_row, num_positions, cols, top, height, left, width,
      [&](int64_t, uint64_t word) {
        fresh += width - static_cast<int64_t>(((word & low_bytes(width)) * kByteOnes) >> 56);  // byte sum: the Trues
      },
      [&](int64_t position) { fresh += !mask_row[position]; });
  return fresh;
}

// Sets the rectangle's cells True and lists each newly set position at list_end[0], list_end[-1], ... (row by
// row, columns ascending).
MJP_HOST_DEVICE MJP_FORCE_INLINE void mark_fresh_cells(bool* mask_row, int64_t num_positions, int64_t cols,
                                                       int64_t top, int64_t height, int64_t left, int64_t width,
                                                       int64_t* list_end) {
  for_each_rectangle_row(
      mask_row, num_positions, cols, top, height, left, width,
      [&](int64_t start, uint64_t word) {
        const uint64_t cells = kByteOnes & low_bytes(width);
        for (uint64_t fresh = ~word & cells; fresh != 0; fresh &= fresh - 1) {
          *list_end-- = start + (trailing_zeros(fresh) >> 3);
        }
        word |= cells;
        memcpy(mask_row + start, &word, sizeof(word));
      },
      [&](int64_t position) {
        if (!mask_row[position]) {
          mask_row[position] = true;
          *list_end-- = position;
        }
      });
}

// The rectangle of one attempt of the block-wise mask: rows [top, top + height) x cols [left, left + width).
struct Rectangle {
  int64_t top, height, left, width;
};

// Draws attempt number `attempt` (round * kAttemptsPerRound + its index in the round) of a round whose area lies in
// [low, high): false when its height or width would fill the grid (BEiT skips such an attempt), else true with `r`
// set. The tables are sample_jigsaw_row's.
MJP_HOST_DEVICE MJP_FORCE_INLINE bool draw_rectangle(uint64_t seed, uint32_t c1, uint32_t c2, uint32_t attempt,
                                                     int64_t low, int64_t high, int64_t rows, int64_t cols,
                                                     const int64_t* h_thresholds, const int64_t* w_thresholds,
                                                     Rectangle& r) {
  const Philox4 draw = philox4x32_10(seed, attempt, c1, c2, kTagMask);
  // Q32 area uniform in [low, high); exact in int64 since high <= 2**30.
  const int64_t area_q = low * (int64_t(1) << 32) + (high - low) * static_cast<int64_t>(draw.o0);
  const int64_t bin = static_cast<int64_t>(draw.o1 >> kAspectBinShift);
  const int64_t* h_row = h_thresholds + bin * rows;
  const int64_t* w_row = w_thresholds + bin * cols;
  r.height = 0;
  for (int64_t k = 0; k < rows; ++k) r.height += area_q >= h_row[k];
  if (r.height >= rows) return false;
  r.width = 0;
  for (int64_t k = 0; k < cols; ++k) r.width += area_q >= w_row[k];
  if (r.width >= cols) return false;
  r.top = static_cast<int64_t>((static_cast<uint64_t>(draw.o2) * (rows - r.height + 1)) >> 32);
  r.left = static_cast<int64_t>((static_cast<uint64_t>(draw.o3) * (cols - r.width + 1)) >> 32);
  return true;
}

// The bounds of round `round` of the block-wise mask, `count` cells masked so far: its areas lie in [low, high).
MJP_HOST_DEVICE MJP_FORCE_INLINE void round_area_bounds(int64_t target, int64_t count, int64_t min_block,
                                                        int64_t& low, int64_t& high) {
  const int64_t remaining = target - count;
  low = min_block < remaining ? min_block : remaining;
  high = min_block < remaining ? remaining : min_block;
}

// Samples one jigsaw (docs/sampler.md, "Per sample") into mask_row[0, N) and perm_row[0, N), N = rows * cols.
//
// rows, cols: the grid, N <= 2**30; target: floor(ratio * N) in [0, N]; min_block in [1, 2**30];
// stream: the stream index s (offset + i, or offset when shared); prob_threshold in [0, 2**32];
// h_thresholds: int64 [1024, rows] and w_thresholds: int64 [1024, cols], row-major and contiguous.
// perm_row doubles as the scratch space of the permutation's sort.
MJP_HOST_DEVICE inline void sample_jigsaw_row(int64_t rows, int64_t cols, int64_t target, int64_t min_block,
                                              uint64_t seed, uint64_t stream, int64_t prob_threshold,
                                              const int64_t* h_thresholds, const int64_t* w_thresholds,
                                              bool* mask_row, int64_t* perm_row) {
  const int64_t num_positions = rows * cols;
  for (int64_t n = 0; n < num_positions; ++n) mask_row[n] = false;
  const uint32_t c1 = static_cast<uint32_t>(stream);
  const uint32_t c2 = static_cast<uint32_t>(stream >> 32);

  const uint32_t coin = philox4x32_10(seed, 0, c1, c2, kTagCoin).o0;
  if (!(static_cast<int64_t>(coin) < prob_threshold) || target <= 0) {
    for (int64_t n = 0; n < num_positions; ++n) perm_row[n] = n;
    return;
  }

  // ---- Block-wise mask: BEiT's loop with integer geometry.
  int64_t count = 0;
  for (uint32_t round = 0; count < target; ++round) {
    const int64_t remaining = target - count;
    int64_t low, high;
    round_area_bounds(target, count, min_block, low, high);
    int64_t delta = 0;
    for (uint32_t attempt = 0; attempt < kAttemptsPerRound && delta == 0; ++attempt) {
      Rectangle r;
      if (!draw_rectangle(seed, c1, c2, round * kAttemptsPerRound + attempt, low, high, rows, cols, h_thresholds,
                          w_thresholds, r)) {
        continue;
      }
      const int64_t fresh = count_fresh_cells(mask_row, num_positions, cols, r.top, r.height, r.left, r.width);
      if (fresh > 0 && fresh <= remaining) {
        // Mark the new cells and list them downwards from perm_row[N - 1 - count]: after the loop,
        // perm_row[N - count, N) lists every masked position (in no particular order).
        mark_fresh_cells(mask_row, num_positions, cols, r.top, r.height, r.left, r.width,
                         perm_row + (num_positions - 1 - count));
        delta = fresh;
      }
    }
    if (delta == 0) break;
    count += delta;
  }

  // ---- Permutation of the masked positions.
  permute_masked(seed, c1, c2, num_positions, count, mask_row, perm_row);
}

}  // namespace mjp
