// CPU backend of flashattn.fwd and flashattn.bwd: the FlashAttention algorithm, tiled for a CPU.
//
// Forward (fwd_cpu_kernel, attend_query_block): work is split over (entry, head, block of kBlockM query rows) in one
// at::parallel_for, an entry being a batch entry, a packed sequence or a KV-cache entry; short GQA queries (decoding)
// take every query head of a kv head in one work item, which then converts each key block once for all of them. A
// work item loads its query rows once, then walks the key/value blocks of kBlockN keys, keeping per query row a
// running max m, a running sum l of exp(score - m) and an unnormalised output accumulator. The full (Lq, Lk) score
// matrix never exists; the scratch memory of a thread is O((kBlockM + 2 kBlockN) * D).
//
// Backward (bwd_cpu_kernel): the probabilities are recomputed tile by tile from q, k and the saved lse, in three
// passes, none of which writes where another work item writes (no atomics, no reductions across threads):
//   1. row_stats:        delta_i = rowsum(dO * O)_i - dlse_i per query row (and lse in the accumulation type);
//   2. key_block_grads:  per (batch, kv head, key block): dV and dK of those keys, summed over every query head of the
//                        kv head's group and every query block that sees the keys;
//   3. query_block_grads: per (batch, head, query block): dQ of those rows, over the key blocks they see.
// Each tile recomputes S = scale * Q K^T and dP = dO V^T (passes 2 and 3 both do: 7 tile GEMMs instead of the 5 of a
// fused kernel, the price of writing dQ without atomics). Every output element is produced by one work item, always
// summing in the same order, so the backward is deterministic (bitwise-identical across runs and thread counts) by
// construction: the `deterministic` flag of flashattn.bwd needs nothing extra here.
//
// All arithmetic is in at::opmath_type<scalar_t> (float for float/half/bfloat16, double for double); inputs are
// converted while they are copied into the scratch tiles, so the hot loops run on contiguous opmath data and the
// compiler can vectorise them (their innermost loops are element-wise, no reductions).
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "api/checks.h"
#include "api/layouts.h"

namespace flashattn {
namespace {

// ==== shared by the forward and the backward ======================================================================

// 32 query rows x 64 keys: the tiles of one work item (q, k^T, v, scores, accumulator) stay within ~200 KB at
// D = 256, so they live in L2; 32 rows keep enough work items for the threads when Lq is short.
constexpr int64_t kBlockM = 32;
constexpr int64_t kBlockN = 64;

void check_cpu_dtype(at::ScalarType dtype, const char* op) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16, op,
              ": CPU supports float32, float64, float16 and bfloat16 (got ", dtype, ")");
}

// A (rows, D) view of one (batch, head) slice of a 4-D tensor: base pointer and the stride between rows.
// The last dimension is contiguous (checked by check_fwd_inputs), so element (r, d) is at ptr[r * row_stride + d].
template <typename T>
struct RowMatrix {
  T* ptr;
  int64_t row_stride;
  T* row(int64_t r) const { return ptr + r * row_stride; }
};

template <typename T>
RowMatrix<T> head_slice(const at::Tensor& t, int64_t b, int64_t h) {
  return {static_cast<T*>(t.data_ptr()) + b * t.stride(0) + h * t.stride(1), t.stride(2)};
}

// The rows of one kv head of a paged cache (num_pages, Hk, page_size, D), read in place: row r lives in page
// table[r / page_size], at row r % page_size of it.
template <typename T>
struct PagedRows {
  T* ptr;  // the kv head's first row in page 0
  int64_t page_stride, row_stride, page_size;
  const int32_t* table;  // the entry's pages in order
  T* row(int64_t r) const { return ptr + table[r / page_size] * page_stride + r % page_size * row_stride; }
};

// Where a forward entry reads kv head h_kv's keys and values: rows of a (B, Hk, Lk, D) tensor pair at the entry's
// offset...
template <typename T>
struct DenseKv {
  const T* k;
  const T* v;
  int64_t k_head, k_row, v_head, v_row;
  std::pair<RowMatrix<const T>, RowMatrix<const T>> operator()(int64_t h_kv) const {
    return {{k + h_kv * k_head, k_row}, {v + h_kv * v_head, v_row}};
  }
};

// ...or an entry's pages of a paged cache (num_pages, Hk, page_size, D), through its block table row.
template <typename T>
struct PagedKv {
  const T* k;
  const T* v;
  int64_t k_head, v_head, k_page, v_page, k_row, v_row, page_size;
  const int32_t* table;
  std::pair<PagedRows<const T>, PagedRows<const T>> operator()(int64_t h_kv) const {
    return {{k + h_kv * k_head, k_page, k_row, page_size, table}, {v + h_kv * v_head, v_page, v_row, page_size, table}};
  }
};

// One attention problem of a forward call (a batch entry, a packed sequence, a cache entry): its shape (batch 1), its
// query rows, outputs and lse (query i of head h at q + h * q_head + i * q_row, ...) and its kv heads' rows.
template <typename T, typename Kv>
struct FwdEntry {
  AttentionShape s;
  int64_t left, right;  // the band (ScoreMods, normalised for this entry's lengths)
  const T* q;
  int64_t q_head, q_row;
  T* out;
  int64_t o_head, o_row;
  float* lse;
  int64_t lse_head, lse_row;
  Kv kv;
};

// Batch entry b of (B, H, Lq, D) q / out and (B, H, Lq) lse (any strides with stride(-1) == 1), reading `kv`.
template <typename T, typename Kv>
FwdEntry<T, Kv> batch_entry(const at::Tensor& q, at::Tensor& out, at::Tensor& lse, int64_t b, const AttentionShape& s,
                            const ScoreMods& mods, const Kv& kv) {
  return {s, mods.left, mods.right, static_cast<const T*>(q.data_ptr()) + b * q.stride(0), q.stride(1), q.stride(2),
          static_cast<T*>(out.data_ptr()) + b * out.stride(0), out.stride(1), out.stride(2),
          lse.data_ptr<float>() + b * lse.stride(0), lse.stride(1), lse.stride(2), kv};
}

// Rows first .. of kv head h_kv of entry b of (B, Hk, Lk, D) k and v.
template <typename T>
DenseKv<T> batch_kv(const at::Tensor& k, const at::Tensor& v, int64_t b, int64_t first = 0) {
  return {static_cast<const T*>(k.data_ptr()) + b * k.stride(0) + first * k.stride(2),
          static_cast<const T*>(v.data_ptr()) + b * v.stride(0) + first * v.stride(2), k.stride(1), k.stride(2),
          v.stride(1), v.stride(2)};
}

