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

#include <atomic>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/fast.h"
#include "mlx/primitives.h"
#include "mlx/transforms.h"

namespace nb = nanobind;
using namespace mlx::core;

extern "C" void adaspec_stored_values(int vector, int type, const unsigned char* src, int rows,
                                      int k, long row_bytes, float* out);  // the router's
extern "C" void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k,
                            float alpha, const float* a, int lda, const float* b, int ldb,
                            float beta, float* c, int ldc);

namespace {

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
std::atomic<long> buffer_copies{0};  // cache buffers copied because mlx could not donate them

// mlx's exp (backend/cpu/simd/math.h): the same operations in the same order and precision;
// the fused multiply-adds round once, as std::fma does. mlx rounds x + 0.5 in double before
// the floor; in float it is the same value wherever the result is not replaced by a select
// below (|x0| <= 88 keeps |x| < 128, where adding 0.5 is exact), so the loop can vectorize.
inline float exp_as_mlx(float x0) {
  float x = x0 * 1.442695f;
  float ipart = std::floor(x + 0.5f);
  float fpart = x - ipart;
  float p = 1.535336188319500e-4f;
  p = std::fma(p, fpart, 1.339887440266574e-3f);
  p = std::fma(p, fpart, 9.618437357674640e-3f);
  p = std::fma(p, fpart, 5.550332471162809e-2f);
  p = std::fma(p, fpart, 2.402264791363012e-1f);
  p = std::fma(p, fpart, 6.931472028550421e-1f);
  p = std::fma(p, fpart, 1.000000000000000f);
  float r = std::bit_cast<float>((static_cast<int>(ipart) + 127) << 23) * p;
  r = x0 != x0 ? x0 : r;
  r = x0 > 88.0f ? INFINITY : r;
  return x0 < -88.0f ? 0.0f : r;
}

// softmax.py's softmax of one row in place: max, exp(x - max), sum from the left, * (1/sum)
void softmax_row(float* s, int n) {
  // the row max in 16 lanes (a maximum's value does not depend on the order it is taken in;
  // of +0 and -0 either may come out, and exp(x - (+0)) == exp(x - (-0)))
  float lanes[16];
  for (int c = 0; c < 16; c++) lanes[c] = s[0];
  int j = 0;
  for (; j + 16 <= n; j += 16)
    for (int c = 0; c < 16; c++) lanes[c] = s[j + c] > lanes[c] ? s[j + c] : lanes[c];
  float m = lanes[0];
  for (int c = 1; c < 16; c++) m = lanes[c] > m ? lanes[c] : m;
  for (; j < n; j++) m = s[j] > m ? s[j] : m;
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

std::vector<array> pick(const std::vector<array>& grads, const std::vector<int>& argnums) {
  std::vector<array> out;
  for (int a : argnums) out.push_back(grads[a]);
  return out;
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
  // Gradients (training a drafter through it): those of mlx's own SDPA, which this computes.
  std::vector<array> vjp(const std::vector<array>& primals, const std::vector<array>& cotangents,
                         const std::vector<int>& argnums, const std::vector<array>&) override {
    auto fn = [this](const std::vector<array>& in) -> std::vector<array> {
      return {fast::scaled_dot_product_attention(in[0], in[1], in[2], scale_,
                                                 causal_ ? "causal" : "", {}, {}, false,
                                                 stream())};
    };
    return pick(mlx::core::vjp(fn, primals, cotangents).second, argnums);
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

// y [m, n] = x [m, k] @ w [n, k]^T (+ b [n]) through the cblas_sgemm call mlx's Matmul makes for
// nn.Linear (AddMM with a bias: the output filled with the bias rows, then added with beta 1)
void linear(const float* x, int m, int k, const float* w, const float* b, int n, float* y) {
  if (b)
    for (int r = 0; r < m; r++) std::memcpy(y + static_cast<size_t>(r) * n, b, sizeof(float) * n);
  cblas_sgemm(kRowMajor, kNoTrans, kTrans, m, n, k, 1.0f, x, k, w, k, b ? 1.0f : 0.0f, y, n);
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
      for (auto& j : jobs) linear(xp, m, k, j.w, j.b, j.n, j.y);
    });
  }

  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("linears: CPU only");
  }
  // Gradients: those of the matmuls (and bias additions) this computes.
  std::vector<array> vjp(const std::vector<array>& primals, const std::vector<array>& cotangents,
                         const std::vector<int>& argnums, const std::vector<array>&) override {
    auto fn = [this](const std::vector<array>& in) -> std::vector<array> {
      std::vector<array> outs;
      size_t at = 1;
      for (size_t i = 0; i < bias_.size(); i++) {
        auto y = matmul(in[0], transpose(in[at++], stream()), stream());
        outs.push_back(bias_[i] ? add(y, in[at++], stream()) : y);
      }
      return outs;
    };
    return pick(mlx::core::vjp(fn, primals, cotangents).second, argnums);
  }
  const char* name() const override { return "Linears"; }
  bool is_equivalent(const Primitive& other) const override {
    return bias_ == static_cast<const Linears&>(other).bias_;
  }

