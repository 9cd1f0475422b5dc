// Write token rows into their cache slots in place: the CPU kernel behind kernels_pallas/kv_cache/writes.py's write_rows.
//
// Why: the portable write is a while loop of dynamic_update_slice (a scatter made XLA copy the whole cache, see
// kv_cache/writes.py); on XLA:CPU each loop costs ~0.1 ms of fixed overhead per layer, 3-4 ms of a ~15 ms batch-1 int8
// decode step for SmolLM2's 30 layers. Here it is one memcpy per token and head. The output aliases the array
// operand (input_output_aliases), so XLA hands over the cache's own buffer; if it ever does not, it is copied first.
//
// The array is read as [H, N] (H = rows' second axis: KV heads of a head-major cache, 1 for MLA's latent pages);
// rows are [T, H, W]; row t of head h goes to elements [offsets[t], offsets[t] + W) of head h. Offsets outside
// [0, N - W] are padding and are skipped, so no write leaves the buffer.

#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error WriteRowsCpu(ffi::AnyBuffer array, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> offsets,
                        ffi::Result<ffi::AnyBuffer> out) {
  const auto rdims = rows.dimensions();
  if (rdims.size() != 3 || rows.element_type() != array.element_type() || out->size_bytes() != array.size_bytes())
    return ffi::Error::InvalidArgument("write_rows_cpu: rows [T, H, W] of the array's dtype expected");
  const int64_t count = rdims[0], heads = rdims[1], width = rdims[2];
  if (offsets.element_count() != count || heads < 1 || array.element_count() % heads)
    return ffi::Error::InvalidArgument("write_rows_cpu: offsets [T] and an array of H * N elements expected");
  const int64_t per_head = array.element_count() / heads;
  const size_t elem = array.element_count() ? array.size_bytes() / array.element_count() : 1;
  auto* dst = static_cast<uint8_t*>(out->untyped_data());
  if (dst != array.untyped_data()) std::memcpy(dst, array.untyped_data(), array.size_bytes());
  const auto* src = static_cast<const uint8_t*>(rows.untyped_data());
  const int32_t* offset = offsets.typed_data();
  const size_t row_bytes = width * elem;
  for (int64_t t = 0; t < count; ++t) {
    if (offset[t] < 0 || offset[t] > per_head - width) continue;
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(dst + (h * per_head + offset[t]) * elem, src + (t * heads + h) * row_bytes, row_bytes);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagejaxWriteRowsCpu, WriteRowsCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // array [H, ...] (aliased by the result)
                                  .Arg<ffi::AnyBuffer>()         // rows [T, H, W]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // offsets [T], elements into each head's slab
                                  .Ret<ffi::AnyBuffer>());       // the updated array
