//! Every decision of a dense call, from plain data: no CUDA call in this module.
//!
//! In: the problem, the options and the device's limits ([`plan_call`]: the plan and the
//! backend's adjustments to it), the plan's [`DenseConfig`] ([`dense_config`]), what the device
//! offers ([`DeviceFacts`]: compute capability, multiprocessors, shared memory) and the call's
//! buffers ([`CallFacts`]: scratch size, input alignment). Out: a [`Schedule`] (which forward,
//! row pass, class pass, whether the sparse backward is tried) with the reason strings the
//! call reports in its `plan_reason`. The executor (`exec.rs`) walks it.
//!
//! Two decisions depend on the data and are taken during the call, still by the pure
//! functions here: whether the sparse backward keeps going after its probe chunk
//! ([`probe_verdict`], [`fold_after_probe`]) and how many row chunks the WGMMA row pass gets
//! when a sparse backward gave way with its first chunk's logits in place
//! ([`row_pass_note`]).

use super::budget::*;
use super::*;
use cce_core::{Plan, StrategyKind};

pub(crate) use super::call_plan::{give_way_plan, plan_call, ChunkedG16, PlanKnobs};

/// Mean kept entries per row (the probe's) above which the sparse backward runs the forward
/// rows and select apart rather than folded (`cce_sparse_select_fwd_*`). Rows keeping more
/// have more candidates per select warp, and the folded form compacts its candidate slots
/// more often: session 7 run 3 measured the folded form faster at 3 and 209 kept entries per
/// row (V = 128256: c/8 10.49 against 11.17 ms at 4096 rows) and slower at 327 (the seed's
/// c/8: select 39-40 ms against 9.4 + 21.2 apart). The bound sits between.
pub(crate) const FOLD_MAX_KEPT: f64 = 256.0;

/// Dynamic shared memory per block the automatic cluster choice aims at: two blocks of 512
/// threads per SM, so that one block loads while the other computes or writes.
pub(crate) const FUSED_TARGET_SMEM_BYTES: usize = 100 << 10;

/// What the device offers the decisions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DeviceFacts {
    /// Compute capability, major.
    pub major: i32,
    /// Compute capability, minor.
    pub minor: i32,
    /// Multiprocessors (the persistent grids of the WGMMA kernels).
    pub sm_count: usize,
    /// Largest dynamic shared memory a block may opt into, in bytes.
    pub max_smem_optin: usize,
    /// Static shared memory of the cluster-fused row kernels (0 where they are not loaded).
    pub fused_static_smem: usize,
}

impl DeviceFacts {
    /// The WGMMA kernels are loaded: compute capability 9.0 (they are compiled for sm_90a only)
    /// and shared memory for their staged tiles and output buffer.
    pub fn wgmma(&self) -> bool {
        (self.major, self.minor) == (9, 0) && self.max_smem_optin >= WGMMA_SMEM_OUT_BYTES
    }

    /// The cluster-fused row kernels are loaded (compute capability 9.0 or newer).
    pub fn fused_kernels(&self) -> bool {
        self.major >= 9
    }
}

/// Which of the three calls runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CallKind {
    /// Forward only.
    Forward,
    /// Forward and backward in one call.
    ForwardBackward,
    /// Backward from a saved lse and `1 − p_y`.
    Backward,
}

impl CallKind {
    /// The call computes the forward (lse, loss).
    pub fn forward(self) -> bool {
        self != CallKind::Backward
    }

    /// The call computes gradients.
    pub fn backward(self) -> bool {
        self != CallKind::Forward
    }
}

/// What the decisions need of the call's buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CallFacts {
    /// Bytes of the workspace's scratch buffer.
    pub scratch: usize,
    /// `e` and `c` start on 16-byte boundaries (the WGMMA kernels' TMA loads need it).
    pub aligned: bool,
    /// The stream is capturing a CUDA graph: no decision may read the device.
    pub capturing: bool,
    /// The gradients are added to the outputs' contents ([`DenseGradOut::accumulate`]).
    pub accumulate: bool,
}

/// How a forward-only call computes lse and loss.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ForwardPath {
    /// The fused WGMMA forward, `group` rows per row group.
    Wgmma {
        /// Rows per row group.
        group: usize,
    },
    /// The plan's class tiles, the row reductions on a second stream.
    ClassTiles(cce_core::ClassForward),
    /// Row chunks: the logits GEMM then the forward row kernel.
    RowChunks,
}

