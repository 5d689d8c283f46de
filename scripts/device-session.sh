#!/usr/bin/env bash
# Several staged device runs in one device call, within one time budget.
#
#   BUDGET=540 bash scripts/device-session.sh 'NAME|SECONDS|COMMAND' ...
#
# Each step runs COMMAND with `bash -c` from the repository root under `timeout SECONDS`
# (cut to what is left of BUDGET, default 540 s of the device tool's 600), its output in
# $OUT/NAME.log (the device tool brings back only a few files: keep the steps few). A step
# cut to under 20 s by the budget is skipped. Last, one line per step (exit status, seconds) and
# the last TAIL lines (default 25) of each log, so the call's reply holds the tables that
# the runners print last. Example (payloads staged with scripts/device-wgpu.sh build and
# scripts/device-cuda.sh build, carried as .devbin/wq and .devbin/cuda):
#   BUDGET=560 bash scripts/device-session.sh \
#     'wgpu|200|DEVBIN=.devbin/wq bash .devbin/wq/device-wgpu.sh run report,quick' \
#     'cuda|300|DEVBIN=.devbin/cuda bash .devbin/cuda/device-cuda.sh run tests,suite'
set -uo pipefail

OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
budget=${BUDGET:-540}
tail_lines=${TAIL:-25}
start=$(date +%s)
summary=()
names=()

for step in "$@"; do
  IFS='|' read -r name secs cmd <<<"$step"
  if [[ -z $name || ! $secs =~ ^[0-9]+$ || -z $cmd ]]; then
    echo "device-session: a step is NAME|SECONDS|COMMAND, got: $step" >&2
    exit 2
  fi
done

for step in "$@"; do
  IFS='|' read -r name secs cmd <<<"$step"
  left=$((budget - ($(date +%s) - start)))
  if ((secs > left)); then
    secs=$left
    cut=1
  else
    cut=0
  fi
  if ((cut && secs < 20)); then
    summary+=("$name: skipped (${left}s of the budget left)")
    continue
  fi
  t0=$(date +%s)
  timeout --kill-after=5 "$secs" bash -c "$cmd" >"$OUT/$name.log" 2>&1
  rc=$?
  summary+=("$name: rc $rc, $(($(date +%s) - t0)) s of $secs")
  names+=("$name")
done

for name in "${names[@]}"; do
  echo "===== $name (last $tail_lines lines of $OUT/$name.log)"
  tail -n "$tail_lines" "$OUT/$name.log"
done
echo "===== steps"
printf '%s\n' "${summary[@]}"
