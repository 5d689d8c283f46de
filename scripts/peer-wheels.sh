#!/usr/bin/env bash
# The side-by-side benchmark's peers as wheels, for a machine without network (the H200):
# Liger 0.8.5 from PyPI, Apple's CCE built from apple/ml-cross-entropy at d42911f (version
# 25.6.4), and the 12k-row real file. Writes them into .devbin/whl (ignored by git; the default
# PEERS of scripts/device-cuda.sh's pybench phase), which a device call carries.
#
# Usage: scripts/peer-wheels.sh [PYTHON]   (a Python with pip; default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-python3}"
OUT="$PWD/.devbin/whl"
mkdir -p "$OUT"
"$PY" -m pip download -q --no-deps liger-kernel==0.8.5 -d "$OUT"
SRC="$(mktemp -d)"
git clone -q https://github.com/apple/ml-cross-entropy "$SRC/ml-cross-entropy"
git -C "$SRC/ml-cross-entropy" checkout -q d42911f
SETUPTOOLS_SCM_PRETEND_VERSION=25.6.4 "$PY" -m pip wheel -q --no-deps "$SRC/ml-cross-entropy" -w "$OUT"
rm -rf "$SRC"
cp ../shared/data/smollm2_lce_real_E12k.safetensors "$OUT/"
ls -l "$OUT"
