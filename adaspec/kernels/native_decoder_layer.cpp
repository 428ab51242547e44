// A llama / qwen2 decoder layer in one mlx graph node (DecoderLayer): norms, projections
// (native_linears.cpp's call), RoPE, the KV cache writes and attention (native_kv_attention.cpp's
// work), swiglu and the residual sums, each with the bits of the graph of ops it stands for.
#include "native.h"

namespace adaspec_native {

namespace {

// RMSNorm of each row of x [m, n] as kernels/layers.py's ExactRMSNorm (mx.fast.rms_norm's CPU
// fallback): the squares summed from the left (mlx's Sum on this CPU), times float(1 / n),
// plus eps, 1 / sqrt, then x * that * weight, each step rounded to float. A row's sum is one
// chain of dependent additions, so RG rows are summed side by side (each still from the left):
// the chains overlap instead of each waiting on its own additions in turn.
constexpr int RG = 8;

void rms_norm(const float* x, int m, int n, const float* w, float eps, float* y) {
  float inv_n = static_cast<float>(1.0 / n);
  for (int r0 = 0; r0 < m; r0 += RG) {
    const float* rows[RG];
    for (int r = 0; r < RG; r++)  // past the last row: row r0 again, its sum not used
      rows[r] = x + static_cast<size_t>(r0 + (r0 + r < m ? r : 0)) * n;
    float total[RG] = {};
    for (int j = 0; j < n; j++)
      for (int r = 0; r < RG; r++) total[r] += rows[r][j] * rows[r][j];
    for (int r = 0; r < RG && r0 + r < m; r++) {
      float f = 1.0f / std::sqrt(total[r] * inv_n + eps);
      float* yr = y + static_cast<size_t>(r0 + r) * n;
      for (int j = 0; j < n; j++) yr[j] = rows[r][j] * f * w[j];
    }
  }
}

// mlx-lm's swiglu (its compiled silu(gate) * up): gate * sigmoid(gate) * up, with mlx's
// sigmoid (1 / (1 + exp(|g|)), mirrored for g >= 0) on its exp polynomial
void swiglu(const float* g, const float* u, size_t n, float* y) {
  for (size_t j = 0; j < n; j++) {
    float e = 1.0f / (1.0f + exp_as_mlx(std::fabs(g[j])));
    float s = g[j] < 0.0f ? e : 1.0f - e;
    y[j] = g[j] * s * u[j];
  }
}

// A llama / qwen2 decoder layer (mlx-lm's TransformerBlock with its Attention and MLP) over
// the rows of x [1, M, H] of one or several sequences, in one node, each sequence's rows with
// the bits of its own forward's graph of mlx ops and adaspec's twins: input RMSNorm; q, k, v
// projections; RoPE, the KV cache writes and attention (AttentionCache's work: sequence i's
// rows against its own cache); o projection; residual sum; post-attention RMSNorm; gate and up
// projections; swiglu; down projection; residual sum. Inputs: x, the two norms' weights, the
// seven projections' weights (q, k, v, o, gate, up, down), each followed by its bias where it
// has one, cos and sin [M, dims / 2] (each row's angles), then every sequence's key and value
// buffers. Outputs: the layer's output [1, M, H], then every sequence's new buffers.
class DecoderLayer : public Primitive {
 public:
  DecoderLayer(Stream s, std::vector<bool> bias, float eps1, float eps2, float scale,
               std::vector<int> first, std::vector<int> rows, std::vector<int> offsets,
               std::vector<int> fold, Rope rope)
      : Primitive(s), bias_(bias), eps1_(eps1), eps2_(eps2), scale_(scale), first_(first),
        rows_(rows), offsets_(offsets), fold_(fold), rope_(rope) {}

