// The MJP position term on tokens that are already embedded, as two dispatcher operators with CPU kernels (and Meta
// kernels, so FakeTensor and torch.compile see their shapes):
//
//   torch.ops.mjp_fast.pos_embed_extension(tokens, perm, mask, pos_embed, unk_embed) -> out
//     out[b, n, :] = tokens[b, perm[b, n], :] + (unk_embed if mask[b, n] else pos_embed[n])
//   torch.ops.mjp_fast.pos_embed_extension_backward(grad_out, perm, mask, tokens_dtype, pos_dtype, unk_dtype)
//     -> (grad_tokens, grad_pos, grad_unk)
//
// Registered with the dispatcher from C++ (not pybind), so a call from Python is one dispatcher call with no Python
// wrapper in between. The Python layer owns the autograd (it pairs the two operators).
//
// Forward: one pass over the B * N token rows, each element added in acc_t (float; double when either side is
// double) and rounded once. Backward: one pass over the positions n; for each, the samples b in order: the gradient
// row is moved back to where perm took the token from (perm[b] is a permutation: each destination row is written
// once, no atomics) and summed into pos_embed's or unk_embed's share. Every sum runs in a fixed order whatever the
// thread count: the results are bitwise reproducible.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/bit_cast.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "ops.h"

namespace mjp {

// See the anchor in ops.h.
extern const int kPosEmbedOperators = 1;

namespace {

// Accumulation type: double when any of the dtypes involved is double, float otherwise (half and bfloat16 too).
template <typename... Ts>
using acc_of = std::conditional_t<(std::is_same_v<Ts, double> || ...), double, float>;

bool is_float_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16;
}

void check_float_dtype(const char* op, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(is_float_dtype(dtype), op, ": ", name, " must be float32, float64, float16 or bfloat16, got ", dtype);
}

// perm int64 [B, N] and mask bool [B, N] on the device of `like`. Symbolic sizes, so the Meta kernels can share it.
void check_perm_mask(const char* op, const at::Tensor& perm, const at::Tensor& mask, const c10::SymInt& batch,
                     const c10::SymInt& positions, const at::Tensor& like) {
  TORCH_CHECK(perm.scalar_type() == at::kLong, op, ": perm must be int64, got ", perm.scalar_type());
  TORCH_CHECK(mask.scalar_type() == at::kBool, op, ": mask must be bool, got ", mask.scalar_type());
  TORCH_CHECK(perm.dim() == 2 && perm.sym_size(0) == batch && perm.sym_size(1) == positions, op, ": perm must be [",
              batch, ", ", positions, "], got ", perm.sym_sizes());
  TORCH_CHECK(mask.dim() == 2 && mask.sym_size(0) == batch && mask.sym_size(1) == positions, op, ": mask must be [",
              batch, ", ", positions, "], got ", mask.sym_sizes());
  TORCH_CHECK(perm.device() == like.device() && mask.device() == like.device(), op, ": perm on ", perm.device(),
              ", mask on ", mask.device(), ", expected ", like.device());
}

void check_forward_args(const at::Tensor& tokens, const at::Tensor& perm, const at::Tensor& mask,
                        const at::Tensor& pos_embed, const at::Tensor& unk_embed) {
  constexpr const char* op = "mjp_fast::pos_embed_extension";
  TORCH_CHECK(tokens.dim() == 3, op, ": tokens must be [B, N, D], got ", tokens.sym_sizes());
  check_float_dtype(op, "tokens", tokens.scalar_type());
  check_float_dtype(op, "pos_embed", pos_embed.scalar_type());
  const auto& positions = tokens.sym_size(1);
  const auto& dim = tokens.sym_size(2);
  TORCH_CHECK(pos_embed.dim() == 2 && pos_embed.sym_size(0) == positions && pos_embed.sym_size(1) == dim, op,
              ": pos_embed must be [N, D] = [", positions, ", ", dim, "], got ", pos_embed.sym_sizes());
  TORCH_CHECK(unk_embed.dim() == 1 && unk_embed.sym_size(0) == dim, op, ": unk_embed must be [D] = [", dim,
              "], got ", unk_embed.sym_sizes());
  TORCH_CHECK(unk_embed.scalar_type() == pos_embed.scalar_type(), op, ": unk_embed dtype ", unk_embed.scalar_type(),
              " differs from pos_embed's ", pos_embed.scalar_type(), " (the output dtype)");
  TORCH_CHECK(pos_embed.device() == tokens.device() && unk_embed.device() == tokens.device(), op, ": pos_embed on ",
              pos_embed.device(), ", unk_embed on ", unk_embed.device(), ", tokens on ", tokens.device());
  check_perm_mask(op, perm, mask, tokens.sym_size(0), positions, tokens);
}

void check_backward_args(const at::Tensor& grad_out, const at::Tensor& perm, const at::Tensor& mask,
                         at::ScalarType tokens_dtype, at::ScalarType pos_dtype, at::ScalarType unk_dtype) {
  constexpr const char* op = "mjp_fast::pos_embed_extension_backward";
  TORCH_CHECK(grad_out.dim() == 3, op, ": grad_out must be [B, N, D], got ", grad_out.sym_sizes());
  check_float_dtype(op, "grad_out", grad_out.scalar_type());
  check_float_dtype(op, "tokens_dtype", tokens_dtype);
  check_float_dtype(op, "pos_dtype", pos_dtype);
  check_float_dtype(op, "unk_dtype", unk_dtype);
  check_perm_mask(op, perm, mask, grad_out.sym_size(0), grad_out.sym_size(1), grad_out);
}

void check_cpu(const char* op, const at::Tensor& tensor) {
  TORCH_CHECK(tensor.is_cpu(), op, ": the CPU kernel got tensors on ", tensor.device());
}

// Rows per parallel task: about 32768 elements each (ATen's grain size for elementwise work).
constexpr int64_t kGrainElements = 32768;

int64_t grain(int64_t row_elements) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(row_elements, 1));
}

