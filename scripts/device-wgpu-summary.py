#!/usr/bin/env python3
"""Summary of cce-bench-wgpu JSON lines (scripts/device-wgpu.sh): per case the forward and
forward+backward times, TFLOP/s, the share of the H200's fp32 FMA peak, and the ratios to the
CUDA backend and to the cuBLAS logits GEMM measured on the same machine.

The CUDA and cuBLAS figures are BENCHMARKS.md's "Current state" (session 12, bundle of commit
3fb9830: bf16, default options (filtered) and exact, 0.5 GiB), a different run of the same
machine: the ratios compare runs, not one process.

usage: device-wgpu-summary.py FILE.jsonl...
"""
import json
import sys

# (shape, data, mode) -> (forward ms, fwd+bwd ms) of the CUDA backend; gemma2 with softcap 30.
CUDA = {
    ("gemma2", "c/8", "filtered"): (14.46, 68.24),
    ("gemma2", "randn", "filtered"): (14.74, 67.97),
    ("gemma2", "c/8", "exact"): (14.46, 68.27),
    ("gemma2", "randn", "exact"): (14.74, 67.06),
    ("llama3", "c/8", "filtered"): (10.15, 19.24),
    ("llama3", "randn", "filtered"): (10.06, 14.03),
    ("llama3", "c/8", "exact"): (10.15, 51.29),
    ("llama3", "randn", "exact"): (10.06, 50.54),
    ("seed", "c/8", "filtered"): (102.06, 170.88),
    ("seed", "randn", "filtered"): (102.06, 127.29),
    ("seed", "c/8", "exact"): (102.06, 446.91),
    ("seed", "randn", "exact"): (102.06, 423.50),
}
# cuBLAS bf16 logits GEMM (one GEMM, 2·N·V·D FLOP) in ms, same run.
GEMM_MS = {"gemma2": 13.40, "llama3": 11.98, "seed": 101.64}
PEAK_TFLOPS = 67.0  # H200 fp32 FMA peak


def ratio(a, b):
    return f"{a / b:.1f}x" if a and b else "-"


def row(r):
    cuda_f, cuda_fb = (None, None)
    if r["dtype"] == "bf16" and (r["shape"] != "gemma2" or r.get("softcap") == 30):
        cuda_f, cuda_fb = CUDA.get((r["shape"], r["data"], r["mode"]), (None, None))
    cap = f" softcap {r['softcap']}" if r.get("softcap") else ""
    cells = [
        f"{r['shape']} {r['n']}x{r['d']}x{r['v']}{cap}",
        r["data"],
        r["dtype"],
        r["mode"],
        r.get("config", "-"),
        f"{r['forward_ms']:.1f}",
        f"{r['forward_tflops']:.2f}",
        f"{100 * r['forward_tflops'] / PEAK_TFLOPS:.1f}%",
        ratio(r["forward_ms"], cuda_f),
        ratio(r["forward_ms"], GEMM_MS.get(r["shape"])),
    ]
    fb = r.get("fwd_bwd_ms")
    if fb:
        cells += [
            f"{fb:.1f}",
            f"{r['fwd_bwd_floor_tflops']:.2f}",
            f"{r['fwd_bwd_exec_tflops']:.2f}",
            f"{100 * r['fwd_bwd_exec_tflops'] / PEAK_TFLOPS:.1f}%",
            ratio(fb, cuda_fb),
            ratio(fb, 3 * GEMM_MS[r["shape"]]) if r["shape"] in GEMM_MS else "-",
            f"{100 * r['tiles_kept']:.0f}%",
            f"{r['dropped_mass_max']:.1e}",
        ]
    else:
        cells += ["-"] * 8
    return "| " + " | ".join(cells) + " |"


def main(paths):
    head = [
        "shape", "data", "dtype", "mode", "config", "forward ms", "TFLOP/s", "% fp32 peak",
        "x CUDA", "x cuBLAS GEMM", "fwd+bwd ms", "floor TFLOP/s", "executed TFLOP/s",
        "executed % peak", "x CUDA", "x 3 GEMMs", "tiles kept", "dropped max",
    ]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for path in paths:
        with open(path) as f:
            for line in f:
                if line.strip():
                    print(row(json.loads(line)))


if __name__ == "__main__":
    main(sys.argv[1:])
