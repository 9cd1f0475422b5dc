// Per-thread scratch memory for the kernels' temporaries (quantized activations, partial sums).
//
// Why: a decode step calls each kernel hundreds of times, and a std::vector per call allocates -- above glibc's mmap
// threshold (128 KiB, e.g. the LM head's partial sums) that is a fresh mapping whose pages fault in on every call.
// This buffer grows to the largest size asked and is reused; it holds whatever the last call left there.

#pragma once

#include <cstddef>
#include <vector>

namespace pagejax {

// Buffer number kSlot of the calling thread, at least `count` elements: distinct slots for buffers used together
// (the slots are shared by every kernel of the library, which never nest).
template <typename T, int kSlot>
T* scratch(size_t count) {
  thread_local std::vector<T> buffer;
  if (buffer.size() < count) buffer.resize(count);
  return buffer.data();
}

}  // namespace pagejax
