//! Where a call's buffers go: the byte layouts of the scratch buffer (split dense's row pass,
//! the WGMMA class pass's chunks) and the workspace allocation, [`DenseWorkspace`].

use super::*;

impl DenseConfig {
    /// Split dense: bytes of the f16 copy of `e` (bf16 inputs with `d_c` only), rounded up to
    /// 256 so that the f32 chunk after it stays aligned.
    pub(crate) fn e16_bytes(&self) -> usize {
        if self.chunk_classes.is_some() && self.dtype == DType::BF16 && self.compute_d_c {
            (self.n * self.d * 2).div_ceil(256) * 256
        } else {
            0
        }
    }

    /// Split dense: byte offsets in the workspace's scratch buffer of the row pass's regions
    /// (256-byte aligned): the f16 copy of `c`, the logits, the f32 `d_e` rows, the per-row
    /// scales; and the end.
    pub(crate) fn row_layout(&self) -> RowLayout {
        let al = |x: usize| x.div_ceil(256) * 256;
        let r = self.effective_chunk_rows();
        let ld = self.ld();
        let mode = self.g_mode();
        let c16 = if mode == 2 && self.dtype == DType::BF16 {
            al(self.v * self.d * 2)
        } else {
            0
        };
        let logits = c16;
        let tmp = logits + al(r * ld * 4);
        let rs = tmp + if mode != 0 { al(r * self.d * 4) } else { 0 };
        let end = rs + if mode != 0 { al(r * 4) } else { 0 };
        RowLayout {
            c16: 0,
            logits,
            tmp,
            rs,
            end,
        }
    }

    /// Rows per chunk of the row pass when it takes the WGMMA epilogue (`row_pass_wgmma`):
    /// chunked dense fills its logits region (`effective_chunk_rows` rows of `ld` f32, as the
    /// plan sized it) with as many rows of the epilogue's layout as fit — bf16 q (`2·ld`
    /// bytes), the float2 partials of the row's 256-class tiles and the target logit — about
    /// twice the plan's rows, at most `N` ([`wgmma_rows_in`]); split dense keeps its rows (its
    /// row layout has other regions after the logits).
    ///
    /// With [`DenseConfig::row_e16`] each row also holds its f16 copy of `e` (`2·D` bytes,
    /// after 256 bytes of alignment), and the rows are not raised to the plan's (they may
    /// hold fewer where `D` is large against `V`).
    pub(crate) fn wgmma_chunk_rows(&self) -> usize {
        let rows = self.effective_chunk_rows();
        if self.chunk_classes.is_some() {
            return rows;
        }
        let region = rows * self.ld() * 4;
        if self.row_e16() {
            return wgmma_rows_in(region.saturating_sub(256), self.ld(), self.v, self.d)
                .min(self.n.max(1));
        }
        wgmma_rows_in(region, self.ld(), self.v, 0).clamp(rows, self.n.max(1))
    }

    /// Chunked dense with f32 gradients of bf16 inputs and `d_c`: where the WGMMA row pass
    /// runs, it writes `G` as f16 times a power of two for the `d_c` product against an f16
    /// copy of the chunk's rows of `e` (split dense's numerics for `d_c`: 11 significand bits
    /// against bf16's 8), then turns it into bf16 for `d_e`. True when the layout holds at
    /// least one row of it ([`DenseConfig::wgmma_row_offsets`]).
    pub(crate) fn row_e16(&self) -> bool {
        self.chunk_classes.is_none()
            && self.dtype == DType::BF16
            && self.grad_f32
            && self.compute_d_c
            && wgmma_rows_in(
                (self.effective_chunk_rows() * self.ld() * 4).saturating_sub(256),
                self.ld(),
                self.v,
                self.d,
            ) >= 1
    }

    /// Byte offsets in the logits region of the WGMMA row pass's buffers for chunks of
    /// `chunk` rows: q at 0, the partials, the target logits, the f16 copy of `e`
    /// ([`DenseConfig::row_e16`], else empty) and the end.
    pub(crate) fn wgmma_row_offsets(&self, chunk: usize) -> WgmmaRowOffsets {
        let partial = chunk * self.ld() * 2;
        let zy = partial + chunk * self.v.div_ceil(WGMMA_BN) * 8;
        let after = zy + chunk * 4;
        let (e16, end) = if self.row_e16() {
            let at = after.div_ceil(256) * 256;
            (at, at + chunk * self.d * 2)
        } else {
            (after, after)
        };
        WgmmaRowOffsets {
            partial,
            zy,
            e16,
            end,
        }
    }

    /// Split dense: bytes of the f32 `d_c` chunk that f16 operands need before a bf16 output
    /// (cuBLAS has no f16 x f16 → bf16 GEMM).
    pub(crate) fn dc_tmp_bytes(&self) -> usize {
        match self.chunk_classes {
            Some(k) if self.dtype == DType::BF16 && self.compute_d_c && !self.grad_f32 => {
                k.clamp(1, self.v) * self.d * 4
            }
            _ => 0,
        }
    }