// float -> bfloat16 as c10::BFloat16 rounds (to nearest even; NaN to 0x7FC0), without its branch: the loops that
// store bfloat16 vectorize.
inline at::BFloat16 round_to_bfloat16(float value) {
  const uint32_t bits = c10::bit_cast<uint32_t>(value);
  const uint32_t rounded = (bits + UINT32_C(0x7FFF) + ((bits >> 16) & 1)) >> 16;
  const bool nan = (bits & UINT32_C(0x7FFFFFFF)) > UINT32_C(0x7F800000);
  return at::BFloat16(static_cast<uint16_t>(nan ? UINT32_C(0x7FC0) : rounded), at::BFloat16::from_bits());
}

// static_cast<to_t>(value), with the vectorizable float -> bfloat16 rounding.
template <typename to_t, typename from_t>
inline to_t cast_to(from_t value) {
  if constexpr (std::is_same_v<to_t, at::BFloat16> && std::is_same_v<from_t, float>) {
    return round_to_bfloat16(value);
  } else {
    return static_cast<to_t>(value);
  }
}

// The loops below are compiled for the baseline ISA the extension is built for (x86-64: SSE2) and, on x86-64 with
// GCC or Clang, once more for AVX2 + FMA, picked at run time: the drivers (forward_rows, backward_positions) are
// always inlined into two entry points with different targets. (At DeiT-Tiny's shapes, batch 32, on one core, the
// AVX2 build takes the bfloat16 forward from about 2.6x the time of torch's bfloat16 add to about 1.1x.)
#if defined(__GNUC__) && defined(__x86_64__)
#define MJP_AVX2_CLONES 1
#define MJP_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define MJP_ALWAYS_INLINE inline
#endif

