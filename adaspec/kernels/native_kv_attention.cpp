// RoPE, the KV cache writes and attention of one or several sequences in one mlx graph node
// (AttentionCache): ExactRoPE's arithmetic (kernels/layers.py) on its shared angles, mlx-lm's
// KVCache layout (written in place where mlx may donate the old buffer, as its SliceUpdate
// does) and the attention of native_attention.cpp. The cache work here is shared with
// native_decoder_layer.cpp.
#include "native.h"

#include <climits>
#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace adaspec_native {

namespace {

// RoPE (not traditional) as kernels/layers.py's ExactRoPE computes it: the first `dims`
// lanes of a head rotated in halves, (x1 * cos - x2 * sin, x1 * sin + x2 * cos), each product
// rounded before the sum (no fused multiply-add, as mlx's kernel), the other lanes copied.
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

// Whether no array but this node's references `a` (and its buffer is its own); with nothing
// else holding the buffer, the node may write into it, as mlx's SliceUpdate does when it may
// donate it (writable).
// array::is_donatable asks for one reference to `a`, but mlx gives each output of a
// multi-output node its own copy of the inputs, so here there are `outputs` of them.
// An array is one shared pointer to its descriptor (asserted), read for its count.
bool only_this_node_refers(const array& a, size_t outputs) {
  static_assert(sizeof(array) == sizeof(std::shared_ptr<void>));
  auto& desc = *reinterpret_cast<const std::shared_ptr<void>*>(&a);
  return desc.use_count() == static_cast<long>(outputs) && a.data_shared_ptr()->is_owned();
}

// Where the rows of a cache buffer end that any array holding it may read: the end of the rows
// a cache node last wrote into it (offset + rows), by the buffer's data, with the node's output
// array that holds it. Once a node has written a buffer (in place or into a copy) every earlier
// holder of it saw the cache at most that far, and rows from there on are unwritten for all of
// them; while that output is the array a later node is given, nothing else wrote it since (an
// op writing it in place would have needed the only reference to that output).
struct Written {
  std::weak_ptr<array::Data> data;
  int end;
  std::uintptr_t output;
};
std::mutex written_mu;
std::unordered_map<const void*, Written> written;
size_t written_swept = 64;

int written_end(const array& a) {
  std::lock_guard<std::mutex> lock(written_mu);
  auto it = written.find(a.data_shared_ptr().get());
  if (it == written.end() || it->second.output != a.id() ||
      it->second.data.lock() != a.data_shared_ptr())
    return INT_MAX;
  return it->second.end;
}

void note_written(const array& a, int end) {
  std::lock_guard<std::mutex> lock(written_mu);
  written[a.data_shared_ptr().get()] = {a.data_shared_ptr(), end, a.id()};
  if (written.size() > 2 * written_swept) {  // forget the buffers that are gone
    std::erase_if(written, [](const auto& e) { return e.second.data.expired(); });
    written_swept = std::max<size_t>(64, written.size());
  }
}

// Whether a node writing rows from `offset` on may write into buffer `a` in place: donatable
// (nothing else holds the buffer), or `a` is still being made by an eval in flight and the rows are past every row written so
// far. An eval in flight holds its nodes' inputs and outputs until the stream has run it (only
// so that they are not freed), so a buffer is never donatable then; mlx_lm's decoding loop
// evaluates step n + 1's graph while step n runs, and every layer's cache was copied at every
// step (SmolLM2-135M, 200 tokens: 56 copies a step, 5% of the process's time, growing with
// the context). Writing past the end no holder reads changes nothing any holder sees. After
// a rollback (rows rewritten), only a donatable buffer is written in place.
bool writable(const array& a, size_t outputs, int offset) {
  return only_this_node_refers(a, outputs) &&
         (a.data_shared_ptr().use_count() == 1 ||
          (!a.is_available() && offset >= written_end(a)));
}

// Several sequences' RoPE, KV cache writes and attention in one node. Inputs: q [1, M, Hq * D],
// k [1, M, Hk * D], v [1, M, Hk * Dv] as the projections give them (or [1, M, H, D], as a
// q/k norm gives them), cos and sin [M, dims / 2] (row m's angles, at its own sequence's
// position), then per sequence its cache buffers kb [1, Hk, cap, D] and vb [1, Hk, cap, Dv]
// (mlx-lm's KVCache.keys / values). Sequence i owns rows first_i .. +n_i: they are written at
// positions offset_i .. of its buffers (in place when mlx may donate the old buffer; else into
// a copy), and its attention reads keys 0 .. offset_i + n_i of the result, exactly as mlx's
// attention on mlx-lm's `update_and_fetch` views. Outputs: [1, M, Hq * Dv] (o_proj's input),
// then every sequence's new kb, vb.
class AttentionCache : public Primitive {
 public:
  AttentionCache(Stream s, float scale, std::vector<int> first, std::vector<int> rows,
                 std::vector<int> offsets, std::vector<int> fold, Rope rope)
      : Primitive(s), scale_(scale), first_(first), rows_(rows), offsets_(offsets),
        fold_(fold), rope_(rope) {}