    /// Bytes of the workspace's scratch buffer: the row chunk's logits (chunked dense); split
    /// dense's row pass (`DenseConfig::row_layout`), its class pass with `d_c` (the logits `N x
    /// ld_classes` f32 and the f32 `d_c` temp each rounded up to 256 bytes, plus the f16 copy
    /// of `e`, so that the WGMMA class pass's layout, `DenseConfig::gcols_layout`, always
    /// holds the chunks of the cuBLAS one) and the sparse backward's pairs (the plan sized
    /// them to fit; chunks capped by a test knob may leave it smaller, then it grows); the
    /// class-tiled forward's buffers.
    pub fn scratch_bytes(&self) -> usize {
        let al = |x: usize| x.div_ceil(256) * 256;
        if self.chunk_classes.is_some() {
            let class_pass = if self.compute_d_c {
                al(self.n * self.ld_classes() * 4) + self.e16_bytes() + al(self.dc_tmp_bytes())
            } else {
                0
            };
            self.row_layout()
                .end
                .max(class_pass)
                .max(self.sparse.map_or(0, |sp| sp.scratch_bytes))
        } else {
            self.effective_chunk_rows() * self.ld() * 4
        }
        .max(self.class_forward.map_or(0, |cf| cf.bytes(self.n)))
    }

    /// The configuration of a forward-only call with a workspace budget of `budget` bytes (as
    /// the backend runs one): no gradient (no accumulators, no f16 copies of `e` or `c`, no
    /// sparse backward), and a workspace ([`DenseWorkspace::bytes`]) within
    /// [`FORWARD_WORKSPACE_CAP`], or the budget less the cuBLAS workspace where that is smaller
    /// (`cap`). Its scratch holds whichever forward runs within what `cap` leaves beside the
    /// per-row buffers (`room`): row chunks of the plan's rows at most
    /// (`budget::forward_chunk_rows`, at least one row), the class tiles
    /// (`budget::forward_class_tiles`, within the plan's, which a test's chunk cap may have
    /// shrunk) and so the fused WGMMA forward's row groups, which take what the scratch holds
    /// (`budget::forward_group_rows`: a row of logits holds the partials of 128 rows). Over
    /// `cap` only where the per-row buffers and one row of logits exceed it.
    pub fn forward_only(mut self, budget: u64) -> Self {
        let cap = budget::forward_workspace_cap(budget);
        self.compute_d_e = false;
        self.compute_d_c = false;
        self.sparse = None;
        let beside = WorkspaceSizes::of(&self).besides_scratch();
        let room = usize::try_from(cap.saturating_sub(beside)).unwrap_or(usize::MAX) / 256 * 256;
        let (n, v) = (self.n, self.v);
        self.chunk_rows =
            budget::forward_chunk_rows(n, self.effective_chunk_rows(), self.ld() * 4, room);
        self.class_forward = self.class_forward.and_then(|planned| {
            let cf = budget::forward_class_tiles(n, v, self.tile, room)?;
            Some(cce_core::ClassForward {
                rows: cf.rows.min(planned.rows),
                classes: cf.classes.min(planned.classes),
            })
        });
        self
    }

    /// `ResourceLimit` unless the workspace of this configuration ([`WorkspaceSizes::total`])
    /// and the cuBLAS workspace ([`CUBLAS_WORKSPACE_BYTES`]) fit `budget` bytes; else their sum
    /// in bytes, what the call reports as its workspace.
    pub(crate) fn check_budget(&self, budget: u64) -> Result<u64> {
        let total = WorkspaceSizes::of(self).total() + CUBLAS_WORKSPACE_BYTES as u64;
        if total > budget {
            return Err(CceError::ResourceLimit {
                resource: format!(
                    "workspace bytes (the engine's buffers for N = {}, V = {} and the {} B \
                     cuBLAS workspace)",
                    self.n, self.v, CUBLAS_WORKSPACE_BYTES
                ),
                requested: total,
                max: budget,
            });
        }
        Ok(total)
    }

