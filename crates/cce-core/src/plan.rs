//! The blocking plan: how a call is cut into chunks, tiles and passes. Pure data, computed from
//! the problem, the options, the device limits and the memory budget; backends follow it and
//! never invent tile sizes, so the CPU reference runs the very plan a GPU runs.
//!
//! Vocabulary: a **tile** is a sub-matrix of the logits (`tile.rows x tile.classes`); a
//! **block** is a thread block / workgroup of a backend. A **chunk** is a range of rows or of
//! classes processed as one unit so that buffers fit the device and accumulators fit the budget.
//!
//! Strategies (PERFORMANCE.md, "Design space"):
//! - [`Strategy::TileOwnership`]: forward = online log-sum-exp over class tiles per row tile
//!   (paper section 4.2), partial `(max, sum)` per class chunk merged in a fixed order; backward
//!   recomputes logits tiles (paper section 4.3) in a row-owned pass for `d_e` (one block owns a
//!   row tile and loops over all classes) and a class-owned pass for `d_c`/`d_bias`; with the
//!   filter on, a threshold pass builds each row's histogram first. No float atomics, bitwise
//!   deterministic; f32 accumulators per row chunk / class chunk.
//! - [`Strategy::ChunkedDense`]: per chunk of rows, the logits are materialized in an f32
//!   workspace (`chunk_rows x V`), then lse, thresholds and `G` in one memory pass, then
//!   `d_e = G·C` and `d_c += Gᵀ·E` as GEMMs. 3 GEMMs, no recompute; needs `chunk_rows·V·4`
//!   bytes plus a `V·D·4` f32 `d_c` accumulator (unless gradients are f32).
//! - [`Strategy::SplitDense`]: two dense passes that need no accumulator across chunks, so
//!   they fit a small budget. Row pass, per chunk of rows: logits `[chunk_rows, V]`
//!   materialized, lse, thresholds and `G`, then `d_e = G·C` complete for those rows. Class
//!   pass, per chunk of classes: the logits `[N, chunk_classes]` recomputed, `G` again (from the
//!   saved lse and thresholds), then `d_c = Gᵀ·E` complete for those classes. 4 GEMMs (one
//!   recompute, PERFORMANCE.md "Design space" 2), workspace
//!   `max(chunk_rows·V, N·chunk_classes)·4` bytes plus, with bf16 inputs, an f16 copy of `e`
//!   for the `d_c` product (`N·D·2`).
//! - [`SparseBackward`], an attempt before split dense's backward when the filter is on
//!   (PERFORMANCE.md "Design space" 4): the row pass keeps, per row, only the entries with
//!   `g0_ij ≥ τ_i` (the filter rule's threshold, so the dropped mass is `≤ δ` per row) as
//!   `(class, G)` pairs; `d_e` gathers rows of `C`, `d_c` gathers rows of `E` after the pairs
//!   are regrouped by class. One logits GEMM in all, no recompute. It gives way to the dense
//!   passes when the first row chunk keeps more entries per row than pays
//!   ([`SPARSE_PAY_DIVISOR`]) or the pairs outgrow their capacity.

use crate::dtype::DType;
use crate::error::{CceError, Result};
use crate::filter::{FilterRule, N_BINS};
use crate::options::{GradDType, Options};
use crate::problem::Problem;
use std::fmt;
use std::ops::Range;

mod subplans;
pub use subplans::{
    ClassForward, SparseBackward, CLASS_FORWARD_MIN_CLASSES, CLASS_FORWARD_STATE_BYTES,
    SPARSE_MIN_PAIRS_PER_ROW, SPARSE_PAY_DIVISOR, SPARSE_PROBE_ROWS,
};

/// Which strategies a backend implements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StrategyKind {
    /// See [`Strategy::TileOwnership`].
    TileOwnership,
    /// See [`Strategy::ChunkedDense`].
    ChunkedDense,
    /// See [`Strategy::SplitDense`].
    SplitDense,
}