  void eval_cpu(const std::vector<array>& in, std::vector<array>& outs) override {
    auto& out = outs[0];
    out.set_data(allocator::malloc(out.nbytes()));
    CacheJob job{first_, rows_, offsets_, fold_, scale_, rope_};
    job.hq = rope_.hq, job.hk = rope_.hk, job.m = static_cast<int>(in[0].shape(1));
    take_buffers(job, in, 5, outs);  // q, k, v rows, then cos and sin
    for (int j = 0; j < 5; j++)
      if (!in[j].flags().row_contiguous)
        throw std::runtime_error("rope_attention_cache: inputs not contiguous");
    job.q = rowwise(in[0].data<float>(), job.m, job.hq, job.d);
    job.kn = rowwise(in[1].data<float>(), job.m, job.hk, job.d);
    job.vn = rowwise(in[2].data<float>(), job.m, job.hk, job.dv);
    job.cs = in[3].data<float>();
    job.sn = in[4].data<float>();
    job.o = Out{out.data<float>(), job.dv, int64_t{job.hq} * job.dv};
    auto& enc = encoder_for(stream(), in, outs);
    enc.dispatch([job = std::move(job)]() { run_cache_job(job); });
  }

  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("rope_attention_cache: CPU only");
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
  std::vector<int> fold_;
  Rope rope_;
};

}  // namespace

void take_buffers(CacheJob& job, const std::vector<array>& in, size_t at,
                  std::vector<array>& outs, size_t out_at) {
  size_t n = job.first.size();
  for (size_t j = 0; j < 2 * n; j++) {
    auto& src = in[at + j];
    auto& dst = outs[out_at + j];
    if (!src.flags().row_contiguous) throw std::runtime_error("cache node: buffer not contiguous");
    if (writable(src, outs.size(), job.offsets[j / 2])) {
      dst.copy_shared_buffer(src);
    } else {
      buffer_copies++;
      dst.set_data(allocator::malloc(dst.nbytes()));
      job.copies.push_back({src.data<float>(), dst.data<float>(), src.size()});
    }
    note_written(dst, job.offsets[j / 2] + job.rows[j / 2]);
  }
  job.d = static_cast<int>(outs[out_at].shape(3));
  job.dv = static_cast<int>(outs[out_at + 1].shape(3));
  for (size_t i = 0; i < n; i++) {
    int cap = static_cast<int>(outs[out_at + 2 * i].shape(2));
    job.caps.push_back(cap);
    job.shapes.push_back({1, job.hq, job.hk, 0, job.offsets[i] + job.rows[i], job.d, job.dv});
    for (int j = 0; j < 2; j++) {
      auto& b = outs[out_at + 2 * i + j];
      job.bufs.push_back(b.data<float>());
      job.views.push_back({b.data<float>(), b.strides()[0], b.strides()[1], b.strides()[2], 1});
    }
  }
}

