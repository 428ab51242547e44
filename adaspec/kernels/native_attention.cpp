// Attention on the CPU in one mlx graph node, with the bits of adaspec's sdpa
// (kernels/attention.py), which has the bits of mlx's fast.cpp fallback: the query
// scaled, q @ k^T and probs @ v through the same cblas_sgemm calls mlx's Matmul makes
// (the routed kernel: the same rows, transposes and leading dimensions), the causal mask
// as fast.cpp writes it, and softmax as softmax.cpp computes it (row max, mlx's exp
// polynomial with fused multiply-adds, the sum from the left, times 1 / sum).
#include <nanobind/nanobind.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace nb = nanobind;
using namespace mlx::core;

extern "C" void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k,
                            float alpha, const float* a, int lda, const float* b, int ldb,
                            float beta, float* c, int ldc);

namespace {

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;

// mlx's exp (backend/cpu/simd/math.h) one lane at a time: the same operations in the
// same order and precision; the fused multiply-adds round once, as std::fma does.
inline float exp_as_mlx(float x0) {
  float x = x0 * 1.442695f;
  float ipart = static_cast<float>(std::floor(static_cast<double>(x) + 0.5));
  float fpart = x - ipart;
  float p = 1.535336188319500e-4f;
  p = std::fma(p, fpart, 1.339887440266574e-3f);
  p = std::fma(p, fpart, 9.618437357674640e-3f);
  p = std::fma(p, fpart, 5.550332471162809e-2f);
  p = std::fma(p, fpart, 2.402264791363012e-1f);
  p = std::fma(p, fpart, 6.931472028550421e-1f);
  p = std::fma(p, fpart, 1.000000000000000f);
  int bits = (static_cast<int>(ipart) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  float r = std::isnan(x0) ? x0 : scale * p;
  r = x0 > 88.0f ? INFINITY : r;
  return x0 < -88.0f ? 0.0f : r;
}

// softmax.py's softmax of one row in place: max, exp(x - max), sum from the left, * (1/sum)
void softmax_row(float* s, int n) {
  float m = s[0];
  for (int j = 1; j < n; j++) m = s[j] > m ? s[j] : m;
  for (int j = 0; j < n; j++) s[j] = exp_as_mlx(s[j] - m);
  float total = 0.0f;
  for (int j = 0; j < n; j++) total += s[j];
  float inv = 1.0f / total;
  for (int j = 0; j < n; j++) s[j] = s[j] * inv;
}

struct View {  // a rank-4 fp32 array's data and element strides
  const float* p;
  int64_t s0, s1, s2, s3;
  const float* at(int64_t b, int64_t h, int64_t r) const { return p + b * s0 + h * s1 + r * s2; }
};

View view(const array& a) {
  auto& st = a.strides();
  return {a.data<float>(), st[0], st[1], st[2], st[3]};
}

struct Shape4 {
  int B, Hq, Hk, L, S, D, Dv;
};

struct Out {  // where a head's output rows go: o + head * sh + row * sr
  float* o;
  int64_t sh, sr;
};

// One KV head's query rows (query heads h*rep+r0 .. +reps, each rows l0 .. l0+n of q) against
// keys 0..S of k and v, as sdpa computes them; its output rows stored through `out`.
void head(const Shape4& d, int l0, int n, const View& q, const View& k, const View& v,
          float scale, bool causal, int b, int h, int r0, int reps, const Out& out,
          std::vector<float>& qs, std::vector<float>& sc, std::vector<float>& res) {
  int rep = d.Hq / d.Hk, rows = reps * n;
  qs.resize(static_cast<size_t>(rows) * d.D);
  sc.resize(static_cast<size_t>(rows) * d.S);
  res.resize(static_cast<size_t>(rows) * d.Dv);
  for (int r = 0; r < reps; r++)
    for (int l = 0; l < n; l++) {
      const float* src = q.at(b, h * rep + r0 + r, l0 + l);
      float* dst = &qs[(static_cast<size_t>(r) * n + l) * d.D];
      for (int c = 0; c < d.D; c++) dst[c] = scale * src[c * q.s3];
    }
  cblas_sgemm(kRowMajor, kNoTrans, kTrans, rows, d.S, d.D, 1.0f, qs.data(), d.D,
              k.at(b, h, 0), static_cast<int>(k.s2), 0.0f, sc.data(), d.S);
  for (int i = 0; i < rows; i++) {
    float* s = &sc[static_cast<size_t>(i) * d.S];
    if (causal) {
      int last = d.S - n + i % n;  // the newest key this query row may see
      for (int j = last + 1; j < d.S; j++) s[j] = -FLT_MAX;
    }
    softmax_row(s, d.S);
  }
  cblas_sgemm(kRowMajor, kNoTrans, kNoTrans, rows, d.Dv, d.S, 1.0f, sc.data(), d.S,
              v.at(b, h, 0), static_cast<int>(v.s2), 0.0f, res.data(), d.Dv);
  for (int r = 0; r < reps; r++)
    for (int l = 0; l < n; l++)
      std::memcpy(out.o + (h * rep + r0 + r) * out.sh + (l0 + l) * out.sr,
                  &res[(static_cast<size_t>(r) * n + l) * d.Dv], sizeof(float) * d.Dv);
}

// Every KV head of batch row b: folded (one GEMM per KV head) or one query head at a time.
void heads(const Shape4& d, int l0, int n, const View& q, const View& k, const View& v,
           float scale, bool causal, bool fold, int b, const Out& out) {
  std::vector<float> qs, sc, res;
  int rep = d.Hq / d.Hk;
  for (int h = 0; h < d.Hk; h++) {
    if (fold) {
      head(d, l0, n, q, k, v, scale, causal, b, h, 0, rep, out, qs, sc, res);
    } else {
      for (int r = 0; r < rep; r++)
        head(d, l0, n, q, k, v, scale, causal, b, h, r, 1, out, qs, sc, res);
    }
  }
}

void check_last_axis(const std::vector<array>& in) {
  for (auto& a : in)
    if (a.strides()[3] != 1) throw std::runtime_error("attention: last axis strided");
}

class AttentionCore : public Primitive {
 public:
  AttentionCore(Stream s, float scale, bool causal, bool fold)
      : Primitive(s), scale_(scale), causal_(causal), fold_(fold) {}

  void eval_cpu(const std::vector<array>& in, std::vector<array>& outs) override {
    auto& out = outs[0];
    out.set_data(allocator::malloc(out.nbytes()));
    check_last_axis(in);
    Shape4 d{static_cast<int>(in[0].shape(0)), static_cast<int>(in[0].shape(1)),
             static_cast<int>(in[1].shape(1)), static_cast<int>(in[0].shape(2)),
             static_cast<int>(in[1].shape(2)), static_cast<int>(in[0].shape(3)),
             static_cast<int>(in[2].shape(3))};
    View q = view(in[0]), k = view(in[1]), v = view(in[2]);
    float* o = out.data<float>();
    float scale = scale_;
    bool causal = causal_, fold = fold_;
    auto& enc = cpu::get_command_encoder(stream());
    for (auto& a : in) enc.set_input_array(a);
    enc.set_output_array(out);
    enc.dispatch([=]() {
      for (int b = 0; b < d.B; b++) {
        Out out{o + static_cast<size_t>(b) * d.Hq * d.L * d.Dv, int64_t{d.L} * d.Dv, d.Dv};
        heads(d, 0, d.L, q, k, v, scale, causal, fold, b, out);
      }
    });
  }

  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("attention_core: CPU only");
  }
  const char* name() const override { return "AttentionCore"; }
  bool is_equivalent(const Primitive& other) const override {
    auto& o = static_cast<const AttentionCore&>(other);
    return scale_ == o.scale_ && causal_ == o.causal_ && fold_ == o.fold_;
  }

 private:
  float scale_;
  bool causal_, fold_;
};

// Several sequences' attention in one node: sequence i's query rows first_i .. +n_i of q
// [1, Hq, M, D] against its own keys and values (inputs 1 + 2i, 2 + 2i), each exactly as
// sdpa computes that sequence alone (causal when it has several rows, folded where sdpa
// folds); the output laid out as o_proj takes it, [1, M, Hq * Dv].
class AttentionRows : public Primitive {
 public:
  AttentionRows(Stream s, float scale, std::vector<int> first, std::vector<int> rows,
                std::vector<bool> fold)
      : Primitive(s), scale_(scale), first_(first), rows_(rows), fold_(fold) {}