/// How split dense's class pass computes `G`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum ClassPath {
    /// The WGMMA GEMM with `G` in its epilogue, in the chunks of this layout.
    Wgmma(GColsLayout),
    /// A cuBLAS logits GEMM and `cce_split_gcols_*` per chunk of the plan's classes; why the
    /// epilogue does not apply.
    Cublas(String),
}

/// The paths of one call, decided before anything is launched.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Schedule {
    /// Which call.
    pub kind: CallKind,
    /// Split dense (a row pass then a class pass), else chunked dense.
    pub split: bool,
    /// The dense row kernels zero the entries under the filter threshold (chunked dense,
    /// filter on for both gradients).
    pub filtering: bool,
    /// The plan's sparse backward runs first (filtered split-dense calls with a backward).
    pub try_sparse: bool,
    /// Why a planned sparse backward is not tried, when it is not.
    pub sparse_note: Option<String>,
    /// The products add to the gradient outputs' contents (f32 outputs): beta = 1 for every
    /// `d_e` and `d_c` GEMM, `d_e` finished with `+=`, the `d_bias` output not zeroed.
    pub accumulate: bool,
    /// The cluster-fused row kernel: (cluster size, columns per block).
    pub fused: Option<(usize, usize)>,
    /// How the row pass stores `G` for `d_e` (`DenseConfig::g_mode`; 0 without a backward).
    pub g_mode: u8,
    /// The row pass's `d_e` product reads an f16 copy of bf16 `c` (f16 `G`), made before the
    /// row chunks unless the sparse backward ran to the end.
    pub c16_copy: bool,
    /// Forward-only calls: how the forward runs.
    pub forward: Option<ForwardPath>,
    /// The note of a forward-only call that did not take the row chunks.
    pub forward_note: Option<String>,
    /// Split dense's row pass of a forward-and-backward call: `Ok` through the WGMMA epilogue,
    /// `Err(why)` the cuBLAS row pass.
    pub row_wgmma: Option<std::result::Result<(), &'static str>>,
    /// Chunked dense's WGMMA row pass writes `G` as scaled f16 for the `d_c` product against
    /// an f16 copy of the chunk's `e`, then bf16 for `d_e` ([`DenseConfig::row_e16`]).
    pub row_g16: bool,
    /// Split dense's class pass (calls with a backward and `d_c`).
    pub class_pass: Option<ClassPath>,
}

/// The schedule of a `kind` call of `cfg` on `dev` with buffers `call`.
pub(crate) fn schedule(
    cfg: &DenseConfig,
    kind: CallKind,
    dev: &DeviceFacts,
    call: CallFacts,
) -> Schedule {
    let split = cfg.chunk_classes.is_some();
    let backward = kind.backward();
    // Split dense skips nothing (allowed: "an implementation may skip fewer"): its dense
    // GEMMs gain nothing from zeroed entries, and the threshold's histogram pass cost 3-7%
    // at the seed shape (docs/perf-log.md), so filtered calls run exactly like exact ones.
    let filtering = backward && cfg.filtering() && !split;
    let fused = if kind == CallKind::ForwardBackward && !split {
        fused_layout(cfg, dev)
    } else {
        None
    };
    let g_mode = if backward { cfg.g_mode() } else { 0 };
    let accumulate = backward && call.accumulate;
    let sparse_planned = backward && split && cfg.sparse.is_some() && cfg.filtering();
    let (forward, forward_note) = if kind == CallKind::Forward {
        match (
            wgmma_forward_rows(cfg, dev, call.scratch, call.aligned),
            cfg.class_forward,
        ) {
            (Ok(group), _) => (
                Some(ForwardPath::Wgmma { group }),
                Some(wgmma_forward_note(cfg, group, dev.sm_count)),
            ),
            (Err(_), Some(cf)) => (
                Some(ForwardPath::ClassTiles(cf)),
                Some(class_tiles_note(cfg, cf)),
            ),
            (Err(_), None) => (Some(ForwardPath::RowChunks), None),
        }
    } else {
        (None, None)
    };
    let row_wgmma = (kind == CallKind::ForwardBackward).then(|| {
        match wgmma_rows_unfit(cfg, dev, g_mode, call.aligned) {
            None => Ok(()),
            Some(why) => Err(why),
        }
    });
    let class_pass = (split && backward && cfg.compute_d_c).then(|| {
        match wgmma_gcols_classes(cfg, dev, call.scratch, call.aligned) {
            Ok(l) => ClassPath::Wgmma(l),
            Err(why) => ClassPath::Cublas(why),
        }
    });
    Schedule {
        kind,
        split,
        filtering,
        try_sparse: sparse_planned && !call.capturing && !accumulate,
        sparse_note: match (sparse_planned, call.capturing, accumulate) {
            (true, true, _) => Some(sparse_capture_note()),
            (true, false, true) => Some(sparse_accumulate_note()),
            _ => None,
        },
        accumulate,
        fused,
        g_mode,
        c16_copy: g_mode == 2 && cfg.dtype == DType::BF16,
        forward,
        forward_note,
        row_g16: !split && cfg.row_e16() && row_wgmma == Some(Ok(())),
        row_wgmma,
        class_pass,
    }
}

