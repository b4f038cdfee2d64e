// The differentiable forms of the extension's position-step and DAL operators, with their autograd in C++:
//
//   torch.ops.mjp_fast.pos_embed_extension_autograd(tokens, perm, mask, pos_embed, unk_embed, prefix,
//                                                   prefix_positions) -> out
//     pos_embed_extension's forward (pos_embed_cpu.cpp), differentiable in tokens, pos_embed, unk_embed and prefix:
//     its backward is pos_embed_extension_backward.
//   torch.ops.mjp_fast.dal_loss_extension_autograd(pos, skip_rows, w1, b1, w2, b2, coords, mask, scale) -> loss
//     dal_loss_extension's loss (dal_loss.cpp), differentiable in pos, w1, b1, w2 and b2: its backward is
//     dal_loss_extension_backward, fed with the forward's saved pred, hidden and weights.
//
// Why C++: these two run in every training step of an MJP ViT on the CPU backend, and at small sizes the step is
// all host time. A Python torch.autograd.Function costs a Python call into its forward, another into its backward
// and the context's bookkeeping on each; a torch::autograd::Function registered as the operator's Autograd kernel
// costs one dispatcher call forward and none of Python's backward: the engine runs the node in C++.
//
// Each operator also has a CompositeExplicitAutograd kernel (the forward operator alone), which is what runs where
// autograd is off (inference mode) and what FakeTensor and torch.compile see below the Autograd key: they trace the
// inner operators, whose Meta kernels give the shapes. Both forms live in this one file because the autograd headers
// are heavy and this is the only translation unit that includes them (compile time on small CI machines).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <tuple>

#include "ops.h"

namespace mjp {

// See the anchor in ops.h.
extern const int kAutogradOperators = 1;

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The inner operators, looked up once (on first use: static registration order across files is not defined).
const auto& pos_embed_forward_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mjp_fast::pos_embed_extension", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const std::optional<at::Tensor>&, int64_t)>();
  return op;
}

const auto& pos_embed_backward_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mjp_fast::pos_embed_extension_backward", "")
          .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t, c10::SymIntArrayRef,
              c10::SymIntArrayRef, at::ScalarType, at::ScalarType, at::ScalarType, at::ScalarType)>();
  return op;
}

const auto& dal_forward_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mjp_fast::dal_loss_extension", "")
          .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
              const at::Tensor&, int64_t, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
              const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
              const std::optional<at::Tensor>&, double)>();
  return op;
}

const auto& dal_backward_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mjp_fast::dal_loss_extension_backward", "")
          .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, int64_t, const std::optional<at::Tensor>&, const at::Tensor&,
              const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double, bool, bool)>();
  return op;
}

int64_t dtype_code(at::ScalarType dtype) { return static_cast<int64_t>(dtype); }

// ---- What each backward needs, saved by its forward, and the gradients it computes from it (shared by the nodes)

// The position step: what gives each gradient its input's shape and dtype (no tensor kept for it).
void save_position_layout(AutogradContext* ctx, const at::Tensor& tokens, const at::Tensor& pos_embed,
                          const at::Tensor& unk_embed, const std::optional<at::Tensor>& prefix,
                          int64_t prefix_positions) {
  const bool has_prefix = present(prefix);
  const auto& dim = tokens.sym_size(2);
  auto& saved = ctx->saved_data;
  saved["prefix_count"] = has_prefix ? (prefix->sym_numel() / dim).guard_int(__FILE__, __LINE__) : int64_t{0};
  saved["prefix_positions"] = prefix_positions;
  // Shapes as IValues: an int list, or a SymInt list under torch.compile's dynamic shapes.
  saved["pos_shape"] = c10::IValue(pos_embed.sym_sizes());
  saved["prefix_shape"] = has_prefix ? c10::IValue(prefix->sym_sizes()) : c10::IValue(std::vector<int64_t>{0});
  saved["dtypes"] = c10::List<int64_t>({dtype_code(tokens.scalar_type()), dtype_code(pos_embed.scalar_type()),
                                        dtype_code(unk_embed.scalar_type()),
                                        dtype_code(has_prefix ? prefix->scalar_type() : pos_embed.scalar_type())});
}