// The keys query row i sees, [key_begin(i), key_end(i)) (empty when key_begin >= key_end), and the rows that see a
// key range: the band of ScoreMods (causal is right = 0). Both bounds are non-decreasing in i.
struct Band {
  int64_t len_q, len_k, shift, left, right;
  Band(const AttentionShape& s, const ScoreMods& mods) : Band(s, mods.left, mods.right) {}
  Band(const AttentionShape& s, int64_t left, int64_t right)
      : len_q(s.len_q), len_k(s.len_k), shift(s.len_k - s.len_q), left(left), right(right) {}
  int64_t key_begin(int64_t i) const { return left < 0 ? 0 : std::clamp<int64_t>(i + shift - left, 0, len_k); }
  int64_t key_end(int64_t i) const { return right < 0 ? len_k : std::clamp<int64_t>(i + shift + right + 1, 0, len_k); }
  // Rows [first, last) see at least one of the keys [k_begin, k_end).
  int64_t first_row_seeing(int64_t k_begin) const {
    return right < 0 ? 0 : std::clamp<int64_t>(k_begin - shift - right, 0, len_q);
  }
  int64_t row_end_seeing(int64_t k_end) const {
    return left < 0 ? len_q : std::clamp<int64_t>(k_end - 1 - shift + left + 1, 0, len_q);
  }
};

// Gemma 2's cap of the (scaled) scores: softcap * tanh(s / softcap); nothing when softcap is 0.
template <typename acc_t>
void cap_scores(acc_t* scores, int64_t rows, int64_t cols, double softcap) {
  if (softcap == 0.0) return;
  const acc_t cap = static_cast<acc_t>(softcap), inv_cap = static_cast<acc_t>(1.0 / softcap);
  for (int64_t r = 0; r < rows; ++r) {
    acc_t* row = scores + r * kBlockN;
    for (int64_t c = 0; c < cols; ++c) row[c] = cap * std::tanh(row[c] * inv_cap);
  }
}

// tile[r][x] = mul * src.row(begin + r)[x] for `rows` rows (RowMatrix or PagedRows): a (rows, D) opmath tile.
template <typename Rows, typename acc_t>
void load_rows(const Rows& src, int64_t begin, int64_t rows, int64_t d, acc_t* tile, acc_t mul = acc_t(1)) {
  for (int64_t r = 0; r < rows; ++r) {
    const auto* row = src.row(begin + r);
    for (int64_t x = 0; x < d; ++x) tile[r * d + x] = static_cast<acc_t>(row[x]) * mul;
  }
}

// tile[x][c] = src.row(begin + c)[x] for `cols` rows: a (D, kBlockN) transposed opmath tile, the right-hand side of
// block_scores.
template <typename Rows, typename acc_t>
void load_rows_transposed(const Rows& src, int64_t begin, int64_t cols, int64_t d, acc_t* tile) {
  for (int64_t c = 0; c < cols; ++c) {
    const auto* row = src.row(begin + c);
    for (int64_t x = 0; x < d; ++x) tile[x * kBlockN + c] = static_cast<acc_t>(row[x]);
  }
}

// scores[r][c] = a[r] . b_t[:, c] for `rows` rows of the (rows, D) tile a and `cols` columns of the (D, kBlockN)
// tile b_t; scores has kBlockN columns. The forward's q K^T (q carries the scale) and the backward's dO V^T.
template <typename acc_t>
void block_scores(const acc_t* a, const acc_t* b_t, acc_t* scores, int64_t rows, int64_t cols, int64_t d) {
  for (int64_t r = 0; r < rows; ++r) {
    acc_t* s_row = scores + r * kBlockN;
    std::fill(s_row, s_row + cols, acc_t(0));
    const acc_t* a_row = a + r * d;
    for (int64_t x = 0; x < d; ++x) {
      const acc_t ax = a_row[x];
      const acc_t* b_col = b_t + x * kBlockN;
      for (int64_t c = 0; c < cols; ++c) s_row[c] += ax * b_col[c];
    }
  }
}

// ==== forward =====================================================================================================

// Per-thread scratch tiles, allocated once per parallel chunk and reused for all its work items.
template <typename acc_t>
struct FwdScratch {
  explicit FwdScratch(int64_t d)
      : q(kBlockM * d), k_t(d * kBlockN), v(kBlockN * d), p(kBlockM * kBlockN), acc(kBlockM * d), m(kBlockM),
        l(kBlockM) {}
  std::vector<acc_t> q;    // (kBlockM, D) query rows, pre-multiplied by the scale
  std::vector<acc_t> k_t;  // (D, kBlockN) keys, transposed so that Q K^T has an element-wise inner loop
  std::vector<acc_t> v;    // (kBlockN, D) values
  std::vector<acc_t> p;    // (kBlockM, kBlockN) scores, then exp(score - m) in place
  std::vector<acc_t> acc;  // (kBlockM, D) unnormalised output rows
  std::vector<acc_t> m;    // running row max of the scores seen so far (-inf before any visible key)
  std::vector<acc_t> l;    // running row sum of exp(score - m)
};

// One online-softmax step for one query row over `visible` keys of the current block (visible >= 1):
// the row max grows to m_new, the old sum and accumulator are rescaled by exp(m_old - m_new), and the new
// probabilities (written over the scores) are added. With a finite score visible m_new is finite, so the first visible
// block gives exp(-inf - m_new) = 0 for the empty history; NaN or +inf scores make l NaN (see the epilogue). While
// every score so far is -inf they weigh 0 and the row stays without history (exp(-inf - -inf) would be NaN).
template <typename acc_t>
void online_softmax_row(acc_t* s_row, const acc_t* v, acc_t* acc_row, acc_t& m, acc_t& l, int64_t visible,
                        int64_t d) {
  const acc_t m_new = std::max(m, *std::max_element(s_row, s_row + visible));
  if (m_new == -std::numeric_limits<acc_t>::infinity()) {
    // std::max lets a NaN through as -inf when it is not first: a NaN score still makes the row NaN.
    if (std::any_of(s_row, s_row + visible, [](acc_t x) { return std::isnan(x); })) {
      l = std::numeric_limits<acc_t>::quiet_NaN();
    }
    return;
  }
  const acc_t rescale = std::exp(m - m_new);
  acc_t row_sum = 0;
  for (int64_t c = 0; c < visible; ++c) {
    s_row[c] = std::exp(s_row[c] - m_new);
    row_sum += s_row[c];
  }
  l = l * rescale + row_sum;
  m = m_new;
  for (int64_t x = 0; x < d; ++x) acc_row[x] *= rescale;
  for (int64_t c = 0; c < visible; ++c) {
    const acc_t p = s_row[c];
    const acc_t* v_row = v + c * d;
    for (int64_t x = 0; x < d; ++x) acc_row[x] += p * v_row[x];
  }
}

