// Several projections of one input in one mlx graph node (Linears), each through the GEMM
// call mlx's Matmul makes for nn.Linear; `linear` is that call, for native_decoder_layer.cpp too.
#include "native.h"

namespace adaspec_native {

void linear(const float* x, int m, int k, const float* w, const float* b, int n, float* y) {
  if (b)
    for (int r = 0; r < m; r++) std::memcpy(y + static_cast<size_t>(r) * n, b, sizeof(float) * n);
  cblas_sgemm(kRowMajor, kNoTrans, kTrans, m, n, k, 1.0f, x, k, w, k, b ? 1.0f : 0.0f, y, n);
}

namespace {

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
    auto& enc = encoder_for(stream(), in, outs);
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

}  // namespace

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

}  // namespace adaspec_native
