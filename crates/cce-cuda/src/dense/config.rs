//! The configuration of a dense call: [`DenseConfig`] (from a plan and its options), the row
//! pass choice [`RowPass`], and the default switches of the WGMMA paths.

use super::*;

/// Whether forward-only calls take the fused WGMMA forward where it applies
/// ([`DenseConfig::wgmma_forward`], [`crate::CudaSwitches::wgmma_forward`]).
pub const WGMMA_FORWARD_DEFAULT: bool = true;

/// Whether split dense's class pass takes the WGMMA GEMM with `G` in its epilogue where it
/// applies ([`DenseConfig::wgmma_gcols`], [`crate::CudaSwitches::wgmma_gcols`]).
pub const WGMMA_GCOLS_DEFAULT: bool = true;

/// Whether the dense row pass (split or chunked dense) of a forward-and-backward call takes the WGMMA GEMM with the
/// lse partials and bf16 `e^{z − m}` in its epilogue where it applies
/// ([`DenseConfig::wgmma_rows`], `schedule::wgmma_rows_unfit`,
/// [`crate::CudaSwitches::wgmma_rows`]).
pub const WGMMA_ROWS_DEFAULT: bool = true;

/// Largest softcap the WGMMA epilogues take: their `cap_fast` (`wgmma.cu`) has an absolute
/// error of a few `s·2⁻²²` (~1e-5 at 30, under the f32 logits' own rounding); above this the
/// class tiles / cuBLAS class pass with `tanhf` run instead.
pub const WGMMA_SOFTCAP_MAX: f32 = 100.0;

/// Smallest softcap split dense's WGMMA row pass takes: its `G` pass (`cce_wgmma_qrows_g_cap_*`)
/// forms the softcap factor `1 − (z/s)²` from `z` rebuilt from the bf16 `e^{z − max}`, which has
/// no relative accuracy once `|x|` is many times `s` (the factor is then ~`4e^{−2|x|/s}`); under
/// this cap the cuBLAS row pass with the exact factor runs instead.
pub const WGMMA_ROWS_SOFTCAP_MIN: f32 = 1.0;

/// Bytes of workspace a forward-only call of the backend takes at most (the engine's buffers,
/// [`crate::dense::DenseWorkspace::bytes`]; the cuBLAS workspace,
/// [`crate::dense::CUBLAS_WORKSPACE_BYTES`], comes on top), or less where the budget less the
/// cuBLAS workspace is smaller: 64 MiB. The fused WGMMA forward runs in row groups whose
/// partials fit it (8 bytes per row and 256 classes: 8192 rows at `V` = 256000), the class
/// tiles and the row chunks fit it too. Only a problem whose per-row buffers and one row of
/// logits alone exceed it (millions of rows, or a `V` of millions) takes more.
pub const FORWARD_WORKSPACE_CAP: u64 = 64 << 20;

/// Cluster sizes the fused kernel is instantiated for.
pub const CLUSTER_SIZES: [usize; 5] = [1, 2, 4, 8, 16];

/// How steps 2 and 3 run in a forward+backward call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowPass {
    /// Forward row kernel then backward row kernel: two reads of the logits.
    TwoPass,
    /// One fused kernel per row with the row resident in the shared memory of a cluster of
    /// `cluster` blocks (`None`: the smallest of [`CLUSTER_SIZES`] whose slice fits
    /// ~100 KiB). Needs compute capability 9.0; falls back to `TwoPass` where the row does
    /// not fit 16 blocks' shared memory.
    Fused {
        /// Blocks per cluster (one of [`CLUSTER_SIZES`]), or automatic.
        cluster: Option<usize>,
    },
}

