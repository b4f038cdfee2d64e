// The DAL loss (dense absolute localization) with its regressor, as two dispatcher operators:
//
//   torch.ops.mjp_fast.dal_loss_extension(pos, skip_rows, w1, b1, w2, b2, coords, mask, scale)
//     -> (loss, pred, hidden, weights)
//     pos: the model's whole position table, any shape with last two dims [skip_rows + N, D] (the first skip_rows
//     rows, the prefix tokens' positions, are not regressed); below, pos means its rows skip_rows.. ([N, D]).
//     hidden = relu(pos @ w1^T + b1)             [N, H]   ([N, 0] for the linear regressor: no w1)
//     pred = hidden @ w2^T + b2                   [N, 2]   (linear regressor: pos @ w2^T + b2)
//     weights[n] = u[n] / max(sum_m u[m], 1)      [N]      u[n]: samples b with mask[b, n] False (1 without a mask)
//     loss = scale * sum_n weights[n] * |pred[n] - coords[n]|_1                 []
//   torch.ops.mjp_fast.dal_loss_extension_backward(grad, pos, skip_rows, w1, w2, coords, pred, hidden, weights, scale,
//                                                  has_b1, has_b2) -> (grad_pos, grad_w1, grad_b1, grad_w2, grad_b2)
//     grad_pos has pos's whole shape, zeros in the skipped rows.
//
// Everything runs in float32 (float64 when pos is float64), under torch.autocast too (the kernels turn it off for
// their own operations): pred, hidden and weights come out in that dtype (they are what the backward needs), the
// gradients in the dtype of their tensors; a gradient that does not apply (no w1, no bias) is an empty [0] tensor.
// Beyond the regressor's GEMMs the work is tiny, so the cost is the number of operations:
// - CPU kernels: the GEMMs over the D-wide rows (one forward, two backward) as loops on the calling thread up to
//   kLoopGemmLimit multiply-adds, through ATen's BLAS above; the rest (bias and ReLU, the [N, 2] layer, the weights,
//   the L1 and their gradients: O(N * H) work) in plain loops, in a fixed order (bitwise reproducible). At small
//   sizes a training step's DAL is then a few microseconds of host time, and never waits for another thread.
// - CUDA kernels (dal_loss_cuda.cu) for the nonlinear regressor: two launches forward, two backward.
// - CompositeExplicitAutograd kernels (the linear regressor on CUDA, and any other device): the fewest ATen
//   operations that compute it, 12 forward and 14 backward (a view or two more for a table with skipped rows) instead
//   of the ~40 of the nn.Sequential regressor and the weighted L1 under autograd.
// Meta kernels give the shapes to FakeTensor and torch.compile. The autograd is autograd_ops.cpp's
// (dal_loss_extension_autograd) or the Python layer's.
#include <ATen/Dispatch.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/ops/_addmm_activation.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/dot.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/gt.h>
#include <ATen/ops/linalg_vector_norm.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/sub.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/threshold_backward.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "ops.h"

