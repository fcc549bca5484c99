// Argument validation shared by every backend: one place, one message style ("flashattn.<op>: <arg> <rule>").
#pragma once

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <cmath>
#include <initializer_list>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

namespace flashattn {

// Sizes of one attention call, read from validated inputs.
struct AttentionShape {
  int64_t batch, heads, heads_kv, len_q, len_k, head_dim;
  bool empty() const { return batch == 0 || heads == 0 || len_q == 0; }
};

inline AttentionShape check_fwd_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const char* op = "flashattn.fwd") {
  TORCH_CHECK(q.dim() == 4, op, ": q must have 4 dimensions (B, H, Lq, D), got ", q.dim());
  TORCH_CHECK(k.dim() == 4, op, ": k must have 4 dimensions (B, Hk, Lk, D), got ", k.dim());
  TORCH_CHECK(v.dim() == 4, op, ": v must have 4 dimensions (B, Hk, Lk, D), got ", v.dim());
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              op, ": q, k and v must have the same dtype, got ", q.scalar_type(), ", ", k.scalar_type(),
              " and ", v.scalar_type());
  TORCH_CHECK(q.device() == k.device() && q.device() == v.device(),
              op, ": q, k and v must be on the same device, got ", q.device(), ", ", k.device(), " and ",
              v.device());

  AttentionShape s{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3)};
  TORCH_CHECK(k.size(0) == s.batch && v.size(0) == s.batch,
              op, ": q, k and v must have the same batch size B, got ", s.batch, ", ", k.size(0), " and ",
              v.size(0));
  TORCH_CHECK(k.size(3) == s.head_dim && v.size(3) == s.head_dim,
              op, ": q, k and v must have the same head dim D, got ", s.head_dim, ", ", k.size(3), " and ",
              v.size(3));
  TORCH_CHECK(s.head_dim >= 1, op, ": head dim D must be >= 1, got ", s.head_dim);
  TORCH_CHECK(v.size(1) == s.heads_kv, op, ": k and v must have the same number of heads, got ",
              s.heads_kv, " and ", v.size(1));
  TORCH_CHECK(v.size(2) == s.len_k, op, ": k and v must have the same length Lk, got ", s.len_k, " and ",
              v.size(2));
  TORCH_CHECK(s.heads_kv > 0 ? s.heads % s.heads_kv == 0 : s.heads == 0,
              op, ": the number of kv heads (", s.heads_kv, ") must divide the number of query heads (",
              s.heads, ")");
  for (const auto* t : {&q, &k, &v}) {
    const char* name = t == &q ? "q" : (t == &k ? "k" : "v");
    TORCH_CHECK(t->stride(3) == 1 || t->size(3) == 1, op, ": ", name,
                " must have stride(-1) == 1 (contiguous last dimension), got stride ", t->stride(3));
  }
  return s;
}

// Sizes of a packed (varlen) call: q (total_q, H, D), k and v (total_k, Hk, D), B sequences.
struct VarlenShape {
  int64_t batch, heads, heads_kv, total_q, total_k, head_dim;
};

