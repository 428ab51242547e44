// An embedding table at its stored bits, gathered in one lazy mlx graph node (StoredRows).
#include "native.h"

namespace adaspec_native {

namespace {

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

}  // namespace

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

}  // namespace adaspec_native
