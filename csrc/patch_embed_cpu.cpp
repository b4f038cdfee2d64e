// CPU path of the MJP patch embedding, with the P prefix (class and register) tokens in front of each sample's patch
// tokens and Q (0 or P) position-table rows for them:
//
//   out[b, t, :]     = prefix[t] + (pos[t] if t < Q)                                                     t < P
//   out[b, P + n, :] = W_flat @ patch(images[b], perm[b, n]) + bias + (unk if mask[b, n] else pos[Q + n])
//
// The im2col matrix (patches in perm order, one row per token) is never materialised whole: the rows are
// gathered in chunks of about 512 KiB that stay in the core's cache, each chunk goes straight into a GEMM
// (at::mm_out, i.e. MKL / oneDNN, single-threaded inside our parallel loop) and, in the forward, through the
// epilogue while its output is still in cache. Everything is computed in at::opmath_type<scalar_t> ("acc_t":
// float for float, half and bfloat16, double for double): half and bfloat16 patches are gathered into float, the
// GEMMs and sums run in float, and each output is rounded once.
//
// The float32 weight gradient takes another way: the gradient rows are moved back to the patches they were cut from
// (P(XW) = (PX)W: the inverse of perm), which makes it the weight gradient of a plain stride-P convolution of the
// images, computed by ATen's convolution_backward (oneDNN) as timm's Conv2d computes its own. Measured on 2 cores,
// batch 64, 224 px, P 16, D 384, the bench's forward + backward: 1.13-1.15x timm's with the chunked GEMMs below,
// 0.97-1.04x this way. The other dtypes, and small problems (host time), keep the chunked GEMMs (float accumulation
// for half and bfloat16).
//
// At the end of the file, the dispatcher operators over this path and the CUDA one (cuda_ops.cpp):
// torch.ops.mjp_fast.patch_embed_extension and patch_embed_extension_backward, with their argument checks and Meta
// kernels. Python calls them as one dispatcher call each way; their autograd is registered from Python
// (mjp_fast/ops/patch_embed.py).
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/ops/convolution_backward.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "ops.h"
#include "row_layout.h"

