#!/usr/bin/env bash
# A static library that defines the LLVM symbols cubecl-llvm references, each as a function that
# prints its name and aborts, so that a binary with burn's CUDA backend links without LLVM.
#
#   scripts/cubecl-llvm-stub.sh DEPS_DIR OUT.a
#
# Why: cubecl-cuda 0.11.3 (burn 0.22.1's CUDA runtime) always depends on cubecl-llvm, whose
# build script (through tracel-llvm-bundler) downloads an LLVM 23 bundle from GitHub and links
# it. Neither this machine nor the device machine reaches GitHub. With DOCS_RS=1 both build
# scripts skip the bundle (what docs.rs does), which is enough for check, clippy and doc; a
# binary then lacks LLVM's symbols at link time. This library supplies them.
#
# Only for binaries whose burn CUDA kernels are compiled by NVRTC (cubecl-cuda's `cpp` feature,
# `--features cubecl-cuda/cpp` on cce-burn): cubecl's LLVM compiler would call a stub and abort
# with its name.
#
# DEPS_DIR is the profile's deps folder (e.g. target/burn/debug/deps) after the build that
# failed to link: every rlib there is scanned for undefined C symbols of LLVM's C API (`LLVM*`)
# and of cubecl-llvm's C++ shims (`cubecl_*`).
set -euo pipefail

deps=${1:?usage: $0 DEPS_DIR OUT.a}
out=${2:?usage: $0 DEPS_DIR OUT.a}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

for rlib in "$deps"/lib*.rlib; do
  nm -u --format=just-symbols "$rlib" 2>/dev/null || true
done | grep -E '^(LLVM|cubecl_)[A-Za-z0-9_]*$' | sort -u >"$work/symbols"

count=$(wc -l <"$work/symbols")
if [ "$count" -eq 0 ]; then
  echo "no LLVM symbol is referenced under $deps (was cce-burn built with --features cuda?)" >&2
  exit 1
fi

{
  echo '#include <stdio.h>'
  echo '#include <stdlib.h>'
  echo 'static void cce_no_llvm(const char *name) {'
  echo '  fprintf(stderr, "%s: LLVM is not linked in this build (burn'"'"'s CUDA kernels are "'
  echo '          "compiled by NVRTC: cubecl-cuda/cpp; scripts/cubecl-llvm-stub.sh)\n", name);'
  echo '  abort();'
  echo '}'
  while read -r s; do
    echo "void $s(void) { cce_no_llvm(\"$s\"); }"
  done <"$work/symbols"
} >"$work/stub.c"

cc -O1 -fPIC -w -c "$work/stub.c" -o "$work/stub.o"
rm -f "$out"
ar rcs "$out" "$work/stub.o"
echo "stubbed $count LLVM symbols into $out"
