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

/// A sparse backward tried before [`Strategy::SplitDense`]'s dense backward (module docs).
///
/// Memory: one scratch buffer of `scratch_bytes` (split dense's, grown when that is too small
/// for a useful capacity and the budget allows; the dense passes reuse it if it gives way):
/// the logits chunk at its start, the kept pairs as 8-byte records (class, G) growing down
/// from its end, and after the row pass the pairs regrouped by class over the logits
/// ([`SparseBackward::class_layout`]). Plus `8·N` bytes of row offsets and counts and the tile
/// statistics' flags, which the plan adds to the workspace.
///
/// Chunking: the first row chunk (`probe_rows`) measures the density; the following chunks
/// take the most rows (up to `max_rows`) whose logits leave room for the pairs that density
/// predicts ([`SparseBackward::rows_after_probe`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SparseBackward {
    /// Rows of the first row chunk.
    pub probe_rows: usize,
    /// Most rows per chunk after it.
    pub max_rows: usize,
    /// Bytes of the scratch buffer it lays out (a multiple of 256).
    pub scratch_bytes: usize,
    /// Mean kept entries per row of the first row chunk above which the dense passes are
    /// taken instead: about where gathering `2·k·D` input elements per row stops being
    /// cheaper than split dense's three tensor-core GEMMs (PERFORMANCE.md "Design space" 4;
    /// `V / SPARSE_PAY_DIVISOR`, at least 1).
    pub max_mean_kept: usize,
}

/// [`SparseBackward::max_mean_kept`] is `V / SPARSE_PAY_DIVISOR`. With 16-bit inputs a row's
/// sparse backward reads `2·k·D·2` bytes of gathered rows (at an effective ~2-3 TB/s on an
/// H200) against dense GEMMs of `2·V·D` flops per row and product (~660 Tflop/s): they break
/// even near `k ≈ V / 150` (three GEMMs); `V / 256` keeps a margin for the gathers' poorer
/// locality.
pub const SPARSE_PAY_DIVISOR: usize = 256;

/// Rows of [`SparseBackward::probe_rows`] (at most `N`).
pub const SPARSE_PROBE_ROWS: usize = 128;

/// Pairs per row [`SparseBackward::rows_after_probe`] leaves room for at least.
pub const SPARSE_MIN_PAIRS_PER_ROW: usize = 64;

fn align256(x: usize) -> usize {
    x.div_ceil(256) * 256
}

impl SparseBackward {
    /// f32 row stride of the logits chunk: `V` rounded up to 8.
    pub fn ld(v: usize) -> usize {
        v.div_ceil(8) * 8
    }

    /// Bytes the logits of a `rows`-row chunk take at the start of the scratch.
    pub fn logits_bytes(rows: usize, v: usize) -> usize {
        align256(rows * Self::ld(v) * 4)
    }

    /// Pairs the scratch holds while chunks of `rows` rows run: the records stay clear of the
    /// logits, and the regrouping by class needs them twice plus about `12·V` bytes
    /// ([`SparseBackward::class_layout`]).
    pub fn capacity(&self, rows: usize, v: usize) -> usize {
        let s = self.scratch_bytes;
        let by_rows = s.saturating_sub(Self::logits_bytes(rows, v)) / 8;
        let by_class = s.saturating_sub(Self::class_bytes(v)) / 16;
        by_rows.min(by_class).min(u32::MAX as usize - 1)
    }

    /// Rows per chunk after a first chunk of `probe_rows` rows kept `pairs` pairs, `n` rows in
    /// all: the most rows (at most `max_rows`, at least `probe_rows`) whose logits leave room
    /// for the pairs that density predicts, plus a quarter, and at least
    /// [`SPARSE_MIN_PAIRS_PER_ROW`] per row (a probe of ignored or peaked rows would otherwise
    /// leave no room for denser rows later).
    pub fn rows_after_probe(&self, pairs: u64, n: usize, v: usize) -> usize {
        let probe = self.probe_rows.clamp(1, n);
        let mean = pairs as f64 / probe as f64;
        let floor = (SPARSE_MIN_PAIRS_PER_ROW.min(v) * n) as f64;
        let expect = (pairs as f64 + 1.25 * mean * (n - probe) as f64).max(floor) + 1024.0;
        let room = (self.scratch_bytes as f64 - 8.0 * expect).max(0.0);
        let rows = (room / (Self::ld(v) * 4) as f64).floor() as usize;
        rows.min(self.max_rows).min(n).max(probe)
    }

