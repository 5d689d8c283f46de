"""The benchmark's inputs: synthetic cases drawn as the Rust generator draws them
(``crates/cce-data/src/gen.rs``, the distributions of the design's CASES.md: the same laws and
parameters, torch's generators instead of ChaCha8 streams) and cases read from safetensors files
(the SmolLM2 fixture and 12k-row file, or a user's). Used by :mod:`cut_cross_entropy_rs.bench`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

FIXTURE_FILE = "smollm2_lce_real_1k.safetensors"
E12K_FILE = "smollm2_lce_real_E12k.safetensors"


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
