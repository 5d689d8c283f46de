#!/usr/bin/env bash
# wgpu device runner (issue 21): the wgpu backend on the H200 through NVIDIA's Vulkan driver.
#
#   scripts/device-wgpu.sh build          # here (no GPU needed): build, strip and stage
#   scripts/device-wgpu.sh run [PHASES]   # on the device machine, from the repository root
#
# build: the release benchmark `cce-bench-wgpu` and the test executables (cce-wgpu's
# conformance, interop and shaders_naga; the workspace suite's wgpu arm as `suite`), stripped,
# into $DEVBIN (default .devbin/wgpu of this checkout; .devbin/ is in .gitignore), with the
# Vulkan loader in $DEVBIN/gl: the H200 machine has NVIDIA's Vulkan driver (its ICD) but no
# loader (libvulkan.so.1), so Debian's libvulkan1 .deb is carried with glvnd's (`apt-get
# download`; where that fails, the loader installed here is copied); `run` unpacks them
# into /. To carry it with the repository under the device tool's 64 MiB, gzip the executables
# (`gzip -f` all but device-wgpu.sh and gl/, dropping the *-coop ones when the coop phase is not
# run): `run` unpacks every $DEVBIN/*.gz in place first.
# QUICK=1 build: only what the `report`, `quick` and `t128` phases run (cce-bench-wgpu, cce-bench-sgemm,
# gzipped) and the loader: a few MiB to carry beside other things.
# COOP_ONLY=1 build: only what the `coop` phase runs (cce-wgpu's conformance tests and
# cce-bench-wgpu, both with the cargo feature coop-matrix, as conformance-coop and
# cce-bench-wgpu-coop, gzipped) and the loader; then from the checkout holding $DEVBIN:
#   DEVBIN=.devbin/wgpu-coop3 bash .devbin/wgpu-coop3/device-wgpu.sh run coop
# with carry [".devbin/wgpu-coop3"] (the staged copy of this script runs, whatever the
# checkout's own script is).
# Then call the device tool from the same checkout with carry [".devbin/wgpu"] and command
#   "bash scripts/device-wgpu.sh run report,tests"   (then "... run sweep", "... run bench",
#   "... run seed": each phase fits the device tool's 10 minutes per command).
#
# run: PHASES is a comma list of
#   report  nvidia-smi and the adapter report: features (SUBGROUP, SHADER_F16,
#           SHADER_FLOAT32_ATOMIC, EXPERIMENTAL_COOPERATIVE_MATRIX) and how the backward sums
#           its splits, subgroup sizes, workgroup limits, the kernel configuration and
#           `adapter.cooperative_matrix_properties()`;
#   tests   naga validation, cce-wgpu's conformance and interop tests, the workspace suite;
#   sweep   kernel configurations in alternation (--ab) at 8192 x 2304 x 256000 c/8 exact:
#           8:16 (the default on 48 KiB devices), 8:8, 8:4 and 8:16 with wgpu's runtime checks
#           (the trusted modules' gain); SWEEP_CONFIGS overrides the list; then 8:16 with
#           8192 workgroups instead of 2048 (the wave tail);
#   bench   8192 x 2304 x 256000 (softcap 30, as the CUDA figures) and 8192 x 4096 x 128256,
#           c/8 and randn, bf16, filtered (default options) and exact: forward and
#           forward+backward, TFLOP/s and the ratio to the CUDA backend (figures below);
#   seed    32768 x 4096 x 256000, c/8, bf16, exact and filtered;
#   dtypes  8192 x 2304 x 256000 c/8 exact in f16 and f32;
#   speed   issue 21's A/B of the logits main loops at 8192 x 2304 x 256000 c/8 exact bf16:
#           8:8:scalar (the GPU default), 8:8:named and 8:16:named (the scalar staging with
#           named accumulators in every FMA shader, generated WGSL), forward and
#           forward+backward in alternation, then one call of each with GPU timestamps
#           per shader (--profile); SPEED_CONFIGS overrides the list; its deadline is what is
#           left of 450 s since the script started, so that "run tests,speed" fits one
#           8-minute device call; its table prints last;
#   sgemm   issue 21's reference SGEMM (cce-bench-sgemm, benches/src/sgemm): a textbook
#           register-tiled WGSL SGEMM (128 x 128 tiles of 8 x 8 micro-tiles, BK 8/16, array or
#           named accumulators, trusted or checked modules; 64 x 64 tiles of 8 x 8 (our
#           kernels' geometry: 64 threads) and of 4 x 4) against
#           cce-wgpu's own logits main loops with a plain store (ours-scalar/named/quad), f32
#           and bf16 inputs, at 4096^3 and one logits chunk (8192 x 8192 x 2304): each variant
#           checked entry by entry at 256^3 (and 200 x 136 x 72 for ours) first, then GPU
#           timestamps (median of 7 after 2 warm-ups), TFLOP/s; the SPIR-V of every variant in
#           $OUT/spirv with a scan of it in the log; ~1 minute; SGEMM_ARGS adds arguments (e.g.
#           "--variants t128r8k8,ours-named --reps 9"); its table prints last;
#   gap     issue 21's "where the forward loses 5x" (docs/perf-log.md, session 17): the
#           forward shader's real entry point and ablations of it (cce-bench-sgemm
#           --fwd-variants, benches/src/sgemm/fwd.rs: no global writes; the epilogue replaced by
#           per-row sums with the real or a small workgroup memory; one class tile per
#           workgroup; the scalar main loop) on one class chunk as the backend dispatches it
#           (8192 x 29120 x 2304, 16 x 128 workgroups of 29 tiles) and on 8192 x 8192 x 2304,
#           beside ours-named:bf16, GPU timestamps, each checked against f64 first; then the
#           real forward at 8192 x 2304 x 256000 c/8 exact bf16, forward only, wall against
#           GPU time per dispatch, 8:8:named against 8:8:named:w65536 (one class tile per
#           forward workgroup); ~90 s; GAP_FWD / GAP_CONFIGS override the variant / config
#           lists; its tables print last;
#   quick   the short form of gap and bwd for a device call of about two minutes in all (~130
#           s, at most 205 s by its timeouts):
#           the forward shader's real entry point against the `fwd-loop` ablation on the one
#           chunk the backend dispatches (8192 x 29120 x 2304, checked on 70 x 136 x 264 first,
#           1 warm-up + 3 timed dispatches) and on the same chunk the backward's d_e and d_c
#           passes with f32 atomics at 2048 target workgroups, scattered (bwd-atomic,
#           dc-atomic) against coalesced through subgroup shuffles (bwd-atomic-co,
#           dc-atomic-co), each checked on 70 x 300 x 136 first; then the backend at 8192 x
#           2304 x 256000 c/8 exact bf16, 8:8:named with its default backward (f32 atomics
#           scattered where the device has SHADER_FLOAT32_ATOMIC) against 8:8:named:co (the
#           atomics coalesced through subgroup shuffles, off by default until measured) and
#           8:8:named:det (deterministic calls: per-split slabs), forward and forward+backward,
#           1 warm-up + 1 timed call each, then one call each with GPU timestamps per shader;
#           QUICK_FWD / QUICK_BWD / QUICK_CONFIGS override the variant / config lists; its
#           tables print last;
#   bwd     the backward's d_e and d_c passes on the one chunk the backend dispatches (8192 x
#           29120 x 2304; at 2048 target workgroups d_e 16 x 128 workgroups of 29 class tiles,
#           d_c 5 x 455 workgroups of 26 row tiles), bf16, GPU timestamps (cce-bench-sgemm
#           --bwd-variants, benches/src/sgemm/bwd.rs), each checked against f64 on 70 x 300 x
#           136 first: where the second product's time goes (docs/perf-log.md, session 20,
#           "why the backward's second product runs at half the forward's rate"): the logits +
#           G alone at the module's registers (bwd-noprod) and without the product's code
#           (bwd-noprodc), the product without slab updates (bwd-noslab) and, on top of that,
#           without the G panel's staging (bwd-nog), the C panel's global loads (bwd-nox), the
#           product's barriers (bwd-nobar), its depth loops (bwd-nofma), with an opaque panel
#           loop count (bwd-dynk); the scalar loop's module (bwd-noslab:scalar,
#           bwd-noprod:scalar); d_c's noslab and nog; and the forward's real pass on the same
#           chunk (BWD_FWD, default fwd-real; fwd-real:padN adds N KiB of workgroup memory,
#           benches/src/sgemm/fwd.rs); ~60 s (at most 110 by its timeout, timing stops at 90);
#           BWD_VARIANTS overrides the list (session 19/20's: bwd-real:t896, bwd-atomic,
#           bwd-atomic-co, dc-real:t896, dc-atomic, dc-atomic-co, bwd-real, dc-real,
#           bwd-atomic:t896, dc-atomic:t896, bwd-atomic:w2, dc-atomic:w2, bwd-slab4, dc-nobias,
#           dc-slab4; d_c has every product ablation too: dc-nox, dc-nobar, dc-nofma, dc-dynk,
#           dc-noprod, dc-noprodc); its tables print last;
#   t128    issue 21's 128 x 128, 256-thread main loop (docs/perf-log.md, session 21; QUICK=1
#           builds what it runs): first the forward and backward shaders on the one chunk
#           (8192 x 29120 x 2304 bf16, cce-bench-sgemm --fwd-variants / --bwd-variants, each
#           checked against f64 on a small chunk first, 1 warm-up + 3 timed dispatches): the
#           forward's real pass at 8x8 (the default), 16x16 and 16x8 (the named loop's wide
#           form: written-out depth steps, interleaved panels, 16-byte staging), 16x16:loop
#           (the 128 x 128 geometry with 8:8's loop text: what the form adds) and fwd-loop:16x16
#           (no epilogue); the d_e pass with f32 atomics at 8x8, 16x16, 16x8 and 16x16:loop,
#           its noslab / noprod at 8x8 and 16x16 (the second product = noslab − noprod), d_c
#           with atomics at 8x8, 16x16, 16x8; then the backend at 8192 x 2304 x 256000 c/8
#           exact bf16, 8:8:named against 16:16:named and 16:8:named (the threshold pass, not
#           run exact, would take 8:8), forward and forward+backward in alternation, each
#           config's loss and max |Δ lse| against 8:8's, then one call each with GPU
#           timestamps per shader; T128_FWD / T128_BWD / T128_CONFIGS override the lists;
#           ~4 minutes (at most 150 + 330 s by its timeouts); its tables print last;
#   coop    the cooperative-matrix forward and backward (build with the cargo feature coop-matrix; COOP_ONLY=1
#           builds just this): the adapter report of that build (whether it is usable and at
#           which tile), cce-wgpu's conformance tests with it (their f16 cases take the default
#           128 x 128 forward, `coop_forwards_64_and_128` all three), then the forward alone at
#           8192 x 2304 x 256000 f16 c/8 exact in alternation (--ab --forward-only, then one
#           call each with GPU timestamps per shader): 8:8:coop128 (logits_coop128.wgsl,
#           128 x 128, 32 x 64 per subgroup), 8:8:coop128w (logits_coop128w.wgsl, 128 x 128,
#           64 x 64 per subgroup), 8:8:coop128w16 (the same with 16-deep panels) and
#           8:8:named:fma (the FMA forward), with each config's loss
#           and the largest |Δ lse| against the first's; COOP_CONFIGS overrides the list
#           (8:8:coop64: logits_coop.wgsl, 64 x 64); then the backend's forward+backward at
#           the same shape (--ab --profile, the forward rounds too): 8:8:coop128:fmabwd (the
#           coop forward with the FMA backward: the reference), 8:8:coop128:coopbwd (the backward's
#           d_e and d_c products by cooperative matrices, bwd_coop.wgsl, 128 x 128, f16 G) and
#           8:8:named:fma, with each config's loss and the largest |Δ| of its d_e and d_c
#           against the reference's (COOP_BWD_CONFIGS overrides the list; the conformance
#           tests' coop_backward_products judge the coop backward against f64 first); ~4
#           minutes (at most 150 + 100 + 240 s by its timeouts); its tables print last.
# Default: report,tests. BENCH_ARGS adds arguments to every benchmark call (e.g. "--configs
# 8:8" or "--target-workgroups 4096"). Logs and JSON lines go to $OUT; a summary table (from
# the JSON lines of every phase run so far, scripts/device-wgpu-summary.py: TFLOP/s, share of
# the fp32 peak, ratios to the CUDA backend and the cuBLAS GEMM of BENCHMARKS.md's session 12
# run on the same machine) is printed last.
set -uo pipefail