 private:
  std::vector<bool> bias_;
};

// RoPE (not traditional) as kernels/layers.py's ExactRoPE computes it: the first `dims`
// lanes of a head rotated in halves, (x1 * cos - x2 * sin, x1 * sin + x2 * cos), each product
// rounded before the sum (no fused multiply-add, as mlx's kernel), the other lanes copied.
struct Rope {
  int dims = 0, hq = 0, hk = 0;  // dims 0: q, k, v come as [1, H, M, D], already rotated
};

void rotate(const float* x, const float* c, const float* s, int dims, int d, float* out) {
  int half = dims / 2;
  for (int j = 0; j < half; j++) {
    float a = x[j] * c[j], b = x[half + j] * s[j];
    out[j] = a - b;
  }
  for (int j = 0; j < half; j++) {
    float a = x[j] * s[j], b = x[half + j] * c[j];
    out[half + j] = a + b;
  }
  for (int j = dims; j < d; j++) out[j] = x[j];
}

// Whether the node may write into input `a`'s buffer, as mlx's SliceUpdate does when it may
// donate it: nothing else holds the buffer and no array but this node's references `a`.
// array::is_donatable asks for one reference to `a`, but mlx gives each output of a
// multi-output node its own copy of the inputs, so here there are `outputs` of them.
// An array is one shared pointer to its descriptor (asserted), read for its count.
bool donatable(const array& a, size_t outputs) {
  static_assert(sizeof(array) == sizeof(std::shared_ptr<void>));
  auto& desc = *reinterpret_cast<const std::shared_ptr<void>*>(&a);
  return desc.use_count() == static_cast<long>(outputs) && a.data_shared_ptr().use_count() == 1 &&
         a.data_shared_ptr()->is_owned();
}

// A cache node's work (AttentionCache, DecoderLayer): per sequence, its rows' keys (rotated
// with RoPE when rope.dims) and values written into its cache buffers at its offset, then its
// rows' attention against keys 0 .. offset + rows, output rows through `o`.
struct Copy {
  const float* src;
  float* dst;
  size_t count;
};

struct CacheJob {
  std::vector<int> first, rows, offsets;
  std::vector<bool> fold;
  float scale;
  Rope rope;
  int hq, hk, m, d, dv;
  std::vector<Shape4> shapes;  // per sequence
  std::vector<View> views;     // per sequence: its key and value buffers
  std::vector<float*> bufs;
  std::vector<int> caps;
  std::vector<Copy> copies;  // buffers that could not be donated: copied before writing
  View q, kn, vn;
  const float *cs = nullptr, *sn = nullptr;
  Out o;
};

// rows given as [1, M, heads * dims] (the projections' outputs): read as [1, H, M, D]
View rowwise(const float* p, int m, int h, int dd) {
  return View{p, int64_t{m} * h * dd, dd, int64_t{h} * dd, 1};
}