namespace mjp {

// See the anchor in ops.h.
extern const int kDalLossOperators = 1;

namespace {

constexpr const char* kForward = "mjp_fast::dal_loss_extension";
constexpr const char* kBackward = "mjp_fast::dal_loss_extension_backward";

bool is_float_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16;
}

// The computation dtype: float64 for float64 embeddings, float32 otherwise.
at::ScalarType compute_dtype(const at::Tensor& pos) {
  return pos.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// A floating tensor of exactly `sizes` on pos's device. Symbolic sizes, so the Meta kernels share the checks.
void check_param(const char* op, const char* name, const at::Tensor& tensor, c10::SymIntArrayRef sizes,
                 const at::Tensor& pos) {
  TORCH_CHECK(tensor.sym_sizes() == sizes, op, ": ", name, " must be ", sizes, ", got ", tensor.sym_sizes());
  TORCH_CHECK(is_float_dtype(tensor.scalar_type()), op, ": ", name,
              " must be float32, float64, float16 or bfloat16, got ", tensor.scalar_type());
  TORCH_CHECK(tensor.device() == pos.device(), op, ": ", name, " on ", tensor.device(), ", pos on ", pos.device());
}

// Checks coords [N, 2], pos (the whole table: last two dims [skip_rows + N, D], leading dims of size 1), w1 [H, D]
// and w2 [2, H] ([2, D] without w1); returns H (D without w1).
c10::SymInt check_regressor(const char* op, const at::Tensor& pos, int64_t skip_rows,
                            const std::optional<at::Tensor>& w1, const at::Tensor& w2, const at::Tensor& coords) {
  TORCH_CHECK(coords.dim() == 2, op, ": coords must be [N, 2], got ", coords.sym_sizes());
  TORCH_CHECK(skip_rows >= 0, op, ": skip_rows must be >= 0, got ", skip_rows);
  TORCH_CHECK(pos.dim() >= 2, op, ": pos must be the position table, last two dims [skip_rows + N, D], got ",
              pos.sym_sizes());
  TORCH_CHECK(is_float_dtype(pos.scalar_type()), op, ": pos must be float32, float64, float16 or bfloat16, got ",
              pos.scalar_type());
  const c10::SymInt positions = coords.sym_size(0), dim = pos.sym_size(-1);
  TORCH_CHECK(pos.sym_size(-2) == positions + skip_rows && pos.sym_numel() == (positions + skip_rows) * dim, op,
              ": pos must be the whole position table, last two dims [skip_rows + N, D] = [", skip_rows, " + ",
              positions, ", D] (N = coords.size(0)) and no other rows (leading dims of size 1), got ",
              pos.sym_sizes());
  c10::SymInt hidden = dim;
  if (present(w1)) {
    TORCH_CHECK(w1->dim() == 2, op, ": w1 must be [H, D], got ", w1->sym_sizes());
    hidden = w1->sym_size(0);
    check_param(op, "w1", *w1, {hidden, dim}, pos);
  }
  check_param(op, "w2", w2, {c10::SymInt(2), hidden}, pos);
  check_param(op, "coords", coords, {positions, c10::SymInt(2)}, pos);
  return hidden;
}

void check_forward_args(const at::Tensor& pos, int64_t skip_rows, const std::optional<at::Tensor>& w1,
                        const std::optional<at::Tensor>& b1, const at::Tensor& w2,
                        const std::optional<at::Tensor>& b2, const at::Tensor& coords,
                        const std::optional<at::Tensor>& mask) {
  const c10::SymInt hidden = check_regressor(kForward, pos, skip_rows, w1, w2, coords);
  if (present(b1)) {
    TORCH_CHECK(present(w1), kForward, ": b1 given without w1");
    check_param(kForward, "b1", *b1, {hidden}, pos);
  }
  if (present(b2)) check_param(kForward, "b2", *b2, {c10::SymInt(2)}, pos);
  if (present(mask)) {
    TORCH_CHECK(mask->scalar_type() == at::kBool, kForward, ": mask must be bool, got ", mask->scalar_type());
    TORCH_CHECK(mask->dim() == 2 && mask->sym_size(1) == coords.sym_size(0), kForward,
                ": mask must be [B, N] with N = ", coords.sym_size(0), ", got ", mask->sym_sizes());
    TORCH_CHECK(mask->device() == pos.device(), kForward, ": mask on ", mask->device(), ", pos on ", pos.device());
  }
}

void check_backward_args(const at::Tensor& grad, const at::Tensor& pos, int64_t skip_rows,
                         const std::optional<at::Tensor>& w1, const at::Tensor& w2, const at::Tensor& coords,
                         const at::Tensor& pred, const at::Tensor& hidden, const at::Tensor& weights) {
  const c10::SymInt width = check_regressor(kBackward, pos, skip_rows, w1, w2, coords);
  const c10::SymInt positions = coords.sym_size(0);
  const auto dtype = compute_dtype(pos);
  TORCH_CHECK(grad.dim() == 0 && is_float_dtype(grad.scalar_type()), kBackward,
              ": grad must be a floating scalar of shape [], got ", grad.scalar_type(), " ", grad.sym_sizes());
  const c10::SymInt hidden_width = present(w1) ? width : c10::SymInt(0);
  // The forward's outputs, in the computation dtype.
  auto check_saved = [&](const char* name, const at::Tensor& tensor, c10::SymIntArrayRef sizes) {
    TORCH_CHECK(tensor.sym_sizes() == sizes, kBackward, ": ", name, " must be ", sizes, ", got ", tensor.sym_sizes());
    TORCH_CHECK(tensor.scalar_type() == dtype, kBackward, ": ", name, " must be ", dtype, ", got ",
                tensor.scalar_type());
    TORCH_CHECK(tensor.device() == pos.device(), kBackward, ": ", name, " on ", tensor.device(), ", pos on ",
                pos.device());
  };
  check_saved("pred", pred, {positions, c10::SymInt(2)});
  check_saved("hidden", hidden, {positions, hidden_width});
  check_saved("weights", weights, {positions});
}

// An empty [0] gradient, for a tensor that does not exist.
at::Tensor no_gradient(const at::Tensor& like) { return at::empty({0}, like.options()); }

// `tensor` in `dtype`, without a dispatch when it already is.
at::Tensor as_dtype(const at::Tensor& tensor, at::ScalarType dtype) {
  return tensor.scalar_type() == dtype ? tensor : tensor.to(dtype);
}

// The regressed rows [N, D] of a position table (rows skip_rows.. of its last two dims): a view, without a dispatch
// for an [N, D] table.
at::Tensor regressed_rows(const at::Tensor& table, int64_t skip_rows, int64_t positions) {
  const auto rows = table.dim() == 2 ? table : table.view({table.size(-2), table.size(-1)});
  return skip_rows == 0 ? rows : rows.narrow(0, skip_rows, positions);
}

// `rows` ([N, D], the gradient of the regressed rows) as the gradient of the table `pos`: pos's shape and dtype, zeros
// in the skipped rows. Without skipped rows the rows themselves, cast and reshaped.
at::Tensor table_from_rows(const at::Tensor& pos, int64_t skip_rows, const at::Tensor& rows) {
  if (skip_rows == 0) {
    const auto grad = as_dtype(rows, pos.scalar_type());
    return pos.dim() == 2 ? grad : grad.view(pos.sizes());
  }
  auto grad = at::zeros(pos.sizes(), pos.options());
  regressed_rows(grad, skip_rows, rows.size(0)).copy_(rows);
  return grad;
}

// The gradient of the table `pos` whose regressed rows get d_features @ weight (computed in `dtype`): as
// table_from_rows, the product written straight into the zero-filled table when pos has the computation dtype.
at::Tensor table_gradient(const at::Tensor& pos, int64_t skip_rows, const at::Tensor& d_features,
                          const at::Tensor& weight, at::ScalarType dtype) {
  if (skip_rows == 0 || pos.scalar_type() != dtype) return table_from_rows(pos, skip_rows, at::mm(d_features, weight));
  auto grad = at::zeros(pos.sizes(), pos.options());
  auto rows = regressed_rows(grad, skip_rows, d_features.size(0));
  at::mm_out(rows, d_features, weight);
  return grad;
}

// `rows` ([N, D], the regressed rows in the computation dtype) with the rows of weight 0 (positions every sample
// masks, out of the loss) read as zeros: their values, even inf or NaN, then reach neither the loss nor, as
// 0 * inf in a GEMM, the gradients. Two operations on the device, no host sync (the CUDA path; the CPU kernel skips
// those rows in its loops instead).
at::Tensor kept_rows(const at::Tensor& rows, const at::Tensor& weights) {
  return at::where(weights.unsqueeze(1).gt(0), rows, 0);
}

// As kept_rows for the CPU kernel's GEMMs through ATen: `rows` itself unless a row of weight 0 holds a non-finite
// value (scanning only those rows: no copy in the usual case), else a copy with those rows zeroed.
at::Tensor finite_kept_rows(const at::Tensor& rows, const at::Tensor& weights) {
  const int64_t positions = rows.size(0), dim = rows.size(1);
  bool clean = true;
  AT_DISPATCH_FLOATING_TYPES(rows.scalar_type(), "mjp_dal_kept_rows_cpu", [&] {
    const scalar_t* data = rows.data_ptr<scalar_t>();
    const scalar_t* weight_data = weights.data_ptr<scalar_t>();
    for (int64_t n = 0; n < positions && clean; ++n) {
      if (weight_data[n] != 0) continue;
      for (int64_t k = 0; k < dim; ++k) clean &= std::isfinite(static_cast<double>(data[n * dim + k]));
    }
  });
  return clean ? rows : kept_rows(rows, weights);
}

// The DAL kernels compute in float32 as specified, also when called under torch.autocast (whose keys would otherwise
// send their matrix products to bfloat16 or float16), and are never recorded by autograd (the Python layer owns the
// graph).
struct RawComputation {
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  const c10::impl::ExcludeDispatchKeyGuard no_autocast{c10::autocast_dispatch_keyset};
};

// (loss, pred, hidden, weights) and (grad_pos, grad_w1, grad_b1, grad_w2, grad_b2).
using ForwardOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using BackwardOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// dal_loss_extension's arguments, checked, with what every kernel derives from them. Each backend's kernel is a
// member function, so that its body names the arguments as the operator's schema does.
struct DalForward {
  const at::Tensor& pos;
  int64_t skip_rows;
  const std::optional<at::Tensor>& w1;
  const std::optional<at::Tensor>& b1;
  const at::Tensor& w2;
  const std::optional<at::Tensor>& b2;
  const at::Tensor& coords;
  const std::optional<at::Tensor>& mask;
  double scale;
  at::ScalarType dtype;  // the computation dtype
  int64_t positions;     // N

  ForwardOutputs composite() const;  // ATen operations (CompositeExplicitAutograd)
  ForwardOutputs cpu_loops() const;  // the CPU kernel
#ifdef MJP_WITH_CUDA
  ForwardOutputs cuda_kernels() const;  // dal_loss_cuda.cu: the nonlinear regressor (the linear one: composite)
#endif
};

// dal_loss_extension_backward's arguments, checked, with what every kernel derives from them (as DalForward).
struct DalBackward {
  const at::Tensor& grad;
  const at::Tensor& pos;
  int64_t skip_rows;
  const std::optional<at::Tensor>& w1;
  const at::Tensor& w2;
  const at::Tensor& coords;
  const at::Tensor& pred;
  const at::Tensor& hidden;
  const at::Tensor& weights;
  double scale;
  bool has_b1;
  bool has_b2;
  at::ScalarType dtype;  // the computation dtype
  int64_t positions;     // N

  BackwardOutputs composite() const;  // ATen operations (CompositeExplicitAutograd)
  BackwardOutputs cpu_loops() const;  // the CPU kernel
#ifdef MJP_WITH_CUDA
  BackwardOutputs cuda_kernels() const;  // dal_loss_cuda.cu: the nonlinear regressor (the linear one: composite)
#endif
};

// An operator's kernel for one backend (the registrations below): the arguments checked, then `kernel` (a member
// function of DalForward or DalBackward) under RawComputation.
template <ForwardOutputs (DalForward::*kernel)() const>
ForwardOutputs dal_loss_forward(const at::Tensor& pos, int64_t skip_rows, const std::optional<at::Tensor>& w1,
                                const std::optional<at::Tensor>& b1, const at::Tensor& w2,
                                const std::optional<at::Tensor>& b2, const at::Tensor& coords,
                                const std::optional<at::Tensor>& mask, double scale) {
  const RawComputation raw;
  check_forward_args(pos, skip_rows, w1, b1, w2, b2, coords, mask);
  const DalForward args{pos, skip_rows, w1, b1, w2, b2, coords, mask, scale, compute_dtype(pos), coords.size(0)};
  return (args.*kernel)();
}

template <BackwardOutputs (DalBackward::*kernel)() const>
BackwardOutputs dal_loss_backward(const at::Tensor& grad, const at::Tensor& pos, int64_t skip_rows,
                                  const std::optional<at::Tensor>& w1, const at::Tensor& w2, const at::Tensor& coords,
                                  const at::Tensor& pred, const at::Tensor& hidden, const at::Tensor& weights,
                                  double scale, bool has_b1, bool has_b2) {
  const RawComputation raw;
  check_backward_args(grad, pos, skip_rows, w1, w2, coords, pred, hidden, weights);
  const DalBackward args{grad, pos, skip_rows, w1, w2, coords, pred, hidden, weights, scale, has_b1, has_b2,
                         compute_dtype(pos), coords.size(0)};
  return (args.*kernel)();
}

ForwardOutputs DalForward::composite() const {
  // The weights first: a position that every sample masks (weight 0) is out of the loss, so its row of the table is
  // read as zeros (a non-finite value there must not reach the loss nor, as 0 * inf, the gradients).
  at::Tensor weights;
  auto pos_c = as_dtype(regressed_rows(pos, skip_rows, positions), dtype);
  if (present(mask)) {
    // u[n] = samples keeping n unmasked; summed and normalised on the device (no host sync).
    weights = at::sum(mask->logical_not(), {0}, /*keepdim=*/false, dtype);
    weights.div_(weights.sum().clamp_min_(1));
    pos_c = kept_rows(pos_c, weights);
  } else {
    weights = at::full({positions}, 1.0 / static_cast<double>(std::max<int64_t>(positions, 1)), pos_c.options());
  }
  at::Tensor hidden, features;  // features: what the last Linear maps ([N, H] hidden, or pos for a linear regressor)
  if (present(w1)) {
    const auto w1_t = as_dtype(*w1, dtype).t();
    // relu(pos @ w1^T + b1) in one operation (on CUDA a cuBLASLt epilogue).
    hidden = present(b1) ? at::_addmm_activation(as_dtype(*b1, dtype), pos_c, w1_t) : at::mm(pos_c, w1_t).relu_();
    features = hidden;
  } else {
    hidden = at::empty({positions, 0}, pos_c.options());
    features = pos_c;
  }
  const auto w2_t = as_dtype(w2, dtype).t();
  const auto pred = present(b2) ? at::addmm(as_dtype(*b2, dtype), features, w2_t) : at::mm(features, w2_t);
  // |pred - coords|_1 per position, then weighted and summed.
  const auto errors = at::linalg_vector_norm(at::sub(pred, as_dtype(coords, dtype)), 1, {1});
  auto loss = at::dot(errors, weights);
  if (scale != 1.0) loss.mul_(scale);
  return {loss, pred, hidden, weights};
}

BackwardOutputs DalBackward::composite() const {
  // d_pred = grad * scale * weights[:, None] * sign(pred - coords); sign(0) = 0, as abs's backward.
  auto d_pred = at::sub(pred, as_dtype(coords, dtype));
  d_pred.sign_();
  auto row_scale = weights.unsqueeze(1).mul(grad);  // [N, 1], in weights' dtype (grad is a 0-d tensor)
  if (scale != 1.0) row_scale.mul_(scale);
  d_pred.mul_(row_scale);
  const auto w2_c = as_dtype(w2, dtype);
  const auto grad_b2 = has_b2 ? as_dtype(d_pred.sum(0), w2.scalar_type()) : no_gradient(w2);
  const auto d_pred_t = d_pred.t();
  if (!present(w1)) {
    const auto pos_c = kept_rows(as_dtype(regressed_rows(pos, skip_rows, positions), dtype), weights);
    return {table_gradient(pos, skip_rows, d_pred, w2_c, dtype), no_gradient(pos), no_gradient(pos),
            as_dtype(at::mm(d_pred_t, pos_c), w2.scalar_type()), grad_b2};
  }
  const auto grad_w2 = as_dtype(at::mm(d_pred_t, hidden), w2.scalar_type());
  const auto d_hidden = at::threshold_backward(at::mm(d_pred, w2_c), hidden, 0);  // relu's backward
  const auto grad_b1 = has_b1 ? as_dtype(d_hidden.sum(0), w1->scalar_type()) : no_gradient(*w1);
  const auto pos_c = kept_rows(as_dtype(regressed_rows(pos, skip_rows, positions), dtype), weights);
  const auto grad_w1 = as_dtype(at::mm(d_hidden.t(), pos_c), w1->scalar_type());
  const auto grad_pos = table_gradient(pos, skip_rows, d_hidden, as_dtype(*w1, dtype), dtype);
  return {grad_pos, grad_w1, grad_b1, grad_w2, grad_b2};
}

// ---- CPU kernels: the GEMMs over D through ATen, the O(N * H) rest in loops (see the top of the file).

template <typename T>
T sign_of(T value) {
  return static_cast<T>((value > T(0)) - (value < T(0)));
}

// Below this many multiply-adds (N * H * D) a GEMM runs as a loop on the calling thread, not through ATen: there
// the call (dispatch, an output allocation, BLAS's set-up) costs more than the arithmetic, and BLAS would split a
// GEMM of microseconds over the intra-op threads, whose fork and join cost more than it saves. On a machine whose
// cores are shared, each such parallel region waits for a descheduled thread: measured on 2 busy cores, the
// [196, 64] x [64, 64] GEMMs of the cpu preset's DAL loss (a 14x14 grid, D = H = 64) took 16 ms each through
// ATen on 2 threads (21 us with torch.set_num_threads(1)), so the DAL loss cost 48 ms of a 2 s step; with these
// loops its forward and backward take 0.5-1 ms. 2**21: a 14x14 grid at D = H = 100, well under a millisecond on
// one core; DeiT-Tiny's 196 x 192 x 192 stays with ATen.
constexpr int64_t kLoopGemmLimit = int64_t(1) << 21;

// The loops keep their innermost index on a contiguous output row (no reduction into one scalar), so that the
// compiler vectorizes them without reassociating a sum.

// out[i, j] = sum_k a[i, k] * b[k, j] (a b): a [M, K], b [K, J] row-major, out [M, J] with row stride ldo.
template <typename T>
void gemm_nn(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out, int64_t m, int64_t k_count,
             int64_t j_count, int64_t ldo) {
  for (int64_t i = 0; i < m; ++i) {
    T* __restrict__ row = out + i * ldo;
    std::fill(row, row + j_count, T(0));
    for (int64_t k = 0; k < k_count; ++k) {
      const T scale = a[i * k_count + k];
      const T* __restrict__ b_row = b + k * j_count;
      for (int64_t j = 0; j < j_count; ++j) row[j] += scale * b_row[j];
    }
  }
}

// out[i, j] = sum_k a[i, k] * b[j, k] (a b^T): a [M, K] and b [J, K] row-major, out [M, J] with row stride ldo.
// b (a weight, small) is transposed once into a buffer, and the product runs as gemm_nn.
template <typename T>
void gemm_nt(const T* a, const T* b, T* out, int64_t m, int64_t j_count, int64_t k_count, int64_t ldo) {
  std::vector<T> b_t(static_cast<size_t>(k_count * j_count));
  for (int64_t j = 0; j < j_count; ++j) {
    for (int64_t k = 0; k < k_count; ++k) b_t[k * j_count + j] = b[j * k_count + k];
  }
  gemm_nn(a, b_t.data(), out, m, k_count, j_count, ldo);
}

// out[i, j] = sum_m a[m, i] * b[m, j] (a^T b): a [M, I], b [M, J] row-major, out [I, J] with row stride ldo. The
// rows m with weights[m] == 0 (out of the loss, a's rows zero) are skipped: b's values there, even inf or NaN, do
// not reach out.
template <typename T>
void gemm_tn(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out, int64_t m_count,
             int64_t i_count, int64_t j_count, int64_t ldo, const T* weights) {
  for (int64_t i = 0; i < i_count; ++i) std::fill(out + i * ldo, out + i * ldo + j_count, T(0));
  for (int64_t m = 0; m < m_count; ++m) {
    if (weights[m] == 0) continue;
    const T* __restrict__ b_row = b + m * j_count;
    for (int64_t i = 0; i < i_count; ++i) {
      const T scale = a[m * i_count + i];
      T* __restrict__ out_row = out + i * ldo;
      for (int64_t j = 0; j < j_count; ++j) out_row[j] += scale * b_row[j];
    }
  }
}

ForwardOutputs DalForward::cpu_loops() const {
  const auto pos_c = as_dtype(regressed_rows(pos, skip_rows, positions), dtype).contiguous();
  const auto options = pos_c.options();
  // hidden = pos @ w1^T (the one GEMM; bias and ReLU below), or nothing for the linear regressor.
  at::Tensor hidden;
  if (!present(w1)) {
    hidden = at::empty({positions, 0}, options);
  } else if (positions * w1->size(0) * w1->size(1) <= kLoopGemmLimit) {
    const auto w1_c = as_dtype(*w1, dtype).contiguous();
    hidden = at::empty({positions, w1->size(0)}, options);
    AT_DISPATCH_FLOATING_TYPES(dtype, "mjp_dal_hidden_cpu", [&] {
      gemm_nt(pos_c.data_ptr<scalar_t>(), w1_c.data_ptr<scalar_t>(), hidden.data_ptr<scalar_t>(), positions,
              w1->size(0), w1->size(1), w1->size(0));
    });
  } else {
    hidden = at::mm(pos_c, as_dtype(*w1, dtype).t()).contiguous();
  }
  const int64_t width = present(w1) ? hidden.size(1) : pos_c.size(1);  // of what the last layer maps
  const auto features = present(w1) ? hidden : pos_c;
  const auto w2_c = as_dtype(w2, dtype).contiguous();
  const auto coords_c = as_dtype(coords, dtype).contiguous();
  const auto b1_c = present(b1) ? as_dtype(*b1, dtype).contiguous() : at::Tensor();
  const auto b2_c = present(b2) ? as_dtype(*b2, dtype).contiguous() : at::Tensor();
  const auto mask_c = present(mask) ? mask->contiguous() : at::Tensor();
  auto pred = at::empty({positions, 2}, options);
  auto weights = at::empty({positions}, options);
  auto loss = at::empty({}, options);
  AT_DISPATCH_FLOATING_TYPES(dtype, "mjp_dal_loss_forward_cpu", [&] {
    scalar_t* weight_data = weights.data_ptr<scalar_t>();
    // weights[n] = samples keeping n unmasked / all unmasked tokens of the batch (at least 1).
    if (mask_c.defined()) {
      const bool* mask_data = mask_c.data_ptr<bool>();
      const int64_t batch = mask_c.size(0);
      std::fill(weight_data, weight_data + positions, scalar_t(0));
      for (int64_t b = 0; b < batch; ++b) {
        for (int64_t n = 0; n < positions; ++n) weight_data[n] += mask_data[b * positions + n] ? 0 : 1;
      }
      scalar_t total = 0;
      for (int64_t n = 0; n < positions; ++n) total += weight_data[n];
      total = std::max(total, scalar_t(1));
      for (int64_t n = 0; n < positions; ++n) weight_data[n] /= total;
    } else {
      std::fill(weight_data, weight_data + positions,
                static_cast<scalar_t>(1.0 / static_cast<double>(std::max<int64_t>(positions, 1))));
    }
    // A position of weight 0 (every sample masks it) is out of the loss: its row is neither used nor kept (hidden
    // and pred zero), so that its values, even inf or NaN, reach neither the loss nor the gradients.
    scalar_t* hidden_data = hidden.data_ptr<scalar_t>();
    if (present(w1)) {
      const scalar_t* bias = b1_c.defined() ? b1_c.data_ptr<scalar_t>() : nullptr;
      for (int64_t n = 0; n < positions; ++n) {
        scalar_t* row = hidden_data + n * width;
        if (weight_data[n] == 0) {
          std::fill(row, row + width, scalar_t(0));
          continue;
        }
        // relu as torch's: NaN stays NaN (std::max(NaN, 0) returns its first argument).
        for (int64_t h = 0; h < width; ++h) row[h] = std::max(row[h] + (bias ? bias[h] : scalar_t(0)), scalar_t(0));
      }
    }
    const scalar_t* feature_data = features.data_ptr<scalar_t>();
    const scalar_t* w2_data = w2_c.data_ptr<scalar_t>();
    const scalar_t* coords_data = coords_c.data_ptr<scalar_t>();
    scalar_t* pred_data = pred.data_ptr<scalar_t>();
    for (int64_t n = 0; n < positions; ++n) {
      const scalar_t* row = feature_data + n * width;
      const bool kept = weight_data[n] != 0;
      for (int64_t j = 0; j < 2; ++j) {
        scalar_t sum = b2_c.defined() ? b2_c.data_ptr<scalar_t>()[j] : scalar_t(0);
        for (int64_t k = 0; kept && k < width; ++k) sum += row[k] * w2_data[j * width + k];
        pred_data[n * 2 + j] = sum;
      }
    }
    scalar_t sum = 0;
    for (int64_t n = 0; n < positions; ++n) {
      if (weight_data[n] == 0) continue;
      const scalar_t error = std::abs(pred_data[n * 2] - coords_data[n * 2]) +
                             std::abs(pred_data[n * 2 + 1] - coords_data[n * 2 + 1]);
      sum += weight_data[n] * error;
    }
    loss.data_ptr<scalar_t>()[0] = sum * static_cast<scalar_t>(scale);
  });
  return {loss, pred, hidden, weights};
}

BackwardOutputs DalBackward::cpu_loops() const {
  const auto pos_c = as_dtype(regressed_rows(pos, skip_rows, positions), dtype).contiguous();
  const auto options = pos_c.options();
  const int64_t width = present(w1) ? hidden.size(1) : pos_c.size(1);  // of what the last layer maps
  const auto features = present(w1) ? hidden.contiguous() : pos_c;
  const auto w2_c = as_dtype(w2, dtype).contiguous();
  const auto coords_c = as_dtype(coords, dtype).contiguous();
  const auto pred_c = pred.contiguous(), weights_c = weights.contiguous();
  auto d_pred = at::empty({positions, 2}, options);
  auto grad_w2 = at::empty({2, width}, options);
  auto grad_b2 = at::empty({2}, options);
  // d_features: the gradient of what the last layer maps: d_hidden (zero where the ReLU was off), or of pos's rows.
  auto d_features = at::empty({positions, width}, options);
  auto grad_b1 = at::empty({present(w1) && has_b1 ? width : 0}, options);
  AT_DISPATCH_FLOATING_TYPES(dtype, "mjp_dal_loss_backward_cpu", [&] {
    // d_pred = grad * scale * weights[n] * sign(pred - coords); sign(0) = 0, as abs's backward.
    const scalar_t factor = static_cast<scalar_t>(grad.item<double>() * scale);
    const scalar_t* pred_data = pred_c.data_ptr<scalar_t>();
    const scalar_t* coords_data = coords_c.data_ptr<scalar_t>();
    const scalar_t* weight_data = weights_c.data_ptr<scalar_t>();
    scalar_t* d_pred_data = d_pred.data_ptr<scalar_t>();
    for (int64_t n = 0; n < positions * 2; ++n) {
      d_pred_data[n] = factor * weight_data[n / 2] * sign_of(pred_data[n] - coords_data[n]);
    }
    const scalar_t* feature_data = features.data_ptr<scalar_t>();
    const scalar_t* w2_data = w2_c.data_ptr<scalar_t>();
    scalar_t* grad_w2_data = grad_w2.data_ptr<scalar_t>();
    scalar_t* grad_b2_data = grad_b2.data_ptr<scalar_t>();
    scalar_t* d_feature_data = d_features.data_ptr<scalar_t>();
    std::fill(grad_w2_data, grad_w2_data + 2 * width, scalar_t(0));
    grad_b2_data[0] = grad_b2_data[1] = 0;
    for (int64_t n = 0; n < positions; ++n) {
      const scalar_t g0 = d_pred_data[n * 2], g1 = d_pred_data[n * 2 + 1];
      const scalar_t* row = feature_data + n * width;
      scalar_t* d_row = d_feature_data + n * width;
      if (weight_data[n] == 0) {  // out of the loss: no gradient through it, whatever its row holds
        std::fill(d_row, d_row + width, scalar_t(0));
        continue;
      }
      grad_b2_data[0] += g0;
      grad_b2_data[1] += g1;
      for (int64_t k = 0; k < width; ++k) {
        grad_w2_data[k] += g0 * row[k];
        grad_w2_data[width + k] += g1 * row[k];
        // relu's backward (threshold_backward at 0) for the hidden layer; none for the linear regressor's input.
        const scalar_t d = g0 * w2_data[k] + g1 * w2_data[width + k];
        d_row[k] = present(w1) && !(row[k] > 0) ? scalar_t(0) : d;
      }
    }
    if (grad_b1.numel() > 0) {
      scalar_t* grad_b1_data = grad_b1.data_ptr<scalar_t>();
      std::fill(grad_b1_data, grad_b1_data + width, scalar_t(0));
      for (int64_t n = 0; n < positions; ++n) {
        for (int64_t h = 0; h < width; ++h) grad_b1_data[h] += d_feature_data[n * width + h];
      }
    }
  });
  const auto grad_b2_out = has_b2 ? as_dtype(grad_b2, w2.scalar_type()) : no_gradient(w2);
  if (!present(w1)) {
    // The linear regressor: d_features is already the gradient of pos's rows.
    return {table_from_rows(pos, skip_rows, d_features), no_gradient(pos), no_gradient(pos),
            as_dtype(grad_w2, w2.scalar_type()), grad_b2_out};
  }
  const auto grad_b1_out = has_b1 ? as_dtype(grad_b1, w1->scalar_type()) : no_gradient(*w1);
  const auto w1_c = as_dtype(*w1, dtype).contiguous();
  const int64_t dim = w1_c.size(1);
  if (positions * width * dim > kLoopGemmLimit) {
    const auto grad_w1 = as_dtype(at::mm(d_features.t(), finite_kept_rows(pos_c, weights_c)), w1->scalar_type());
    const auto grad_pos = table_gradient(pos, skip_rows, d_features, w1_c, dtype);
    return {grad_pos, grad_w1, grad_b1_out, as_dtype(grad_w2, w2.scalar_type()), grad_b2_out};
  }
  // Small: grad_w1 = d_hidden^T pos and the table's rows = d_hidden w1 as loops, written in place.
  auto grad_w1 = at::empty({width, dim}, options);
  const bool direct = pos.scalar_type() == dtype;  // write the table's gradient itself, else a buffer then a cast
  auto grad_table = direct ? at::empty(pos.sizes(), pos.options()) : at::empty({positions, dim}, options);
  AT_DISPATCH_FLOATING_TYPES(dtype, "mjp_dal_small_gemms_cpu", [&] {
    const scalar_t* d_data = d_features.data_ptr<scalar_t>();
    gemm_tn(d_data, pos_c.data_ptr<scalar_t>(), grad_w1.data_ptr<scalar_t>(), positions, width, dim, dim,
            weights_c.data_ptr<scalar_t>());
    scalar_t* table = grad_table.data_ptr<scalar_t>();
    if (direct) {
      std::fill(table, table + skip_rows * dim, scalar_t(0));  // the prefix rows are not regressed
      table += skip_rows * dim;
    }
    gemm_nn(d_data, w1_c.data_ptr<scalar_t>(), table, positions, width, dim, dim);
  });
  return {direct ? grad_table : table_from_rows(pos, skip_rows, grad_table), as_dtype(grad_w1, w1->scalar_type()),
          grad_b1_out, as_dtype(grad_w2, w2.scalar_type()), grad_b2_out};
}

#ifdef MJP_WITH_CUDA
// ---- CUDA kernels (dal_loss_cuda.cu, through cuda_ops.cpp) for the nonlinear regressor, the default: two launches
// each way instead of the composite's 12 and 14 operations (and their views). The linear regressor (rare; no hidden
// layer) keeps the composite.

// `tensor` in `dtype` and contiguous: itself, without a dispatch, in the usual case.
at::Tensor contiguous_as(const at::Tensor& tensor, at::ScalarType dtype) {
  const auto converted = as_dtype(tensor, dtype);
  return converted.is_contiguous() ? converted : converted.contiguous();
}

std::optional<at::Tensor> optional_contiguous_as(const std::optional<at::Tensor>& tensor, at::ScalarType dtype) {
  return present(tensor) ? std::optional<at::Tensor>(contiguous_as(*tensor, dtype)) : std::nullopt;
}

ForwardOutputs DalForward::cuda_kernels() const {
  if (!present(w1)) return composite();
  const auto mask_c = present(mask) ? std::optional<at::Tensor>(contiguous_as(*mask, at::kBool)) : std::nullopt;
  return dal_loss_forward_cuda(contiguous_as(pos, dtype), skip_rows, contiguous_as(*w1, dtype),
                               optional_contiguous_as(b1, dtype), contiguous_as(w2, dtype),
                               optional_contiguous_as(b2, dtype), contiguous_as(coords, dtype), mask_c, scale);
}

BackwardOutputs DalBackward::cuda_kernels() const {
  if (!present(w1)) return composite();
  auto [grad_table, grad_w1, grad_b1, grad_w2, grad_b2] = dal_loss_backward_cuda(
      contiguous_as(grad, dtype), contiguous_as(pos, dtype), skip_rows, contiguous_as(*w1, dtype),
      contiguous_as(w2, dtype), contiguous_as(coords, dtype), contiguous_as(pred, dtype),
      contiguous_as(hidden, dtype), contiguous_as(weights, dtype), scale, has_b1, has_b2);
  const auto grad_pos = as_dtype(grad_table, pos.scalar_type());
  return {pos.dim() == 2 ? grad_pos : grad_pos.view(pos.sizes()), as_dtype(grad_w1, w1->scalar_type()),
          has_b1 ? as_dtype(grad_b1, w1->scalar_type()) : no_gradient(*w1), as_dtype(grad_w2, w2.scalar_type()),
          has_b2 ? as_dtype(grad_b2, w2.scalar_type()) : no_gradient(w2)};
}
#endif

// ---- Meta kernels: checks and output shapes only (symbolic sizes, for torch.compile's dynamic shapes).

ForwardOutputs dal_loss_forward_meta(
    const at::Tensor& pos, int64_t skip_rows, const std::optional<at::Tensor>& w1,
    const std::optional<at::Tensor>& b1, const at::Tensor& w2, const std::optional<at::Tensor>& b2,
    const at::Tensor& coords, const std::optional<at::Tensor>& mask, double /*scale*/) {
  check_forward_args(pos, skip_rows, w1, b1, w2, b2, coords, mask);
  const auto options = pos.options().dtype(compute_dtype(pos));
  const c10::SymInt positions = coords.sym_size(0);
  const c10::SymInt hidden_width = present(w1) ? w1->sym_size(0) : c10::SymInt(0);
  return {at::empty_symint({}, options), at::empty_symint({positions, c10::SymInt(2)}, options),
          at::empty_symint({positions, hidden_width}, options), at::empty_symint({positions}, options)};
}

BackwardOutputs dal_loss_backward_meta(
    const at::Tensor& grad, const at::Tensor& pos, int64_t skip_rows, const std::optional<at::Tensor>& w1,
    const at::Tensor& w2, const at::Tensor& coords, const at::Tensor& pred, const at::Tensor& hidden,
    const at::Tensor& weights, double /*scale*/, bool has_b1, bool has_b2) {
  check_backward_args(grad, pos, skip_rows, w1, w2, coords, pred, hidden, weights);
  const auto grad_b2 = has_b2 ? at::empty_symint({c10::SymInt(2)}, w2.options()) : no_gradient(w2);
  if (!present(w1)) {
    return {at::empty_symint(pos.sym_sizes(), pos.options()), no_gradient(pos), no_gradient(pos),
            at::empty_symint(w2.sym_sizes(), w2.options()), grad_b2};
  }
  return {at::empty_symint(pos.sym_sizes(), pos.options()), at::empty_symint(w1->sym_sizes(), w1->options()),
          has_b1 ? at::empty_symint({w1->sym_size(0)}, w1->options()) : no_gradient(*w1),
          at::empty_symint(w2.sym_sizes(), w2.options()), grad_b2};
}

}  // namespace
}  // namespace mjp

