#!/usr/bin/env bash
# CUDA device runner for cce-cuda (issue 5).
#
#   scripts/device-cuda.sh build [core|burn|python] # here (no GPU needed): build, strip and stage binaries
#   scripts/device-cuda.sh run [PHASES] # on the device machine, from the repository root
#
# build: `cargo test --release -p cce-cuda --no-run --message-format=json` gives the test
# executables; `cargo build --release -p cce-benches --features cuda --bin cce-bench-cuda` the
# benchmark. Both are stripped and copied, with a kernel CUBIN compiled here by NVRTC (the
# backend's disk cache, so the device skips the compile), into $DEVBIN (default
# /work/main/.devbin/cuda: the device tool sends the lead's checkout /work/main, so the
# binaries must be there; .devbin/ is in .gitignore). Both kernel caches (the tile backend's
# and the dense engine's CUBIN) are gzipped there and unzipped by `run`, so the carried tree
# stays under the device tool's 64 MiB. Then call the device tool with
#   carry [".devbin/cuda"], command "bash scripts/device-cuda.sh run" (DEVBIN=.devbin/<name>
#   when the binaries were staged elsewhere), or copy this script
#   into .devbin/cuda and run it from there when the checkout's copy is older).
#
# build burn: only cce-burn's CUDA test (crates/cce-burn/tests/cuda.rs, burn's CUDA backend),
# also the last step of a full build. cce-burn is its own workspace (target dir $BURN_TARGET_DIR,
# default target/burn), built in the dev profile (its dependencies at opt-level 2) with
# `--features cuda,cubecl-cuda/cpp` (burn's own kernels compiled by NVRTC) and DOCS_RS=1, which
# makes cubecl-llvm's build skip the LLVM bundle it would download; the test binary links
# scripts/cubecl-llvm-stub.sh's stubs in LLVM's place. Staged as burn-cuda.gz (gzipped: the
# carried tree's 64 MiB), unzipped by `run`.
#
# build python: the PyTorch package's wheel (maturin on PATH, e.g. a venv with maturin 1.16 and
# ziglang: python/README.md), staged in $DEVBIN/py, also the last step of a full build.
#
# run: PHASES is a comma list of tests,suite,large,sanitize,dense,bench,burn,python,pybench
# (pybench: the side-by-side PyTorch benchmark against the peers' wheels, see its phase; default
# tests,suite,sanitize,bench,burn,python); "burn" is cce-burn's CUDA test; "python" installs the
# staged wheel into /tmp/cce-site (no network: --no-index --no-deps, beside the machine's torch)
# and runs the package's pytest suite (its CUDA tests, graph capture and torch.compile
# included) with the kernel cache of this bundle; "suite" is the workspace conformance suite (cce-conformance);
# BENCH_ARGS passes arguments to cce-bench-cuda (e.g. "--filter llama3 --reps 3"), TEST_FILTER a
# test-name filter to the tests phase (e.g. "wgmma_"). Logs go to
# $OUT (at most 8 files come back); a summary table is printed last.
set -uo pipefail

DEVBIN=${DEVBIN:-/work/main/.devbin/cuda}
mode=${1:-}

# Stage cce-conformance's test binary TARGET (built with the cuda feature) as $DEVBIN/NAME.
stage_conformance() {
  cargo test --release -p cce-conformance --features cuda --test "$1" --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, sys, shutil, os
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[2]:
        shutil.copy(m["executable"], os.path.join(sys.argv[1], sys.argv[3]))
        print("staged", sys.argv[3])
' "$DEVBIN" "$1" "$2"
}