// destination[d] = token[d] + term[d] in acc_t, rounded once.
template <typename acc_t, typename token_t, typename out_t>
MJP_ALWAYS_INLINE void add_row(const token_t* __restrict__ token, const out_t* __restrict__ term, int64_t dim,
                               out_t* __restrict__ destination) {
  for (int64_t d = 0; d < dim; ++d) {
    destination[d] = cast_to<out_t>(static_cast<acc_t>(token[d]) + static_cast<acc_t>(term[d]));
  }
}

// destination[0, count) = source, converted (rounded once).
template <typename to_t, typename from_t>
MJP_ALWAYS_INLINE void copy_row(const from_t* __restrict__ source, int64_t count, to_t* __restrict__ destination) {
  for (int64_t i = 0; i < count; ++i) destination[i] = cast_to<to_t>(source[i]);
}

// sum[0, count) += source, in acc_t.
template <typename acc_t, typename from_t>
MJP_ALWAYS_INLINE void accumulate_row(const from_t* __restrict__ source, int64_t count, acc_t* __restrict__ sum) {
  for (int64_t i = 0; i < count; ++i) sum[i] += static_cast<acc_t>(source[i]);
}

// destination[offset, offset + count) = source, converted to `dtype` (rounded once).
template <typename from_t>
MJP_ALWAYS_INLINE void store_as(const from_t* source, int64_t count, at::ScalarType dtype, void* destination,
                                int64_t offset) {
  switch (dtype) {
    case at::kFloat: return copy_row(source, count, static_cast<float*>(destination) + offset);
    case at::kDouble: return copy_row(source, count, static_cast<double*>(destination) + offset);
    case at::kHalf: return copy_row(source, count, static_cast<at::Half*>(destination) + offset);
    case at::kBFloat16: return copy_row(source, count, static_cast<at::BFloat16*>(destination) + offset);
    default: TORCH_CHECK(false, "mjp_fast::pos_embed_extension_backward: unexpected dtype ", dtype);
  }
}

// The forward's data: tokens [B, N, D], perm, mask [B, N], pos [N, D], unk [D], out [B, N, D], all contiguous.
template <typename token_t, typename out_t>
struct ForwardData {
  const token_t* tokens;
  const int64_t* perm;
  const bool* mask;
  const out_t* pos;
  const out_t* unk;
  out_t* out;
  int64_t positions, dim;
};

// out rows [row_begin, row_end) of [B * N, D]. Returns false if a perm entry was out of range (its row is zeroed).
template <typename token_t, typename out_t>
MJP_ALWAYS_INLINE bool forward_rows(const ForwardData<token_t, out_t>& data, int64_t row_begin, int64_t row_end) {
  const int64_t positions = data.positions, dim = data.dim;
  bool valid = true;
  for (int64_t row = row_begin; row < row_end; ++row) {
    const int64_t b = row / positions, n = row - b * positions;
    const int64_t source = data.perm[row];
    out_t* destination = data.out + row * dim;
    if (source < 0 || source >= positions) {
      std::fill(destination, destination + dim, out_t(0));
      valid = false;
      continue;
    }
    const out_t* term = data.mask[row] ? data.unk : data.pos + n * dim;
    add_row<acc_of<token_t, out_t>>(data.tokens + (b * positions + source) * dim, term, dim, destination);
  }
  return valid;
}

// The backward's data: grad [B, N, D], perm, mask [B, N] contiguous; grad_tokens [B, N, D] and grad_pos [N, D] in
// their dtypes; unk_partial [N, D] in acc_t.
template <typename grad_t, typename acc_t>
struct BackwardData {
  const grad_t* grad;
  const int64_t* perm;
  const bool* mask;
  at::ScalarType tokens_dtype, pos_dtype;
  void* grad_tokens;
  void* grad_pos;
  acc_t* unk_partial;
  int64_t batch, positions, dim;
};