// {grad_tokens, grad_pos, grad_unk, grad_prefix} of the position step (grad_prefix undefined without a prefix).
std::array<at::Tensor, 4> position_gradients(AutogradContext* ctx, const at::Tensor& grad, const at::Tensor& perm,
                                             const at::Tensor& mask) {
  const auto& saved = ctx->saved_data;
  const int64_t prefix_count = saved.at("prefix_count").toInt();
  const auto dtypes = saved.at("dtypes").toIntList();
  auto [grad_tokens, grad_pos, grad_unk, grad_prefix] = pos_embed_backward_op().call(
      grad.is_contiguous() ? grad : grad.contiguous(), perm, mask, prefix_count, saved.at("prefix_positions").toInt(),
      saved.at("pos_shape").toSymIntVector(), saved.at("prefix_shape").toSymIntVector(),
      static_cast<at::ScalarType>(dtypes.get(0)), static_cast<at::ScalarType>(dtypes.get(1)),
      static_cast<at::ScalarType>(dtypes.get(2)), static_cast<at::ScalarType>(dtypes.get(3)));
  return {grad_tokens, grad_pos, grad_unk, prefix_count > 0 ? grad_prefix : at::Tensor()};
}

// The DAL loss: its settings (its tensors go into the node's own save_for_backward list).
void save_dal_settings(AutogradContext* ctx, int64_t skip_rows, double scale, const std::optional<at::Tensor>& b1,
                       const std::optional<at::Tensor>& b2) {
  auto& saved = ctx->saved_data;
  saved["skip_rows"] = skip_rows;
  saved["scale"] = scale;
  saved["has_b1"] = present(b1);
  saved["has_b2"] = present(b2);
}

// {grad_pos, grad_w1, grad_b1, grad_w2, grad_b2} of the DAL loss, undefined for the layers that are absent. w1:
// undefined for the linear regressor (as saved).
std::array<at::Tensor, 5> dal_gradients(AutogradContext* ctx, const at::Tensor& grad, const at::Tensor& pos,
                                        const at::Tensor& w1, const at::Tensor& w2, const at::Tensor& coords,
                                        const at::Tensor& pred, const at::Tensor& hidden, const at::Tensor& weights) {
  const auto& saved = ctx->saved_data;
  const bool has_w1 = w1.defined(), has_b1 = saved.at("has_b1").toBool(), has_b2 = saved.at("has_b2").toBool();
  auto [grad_pos, grad_w1, grad_b1, grad_w2, grad_b2] = dal_backward_op().call(
      grad, pos, saved.at("skip_rows").toInt(), has_w1 ? std::optional<at::Tensor>(w1) : std::nullopt, w2, coords,
      pred, hidden, weights, saved.at("scale").toDouble(), has_b1, has_b2);
  // The absent layers' empty [0] gradients become none.
  return {grad_pos, has_w1 ? grad_w1 : at::Tensor(), has_b1 ? grad_b1 : at::Tensor(), grad_w2,
          has_b2 ? grad_b2 : at::Tensor()};
}

// ---- The position step

class PosEmbedFunction : public torch::autograd::Function<PosEmbedFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& tokens, const at::Tensor& perm,
                            const at::Tensor& mask, const at::Tensor& pos_embed, const at::Tensor& unk_embed,
                            const std::optional<at::Tensor>& prefix, int64_t prefix_positions) {
    auto out = pos_embed_forward_op().call(tokens, perm, mask, pos_embed, unk_embed, prefix, prefix_positions);
    ctx->save_for_backward({perm, mask});
    save_position_layout(ctx, tokens, pos_embed, unk_embed, prefix, prefix_positions);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto s = ctx->get_saved_variables();
    const auto [grad_tokens, grad_pos, grad_unk, grad_prefix] = position_gradients(ctx, grad_outputs[0], s[0], s[1]);
    // One entry per forward argument: perm, mask and the int get none.
    return {grad_tokens, at::Tensor(), at::Tensor(), grad_pos, grad_unk, grad_prefix, at::Tensor()};
  }
};

at::Tensor pos_embed_autograd(const at::Tensor& tokens, const at::Tensor& perm, const at::Tensor& mask,
                              const at::Tensor& pos_embed, const at::Tensor& unk_embed,
                              const std::optional<at::Tensor>& prefix, int64_t prefix_positions) {
  return PosEmbedFunction::apply(tokens, perm, mask, pos_embed, unk_embed, prefix, prefix_positions);
}

