// A llama / qwen2 decoder layer in one mlx graph node (DecoderLayer): norms, projections
// (native_linears.cpp's call), RoPE, the KV cache writes and attention (native_kv_attention.cpp's
// work), swiglu and the residual sums, each with the bits of the graph of ops it stands for;
// and a model's layers in one node (DecoderLayers, made by a DecoderStack).
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

struct Proj {  // a projection's weight [n, k] and bias [n] (or none)
  const float *w, *b;
  int n, k;
};

struct LayerRefs {  // what a layer body reads of its weights
  const float *w1, *w2;  // the two norms' weights
  float eps1, eps2;
  std::vector<Proj> p;  // q, k, v, o, gate, up, down
};

// The norm weights and seven projections (each followed by its bias where bias[i]) from
// arrays[at] on; `at` is left after them.
LayerRefs layer_refs(const std::vector<array>& arrays, size_t& at, const std::vector<bool>& bias,
                     float eps1, float eps2) {
  LayerRefs l{arrays[at].data<float>(), arrays[at + 1].data<float>(), eps1, eps2, {}};
  at += 2;
  for (size_t i = 0; i < 7; i++) {
    auto& w = arrays[at++];
    const float* b = bias[i] ? arrays[at++].data<float>() : nullptr;
    l.p.push_back({w.data<float>(), b, static_cast<int>(w.shape(0)),
                   static_cast<int>(w.shape(1))});
  }
  return l;
}

// A decoder layer node's prologue: its inputs contiguous, output 0 (the rows [1, M, H])
// allocated; returns (M, H).
std::pair<int, int> layer_rows_out(const char* who, const std::vector<array>& in,
                                   std::vector<array>& outs) {
  for (auto& a : in)
    if (!a.flags().row_contiguous) throw std::runtime_error(std::string(who) + ": not contiguous");
  outs[0].set_data(allocator::malloc(outs[0].nbytes()));
  return {static_cast<int>(in[0].shape(1)), static_cast<int>(in[0].shape(2))};
}

// `job` (a layer's sequences, their rows, offsets and folds) ready to run on m rows: RoPE's
// angles cos and sin, its buffers inputs at .. and outputs out_at ..
CacheJob layer_job(CacheJob job, int m, const array& cos, const array& sin,
                   const std::vector<array>& in, size_t at, std::vector<array>& outs,
                   size_t out_at) {
  job.hq = job.rope.hq, job.hk = job.rope.hk, job.m = m;
  job.cs = cos.data<float>();
  job.sn = sin.data<float>();
  take_buffers(job, in, at, outs, out_at);
  return job;
}

struct Scratch {  // a layer body's intermediate rows, kept across the layers of a stack
  std::vector<float> xn, q, k, v, att, r, h, g, u;
};