# cce-burn's CUDA test binary, staged as $DEVBIN/burn-cuda.gz (see the header).
build_burn() {
  local target=${BURN_TARGET_DIR:-target/burn}
  local manifest=crates/cce-burn/Cargo.toml
  local features=cuda,cubecl-cuda/cpp
  # Every dependency's rlib (a library links nothing, so LLVM's symbols are not needed yet).
  DOCS_RS=1 CARGO_TARGET_DIR=$target cargo build --manifest-path $manifest --locked \
    --features $features --lib
  scripts/cubecl-llvm-stub.sh "$target/debug/deps" "$target/libcce_llvm_stub.a"
  local stub="$target/libcce_llvm_stub.a"
  [[ $stub == /* ]] || stub="$PWD/$stub"
  rm -f "$DEVBIN/burn-cuda" "$DEVBIN/burn-cuda.gz"
  DOCS_RS=1 CARGO_TARGET_DIR=$target cargo rustc --manifest-path $manifest --locked \
    --features $features --test cuda --message-format=json \
    -- -C link-arg="$stub" |
    python3 -c '
import json, sys, shutil, os
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "cuda":
        shutil.copy(m["executable"], os.path.join(sys.argv[1], "burn-cuda"))
        print("staged burn-cuda")
' "$DEVBIN"
  strip "$DEVBIN/burn-cuda"
  gzip -f "$DEVBIN/burn-cuda"
  cp scripts/device-cuda.sh "$DEVBIN/"
  ls -la "$DEVBIN/burn-cuda.gz"
}

# The PyTorch package's wheel, staged as $DEVBIN/py/*.whl.
build_python() {
  rm -rf "$DEVBIN/py"
  mkdir -p "$DEVBIN/py"
  maturin build --release --zig --compatibility manylinux_2_28 -m python/Cargo.toml -o "$DEVBIN/py"
  ls -la "$DEVBIN/py"
}

if [ "$mode" = build ]; then
  set -e
  cd "$(dirname "$0")/.."
  export LD_LIBRARY_PATH=/opt/cuda-pip/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  mkdir -p "$DEVBIN/kcache"
  if [ "${2:-}" = burn ]; then
    build_burn
    exit 0
  fi
  if [ "${2:-}" = python ]; then
    build_python
    exit 0
  fi
  rm -f "$DEVBIN"/kcache/*
  cargo test --release -p cce-cuda --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, sys, shutil, os
dst = sys.argv[1]
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        name = m["target"]["name"]
        if name in ("conformance", "wgmma", "wgmma_chunked", "errors", "large", "api", "numerics", "capture", "accumulate", "vocab_parallel", "staircase"):
            shutil.copy(m["executable"], os.path.join(dst, name))
            print("staged", name)
' "$DEVBIN"
  # The workspace conformance suite (tests/tests/cuda.rs) stamped on the CUDA backend, the same
  # suite with the staircase backward switched off (tests/tests/cuda_no_staircase.rs), and the
  # property-based harness (tests/tests/fuzz.rs, CUDA arm only at run time).
  stage_conformance cuda suite
  stage_conformance cuda_no_staircase suite_no_staircase
  stage_conformance fuzz fuzz
  cargo build --release -p cce-benches --features cuda --bin cce-bench-cuda --bin cce-bench-dense
  cp "${CARGO_TARGET_DIR:-target}"/release/cce-bench-cuda "${CARGO_TARGET_DIR:-target}"/release/cce-bench-dense "$DEVBIN/"
  strip "$DEVBIN"/conformance "$DEVBIN"/capture "$DEVBIN"/accumulate "$DEVBIN"/wgmma "$DEVBIN"/wgmma_chunked "$DEVBIN"/errors "$DEVBIN"/large "$DEVBIN"/api "$DEVBIN"/numerics "$DEVBIN"/suite "$DEVBIN"/suite_no_staircase "$DEVBIN"/staircase "$DEVBIN"/fuzz "$DEVBIN"/cce-bench-cuda "$DEVBIN"/cce-bench-dense
  CCE_CUDA_CACHE_DIR="$DEVBIN/kcache" cargo test --release -p cce-cuda --test nvrtc_compile fill_kernel_cache -- --nocapture
  # The dense engine's module too (chunked.cu + wgmma.cu), then gzip both CUBINs: the carried
  # tree must stay under the device tool's 64 MiB with the repository (run unzips them).
  CCE_CUDA_CACHE_DIR="$DEVBIN/kcache" "$DEVBIN/cce-bench-dense" --mode compile
  gzip -f "$DEVBIN"/kcache/*.cubin
  # The executables gzipped too (a third of their size): run unzips every $DEVBIN/*.gz.
  for f in "$DEVBIN"/*; do
    [ -f "$f" ] && [ -x "$f" ] && [[ $f != *.sh && $f != *.gz ]] && gzip -f "$f"
  done
  cp scripts/device-cuda.sh "$DEVBIN/"
  # cce-data finds the shipped fixture through a path fixed at compile time (this checkout).
  pwd >"$DEVBIN/build_root"
  # `build core`: the binaries above only (cce-burn's test and the wheel are built on request).
  if [ "${2:-}" != core ]; then
    build_burn
    build_python
  fi
  du -ch "$DEVBIN"/* "$DEVBIN"/kcache/* | tail -1
  ls -la "$DEVBIN" "$DEVBIN/kcache"
  exit 0
fi

if [ "$mode" != run ]; then
  echo "usage: $0 build [burn|python] | run [tests,suite,large,sanitize,dense,bench,burn,python,pybench]" >&2
  exit 2
fi

# DEVBIN here is relative to the checkout the device runs in (e.g. DEVBIN=.devbin/cuda-api).
D=${DEVBIN:-.devbin/cuda}
OUT=${OUT:-/tmp/cce-out}
mkdir -p "$OUT"
PHASES=${2:-tests,suite,sanitize,bench,burn,python}
export CCE_CUDA_CACHE_DIR=$D/kcache CCE_REQUIRE_CUDA=1 RUST_BACKTRACE=1 CCE_DATA_DIR=$PWD/data
# Make the build checkout's data/ path (compiled into cce-data) point at this copy's data/.
if [ -f "$D/build_root" ]; then
  root=$(cat "$D/build_root")
  if [ ! -e "$root/data" ]; then
    mkdir -p "$root/crates/cce-data" && ln -sfn "$PWD/data" "$root/data"
  fi
fi
# The build gzips the kernel caches (see build); unzip them once here.
for f in "$D"/kcache/*.cubin.gz "$D"/*.gz; do
  [ -e "$f" ] && gunzip -f "$f"
done
declare -A status
summary() {
  echo
  echo "==== summary ===="
  printf '%-12s %s\n' phase result
  for k in tests suite no_stair fuzz large memcheck racecheck dense bench burn python pybench; do
    [ -n "${status[$k]:-}" ] && printf '%-12s %s\n' "$k" "${status[$k]}"
  done
}
trap summary EXIT

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"

if [[ $PHASES == *tests* ]]; then
  ok=1
  for t in staircase errors numerics conformance wgmma wgmma_chunked api capture accumulate vocab_parallel; do
    echo "==== $t ===="
    # TEST_FILTER (optional): a test-name filter, e.g. "wgmma_" (both binaries get it).
    # shellcheck disable=SC2086
    if ! timeout 300 "$D/$t" ${TEST_FILTER:-} --test-threads=1 --nocapture >>"$OUT/tests.log" 2>&1; then ok=0; fi
  done
  grep -E "^test |test result|panicked|skipping" "$OUT/tests.log" | tail -30
  status[tests]=$([ $ok = 1 ] && echo PASS || echo FAIL)
fi

if [[ $PHASES == *suite* ]]; then
  if timeout 400 "$D/suite" --test-threads=1 >"$OUT/suite.log" 2>&1; then
    status[suite]=PASS
  else
    status[suite]=FAIL
  fi
  grep -E "^test |test result|panicked" "$OUT/suite.log" | tail -40
  if [ -x "$D/suite_no_staircase" ]; then
    if CCE_REQUIRE_CUDA=1 timeout 400 "$D/suite_no_staircase" --test-threads=1 >"$OUT/suite_no_staircase.log" 2>&1; then
      status[no_stair]=PASS
    else
      status[no_stair]=FAIL
    fi
    grep -E "^test |test result|panicked" "$OUT/suite_no_staircase.log" | tail -30
  fi
  if [ -x "$D/fuzz" ]; then
    if CCE_REQUIRE_CUDA=1 timeout 300 "$D/fuzz" fuzz_cuda --test-threads=1 >"$OUT/fuzz.log" 2>&1; then
      status[fuzz]=PASS
    else
      status[fuzz]=FAIL
    fi
    grep -E "^test |test result|panicked|FAIL" "$OUT/fuzz.log" | tail -20
  fi
fi

if [[ $PHASES == *large* ]]; then
  if timeout 400 "$D/large" --ignored --test-threads=1 --nocapture >"$OUT/large.log" 2>&1; then
    status[large]=PASS
  else
    status[large]=FAIL
  fi
  grep -E "^test |test result|panicked|call|rel" "$OUT/large.log" | tail -20
fi

if [[ $PHASES == *sanitize* ]]; then
  for tool in memcheck racecheck; do
    timeout 300 compute-sanitizer --tool $tool --error-exitcode 99 --print-limit 20 \
      "$D/conformance" sanitizer_smoke --test-threads=1 >"$OUT/$tool.log" 2>&1
    rc=$?
    tail -5 "$OUT/$tool.log"
    s=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/$tool.log" | tail -1)
    status[$tool]="rc=$rc ${s:-no summary line}"
  done
fi

if [[ $PHASES == *dense* ]]; then
  # The dense strategies' benchmark (cce-bench-dense); DENSE_ARGS e.g. "--shapes ... --data ...".
  for p in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -e "$p/libcublas.so.13" ] && export LD_LIBRARY_PATH="$p:${LD_LIBRARY_PATH:-}"
  done
  # shellcheck disable=SC2086
  timeout ${DENSE_TIMEOUT:-400} "$D/cce-bench-dense" --mode bench ${DENSE_ARGS:-} >"$OUT/dense.log" 2>&1
  rc=$?
  grep -E "^\|" "$OUT/dense.log" | tail -40 || tail -20 "$OUT/dense.log"
  status[dense]="rc=$rc"
fi

if [[ ,$PHASES, == *,bench,* ]]; then
  # shellcheck disable=SC2086
  timeout 500 "$D/cce-bench-cuda" ${BENCH_ARGS:-} --out "$OUT/bench.md" >"$OUT/bench.log" 2>&1
  rc=$?
  cat "$OUT/bench.md" 2>/dev/null || tail -20 "$OUT/bench.log"
  status[bench]="rc=$rc"
fi

if [[ $PHASES == *burn* ]]; then
  if [ -x "$D/burn-cuda" ]; then
    # cubecl-cuda's NVRTC compile of burn's own kernels takes CUDA's headers from CUDA_PATH
    # (else /usr/local/cuda); our backend needs libcublas.
    if [ -z "${CUDA_PATH:-}" ] && command -v nvcc >/dev/null; then
      CUDA_PATH=$(dirname "$(dirname "$(command -v nvcc)")")
      export CUDA_PATH
    fi
    for p in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
      [ -e "$p/libcublas.so.13" ] && export LD_LIBRARY_PATH="$p:${LD_LIBRARY_PATH:-}"
    done
    if timeout 400 "$D/burn-cuda" --test-threads=1 --nocapture >"$OUT/burn.log" 2>&1; then
      status[burn]=PASS
    else
      status[burn]=FAIL
    fi
    grep -E "^test |test result|panicked|^cuda|skipped|LLVM" "$OUT/burn.log" | tail -40
  else
    status[burn]="not staged ($D/burn-cuda; scripts/device-cuda.sh build burn)"
  fi
fi

if [[ $PHASES == *python* ]]; then
  whl=$(ls "$D"/py/*.whl 2>/dev/null | head -1)
  if [ -n "$whl" ]; then
    for p in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
      [ -e "$p/libcublas.so.13" ] && export LD_LIBRARY_PATH="$p:${LD_LIBRARY_PATH:-}"
    done
    rm -rf /tmp/cce-site
    python3 -m pip install -q --no-index --no-deps --target /tmp/cce-site "$whl" >"$OUT/python.log" 2>&1
    # From the repository root with the installed package first on the path (the source
    # folder python/cut_cross_entropy_rs is not importable from here).
    if PYTHONPATH=/tmp/cce-site timeout 500 python3 -m pytest -q -p no:cacheprovider python/tests \
      >>"$OUT/python.log" 2>&1; then
      status[python]=PASS
    else
      status[python]=FAIL
    fi
    grep -E "passed|failed|FAILED|Error" "$OUT/python.log" | tail -25
  else
    status[python]="not staged ($D/py; scripts/device-cuda.sh build python)"
  fi
fi

if [[ $PHASES == *pybench* ]]; then
  # The side-by-side benchmark (python/cut_cross_entropy_rs/bench.py): this package's wheel
  # and the peers' wheels of $PEERS (default .devbin/whl: Liger 0.8.5 from PyPI, Apple's CCE
  # built from apple/ml-cross-entropy, the 12k-row real file), PYBENCH_ARGS its arguments.
  W=${PEERS:-.devbin/whl}
  rm -rf /tmp/cce-bench-site
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/cce-bench-site \
    "$D"/py/cut_cross_entropy_rs-*.whl "$W"/*.whl >"$OUT/pybench.log" 2>&1
  args=${PYBENCH_ARGS:---iters 5 --warmup 2 --peers ours,ours-exact,liger,compile,cce --shapes 8192,2304,256000;8192,4096,128256 --data lm,real}
  # shellcheck disable=SC2086
  if PYTHONPATH=/tmp/cce-bench-site timeout "${PYBENCH_TIMEOUT:-500}" python3 -m cut_cross_entropy_rs.bench \
    $args --out "$OUT/pybench.md" >>"$OUT/pybench.log" 2>&1; then
    status[pybench]=PASS
  else
    status[pybench]=FAIL
  fi
  grep -E "^\| " "$OUT/pybench.md" 2>/dev/null | cut -c1-250 | head -40
fi