// The rules of packed inputs that hold without reading cu_seqlens' values (no device synchronisation).
inline VarlenShape check_varlen_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                       const char* op = "flashattn.fwd_varlen") {
  TORCH_CHECK(q.dim() == 3, op, ": q must have 3 dimensions (total_q, H, D), got ", q.dim());
  TORCH_CHECK(k.dim() == 3, op, ": k must have 3 dimensions (total_k, Hk, D), got ", k.dim());
  TORCH_CHECK(v.dim() == 3, op, ": v must have 3 dimensions (total_k, Hk, D), got ", v.dim());
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), op,
              ": q, k and v must have the same dtype, got ", q.scalar_type(), ", ", k.scalar_type(), " and ",
              v.scalar_type());
  TORCH_CHECK(q.device() == k.device() && q.device() == v.device(), op,
              ": q, k and v must be on the same device, got ", q.device(), ", ", k.device(), " and ", v.device());
  TORCH_CHECK(k.sizes() == v.sizes(), op, ": k and v must have the same shape, got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(k.size(2) == q.size(2), op, ": q, k and v must have the same head dim D, got ", q.size(2), " and ",
              k.size(2));
  TORCH_CHECK(q.size(2) >= 1, op, ": head dim D must be >= 1, got ", q.size(2));
  TORCH_CHECK(k.size(1) > 0 ? q.size(1) % k.size(1) == 0 : q.size(1) == 0, op, ": the number of kv heads (",
              k.size(1), ") must divide the number of query heads (", q.size(1), ")");
  for (const auto* t : {&q, &k, &v}) {
    const char* name = t == &q ? "q" : (t == &k ? "k" : "v");
    TORCH_CHECK(t->stride(2) == 1 || t->size(2) == 1, op, ": ", name,
                " must have stride(-1) == 1 (contiguous last dimension), got stride ", t->stride(2));
  }
  for (const auto* t : {&cu_seqlens_q, &cu_seqlens_k}) {
    const char* name = t == &cu_seqlens_q ? "cu_seqlens_q" : "cu_seqlens_k";
    TORCH_CHECK(t->scalar_type() == at::kInt, op, ": ", name, " must be int32, got ", t->scalar_type());
    TORCH_CHECK(t->dim() == 1 && t->size(0) >= 1, op, ": ", name, " must have shape (B + 1,), got ", t->sizes());
    TORCH_CHECK(t->device() == q.device(), op, ": ", name, " must be on q's device ", q.device(), ", got ",
                t->device());
  }
  TORCH_CHECK(cu_seqlens_q.size(0) == cu_seqlens_k.size(0), op,
              ": cu_seqlens_q and cu_seqlens_k must have the same length B + 1, got ", cu_seqlens_q.size(0), " and ",
              cu_seqlens_k.size(0));
  TORCH_CHECK(cu_seqlens_q.size(0) > 1 || (q.size(0) == 0 && k.size(0) == 0), op,
              ": with no sequences (cu_seqlens of length 1) q and k must have no rows, got total_q = ", q.size(0),
              " and total_k = ", k.size(0));
  return {cu_seqlens_q.size(0) - 1, q.size(1), k.size(1), q.size(0), k.size(0), q.size(2)};
}

// The values of a cu_seqlens on the host (CPU tensors: readable without a synchronisation): 0 first, non-decreasing,
// `total` last.
inline void check_cu_seqlens_values(const at::Tensor& cu_seqlens, int64_t total, const char* name, const char* op) {
  const int32_t* c = cu_seqlens.data_ptr<int32_t>();
  const int64_t n = cu_seqlens.size(0);
  TORCH_CHECK(c[0] == 0, op, ": ", name, " must start at 0, got ", c[0]);
  for (int64_t i = 1; i < n; ++i) {
    TORCH_CHECK(c[i] >= c[i - 1], op, ": ", name, " must be non-decreasing, got ", c[i - 1], " then ", c[i],
                " at ", i);
  }
  TORCH_CHECK(c[n - 1] == total, op, ": ", name, "[-1] must equal the packed length ", total, ", got ", c[n - 1]);
}

// Every backend works with scale * log2(e) in float32 (the kernels take exp2), so |scale| is bounded by that.
inline constexpr double kMaxScale = std::numeric_limits<float>::max() / 1.4426950408889634;  // log2(e)

inline double resolve_scale(std::optional<double> scale, int64_t head_dim, const char* op = "flashattn.fwd") {
  const double value = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(head_dim));
  TORCH_CHECK(std::isfinite(value), op, ": scale must be finite, got ", value);
  TORCH_CHECK(std::abs(value) <= kMaxScale, op, ": scale must be at most ", kMaxScale,
              " in magnitude (scale * log2(e) must fit in float32), got ", value);
  return value;
}

// The score modifications of one call, checked and put in the one form every backend works with: causal folded into
// the band (right = 0), and a bound that leaves every key of every row visible dropped (-1), so that a band equal
// to plain causal, or to no mask, runs the plain kernels.
struct ScoreMods {
  int64_t left = -1, right = -1;  // the band: query i sees key j iff i + shift - left <= j <= i + shift + right
  double softcap = 0.0;           // > 0: scores are softcap * tanh(score / softcap)
  std::optional<at::Tensor> sinks;
  bool causal() const { return left < 0 && right == 0; }      // exactly the bottom-right causal mask
  bool window() const { return left >= 0 || right > 0; }      // a band other than causal (or none)
  bool plain() const { return !window() && softcap == 0.0 && !sinks.has_value(); }
};

