// Attention on the CPU in one mlx graph node, with the bits of adaspec's sdpa
// (kernels/attention.py), which has the bits of mlx's fast.cpp fallback: the query
// scaled, q @ k^T and probs @ v through the same cblas_sgemm calls mlx's Matmul makes
// (the routed kernel: the same rows, transposes and leading dimensions), the causal mask
// as fast.cpp writes it, and softmax as softmax.cpp computes it (row max, mlx's exp
// polynomial with fused multiply-adds, the sum from the left, times 1 / sum).
#include <nanobind/nanobind.h>
#include <nanobind/stl/variant.h>

#include <cfloat>
#include <cmath>
#include <cstring>
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

// One KV head's `rows` query rows (query heads h*rep+r0 .. , each L rows) against its keys.
void head(const Shape4& d, const View& q, const View& k, const View& v, float scale, bool causal,
          int b, int h, int r0, int reps, float* out, std::vector<float>& qs,
          std::vector<float>& sc) {
  int rep = d.Hq / d.Hk, rows = reps * d.L;
  qs.resize(static_cast<size_t>(rows) * d.D);
  sc.resize(static_cast<size_t>(rows) * d.S);
  for (int r = 0; r < reps; r++)
    for (int l = 0; l < d.L; l++) {
      const float* src = q.at(b, h * rep + r0 + r, l);
      float* dst = &qs[(static_cast<size_t>(r) * d.L + l) * d.D];
      for (int c = 0; c < d.D; c++) dst[c] = scale * src[c * q.s3];
    }
  cblas_sgemm(kRowMajor, kNoTrans, kTrans, rows, d.S, d.D, 1.0f, qs.data(), d.D,
              k.at(b, h, 0), static_cast<int>(k.s2), 0.0f, sc.data(), d.S);
  for (int i = 0; i < rows; i++) {
    float* s = &sc[static_cast<size_t>(i) * d.S];
    if (causal) {
      int last = d.S - d.L + i % d.L;  // the newest key this query row may see
      for (int j = last + 1; j < d.S; j++) s[j] = -FLT_MAX;
    }
    softmax_row(s, d.S);
  }
  cblas_sgemm(kRowMajor, kNoTrans, kNoTrans, rows, d.Dv, d.S, 1.0f, sc.data(), d.S,
              v.at(b, h, 0), static_cast<int>(v.s2), 0.0f, out, d.Dv);
}

class AttentionCore : public Primitive {
 public:
  AttentionCore(Stream s, float scale, bool causal, bool fold)
      : Primitive(s), scale_(scale), causal_(causal), fold_(fold) {}

  void eval_cpu(const std::vector<array>& in, std::vector<array>& outs) override {
    auto& out = outs[0];
    out.set_data(allocator::malloc(out.nbytes()));
    for (auto& a : in)
      if (a.strides()[3] != 1) throw std::runtime_error("attention_core: last axis strided");
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
      std::vector<float> qs, sc;
      int rep = d.Hq / d.Hk;
      for (int b = 0; b < d.B; b++)
        for (int h = 0; h < d.Hk; h++) {
          float* base = o + (static_cast<size_t>(b) * d.Hq + h * rep) * d.L * d.Dv;
          if (fold) {
            head(d, q, k, v, scale, causal, b, h, 0, rep, base, qs, sc);
          } else {
            for (int r = 0; r < rep; r++)
              head(d, q, k, v, scale, causal, b, h, r, 1,
                   base + static_cast<size_t>(r) * d.L * d.Dv, qs, sc);
          }
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

}  // namespace

NB_MODULE(_adaspec_native, m) {
  m.def("attention_core", &attention_core, nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("scale"), nb::arg("causal"), nb::arg("fold"), nb::kw_only(),
        nb::arg("stream") = nb::none());
}