TORCH_LIBRARY_FRAGMENT(mjp_fast, m) {
  m.def(
      "dal_loss_extension(Tensor pos, int skip_rows, Tensor? w1, Tensor? b1, Tensor w2, Tensor? b2, Tensor coords, "
      "Tensor? mask, float scale) -> (Tensor loss, Tensor pred, Tensor hidden, Tensor weights)",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "dal_loss_extension_backward(Tensor grad, Tensor pos, int skip_rows, Tensor? w1, Tensor w2, Tensor coords, "
      "Tensor pred, Tensor hidden, Tensor weights, float scale, bool has_b1, bool has_b2) -> (Tensor grad_pos, "
      "Tensor grad_w1, Tensor grad_b1, Tensor grad_w2, Tensor grad_b2)",
      {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(mjp_fast, CompositeExplicitAutograd, m) {
  m.impl("dal_loss_extension", TORCH_FN(mjp::dal_loss_forward<&mjp::DalForward::composite>));
  m.impl("dal_loss_extension_backward", TORCH_FN(mjp::dal_loss_backward<&mjp::DalBackward::composite>));
}

TORCH_LIBRARY_IMPL(mjp_fast, CPU, m) {
  m.impl("dal_loss_extension", TORCH_FN(mjp::dal_loss_forward<&mjp::DalForward::cpu_loops>));
  m.impl("dal_loss_extension_backward", TORCH_FN(mjp::dal_loss_backward<&mjp::DalBackward::cpu_loops>));
}

#ifdef MJP_WITH_CUDA
TORCH_LIBRARY_IMPL(mjp_fast, CUDA, m) {
  m.impl("dal_loss_extension", TORCH_FN(mjp::dal_loss_forward<&mjp::DalForward::cuda_kernels>));
  m.impl("dal_loss_extension_backward", TORCH_FN(mjp::dal_loss_backward<&mjp::DalBackward::cuda_kernels>));
}
#endif

TORCH_LIBRARY_IMPL(mjp_fast, Meta, m) {
  m.impl("dal_loss_extension", TORCH_FN(mjp::dal_loss_forward_meta));
  m.impl("dal_loss_extension_backward", TORCH_FN(mjp::dal_loss_backward_meta));
}
