// RoPE's cos/sin tables [T, D/2] for a step's positions: the CPU kernel behind models/layers.py's apply_rope.
//
// Why: XLA:CPU fuses cos(position * inv_freq) into the rotation of every head and output element, so a layer
// evaluated T * H * D transcendentals instead of T * D / 2 (3.5 ms of a 60 ms batch-32 int8 decode step for
// SmolLM2; an optimization barrier does not survive XLA:CPU's pipeline). A custom call's results are materialized.

#include <cmath>
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error RopeTablesCpu(ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::F32> inv_freq,
                         ffi::ResultBuffer<ffi::F32> cos, ffi::ResultBuffer<ffi::F32> sin) {
  const int64_t t = positions.element_count(), h = inv_freq.element_count();
  if (cos->element_count() != t * h || sin->element_count() != t * h)
    return ffi::Error::InvalidArgument("rope_tables_cpu: results must be [T, D/2]");
  const int32_t* pos = positions.typed_data();
  const float* freq = inv_freq.typed_data();
  float* c = cos->typed_data();
  float* s = sin->typed_data();
  for (int64_t i = 0; i < t; ++i)
    for (int64_t j = 0; j < h; ++j) {
      const float angle = static_cast<float>(pos[i]) * freq[j];
      c[i * h + j] = std::cos(angle);
      s[i * h + j] = std::sin(angle);
    }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagejaxRopeTablesCpu, RopeTablesCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions [T]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // inv_freq [D/2]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // cos [T, D/2]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // sin [T, D/2]