/// Why the WGMMA kernels (`kernels/wgmma.cu`) cannot run `cfg` over `cols` classes per
/// launch, for the conditions every one of them shares; `None` when they hold. `on`: the
/// path's switch; `aligned`: the inputs start on 16-byte boundaries.
pub(crate) fn wgmma_unfit(
    cfg: &DenseConfig,
    dev: &DeviceFacts,
    on: bool,
    aligned: bool,
    cols: usize,
) -> Option<&'static str> {
    let (n, d, v) = (cfg.n, cfg.d, cfg.v);
    Some(if !on {
        "switched off"
    } else if !dev.wgmma() {
        "not compute capability 9.0"
    } else if !matches!(cfg.dtype, DType::BF16 | DType::F16) {
        "dtype not bf16 / f16"
    } else if cfg.softcap.is_some_and(|s| s > WGMMA_SOFTCAP_MAX) {
        "softcap above 100 (the epilogue's tanh is exact to ~s·2⁻²¹)"
    } else if n == 0 || v == 0 || d == 0 {
        "an empty dimension"
    } else if !d.is_multiple_of(WGMMA_BK) {
        "D not a multiple of 64"
    } else if !aligned {
        "inputs not 16-byte aligned"
    } else if i32::try_from(n.div_ceil(WGMMA_BM) * cols.div_ceil(WGMMA_BN)).is_err()
        || i32::try_from(d).is_err()
        || i32::try_from(v).is_err()
    {
        "sizes past 32 bits"
    } else {
        return None;
    })
}

/// Rows per row group of the fused WGMMA forward (`kernels/wgmma.cu`) for `cfg`, with
/// `scratch` bytes for the float2 partials ([`forward_group_rows`]: all `N` rows when they
/// fit, else the fewest even groups of multiples of 128 rows). `Err(why)` when it does not
/// apply: switched off ([`DenseConfig::wgmma_forward`]), not compute capability 9.0, not bf16
/// / f16, a softcap above [`WGMMA_SOFTCAP_MAX`], label smoothing, entropy or argmax, `D` not a
/// multiple of 64, inputs not 16-byte aligned, sizes past 32 bits, or less scratch than 128
/// rows need ([`wgmma_unfit`] holds the shared conditions).
pub(crate) fn wgmma_forward_rows(
    cfg: &DenseConfig,
    dev: &DeviceFacts,
    scratch: usize,
    aligned: bool,
) -> std::result::Result<usize, String> {
    let (n, v) = (cfg.n, cfg.v);
    let why = if let Some(why) = wgmma_unfit(cfg, dev, cfg.wgmma_forward, aligned, v) {
        why
    } else if cfg.label_smoothing != 0.0 {
        "label smoothing"
    } else if cfg.want_entropy || cfg.want_argmax {
        "entropy / argmax requested"
    } else {
        let group = forward_group_rows(n, v, scratch);
        if group > 0 && i32::try_from(group).is_ok() {
            return Ok(group);
        }
        "scratch holds the partials of fewer than 128 rows"
    };
    Err(why.to_string())
}