// Computes queries [q_begin, q_end) of heads h_first .. h_first + heads - 1 of an entry (query heads of one kv head,
// whose rows k_mat, v_mat they read; at most kBlockM rows in all, head by head): out = softmax(scale * q k^T) v,
// lse = m + log(l), with the band, softcap and each head's sink (sink_of: null without sinks) applied.
template <typename scalar_t, typename Entry, typename Rows>
void attend_query_block(const Entry& e, const Rows& k_mat, const Rows& v_mat, int64_t h_first, int64_t heads,
                        int64_t q_begin, int64_t q_end, const Band& band, double softcap, const float* sink_of,
                        double scale, FwdScratch<at::opmath_type<scalar_t>>& tmp) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t d = e.s.head_dim;
  const int64_t queries = q_end - q_begin;
  const int64_t rows = heads * queries;
  // Row r of the block: query query_of(r) of head h_first + r / queries.
  const auto query_of = [&](int64_t r) { return q_begin + r % queries; };

  for (int64_t g = 0; g < heads; ++g) {
    const RowMatrix<const scalar_t> q_rows{e.q + (h_first + g) * e.q_head, e.q_row};
    load_rows(q_rows, q_begin, queries, d, tmp.q.data() + g * queries * d, static_cast<acc_t>(scale));
  }
  std::fill(tmp.acc.begin(), tmp.acc.begin() + rows * d, acc_t(0));
  std::fill(tmp.m.begin(), tmp.m.end(), -std::numeric_limits<acc_t>::infinity());
  std::fill(tmp.l.begin(), tmp.l.end(), acc_t(0));

  // The block's rows see keys [first row's begin, last row's end); key blocks outside are never loaded.
  const int64_t block_key_begin = band.key_begin(q_begin);
  const int64_t block_key_end = band.key_end(q_end - 1);
  for (int64_t k_begin = block_key_begin; k_begin < block_key_end; k_begin += kBlockN) {
    const int64_t cols = std::min(kBlockN, block_key_end - k_begin);
    load_rows_transposed(k_mat, k_begin, cols, d, tmp.k_t.data());
    load_rows(v_mat, k_begin, cols, d, tmp.v.data());
    block_scores(tmp.q.data(), tmp.k_t.data(), tmp.p.data(), rows, cols, d);
    cap_scores(tmp.p.data(), rows, cols, softcap);
    for (int64_t r = 0; r < rows; ++r) {
      // The row's visible keys in this block: columns [first, last).
      const int64_t first = std::max<int64_t>(0, band.key_begin(query_of(r)) - k_begin);
      const int64_t last = std::min(cols, band.key_end(query_of(r)) - k_begin);
      if (last <= first) continue;
      online_softmax_row(tmp.p.data() + r * kBlockN + first, tmp.v.data() + first * d, tmp.acc.data() + r * d,
                         tmp.m[r], tmp.l[r], last - first, d);
    }
  }

  // The sink joins the denominator: l grows by exp(sink - m) against the row's base m, which moves to the sink where
  // that is larger (or the row saw no key).
  for (int64_t r = 0; r < rows && sink_of != nullptr; ++r) {
    const float sink = sink_of[h_first + r / queries];
    if (sink != -std::numeric_limits<float>::infinity()) {
      const acc_t m_new = std::max(tmp.m[r], static_cast<acc_t>(sink));
      const acc_t rescale = tmp.l[r] != 0 ? std::exp(tmp.m[r] - m_new) : acc_t(0);
      tmp.l[r] = tmp.l[r] * rescale + std::exp(static_cast<acc_t>(sink) - m_new);
      for (int64_t x = 0; x < d; ++x) tmp.acc[r * d + x] *= rescale;
      tmp.m[r] = m_new;
    }
  }

  // Normalise. A row that saw no key (and has no sink) has l == 0: it returns zeros and lse = -inf. A NaN score or a
  // +inf one (inf - inf) make l NaN, and a row whose visible scores are all -inf (no sink) gets l NaN here: NaN out and
  // lse, as softmax gives.
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t h = h_first + r / queries, i = query_of(r);
    const bool sees_keys = band.key_begin(i) < band.key_end(i);
    const acc_t l = tmp.l[r] == 0 && sees_keys ? std::numeric_limits<acc_t>::quiet_NaN() : tmp.l[r];
    const acc_t inv_l = l != 0 ? acc_t(1) / l : acc_t(0);
    scalar_t* dst = e.out + h * e.o_head + i * e.o_row;
    for (int64_t x = 0; x < d; ++x) dst[x] = static_cast<scalar_t>(tmp.acc[r * d + x] * inv_l);
    e.lse[h * e.lse_head + i * e.lse_row] =
        l != 0 ? static_cast<float>(tmp.m[r] + std::log(l)) : -std::numeric_limits<float>::infinity();
  }
}

// The forward over a call's entries (FwdEntry: batch entries, packed sequences or cache entries), every entry's work
// items (entry, query head or heads, block of query rows) in one parallel_for. Short GQA queries (decoding) take every
// query head of a kv head in one item, so that each key block is converted once for all of them; a row's arithmetic
// is the same either way (the same bits).
template <typename scalar_t, typename Entry>
void fwd_cpu_kernel(const std::vector<Entry>& entries, double softcap, const std::optional<at::Tensor>& sinks,
                    double scale) {
  const at::Tensor sink_rows = sinks.has_value() ? sinks->contiguous() : at::Tensor();
  const float* sink_of = sink_rows.defined() ? sink_rows.data_ptr<float>() : nullptr;
  // Per entry: the query heads and the query rows of an item, and the first item past the entry.
  std::vector<int64_t> item_heads(entries.size()), block_rows(entries.size()), items_end(entries.size());
  int64_t items = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const AttentionShape& s = entries[i].s;
    const int64_t group = s.heads / s.heads_kv;
    const bool pack = group > 1 && s.len_q * group <= kBlockM;
    item_heads[i] = pack ? group : 1;
    block_rows[i] = pack ? s.len_q : kBlockM;
    const int64_t q_blocks = s.len_q == 0 ? 0 : (s.len_q + block_rows[i] - 1) / block_rows[i];
    items += s.heads / item_heads[i] * q_blocks;
    items_end[i] = items;
  }
  // grain 1: a work item already costs kBlockM * Lk * D multiply-adds (or is a decode row of a long cache).
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    FwdScratch<at::opmath_type<scalar_t>> tmp(entries.empty() ? 0 : entries.front().s.head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const size_t i = std::upper_bound(items_end.begin(), items_end.end(), item) - items_end.begin();
      const Entry& e = entries[i];
      const int64_t group = e.s.heads / e.s.heads_kv;
      const int64_t heads = item_heads[i];
      const int64_t q_blocks = (e.s.len_q + block_rows[i] - 1) / block_rows[i];
      const int64_t local = item - (i == 0 ? 0 : items_end[i - 1]);
      const int64_t q_begin = local % q_blocks * block_rows[i];
      const int64_t h_first = local / q_blocks * heads;
      const auto [k_mat, v_mat] = e.kv(h_first / group);
      attend_query_block<scalar_t>(e, k_mat, v_mat, h_first, heads, q_begin,
                                   std::min(e.s.len_q, q_begin + block_rows[i]), Band(e.s, e.left, e.right), softcap,
                                   sink_of, scale, tmp);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> fwd_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           bool causal, std::optional<double> scale, at::IntArrayRef window_size,
                                           double softcap, const std::optional<at::Tensor>& sinks) {
  const AttentionShape s = check_fwd_inputs(q, k, v);
  check_cpu_dtype(q.scalar_type(), "flashattn.fwd");
  const double softmax_scale = resolve_scale(scale, s.head_dim);
  const ScoreMods mods = check_score_mods(q, s, causal, window_size, softcap, sinks);

  at::Tensor out = empty_output_like(q);
  at::Tensor lse = at::empty({s.batch, s.heads, s.len_q}, q.options().dtype(at::kFloat));
  if (s.empty()) return {out, lse};

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "flashattn_fwd_cpu", [&] {
    const AttentionShape entry_shape{1, s.heads, s.heads_kv, s.len_q, s.len_k, s.head_dim};
    std::vector<FwdEntry<scalar_t, DenseKv<scalar_t>>> entries;
    for (int64_t b = 0; b < s.batch; ++b) {
      entries.push_back(batch_entry<scalar_t>(q, out, lse, b, entry_shape, mods, batch_kv<scalar_t>(k, v, b)));
    }
    fwd_cpu_kernel<scalar_t>(entries, mods.softcap, mods.sinks, softmax_scale);
  });
  return {out, lse};
}