namespace mjp {
namespace {

// im2col rows per chunk, in bytes of float. A forward / image-gradient chunk stays in the core's L2 on its way into
// the GEMM and through the epilogue; a weight-gradient chunk (dtypes other than float32) is larger, since each one
// also reads and writes the [D, K] accumulator. (Measured on 2 cores at batch 64, 224 px, P 16, D 384, forward +
// weight/bias/pos/unk gradients: 128 KiB to 1 MiB chunks are within noise of each other, about 0.9x the time of
// timm's PatchEmbed + pos add; the whole-batch im2col followed by one GEMM took about 1.1x.)
constexpr int64_t kChunkBytes = 512 * 1024;
constexpr int64_t kWeightGradChunkBytes = 1024 * 1024;
// The float32 weight gradient goes through convolution_backward from this many multiply-adds (B * N * K * D) on
// (see the top of the file); below, the chunked GEMMs. 2**22: a batch of 4 at 32 px, patch 4, D 384 is above it.
constexpr int64_t kConvolutionWeightGradMacs = int64_t(1) << 22;

int64_t rows_per_chunk(const PatchGeometry& g, int64_t bytes) {
  // Zero channels make K = 0 (an im2col row holds nothing): the chunk is then sized by the output rows of D.
  const int64_t width = g.patch_size > 0 ? g.patch_size : std::max<int64_t>(g.dim, 1);
  return std::clamp<int64_t>(bytes / (width * static_cast<int64_t>(sizeof(float))), 8, 1 << 20);
}

template <typename scalar_t>
using acc_t = at::opmath_type<scalar_t>;

// Strides of images [B, C, H, W] (stride(3) == 1).
struct ImageStrides {
  int64_t batch, channel, height;
};

// Grid position whose patch im2col row `row` (= b * N + n) shows, or -1 when perm holds an out-of-range entry: such a
// token shows a zero patch and sends no gradient back (the contract of validate=False, mjp_fast/_validate.py).
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
// [row_begin, row_end), with (row, col) the grid position perm[r]; the row of an out-of-range perm entry is zeros.
template <typename scalar_t>
void gather_rows(const PatchGeometry& g, const scalar_t* images, ImageStrides strides, const int64_t* perm,
                 int64_t row_begin, int64_t row_end, acc_t<scalar_t>* columns) {
  const int64_t P = g.patch, K = g.patch_size, N = g.positions;
  for (int64_t row = row_begin; row < row_end; ++row) {
    const int64_t b = row / N, n = row - b * N;
    acc_t<scalar_t>* out = columns + (row - row_begin) * K;
    const int64_t m = source_position(perm, row, n, N);
    if (m < 0) {
      std::fill(out, out + K, acc_t<scalar_t>(0));
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
}

// The inverse move, added: grad_images[b, c, row * P + py, col * P + px] += columns[r - row_begin, (c, py, px)]
// (grad_images starts at zero). When perm is a permutation per sample each pixel is written once, so rows in other
// threads never meet; otherwise the caller runs this on one thread (a patch several tokens show sums their gradients).
template <typename scalar_t>
void scatter_rows(const PatchGeometry& g, const acc_t<scalar_t>* columns, const int64_t* perm, int64_t row_begin,
                  int64_t row_end, ImageStrides strides, scalar_t* grad_images) {
  using acc = acc_t<scalar_t>;
  const int64_t P = g.patch, K = g.patch_size, N = g.positions;
  for (int64_t row = row_begin; row < row_end; ++row) {
    const int64_t b = row / N, n = row - b * N;
    const int64_t m = source_position(perm, row, n, N);
    if (m < 0) continue;
    const int64_t grid_row = m / g.cols, grid_col = m - grid_row * g.cols;
    scalar_t* patch = grad_images + b * strides.batch + grid_row * P * strides.height + grid_col * P;
    const acc* in = columns + (row - row_begin) * K;
    for (int64_t c = 0; c < g.channels; ++c) {
      scalar_t* plane = patch + c * strides.channel;
      for (int64_t py = 0; py < P; ++py) {
        scalar_t* out = plane + py * strides.height;
        for (int64_t px = 0; px < P; ++px) out[px] = static_cast<scalar_t>(static_cast<acc>(out[px]) + in[px]);
        in += P;
      }
    }
  }
}

// Whether every perm[b] is a permutation of 0..N-1 (null: the identity). A host loop over B * N entries: the CPU
// has no device to wait for.
bool is_permutation(const int64_t* perm, int64_t batch, int64_t num_positions) {
  if (perm == nullptr) return true;
  std::vector<uint8_t> seen(num_positions);
  for (int64_t b = 0; b < batch; ++b) {
    std::fill(seen.begin(), seen.end(), uint8_t(0));
    for (int64_t n = 0; n < num_positions; ++n) {
      const int64_t m = perm[b * num_positions + n];
      if (m < 0 || m >= num_positions || seen[m]) return false;
      seen[m] = 1;
    }
  }
  return true;
}

// out[b, P + n, :] = projected[r - row_begin, :] + bias + (unk if mask[r] else pos[n]) for the im2col rows
// r = b * N + n in [row_begin, row_end), in acc_t, rounded once. pos: the table's patch rows. `projected` may be the
// very memory of those output rows (when scalar_t is acc_t and P = 0).
template <typename scalar_t>
void add_embeddings_rows(const PatchGeometry& g, const acc_t<scalar_t>* projected, int64_t row_begin,
                         int64_t row_end, const scalar_t* bias, const scalar_t* pos, const scalar_t* unk,
                         const bool* mask, scalar_t* tokens) {
  using acc = acc_t<scalar_t>;
  const int64_t D = g.dim, N = g.positions, P = g.prefix_rows;
  for (int64_t row = row_begin; row < row_end; ++row) {
    const acc* in = projected + (row - row_begin) * D;
    const int64_t b = row / N;
    scalar_t* out = tokens + (row + (b + 1) * P) * D;
    // A masked token without an unk_embed gets no position term.
    const scalar_t* add = (mask != nullptr && mask[row]) ? unk : pos + (row - b * N) * D;
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

// Deterministic sums of grad_out [B, P + N, D] in acc_t: prefix_sum[t] over the samples' prefix rows t, and over
// their patch rows pos_sum[n] (the table's patch rows) of unmasked tokens at n, unk_sum of masked tokens, bias_sum of
// all (null: not wanted). Parallel over chunks of D only, so every element is summed in the same (b, n) order
// whatever the thread count.
template <typename scalar_t>
void reduce_embedding_grads(const PatchGeometry& g, const scalar_t* grad, const bool* mask, acc_t<scalar_t>* pos_sum,
                            acc_t<scalar_t>* unk_sum, acc_t<scalar_t>* bias_sum, acc_t<scalar_t>* prefix_sum) {
  using acc = acc_t<scalar_t>;
  const int64_t D = g.dim, N = g.positions, P = g.prefix_rows;
  at::parallel_for(0, D, 16, [&](int64_t d_begin, int64_t d_end) {
    const int64_t width = d_end - d_begin;
    for (int64_t b = 0; b < g.batch; ++b) {
      const scalar_t* sample = grad + b * g.rows_per_sample() * D + d_begin;
      if (prefix_sum != nullptr) {
        for (int64_t t = 0; t < P; ++t) {
          const scalar_t* __restrict__ in = sample + t * D;
          acc* __restrict__ sum = prefix_sum + t * D + d_begin;
          for (int64_t d = 0; d < width; ++d) sum[d] += static_cast<acc>(in[d]);
        }
      }
      for (int64_t n = 0; n < N; ++n) {
        const int64_t row = b * N + n;
        const scalar_t* __restrict__ in = sample + (P + n) * D;
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

// The gradient rows of im2col rows [row_begin, row_end) (row b * N + n: grad_out[b, P + n]) as an acc_t matrix:
// a view of grad_out when it is acc_t and has no prefix rows between the samples' patch rows, else a converted copy in
// `buffer` ([rows per chunk, D], acc_t; defined exactly then). grad_3d: grad_out [B, P + N, D].
at::Tensor acc_rows(const PatchGeometry& g, const at::Tensor& grad_3d, int64_t row_begin, int64_t row_end,
                    at::Tensor& buffer) {
  const int64_t N = g.positions;
  if (g.prefix_rows == 0) {
    const auto rows = grad_3d.view({g.batch * N, g.dim}).narrow(0, row_begin, row_end - row_begin);
    if (!buffer.defined()) return rows;
    auto converted = buffer.narrow(0, 0, row_end - row_begin);
    converted.copy_(rows);
    return converted;
  }
  // One copy per sample the rows span (a chunk holds about a sample's worth of rows: one or two).
  for (int64_t row = row_begin; row < row_end;) {
    const int64_t b = row / N, n = row - b * N;
    const int64_t count = std::min(row_end - row, N - n);
    buffer.narrow(0, row - row_begin, count).copy_(grad_3d.select(0, b).narrow(0, g.prefix_rows + n, count));
    row += count;
  }
  return buffer.narrow(0, 0, row_end - row_begin);
}

// The prefix rows of every sample: out[b, t] = prefix[t] + (pos[t] if t < Q) for t < P, in acc_t, rounded once;
// computed once and copied to each sample.
template <typename scalar_t>
void write_prefix_rows(const PatchGeometry& g, const scalar_t* prefix, const scalar_t* pos, scalar_t* out) {
  using acc = acc_t<scalar_t>;
  const int64_t D = g.dim, block = g.prefix_rows * D;
  if (block == 0 || g.batch == 0) return;
  for (int64_t t = 0; t < g.prefix_rows; ++t) {
    for (int64_t d = 0; d < D; ++d) {
      const int64_t i = t * D + d;
      out[i] = t < g.prefix_positions ? static_cast<scalar_t>(static_cast<acc>(prefix[i]) + static_cast<acc>(pos[i]))
                                      : prefix[i];
    }
  }
  const int64_t stride = g.rows_per_sample() * D;
  at::parallel_for(1, g.batch, std::max<int64_t>(1, 32768 / block), [&](int64_t b_begin, int64_t b_end) {
    for (int64_t b = b_begin; b < b_end; ++b) std::memcpy(out + b * stride, out, block * sizeof(scalar_t));
  });
}

}  // namespace

at::Tensor patch_embed_forward_cpu(const PatchGeometry& g, const at::Tensor& images, const at::Tensor& weight,
                                   const std::optional<at::Tensor>& bias, const at::Tensor& pos_embed,
                                   const std::optional<at::Tensor>& unk_embed, const std::optional<at::Tensor>& perm,
                                   const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& prefix) {
  const int64_t total_rows = g.batch * g.positions;  // im2col rows: the patch tokens
  auto tokens = at::empty({g.batch * g.rows_per_sample(), g.dim}, images.options());
  const auto acc_dtype = at::toOpMathType(images.scalar_type());
  const auto acc_options = images.options().dtype(acc_dtype);
  const auto weight_t = weight.view({g.dim, g.patch_size}).to(acc_dtype).t();  // [K, D]
  // The GEMM writes the output rows themselves when they are acc_t and contiguous (no prefix rows between samples).
  const bool tokens_are_acc = images.scalar_type() == acc_dtype && g.prefix_rows == 0;
  const int64_t chunk = rows_per_chunk(g, kChunkBytes);
  const int64_t num_chunks = (total_rows + chunk - 1) / chunk;
  MJP_DISPATCH_FLOATING_TYPES(images.scalar_type(), "mjp_patch_embed_forward", [&] {
    using acc = acc_t<scalar_t>;
    const scalar_t* image_data = images.data_ptr<scalar_t>();
    const scalar_t* pos_data = pos_embed.data_ptr<scalar_t>();
    write_prefix_rows<scalar_t>(g, optional_data<scalar_t>(prefix), pos_data, tokens.data_ptr<scalar_t>());
    at::parallel_for(0, num_chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
      auto columns = at::empty({chunk, g.patch_size}, acc_options);
      auto projected = tokens_are_acc ? at::Tensor() : at::empty({chunk, g.dim}, acc_options);
      for (int64_t c = chunk_begin; c < chunk_end; ++c) {
        const int64_t row_begin = c * chunk, row_end = std::min(total_rows, row_begin + chunk);
        const int64_t rows = row_end - row_begin;
        gather_rows(g, image_data, image_strides(images), optional_data<int64_t>(perm), row_begin, row_end,
                    columns.data_ptr<acc>());
        auto out = tokens_are_acc ? tokens.narrow(0, row_begin, rows) : projected.narrow(0, 0, rows);
        at::mm_out(out, columns.narrow(0, 0, rows), weight_t);
        add_embeddings_rows<scalar_t>(g, out.data_ptr<acc>(), row_begin, row_end, optional_data<scalar_t>(bias),
                                      pos_data + g.prefix_positions * g.dim, optional_data<scalar_t>(unk_embed),
                                      optional_data<bool>(mask), tokens.data_ptr<scalar_t>());
      }
    });
  });
  return tokens.view({g.batch, g.rows_per_sample(), g.dim});
}

std::vector<std::optional<at::Tensor>> patch_embed_backward_cpu(
    const PatchGeometry& g, const at::Tensor& grad_out, const at::Tensor& images, const at::Tensor& weight,
    const std::optional<at::Tensor>& perm, const std::optional<at::Tensor>& mask, bool need_images,
    bool need_weight, bool need_bias, bool need_pos, bool need_unk, bool need_prefix, at::IntArrayRef pos_shape,
    at::IntArrayRef prefix_shape) {
  std::vector<std::optional<at::Tensor>> grads(6);
  const int64_t total_rows = g.batch * g.positions;  // im2col rows: the patch tokens
  const auto grad_3d = grad_out.view({g.batch, g.rows_per_sample(), g.dim});
  const auto dtype = grad_out.scalar_type();
  const auto acc_dtype = at::toOpMathType(dtype);
  const auto acc_options = grad_out.options().dtype(acc_dtype);
  // Whether the patch rows of grad_out serve the GEMMs as they are (acc_t, no prefix rows between them).
  const bool grad_is_acc = dtype == acc_dtype && g.prefix_rows == 0;
  const int64_t* perm_data = optional_data<int64_t>(perm);

  // Below kConvolutionWeightGradMacs multiply-adds the chunked GEMMs cost less host time than the convolution's
  // set-up (a tiny model's step on the CPU is host time).
  const int64_t weight_grad_macs = total_rows * g.patch_size * g.dim;
  if (need_weight && dtype == at::kFloat && weight_grad_macs >= kConvolutionWeightGradMacs) {
    // float32: the convolution's own weight gradient (oneDNN) on the images as they are. P(XW) = (PX)W, so moving
    // each token's gradient row back to the patch it was cut from (the inverse of perm: a copy of [B, N, D]) gives
    // the gradient of the unjigsawed embedding, a stride-P convolution, whose weight gradient needs no im2col.
    // Each patch's row is the sum of the rows of the tokens that show it: the same thing for a permutation, and the
    // exact gradient for any other perm (a patch no token shows gets zeros; an out-of-range entry adds nothing).
    const int64_t N = g.positions;
    const auto patch_grads = grad_3d.narrow(1, g.prefix_rows, N);
    at::Tensor unmoved = patch_grads;
    if (perm_data != nullptr) {
      unmoved = at::empty({g.batch, N, g.dim}, grad_out.options());
      const float* grad_data = grad_3d.data_ptr<float>();
      float* out_data = unmoved.data_ptr<float>();
      const int64_t sample_stride = g.rows_per_sample() * g.dim, D = g.dim;
      // One sample per task: its rows are zeroed, then added to, by that task alone.
      at::parallel_for(0, g.batch, std::max<int64_t>(1, 32768 / (N * D + 1)), [&](int64_t b_begin, int64_t b_end) {
        for (int64_t b = b_begin; b < b_end; ++b) {
          float* sample = out_data + b * N * D;
          std::fill(sample, sample + N * D, 0.0f);
          for (int64_t n = 0; n < N; ++n) {
            const int64_t source = perm_data[b * N + n];
            if (source < 0 || source >= N) continue;
            const float* __restrict__ in = grad_data + b * sample_stride + (g.prefix_rows + n) * D;
            float* __restrict__ out = sample + source * D;
            for (int64_t d = 0; d < D; ++d) out[d] += in[d];
          }
        }
      });
    }
    const auto grad_map = unmoved.view({g.batch, g.rows, g.cols, g.dim}).permute({0, 3, 1, 2});  // [B, D, gh, gw]
    const std::vector<int64_t> stride{g.patch, g.patch}, padding{0, 0}, dilation{1, 1}, output_padding{0, 0};
    auto results = at::convolution_backward(grad_map, images, weight, std::nullopt, stride, padding, dilation,
                                            /*transposed=*/false, output_padding, /*groups=*/1, {false, true, false});
    grads[1] = std::get<1>(results);
  } else if (need_weight) {
    // grad_weight = grad_out^T @ columns, the columns regathered chunk by chunk. Each of `groups` contiguous runs
    // of chunks accumulates its own partial sum, and the partials are added in order: deterministic for a given
    // thread count.
    const int64_t chunk = rows_per_chunk(g, kWeightGradChunkBytes);
    const int64_t num_chunks = (total_rows + chunk - 1) / chunk;
    const int64_t groups = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_chunks));
    std::vector<at::Tensor> partials(groups);
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
            gather_rows(g, image_data, image_strides(images), perm_data, row_begin, row_end, columns.data_ptr<acc>());
            const auto grad_rows = acc_rows(g, grad_3d, row_begin, row_end, grad_buffer);
            partial.addmm_(grad_rows.t(), columns.narrow(0, 0, row_end - row_begin));
          }
          partials[group] = partial;
        }
      });
    });
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
    // Chunks in parallel write disjoint pixels only when each perm[b] is a permutation; otherwise one thread adds
    // them all (a perm that is not one comes only with validate=False: correct, not fast).
    const int64_t grain = is_permutation(perm_data, g.batch, g.positions) ? 1 : std::max<int64_t>(num_chunks, 1);
    MJP_DISPATCH_FLOATING_TYPES(dtype, "mjp_patch_embed_backward_images", [&] {
      using acc = acc_t<scalar_t>;
      scalar_t* grad_image_data = grad_images.data_ptr<scalar_t>();
      at::parallel_for(0, num_chunks, grain, [&](int64_t chunk_begin, int64_t chunk_end) {
        auto columns = at::empty({chunk, g.patch_size}, acc_options);
        auto grad_buffer = grad_is_acc ? at::Tensor() : at::empty({chunk, g.dim}, acc_options);
        for (int64_t c = chunk_begin; c < chunk_end; ++c) {
          const int64_t row_begin = c * chunk, row_end = std::min(total_rows, row_begin + chunk);
          auto out = columns.narrow(0, 0, row_end - row_begin);
          at::mm_out(out, acc_rows(g, grad_3d, row_begin, row_end, grad_buffer), weight_flat);
          scatter_rows<scalar_t>(g, out.data_ptr<acc>(), perm_data, row_begin, row_end, strides, grad_image_data);
        }
      });
    });
    grads[0] = grad_images;
  }
  if (need_prefix && g.prefix_rows == 0) grads[5] = at::empty({0}, grad_out.options());
  // The prefix rows' sums serve grad_prefix and the table's first Q rows.
  const bool need_prefix_sums = g.prefix_rows > 0 && (need_prefix || (need_pos && g.prefix_positions > 0));
  if (need_bias || need_pos || need_unk || need_prefix_sums) {
    const int64_t table_rows = g.prefix_positions + g.positions;
    auto pos_sum = need_pos ? at::zeros({table_rows, g.dim}, acc_options) : at::Tensor();
    auto unk_sum = need_unk ? at::zeros({g.dim}, acc_options) : at::Tensor();
    auto bias_sum = need_bias ? at::zeros({g.dim}, acc_options) : at::Tensor();
    auto prefix_sum = need_prefix_sums ? at::zeros({g.prefix_rows, g.dim}, acc_options) : at::Tensor();
    MJP_DISPATCH_FLOATING_TYPES(dtype, "mjp_reduce_embedding_grads", [&] {
      using acc = acc_t<scalar_t>;
      reduce_embedding_grads<scalar_t>(g, grad_out.data_ptr<scalar_t>(), optional_data<bool>(mask),
                                       need_pos ? pos_sum.data_ptr<acc>() + g.prefix_positions * g.dim : nullptr,
                                       need_unk ? unk_sum.data_ptr<acc>() : nullptr,
                                       need_bias ? bias_sum.data_ptr<acc>() : nullptr,
                                       need_prefix_sums ? prefix_sum.data_ptr<acc>() : nullptr);
    });
    if (need_pos && g.prefix_positions > 0) pos_sum.narrow(0, 0, g.prefix_positions).copy_(prefix_sum);
    if (need_bias) grads[2] = bias_sum.to(dtype);
    if (need_pos) grads[3] = pos_sum.to(dtype).view(pos_shape);
    if (need_unk) grads[4] = unk_sum.to(dtype);
    if (need_prefix && g.prefix_rows > 0) grads[5] = prefix_sum.to(dtype).view(prefix_shape);
  }
  return grads;
}

// ---- The dispatcher operators torch.ops.mjp_fast.patch_embed_extension[_backward]: their argument checks (on
// symbolic sizes, so the Meta kernels share them), one kernel each for the CPU and CUDA keys (it runs the CPU or the
// CUDA implementation by the tensors' device), the Meta kernels, and the registrations at the end of the file.

// See the anchor in ops.h.
extern const int kPatchEmbedOperators = 1;

namespace {

constexpr const char* kForward = "mjp_fast::patch_embed_extension";
constexpr const char* kBackward = "mjp_fast::patch_embed_extension_backward";

// A call's sizes: B, N = (H / p) * (W / p) for patch size p, D.
struct CallSizes {
  c10::SymInt batch, positions, dim;
};

// Checks images [B, C, H, W] and weight [D, C, p, p] (one float dtype, one device).
CallSizes check_images_weight(const char* op, const at::Tensor& images, const at::Tensor& weight) {
  TORCH_CHECK(images.dim() == 4, op, ": images must be [B, C, H, W], got ", images.sym_sizes());
  TORCH_CHECK(weight.dim() == 4 && weight.sym_size(2) == weight.sym_size(3) && weight.sym_size(2) >= 1, op,
              ": weight must be [D, C, P, P], got ", weight.sym_sizes());
  TORCH_CHECK(weight.sym_size(1) == images.sym_size(1), op, ": weight has ", weight.sym_size(1),
              " input channels, images have ", images.sym_size(1));
  const auto dtype = images.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kDouble, op,
              ": images must be float32, float16, bfloat16 or float64, got ", dtype);
  TORCH_CHECK(weight.scalar_type() == dtype, op, ": weight dtype ", weight.scalar_type(), " differs from images ",
              dtype);
  TORCH_CHECK(weight.device() == images.device(), op, ": weight on ", weight.device(), ", images on ",
              images.device());
  const auto& patch = weight.sym_size(2);
  return {images.sym_size(0), (images.sym_size(2) / patch) * (images.sym_size(3) / patch), weight.sym_size(0)};
}

// `size` elements, the images' dtype and device.
void check_like_images(const char* op, const char* name, const at::Tensor& tensor, const at::Tensor& images,
                       const c10::SymInt& size) {
  TORCH_CHECK(tensor.sym_numel() == size, op, ": ", name, " must have ", size, " elements, got shape ",
              tensor.sym_sizes());
  TORCH_CHECK(tensor.scalar_type() == images.scalar_type(), op, ": ", name, " dtype ", tensor.scalar_type(),
              " differs from images ", images.scalar_type());
  TORCH_CHECK(tensor.device() == images.device(), op, ": ", name, " on ", tensor.device(), ", images on ",
              images.device());
}

// perm (int64) or mask (bool), absent or B * N elements on the images' device.
void check_index(const char* op, const char* name, const std::optional<at::Tensor>& tensor, at::ScalarType dtype,
                 const at::Tensor& images, const CallSizes& sizes) {
  if (!present(tensor)) return;
  TORCH_CHECK(tensor->scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", tensor->scalar_type());
  TORCH_CHECK(tensor->sym_numel() == sizes.batch * sizes.positions, op, ": ", name, " must be [", sizes.batch, ", ",
              sizes.positions, "], got ", tensor->sym_sizes());
  TORCH_CHECK(tensor->device() == images.device(), op, ": ", name, " on ", tensor->device(), ", images on ",
              images.device());
}

// Returns the sizes and P.
std::pair<CallSizes, c10::SymInt> check_forward_args(const at::Tensor& images, const at::Tensor& weight,
                                                     const std::optional<at::Tensor>& bias,
                                                     const at::Tensor& pos_embed,
                                                     const std::optional<at::Tensor>& unk_embed,
                                                     const std::optional<at::Tensor>& perm,
                                                     const std::optional<at::Tensor>& mask,
                                                     const std::optional<at::Tensor>& prefix,
                                                     int64_t prefix_positions) {
  const char* op = kForward;
  const CallSizes sizes = check_images_weight(op, images, weight);
  if (present(prefix)) {
    TORCH_CHECK(prefix->scalar_type() == images.scalar_type(), op, ": prefix dtype ", prefix->scalar_type(),
                " differs from images ", images.scalar_type());
  }
  c10::SymInt prefix_rows = prefix_rows_of(op, prefix, sizes.dim, images, "images");
  check_prefix_positions(op, prefix_positions, prefix_rows);
  if (present(bias)) check_like_images(op, "bias", *bias, images, sizes.dim);
  check_table_shape(op, "pos_embed", pos_embed.sym_sizes(), sizes.positions + prefix_positions, sizes.dim);
  check_like_images(op, "pos_embed", pos_embed, images, pos_embed.sym_numel());  // its dtype and device
  if (present(unk_embed)) check_like_images(op, "unk_embed", *unk_embed, images, sizes.dim);
  check_index(op, "perm", perm, at::kLong, images, sizes);
  check_index(op, "mask", mask, at::kBool, images, sizes);
  return {sizes, std::move(prefix_rows)};
}

// Returns the gradients' shapes: those of images and weight, [D], pos_shape (default [Q + N, D]), [D], prefix_shape
// (default [P, D]; [0] when P = 0).
std::vector<std::vector<c10::SymInt>> check_backward_args(
    const at::Tensor& grad_out, const at::Tensor& images, const at::Tensor& weight,
    const std::optional<at::Tensor>& perm, const std::optional<at::Tensor>& mask, int64_t prefix_count,
    int64_t prefix_positions, at::OptionalSymIntArrayRef pos_shape, at::OptionalSymIntArrayRef prefix_shape) {
  const char* op = kBackward;
  const CallSizes sizes = check_images_weight(op, images, weight);
  const auto& dim = sizes.dim;
  TORCH_CHECK(prefix_count >= 0, op, ": prefix_count must be >= 0, got ", prefix_count);
  check_prefix_positions(op, prefix_positions, prefix_count);
  TORCH_CHECK(grad_out.dim() == 3 && grad_out.sym_size(0) == sizes.batch &&
                  grad_out.sym_size(1) == sizes.positions + prefix_count && grad_out.sym_size(2) == dim,
              op, ": grad_out must be [B, P + N, D] = [", sizes.batch, ", ", prefix_count, " + ", sizes.positions,
              ", ", dim, "], got ", grad_out.sym_sizes());
  TORCH_CHECK(grad_out.scalar_type() == images.scalar_type(), op, ": grad_out dtype ", grad_out.scalar_type(),
              " differs from images ", images.scalar_type());
  TORCH_CHECK(grad_out.device() == images.device(), op, ": grad_out on ", grad_out.device(), ", images on ",
              images.device());
  std::vector<c10::SymInt> pos_sizes =
      pos_shape.has_value() ? pos_shape->vec() : std::vector<c10::SymInt>{sizes.positions + prefix_positions, dim};
  check_table_shape(op, "pos_shape", pos_sizes, sizes.positions + prefix_positions, dim);
  std::vector<c10::SymInt> prefix_sizes{0};
  if (prefix_count > 0) {
    prefix_sizes = prefix_shape.has_value() ? prefix_shape->vec() : std::vector<c10::SymInt>{prefix_count, dim};
    c10::SymInt numel = 1;
    for (const auto& size : prefix_sizes) numel = numel * size;
    TORCH_CHECK(numel == dim * prefix_count, op, ": prefix_shape must hold P * D = ", prefix_count, " * ", dim,
                " elements, got ", c10::SymIntArrayRef(prefix_sizes));
  }
  check_index(op, "perm", perm, at::kLong, images, sizes);
  check_index(op, "mask", mask, at::kBool, images, sizes);
  return {images.sym_sizes().vec(), weight.sym_sizes().vec(), {dim}, pos_sizes, {dim}, prefix_sizes};
}

// The geometry of a checked call on real tensors.
PatchGeometry geometry_of(const at::Tensor& images, const at::Tensor& weight, int64_t prefix_rows,
                          int64_t prefix_positions) {
  PatchGeometry g;
  g.batch = images.size(0);
  g.channels = images.size(1);
  g.patch = weight.size(2);
  g.rows = images.size(2) / g.patch;
  g.cols = images.size(3) / g.patch;
  g.positions = g.rows * g.cols;
  g.patch_size = g.channels * g.patch * g.patch;
  g.dim = weight.size(0);
  g.prefix_rows = prefix_rows;
  g.prefix_positions = prefix_positions;
  return g;
}

// The tensor itself when contiguous (no dispatch), else a contiguous copy.
at::Tensor contiguous(const at::Tensor& tensor) { return tensor.is_contiguous() ? tensor : tensor.contiguous(); }

std::optional<at::Tensor> contiguous(const std::optional<at::Tensor>& tensor) {
  if (!present(tensor)) return std::nullopt;
  return contiguous(*tensor);
}

// Images may be strided, but the innermost (width) stride must be 1 for the row copies.
at::Tensor row_contiguous(const at::Tensor& images) {
  return images.size(3) <= 1 || images.stride(3) == 1 ? images : images.contiguous();
}

// compute_dtype: autocast's casts inside the operator. A floating tensor of another dtype (float64 aside, as autocast
// leaves it) is converted to it, as autocast converts a convolution's inputs; without compute_dtype, nothing is (the
// checks then want one dtype). One dispatcher call from Python in place of one per cast: under autocast the fused
// embedding's inputs (weight, bias, table, unk, prefix), output and gradients took 12 casts from Python, about
// 17 us of host time each on the H100's host (2026-11-27).
at::Tensor in_compute(const at::Tensor& tensor, std::optional<at::ScalarType> compute) {
  if (!compute.has_value() || tensor.scalar_type() == *compute || !tensor.is_floating_point() ||
      tensor.scalar_type() == at::kDouble) {
    return tensor;
  }
  return tensor.to(*compute);
}

std::optional<at::Tensor> in_compute(const std::optional<at::Tensor>& tensor, std::optional<at::ScalarType> compute) {
  if (!present(tensor)) return std::nullopt;
  return in_compute(*tensor, compute);
}

// `tensor` in `dtype` when one is given (the caller's dtype of that input), else as it is.
at::Tensor as_dtype(at::Tensor tensor, std::optional<at::ScalarType> dtype) {
  return dtype.has_value() && *dtype != tensor.scalar_type() ? tensor.to(*dtype) : tensor;
}

// The kernel of the CPU and CUDA keys: the inputs in compute_dtype, the checks, then patch_embed_forward_cpu or _cuda,
// the output in out_dtype.
at::Tensor patch_embed_forward_kernel(const at::Tensor& images_in, const at::Tensor& weight_in,
                                      const std::optional<at::Tensor>& bias_in, const at::Tensor& pos_in,
                                      const std::optional<at::Tensor>& unk_in, const std::optional<at::Tensor>& perm,
                                      const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& prefix_in,
                                      int64_t prefix_positions, std::optional<at::ScalarType> out_dtype,
                                      std::optional<at::ScalarType> compute_dtype) {
  // The ATen operations inside are the implementation's: no autograd recording (the caller owns the graph), and the
  // out= GEMMs must not see arguments that require grad (a weight that is an nn.Parameter does).
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  const auto images = in_compute(images_in, compute_dtype);
  const auto weight = in_compute(weight_in, compute_dtype);
  const auto bias = in_compute(bias_in, compute_dtype);
  const auto pos_embed = in_compute(pos_in, compute_dtype);
  const auto unk_embed = in_compute(unk_in, compute_dtype);
  const auto prefix = in_compute(prefix_in, compute_dtype);
  const auto prefix_rows =
      check_forward_args(images, weight, bias, pos_embed, unk_embed, perm, mask, prefix, prefix_positions).second;
  const PatchGeometry g = geometry_of(images, weight, prefix_rows.expect_int(), prefix_positions);
  const auto perm_c = contiguous(perm);
  const auto mask_c = contiguous(mask);
  const auto images_c = row_contiguous(images);
  const auto weight_c = contiguous(weight);
  const auto pos_c = contiguous(pos_embed);
  const auto bias_c = contiguous(bias);
  const auto unk_c = contiguous(unk_embed);
  const auto prefix_c = g.prefix_rows > 0 ? contiguous(prefix) : std::nullopt;
  auto out = [&] {
#ifdef MJP_WITH_CUDA
    if (images.is_cuda()) {
      return patch_embed_forward_cuda(g, images_c, weight_c, bias_c, pos_c, unk_c, perm_c, mask_c, prefix_c);
    }
#endif
    TORCH_CHECK(images.is_cpu(), kForward, ": tensors must be on the CPU or a CUDA device, got ", images.device());
    return patch_embed_forward_cpu(g, images_c, weight_c, bias_c, pos_c, unk_c, perm_c, mask_c, prefix_c);
  }();
  return as_dtype(std::move(out), out_dtype);
}

// The dtype of each gradient: the images' (as given, before compute_dtype), the weight's for weight and bias, then
// pos_dtype, unk_dtype and prefix_dtype (each, when absent, the dtype the kernels computed in).
std::vector<std::optional<at::ScalarType>> gradient_dtypes(const at::Tensor& images, const at::Tensor& weight,
                                                           std::optional<at::ScalarType> pos_dtype,
                                                           std::optional<at::ScalarType> unk_dtype,
                                                           std::optional<at::ScalarType> prefix_dtype) {
  return {images.scalar_type(), weight.scalar_type(), weight.scalar_type(), pos_dtype, unk_dtype, prefix_dtype};
}

// The parameters of patch_embed_extension_backward, in its schema's order (registered at the end of the file),
// written once for the operator's two kernels: the dispatcher calls the CPU/CUDA kernel and the Meta kernel with the
// schema's arguments one by one, so each must declare the whole flat list (a struct of them cannot be registered),
// and one list keeps the two from drifting apart when the schema changes. The names it declares, for both bodies:
// grad_in, images_in, weight_in (as given, before compute_dtype), perm, mask, need_images ... need_prefix,
// prefix_count, prefix_positions, pos_shape, prefix_shape, pos_dtype, unk_dtype, prefix_dtype, compute_dtype.
// Undefined after the Meta kernel.
#define MJP_PATCH_EMBED_BACKWARD_PARAMETERS                                                                            \
  const at::Tensor& grad_in, const at::Tensor& images_in, const at::Tensor& weight_in,                                 \
      const std::optional<at::Tensor>& perm, const std::optional<at::Tensor>& mask, bool need_images,                  \
      bool need_weight, bool need_bias, bool need_pos, bool need_unk, bool need_prefix, int64_t prefix_count,          \
      int64_t prefix_positions, at::OptionalSymIntArrayRef pos_shape, at::OptionalSymIntArrayRef prefix_shape,         \
      std::optional<at::ScalarType> pos_dtype, std::optional<at::ScalarType> unk_dtype,                                \
      std::optional<at::ScalarType> prefix_dtype, std::optional<at::ScalarType> compute_dtype

// The kernel of the CPU and CUDA keys: grad_out, images and weight in compute_dtype, the checks, then
// patch_embed_backward_cpu or _cuda, each gradient in its dtype (gradient_dtypes); an empty [0] tensor for each
// gradient not asked for.
std::vector<at::Tensor> patch_embed_backward_kernel(MJP_PATCH_EMBED_BACKWARD_PARAMETERS) {
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  const auto grad_out = in_compute(grad_in, compute_dtype);
  const auto images = in_compute(images_in, compute_dtype);
  const auto weight = in_compute(weight_in, compute_dtype);
  const auto shapes = check_backward_args(grad_out, images, weight, perm, mask, prefix_count, prefix_positions,
                                          pos_shape, prefix_shape);
  const PatchGeometry g = geometry_of(images, weight, prefix_count, prefix_positions);
  const auto pos_sizes = C10_AS_INTARRAYREF_SLOW(shapes[3]);
  const auto prefix_sizes = C10_AS_INTARRAYREF_SLOW(shapes[5]);
  const auto perm_c = contiguous(perm);
  const auto mask_c = contiguous(mask);
  const auto grad_c = contiguous(grad_out);
  const auto images_c = need_weight ? row_contiguous(images) : images;
  const auto weight_c = contiguous(weight);
  auto grads = [&] {
#ifdef MJP_WITH_CUDA
    if (images.is_cuda()) {
      return patch_embed_backward_cuda(g, grad_c, images_c, weight_c, perm_c, mask_c, need_images, need_weight,
                                       need_bias, need_pos, need_unk, need_prefix, pos_sizes, prefix_sizes);
    }
#endif
    TORCH_CHECK(images.is_cpu(), kBackward, ": tensors must be on the CPU or a CUDA device, got ", images.device());
    return patch_embed_backward_cpu(g, grad_c, images_c, weight_c, perm_c, mask_c, need_images, need_weight,
                                    need_bias, need_pos, need_unk, need_prefix, pos_sizes, prefix_sizes);
  }();
  const auto dtypes = gradient_dtypes(images_in, weight_in, pos_dtype, unk_dtype, prefix_dtype);
  std::vector<at::Tensor> out;
  out.reserve(grads.size());
  for (size_t i = 0; i < grads.size(); ++i) {
    out.push_back(present(grads[i]) ? as_dtype(std::move(*grads[i]), dtypes[i]) : at::empty({0}, grad_out.options()));
  }
  return out;
}

// ---- Meta kernels: the checks and the outputs' shapes (symbolic sizes, for torch.compile's dynamic shapes).

at::Tensor patch_embed_forward_meta(const at::Tensor& images_in, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias, const at::Tensor& pos_embed,
                                    const std::optional<at::Tensor>& unk_embed,
                                    const std::optional<at::Tensor>& perm, const std::optional<at::Tensor>& mask,
                                    const std::optional<at::Tensor>& prefix, int64_t prefix_positions,
                                    std::optional<at::ScalarType> out_dtype,
                                    std::optional<at::ScalarType> compute_dtype) {
  // The checks on the tensors as the kernel takes them (meta conversions: no data)
  const auto images = in_compute(images_in, compute_dtype);
  const auto [sizes, prefix_rows] = check_forward_args(
      images, in_compute(weight, compute_dtype), in_compute(bias, compute_dtype), in_compute(pos_embed, compute_dtype),
      in_compute(unk_embed, compute_dtype), perm, mask, in_compute(prefix, compute_dtype), prefix_positions);
  return at::empty_symint({sizes.batch, prefix_rows + sizes.positions, sizes.dim},
                          images.options().dtype(out_dtype.value_or(images.scalar_type())));
}

std::vector<at::Tensor> patch_embed_backward_meta(MJP_PATCH_EMBED_BACKWARD_PARAMETERS) {
  const auto grad_out = in_compute(grad_in, compute_dtype);
  const auto shapes =
      check_backward_args(grad_out, in_compute(images_in, compute_dtype), in_compute(weight_in, compute_dtype), perm,
                          mask, prefix_count, prefix_positions, pos_shape, prefix_shape);
  const auto dtypes = gradient_dtypes(images_in, weight_in, pos_dtype, unk_dtype, prefix_dtype);
  const bool needs[] = {need_images, need_weight, need_bias, need_pos, need_unk, need_prefix};
  std::vector<at::Tensor> out;
  out.reserve(shapes.size());
  for (size_t i = 0; i < shapes.size(); ++i) {
    const auto options = grad_out.options().dtype(dtypes[i].value_or(grad_out.scalar_type()));
    out.push_back(needs[i] ? at::empty_symint(shapes[i], options)
                           : at::empty_symint({c10::SymInt(0)}, grad_out.options()));
  }
  return out;
}

#undef MJP_PATCH_EMBED_BACKWARD_PARAMETERS

}  // namespace
}  // namespace mjp

