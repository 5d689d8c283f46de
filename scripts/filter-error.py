"""The gradient filter's error on the shipped real rows (issue 23: the default dropped-mass bound).

For each bound delta, every row drops its smallest probabilities (each below filter_eps, the
library's bf16 `auto` 2^-12 unless --eps) while the dropped mass stays <= delta (the library's
rule: cce_core::FilterRule), and the filtered G = softmax - onehot gives d_e = G C and
d_c = G^T E, compared in f64 with the exact ones: relative L2 error, the worst row's, entries
kept per row. Inputs: the bf16 E and the exact f32 C of shared/data (f64 arithmetic).

    python3 scripts/filter-error.py [--data ../shared/data/smollm2_lce_real_1k.safetensors]
"""

import argparse
import json
import struct

import numpy as np


def load(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        blob = f.read()
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        raw = blob[a:b]
        dt = meta["dtype"]
        if dt == "BF16":
            x = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            x = np.frombuffer(
                raw,
                {"F16": np.float16, "F32": np.float32, "I8": np.int8, "I32": np.int32}[
                    dt
                ],
            )
        out[name] = x.reshape(meta["shape"])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="../shared/data/smollm2_lce_real_1k.safetensors")
    ap.add_argument("--eps", type=float, default=2.0**-12)
    ap.add_argument("--deltas", default="1e-4,3e-4,1e-3,3e-3,1e-2")
    args = ap.parse_args()
    t = load(args.data)
    e = t["E"].astype(np.float64)
    scale = np.repeat(t["C_scale"].astype(np.float64), 32, axis=1)
    c = t["C_q8"].astype(np.float64) * scale
    y = t["targets"].astype(np.int64)
    n, v = e.shape[0], c.shape[0]
    z = e @ c.T
    z -= z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    g = p.copy()
    g[np.arange(n), y] -= 1.0
    d_e, d_c = g @ c, g.T @ e
    # Per row: probabilities ascending; droppable while below eps (never the target).
    order = np.argsort(p, axis=1)
    ps = np.take_along_axis(p, order, axis=1)
    tgt_sorted = order == y[:, None]
    droppable = (ps < args.eps) & ~tgt_sorted
    mass = np.cumsum(np.where(droppable, ps, 0.0), axis=1)
    print(
        f"{n} rows, V {v}, filter_eps {args.eps:.3e}; bf16 output rounding is 2^-9 = {2**-9:.2e} relative"
    )
    print(
        "| delta | kept/row mean | kept/row p95 | dropped/row max | d_e rel L2 | d_e worst row / largest row | d_c rel L2 | d_c worst row / largest row |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for delta in [float(x) for x in args.deltas.split(",")]:
        drop_sorted = droppable & (mass <= delta)
        drop = np.zeros_like(drop_sorted)
        np.put_along_axis(drop, order, drop_sorted, axis=1)
        gf = np.where(drop, 0.0, g)
        fe, fc = gf @ c, gf.T @ e
        rel = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b)
        # A row's error against the largest row of the exact gradient (a confident row may lose
        # its whole non-target mass, so its own relative error may be 1 at a tiny norm).
        row = lambda a, b: (
            np.linalg.norm(a - b, axis=1) / np.linalg.norm(b, axis=1).max()
        ).max()
        kept = v - drop.sum(axis=1)
        dropped = np.where(drop, p, 0.0).sum(axis=1)
        print(
            f"| {delta:.0e} | {kept.mean():.0f} | {np.percentile(kept, 95):.0f} | {dropped.max():.2e} | "
            f"{rel(fe, d_e):.2e} | {row(fe, d_e):.2e} | {rel(fc, d_c):.2e} | {row(fc, d_c):.2e} |"
        )


if __name__ == "__main__":
    main()