    /// Split dense's class pass through the WGMMA `G` epilogue in a scratch buffer of
    /// `scratch` bytes: the f16 copy of `e` ([`DenseConfig::e16_bytes`]) and the f32 `d_c`
    /// temp (bf16 outputs, [`DenseConfig::dc_tmp_bytes`] `> 0`: `dc_classes x D` f32) at its
    /// end, 256-byte aligned, and the f16 `G` of a chunk (`N x ldg`, 2 bytes per row and
    /// class) from byte 0 up to them.
    ///
    /// The rule, with `K` the plan's class chunk, `ldk` [`DenseConfig::ld_classes`] and `K'`
    /// `K` rounded down to 8: `classes` is `V` when it fits with one `d_c` GEMM per chunk (a
    /// temp of `classes`: each class costs `2N + 4D` bytes, `2N` without a temp), else the
    /// most whole 256-class tiles that do, at most `max(2·ldk, 8·K)`; `dc_classes` is
    /// `classes`, or where that exceeds the cap `max(K', 4·K rounded down to 8)`, the fewest
    /// even sub-chunks under it (multiples of 8, at least `K'`). The caps seldom bind in a
    /// planned call: the plan sizes `K` from the same budget (f32 logits, 4 bytes per row and
    /// class), so the scratch holds 1-2 `K` classes of f16 `G`, more only when the row pass's
    /// chunk or the plan's largest `K` (4096) leaves it larger; they keep a test's small chunk
    /// cap (`CudaBackend::with_chunk_cap`) giving several chunks and sub-chunks.
    ///
    /// Never smaller than the cuBLAS class pass's layout gives (`classes ≥ 2·ldk` rounded down
    /// to tiles, or `V`; `dc_classes ≥ K'`): when no chunk above that floor fits with a temp
    /// of all its classes, the floor's chunk with the most `d_c` classes per GEMM that fit,
    /// split evenly. The scratch of [`DenseConfig::scratch_bytes`] always holds that floor.
    /// `None` when not even it fits (a smaller scratch) or a dimension is empty. Sizes only:
    /// whether the epilogue applies is `schedule::wgmma_gcols_classes`'s.
    pub(crate) fn gcols_layout(&self, scratch: usize) -> Option<GColsLayout> {
        let (n, d, v) = (self.n, self.d, self.v);
        if n == 0 || d == 0 || v == 0 {
            return None;
        }
        let al = |x: usize| x.div_ceil(256) * 256;
        let kmax = self.chunk_classes.unwrap_or(v).clamp(1, v);
        let two = 2 * self.ld_classes();
        let e16 = self.e16_bytes();
        let temp = self.dc_tmp_bytes() > 0;
        // Whole tiles of at most `cap` classes, or V when it fits.
        let tiles = |cap: usize| {
            if v <= cap {
                v
            } else if cap >= WGMMA_BN {
                cap / WGMMA_BN * WGMMA_BN
            } else {
                cap
            }
        };
        let down8 = |k: usize| if k >= 8 { k / 8 * 8 } else { k };
        // The cuBLAS class pass's sizes (the floor) and the caps.
        let kw0 = tiles(two);
        let ks0 = down8(kmax);
        let kw_top = tiles(two.max(8 * kmax));
        let ks_cap = ks0.max(down8(4 * kmax));
        let fit = |kw: usize, ks: usize| -> Option<GColsLayout> {
            let ldg = kw.div_ceil(8) * 8;
            let tmp_bytes = if temp { al(ks * d * 4) } else { 0 };
            let tail = scratch.checked_sub(e16 + tmp_bytes)? / 256 * 256;
            (n * ldg * 2 <= tail).then_some(GColsLayout {
                classes: kw,
                dc_classes: ks,
                ldg,
                e16_off: tail,
                tmp_off: tail + e16,
            })
        };
        // Sub-chunks of a chunk of kw classes with at most lim (a multiple of 8) per GEMM: as
        // many as lim gives, of even size (a multiple of 8, at least K' where lim allows).
        let split = |kw: usize, lim: usize| {
            if lim >= kw {
                kw
            } else {
                let m = kw.div_ceil(lim);
                (kw.div_ceil(m).div_ceil(8) * 8).max(ks0).min(lim)
            }
        };
        // The largest chunk from the top down to the floor that fits with a temp of all its
        // classes (one d_c GEMM per chunk); its d_c then split under the cap (a smaller temp).
        let mut kw = kw_top;
        while kw >= kw0 {
            if fit(kw, kw).is_some() {
                return fit(kw, if temp { split(kw, ks_cap) } else { kw });
            }
            if !kw.is_multiple_of(WGMMA_BN) {
                kw = kw / WGMMA_BN * WGMMA_BN;
            } else if kw > WGMMA_BN {
                kw -= WGMMA_BN;
            } else {
                break;
            }
        }
        // The floor's chunk with the most d_c classes per GEMM that fit, split evenly.
        if temp {
            let mut lim = down8(kw0.min(ks_cap));
            while lim >= 8 {
                if fit(kw0, lim).is_some() {
                    return fit(kw0, split(kw0, lim));
                }
                lim -= 8;
            }
        }
        None
    }
}

/// Bytes per row of the WGMMA row pass's layout in a logits region (`row_pass_wgmma`): bf16 q
/// at a row stride of `ld` elements, the float2 (max, Σexp) partials of the row's
/// `ceil(V / 256)` class tiles, the f32 target logit and `e16_d` f16 values of `e`
/// ([`DenseConfig::row_e16`]: `D`, else 0).
pub(crate) fn wgmma_row_bytes(ld: usize, v: usize, e16_d: usize) -> usize {
    ld * 2 + v.div_ceil(WGMMA_BN) * 8 + 4 + e16_d * 2
}

/// Rows of the WGMMA row pass's layout ([`wgmma_row_bytes`]) that fit a region of `bytes`.
pub(crate) fn wgmma_rows_in(bytes: usize, ld: usize, v: usize, e16_d: usize) -> usize {
    bytes / wgmma_row_bytes(ld, v, e16_d)
}

/// Byte offsets of the WGMMA row pass's buffers in a chunk's logits region
/// ([`DenseConfig::wgmma_row_offsets`]; q at 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct WgmmaRowOffsets {
    /// float2 partials `[chunk, ceil(V / 256)]`.
    pub partial: usize,
    /// f32 target logits `[chunk]`.
    pub zy: usize,
    /// f16 copy of the chunk's rows of `e` `[chunk, D]`, 256-byte aligned (empty without
    /// [`DenseConfig::row_e16`]).
    pub e16: usize,
    /// End of the buffers.
    pub end: usize,
}

