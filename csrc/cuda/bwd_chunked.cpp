// CUDA backward, chunked version: the FlashAttention backward equations evaluated on chunks of query rows with
// cuBLAS GEMMs in float32. It serves the cases the fused kernel (sm80/bwd_kernel.h) does not cover (head dims
// above 128, deterministic=True) and is the reference path it is checked against. Like the fused kernel it
// recomputes P from lse:
//   P = exp(scale * Q K^T - lse),  dV = P^T dO,  dP = dO V^T,  dS = P * (dP - (rowsum(dO * O) - dlse)),
//   dQ = scale * dS K,  dK = scale * dS^T Q.
// It takes every score modification: the band masks P, softcap recomputes t = tanh(scale * Q K^T / softcap) for
// P = exp(softcap * t - lse) and multiplies dS by 1 - t^2; sinks enter through lse alone.
// GQA: the query heads of one kv head are stacked along the row axis, so dK/dV of that kv head come out summed over
// its group without repeating K/V. The chunk order is fixed and nothing is accumulated atomically, so the result is
// deterministic whenever cuBLAS is (torch.use_deterministic_algorithms(True) plus CUBLAS_WORKSPACE_CONFIG), and
// batch-invariant: each batch entry runs the same GEMMs whatever the batch size.
#include <ATen/ATen.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <tuple>

#include "api/checks.h"
#include "api/layouts.h"
#include "cuda/bwd_chunked.h"

namespace flashattn {

// Score-sized fp32 temporaries per chunk stay under this many elements (a few live at once: ~2 GiB at most).
constexpr int64_t kMaxChunkElements = int64_t{1} << 27;

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_chunked(const at::Tensor& dout, const at::Tensor& q,
                                                           const at::Tensor& k, const at::Tensor& v,
                                                           const at::Tensor& out, const at::Tensor& lse,
                                                           const std::optional<at::Tensor>& dlse,
                                                           const AttentionShape& s, const ScoreMods& mods,
                                                           double softmax_scale) {
  at::Tensor dq = at::zeros(q.sizes(), q.options().dtype(at::kFloat));
  at::Tensor dk = at::zeros(k.sizes(), k.options().dtype(at::kFloat));
  at::Tensor dv = at::zeros(v.sizes(), v.options().dtype(at::kFloat));
  // The gradients in their inputs' types and layouts (api/layouts.h).
  const auto result = [&] {
    return std::make_tuple(empty_output_like(q).copy_(dq), empty_output_like(k).copy_(dk),
                           empty_output_like(v).copy_(dv));
  };
  if (s.empty() || s.len_k == 0) return result();

  // One batch entry at a time, in chunks sized from its own shape: every GEMM and reduction has the same shape
  // whatever the batch size, so a sequence's gradients are the same bits in any batch.
  // Rows of one kv head: its `group` query heads one after the other, (Hk, group * Lq, D).
  const int64_t group = s.heads / s.heads_kv;
  const int64_t rows = group * s.len_q;
  const int64_t chunk = std::max<int64_t>(1, kMaxChunkElements / (s.heads_kv * s.len_k));
  const at::Tensor key_index = at::arange(s.len_k, q.options().dtype(at::kLong));
  for (int64_t b = 0; b < s.batch; ++b) {
    const auto by_kv_head = [&](const at::Tensor& t) {
      return t[b].to(at::kFloat).contiguous().view({s.heads_kv, rows, s.head_dim});
    };
    const at::Tensor q_rows = by_kv_head(q);
    const at::Tensor do_rows = by_kv_head(dout);
    at::Tensor delta = (dout[b].to(at::kFloat) * out[b].to(at::kFloat)).sum(-1);  // rowsum(dO * O), (H, Lq)
    if (dlse.has_value()) delta = delta - (*dlse)[b];
    const at::Tensor lse_b = lse[b];
    // Rows without a visible key (lse = -inf) have P = 0; a non-finite dlse there must not make 0 * inf = NaN. A NaN
    // lse (a row with NaN or infinite scores) is kept: its gradients are NaN.
    delta.masked_fill_(lse_b.isinf(), 0.0);
    const at::Tensor delta_rows = delta.contiguous().view({s.heads_kv, rows, 1});
    const at::Tensor lse_rows = lse_b.contiguous().view({s.heads_kv, rows, 1});
    const at::Tensor k_f = k[b].to(at::kFloat);  // (Hk, Lk, D)
    const at::Tensor k_t = k_f.transpose(-1, -2);
    const at::Tensor v_t = v[b].to(at::kFloat).transpose(-1, -2);
    at::Tensor dq_rows = dq[b].view({s.heads_kv, rows, s.head_dim});
    at::Tensor dk_b = dk[b];
    at::Tensor dv_b = dv[b];

    for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
      const int64_t r1 = std::min(rows, r0 + chunk);
      const at::Tensor q_c = q_rows.narrow(1, r0, r1 - r0);
      const at::Tensor do_c = do_rows.narrow(1, r0, r1 - r0);
      const at::Tensor lse_c = lse_rows.narrow(1, r0, r1 - r0);

      at::Tensor p = at::matmul(q_c, k_t).mul_(softmax_scale);  // (Hk, C, Lk) scores
      at::Tensor tanh_scores;
      if (mods.softcap > 0.0) {
        tanh_scores = p.div_(mods.softcap).tanh_();
        p = tanh_scores.mul(mods.softcap);
      }
      p.sub_(lse_c).exp_();
      // A row without any visible key has lse = -inf: its P row must be 0, not exp(nan).
      at::Tensor invisible = lse_c.isinf().expand_as(p);
      if (mods.left >= 0 || mods.right >= 0) {
        const at::Tensor query_index = at::arange(r0, r1, key_index.options()).remainder(s.len_q).unsqueeze(1);
        const at::Tensor diagonal = query_index + (s.len_k - s.len_q);
        const at::Tensor keys = key_index.unsqueeze(0);
        if (mods.right >= 0) invisible = invisible.logical_or(keys > diagonal + mods.right);
        if (mods.left >= 0) invisible = invisible.logical_or(keys < diagonal - mods.left);
      }
      p.masked_fill_(invisible, 0.0);

      dv_b.add_(at::matmul(p.transpose(-1, -2), do_c));
      at::Tensor ds = at::matmul(do_c, v_t).sub_(delta_rows.narrow(1, r0, r1 - r0)).mul_(p);  // dS = P (dP - D)
      if (mods.softcap > 0.0) ds.mul_(tanh_scores.square_().neg_().add_(1.0));
      dq_rows.narrow(1, r0, r1 - r0).copy_(at::matmul(ds, k_f).mul_(softmax_scale));
      dk_b.add_(at::matmul(ds.transpose(-1, -2), q_c).mul_(softmax_scale));
    }
  }
  return result();
}

}  // namespace flashattn