// For positions [n_begin, n_end): grad_tokens[b, perm[b, n]] = grad[b, n] for every b, grad_pos[n] = the sum over the
// unmasked b, unk_partial[n] = the sum over the masked b (in acc_t, summed over n afterwards). pos_sum: [D] scratch.
template <typename grad_t, typename acc_t>
MJP_ALWAYS_INLINE void backward_positions(const BackwardData<grad_t, acc_t>& data, int64_t n_begin, int64_t n_end,
                                          acc_t* pos_sum) {
  const int64_t positions = data.positions, dim = data.dim;
  for (int64_t n = n_begin; n < n_end; ++n) {
    acc_t* unk_sum = data.unk_partial + n * dim;
    std::fill(pos_sum, pos_sum + dim, acc_t(0));
    std::fill(unk_sum, unk_sum + dim, acc_t(0));
    for (int64_t b = 0; b < data.batch; ++b) {
      const int64_t row = b * positions + n;
      const grad_t* in = data.grad + row * dim;
      store_as(in, dim, data.tokens_dtype, data.grad_tokens, (b * positions + data.perm[row]) * dim);
      accumulate_row(in, dim, data.mask[row] ? unk_sum : pos_sum);
    }
    store_as(pos_sum, dim, data.pos_dtype, data.grad_pos, n * dim);
  }
}

// The two builds of the drivers, and the run-time choice.
template <typename token_t, typename out_t>
bool forward_rows_baseline(const ForwardData<token_t, out_t>& data, int64_t row_begin, int64_t row_end) {
  return forward_rows(data, row_begin, row_end);
}
template <typename grad_t, typename acc_t>
void backward_positions_baseline(const BackwardData<grad_t, acc_t>& data, int64_t n_begin, int64_t n_end,
                                 acc_t* pos_sum) {
  backward_positions(data, n_begin, n_end, pos_sum);
}
#ifdef MJP_AVX2_CLONES
template <typename token_t, typename out_t>
__attribute__((target("avx2,fma"))) bool forward_rows_avx2(const ForwardData<token_t, out_t>& data, int64_t row_begin,
                                                           int64_t row_end) {
  return forward_rows(data, row_begin, row_end);
}
template <typename grad_t, typename acc_t>
__attribute__((target("avx2,fma"))) void backward_positions_avx2(const BackwardData<grad_t, acc_t>& data,
                                                                 int64_t n_begin, int64_t n_end, acc_t* pos_sum) {
  backward_positions(data, n_begin, n_end, pos_sum);
}
#endif

bool use_avx2() {
#ifdef MJP_AVX2_CLONES
  static const bool supported = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return supported;
#else
  return false;
#endif
}

// Whether every perm[b] is a permutation of 0..N-1 (the backward's scatter writes each row exactly once).
bool perm_is_permutation(const int64_t* perm, int64_t batch, int64_t positions) {
  std::atomic<bool> valid{true};
  at::parallel_for(0, batch, grain(positions), [&](int64_t b_begin, int64_t b_end) {
    std::vector<uint8_t> seen(positions);
    for (int64_t b = b_begin; b < b_end && valid.load(std::memory_order_relaxed); ++b) {
      std::fill(seen.begin(), seen.end(), uint8_t(0));
      for (int64_t n = 0; n < positions; ++n) {
        const int64_t source = perm[b * positions + n];
        if (source < 0 || source >= positions || seen[source]) {
          valid.store(false, std::memory_order_relaxed);
          break;
        }
        seen[source] = 1;
      }
    }
  });
  return valid.load();
}