/// Why the dense row pass (split or chunked dense) cannot take the WGMMA epilogue (`cce_wgmma_lseq*` and
/// `cce_wgmma_qrows_g*`, [`DenseConfig::wgmma_rows`]) for `cfg` with the row pass's `G` mode
/// `g_mode`; `None` when it can. Besides [`wgmma_unfit`]'s conditions: bf16 inputs only (f16
/// `G` would round twice), a softcap of at least [`WGMMA_ROWS_SOFTCAP_MIN`], `G` in the input
/// dtype (`g_mode` 0: not the f16 `G` of a budget with an f16 copy of `c`), no label smoothing
/// (the combine has no `Σz`), no entropy or argmax, and at most 65535·8 class tiles (the `G`
/// pass's grid). The caller checks the call (forward and backward in one call).
pub(crate) fn wgmma_rows_unfit(
    cfg: &DenseConfig,
    dev: &DeviceFacts,
    g_mode: u8,
    aligned: bool,
) -> Option<&'static str> {
    if let Some(why) = wgmma_unfit(cfg, dev, cfg.wgmma_rows, aligned, cfg.v) {
        return Some(why);
    }
    Some(if cfg.dtype != DType::BF16 {
        "f16 inputs (the G pass writes bf16 G)"
    } else if cfg.softcap.is_some_and(|s| s < WGMMA_ROWS_SOFTCAP_MIN) {
        "softcap under 1 (the G pass's softcap factor comes from the bf16 e^(z - max), which \
         loses its relative accuracy where |x| is many times the cap)"
    } else if g_mode != 0 {
        "f16 G for d_e (the budget's f16 copy of c)"
    } else if cfg.label_smoothing != 0.0 {
        "label smoothing"
    } else if cfg.want_entropy || cfg.want_argmax {
        "entropy / argmax requested"
    } else if cfg.v.div_ceil(WGMMA_BN).div_ceil(8) > 65535 {
        "V past the G pass's grid"
    } else {
        return None;
    })
}

/// Chunks of split dense's class pass through the WGMMA `G` epilogue
/// (`cce_wgmma_gcols[_cap]_*`) in a scratch buffer of `scratch` bytes (the workspace's,
/// [`DenseConfig::scratch_bytes`]): its layout, [`DenseConfig::gcols_layout`] (the f16 `G` of
/// up to `classes` classes at byte 0, the f16 copy of `e` and the f32 `d_c` temp of
/// `dc_classes` classes at the end). `Err` says why the epilogue does not apply: switched off
/// ([`DenseConfig::wgmma_gcols`]), not compute capability 9.0, f32 inputs, a softcap above
/// [`WGMMA_SOFTCAP_MAX`], an empty dimension, `D` not a multiple of 64, unaligned inputs or
/// sizes past 32 bits (the tile count of a chunk included), a scratch too small for the
/// layout, chunks under one 256-class tile. (No `τ`: split dense's row pass never filters, so
/// `τ = 0`.)
pub(crate) fn wgmma_gcols_classes(
    cfg: &DenseConfig,
    dev: &DeviceFacts,
    scratch: usize,
    aligned: bool,
) -> std::result::Result<GColsLayout, String> {
    let (n, v) = (cfg.n, cfg.v);
    let layout = cfg.gcols_layout(scratch);
    let kw = layout.map_or(0, |l| l.classes);
    let why = if let Some(why) = wgmma_unfit(cfg, dev, cfg.wgmma_gcols, aligned, kw) {
        why
    } else if i32::try_from(n).is_err() {
        "sizes past 32 bits"
    } else if let Some(l) = layout {
        if kw < v && kw < WGMMA_BN {
            "class chunk under one 256-class tile"
        } else {
            return Ok(l);
        }
    } else {
        "scratch too small for the G chunk, the f16 copy of e and the d_c temp"
    };
    Err(why.to_string())
}

/// Cluster size and slice (columns per block) of the fused row kernel, or `None` when it does
/// not apply (not asked, not Hopper, or the row does not fit 16 blocks' shared memory).
pub(crate) fn fused_layout(cfg: &DenseConfig, dev: &DeviceFacts) -> Option<(usize, usize)> {
    let RowPass::Fused { cluster } = cfg.row_pass else {
        return None;
    };
    if !dev.fused_kernels() {
        return None;
    }
    let max_dyn = dev.max_smem_optin.saturating_sub(dev.fused_static_smem);
    let slice_of = |cs: usize| cfg.v.div_ceil(cs).div_ceil(4) * 4;
    let fits = |cs: usize| slice_of(cs) * 4 <= max_dyn;
    let cs = match cluster {
        Some(cs) if CLUSTER_SIZES.contains(&cs) && fits(cs) => cs,
        Some(_) => return None,
        None => {
            let want = CLUSTER_SIZES
                .iter()
                .copied()
                .find(|&cs| slice_of(cs) * 4 <= FUSED_TARGET_SMEM_BYTES);
            match want {
                Some(cs) => cs,
                None => CLUSTER_SIZES.iter().copied().find(|&cs| fits(cs))?,
            }
        }
    };
    Some((cs, slice_of(cs)))
}

