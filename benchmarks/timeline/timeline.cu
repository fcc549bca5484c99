// A clock64 timeline of the Hopper forward without a mask (bf16, head dim HEAD_DIM), from the stamped copy that
// patch_fwd.py writes. Usage: timeline B H L out.csv. Times back-to-back calls and calls after a 256 MB memset (as
// triton's do_bench does), then writes the stamps of a back-to-back call as CSV rows (cta, role, tile, event, clock).
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "fwd_kernel_timeline.h"

#ifndef HEAD_DIM
#define HEAD_DIM 256
#endif

using namespace flashattn;

int main(int argc, char** argv) {
  if (argc < 5) {
    fprintf(stderr, "usage: %s B H L out.csv\n", argv[0]);
    return 2;
  }
  const int batch = atoi(argv[1]), heads = atoi(argv[2]), len = atoi(argv[3]);
  constexpr int kD = HEAD_DIM;
  const size_t n = size_t(batch) * heads * len * kD;
  std::vector<__nv_bfloat16> host(n);
  srand(1);
  for (auto& x : host) x = __float2bfloat16(rand() / float(RAND_MAX) * 2.f - 1.f);
  void *q, *k, *v, *o, *flush;
  float* lse;
  cudaMalloc(&q, n * 2), cudaMalloc(&k, n * 2), cudaMalloc(&v, n * 2), cudaMalloc(&o, n * 2);
  cudaMalloc(&lse, size_t(batch) * heads * len * 4);
  cudaMalloc(&flush, size_t(256) << 20);
  for (void* t : {q, k, v}) cudaMemcpy(t, host.data(), n * 2, cudaMemcpyHostToDevice);

  FwdParams p{};
  p.q = q, p.k = k, p.v = v, p.out = o, p.lse = lse;
  p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.o_batch_stride = int64_t(heads) * len * kD;
  p.q_head_stride = p.k_head_stride = p.v_head_stride = p.o_head_stride = int64_t(len) * kD;
  p.q_row_stride = p.k_row_stride = p.v_row_stride = p.o_row_stride = kD;
  p.batch = batch, p.heads = p.heads_kv = heads, p.heads_per_kv = 1, p.len_q = p.len_k = len, p.head_dim = kD;
  p.scale = 1.f / sqrtf(float(kD)), p.scale_log2 = p.scale * 1.4426950408889634f;
  const auto launch = [&] { return sm90::run_fwd_sm90<__nv_bfloat16, kD, false>(p, 0); };
  const double flops = 4.0 * batch * heads * double(len) * len * kD;

  cudaEvent_t start, stop;
  cudaEventCreate(&start), cudaEventCreate(&stop);
  for (int i = 0; i < 200; ++i) launch();  // warm-up
  cudaEventRecord(start);
  for (int i = 0; i < 50; ++i) launch();
  cudaEventRecord(stop);
  if (cudaError_t err = cudaDeviceSynchronize(); err != cudaSuccess) {
    fprintf(stderr, "%s\n", cudaGetErrorString(err));
    return 1;
  }
  float ms = 0.f;
  cudaEventElapsedTime(&ms, start, stop);
  fprintf(stderr, "D%d L %d: back to back %.4f ms (%.1f TFLOP/s)", kD, len, ms / 50, flops / (ms / 50) / 1e9);
  std::vector<float> times(60);
  for (float& t : times) {
    cudaMemsetAsync(flush, 0, size_t(256) << 20);
    cudaEventRecord(start);
    launch();
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    cudaEventElapsedTime(&t, start, stop);
  }
  std::sort(times.begin(), times.end());
  fprintf(stderr, "; after a memset, median %.4f ms (%.1f TFLOP/s)\n", times[30], flops / times[30] / 1e9);

  for (int i = 0; i < 5; ++i) launch();  // the stamps of a back-to-back call
  cudaDeviceSynchronize();
  std::vector<long long> stamps(8 * 3 * 16 * 32);
  cudaMemcpyFromSymbol(stamps.data(), g_timeline, stamps.size() * sizeof(long long));
  FILE* out = fopen(argv[4], "w");
  if (out == nullptr) {
    perror(argv[4]);
    return 1;
  }
  for (size_t i = 0; i < stamps.size(); ++i) {
    fprintf(out, "%zu,%zu,%zu,%zu,%lld\n", i / (3 * 16 * 32), i / (16 * 32) % 3, i / 32 % 16, i % 32, stamps[i]);
  }
  fclose(out);
  return 0;
}