// Outputs 1 .. of a cache node are the buffers of inputs at .. (one key and one value buffer
// per sequence): shared with the input where mlx may donate it, else a copy made first.
void take_buffers(CacheJob& job, const std::vector<array>& in, size_t at,
                  std::vector<array>& outs) {
  size_t n = job.first.size();
  for (size_t j = 0; j < 2 * n; j++) {
    auto& src = in[at + j];
    auto& dst = outs[1 + j];
    if (!src.flags().row_contiguous) throw std::runtime_error("attention_cache: buffer");
    if (donatable(src, outs.size())) {
      dst.copy_shared_buffer(src);
    } else {
      buffer_copies++;
      dst.set_data(allocator::malloc(dst.nbytes()));
      job.copies.push_back({src.data<float>(), dst.data<float>(), src.size()});
    }
  }
  job.d = static_cast<int>(outs[1].shape(3));
  job.dv = static_cast<int>(outs[2].shape(3));
  for (size_t i = 0; i < n; i++) {
    int cap = static_cast<int>(outs[1 + 2 * i].shape(2));
    job.caps.push_back(cap);
    job.shapes.push_back({1, job.hq, job.hk, 0, job.offsets[i] + job.rows[i], job.d, job.dv});
    for (int j = 0; j < 2; j++) {
      auto& b = outs[1 + 2 * i + j];
      job.bufs.push_back(b.data<float>());
      job.views.push_back({b.data<float>(), b.strides()[0], b.strides()[1], b.strides()[2], 1});
    }
  }
}

void run_cache_job(const CacheJob& j) {
  for (auto& c : j.copies) std::memcpy(c.dst, c.src, sizeof(float) * c.count);
  int hq = j.hq, hk = j.hk, m = j.m, d = j.d, dv = j.dv;
  std::vector<float> rotated;  // rope: q rotated, as [Hq, M, D]
  View qv = j.q;
  if (j.rope.dims) {
    rotated.resize(static_cast<size_t>(hq) * m * d);
    for (int h = 0; h < hq; h++)
      for (int l = 0; l < m; l++)
        rotate(j.q.at(0, h, l), j.cs + static_cast<size_t>(l) * (j.rope.dims / 2),
               j.sn + static_cast<size_t>(l) * (j.rope.dims / 2), j.rope.dims, d,
               &rotated[(static_cast<size_t>(h) * m + l) * d]);
    qv = View{rotated.data(), int64_t{hq} * m * d, int64_t{m} * d, d, 1};
  }
  for (size_t i = 0; i < j.first.size(); i++) {
    for (int h = 0; h < hk; h++)
      for (int l = 0; l < j.rows[i]; l++) {
        size_t at = (static_cast<size_t>(h) * j.caps[i] + j.offsets[i] + l);
        const float* ks = j.kn.at(0, h, j.first[i] + l);
        float* kd = j.bufs[2 * i] + at * d;
        if (j.rope.dims) {
          size_t row = static_cast<size_t>(j.first[i] + l) * (j.rope.dims / 2);
          rotate(ks, j.cs + row, j.sn + row, j.rope.dims, d, kd);
        } else {
          std::memcpy(kd, ks, sizeof(float) * d);
        }
        std::memcpy(j.bufs[2 * i + 1] + at * dv, j.vn.at(0, h, j.first[i] + l),
                    sizeof(float) * dv);
      }
    heads(j.shapes[i], j.first[i], j.rows[i], qv, j.views[2 * i], j.views[2 * i + 1], j.scale,
          j.rows[i] > 1, j.fold[i], 0, j.o);
  }
}

// Several sequences' KV cache writes and attention in one node. Inputs: q [1, Hq, M, D], the
// new keys k [1, Hk, M, D] and values v [1, Hk, M, Dv] of all M rows, then per sequence its
// cache buffers kb [1, Hk, cap, D] and vb [1, Hk, cap, Dv] (mlx-lm's KVCache.keys / values).
// Sequence i owns rows first_i .. +n_i: they are written at positions offset_i .. of its
// buffers (in place when mlx may donate the old buffer, as its SliceUpdate does; else into a
// copy), and its attention reads keys 0 .. offset_i + n_i of the result, exactly as sdpa on
// mlx-lm's `update_and_fetch` views. Outputs: [1, M, Hq * Dv] (o_proj's input), then every
// sequence's new kb, vb.
class AttentionCache : public Primitive {
 public:
  AttentionCache(Stream s, float scale, std::vector<int> first, std::vector<int> rows,
                 std::vector<int> offsets, std::vector<bool> fold, Rope rope)
      : Primitive(s), scale_(scale), first_(first), rows_(rows), offsets_(offsets),
        fold_(fold), rope_(rope) {}