TORCH_LIBRARY_FRAGMENT(mjp_fast, m) {
  m.def(
      "patch_embed_extension(Tensor images, Tensor weight, Tensor? bias, Tensor pos_embed, Tensor? unk_embed, "
      "Tensor? perm, Tensor? mask, Tensor? prefix=None, int prefix_positions=0, ScalarType? out_dtype=None, "
      "ScalarType? compute_dtype=None) -> Tensor",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "patch_embed_extension_backward(Tensor grad_out, Tensor images, Tensor weight, Tensor? perm, Tensor? mask, "
      "bool need_images, bool need_weight, bool need_bias, bool need_pos, bool need_unk, bool need_prefix=False, "
      "int prefix_count=0, int prefix_positions=0, SymInt[]? pos_shape=None, SymInt[]? prefix_shape=None, "
      "ScalarType? pos_dtype=None, ScalarType? unk_dtype=None, ScalarType? prefix_dtype=None, "
      "ScalarType? compute_dtype=None) -> Tensor[]",
      {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(mjp_fast, CPU, m) {
  m.impl("patch_embed_extension", TORCH_FN(mjp::patch_embed_forward_kernel));
  m.impl("patch_embed_extension_backward", TORCH_FN(mjp::patch_embed_backward_kernel));
}

#ifdef MJP_WITH_CUDA
TORCH_LIBRARY_IMPL(mjp_fast, CUDA, m) {
  m.impl("patch_embed_extension", TORCH_FN(mjp::patch_embed_forward_kernel));
  m.impl("patch_embed_extension_backward", TORCH_FN(mjp::patch_embed_backward_kernel));
}
#endif

TORCH_LIBRARY_IMPL(mjp_fast, Meta, m) {
  m.impl("patch_embed_extension", TORCH_FN(mjp::patch_embed_forward_meta));
  m.impl("patch_embed_extension_backward", TORCH_FN(mjp::patch_embed_backward_meta));
}