inline ScoreMods check_score_mods(const at::Tensor& q, const AttentionShape& s, bool causal,
                                  at::IntArrayRef window_size, double softcap, const std::optional<at::Tensor>& sinks,
                                  const char* op = "flashattn.fwd") {
  TORCH_CHECK(window_size.size() == 2, op, ": window_size must be (left, right), got ", window_size.size(),
              " values");
  TORCH_CHECK(window_size[0] >= -1 && window_size[1] >= -1, op,
              ": window_size entries must be >= 0, or -1 for unbounded; got (", window_size[0], ", ", window_size[1],
              ")");
  // The kernels hold softcap in float32 and take softcap * log2(e) as the capped scores' scale: a positive cap must be
  // a normal float32 (a smaller one would round to 0, which means off) within the scale's bound.
  TORCH_CHECK(softcap == 0.0 || (softcap >= std::numeric_limits<float>::min() && softcap <= kMaxScale), op,
              ": softcap must be 0 (off) or a positive float32 from ", std::numeric_limits<float>::min(), " to ",
              kMaxScale, " (softcap * log2(e) must fit in float32), got ", softcap);
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == s.heads, op, ": sinks must have shape (H,) = (", s.heads,
                ",), got ", sinks->sizes());
    TORCH_CHECK(sinks->scalar_type() == at::kFloat, op, ": sinks must be float32, got ", sinks->scalar_type());
    TORCH_CHECK(sinks->device() == q.device(), op, ": sinks must be on q's device ", q.device(), ", got ",
                sinks->device());
  }
  ScoreMods mods;
  mods.left = window_size[0];
  mods.right = causal ? 0 : window_size[1];
  // Row Lq - 1 has the highest lower bound (Lk - 1 - left), row 0 the lowest upper bound (Lk - Lq + right).
  if (mods.left >= s.len_k - 1) mods.left = -1;
  if (mods.right >= s.len_q - 1) mods.right = -1;
  mods.softcap = softcap;
  mods.sinks = sinks;
  return mods;
}

// A backward's dout and out: q's shape, dtype and device, rows contiguous unless empty (autograd's gradient of an
// empty out.sum() has every stride 0; nothing of it is read); lse and dlse: float32 of `lse_shape` (spelt `lse_dims`
// in messages) on q's device.
inline void check_bwd_tensors(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& out,
                              const at::Tensor& lse, const std::optional<at::Tensor>& dlse, at::IntArrayRef lse_shape,
                              const char* lse_dims, const char* op) {
  for (const auto* t : {&dout, &out}) {
    const char* name = t == &dout ? "dout" : "out";
    TORCH_CHECK(t->sizes() == q.sizes(), op, ": ", name, " must have q's shape ", q.sizes(), ", got ", t->sizes());
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), op, ": ", name, " must have q's dtype ", q.scalar_type(),
                ", got ", t->scalar_type());
    TORCH_CHECK(t->device() == q.device(), op, ": ", name, " must be on q's device ", q.device(), ", got ",
                t->device());
    TORCH_CHECK(t->stride(-1) == 1 || t->size(-1) == 1 || t->numel() == 0, op, ": ", name,
                " must have stride(-1) == 1 (contiguous last dimension), got stride ", t->stride(-1));
  }
  for (const at::Tensor* t : {&lse, dlse.has_value() ? &*dlse : nullptr}) {
    if (t == nullptr) continue;
    const char* name = t == &lse ? "lse" : "dlse";
    TORCH_CHECK(t->sizes() == lse_shape, op, ": ", name, " must have shape ", lse_dims, " = ", lse_shape, ", got ",
                t->sizes());
    TORCH_CHECK(t->scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ", t->scalar_type());
    TORCH_CHECK(t->device() == q.device(), op, ": ", name, " must be on q's device ", q.device(), ", got ",
                t->device());
  }
}

