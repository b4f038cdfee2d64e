// Tensor-level CUDA operations: allocation, device guard, stream, cuBLAS GEMMs through at::mm, and the kernel
// launches of sampler_cuda.cu / patch_embed_cuda.cu / pos_embed_cuda.cu / dal_loss_cuda.cu. Compiled by the host
// compiler, only with MJP_WITH_CUDA.
#include <ATen/OpMathType.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <initializer_list>
#include <limits>

#include "cuda_kernels.h"
#include "ops.h"

namespace mjp {
namespace {

cuda::PatchLayout patch_layout(const PatchGeometry& g, int64_t batch_stride, int64_t channel_stride,
                               int64_t height_stride) {
  return cuda::PatchLayout{g.batch, g.positions, g.patch_size, g.patch, g.cols, g.dim,
                           batch_stride, channel_stride, height_stride};
}

cuda::PatchLayout image_layout(const PatchGeometry& g, const at::Tensor& images) {
  return patch_layout(g, images.stride(0), images.stride(1), images.stride(2));
}

// The im2col matrix [B * (row_prefix + N), K] of images, patches in perm order, zeros in each sample's row_prefix
// first rows.
at::Tensor gather_columns(const PatchGeometry& g, const at::Tensor& images, const std::optional<at::Tensor>& perm,
                          cudaStream_t stream, int64_t row_prefix = 0) {
  auto columns = at::empty({g.batch * (row_prefix + g.positions), g.patch_size}, images.options());
  auto layout = image_layout(g, images);
  layout.row_prefix = row_prefix;
  MJP_DISPATCH_FLOATING_TYPES(images.scalar_type(), "mjp_gather_patches_cuda", [&] {
    C10_CUDA_CHECK(cuda::launch_gather_patches<scalar_t>(layout, images.data_ptr<scalar_t>(),
                                                         optional_data<int64_t>(perm),
                                                         columns.data_ptr<scalar_t>(), stream));
  });
  return columns;
}

// mask and perm of batch_size samples, from the kernel of sampler_cuda.cu.
std::tuple<at::Tensor, at::Tensor> launch_sampler(int64_t batch_size, int64_t rows, int64_t cols, int64_t target,
                                                  int64_t min_block, const cuda::SamplerStream& source, bool shared,
                                                  const at::Tensor& h_thresholds, const at::Tensor& w_thresholds) {
  const c10::cuda::CUDAGuard guard(h_thresholds.device());
  const int64_t num_positions = rows * cols;
  auto mask = at::empty({batch_size, num_positions}, h_thresholds.options().dtype(at::kBool));
  auto perm = at::empty({batch_size, num_positions}, h_thresholds.options().dtype(at::kLong));
  C10_CUDA_CHECK(cuda::launch_sample_jigsaw(batch_size, rows, cols, target, min_block, source, shared,
                                            h_thresholds.data_ptr<int64_t>(), w_thresholds.data_ptr<int64_t>(),
                                            mask.data_ptr<bool>(), perm.data_ptr<int64_t>(),
                                            c10::cuda::getCurrentCUDAStream()));
  return {mask, perm};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> sample_jigsaw_cuda(int64_t batch_size, int64_t rows, int64_t cols, int64_t target,
                                                      int64_t min_block, uint64_t seed, uint64_t offset, bool shared,
                                                      int64_t prob_threshold, const at::Tensor& h_thresholds,
                                                      const at::Tensor& w_thresholds) {
  cuda::SamplerStream source;
  source.stream_shift = offset;
  source.seed = seed;
  source.prob_threshold = prob_threshold;
  return launch_sampler(batch_size, rows, cols, target, min_block, source, shared, h_thresholds, w_thresholds);
}

std::tuple<at::Tensor, at::Tensor> sample_jigsaw_from_counter_cuda(const at::Tensor& counter, const at::Tensor& params,
                                                                   uint64_t counter_scale, uint64_t stream_shift,
                                                                   int64_t batch_size, int64_t rows, int64_t cols,
                                                                   int64_t target, int64_t min_block, bool shared,
                                                                   const at::Tensor& h_thresholds,
                                                                   const at::Tensor& w_thresholds) {
  cuda::SamplerStream source;
  source.counter = counter.data_ptr<int64_t>();
  source.params = params.data_ptr<int64_t>();
  source.counter_scale = counter_scale;
  source.stream_shift = stream_shift;
  return launch_sampler(batch_size, rows, cols, target, min_block, source, shared, h_thresholds, w_thresholds);
}

at::Tensor patch_embed_forward_cuda(const PatchGeometry& g, const at::Tensor& images, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias, const at::Tensor& pos_embed,
                                    const std::optional<at::Tensor>& unk_embed, const std::optional<at::Tensor>& perm,
                                    const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& prefix) {
  const c10::cuda::CUDAGuard guard(images.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto columns = gather_columns(g, images, perm, stream);
  auto tokens = at::mm(columns, weight.view({g.dim, g.patch_size}).t());
  TORCH_CHECK(tokens.is_contiguous(), "patch_embed: at::mm returned a non-contiguous result");
  // Without prefix rows the epilogue runs in place; with them it writes [B, P + N, D] from the GEMM's [B * N, D].
  auto out = g.prefix_rows == 0 ? tokens : at::empty({g.batch * g.rows_per_sample(), g.dim}, tokens.options());
  const auto layout = image_layout(g, images);
  MJP_DISPATCH_FLOATING_TYPES(images.scalar_type(), "mjp_add_embeddings_cuda", [&] {
    C10_CUDA_CHECK(cuda::launch_add_embeddings<scalar_t>(
        layout, tokens.data_ptr<scalar_t>(), optional_data<scalar_t>(bias), pos_embed.data_ptr<scalar_t>(),
        optional_data<scalar_t>(unk_embed), optional_data<bool>(mask), optional_data<scalar_t>(prefix),
        g.prefix_rows, g.prefix_positions, out.data_ptr<scalar_t>(), stream));
  });
  return out.view({g.batch, g.rows_per_sample(), g.dim});
}

std::vector<std::optional<at::Tensor>> patch_embed_backward_cuda(
    const PatchGeometry& g, const at::Tensor& grad_out, const at::Tensor& images, const at::Tensor& weight,
    const std::optional<at::Tensor>& perm, const std::optional<at::Tensor>& mask, bool need_images,
    bool need_weight, bool need_bias, bool need_pos, bool need_unk, bool need_prefix, at::IntArrayRef pos_shape,
    at::IntArrayRef prefix_shape) {
  const c10::cuda::CUDAGuard guard(grad_out.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  std::vector<std::optional<at::Tensor>> grads(6);
  const auto options = grad_out.options();
  // grad_out [B, P + N, D] (contiguous) as it is, with no copy of its patch rows (77 MB for DeiT-S's float32 gradient
  // at batch 256): the GEMMs take all its rows against an im2col matrix with zero rows in front of each sample's
  // patches (their products add nothing, 1/197 more work for a class token; only a non-finite prefix gradient, where
  // the step is lost anyway, would reach the weight's gradient as 0 * inf), and the reductions read each sample's
  // patch rows, and its prefix rows, in place.
  const auto grad_2d = grad_out.view({g.batch * g.rows_per_sample(), g.dim});
  const int64_t patch_offset = g.prefix_rows * g.dim, sample_stride = g.rows_per_sample() * g.dim;

  if (need_weight) {
    const auto columns = gather_columns(g, images, perm, stream, g.prefix_rows);
    grads[1] = at::mm(grad_2d.t(), columns).view({g.dim, g.channels, g.patch, g.patch});
  }
  if (need_images) {
    const auto grad_columns = at::mm(grad_2d, weight.view({g.dim, g.patch_size}));
    const int64_t height = images.size(2), width = images.size(3);
    auto grad_images = at::zeros({g.batch, g.channels, height, width}, options);
    auto layout = patch_layout(g, g.channels * height * width, height * width, width);
    layout.row_prefix = g.prefix_rows;
    MJP_DISPATCH_FLOATING_TYPES(grad_out.scalar_type(), "mjp_scatter_patches_cuda", [&] {
      C10_CUDA_CHECK(cuda::launch_scatter_patches<scalar_t>(layout, grad_columns.data_ptr<scalar_t>(),
                                                            optional_data<int64_t>(perm),
                                                            grad_images.data_ptr<scalar_t>(), stream));
    });
    grads[0] = grad_images;
  }
  if (need_prefix && g.prefix_rows == 0) grads[5] = at::empty({0}, options);
  at::Tensor grad_prefix;  // [P, D]: grad_prefix, and the table's first Q rows
  if (g.prefix_rows > 0 && (need_prefix || (need_pos && g.prefix_positions > 0))) {
    grad_prefix = at::empty({g.prefix_rows, g.dim}, options);
    auto layout = patch_layout(g, 0, 0, 0);
    layout.positions = g.prefix_rows;
    MJP_DISPATCH_FLOATING_TYPES(grad_out.scalar_type(), "mjp_reduce_prefix_grads_cuda", [&] {
      C10_CUDA_CHECK(cuda::launch_reduce_embedding_grads<scalar_t>(layout, grad_out.data_ptr<scalar_t>(), sample_stride,
                                                                   nullptr, grad_prefix.data_ptr<scalar_t>(), nullptr,
                                                                   nullptr, nullptr, nullptr, stream));
    });
    if (need_prefix) grads[5] = grad_prefix.view(prefix_shape);
  }
  if (need_bias || need_pos || need_unk) {
    const auto acc_options = options.dtype(at::toOpMathType(grad_out.scalar_type()));
    const int64_t table_rows = g.prefix_positions + g.positions;
    auto grad_table = need_pos ? at::empty({table_rows, g.dim}, options) : at::Tensor();
    auto grad_unk = need_unk ? at::empty({g.dim}, options) : at::Tensor();
    auto grad_bias = need_bias ? at::empty({g.dim}, options) : at::Tensor();
    auto unk_partial = need_unk ? at::empty({g.positions, g.dim}, acc_options) : at::Tensor();
    auto bias_partial = need_bias ? at::empty({g.positions, g.dim}, acc_options) : at::Tensor();
    const auto layout = patch_layout(g, 0, 0, 0);
    MJP_DISPATCH_FLOATING_TYPES(grad_out.scalar_type(), "mjp_reduce_grads_cuda", [&] {
      C10_CUDA_CHECK(cuda::launch_reduce_embedding_grads<scalar_t>(
          layout, grad_out.data_ptr<scalar_t>() + patch_offset, sample_stride, optional_data<bool>(mask),
          need_pos ? grad_table.data_ptr<scalar_t>() + g.prefix_positions * g.dim : nullptr,
          need_unk ? grad_unk.data_ptr<scalar_t>() : nullptr,
          need_bias ? grad_bias.data_ptr<scalar_t>() : nullptr,
          need_unk ? unk_partial.data_ptr<cuda::accumulate_t<scalar_t>>() : nullptr,
          need_bias ? bias_partial.data_ptr<cuda::accumulate_t<scalar_t>>() : nullptr, stream));
    });
    if (need_pos && g.prefix_positions > 0) grad_table.narrow(0, 0, g.prefix_positions).copy_(grad_prefix);
    if (need_bias) grads[2] = grad_bias;
    if (need_pos) grads[3] = grad_table.view(pos_shape);
    if (need_unk) grads[4] = grad_unk;
  }
  return grads;
}

namespace {

cuda::PositionLayout position_layout(int64_t batch, int64_t positions, int64_t dim, int64_t prefix_rows,
                                     int64_t prefix_positions) {
  return cuda::PositionLayout{batch, positions, dim, prefix_rows, prefix_positions};
}

// The dtype the backward sums in: double when any gradient involved is double, else float (the CPU kernel's rule).
at::ScalarType position_sum_dtype(std::initializer_list<at::ScalarType> dtypes) {
  for (const auto dtype : dtypes) {
    if (dtype == at::kDouble) return at::kDouble;
  }
  return at::kFloat;
}

// An output of the backward's sums: the gradient itself when its dtype is the summing dtype (the usual float32
// table: no copy), else a buffer of that dtype (converted, rounded once, by `finished`).
at::Tensor sums_for(at::IntArrayRef shape, at::ScalarType dtype, at::ScalarType sum_dtype,
                    const at::TensorOptions& options) {
  return at::empty(shape, options.dtype(dtype == sum_dtype ? dtype : sum_dtype));
}

at::Tensor finished(const at::Tensor& sums, at::ScalarType dtype, at::IntArrayRef shape) {
  return sums.scalar_type() == dtype ? sums.view(shape) : sums.to(dtype).view(shape);
}

}  // namespace

at::Tensor pos_embed_forward_cuda(const at::Tensor& tokens, const at::Tensor& perm, const at::Tensor& mask,
                                  const at::Tensor& pos_embed, const at::Tensor& unk_embed,
                                  const std::optional<at::Tensor>& prefix, int64_t prefix_rows,
                                  int64_t prefix_positions) {
  const c10::cuda::CUDAGuard guard(tokens.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t batch = tokens.size(0), positions = tokens.size(1), dim = tokens.size(2);
  auto out = at::empty({batch, prefix_rows + positions, dim}, pos_embed.options());
  // The prefix in the output dtype (the Python layer passes it so; another dtype is rounded to it first).
  at::Tensor prefix_c;
  if (prefix_rows > 0) {
    prefix_c = prefix->scalar_type() == pos_embed.scalar_type() ? *prefix : prefix->to(pos_embed.scalar_type());
  }
  const auto layout = position_layout(batch, positions, dim, prefix_rows, prefix_positions);
  MJP_DISPATCH_FLOATING_TYPES(pos_embed.scalar_type(), "mjp_position_forward_cuda", [&] {
    using out_t = scalar_t;
    const out_t* prefix_data = prefix_rows > 0 ? prefix_c.data_ptr<out_t>() : nullptr;
    MJP_DISPATCH_FLOATING_TYPES(tokens.scalar_type(), "mjp_position_forward_cuda", [&] {
      // (the launch's status through a variable: a template argument list's comma would split the macro's argument)
      const cudaError_t status = cuda::launch_position_forward<scalar_t, out_t>(
          layout, tokens.data_ptr<scalar_t>(), perm.data_ptr<int64_t>(), mask.data_ptr<bool>(),
          pos_embed.data_ptr<out_t>(), unk_embed.data_ptr<out_t>(), prefix_data, out.data_ptr<out_t>(), stream);
      C10_CUDA_CHECK(status);
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> pos_embed_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& perm, const at::Tensor& mask, int64_t prefix_count,
    int64_t prefix_positions, at::IntArrayRef pos_shape, at::IntArrayRef prefix_shape, at::ScalarType tokens_dtype,
    at::ScalarType pos_dtype, at::ScalarType unk_dtype, at::ScalarType prefix_dtype) {
  const c10::cuda::CUDAGuard guard(grad_out.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t batch = grad_out.size(0), positions = perm.size(1), dim = grad_out.size(2);
  TORCH_CHECK(positions <= std::numeric_limits<int32_t>::max(),
              "mjp_fast::pos_embed_extension_backward: N must be below 2**31 on CUDA, got ", positions);
  const auto layout = position_layout(batch, positions, dim, prefix_count, prefix_positions);
  const auto options = grad_out.options();

  auto grad_tokens = at::empty({batch, positions, dim}, options.dtype(tokens_dtype));
  auto inverse = at::empty({batch, positions}, options.dtype(at::kInt));
  MJP_DISPATCH_FLOATING_TYPES(grad_out.scalar_type(), "mjp_position_move_back_cuda", [&] {
    using grad_t = scalar_t;
    MJP_DISPATCH_FLOATING_TYPES(tokens_dtype, "mjp_position_move_back_cuda", [&] {
      const cudaError_t status = cuda::launch_position_move_back<grad_t, scalar_t>(
          layout, grad_out.data_ptr<grad_t>(), perm.data_ptr<int64_t>(), inverse.data_ptr<int32_t>(),
          grad_tokens.data_ptr<scalar_t>(), stream);
      C10_CUDA_CHECK(status);
    });
  });

  const auto sum_dtype = position_sum_dtype({grad_out.scalar_type(), pos_dtype, unk_dtype, prefix_dtype});
  auto table = sums_for(pos_shape, pos_dtype, sum_dtype, options);
  auto unk = sums_for({dim}, unk_dtype, sum_dtype, options);
  auto unk_partial = at::empty({positions, dim}, options.dtype(sum_dtype));
  auto prefix_sums = prefix_count > 0 ? sums_for(prefix_shape, prefix_dtype, sum_dtype, options) : at::Tensor();
  MJP_DISPATCH_FLOATING_TYPES(grad_out.scalar_type(), "mjp_position_reduce_cuda", [&] {
    using grad_t = scalar_t;
    auto reduce = [&](auto zero) {
      using acc_t = decltype(zero);
      const cudaError_t status = cuda::launch_position_reduce<grad_t, acc_t>(
          layout, grad_out.data_ptr<grad_t>(), mask.data_ptr<bool>(), table.data_ptr<acc_t>(),
          unk_partial.data_ptr<acc_t>(), unk.data_ptr<acc_t>(),
          prefix_count > 0 ? prefix_sums.data_ptr<acc_t>() : nullptr, stream);
      C10_CUDA_CHECK(status);
    };
    if (sum_dtype == at::kDouble) {
      reduce(double(0));
    } else {
      reduce(float(0));
    }
  });
  auto grad_prefix = prefix_count > 0 ? finished(prefix_sums, prefix_dtype, prefix_shape)
                                      : at::empty({0}, options.dtype(prefix_dtype));
  return {grad_tokens, finished(table, pos_dtype, pos_shape), finished(unk, unk_dtype, {dim}), grad_prefix};
}

namespace {

cuda::DalShape dal_shape(const at::Tensor& coords, const at::Tensor& w1, const std::optional<at::Tensor>& mask) {
  return cuda::DalShape{coords.size(0), w1.size(1), w1.size(0), present(mask) ? mask->size(0) : 0};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> dal_loss_forward_cuda(
    const at::Tensor& table, int64_t skip_rows, const at::Tensor& w1, const std::optional<at::Tensor>& b1,
    const at::Tensor& w2, const std::optional<at::Tensor>& b2, const at::Tensor& coords,
    const std::optional<at::Tensor>& mask, double scale) {
  const c10::cuda::CUDAGuard guard(table.device());
  const auto shape = dal_shape(coords, w1, mask);
  const auto options = table.options();
  auto loss = at::empty({}, options);
  auto pred = at::empty({shape.positions, 2}, options);
  auto hidden = at::empty({shape.positions, shape.hidden}, options);
  auto weights = at::empty({shape.positions}, options);
  AT_DISPATCH_FLOATING_TYPES(table.scalar_type(), "mjp_dal_loss_forward_cuda", [&] {  // the computation dtypes
    using T = scalar_t;
    C10_CUDA_CHECK(cuda::launch_dal_forward<T>(
        shape, table.data_ptr<T>() + skip_rows * shape.dim, w1.data_ptr<T>(), optional_data<T>(b1), w2.data_ptr<T>(),
        optional_data<T>(b2), coords.data_ptr<T>(), optional_data<bool>(mask), scale, loss.data_ptr<T>(),
        pred.data_ptr<T>(), hidden.data_ptr<T>(), weights.data_ptr<T>(), c10::cuda::getCurrentCUDAStream()));
  });
  return {loss, pred, hidden, weights};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> dal_loss_backward_cuda(
    const at::Tensor& grad, const at::Tensor& table, int64_t skip_rows, const at::Tensor& w1, const at::Tensor& w2,
    const at::Tensor& coords, const at::Tensor& pred, const at::Tensor& hidden, const at::Tensor& weights,
    double scale, bool has_b1, bool has_b2) {
  const c10::cuda::CUDAGuard guard(table.device());
  const auto shape = dal_shape(coords, w1, std::nullopt);
  const auto options = table.options();
  auto grad_table = at::empty({skip_rows + shape.positions, shape.dim}, options);
  auto grad_w1 = at::empty({shape.hidden, shape.dim}, options);
  auto grad_b1 = at::empty({has_b1 ? shape.hidden : 0}, options);
  auto grad_w2 = at::empty({2, shape.hidden}, options);
  auto grad_b2 = at::empty({has_b2 ? 2 : 0}, options);
  auto d_hidden = at::empty({shape.positions, shape.hidden}, options);
  AT_DISPATCH_FLOATING_TYPES(table.scalar_type(), "mjp_dal_loss_backward_cuda", [&] {
    using T = scalar_t;
    C10_CUDA_CHECK(cuda::launch_dal_backward<T>(
        shape, skip_rows, grad.data_ptr<T>(), scale, table.data_ptr<T>() + skip_rows * shape.dim, w1.data_ptr<T>(),
        w2.data_ptr<T>(), coords.data_ptr<T>(), pred.data_ptr<T>(), hidden.data_ptr<T>(), weights.data_ptr<T>(),
        d_hidden.data_ptr<T>(), grad_table.data_ptr<T>(), grad_w1.data_ptr<T>(),
        has_b1 ? grad_b1.data_ptr<T>() : nullptr, grad_w2.data_ptr<T>(), has_b2 ? grad_b2.data_ptr<T>() : nullptr,
        c10::cuda::getCurrentCUDAStream()));
  });
  return {grad_table, grad_w1, grad_b1, grad_w2, grad_b2};
}

}  // namespace mjp