/// The note of the fused WGMMA forward in row groups of `group` rows: the largest persistent
/// grid is the first group's (it has the most rows).
pub(crate) fn wgmma_forward_note(cfg: &DenseConfig, group: usize, sm_count: usize) -> String {
    let n_tiles = cfg.v.div_ceil(WGMMA_BN);
    let grid_max = (group.min(cfg.n).div_ceil(WGMMA_BM) * n_tiles).min(sm_count.max(1));
    format!(
        "forward: WGMMA GEMM with the lse in its epilogue ({} row group(s) of up to {} rows x \
         {n_tiles} class tile(s) of {WGMMA_BN}, {grid_max} persistent blocks), a combine pass \
         per row group",
        cfg.n.div_ceil(group),
        group.min(cfg.n),
    )
}

/// The note of the forward over the plan's class tiles.
pub(crate) fn class_tiles_note(cfg: &DenseConfig, cf: cce_core::ClassForward) -> String {
    let (n, v) = (cfg.n, cfg.v);
    format!(
        "forward: {} GEMM tile(s) of {} rows x {} classes through two buffers, row reductions on a second stream",
        n.div_ceil(cf.rows) * v.div_ceil(cf.classes),
        cf.rows.min(n),
        cf.classes.min(v)
    )
}

/// The note of split dense's row pass in a forward-and-backward call: through the WGMMA
/// epilogue over `wg_chunks` chunks of up to `rows` rows, or the cuBLAS row pass and why.
pub(crate) fn row_pass_note(
    verdict: std::result::Result<(), &'static str>,
    wg_chunks: usize,
    rows: usize,
) -> String {
    match verdict {
        Ok(()) => format!(
            "row pass: WGMMA GEMM with the lse partials and bf16 e^(z - max) in its \
             epilogue, then G in place ({wg_chunks} chunk(s) of up to {rows} rows, no f32 \
             logits in memory)"
        ),
        Err(why) => format!(
            "row pass: cuBLAS f32 logits, forward and backward row kernels (no WGMMA \
             epilogue: {why})"
        ),
    }
}

impl ClassPath {
    /// Classes per chunk, `G`'s row stride in elements of the class pass's dtype, classes per
    /// `d_c` GEMM: the layout's through the WGMMA epilogue; else the plan's chunk (`kmax`),
    /// `ldg` ([`DenseConfig::ld_classes`] in elements), one `d_c` GEMM per chunk.
    pub fn steps(&self, kmax: usize, ldg: usize) -> (usize, usize, usize) {
        match self {
            ClassPath::Wgmma(l) => (l.classes, l.ldg, l.dc_classes),
            ClassPath::Cublas(_) => (kmax, ldg, kmax),
        }
    }

    /// The note of the class pass ([`DenseStats::class_pass`]); `kmax` the plan's chunk of
    /// classes (clamped to `1..=V`).
    pub fn note(&self, cfg: &DenseConfig, kmax: usize) -> String {
        let v = cfg.v;
        match self {
            ClassPath::Wgmma(l) => format!(
                "class pass: WGMMA GEMM with G in its epilogue ({} chunk(s) of up to {} \
                 classes, d_c in sub-chunks of up to {} classes, f16 G, no logits in memory)",
                v.div_ceil(l.classes),
                l.classes,
                l.dc_classes
            ),
            ClassPath::Cublas(why) => format!(
                "class pass: cuBLAS logits then G ({} chunk(s) of up to {} classes; no \
                 WGMMA epilogue: {why})",
                v.div_ceil(kmax),
                kmax.min(v)
            ),
        }
    }
}

/// The note of a sparse backward that ran: `kept` entries over `n` rows.
pub(crate) fn sparse_used_note(kept: u64, n: usize) -> String {
    format!(
        "sparse backward: {kept} kept entries ({:.1} per row), one logits GEMM",
        kept as f64 / n as f64
    )
}

