// Checks of the row layout shared by the position-step operators (pos_embed_cpu.cpp) and the patch embedding
// (patch_embed_cpu.cpp): P prefix tokens (a tensor of P * D elements), Q = prefix_positions rows of the position
// table in front of the N patch rows, the table given whole. One definition for both, on symbolic sizes so the
// Meta kernels share them.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>

namespace mjp {

// The number of prefix rows P of a prefix tensor holding P * D elements (0 without one). The caller checks its
// dtype; ``like`` (named ``like_name`` in the message) gives the device it must be on.
inline c10::SymInt prefix_rows_of(const char* op, const std::optional<at::Tensor>& prefix, const c10::SymInt& dim,
                                  const at::Tensor& like, const char* like_name) {
  if (!prefix.has_value() || !prefix->defined()) return 0;
  TORCH_CHECK(prefix->device() == like.device(), op, ": prefix on ", prefix->device(), ", ", like_name, " on ",
              like.device());
  const c10::SymInt numel = prefix->sym_numel();
  if (dim == 0) {
    TORCH_CHECK(numel == 0, op, ": prefix must be empty when D = 0, got shape ", prefix->sym_sizes());
    return 0;
  }
  TORCH_CHECK(numel % dim == 0, op, ": prefix must hold P * D elements (P prefix tokens of D = ", dim,
              "), got shape ", prefix->sym_sizes());
  return numel / dim;
}

// prefix_positions Q: 0 (no table rows for the prefix tokens) or P (one row each, in front of the patch rows).
inline void check_prefix_positions(const char* op, int64_t prefix_positions, const c10::SymInt& prefix_rows) {
  TORCH_CHECK(prefix_positions == 0 || prefix_rows == prefix_positions, op,
              ": prefix_positions must be 0 or the number of prefix tokens P = ", prefix_rows, ", got ",
              prefix_positions);
}

// The whole position table's shape: at least 2-D, last two dims [Q + N, D], no other rows (leading dims of size 1).
inline void check_table_shape(const char* op, const char* name, c10::SymIntArrayRef shape, const c10::SymInt& rows,
                              const c10::SymInt& dim) {
  const size_t ndim = shape.size();
  c10::SymInt numel = 1;
  for (const auto& size : shape) numel = numel * size;
  TORCH_CHECK(ndim >= 2 && shape[ndim - 2] == rows && shape[ndim - 1] == dim && numel == rows * dim, op, ": ", name,
              " must be the whole position table, last two dims [Q + N, D] = [", rows, ", ", dim,
              "] and no other rows (leading dims of size 1), got ", shape);
}

}  // namespace mjp
