"""A pure-torch prototype of the staircase backward, a peer of the side-by-side benchmark
(``--peers staircase``): what the design of docs/perf-log.md (session 23) gains on the
device before its CUDA kernels are wired into the library.

The forward visits the classes by batch-mean logit (``ē · c_j``, one GEMV, then a stable sort)
in chunks of a gathered ``c`` and keeps per (row, 256-class tile) the tile's largest logit and
``Σ e^{z − max}``; with the lse they give each row's probability mass per tile. Each row then
keeps the shortest prefix of tiles whose dropped suffix has every ``p < filter_eps`` (the
target's tile always kept) and a mass of at most ``max_dropped_mass`` (the contract of
MATH.md; ``cce_core::tile_budget``), rounded up to the backward's class chunk. The rows sorted
by that count need each class chunk on a prefix of them, so the backward is, per chunk, three
dense GEMMs (logits, ``d_e``, ``d_c``) over the first ``n_c`` sorted rows.

The prototype runs its elementwise steps in eager torch (several passes over each chunk's
logits), which a fused kernel would not; its statistics therefore also give the time of its
GEMMs alone, the part the library's WGMMA epilogues would leave. Mean reduction, targets < 0
ignored, optional softcap; no label smoothing or z-loss.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

TILE = 256
"""Classes per tile of the statistics (the WGMMA forward's partials)."""


def _logits(e: Tensor, c: Tensor) -> Tensor:
    """``e · cᵀ`` with f32 output (f32 accumulation of 16-bit inputs)."""
    if e.dtype in (torch.bfloat16, torch.float16) and e.is_cuda:
        try:
            return torch.mm(e, c.T, out_dtype=torch.float32)
        except (RuntimeError, TypeError, NotImplementedError):
            pass
    return torch.mm(e, c.T).float()


def _mm_f32(a: Tensor, b: Tensor) -> Tensor:
    if a.dtype in (torch.bfloat16, torch.float16) and a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError, NotImplementedError):
            pass
    return torch.mm(a, b).float()


def _cap(x: Tensor, softcap: float | None) -> Tensor:
    return x if softcap is None else softcap * torch.tanh(x / softcap)


