// The MJP position term on tokens that are already embedded, written together with the prefix (class and register)
// tokens in front, as two dispatcher operators with CPU kernels, CUDA kernels when compiled (pos_embed_cuda.cu) and
// Meta kernels (so FakeTensor and torch.compile see their shapes):
//
//   torch.ops.mjp_fast.pos_embed_extension(tokens, perm, mask, pos_embed, unk_embed, prefix, prefix_positions) -> out
//     out [B, P + N, D], P = prefix.numel() / D (0 without a prefix), Q = prefix_positions (0 or P), pos_embed the
//     model's whole table (last two dims [Q + N, D]):
//     out[b, t, :]     = prefix[t] + (pos_embed[t] if t < Q else 0)                          t < P
//     out[b, P + n, :] = tokens[b, perm[b, n], :] + (unk_embed if mask[b, n] else pos_embed[Q + n])
//   torch.ops.mjp_fast.pos_embed_extension_backward(grad_out, perm, mask, prefix_count, prefix_positions, pos_shape,
//                                                   prefix_shape, tokens_dtype, pos_dtype, unk_dtype, prefix_dtype)
//     -> (grad_tokens, grad_pos, grad_unk, grad_prefix)
//     grad_pos in pos_shape, grad_prefix in prefix_shape (an empty [0] tensor when prefix_count is 0: prefix_shape is
//     then ignored, prefix_dtype only checked): the shapes and dtypes of the inputs, so the caller reshapes
//     nothing. The shapes are SymInt[], so torch.compile keeps them symbolic (int[] would specialise on N).
//
// Registered with the dispatcher from C++ (not pybind), so a call from Python is one dispatcher call with no Python
// wrapper in between. The Python layer owns the autograd (it pairs the two operators).
//
// Forward: one pass over the B * N token rows, each element added in acc_t (float; double when either side is
// double) and rounded once; the P prefix rows are computed once and copied to every sample. Backward: one pass over
// the positions n; for each, the samples b in order: the gradient row is moved back to where perm took the token
// from (perm[b] is a permutation: each destination row is written once, no atomics) and summed into pos_embed's or
// unk_embed's share; the prefix rows are summed over b in order. Every sum runs in a fixed order whatever the thread
// count: the results are bitwise reproducible.
//
// A perm that is not a valid jigsaw's (only with validate=False: mjp_fast/_validate.py says what it promises): an
// entry outside [0, N) moves a zero token (its row is the position term alone) and sends no gradient back; when some
// perm[b] is not a permutation, the tokens' gradient is the exact one of the gather (a token row gets the sum of the
// gradients of the rows that show it, zeros if none), made by a second, serial pass.
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/ops/empty.h>
#include <c10/util/bit_cast.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "row_layout.h"

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

// Returns P.
c10::SymInt check_forward_args(const at::Tensor& tokens, const at::Tensor& perm, const at::Tensor& mask,
                               const at::Tensor& pos_embed, const at::Tensor& unk_embed,
                               const std::optional<at::Tensor>& prefix, int64_t prefix_positions) {
  constexpr const char* op = "mjp_fast::pos_embed_extension";
  TORCH_CHECK(tokens.dim() == 3, op, ": tokens must be [B, N, D], got ", tokens.sym_sizes());
  check_float_dtype(op, "tokens", tokens.scalar_type());
  check_float_dtype(op, "pos_embed", pos_embed.scalar_type());
  const auto& positions = tokens.sym_size(1);
  const auto& dim = tokens.sym_size(2);
  if (prefix.has_value() && prefix->defined()) check_float_dtype(op, "prefix", prefix->scalar_type());
  const c10::SymInt prefix_rows = prefix_rows_of(op, prefix, dim, tokens, "tokens");
  check_prefix_positions(op, prefix_positions, prefix_rows);
  check_table_shape(op, "pos_embed", pos_embed.sym_sizes(), positions + prefix_positions, dim);
  TORCH_CHECK(unk_embed.dim() == 1 && unk_embed.sym_size(0) == dim, op, ": unk_embed must be [D] = [", dim,
              "], got ", unk_embed.sym_sizes());
  TORCH_CHECK(unk_embed.scalar_type() == pos_embed.scalar_type(), op, ": unk_embed dtype ", unk_embed.scalar_type(),
              " differs from pos_embed's ", pos_embed.scalar_type(), " (the output dtype)");
  TORCH_CHECK(pos_embed.device() == tokens.device() && unk_embed.device() == tokens.device(), op, ": pos_embed on ",
              pos_embed.device(), ", unk_embed on ", unk_embed.device(), ", tokens on ", tokens.device());
  check_perm_mask(op, perm, mask, tokens.sym_size(0), positions, tokens);
  return prefix_rows;
}