/// Everything that configures a chunked-dense call besides the buffers.
#[derive(Clone, Debug, PartialEq)]
pub struct DenseConfig {
    /// Rows.
    pub n: usize,
    /// Hidden size.
    pub d: usize,
    /// Classes.
    pub v: usize,
    /// dtype of `e`, `c`, `bias` (and of `G`).
    pub dtype: DType,
    /// Whether a bias is given.
    pub has_bias: bool,
    /// Rows per chunk (the plan's `chunk_rows`).
    pub chunk_rows: usize,
    /// [`cce_core::Strategy::SplitDense`]: classes per chunk of the class pass (`d_c` complete
    /// per class chunk, no f32 accumulator); `None`: chunked dense.
    pub chunk_classes: Option<usize>,
    /// Split dense: the row pass computes `d_e` from f16 `G` and `c` in f16 (see
    /// [`cce_core::Strategy::SplitDense`]); false: `G` in the input dtype.
    pub de_f16: bool,
    /// Tile shape of the plan, for the tile statistics (rows, classes).
    pub tile: (usize, usize),
    /// Softcap `s` (0 or negative: off).
    pub softcap: Option<f32>,
    /// Label smoothing `α`.
    pub label_smoothing: f32,
    /// z-loss weight `λ`.
    pub z_loss: f32,
    /// Loss reduction.
    pub reduction: Reduction,
    /// The resolved filter rule.
    pub filter: FilterRule,
    /// Gradients in f32 (else the input dtype).
    pub grad_f32: bool,
    /// Compute `d_e`.
    pub compute_d_e: bool,
    /// Compute `d_c` (and `d_bias`).
    pub compute_d_c: bool,
    /// Entropy side output.
    pub want_entropy: bool,
    /// Argmax side output.
    pub want_argmax: bool,
    /// Row pass of forward+backward calls.
    pub row_pass: RowPass,
    /// The plan's sparse backward, tried first in filtered backward calls (split dense only).
    pub sparse: Option<cce_core::SparseBackward>,
    /// The plan's class tiles of forward-only calls ([`cce_core::ClassForward`]; a backend
    /// call's fitted within [`FORWARD_WORKSPACE_CAP`]); `None`: the row chunks.
    pub class_forward: Option<cce_core::ClassForward>,
    /// Forward-only calls take the fused WGMMA forward (`kernels/wgmma.cu`) where it applies
    /// (`schedule::wgmma_forward_rows`); else the class tiles or row chunks. Default
    /// [`WGMMA_FORWARD_DEFAULT`].
    pub wgmma_forward: bool,
    /// Split dense's class pass computes `G` in the epilogue of a WGMMA GEMM
    /// (`cce_wgmma_gcols_*`, no f32 logits) where it applies
    /// (`schedule::wgmma_gcols_classes`); else a cuBLAS logits GEMM and `cce_split_gcols_*`.
    /// Default [`WGMMA_GCOLS_DEFAULT`].
    pub wgmma_gcols: bool,
    /// The dense row pass (split or chunked dense) of a forward-and-backward call computes the
    /// logits in a WGMMA GEMM whose epilogue writes the lse partials and bf16 `e^{z − m}`, then
    /// `G` in place (chunked dense's `d_c` GEMM reads that `G` too)
    /// (`cce_wgmma_lseq*`, `cce_wgmma_qrows_g*`), where it applies
    /// (`schedule::wgmma_rows_unfit`); else a cuBLAS f32 logits GEMM and the forward and
    /// backward row kernels. Default [`WGMMA_ROWS_DEFAULT`].
    pub wgmma_rows: bool,
    /// A sparse backward that gives way ends the call instead of handing its rows to the dense
    /// passes ([`DenseStats::gave_way_stop`]): the caller runs the call again on the exact
    /// call's plan (`schedule::give_way_plan`). False unless the backend has such a plan.
    pub stop_on_give_way: bool,
    /// Chunked dense with gradients in the input dtype accumulates `d_c` across its row chunks
    /// in the caller's `d_c` (each chunk's product summed in f32, then added and rounded to
    /// the gradient dtype by the GEMM) instead of an f32 `V x D` accumulator in the workspace:
    /// Liger's trade, 3 GEMMs within a budget that holds no accumulator, one rounding of the
    /// running sum per chunk (`call_plan::dc_in_grad_dtype`,
    /// [`crate::CudaSwitches::dc_in_grad_dtype`]). False unless set.
    pub dc_in_grad_dtype: bool,
}

/// The backend's switches that reach the engine's configuration ([`crate::CudaSwitches`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PathSwitches {
    /// [`DenseConfig::wgmma_forward`].
    pub wgmma_forward: bool,
    /// [`DenseConfig::wgmma_gcols`].
    pub wgmma_gcols: bool,
    /// [`DenseConfig::wgmma_rows`].
    pub wgmma_rows: bool,
    /// Chunked dense may accumulate `d_c` in the gradient dtype where the budget holds no f32
    /// accumulator ([`DenseConfig::dc_in_grad_dtype`]).
    pub dc_in_grad_dtype: bool,
}

impl PathSwitches {
    /// Every WGMMA path where it applies, `d_c` accumulated in f32 (the defaults).
    pub const DEFAULT: Self = Self {
        wgmma_forward: WGMMA_FORWARD_DEFAULT,
        wgmma_gcols: WGMMA_GCOLS_DEFAULT,
        wgmma_rows: WGMMA_ROWS_DEFAULT,
        dc_in_grad_dtype: false,
    };
}