// ==== backward ====================================================================================================
//
// With S = scale Q K^T, P = exp(S - lse) (0 where masked or lse = -inf), D_i = rowsum(dO * O)_i - dlse_i:
//   dV = P^T dO,   dP = dO V^T,   dS = P * (dP - D),   dQ = scale dS K,   dK = scale dS^T Q.
// (dlse enters through d lse_i / d S_ij = P_ij: it adds P * dlse to dS.) dK and dV of a kv head sum over the query
// heads of its group. A row with lse = -inf (one that sees no key, as fwd returns it) has P = 0: it is skipped
// outright, so whatever its dout or dlse holds never turns into 0 * inf = NaN. With softcap, S is the capped score
// c tanh(S0 / c) and dS carries the factor 1 - tanh^2 on its way back to S0. A sink only enters through lse (its
// probability exp(sink - lse) is the part of the denominator no key takes): d sink = -sum_i exp(sink - lse_i) D_i.

// Per-row inputs of the backward, (B, H, Lq) contiguous in the accumulation type (lse and dlse may have any strides).
template <typename acc_t>
struct RowStats {
  std::vector<acc_t> lse;     // the saved logsumexp, -inf for a row that sees no key
  std::vector<acc_t> delta;   // rowsum(dO * O) - dlse
  std::vector<acc_t> dsinks;  // per head, with sinks
  int64_t heads, len_q;
  const acc_t* lse_of(int64_t b, int64_t h) const { return lse.data() + (b * heads + h) * len_q; }
  const acc_t* delta_of(int64_t b, int64_t h) const { return delta.data() + (b * heads + h) * len_q; }
};

template <typename scalar_t>
RowStats<at::opmath_type<scalar_t>> row_stats(const at::Tensor& dout, const at::Tensor& out, const at::Tensor& lse,
                                              const std::optional<at::Tensor>& dlse,
                                              const std::optional<at::Tensor>& sinks, const AttentionShape& s) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t rows_total = s.batch * s.heads * s.len_q;
  RowStats<acc_t> stats{std::vector<acc_t>(rows_total), std::vector<acc_t>(rows_total), {}, s.heads, s.len_q};
  // The start of the (Lq,) row of a (B, H, Lq) float tensor for (b, h); its elements are stride(2) apart.
  const auto float_row = [](const at::Tensor& t, int64_t b, int64_t h) {
    return t.data_ptr<float>() + b * t.stride(0) + h * t.stride(1);
  };
  at::parallel_for(0, s.batch * s.heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / s.heads, h = bh % s.heads;
      const auto do_mat = head_slice<const scalar_t>(dout, b, h);
      const auto o_mat = head_slice<const scalar_t>(out, b, h);
      const float* lse_row = float_row(lse, b, h);
      const float* dlse_row = dlse.has_value() ? float_row(*dlse, b, h) : nullptr;
      const int64_t lse_step = lse.stride(2), dlse_step = dlse.has_value() ? dlse->stride(2) : 0;
      for (int64_t i = 0; i < s.len_q; ++i) {
        const scalar_t* do_row = do_mat.row(i);
        const scalar_t* o_row = o_mat.row(i);
        acc_t dot = 0;
        for (int64_t x = 0; x < s.head_dim; ++x) dot += static_cast<acc_t>(do_row[x]) * static_cast<acc_t>(o_row[x]);
        stats.delta[bh * s.len_q + i] = dlse_row ? dot - static_cast<acc_t>(dlse_row[i * dlse_step]) : dot;
        stats.lse[bh * s.len_q + i] = static_cast<acc_t>(lse_row[i * lse_step]);
      }
    }
  });
  if (sinks.has_value()) {  // one thread per head, rows in order: deterministic
    const at::Tensor sink = sinks->contiguous();
    stats.dsinks.assign(s.heads, acc_t(0));
    at::parallel_for(0, s.heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t h = begin; h < end; ++h) {
        const acc_t sink_h = static_cast<acc_t>(sink.data_ptr<float>()[h]);
        double sum = 0;  // over B * Lq rows: in double, so that the error does not grow with the rows
        for (int64_t b = 0; b < s.batch; ++b) {
          const acc_t* lse_bh = stats.lse_of(b, h);
          const acc_t* delta_bh = stats.delta_of(b, h);
          for (int64_t i = 0; i < s.len_q; ++i) {
            if (lse_bh[i] == -std::numeric_limits<acc_t>::infinity()) continue;
            sum += static_cast<double>(std::exp(sink_h - lse_bh[i]) * delta_bh[i]);
          }
        }
        stats.dsinks[h] = static_cast<acc_t>(-sum);
      }
    });
  }
  return stats;
}