/// Byte offsets of split dense's row-pass regions ([`DenseConfig::row_layout`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RowLayout {
    /// f16 copy of `c` (bf16 inputs, `d_e` from f16 `G`).
    pub c16: usize,
    /// f32 logits `[chunk_rows, ld]`, overwritten by `G`.
    pub logits: usize,
    /// f32 `d_e` rows `[chunk_rows, D]`.
    pub tmp: usize,
    /// f32 per-row scales `[chunk_rows]` (f16 mode).
    pub rs: usize,
    /// End of the row pass's regions.
    pub end: usize,
}

/// Split dense's class pass through the WGMMA `G` epilogue: chunk sizes and where its regions
/// sit in the workspace's scratch buffer ([`DenseConfig::gcols_layout`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct GColsLayout {
    /// Classes per chunk (one `cce_wgmma_gcols*` launch): `V`, or whole 256-class tiles.
    pub classes: usize,
    /// Classes per `d_c` GEMM (sub-chunk of a chunk): `classes` (one GEMM per chunk; always
    /// without the f32 temp), or a multiple of 8 under it, so that each sub-chunk starts on a
    /// 16-byte column of `G`.
    pub dc_classes: usize,
    /// Row stride of the f16 `G` `[N, ldg]` at byte 0, in elements: `classes` rounded up to 8.
    pub ldg: usize,
    /// Byte offset of the f16 copy of `e` ([`DenseConfig::e16_bytes`]), 256-byte aligned,
    /// at least `N·ldg·2` (after `G`).
    pub e16_off: usize,
    /// Byte offset of the f32 `d_c` temp (`dc_classes x D` f32, bf16 outputs;
    /// [`DenseConfig::dc_tmp_bytes`] `> 0`), `e16_off + e16_bytes`, 256-byte aligned; the temp
    /// ends within the scratch.
    pub tmp_off: usize,
}

/// Device workspace of a call, reusable across calls of the same configuration.
#[derive(Debug)]
pub struct DenseWorkspace {
    pub(super) chunk_rows: usize,
    pub(super) ld: usize,
    pub(super) logits: CudaSlice<u8>,
    pub(super) tau: CudaSlice<u8>,
    /// Split dense's power-of-two scales, [`SCALES_BYTES`]: one `ScaleSet` per use (maxima
    /// and factors, written and read on the device).
    pub(super) scales: CudaSlice<u8>,
    pub(super) dc_acc: Option<CudaSlice<u8>>,
    pub(super) dbias_acc: Option<CudaSlice<u8>>,
    pub(super) row_loss: CudaSlice<u8>,
    pub(super) kept: CudaSlice<u8>,
    pub(super) dropped: CudaSlice<u8>,
    pub(super) flags: CudaSlice<u8>,
    pub(super) edges: CudaSlice<u8>,
    pub(super) stats: CudaSlice<u8>,
    /// Sparse backward: row offsets then row counts, u32 `[N]` each.
    pub(super) sparse_rows: CudaSlice<u8>,
    /// Sparse backward: pair counter (u64), overflow flag and re-read rows (u32), the folded
    /// select's lse − max histogram of the probe rows (32 u32).
    pub(super) sparse_ctl: CudaSlice<u8>,
    pub(super) bytes: u64,
}

/// The byte size of every buffer of a [`DenseWorkspace`] for a configuration: a pure
/// function of it, so that a caller can size the workspace before a call
/// (`CudaBackend::workspace_bytes`) and the allocation follows the same numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct WorkspaceSizes {
    logits: usize,
    tau: usize,
    scales: usize,
    dc_acc: Option<usize>,
    dbias_acc: Option<usize>,
    row_loss: usize,
    kept: usize,
    dropped: usize,
    flags: usize,
    sparse_rows: usize,
    sparse_ctl: usize,
    edges: usize,
    stats: usize,
}

impl WorkspaceSizes {
    /// The sizes of `cfg`'s buffers (each at least 4 bytes, as allocated).
    pub(crate) fn of(cfg: &DenseConfig) -> Self {
        let split = cfg.chunk_classes.is_some();
        // Filter statistics: split dense never filters (see `run`), so it keeps placeholders,
        // unless it tries a sparse backward.
        let split_plain = split && cfg.sparse.is_none();
        let per_row = |on: bool| if on { cfg.n * 4 } else { 4 };
        Self {
            logits: cfg.scratch_bytes(),
            tau: per_row(split),
            scales: SCALES_BYTES,
            dc_acc: (cfg.compute_d_c && !cfg.grad_f32 && !split && !cfg.dc_in_grad_dtype)
                .then_some(cfg.v * cfg.d * 4),
            dbias_acc: (cfg.compute_d_c && cfg.has_bias && !cfg.grad_f32).then_some(cfg.v * 4),
            row_loss: cfg.n * 4,
            kept: per_row(!split_plain),
            dropped: per_row(!split_plain),
            flags: if split_plain {
                4
            } else {
                cfg.row_tiles() * cfg.class_tiles() * 4
            },
            sparse_rows: if cfg.sparse.is_some() { cfg.n * 8 } else { 4 },
            // Pairs (u64), overflow and re-read rows (u32 each), then the folded select's
            // histogram of lse − max over the probe's rows (32 u32).
            sparse_ctl: 16 + 32 * 4,
            edges: N_BINS * 4,
            stats: 8 * 8,
        }
    }