at::Tensor pos_embed_no_autograd(const at::Tensor& tokens, const at::Tensor& perm, const at::Tensor& mask,
                                 const at::Tensor& pos_embed, const at::Tensor& unk_embed,
                                 const std::optional<at::Tensor>& prefix, int64_t prefix_positions) {
  return pos_embed_forward_op().call(tokens, perm, mask, pos_embed, unk_embed, prefix, prefix_positions);
}

// ---- The DAL loss

class DalLossFunction : public torch::autograd::Function<DalLossFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& pos, int64_t skip_rows,
                            const std::optional<at::Tensor>& w1, const std::optional<at::Tensor>& b1,
                            const at::Tensor& w2, const std::optional<at::Tensor>& b2, const at::Tensor& coords,
                            const std::optional<at::Tensor>& mask, double scale) {
    auto [loss, pred, hidden, weights] = dal_forward_op().call(pos, skip_rows, w1, b1, w2, b2, coords, mask, scale);
    // An absent w1 is saved as an undefined tensor (the linear regressor).
    ctx->save_for_backward({pos, present(w1) ? *w1 : at::Tensor(), w2, coords, pred, hidden, weights});
    save_dal_settings(ctx, skip_rows, scale, b1, b2);
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto s = ctx->get_saved_variables();
    const auto [grad_pos, grad_w1, grad_b1, grad_w2, grad_b2] =
        dal_gradients(ctx, grad_outputs[0], s[0], s[1], s[2], s[3], s[4], s[5], s[6]);
    // One entry per forward argument; the non-tensors get none.
    return {grad_pos, at::Tensor(), grad_w1,      grad_b1,      grad_w2,
            grad_b2,  at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor dal_loss_autograd(const at::Tensor& pos, int64_t skip_rows, const std::optional<at::Tensor>& w1,
                             const std::optional<at::Tensor>& b1, const at::Tensor& w2,
                             const std::optional<at::Tensor>& b2, const at::Tensor& coords,
                             const std::optional<at::Tensor>& mask, double scale) {
  return DalLossFunction::apply(pos, skip_rows, w1, b1, w2, b2, coords, mask, scale);
}

at::Tensor dal_loss_no_autograd(const at::Tensor& pos, int64_t skip_rows, const std::optional<at::Tensor>& w1,
                                const std::optional<at::Tensor>& b1, const at::Tensor& w2,
                                const std::optional<at::Tensor>& b2, const at::Tensor& coords,
                                const std::optional<at::Tensor>& mask, double scale) {
  return std::get<0>(dal_forward_op().call(pos, skip_rows, w1, b1, w2, b2, coords, mask, scale));
}

// ---- The position step and the DAL loss of one training step, as one node

// The two above in one operator: a training step of an MJP ViT on the CPU backend computes both from the same table,
// so one call from Python and one autograd node serve both (the position table's two gradients are summed here).
class MjpStepFunction : public torch::autograd::Function<MjpStepFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& tokens, const at::Tensor& perm,
                               const at::Tensor& mask, const at::Tensor& pos_embed, const at::Tensor& unk_embed,
                               const std::optional<at::Tensor>& prefix, int64_t prefix_positions,
                               const std::optional<at::Tensor>& w1, const std::optional<at::Tensor>& b1,
                               const at::Tensor& w2, const std::optional<at::Tensor>& b2, const at::Tensor& coords,
                               const std::optional<at::Tensor>& dal_mask, double scale) {
    auto out = pos_embed_forward_op().call(tokens, perm, mask, pos_embed, unk_embed, prefix, prefix_positions);
    save_position_layout(ctx, tokens, pos_embed, unk_embed, prefix, prefix_positions);
    auto [loss, pred, hidden, weights] =
        dal_forward_op().call(pos_embed, prefix_positions, w1, b1, w2, b2, coords, dal_mask, scale);
    ctx->save_for_backward(
        {perm, mask, pos_embed, present(w1) ? *w1 : at::Tensor(), w2, coords, pred, hidden, weights});
    save_dal_settings(ctx, prefix_positions, scale, b1, b2);
    // Gradients that never come are not made up as zeros: either output may go unused (DAL's weight 0).
    ctx->set_materialize_grads(false);
    return {out, loss};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto s = ctx->get_saved_variables();
    std::array<at::Tensor, 4> position{};  // tokens, pos, unk, prefix
    std::array<at::Tensor, 5> dal{};       // pos, w1, b1, w2, b2
    if (grad_outputs[0].defined()) position = position_gradients(ctx, grad_outputs[0], s[0], s[1]);
    if (grad_outputs[1].defined()) dal = dal_gradients(ctx, grad_outputs[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8]);
    // The table's two gradients, summed into the position step's (a fresh tensor of the same shape and dtype).
    auto grad_pos = position[1];
    if (dal[0].defined()) grad_pos = grad_pos.defined() ? grad_pos.add_(dal[0]) : dal[0];
    // One entry per forward argument: perm, mask, the ints, coords, dal_mask and scale get none.
    return {position[0], at::Tensor(), at::Tensor(), grad_pos,     position[2],  position[3], at::Tensor(),
            dal[1],      dal[2],       dal[3],       dal[4],       at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> mjp_step_autograd(
    const at::Tensor& tokens, const at::Tensor& perm, const at::Tensor& mask, const at::Tensor& pos_embed,
    const at::Tensor& unk_embed, const std::optional<at::Tensor>& prefix, int64_t prefix_positions,
    const std::optional<at::Tensor>& w1, const std::optional<at::Tensor>& b1, const at::Tensor& w2,
    const std::optional<at::Tensor>& b2, const at::Tensor& coords, const std::optional<at::Tensor>& dal_mask,
    double scale) {
  auto outputs = MjpStepFunction::apply(tokens, perm, mask, pos_embed, unk_embed, prefix, prefix_positions, w1, b1,
                                        w2, b2, coords, dal_mask, scale);
  return {outputs[0], outputs[1]};
}

std::tuple<at::Tensor, at::Tensor> mjp_step_no_autograd(
    const at::Tensor& tokens, const at::Tensor& perm, const at::Tensor& mask, const at::Tensor& pos_embed,
    const at::Tensor& unk_embed, const std::optional<at::Tensor>& prefix, int64_t prefix_positions,
    const std::optional<at::Tensor>& w1, const std::optional<at::Tensor>& b1, const at::Tensor& w2,
    const std::optional<at::Tensor>& b2, const at::Tensor& coords, const std::optional<at::Tensor>& dal_mask,
    double scale) {
  return {pos_embed_no_autograd(tokens, perm, mask, pos_embed, unk_embed, prefix, prefix_positions),
          dal_loss_no_autograd(pos_embed, prefix_positions, w1, b1, w2, b2, coords, dal_mask, scale)};
}

}  // namespace
}  // namespace mjp

TORCH_LIBRARY_FRAGMENT(mjp_fast, m) {
  m.def(
      "pos_embed_extension_autograd(Tensor tokens, Tensor perm, Tensor mask, Tensor pos_embed, Tensor unk_embed, "
      "Tensor? prefix, int prefix_positions) -> Tensor",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "dal_loss_extension_autograd(Tensor pos, int skip_rows, Tensor? w1, Tensor? b1, Tensor w2, Tensor? b2, "
      "Tensor coords, Tensor? mask, float scale) -> Tensor",
      {at::Tag::pt2_compliant_tag});
  m.def(
      "mjp_step_extension_autograd(Tensor tokens, Tensor perm, Tensor mask, Tensor pos_embed, Tensor unk_embed, "
      "Tensor? prefix, int prefix_positions, Tensor? w1, Tensor? b1, Tensor w2, Tensor? b2, Tensor coords, "
      "Tensor? dal_mask, float scale) -> (Tensor out, Tensor dal_loss)",
      {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(mjp_fast, Autograd, m) {
  m.impl("pos_embed_extension_autograd", TORCH_FN(mjp::pos_embed_autograd));
  m.impl("dal_loss_extension_autograd", TORCH_FN(mjp::dal_loss_autograd));
  m.impl("mjp_step_extension_autograd", TORCH_FN(mjp::mjp_step_autograd));
}

TORCH_LIBRARY_IMPL(mjp_fast, CompositeExplicitAutograd, m) {
  m.impl("pos_embed_extension_autograd", TORCH_FN(mjp::pos_embed_no_autograd));
  m.impl("dal_loss_extension_autograd", TORCH_FN(mjp::dal_loss_no_autograd));
  m.impl("mjp_step_extension_autograd", TORCH_FN(mjp::mjp_step_no_autograd));
}
