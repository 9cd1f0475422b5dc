// Write token rows into their page slots in place: the CPU kernel behind kernels_pallas/kv_cache.py's write_rows.
//
// Why: the portable write is a while loop of dynamic_update_slice (a scatter made XLA copy the whole cache, see
// kv_cache.py); on XLA:CPU each loop costs ~0.1 ms of fixed overhead per layer, 3-4 ms of a ~15 ms batch-1 int8
// decode step for SmolLM2's 30 layers. Here it is one memcpy per token. The output aliases the cache operand
// (input_output_aliases), so XLA hands over the cache's own buffer; if it ever does not, the cache is copied first.
// Slots outside [0, num_pages * page_size) are padding and are skipped, so no write leaves the buffer.

#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error WriteRowsCpu(ffi::AnyBuffer array, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> slots,
                        ffi::Result<ffi::AnyBuffer> out) {
  const auto dims = array.dimensions();
  if (dims.size() < 2 || rows.element_type() != array.element_type() || out->size_bytes() != array.size_bytes())
    return ffi::Error::InvalidArgument("write_rows_cpu: array [P, page_size, ...] and rows of its dtype expected");
  const int64_t num_slots = dims[0] * dims[1], count = slots.element_count();
  if (num_slots == 0) return ffi::Error::Success();
  const size_t row_bytes = array.size_bytes() / num_slots;
  if (rows.size_bytes() != static_cast<size_t>(count) * row_bytes)
    return ffi::Error::InvalidArgument("write_rows_cpu: rows must be [T, *array.shape[2:]] for T slots");
  auto* dst = static_cast<uint8_t*>(out->untyped_data());
  if (dst != array.untyped_data()) std::memcpy(dst, array.untyped_data(), array.size_bytes());
  const auto* src = static_cast<const uint8_t*>(rows.untyped_data());
  const int32_t* slot = slots.typed_data();
  for (int64_t i = 0; i < count; ++i)
    if (slot[i] >= 0 && slot[i] < num_slots) std::memcpy(dst + slot[i] * row_bytes, src + i * row_bytes, row_bytes);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagejaxWriteRowsCpu, WriteRowsCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // array [P, page_size, ...] (aliased by the result)
                                  .Arg<ffi::AnyBuffer>()         // rows [T, ...]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots [T]
                                  .Ret<ffi::AnyBuffer>());       // the updated array
