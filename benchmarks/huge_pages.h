// n zeroed Ts on 2 MiB pages (transparent huge pages, as kernels/packed.py asks for the packed weights): the
// harnesses' (qlinear_harness.cpp, linear_harness.cpp) weights and inputs, placed as the package places them.
#pragma once
#include <sys/mman.h>

#include <cstdlib>
#include <cstring>

template <class T>
static T* huge(size_t n) {
  const size_t page = size_t{2} << 20, bytes = (n * sizeof(T) + page - 1) / page * page;
  void* p = std::aligned_alloc(page, bytes);
  madvise(p, bytes, MADV_HUGEPAGE);
  std::memset(p, 0, bytes);
  return static_cast<T*>(p);
}