  void eval_cpu(const std::vector<array>& in, std::vector<array>& outs) override {
    if (rope_.dims == 0) check_last_axis({in[0], in[1], in[2]});
    auto& out = outs[0];
    out.set_data(allocator::malloc(out.nbytes()));
    CacheJob job{first_, rows_, offsets_, fold_, scale_, rope_};
    job.hq = rope_.dims ? rope_.hq : static_cast<int>(in[0].shape(1));
    job.hk = rope_.dims ? rope_.hk : static_cast<int>(in[1].shape(1));
    job.m = rope_.dims ? static_cast<int>(in[0].shape(1)) : static_cast<int>(in[0].shape(2));
    take_buffers(job, in, rope_.dims ? 5 : 3, outs);  // rope: q, k, v rows, then cos and sin
    if (rope_.dims) {
      for (int j = 0; j < 5; j++)
        if (!in[j].flags().row_contiguous)
          throw std::runtime_error("attention_cache: rope inputs not contiguous");
      job.q = rowwise(in[0].data<float>(), job.m, job.hq, job.d);
      job.kn = rowwise(in[1].data<float>(), job.m, job.hk, job.d);
      job.vn = rowwise(in[2].data<float>(), job.m, job.hk, job.dv);
      job.cs = in[3].data<float>();
      job.sn = in[4].data<float>();
    } else {
      job.q = view(in[0]), job.kn = view(in[1]), job.vn = view(in[2]);
    }
    job.o = Out{out.data<float>(), job.dv, int64_t{job.hq} * job.dv};
    auto& enc = cpu::get_command_encoder(stream());
    for (auto& a : in) enc.set_input_array(a);
    for (auto& a : outs) enc.set_output_array(a);
    enc.dispatch([job = std::move(job)]() { run_cache_job(job); });
  }

  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("attention_cache: CPU only");
  }
  const char* name() const override { return "AttentionCache"; }
  bool is_equivalent(const Primitive& other) const override {
    auto& o = static_cast<const AttentionCache&>(other);
    return scale_ == o.scale_ && first_ == o.first_ && rows_ == o.rows_ &&
           offsets_ == o.offsets_ && fold_ == o.fold_ && rope_.dims == o.rope_.dims &&
           rope_.hq == o.rope_.hq && rope_.hk == o.rope_.hk;
  }

 private:
  float scale_;
  std::vector<int> first_, rows_, offsets_;
  std::vector<bool> fold_;
  Rope rope_;
};

// What every cache node checks (one buffer pair, row count, offset and fold flag per sequence,
// each with room for its rows, the rows adding up to m): appends the buffers to `inputs` and
// their shapes to `shapes`; returns each sequence's first row.
std::vector<int> cache_inputs(const char* what, std::vector<array>& inputs,
                              std::vector<Shape>& shapes, int m, int hk, int d, int dv,
                              const std::vector<array>& kbufs, const std::vector<array>& vbufs,
                              const std::vector<int>& rows, const std::vector<int>& offsets,
                              const std::vector<bool>& fold) {
  size_t n = rows.size();
  if (n == 0 || kbufs.size() != n || vbufs.size() != n || offsets.size() != n ||
      fold.size() != n)
    throw std::invalid_argument(std::string(what) + ": accepted: one key buffer, value buffer, "
                                "row count, offset and fold flag per sequence");
  std::vector<int> first;
  int at = 0;
  for (size_t i = 0; i < n; i++) {
    auto &kb = kbufs[i], &vb = vbufs[i];
    bool ok = kb.ndim() == 4 && vb.ndim() == 4 && kb.dtype() == float32 &&
              vb.dtype() == float32 && kb.shape(0) == 1 && vb.shape(0) == 1 &&
              kb.shape(1) == hk && vb.shape(1) == hk && kb.shape(3) == d && vb.shape(3) == dv &&
              kb.shape(2) == vb.shape(2) && rows[i] > 0 && offsets[i] >= 0 &&
              offsets[i] + rows[i] <= kb.shape(2);
    if (!ok)
      throw std::invalid_argument(std::string(what) + ": accepted: buffers [1,Hk,cap,D] and "
                                  "[1,Hk,cap,Dv] with room for offset + rows");
    first.push_back(at);
    at += rows[i];
    inputs.push_back(kb);
    inputs.push_back(vb);
    shapes.push_back(kb.shape());
    shapes.push_back(vb.shape());
  }
  if (at != m)
    throw std::invalid_argument(std::string(what) + ": the row counts must add up to the rows");
  return first;
}