impl DenseConfig {
    /// The configuration of a plan (which must be `ChunkedDense`) and its options.
    pub fn from_plan(plan: &cce_core::Plan, opts: &cce_core::Options) -> Result<Self> {
        let (chunk_rows, chunk_classes, de_f16) = match plan.strategy {
            cce_core::Strategy::ChunkedDense { chunk_rows } => (chunk_rows, None, false),
            cce_core::Strategy::SplitDense {
                chunk_rows,
                chunk_classes,
                de_f16,
            } => (chunk_rows, Some(chunk_classes), de_f16),
            other => {
                return Err(CceError::InvalidOption {
                    name: "plan.strategy",
                    reason: format!("chunked-dense engine given a {other} plan"),
                })
            }
        };
        let p = &plan.problem;
        Ok(Self {
            n: p.n,
            d: p.d,
            v: p.v,
            dtype: p.dtype,
            has_bias: p.has_bias,
            chunk_rows,
            chunk_classes,
            de_f16,
            tile: (plan.tile.rows, plan.tile.classes),
            softcap: opts.softcap,
            label_smoothing: opts.label_smoothing,
            z_loss: opts.z_loss,
            reduction: opts.reduction,
            filter: plan.filter,
            grad_f32: opts.grad_dtype == cce_core::GradDType::F32 || p.dtype == DType::F32,
            compute_d_e: opts.compute_d_e,
            compute_d_c: opts.compute_d_c,
            want_entropy: opts.side_outputs.entropy,
            want_argmax: opts.side_outputs.argmax,
            // Measured on the H200 (docs/perf-log.md): the two-pass row kernels are as fast as
            // the cluster-fused kernel in exact mode and faster with the filter on.
            row_pass: RowPass::TwoPass,
            sparse: if chunk_classes.is_some() {
                plan.sparse
            } else {
                None
            },
            class_forward: plan.forward,
            wgmma_forward: WGMMA_FORWARD_DEFAULT,
            wgmma_gcols: WGMMA_GCOLS_DEFAULT,
            wgmma_rows: WGMMA_ROWS_DEFAULT,
            stop_on_give_way: false,
            dc_in_grad_dtype: false,
        })
    }

    /// Whether entries are skipped: the filter is on for both gradients.
    pub fn filtering(&self) -> bool {
        self.filter.enabled && self.filter.filter_e_grad && self.filter.filter_c_grad
    }

    /// f32 row stride of the logits chunk: `V` rounded up to 8 (32-byte rows).
    pub fn ld(&self) -> usize {
        self.v.div_ceil(8) * 8
    }

    /// Rows per chunk actually used: the plan's, at most `N`. (cuBLAS takes 32-bit sizes and
    /// leading dimensions but addresses matrices of more than 2³¹ elements, so the chunk is
    /// not clamped further.)
    pub fn effective_chunk_rows(&self) -> usize {
        self.chunk_rows.clamp(1, self.n)
    }

    /// dtype of `G` (the input dtype).
    pub(crate) fn g_dtype(&self) -> DType {
        self.dtype
    }

    /// Split dense: f32 row stride of the class pass's logits, the chunk's classes rounded up
    /// to 8.
    pub(crate) fn ld_classes(&self) -> usize {
        self.chunk_classes.unwrap_or(0).clamp(1, self.v).div_ceil(8) * 8
    }

    /// Split dense: dtype of the class pass's `G` and `e` operands (f16 for 16-bit inputs,
    /// f32 for f32 inputs).
    pub(crate) fn class_pass_dtype(&self) -> DType {
        if self.dtype == DType::F32 {
            DType::F32
        } else {
            DType::F16
        }
    }

    /// Split dense: how the row pass stores `G` for `d_e` (the backward row kernel's mode,
    /// `rows.cu` "GStore"): 0 in the input dtype (written over the logits; `d_e` straight
    /// from one GEMM), 2 in f16 scaled per row (`d_e` through f32 rows and a finishing pass).
    pub(crate) fn g_mode(&self) -> u8 {
        let f16_g = self.dtype == DType::F16 || (self.dtype == DType::BF16 && self.de_f16);
        if self.chunk_classes.is_some() && self.compute_d_e && f16_g {
            2
        } else {
            0
        }
    }

    /// dtype of the returned gradients.
    pub fn grad_dtype(&self) -> DType {
        if self.grad_f32 {
            DType::F32
        } else {
            self.dtype
        }
    }

    /// dtype `d_c` is accumulated in across chunked dense's row chunks: f32 (the f32 output
    /// or the workspace's accumulator), or the gradient dtype with
    /// [`Self::dc_in_grad_dtype`].
    pub(crate) fn dc_acc_dtype(&self) -> DType {
        if self.dc_in_grad_dtype {
            self.grad_dtype()
        } else {
            DType::F32
        }
    }

    pub(super) fn row_tiles(&self) -> usize {
        self.n.div_ceil(self.tile.0)
    }

    pub(super) fn class_tiles(&self) -> usize {
        self.v.div_ceil(self.tile.1)
    }
}