  void eval_cpu(const std::vector<array>& in, std::vector<array>& outs) override {
    for (auto& a : in)
      if (!a.flags().row_contiguous) throw std::runtime_error("decoder_layer: not contiguous");
    auto& out = outs[0];
    out.set_data(allocator::malloc(out.nbytes()));
    int m = static_cast<int>(in[0].shape(1)), hidden = static_cast<int>(in[0].shape(2));
    struct Proj {
      const float *w, *b;
      int n, k;
    };
    std::vector<Proj> p;
    size_t at = 3;
    for (size_t i = 0; i < 7; i++) {
      auto& w = in[at++];
      const float* b = bias_[i] ? in[at++].data<float>() : nullptr;
      p.push_back({w.data<float>(), b, static_cast<int>(w.shape(0)),
                   static_cast<int>(w.shape(1))});
    }
    CacheJob job{first_, rows_, offsets_, fold_, scale_, rope_};
    job.hq = rope_.hq, job.hk = rope_.hk, job.m = m;
    job.cs = in[at].data<float>();
    job.sn = in[at + 1].data<float>();
    take_buffers(job, in, at + 2, outs);
    const float *x = in[0].data<float>(), *w1 = in[1].data<float>(), *w2 = in[2].data<float>();
    float* y = out.data<float>();
    float eps1 = eps1_, eps2 = eps2_;
    auto& enc = cpu::get_command_encoder(stream());
    for (auto& a : in) enc.set_input_array(a);
    for (auto& a : outs) enc.set_output_array(a);
    enc.dispatch([job = std::move(job), p = std::move(p), x, w1, w2, y, m, hidden, eps1,
                  eps2]() mutable {
      size_t mh = static_cast<size_t>(m) * hidden, mi = static_cast<size_t>(m) * p[4].n;
      std::vector<float> xn(mh), q(static_cast<size_t>(m) * p[0].n),
          k(static_cast<size_t>(m) * p[1].n), v(static_cast<size_t>(m) * p[2].n),
          att(static_cast<size_t>(m) * p[3].k), r(mh), h(mh), g(mi), u(mi);
      rms_norm(x, m, hidden, w1, eps1, xn.data());
      linear(xn.data(), m, hidden, p[0].w, p[0].b, p[0].n, q.data());
      linear(xn.data(), m, hidden, p[1].w, p[1].b, p[1].n, k.data());
      linear(xn.data(), m, hidden, p[2].w, p[2].b, p[2].n, v.data());
      job.q = rowwise(q.data(), m, job.hq, job.d);
      job.kn = rowwise(k.data(), m, job.hk, job.d);
      job.vn = rowwise(v.data(), m, job.hk, job.dv);
      job.o = Out{att.data(), job.dv, int64_t{job.hq} * job.dv};
      run_cache_job(job);
      linear(att.data(), m, p[3].k, p[3].w, p[3].b, p[3].n, r.data());
      for (size_t j = 0; j < mh; j++) h[j] = x[j] + r[j];
      rms_norm(h.data(), m, hidden, w2, eps2, xn.data());
      linear(xn.data(), m, hidden, p[4].w, p[4].b, p[4].n, g.data());
      linear(xn.data(), m, hidden, p[5].w, p[5].b, p[5].n, u.data());
      swiglu(g.data(), u.data(), mi, g.data());
      linear(g.data(), m, p[6].k, p[6].w, p[6].b, p[6].n, r.data());
      for (size_t j = 0; j < mh; j++) y[j] = h[j] + r[j];
    });
  }

  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("decoder_layer: CPU only");
  }
  const char* name() const override { return "DecoderLayer"; }
  bool is_equivalent(const Primitive& other) const override {
    auto& o = static_cast<const DecoderLayer&>(other);
    return bias_ == o.bias_ && eps1_ == o.eps1_ && eps2_ == o.eps2_ && scale_ == o.scale_ &&
           first_ == o.first_ && rows_ == o.rows_ && offsets_ == o.offsets_ &&
           fold_ == o.fold_ && rope_.dims == o.rope_.dims && rope_.hq == o.rope_.hq &&
           rope_.hk == o.rope_.hk;
  }

 private:
  std::vector<bool> bias_;
  float eps1_, eps2_, scale_;
  std::vector<int> first_, rows_, offsets_;
  std::vector<int> fold_;
  Rope rope_;
};

}  // namespace