  void eval_cpu(const std::vector<array>& in, std::vector<array>& outs) override {
    auto& out = outs[0];
    out.set_data(allocator::malloc(out.nbytes()));
    check_last_axis(in);
    int hq = static_cast<int>(in[0].shape(1)), dv = static_cast<int>(in[2].shape(3));
    std::vector<Shape4> shapes;
    std::vector<View> views;
    for (size_t i = 0; i < first_.size(); i++) {
      auto& k = in[1 + 2 * i];
      shapes.push_back({1, hq, static_cast<int>(k.shape(1)), 0, static_cast<int>(k.shape(2)),
                        static_cast<int>(k.shape(3)), dv});
      views.push_back(view(k));
      views.push_back(view(in[2 + 2 * i]));
    }
    View q = view(in[0]);
    Out o{out.data<float>(), dv, int64_t{hq} * dv};
    auto& enc = cpu::get_command_encoder(stream());
    for (auto& a : in) enc.set_input_array(a);
    enc.set_output_array(out);
    enc.dispatch([=, first = first_, rows = rows_, fold = fold_, scale = scale_]() {
      for (size_t i = 0; i < first.size(); i++)
        heads(shapes[i], first[i], rows[i], q, views[2 * i], views[2 * i + 1], scale,
              rows[i] > 1, fold[i], 0, o);
    });
  }

  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("attention_rows: CPU only");
  }
  const char* name() const override { return "AttentionRows"; }
  bool is_equivalent(const Primitive& other) const override {
    auto& o = static_cast<const AttentionRows&>(other);
    return scale_ == o.scale_ && first_ == o.first_ && rows_ == o.rows_ && fold_ == o.fold_;
  }

