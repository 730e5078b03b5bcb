// Every decoder layer of the eager CPU forward in one call: torch.ops.llm_cpu.decoder_layers
// runs, layer after layer, the same kernels in the same order as the model's Python layers
// (models/blocks.py DecoderLayer, models/gemma.py SandwichLayer, on the cpu_kernels backend),
// so its results are the same bits. The pre-norm layer (Llama's):
//     h = rms_norm(x); qkv = h Wqkv; a = paged_attention(q, k, v) (rope, cache write);
//     h = a Wo; h = add_rms_norm(x += h); h = act_and_mul(h Wgate_up); x += h Wdown
// and the sandwich layer (Gemma 2's and 3's) a norm after attention and after the MLP too:
//     ...; h = rms_norm(a Wo); h = add_rms_norm(x += h); ...; x += rms_norm(h Wdown)
// Where a layer has them: per-head q/k norms between the projection and attention (Gemma
// 3's, Qwen3's: PyTorch's ops, as the Python layer runs them, head_norm), Gemma's norms
// scaling by 1 + w (the kernels' *_offset norms), the gelu-tanh MLP (gelu_tanh_and_mul), and
// each layer's own window, softcap and rope table (Gemma 2 and 3 alternate sliding and global
// layers). (act_and_mul inside the product where amx_linear runs it gated, SiLU only; the
// last add and the next layer's first norm in one add_rms_norm, the same bits as the two.)
// What it saves is the Python between them: ~10 module calls and op dispatches a layer,
// a third of a one-token decode step of a small model (stages/executor/fused.py says when
// it runs). Each product is oneDNN's packed one (mkldnn::_linear_pointwise),
// llm_cpu::amx_linear, llm_cpu::bf16_vector_linear, llm_cpu::mkl_linear,
// llm_cpu::quantized_linear or llm_cpu::amx_quantized_linear, called through the dispatcher
// as Python calls them. Built with the other kernels by kernels.py.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <string_view>
#include <vector>

namespace {

using OptTensor = std::optional<at::Tensor>;

// Per layer, the entries of `weights`: the norms before attention (kNorm1) and before the
// MLP (kNorm2), a weight and a bias (or None) per projection; then the norms a layer may have
// (None where it has not): per-head q and k norms, the sandwich layer's norms after attention
// and after the MLP.
enum Entry { kNorm1, kQkvW, kQkvB, kOW, kOB, kNorm2, kGateUpW, kGateUpB, kDownW, kDownB,
             kQNorm, kKNorm, kPostAttentionNorm, kPostMlpNorm, kEntries };
// Per projection, the entries of `ints` after the 3 shared ones: its kind, bits and outputs.
// kAmxGated, kVectorGated, kQuantizedAmxGated: a gate/up product whose amx_linear
// (bf16_vector_linear, amx_quantized_linear) writes silu(gate) * up itself.
enum Kind {
  kPacked = 0,
  kQuantized = 1,
  kAmx = 2,
  kAmxGated = 3,
  kMkl = 4,
  kVector = 5,
  kVectorGated = 6,
  kQuantizedAmx = 7,
  kQuantizedAmxGated = 8
};
constexpr int64_t kShared = 3, kPerProjection = 3, kProjections = 4;
// Per layer, the entries of `ints` after its projections': whether its norms (q/k norms too)
// scale by 1 + w (Gemma's: 1) or w (0); its MLP's activation; its attention's window (0:
// none), rope table (an index into `ropes`' (cos, sin) pairs, negative from the end) and
// KV group (an index into `block_tables`).
enum LayerInt { kOffsetNorms = kProjections * kPerProjection, kActivation, kWindow, kRope,
                kTable, kPerLayer };
enum Activation { kSilu = 0, kGeluTanh = 1 };

struct Ops {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)> rms_norm;
  c10::TypedOperatorHandle<at::Tensor(at::Tensor&, const at::Tensor&, const at::Tensor&, double)>
      add_rms_norm;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)>
      rms_norm_offset;
  c10::TypedOperatorHandle<at::Tensor(at::Tensor&, const at::Tensor&, const at::Tensor&, double)>
      add_rms_norm_offset;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, bool)> silu_and_mul;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> gelu_tanh_and_mul;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      double, int64_t, double, const OptTensor&)>
      paged_attention;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&,
                                      int64_t, int64_t)>
      quantized_linear;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&,
                                      int64_t, bool)>
      amx_linear;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&,
                                      int64_t, int64_t, bool)>
      amx_quantized_linear;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&,
                                      int64_t, bool)>
      vector_linear;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&,
                                      int64_t, int64_t)>
      mkl_linear;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&,
                                      std::string_view, c10::List<std::optional<c10::Scalar>>,
                                      std::optional<std::string_view>)>
      packed_linear;
};