/// Why a capturing call skips the planned sparse backward: its choice between the sparse and
/// the dense products reads the kept-entry count back, which a graph cannot.
pub(crate) fn sparse_capture_note() -> String {
    "dense passes: the stream is capturing a CUDA graph, and the sparse backward's choice \
     reads the kept-entry count on the host"
        .into()
}

/// Why a capturing filtered call runs on the exact call's plan from the start: a call that is
/// not captured would run it after its sparse backward gave way
/// ([`super::call_plan::give_way_plan`]), and the capture cannot read that verdict.
pub(crate) fn give_way_capture_note() -> String {
    "the stream is capturing a CUDA graph, where the sparse backward's choice (it reads the \
     kept-entry count on the host) cannot run, so the call ran on the exact call's plan, which \
     a call that is not captured takes when the sparse backward gives way"
        .into()
}

/// Why an accumulating call skips the planned sparse backward: its gather kernels write the
/// gradients (they do not add to them), so the dense passes, which do, run instead.
pub(crate) fn sparse_accumulate_note() -> String {
    "dense passes: the call accumulates into the gradient outputs, which the sparse \
     backward's gather kernels overwrite"
        .into()
}

/// The note of a sparse backward that gave way to the dense passes (`reused`: they start from
/// its first chunk's logits).
pub(crate) fn sparse_gave_way_note(why: &str, reused: bool) -> String {
    format!(
        "dense passes{}: {why}",
        if reused {
            " (the first chunk's logits reused)"
        } else {
            ""
        }
    )
}

/// The note of a sparse backward that gave way in a call that then runs again on the exact
/// call's plan ([`super::call_plan::give_way_plan`]).
pub(crate) fn sparse_gave_way_stop_note(why: &str) -> String {
    format!("the sparse backward gave way ({why}), so the call ran again on the exact call's plan")
}

/// Whether the sparse backward's first chunk may reuse its logits in the dense passes: they
/// sit at the start of the scratch, where the row pass's are unless an f16 copy of `c` comes
/// first (`layout_logits` > 0), and the probe's rows fit one row chunk.
pub(crate) fn reuse_probe_rows(layout_logits: usize, rows: usize, chunk: usize) -> usize {
    if layout_logits == 0 && rows <= chunk {
        rows
    } else {
        0
    }
}

/// How the sparse backward goes on after its probe chunk.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct AfterProbe {
    /// Rows per chunk from the second chunk on.
    pub chunk: usize,
    /// Pair capacity of those chunks.
    pub cap: u64,
    /// `d_e` in one launch after the row pass (peaked data) instead of per chunk.
    pub defer_d_e: bool,
}

/// The sparse backward's verdict after its probe of `rows` rows, which kept `pairs` entries
/// (`over`: a row's pairs overflowed the capacity `cap`): go on (chunk sizes), or why the
/// dense passes run instead.
pub(crate) fn probe_verdict(
    cfg: &DenseConfig,
    sp: &cce_core::SparseBackward,
    rows: usize,
    (pairs, over, cap): (u64, bool, u64),
) -> std::result::Result<AfterProbe, String> {
    let (n, v) = (cfg.n, cfg.v);
    let mean = pairs as f64 / rows as f64;
    if over {
        return Err(format!(
            "the first {rows} rows' pairs overflowed the sparse capacity of {cap}"
        ));
    }
    if mean > sp.max_mean_kept as f64 {
        return Err(format!(
            "the first {rows} rows keep {mean:.0} entries per row (filter threshold at dropped mass {:.0e}), above the {} where the sparse products stop paying",
            cfg.filter.max_dropped_mass, sp.max_mean_kept
        ));
    }
    // Grow the chunks to what the density leaves room for.
    let chunk = sp.rows_after_probe(pairs, n, v);
    let cap = sp.capacity(chunk, v) as u64;
    if mean * n as f64 > cap as f64 {
        return Err(format!(
            "the first {rows} rows keep {mean:.0} entries per row; all {n} rows would need about {:.0} pairs, over the sparse capacity of {cap}",
            mean * n as f64
        ));
    }
    Ok(AfterProbe {
        chunk,
        cap,
        defer_d_e: sp.defer_d_e(mean * n as f64, v),
    })
}

/// Why the sparse backward gives way after its row pass: the pairs outgrew `cap`.
pub(crate) fn pairs_outgrew_note(cap: u64, pairs: u64) -> String {
    format!("the pairs outgrew the sparse capacity of {cap} after the first chunk ({pairs} asked)")
}

