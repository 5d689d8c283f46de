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
import math
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

from .bench_data import (
    E12K_FILE,
    FIXTURE_FILE,
    Case,
    _chunk_rows,
    ar1_rows,
    find_real_file,
    load_safetensors_case,
    make_synthetic,
    parse_scaled,
    read_safetensors,
    sample_targets,
)

__all__ = [
    "E12K_FILE",
    "FIXTURE_FILE",
    "Case",
    "ar1_rows",
    "parse_scaled",
    "sample_targets",
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
KNOWN_PEERS = ("ours", "ours-exact", "ours-bf16dc", "liger", "cce", "cce-exact", "compile", "torch", "staircase")
GIB = float(1 << 30)


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
    if name in ("ours", "ours-exact", "ours-bf16dc"):
        import cut_cross_entropy_rs
        from cut_cross_entropy_rs import linear_cross_entropy as ours

        eps = "auto" if name == "ours" else None
        # ours-bf16dc: exact, d_c accumulated in the bf16 gradient (Liger's trade).
        kw = dict(filter_eps=eps, workspace_budget_bytes=budget, dc_in_grad_dtype=name == "ours-bf16dc")

        def call_ours(e, c, t, softcap, stats):
            out = ours(e, c, t, softcap=softcap, return_stats=stats, **kw)
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
    if name == "staircase":
        # The pure-torch prototype of the staircase backward (bench_staircase.py): not this
        # library's code path; its notes give the kept share and the time of its GEMMs alone.
        from .bench_staircase import staircase_loss

        def call_staircase(e, c, t, softcap, stats):
            out: dict | None = {} if stats else None
            return staircase_loss(e, c, t, softcap=softcap, stats=out), out

        return Peer(name, call_staircase, "prototype")
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


def _workspace_bytes(stats: Any) -> int | None:
    """The largest ``workspace_bytes`` of ours' forward and backward statistics, if any."""
    if not stats:
        return None
    sizes = [int(part.get("workspace_bytes", 0)) for part in (stats.get("forward"), stats.get("backward")) if part]
    return max(sizes) if sizes else None


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
            # This library's CUDA backend keeps its workspace in a pool of its own (reserved by
            # the warm-up, invisible to both counters): its statistics say how large it is.
            kept = _workspace_bytes(stats)
            if kept is not None:
                row["outside_gib"] = max(row.get("outside_gib", 0.0), kept / GIB)
            row["extra_gib"] += row.get("outside_gib", 0.0)
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