/// The chosen strategy with its parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strategy {
    /// Recomputing tile-owned forward/backward (module docs).
    TileOwnership,
    /// Row-chunked materialized logits (module docs).
    ChunkedDense {
        /// Rows per chunk (a multiple of the tile rows, but at most `N`: a problem of fewer
        /// rows than a tile is one chunk of all its rows, and its label says so).
        chunk_rows: usize,
    },
    /// A row pass for `d_e` and a class pass for `d_c`, each complete per chunk (module docs).
    SplitDense {
        /// Rows per chunk of the row pass (a multiple of the tile rows, but at most `N`).
        chunk_rows: usize,
        /// Classes per chunk of the class pass (a multiple of the tile classes, at most
        /// [`SPLIT_DENSE_MAX_CLASSES`]).
        chunk_classes: usize,
        /// The row pass's `d_e = G·C` from f16 `G` (scaled per row) and `c` in f16 (the input
        /// for f16, an f16 copy for bf16: `V·D·2` bytes); false: `G` in the input dtype (bf16 or
        /// f32), one GEMM either way.
        de_f16: bool,
    },
}

/// Largest class chunk of [`Strategy::SplitDense`]: the range measured on the H200 (BENCHMARKS.md
/// "CUDA split dense"). The CUDA class-pass kernel held a whole chunk row in registers (256
/// threads x 16 values) until session 5; it now streams rows of any length, so the cap is a
/// tuning bound, not a kernel limit.
pub const SPLIT_DENSE_MAX_CLASSES: usize = 4096;

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Strategy::TileOwnership => write!(f, "tile-ownership"),
            Strategy::ChunkedDense { chunk_rows } => write!(f, "chunked-dense({chunk_rows} rows)"),
            Strategy::SplitDense {
                chunk_rows,
                chunk_classes,
                de_f16,
            } => write!(
                f,
                "split-dense({chunk_rows}-row chunks for d_e{}, {chunk_classes}-class chunks for d_c)",
                if *de_f16 { " with f16 G" } else { "" }
            ),
        }
    }
}

/// Shape of a logits tile and of the depth step along `D`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TileShape {
    /// Rows (tokens) per tile.
    pub rows: usize,
    /// Classes per tile.
    pub classes: usize,
    /// Step along `D` per inner iteration (staged through fast memory).
    pub depth: usize,
}

/// Hardware facts a backend reports; the plan derives everything else from them.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceLimits {
    /// Device name (for reports).
    pub name: String,
    /// Largest single buffer (binding) in bytes.
    pub max_buffer_bytes: u64,
    /// Fast on-chip memory per block (shared / workgroup memory) in bytes.
    pub max_block_memory_bytes: u64,
    /// Threads per block.
    pub max_threads_per_block: u32,
    /// Largest grid (blocks) per dimension.
    pub max_grid: [u32; 3],
    /// Element indices within one buffer must stay below `2^(index_bits − 1)` (32 on GPUs).
    pub index_bits: u32,
    /// Tile shape the backend's kernels are written for (fixed at compile time of the kernels).
    pub tile: TileShape,
    /// Strategies the backend implements, in order of preference.
    pub strategies: Vec<StrategyKind>,
    /// Whether the backend runs forward-only calls of the dense strategies over
    /// [`ClassForward`] tiles (then the plan sets [`Plan::forward`]).
    pub class_forward: bool,
}

impl DeviceLimits {
    /// Check the values the plan divides by, shifts by or iterates over: every tile dimension
    /// and `index_bits` at least 1, at least one strategy. (Sizes too small for one tile, a zero
    /// buffer or grid, are `ResourceLimit` from [`Plan::new`].)
    ///
    /// Errors: `InvalidOption { name: "DeviceLimits::<field>", .. }`, e.g. for a hand-built
    /// `DeviceLimits` given to `CpuBackend::with_limits`.
    pub fn validate(&self) -> Result<()> {
        let bad =
            |name: &'static str, reason: String| Err(CceError::InvalidOption { name, reason });
        let TileShape {
            rows,
            classes,
            depth,
        } = self.tile;
        if rows == 0 || classes == 0 || depth == 0 {
            return bad(
                "DeviceLimits::tile",
                format!(
                    "{}: every tile dimension must be >= 1, got {rows} rows x {classes} classes x {depth} depth",
                    self.name
                ),
            );
        }
        if self.index_bits == 0 {
            return bad(
                "DeviceLimits::index_bits",
                format!("{}: must be >= 1, got 0", self.name),
            );
        }
        if self.strategies.is_empty() {
            return bad(
                "DeviceLimits::strategies",
                "the backend lists no strategy".into(),
            );
        }
        Ok(())
    }