    /// Bytes of every buffer but the scratch (each at least 4, as allocated).
    pub(crate) fn besides_scratch(&self) -> u64 {
        self.total() - self.logits.max(4) as u64
    }

    /// Total bytes (each buffer at least 4, as allocated).
    pub(crate) fn total(&self) -> u64 {
        let required = [
            self.logits,
            self.tau,
            self.scales,
            self.row_loss,
            self.kept,
            self.dropped,
            self.flags,
            self.sparse_rows,
            self.sparse_ctl,
            self.edges,
            self.stats,
        ];
        required
            .into_iter()
            .chain(self.dc_acc)
            .chain(self.dbias_acc)
            .map(|n| n.max(4) as u64)
            .sum()
    }
}

impl DenseWorkspace {
    /// Allocate the workspace of `cfg` on the engine's stream (its sizes: `WorkspaceSizes::of`).
    pub fn new(engine: &DenseEngine, cfg: &DenseConfig) -> Result<Self> {
        let chunk_rows = cfg.effective_chunk_rows();
        let ld = cfg.ld();
        let sz = WorkspaceSizes::of(cfg);
        let mut bytes = 0u64;
        let mut alloc = |n: usize| -> Result<CudaSlice<u8>> {
            let n = n.max(4);
            bytes += n as u64;
            // Every byte of a workspace buffer is written on the device before it is read
            // (logits by the GEMM, accumulators zeroed per call, row state by kernels).
            engine.alloc_workspace(n)
        };
        let logits = alloc(sz.logits)?;
        let tau = alloc(sz.tau)?;
        let scales = alloc(sz.scales)?;
        let dc_acc = sz.dc_acc.map(&mut alloc).transpose()?;
        let dbias_acc = sz.dbias_acc.map(&mut alloc).transpose()?;
        let row_loss = alloc(sz.row_loss)?;
        let kept = alloc(sz.kept)?;
        let dropped = alloc(sz.dropped)?;
        let flags = alloc(sz.flags)?;
        let sparse_rows = alloc(sz.sparse_rows)?;
        let sparse_ctl = alloc(sz.sparse_ctl)?;
        let mut edges = alloc(sz.edges)?;
        let stats = alloc(sz.stats)?;
        debug_assert_eq!(bytes, sz.total());
        let host: Vec<f32> = (0..N_BINS).map(|k| cfg.filter.edge(k)).collect();
        engine
            .stream
            .memcpy_htod(bytemuck::cast_slice::<f32, u8>(&host), &mut edges)
            .map_err(drv)?;
        Ok(Self {
            chunk_rows,
            ld,
            logits,
            tau,
            scales,
            dc_acc,
            dbias_acc,
            row_loss,
            kept,
            dropped,
            flags,
            edges,
            stats,
            sparse_rows,
            sparse_ctl,
            bytes,
        })
    }