std::vector<array> decoder_layer(const array& x, const array& norm1, const array& norm2,
                                 double eps1, double eps2,
                                 const std::vector<array>& weights,
                                 const std::vector<std::optional<array>>& biases,
                                 const array& cos, const array& sin, int dims, int n_heads,
                                 int n_kv_heads, const std::vector<array>& kbufs,
                                 const std::vector<array>& vbufs, const std::vector<int>& rows,
                                 const std::vector<int>& offsets, const std::vector<int>& fold,
                                 float scale, StreamOrDevice s) {
  auto bad = [](const char* what) {
    return std::invalid_argument(std::string("decoder_layer: accepted: ") + what);
  };
  if (x.ndim() != 3 || x.shape(0) != 1 || x.dtype() != float32)
    throw bad("x fp32 [1, M, H]");
  int m = static_cast<int>(x.shape(1)), hidden = static_cast<int>(x.shape(2));
  if (weights.size() != 7 || biases.size() != 7)
    throw bad("seven weights (q, k, v, o, gate, up, down) and seven biases (or None)");
  if (n_kv_heads <= 0 || n_heads % n_kv_heads != 0) throw bad("Hq a multiple of Hk");
  for (auto* a : {&norm1, &norm2})
    if (a->ndim() != 1 || a->dtype() != float32 || a->shape(0) != hidden)
      throw bad("fp32 norm weights [H]");
  if (kbufs.empty() || vbufs.empty() || kbufs[0].ndim() != 4 || vbufs[0].ndim() != 4)
    throw bad("key and value buffers [1, Hk, cap, D]");
  int d = static_cast<int>(kbufs[0].shape(3)), dv = static_cast<int>(vbufs[0].shape(3));
  int inter = weights[4].ndim() == 2 ? static_cast<int>(weights[4].shape(0)) : -1;
  // each projection's [N, K]
  std::vector<std::pair<int, int>> want{{n_heads * d, hidden},  {n_kv_heads * d, hidden},
                                        {n_kv_heads * dv, hidden}, {hidden, n_heads * dv},
                                        {inter, hidden},         {inter, hidden},
                                        {hidden, inter}};
  std::vector<array> inputs{x, norm1, norm2};
  std::vector<bool> has;
  for (size_t i = 0; i < 7; i++) {
    auto& w = weights[i];
    if (w.ndim() != 2 || w.dtype() != float32 || w.shape(0) != want[i].first ||
        w.shape(1) != want[i].second)
      throw bad("fp32 weights of the layer's shapes ([N, K]: q Hq*D x H, k and v Hk*D x H, "
                "o H x Hq*Dv, gate and up I x H, down H x I)");
    inputs.push_back(w);
    has.push_back(biases[i].has_value());
    if (biases[i]) {
      auto& b = *biases[i];
      if (b.ndim() != 1 || b.dtype() != float32 || b.shape(0) != w.shape(0))
        throw bad("fp32 biases [N]");
      inputs.push_back(b);
    }
  }
  if (dims <= 0 || dims % 2 || dims > d || cos.dtype() != float32 || sin.dtype() != float32 ||
      cos.shape() != Shape{m, dims / 2} || sin.shape() != cos.shape())
    throw bad("cos and sin fp32 [M, dims/2], even dims <= D");
  inputs.push_back(cos);
  inputs.push_back(sin);
  std::vector<Shape> shapes{x.shape()};
  auto first = cache_inputs("decoder_layer", inputs, shapes, m, n_heads, n_kv_heads, d, dv, kbufs, vbufs,
                            rows, offsets, fold);
  auto node = std::make_shared<DecoderLayer>(to_stream(s), has, static_cast<float>(eps1),
                                             static_cast<float>(eps2), scale, first, rows,
                                             offsets, fold, Rope{dims, n_heads, n_kv_heads});
  std::vector<Dtype> dtypes(shapes.size(), float32);
  return array::make_arrays(std::move(shapes), dtypes, node, std::move(inputs));
}

DecoderStack::DecoderStack(const std::vector<array>& norm1, const std::vector<array>& norm2,
                           const std::vector<double>& eps1, const std::vector<double>& eps2,
                           const std::vector<std::vector<array>>& weights,
                           const std::vector<std::vector<std::optional<array>>>& biases,
                           int dims, int n_heads, int n_kv_heads, float scale)
    : dims_(dims), n_heads_(n_heads), n_kv_heads_(n_kv_heads), scale_(scale) {
  size_t n = norm1.size();
  if (n == 0 || norm2.size() != n || eps1.size() != n || eps2.size() != n ||
      weights.size() != n || biases.size() != n)
    throw std::invalid_argument("decoder_stack: accepted: per layer (at least one) two norm "
                                "weights, two eps, seven weights and seven biases (or None)");
  for (size_t i = 0; i < n; i++)
    layers_.push_back({norm1[i], norm2[i], eps1[i], eps2[i], weights[i], biases[i]});
}

std::vector<array> DecoderStack::operator()(const array& x, const std::vector<array>& kbufs,
                                            const std::vector<array>& vbufs, int rows,
                                            int offset, int fold, const array& cos,
                                            const array& sin, StreamOrDevice s) const {
  if (kbufs.size() != layers_.size() || vbufs.size() != layers_.size())
    throw std::invalid_argument("decoder_stack: accepted: one key and one value buffer per "
                                "layer (" + std::to_string(layers_.size()) + ")");
  std::vector<array> outs{x};
  for (size_t i = 0; i < layers_.size(); i++) {
    auto& l = layers_[i];
    auto layer = decoder_layer(outs[0], l.norm1, l.norm2, l.eps1, l.eps2, l.weights, l.biases,
                               cos, sin, dims_, n_heads_, n_kv_heads_, {kbufs[i]}, {vbufs[i]},
                               {rows}, {offset}, {fold}, scale_, s);
    outs[0] = layer[0];
    outs.push_back(layer[1]);
    outs.push_back(layer[2]);
  }
  return outs;
}

}  // namespace adaspec_native
