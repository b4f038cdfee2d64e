// CPU path of the MJP patch embedding:
//
//   tokens[b, n, :] = W_flat @ patch(images[b], perm[b, n]) + bias + (unk if mask[b, n] else pos[n])
//
// The im2col matrix (patches in perm order, one row per token) is never materialised whole: the rows are
// gathered in chunks of about 512 KiB that stay in the core's cache, each chunk goes straight into a GEMM
// (at::mm_out, i.e. MKL / oneDNN, single-threaded inside our parallel loop) and, in the forward, through the
// epilogue while its output is still in cache. Everything is computed in at::opmath_type<scalar_t> ("acc_t":
// float for float, half and bfloat16, double for double): half and bfloat16 patches are gathered into float, the
// GEMMs and sums run in float, and each output is rounded once.
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <type_traits>

#include "ops.h"

namespace mjp {
namespace {

// im2col rows per chunk, in bytes of float. A forward / image-gradient chunk stays in the core's L2 on its way into
// the GEMM and through the epilogue; a weight-gradient chunk is larger, since each one also reads and writes the
// [D, K] accumulator. (Measured on 2 cores at batch 64, 224 px, P 16, D 384, forward + weight/bias/pos/unk
// gradients: 128 KiB to 1 MiB chunks are within noise of each other, about 0.9x the time of timm's PatchEmbed +
// pos add; the whole-batch im2col followed by one GEMM took about 1.1x.)
constexpr int64_t kChunkBytes = 512 * 1024;
constexpr int64_t kWeightGradChunkBytes = 1024 * 1024;

int64_t rows_per_chunk(const PatchGeometry& g, int64_t bytes) {
  return std::clamp<int64_t>(bytes / (g.patch_size * static_cast<int64_t>(sizeof(float))), 8, 1 << 20);
}

template <typename scalar_t>
using acc_t = at::opmath_type<scalar_t>;

// Strides of images [B, C, H, W] (stride(3) == 1).
struct ImageStrides {
  int64_t batch, channel, height;
};

// Grid position whose patch im2col row `row` (= b * N + n) shows, or -1 when perm holds an out-of-range entry.
inline int64_t source_position(const int64_t* perm, int64_t row, int64_t n, int64_t num_positions) {
  if (perm == nullptr) return n;
  const int64_t m = perm[row];
  return (m >= 0 && m < num_positions) ? m : -1;
}

// Copies `count` elements, converting.
template <typename From, typename To>
inline void copy_convert(const From* source, int64_t count, To* destination) {
  if constexpr (std::is_same_v<From, To>) {
    std::memcpy(destination, source, count * sizeof(To));
  } else {
    for (int64_t i = 0; i < count; ++i) destination[i] = static_cast<To>(source[i]);
  }
}

// columns[r - row_begin, (c, py, px)] = images[b, c, row * P + py, col * P + px] for im2col rows r in
// [row_begin, row_end), with (row, col) the grid position perm[r]. Returns false if some perm entry was out of
// range (its row is left as zeros).
template <typename scalar_t>
bool gather_rows(const PatchGeometry& g, const scalar_t* images, ImageStrides strides, const int64_t* perm,
                 int64_t row_begin, int64_t row_end, acc_t<scalar_t>* columns) {
  const int64_t P = g.patch, K = g.patch_size, N = g.positions;
  bool valid = true;
  for (int64_t row = row_begin; row < row_end; ++row) {
    const int64_t b = row / N, n = row - b * N;
    acc_t<scalar_t>* out = columns + (row - row_begin) * K;
    const int64_t m = source_position(perm, row, n, N);
    if (m < 0) {
      std::fill(out, out + K, acc_t<scalar_t>(0));
      valid = false;
      continue;
    }
    const int64_t grid_row = m / g.cols, grid_col = m - grid_row * g.cols;
    const scalar_t* patch = images + b * strides.batch + grid_row * P * strides.height + grid_col * P;
    for (int64_t c = 0; c < g.channels; ++c) {
      const scalar_t* plane = patch + c * strides.channel;
      for (int64_t py = 0; py < P; ++py) {
        copy_convert(plane + py * strides.height, P, out);
        out += P;
      }
    }
  }
  return valid;
}

// The inverse move: grad_images[b, c, row * P + py, col * P + px] = columns[r - row_begin, (c, py, px)].
// perm is a permutation per sample, so each pixel is written at most once: no atomics, no races.
template <typename scalar_t>
bool scatter_rows(const PatchGeometry& g, const acc_t<scalar_t>* columns, const int64_t* perm, int64_t row_begin,
                  int64_t row_end, ImageStrides strides, scalar_t* grad_images) {
  const int64_t P = g.patch, K = g.patch_size, N = g.positions;
  bool valid = true;
  for (int64_t row = row_begin; row < row_end; ++row) {
    const int64_t b = row / N, n = row - b * N;
    const int64_t m = source_position(perm, row, n, N);
    if (m < 0) {
      valid = false;
      continue;
    }
    const int64_t grid_row = m / g.cols, grid_col = m - grid_row * g.cols;
    scalar_t* patch = grad_images + b * strides.batch + grid_row * P * strides.height + grid_col * P;
    const acc_t<scalar_t>* in = columns + (row - row_begin) * K;
    for (int64_t c = 0; c < g.channels; ++c) {
      scalar_t* plane = patch + c * strides.channel;
      for (int64_t py = 0; py < P; ++py) {
        copy_convert(in, P, plane + py * strides.height);
        in += P;
      }
    }
  }
  return valid;
}

// tokens[r, :] = projected[r - row_begin, :] + bias + (unk if mask[r] else pos[n]) for r in [row_begin, row_end),
// in acc_t, rounded once. `projected` may be the very memory of those token rows (when scalar_t is acc_t).
template <typename scalar_t>
void add_embeddings_rows(const PatchGeometry& g, const acc_t<scalar_t>* projected, int64_t row_begin,
                         int64_t row_end, const scalar_t* bias, const scalar_t* pos, const scalar_t* unk,
                         const bool* mask, scalar_t* tokens) {
  using acc = acc_t<scalar_t>;
  const int64_t D = g.dim, N = g.positions;
  for (int64_t row = row_begin; row < row_end; ++row) {
    const acc* in = projected + (row - row_begin) * D;
    scalar_t* out = tokens + row * D;
    // A masked token without an unk_embed gets no position term.
    const scalar_t* add = (mask != nullptr && mask[row]) ? unk : pos + (row % N) * D;
    if (bias != nullptr && add != nullptr) {
      for (int64_t d = 0; d < D; ++d) {
        out[d] = static_cast<scalar_t>(in[d] + static_cast<acc>(bias[d]) + static_cast<acc>(add[d]));
      }
    } else if (bias != nullptr || add != nullptr) {
      const scalar_t* only = bias != nullptr ? bias : add;
      for (int64_t d = 0; d < D; ++d) out[d] = static_cast<scalar_t>(in[d] + static_cast<acc>(only[d]));
    } else if (static_cast<const void*>(in) != static_cast<const void*>(out)) {
      copy_convert(in, D, out);
    }
  }
}

// Deterministic sums of grad_out [B * N, D] in acc_t: pos_sum[n] over unmasked tokens at n, unk_sum over masked
// tokens, bias_sum over all (null: not wanted). Parallel over chunks of D only, so every element is summed in the
// same (b, n) order whatever the thread count.
template <typename scalar_t>
void reduce_embedding_grads(const PatchGeometry& g, const scalar_t* grad, const bool* mask, acc_t<scalar_t>* pos_sum,
                            acc_t<scalar_t>* unk_sum, acc_t<scalar_t>* bias_sum) {
  using acc = acc_t<scalar_t>;
  const int64_t D = g.dim, N = g.positions;
  at::parallel_for(0, D, 16, [&](int64_t d_begin, int64_t d_end) {
    const int64_t width = d_end - d_begin;
    for (int64_t b = 0; b < g.batch; ++b) {
      for (int64_t n = 0; n < N; ++n) {
        const int64_t row = b * N + n;
        const scalar_t* __restrict__ in = grad + row * D + d_begin;
        if (bias_sum != nullptr) {
          acc* __restrict__ sum = bias_sum + d_begin;
          for (int64_t d = 0; d < width; ++d) sum[d] += static_cast<acc>(in[d]);
        }
        acc* __restrict__ sum = nullptr;
        if (mask != nullptr && mask[row]) {
          if (unk_sum != nullptr) sum = unk_sum + d_begin;
        } else if (pos_sum != nullptr) {
          sum = pos_sum + n * D + d_begin;
        }
        if (sum != nullptr) {
          for (int64_t d = 0; d < width; ++d) sum[d] += static_cast<acc>(in[d]);
        }
      }
    }
  });
}

ImageStrides image_strides(const at::Tensor& images) {
  return ImageStrides{images.stride(0), images.stride(1), images.stride(2)};
}

// Rows [row_begin, row_end) of grad_out [B * N, D] in acc_t: a view when the dtypes agree, else a converted copy
// in `buffer` ([rows per chunk, D], acc_t).
at::Tensor acc_rows(const at::Tensor& grad_2d, int64_t row_begin, int64_t row_end, at::Tensor& buffer) {
  const auto rows = grad_2d.narrow(0, row_begin, row_end - row_begin);
  if (!buffer.defined()) return rows;
  auto converted = buffer.narrow(0, 0, row_end - row_begin);
  converted.copy_(rows);
  return converted;
}

void check_perm(bool valid, const PatchGeometry& g) {
  TORCH_CHECK(valid, "patch_embed: perm holds an entry outside [0, ", g.positions, ")");
}

}  // namespace

at::Tensor patch_embed_forward_cpu(const PatchGeometry& g, const at::Tensor& images, const at::Tensor& weight,
                                   const std::optional<at::Tensor>& bias, const at::Tensor& pos_embed,
                                   const std::optional<at::Tensor>& unk_embed, const std::optional<at::Tensor>& perm,
                                   const std::optional<at::Tensor>& mask) {
  const int64_t total_rows = g.batch * g.positions;
  auto tokens = at::empty({total_rows, g.dim}, images.options());
  const auto acc_dtype = at::toOpMathType(images.scalar_type());
  const auto acc_options = images.options().dtype(acc_dtype);
  const auto weight_t = weight.view({g.dim, g.patch_size}).to(acc_dtype).t();  // [K, D]
  const bool tokens_are_acc = images.scalar_type() == acc_dtype;
  const int64_t chunk = rows_per_chunk(g, kChunkBytes);
  const int64_t num_chunks = (total_rows + chunk - 1) / chunk;
  std::atomic<bool> valid{true};
  MJP_DISPATCH_FLOATING_TYPES(images.scalar_type(), "mjp_patch_embed_forward", [&] {
    using acc = acc_t<scalar_t>;
    const scalar_t* image_data = images.data_ptr<scalar_t>();
    at::parallel_for(0, num_chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
      auto columns = at::empty({chunk, g.patch_size}, acc_options);
      auto projected = tokens_are_acc ? at::Tensor() : at::empty({chunk, g.dim}, acc_options);
      for (int64_t c = chunk_begin; c < chunk_end; ++c) {
        const int64_t row_begin = c * chunk, row_end = std::min(total_rows, row_begin + chunk);
        const int64_t rows = row_end - row_begin;
        if (!gather_rows(g, image_data, image_strides(images), optional_data<int64_t>(perm), row_begin, row_end,
                         columns.data_ptr<acc>())) {
          valid.store(false, std::memory_order_relaxed);
        }
        // The GEMM writes the token rows themselves when they are acc_t, a buffer otherwise.
        auto out = tokens_are_acc ? tokens.narrow(0, row_begin, rows) : projected.narrow(0, 0, rows);
        at::mm_out(out, columns.narrow(0, 0, rows), weight_t);
        add_embeddings_rows<scalar_t>(g, out.data_ptr<acc>(), row_begin, row_end, optional_data<scalar_t>(bias),
                                      pos_embed.data_ptr<scalar_t>(), optional_data<scalar_t>(unk_embed),
                                      optional_data<bool>(mask), tokens.data_ptr<scalar_t>());
      }
    });
  });
  check_perm(valid.load(), g);
  return tokens.view({g.batch, g.positions, g.dim});
}