// The backward's extra tensors must match what fwd produced for these q, k, v.
inline AttentionShape check_bwd_inputs(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                       const std::optional<at::Tensor>& dlse) {
  constexpr const char* op = "flashattn.bwd";
  const AttentionShape s = check_fwd_inputs(q, k, v, op);
  const std::vector<int64_t> lse_shape{s.batch, s.heads, s.len_q};
  check_bwd_tensors(dout, q, out, lse, dlse, lse_shape, "(B, H, Lq)", op);
  return s;
}

// Sizes of a KV-cache call: q (B, H, Lq, D); a dense cache (B, Hk, capacity, D) or a paged one (num_pages, Hk,
// page_size, D) whose pages each batch entry lists in block_table (B, max_pages); len_new appended keys.
struct KvCacheShape {
  int64_t batch, heads, heads_kv, len_q, head_dim, capacity, len_new, page_size, num_pages;
  bool paged;
};

// The rules of a KV-cache call that hold without reading cache_seqlens' or block_table's values.
inline KvCacheShape check_kvcache_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                         const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
                                         const std::optional<at::Tensor>& cache_seqlens,
                                         const std::optional<at::Tensor>& block_table, int64_t num_splits,
                                         const std::optional<at::Tensor>& cache_leftpad,
                                         const char* op = "flashattn.fwd_kvcache") {
  TORCH_CHECK(num_splits >= 0, op, ": num_splits must be >= 0 (0: chosen from the shape), got ", num_splits);
  TORCH_CHECK(q.dim() == 4, op, ": q must have 4 dimensions (B, H, Lq, D), got ", q.dim());
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, op,
              ": k_cache and v_cache must have 4 dimensions, got ", k_cache.dim(), " and ", v_cache.dim());
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), op, ": k_cache and v_cache must have the same shape, got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(), op,
              ": q, k_cache and v_cache must have the same dtype, got ", q.scalar_type(), ", ",
              k_cache.scalar_type(), " and ", v_cache.scalar_type());
  TORCH_CHECK(q.device() == k_cache.device() && q.device() == v_cache.device(), op,
              ": q, k_cache and v_cache must be on the same device");
  KvCacheShape s{q.size(0), q.size(1), k_cache.size(1), q.size(2), q.size(3), 0, 0, 0, 0, block_table.has_value()};
  TORCH_CHECK(k_cache.size(3) == s.head_dim && s.head_dim >= 1, op, ": q and the caches must have the same head dim "
              "D >= 1, got ", s.head_dim, " and ", k_cache.size(3));
  TORCH_CHECK(s.heads_kv > 0 ? s.heads % s.heads_kv == 0 : s.heads == 0, op, ": the number of kv heads (",
              s.heads_kv, ") must divide the number of query heads (", s.heads, ")");
  if (s.paged) {
    const at::Tensor& bt = *block_table;
    TORCH_CHECK(bt.scalar_type() == at::kInt && bt.dim() == 2 && bt.size(0) == s.batch, op,
                ": block_table must be int32 of shape (B, max_pages) with B = ", s.batch, ", got ", bt.scalar_type(),
                " ", bt.sizes());
    TORCH_CHECK(bt.device() == q.device(), op, ": block_table must be on q's device");
    s.num_pages = k_cache.size(0);
    TORCH_CHECK(s.num_pages > 0 && s.num_pages <= std::numeric_limits<int32_t>::max(), op,
                ": a paged k_cache must hold from 1 to 2^31 - 1 pages (block_table is int32), got shape ",
                k_cache.sizes());
    s.page_size = k_cache.size(2);
    TORCH_CHECK(s.page_size >= 1, op, ": a paged k_cache must have pages of at least one row, got shape ",
                k_cache.sizes());
    s.capacity = bt.size(1) * s.page_size;
  } else {
    TORCH_CHECK(k_cache.size(0) == s.batch, op, ": a dense k_cache must have q's batch size ", s.batch, ", got ",
                k_cache.size(0));
    s.capacity = k_cache.size(2);
  }
  TORCH_CHECK(k.has_value() == v.has_value(), op, ": k and v must be given together");
  if (k.has_value()) {
    for (const auto* t : {&*k, &*v}) {
      const char* name = t == &*k ? "k" : "v";
      TORCH_CHECK(t->dim() == 4 && t->size(0) == s.batch && t->size(1) == s.heads_kv && t->size(3) == s.head_dim,
                  op, ": ", name, " must have shape (B, Hk, Lnew, D) = (", s.batch, ", ", s.heads_kv, ", Lnew, ",
                  s.head_dim, "), got ", t->sizes());
      TORCH_CHECK(t->scalar_type() == q.scalar_type() && t->device() == q.device(), op, ": ", name,
                  " must have q's dtype and device");
    }
    TORCH_CHECK(k->size(2) == v->size(2), op, ": k and v must have the same length Lnew");
    s.len_new = k->size(2);
    TORCH_CHECK(s.len_new <= s.capacity, op, ": k and v must fit in the cache: Lnew = ", s.len_new,
                " is more than its ", s.capacity, " rows", s.paged ? " (max_pages * page_size)" : " (Lmax)");
    // The append writes each entry's rows through its own view, past PyTorch's overlap checks of copy_: a cache
    // whose elements share memory (an expanded one), or caches and new keys that share it, would take the writes of
    // one entry or tensor in the place of another's.
    for (const auto& [name, t] : {std::pair{"k_cache", &k_cache}, std::pair{"v_cache", &v_cache}}) {
      TORCH_CHECK(at::has_internal_overlap(*t) != at::MemOverlap::Yes, op, ": ", name,
                  " is written (k and v are given), so no two of its elements may share memory (an expanded "
                  "tensor): clone it");
    }
    const auto overlaps = [](const at::Tensor& a, const at::Tensor& b) {
      const at::MemOverlapStatus status = at::get_overlap_status(a, b);
      return status == at::MemOverlapStatus::Full || status == at::MemOverlapStatus::Partial;
    };
    TORCH_CHECK(!overlaps(k_cache, v_cache), op,
                ": k_cache and v_cache are written (k and v are given), so they must not share memory");
    for (const auto& [name, t] : {std::pair{"k", &*k}, std::pair{"v", &*v}}) {
      TORCH_CHECK(!overlaps(*t, k_cache) && !overlaps(*t, v_cache), op, ": ", name,
                  " must not share memory with k_cache or v_cache, which the call writes");
    }
  }
  if (cache_seqlens.has_value()) {
    const at::Tensor& c = *cache_seqlens;
    TORCH_CHECK(c.scalar_type() == at::kInt && c.dim() == 1 && c.size(0) == s.batch, op,
                ": cache_seqlens must be int32 of shape (B,) = (", s.batch, ",), got ", c.scalar_type(), " ",
                c.sizes());
    TORCH_CHECK(c.device() == q.device(), op, ": cache_seqlens must be on q's device");
  }
  if (cache_leftpad.has_value()) {
    const at::Tensor& c = *cache_leftpad;
    TORCH_CHECK(!s.paged, op, ": cache_leftpad takes a dense cache, not a paged one (block_table)");
    TORCH_CHECK(c.scalar_type() == at::kInt && c.dim() == 1 && c.size(0) == s.batch, op,
                ": cache_leftpad must be int32 of shape (B,) = (", s.batch, ",), got ", c.scalar_type(), " ",
                c.sizes());
    TORCH_CHECK(c.device() == q.device(), op, ": cache_leftpad must be on q's device");
  }
  for (const auto& [name, t] : {std::pair{"q", &q}, std::pair{"k_cache", &k_cache}, std::pair{"v_cache", &v_cache},
                                std::pair{"k", k.has_value() ? &*k : nullptr},
                                std::pair{"v", v.has_value() ? &*v : nullptr}}) {
    if (t == nullptr) continue;
    TORCH_CHECK(t->stride(3) == 1 || t->size(3) == 1, op, ": ", name,
                " must have stride(-1) == 1 (contiguous last dimension), got stride ", t->stride(3));
  }
  return s;
}

// The packed backward's extra tensors: dout and out like q, lse and dlse float32 (H, total_q).
inline void check_varlen_bwd_inputs(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& out,
                                    const at::Tensor& lse, const std::optional<at::Tensor>& dlse,
                                    const VarlenShape& vs, const char* op = "flashattn.bwd_varlen") {
  const std::vector<int64_t> lse_shape{vs.heads, vs.total_q};
  check_bwd_tensors(dout, q, out, lse, dlse, lse_shape, "(H, total_q)", op);
}

}  // namespace flashattn
