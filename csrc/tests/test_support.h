// What the C++ tests share: the CHECK macro and its counters, and the sampler's threshold tables.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "sampler.h"

namespace mjp_tests {

inline int failures = 0;
inline int checks = 0;

// Threshold tables of docs/sampler.md, computed here in double as the Python side does.
inline void build_tables(int64_t rows, int64_t cols, double min_aspect, std::vector<int64_t>& h,
                         std::vector<int64_t>& w) {
  const double low = std::log(min_aspect), high = std::log(1.0 / min_aspect);
  h.assign(mjp::kAspectBins * rows, 0);
  w.assign(mjp::kAspectBins * cols, 0);
  for (int j = 0; j < mjp::kAspectBins; ++j) {
    const double aspect = std::exp(low + (j + 0.5) / mjp::kAspectBins * (high - low));
    const auto threshold = [](double area) { return static_cast<int64_t>(std::min(std::ceil(area * 0x1p32), 0x1p62)); };
    for (int64_t k = 0; k < rows; ++k) h[j * rows + k] = threshold((k + 0.5) * (k + 0.5) / aspect);
    for (int64_t k = 0; k < cols; ++k) w[j * cols + k] = threshold((k + 0.5) * (k + 0.5) * aspect);
  }
}

}  // namespace mjp_tests

#define CHECK(condition, ...)                                            \
  do {                                                                   \
    ++::mjp_tests::checks;                                               \
    if (!(condition)) {                                                  \
      ++::mjp_tests::failures;                                           \
      std::printf("FAILED %s:%d: %s: ", __FILE__, __LINE__, #condition); \
      std::printf(__VA_ARGS__);                                          \
      std::printf("\n");                                                 \
    }                                                                    \
  } while (0)
