#!/usr/bin/env bash
# Second device run for chunked-dense: the cuda branch's conformance/errors suites through the
# ChunkedDense dispatch (the plan now prefers it for their small shapes), memcheck on the
# sanitizer smoke test, and the two-pass bench with exact timings on randn and c/8 data.
set -u
D=.devbin/dense
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
for p in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -e "$p/libcublas.so.13" ] && export LD_LIBRARY_PATH="$p:${LD_LIBRARY_PATH:-}"
done
export CCE_CUDA_CACHE_DIR=$D/cache CCE_REQUIRE_CUDA=1
timeout 30 $D/errors --test-threads=1 >"$OUT/errors.log" 2>&1; echo "errors rc=$?"
grep -E "test result|panicked|FAILED" "$OUT/errors.log" | head -5
timeout 70 $D/conformance --test-threads=1 --nocapture >"$OUT/conformance.log" 2>&1; echo "conformance rc=$?"
grep -E "^test |test result|panicked|chunked|logit std" "$OUT/conformance.log" | head -30
timeout 50 compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 10 $D/conformance sanitizer_smoke --test-threads=1 >"$OUT/memcheck.log" 2>&1; echo "memcheck rc=$?"
grep -E "ERROR SUMMARY|test result" "$OUT/memcheck.log" | tail -2
timeout 65 $D/cce-bench-dense --mode bench --row-pass two-pass \
  --shapes "4096,4096,128256;8192,4096,128256;8192,2304,256000,30;32768,4096,256000" >"$OUT/bench2.txt" 2>&1
echo "bench rc=$?"; grep -E "floor:|ERROR" "$OUT/bench2.txt"; grep -E "^\| [0-9]" "$OUT/bench2.txt" | sort -u