    /// Bytes the regrouping by class needs besides its `16·pairs` (the class records and the
    /// row records): counts, the scan's counters, starts and the class lists
    /// ([`SparseBackward::class_layout`]), with their alignment.
    pub fn class_bytes(v: usize) -> usize {
        12 * (v + 1) + 4 * (v.div_ceil(4096) + 2) + 1024
    }

    /// Whether `d_e` is gathered once after the row pass (a warp per row over all rows)
    /// rather than per row chunk (a block per row and column slice): when the first chunk
    /// predicts `pairs` < 2·V, i.e. a class is gathered less than twice on average (peaked
    /// data: a few records per row, where the per-chunk blocks are mostly idle; seed shape,
    /// randn: 1.8 → 0.4 ms). Denser rows keep the per-chunk blocks, whose warps split a row's
    /// records (session 6, run 4).
    pub fn defer_d_e(&self, pairs: f64, v: usize) -> bool {
        pairs < 2.0 * v as f64
    }

    /// Byte offsets of the regrouping by class for `pairs` pairs: records (row, G) at 0,
    /// counts u32 `[V]` followed by the scan's counters u32 `[2 + ⌈V / 4096⌉]`, starts u32
    /// `[V + 1]`, the class lists u32 `[V]`; and the end, which stays below the row records
    /// (`scratch_bytes − 8·pairs`) when `pairs ≤ capacity`. Returns
    /// `(counts, starts, lists, end)`.
    pub fn class_layout(pairs: usize, v: usize) -> (usize, usize, usize, usize) {
        // class_bytes(v) bounds everything past the records (alignment included).
        let counts = align256(pairs * 8);
        let starts = counts + align256((v + 2 + v.div_ceil(4096)) * 4);
        let lists = starts + align256((v + 1) * 4);
        (counts, starts, lists, lists + v * 4)
    }

    /// The sparse backward for `N x V` in split dense's `scratch` bytes, growing it up to
    /// `room` bytes when that holds fewer than `min(1024, V)` pairs per row; `None` when even `room` does
    /// not hold 1 pair per row next to the first chunk's logits. Chunks: `probe_rows` =
    /// [`SPARSE_PROBE_ROWS`] (a multiple of `unit_rows` when larger, at most `N`), then at
    /// most `max_rows`.
    pub fn fit(
        scratch: usize,
        room: usize,
        n: usize,
        v: usize,
        unit_rows: usize,
        max_rows: usize,
    ) -> Option<Self> {
        let probe = if SPARSE_PROBE_ROWS >= unit_rows {
            SPARSE_PROBE_ROWS / unit_rows * unit_rows
        } else {
            unit_rows
        }
        .min(n)
        .min(max_rows.max(1));
        let need = |pairs: usize| -> usize {
            (Self::logits_bytes(probe, v) + 8 * pairs).max(16 * pairs + Self::class_bytes(v))
        };
        // Room for 1024 pairs per row (or every entry), when the budget has it.
        let target = align256(need((1024 * n).min(n * v)));
        let scratch_bytes = if scratch >= target {
            scratch / 256 * 256
        } else if room >= target {
            target
        } else if room.max(scratch) >= need(n) {
            room.max(scratch) / 256 * 256
        } else {
            return None;
        };
        let sp = Self {
            probe_rows: probe.max(1),
            max_rows: max_rows.max(probe).max(1),
            // A multiple of 256: the records grow down from its end in 8-byte units.
            scratch_bytes,
            max_mean_kept: (v / SPARSE_PAY_DIVISOR).max(1),
        };
        (sp.capacity(sp.probe_rows, v) >= n).then_some(sp)
    }
}