void run_cache_job(const CacheJob& j) {
  for (auto& c : j.copies) std::memcpy(c.dst, c.src, sizeof(float) * c.count);
  int hq = j.hq, hk = j.hk, m = j.m, d = j.d, dv = j.dv;
  std::vector<float> rotated(static_cast<size_t>(hq) * m * d);  // q rotated, as [Hq, M, D]
  for (int h = 0; h < hq; h++)
    for (int l = 0; l < m; l++)
      rotate(j.q.at(0, h, l), j.cs + static_cast<size_t>(l) * (j.rope.dims / 2),
             j.sn + static_cast<size_t>(l) * (j.rope.dims / 2), j.rope.dims, d,
             &rotated[(static_cast<size_t>(h) * m + l) * d]);
  View qv{rotated.data(), int64_t{hq} * m * d, int64_t{m} * d, d, 1};
  for (size_t i = 0; i < j.first.size(); i++) {
    for (int h = 0; h < hk; h++)
      for (int l = 0; l < j.rows[i]; l++) {
        size_t at = (static_cast<size_t>(h) * j.caps[i] + j.offsets[i] + l);
        const float* ks = j.kn.at(0, h, j.first[i] + l);
        float* kd = j.bufs[2 * i] + at * d;
        size_t row = static_cast<size_t>(j.first[i] + l) * (j.rope.dims / 2);
        rotate(ks, j.cs + row, j.sn + row, j.rope.dims, d, kd);
        std::memcpy(j.bufs[2 * i + 1] + at * dv, j.vn.at(0, h, j.first[i] + l),
                    sizeof(float) * dv);
      }
    heads(j.shapes[i], j.first[i], j.rows[i], qv, j.views[2 * i], j.views[2 * i + 1], j.scale,
          j.rows[i] > 1, nullptr, j.fold[i], 0, j.o);
  }
}

std::vector<int> cache_inputs(const char* what, std::vector<array>& inputs,
                              std::vector<Shape>& shapes, int m, int hq, int hk, int d, int dv,
                              const std::vector<array>& kbufs, const std::vector<array>& vbufs,
                              const std::vector<int>& rows, const std::vector<int>& offsets,
                              const std::vector<int>& fold) {
  size_t n = rows.size();
  if (n == 0 || kbufs.size() != n || vbufs.size() != n || offsets.size() != n ||
      fold.size() != n)
    throw std::invalid_argument(std::string(what) + ": accepted: one key buffer, value buffer, "
                                "row count, offset and fold per sequence");
  std::vector<int> first;
  int at = 0;
  for (size_t i = 0; i < n; i++) {
    check_fold(what, fold[i], hq, hk);
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

std::vector<array> rope_attention_cache(const array& q, const array& k, const array& v,
                                        const array& cos, const array& sin, int dims,
                                        int n_heads, int n_kv_heads,
                                        const std::vector<array>& kbufs,
                                        const std::vector<array>& vbufs,
                                        const std::vector<int>& rows,
                                        const std::vector<int>& offsets,
                                        const std::vector<int>& fold, float scale,
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
  std::vector<array> inputs{q, k, v, cos, sin};
  std::vector<Shape> shapes{{1, m, n_heads * dv}};
  auto first = cache_inputs("rope_attention_cache", inputs, shapes, m, n_heads, n_kv_heads, d, dv, kbufs,
                            vbufs, rows, offsets, fold);
  std::vector<Dtype> dtypes(shapes.size(), float32);
  auto node = std::make_shared<AttentionCache>(to_stream(s), scale, first, rows, offsets, fold,
                                               Rope{dims, n_heads, n_kv_heads});
  return array::make_arrays(std::move(shapes), dtypes, node, std::move(inputs));
}

}  // namespace adaspec_native
