#!/usr/bin/env bash
# Build and run the wgmma lse microbenchmark on the H200. Logs go to $OUT (or ./out).
#   bash run.sh            all shapes, BN = 256 and 128
#   SHAPES="..." bash run.sh   custom list of "N D V BN reps group_m" entries separated by ';'
set -u
OUT=${OUT:-./out}
mkdir -p "$OUT"
LOG=$OUT/run.log
exec > >(tee "$LOG") 2>&1

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader || true
nvcc --version | tail -2

echo "== build"
t0=$(date +%s)
nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v bench.cu -lcublas -lcuda -o bench \
  > "$OUT/ptxas.txt" 2>&1
rc=$?
grep -A3 "gemm_lse\|C75" "$OUT/ptxas.txt" | grep -v "^--"
grep -i "warning\|error" "$OUT/ptxas.txt" | head -20
echo "build rc=$rc in $(( $(date +%s) - t0 )) s"
[ $rc -eq 0 ] || exit 1
echo "HGMMA count (all kernels): $(cuobjdump --dump-sass bench | grep -c HGMMA)"
cuobjdump --dump-sass bench > "$OUT/sass.txt" 2>&1
grep -E "Function :|HGMMA" "$OUT/sass.txt" | awk '/Function/{f=$3} /HGMMA/{c[f]++} END{for(k in c) print "  " k ": " c[k] " HGMMA"}'
grep -c "LDL\|STL" "$OUT/sass.txt" | sed 's/^/  LDL\/STL lines in SASS: /'

# entries: N D V BN reps group_m cluster_m ordered_epi
DEFAULT="1000 512 5003 256 20 16 1 0;1000 512 5003 256 20 16 1 1;1000 512 5003 256 20 16 2 1;\
4096 4096 128256 256 20 16 1 0;4096 4096 128256 256 20 16 1 1;\
8192 4096 128256 256 15 16 1 0;8192 4096 128256 256 15 16 1 1;8192 4096 128256 256 15 16 2 1;\
32768 4096 256000 256 10 16 1 0;32768 4096 256000 256 10 16 1 1;32768 4096 256000 256 10 16 2 1"
SHAPES=${SHAPES:-$DEFAULT}

IFS=';' read -ra LIST <<< "$SHAPES"
for e in "${LIST[@]}"; do
  set -- $e
  echo "== ./bench $*"
  nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader,nounits -lms 200 > smi.tmp 2>/dev/null &
  smi=$!
  timeout 90 ./bench "$@"
  rc=$?
  kill $smi 2>/dev/null; wait $smi 2>/dev/null
  echo "   rc=$rc"
  sort -t, -k1n smi.tmp | awk -F', *' '{c[NR]=$1; if($2>p)p=$2; if($3>t)t=$3} END{if(NR) printf "   nvidia-smi over the run (%d samples): SM clock min %s median %s max %s MHz, power max %s W, temp max %s C\n", NR, c[1], c[int((NR+1)/2)], c[NR], p, t}'
  cat smi.tmp >> "$OUT/smi.csv"
  if [ $rc -ne 0 ] && [ "$1" = "1000" ] && command -v compute-sanitizer > /dev/null; then
    echo "   -> compute-sanitizer on the failing small shape"
    timeout 60 compute-sanitizer --tool memcheck ./bench "$@" 2>&1 | head -40
  fi
done

echo "== table"
printf "%-20s %11s | %9s %6s | %9s %6s %6s %8s | %9s %6s %6s %8s | %8s %6s\n" "N x D x V" BN/CM/G/O cublas_ms TF/s A_ms TF/s A/cub A_err Bc_ms TF/s B/cub B_err M_ms M/cub
grep '^RESULT N=' "$LOG" | sed 's/RESULT //' | while read -r line; do
  declare -A kv=()
  for f in $line; do kv[${f%%=*}]=${f#*=}; done
  printf "%-20s %11s | %9s %6s | %9s %6s %6s %8s | %9s %6s %6s %8s | %8s %6s\n" "${kv[N]}x${kv[D]}x${kv[V]}" "${kv[BN]}/${kv[CM]}/${kv[G]}/${kv[O]}" \
    "${kv[cublas_ms]}" "${kv[cublas_tf]}" "${kv[A_ms]}" "${kv[A_tf]}" "${kv[A_ratio]}" "${kv[A_err]}" \
    "${kv[Bc_ms]}" "${kv[B_tf]}" "${kv[B_ratio]}" "${kv[B_err]}" "${kv[M_ms]}" "${kv[M_ratio]}"
done
grep '^RESULT FAIL' "$LOG" || true