    /// Device bytes held (the plan's workspace: logits chunk, accumulators, row state).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Rows per chunk.
    pub fn chunk_rows(&self) -> usize {
        self.chunk_rows
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cce_core::{DeviceLimits, Options, Plan, Problem, StrategyKind, TileShape};

    /// Split dense's configuration as `cce_bench_dense` plans it (limits of `cuda_limits`, the
    /// budget less the cuBLAS workspace), or with its chunks capped like
    /// `CudaBackend::with_chunk_cap` (the conformance tests).
    fn split_cfg(
        (n, d, v): (usize, usize, usize),
        dtype: DType,
        opts: &Options,
        cap: Option<(usize, usize)>,
    ) -> DenseConfig {
        let problem = Problem {
            n,
            d,
            v,
            dtype,
            has_bias: false,
            seq_len: n,
        };
        let limits = DeviceLimits {
            name: "cuda".into(),
            max_buffer_bytes: 1 << 40,
            max_block_memory_bytes: 227 << 10,
            max_threads_per_block: 1024,
            max_grid: [i32::MAX as u32, 65535, 65535],
            index_bits: 32,
            tile: TileShape {
                rows: 128,
                classes: 128,
                depth: 64,
            },
            strategies: vec![StrategyKind::SplitDense],
            class_forward: true,
        };
        let share = Options {
            workspace_budget_bytes: budget::plan_budget(opts.workspace_budget_bytes),
            ..opts.clone()
        };
        let mut plan = Plan::new(&problem, &share, &limits).unwrap();
        if let (
            Some((rows, classes)),
            cce_core::Strategy::SplitDense {
                chunk_rows,
                chunk_classes,
                ..
            },
        ) = (cap, &mut plan.strategy)
        {
            *chunk_rows = (*chunk_rows).min(rows);
            *chunk_classes = (*chunk_classes).min(classes);
            if let Some(cf) = plan.forward.as_mut() {
                cf.rows = cf.rows.min(rows);
                cf.classes = cf.classes.min(classes);
            }
        }
        DenseConfig::from_plan(&plan, opts).unwrap()
    }

    /// The invariants of [`DenseConfig::gcols_layout`] in `scratch` bytes: the regions fit and
    /// are aligned, the chunks are whole tiles (or V) within the caps, and never smaller than
    /// the cuBLAS class pass's (2·ldk in tiles, the plan's chunk rounded down to 8).
    fn check_layout(cfg: &DenseConfig, scratch: usize) -> GColsLayout {
        let what = format!("{}x{}x{} {:?}", cfg.n, cfg.d, cfg.v, cfg.dtype);
        let l = cfg
            .gcols_layout(scratch)
            .unwrap_or_else(|| panic!("{what}: no layout in {scratch} B"));
        let (n, d, v) = (cfg.n, cfg.d, cfg.v);
        let kmax = cfg.chunk_classes.unwrap().clamp(1, v);
        let two = 2 * cfg.ld_classes();
        let temp = cfg.dc_tmp_bytes() > 0;
        assert!(
            l.classes == v || l.classes.is_multiple_of(WGMMA_BN),
            "{what}: {l:?}"
        );
        assert!(
            l.classes <= v && l.classes <= two.max(8 * kmax),
            "{what}: {l:?}"
        );
        let kw0 = if v <= two {
            v
        } else {
            two / WGMMA_BN * WGMMA_BN
        };
        assert!(l.classes >= kw0, "{what}: {l:?} under {kw0}");
        assert_eq!(l.ldg, l.classes.div_ceil(8) * 8, "{what}");
        assert!(n * l.ldg * 2 <= l.e16_off, "{what}: {l:?}");
        assert_eq!(l.e16_off % 256, 0, "{what}: {l:?}");
        assert_eq!(l.tmp_off, l.e16_off + cfg.e16_bytes(), "{what}: {l:?}");
        if temp {
            assert!(l.dc_classes <= l.classes, "{what}: {l:?}");
            assert!(
                l.dc_classes.is_multiple_of(8) || l.dc_classes == l.classes,
                "{what}: {l:?}"
            );
            let ks0 = if kmax >= 8 { kmax / 8 * 8 } else { kmax };
            assert!(l.dc_classes >= ks0, "{what}: {l:?} under {ks0}");
            assert!(l.tmp_off + l.dc_classes * d * 4 <= scratch, "{what}: {l:?}");
        } else {
            assert_eq!(l.dc_classes, l.classes, "{what}");
            assert!(l.tmp_off <= scratch, "{what}: {l:?}");
        }
        l
    }

    #[test]
    fn scales_region_holds_every_scale_set() {
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            let cfg = split_cfg((129, 128, 5003), dtype, &Options::exact(), None);
            let sz = WorkspaceSizes::of(&cfg);
            assert_eq!(sz.scales, SCALES_BYTES);
            assert!(ScaleSet::RowChunk.offset() + SET_WORDS * 4 <= sz.scales);
            let without = WorkspaceSizes { scales: 0, ..sz };
            assert_eq!(sz.total(), without.total() - 4 + SCALES_BYTES as u64);
        }
    }

    #[test]
    fn gcols_layout_bench_shapes() {
        let opts = |softcap| Options {
            softcap,
            workspace_budget_bytes: 1 << 29,
            ..Options::default()
        };
        // (N, D, V, softcap): the sizes the 0.5 GiB split-dense benches get.
        for (shape, softcap) in [
            ((8192, 2304, 256000), Some(30.0)),
            ((32768, 4096, 256000), None),
            ((8192, 4096, 128256), None),
            ((4096, 4096, 128256), None),
        ] {
            for exact in [false, true] {
                let mut o = opts(softcap);
                if exact {
                    o.filter_eps = Options::exact().filter_eps;
                }
                let cfg = split_cfg(shape, DType::BF16, &o, None);
                let scratch = cfg.scratch_bytes();
                let l = check_layout(&cfg, scratch);
                eprintln!(
                    "{shape:?} exact {exact}: plan chunk {:?} classes, scratch {scratch} B \
                     (row pass {} B, class tiles {:?} B, sparse {:?} B): {l:?} ({} chunk(s))",
                    cfg.chunk_classes,
                    cfg.row_layout().end,
                    cfg.class_forward.map(|cf| cf.bytes(cfg.n)),
                    cfg.sparse.map(|sp| sp.scratch_bytes),
                    shape.2.div_ceil(l.classes)
                );
            }
        }
        // The scratch the WGMMA class pass got at the first two (docs/perf-log.md).
        let cfg = split_cfg((8192, 2304, 256000), DType::BF16, &opts(Some(30.0)), None);
        let l = check_layout(&cfg, 393_216_000);
        // (393216000 − 37748736) / (2·8192 + 4·2304) = 13885 classes: 54 tiles.
        assert_eq!((l.classes, l.dc_classes), (13824, 13824), "{l:?}");
        let cfg = split_cfg((32768, 4096, 256000), DType::BF16, &opts(None), None);
        let l = check_layout(&cfg, 490_282_752);
        // 2·ldk = 2816 classes (11 tiles) leave no room for a temp of 2816: two d_c GEMMs of
        // 1408 per chunk, as the cuBLAS class pass's layout gave.
        assert_eq!((l.classes, l.dc_classes), (2816, 1408), "{l:?}");
    }

