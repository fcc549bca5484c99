// CPU backend of flashattn.fwd: a tiled online-softmax forward (the FlashAttention algorithm, written for a CPU).
//
// Work is split over (batch, head, block of kBlockM query rows) with at::parallel_for. One work item loads its query
// block once, then walks the key/value blocks of kBlockN keys, keeping per query row a running max m, a running sum l
// of exp(score - m) and an unnormalised output accumulator. The full (Lq, Lk) score matrix never exists; the scratch
// memory of a thread is O((kBlockM + 2 kBlockN) * D).
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
#include <vector>

#include "api/checks.h"

namespace flashattn {
namespace {

// 32 query rows x 64 keys: the tiles of one work item (q, k^T, v, scores, accumulator) stay within ~200 KB at
// D = 256, so they live in L2; 32 rows keep enough work items for the threads when Lq is short.
constexpr int64_t kBlockM = 32;
constexpr int64_t kBlockN = 64;

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

// Keys visible to query row i are [0, key_end(i)): all of them, or with the bottom-right causal mask those with
// j <= i + Lk - Lq. May be <= 0 (the row sees no key) when Lq > Lk.
inline int64_t key_end(int64_t i, const AttentionShape& s, bool causal) {
  return causal ? std::min(s.len_k, i + s.len_k - s.len_q + 1) : s.len_k;
}

// Per-thread scratch tiles, allocated once per parallel chunk and reused for all its work items.
template <typename acc_t>
struct Scratch {
  explicit Scratch(int64_t d)
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

// scores[r][c] = q[r] . k[c] for `rows` query rows and `cols` keys (q already carries the scale).
template <typename acc_t>
void block_scores(const acc_t* q, const acc_t* k_t, acc_t* scores, int64_t rows, int64_t cols, int64_t d) {
  for (int64_t r = 0; r < rows; ++r) {
    acc_t* s_row = scores + r * kBlockN;
    std::fill(s_row, s_row + cols, acc_t(0));
    const acc_t* q_row = q + r * d;
    for (int64_t x = 0; x < d; ++x) {
      const acc_t qx = q_row[x];
      const acc_t* k_col = k_t + x * kBlockN;
      for (int64_t c = 0; c < cols; ++c) s_row[c] += qx * k_col[c];
    }
  }
}

// One online-softmax step for one query row over `visible` keys of the current block (visible >= 1):
// the row max grows to m_new, the old sum and accumulator are rescaled by exp(m_old - m_new), and the new
// probabilities (written over the scores) are added. m_new is finite because at least one finite score is visible,
// so the first visible block gives exp(-inf - m_new) = 0 for the empty history instead of a NaN.
template <typename acc_t>
void online_softmax_row(acc_t* s_row, const acc_t* v, acc_t* acc_row, acc_t& m, acc_t& l, int64_t visible,
                        int64_t d) {
  const acc_t m_new = std::max(m, *std::max_element(s_row, s_row + visible));
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

// Computes rows [q_begin, q_end) of one (batch, head): out = softmax(scale * q k^T) v, lse = m + log(l).
template <typename scalar_t>
void attend_query_block(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                        at::Tensor& lse, const AttentionShape& s, int64_t b, int64_t h, int64_t q_begin, int64_t q_end,
                        bool causal, double scale, Scratch<at::opmath_type<scalar_t>>& tmp) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t d = s.head_dim;
  const int64_t rows = q_end - q_begin;
  const int64_t h_kv = h / (s.heads / s.heads_kv);
  const auto q_mat = head_slice<const scalar_t>(q, b, h);
  const auto k_mat = head_slice<const scalar_t>(k, b, h_kv);
  const auto v_mat = head_slice<const scalar_t>(v, b, h_kv);

  for (int64_t r = 0; r < rows; ++r) {
    const scalar_t* src = q_mat.row(q_begin + r);
    for (int64_t x = 0; x < d; ++x) tmp.q[r * d + x] = static_cast<acc_t>(src[x]) * static_cast<acc_t>(scale);
  }
  std::fill(tmp.acc.begin(), tmp.acc.begin() + rows * d, acc_t(0));
  std::fill(tmp.m.begin(), tmp.m.end(), -std::numeric_limits<acc_t>::infinity());
  std::fill(tmp.l.begin(), tmp.l.end(), acc_t(0));

  // The last row of the block sees the most keys; key blocks past its limit are fully masked and never loaded.
  const int64_t block_key_end = std::max<int64_t>(0, key_end(q_end - 1, s, causal));
  for (int64_t k_begin = 0; k_begin < block_key_end; k_begin += kBlockN) {
    const int64_t cols = std::min(kBlockN, block_key_end - k_begin);
    for (int64_t c = 0; c < cols; ++c) {
      const scalar_t* k_src = k_mat.row(k_begin + c);
      const scalar_t* v_src = v_mat.row(k_begin + c);
      for (int64_t x = 0; x < d; ++x) {
        tmp.k_t[x * kBlockN + c] = static_cast<acc_t>(k_src[x]);
        tmp.v[c * d + x] = static_cast<acc_t>(v_src[x]);
      }
    }
    block_scores(tmp.q.data(), tmp.k_t.data(), tmp.p.data(), rows, cols, d);
    for (int64_t r = 0; r < rows; ++r) {
      // Causal: only the first `visible` keys of this block are visible to the row (none on blocks right of it).
      const int64_t visible = std::min(cols, key_end(q_begin + r, s, causal) - k_begin);
      if (visible <= 0) continue;
      online_softmax_row(tmp.p.data() + r * kBlockN, tmp.v.data(), tmp.acc.data() + r * d, tmp.m[r], tmp.l[r],
                         visible, d);
    }
  }

  // Normalise. A row that saw no key has l == 0: it returns zeros and lse = -inf (not 0/0 = NaN).
  const auto out_mat = head_slice<scalar_t>(out, b, h);
  float* lse_row = lse.data_ptr<float>() + b * lse.stride(0) + h * lse.stride(1);
  for (int64_t r = 0; r < rows; ++r) {
    const acc_t l = tmp.l[r];
    const acc_t inv_l = l > 0 ? acc_t(1) / l : acc_t(0);
    scalar_t* dst = out_mat.row(q_begin + r);
    for (int64_t x = 0; x < d; ++x) dst[x] = static_cast<scalar_t>(tmp.acc[r * d + x] * inv_l);
    lse_row[q_begin + r] =
        l > 0 ? static_cast<float>(tmp.m[r] + std::log(l)) : -std::numeric_limits<float>::infinity();
  }
}

template <typename scalar_t>
void fwd_cpu_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse,
                    const AttentionShape& s, bool causal, double scale) {
  const int64_t q_blocks = (s.len_q + kBlockM - 1) / kBlockM;
  const int64_t work_items = s.batch * s.heads * q_blocks;
  // grain 1: a work item already costs kBlockM * Lk * D multiply-adds (or is a decode row of a long cache).
  at::parallel_for(0, work_items, 1, [&](int64_t begin, int64_t end) {
    Scratch<at::opmath_type<scalar_t>> tmp(s.head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t q_block = item % q_blocks;
      const int64_t bh = item / q_blocks;
      const int64_t q_begin = q_block * kBlockM;
      const int64_t q_end = std::min(s.len_q, q_begin + kBlockM);
      attend_query_block<scalar_t>(q, k, v, out, lse, s, bh / s.heads, bh % s.heads, q_begin, q_end, causal, scale,
                                   tmp);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> fwd_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           bool causal, std::optional<double> scale) {
  const AttentionShape s = check_fwd_inputs(q, k, v);
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16,
              "flashattn.fwd: CPU supports float32, float64, float16 and bfloat16 (got ", dtype, ")");
  const double softmax_scale = resolve_scale(scale, s.head_dim);

  at::Tensor out = at::empty({s.batch, s.heads, s.len_q, s.head_dim}, q.options());
  at::Tensor lse = at::empty({s.batch, s.heads, s.len_q}, q.options().dtype(at::kFloat));
  if (s.empty()) return {out, lse};

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "flashattn_fwd_cpu", [&] {
    fwd_cpu_kernel<scalar_t>(q, k, v, out, lse, s, causal, softmax_scale);
  });
  return {out, lse};
}

}  // namespace
}  // namespace flashattn

TORCH_LIBRARY_IMPL(flashattn, CPU, m) { m.impl("fwd", &flashattn::fwd_cpu); }