/// Forward-only calls of the dense strategies: the logits in tiles of `rows x classes`
/// (all rows when the scratch allows, so each GEMM streams `c` once), written alternately into
/// two buffers so that the row reductions of one tile (online max / Σexp / target logit,
/// Milakov & Gimelshein 2018; the paper's blockwise lse, section 4.1) run while the GEMM of
/// the next writes the other (`cce-cuda`: a second stream).
///
/// Memory (inside the strategy's scratch, nothing added): two f32 buffers of
/// [`ClassForward::buffer_bytes`], then the per-row state, [`CLASS_FORWARD_STATE_BYTES`] per
/// row (running max, Σexp, Σexp·z, Σz, argmax, target logit).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClassForward {
    /// Rows per tile (`N`, or a multiple of the tile rows).
    pub rows: usize,
    /// Classes per tile (`V`, or a multiple of the tile classes).
    pub classes: usize,
}

/// Bytes of [`ClassForward`]'s state per row: six 4-byte values.
pub const CLASS_FORWARD_STATE_BYTES: usize = 24;

/// Fewest classes per [`ClassForward`] tile before it gives up rows instead (a GEMM with a
/// narrower output keeps the tensor cores busy, PERFORMANCE.md "floors").
pub const CLASS_FORWARD_MIN_CLASSES: usize = 1024;

impl ClassForward {
    /// f32 row stride of a buffer: `classes` rounded up to 8 (32-byte rows).
    pub fn ld(&self) -> usize {
        self.classes.div_ceil(8) * 8
    }

    /// Bytes of one of the two logits buffers (a multiple of 256).
    pub fn buffer_bytes(&self) -> usize {
        align256(self.rows * self.ld() * 4)
    }

    /// Byte offset of the per-row state (after both buffers).
    pub fn state_offset(&self) -> usize {
        2 * self.buffer_bytes()
    }

    /// Bytes it uses in the scratch for `n` rows: both buffers and the state.
    pub fn bytes(&self, n: usize) -> usize {
        self.state_offset() + align256(n * CLASS_FORWARD_STATE_BYTES)
    }

    /// The tiles for `N x V` in `scratch` bytes: all rows and the most classes (multiples of
    /// `unit_classes`, or `V`) whose two buffers fit; when that is under
    /// [`CLASS_FORWARD_MIN_CLASSES`], that many classes and the most rows (multiples of
    /// `unit_rows`). `None` when not even one unit of rows fits.
    pub fn fit(
        scratch: usize,
        n: usize,
        v: usize,
        unit_rows: usize,
        unit_classes: usize,
    ) -> Option<Self> {
        if n == 0 || v == 0 {
            return None;
        }
        // Class tiles in whole units of 8 classes at least (the kernels' float4 loads of the
        // bias need tile starts at multiples of 4).
        let (unit_rows, unit_classes) = (unit_rows.max(1), unit_classes.max(8).div_ceil(8) * 8);
        let state = align256(n * CLASS_FORWARD_STATE_BYTES);
        let half = scratch.checked_sub(state)? / 2;
        let fits = |cf: &Self| cf.bytes(n) <= scratch;
        let all = Self {
            rows: n,
            classes: v,
        };
        if fits(&all) {
            return Some(all);
        }
        // Both candidates start from `half` and step down one unit while the 256-byte
        // rounding of the buffers leaves them over the scratch.
        // `V` itself, or a multiple of the unit: after `V`, the next candidate is the largest
        // multiple below it.
        let k0 = (half / (n * 4)).min(v);
        let mut k = if k0 == v {
            v
        } else {
            k0 / unit_classes * unit_classes
        };
        while k > 0 && k >= CLASS_FORWARD_MIN_CLASSES.min(v) {
            let cf = Self {
                rows: n,
                classes: k,
            };
            if fits(&cf) {
                return Some(cf);
            }
            k = if k == v {
                (v - 1) / unit_classes * unit_classes
            } else {
                k - unit_classes.min(k)
            };
        }
        let classes = (CLASS_FORWARD_MIN_CLASSES.div_ceil(unit_classes) * unit_classes).min(v);
        let ld = Self { rows: 1, classes }.ld();
        let mut rows = (half / (ld * 4) / unit_rows * unit_rows).min(n);
        while rows > 0 {
            let cf = Self { rows, classes };
            if fits(&cf) {
                return Some(cf);
            }
            rows -= unit_rows.min(rows);
        }
        None
    }
}

impl fmt::Display for ClassForward {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "forward-only calls: logits in {}-row x {}-class tiles through two buffers (each tile's row reductions overlap the next tile's GEMM)",
            self.rows, self.classes
        )
    }
}