std::vector<std::optional<at::Tensor>> patch_embed_backward_cpu(
    const PatchGeometry& g, const at::Tensor& grad_out, const at::Tensor& images, const at::Tensor& weight,
    const std::optional<at::Tensor>& perm, const std::optional<at::Tensor>& mask, bool need_images,
    bool need_weight, bool need_bias, bool need_pos, bool need_unk) {
  std::vector<std::optional<at::Tensor>> grads(5);
  const int64_t total_rows = g.batch * g.positions;
  const auto grad_2d = grad_out.view({total_rows, g.dim});
  const auto dtype = grad_out.scalar_type();
  const auto acc_dtype = at::toOpMathType(dtype);
  const auto acc_options = grad_out.options().dtype(acc_dtype);
  const bool grad_is_acc = dtype == acc_dtype;
  const int64_t* perm_data = optional_data<int64_t>(perm);

  if (need_weight) {
    // grad_weight = grad_out^T @ columns, the columns regathered chunk by chunk. Each of `groups` contiguous runs
    // of chunks accumulates its own partial sum, and the partials are added in order: deterministic for a given
    // thread count.
    const int64_t chunk = rows_per_chunk(g, kWeightGradChunkBytes);
    const int64_t num_chunks = (total_rows + chunk - 1) / chunk;
    const int64_t groups = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_chunks));
    std::vector<at::Tensor> partials(groups);
    std::atomic<bool> valid{true};
    MJP_DISPATCH_FLOATING_TYPES(dtype, "mjp_patch_embed_backward_weight", [&] {
      using acc = acc_t<scalar_t>;
      const scalar_t* image_data = images.data_ptr<scalar_t>();
      at::parallel_for(0, groups, 1, [&](int64_t group_begin, int64_t group_end) {
        auto columns = at::empty({chunk, g.patch_size}, acc_options);
        auto grad_buffer = grad_is_acc ? at::Tensor() : at::empty({chunk, g.dim}, acc_options);
        for (int64_t group = group_begin; group < group_end; ++group) {
          auto partial = at::zeros({g.dim, g.patch_size}, acc_options);
          const int64_t first = group * num_chunks / groups, last = (group + 1) * num_chunks / groups;
          for (int64_t c = first; c < last; ++c) {
            const int64_t row_begin = c * chunk, row_end = std::min(total_rows, row_begin + chunk);
            if (!gather_rows(g, image_data, image_strides(images), perm_data, row_begin, row_end,
                             columns.data_ptr<acc>())) {
              valid.store(false, std::memory_order_relaxed);
            }
            const auto grad_rows = acc_rows(grad_2d, row_begin, row_end, grad_buffer);
            partial.addmm_(grad_rows.t(), columns.narrow(0, 0, row_end - row_begin));
          }
          partials[group] = partial;
        }
      });
    });
    check_perm(valid.load(), g);
    auto grad_weight = partials[0];
    for (int64_t group = 1; group < groups; ++group) grad_weight.add_(partials[group]);
    grads[1] = grad_weight.to(dtype).view({g.dim, g.channels, g.patch, g.patch});
  }
  if (need_images) {
    // grad_images: each chunk's (grad_out rows @ W_flat) scattered back to the patches perm points to.
    const int64_t height = images.size(2), width = images.size(3);
    auto grad_images = at::zeros({g.batch, g.channels, height, width}, grad_out.options());
    const auto weight_flat = weight.view({g.dim, g.patch_size}).to(acc_dtype);
    const ImageStrides strides{g.channels * height * width, height * width, width};
    const int64_t chunk = rows_per_chunk(g, kChunkBytes);
    const int64_t num_chunks = (total_rows + chunk - 1) / chunk;
    std::atomic<bool> valid{true};
    MJP_DISPATCH_FLOATING_TYPES(dtype, "mjp_patch_embed_backward_images", [&] {
      using acc = acc_t<scalar_t>;
      scalar_t* grad_image_data = grad_images.data_ptr<scalar_t>();
      at::parallel_for(0, num_chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
        auto columns = at::empty({chunk, g.patch_size}, acc_options);
        auto grad_buffer = grad_is_acc ? at::Tensor() : at::empty({chunk, g.dim}, acc_options);
        for (int64_t c = chunk_begin; c < chunk_end; ++c) {
          const int64_t row_begin = c * chunk, row_end = std::min(total_rows, row_begin + chunk);
          auto out = columns.narrow(0, 0, row_end - row_begin);
          at::mm_out(out, acc_rows(grad_2d, row_begin, row_end, grad_buffer), weight_flat);
          if (!scatter_rows<scalar_t>(g, out.data_ptr<acc>(), perm_data, row_begin, row_end, strides,
                                      grad_image_data)) {
            valid.store(false, std::memory_order_relaxed);
          }
        }
      });
    });
    check_perm(valid.load(), g);
    grads[0] = grad_images;
  }
  if (need_bias || need_pos || need_unk) {
    auto pos_sum = need_pos ? at::zeros({g.positions, g.dim}, acc_options) : at::Tensor();
    auto unk_sum = need_unk ? at::zeros({g.dim}, acc_options) : at::Tensor();
    auto bias_sum = need_bias ? at::zeros({g.dim}, acc_options) : at::Tensor();
    MJP_DISPATCH_FLOATING_TYPES(dtype, "mjp_reduce_embedding_grads", [&] {
      using acc = acc_t<scalar_t>;
      reduce_embedding_grads<scalar_t>(g, grad_out.data_ptr<scalar_t>(), optional_data<bool>(mask),
                                       need_pos ? pos_sum.data_ptr<acc>() : nullptr,
                                       need_unk ? unk_sum.data_ptr<acc>() : nullptr,
                                       need_bias ? bias_sum.data_ptr<acc>() : nullptr);
    });
    if (need_bias) grads[2] = bias_sum.to(dtype);
    if (need_pos) grads[3] = pos_sum.to(dtype);
    if (need_unk) grads[4] = unk_sum.to(dtype);
  }
  return grads;
}

}  // namespace mjp
