// Partial-page copy (CPU): slots [0, n) of one page onto another, in every layer of K and V.
#include <cstring>
#include <initializer_list>

#include "kernels.h"

namespace folio::cpu {

void copy_page_slots(const PageCopyParams& p, int64_t begin, int64_t end) {
  const int64_t page_bytes = p.page_size * p.slot_elems * p.elem_size;
  const int64_t layer_bytes = p.num_pages * page_bytes;
  const size_t copy_bytes = static_cast<size_t>(p.num_slots * p.slot_elems * p.elem_size);
  for (void* cache : {p.k_cache, p.v_cache}) {
    char* base = static_cast<char*>(cache);
    for (int64_t layer = begin; layer < end; ++layer) {
      char* layer_base = base + layer * layer_bytes;
      // memmove: src == dst is legal (a no-op copy) and must not be undefined behaviour
      std::memmove(layer_base + p.dst_page * page_bytes, layer_base + p.src_page * page_bytes, copy_bytes);
    }
  }
}

}  // namespace folio::cpu