    #[test]
    fn gcols_layout_small_and_capped() {
        // Every dtype / output / d_c combination, shapes from one row up, planned within a
        // small budget and capped like the conformance tests.
        let mut seen = 0;
        for &(n, d, v) in &[
            (1, 64, 7),
            (129, 128, 5003),
            (300, 576, 600),
            (130, 64, 257),
            (257, 192, 1000),
            (200, 128, 1000),
            (200, 128, 3500),
            (4096, 256, 50000),
            (161, 64, 1),
        ] {
            for dtype in [DType::BF16, DType::F16] {
                for (grad_dtype, compute_d_c) in [
                    (cce_core::GradDType::Input, true),
                    (cce_core::GradDType::F32, true),
                    (cce_core::GradDType::Input, false),
                ] {
                    for cap in [None, Some((64, 128)), Some((64, 384))] {
                        let opts = Options {
                            label_smoothing: 0.1,
                            grad_dtype,
                            compute_d_c,
                            workspace_budget_bytes: 64 << 20,
                            ..Options::exact()
                        };
                        let cfg = split_cfg((n, d, v), dtype, &opts, cap);
                        if compute_d_c {
                            // The class pass runs with d_c only (the scratch holds it then).
                            check_layout(&cfg, cfg.scratch_bytes());
                            seen += 1;
                        }
                    }
                }
            }
        }
        assert!(seen > 100);
        // The chunks of the conformance test `wgmma_gcols_class_pass` (its backend plans these
        // shapes alike: 64-row chunks, so a scratch of a few 64-row logits chunks): several
        // WGMMA launches, a partial last chunk, d_c sub-chunks with bf16 outputs.
        let opts = Options {
            label_smoothing: 0.1,
            softcap: Some(50.0),
            ..Options::exact()
        };
        for (shape, cap, bf16, f16) in [
            ((129, 128, 5003), 128, (1024, 512), (1024, 1024)),
            ((300, 576, 600), 128, (256, 128), (256, 256)),
            ((130, 64, 257), 128, (256, 128), (257, 257)),
            ((257, 192, 1000), 128, (256, 256), (512, 512)),
            ((200, 128, 1000), 384, (768, 384), (768, 768)),
        ] {
            for (dtype, want) in [(DType::BF16, bf16), (DType::F16, f16)] {
                let cfg = split_cfg(shape, dtype, &opts, Some((64, cap)));
                let l = check_layout(&cfg, cfg.scratch_bytes());
                assert_eq!(
                    (l.classes, l.dc_classes),
                    want,
                    "{shape:?} {dtype:?}: {l:?}"
                );
            }
        }
        // A scratch too small for even the cuBLAS pass's chunk has no layout.
        let opts = Options::exact();
        let cfg = split_cfg((129, 128, 5003), DType::BF16, &opts, Some((64, 128)));
        assert_eq!(cfg.gcols_layout(1024), None);
    }