// Returns N.
c10::SymInt check_backward_args(const at::Tensor& grad_out, const at::Tensor& perm, const at::Tensor& mask,
                                int64_t prefix_count, int64_t prefix_positions, c10::SymIntArrayRef pos_shape,
                                c10::SymIntArrayRef prefix_shape, at::ScalarType tokens_dtype,
                                at::ScalarType pos_dtype, at::ScalarType unk_dtype, at::ScalarType prefix_dtype) {
  constexpr const char* op = "mjp_fast::pos_embed_extension_backward";
  TORCH_CHECK(grad_out.dim() == 3, op, ": grad_out must be [B, P + N, D], got ", grad_out.sym_sizes());
  check_float_dtype(op, "grad_out", grad_out.scalar_type());
  check_float_dtype(op, "tokens_dtype", tokens_dtype);
  check_float_dtype(op, "pos_dtype", pos_dtype);
  check_float_dtype(op, "unk_dtype", unk_dtype);
  check_float_dtype(op, "prefix_dtype", prefix_dtype);
  TORCH_CHECK(prefix_count >= 0, op, ": prefix_count must be >= 0, got ", prefix_count);
  check_prefix_positions(op, prefix_positions, prefix_count);
  TORCH_CHECK(perm.dim() == 2, op, ": perm must be [B, N], got ", perm.sym_sizes());
  const c10::SymInt positions = perm.sym_size(1);
  const auto& dim = grad_out.sym_size(2);
  TORCH_CHECK(grad_out.sym_size(1) == positions + prefix_count, op, ": grad_out must be [B, P + N, D] with P = ",
              prefix_count, " and N = ", positions, " (perm's), got ", grad_out.sym_sizes());
  check_table_shape(op, "pos_shape", pos_shape, positions + prefix_positions, dim);
  if (prefix_count > 0) {
    c10::SymInt numel = 1;
    for (const auto& size : prefix_shape) numel = numel * size;
    TORCH_CHECK(numel == dim * prefix_count, op, ": prefix_shape must hold P * D = ", prefix_count, " * ", dim,
                " elements, got ", prefix_shape);
  }
  check_perm_mask(op, perm, mask, grad_out.sym_size(0), positions, grad_out);
  return positions;
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

// The forward's data: tokens [B, N, D], perm, mask [B, N], pos [N, D] (the table's patch rows), unk [D], all
// contiguous; out [B, prefix_rows + N, D], whose patch rows this writes.
template <typename token_t, typename out_t>
struct ForwardData {
  const token_t* tokens;
  const int64_t* perm;
  const bool* mask;
  const out_t* pos;
  const out_t* unk;
  out_t* out;
  int64_t positions, dim, prefix_rows;
};

// Token rows [row_begin, row_end) of [B * N, D], into out's patch rows. An out-of-range perm entry moves a zero
// token: its row is the position term alone.
template <typename token_t, typename out_t>
MJP_ALWAYS_INLINE void forward_rows(const ForwardData<token_t, out_t>& data, int64_t row_begin, int64_t row_end) {
  const int64_t positions = data.positions, dim = data.dim, prefix_rows = data.prefix_rows;
  for (int64_t row = row_begin; row < row_end; ++row) {
    const int64_t b = row / positions, n = row - b * positions;
    const int64_t source = data.perm[row];
    out_t* destination = data.out + (row + (b + 1) * prefix_rows) * dim;  // out[b, P + n]
    const out_t* term = data.mask[row] ? data.unk : data.pos + n * dim;
    if (source < 0 || source >= positions) {
      copy_row(term, dim, destination);
      continue;
    }
    add_row<acc_of<token_t, out_t>>(data.tokens + (b * positions + source) * dim, term, dim, destination);
  }
}

// out[0, t] = prefix[t] + (pos[t] if t < prefix_positions) for t < prefix_rows, in acc_t, rounded once. pos: the
// table's first rows.
template <typename prefix_t, typename out_t>
void prefix_block(const prefix_t* prefix, const out_t* pos, int64_t prefix_rows, int64_t prefix_positions,
                  int64_t dim, out_t* out) {
  for (int64_t t = 0; t < prefix_rows; ++t) {
    if (t < prefix_positions) {
      add_row<acc_of<prefix_t, out_t>>(prefix + t * dim, pos + t * dim, dim, out + t * dim);
    } else {
      copy_row(prefix + t * dim, dim, out + t * dim);
    }
  }
}

// The backward's data: grad [B, prefix_rows + N, D], perm, mask [B, N] contiguous; grad_tokens [B, N, D] and
// grad_pos [N, D] (the table's patch rows) in their dtypes; unk_partial [N, D] in acc_t.
template <typename grad_t, typename acc_t>
struct BackwardData {
  const grad_t* grad;
  const int64_t* perm;
  const bool* mask;
  at::ScalarType tokens_dtype, pos_dtype;
  void* grad_tokens;
  void* grad_pos;
  acc_t* unk_partial;
  int64_t batch, positions, dim, prefix_rows;
};

// For positions [n_begin, n_end): grad_tokens[b, perm[b, n]] = grad[b, P + n] for every b (grad_tokens null: not
// here, see move_back_exact), grad_pos[n] = the sum over the unmasked b, unk_partial[n] = the sum over the masked b
// (in acc_t, summed over n afterwards). pos_sum: [D] scratch.
template <typename grad_t, typename acc_t>
MJP_ALWAYS_INLINE void backward_positions(const BackwardData<grad_t, acc_t>& data, int64_t n_begin, int64_t n_end,
                                          acc_t* pos_sum) {
  const int64_t positions = data.positions, dim = data.dim, rows_per_sample = data.prefix_rows + positions;
  for (int64_t n = n_begin; n < n_end; ++n) {
    acc_t* unk_sum = data.unk_partial + n * dim;
    std::fill(pos_sum, pos_sum + dim, acc_t(0));
    std::fill(unk_sum, unk_sum + dim, acc_t(0));
    for (int64_t b = 0; b < data.batch; ++b) {
      const int64_t row = b * positions + n;
      const grad_t* in = data.grad + (b * rows_per_sample + data.prefix_rows + n) * dim;
      if (data.grad_tokens != nullptr) {
        store_as(in, dim, data.tokens_dtype, data.grad_tokens, (b * positions + data.perm[row]) * dim);
      }
      accumulate_row(in, dim, data.mask[row] ? unk_sum : pos_sum);
    }
    store_as(pos_sum, dim, data.pos_dtype, data.grad_pos, n * dim);
  }
}

// The two builds of the drivers, and the run-time choice.
template <typename token_t, typename out_t>
void forward_rows_baseline(const ForwardData<token_t, out_t>& data, int64_t row_begin, int64_t row_end) {
  forward_rows(data, row_begin, row_end);
}
template <typename grad_t, typename acc_t>
void backward_positions_baseline(const BackwardData<grad_t, acc_t>& data, int64_t n_begin, int64_t n_end,
                                 acc_t* pos_sum) {
  backward_positions(data, n_begin, n_end, pos_sum);
}
#ifdef MJP_AVX2_CLONES
template <typename token_t, typename out_t>
__attribute__((target("avx2,fma"))) void forward_rows_avx2(const ForwardData<token_t, out_t>& data, int64_t row_begin,
                                                           int64_t row_end) {
  forward_rows(data, row_begin, row_end);
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

// The tokens' gradient when some perm[b] is not a permutation: grad_tokens[b, m] = the sum over the n with
// perm[b, n] = m of grad[b, P + n], in acc_t (zeros where no n shows m; out-of-range entries add nothing). One task
// per sample, each sample's rows in order: deterministic.
template <typename grad_t, typename acc_t>
void move_back_exact(const grad_t* grad, const int64_t* perm, int64_t batch, int64_t positions, int64_t dim,
                     int64_t prefix_rows, at::ScalarType tokens_dtype, void* grad_tokens) {
  at::parallel_for(0, batch, 1, [&](int64_t b_begin, int64_t b_end) {
    std::vector<acc_t> sums(positions * dim);
    for (int64_t b = b_begin; b < b_end; ++b) {
      std::fill(sums.begin(), sums.end(), acc_t(0));
      for (int64_t n = 0; n < positions; ++n) {
        const int64_t source = perm[b * positions + n];
        if (source < 0 || source >= positions) continue;
        accumulate_row(grad + (b * (prefix_rows + positions) + prefix_rows + n) * dim, dim,
                       sums.data() + source * dim);
      }
      store_as(sums.data(), positions * dim, tokens_dtype, grad_tokens, b * positions * dim);
    }
  });
}

at::Tensor pos_embed_forward_cpu(const at::Tensor& tokens, const at::Tensor& perm, const at::Tensor& mask,
                                 const at::Tensor& pos_embed, const at::Tensor& unk_embed,
                                 const std::optional<at::Tensor>& prefix, int64_t prefix_positions) {
  constexpr const char* op = "mjp_fast::pos_embed_extension";
  const int64_t prefix_rows =
      check_forward_args(tokens, perm, mask, pos_embed, unk_embed, prefix, prefix_positions).expect_int();
  for (const auto* tensor : {&tokens, &perm, &mask, &pos_embed, &unk_embed}) check_cpu(op, *tensor);
  if (present(prefix)) check_cpu(op, *prefix);
  const int64_t batch = tokens.size(0), positions = tokens.size(1), dim = tokens.size(2);
  const int64_t rows_per_sample = prefix_rows + positions;
  // No-ops (no dispatch) for the contiguous tensors callers pass.
  const auto tokens_c = tokens.is_contiguous() ? tokens : tokens.contiguous();
  const auto perm_c = perm.is_contiguous() ? perm : perm.contiguous();
  const auto mask_c = mask.is_contiguous() ? mask : mask.contiguous();
  const auto pos_c = pos_embed.is_contiguous() ? pos_embed : pos_embed.contiguous();
  const auto unk_c = unk_embed.is_contiguous() ? unk_embed : unk_embed.contiguous();
  const auto prefix_c = prefix_rows == 0 || prefix->is_contiguous() ? prefix : prefix->contiguous();
  auto out = at::empty({batch, rows_per_sample, dim}, pos_embed.options());
  MJP_DISPATCH_FLOATING_TYPES(pos_embed.scalar_type(), "mjp_pos_embed_forward", [&] {
    using out_t = scalar_t;
    out_t* out_data = out.data_ptr<out_t>();
    const out_t* pos_data = pos_c.data_ptr<out_t>();
    if (prefix_rows > 0 && batch > 0) {
      // The prefix rows are the same in every sample: computed once into sample 0, copied to the others.
      const int64_t block = prefix_rows * dim;
      MJP_DISPATCH_FLOATING_TYPES(prefix_c->scalar_type(), "mjp_pos_embed_prefix", [&] {
        prefix_block(prefix_c->data_ptr<scalar_t>(), pos_data, prefix_rows, prefix_positions, dim, out_data);
      });
      at::parallel_for(1, batch, grain(block), [&](int64_t b_begin, int64_t b_end) {
        for (int64_t b = b_begin; b < b_end; ++b) {
          std::copy(out_data, out_data + block, out_data + b * rows_per_sample * dim);
        }
      });
    }
    MJP_DISPATCH_FLOATING_TYPES(tokens.scalar_type(), "mjp_pos_embed_forward", [&] {
      using token_t = scalar_t;
      const ForwardData<token_t, out_t> data{tokens_c.data_ptr<token_t>(),  perm_c.data_ptr<int64_t>(),
                                             mask_c.data_ptr<bool>(),       pos_data + prefix_positions * dim,
                                             unk_c.data_ptr<out_t>(),       out_data,
                                             positions,                     dim,
                                             prefix_rows};
      auto* rows = forward_rows_baseline<token_t, out_t>;
#ifdef MJP_AVX2_CLONES
      if (use_avx2()) rows = forward_rows_avx2<token_t, out_t>;
#endif
      at::parallel_for(0, batch * positions, grain(dim), [&](int64_t row_begin, int64_t row_end) {
        rows(data, row_begin, row_end);
      });
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> pos_embed_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& perm, const at::Tensor& mask, int64_t prefix_count,
    int64_t prefix_positions, at::IntArrayRef pos_shape, at::IntArrayRef prefix_shape, at::ScalarType tokens_dtype,
    at::ScalarType pos_dtype, at::ScalarType unk_dtype, at::ScalarType prefix_dtype) {
  constexpr const char* op = "mjp_fast::pos_embed_extension_backward";
  check_backward_args(grad_out, perm, mask, prefix_count, prefix_positions, c10::fromIntArrayRefSlow(pos_shape),
                      c10::fromIntArrayRefSlow(prefix_shape), tokens_dtype, pos_dtype, unk_dtype, prefix_dtype);
  for (const auto* tensor : {&grad_out, &perm, &mask}) check_cpu(op, *tensor);
  const int64_t batch = grad_out.size(0), positions = perm.size(1), dim = grad_out.size(2);
  const int64_t prefix_rows = prefix_count, rows_per_sample = prefix_rows + positions;
  const auto grad_c = grad_out.is_contiguous() ? grad_out : grad_out.contiguous();
  const auto perm_c = perm.is_contiguous() ? perm : perm.contiguous();
  const auto mask_c = mask.is_contiguous() ? mask : mask.contiguous();
  const int64_t* perm_data = perm_c.data_ptr<int64_t>();
  // The one-pass scatter below writes every row of grad_tokens once only for a permutation (a host loop over B * N
  // entries: no device to wait for on the CPU).
  const bool permutation = perm_is_permutation(perm_data, batch, positions);
  const auto options = grad_out.options();
  auto grad_tokens = at::empty({batch, positions, dim}, options.dtype(tokens_dtype));
  auto grad_pos = at::empty(pos_shape, options.dtype(pos_dtype));
  auto grad_unk = at::empty({dim}, options.dtype(unk_dtype));
  const auto prefix_options = options.dtype(prefix_dtype);
  auto grad_prefix = prefix_rows > 0 ? at::empty(prefix_shape, prefix_options) : at::empty({0}, prefix_options);
  const bool use_double = grad_out.scalar_type() == at::kDouble || pos_dtype == at::kDouble ||
                          unk_dtype == at::kDouble || prefix_dtype == at::kDouble;
  MJP_DISPATCH_FLOATING_TYPES(grad_out.scalar_type(), "mjp_pos_embed_backward", [&] {
    using grad_t = scalar_t;
    const grad_t* grad_data = grad_c.data_ptr<grad_t>();
    auto run = [&](auto acc_zero) {
      using acc_t = decltype(acc_zero);
      // unk_embed's share per position, summed over the positions below in order.
      std::vector<acc_t> unk_partial(positions * dim);
      const BackwardData<grad_t, acc_t> data{grad_data,
                                             perm_data,
                                             mask_c.data_ptr<bool>(),
                                             tokens_dtype,
                                             pos_dtype,
                                             permutation ? grad_tokens.data_ptr() : nullptr,
                                             static_cast<char*>(grad_pos.data_ptr()) +
                                                 prefix_positions * dim * grad_pos.element_size(),
                                             unk_partial.data(),
                                             batch,
                                             positions,
                                             dim,
                                             prefix_rows};
      if (!permutation) {
        move_back_exact<grad_t, acc_t>(grad_data, perm_data, batch, positions, dim, prefix_rows, tokens_dtype,
                                       grad_tokens.data_ptr());
      }
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
      // The prefix rows: grad_prefix[t] (and grad_pos[t], t < Q) = the sum over b of grad[b, t], b in order.
      at::parallel_for(0, prefix_rows, grain(batch * dim), [&](int64_t t_begin, int64_t t_end) {
        std::vector<acc_t> sum(dim);
        for (int64_t t = t_begin; t < t_end; ++t) {
          std::fill(sum.begin(), sum.end(), acc_t(0));
          for (int64_t b = 0; b < batch; ++b) accumulate_row(grad_data + (b * rows_per_sample + t) * dim, dim,
                                                             sum.data());
          store_as(sum.data(), dim, prefix_dtype, grad_prefix.data_ptr(), t * dim);
          if (t < prefix_positions) store_as(sum.data(), dim, pos_dtype, grad_pos.data_ptr(), t * dim);
        }
      });
    };
    if (use_double) {
      run(double(0));
    } else {
      run(float(0));
    }
  });
  return {grad_tokens, grad_pos, grad_unk, grad_prefix};
}

#ifdef MJP_WITH_CUDA
// ---- CUDA kernels (pos_embed_cuda.cu, through cuda_ops.cpp): the same checks, then the GPU's passes. The perm's
// validity is not checked on the host (that would wait for the GPU): the backward finds, on the device, the rows of the
// tokens' gradient that several positions or none show.

void check_cuda(const char* op, const at::Tensor& tensor, const at::Tensor& like) {
  TORCH_CHECK(tensor.is_cuda() && tensor.device() == like.device(), op, ": the CUDA kernel got tensors on ",
              tensor.device(), " and ", like.device());
}

at::Tensor pos_embed_forward_cuda_kernel(const at::Tensor& tokens, const at::Tensor& perm, const at::Tensor& mask,
                                         const at::Tensor& pos_embed, const at::Tensor& unk_embed,
                                         const std::optional<at::Tensor>& prefix, int64_t prefix_positions) {
  constexpr const char* op = "mjp_fast::pos_embed_extension";
  // at:: calls inside (a prefix rounded to the output dtype) are the implementation's: no autograd recording.
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  const int64_t prefix_rows =
      check_forward_args(tokens, perm, mask, pos_embed, unk_embed, prefix, prefix_positions).expect_int();
  for (const auto* tensor : {&tokens, &perm, &mask, &pos_embed, &unk_embed}) check_cuda(op, *tensor, tokens);
  if (prefix_rows > 0) check_cuda(op, *prefix, tokens);
  std::optional<at::Tensor> prefix_c;
  if (prefix_rows > 0) prefix_c = prefix->contiguous();
  return pos_embed_forward_cuda(tokens.contiguous(), perm.contiguous(), mask.contiguous(), pos_embed.contiguous(),
                                unk_embed.contiguous(), prefix_c, prefix_rows, prefix_positions);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> pos_embed_backward_cuda_kernel(
    const at::Tensor& grad_out, const at::Tensor& perm, const at::Tensor& mask, int64_t prefix_count,
    int64_t prefix_positions, at::IntArrayRef pos_shape, at::IntArrayRef prefix_shape, at::ScalarType tokens_dtype,
    at::ScalarType pos_dtype, at::ScalarType unk_dtype, at::ScalarType prefix_dtype) {
  constexpr const char* op = "mjp_fast::pos_embed_extension_backward";
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  check_backward_args(grad_out, perm, mask, prefix_count, prefix_positions, c10::fromIntArrayRefSlow(pos_shape),
                      c10::fromIntArrayRefSlow(prefix_shape), tokens_dtype, pos_dtype, unk_dtype, prefix_dtype);
  for (const auto* tensor : {&grad_out, &perm, &mask}) check_cuda(op, *tensor, grad_out);
  return pos_embed_backward_cuda(grad_out.contiguous(), perm.contiguous(), mask.contiguous(), prefix_count,
                                 prefix_positions, pos_shape, prefix_shape, tokens_dtype, pos_dtype, unk_dtype,
                                 prefix_dtype);
}
#endif

// ---- Meta kernels: checks and output shapes only (symbolic sizes, for torch.compile's dynamic shapes).

at::Tensor pos_embed_forward_meta(const at::Tensor& tokens, const at::Tensor& perm, const at::Tensor& mask,
                                  const at::Tensor& pos_embed, const at::Tensor& unk_embed,
                                  const std::optional<at::Tensor>& prefix, int64_t prefix_positions) {
  const c10::SymInt prefix_rows =
      check_forward_args(tokens, perm, mask, pos_embed, unk_embed, prefix, prefix_positions);
  return at::empty_symint({tokens.sym_size(0), prefix_rows + tokens.sym_size(1), tokens.sym_size(2)},
                          pos_embed.options());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> pos_embed_backward_meta(
    const at::Tensor& grad_out, const at::Tensor& perm, const at::Tensor& mask, int64_t prefix_count,
    int64_t prefix_positions, c10::SymIntArrayRef pos_shape, c10::SymIntArrayRef prefix_shape,
    at::ScalarType tokens_dtype, at::ScalarType pos_dtype, at::ScalarType unk_dtype, at::ScalarType prefix_dtype) {
  const c10::SymInt positions =
      check_backward_args(grad_out, perm, mask, prefix_count, prefix_positions, pos_shape, prefix_shape, tokens_dtype,
                          pos_dtype, unk_dtype, prefix_dtype);
  const auto options = grad_out.options();
  const auto& dim = grad_out.sym_size(2);
  return {at::empty_symint({grad_out.sym_size(0), positions, dim}, options.dtype(tokens_dtype)),
          at::empty_symint(pos_shape, options.dtype(pos_dtype)), at::empty_symint({dim}, options.dtype(unk_dtype)),
          prefix_count > 0 ? at::empty_symint(prefix_shape, options.dtype(prefix_dtype))
                           : at::empty_symint({c10::SymInt(0)}, options.dtype(prefix_dtype))};
}

}  // namespace
}  // namespace mjp

TORCH_LIBRARY_FRAGMENT(mjp_fast, m) {
  m.def(
      "pos_embed_extension(Tensor tokens, Tensor perm, Tensor mask, Tensor pos_embed, Tensor unk_embed, "
      "Tensor? prefix, int prefix_positions) -> Tensor",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "pos_embed_extension_backward(Tensor grad_out, Tensor perm, Tensor mask, int prefix_count, "
      "int prefix_positions, SymInt[] pos_shape, SymInt[] prefix_shape, ScalarType tokens_dtype, "
      "ScalarType pos_dtype, ScalarType unk_dtype, ScalarType prefix_dtype) -> (Tensor grad_tokens, Tensor grad_pos, "
      "Tensor grad_unk, Tensor grad_prefix)",
      {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(mjp_fast, CPU, m) {
  m.impl("pos_embed_extension", TORCH_FN(mjp::pos_embed_forward_cpu));
  m.impl("pos_embed_extension_backward", TORCH_FN(mjp::pos_embed_backward_cpu));
}

#ifdef MJP_WITH_CUDA
TORCH_LIBRARY_IMPL(mjp_fast, CUDA, m) {
  m.impl("pos_embed_extension", TORCH_FN(mjp::pos_embed_forward_cuda_kernel));
  m.impl("pos_embed_extension_backward", TORCH_FN(mjp::pos_embed_backward_cuda_kernel));
}
#endif

TORCH_LIBRARY_IMPL(mjp_fast, Meta, m) {
  m.impl("pos_embed_extension", TORCH_FN(mjp::pos_embed_forward_meta));
  m.impl("pos_embed_extension_backward", TORCH_FN(mjp::pos_embed_backward_meta));
}
