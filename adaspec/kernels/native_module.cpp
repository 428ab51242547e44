// The Python module of adaspec's mlx primitives (kernels/native.py builds and loads it): each
// constructor as mlx's own Python functions take their arguments, arrays crossing as mlx's
// (nanobind, domain `mlx`).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "native.h"

namespace nb = nanobind;
using namespace adaspec_native;

NB_MODULE(_adaspec_native, m) {
  m.def("attention_core", &attention_core, nb::arg("q"), nb::arg("k"), nb::arg("v"),
        nb::arg("scale"), nb::arg("causal"), nb::arg("fold"), nb::arg("mask") = nb::none(),
        nb::kw_only(), nb::arg("stream") = nb::none());
  m.def("stored_rows", &stored_rows, nb::arg("ids"), nb::arg("table"), nb::arg("type"),
        nb::arg("n"), nb::arg("k"), nb::arg("row_bytes"), nb::kw_only(),
        nb::arg("stream") = nb::none());
  m.def("buffer_copies", []() { return buffer_copies.load(); });
  m.def("linears", &linears, nb::arg("x"), nb::arg("weights"), nb::arg("biases"),
        nb::kw_only(), nb::arg("stream") = nb::none());
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
  nb::class_<DecoderStack>(m, "DecoderStack")
      .def(nb::init<const std::vector<array>&, const std::vector<array>&,
                    const std::vector<double>&, const std::vector<double>&,
                    const std::vector<std::vector<array>>&,
                    const std::vector<std::vector<std::optional<array>>>&, int, int, int,
                    float>(),
           nb::arg("norm1"), nb::arg("norm2"), nb::arg("eps1"), nb::arg("eps2"),
           nb::arg("weights"), nb::arg("biases"), nb::arg("dims"), nb::arg("n_heads"),
           nb::arg("n_kv_heads"), nb::arg("scale"))
      .def("__call__", &DecoderStack::operator(), nb::arg("x"), nb::arg("key_buffers"),
           nb::arg("value_buffers"), nb::arg("rows"), nb::arg("offset"), nb::arg("fold"),
           nb::arg("cos"), nb::arg("sin"), nb::kw_only(), nb::arg("stream") = nb::none())
      .def("__len__", &DecoderStack::size);
}
