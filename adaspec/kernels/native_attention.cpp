// Attention on the CPU in one mlx graph node (AttentionCore), with the bits of mlx's fast.cpp
// fallback for `mx.fast.scaled_dot_product_attention`: the query scaled, q @ k^T and probs @ v
// through the same cblas_sgemm calls mlx's Matmul makes (the routed kernel: the same rows,
// transposes and leading dimensions), the causal mask as fast.cpp writes it (or an array mask
// as it applies one), and softmax as softmax.cpp computes it (row max, mlx's exp polynomial
// with fused multiply-adds, the sum from the left, times 1 / sum). `heads` is the attention of
// every native node (native_kv_attention.cpp and native_decoder_layer.cpp call it too).
#include "native.h"

#include <dlfcn.h>

namespace adaspec_native {

namespace {

// softmax.cpp's softmax of one row in place: max, exp(x - max), sum from the left, * (1/sum)
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

// fast.cpp's array mask on one row of scores: query head h, query row l of batch row b
void apply_mask(const Mask& mk, int64_t b, int64_t h, int64_t l, float* s, int n) {
  auto at = b * mk.s0 + h * mk.s1 + l * mk.s2;
  if (mk.boolean) {
    auto m = static_cast<const bool*>(mk.p) + at;
    for (int j = 0; j < n; j++) s[j] = m[j * mk.s3] ? s[j] : -FLT_MAX;
  } else {
    auto m = static_cast<const float*>(mk.p) + at;
    for (int j = 0; j < n; j++) s[j] = s[j] + m[j * mk.s3];
  }
}

// One KV head's query rows (query heads h*rep+r0 .. +reps, each rows l0 .. l0+n of q) against
// keys 0..S of k and v, as mlx's fallback computes them; its output rows stored through `out`.
void head(const Shape4& d, int l0, int n, const View& q, const View& k, const View& v,
          float scale, bool causal, const Mask* mask, int b, int h, int r0, int reps,
          const Out& out, std::vector<float>& qs, std::vector<float>& sc,
          std::vector<float>& res) {
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
    } else if (mask) {
      apply_mask(*mask, b, h * rep + r0 + i / n, l0 + i % n, s, d.S);
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

class AttentionCore : public Primitive {
 public:
  AttentionCore(Stream s, float scale, bool causal, int fold)
      : Primitive(s), scale_(scale), causal_(causal), fold_(fold) {}

  void eval_cpu(const std::vector<array>& in, std::vector<array>& outs) override {
    auto& out = outs[0];
    out.set_data(allocator::malloc(out.nbytes()));
    check_last_axis({in[0], in[1], in[2]});
    Shape4 d{static_cast<int>(in[0].shape(0)), static_cast<int>(in[0].shape(1)),
             static_cast<int>(in[1].shape(1)), static_cast<int>(in[0].shape(2)),
             static_cast<int>(in[1].shape(2)), static_cast<int>(in[0].shape(3)),
             static_cast<int>(in[2].shape(3))};
    View q = view(in[0]), k = view(in[1]), v = view(in[2]);
    std::optional<Mask> mask;
    if (in.size() > 3) {
      auto& m = in[3];
      auto& st = m.strides();
      mask = Mask{m.data<void>(), m.dtype() == bool_, st[0], st[1], st[2], st[3]};
    }
    float* o = out.data<float>();
    float scale = scale_;
    bool causal = causal_;
    int fold = fold_;
    auto& enc = cpu::get_command_encoder(stream());
    for (auto& a : in) enc.set_input_array(a);
    enc.set_output_array(out);
    enc.dispatch([=]() {
      for (int b = 0; b < d.B; b++) {
        Out out{o + static_cast<size_t>(b) * d.Hq * d.L * d.Dv, int64_t{d.L} * d.Dv, d.Dv};
        heads(d, 0, d.L, q, k, v, scale, causal, mask ? &*mask : nullptr, fold, b, out);
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
      bool masked = in.size() > 3;
      auto mode = causal_ ? "causal" : masked ? "array" : "";
      std::optional<array> mask = masked ? std::optional<array>(in[3]) : std::nullopt;
      return {fast::scaled_dot_product_attention(in[0], in[1], in[2], scale_, mode, mask, {},
                                                 false, stream())};
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
  bool causal_;
  int fold_;
};

}  // namespace

namespace {

// The routed BLAS's adaspec_split2 (kernels/blas_route.c: a function's two halves on its two
// threads), or null where it is not loaded
using Split2 = void (*)(void (*)(void*, int), void*);
Split2 split2() {
  static Split2 f = reinterpret_cast<Split2>(dlsym(RTLD_DEFAULT, "adaspec_split2"));
  return f;
}

// Multiply-adds of a node's attention from which its heads are shared by two threads: below,
// the hand-off costs about what it saves
constexpr int64_t kSplitWork = int64_t{1} << 16;

// What `heads` does, as units (a KV head, its first query head, up to `fold` of them): units
// [0, cut) are one half, the rest the other
struct HeadUnits {
  const Shape4& d;
  int l0, n;
  const View &q, &k, &v;
  float scale;
  bool causal;
  const Mask* mask;
  int fold, b;
  const Out& out;
  std::vector<std::pair<int, int>> units;
  size_t cut;

  void run(size_t from, size_t to) const {
    std::vector<float> qs, sc, res;
    int rep = d.Hq / d.Hk;
    for (size_t i = from; i < to; i++) {
      auto [h, r] = units[i];
      head(d, l0, n, q, k, v, scale, causal, mask, b, h, r, std::min(fold, rep - r), out, qs, sc,
           res);
    }
  }
  static void half(void* self, int second) {
    auto& u = *static_cast<const HeadUnits*>(self);
    second ? u.run(u.cut, u.units.size()) : u.run(0, u.cut);
  }
};

}  // namespace

// Every head's attention, each exactly as `head` computes it alone: with enough work, half the
// query heads on each of the routed BLAS's two threads (each head's GEMMs then on its thread
// alone). A smaller fold takes fewer query heads per GEMM, with the same bits, where the units
// would not halve (SmolLM2: 3 query heads a KV head, 3 KV heads).
void heads(const Shape4& d, int l0, int n, const View& q, const View& k, const View& v,
           float scale, bool causal, const Mask* mask, int fold, int b, const Out& out) {
  int rep = d.Hq / d.Hk;
  Split2 two = int64_t{d.Hq} * n * d.S * (d.D + d.Dv) >= kSplitWork ? split2() : nullptr;
  auto units_of = [&](int f) {
    std::vector<std::pair<int, int>> u;
    for (int h = 0; h < d.Hk; h++)
      for (int r = 0; r < rep; r += f) u.push_back({h, r});
    return u;
  };
  auto units = units_of(fold);
  while (two && units.size() % 2 && fold > 1) units = units_of(fold = (fold + 1) / 2);
  HeadUnits job{d, l0, n, q, k, v, scale, causal, mask, fold, b, out, std::move(units), 0};
  if (!two || job.units.size() < 2) {
    job.run(0, job.units.size());
    return;
  }
  for (int taken = 0; 2 * taken < d.Hq; job.cut++)  // the first half of the query heads
    taken += std::min(fold, rep - job.units[job.cut].second);
  two(&HeadUnits::half, &job);
}

void check_fold(const char* what, int fold, int hq, int hk) {
  if (fold < 1 || fold > hq / hk)
    throw std::invalid_argument(std::string(what) + ": fold " + std::to_string(fold) +
                                "; accepted: 1 to " + std::to_string(hq / hk) +
                                " query heads per GEMM");
}

array attention_core(const array& q, const array& k, const array& v, float scale, bool causal,
                     int fold, const std::optional<array>& mask, StreamOrDevice s) {
  for (auto* a : {&q, &k, &v})
    if (a->ndim() != 4 || a->dtype() != float32)
      throw std::invalid_argument("attention_core: accepted: fp32 arrays of rank 4");
  if (k.shape(1) == 0 || q.shape(1) % k.shape(1) != 0 || k.shape(2) != v.shape(2) ||
      q.shape(3) != k.shape(3) || q.shape(0) != k.shape(0) || v.shape(1) != k.shape(1))
    throw std::invalid_argument("attention_core: accepted: q [B,Hq,L,D], k [B,Hk,S,D], "
                                "v [B,Hk,S,Dv] with Hq a multiple of Hk");
  check_fold("attention_core", fold, q.shape(1), k.shape(1));
  if (causal && q.shape(2) > k.shape(2))
    throw std::invalid_argument("attention_core: causal needs at least as many keys as rows");
  std::vector<array> inputs{q, k, v};
  if (mask) {
    Shape full{q.shape(0), q.shape(1), q.shape(2), k.shape(2)};
    if (causal || (mask->dtype() != bool_ && mask->dtype() != float32) || mask->ndim() > 4)
      throw std::invalid_argument("attention_core: accepted: a bool or fp32 mask of rank <= 4, "
                                  "not with causal");
    inputs.push_back(broadcast_to(*mask, full, s));  // a view: strides 0 where broadcast
  }
  Shape shape{q.shape(0), q.shape(1), q.shape(2), v.shape(3)};
  return array(shape, float32, std::make_shared<AttentionCore>(to_stream(s), scale, causal, fold),
               std::move(inputs));
}

}  // namespace adaspec_native