// One decoder layer over x [m, hidden] into y (not x): input RMSNorm; q, k, v projections;
// RoPE, the KV cache writes and attention (`job`); o projection; residual sum; post-attention
// RMSNorm; gate and up projections; swiglu; down projection; residual sum.
void layer_body(CacheJob& job, const LayerRefs& l, const float* x, float* y, int m, int hidden,
                Scratch& s) {
  auto& p = l.p;
  size_t mh = static_cast<size_t>(m) * hidden, mi = static_cast<size_t>(m) * p[4].n;
  s.xn.resize(mh), s.r.resize(mh), s.h.resize(mh), s.g.resize(mi), s.u.resize(mi);
  s.q.resize(static_cast<size_t>(m) * p[0].n), s.k.resize(static_cast<size_t>(m) * p[1].n);
  s.v.resize(static_cast<size_t>(m) * p[2].n), s.att.resize(static_cast<size_t>(m) * p[3].k);
  rms_norm(x, m, hidden, l.w1, l.eps1, s.xn.data());
  linear(s.xn.data(), m, hidden, p[0].w, p[0].b, p[0].n, s.q.data());
  linear(s.xn.data(), m, hidden, p[1].w, p[1].b, p[1].n, s.k.data());
  linear(s.xn.data(), m, hidden, p[2].w, p[2].b, p[2].n, s.v.data());
  job.q = rowwise(s.q.data(), m, job.hq, job.d);
  job.kn = rowwise(s.k.data(), m, job.hk, job.d);
  job.vn = rowwise(s.v.data(), m, job.hk, job.dv);
  job.o = Out{s.att.data(), job.dv, int64_t{job.hq} * job.dv};
  run_cache_job(job);
  linear(s.att.data(), m, p[3].k, p[3].w, p[3].b, p[3].n, s.r.data());
  for (size_t j = 0; j < mh; j++) s.h[j] = x[j] + s.r[j];
  rms_norm(s.h.data(), m, hidden, l.w2, l.eps2, s.xn.data());
  linear(s.xn.data(), m, hidden, p[4].w, p[4].b, p[4].n, s.g.data());
  linear(s.xn.data(), m, hidden, p[5].w, p[5].b, p[5].n, s.u.data());
  swiglu(s.g.data(), s.u.data(), mi, s.g.data());
  linear(s.g.data(), m, p[6].k, p[6].w, p[6].b, p[6].n, s.r.data());
  for (size_t j = 0; j < mh; j++) y[j] = s.h[j] + s.r[j];
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
    auto [m, hidden] = layer_rows_out("decoder_layer", in, outs);
    size_t at = 1;
    LayerRefs l = layer_refs(in, at, bias_, eps1_, eps2_);
    CacheJob job = layer_job({first_, rows_, offsets_, fold_, scale_, rope_}, m, in[at],
                             in[at + 1], in, at + 2, outs, 1);
    const float* x = in[0].data<float>();
    float* y = outs[0].data<float>();
    encoder_for(stream(), in, outs).dispatch([job = std::move(job), l = std::move(l), x, y, m, hidden]() mutable {
      Scratch s;
      layer_body(job, l, x, y, m, hidden, s);
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

// A model's decoder layers in one node: layer i is DecoderLayer's work on layer i - 1's output
// (one sequence; the same offset, rows and fold in every layer). The weights are not inputs:
// the node holds them (evaluated, never donated). Inputs: x [1, M, H], cos and sin, then each
// layer's key and value buffers. Outputs: the last layer's output, then each layer's new
// buffers.
class DecoderLayers : public Primitive {
 public:
  DecoderLayers(Stream s, std::shared_ptr<const StackWeights> held, float scale, int rows,
                int offset, int fold, Rope rope)
      : Primitive(s), held_(std::move(held)), scale_(scale), rows_(rows), offset_(offset),
        fold_(fold), rope_(rope) {}

  void eval_cpu(const std::vector<array>& in, std::vector<array>& outs) override {
    auto [m, hidden] = layer_rows_out("decoder_stack", in, outs);
    std::vector<CacheJob> jobs;
    std::vector<LayerRefs> refs;
    size_t at = 0;
    auto& w = *held_;
    for (size_t i = 0; i < w.bias.size(); i++) {
      refs.push_back(layer_refs(w.arrays, at, w.bias[i], w.eps1[i], w.eps2[i]));
      jobs.push_back(layer_job({{0}, {rows_}, {offset_}, {fold_}, scale_, rope_}, m, in[1], in[2],
                               in, 3 + 2 * i, outs, 1 + 2 * i));
    }
    const float* x = in[0].data<float>();
    float* y = outs[0].data<float>();
    encoder_for(stream(), in, outs).dispatch([jobs = std::move(jobs), refs = std::move(refs), x, y, m, hidden]() mutable {
      Scratch s;
      size_t mh = static_cast<size_t>(m) * hidden, n = jobs.size();
      std::vector<float> a(n > 1 ? mh : 0), b(n > 2 ? mh : 0);  // layer outputs, in turn
      const float* cur = x;
      for (size_t i = 0; i < n; i++) {
        float* dst = i + 1 == n ? y : (i % 2 ? b.data() : a.data());
        layer_body(jobs[i], refs[i], cur, dst, m, hidden, s);
        cur = dst;
      }
    });
  }

  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("decoder_stack: CPU only");
  }
  const char* name() const override { return "DecoderLayers"; }
  bool is_equivalent(const Primitive& other) const override {
    auto& o = static_cast<const DecoderLayers&>(other);
    return held_ == o.held_ && scale_ == o.scale_ && rows_ == o.rows_ &&
           offset_ == o.offset_ && fold_ == o.fold_ &&
           rope_.dims == o.rope_.dims && rope_.hq == o.rope_.hq && rope_.hk == o.rope_.hk;
  }

 private:
  std::shared_ptr<const StackWeights> held_;
  float scale_;
  int rows_, offset_, fold_;
  Rope rope_;
};

}  // namespace

namespace {

std::invalid_argument refused(const char* who, const char* what) {
  return std::invalid_argument(std::string(who) + ": accepted: " + what);
}

// What a decoder layer node checks of x [1, M, H], a layer's norm weights, weights and biases
// (d, dv: the head dims of its cache buffers) and the angles; appends x, the norm weights and
// each weight followed by its bias to `inputs`; returns which projections have a bias.
std::vector<bool> checked_layer(const char* who, const array& x, const array& norm1,
                                const array& norm2, const std::vector<array>& weights,
                                const std::vector<std::optional<array>>& biases,
                                const array& cos, const array& sin, int dims, int n_heads,
                                int n_kv_heads, int d, int dv, std::vector<array>& inputs) {
  if (x.ndim() != 3 || x.shape(0) != 1 || x.dtype() != float32)
    throw refused(who, "x fp32 [1, M, H]");
  int m = static_cast<int>(x.shape(1)), hidden = static_cast<int>(x.shape(2));
  if (weights.size() != 7 || biases.size() != 7)
    throw refused(who, "seven weights (q, k, v, o, gate, up, down) and seven biases (or None)");
  if (n_kv_heads <= 0 || n_heads % n_kv_heads != 0) throw refused(who, "Hq a multiple of Hk");
  for (auto* a : {&norm1, &norm2})
    if (a->ndim() != 1 || a->dtype() != float32 || a->shape(0) != hidden)
      throw refused(who, "fp32 norm weights [H]");
  int inter = weights[4].ndim() == 2 ? static_cast<int>(weights[4].shape(0)) : -1;
  // each projection's [N, K]
  std::vector<std::pair<int, int>> want{{n_heads * d, hidden},  {n_kv_heads * d, hidden},
                                        {n_kv_heads * dv, hidden}, {hidden, n_heads * dv},
                                        {inter, hidden},         {inter, hidden},
                                        {hidden, inter}};
  inputs.insert(inputs.end(), {x, norm1, norm2});
  std::vector<bool> has;
  for (size_t i = 0; i < 7; i++) {
    auto& w = weights[i];
    if (w.ndim() != 2 || w.dtype() != float32 || w.shape(0) != want[i].first ||
        w.shape(1) != want[i].second)
      throw refused(who, "fp32 weights of the layer's shapes ([N, K]: q Hq*D x H, k and v "
                         "Hk*D x H, o H x Hq*Dv, gate and up I x H, down H x I)");
    inputs.push_back(w);
    has.push_back(biases[i].has_value());
    if (biases[i]) {
      auto& b = *biases[i];
      if (b.ndim() != 1 || b.dtype() != float32 || b.shape(0) != w.shape(0))
        throw refused(who, "fp32 biases [N]");
      inputs.push_back(b);
    }
  }
  if (dims <= 0 || dims % 2 || dims > d || cos.dtype() != float32 || sin.dtype() != float32 ||
      cos.shape() != Shape{m, dims / 2} || sin.shape() != cos.shape())
    throw refused(who, "cos and sin fp32 [M, dims/2], even dims <= D");
  return has;
}

std::pair<int, int> head_dims(const char* who, const std::vector<array>& kbufs,
                              const std::vector<array>& vbufs) {
  if (kbufs.empty() || vbufs.empty() || kbufs[0].ndim() != 4 || vbufs[0].ndim() != 4)
    throw refused(who, "key and value buffers [1, Hk, cap, D]");
  return {static_cast<int>(kbufs[0].shape(3)), static_cast<int>(vbufs[0].shape(3))};
}

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
  const char* who = "decoder_layer";
  auto [d, dv] = head_dims(who, kbufs, vbufs);
  std::vector<array> inputs;
  auto has = checked_layer(who, x, norm1, norm2, weights, biases, cos, sin, dims, n_heads,
                           n_kv_heads, d, dv, inputs);
  inputs.push_back(cos);
  inputs.push_back(sin);
  std::vector<Shape> shapes{x.shape()};
  int m = static_cast<int>(x.shape(1));
  auto first = cache_inputs(who, inputs, shapes, m, n_heads, n_kv_heads, d, dv, kbufs, vbufs,
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
  auto held = std::make_shared<StackWeights>();
  for (size_t i = 0; i < n; i++) {
    layers_.push_back({norm1[i], norm2[i], eps1[i], eps2[i], weights[i], biases[i]});
    auto& a = held->arrays;
    a.insert(a.end(), {norm1[i], norm2[i]});  // the order layer_refs reads
    std::vector<bool> has;
    for (size_t j = 0; j < weights[i].size(); j++) {
      a.push_back(weights[i][j]);
      has.push_back(j < biases[i].size() && biases[i][j]);
      if (has.back()) a.push_back(*biases[i][j]);
    }
    held->bias.push_back(has);
    held->eps1.push_back(static_cast<float>(eps1[i]));
    held->eps2.push_back(static_cast<float>(eps2[i]));
  }
  eval(held->arrays);  // the node reads them, not mlx: they must be computed
  held_ = held;
}

std::vector<array> DecoderStack::operator()(const array& x, const std::vector<array>& kbufs,
                                            const std::vector<array>& vbufs, int rows,
                                            int offset, int fold, const array& cos,
                                            const array& sin, StreamOrDevice s) const {
  const char* who = "decoder_stack";
  if (kbufs.size() != layers_.size() || vbufs.size() != layers_.size())
    throw std::invalid_argument("decoder_stack: accepted: one key and one value buffer per "
                                "layer (" + std::to_string(layers_.size()) + ")");
  auto [d, dv] = head_dims(who, kbufs, vbufs);
  std::vector<array> checked;
  // every layer's weights against x's width and the buffers' head dims, once per such pair
  // (the weights cannot change: the stack holds them); x and the angles on every call
  auto& l0 = layers_[0];
  checked_layer(who, x, l0.norm1, l0.norm2, l0.weights, l0.biases, cos, sin, dims_, n_heads_,
                n_kv_heads_, d, dv, checked);
  std::array<int, 3> key{static_cast<int>(x.shape(2)), d, dv};
  if (key != checked_) {
    for (auto& l : layers_) {
      checked.clear();
      checked_layer(who, x, l.norm1, l.norm2, l.weights, l.biases, cos, sin, dims_, n_heads_,
                    n_kv_heads_, d, dv, checked);
    }
    checked_ = key;
  }
  std::vector<array> inputs{x, cos, sin};
  std::vector<Shape> shapes{x.shape()};
  for (size_t i = 0; i < layers_.size(); i++)
    cache_inputs(who, inputs, shapes, static_cast<int>(x.shape(1)), n_heads_, n_kv_heads_, d,
                 dv, {kbufs[i]}, {vbufs[i]}, {rows}, {offset}, {fold});
  auto node = std::make_shared<DecoderLayers>(to_stream(s), held_, scale_, rows, offset, fold,
                                              Rope{dims_, n_heads_, n_kv_heads_});
  std::vector<Dtype> dtypes(shapes.size(), float32);
  return array::make_arrays(std::move(shapes), dtypes, node, std::move(inputs));
}

}  // namespace adaspec_native
