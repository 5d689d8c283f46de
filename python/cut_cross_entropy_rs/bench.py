"""Side-by-side benchmark: this library against Apple's CCE, Liger, torch.compile and eager torch.

One process, the same inputs for every peer, the cuBLAS floor measured in the same run::

    python -m cut_cross_entropy_rs.bench --shapes "32768,4096,256000" --data randn,c/8,lm \\
        --safetensors shared/data/smollm2_lce_real_E12k.safetensors --iters 3 --warmup 1 --out bench.md

Per (shape, data, peer): forward+backward time (the loss and the gradients of ``e`` and ``c``;
CUDA events, median of ``--iters`` after ``--warmup``; ``time.perf_counter`` on the CPU),
forward-only time (under ``torch.no_grad``, inputs not requiring grad), peak memory above the
inputs and the two gradients (``torch.cuda.max_memory_allocated`` after
``reset_peak_memory_stats``), and the relative Frobenius errors of the loss, ``d_e`` and ``d_c``
against an fp32 truth computed in row chunks.
Times are also given as ratios to the same run's cuBLAS floor: one GEMM of the logits' shape
(f32 output where ``torch.mm(..., out_dtype=torch.float32)`` exists, CUDA) for the forward, and
the three GEMMs of the full problem (logits, ``d_e = G·C``, ``d_c = Gᵀ·E``) for forward+backward.

The synthetic data follow the Rust generator of this repository (``crates/cce-data/src/gen.rs``,
the distributions of the design's CASES.md): the same laws and parameters, drawn with torch's
generators rather than ChaCha8 streams, so the numbers differ from the Rust generator's for the
same seed while the distributions are the same. See :func:`make_synthetic`.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "Case",
    "DevicePool",
    "Peer",
    "Truth",
    "gemm_floor",
    "load_peers",
    "find_real_file",
    "load_safetensors_case",
    "main",
    "make_synthetic",
    "parse_shapes",
    "read_safetensors",
    "run_peer",
    "truth",
    "write_report",
]

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
DEFAULT_PEERS = "ours,ours-exact,liger,cce,compile,torch"
KNOWN_PEERS = ("ours", "ours-exact", "liger", "cce", "cce-exact", "compile", "torch")
GIB = float(1 << 30)

FIXTURE_FILE = "smollm2_lce_real_1k.safetensors"
E12K_FILE = "smollm2_lce_real_E12k.safetensors"

# ---------------------------------------------------------------------------------------------
# Parsing


def parse_shapes(text: str) -> list[tuple[int, int, int, float | None]]:
    """``"N,D,V[,softcap];..."`` into ``[(N, D, V, softcap or None), ...]``."""
    shapes = []
    for part in text.split(";"):
        part = part.strip()
        if not part:
            continue
        fields = [x.strip() for x in part.split(",")]
        if len(fields) not in (3, 4):
            raise ValueError(f"shape {part!r}: expected N,D,V or N,D,V,softcap")
        n, d, v = (int(x) for x in fields[:3])
        if min(n, d, v) < 1:
            raise ValueError(f"shape {part!r}: N, D and V must be >= 1")
        softcap = float(fields[3]) if len(fields) == 4 and fields[3] not in ("", "none") else None
        shapes.append((n, d, v, softcap))
    if not shapes:
        raise ValueError("no shape given")
    return shapes


def parse_bytes(text: str | None) -> int | None:
    """``"512MiB"``, ``"0.5GiB"``, ``"1e9"`` (bytes) or None into a byte count."""
    if text is None or text.strip().lower() in ("", "none", "default"):
        return None
    t = text.strip()
    for suffix, mult in (("gib", 1 << 30), ("mib", 1 << 20), ("kib", 1 << 10), ("g", 1 << 30), ("m", 1 << 20)):
        if t.lower().endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(float(t))


def parse_scaled(name: str) -> tuple[float, float] | None:
    """``randn`` → (1, 1); ``c/8`` → (1, 1/8); ``e*8`` → (8, 1); other names → None.

    Combined factors (the Rust generator's ``e*2,c/4``) are written with ``+`` here
    (``e*2+c/4``), since ``--data`` is itself a comma list."""
    t = name.strip().lower()
    if t == "randn":
        return 1.0, 1.0
    e_scale, c_scale = 1.0, 1.0
    for part in t.split("+"):
        part = part.strip()
        if len(part) < 3 or part[0] not in "ec" or part[1] not in "*/":
            return None
        try:
            x = float(part[2:])
        except ValueError:
            return None
        if not (math.isfinite(x) and x > 0):
            return None
        factor = x if part[1] == "*" else 1.0 / x
        if part[0] == "e":
            e_scale = factor
        else:
            c_scale = factor
    return e_scale, c_scale


# ---------------------------------------------------------------------------------------------
# Data


@dataclass
class Case:
    """One problem: inputs in the benchmark's dtype on the benchmark's device."""

    shape: tuple[int, int, int, float | None]
    data: str
    e: Tensor
    c: Tensor
    targets: Tensor
    note: str = ""

    @property
    def label(self) -> str:
        """``N x D x V[, softcap s]``."""
        n, d, v, softcap = self.shape
        return f"{n}x{d}x{v}" + ("" if softcap is None else f", softcap {softcap:g}")


# Parameters of the lm generator, as LmParams::SMALL_VOCAB / LARGE_VOCAB of gen.rs.
LM_SMALL = dict(
    clusters=15,
    slope_mu=0.52,
    slope_sigma=0.22,
    peak_mu=2.0,
    peak_sigma=0.55,
    bulk_std=3.0,
    unigram_std=2.0,
    topic_keep=0.5,
    zipf_exponent=1.0,
    row_corr=0.98,
    peak_prior=0.3,
    magnitude=2.0,
)
LM_LARGE = dict(LM_SMALL, clusters=30, slope_mu=0.65, peak_mu=2.3, unigram_std=3.5, row_corr=0.99, peak_prior=0.0)


def _gen(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _chunk_rows(width: int, bytes_per_elem: int, budget: int) -> int:
    return max(1, budget // max(1, width * bytes_per_elem))


def _randn_rows(rows: int, cols: int, scale: float, dtype, device, g, chunk_bytes: int = 1 << 30) -> Tensor:
    """``scale · N(0, 1)`` of shape ``(rows, cols)`` in ``dtype``, drawn in f32 by row chunks (no
    full f32 copy)."""
    out = torch.empty(rows, cols, dtype=dtype, device=device)
    step = _chunk_rows(cols, 4, chunk_bytes)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        out[r0:r1] = (torch.randn(r1 - r0, cols, generator=g, device=device) * scale).to(dtype)
    return out


def sample_targets(e32: Tensor, c32: Tensor, g: torch.Generator, chunk_bytes: int = 2 << 30) -> Tensor:
    """``targets[i] ~ softmax(e_i · cᵀ)`` by Gumbel-max over f32 logits, row chunk by row chunk
    (the Rust generator draws the same law by an inverse-CDF scan in f64)."""
    n, v = e32.shape[0], c32.shape[0]
    out = torch.empty(n, dtype=torch.int64, device=e32.device)
    step = _chunk_rows(v, 8, chunk_bytes)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        x = e32[r0:r1] @ c32.T
        gumbel = torch.rand(x.shape, generator=g, device=x.device).clamp_(min=1e-30).log_().neg_().log_().neg_()
        out[r0:r1] = x.add_(gumbel).argmax(dim=1)
        del x, gumbel
    return out


def ar1_rows(z: Tensor, r: float, block: int = 256) -> Tensor:
    """The AR(1) along the rows of gen.rs: ``x_0 = z_0``, ``x_i = r·x_{i-1} + sqrt(1 - r²)·z_i``,
    as a blocked scan (a lower-triangular matrix of powers of ``r`` per block of rows)."""
    n = z.shape[0]
    q = math.sqrt(1.0 - r * r)
    j = torch.arange(block, dtype=torch.float64)
    diff = j[:, None] - j[None, :]
    lower = torch.where(diff >= 0, r ** diff.clamp(min=0), torch.zeros((), dtype=torch.float64))
    lower = lower.to(device=z.device, dtype=torch.float32)
    carry_w = (r ** (j + 1)).to(device=z.device, dtype=torch.float32)
    out = torch.empty_like(z)
    prev = None
    for b0 in range(0, n, block):
        m = min(block, n - b0)
        w = z[b0 : b0 + m] * q
        if b0 == 0:
            w[0] = z[0]
        xb = lower[:m, :m] @ w
        if prev is not None:
            xb += carry_w[:m, None] * prev[None, :]
        out[b0 : b0 + m] = xb
        prev = xb[-1].clone()
    return out


def _lm_inputs(n: int, d: int, v: int, p: dict, device, g) -> tuple[Tensor, Tensor]:
    """``e`` and ``c`` in f32 of the ``lm`` construction (``fill_lm`` of gen.rs): coordinate 0 the
    unigram prior, ``1..=K`` the topics, the rest the bulk with the peak class's direction."""
    k = min(p["clusters"], (d - 1) // 2)
    b0 = 1 + k
    db = d - b0
    f = float(p["magnitude"])
    f64 = dict(dtype=torch.float64, device=device)

    # Classes: a Zipf prior over random ranks, centred, jittered to unigram_std; clusters.
    rank = (torch.randperm(v, generator=g, device=device) + 1).to(torch.float64)
    raw = -p["zipf_exponent"] * rank.log()
    raw = raw - raw.mean()
    var = float((raw * raw).mean())
    target = p["unigram_std"] ** 2
    shrink, jitter = (math.sqrt(target / var), 0.0) if var > target else (1.0, math.sqrt(target - var))
    bias = raw * shrink + jitter * torch.randn(v, generator=g, **f64)
    member = torch.randint(0, max(k, 1), (v,), generator=g, device=device)
    weight = torch.empty(v, **f64).exponential_(generator=g)

    # Rows: a sticky topic, a slope, a peak class drawn from softmax(peak_prior * bias), a lift.
    if k > 0:
        new = torch.rand(n, generator=g, device=device) >= p["topic_keep"]
        new[0] = True
        draws = torch.randint(0, k, (n,), generator=g, device=device)
        start = torch.where(new, torch.arange(n, device=device), torch.zeros_like(draws))
        topic = draws[start.cummax(dim=0).values]
    slope = (p["slope_mu"] + p["slope_sigma"] * torch.randn(n, generator=g, **f64)).exp()
    prior = (p["peak_prior"] * (bias - bias.max())).exp().float()
    peak = torch.multinomial(prior, n, replacement=True, generator=g)
    lift = (p["peak_mu"] + p["peak_sigma"] * torch.randn(n, generator=g, **f64)).exp()

    c32 = torch.zeros(v, d, dtype=torch.float32, device=device)
    c32[:, 0] = (bias / f).float()
    if k > 0:
        c32[torch.arange(v, device=device), 1 + member] = (weight / f).float()
    if db > 0:
        step = _chunk_rows(db, 4, 1 << 30)
        for r0 in range(0, v, step):
            r1 = min(v, r0 + step)
            u = torch.randn(r1 - r0, db, generator=g, device=device)
            c32[r0:r1, b0:] = u / u.norm(dim=1, keepdim=True).clamp(min=1e-30) / f
            del u

    e32 = torch.zeros(n, d, dtype=torch.float32, device=device)
    e32[:, 0] = f
    if k > 0:
        e32[torch.arange(n, device=device), 1 + topic] = (slope * f).float()
    if db > 0:
        z = torch.randn(n, db, generator=g, device=device)
        if p["row_corr"] > 0:
            z = ar1_rows(z, p["row_corr"])
        var_row = (p["bulk_std"] ** 2 - lift * lift / db).clamp(min=0)
        s = (var_row.sqrt() * math.sqrt(db)).float() / z.norm(dim=1).clamp(min=1e-30)
        e32[:, b0:] = (z * s[:, None] + lift.float()[:, None] * c32[peak, b0:] * f) * f
    return e32, c32


def _iid_inputs(n: int, d: int, v: int, entropy: float, device, g) -> tuple[Tensor, Tensor]:
    """``iid`` of gen.rs: ``c ~ N(0, 1/D)``, rows of ``e`` of norm ``a·sqrt(D)`` with ``a`` such
    that the mean softmax entropy of a sample of rows is ``entropy`` nats (found here by
    bisection on ``log a``; gen.rs uses safeguarded Newton steps: the same ``a`` to ~1e-4 nats)."""
    if not 0 < entropy < math.log(v):
        raise ValueError(f"iid entropy {entropy} nats must lie in (0, ln V = {math.log(v):.3f})")
    e32 = torch.randn(n, d, generator=g, device=device)
    c32 = torch.randn(v, d, generator=g, device=device) / math.sqrt(d)
    e32 *= math.sqrt(d) / e32.norm(dim=1, keepdim=True).clamp(min=1e-30)
    s = min(n, max((256 << 20) // (4 * v), 16))
    x = e32[(torch.arange(s, device=device) * n) // s] @ c32.T

    def mean_entropy(a: float) -> float:
        z = x * a
        lse = z.logsumexp(dim=1)
        return float((lse - (z.softmax(dim=1) * z).sum(dim=1)).mean())

    lo, hi = -30.0, 30.0
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        if mean_entropy(math.exp(mid)) > entropy:
            lo = mid
        else:
            hi = mid
    e32 *= math.exp(0.5 * (lo + hi))
    return e32, c32


def make_synthetic(data: str, n: int, d: int, v: int, softcap: float | None, dtype, device, seed: int = 0) -> Case:
    """One synthetic case of CASES.md, drawn as ``crates/cce-data/src/gen.rs`` draws it.

    - ``randn``: ``e``, ``c`` ~ N(0, 1), targets uniform (the seed's inputs);
    - ``c/8``, ``e/8``, ``c*8``, ``e*8`` (any factor; both as ``e*2+c/4``): randn scaled, targets
      uniform;
    - ``iid`` / ``iid:H``: iid Gaussian logits at a mean entropy of 2.5 / ``H`` nats, targets
      sampled from the softmax;
    - ``lm`` (the preset for ``V``: ``lm:small`` below 100000, ``lm:large`` from there on): the
      generator calibrated to real LM logits, targets sampled from the softmax.

    Differences from gen.rs: torch's random streams instead of per-row ChaCha8 streams (same
    laws, other numbers); targets by Gumbel-max over f32 logits instead of an inverse-CDF scan
    in f64; the iid scale by bisection. Values are drawn in f32 and rounded once to ``dtype``
    (gen.rs returns f32; the Rust benches round the same way)."""
    g = _gen(device, seed)
    name = data.strip().lower()
    scaled = parse_scaled(name)
    if scaled is not None:
        e = _randn_rows(n, d, scaled[0], dtype, device, g)
        c = _randn_rows(v, d, scaled[1], dtype, device, g)
        targets = torch.randint(0, v, (n,), generator=g, device=device)
        return Case((n, d, v, softcap), data, e, c, targets)
    if name.startswith("iid"):
        entropy = float(name.split(":", 1)[1]) if ":" in name else 2.5
        e32, c32 = _iid_inputs(n, d, v, entropy, device, g)
    elif name in ("lm", "lm:small", "lm:large"):
        preset = {"lm:small": LM_SMALL, "lm:large": LM_LARGE}.get(name, LM_SMALL if v < 100_000 else LM_LARGE)
        e32, c32 = _lm_inputs(n, d, v, preset, device, g)
    else:
        raise ValueError(f"unknown data {data!r} (randn, c/8, e/8, c*8, e*8, iid, iid:H, lm, lm:small, lm:large, real)")
    targets = sample_targets(e32, c32, g)
    e, c = e32.to(dtype), c32.to(dtype)
    del e32, c32
    return Case((n, d, v, softcap), data, e, c, targets)


_ST_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
}


def read_safetensors(path: str | os.PathLike) -> dict[str, Tensor]:
    """All tensors of a safetensors file, on the CPU (a small reader of the format: an 8-byte
    little-endian header length, a JSON header, the raw data; no dependency)."""
    raw = bytearray(Path(path).read_bytes())
    hlen = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + hlen].decode("utf-8"))
    base = 8 + hlen
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = _ST_DTYPES.get(meta["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name}: unsupported dtype {meta['dtype']}")
        start, end = meta["data_offsets"]
        shape = list(meta["shape"])
        if end == start:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(raw, dtype=torch.uint8, count=end - start, offset=base + start)
        out[name] = flat.view(dtype).reshape(shape).clone()
    return out


def _find_file(name: str, extra: list[Path]) -> Path | None:
    roots = [Path.cwd() / "data", Path.cwd() / "shared" / "data", Path.cwd().parent / "shared" / "data"]
    roots += [Path(__file__).resolve().parents[2] / "data", Path("/work/shared/data")]
    for p in extra + [r / name for r in roots]:
        if p.is_file():
            return p
    return None


def _head_of(tensors: dict[str, Tensor], c_key: str) -> Tensor | None:
    if c_key in tensors:
        return tensors[c_key].float()
    if "C_q8" in tensors and "C_scale" in tensors:
        # GGUF Q8_0 as the SmolLM2 fixture ships it: C[v, d] = f32(scale[v, d / 32]) * f32(q8[v, d]).
        q, s = tensors["C_q8"], tensors["C_scale"]
        return s.float().repeat_interleave(32, dim=1)[:, : q.shape[1]] * q.float()
    return None


def load_safetensors_case(
    path: str | os.PathLike,
    dtype,
    device,
    keys: str = "E,C,targets",
    head: str | os.PathLike | None = None,
    softcap: float | None = None,
) -> Case:
    """A case from a safetensors file with ``e`` ``[N, D]``, ``c`` ``[V, D]`` and ``targets``
    ``[N]`` under ``keys`` (``"E,C,targets"`` by default).

    The SmolLM2 fixtures of ``shared/data`` load as they are: ``C`` may be stored as ``C_q8``
    and ``C_scale`` (Q8_0, decoded exactly to f32), and a file without ``C``
    (``smollm2_lce_real_E12k.safetensors``) takes it from ``head`` or else from
    ``smollm2_lce_real_1k.safetensors`` beside it, in ``$CCE_DATA_DIR``, ``./data``,
    ``./shared/data``, ``../shared/data`` or ``/work/shared/data``. ``C`` is rounded to
    ``dtype`` like ``e`` (the truth is computed from the rounded copy)."""
    e_key, c_key, t_key = (k.strip() for k in keys.split(","))
    path = Path(path)
    tensors = read_safetensors(path)
    for key in (e_key, t_key):
        if key not in tensors:
            raise KeyError(f"{path}: no tensor {key!r} (has {sorted(tensors)})")
    c32 = _head_of(tensors, c_key)
    head_note = ""
    if c32 is None:
        extra = [Path(head)] if head is not None else []
        extra.append(path.parent / FIXTURE_FILE)
        if os.environ.get("CCE_DATA_DIR"):
            extra.append(Path(os.environ["CCE_DATA_DIR"]) / FIXTURE_FILE)
        found = _find_file(FIXTURE_FILE, extra) if head is None else Path(head)
        if found is None or not found.is_file():
            raise FileNotFoundError(f"{path}: no {c_key!r} in the file and no head file ({FIXTURE_FILE}); pass --head")
        c32 = _head_of(read_safetensors(found), c_key)
        if c32 is None:
            raise KeyError(f"{found}: no {c_key!r} (nor C_q8/C_scale)")
        head_note = f", head from {found.name}"
    e = tensors[e_key].to(device=device, dtype=dtype)
    c = c32.to(device=device, dtype=dtype)
    targets = tensors[t_key].to(device=device, dtype=torch.int64).reshape(-1)
    if e.dim() != 2 or c.dim() != 2 or e.shape[1] != c.shape[1] or targets.shape[0] != e.shape[0]:
        raise ValueError(f"{path}: shapes e {tuple(e.shape)}, c {tuple(c.shape)}, targets {tuple(targets.shape)}")
    n, d = e.shape
    v = c.shape[0]
    return Case((n, d, v, softcap), f"real ({path.name})", e, c, targets, note=f"{path.name}{head_note}")


def find_real_file() -> Path | None:
    """The 12k-row real file (``$CCE_E12K``, ``./shared/data``, ``../shared/data``,
    ``/work/shared/data``, ``./data``), else the 1k fixture; None when neither is found."""
    extra = [Path(os.environ["CCE_E12K"])] if os.environ.get("CCE_E12K") else []
    return _find_file(E12K_FILE, extra) or _find_file(FIXTURE_FILE, [])


# ---------------------------------------------------------------------------------------------
# Truth


@dataclass
class Truth:
    """The fp32 truth of a case (mean reduction): loss, ``d_e``, ``d_c`` (f32) and the mean
    softmax entropy of the rows (nats)."""

    loss: float
    d_e: Tensor
    d_c: Tensor
    entropy: float


def truth(case: Case, ignore_index: int = -100, chunk_bytes: int = 4 << 30) -> Truth:
    """Loss and gradients in f32 from the case's inputs (exact in f32), row chunk by row chunk:
    the chunk's f32 logits (TF32 off), softmax, ``G = (softmax - onehot) / n_valid`` (times the
    softcap's derivative), ``d_e`` rows ``= G·C`` and ``d_c += Gᵀ·E``. Holds ``c`` and ``d_c`` in
    f32 plus about ``chunk_bytes`` of logits."""
    e, c, t = case.e, case.c, case.targets
    softcap = case.shape[3]
    n, d = e.shape
    v = c.shape[0]
    c32 = c.float()
    d_e = torch.empty(n, d, dtype=torch.float32, device=e.device)
    d_c = torch.zeros(v, d, dtype=torch.float32, device=e.device)
    valid = t != ignore_index
    n_valid = max(1, int(valid.sum()))
    step = _chunk_rows(v, 4 * 3, chunk_bytes)
    loss_sum = torch.zeros((), dtype=torch.float64, device=e.device)
    ent_sum = torch.zeros((), dtype=torch.float64, device=e.device)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            e32 = e[r0:r1].float()
            z = e32 @ c32.T
            th = None
            if softcap is not None:
                th = z.div_(softcap).tanh_()
                z = th * softcap
            lse = z.logsumexp(dim=1)
            p = (z - lse[:, None]).exp_()
            ent_sum += (lse - (p * z).sum(dim=1)).double().sum()
            vm = valid[r0:r1]
            tt = t[r0:r1].clamp(min=0)[:, None]
            loss_sum += ((lse - z.gather(1, tt)[:, 0]) * vm).double().sum()
            del z
            p.scatter_add_(1, tt, -torch.ones_like(tt, dtype=p.dtype))
            p *= (vm.to(p.dtype) / n_valid)[:, None]
            if th is not None:
                p *= 1 - th * th
                del th
            d_e[r0:r1] = p @ c32
            d_c.addmm_(p.T, e32)
            del p, e32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    del c32
    return Truth(float(loss_sum) / n_valid, d_e, d_c, float(ent_sum) / n)


def rel_err(x: Tensor, ref: Tensor, chunk_rows: int = 16384) -> float:
    """``‖x - ref‖_F / ‖ref‖_F`` in f32/f64, by row chunks (no full f32 copy of ``x``)."""
    num = 0.0
    den = 0.0
    for r0 in range(0, ref.shape[0], chunk_rows):
        a = x[r0 : r0 + chunk_rows].float()
        b = ref[r0 : r0 + chunk_rows]
        num += float((a - b).double().pow(2).sum())
        den += float(b.double().pow(2).sum())
    return math.sqrt(num) / math.sqrt(den) if den > 0 else math.sqrt(num)


# ---------------------------------------------------------------------------------------------
# Timing and floors


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> float:
    """Median time of ``fn()`` in ms over ``iters`` runs after ``warmup`` runs: CUDA events
    around each run on CUDA, ``time.perf_counter`` around each run elsewhere."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    if device.type == "cuda":
        for _ in range(max(1, iters)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(max(1, iters)):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _mm_f32_out(a: Tensor, b: Tensor) -> tuple[Tensor, bool]:
    """``a @ b`` with f32 output where torch has ``mm(..., out_dtype=float32)`` for these
    tensors (CUDA, 16-bit inputs), else in the inputs' dtype; and whether f32 was used."""
    if a.dtype in (torch.bfloat16, torch.float16):
        try:
            return torch.mm(a, b, out_dtype=torch.float32), True
        except (RuntimeError, TypeError, NotImplementedError):
            pass
    return torch.mm(a, b), False


@dataclass
class Floor:
    """The same run's cuBLAS floor: ms of the logits GEMM and of the d_e and d_c GEMMs."""

    logits_ms: float
    de_ms: float
    dc_ms: float
    f32_out: bool

    @property
    def one(self) -> float:
        """Floor of a forward: one logits GEMM."""
        return self.logits_ms

    @property
    def three(self) -> float:
        """Floor of a forward+backward: logits + d_e + d_c GEMMs."""
        return self.logits_ms + self.de_ms + self.dc_ms

    def describe(self) -> str:
        """One line for the report."""
        out = "f32-out" if self.f32_out else "16-bit-out"
        return (
            f"logits GEMM ({out}) {self.logits_ms:.2f} ms, d_e GEMM {self.de_ms:.2f} ms, "
            f"d_c GEMM ({out}) {self.dc_ms:.2f} ms; 3-GEMM floor {self.three:.2f} ms"
        )


def gemm_floor(e: Tensor, c: Tensor, warmup: int, iters: int) -> Floor:
    """Times ``torch.mm`` on the problem's GEMMs: logits ``E·Cᵀ`` (N x V, f32 output where
    available), ``d_e = G·C`` (N x D, input dtype) and ``d_c = Gᵀ·E`` (V x D, f32 output where
    available), with a random ``G`` (N x V, input dtype). Holds ``G`` and one f32 logits matrix."""
    device = e.device
    n, v = e.shape[0], c.shape[0]
    g = torch.randn(n, v, dtype=e.dtype, device=device).mul_(1e-3)
    f32 = _mm_f32_out(e, c.T)[1]
    logits_ms = time_ms(lambda: _mm_f32_out(e, c.T), device, warmup, iters)
    de_ms = time_ms(lambda: torch.mm(g, c), device, warmup, iters)
    dc_ms = time_ms(lambda: _mm_f32_out(g.T, e), device, warmup, iters)
    return Floor(logits_ms, de_ms, dc_ms, f32)


# ---------------------------------------------------------------------------------------------
# Peers


@dataclass
class Peer:
    """A loss to benchmark: ``call(e, c, targets, softcap, stats)`` returns ``(loss, stats or
    None)``, the mean cross-entropy of ``e·cᵀ`` against ``targets``."""

    name: str
    call: Callable[..., tuple[Tensor, Any]]
    version: str = ""


def _dense_loss(e: Tensor, c: Tensor, t: Tensor, softcap: float | None) -> Tensor:
    logits = F.linear(e, c).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits, t)


def _make_peer(name: str, budget: int | None) -> Peer:
    """The peer ``name``; raises (ImportError, ...) when it cannot be made here."""
    if name in ("ours", "ours-exact"):
        import cut_cross_entropy_rs
        from cut_cross_entropy_rs import linear_cross_entropy as ours

        eps = None if name == "ours-exact" else "auto"

        def call_ours(e, c, t, softcap, stats):
            out = ours(e, c, t, softcap=softcap, filter_eps=eps, workspace_budget_bytes=budget, return_stats=stats)
            return out if stats else (out, None)

        return Peer(name, call_ours, cut_cross_entropy_rs.__version__)
    if name == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        modules: dict[float | None, Any] = {}

        def call_liger(e, c, t, softcap, stats):
            if softcap not in modules:
                modules[softcap] = LigerFusedLinearCrossEntropyLoss(softcap=softcap)
            return modules[softcap](c, e, t), None

        return Peer(name, call_liger, _version("liger-kernel"))
    if name in ("cce", "cce-exact"):
        from cut_cross_entropy import linear_cross_entropy as cce

        kw = {"filter_eps": None} if name == "cce-exact" else {}

        def call_cce(e, c, t, softcap, stats):
            return cce(e, c, t, softcap=softcap, **kw), None

        return Peer(name, call_cce, _version("cut-cross-entropy"))
    if name == "compile":
        compiled = torch.compile(_dense_loss, dynamic=False)
        return Peer(name, lambda e, c, t, softcap, stats: (compiled(e, c, t, softcap), None), torch.__version__)
    if name == "torch":
        return Peer(name, lambda e, c, t, softcap, stats: (_dense_loss(e, c, t, softcap), None), torch.__version__)
    raise ValueError(f"unknown peer {name!r} (known: {', '.join(KNOWN_PEERS)})")


def _version(dist: str) -> str:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:  # noqa: BLE001 - a version is only informative
        return "?"


def load_peers(names: list[str], budget: int | None) -> tuple[list[Peer], list[str]]:
    """The peers that import, and one line per peer that does not
    (``"peer X: not importable (reason)"``)."""
    peers, missing = [], []
    for name in names:
        try:
            peers.append(_make_peer(name, budget))
        except ValueError:
            raise
        except Exception as err:  # noqa: BLE001 - any import failure is reported, not fatal
            missing.append(f"peer {name}: not importable ({type(err).__name__}: {err})")
    return peers, missing


# ---------------------------------------------------------------------------------------------
# One (case, peer)


def _is_oom(err: BaseException) -> bool:
    """torch's OOM, this library's ``CceError`` of kind ``OutOfMemory``, or a message saying so."""
    if isinstance(err, torch.OutOfMemoryError) or getattr(err, "kind", None) == "OutOfMemory":
        return True
    return "out of memory" in str(err).lower()


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class DevicePool:
    """High-water mark of the CUDA driver's current memory pool of a device (``cuMemAllocAsync``
    allocations), read through ``libcuda`` with ctypes.

    This library's CUDA backend allocates its workspace and its own output buffers there
    (cudarc's stream-ordered allocations), outside torch's caching allocator, so
    ``torch.cuda.max_memory_allocated`` does not see them. Used only while torch's allocator is
    its native one (torch's ``cudaMallocAsync`` backend would put its own blocks in the pool
    too). ``ok`` is False where the driver or the pool cannot be read."""

    USED_MEM_CURRENT = 7  # CU_MEMPOOL_ATTR_USED_MEM_CURRENT
    USED_MEM_HIGH = 8  # CU_MEMPOOL_ATTR_USED_MEM_HIGH

    def __init__(self, device: torch.device):
        self.ok = False
        try:
            if device.type != "cuda" or torch.cuda.get_allocator_backend() != "native":
                return
            torch.cuda.init()
            lib = ctypes.CDLL("libcuda.so.1")
            dev = ctypes.c_int()
            index = device.index if device.index is not None else torch.cuda.current_device()
            if lib.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(index)) != 0:
                return
            pool = ctypes.c_void_p()
            if lib.cuDeviceGetMemPool(ctypes.byref(pool), dev) != 0:
                return
            self.lib, self.pool = lib, pool
            self.ok = self._get(self.USED_MEM_CURRENT) is not None
        except Exception:  # noqa: BLE001 - no pool reading is a degraded column, not an error
            self.ok = False

    def _get(self, attr: int) -> int | None:
        value = ctypes.c_uint64()
        rc = self.lib.cuMemPoolGetAttribute(self.pool, ctypes.c_int(attr), ctypes.byref(value))
        return int(value.value) if rc == 0 else None

    def reset(self) -> int | None:
        """Resets the high-water mark to the bytes in use now, and returns them."""
        zero = ctypes.c_uint64(0)
        if self.lib.cuMemPoolSetAttribute(self.pool, ctypes.c_int(self.USED_MEM_HIGH), ctypes.byref(zero)) != 0:
            return None
        return self._get(self.USED_MEM_CURRENT)

    def high(self) -> int | None:
        """The most bytes in use since the last :meth:`reset`."""
        return self._get(self.USED_MEM_HIGH)


_POOLS: dict[str, DevicePool] = {}


def _pool(device: torch.device) -> DevicePool | None:
    if device.type != "cuda":
        return None
    key = str(device)
    if key not in _POOLS:
        _POOLS[key] = DevicePool(device)
    return _POOLS[key] if _POOLS[key].ok else None


def _stats_note(stats: Any, n: int) -> str:
    """Strategy, kept entries per row and dropped mass of ours' ``return_stats``."""
    if not stats:
        return ""
    fwd = stats.get("forward", {})
    bwd = stats.get("backward", {})
    src = bwd or fwd
    strategy = str(src.get("strategy", "?"))
    reason = str(src.get("plan_reason", "")).split(":", 1)[0].strip()
    parts = [strategy + (f" ({reason})" if reason and not strategy.startswith(reason) else "")]
    if bwd and (bwd.get("entries_kept", 0) or bwd.get("entries_skipped", 0)):
        kept = bwd.get("entries_kept", 0) / max(1, bwd.get("n_valid", n) or n)
        parts.append(f"kept {kept:.4g}/row")
        parts.append(f"dropped max {bwd.get('dropped_mass_max', 0.0):.2g}")
    return "; ".join(parts)


def run_peer(peer: Peer, case: Case, ref: Truth | None, warmup: int, iters: int) -> dict:
    """Benchmarks one peer on one case; returns a row dict (``status`` "ok", "OOM" or
    "error: ..."). Order: warm-up, one measured call (peak memory, gradients, stats), then the
    timed forward+backward and forward-only runs."""
    device = case.e.device
    softcap = case.shape[3]
    e = case.e.detach().requires_grad_(True)
    c = case.c.detach().requires_grad_(True)
    t = case.targets
    row: dict[str, Any] = {"peer": peer.name, "status": "ok"}

    def fwd_bwd():
        loss, _ = peer.call(e, c, t, softcap, False)
        torch.autograd.grad(loss, (e, c))

    def fwd():
        # Inputs that do not require grad (Liger and Apple's CCE decide on requires_grad, not
        # on the grad mode, whether their forward prepares the backward).
        with torch.no_grad():
            peer.call(case.e, case.c, t, softcap, False)

    failure = None
    try:
        for _ in range(warmup):
            fwd_bwd()
        _sync(device)
        pool = _pool(device)
        pool_base = pool.reset() if pool is not None else None
        if device.type == "cuda":
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        loss, stats = peer.call(e, c, t, softcap, True)
        d_e, d_c = torch.autograd.grad(loss, (e, c))
        _sync(device)
        if device.type == "cuda":
            grads = d_e.numel() * d_e.element_size() + d_c.numel() * d_c.element_size()
            row["extra_gib"] = (torch.cuda.max_memory_allocated(device) - base - grads) / GIB
            pool_high = pool.high() if pool is not None else None
            if pool_base is not None and pool_high is not None:
                # Upper bound of the peak of the sum: the two peaks may not coincide.
                row["outside_gib"] = max(0, pool_high - pool_base) / GIB
                row["extra_gib"] += row["outside_gib"]
        row["loss"] = float(loss.detach())
        if ref is not None:
            row["loss_err"] = abs(row["loss"] - ref.loss) / max(abs(ref.loss), 1e-30)
            row["de_err"] = rel_err(d_e, ref.d_e)
            row["dc_err"] = rel_err(d_c, ref.d_c)
        notes = [_stats_note(stats, case.shape[0])]
        if row.get("outside_gib", 0.0) >= 1e-3:
            notes.append(f"{row['outside_gib']:.3f} GiB of extra outside torch's allocator")
        row["notes"] = "; ".join(x for x in notes if x)
        del loss, d_e, d_c, stats
        row["fb_ms"] = time_ms(fwd_bwd, device, 0, iters)
    except Exception as err:  # noqa: BLE001 - a failing peer is a row, not the end of the run
        failure = _failure(err)
    if failure is not None:
        row["status"] = failure
        _free(device)
        return row
    try:
        row["f_ms"] = time_ms(fwd, device, warmup, iters)
    except Exception as err:  # noqa: BLE001 - the forward+backward figures stand
        failure = _failure(err)
    if failure is not None:
        row["f_status"] = failure
        _free(device)
    return row


def _failure(err: BaseException) -> str:
    """``"OOM"`` or ``"error: Type: first line of the message"``."""
    if _is_oom(err):
        return "OOM"
    first = (str(err).splitlines() or [""])[0][:160]
    return f"error: {type(err).__name__}: {first}"


# ---------------------------------------------------------------------------------------------
# Report


def _fmt(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


TABLE_HEADER = (
    "| shape | data | peer | fwd+bwd ms | / 3-GEMM floor | fwd ms | / 1-GEMM floor | extra GiB "
    "| loss rel. err | d_e rel. err | d_c rel. err | notes |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def format_row(case_label: str, data_label: str, row: dict, floor: Floor | None) -> str:
    """One markdown table row."""
    if row["status"] != "ok":
        return f"| {case_label} | {data_label} | {row['peer']} | {row['status']} | | | | | | | | |"
    fb, f = row.get("fb_ms"), row.get("f_ms")
    r3 = None if floor is None or fb is None else fb / floor.three
    r1 = None if floor is None or f is None else f / floor.one
    cells = [
        case_label,
        data_label,
        row["peer"],
        _fmt(fb, ".2f"),
        _fmt(r3, ".3f") + ("x" if r3 is not None else ""),
        row.get("f_status") or _fmt(f, ".2f"),
        _fmt(r1, ".3f") + ("x" if r1 is not None else ""),
        _fmt(row.get("extra_gib"), ".3f"),
        _fmt(row.get("loss_err"), ".1e"),
        _fmt(row.get("de_err"), ".1e"),
        _fmt(row.get("dc_err"), ".1e"),
        row.get("notes", ""),
    ]
    return "| " + " | ".join(cells) + " |"


def _environment(device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    try:
        import triton

        tri = f", triton {triton.__version__}"
    except Exception:  # noqa: BLE001
        tri = ""
    return f"{name}, torch {torch.__version__}{tri}, Python {sys.version.split()[0]}"


# ---------------------------------------------------------------------------------------------
# Main


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(
        prog="python -m cut_cross_entropy_rs.bench",
        description="Side-by-side benchmark of fused linear cross-entropy implementations (same inputs, one process).",
    )
    p.add_argument(
        "--shapes", default="32768,4096,256000;8192,2304,256000", help="N,D,V[,softcap];... (default %(default)s)"
    )
    p.add_argument(
        "--data",
        default="randn,c/8,lm",
        help="comma list: randn, c/8, e/8, c*8, e*8, e*2+c/4, iid, iid:H, lm, lm:small, lm:large, real "
        "(real: the SmolLM2 12k-row file, found as --safetensors explains, at its own shape) (default %(default)s)",
    )
    p.add_argument(
        "--safetensors",
        action="append",
        default=[],
        metavar="PATH",
        help="a file with e, c, targets (see --keys; may repeat); benchmarked at its own shape",
    )
    p.add_argument(
        "--keys", default="E,C,targets", help="names of e, c, targets in --safetensors (default %(default)s)"
    )
    p.add_argument("--head", default=None, help="file holding C when --safetensors has none (default: the 1k fixture)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="input dtype (default %(default)s)")
    p.add_argument(
        "--peers", default=DEFAULT_PEERS, help=f"comma list of {', '.join(KNOWN_PEERS)} (default %(default)s)"
    )
    p.add_argument(
        "--iters", type=int, default=5, help="timed runs per measurement, median reported (default %(default)s)"
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed runs first (default %(default)s)")
    p.add_argument(
        "--budget", default=None, help="ours' workspace_budget_bytes, e.g. 512MiB, 8GiB (default: library's)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic data (default %(default)s)")
    p.add_argument("--truth-chunk-gib", type=float, default=4.0, help="logits memory of the truth's chunks")
    p.add_argument("--no-truth", action="store_true", help="skip the fp32 truth (no error columns)")
    p.add_argument("--no-floor", action="store_true", help="skip the cuBLAS floor")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--out", default=None, help="write the markdown report (command, environment, floors, table) here")
    return p


def _cases(args, dtype, device):
    """Yields cases one at a time (each freed before the next is drawn)."""
    datas = [x.strip() for x in args.data.split(",") if x.strip()]
    synthetic = [x for x in datas if x.lower() != "real"]
    for shape in parse_shapes(args.shapes) if synthetic else []:
        n, d, v, softcap = shape
        for data in synthetic:
            yield lambda data=data, n=n, d=d, v=v, softcap=softcap: make_synthetic(
                data, n, d, v, softcap, dtype, device, args.seed
            )
    files = list(args.safetensors)
    if "real" in [x.lower() for x in datas]:
        found = find_real_file()
        if found is None:
            print(f"data real: neither {E12K_FILE} nor {FIXTURE_FILE} found (pass --safetensors)", flush=True)
        elif str(found) not in files:
            files.append(str(found))
    for path in files:
        yield lambda path=path: load_safetensors_case(path, dtype, device, args.keys, args.head)


def main(argv: list[str] | None = None) -> list[dict]:
    """Runs the benchmark; prints the report as it goes, writes ``--out``; returns the rows."""
    parser = build_parser()
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype]
    torch.backends.cuda.matmul.allow_tf32 = False
    names = [x.strip() for x in args.peers.split(",") if x.strip()]
    unknown = [x for x in names if x not in KNOWN_PEERS]
    if unknown:
        parser.error(f"unknown peer(s) {', '.join(unknown)} (known: {', '.join(KNOWN_PEERS)})")
    peers, missing = load_peers(names, parse_bytes(args.budget))
    command = "python -m cut_cross_entropy_rs.bench " + shlex.join(sys.argv[1:] if argv is None else argv)
    lines = [
        f"Command: `{command}`",
        "",
        f"Environment: {_environment(device)}; dtype {args.dtype}; median of {args.iters} after {args.warmup} warm-up.",
        "Peers: " + ", ".join(f"{p.name} {p.version}".strip() for p in peers),
    ]
    lines += missing
    for line in lines:
        print(line, flush=True)
    table: list[str] = []
    floor_lines: list[str] = []
    rows: list[dict] = []
    floors: dict[tuple[int, int, int, str], Floor] = {}
    seen: set[tuple[int, int, int, str]] = set()
    t_start = time.perf_counter()
    for make in _cases(args, dtype, device):
        t_case = time.perf_counter()
        try:
            case = make()
        except Exception as err:  # noqa: BLE001 - a case that cannot be made is reported
            line = f"case skipped: {'OOM' if _is_oom(err) else f'{type(err).__name__}: {err}'}"
            print(line, flush=True)
            floor_lines.append(line)
            _free(device)
            continue
        key = (*case.shape[:3], str(case.e.dtype))
        if key not in seen:
            seen.add(key)
            line = f"floor {case.label}: not measured (--no-floor)"
            if not args.no_floor:
                try:
                    floors[key] = gemm_floor(case.e, case.c, args.warmup, args.iters)
                    line = f"floor {case.label}: {floors[key].describe()}"
                except Exception as err:  # noqa: BLE001 - the table is still worth having
                    line = f"floor {case.label}: not measured ({'OOM' if _is_oom(err) else err})"
                _free(device)
            print(f"\n{line}\n\n{TABLE_HEADER}", flush=True)
            floor_lines.append(line)
        ref = None
        data_label = case.data
        t_made = time.perf_counter()
        if not args.no_truth:
            try:
                ref = truth(case, chunk_bytes=int(args.truth_chunk_gib * GIB))
                _sync(device)
                data_label += f", {ref.entropy:.2f} nats"
                print(
                    f"(case {case.label} {case.data}: inputs and floor {t_made - t_case:.1f} s, "
                    f"truth {time.perf_counter() - t_made:.1f} s, loss {ref.loss:.6f})",
                    flush=True,
                )
            except Exception as err:  # noqa: BLE001 - timings without errors still count
                line = f"truth {case.label} {case.data}: not computed ({'OOM' if _is_oom(err) else err})"
                print(line, flush=True)
                floor_lines.append(line)
                _free(device)
        for peer in peers:
            row = run_peer(peer, case, ref, args.warmup, args.iters)
            row.update(shape=case.label, data=data_label)
            rows.append(row)
            text = format_row(case.label, data_label, row, floors.get(key))
            table.append(text)
            print(text, flush=True)
        del case, ref
        _free(device)
        write_report(args.out, lines, floor_lines, table, "(run in progress)")
    wall = f"Wall time of the run: {time.perf_counter() - t_start:.0f} s."
    print(wall, flush=True)
    write_report(args.out, lines, floor_lines, table, wall)
    return rows


def write_report(path: str | None, lines: list[str], floor_lines: list[str], table: list[str], tail: str) -> None:
    """Writes the markdown report (rewritten after every case, so a run cut short keeps its
    rows)."""
    if path:
        report = lines + [""] + floor_lines + ["", TABLE_HEADER] + table + ["", tail]
        Path(path).write_text("\n".join(report) + "\n")


if __name__ == "__main__":
    main()