    #[test]
    fn every_planned_call_fits_its_budget() {
        // Whatever the backend plans, its calls' workspace and the cuBLAS workspace stay within
        // the budget (`DenseConfig::check_budget` never refuses a planned call here), and a
        // forward-only call within the forward-only cap.
        let limits = schedule::device_limits("test", 140 << 30, 227 << 10);
        let mut planned = 0;
        for &(n, d, v) in &[
            (1, 64, 7),
            (129, 128, 5003),
            (300, 576, 600),
            (161, 64, 1),
            (1000, 256, 3000),
            (4096, 256, 50000),
            (20000, 64, 100000),
        ] {
            for dtype in [DType::BF16, DType::F16, DType::F32] {
                for (grad_dtype, compute_d_e, compute_d_c, exact) in [
                    (cce_core::GradDType::Input, true, true, false),
                    (cce_core::GradDType::Input, true, true, true),
                    (cce_core::GradDType::F32, true, true, true),
                    (cce_core::GradDType::Input, true, false, false),
                    (cce_core::GradDType::Input, false, true, true),
                ] {
                    for budget in [33u64 << 20, 40 << 20, 64 << 20, 100 << 20, 512 << 20] {
                        for chunk_cap in [None, Some((64, 128))] {
                            let base = if exact {
                                Options::exact()
                            } else {
                                Options::default()
                            };
                            let opts = Options {
                                grad_dtype,
                                compute_d_e,
                                compute_d_c,
                                workspace_budget_bytes: budget,
                                ..base
                            };
                            let problem = Problem {
                                n,
                                d,
                                v,
                                dtype,
                                has_bias: false,
                                seq_len: n,
                            };
                            let knobs = schedule::PlanKnobs {
                                chunk_cap,
                                sparse: crate::SparseMode::Auto,
                                split_de_f16: true,
                                chunked_f32_grads: false,
                                chunked_g16: None,
                                dc_in_grad_dtype: false,
                                sparse_expected: true,
                            };
                            let at = format!("{n}x{d}x{v} {dtype:?} {opts:?}");
                            let plan = match schedule::plan_call(&problem, &opts, &limits, knobs) {
                                Ok(plan) => plan,
                                Err(CceError::ResourceLimit { max, .. }) => {
                                    assert_eq!(max, budget, "{at}");
                                    continue;
                                }
                                Err(e) => panic!("{at}: {e}"),
                            };
                            planned += 1;
                            for backward in [false, true] {
                                let switches = PathSwitches::DEFAULT;
                                let cfg = schedule::dense_config(&plan, &opts, switches, backward)
                                    .unwrap_or_else(|e| panic!("{at} backward {backward}: {e}"));
                                let total = WorkspaceSizes::of(&cfg).total();
                                assert!(total + CUBLAS_WORKSPACE_BYTES as u64 <= budget, "{at}");
                                if !backward {
                                    let cap = budget::forward_workspace_cap(budget);
                                    assert!(total <= cap, "{at}: {total} B");
                                    if let Some(cf) = cfg.class_forward {
                                        assert!(cf.bytes(n) <= cfg.scratch_bytes(), "{at}");
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        assert!(planned > 500, "{planned}");
    }

    #[test]
    fn a_workspace_over_the_budget_is_a_resource_error() {
        let opts = Options::exact();
        let cfg = split_cfg((4096, 256, 50000), DType::BF16, &opts, None);
        let total = WorkspaceSizes::of(&cfg).total() + CUBLAS_WORKSPACE_BYTES as u64;
        assert_eq!(cfg.check_budget(total).unwrap(), total);
        match cfg.check_budget(total - 1) {
            Err(CceError::ResourceLimit { requested, max, .. }) => {
                assert_eq!((requested, max), (total, total - 1))
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn chunked_dense_fills_its_logits_region_with_about_twice_the_rows_of_16_bit_q() {
        let opts = Options::exact();
        let mut cfg = split_cfg((8192, 2304, 256000), DType::BF16, &opts, None);
        cfg.chunk_classes = None;
        cfg.chunk_rows = 480;
        let rows = cfg.wgmma_chunk_rows();
        let region = 480 * cfg.ld() * 4;
        assert!(rows * wgmma_row_bytes(cfg.ld(), cfg.v, 0) <= region);
        assert!((rows + 1) * wgmma_row_bytes(cfg.ld(), cfg.v, 0) > region);
        assert_eq!(
            cfg.wgmma_row_offsets(rows).end,
            rows * wgmma_row_bytes(cfg.ld(), cfg.v, 0)
        );
        assert!((900..960).contains(&rows), "{rows}");
        // At most N, never under the plan's rows (a tiny V: partials as large as q).
        cfg.chunk_rows = 6000;
        assert_eq!(cfg.wgmma_chunk_rows(), 8192);
        let mut tiny = split_cfg((100, 64, 3), DType::BF16, &opts, None);
        tiny.chunk_classes = None;
        tiny.chunk_rows = 7;
        assert!(tiny.wgmma_chunk_rows() >= 7);
        // Split dense keeps its rows.
        let split = split_cfg((8192, 2304, 256000), DType::BF16, &opts, None);
        assert_eq!(split.wgmma_chunk_rows(), split.effective_chunk_rows());
    }

    #[test]
    fn chunked_f32_grads_keep_an_aligned_f16_copy_of_e_within_the_logits_region() {
        let opts = Options {
            grad_dtype: cce_core::GradDType::F32,
            ..Options::exact()
        };
        for (shape, plan_rows) in [
            ((8192, 2304, 256000), 384),
            ((8192, 4096, 128256), 896),
            ((700, 128, 3001), 128),
            ((517, 64, 700), 128),
            ((300, 4096, 64), 1),
        ] {
            let mut cfg = split_cfg(shape, DType::BF16, &opts, None);
            cfg.chunk_classes = None;
            cfg.chunk_rows = plan_rows;
            let region = plan_rows * cfg.ld() * 4;
            if !cfg.row_e16() {
                // Not even one row fits beside its f16 e: bf16 G as before.
                assert!(
                    region < 256 + wgmma_row_bytes(cfg.ld(), cfg.v, cfg.d),
                    "{shape:?}"
                );
                continue;
            }
            let rows = cfg.wgmma_chunk_rows();
            let o = cfg.wgmma_row_offsets(rows);
            assert!(rows >= 1 && rows <= shape.0, "{shape:?}: {rows}");
            assert_eq!(o.e16 % 256, 0, "{shape:?}");
            assert!(o.e16 >= o.zy + rows * 4 && o.end == o.e16 + rows * cfg.d * 2);
            assert!(o.end <= region, "{shape:?}: {o:?} past {region}");
            // The next row would not fit.
            if rows < shape.0 {
                let more = cfg.wgmma_row_offsets(rows + 1);
                assert!(more.end + 256 > region, "{shape:?}: {rows} rows");
            }
        }
        // bf16 gradients, split dense or no d_c: no copy.
        let mut cfg = split_cfg((8192, 2304, 256000), DType::BF16, &Options::exact(), None);
        cfg.chunk_classes = None;
        assert!(!cfg.row_e16());
    }
}