// One node for the sequences' cache writes and attention; `heads` and `dims` are the buffers'
// head count and key/value widths.
std::vector<array> cache_node(const char* what, std::vector<array> inputs, int m, int hq, int hk,
                              int d, int dv, const std::vector<array>& kbufs,
                              const std::vector<array>& vbufs, const std::vector<int>& rows,
                              const std::vector<int>& offsets, const std::vector<bool>& fold,
                              float scale, Rope rope, StreamOrDevice s) {
  std::vector<Shape> shapes{{1, m, hq * dv}};
  auto first = cache_inputs(what, inputs, shapes, m, hk, d, dv, kbufs, vbufs, rows, offsets,
                            fold);
  std::vector<Dtype> dtypes(shapes.size(), float32);
  return array::make_arrays(
      std::move(shapes), dtypes,
      std::make_shared<AttentionCache>(to_stream(s), scale, first, rows, offsets, fold, rope),
      std::move(inputs));
}

std::vector<array> attention_cache(const array& q, const array& k, const array& v,
                                   const std::vector<array>& kbufs,
                                   const std::vector<array>& vbufs, const std::vector<int>& rows,
                                   const std::vector<int>& offsets,
                                   const std::vector<bool>& fold, float scale,
                                   StreamOrDevice s) {
  for (auto* a : {&q, &k, &v})
    if (a->ndim() != 4 || a->dtype() != float32 || a->shape(0) != 1)
      throw std::invalid_argument("attention_cache: accepted: q, k, v fp32 [1, heads, M, D]");
  if (k.shape(1) == 0 || q.shape(1) % k.shape(1) != 0 || v.shape(1) != k.shape(1) ||
      k.shape(2) != q.shape(2) || v.shape(2) != q.shape(2) || k.shape(3) != q.shape(3))
    throw std::invalid_argument("attention_cache: accepted: q [1,Hq,M,D], k [1,Hk,M,D], "
                                "v [1,Hk,M,Dv], Hq a multiple of Hk");
  return cache_node("attention_cache", {q, k, v}, q.shape(2), q.shape(1), k.shape(1),
                    k.shape(3), v.shape(3), kbufs, vbufs, rows, offsets, fold, scale, Rope{}, s);
}

// The same with RoPE applied inside: q [1, M, Hq * D], k [1, M, Hk * D], v [1, M, Hk * Dv]
// as the projections give them (or [1, M, H, D], as a q/k norm gives them), cos and sin
// [M, dims / 2] (row m's angles, at its own sequence's position).
std::vector<array> rope_attention_cache(const array& q, const array& k, const array& v,
                                        const array& cos, const array& sin, int dims,
                                        int n_heads, int n_kv_heads,
                                        const std::vector<array>& kbufs,
                                        const std::vector<array>& vbufs,
                                        const std::vector<int>& rows,
                                        const std::vector<int>& offsets,
                                        const std::vector<bool>& fold, float scale,
                                        StreamOrDevice s) {
  if (n_kv_heads <= 0 || n_heads % n_kv_heads != 0 || kbufs.empty() || vbufs.empty())
    throw std::invalid_argument("rope_attention_cache: accepted: Hq a multiple of Hk, and "
                                "key and value buffers");
  int m = q.ndim() >= 2 ? static_cast<int>(q.shape(1)) : 0;
  int d = static_cast<int>(kbufs[0].ndim() == 4 ? kbufs[0].shape(3) : 0);
  int dv = static_cast<int>(vbufs[0].ndim() == 4 ? vbufs[0].shape(3) : 0);
  for (auto* a : {&q, &k, &v, &cos, &sin})
    if (a->dtype() != float32)
      throw std::invalid_argument("rope_attention_cache: accepted: fp32 arrays");
  if (q.shape(0) != 1 || q.size() != size_t(m) * n_heads * d ||
      k.size() != size_t(m) * n_kv_heads * d || v.size() != size_t(m) * n_kv_heads * dv ||
      k.shape(1) != m || v.shape(1) != m || dims <= 0 || dims % 2 || dims > d ||
      cos.shape() != Shape{m, dims / 2} || sin.shape() != cos.shape())
    throw std::invalid_argument("rope_attention_cache: accepted: q [1,M,Hq*D], k [1,M,Hk*D], "
                                "v [1,M,Hk*Dv], cos and sin [M, dims/2], even dims <= D");
  return cache_node("rope_attention_cache", {q, k, v, cos, sin}, m, n_heads, n_kv_heads, d, dv,
                    kbufs, vbufs, rows, offsets, fold, scale, Rope{dims, n_heads, n_kv_heads}, s);
}

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