// Per-thread scratch tiles of the backward; each pass uses the ones it needs.
template <typename acc_t>
struct BwdScratch {
  explicit BwdScratch(int64_t d)
      : q(kBlockM * d), dout(kBlockM * d), k_t(d * kBlockN), v_t(d * kBlockN), k(kBlockN * d),
        p(kBlockM * kBlockN), ds(kBlockM * kBlockN), first(kBlockM), visible(kBlockM),
        acc_a(std::max(kBlockM, kBlockN) * d), acc_b(kBlockN * d) {}
  std::vector<acc_t> q;          // (kBlockM, D) query rows, pre-multiplied by the scale (as in the forward)
  std::vector<acc_t> dout;       // (kBlockM, D) their output gradients
  std::vector<acc_t> k_t, v_t;   // (D, kBlockN) keys and values, transposed for block_scores
  std::vector<acc_t> k;          // (kBlockN, D) keys as rows, for dQ += dS K (query pass only)
  std::vector<acc_t> p;          // (kBlockM, kBlockN) (capped) scores, then probabilities P
  std::vector<acc_t> ds;         // (kBlockM, kBlockN) dP = dO V^T, then dS
  std::vector<int64_t> first;    // per query row, the first key of the key block it sees...
  std::vector<int64_t> visible;  // ...and the end of those keys (first == visible: none)
  std::vector<acc_t> acc_a;      // key pass: (kBlockN, D) dK; query pass: (kBlockM, D) dQ / scale
  std::vector<acc_t> acc_b;      // key pass: (kBlockN, D) dV
};

// The tile of one (query block, key block) pair, shared by both passes. Expects q, dout, k_t, v_t loaded; leaves P in
// tmp.p, dS in tmp.ds and the visible key count of each row in tmp.visible (entries past it are not written).
template <typename acc_t>
void probs_and_score_grads(BwdScratch<acc_t>& tmp, const AttentionShape& s, const Band& band, double softcap,
                           int64_t q_begin, int64_t rows, int64_t k_begin, int64_t cols, const acc_t* lse,
                           const acc_t* delta) {
  const int64_t d = s.head_dim;
  block_scores(tmp.q.data(), tmp.k_t.data(), tmp.p.data(), rows, cols, d);      // S, bitwise as in the forward
  cap_scores(tmp.p.data(), rows, cols, softcap);
  block_scores(tmp.dout.data(), tmp.v_t.data(), tmp.ds.data(), rows, cols, d);  // dP
  const acc_t inv_cap = softcap > 0.0 ? static_cast<acc_t>(1.0 / softcap) : acc_t(0);
  for (int64_t r = 0; r < rows; ++r) {
    const acc_t row_lse = lse[q_begin + r];
    const int64_t first = std::clamp<int64_t>(band.key_begin(q_begin + r) - k_begin, 0, cols);
    const int64_t last = std::clamp<int64_t>(band.key_end(q_begin + r) - k_begin, 0, cols);
    const bool keyless = row_lse == -std::numeric_limits<acc_t>::infinity() || last <= first;
    tmp.first[r] = keyless ? 0 : first;
    tmp.visible[r] = keyless ? 0 : last;
    acc_t* p_row = tmp.p.data() + r * kBlockN;
    acc_t* ds_row = tmp.ds.data() + r * kBlockN;
    const acc_t row_delta = delta[q_begin + r];
    for (int64_t c = tmp.first[r]; c < tmp.visible[r]; ++c) {
      const acc_t score = p_row[c];
      p_row[c] = std::exp(score - row_lse);
      ds_row[c] = p_row[c] * (ds_row[c] - row_delta);
      if (softcap > 0.0) {
        const acc_t t = score * inv_cap;  // tanh of the uncapped score over the cap
        ds_row[c] *= acc_t(1) - t * t;
      }
    }
  }
}

// dK and dV of keys [k_begin, k_begin + cols) of kv head h_kv: over the query heads of its group and every query
// block that sees at least one of the keys (the band's other blocks are skipped).
template <typename scalar_t>
void key_block_grads(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     at::Tensor& dk, at::Tensor& dv, const RowStats<at::opmath_type<scalar_t>>& stats,
                     const AttentionShape& s, int64_t b, int64_t h_kv, int64_t k_begin, int64_t cols,
                     const Band& band, double softcap, double scale, BwdScratch<at::opmath_type<scalar_t>>& tmp) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t d = s.head_dim;
  const int64_t group = s.heads / s.heads_kv;
  load_rows_transposed(head_slice<const scalar_t>(k, b, h_kv), k_begin, cols, d, tmp.k_t.data());
  load_rows_transposed(head_slice<const scalar_t>(v, b, h_kv), k_begin, cols, d, tmp.v_t.data());
  acc_t* dk_acc = tmp.acc_a.data();
  acc_t* dv_acc = tmp.acc_b.data();
  std::fill(dk_acc, dk_acc + cols * d, acc_t(0));
  std::fill(dv_acc, dv_acc + cols * d, acc_t(0));

  const int64_t q_first = band.first_row_seeing(k_begin) / kBlockM * kBlockM;
  const int64_t q_end = band.row_end_seeing(k_begin + cols);
  for (int64_t h = h_kv * group; h < (h_kv + 1) * group; ++h) {
    const auto q_mat = head_slice<const scalar_t>(q, b, h);
    const auto do_mat = head_slice<const scalar_t>(dout, b, h);
    for (int64_t q_begin = q_first; q_begin < q_end; q_begin += kBlockM) {
      const int64_t rows = std::min(kBlockM, s.len_q - q_begin);
      load_rows(q_mat, q_begin, rows, d, tmp.q.data(), static_cast<acc_t>(scale));
      load_rows(do_mat, q_begin, rows, d, tmp.dout.data());
      probs_and_score_grads(tmp, s, band, softcap, q_begin, rows, k_begin, cols, stats.lse_of(b, h),
                            stats.delta_of(b, h));
      // dV += P^T dO and dK += dS^T (scale Q): row r adds to the keys it sees.
      for (int64_t r = 0; r < rows; ++r) {
        const acc_t* p_row = tmp.p.data() + r * kBlockN;
        const acc_t* ds_row = tmp.ds.data() + r * kBlockN;
        const acc_t* do_row = tmp.dout.data() + r * d;
        const acc_t* q_row = tmp.q.data() + r * d;
        for (int64_t c = tmp.first[r]; c < tmp.visible[r]; ++c) {
          const acc_t p = p_row[c], ds = ds_row[c];
          acc_t* dv_row = dv_acc + c * d;
          acc_t* dk_row = dk_acc + c * d;
          for (int64_t x = 0; x < d; ++x) {
            dv_row[x] += p * do_row[x];
            dk_row[x] += ds * q_row[x];
          }
        }
      }
    }
  }

  const auto dk_mat = head_slice<scalar_t>(dk, b, h_kv);
  const auto dv_mat = head_slice<scalar_t>(dv, b, h_kv);
  for (int64_t c = 0; c < cols; ++c) {
    scalar_t* dk_dst = dk_mat.row(k_begin + c);
    scalar_t* dv_dst = dv_mat.row(k_begin + c);
    for (int64_t x = 0; x < d; ++x) {
      dk_dst[x] = static_cast<scalar_t>(dk_acc[c * d + x]);
      dv_dst[x] = static_cast<scalar_t>(dv_acc[c * d + x]);
    }
  }
}