    /// Limits of the CPU reference: 64-bit indices, 1 TiB buffers, both strategies.
    pub fn cpu() -> Self {
        Self {
            name: "cpu".into(),
            max_buffer_bytes: 1 << 40,
            max_block_memory_bytes: 1 << 20,
            max_threads_per_block: 1,
            max_grid: [u32::MAX; 3],
            index_bits: 64,
            tile: TileShape {
                rows: 64,
                classes: 256,
                depth: 64,
            },
            strategies: vec![StrategyKind::ChunkedDense, StrategyKind::TileOwnership],
            class_forward: false,
        }
    }
}

/// One pass over the problem, in execution order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    /// Forward: lse, target logit, loss, side outputs.
    Forward,
    /// Backward, filter on: per-row histogram of `g0` and threshold `τ_i`.
    Threshold,
    /// Backward: `d_e`, row-owned.
    BackwardDe,
    /// Backward: `d_c` and `d_bias`, class-owned.
    BackwardDc,
}

/// A logits tile: a range of rows and a range of classes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tile {
    /// Rows of the tile.
    pub rows: Range<usize>,
    /// Classes of the tile.
    pub classes: Range<usize>,
}

/// The blocking plan of one call.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// The validated problem.
    pub problem: Problem,
    /// The strategy.
    pub strategy: Strategy,
    /// Logits tile shape.
    pub tile: TileShape,
    /// Row chunks (cover `0..N` in order, disjoint, each a multiple of `tile.rows` but the last).
    pub row_chunks: Vec<Range<usize>>,
    /// Class chunks (cover `0..V` likewise with `tile.classes`).
    pub class_chunks: Vec<Range<usize>>,
    /// Passes of a forward+backward call, in order (a forward-only call runs the first).
    pub passes: Vec<Pass>,
    /// Extra device memory the call uses beyond inputs and outputs, bytes.
    pub workspace_bytes: u64,
    /// The resolved filter rule.
    pub filter: FilterRule,
    /// A sparse backward to try before the strategy's dense one (split dense with the filter
    /// on for both gradients, no label smoothing, not deterministic), or `None`.
    pub sparse: Option<SparseBackward>,
    /// How forward-only calls of the dense strategies tile the logits, or `None` (they use
    /// the row chunks).
    pub forward: Option<ClassForward>,
    /// Why this strategy and these chunks were chosen (for reports).
    pub reason: String,
}

fn div_ceil(a: usize, b: usize) -> usize {
    a.div_ceil(b)
}

fn split(total: usize, chunk: usize) -> Vec<Range<usize>> {
    (0..div_ceil(total, chunk))
        .map(|i| i * chunk..((i + 1) * chunk).min(total))
        .collect()
}

/// Largest multiple of `unit` that is `<= cap` (at least `unit`), and at most `total` rounded up.
fn fit(cap: u64, unit: usize, total: usize) -> usize {
    let m = (cap / unit as u64).max(1) as usize * unit;
    m.min(div_ceil(total, unit) * unit)
}