impl fmt::Display for SparseBackward {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "sparse backward first (a {}-row chunk measures the density, then up to {}-row chunks; {} B of scratch; dense passes above {} kept entries per row)",
            self.probe_rows, self.max_rows, self.scratch_bytes, self.max_mean_kept
        )
    }
}

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
    /// `InvalidOption` when `limits` lists no strategy.
    pub fn new(problem: &Problem, opts: &Options, limits: &DeviceLimits) -> Result<Self> {
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
                    }
                    let ws = state(class_chunk) + acc(row_chunk, class_chunk);
                    if ws > budget {
                        why.push(format!(
                            "tile-ownership needs at least {ws} B with one-tile chunks, over the budget of {budget} B"
                        ));
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
        if limits.strategies.is_empty() {
            return Err(CceError::InvalidOption {
                name: "DeviceLimits::strategies",
                reason: "the backend lists no strategy".into(),
            });
        }
        Err(CceError::ResourceLimit {
            resource: format!("workspace bytes ({})", why.join("; ")),
            requested: row_state_bytes(div_ceil(v, tile.classes)),
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
mod tests {
    use super::Strategy;

    #[test]
    fn class_layout_and_d_e_deferral() {
        let sp = SparseBackward::fit(1 << 29, 1 << 29, 32768, 256000, 128, 384).unwrap();
        // randn at the seed keeps ~3 pairs per row, c/8 ~324.
        assert!(sp.defer_d_e(3.0 * 32768.0, 256000));
        assert!(!sp.defer_d_e(324.0 * 32768.0, 256000));
        for v in [1usize, 7, 4095, 4096, 4097, 256000] {
            for pairs in [0usize, 1, 1000] {
                let (counts, starts, lists, end) = SparseBackward::class_layout(pairs, v);
                assert!(counts >= 8 * pairs && starts >= counts + 4 * (v + 2 + v.div_ceil(4096)));
                assert!(lists >= starts + 4 * (v + 1) && end == lists + 4 * v);
                assert!(end <= 16 * pairs + SparseBackward::class_bytes(v) - 8 * pairs);
            }
        }
    }
    use super::*;
    use crate::tensor::HostTensor;
    use proptest::prelude::{any, prop, prop_assert, proptest, ProptestConfig};

    fn problem(n: usize, d: usize, v: usize, dt: DType) -> Problem {
        Problem {
            n,
            d,
            v,
            dtype: dt,
            has_bias: false,
            seq_len: n,
        }
    }

    fn gpu_limits(max_buffer: u64, tile: (usize, usize)) -> DeviceLimits {
        DeviceLimits {
            name: "test-gpu".into(),
            max_buffer_bytes: max_buffer,
            max_block_memory_bytes: 48 << 10,
            max_threads_per_block: 256,
            max_grid: [65535, 65535, 65535],
            index_bits: 32,
            tile: TileShape {
                rows: tile.0,
                classes: tile.1,
                depth: 16,
            },
            strategies: vec![StrategyKind::ChunkedDense, StrategyKind::TileOwnership],
            class_forward: false,
        }
    }

    fn check_invariants(plan: &Plan, limits: &DeviceLimits, budget: u64) {
        let p = &plan.problem;
        // Coverage: every (row, class) pair exactly once; tiles within bounds and shapes.
        let mut count = vec![0u8; p.n * p.v];
        for t in plan.tiles() {
            assert!(t.rows.end <= p.n && t.classes.end <= p.v);
            assert!(!t.rows.is_empty() && !t.classes.is_empty());
            assert!(t.rows.len() <= plan.tile.rows && t.classes.len() <= plan.tile.classes);
            for r in t.rows.clone() {
                for c in t.classes.clone() {
                    count[r * p.v + c] += 1;
                }
            }
        }
        assert!(count.iter().all(|&x| x == 1), "coverage");
        assert_eq!(plan.tiles().count() as u64, plan.tile_count());
        // Chunks: ordered, disjoint, covering, tile-aligned starts.
        for (chunks, total, unit) in [
            (&plan.row_chunks, p.n, plan.tile.rows),
            (&plan.class_chunks, p.v, plan.tile.classes),
        ] {
            assert_eq!(chunks.first().unwrap().start, 0);
            assert_eq!(chunks.last().unwrap().end, total);
            for w in chunks.windows(2) {
                assert_eq!(w[0].end, w[1].start);
            }
            for c in chunks.iter() {
                assert_eq!(c.start % unit, 0);
            }
        }
        // Limits: buffers of a chunk fit, indices fit.
        let idx_cap = if limits.index_bits >= 64 {
            u64::MAX
        } else {
            (1u64 << (limits.index_bits - 1)) - 1
        };
        for c in &plan.class_chunks {
            assert!(c.len() as u64 * p.d as u64 * 4 <= limits.max_buffer_bytes);
            assert!((c.len() as u64 * p.d as u64) <= idx_cap);
            assert!(c.len().div_ceil(plan.tile.classes) as u64 <= limits.max_grid[0] as u64);
        }
        for r in &plan.row_chunks {
            assert!(r.len() as u64 * p.d as u64 * 4 <= limits.max_buffer_bytes);
            assert!(r.len().div_ceil(plan.tile.rows) as u64 <= limits.max_grid[1] as u64);
        }
        if let Strategy::ChunkedDense { chunk_rows } = plan.strategy {
            assert!(chunk_rows as u64 * p.v as u64 * 4 <= limits.max_buffer_bytes);
            assert!(chunk_rows as u64 * p.v as u64 <= idx_cap);
            // The chunks are the plan's chunks: the label names the rows a chunk holds.
            assert_eq!(plan.row_chunks[0].len(), chunk_rows);
            assert!(chunk_rows <= p.n);
        }
        if let Strategy::SplitDense {
            chunk_rows,
            chunk_classes,
            ..
        } = plan.strategy
        {
            // The chunks are the plan's chunks, and each buffer of a pass fits one binding.
            assert_eq!(plan.row_chunks[0].len(), chunk_rows);
            assert_eq!(plan.class_chunks[0].len(), chunk_classes);
            assert!(chunk_classes <= SPLIT_DENSE_MAX_CLASSES);
            assert!(chunk_rows as u64 * p.v.div_ceil(8) as u64 * 32 <= limits.max_buffer_bytes);
            assert!(p.n as u64 * chunk_classes.div_ceil(8) as u64 * 32 <= limits.max_buffer_bytes);
        }
        if let Some(sp) = plan.sparse {
            // Split dense's scratch holds the sparse layout; the pairs cover one per row.
            let Strategy::SplitDense { chunk_rows, .. } = plan.strategy else {
                panic!("sparse backward without split dense")
            };
            assert!(sp.probe_rows >= 1 && sp.probe_rows <= p.n);
            assert_eq!(sp.scratch_bytes % 256, 0);
            assert!(sp.max_rows >= sp.probe_rows && sp.max_rows <= chunk_rows.max(sp.probe_rows));
            assert!(sp.capacity(sp.probe_rows, p.v) >= p.n && sp.max_mean_kept >= 1);
            // Every chunk size it may pick keeps the records clear of the logits and the
            // regrouping by class below the records.
            for pairs in [0u64, p.n as u64, 7 * p.n as u64, 1000 * p.n as u64] {
                let rows = sp.rows_after_probe(pairs, p.n, p.v);
                assert!(rows >= sp.probe_rows.min(p.n) && rows <= sp.max_rows.min(p.n));
                let cap = sp.capacity(rows, p.v);
                assert!(
                    SparseBackward::logits_bytes(rows, p.v) + 8 * cap <= sp.scratch_bytes
                        || cap == 0
                );
                let (_, _, _, end) = SparseBackward::class_layout(cap, p.v);
                assert!(
                    end + 8 * cap <= sp.scratch_bytes || cap == 0,
                    "{sp:?} rows {rows} cap {cap}"
                );
            }
            assert!(plan.filter.filter_e_grad && plan.filter.filter_c_grad);
        }
        assert!(
            plan.workspace_bytes <= budget,
            "workspace {} > budget {budget}",
            plan.workspace_bytes
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]
        #[test]
        fn plan_invariants_hold(
            n in 1usize..300, d in 1usize..80, v in 1usize..700,
            tr in prop::sample::select(vec![1usize, 16, 64, 128]),
            tc in prop::sample::select(vec![1usize, 32, 64, 128, 256]),
            buf_kib in 4u64..4096, budget_kib in 1u64..(64 << 10),
            dt in prop::sample::select(vec![DType::F32, DType::F16, DType::BF16]),
            filter_off in any::<bool>(),
            split in any::<bool>(),
        ) {
            let p = problem(n, d, v, dt);
            let mut limits = gpu_limits(buf_kib << 10, (tr, tc));
            if split {
                limits.strategies = vec![StrategyKind::SplitDense, StrategyKind::TileOwnership];
            }
            let opts = Options {
                workspace_budget_bytes: budget_kib << 10,
                filter_eps: if filter_off { crate::options::FilterEps::Off } else { crate::options::FilterEps::Auto },
                ..Default::default()
            };
            match Plan::new(&p, &opts, &limits) {
                Ok(plan) => check_invariants(&plan, &limits, opts.workspace_budget_bytes),
                Err(CceError::ResourceLimit { .. }) => {
                    // Only a budget or a buffer too small for one tile may refuse.
                    let one_tile = (tr.max(tc) * d * 4) as u64 <= limits.max_buffer_bytes;
                    let roomy = Options { workspace_budget_bytes: 1 << 40, ..opts.clone() };
                    prop_assert!(!one_tile || Plan::new(&p, &roomy, &limits).is_ok());
                }
                Err(e) => prop_assert!(false, "unexpected error {e}"),
            }
        }
    }

    #[test]
    fn seed_shape_default_budget_is_tile_ownership_within_budget() {
        let p = problem(32768, 4096, 256000, DType::BF16);
        let limits = gpu_limits(2 << 30, (128, 128));
        let plan = Plan::new(&p, &Options::default(), &limits).unwrap();
        assert_eq!(plan.strategy, Strategy::TileOwnership);
        assert!(plan.workspace_bytes <= 512 << 20);
        // With a budget for the f32 d_c accumulator, chunked dense is chosen.
        let big = Options {
            workspace_budget_bytes: 8 << 30,
            ..Default::default()
        };
        let plan = Plan::new(&p, &big, &limits).unwrap();
        assert!(
            matches!(plan.strategy, Strategy::ChunkedDense { chunk_rows } if chunk_rows >= 1024)
        );
    }

    #[test]
    fn seed_shape_default_budget_is_split_dense_within_budget() {
        let p = problem(32768, 4096, 256000, DType::BF16);
        let mut limits = gpu_limits(140 << 30, (128, 128));
        limits.strategies = vec![
            StrategyKind::ChunkedDense,
            StrategyKind::SplitDense,
            StrategyKind::TileOwnership,
        ];
        // The CUDA backend's budget: the default 0.5 GiB less its 32 MiB cuBLAS workspace.
        let opts = Options {
            workspace_budget_bytes: (512 << 20) - (32 << 20),
            ..Options::default()
        };
        let plan = Plan::new(&p, &opts, &limits).unwrap();
        let Strategy::SplitDense {
            chunk_rows,
            chunk_classes,
            de_f16,
        } = plan.strategy
        else {
            panic!("{}", plan.reason)
        };
        // 480 MiB: 384 rows of V = 256000 f32 logits (no room for an f16 copy of c); the f16
        // copy of e (256 MiB) and an f32 d_c chunk beside ~1.4k classes of N = 32768.
        assert_eq!(chunk_rows, 384);
        assert!(!de_f16);
        assert!((1280..=1792).contains(&chunk_classes), "{chunk_classes}");
        assert!(plan.workspace_bytes <= opts.workspace_budget_bytes);
        // The sparse backward holds the pairs of c/8 data at the seed shape (324 per row).
        let sp = plan.sparse.expect("sparse backward");
        assert!(sp.capacity(sp.probe_rows, 256000) >= 32768 * 324, "{sp}");
        // randn data (3 pairs per row) gets 384-row chunks, c/8 (324) about as many.
        assert_eq!(sp.rows_after_probe(3 * 128, 32768, 256000), 384);
        assert!(sp.rows_after_probe(324 * 128, 32768, 256000) >= 300);
        assert_eq!(sp.max_mean_kept, 1000);
        assert!(
            plan.reason.starts_with("sparse backward first"),
            "{}",
            plan.reason
        );
        // Exact calls, label smoothing and deterministic mode take no sparse backward.
        for o in [
            Options::exact(),
            Options {
                label_smoothing: 0.1,
                ..Default::default()
            },
            Options {
                deterministic: true,
                ..Default::default()
            },
        ] {
            assert!(Plan::new(&p, &o, &limits).unwrap().sparse.is_none());
        }
        assert!(
            plan.reason.contains("chunked-dense needs"),
            "{}",
            plan.reason
        );
        check_invariants_light(&plan, &limits);
    }

    #[test]
    fn sparse_chunks_leave_room_for_denser_rows_than_the_probe() {
        // A probe of ignored rows (0 pairs) must not size the chunks so large that later rows
        // keeping ~10 entries each overflow (8192 x 4096 x 128256, default budget).
        let p = problem(8192, 4096, 128256, DType::BF16);
        let mut limits = gpu_limits(140 << 30, (128, 128));
        limits.strategies = vec![StrategyKind::SplitDense, StrategyKind::TileOwnership];
        let plan = Plan::new(&p, &Options::default(), &limits).unwrap();
        let sp = plan.sparse.expect("sparse backward");
        for pairs in [0, 3 * 128] {
            let rows = sp.rows_after_probe(pairs, p.n, p.v);
            assert!(
                sp.capacity(rows, p.v) >= SPARSE_MIN_PAIRS_PER_ROW * p.n,
                "{sp:?}: {rows} rows leave {} pairs",
                sp.capacity(rows, p.v)
            );
        }
    }

    #[test]
    fn small_binding_splits_the_vocabulary() {
        // lavapipe: 128 MiB per binding; c of the seed shape is 2 GiB in bf16.
        let p = problem(4096, 4096, 256000, DType::BF16);
        let limits = gpu_limits(128 << 20, (64, 64));
        let plan = Plan::new(&p, &Options::default(), &limits).unwrap();
        assert!(plan.class_chunks.len() > 1);
        check_invariants_light(&plan, &limits);
    }

    fn check_invariants_light(plan: &Plan, limits: &DeviceLimits) {
        for c in &plan.class_chunks {
            assert!(c.len() as u64 * plan.problem.d as u64 * 4 <= limits.max_buffer_bytes);
        }
    }

    #[test]
    fn too_small_a_buffer_is_a_resource_error() {
        let p = problem(10, 1 << 20, 10, DType::F32);
        let limits = gpu_limits(1 << 20, (16, 16));
        assert!(matches!(
            Plan::new(&p, &Options::default(), &limits),
            Err(CceError::ResourceLimit { .. })
        ));
        let _ = HostTensor::scalar_f32(0.0);
    }

    #[test]
    fn labels_name_the_rows_and_classes_a_chunk_holds() {
        // A problem shorter than a tile is one chunk of its own rows: `cce run --n 5` printed
        // "chunked-dense(64 rows)" for 5 rows.
        let cpu = DeviceLimits::cpu();
        for (n, v) in [(5, 64), (100, 700), (1024, 49152)] {
            let plan =
                Plan::new(&problem(n, 16, v, DType::F32), &Options::default(), &cpu).unwrap();
            assert_eq!(plan.strategy, Strategy::ChunkedDense { chunk_rows: n });
            assert_eq!(
                plan.strategy.to_string(),
                format!("chunked-dense({n} rows)")
            );
            assert!(
                plan.reason
                    .starts_with(&format!("chunked-dense: {n}-row logits chunk")),
                "{}",
                plan.reason
            );
        }
        // Several chunks: whole tiles, and the label is the first chunk's length.
        let small = Options {
            workspace_budget_bytes: 2 << 20,
            ..Default::default()
        };
        let plan = Plan::new(&problem(1000, 16, 4096, DType::F32), &small, &cpu).unwrap();
        let Strategy::ChunkedDense { chunk_rows } = plan.strategy else {
            panic!("{}", plan.reason)
        };
        assert!(plan.row_chunks.len() > 1 && chunk_rows.is_multiple_of(64));
        assert_eq!(plan.row_chunks[0].len(), chunk_rows);
        assert_eq!(
            plan.strategy.to_string(),
            format!("chunked-dense({chunk_rows} rows)")
        );

        // Split dense clamps its chunks to N and V; its label says so.
        let mut limits = gpu_limits(1 << 30, (64, 64));
        limits.strategies = vec![StrategyKind::SplitDense];
        let plan = Plan::new(
            &problem(5, 16, 100, DType::F32),
            &Options::default(),
            &limits,
        )
        .unwrap();
        assert_eq!(
            plan.strategy.to_string(),
            "split-dense(5-row chunks for d_e, 100-class chunks for d_c)"
        );
        // Tile ownership has no parameters in its label; its reason names the chunks.
        limits.strategies = vec![StrategyKind::TileOwnership];
        let plan = Plan::new(
            &problem(5, 16, 100, DType::F32),
            &Options::default(),
            &limits,
        )
        .unwrap();
        assert_eq!(plan.strategy.to_string(), "tile-ownership");
        assert!(
            plan.reason
                .starts_with("tile-ownership: 1 row chunk(s) of 5, 1 class chunk(s) of 100,"),
            "{}",
            plan.reason
        );
    }

    #[test]
    fn class_forward_takes_all_rows_at_the_seed_shape_and_fits_its_scratch() {
        // Default budget at the seed shape: split dense's scratch holds two 32768-row buffers
        // of at least 1024 classes.
        let p = problem(32768, 4096, 256000, DType::BF16);
        let mut limits = gpu_limits(140 << 30, (128, 128));
        limits.strategies = vec![StrategyKind::SplitDense, StrategyKind::TileOwnership];
        // A backend without class tiles (here the default test limits) gets none in its plan,
        // and no workspace for them.
        let without = Plan::new(&p, &Options::default(), &limits).unwrap();
        assert!(without.forward.is_none() && !without.reason.contains("forward-only"));
        limits.class_forward = true;
        let plan = Plan::new(&p, &Options::default(), &limits).unwrap();
        assert!(plan.workspace_bytes >= without.workspace_bytes);
        let cf = plan.forward.expect("class forward");
        assert_eq!(cf.rows, 32768);
        assert!(
            cf.classes >= CLASS_FORWARD_MIN_CLASSES && cf.classes.is_multiple_of(128),
            "{cf:?}"
        );
        assert!(
            plan.reason.contains("forward-only calls"),
            "{}",
            plan.reason
        );
        assert!((cf.bytes(p.n) as u64) < plan.workspace_bytes);
    }

    #[test]
    fn class_forward_tiles_are_whole_units_or_all_classes() {
        // V = 1615 misses only by the buffers' 256-byte rounding; the next candidate must be a
        // multiple of the unit (1600), not V − unit (1599, whose tiles would start off the
        // bias's 4-element alignment).
        let cf = ClassForward::fit(13256, 1, 1615, 16, 16).expect("fits");
        assert!(
            cf.classes == 1615 || cf.classes.is_multiple_of(16),
            "{cf:?}"
        );
        assert!(cf.bytes(1) <= 13256);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        #[test]
        fn class_forward_fits_and_covers(
            scratch in 0usize..(64 << 20),
            n in 1usize..20000,
            v in 1usize..300000,
            unit in prop::sample::select(vec![16usize, 64, 128]),
        ) {
            match ClassForward::fit(scratch, n, v, unit, unit) {
                Some(cf) => {
                    prop_assert!(cf.bytes(n) <= scratch, "{cf:?} over {scratch}");
                    prop_assert!(cf.rows >= 1 && cf.rows <= n && cf.classes >= 1 && cf.classes <= v);
                    prop_assert!(cf.rows == n || cf.rows.is_multiple_of(unit));
                    prop_assert!(cf.classes == v || cf.classes.is_multiple_of(unit));
                    prop_assert!(cf.ld().is_multiple_of(8) && cf.ld() >= cf.classes);
                    prop_assert!(cf.buffer_bytes().is_multiple_of(256));
                    // Fewer classes than the minimum only with every row or every class.
                    prop_assert!(cf.classes >= CLASS_FORWARD_MIN_CLASSES.min(v) || cf.rows == n);
                }
                None => {
                    // Not even one unit of rows of the smallest tile fits.
                    let classes = (CLASS_FORWARD_MIN_CLASSES.div_ceil(unit) * unit).min(v);
                    let least = ClassForward { rows: unit.min(n), classes };
                    prop_assert!(least.bytes(n) > scratch);
                }
            }
        }
    }
}