// dQ of rows [q_begin, q_begin + rows) of query head h, over the key blocks they see.
template <typename scalar_t>
void query_block_grads(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       at::Tensor& dq, const RowStats<at::opmath_type<scalar_t>>& stats, const AttentionShape& s,
                       int64_t b, int64_t h, int64_t q_begin, int64_t rows, const Band& band, double softcap,
                       double scale, BwdScratch<at::opmath_type<scalar_t>>& tmp) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t d = s.head_dim;
  const int64_t h_kv = h / (s.heads / s.heads_kv);
  const auto k_mat = head_slice<const scalar_t>(k, b, h_kv);
  const auto v_mat = head_slice<const scalar_t>(v, b, h_kv);
  load_rows(head_slice<const scalar_t>(q, b, h), q_begin, rows, d, tmp.q.data(), static_cast<acc_t>(scale));
  load_rows(head_slice<const scalar_t>(dout, b, h), q_begin, rows, d, tmp.dout.data());
  acc_t* dq_acc = tmp.acc_a.data();  // dS K; the scale is applied once at the end
  std::fill(dq_acc, dq_acc + rows * d, acc_t(0));

  const int64_t block_key_end = band.key_end(q_begin + rows - 1);
  for (int64_t k_begin = band.key_begin(q_begin); k_begin < block_key_end; k_begin += kBlockN) {
    const int64_t cols = std::min(kBlockN, block_key_end - k_begin);
    load_rows_transposed(k_mat, k_begin, cols, d, tmp.k_t.data());
    load_rows_transposed(v_mat, k_begin, cols, d, tmp.v_t.data());
    load_rows(k_mat, k_begin, cols, d, tmp.k.data());
    probs_and_score_grads(tmp, s, band, softcap, q_begin, rows, k_begin, cols, stats.lse_of(b, h),
                          stats.delta_of(b, h));
    for (int64_t r = 0; r < rows; ++r) {
      const acc_t* ds_row = tmp.ds.data() + r * kBlockN;
      acc_t* dq_row = dq_acc + r * d;
      for (int64_t c = tmp.first[r]; c < tmp.visible[r]; ++c) {
        const acc_t ds = ds_row[c];
        const acc_t* k_row = tmp.k.data() + c * d;
        for (int64_t x = 0; x < d; ++x) dq_row[x] += ds * k_row[x];
      }
    }
  }

  const auto dq_mat = head_slice<scalar_t>(dq, b, h);
  for (int64_t r = 0; r < rows; ++r) {
    scalar_t* dst = dq_mat.row(q_begin + r);
    for (int64_t x = 0; x < d; ++x) dst[x] = static_cast<scalar_t>(dq_acc[r * d + x] * static_cast<acc_t>(scale));
  }
}

template <typename scalar_t>
void bwd_cpu_kernel(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& dlse,
                    at::Tensor& dq, at::Tensor& dk, at::Tensor& dv, at::Tensor& dsinks, const AttentionShape& s,
                    const ScoreMods& mods, double scale) {
  using acc_t = at::opmath_type<scalar_t>;
  const RowStats<acc_t> stats = row_stats<scalar_t>(dout, out, lse, dlse, mods.sinks, s);
  for (int64_t h = 0; h < static_cast<int64_t>(stats.dsinks.size()); ++h) {
    dsinks.data_ptr<float>()[h] = static_cast<float>(stats.dsinks[h]);
  }
  const Band band(s, mods);

  // grain 1 in both passes: a work item costs at least kBlockN (or kBlockM) * D multiply-adds per visible row/key.
  const int64_t k_blocks = (s.len_k + kBlockN - 1) / kBlockN;
  at::parallel_for(0, s.batch * s.heads_kv * k_blocks, 1, [&](int64_t begin, int64_t end) {
    BwdScratch<acc_t> tmp(s.head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t k_begin = item % k_blocks * kBlockN;
      const int64_t bh = item / k_blocks;
      key_block_grads<scalar_t>(dout, q, k, v, dk, dv, stats, s, bh / s.heads_kv, bh % s.heads_kv, k_begin,
                                std::min(kBlockN, s.len_k - k_begin), band, mods.softcap, scale, tmp);
    }
  });

  const int64_t q_blocks = (s.len_q + kBlockM - 1) / kBlockM;
  at::parallel_for(0, s.batch * s.heads * q_blocks, 1, [&](int64_t begin, int64_t end) {
    BwdScratch<acc_t> tmp(s.head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t q_begin = item % q_blocks * kBlockM;
      const int64_t bh = item / q_blocks;
      query_block_grads<scalar_t>(dout, q, k, v, dq, stats, s, bh / s.heads, bh % s.heads, q_begin,
                                  std::min(kBlockM, s.len_q - q_begin), band, mods.softcap, scale, tmp);
    }
  });
}

// `deterministic` is accepted and needs nothing: the CPU backward is deterministic by construction (see the top).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, bool causal, std::optional<double> scale, const std::optional<at::Tensor>& dlse,
    bool /*deterministic*/, at::IntArrayRef window_size, double softcap, const std::optional<at::Tensor>& sinks) {
  const AttentionShape s = check_bwd_inputs(dout, q, k, v, out, lse, dlse);
  check_cpu_dtype(q.scalar_type(), "flashattn.bwd");
  const double softmax_scale = resolve_scale(scale, s.head_dim, "flashattn.bwd");
  const ScoreMods mods = check_score_mods(q, s, causal, window_size, softcap, sinks, "flashattn.bwd");

  at::Tensor dsinks = at::zeros({sinks.has_value() ? s.heads : 0}, q.options().dtype(at::kFloat));
  if (s.empty()) {  // nothing attends to anything: every gradient is zero
    return {empty_output_like(q).zero_(), empty_output_like(k).zero_(), empty_output_like(v).zero_(), dsinks};
  }
  // Every element is written: dK / dV by their key block's work item, dQ by its query block's (0 on keyless rows).
  at::Tensor dq = empty_output_like(q);
  at::Tensor dk = empty_output_like(k);
  at::Tensor dv = empty_output_like(v);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "flashattn_bwd_cpu", [&] {
    bwd_cpu_kernel<scalar_t>(dout, q, k, v, out, lse, dlse, dq, dk, dv, dsinks, s, mods, softmax_scale);
  });
  return {dq, dk, dv, dsinks};
}

// ==== packed sequences (varlen) ===================================================================================
//
// The forward takes every sequence as an entry (its rows in place in the packed tensors, any strides, no copy), all in
// one parallel_for; the backward runs the dense kernels above on (1, H, L_b, D) views, one sequence after the other.
// Either way a sequence has the bits of the dense op on it alone, whatever else is packed with it.