impl Plan {
    /// Compute the plan within `opts.workspace_budget_bytes` (all of it: a backend whose GEMM
    /// library holds device memory of its own, such as cuBLAS's workspace, plans with the
    /// budget less that).
    ///
    /// Errors: `ResourceLimit` when even one tile's chunk does not fit `limits` or the budget;
    /// `InvalidOption` for degenerate `limits` ([`DeviceLimits::validate`]: a zero tile
    /// dimension or `index_bits`, no strategy).
    pub fn new(problem: &Problem, opts: &Options, limits: &DeviceLimits) -> Result<Self> {
        limits.validate()?;
        let filter = FilterRule::resolve(opts, problem.dtype);
        let tile = limits.tile;
        let (n, v, d) = (problem.n, problem.v, problem.d);
        let grads_f32 = opts.grad_dtype == GradDType::F32 || problem.dtype == DType::F32;
        let idx_cap = if limits.index_bits >= 64 {
            u64::MAX
        } else {
            (1u64 << (limits.index_bits - 1)) - 1
        };
        // Per-row and per-chunk bookkeeping, O(N).
        let row_state_bytes = |class_chunks: usize| -> u64 {
            let hist = if filter.enabled { N_BINS as u64 * 4 } else { 0 };
            n as u64 * (8 * class_chunks as u64 + 24 + hist)
        };
        // Buffers of one row chunk / class chunk must fit the device's binding and indexing.
        let row_elem_bytes = (d as u64) * 4; // an f32 [rows, D] accumulator row is the widest
        let class_elem_bytes = (d as u64) * 4;
        let rows_cap = (limits.max_buffer_bytes / row_elem_bytes).min(idx_cap / d as u64);
        let classes_cap = (limits.max_buffer_bytes / class_elem_bytes).min(idx_cap / d as u64);
        if rows_cap < tile.rows as u64 || classes_cap < tile.classes as u64 {
            return Err(CceError::ResourceLimit {
                resource: format!("buffer bytes for one tile of D = {d} on {}", limits.name),
                requested: (tile.rows.max(tile.classes) as u64) * row_elem_bytes,
                max: limits.max_buffer_bytes,
            });
        }
        // The grid of one chunk: (class tiles, row tiles).
        let grid_rows_cap = limits.max_grid[1] as u64 * tile.rows as u64;
        let grid_classes_cap = limits.max_grid[0] as u64 * tile.classes as u64;
        let rows_cap = rows_cap.min(grid_rows_cap);
        let classes_cap = classes_cap.min(grid_classes_cap);
        let budget = opts.workspace_budget_bytes;
        let mut why = Vec::new();
        let mut tile_ownership_least = None;
        for kind in &limits.strategies {
            match kind {
                StrategyKind::ChunkedDense => {
                    let dc_acc = if grads_f32 {
                        0
                    } else {
                        v as u64 * d as u64 * 4
                    };
                    let fixed = dc_acc + row_state_bytes(1);
                    if fixed >= budget {
                        why.push(format!(
                            "chunked-dense needs {} B for the f32 d_c accumulator and row state, over the budget of {budget} B",
                            fixed
                        ));
                        continue;
                    }
                    let per_row = v as u64 * 4;
                    let cap = ((budget - fixed) / per_row)
                        .min(rows_cap)
                        .min(idx_cap / v as u64)
                        .min(limits.max_buffer_bytes / per_row);
                    if cap < tile.rows as u64 {
                        why.push(format!(
                            "chunked-dense: budget {budget} B leaves room for {cap} rows of logits, under one tile of {} rows",
                            tile.rows
                        ));
                        continue;
                    }
                    // Chunks of at least 1024 rows keep the d_c update compute-bound (PERFORMANCE.md).
                    // At most N: `fit` rounds up to whole tiles, which a short problem does not
                    // fill (N = 5 is one chunk of 5 rows, not of 64).
                    let chunk_rows = fit(cap, tile.rows, n).min(n);
                    let row_chunks = split(n, chunk_rows);
                    let class_chunks = split(v, fit(classes_cap, tile.classes, v));
                    let workspace_bytes =
                        fixed + (chunk_rows as u64) * per_row + row_state_bytes(class_chunks.len())
                            - row_state_bytes(1);
                    let plan = Self::finish(
                        problem,
                        Strategy::ChunkedDense { chunk_rows },
                        tile,
                        row_chunks,
                        class_chunks,
                        workspace_bytes,
                        filter,
                        format!(
                            "chunked-dense: {chunk_rows}-row logits chunk ({} B) and d_c accumulator ({dc_acc} B) fit the budget of {budget} B",
                            chunk_rows as u64 * per_row
                        ),
                    );
                    let scratch = chunk_rows * SparseBackward::ld(v) * 4;
                    return Ok(plan.with_class_forward(scratch, budget, limits));
                }
                StrategyKind::SplitDense => {
                    // The sparse backward's own state: row offsets and counts [N] u32 each,
                    // the tile statistics' flags, a counter.
                    let sparse_ok = filter.filter_e_grad
                        && filter.filter_c_grad
                        && opts.label_smoothing == 0.0
                        && !opts.deterministic;
                    let sparse_fixed = if sparse_ok {
                        8 * n as u64
                            + 4 * (div_ceil(n, tile.rows) as u64 * div_ceil(v, tile.classes) as u64)
                            + 256
                    } else {
                        0
                    };
                    // Row state as for chunked dense, plus τ_i [N] f32 and a d_bias f32 [V].
                    let fixed = row_state_bytes(1) + n as u64 * 4 + v as u64 * 4 + sparse_fixed;
                    let room = budget.saturating_sub(fixed);
                    let dt = problem.dtype;
                    let ld_v = v.div_ceil(8) as u64 * 8;
                    let ld_of = |cols: usize| cols.div_ceil(8) as u64 * 8 * 4;
                    // Row pass: the logits rows; with f16 G for d_e (f16 inputs, or bf16 with
                    // an f16 copy of c, V·D·2 bytes) also f32 d_e rows and a scale per row.
                    // Without the copy, bf16 inputs take bf16 G (8 significand bits instead of
                    // 11, as a materialized bf16 computation).
                    let row_pass = |de_f16: bool| -> (u64, u64) {
                        let mut unit = ld_v * 4;
                        let mut once = 0;
                        let f16_g = dt == DType::F16 || (dt == DType::BF16 && de_f16);
                        if opts.compute_d_e && f16_g {
                            unit += d as u64 * 4 + 4;
                            if dt == DType::BF16 {
                                once = v as u64 * d as u64 * 2;
                            }
                        }
                        (unit, once)
                    };
                    let rows_for = |(unit, once): (u64, u64)| -> u64 {
                        (room.saturating_sub(once) / unit)
                            .min(rows_cap)
                            .min(idx_cap / ld_v)
                            .min(limits.max_buffer_bytes / (ld_v * 4))
                    };
                    // Prefer f16 G for d_e when its copy of c leaves at least 1024 rows (or N).
                    let de_f16 = dt == DType::F16
                        || (dt == DType::BF16 && rows_for(row_pass(true)) >= 1024.min(n) as u64);
                    let (row_unit, row_once) = row_pass(de_f16);
                    let row_cap = rows_for((row_unit, row_once));
                    // Class pass: the logits of every row for a chunk of classes; bf16 inputs
                    // add an f16 copy of e and an f32 d_c chunk (no f16 x f16 -> bf16 GEMM).
                    let e16 = if dt == DType::BF16 && opts.compute_d_c {
                        n as u64 * d as u64 * 2
                    } else {
                        0
                    };
                    let dc_tmp_per_class = if e16 > 0 && !grads_f32 {
                        d as u64 * 4
                    } else {
                        0
                    };
                    let class_cap = (room.saturating_sub(e16) / (n as u64 * 4 + dc_tmp_per_class))
                        .min(SPLIT_DENSE_MAX_CLASSES as u64)
                        .min(classes_cap)
                        .min(idx_cap / (n as u64 * 8))
                        .min(limits.max_buffer_bytes / (n as u64 * 8))
                        // The logits rows are ⌈k/8⌉·8 f32 wide: a chunk of under 8 classes
                        // still takes 32 bytes per row (proptest: N = 161, V = 1, 4 KiB).
                        .min(limits.max_buffer_bytes / (n as u64 * 32) * 8);
                    let min_rows = tile.rows.min(n) as u64;
                    let min_classes = tile.classes.min(v) as u64;
                    if row_cap < min_rows || class_cap < min_classes {
                        why.push(format!(
                            "split-dense: budget {budget} B leaves room for {row_cap} logits rows of V = {v} and {class_cap} classes of N = {n}, under one tile"
                        ));
                        continue;
                    }
                    let chunk_rows = fit(row_cap, tile.rows, n).min(n);
                    let chunk_classes = fit(class_cap, tile.classes, v).min(v);
                    let scratch = (row_once + chunk_rows as u64 * row_unit).max(
                        n as u64 * ld_of(chunk_classes)
                            + e16
                            + chunk_classes as u64 * dc_tmp_per_class,
                    );
                    let workspace_bytes = fixed + scratch;
                    if workspace_bytes > budget {
                        why.push(format!(
                            "split-dense needs {workspace_bytes} B with its smallest chunks, over the budget of {budget} B"
                        ));
                        continue;
                    }
                    let row_chunks = split(n, chunk_rows);
                    let class_chunks = split(v, chunk_classes);
                    let forward_scratch = usize::try_from(scratch).unwrap_or(usize::MAX);
                    let de_how = match (dt, de_f16) {
                        (DType::F32, _) => "f32 G",
                        (DType::BF16, true) => "f16 G and an f16 copy of c",
                        (DType::BF16, false) => {
                            "bf16 G; a budget with room for an f16 copy of c gives f16 G"
                        }
                        _ => "f16 G",
                    };
                    let reason = format!(
                        "split-dense: {} row chunk(s) of {chunk_rows} for d_e ({de_how}) and {} class chunk(s) of {chunk_classes} for d_c, no cross-chunk accumulator; workspace {workspace_bytes} B within {budget} B{}{}",
                        row_chunks.len(),
                        class_chunks.len(),
                        if filter.enabled {
                            "; its dense passes skip nothing (dense GEMMs gain nothing from skipped entries)"
                        } else {
                            ""
                        },
                        if why.is_empty() { String::new() } else { format!(" ({})", why.join("; ")) }
                    );
                    let mut plan = Self::finish(
                        problem,
                        Strategy::SplitDense {
                            chunk_rows,
                            chunk_classes,
                            de_f16,
                        },
                        tile,
                        row_chunks,
                        class_chunks,
                        workspace_bytes,
                        filter,
                        reason,
                    );
                    if sparse_ok {
                        let room_s = budget.saturating_sub(workspace_bytes) + scratch;
                        plan.sparse = match (usize::try_from(scratch), usize::try_from(room_s)) {
                            (Ok(s), Ok(r)) => {
                                SparseBackward::fit(s, r, n, v, tile.rows, chunk_rows)
                            }
                            _ => None,
                        };
                        match plan.sparse {
                            Some(sp) => {
                                plan.workspace_bytes +=
                                    (sp.scratch_bytes as u64).saturating_sub(scratch);
                                plan.reason = format!("{sp}; then {}", plan.reason)
                            }
                            None => {
                                plan.workspace_bytes -= sparse_fixed;
                                plan.reason.push_str(
                                    "; no sparse backward: its pairs would not fit the scratch",
                                );
                            }
                        }
                    } else if filter.enabled {
                        plan.reason.push_str(
                            "; no sparse backward (it needs the filter on both gradients, no label smoothing, and non-deterministic mode)",
                        );
                    }
                    let scratch = plan
                        .sparse
                        .map_or(forward_scratch, |sp| sp.scratch_bytes.max(forward_scratch));
                    return Ok(plan.with_class_forward(scratch, budget, limits));
                }
                StrategyKind::TileOwnership => {
                    // Accumulators: f32 [rows, D] for the d_e pass, f32 [classes, D] for the
                    // d_c pass (not at the same time), none when gradients are f32.
                    let mut class_chunk = fit(classes_cap, tile.classes, v);
                    let mut row_chunk = fit(rows_cap, tile.rows, n);
                    let state = |cc: usize| row_state_bytes(div_ceil(v, cc));
                    let acc = |rc: usize, cc: usize| -> u64 {
                        if grads_f32 {
                            0
                        } else {
                            (rc as u64 * d as u64 * 4).max(cc as u64 * d as u64 * 4)
                        }
                    };
                    // Smaller class chunks shrink the accumulator but add per-row state, so
                    // the least need over the sizes tried is what a refusal reports.
                    let mut least = state(class_chunk) + acc(row_chunk, class_chunk);
                    while state(class_chunk) + acc(row_chunk, class_chunk) > budget {
                        let de = row_chunk as u64 * d as u64;
                        let dc = class_chunk as u64 * d as u64;
                        if dc >= de && class_chunk > tile.classes {
                            class_chunk = fit(class_chunk as u64 / 2, tile.classes, v);
                        } else if row_chunk > tile.rows {
                            row_chunk = fit(row_chunk as u64 / 2, tile.rows, n);
                        } else if class_chunk > tile.classes {
                            class_chunk = fit(class_chunk as u64 / 2, tile.classes, v);
                        } else {
                            break;
                        }
                        least = least.min(state(class_chunk) + acc(row_chunk, class_chunk));
                    }
                    let ws = state(class_chunk) + acc(row_chunk, class_chunk);
                    if ws > budget {
                        why.push(format!(
                            "tile-ownership needs at least {least} B (the least over the chunk sizes tried), over the budget of {budget} B"
                        ));
                        tile_ownership_least = Some(least);
                        continue;
                    }
                    let row_chunks = split(n, row_chunk);
                    let class_chunks = split(v, class_chunk);
                    // The rows and classes a chunk holds: `fit` rounds up to whole tiles, which
                    // a short problem does not fill (N = 5 is one chunk of 5 rows, not of 64).
                    let reason = format!(
                        "tile-ownership: {} row chunk(s) of {}, {} class chunk(s) of {}, workspace {ws} B within {budget} B{}",
                        row_chunks.len(),
                        row_chunk.min(n),
                        class_chunks.len(),
                        class_chunk.min(v),
                        if why.is_empty() { String::new() } else { format!(" ({})", why.join("; ")) }
                    );
                    return Ok(Self::finish(
                        problem,
                        Strategy::TileOwnership,
                        tile,
                        row_chunks,
                        class_chunks,
                        ws,
                        filter,
                        reason,
                    ));
                }
            }
        }
        Err(CceError::ResourceLimit {
            resource: format!("workspace bytes ({})", why.join("; ")),
            requested: tile_ownership_least
                .unwrap_or_else(|| row_state_bytes(div_ceil(v, tile.classes))),
            max: budget,
        })
    }

