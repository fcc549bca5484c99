#!/usr/bin/env bash
# On the GPU machine, from the repository root: stamps the forward, builds timeline.cu, and writes a timeline per length
# (16k tokens, 8 heads of D256) into $OUT (or /tmp), then summarises them. Usage: bash benchmarks/timeline/run.sh [L ...]
set -euo pipefail
dir=benchmarks/timeline
out=${OUT:-/tmp}
python $dir/patch_fwd.py
nvcc -O3 -std=c++17 --use_fast_math --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -Icsrc -I$dir \
  -Xptxas=-warn-spills $dir/timeline.cu -o /tmp/flashattn_timeline
lengths=("$@")
[ ${#lengths[@]} -gt 0 ] || lengths=(1024 2048 16384)
for len in "${lengths[@]}"; do
  /tmp/flashattn_timeline $((16384 / len > 0 ? 16384 / len : 1)) 8 $len $out/timeline_$len.csv
  python $dir/analyze.py $out/timeline_$len.csv
done