// RMSNorm of each row of x [m, n] as kernels/layers.py's ExactRMSNorm (mx.fast.rms_norm's CPU
// fallback): the squares summed from the left (mlx's Sum on this CPU), times float(1 / n),
// plus eps, 1 / sqrt, then x * that * weight, each step rounded to float.
void rms_norm(const float* x, int m, int n, const float* w, float eps, float* y) {
  float inv_n = static_cast<float>(1.0 / n);
  for (int r = 0; r < m; r++) {
    const float* xr = x + static_cast<size_t>(r) * n;
    float total = 0.0f;
    for (int j = 0; j < n; j++) total += xr[j] * xr[j];
    float f = 1.0f / std::sqrt(total * inv_n + eps);
    float* yr = y + static_cast<size_t>(r) * n;
    for (int j = 0; j < n; j++) yr[j] = xr[j] * f * w[j];
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
               std::vector<bool> fold, Rope rope)
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
  std::vector<bool> fold_;
  Rope rope_;
};

std::vector<array> decoder_layer(const array& x, const array& norm1, const array& norm2,
                                 double eps1, double eps2,
                                 const std::vector<array>& weights,
                                 const std::vector<std::optional<array>>& biases,
                                 const array& cos, const array& sin, int dims, int n_heads,
                                 int n_kv_heads, const std::vector<array>& kbufs,
                                 const std::vector<array>& vbufs, const std::vector<int>& rows,
                                 const std::vector<int>& offsets, const std::vector<bool>& fold,
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
  auto first = cache_inputs("decoder_layer", inputs, shapes, m, n_kv_heads, d, dv, kbufs, vbufs,
                            rows, offsets, fold);
  auto node = std::make_shared<DecoderLayer>(to_stream(s), has, static_cast<float>(eps1),
                                             static_cast<float>(eps2), scale, first, rows,
                                             offsets, fold, Rope{dims, n_heads, n_kv_heads});
  std::vector<Dtype> dtypes(shapes.size(), float32);
  return array::make_arrays(std::move(shapes), dtypes, node, std::move(inputs));
}

// An embedding table at its stored bits (kernels/stored.py): the rows of the token ids, widened
// by the routed kernel's own widening (adaspec_stored_values, the function the numpy gather
// calls), in one lazy node, so building the next step's graph need not wait for the ids.
class StoredRows : public Primitive {
 public:
  StoredRows(Stream s, int type, int n, int k, int64_t row_bytes)
      : Primitive(s), type_(type), n_(n), k_(k), row_bytes_(row_bytes) {}

