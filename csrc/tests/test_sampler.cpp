// Standalone tests of csrc/sampler.h (no torch needed): Philox known-answer vectors, the sorting helpers, the
// permutation against a plain reference, and properties of sampled jigsaws (mask count <= target, perm a
// permutation of the masked positions, identity elsewhere, determinism, no writes outside the rows); the
// cooperative path of sampler_lanes.h (a GPU warp's) against the one-thread path, its lanes run in sequence.
// Exactness against the PyTorch oracle is tested from Python (tests/ops/test_extension.py).
#include "sampler.h"
#include "sampler_lanes.h"
#include "test_support.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <utility>
#include <vector>

namespace {

constexpr uint64_t kExpectedDigest = 0xe5f5611724eae3d4ull;

// ---- Philox known-answer vectors (Random123's kat_vectors for philox4x32-10; key = (seed low, seed high)).
void test_philox_known_answers() {
  struct Case {
    uint64_t seed;
    uint32_t counter[4];
    uint32_t expected[4];
  };
  const Case cases[] = {
      {0, {0, 0, 0, 0}, {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}},
      {0xffffffffffffffffull,
       {0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
       {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}},
      {0x299f31d0a4093822ull,
       {0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u},
       {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}},
  };
  for (const Case& c : cases) {
    const mjp::Philox4 r = mjp::philox4x32_10(c.seed, c.counter[0], c.counter[1], c.counter[2], c.counter[3]);
    const uint32_t got[4] = {r.o0, r.o1, r.o2, r.o3};
    for (int i = 0; i < 4; ++i) {
      CHECK(got[i] == c.expected[i], "seed %llx word %d: got %08x, expected %08x", (unsigned long long)c.seed, i,
            got[i], c.expected[i]);
    }
  }
}

// ---- Sorting helpers against std::sort, on uniform and on skewed (one crowded bucket) values.
void test_sorts() {
  std::mt19937_64 rng(7);
  for (int64_t count : {0, 1, 2, 3, 17, 32, 33, 100, 257, 1000, 5000}) {
    for (int skew = 0; skew < 3; ++skew) {
      std::vector<int64_t> values(count);
      for (auto& v : values) {
        v = static_cast<int64_t>(rng() >> 1);
        if (skew == 1) v >>= 20;                                  // all in bucket 0: big buckets, heap sorts
        if (skew == 2) v = static_cast<int64_t>(rng() % 5) << 58;  // few distinct values, duplicates
      }
      std::vector<int64_t> expected = values;
      std::sort(expected.begin(), expected.end());

      std::vector<int64_t> a = values;
      mjp::heap_sort(a.data(), count);
      CHECK(a == expected, "heap_sort count %lld skew %d", (long long)count, skew);
      a = values;
      mjp::bucket_sort_in_place(a.data(), count);
      CHECK(a == expected, "bucket_sort_in_place count %lld skew %d", (long long)count, skew);
      std::vector<int64_t> out(count, -1);
      mjp::bucket_sort_into(values.data(), count, out.data());
      CHECK(out == expected, "bucket_sort_into count %lld skew %d", (long long)count, skew);
      if (count <= 1000) {
        a = values;
        mjp::insertion_sort(a.data(), count);
        CHECK(a == expected, "insertion_sort count %lld skew %d", (long long)count, skew);
      }
    }
  }
}

// The permutation of docs/sampler.md, written the plain way: s = masked positions sorted by (key, position),
// perm[m_i] = s_i.
std::vector<int64_t> reference_perm(uint64_t seed, uint64_t stream, const std::vector<bool>& mask) {
  const uint32_t c1 = static_cast<uint32_t>(stream), c2 = static_cast<uint32_t>(stream >> 32);
  std::vector<int64_t> masked;
  std::vector<std::pair<uint32_t, int64_t>> by_key;
  for (int64_t n = 0; n < static_cast<int64_t>(mask.size()); ++n) {
    if (mask[n]) {
      masked.push_back(n);
      by_key.emplace_back(mjp::philox4x32_10(seed, static_cast<uint32_t>(n), c1, c2, mjp::kTagPerm).o0, n);
    }
  }
  std::sort(by_key.begin(), by_key.end());
  std::vector<int64_t> perm(mask.size());
  for (int64_t n = 0; n < static_cast<int64_t>(mask.size()); ++n) perm[n] = n;
  for (size_t i = 0; i < masked.size(); ++i) perm[masked[i]] = by_key[i].second;
  return perm;
}

// permute_masked on random masks (both sort paths: free front half or not), against the plain reference.
void test_permute_masked() {
  std::mt19937_64 rng(11);
  for (int64_t num_positions : {1, 2, 7, 50, 196, 1000, 5000}) {
    for (double density : {0.0, 0.05, 0.3, 0.5, 0.51, 0.8, 1.0}) {
      const uint64_t seed = rng(), stream = rng() >> 1;
      std::vector<bool> mask(num_positions);
      std::vector<int64_t> listed;
      for (int64_t n = 0; n < num_positions; ++n) {
        mask[n] = std::uniform_real_distribution<double>(0, 1)(rng) < density;
        if (mask[n]) listed.push_back(n);
      }
      std::shuffle(listed.begin(), listed.end(), rng);
      const int64_t masked = static_cast<int64_t>(listed.size());
      std::vector<int64_t> perm(num_positions + 2, -7);  // guards on both sides
      std::vector<uint8_t> mask_bytes(num_positions);
      for (int64_t n = 0; n < num_positions; ++n) mask_bytes[n] = mask[n];
      for (int64_t i = 0; i < masked; ++i) perm[1 + num_positions - masked + i] = listed[i];
      mjp::permute_masked(seed, static_cast<uint32_t>(stream), static_cast<uint32_t>(stream >> 32), num_positions,
                          masked, reinterpret_cast<const bool*>(mask_bytes.data()), perm.data() + 1);
      const auto expected = reference_perm(seed, stream, mask);
      CHECK(perm.front() == -7 && perm.back() == -7, "guards overwritten, N %lld", (long long)num_positions);
      CHECK(std::equal(expected.begin(), expected.end(), perm.begin() + 1), "N %lld density %.2f",
            (long long)num_positions, density);
    }
  }
}

struct Row {
  std::vector<uint8_t> mask;  // bool storage, with one guard byte on each side
  std::vector<int64_t> perm;  // with one guard on each side
};

Row sample(int64_t rows, int64_t cols, int64_t target, int64_t min_block, uint64_t seed, uint64_t stream,
           int64_t prob_threshold, const std::vector<int64_t>& h, const std::vector<int64_t>& w) {
  const int64_t num_positions = rows * cols;
  Row row{std::vector<uint8_t>(num_positions + 2, 0xAB), std::vector<int64_t>(num_positions + 2, -7)};
  mjp::sample_jigsaw_row(rows, cols, target, min_block, seed, stream, prob_threshold, h.data(), w.data(),
                         reinterpret_cast<bool*>(row.mask.data() + 1), row.perm.data() + 1);
  return row;
}

// Calls body(rows, cols, num_positions, ratio, target, h, w) for each grid {rows, cols} and, within it, each ratio:
// target = floor(ratio * num_positions); h, w: the grid's threshold tables at min aspect 0.3, built once per grid.
template <size_t kGrids, size_t kRatios, typename Body>
void for_each_grid_and_ratio(const int64_t (&grids)[kGrids][2], const double (&ratios)[kRatios], Body&& body) {
  for (const auto& grid : grids) {
    const int64_t rows = grid[0], cols = grid[1], num_positions = rows * cols;
    std::vector<int64_t> h, w;
    mjp_tests::build_tables(rows, cols, 0.3, h, w);
    for (double ratio : ratios) {
      body(rows, cols, num_positions, ratio, static_cast<int64_t>(std::floor(ratio * num_positions)), h, w);
    }
  }
}

void test_sampled_rows() {
  const int64_t grids[][2] = {{1, 1}, {1, 7}, {3, 5}, {7, 13}, {14, 14}, {32, 32}};
  const double ratios[] = {0.0, 0.03, 0.1, 0.5, 0.75, 1.0};
  const uint64_t seeds[] = {0, 1234, 0xffffffffffffffffull};
  int64_t jigsawed = 0, rows_checked = 0;
  for_each_grid_and_ratio(grids, ratios, [&](int64_t rows, int64_t cols, int64_t num_positions, double ratio,
                                              int64_t target, const std::vector<int64_t>& h,
                                              const std::vector<int64_t>& w) {
    for (uint64_t seed : seeds) {
      for (uint64_t stream : {uint64_t(0), uint64_t(5), (uint64_t(1) << 32) + 3, (uint64_t(1) << 62) + 9}) {
        for (int64_t prob_threshold : {int64_t(0), int64_t(1) << 31, int64_t(1) << 32}) {
          const Row a = sample(rows, cols, target, 8, seed, stream, prob_threshold, h, w);
          const Row b = sample(rows, cols, target, 8, seed, stream, prob_threshold, h, w);
          ++rows_checked;
          CHECK(a.mask == b.mask && a.perm == b.perm, "not deterministic: grid %lldx%lld", (long long)rows,
                (long long)cols);
          CHECK(a.mask.front() == 0xAB && a.mask.back() == 0xAB && a.perm.front() == -7 && a.perm.back() == -7,
                "wrote outside the row: grid %lldx%lld ratio %.2f", (long long)rows, (long long)cols, ratio);
          int64_t count = 0;
          std::vector<bool> mask(num_positions);
          std::vector<int64_t> seen(num_positions, 0);
          bool values_ok = true;
          for (int64_t n = 0; n < num_positions; ++n) {
            const uint8_t byte = a.mask[n + 1];
            values_ok &= byte <= 1;
            mask[n] = byte == 1;
            count += mask[n];
            const int64_t p = a.perm[n + 1];
            if (p < 0 || p >= num_positions) {
              values_ok = false;
              continue;
            }
            ++seen[p];
            if (!mask[n]) values_ok &= p == n;  // identity where unmasked
          }
          for (int64_t n = 0; n < num_positions && values_ok; ++n) {
            values_ok &= seen[n] == 1;                     // a permutation
            values_ok &= !mask[n] || mask[a.perm[n + 1]];  // masked positions show masked positions' patches
          }
          CHECK(values_ok, "perm not a permutation of the masked positions: grid %lldx%lld ratio %.2f",
                (long long)rows, (long long)cols, ratio);
          CHECK(count <= target, "mask count %lld > target %lld", (long long)count, (long long)target);
          if (prob_threshold == 0 || target == 0) CHECK(count == 0, "mask without jigsaw: %lld", (long long)count);
          jigsawed += count > 0;
          const auto expected = reference_perm(seed, stream, mask);
          CHECK(std::equal(expected.begin(), expected.end(), a.perm.begin() + 1), "perm differs from reference");
        }
      }
    }
  });
  CHECK(jigsawed > rows_checked / 4, "too few jigsawed rows: %lld of %lld", (long long)jigsawed,
        (long long)rows_checked);
}

// Masks reach their target on a roomy grid at a modest ratio most of the time, and differ across streams.
void test_distribution_sanity() {
  std::vector<int64_t> h, w;
  mjp_tests::build_tables(14, 14, 0.3, h, w);
  const int64_t target = 19;  // floor(0.1 * 196)
  int64_t total = 0, distinct = 0;
  std::vector<uint8_t> previous;
  for (uint64_t stream = 0; stream < 2000; ++stream) {
    const Row r = sample(14, 14, target, 8, 42, stream, int64_t(1) << 32, h, w);
    int64_t count = 0;
    for (int64_t n = 0; n < 196; ++n) count += r.mask[n + 1];
    total += count;
    distinct += r.mask != previous;
    previous = r.mask;
  }
  const double mean = total / 2000.0;
  CHECK(mean > 15.0 && mean <= 19.0, "mean mask count %.2f at target 19", mean);
  CHECK(distinct > 1990, "only %lld of 2000 consecutive masks differ", (long long)distinct);
}

// One digest of many sampled jigsaws (masks and permutations, FNV-1a over perm * 2 + mask). The host build and
// the portable build (the code a GPU thread runs) must both give it: a change of either path, or of the sampler's
// definition, shows here. The value is what both builds, and the sampler before the host fast paths existed,
// gave when those paths were added, with every Python-side test of the compiled sampler against the PyTorch
// oracle passing.
void test_digest_of_both_code_paths() {
  const int64_t grids[][2] = {{14, 14}, {7, 13}, {32, 32}, {23, 23}};
  const double ratios[] = {0.05, 0.1, 0.3, 0.5, 0.75, 0.97};
  uint64_t digest = 1469598103934665603ull;
  for_each_grid_and_ratio(grids, ratios, [&](int64_t rows, int64_t cols, int64_t num_positions, double /*ratio*/,
                                              int64_t target, const std::vector<int64_t>& h,
                                              const std::vector<int64_t>& w) {
    for (uint64_t stream = 0; stream < 40; ++stream) {
      const Row r = sample(rows, cols, target, stream % 3 == 0 ? 1 : 8, 2024, stream, int64_t(1) << 32, h, w);
      for (int64_t n = 0; n < num_positions; ++n) {
        digest = (digest ^ static_cast<uint64_t>(r.perm[n + 1] * 2 + r.mask[n + 1])) * 1099511628211ull;
      }
    }
  });
  CHECK(digest == kExpectedDigest, "digest %016llx, expected %016llx", (unsigned long long)digest,
        (unsigned long long)kExpectedDigest);
}

// sampler_lanes.h's group, run on the host: each phase calls its lanes one after another, in ascending or
// descending order. A lane that read another lane's write of the same phase would see it in one order and not the
// other, so both orders must give sample_jigsaw_row's jigsaw.
struct SerialLanes {
  bool descending = false;
  template <typename Body>
  void each(Body&& body) const {
    for (int i = 0; i < mjp::kSamplerLanes; ++i) body(descending ? mjp::kSamplerLanes - 1 - i : i);
  }
  template <typename Predicate>
  uint32_t ballot(Predicate&& predicate) const {
    uint32_t bits = 0;
    each([&](int lane) { bits |= static_cast<uint32_t>(predicate(lane)) << lane; });
    return bits;
  }
  void sync() const {}
};

void test_lanes_path_equals_the_row_path() {
  // Grids at and around the word (32) and lane counts, thin ones, and the largest the lanes path takes.
  const int64_t grids[][2] = {{1, 1}, {1, 7}, {3, 5}, {4, 8}, {7, 13}, {14, 14}, {24, 24}, {31, 33}, {32, 32},
                              {1, 1024}, {1024, 1}};
  const double ratios[] = {0.0, 0.03, 0.1, 0.5, 0.75, 0.97, 1.0};
  int64_t compared = 0, jigsawed = 0;
  for_each_grid_and_ratio(grids, ratios, [&](int64_t rows, int64_t cols, int64_t num_positions, double ratio,
                                              int64_t target, const std::vector<int64_t>& h,
                                              const std::vector<int64_t>& w) {
    std::vector<int64_t> scratch((mjp::lanes_scratch_bytes(num_positions) + 7) / 8, -1);
    const mjp::LanesScratch s = mjp::lanes_scratch_at(scratch.data(), num_positions);
    for (uint64_t stream = 0; stream < 6; ++stream) {
      for (int64_t min_block : {int64_t(1), int64_t(8), int64_t(50)}) {
        const uint64_t seed = 77 + stream * 0x9E3779B97F4A7C15ull;
        const int64_t prob_threshold = stream == 5 ? int64_t(1) << 31 : int64_t(1) << 32;
        const Row expected = sample(rows, cols, target, min_block, seed, stream, prob_threshold, h, w);
        for (bool descending : {false, true}) {
          Row got{std::vector<uint8_t>(num_positions + 2, 0xAB), std::vector<int64_t>(num_positions + 2, -7)};
          mjp::sample_jigsaw_lanes(SerialLanes{descending}, rows, cols, target, min_block, seed, stream,
                                   prob_threshold, h.data(), w.data(), s,
                                   reinterpret_cast<bool*>(got.mask.data() + 1), got.perm.data() + 1);
          ++compared;
          CHECK(got.mask == expected.mask && got.perm == expected.perm,
                "lanes path differs: grid %lldx%lld ratio %.2f min_block %lld stream %llu, lanes %s",
                (long long)rows, (long long)cols, ratio, (long long)min_block, (unsigned long long)stream,
                descending ? "descending" : "ascending");
        }
        for (int64_t n = 0; n < num_positions; ++n) jigsawed += expected.mask[n + 1] == 1 ? 1 : 0;
      }
    }
  });
  CHECK(compared > 2000 && jigsawed > compared, "too little compared: %lld rows, %lld masked cells",
        (long long)compared, (long long)jigsawed);
  CHECK(mjp::lanes_scratch_bytes(mjp::kLanesSamplerMaxPositions) <= 48 * 1024, "scratch over a block's static 48 KiB");
}

}  // namespace

int main() {
  test_philox_known_answers();
  test_sorts();
  test_permute_masked();
  test_sampled_rows();
  test_distribution_sanity();
  test_digest_of_both_code_paths();
  test_lanes_path_equals_the_row_path();
  std::printf("%d checks, %d failures\n", mjp_tests::checks, mjp_tests::failures);
  return mjp_tests::failures == 0 ? 0 : 1;
}