const Ops& ops() {
  static const Ops found = [] {
    auto& d = c10::Dispatcher::singleton();
    return Ops{
        d.findSchemaOrThrow("llm_cpu::rms_norm", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>(),
        d.findSchemaOrThrow("llm_cpu::add_rms_norm", "")
            .typed<at::Tensor(at::Tensor&, const at::Tensor&, const at::Tensor&, double)>(),
        d.findSchemaOrThrow("llm_cpu::rms_norm_offset", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>(),
        d.findSchemaOrThrow("llm_cpu::add_rms_norm_offset", "")
            .typed<at::Tensor(at::Tensor&, const at::Tensor&, const at::Tensor&, double)>(),
        d.findSchemaOrThrow("llm_cpu::silu_and_mul", "")
            .typed<at::Tensor(const at::Tensor&, bool)>(),
        d.findSchemaOrThrow("llm_cpu::gelu_tanh_and_mul", "")
            .typed<at::Tensor(const at::Tensor&)>(),
        d.findSchemaOrThrow("llm_cpu::paged_attention", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                              int64_t, double, const OptTensor&)>(),
        d.findSchemaOrThrow("llm_cpu::quantized_linear", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t,
                              int64_t)>(),
        d.findSchemaOrThrow("llm_cpu::amx_linear", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t,
                              bool)>(),
        d.findSchemaOrThrow("llm_cpu::amx_quantized_linear", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t,
                              int64_t, bool)>(),
        d.findSchemaOrThrow("llm_cpu::bf16_vector_linear", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t,
                              bool)>(),
        d.findSchemaOrThrow("llm_cpu::mkl_linear", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t,
                              int64_t)>(),
        d.findSchemaOrThrow("mkldnn::_linear_pointwise", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&,
                              std::string_view, c10::List<std::optional<c10::Scalar>>,
                              std::optional<std::string_view>)>()};
  }();
  return found;
}

// y = x W^T + b by projection `p`'s kind (ints: kind, bits, outputs).
at::Tensor project(const at::Tensor& x, const OptTensor& weight, const OptTensor& bias,
                   const int64_t* spec) {
  TORCH_CHECK(weight.has_value(), "decoder_layers: a projection without a weight");
  if (spec[0] == kQuantized) {
    return ops().quantized_linear.call(x, *weight, bias, spec[1], spec[2]);
  }
  if (spec[0] == kMkl) {  // (bits: the thread count at which a lone row takes MKL's path)
    return ops().mkl_linear.call(x.contiguous(), *weight, bias, spec[2], spec[1]);
  }
  if (spec[0] == kAmx || spec[0] == kAmxGated) {
    return ops().amx_linear.call(x.contiguous(), *weight, bias, spec[2], spec[0] == kAmxGated);
  }
  if (spec[0] == kQuantizedAmx || spec[0] == kQuantizedAmxGated) {
    return ops().amx_quantized_linear.call(x.contiguous(), *weight, bias, spec[1], spec[2],
                                           spec[0] == kQuantizedAmxGated);
  }
  if (spec[0] == kVector || spec[0] == kVectorGated) {
    return ops().vector_linear.call(x.contiguous(), *weight, bias, spec[2],
                                    spec[0] == kVectorGated);
  }
  return ops().packed_linear.call(x.contiguous(), *weight, bias, "none",
                                  c10::List<std::optional<c10::Scalar>>(), "");
}

// The norms of a layer: its kernels' (by 1 + w where `offset`), and the norm of x += h, the
// residual add in the same pass.
struct Norms {
  bool offset;
  double eps;
  at::Tensor operator()(const at::Tensor& x, const at::Tensor& w) const {
    return offset ? ops().rms_norm_offset.call(x, w, eps) : ops().rms_norm.call(x, w, eps);
  }
  at::Tensor add(at::Tensor& x, const at::Tensor& h, const at::Tensor& w) const {
    return offset ? ops().add_rms_norm_offset.call(x, h, w, eps)
                  : ops().add_rms_norm.call(x, h, w, eps);
  }
};

// A q or k norm of each head, x [T, heads, D] (a view into the qkv projection): PyTorch's ops
// in the order the Python layer runs them (backends/base.py scale_by_rms: the attention's
// q/k norms are PyTorch's on every backend), so the same bits.
at::Tensor head_norm(const at::Tensor& x, const at::Tensor& w, double eps, bool offset) {
  const at::Tensor mean_square = x.to(at::kFloat).pow(2).mean({-1}, true);
  const at::Tensor scaled = x.to(at::kFloat).mul(mean_square.add(eps).rsqrt());
  if (offset) return scaled.mul(w.to(at::kFloat).add(1.0)).to(x.scalar_type());
  return w.mul(scaled.to(x.scalar_type()));
}

// x [T, hidden], updated in place (the residual stream, as the Python layers update it) and
// returned. ints: heads, kv_heads, head_dim, then per layer its projections' (qkv, o,
// gate_up, down) kind, bits, outputs and its LayerInts. softcaps: each layer's attention
// softcap (0: none); ropes: the (cos, sin) tables, pair after pair. kv_caches: one per layer;
// block_tables: one per KV group (the layers' kTable).
at::Tensor decoder_layers(at::Tensor& x, const c10::List<OptTensor>& weights,
                          c10::IntArrayRef ints, double eps, double scale,
                          const c10::List<at::Tensor>& kv_caches,
                          const c10::List<at::Tensor>& block_tables,
                          const at::Tensor& token_slots, const at::Tensor& positions,
                          const c10::List<at::Tensor>& ropes, c10::ArrayRef<double> softcaps) {
  const int64_t layers = static_cast<int64_t>(kv_caches.size());
  const int64_t num_ropes = static_cast<int64_t>(ropes.size()) / 2;
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kEntries,
              "decoder_layers: ", weights.size(), " weights for ", layers, " layers");
  TORCH_CHECK(static_cast<int64_t>(ints.size()) == kShared + layers * kPerLayer,
              "decoder_layers: ", ints.size(), " ints for ", layers, " layers");
  TORCH_CHECK(static_cast<int64_t>(softcaps.size()) == layers,
              "decoder_layers: ", softcaps.size(), " softcaps for ", layers, " layers");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "decoder_layers: x must be [T, hidden]");
  const int64_t tokens = x.size(0), heads = ints[0], kv_heads = ints[1], d = ints[2];
  const int64_t q_size = heads * d, kv_size = kv_heads * d;
  const Ops& op = ops();
  at::Tensor normed;  // the next layer's first norm, made by this layer's closing add
  for (int64_t l = 0; l < layers; ++l) {
    auto w = [&](int64_t entry) -> OptTensor { return weights.get(l * kEntries + entry); };
    const int64_t* spec = ints.data() + kShared + l * kPerLayer;
    const Norms norm{spec[kOffsetNorms] != 0, eps};
    const int64_t rope = spec[kRope] < 0 ? spec[kRope] + num_ropes : spec[kRope];
    TORCH_CHECK(rope >= 0 && rope < num_ropes, "decoder_layers: layer ", l, "'s rope table ",
                spec[kRope], " of ", num_ropes);
    TORCH_CHECK(spec[kTable] >= 0 && spec[kTable] < static_cast<int64_t>(block_tables.size()),
                "decoder_layers: layer ", l, "'s block table ", spec[kTable], " of ",
                block_tables.size());
    // Past the first layer, the previous one's residual add made this norm in the same pass
    // (add_rms_norm: x += h rounded as x + h, then the norm of x).
    at::Tensor h = l == 0 ? norm(x, *w(kNorm1)) : normed;
    const at::Tensor qkv = project(h, w(kQkvW), w(kQkvB), spec);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, heads, d});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, kv_heads, d});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, kv_heads, d});
    if (w(kQNorm).has_value()) {
      q = head_norm(q, *w(kQNorm), eps, norm.offset);
      k = head_norm(k, *w(kKNorm), eps, norm.offset);
    }
    at::Tensor cache = kv_caches.get(l);
    const at::Tensor a = op.paged_attention.call(
        q, k, v, cache, block_tables.get(spec[kTable]), token_slots, positions,
        ropes.get(2 * rope),
        ropes.get(2 * rope + 1), scale, spec[kWindow], softcaps[l],
        std::nullopt);  // (no sinks: fused.py)
    h = project(a.view({tokens, q_size}), w(kOW), w(kOB), spec + kPerProjection);
    if (w(kPostAttentionNorm).has_value()) h = norm(h, *w(kPostAttentionNorm));
    h = norm.add(x, h, *w(kNorm2));  // x += h
    const int64_t* gate_up = spec + 2 * kPerProjection;
    h = project(h, w(kGateUpW), w(kGateUpB), gate_up);
    if (gate_up[0] != kAmxGated && gate_up[0] != kVectorGated &&
        gate_up[0] != kQuantizedAmxGated) {
      h = spec[kActivation] == kGeluTanh ? op.gelu_tanh_and_mul.call(h)
                                         : op.silu_and_mul.call(h, false);
    }
    h = project(h, w(kDownW), w(kDownB), spec + 3 * kPerProjection);
    if (w(kPostMlpNorm).has_value()) h = norm(h, *w(kPostMlpNorm));
    if (l + 1 < layers) {  // (the next layer's norms scale as this one's: fused.py)
      normed = norm.add(x, h, *weights.get((l + 1) * kEntries + kNorm1));
    } else {
      x.add_(h);
    }
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_cpu, m) {
  m.def("decoder_layers(Tensor(a!) x, Tensor?[] weights, int[] ints, float eps, float scale, "
        "Tensor(b!)[] kv_caches, Tensor[] block_tables, Tensor token_slots, Tensor positions, "
        "Tensor[] ropes, float[] softcaps) -> Tensor(a!)");
}

// (oneDNN's packed weights are MkldnnCPU tensors: the call dispatches on them too.)
TORCH_LIBRARY_IMPL(llm_cpu, CPU, m) { m.impl("decoder_layers", TORCH_FN(decoder_layers)); }
TORCH_LIBRARY_IMPL(llm_cpu, MkldnnCPU, m) { m.impl("decoder_layers", TORCH_FN(decoder_layers)); }