// The (1, heads, rows, D) view of rows [begin, begin + rows) of a packed (total, heads, D) tensor.
at::Tensor sequence_view(const at::Tensor& packed, int64_t begin, int64_t rows) {
  return packed.narrow(0, begin, rows).transpose(0, 1).unsqueeze(0);
}

// The (1, H, rows) view of a (H, total) lse.
at::Tensor sequence_lse(const at::Tensor& lse, int64_t begin, int64_t rows) {
  return lse.narrow(1, begin, rows).unsqueeze(0);
}

// Checked cu_seqlens (CPU tensors, values read here) as contiguous int32 tensors.
std::pair<at::Tensor, at::Tensor> checked_cu_seqlens(const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                                     const VarlenShape& vs, const char* op) {
  at::Tensor cu_q = cu_seqlens_q.contiguous(), cu_k = cu_seqlens_k.contiguous();
  check_cu_seqlens_values(cu_q, vs.total_q, "cu_seqlens_q", op);
  check_cu_seqlens_values(cu_k, vs.total_k, "cu_seqlens_k", op);
  return {cu_q, cu_k};
}

// Calls fn(row of q, row of k, shape, score mods) for every sequence with queries, in order (each sequence as a dense
// (1, H, L_q, D) x (1, Hk, L_k, D) call, its score modifications checked and normalised for its own lengths).
template <typename Fn>
void for_each_sequence(const at::Tensor& cu_q, const at::Tensor& cu_k, const at::Tensor& q, const VarlenShape& vs,
                       bool causal, at::IntArrayRef window_size, double softcap,
                       const std::optional<at::Tensor>& sinks, const char* op, Fn&& fn) {
  // Checked once for the whole pack (as on CUDA), so that a call without sequences is checked too.
  check_score_mods(q, AttentionShape{1, vs.heads, vs.heads_kv, vs.total_q, vs.total_k, vs.head_dim}, causal,
                   window_size, softcap, sinks, op);
  const int32_t* cq = cu_q.data_ptr<int32_t>();
  const int32_t* ck = cu_k.data_ptr<int32_t>();
  for (int64_t b = 0; b < vs.batch; ++b) {
    const AttentionShape s{1, vs.heads, vs.heads_kv, cq[b + 1] - cq[b], ck[b + 1] - ck[b], vs.head_dim};
    const ScoreMods mods = check_score_mods(q, s, causal, window_size, softcap, sinks, op);
    if (!s.empty()) fn(cq[b], ck[b], s, mods);
  }
}

std::tuple<at::Tensor, at::Tensor> fwd_varlen_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                                  std::optional<int64_t> /*max_seqlen_q*/,
                                                  std::optional<int64_t> /*max_seqlen_k*/, bool causal,
                                                  std::optional<double> scale, at::IntArrayRef window_size,
                                                  double softcap, const std::optional<at::Tensor>& sinks) {
  constexpr const char* op = "flashattn.fwd_varlen";
  const VarlenShape vs = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, op);
  check_cpu_dtype(q.scalar_type(), op);
  const double softmax_scale = resolve_scale(scale, vs.head_dim, op);
  const auto [cu_q, cu_k] = checked_cu_seqlens(cu_seqlens_q, cu_seqlens_k, vs, op);
  at::Tensor out = at::empty({vs.total_q, vs.heads, vs.head_dim}, q.options());
  at::Tensor lse = at::empty({vs.heads, vs.total_q}, q.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "flashattn_fwd_varlen_cpu", [&] {
    // Every sequence's rows in place in the packed (total, H, D) tensors and the (H, total_q) lse; one parallel_for.
    std::vector<FwdEntry<scalar_t, DenseKv<scalar_t>>> entries;
    for_each_sequence(cu_q, cu_k, q, vs, causal, window_size, softcap, sinks, op,
                      [&](int64_t row_q, int64_t row_k, const AttentionShape& s, const ScoreMods& mods) {
      const auto rows = [](const at::Tensor& t, int64_t row) {
        return static_cast<scalar_t*>(t.data_ptr()) + row * t.stride(0);
      };
      entries.push_back({s, mods.left, mods.right, rows(q, row_q), q.stride(1), q.stride(0), rows(out, row_q),
                         out.stride(1), out.stride(0), lse.data_ptr<float>() + row_q * lse.stride(1), lse.stride(0),
                         lse.stride(1),
                         DenseKv<scalar_t>{rows(k, row_k), rows(v, row_k), k.stride(1), k.stride(0), v.stride(1),
                                           v.stride(0)}});
    });
    fwd_cpu_kernel<scalar_t>(entries, softcap, sinks, softmax_scale);
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd_varlen_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
    std::optional<int64_t> /*max_seqlen_q*/, std::optional<int64_t> /*max_seqlen_k*/, bool causal,
    std::optional<double> scale, const std::optional<at::Tensor>& dlse, bool /*deterministic*/,
    at::IntArrayRef window_size, double softcap, const std::optional<at::Tensor>& sinks) {
  constexpr const char* op = "flashattn.bwd_varlen";
  const VarlenShape vs = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, op);
  check_varlen_bwd_inputs(dout, q, out, lse, dlse, vs, op);
  check_cpu_dtype(q.scalar_type(), op);
  const double softmax_scale = resolve_scale(scale, vs.head_dim, op);
  const auto [cu_q, cu_k] = checked_cu_seqlens(cu_seqlens_q, cu_seqlens_k, vs, op);
  // Zeroed: a sequence without queries leaves its keys' gradients 0.
  at::Tensor dq = at::zeros(q.sizes(), q.options());
  at::Tensor dk = at::zeros(k.sizes(), k.options());
  at::Tensor dv = at::zeros(v.sizes(), v.options());
  at::Tensor dsinks = at::zeros({sinks.has_value() ? vs.heads : 0}, q.options().dtype(at::kFloat));
  for_each_sequence(cu_q, cu_k, q, vs, causal, window_size, softcap, sinks, op,
                    [&](int64_t row_q, int64_t row_k, const AttentionShape& s, const ScoreMods& mods) {
    const int64_t len_q = s.len_q, len_k = s.len_k;
    at::Tensor dq_b = sequence_view(dq, row_q, len_q);
    at::Tensor dk_b = sequence_view(dk, row_k, len_k);
    at::Tensor dv_b = sequence_view(dv, row_k, len_k);
    at::Tensor dsinks_b = at::zeros_like(dsinks);
    const std::optional<at::Tensor> dlse_b =
        dlse.has_value() ? std::optional<at::Tensor>(sequence_lse(*dlse, row_q, len_q)) : std::nullopt;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "flashattn_bwd_varlen_cpu", [&] {
      bwd_cpu_kernel<scalar_t>(sequence_view(dout, row_q, len_q), sequence_view(q, row_q, len_q),
                               sequence_view(k, row_k, len_k), sequence_view(v, row_k, len_k),
                               sequence_view(out, row_q, len_q), sequence_lse(lse, row_q, len_q), dlse_b, dq_b, dk_b,
                               dv_b, dsinks_b, s, mods, softmax_scale);
    });
    dsinks.add_(dsinks_b);  // sequence by sequence: a fixed order
  });
  return {dq, dk, dv, dsinks};
}

