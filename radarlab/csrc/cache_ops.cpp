// The KV write, as vLLM's reshape_and_cache: token t's K and V rows ([kv_heads, head_dim] each) are
// copied to row slot_mapping[t] of the pools, slot -1 meaning padding (skipped), in one pass.
//
// The torch code (radarlab.kvcache.paged_cache.reshape_and_cache) is an index_put per pool per
// layer, plus the bookkeeping around it. Rows are cast to the pool's dtype rounding to nearest even,
// as torch's .to() does. Every slot is checked against the pool, so a bad slot raises rather than
// writing outside it.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_common.h"
#include "cpu_vec.h"

namespace {
namespace vec = radarlab::vec;

template <typename S, typename P>
void copy_row(P* dst, const S* src, int64_t n) {
  int64_t i = 0;
  if constexpr (std::is_same_v<S, P>) {
    std::memcpy(dst, src, n * sizeof(S));
    return;
  }
  for (; i + vec::N <= n; i += vec::N) vec::store(dst + i, vec::load(src + i));
  for (; i < n; ++i) dst[i] = static_cast<P>(radarlab::to_float(src[i]));
}

void reshape_and_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
                       const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
              v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type(),
              "reshape_and_cache: the pools must be contiguous [num_blocks, block_size, kv_heads, head_dim] of one dtype");
  const int64_t row = k_cache.size(2) * k_cache.size(3), num_slots = k_cache.size(0) * k_cache.size(1);
  for (const at::Tensor* t : {&k, &v})
    TORCH_CHECK(t->dim() == 3 && t->size(1) == k_cache.size(2) && t->size(2) == k_cache.size(3) &&
                t->stride(2) == 1 && t->stride(1) == k_cache.size(3) && t->size(0) == slot_mapping.size(0) &&
                t->scalar_type() == k.scalar_type(),
                "reshape_and_cache: k and v must be [tokens, kv_heads, head_dim] rows matching the pool, one per slot");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "reshape_and_cache: slot_mapping must be contiguous int64");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < slot_mapping.size(0); ++t)
    TORCH_CHECK(slots[t] >= -1 && slots[t] < num_slots, "reshape_and_cache: slot_mapping[", t, "] = ", slots[t],
                " is outside the pool (valid slots: 0..", num_slots - 1, ", or -1 for padding)");
  radarlab::dispatch_float(k, "reshape_and_cache", [&]<typename S>() {
    radarlab::dispatch_float(k_cache, "reshape_and_cache", [&]<typename P>() {
      const S *kp = k.data_ptr<S>(), *vp = v.data_ptr<S>();
      P *kc = k_cache.data_ptr<P>(), *vc = v_cache.data_ptr<P>();
      const int64_t ks = k.stride(0), vs = v.stride(0);
      at::parallel_for(0, slot_mapping.size(0), 64, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          if (slots[t] < 0) continue;
          copy_row(kc + slots[t] * row, kp + t * ks, row);
          copy_row(vc + slots[t] * row, vp + t * vs, row);
        }
      });
    });
  });
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(radarlab, m) {
  m.def("reshape_and_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
}
TORCH_LIBRARY_IMPL(radarlab, CPU, m) { m.impl("reshape_and_cache", &reshape_and_cache); }