def class_order(e: Tensor, c: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """``(order, inv)``: the classes by descending batch-mean logit over the rows with a target
    (all rows when none has one), ties by id; ``inv`` each class's position."""
    valid = targets >= 0
    rows = e[valid] if bool(valid.any()) else e
    score = c.float() @ rows.float().mean(0)
    order = torch.sort(score, descending=True, stable=True).indices
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return order, inv


def kept_tiles(m: Tensor, s: Tensor, lse: Tensor, ytile: Tensor, eps: float, delta: float) -> tuple[Tensor, Tensor]:
    """Per row: the tiles it keeps (a prefix) and the mass of the rest, from the tile maxima
    ``m`` and sums ``s`` (``[N, tiles]``), the lse and the target's tile (−1: none)."""
    finite = torch.isfinite(m)
    pmax = torch.where(finite, torch.exp(m - lse[:, None]), torch.zeros_like(m)).double()
    mass = torch.where(finite, s.double() * pmax, torch.zeros_like(pmax))
    suf_mass = torch.flip(torch.cumsum(torch.flip(mass, [1]), 1), [1])
    suf_max = torch.flip(torch.cummax(torch.flip(pmax, [1]), 1).values, [1])
    t = torch.arange(m.shape[1], device=m.device)
    ok = (suf_mass <= delta) & (suf_max < eps) & (t[None, :] > ytile[:, None])
    kept = m.shape[1] - ok.sum(1)
    return kept, suf_mass


class _Staircase(torch.autograd.Function):
    @staticmethod
    def forward(ctx, e, c, targets, softcap, eps, delta, chunk, fwd_chunk, stats):
        n, v = e.shape[0], c.shape[0]
        order, inv = class_order(e, c, targets)
        valid = targets >= 0
        ypos = torch.where(valid, inv[targets.clamp(min=0)], torch.full_like(targets, -1))
        n_tiles = math.ceil(v / TILE)
        m = torch.full((n, n_tiles), -math.inf, device=e.device)
        s = torch.zeros(n, n_tiles, device=e.device)
        zy = torch.zeros(n, device=e.device)
        rows = torch.arange(n, device=e.device)
        for k0 in range(0, v, fwd_chunk):
            k1 = min(v, k0 + fwd_chunk)
            z = _cap(_logits(e, c[order[k0:k1]]), softcap)
            rel = ypos - k0
            inside = (rel >= 0) & (rel < k1 - k0)
            zy[inside] = z[rows[inside], rel[inside]]
            pad = (-(k1 - k0)) % TILE
            if pad:
                z = torch.nn.functional.pad(z, (0, pad), value=-math.inf)
            zt = z.view(n, -1, TILE)
            mt = zt.amax(-1)
            safe = torch.where(torch.isfinite(mt), mt, torch.zeros_like(mt))
            m[:, k0 // TILE : k0 // TILE + zt.shape[1]] = mt
            s[:, k0 // TILE : k0 // TILE + zt.shape[1]] = torch.exp(zt - safe[..., None]).sum(-1)
            del z, zt
        big = m.amax(1)
        safe = torch.where(torch.isfinite(big), big, torch.zeros_like(big))
        lse = safe + torch.log((s * torch.exp(m - safe[:, None])).sum(1))
        n_valid = int(valid.sum())
        loss = torch.where(valid, lse - zy, torch.zeros_like(lse)).sum() / max(1, n_valid)
        ctx.save_for_backward(e, c, targets, order, inv, ypos, lse, m, s)
        ctx.cfg = (softcap, eps, delta, chunk, n_valid)
        ctx.stats = stats
        return loss

    @staticmethod
    def backward(ctx, grad):
        e, c, targets, order, inv, ypos, lse, m, s = ctx.saved_tensors
        softcap, eps, delta, chunk, n_valid = ctx.cfg
        n, v = e.shape[0], c.shape[0]
        valid = targets >= 0
        g = torch.where(valid, grad.float() / max(1, n_valid), torch.zeros_like(lse))
        ytile = torch.where(valid, ypos // TILE, torch.full_like(ypos, -1))
        kept, suf_mass = kept_tiles(m, s, lse, ytile, eps, delta)
        # Rounded up to the chunk; a row without a gradient keeps nothing.
        eff = torch.clamp(torch.ceil(kept * TILE / chunk) * chunk, max=v).long()
        eff = torch.where(g != 0, eff, torch.zeros_like(eff))
        eff_tiles = torch.div(eff + TILE - 1, TILE, rounding_mode="floor")
        padded = torch.nn.functional.pad(suf_mass, (0, 1))
        dropped = torch.where(g != 0, padded.gather(1, eff_tiles[:, None])[:, 0], torch.zeros_like(padded[:, 0]))
        row_order = torch.sort(eff, descending=True, stable=True).indices
        e_s, eff_s = e[row_order], eff[row_order]
        lse_s, g_s, ypos_s = lse[row_order], g[row_order], ypos[row_order]
        starts = list(range(0, v, chunk))
        counts = [int(x) for x in (eff_s[None, :] > torch.tensor(starts, device=e.device)[:, None]).sum(1).tolist()]
        d_e_s = torch.zeros(n, e.shape[1], device=e.device)
        d_c = torch.zeros(v, c.shape[1], device=e.device)
        for k0, n_c in zip(starts, counts, strict=True):
            if n_c == 0:
                continue
            k1 = min(v, k0 + chunk)
            idx = order[k0:k1]
            cc = c[idx]
            x = _logits(e_s[:n_c], cc)
            p = torch.exp(_cap(x, softcap) - lse_s[:n_c, None])
            gm = g_s[:n_c, None] * p
            rel = ypos_s[:n_c] - k0
            inside = (rel >= 0) & (rel < k1 - k0)
            r_in = torch.nonzero(inside)[:, 0]
            gm[r_in, rel[r_in]] -= g_s[:n_c][r_in]
            if softcap is not None:
                gm = gm * (1.0 - torch.tanh(x / softcap) ** 2)
            g16 = gm.to(e.dtype)
            d_e_s[:n_c] += _mm_f32(g16, cc)
            d_c[idx] = _mm_f32(g16.T, e_s[:n_c])
        d_e = torch.empty_like(d_e_s)
        d_e[row_order] = d_e_s
        if ctx.stats is not None:
            active = g != 0
            kept_entries = int(eff[active].sum())
            total = int(active.sum()) * v
            gemm = gemm_only_ms(e, c, counts, chunk)
            ctx.stats["backward"] = {
                "strategy": f"staircase prototype (kept {kept_entries / max(1, total):.1%} of the logits; "
                f"its GEMMs alone {gemm:.2f} ms)",
                "entries_kept": kept_entries,
                "entries_skipped": total - kept_entries,
                "n_valid": n_valid,
                "dropped_mass_max": float(dropped[valid].max()) if n_valid else 0.0,
                "dropped_mass_mean": float(dropped[valid].mean()) if n_valid else 0.0,
                "chunk_rows": counts,
                "gemm_ms": gemm,
            }
        return d_e.to(e.dtype), d_c.to(c.dtype), None, None, None, None, None, None, None


def staircase_loss(
    e: Tensor,
    c: Tensor,
    targets: Tensor,
    softcap: float | None = None,
    filter_eps: float = 2.0**-12,
    max_dropped_mass: float = 1e-3,
    chunk_classes: int = 8192,
    forward_bytes: int = 1 << 30,
    stats: dict | None = None,
) -> Tensor:
    """The mean cross-entropy of ``e · cᵀ`` (softcapped) against ``targets`` (< 0 ignored),
    whose backward is the staircase (module docs). ``chunk_classes`` (a multiple of 256): the
    backward's class chunk, the staircase's step; ``forward_bytes``: the f32 logits of one
    forward chunk. ``stats``, when given, receives under ``"backward"`` the backward's figures
    (kept share, dropped mass, rows per chunk, the time of its GEMMs alone) once it has run."""
    if chunk_classes % TILE:
        raise ValueError(f"chunk_classes must be a multiple of {TILE}, got {chunk_classes}")
    n = e.shape[0]
    fwd_chunk = max(TILE, forward_bytes // max(1, 4 * n) // TILE * TILE)
    return _Staircase.apply(e, c, targets, softcap, filter_eps, max_dropped_mass, chunk_classes, fwd_chunk, stats)


def gemm_only_ms(e: Tensor, c: Tensor, counts: list[int], chunk: int, iters: int = 3) -> float:
    """Device time of the staircase's GEMMs alone: one full logits GEMM (the forward) and, per
    class chunk with ``n_c`` rows, the logits, ``d_e`` and ``d_c`` GEMMs on those rows (median of
    ``iters`` after one warm-up; CUDA events)."""
    v = c.shape[0]
    top = max(counts) if counts else 0
    g = torch.randn(max(1, top), chunk, device=e.device, dtype=e.dtype).mul_(1e-3)

    def run():
        _logits(e, c)
        for k0, n_c in zip(range(0, v, chunk), counts, strict=True):
            if n_c == 0:
                continue
            k = min(chunk, v - k0)
            cc = c[k0 : k0 + k]
            _logits(e[:n_c], cc)
            _mm_f32(g[:n_c, :k], cc)
            _mm_f32(g[:n_c, :k].T, e[:n_c])

    from .bench import time_ms

    return time_ms(run, e.device, 1, iters)