  void eval_cpu(const std::vector<array>& in, std::vector<array>& outs) override {
    auto& ids = in[0];
    auto& out = outs[0];
    out.set_data(allocator::malloc(out.nbytes()));
    if (!ids.flags().row_contiguous) throw std::runtime_error("stored_rows: ids not contiguous");
    auto& enc = cpu::get_command_encoder(stream());
    enc.set_input_array(ids);
    enc.set_input_array(in[1]);
    enc.set_output_array(out);
    enc.dispatch([ids_p = ids.data<void>(), dt = ids.dtype(), count = ids.size(),
                  table = in[1].data<unsigned char>(), o = out.data<float>(), type = type_,
                  n = n_, k = k_, rb = row_bytes_]() {
      for (size_t i = 0; i < count; i++) {
        int64_t id = dt == int32    ? static_cast<const int32_t*>(ids_p)[i]
                     : dt == uint32 ? static_cast<const uint32_t*>(ids_p)[i]
                                    : static_cast<const int64_t*>(ids_p)[i];
        if (id < 0 || id >= n)
          throw std::out_of_range("token id " + std::to_string(id) + " out of range 0.." +
                                  std::to_string(n - 1));
        adaspec_stored_values(1, type, table + id * rb, 1, k, rb, o + i * k);
      }
    });
  }

  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("stored_rows: CPU only");
  }
  const char* name() const override { return "StoredRows"; }
  bool is_equivalent(const Primitive& other) const override {
    auto& o = static_cast<const StoredRows&>(other);
    return type_ == o.type_ && n_ == o.n_ && k_ == o.k_ && row_bytes_ == o.row_bytes_;
  }

 private:
  int type_, n_, k_;
  int64_t row_bytes_;
};

array stored_rows(const array& ids, const array& table, int type, int n, int k,
                  int64_t row_bytes, StreamOrDevice s) {
  if (ids.dtype() != int32 && ids.dtype() != uint32 && ids.dtype() != int64)
    throw std::invalid_argument("stored_rows: accepted: int32, uint32 or int64 token ids");
  if (table.nbytes() < static_cast<size_t>(n) * row_bytes || k <= 0)
    throw std::invalid_argument("stored_rows: the table holds fewer than n rows of row_bytes");
  auto shape = ids.shape();
  shape.push_back(k);
  return array(std::move(shape), float32,
               std::make_shared<StoredRows>(to_stream(s), type, n, k, row_bytes),
               {contiguous(ids, false, s), table});
}

}  // namespace

NB_MODULE(_adaspec_native, m) {
  m.def("attention_core", &attention_core, nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("scale"), nb::arg("causal"), nb::arg("fold"), nb::kw_only(),
        nb::arg("stream") = nb::none());
  m.def("stored_rows", &stored_rows, nb::arg("ids"), nb::arg("table"), nb::arg("type"),
        nb::arg("n"), nb::arg("k"), nb::arg("row_bytes"), nb::kw_only(),
        nb::arg("stream") = nb::none());
  m.def("buffer_copies", []() { return buffer_copies.load(); });
  m.def("linears", &linears, nb::arg("x"), nb::arg("weights"), nb::arg("biases"),
        nb::kw_only(), nb::arg("stream") = nb::none());
  m.def("attention_cache", &attention_cache, nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("key_buffers"), nb::arg("value_buffers"), nb::arg("rows"), nb::arg("offsets"),
        nb::arg("fold"), nb::arg("scale"), nb::kw_only(), nb::arg("stream") = nb::none());
  m.def("rope_attention_cache", &rope_attention_cache, nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("cos"), nb::arg("sin"), nb::arg("dims"), nb::arg("n_heads"),
        nb::arg("n_kv_heads"), nb::arg("key_buffers"), nb::arg("value_buffers"),
        nb::arg("rows"), nb::arg("offsets"), nb::arg("fold"), nb::arg("scale"), nb::kw_only(),
        nb::arg("stream") = nb::none());
  m.def("decoder_layer", &decoder_layer, nb::arg("x"), nb::arg("norm1"), nb::arg("norm2"),
        nb::arg("eps1"), nb::arg("eps2"), nb::arg("weights"), nb::arg("biases"), nb::arg("cos"),
        nb::arg("sin"), nb::arg("dims"), nb::arg("n_heads"), nb::arg("n_kv_heads"),
        nb::arg("key_buffers"), nb::arg("value_buffers"), nb::arg("rows"), nb::arg("offsets"),
        nb::arg("fold"), nb::arg("scale"), nb::kw_only(), nb::arg("stream") = nb::none());
  m.def("attention_rows", &attention_rows, nb::arg("q"), nb::arg("keys"), nb::arg("values"),
        nb::arg("rows"), nb::arg("fold"), nb::arg("scale"), nb::kw_only(),
        nb::arg("stream") = nb::none());
}
