#!/usr/bin/env bash
# Third device run: the cuda branch's errors + conformance suites on the merged branch.
set -u; D=.devbin/dense; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for p in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do [ -e "$p/libcublas.so.13" ] && export LD_LIBRARY_PATH="$p:${LD_LIBRARY_PATH:-}"; done
export CCE_CUDA_CACHE_DIR=$D/cache CCE_REQUIRE_CUDA=1
timeout 30 $D/errors --test-threads=1 >"$OUT/errors.log" 2>&1; echo "errors rc=$?"; grep -E "test result" "$OUT/errors.log"
timeout 90 $D/conformance --test-threads=1 --nocapture >"$OUT/conformance.log" 2>&1; echo "conformance rc=$?"
grep -E "^test |test result|panicked|strategy|real fixture|logit std" "$OUT/conformance.log" | head -40