/// Whether the sparse backward folds the forward rows into its select kernel
/// (`cce_sparse_select_fwd_*`): a forward call that wants only lse and loss of them (no
/// entropy or argmax output, no label smoothing), the 512-thread select, the switch on.
pub(crate) fn fold_forward(
    forward: bool,
    sel_threads: u32,
    (entropy, argmax, alpha): (bool, bool, f32),
    switch: bool,
) -> bool {
    forward && sel_threads == SEL_THREADS && !entropy && !argmax && alpha == 0.0 && switch
}

/// Whether the chunks after the probe stay folded: unless most of its rows had to be re-read
/// (their candidates against the running max did not fit; the forward rows and select apart
/// then read each row twice instead of three times) or it kept more than [`FOLD_MAX_KEPT`]
/// entries per row.
pub(crate) fn fold_after_probe(fold: bool, reread: u32, rows: usize, pairs: u64) -> bool {
    fold && (reread as usize) * 4 <= rows && (pairs as f64) <= FOLD_MAX_KEPT * rows as f64
}

/// Whether the sparse backward zeroes `d_c` (and `d_bias`) with a memset before its gathers:
/// where most classes have no record (`pairs` < `V`); else the light gather writes the
/// classes without records as zeros.
pub(crate) fn dc_zero_by_memset(pairs: u64, v: usize) -> bool {
    pairs < v as u64
}

/// Threads of a select block: 256 when the switch asks for them, else [`SEL_THREADS`].
pub(crate) fn select_threads(switch: u32) -> u32 {
    if switch == 256 {
        256
    } else {
        SEL_THREADS
    }
}

/// The engine's configuration of a backend call: the plan's, with the call's path switches
/// (`d_c` in the gradient dtype where [`super::call_plan::dc_in_grad_dtype`] holds);
/// a forward-only call (`backward` false) within [`forward_workspace_cap`]
/// ([`DenseConfig::forward_only`]: no gradient buffers, no sparse backward), a call with a
/// backward without the class tiles (none of their buffers).
///
/// Errors: `ResourceLimit` when its workspace and the cuBLAS workspace exceed the budget
/// ([`DenseConfig::check_budget`]; the plan leaves room for it, so only where one row of
/// logits beside the per-row buffers does not fit).
pub(crate) fn dense_config(
    plan: &Plan,
    opts: &cce_core::Options,
    switches: PathSwitches,
    backward: bool,
) -> Result<DenseConfig> {
    let mut cfg = DenseConfig::from_plan(plan, opts)?;
    cfg.wgmma_forward = switches.wgmma_forward;
    cfg.wgmma_gcols = switches.wgmma_gcols;
    cfg.wgmma_rows = switches.wgmma_rows;
    cfg.dc_in_grad_dtype = backward
        && cfg.chunk_classes.is_none()
        && super::call_plan::dc_in_grad_dtype(&plan.problem, opts, switches.dc_in_grad_dtype);
    let budget = opts.workspace_budget_bytes;
    let cfg = if backward {
        cfg.class_forward = None;
        cfg
    } else {
        cfg.forward_only(budget)
    };
    cfg.check_budget(budget)?;
    Ok(cfg)
}

/// The limits the backend plans with on a device called `name` with `total_mem` bytes and
/// `smem_optin` bytes of shared memory per block: both dense strategies, class tiles for
/// forward-only calls, 64-bit element offsets.
pub(crate) fn device_limits(name: &str, total_mem: u64, smem_optin: u64) -> cce_core::DeviceLimits {
    cce_core::DeviceLimits {
        name: name.to_string(),
        max_buffer_bytes: total_mem,
        max_block_memory_bytes: smem_optin,
        max_threads_per_block: crate::backend::NTHREADS,
        max_grid: [i32::MAX as u32, 65535, 65535],
        // Kernels index elements with 64-bit offsets; rows and classes are 32-bit.
        index_bits: 64,
        tile: cce_core::TileShape {
            rows: crate::backend::TILE_ROWS,
            classes: crate::backend::TILE_CLASSES,
            depth: 32,
        },
        strategies: vec![StrategyKind::ChunkedDense, StrategyKind::SplitDense],
        // Forward-only calls of the dense strategies run over class tiles.
        class_forward: true,
    }
}

#[cfg(test)]
#[path = "schedule_tests.rs"]
mod tests;