DEVBIN=${DEVBIN:-.devbin/wgpu}
mode=${1:-}

if [ "$mode" = build ]; then
  set -e
  cd "$(dirname "$0")/.."
  mkdir -p "$DEVBIN/gl"
  stage_tests() { # $1: cargo args; then pairs of (test target name, staged name)
    local args=$1
    shift
    # shellcheck disable=SC2086
    cargo test --release $args --no-run --message-format=json 2>/dev/null |
      python3 -c '
import json, sys, shutil, os
dst, pairs = sys.argv[1], dict(zip(sys.argv[2::2], sys.argv[3::2]))
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        name = m["target"]["name"]
        if name in pairs:
            shutil.copy(m["executable"], os.path.join(dst, pairs[name]))
            print("staged", pairs[name])
' "$DEVBIN" "$@"
  }
  if [ "${COOP_ONLY:-0}" = 1 ]; then
    find "$DEVBIN" -maxdepth 1 -type f -delete
    stage_tests "-p cce-wgpu --features coop-matrix" conformance conformance-coop
    cargo build --release -p cce-benches --features wgpu-coop --bin cce-bench-wgpu
    cp "${CARGO_TARGET_DIR:-target}"/release/cce-bench-wgpu "$DEVBIN/cce-bench-wgpu-coop"
    strip "$DEVBIN"/conformance-coop "$DEVBIN"/cce-bench-wgpu-coop
    gzip -f "$DEVBIN"/conformance-coop "$DEVBIN"/cce-bench-wgpu-coop
  elif [ "${QUICK:-0}" = 1 ]; then
    find "$DEVBIN" -maxdepth 1 -type f -delete
    cargo build --release -p cce-benches --features wgpu --bin cce-bench-wgpu --bin cce-bench-sgemm
    cp "${CARGO_TARGET_DIR:-target}"/release/cce-bench-wgpu \
      "${CARGO_TARGET_DIR:-target}"/release/cce-bench-sgemm "$DEVBIN/"
    strip "$DEVBIN"/cce-bench-wgpu "$DEVBIN"/cce-bench-sgemm
    gzip -f "$DEVBIN"/cce-bench-wgpu "$DEVBIN"/cce-bench-sgemm
  else
  stage_tests "-p cce-wgpu" conformance conformance interop interop shaders_naga shaders_naga
  stage_tests "-p cce-conformance --features wgpu --test wgpu" wgpu suite
  # The cooperative-matrix forward (cargo feature coop-matrix): its own test and bench builds.
  stage_tests "-p cce-wgpu --features coop-matrix" conformance conformance-coop
  cargo build --release -p cce-benches --features wgpu-coop --bin cce-bench-wgpu
  cp "${CARGO_TARGET_DIR:-target}"/release/cce-bench-wgpu "$DEVBIN/cce-bench-wgpu-coop"
  cargo build --release -p cce-benches --features wgpu --bin cce-bench-wgpu --bin cce-bench-sgemm
  cp "${CARGO_TARGET_DIR:-target}"/release/cce-bench-wgpu \
    "${CARGO_TARGET_DIR:-target}"/release/cce-bench-sgemm "$DEVBIN/"
  strip "$DEVBIN"/conformance "$DEVBIN"/interop "$DEVBIN"/shaders_naga "$DEVBIN"/suite \
    "$DEVBIN"/cce-bench-wgpu "$DEVBIN"/conformance-coop "$DEVBIN"/cce-bench-wgpu-coop \
    "$DEVBIN"/cce-bench-sgemm
  fi
  rm -f "$DEVBIN"/gl/*
  # The loader and glvnd's dispatch libraries, which NVIDIA's libGLX_nvidia (the Vulkan ICD)
  # needs: without them the loader finds the ICD but no vkCreateInstance (seen on the H200).
  if ! (cd "$DEVBIN/gl" && apt-get download libvulkan1 libglvnd0 libegl1 libopengl0 libgl1 \
    libglx0 libgles2); then
    echo "apt-get download failed: copying the installed loader instead"
    cp -L /usr/lib/x86_64-linux-gnu/libvulkan.so.1 "$DEVBIN/gl/"
  fi
  cp scripts/device-wgpu.sh "$DEVBIN/"
  # cce-data finds the shipped fixture through a path fixed at compile time (this checkout).
  pwd >"$DEVBIN/build_root"
  du -ch "$DEVBIN"/* | tail -1
  ls -la "$DEVBIN" "$DEVBIN/gl"
  exit 0
fi

if [ "$mode" != run ]; then
  echo "usage: $0 build | run [report,tests,sweep,bench,seed,dtypes,coop,speed,sgemm,gap,quick,bwd,t128]" >&2
  exit 2
fi

case $DEVBIN in
  /*) D=$DEVBIN ;;
  *) D=$PWD/$DEVBIN ;;
esac
OUT=${OUT:-/tmp/cce-out}
mkdir -p "$OUT"
PHASES=${2:-report,tests}
B=$D/cce-bench-wgpu
# Executables carried gzipped (the device tool's 64 MiB carry limit): unpacked in place.
for f in "$D"/*.gz; do
  [ -e "$f" ] && gunzip -f "$f"
done
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp} CCE_REQUIRE_WGPU=1 RUST_BACKTRACE=1
export CCE_DATA_DIR=$PWD/data
if [ -f "$D/build_root" ]; then
  root=$(cat "$D/build_root")
  if [ ! -e "$root/data" ]; then
    mkdir -p "$root/crates/cce-data" && ln -sfn "$PWD/data" "$root/data"
  fi
fi

# The Vulkan loader: the carried .deb unpacked into / as root (the device tool's advice; a
# loader under LD_LIBRARY_PATH alone found no adapter on the H200), else under $D/gl/root.
for f in "$D"/gl/*.deb; do
  [ -e "$f" ] || continue
  if [ "$(id -u)" = 0 ]; then dpkg -x "$f" / && ldconfig; else dpkg -x "$f" "$D/gl/root"; fi
done
export LD_LIBRARY_PATH="$D/gl/root/usr/lib/x86_64-linux-gnu:$D/gl:${LD_LIBRARY_PATH:-}"
# NVIDIA's ICD manifest: the driver's own where the machine has one (/usr/local/nvidia on the
# H200 machines), else one written here that points at the driver's library.
icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
if [ -e "$icd" ]; then
  export VK_DRIVER_FILES=$icd VK_ICD_FILENAMES=$icd
  echo "NVIDIA ICD manifest: $icd"
elif ! ls /usr/share/vulkan/icd.d/nvidia* /etc/vulkan/icd.d/nvidia* >/dev/null 2>&1; then
  lib=$(ldconfig -p | awk '/libGLX_nvidia.so.0/ {print $NF; exit}')
  if [ -n "$lib" ]; then
    printf '{"file_format_version":"1.0.0","ICD":{"library_path":"%s","api_version":"1.3.0"}}\n' \
      "$lib" >"$OUT/nvidia_icd.json"
    export VK_DRIVER_FILES="$OUT/nvidia_icd.json" VK_ICD_FILENAMES="$OUT/nvidia_icd.json"
    echo "no NVIDIA ICD manifest installed: using $lib"
  fi
fi
{ ldconfig -p | grep -i vulkan; ls /usr/local/nvidia/share/vulkan/icd.d 2>&1; } >"$OUT/vulkan-env.txt" 2>&1

declare -A status
summary() {
  echo
  echo "==== summary ===="
  for k in report tests sweep bench seed dtypes coop speed sgemm gap quick bwd t128; do
    [ -n "${status[$k]:-}" ] && printf '%-8s %s\n' "$k" "${status[$k]}"
  done
  # wgpu figures against the CUDA backend and cuBLAS on this machine (the script's docs).
  if ls "$OUT"/bench-*.jsonl >/dev/null 2>&1; then
    python3 scripts/device-wgpu-summary.py "$OUT"/bench-*.jsonl ||
      echo "(no python3: see $OUT/bench-*.jsonl)"
  fi
  if [ -f "$OUT/speed.log" ]; then
    echo
    echo "==== speed: main loops A/B (wall medians, then GPU time per shader) ===="
    grep -E "^\| " "$OUT/speed.log"
  fi
  if [ -f "$OUT/sgemm.log" ]; then
    echo
    echo "==== sgemm: reference SGEMM against our main loops (GPU timestamps, medians) ===="
    grep -E "^adapter|FAIL" "$OUT/sgemm.log"
    grep -E "^\|" "$OUT/sgemm.log"
  fi
  if [ -f "$OUT/gap.log" ]; then
    echo
    echo "==== gap: the forward shader and its ablations (GPU timestamps, medians) ===="
    grep -E "^adapter|FAIL" "$OUT/gap.log"
    grep -E "^\|" "$OUT/gap.log"
  fi
  if [ -f "$OUT/quick.log" ]; then
    echo
    echo "==== quick: the forward shader against fwd-loop, the backward's atomics scattered against coalesced (GPU timestamps, medians) ===="
    grep -E "^adapter|FAIL" "$OUT/quick.log"
    grep -E "^\|" "$OUT/quick.log"
  fi
  if [ -f "$OUT/quick-backend.log" ]; then
    echo
    echo "==== quick: the backend, forward and forward+backward (wall, then GPU per shader) ===="
    grep -E "^\| " "$OUT/quick-backend.log"
  fi
  if [ -f "$OUT/bwd.log" ]; then
    echo
    echo "==== bwd: the d_e and d_c passes and their ablations on one chunk (GPU timestamps, medians) ===="
    grep -E "^adapter|FAIL" "$OUT/bwd.log"
    sed -n '/^| d_e chunk/,/^$/p' "$OUT/bwd.log"
    sed -n '/^| forward chunk/,/^$/p' "$OUT/bwd.log"
  fi
  if [ -f "$OUT/t128.log" ]; then
    echo
    echo "==== t128: the forward and backward shaders at 64 x 64 against 128 x 128 tiles, one chunk (GPU timestamps, medians) ===="
    grep -E "^adapter|FAIL" "$OUT/t128.log"
    grep -E "^\|" "$OUT/t128.log"
  fi
  if [ -f "$OUT/t128-backend.log" ]; then
    echo
    echo "==== t128: the backend at 8:8 against 16:16 and 16:8, forward and forward+backward (wall medians, losses and |Δ lse| against 8:8, then GPU time per shader) ===="
    grep -E "^\| " "$OUT/t128-backend.log"
  fi
  if [ -f "$OUT/coop-gemma2.log" ]; then
    echo
    echo "==== coop: the forward at 8192 x 2304 x 256000 f16, cooperative matrix against FMA (wall medians, losses and |Δ lse| against the first config, then GPU time per shader) ===="
    grep -E "^\| " "$OUT/coop-gemma2.log"
  fi
  if [ -f "$OUT/coop-bwd.log" ]; then
    echo
    echo "==== coop: forward+backward at 8192 x 2304 x 256000 f16, the coop backward against the FMA backward (wall medians, losses and max |Δ d_e|, |Δ d_c| against the first config, then GPU time per shader) ===="
    grep -E "^\| " "$OUT/coop-bwd.log"
  fi
  if [ -f "$OUT/gap-forward.log" ]; then
    echo
    echo "==== gap: the real forward, wall against GPU time per dispatch ===="
    grep -E "^\| " "$OUT/gap-forward.log"
  fi
}
trap summary EXIT

bench() { # $1: name of the log; the rest: benchmark arguments
  local name=$1
  shift
  # shellcheck disable=SC2086
  timeout 590 "$B" --deadline-s 540 --out "$OUT/bench-$name.jsonl" "$@" ${BENCH_ARGS:-} \
    >"$OUT/bench-$name.log" 2>&1
  local rc=$?
  grep -E "^\| |^adapter|using|config wg" "$OUT/bench-$name.log" | tail -30
  status[$name]="${status[$name]:-}rc=$rc "
}

if [[ $PHASES == *report* ]]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm \
    --format=csv,noheader | tee "$OUT/gpu.txt"
  timeout 60 "$B" --adapter-report 2>&1 | tee "$OUT/adapter.txt"
  status[report]=$(grep -q "^adapter:" "$OUT/adapter.txt" && echo ok || echo FAIL)
fi

if [[ $PHASES == *tests* ]]; then
  ok=1
  for t in shaders_naga conformance interop suite; do
    echo "==== $t ===="
    # shaders_naga: the validation test only (the header test reads the source tree).
    filter=$([ $t = shaders_naga ] && echo validates)
    # shellcheck disable=SC2086
    if ! timeout 300 "$D/$t" $filter --test-threads=4 >>"$OUT/tests.log" 2>&1; then ok=0; fi
  done
  grep -E "^test |test result|panicked|skipping" "$OUT/tests.log" | tail -40
  status[tests]=$([ $ok = 1 ] && echo PASS || echo FAIL)
fi

if [[ $PHASES == *sweep* ]]; then
  timeout 400 "$B" --shapes gemma2 --data c/8 --exact --ab --reps 3 --deadline-s 360 \
    --configs "${SWEEP_CONFIGS:-8:16,8:8,8:4,8:16:checked}" >"$OUT/sweep.log" 2>&1
  status[sweep]="rc=$? "
  grep -E "^\| |^adapter" "$OUT/sweep.log"
  # More workgroups than the default 2048 (2.6 rounds of ~790 resident ones: a 14% tail).
  timeout 180 "$B" --shapes gemma2 --data c/8 --exact --ab --reps 3 --deadline-s 150 \
    --configs 8:16 --target-workgroups 8192 >"$OUT/sweep-8192.log" 2>&1
  status[sweep]+="rc=$?"
  grep -E "^\| " "$OUT/sweep-8192.log"
fi

if [[ $PHASES == *bench* ]]; then
  bench gemma2-filtered --shapes gemma2 --data c/8,randn --softcap 30 --reps 3
  bench gemma2-exact --shapes gemma2 --data c/8,randn --softcap 30 --reps 3 --exact
  bench llama3-filtered --shapes llama3 --data c/8,randn --reps 3
  bench llama3-exact --shapes llama3 --data c/8,randn --reps 3 --exact
  status[bench]=${status[gemma2-filtered]:-}${status[gemma2-exact]:-}${status[llama3-filtered]:-}${status[llama3-exact]:-}
fi

if [[ $PHASES == *seed* ]]; then
  bench seed-exact --shapes seed --data c/8 --reps 2 --exact
  bench seed-filtered --shapes seed --data c/8 --reps 2
  status[seed]=${status[seed-exact]:-}${status[seed-filtered]:-}
fi

if [[ $PHASES == *dtypes* ]]; then
  bench dtypes-f16 --shapes gemma2 --data c/8 --dtype f16 --reps 2 --exact
  bench dtypes-f32 --shapes gemma2 --data c/8 --dtype f32 --reps 2 --exact
  status[dtypes]=${status[dtypes-f16]:-}${status[dtypes-f32]:-}
fi

if [[ $PHASES == *speed* ]]; then
  left=$((450 - SECONDS))
  if [ $left -lt 60 ]; then
    status[speed]="skipped: ${left} s left"
  else
    timeout $((left + 20)) "$B" --shapes gemma2 --data c/8 --exact --ab --profile --reps 2 \
      --deadline-s $left --configs "${SPEED_CONFIGS:-8:8:scalar,8:8:named,8:16:named}" \
      ${BENCH_ARGS:-} >"$OUT/speed.log" 2>&1
    status[speed]="rc=$? (deadline ${left} s)"
    grep -E "^adapter|round|deadline" "$OUT/speed.log" | tail -20
  fi
fi

if [[ $PHASES == *sgemm* ]]; then
  # shellcheck disable=SC2086
  timeout 170 "$D/cce-bench-sgemm" --dump-spirv "$OUT/spirv" --deadline-s 120 \
    --out "$OUT/sgemm.jsonl" ${SGEMM_ARGS:-} >"$OUT/sgemm.log" 2>&1
  status[sgemm]="rc=$?"
  grep -E "^adapter|^built|^not built|^spirv|^check.*FAIL" "$OUT/sgemm.log" | cut -c1-220
  echo "checks passed: $(grep -cE '^check .*: ok' "$OUT/sgemm.log")," \
    "failed: $(grep -cE '^check .*: FAIL' "$OUT/sgemm.log")"
fi

if [[ $PHASES == *gap* ]]; then
  timeout 170 "$D/cce-bench-sgemm" --variants ours-named:bf16 --shapes 8192x8192x2304 \
    --check 200x136x72 --deadline-s 110 --out "$OUT/gap.jsonl" --fwd-variants \
    "${GAP_FWD:-fwd-real,fwd-real:t1,fwd-nowrite,fwd-loopwg,fwd-loop,fwd-loop:t1,fwd-real:scalar}" \
    >"$OUT/gap.log" 2>&1
  status[gap]="ablations rc=$?; "
  grep -E "^adapter|^built|^not built|FAIL|TFLOP" "$OUT/gap.log" | cut -c1-220
  timeout 150 "$B" --shapes gemma2 --data c/8 --exact --ab --forward-only --profile --reps 2 \
    --deadline-s 120 --configs "${GAP_CONFIGS:-8:8:named,8:8:named:w65536}" \
    >"$OUT/gap-forward.log" 2>&1
  status[gap]+="forward rc=$?"
  grep -E "^adapter|round|deadline" "$OUT/gap-forward.log" | tail -12
fi

if [[ $PHASES == *quick* ]]; then
  timeout 75 "$D/cce-bench-sgemm" --variants "" --shapes "" --check "" --warmup 1 --reps 3 \
    --deadline-s 60 --out "$OUT/quick.jsonl" --fwd-variants "${QUICK_FWD:-fwd-real,fwd-loop}" \
    --fwd-shapes 8192x29120x2304 --fwd-check 70x136x264 \
    --bwd-variants "${QUICK_BWD-bwd-atomic,bwd-atomic-co,dc-atomic,dc-atomic-co}" \
    --bwd-shapes 8192x29120x2304 --bwd-check 70x300x136 >"$OUT/quick.log" 2>&1
  status[quick]="forward / backward shaders rc=$?; "
  grep -E "^adapter|^built|^not built|FAIL|TFLOP" "$OUT/quick.log" | cut -c1-220
  timeout 130 "$B" --shapes gemma2 --data c/8 --exact --ab --profile --reps 1 \
    --deadline-s 120 --configs "${QUICK_CONFIGS:-8:8:named,8:8:named:co,8:8:named:det}" \
    >"$OUT/quick-backend.log" 2>&1
  status[quick]+="backend rc=$?"
  grep -E "^adapter|round|deadline" "$OUT/quick-backend.log" | tail -12
fi

if [[ $PHASES == *bwd* ]]; then
  timeout 110 "$D/cce-bench-sgemm" --variants "" --shapes "" --check "" --warmup 1 --reps 3 \
    --deadline-s 90 --bwd-variants "${BWD_VARIANTS:-bwd-noprod,bwd-noprodc,bwd-noslab,bwd-nog,bwd-nox,bwd-nobar,bwd-nofma,bwd-dynk,bwd-noslab:scalar,bwd-noprod:scalar,dc-noslab,dc-nog}" \
    --bwd-shapes 8192x29120x2304 --bwd-check 70x300x136 \
    --fwd-variants "${BWD_FWD-fwd-real}" \
    --fwd-shapes 8192x29120x2304 --fwd-check 70x136x264 >"$OUT/bwd.log" 2>&1
  status[bwd]="d_e / d_c ablations rc=$?"
  grep -E "^adapter|^built|^not built|FAIL|TFLOP" "$OUT/bwd.log" | cut -c1-220
fi

if [[ $PHASES == *t128* ]]; then
  timeout 150 "$D/cce-bench-sgemm" --variants "" --shapes "" --check "" --warmup 1 --reps 3 \
    --deadline-s 120 --out "$OUT/t128.jsonl" \
    --fwd-variants "${T128_FWD-fwd-real,fwd-real:16x16,fwd-real:16x8,fwd-real:16x16:loop,fwd-loop:16x16}" \
    --fwd-shapes 8192x29120x2304 --fwd-check 70x136x264 \
    --bwd-variants "${T128_BWD-bwd-atomic,bwd-atomic:16x16,bwd-atomic:16x8,bwd-atomic:16x16:loop,bwd-noslab,bwd-noprod,bwd-noslab:16x16,bwd-noprod:16x16,dc-atomic,dc-atomic:16x16,dc-atomic:16x8}" \
    --bwd-shapes 8192x29120x2304 --bwd-check 70x300x136 >"$OUT/t128.log" 2>&1
  status[t128]="forward / backward shaders rc=$?; "
  grep -E "^adapter|^built|^not built|FAIL|TFLOP" "$OUT/t128.log" | cut -c1-220
  timeout 330 "$B" --shapes gemma2 --data c/8 --exact --ab --profile --reps 2 \
    --deadline-s 300 --configs "${T128_CONFIGS:-8:8:named,16:16:named,16:8:named}" \
    >"$OUT/t128-backend.log" 2>&1
  status[t128]+="backend rc=$?"
  grep -E "^adapter|round|deadline|config " "$OUT/t128-backend.log" | tail -24
fi

if [[ $PHASES == *coop* ]]; then
  C=$D/cce-bench-wgpu-coop
  timeout 60 "$C" --adapter-report 2>&1 | tee "$OUT/adapter-coop.txt"
  ok=PASS
  timeout 150 "$D/conformance-coop" --test-threads=4 >"$OUT/tests-coop.log" 2>&1 || ok=FAIL
  grep -E "^test |test result|panicked" "$OUT/tests-coop.log" | tail -24
  timeout 100 "$C" --shapes gemma2 --data c/8 --dtype f16 --exact --ab --forward-only \
    --profile --reps 3 --deadline-s 60 \
    --configs "${COOP_CONFIGS:-8:8:coop128,8:8:coop128w,8:8:coop128w16,8:8:named:fma}" \
    >"$OUT/coop-gemma2.log" 2>&1
  rc=$?
  grep -E "^adapter|round|deadline" "$OUT/coop-gemma2.log" | tail -12
  timeout 240 "$C" --shapes gemma2 --data c/8 --dtype f16 --exact --ab --profile --reps 2 \
    --deadline-s 220 \
    --configs "${COOP_BWD_CONFIGS:-8:8:coop128:fmabwd,8:8:coop128:coopbwd,8:8:named:fma}" \
    >"$OUT/coop-bwd.log" 2>&1
  rcb=$?
  grep -E "^adapter|round|deadline" "$OUT/coop-bwd.log" | tail -16
  status[coop]="tests $ok; forward A/B rc=$rc; fwd+bwd A/B rc=$rcb; $(grep -h "cooperative-matrix forward" "$OUT/adapter-coop.txt")"
fi
