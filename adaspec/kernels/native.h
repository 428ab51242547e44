// What adaspec's mlx primitives (kernels/native.py builds them, one file per primitive:
// native_attention.cpp, native_kv_attention.cpp, native_linears.cpp, native_decoder_layer.cpp,
// native_stored_rows.cpp; native_module.cpp binds them) share: mlx's exp and softmax, the
// attention of one KV head's query rows, the cache writes of the nodes that own a KV cache,
// and the GEMM call mlx's Matmul makes for nn.Linear.
#pragma once

#include <array>
#include <atomic>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/fast.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "mlx/transforms.h"

extern "C" void adaspec_stored_values(int vector, int type, const unsigned char* src, int rows,
                                      int k, long row_bytes, float* out);  // the router's
extern "C" void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k,
                            float alpha, const float* a, int lda, const float* b, int ldb,
                            float beta, float* c, int ldc);

namespace adaspec_native {

using namespace mlx::core;

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
// cache buffers copied because mlx could not donate them (native_kv_attention.cpp)
inline std::atomic<long> buffer_copies{0};

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

struct View {  // a rank-4 fp32 array's data and element strides
  const float* p;
  int64_t s0, s1, s2, s3;
  const float* at(int64_t b, int64_t h, int64_t r) const { return p + b * s0 + h * s1 + r * s2; }
};

inline View view(const array& a) {
  auto& st = a.strides();
  return {a.data<float>(), st[0], st[1], st[2], st[3]};
}

// rows given as [1, M, heads * dims] (the projections' outputs): read as [1, H, M, D]
inline View rowwise(const float* p, int m, int h, int dd) {
  return View{p, int64_t{m} * h * dd, dd, int64_t{h} * dd, 1};
}

// An array mask broadcast to [B, Hq, L, S] (any strides): a boolean keeps a score where true
// (`where(mask, scores, finfo.min)`), an fp32 one is added, as mlx's fast.cpp applies them.
struct Mask {
  const void* p = nullptr;
  bool boolean = false;
  int64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
};

struct Shape4 {
  int B, Hq, Hk, L, S, D, Dv;
};

struct Out {  // where a head's output rows go: o + head * sh + row * sr
  float* o;
  int64_t sh, sr;
};

// Every KV head of batch row b against keys 0..S of k and v, query rows l0 .. l0 + n of q:
// as adaspec's attention computes them (the query scaled, q @ k^T, the causal or array mask,
// softmax, @ v), with `fold` query heads of a KV head as the rows of one GEMM (1: one query
// head at a time); output rows stored through `out` (native_attention.cpp).
void heads(const Shape4& d, int l0, int n, const View& q, const View& k, const View& v,
           float scale, bool causal, const Mask* mask, int fold, int b, const Out& out);

inline void check_last_axis(const std::vector<array>& in) {
  for (auto& a : in)
    if (a.strides()[3] != 1) throw std::runtime_error("attention: last axis strided");
}

inline std::vector<array> pick(const std::vector<array>& grads, const std::vector<int>& argnums) {
  std::vector<array> out;
  for (int a : argnums) out.push_back(grads[a]);
  return out;
}

// y [m, n] = x [m, k] @ w [n, k]^T (+ b [n]) through the cblas_sgemm call mlx's Matmul makes
// for nn.Linear (AddMM with a bias: the output filled with the bias rows, then added with
// beta 1) (native_linears.cpp)
void linear(const float* x, int m, int k, const float* w, const float* b, int n, float* y);

// RoPE (not traditional) in a cache node: the rotated lanes and the query and KV heads
struct Rope {
  int dims = 0, hq = 0, hk = 0;
};

struct Copy {
  const float* src;
  float* dst;
  size_t count;
};

// A cache node's work (native_kv_attention.cpp, native_decoder_layer.cpp): per sequence, its
// rows' keys (rotated with RoPE) and values written into its cache buffers at its offset, then
// its rows' attention against keys 0 .. offset + rows, output rows through `o`.
struct CacheJob {
  std::vector<int> first, rows, offsets;
  std::vector<int> fold;
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

// Outputs out_at .. of a cache node are the buffers of inputs at .. (one key and one value
// buffer per sequence): shared with the input where mlx may donate it, else a copy made first.
void take_buffers(CacheJob& job, const std::vector<array>& in, size_t at,
                  std::vector<array>& outs, size_t out_at = 1);
void run_cache_job(const CacheJob& j);
// What every cache node checks (one buffer pair, row count, offset and fold per sequence,
// each with room for its rows, the rows adding up to m): appends the buffers to `inputs` and
// their shapes to `shapes`; returns each sequence's first row.
std::vector<int> cache_inputs(const char* what, std::vector<array>& inputs,
                              std::vector<Shape>& shapes, int m, int hq, int hk, int d, int dv,
                              const std::vector<array>& kbufs, const std::vector<array>& vbufs,
                              const std::vector<int>& rows, const std::vector<int>& offsets,
                              const std::vector<int>& fold);

// The stream's CPU encoder with every input and output of a node registered, to dispatch its
// work on.
inline cpu::CommandEncoder& encoder_for(Stream stream, const std::vector<array>& in,
                                        std::vector<array>& outs) {
  auto& enc = cpu::get_command_encoder(stream);
  for (auto& a : in) enc.set_input_array(a);
  for (auto& a : outs) enc.set_output_array(a);
  return enc;
}

// An error naming `fold` unless it is 1 to hq / hk query heads per GEMM.
void check_fold(const char* what, int fold, int hq, int hk);

// The primitives' constructors, as native_module.cpp binds them.
array attention_core(const array& q, const array& k, const array& v, float scale, bool causal,
                     int fold, const std::optional<array>& mask, StreamOrDevice s);
std::vector<array> rope_attention_cache(const array& q, const array& k, const array& v,
                                        const array& cos, const array& sin, int dims,
                                        int n_heads, int n_kv_heads,
                                        const std::vector<array>& kbufs,
                                        const std::vector<array>& vbufs,
                                        const std::vector<int>& rows,
                                        const std::vector<int>& offsets,
                                        const std::vector<int>& fold, float scale,
                                        StreamOrDevice s);
std::vector<array> linears(const array& x, const std::vector<array>& weights,
                           const std::vector<std::optional<array>>& biases, StreamOrDevice s);
std::vector<array> decoder_layer(const array& x, const array& norm1, const array& norm2,
                                 double eps1, double eps2, const std::vector<array>& weights,
                                 const std::vector<std::optional<array>>& biases,
                                 const array& cos, const array& sin, int dims, int n_heads,
                                 int n_kv_heads, const std::vector<array>& kbufs,
                                 const std::vector<array>& vbufs, const std::vector<int>& rows,
                                 const std::vector<int>& offsets, const std::vector<int>& fold,
                                 float scale, StreamOrDevice s);

// A llama / qwen2 model's decoder layers, their weights held once (kernels/native_stack.py
// makes one per model): a call makes one graph node (DecoderLayers) that runs every layer on
// the output of the one before, each with the bits of its DecoderLayer node (one sequence;
// every layer's cache at the same offset). Returns the last layer's output, then each layer's
// new key and value buffers.
struct StackWeights {  // what a stack's node reads: per layer its norm weights and each
  std::vector<array> arrays;  // weight followed by its bias (where it has one)
  std::vector<std::vector<bool>> bias;
  std::vector<float> eps1, eps2;
};

class DecoderStack {
 public:
  DecoderStack(const std::vector<array>& norm1, const std::vector<array>& norm2,
               const std::vector<double>& eps1, const std::vector<double>& eps2,
               const std::vector<std::vector<array>>& weights,
               const std::vector<std::vector<std::optional<array>>>& biases, int dims,
               int n_heads, int n_kv_heads, float scale);
  std::vector<array> operator()(const array& x, const std::vector<array>& kbufs,
                                const std::vector<array>& vbufs, int rows, int offset,
                                int fold, const array& cos, const array& sin,
                                StreamOrDevice s) const;
  size_t size() const { return layers_.size(); }

 private:
  struct Layer {
    array norm1, norm2;
    double eps1, eps2;
    std::vector<array> weights;
    std::vector<std::optional<array>> biases;
  };
  std::vector<Layer> layers_;
  std::shared_ptr<const StackWeights> held_;  // shared with every node made
  mutable std::array<int, 3> checked_{-1, -1, -1};  // (H, D, Dv) every layer was checked for
  int dims_, n_heads_, n_kv_heads_;
  float scale_;
};
array stored_rows(const array& ids, const array& table, int type, int n, int k,
                  int64_t row_bytes, StreamOrDevice s);

}  // namespace adaspec_native
