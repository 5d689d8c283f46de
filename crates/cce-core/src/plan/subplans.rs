//! The plan's sub-plans: the sparse backward tried before split dense's dense backward
//! ([`SparseBackward`]) and the class tiles of a forward-only call ([`ClassForward`]).

use super::*;

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