// ==== KV cache ======================================================================================================
//
// The new keys and values of every entry are written into the cache at its valid length first; then the forward runs
// over every entry's valid keys in one parallel_for: a dense cache's rows from the entry's left padding, or a paged
// one's read in place through the entry's block table row. Nothing past a valid length (or before the left padding's
// end) is read.

std::tuple<at::Tensor, at::Tensor> fwd_kvcache_cpu(const at::Tensor& q, at::Tensor& k_cache, at::Tensor& v_cache,
                                                   const std::optional<at::Tensor>& k,
                                                   const std::optional<at::Tensor>& v,
                                                   const std::optional<at::Tensor>& cache_seqlens,
                                                   const std::optional<at::Tensor>& block_table, bool causal,
                                                   std::optional<double> scale, at::IntArrayRef window_size,
                                                   double softcap, const std::optional<at::Tensor>& sinks,
                                                   int64_t num_splits, const std::optional<at::Tensor>& cache_leftpad) {
  constexpr const char* op = "flashattn.fwd_kvcache";
  const KvCacheShape ks =
      check_kvcache_inputs(q, k_cache, v_cache, k, v, cache_seqlens, block_table, num_splits, cache_leftpad, op);
  check_cpu_dtype(q.scalar_type(), op);
  const double softmax_scale = resolve_scale(scale, ks.head_dim, op);
  // Checked before anything is written to the caches (as on CUDA); normalised below for each entry's keys.
  check_score_mods(q, AttentionShape{ks.batch, ks.heads, ks.heads_kv, ks.len_q, ks.capacity, ks.head_dim}, causal,
                   window_size, softcap, sinks, op);
  const at::Tensor lengths = cache_seqlens.has_value() ? cache_seqlens->contiguous() : at::Tensor();
  const at::Tensor pages = ks.paged ? block_table->contiguous() : at::Tensor();
  const at::Tensor leftpad = cache_leftpad.has_value() ? cache_leftpad->contiguous() : at::Tensor();
  std::vector<int64_t> valid(ks.batch), first(ks.batch, 0);
  for (int64_t b = 0; b < ks.batch; ++b) {
    valid[b] = lengths.defined() ? lengths.data_ptr<int32_t>()[b] : ks.capacity - ks.len_new;
    TORCH_CHECK(valid[b] >= 0 && valid[b] + ks.len_new <= ks.capacity, op, ": cache_seqlens[", b,
                "] + Lnew must lie in [0, ", ks.capacity, "] (the cache's length), got ", valid[b], " + ", ks.len_new);
    if (leftpad.defined()) first[b] = leftpad.data_ptr<int32_t>()[b];
    TORCH_CHECK(first[b] >= 0 && first[b] <= valid[b] + ks.len_new, op, ": cache_leftpad[", b, "] must lie in [0, ",
                valid[b] + ks.len_new, "] (the entry's keys end there), got ", first[b]);
    if (ks.paged) {
      const int32_t* row = pages.data_ptr<int32_t>() + b * pages.size(1);
      for (int64_t i = 0; i * ks.page_size < valid[b] + ks.len_new; ++i) {
        TORCH_CHECK(row[i] >= 0 && row[i] < ks.num_pages, op, ": block_table[", b, ", ", i, "] = ", row[i],
                    " is not a page of the cache (0 .. ", ks.num_pages - 1, ")");
      }
    }
  }
  // Position p of entry b: (page, offset) in a paged cache, (b, p) in a dense one.
  const auto slot = [&](int64_t b, int64_t p) -> std::pair<int64_t, int64_t> {
    if (!ks.paged) return {b, p};
    return {pages.data_ptr<int32_t>()[b * pages.size(1) + p / ks.page_size], p % ks.page_size};
  };
  at::Tensor out = empty_output_like(q);
  at::Tensor lse = at::empty({ks.batch, ks.heads, ks.len_q}, q.options().dtype(at::kFloat));
  for (int64_t b = 0; b < ks.batch; ++b) {
    for (int64_t t = 0; t < ks.len_new; ++t) {
      const auto [where, offset] = slot(b, valid[b] + t);
      k_cache.select(0, where).select(1, offset).copy_(k->select(0, b).select(1, t));
      v_cache.select(0, where).select(1, offset).copy_(v->select(0, b).select(1, t));
    }
  }
  // Every entry's keys (from its left padding to its end) in one parallel_for: a dense cache's rows at the entry's
  // offset, or a paged one's through its block table row.
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "flashattn_fwd_kvcache_cpu", [&] {
    const auto run = [&](const auto& kv_of) {
      using Kv = std::decay_t<decltype(kv_of(int64_t{0}))>;
      std::vector<FwdEntry<scalar_t, Kv>> entries;
      for (int64_t b = 0; b < ks.batch; ++b) {
        const AttentionShape s{1, ks.heads, ks.heads_kv, ks.len_q, valid[b] + ks.len_new - first[b], ks.head_dim};
        const ScoreMods mods = check_score_mods(q, s, causal, window_size, softcap, sinks, op);
        if (s.empty()) continue;
        entries.push_back(batch_entry<scalar_t>(q, out, lse, b, s, mods, kv_of(b)));
      }
      fwd_cpu_kernel<scalar_t>(entries, softcap, sinks, softmax_scale);
    };
    if (ks.paged) {
      run([&](int64_t b) {
        return PagedKv<scalar_t>{static_cast<const scalar_t*>(k_cache.data_ptr()),
                                 static_cast<const scalar_t*>(v_cache.data_ptr()), k_cache.stride(1),
                                 v_cache.stride(1), k_cache.stride(0), v_cache.stride(0), k_cache.stride(2),
                                 v_cache.stride(2), ks.page_size, pages.data_ptr<int32_t>() + b * pages.size(1)};
      });
    } else {
      run([&](int64_t b) { return batch_kv<scalar_t>(k_cache, v_cache, b, first[b]); });
    }
  });
  return {out, lse};
}

}  // namespace
}  // namespace flashattn

TORCH_LIBRARY_IMPL(flashattn, CPU, m) {
  m.impl("fwd_kvcache", &flashattn::fwd_kvcache_cpu);
  m.impl("fwd", &flashattn::fwd_cpu);
  m.impl("bwd", &flashattn::bwd_cpu);
  m.impl("fwd_varlen", &flashattn::fwd_varlen_cpu);
  m.impl("bwd_varlen", &flashattn::bwd_varlen_cpu);
}