    /// Set [`Plan::forward`] in the dense strategy's scratch of `scratch` bytes (the largest
    /// call's, sparse backward included), which it may grow within the budget, and say so in
    /// the reason.
    fn with_class_forward(mut self, scratch: usize, budget: u64, limits: &DeviceLimits) -> Self {
        if !limits.class_forward {
            return self;
        }
        let p = &self.problem;
        let room = usize::try_from(budget.saturating_sub(self.workspace_bytes))
            .unwrap_or(usize::MAX)
            .saturating_add(scratch);
        self.forward = ClassForward::fit(room, p.n, p.v, self.tile.rows, self.tile.classes);
        match self.forward {
            Some(cf) => {
                self.workspace_bytes += cf.bytes(p.n).saturating_sub(scratch) as u64;
                self.reason.push_str(&format!("; {cf}"))
            }
            None => self
                .reason
                .push_str("; forward-only calls use the row chunks (no room for two buffers)"),
        }
        self
    }

    #[allow(clippy::too_many_arguments)]
    fn finish(
        problem: &Problem,
        strategy: Strategy,
        tile: TileShape,
        row_chunks: Vec<Range<usize>>,
        class_chunks: Vec<Range<usize>>,
        workspace_bytes: u64,
        filter: FilterRule,
        reason: String,
    ) -> Self {
        let mut passes = vec![Pass::Forward];
        if filter.enabled {
            passes.push(Pass::Threshold);
        }
        passes.push(Pass::BackwardDe);
        passes.push(Pass::BackwardDc);
        Self {
            problem: *problem,
            strategy,
            tile,
            row_chunks,
            class_chunks,
            passes,
            workspace_bytes,
            filter,
            sparse: None,
            forward: None,
            reason,
        }
    }