 private:
  float scale_;
  std::vector<int> first_, rows_;
  std::vector<bool> fold_;
};

array attention_rows(const array& q, const std::vector<array>& keys,
                     const std::vector<array>& values, const std::vector<int>& rows,
                     const std::vector<bool>& fold, float scale, StreamOrDevice s) {
  size_t n = rows.size();
  if (n == 0 || keys.size() != n || values.size() != n || fold.size() != n)
    throw std::invalid_argument("attention_rows: accepted: one key, value, row count and fold "
                                "flag per sequence, at least one sequence");
  if (q.ndim() != 4 || q.dtype() != float32 || q.shape(0) != 1)
    throw std::invalid_argument("attention_rows: accepted: q fp32 [1, Hq, M, D]");
  std::vector<int> first;
  std::vector<array> inputs{q};
  int at = 0;
  for (size_t i = 0; i < n; i++) {
    auto &k = keys[i], &v = values[i];
    bool ok = k.ndim() == 4 && v.ndim() == 4 && k.dtype() == float32 && v.dtype() == float32 &&
              k.shape(0) == 1 && v.shape(0) == 1 && k.shape(1) == v.shape(1) &&
              k.shape(1) > 0 && q.shape(1) % k.shape(1) == 0 && k.shape(2) == v.shape(2) &&
              k.shape(3) == q.shape(3) && v.shape(3) == values[0].shape(3) && rows[i] > 0 &&
              rows[i] <= k.shape(2);
    if (!ok)
      throw std::invalid_argument("attention_rows: accepted: keys [1,Hk,S,D], values "
                                  "[1,Hk,S,Dv] per sequence, Hq a multiple of Hk, 0 < rows <= S");
    first.push_back(at);
    at += rows[i];
    inputs.push_back(k);
    inputs.push_back(v);
  }
  if (at != q.shape(2))
    throw std::invalid_argument("attention_rows: the row counts must add up to q's rows");
  Shape shape{1, q.shape(2), q.shape(1) * values[0].shape(3)};
  return array(shape, float32,
               std::make_shared<AttentionRows>(to_stream(s), scale, first, rows, fold),
               std::move(inputs));
}

array attention_core(const array& q, const array& k, const array& v, float scale, bool causal,
                     bool fold, StreamOrDevice s) {
  for (auto* a : {&q, &k, &v})
    if (a->ndim() != 4 || a->dtype() != float32)
      throw std::invalid_argument("attention_core: accepted: fp32 arrays of rank 4");
  if (k.shape(1) == 0 || q.shape(1) % k.shape(1) != 0 || k.shape(2) != v.shape(2) ||
      q.shape(3) != k.shape(3) || q.shape(0) != k.shape(0) || v.shape(1) != k.shape(1))
    throw std::invalid_argument("attention_core: accepted: q [B,Hq,L,D], k [B,Hk,S,D], "
                                "v [B,Hk,S,Dv] with Hq a multiple of Hk");
  if (causal && q.shape(2) > k.shape(2))
    throw std::invalid_argument("attention_core: causal needs at least as many keys as rows");
  Shape shape{q.shape(0), q.shape(1), q.shape(2), v.shape(3)};
  return array(shape, float32, std::make_shared<AttentionCore>(to_stream(s), scale, causal, fold),
               {q, k, v});
}

