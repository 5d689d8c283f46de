#!/usr/bin/env bash
# One device run for the chunked-dense CUDA strategy (issue 6): kernel resource usage,
# correctness against the f64 oracle, and timings against the same-run cuBLAS floor.
# Expects the stripped release binary and the NVRTC cache in .devbin/dense (see BENCHMARKS.md).
set -u
D=.devbin/dense
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
for p in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -e "$p/libcublas.so.13" ] && export LD_LIBRARY_PATH="$p:${LD_LIBRARY_PATH:-}"
done
if ! ldconfig -p | grep -q 'libcublas.so.13' && [ -z "${LD_LIBRARY_PATH:-}" ]; then
  CB=$(find /usr/local /opt /usr/lib -name 'libcublas.so.13' 2>/dev/null | head -1)
  [ -n "$CB" ] && export LD_LIBRARY_PATH="$(dirname "$CB"):${LD_LIBRARY_PATH:-}"
fi
echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
export CCE_CUDA_CACHE_DIR=$D/cache
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu --format=csv
CUBIN=$(ls $D/cache/*.cubin | head -1)
{ cuobjdump -res-usage "$CUBIN" 2>&1 | grep -A1 -E "cce_dense_(fwd|bwd|colsum)_bf16|cce_dense_fused_bf16_c(1|8|16)\b";
  echo "local-memory instructions (LDL/STL) in SASS:"; cuobjdump -sass "$CUBIN" | grep -cE "\b(LDL|STL)\b"; } > "$OUT/resusage.txt" 2>&1
cat "$OUT/resusage.txt" | head -30
B=$D/cce-bench-dense
SHAPES="4096,4096,128256;8192,4096,128256;8192,2304,256000,30;32768,4096,256000"
timeout 60 $B --mode check 2>&1 | tee "$OUT/check.txt" | grep -E "CHECK|ERROR|violations [1-9]|NON-FINITE|false|BOUND|filtered vs exact|filter  " | head -60
timeout 80 $B --mode bench --row-pass two-pass --shapes "$SHAPES" 2>&1 | tee "$OUT/bench-two-pass.txt" | grep -vE "^\|" | tail -30
timeout 80 $B --mode bench --row-pass fused --shapes "$SHAPES" 2>&1 | tee "$OUT/bench-fused.txt" | grep -vE "^\|" | tail -30
timeout 35 $B --mode bench --row-pass fused-c8 --shapes "8192,2304,256000,30;32768,4096,256000" 2>&1 | tee "$OUT/bench-fused-c8.txt" | grep -vE "^\|" | tail -12
echo "==== tables"
for f in two-pass fused fused-c8; do grep -E "^\|" "$OUT/bench-$f.txt" | sort -u; done