    /// Row tiles of a row range (the last one may be short).
    pub fn row_tiles(&self, rows: Range<usize>) -> impl Iterator<Item = Range<usize>> + '_ {
        let step = self.tile.rows;
        (rows.start..rows.end)
            .step_by(step)
            .map(move |s| s..(s + step).min(rows.end))
    }

    /// Class tiles of a class range (the last one may be short).
    pub fn class_tiles(&self, classes: Range<usize>) -> impl Iterator<Item = Range<usize>> + '_ {
        let step = self.tile.classes;
        (classes.start..classes.end)
            .step_by(step)
            .map(move |s| s..(s + step).min(classes.end))
    }

    /// Every logits tile, chunk by chunk (row chunk outer, class chunk inner).
    pub fn tiles(&self) -> impl Iterator<Item = Tile> + '_ {
        self.row_chunks.iter().flat_map(move |rc| {
            self.class_chunks.iter().flat_map(move |cc| {
                self.row_tiles(rc.clone()).flat_map(move |rows| {
                    self.class_tiles(cc.clone()).map(move |classes| Tile {
                        rows: rows.clone(),
                        classes,
                    })
                })
            })
        })
    }

    /// Total number of logits tiles.
    pub fn tile_count(&self) -> u64 {
        let rt: u64 = self
            .row_chunks
            .iter()
            .map(|r| div_ceil(r.len(), self.tile.rows) as u64)
            .sum();
        let ct: u64 = self
            .class_chunks
            .iter()
            .map(|c| div_ceil(c.len(), self.tile.classes) as u64)
            .sum();
        rt * ct
    }
}

#[cfg(test)]
mod tests;