// Several projections of one input in one node: y_i = x @ w_i^T (+ b_i), each through the
// cblas_sgemm call mlx's Matmul (AddMM with a bias) makes for nn.Linear on a [1, M, K] input
// (x not transposed, lda K; w_i [N_i, K] read transposed, ldb K; AddMM first fills the
// output with the bias rows, then adds with beta 1), so the routed kernel, and the stored
// weights it finds by w_i's address, give each output its bits.
class Linears : public Primitive {
 public:
  Linears(Stream s, std::vector<bool> bias) : Primitive(s), bias_(bias) {}

  void eval_cpu(const std::vector<array>& in, std::vector<array>& outs) override {
    auto& x = in[0];
    if (!x.flags().row_contiguous) throw std::runtime_error("linears: x not contiguous");
    int m = static_cast<int>(x.size() / x.shape(-1)), k = static_cast<int>(x.shape(-1));
    struct Job {
      const float *w, *b;
      float* y;
      int n;
    };
    std::vector<Job> jobs;
    size_t at = 1;
    for (size_t i = 0; i < outs.size(); i++) {
      auto& w = in[at++];
      const float* b = bias_[i] ? in[at++].data<float>() : nullptr;
      if (w.strides()[1] != 1 || w.strides()[0] != k)
        throw std::runtime_error("linears: weight not a contiguous [N, K] matrix");
      outs[i].set_data(allocator::malloc(outs[i].nbytes()));
      jobs.push_back({w.data<float>(), b, outs[i].data<float>(), static_cast<int>(w.shape(0))});
    }
    const float* xp = x.data<float>();
    auto& enc = cpu::get_command_encoder(stream());
    for (auto& a : in) enc.set_input_array(a);
    for (auto& o : outs) enc.set_output_array(o);
    enc.dispatch([jobs, xp, m, k]() {
      for (auto& j : jobs) {
        if (j.b)
          for (int r = 0; r < m; r++) std::memcpy(j.y + static_cast<size_t>(r) * j.n, j.b,
                                                  sizeof(float) * j.n);
        cblas_sgemm(kRowMajor, kNoTrans, kTrans, m, j.n, k, 1.0f, xp, k, j.w, k,
                    j.b ? 1.0f : 0.0f, j.y, j.n);
      }
    });
  }

  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("linears: CPU only");
  }
  const char* name() const override { return "Linears"; }
  bool is_equivalent(const Primitive& other) const override {
    return bias_ == static_cast<const Linears&>(other).bias_;
  }

 private:
  std::vector<bool> bias_;
};

std::vector<array> linears(const array& x, const std::vector<array>& weights,
                           const std::vector<std::optional<array>>& biases, StreamOrDevice s) {
  if (weights.empty() || biases.size() != weights.size())
    throw std::invalid_argument("linears: accepted: one weight and one bias (or None) each");
  if (x.ndim() != 3 || x.shape(0) != 1 || x.dtype() != float32)
    throw std::invalid_argument("linears: accepted: x fp32 [1, M, K]");
  std::vector<array> inputs{x};
  std::vector<bool> has;
  std::vector<Shape> shapes;
  for (size_t i = 0; i < weights.size(); i++) {
    auto& w = weights[i];
    if (w.ndim() != 2 || w.dtype() != float32 || w.shape(1) != x.shape(2))
      throw std::invalid_argument("linears: accepted: fp32 weights [N, K] with x's K");
    inputs.push_back(w);
    has.push_back(biases[i].has_value());
    if (biases[i]) {
      auto& b = *biases[i];
      if (b.ndim() != 1 || b.dtype() != float32 || b.shape(0) != w.shape(0))
        throw std::invalid_argument("linears: accepted: fp32 biases [N]");
      inputs.push_back(b);
    }
    shapes.push_back({1, x.shape(1), w.shape(0)});
  }
  std::vector<Dtype> dtypes(weights.size(), float32);
  return array::make_arrays(std::move(shapes), dtypes,
                            std::make_shared<Linears>(to_stream(s), has), std::move(inputs));
}

}  // namespace

NB_MODULE(_adaspec_native, m) {
  m.def("attention_core", &attention_core, nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("scale"), nb::arg("causal"), nb::arg("fold"), nb::kw_only(),
        nb::arg("stream") = nb::none());
  m.def("linears", &linears, nb::arg("x"), nb::arg("weights"), nb::arg("biases"),
        nb::kw_only(), nb::arg("stream") = nb::none());
  m.def("attention_rows", &attention_rows, nb::arg("q"), nb::arg("keys"), nb::arg("values"),
        nb::arg("rows"), nb::arg("fold"), nb::arg("scale"), nb::kw_only(),
        nb::arg("stream") = nb::none());
}