at::Tensor pos_embed_forward_cpu(const at::Tensor& tokens, const at::Tensor& perm, const at::Tensor& mask,
                                 const at::Tensor& pos_embed, const at::Tensor& unk_embed) {
  constexpr const char* op = "mjp_fast::pos_embed_extension";
  check_forward_args(tokens, perm, mask, pos_embed, unk_embed);
  for (const auto* tensor : {&tokens, &perm, &mask, &pos_embed, &unk_embed}) check_cpu(op, *tensor);
  const int64_t batch = tokens.size(0), positions = tokens.size(1), dim = tokens.size(2);
  // No-ops (no dispatch) for the contiguous tensors callers pass.
  const auto tokens_c = tokens.is_contiguous() ? tokens : tokens.contiguous();
  const auto perm_c = perm.is_contiguous() ? perm : perm.contiguous();
  const auto mask_c = mask.is_contiguous() ? mask : mask.contiguous();
  const auto pos_c = pos_embed.is_contiguous() ? pos_embed : pos_embed.contiguous();
  const auto unk_c = unk_embed.is_contiguous() ? unk_embed : unk_embed.contiguous();
  auto out = at::empty({batch, positions, dim}, pos_embed.options());
  std::atomic<bool> valid{true};
  MJP_DISPATCH_FLOATING_TYPES(tokens.scalar_type(), "mjp_pos_embed_forward", [&] {
    using token_t = scalar_t;
    MJP_DISPATCH_FLOATING_TYPES(pos_embed.scalar_type(), "mjp_pos_embed_forward", [&] {
      using out_t = scalar_t;
      const ForwardData<token_t, out_t> data{tokens_c.data_ptr<token_t>(), perm_c.data_ptr<int64_t>(),
                                             mask_c.data_ptr<bool>(), pos_c.data_ptr<out_t>(), unk_c.data_ptr<out_t>(),
                                             out.data_ptr<out_t>(), positions, dim};
      auto* rows = forward_rows_baseline<token_t, out_t>;
#ifdef MJP_AVX2_CLONES
      if (use_avx2()) rows = forward_rows_avx2<token_t, out_t>;
#endif
      at::parallel_for(0, batch * positions, grain(dim), [&](int64_t row_begin, int64_t row_end) {
        if (!rows(data, row_begin, row_end)) valid.store(false, std::memory_order_relaxed);
      });
    });
  });
  TORCH_CHECK(valid.load(), op, ": perm holds an entry outside [0, ", positions, ")");
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> pos_embed_backward_cpu(const at::Tensor& grad_out,
                                                                      const at::Tensor& perm, const at::Tensor& mask,
                                                                      at::ScalarType tokens_dtype,
                                                                      at::ScalarType pos_dtype,
                                                                      at::ScalarType unk_dtype) {
  constexpr const char* op = "mjp_fast::pos_embed_extension_backward";
  check_backward_args(grad_out, perm, mask, tokens_dtype, pos_dtype, unk_dtype);
  for (const auto* tensor : {&grad_out, &perm, &mask}) check_cpu(op, *tensor);
  const int64_t batch = grad_out.size(0), positions = grad_out.size(1), dim = grad_out.size(2);
  const auto grad_c = grad_out.is_contiguous() ? grad_out : grad_out.contiguous();
  const auto perm_c = perm.is_contiguous() ? perm : perm.contiguous();
  const auto mask_c = mask.is_contiguous() ? mask : mask.contiguous();
  const int64_t* perm_data = perm_c.data_ptr<int64_t>();
  TORCH_CHECK(perm_is_permutation(perm_data, batch, positions), op,
              ": every perm[b] must be a permutation of 0..", positions - 1);
  const auto options = grad_out.options();
  auto grad_tokens = at::empty({batch, positions, dim}, options.dtype(tokens_dtype));
  auto grad_pos = at::empty({positions, dim}, options.dtype(pos_dtype));
  auto grad_unk = at::empty({dim}, options.dtype(unk_dtype));
  const bool use_double =
      grad_out.scalar_type() == at::kDouble || pos_dtype == at::kDouble || unk_dtype == at::kDouble;
  MJP_DISPATCH_FLOATING_TYPES(grad_out.scalar_type(), "mjp_pos_embed_backward", [&] {
    using grad_t = scalar_t;
    auto run = [&](auto acc_zero) {
      using acc_t = decltype(acc_zero);
      // unk_embed's share per position, summed over the positions below in order.
      std::vector<acc_t> unk_partial(positions * dim);
      const BackwardData<grad_t, acc_t> data{grad_c.data_ptr<grad_t>(), perm_data, mask_c.data_ptr<bool>(),
                                             tokens_dtype, pos_dtype, grad_tokens.data_ptr(), grad_pos.data_ptr(),
                                             unk_partial.data(), batch, positions, dim};
      auto* run_positions = backward_positions_baseline<grad_t, acc_t>;
#ifdef MJP_AVX2_CLONES
      if (use_avx2()) run_positions = backward_positions_avx2<grad_t, acc_t>;
#endif
      at::parallel_for(0, positions, grain(batch * dim), [&](int64_t n_begin, int64_t n_end) {
        std::vector<acc_t> pos_sum(dim);
        run_positions(data, n_begin, n_end, pos_sum.data());
      });
      at::parallel_for(0, dim, grain(positions), [&](int64_t d_begin, int64_t d_end) {
        std::vector<acc_t> sum(d_end - d_begin, acc_t(0));
        for (int64_t n = 0; n < positions; ++n) {
          const acc_t* in = unk_partial.data() + n * dim + d_begin;
          for (int64_t d = 0; d < d_end - d_begin; ++d) sum[d] += in[d];
        }
        store_as(sum.data(), d_end - d_begin, unk_dtype, grad_unk.data_ptr(), d_begin);
      });
    };
    if (use_double) {
      run(double(0));
    } else {
      run(float(0));
    }
  });
  return {grad_tokens, grad_pos, grad_unk};
}

// ---- Meta kernels: checks and output shapes only (symbolic sizes, for torch.compile's dynamic shapes).

at::Tensor pos_embed_forward_meta(const at::Tensor& tokens, const at::Tensor& perm, const at::Tensor& mask,
                                  const at::Tensor& pos_embed, const at::Tensor& unk_embed) {
  check_forward_args(tokens, perm, mask, pos_embed, unk_embed);
  return at::empty_symint(tokens.sym_sizes(), pos_embed.options());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> pos_embed_backward_meta(const at::Tensor& grad_out,
                                                                       const at::Tensor& perm, const at::Tensor& mask,
                                                                       at::ScalarType tokens_dtype,
                                                                       at::ScalarType pos_dtype,
                                                                       at::ScalarType unk_dtype) {
  check_backward_args(grad_out, perm, mask, tokens_dtype, pos_dtype, unk_dtype);
  const auto options = grad_out.options();
  const auto& positions = grad_out.sym_size(1);
  const auto& dim = grad_out.sym_size(2);
  return {at::empty_symint(grad_out.sym_sizes(), options.dtype(tokens_dtype)),
          at::empty_symint({positions, dim}, options.dtype(pos_dtype)),
          at::empty_symint({dim}, options.dtype(unk_dtype))};
}

}  // namespace
}  // namespace mjp

TORCH_LIBRARY_FRAGMENT(mjp_fast, m) {
  m.def("pos_embed_extension(Tensor tokens, Tensor perm, Tensor mask, Tensor pos_embed, Tensor unk_embed) -> Tensor",
        {at::Tag::pt2_compliant_tag});
  m.def(
      "pos_embed_extension_backward(Tensor grad_out, Tensor perm, Tensor mask, ScalarType tokens_dtype, "
      "ScalarType pos_dtype, ScalarType unk_dtype) -> (Tensor, Tensor, Tensor)",
      {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(mjp_fast, CPU, m) {
  m.impl("pos_embed_extension", TORCH_FN(mjp::pos_embed_forward_cpu));
  m.impl("pos_embed_extension_backward", TORCH_FN(mjp::pos_embed_backward_cpu));
}

TORCH_LIBRARY_IMPL(mjp_fast, Meta, m) {
  m.impl("pos_embed_extension", TORCH_FN(mjp::pos_embed_forward_meta));
  m.impl("pos_embed_extension_backward", TORCH_FN(mjp::pos_embed_backward_meta));
}
