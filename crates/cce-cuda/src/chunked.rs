//! [`cce_core::Strategy::ChunkedDense`] and [`cce_core::Strategy::SplitDense`] on CUDA:
//! materialized f32 logits chunks, cuBLAS for the products, custom row kernels
//! (`kernels/chunked.cu`) for everything between them.
//!
//! Split dense runs a row pass (steps 1-4 below per row chunk, with `G` for `d_e` in f16
//! scaled per row against an f16 copy of `c` when [`DenseConfig::de_f16`], else in the input
//! dtype) and then a class pass per chunk of classes over all rows (logits recomputed, `G` from
//! the saved lse in f16 with one power-of-two scale, `d_c` rows complete against an f16 copy of
//! `e`); see `chunked.cu` "Split dense". On Hopper the class pass's logits and `G` are one WGMMA
//! kernel whose epilogue writes `G` from the registers (`wgmma.cu` `cce_wgmma_gcols[_cap]_*`,
//! [`DenseEngine::wgmma_gcols_classes`]); elsewhere a cuBLAS logits GEMM then
//! `cce_split_gcols_*`. On Hopper, a forward-and-backward call with bf16 inputs and bf16 `G`
//! for `d_e` also runs its row pass without f32 logits (steps 1+2+3' below: `wgmma.cu` (3),
//! [`DenseEngine::wgmma_rows_unfit`]). Its dense passes skip nothing when the filter is on.
//!
//! Filtered split-dense calls first try the plan's [`cce_core::SparseBackward`]
//! ([`DenseEngine`]'s `sparse_backward`; `chunked.cu` "Sparse backward"): per row chunk the
//! logits GEMM, the forward rows (in a forward-and-backward call folded into the select
//! kernel, `cce_sparse_select_fwd_*`, which then computes lse and loss in its first read of
//! the row), the kept entries (`g0 ≥ τ_i`) as (class, G) records, `d_e`
//! by gathering rows of `c` (on peaked data in one launch after the last chunk); then the
//! records regrouped by class and `d_c`, `d_bias` by gathering rows of `e` (one column slice
//! of `e` at a time across the classes, so that the slice stays in L2). One logits GEMM, two host syncs (after the first chunk, whose density
//! decides, and after the row pass). When the first chunk keeps more than `max_mean_kept`
//! entries per row or the records would outgrow the scratch, the dense passes run instead and
//! the backward's `plan_reason` says why. Not deterministic (the regrouping by class uses
//! atomics), so deterministic calls never take it.
//!
//! Per chunk of `R` rows (`r0..r0+R`), all on one stream (the class-tiled forward is the only
//! user of the second stream):
//!
//! | step | what | engine | bytes moved per logit |
//! |---|---|---|---|
//! | 1 | `L = E_r · Cᵀ`, f32 `[R, V]` | `cublasGemmEx` (bf16/f16 in, f32 out, f32 compute) | write 4 |
//! | 2 | bias, softcap, lse, loss, entropy, argmax | `cce_dense_fwd_*` | read 4 |
//! | 3 | `G` in the input dtype, written over `L`; per-row filter threshold | `cce_dense_bwd_*` | read 4 (+4 filtered), write 2 |
//! | 2+3 | both in one read, the row resident in a cluster's shared memory | `cce_dense_fused_*` | read 4, write 2 |
//! | 4 | `d_e_r = G · C` (input dtype or f32 out) | `cublasGemmEx` | read 2 |
//! | 5 | `d_c += Gᵀ · E_r` into an f32 `[V, D]` accumulator | `cublasGemmEx`, beta = 1 | read 2 |
//! | 6 | `d_bias += Σ_rows G` | `cce_dense_colsum_*` | read 2 (with a bias only) |
//! | 1+2 | forward only (below): lse partials in the GEMM's epilogue, no `L` | `cce_wgmma_lse_*` + `cce_wgmma_lse_combine_*` | none (8 bytes per row per 256 logits) |
//! | 1+3' | split dense's class pass: `G` of a class chunk in the GEMM's epilogue, no `L` | `cce_wgmma_gcols[_cap]_*` | write 2 (f16 `G`) |
//! | 1+2+3' | split dense's row pass (forward and backward, bf16): lse partials and f16 `q = e^{z − max_tile}` in the GEMM's epilogue, the combine (lse, loss, `z_y`), then `G = cp·q·e^{max_tile − lse}` over `q` as bf16 (the target's `cd − cp·rest`, [`DenseForwardOut::rest`]) | `cce_wgmma_lseq[_x]_bf16`, `cce_wgmma_lse_combine_bf16`, `cce_wgmma_qrows_g[_cap]_bf16` | write 2, read 2, write 2 |
//!
//! Forward only, on compute capability 9.0 with bf16 / f16 inputs, no label smoothing, entropy
//! or argmax and `D` a multiple of 64 (bias and softcap in the epilogue: `cce_wgmma_lse_x_*`) ([`DenseEngine::wgmma_forward_rows`];
//! switch: [`DenseConfig::wgmma_forward`], [`crate::CudaSwitches::wgmma_forward`]), is one fused kernel instead
//! of steps 1-2: `cce_wgmma_lse_*` (`kernels/wgmma.cu`), a persistent TMA + WGMMA GEMM whose
//! epilogue reduces each 128 x 256 tile of logits to per-row (max, Σexp) partials (8 bytes per
//! row and 256 classes in the scratch; the logits never reach memory), then
//! `cce_wgmma_lse_combine_*` per row (lse, the target logit as a dot product of `e` and `c`
//! rows, the loss), in row groups when the partials of all rows do not fit the scratch. It
//! measured 0.97-1.0x one cuBLAS logits GEMM at N 32768, D 4096, V 256000 (bf16, H200;
//! `benches/wgmma/NOTES.md`). Elsewhere forward only is steps 1-2,
//! over the plan's [`cce_core::ClassForward`] tiles when it has them
//! (all rows x a chunk of classes per GEMM, two buffers, the row reductions `cce_cls_fwd_*` on
//! a second stream folding each tile into a running lse state; `chunked.cu` "(2')"); a
//! backward from a saved lse is 1, 3, 4, 5 (it recomputes the logits: 4 GEMMs with the
//! forward). [`DenseEngine::forward_backward`] runs 3 GEMMs.
//!
//! `G` overwrites the logits chunk in place (16-bit `G` has the row stride `2·ld`), so the
//! workspace is the plan's `chunk_rows · V · 4` bytes plus the f32 `d_c` accumulator.
//!
//! Filtering: with the filter on (both `filter_e_grad` and `filter_c_grad`), each active row
//! gets the exact threshold `τ_i` of [`cce_core::filter`] from a histogram of
//! `g0 = |p − onehot|` (65 bins, fixed-point masses), and entries with `g0 < τ_i` are zeroed
//! in `G` (label smoothing's `−α g_i / V` stays: it is the analytic rank-1 term). Since `G` is
//! dense for cuBLAS this saves no time; it is element-level and reports what a sparse backward
//! would skip. With only one of `filter_e_grad` / `filter_c_grad`, nothing is skipped (allowed:
//! "an implementation may skip fewer").
//!
//! Numerics shared by every pass (MATH.md): each forward writes, beside the lse, the row's
//! `rest = 1 − p_y = Σ_{j≠y} e^{z_j − m} / Σ_j e^{z_j − m}` ([`DenseForwardOut::rest`]), its
//! non-target sum accumulated on its own (the target's column left out of every per-row or
//! per-tile Σexp by one compare-and-select), and every backward forms the target's entry of `G`
//! as `cd − cp·rest − cc` (`chunked.cu` `g_target`) instead of `e^{z_y − lse} − 1`, which
//! is 0 once `1 − p_y` is below the f32 lse's resolution (confident rows); the f16 `G` scales
//! bound `|G|` by `rest` too (`g_bound`), so such rows are not flushed to zero. A logit of −inf
//! (a class masked by a −inf bias entry) has p = 0, stays −inf under the softcap, adds 0 to
//! every sum (a tile whose max is −inf contributes (−inf, 0)) and gets exactly 0 in `G`; a row
//! whose target is masked is rejected by the backend before any launch; a −inf from the logits
//! GEMM itself (−inf in `e` or `c`) becomes NaN in the forward kernels (`gemm_logit`), so that
//! `check_finite` names the input instead of silently masking a class. The softcap's factor
//! is `1 − tanh²(x/s)` from `x` (`cap_grad`, `cap_fast_grad`), never `1 − (z/s)²`, except in
//! the WGMMA row pass's `G` pass (hence [`WGMMA_ROWS_SOFTCAP_MIN`]).
//!
//! Everything is deterministic: fixed reduction trees, cuBLAS with a fixed workspace (cuBLAS
//! GEMMs are run-to-run deterministic on one device and stream unless split-K atomics are
//! chosen, which cuBLAS does not do by default), the d_c accumulation in chunk order.

use cce_core::filter::{FilterRule, N_BINS};
use cce_core::{CceError, DType, Reduction, Result};
use cudarc::cublas::{result as cublas_result, sys as cublas_sys};
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DriverError, LaunchConfig,
    PushKernelArg,
};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

const BACKEND: &str = "cuda";

/// The kernel source (`kernels/chunked.cu`, then `kernels/wgmma.cu`: the fused WGMMA forward,
/// compiled only for sm_90a).
pub const KERNEL_SOURCE: &str = concat!(
    include_str!("../kernels/chunked.cu"),
    include_str!("../kernels/wgmma.cu")
);

/// Whether forward-only calls take the fused WGMMA forward where it applies
/// ([`DenseConfig::wgmma_forward`], [`crate::CudaSwitches::wgmma_forward`]).
pub const WGMMA_FORWARD_DEFAULT: bool = true;
/// Whether split dense's class pass takes the WGMMA GEMM with `G` in its epilogue where it
/// applies ([`DenseConfig::wgmma_gcols`], [`crate::CudaSwitches::wgmma_gcols`]).
pub const WGMMA_GCOLS_DEFAULT: bool = true;
/// Whether split dense's row pass in a forward-and-backward call takes the WGMMA GEMM with the
/// lse partials and f16 `e^{z − m}` in its epilogue where it applies
/// ([`DenseConfig::wgmma_rows`], [`DenseEngine::wgmma_rows_unfit`],
/// [`crate::CudaSwitches::wgmma_rows`]).
pub const WGMMA_ROWS_DEFAULT: bool = true;
/// Largest softcap the WGMMA epilogues take: their `cap_fast` (`wgmma.cu`) has an absolute
/// error of a few `s·2⁻²²` (~1e-5 at 30, under the f32 logits' own rounding); above this the
/// class tiles / cuBLAS class pass with `tanhf` run instead.
pub const WGMMA_SOFTCAP_MAX: f32 = 100.0;
/// Smallest softcap split dense's WGMMA row pass takes: its `G` pass (`cce_wgmma_qrows_g_cap_*`)
/// forms the softcap factor `1 − (z/s)²` from `z` rebuilt from the f16 `e^{z − max}`, which has
/// no relative accuracy once `|x|` is many times `s` (the factor is then ~`4e^{−2|x|/s}`); under
/// this cap the cuBLAS row pass with the exact factor runs instead.
pub const WGMMA_ROWS_SOFTCAP_MIN: f32 = 1.0;
/// Threads of `cce_wgmma_lse_*` (producer warpgroup + 2 consumer warpgroups).
const WGMMA_THREADS: u32 = 384;
/// Tile of `cce_wgmma_lse_*`: rows of E, rows of C (classes), K-step (`wgmma.cu`).
const WGMMA_BM: usize = 128;
const WGMMA_BN: usize = 256;
const WGMMA_BK: usize = 64;
/// Dynamic shared memory of `cce_wgmma_lse_*`: 4 stages of (128 + 256) x 64 16-bit values,
/// 1024 bytes of alignment slack, 8 mbarriers.
const WGMMA_SMEM_BYTES: usize = 4 * (WGMMA_BM + WGMMA_BN) * WGMMA_BK * 2 + 1024 + 8 * 8;
/// Dynamic shared memory of the WGMMA kernels with f16 outputs (`cce_wgmma_lseq*`,
/// `cce_wgmma_gcols*`): the stages, 1024 bytes of alignment slack, the mbarriers padded to
/// 1024 bytes, then a 64 x 256 f16 output staging buffer for their TMA stores (`wgmma.cu`
/// `store_f16_tile`).
const WGMMA_SMEM_OUT_BYTES: usize =
    4 * (WGMMA_BM + WGMMA_BN) * WGMMA_BK * 2 + 1024 + 1024 + 64 * WGMMA_BN * 2;
/// Row tiles per group of the grouped tile order (16 measured best, 8 and 32 the same).
const WGMMA_GROUP_M: i32 = 16;
/// Threads (one warp per row) of `cce_wgmma_lse_combine_*`.
const WGMMA_COMBINE_THREADS: u32 = 256;
/// Threads (one warp per 256-column tile of a row) of `cce_wgmma_qrows_g*`.
const WGMMA_QROWS_THREADS: u32 = 256;

/// A `CUtensorMap` as a kernel argument: the 128 opaque bytes `cuTensorMapEncodeTiled`
/// wrote, passed by value (`const __grid_constant__ TmaDesc` in `wgmma.cu`, 64-byte aligned).
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug)]
struct TmaDesc([u64; 16]);

// SAFETY: `TmaDesc` is plain old data (16 u64, `repr(C)`, no padding, no pointers the device
// dereferences as Rust values) with the size (128) and alignment (64) of the kernel's
// `struct __align__(64) TmaDesc { u64 w[16]; }` parameter; the driver copies its bytes into
// the parameter space.
unsafe impl cudarc::driver::DeviceRepr for TmaDesc {}

/// Threads per block of the kernels (must match the `#define`s in `chunked.cu`).
const FWD_THREADS: u32 = 256;
const BWD_THREADS: u32 = 512;
const FUSED_THREADS: u32 = 512;
const COLSUM_THREADS: u32 = 256;
/// Threads (one warp per row) of `cce_dense_target_fix_*`.
const TFIX_THREADS: u32 = 256;
const SEL_THREADS: u32 = 512;
const CLS_THREADS: u32 = 256;
/// Rows per block of `cce_cls_fwd_*` (one warp each).
const CLS_ROWS_PER_BLOCK: usize = CLS_THREADS as usize / 32;
/// Threads and rows (one warp each) per block of `cce_split_gcols_*`.
const GC_THREADS: u32 = 256;
const GC_ROWS: usize = GC_THREADS as usize / 32;
const GATHER_THREADS: u32 = 128;
const GATHER_WARPS: u32 = 8;
/// Row blocks of the d_c gathers over the class lists (light: `cce_sparse_gather_*_l`, heavy:
/// `_h`, times the column blocks); they stride over the lists (classes without records are
/// listed, and written as zeros, only where most classes have records; else a memset zeroes
/// d_c first). Heavy classes hold more than 128 records each, so there are few.
const GATHER_LIGHT_ROW_BLOCKS: u32 = 1024;
const GATHER_HEAVY_ROW_BLOCKS: u32 = 256;
/// Threads of a light d_c gather block and of a d_e gather block (`LIGHT_WARPS` in
/// chunked.cu).
const GATHER_LIGHT_THREADS: u32 = 256;

/// Mean kept entries per row (the probe's) above which the sparse backward runs the forward
/// rows and select apart rather than folded (`cce_sparse_select_fwd_*`). Rows keeping more
/// have more candidates per select warp, and the folded form compacts its candidate slots
/// more often: session 7 run 3 measured the folded form faster at 3 and 209 kept entries per
/// row (V = 128256: c/8 10.49 against 11.17 ms at 4096 rows) and slower at 327 (the seed's
/// c/8: select 39-40 ms against 9.4 + 21.2 apart). The bound sits between.
const FOLD_MAX_KEPT: f64 = 256.0;

/// Classes per scan block (`SCAN_TILE`) and its threads (`SCAN_THREADS`).
const SCAN_TILE: usize = 4096;
const SCAN_THREADS: u32 = 256;
/// Cluster sizes the fused kernel is instantiated for.
pub const CLUSTER_SIZES: [usize; 5] = [1, 2, 4, 8, 16];
/// Dynamic shared memory per block the automatic cluster choice aims at: two blocks of 512
/// threads per SM, so that one block loads while the other computes or writes.
const FUSED_TARGET_SMEM_BYTES: usize = 100 << 10;
/// cuBLAS workspace (Hopper kernels want up to 32 MiB).
pub const CUBLAS_WORKSPACE_BYTES: usize = 32 << 20;

fn drv(e: DriverError) -> CceError {
    CceError::backend(BACKEND, e)
}

fn alloc_err(e: DriverError, bytes: usize) -> CceError {
    if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        CceError::OutOfMemory {
            backend: BACKEND,
            requested_bytes: bytes as u64,
        }
    } else {
        drv(e)
    }
}

fn dtype_code(dt: DType) -> Result<&'static str> {
    match dt {
        DType::F32 => Ok("f32"),
        DType::F16 => Ok("f16"),
        DType::BF16 => Ok("bf16"),
        other => Err(CceError::Unsupported {
            backend: BACKEND,
            what: format!("dtype {other} in the chunked-dense kernels"),
        }),
    }
}

fn cuda_type(dt: DType) -> Result<cublas_sys::cudaDataType> {
    match dt {
        DType::F32 => Ok(cublas_sys::cudaDataType::CUDA_R_32F),
        DType::F16 => Ok(cublas_sys::cudaDataType::CUDA_R_16F),
        DType::BF16 => Ok(cublas_sys::cudaDataType::CUDA_R_16BF),
        other => Err(CceError::Unsupported {
            backend: BACKEND,
            what: format!("dtype {other} in cuBLAS"),
        }),
    }
}

/// The exponent `k` (clamped to ±100) with `max · 2^k ≤ 2^top`; 0 for a zero or non-finite max.
fn pow2_to(max: f32, top: i32) -> i32 {
    if max > 0.0 && max.is_finite() {
        (top - max.log2().ceil() as i32).clamp(-100, 100)
    } else {
        0
    }
}

fn to_i32(x: usize, what: &str) -> Result<i32> {
    i32::try_from(x).map_err(|_| CceError::ResourceLimit {
        resource: format!("{what} (32-bit cuBLAS / kernel argument)"),
        requested: x as u64,
        max: i32::MAX as u64,
    })
}

// ----------------------------------------------------------------------------------------------
// Compilation
// ----------------------------------------------------------------------------------------------

pub use crate::device::{arch_of, compile_options};

/// This module's source for the process caches of [`crate::device`].
pub(crate) const SOURCE: crate::device::Source = crate::device::Source {
    tag: "cce-dense",
    text: || KERNEL_SOURCE.to_string(),
};

/// Compile `chunked.cu` + `wgmma.cu` for `arch` to a CUBIN with NVRTC, through the process and
/// disk caches ([`crate::device`]). Errors: `NoDevice` when libnvrtc cannot be loaded,
/// `Backend` with the compiler log when the source does not compile.
pub fn compile_cubin(arch: &str) -> Result<Vec<u8>> {
    Ok(crate::device::compile_cached(SOURCE, arch)?.to_vec())
}

/// Compile without the cache. Returns the CUBIN.
pub fn compile_uncached(source: &str, options: &[String]) -> Result<Vec<u8>> {
    crate::device::nvrtc_compile(source, "chunked.cu", options)
}

// ----------------------------------------------------------------------------------------------
// Configuration
// ----------------------------------------------------------------------------------------------

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
    /// The plan's class tiles of forward-only calls ([`cce_core::ClassForward`]); `None`: the
    /// row chunks.
    pub class_forward: Option<cce_core::ClassForward>,
    /// Forward-only calls take the fused WGMMA forward (`kernels/wgmma.cu`) where it applies
    /// ([`DenseEngine::wgmma_forward_rows`]); else the class tiles or row chunks. Default
    /// [`WGMMA_FORWARD_DEFAULT`].
    pub wgmma_forward: bool,
    /// Split dense's class pass computes `G` in the epilogue of a WGMMA GEMM
    /// (`cce_wgmma_gcols_*`, no f32 logits) where it applies
    /// ([`DenseEngine::wgmma_gcols_classes`]); else a cuBLAS logits GEMM and `cce_split_gcols_*`.
    /// Default [`WGMMA_GCOLS_DEFAULT`].
    pub wgmma_gcols: bool,
    /// Split dense's row pass of a forward-and-backward call computes the logits in a WGMMA
    /// GEMM whose epilogue writes the lse partials and f16 `e^{z − m}`, then `G` in place
    /// (`cce_wgmma_lseq*`, `cce_wgmma_qrows_g*`), where it applies
    /// ([`DenseEngine::wgmma_rows_unfit`]); else a cuBLAS f32 logits GEMM and the forward and
    /// backward row kernels. Default [`WGMMA_ROWS_DEFAULT`].
    pub wgmma_rows: bool,
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
    pub fn g_dtype(&self) -> DType {
        self.dtype
    }

    /// Split dense: f32 row stride of the class pass's logits, the chunk's classes rounded up
    /// to 8.
    pub fn ld_classes(&self) -> usize {
        self.chunk_classes.unwrap_or(0).clamp(1, self.v).div_ceil(8) * 8
    }

    /// Split dense: dtype of the class pass's `G` and `e` operands (f16 for 16-bit inputs,
    /// f32 for f32 inputs).
    pub fn class_pass_dtype(&self) -> DType {
        if self.dtype == DType::F32 {
            DType::F32
        } else {
            DType::F16
        }
    }

    /// Split dense: bytes of the f16 copy of `e` (bf16 inputs with `d_c` only), rounded up to
    /// 256 so that the f32 chunk after it stays aligned.
    pub fn e16_bytes(&self) -> usize {
        if self.chunk_classes.is_some() && self.dtype == DType::BF16 && self.compute_d_c {
            (self.n * self.d * 2).div_ceil(256) * 256
        } else {
            0
        }
    }

    /// Split dense: how the row pass stores `G` for `d_e` (the backward row kernel's mode,
    /// `chunked.cu` "GStore"): 0 in the input dtype (written over the logits; `d_e` straight
    /// from one GEMM), 2 in f16 scaled per row (`d_e` through f32 rows and a finishing pass).
    pub fn g_mode(&self) -> u8 {
        let f16_g = self.dtype == DType::F16 || (self.dtype == DType::BF16 && self.de_f16);
        if self.chunk_classes.is_some() && self.compute_d_e && f16_g {
            2
        } else {
            0
        }
    }

    /// Split dense: byte offsets in the workspace's scratch buffer of the row pass's regions
    /// (256-byte aligned): the f16 copy of `c`, the logits, the f32 `d_e` rows, the per-row
    /// scales; and the end.
    pub fn row_layout(&self) -> RowLayout {
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

    /// Split dense: bytes of the f32 `d_c` chunk that f16 operands need before a bf16 output
    /// (cuBLAS has no f16 x f16 → bf16 GEMM).
    pub fn dc_tmp_bytes(&self) -> usize {
        match self.chunk_classes {
            Some(k) if self.dtype == DType::BF16 && self.compute_d_c && !self.grad_f32 => {
                k.clamp(1, self.v) * self.d * 4
            }
            _ => 0,
        }
    }

    /// Bytes of the workspace's scratch buffer: the row chunk's logits (chunked dense); split
    /// dense's row pass ([`DenseConfig::row_layout`]), its class pass (the logits `N x
    /// ld_classes` f32 and the f32 `d_c` temp each rounded up to 256 bytes, plus the f16 copy
    /// of `e`, so that the WGMMA class pass's layout, [`DenseConfig::gcols_layout`], always
    /// holds the chunks of the cuBLAS one) and the sparse backward's pairs (the plan sized
    /// them to fit; chunks capped by a test knob may leave it smaller, then it grows); the
    /// class-tiled forward's buffers.
    pub fn scratch_bytes(&self) -> usize {
        let al = |x: usize| x.div_ceil(256) * 256;
        if self.chunk_classes.is_some() {
            self.row_layout()
                .end
                .max(
                    al(self.n * self.ld_classes() * 4) + self.e16_bytes() + al(self.dc_tmp_bytes()),
                )
                .max(self.sparse.map_or(0, |sp| sp.scratch_bytes))
        } else {
            self.effective_chunk_rows() * self.ld() * 4
        }
        .max(self.class_forward.map_or(0, |cf| cf.bytes(self.n)))
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
    /// whether the epilogue applies is [`DenseEngine::wgmma_gcols_classes`]'s.
    pub fn gcols_layout(&self, scratch: usize) -> Option<GColsLayout> {
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

    /// dtype of the returned gradients.
    pub fn grad_dtype(&self) -> DType {
        if self.grad_f32 {
            DType::F32
        } else {
            self.dtype
        }
    }

    fn row_tiles(&self) -> usize {
        self.n.div_ceil(self.tile.0)
    }

    fn class_tiles(&self) -> usize {
        self.v.div_ceil(self.tile.1)
    }
}

// ----------------------------------------------------------------------------------------------
// Buffers
// ----------------------------------------------------------------------------------------------

/// Byte offsets of split dense's row-pass regions ([`DenseConfig::row_layout`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowLayout {
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
pub struct GColsLayout {
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
    chunk_rows: usize,
    ld: usize,
    logits: CudaSlice<u8>,
    tau: CudaSlice<u8>,
    scales: CudaSlice<u8>,
    dc_acc: Option<CudaSlice<u8>>,
    dbias_acc: Option<CudaSlice<u8>>,
    row_loss: CudaSlice<u8>,
    kept: CudaSlice<u8>,
    dropped: CudaSlice<u8>,
    flags: CudaSlice<u8>,
    edges: CudaSlice<u8>,
    stats: CudaSlice<u8>,
    /// Sparse backward: row offsets then row counts, u32 `[N]` each.
    sparse_rows: CudaSlice<u8>,
    /// Sparse backward: pair counter (u64), overflow flag and re-read rows (u32), the folded
    /// select's lse − max histogram of the probe rows (32 u32).
    sparse_ctl: CudaSlice<u8>,
    bytes: u64,
}

impl DenseWorkspace {
    /// Allocate the workspace of `cfg` on the engine's stream.
    pub fn new(engine: &DenseEngine, cfg: &DenseConfig) -> Result<Self> {
        let chunk_rows = cfg.effective_chunk_rows();
        let ld = cfg.ld();
        let mut bytes = 0u64;
        let mut alloc = |n: usize| -> Result<CudaSlice<u8>> {
            let n = n.max(4);
            bytes += n as u64;
            // SAFETY: every byte of a workspace buffer is written on the device before it is
            // read (logits by the GEMM, accumulators zeroed per call, row state by kernels).
            unsafe { engine.stream.alloc::<u8>(n) }.map_err(|e| alloc_err(e, n))
        };
        let logits = alloc(cfg.scratch_bytes())?;
        let tau = alloc(if cfg.chunk_classes.is_some() {
            cfg.n * 4
        } else {
            4
        })?;
        let scales = alloc(8)?;
        let dc_acc = if cfg.compute_d_c && !cfg.grad_f32 && cfg.chunk_classes.is_none() {
            Some(alloc(cfg.v * cfg.d * 4)?)
        } else {
            None
        };
        let dbias_acc = if cfg.compute_d_c && cfg.has_bias && !cfg.grad_f32 {
            Some(alloc(cfg.v * 4)?)
        } else {
            None
        };
        let row_loss = alloc(cfg.n * 4)?;
        // Filter statistics: split dense never filters (see `run`), so it keeps placeholders,
        // unless it tries a sparse backward.
        let split = cfg.chunk_classes.is_some() && cfg.sparse.is_none();
        let kept = alloc(if split { 4 } else { cfg.n * 4 })?;
        let dropped = alloc(if split { 4 } else { cfg.n * 4 })?;
        let flags = alloc(if split {
            4
        } else {
            cfg.row_tiles() * cfg.class_tiles() * 4
        })?;
        let sparse_rows = alloc(if cfg.sparse.is_some() { cfg.n * 8 } else { 4 })?;
        // Pairs (u64), overflow and re-read rows (u32 each), then the folded select's
        // histogram of lse − max over the probe's rows (32 u32).
        let sparse_ctl = alloc(16 + 32 * 4)?;
        let mut edges = alloc(N_BINS * 4)?;
        let stats = alloc(8 * 8)?;
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

/// Inputs of a call. Every buffer is raw bytes on the engine's device.
#[derive(Clone, Copy, Debug)]
pub struct DenseInputs<'a> {
    /// `e` `[N, D]` in `dtype`.
    pub e: &'a CudaSlice<u8>,
    /// `c` `[V, D]` in `dtype`.
    pub c: &'a CudaSlice<u8>,
    /// `bias` `[V]` in `dtype`.
    pub bias: Option<&'a CudaSlice<u8>>,
    /// Prepared targets, i32 `[N]`: the class, or −1 for an ignored row (shift applied).
    pub targets: &'a CudaSlice<u8>,
    /// Rows with a class.
    pub n_valid: usize,
}

/// Upstream gradient of the loss.
#[derive(Clone, Copy, Debug)]
pub enum DenseDLoss<'a> {
    /// `∂L/∂loss` (mean, sum; with `Reduction::None` every valid row gets it).
    Scalar(f32),
    /// `∂L/∂loss_i`, f32 `[N]`.
    PerRow(&'a CudaSlice<u8>),
}

/// Upstream gradients.
#[derive(Clone, Copy, Debug)]
pub struct DenseUpstream<'a> {
    /// Of the loss.
    pub d_loss: DenseDLoss<'a>,
    /// Of the lse, f32 `[N]`.
    pub d_lse: Option<&'a CudaSlice<u8>>,
}

/// Forward outputs (caller-allocated).
#[derive(Debug)]
pub struct DenseForwardOut<'a> {
    /// f32 `[1]` (mean, sum) or `[N]` (none).
    pub loss: &'a mut CudaSlice<u8>,
    /// f32 `[N]`.
    pub lse: &'a mut CudaSlice<u8>,
    /// f32 `[N]`: `1 − p_y` per row without cancellation (0 at ignored rows), which the
    /// backward reads beside the lse.
    pub rest: &'a mut CudaSlice<u8>,
    /// f32 `[N]`, when `want_entropy`.
    pub entropy: Option<&'a mut CudaSlice<u8>>,
    /// i32 `[N]`, when `want_argmax`.
    pub argmax: Option<&'a mut CudaSlice<u8>>,
}

/// Gradient outputs (caller-allocated, in [`DenseConfig::grad_dtype`]).
#[derive(Debug, Default)]
pub struct DenseGradOut<'a> {
    /// `[N, D]`, when `compute_d_e`.
    pub d_e: Option<&'a mut CudaSlice<u8>>,
    /// `[V, D]`, when `compute_d_c`.
    pub d_c: Option<&'a mut CudaSlice<u8>>,
    /// `[V]`, when `compute_d_c` and a bias is given.
    pub d_bias: Option<&'a mut CudaSlice<u8>>,
}

/// What a backward did (merged into `CallStats` by the backend).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DenseStats {
    /// Rows per chunk used.
    pub chunk_rows: usize,
    /// Chunks.
    pub chunks: usize,
    /// Row pass used (after fallbacks).
    pub row_pass: Option<RowPass>,
    /// Whether entries were skipped (filter on for both gradients).
    pub filtered: bool,
    /// Active rows (non-zero upstream gradient).
    pub active_rows: u64,
    /// `(row, class)` entries of active rows computed, summed over the 2 filtered products.
    pub entries_kept: u64,
    /// Entries skipped, likewise.
    pub entries_skipped: u64,
    /// Plan tiles with a kept entry, times 2.
    pub tiles_visited: u64,
    /// Plan tiles without one, times 2.
    pub tiles_skipped: u64,
    /// Largest per-row dropped mass over valid rows.
    pub dropped_mass_max: f64,
    /// Mean per-row dropped mass over valid rows.
    pub dropped_mass_mean: f64,
    /// What the sparse backward did, when the plan had one: used, or why it gave way.
    pub sparse: Option<String>,
    /// How a forward-only call tiled the logits, when it used the plan's class tiles.
    pub forward: Option<String>,
    /// How split dense's class pass computed `G` (the WGMMA epilogue, or why not).
    pub class_pass: Option<String>,
    /// How split dense's row pass of a forward-and-backward call computed the logits, the lse
    /// and `G` (the WGMMA epilogue, or why not).
    pub row_pass_note: Option<String>,
}

// ----------------------------------------------------------------------------------------------
// Engine
// ----------------------------------------------------------------------------------------------

/// The compiled kernels, the cuBLAS handle and its workspace, on one stream.
pub struct DenseEngine {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// cuBLAS handle and workspace, lent by the per-context pool ([`crate::device`]).
    blas: crate::device::PooledBlas,
    funcs: HashMap<String, CudaFunction>,
    arch: String,
    max_smem_optin: usize,
    fused_static_smem: usize,
    /// Multiprocessors (the persistent grid of the WGMMA forward).
    sm_count: usize,
    /// The WGMMA forward's kernels are loaded (compute capability 9.0, enough shared memory).
    wgmma: bool,
    /// The second stream of class-tiled forwards (made on first use, highest priority so that
    /// its row reductions get multiprocessors as the GEMM's blocks retire).
    row_stream: std::sync::OnceLock<Arc<CudaStream>>,
    /// Profiling and the sparse backward's tuning ([`DenseEngine::with_switches`]).
    switches: crate::CudaSwitches,
}

impl std::fmt::Debug for DenseEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DenseEngine")
            .field("arch", &self.arch)
            .field("kernels", &self.funcs.len())
            .finish()
    }
}

/// Device addresses the class pass reads (0 = absent) besides the inputs and workspace.
#[derive(Clone, Copy)]
struct ClassPassArgs {
    /// f32 `[N]` lse (forward output or the caller's saved one).
    lse: u64,
    /// f32 `[N]` `1 − p_y`, saved beside the lse.
    rest: u64,
    /// f32 `[N]` per-row upstream loss gradient, or 0 (then `dl_scalar`).
    dl_rows: u64,
    dl_scalar: f32,
    /// f32 `[N]` upstream lse gradient, or 0.
    dlse: u64,
    /// `d_c` output `[V, D]` in the gradient dtype.
    d_c: u64,
    /// f32 `[V]` `d_bias` accumulator (or the f32 output), when a bias is given.
    d_bias_acc: u64,
}

/// Per-row arrays and scalars the row kernels share (device addresses of `[N]` arrays, 0 =
/// absent; kernels get them offset to their chunk).
#[derive(Clone, Copy)]
struct RowArgs {
    ld: i64,
    v: i32,
    bias: u64,
    softcap: f32,
    alpha: f32,
    lambda: f32,
    targets: u64,
    /// Forward outputs: f32 lse, f32 `1 − p_y`, f32 per-row loss, entropy, argmax.
    lse: u64,
    rest: u64,
    loss_rows: u64,
    entropy: u64,
    argmax: u64,
}

impl RowArgs {
    /// The per-row arrays (targets, lse, rest, loss, entropy, argmax) offset to row `r0`
    /// (absent ones stay 0).
    fn rows_at(&self, r0: usize) -> (u64, u64, u64, u64, u64, u64) {
        let off4 = (r0 * 4) as u64;
        let at = |p: u64| if p != 0 { p + off4 } else { 0 };
        (
            at(self.targets),
            at(self.lse),
            at(self.rest),
            at(self.loss_rows),
            at(self.entropy),
            at(self.argmax),
        )
    }
}

/// Device time per phase, for "why is this call slow" ([`crate::CudaSwitches::profile`]): an
/// event at each mark, the interval since the previous mark summed under the mark's name,
/// printed to stderr by [`PhaseTimer::report`]. Off (no events) without the switch.
struct PhaseTimer {
    stream: Arc<CudaStream>,
    /// The start event, then one event per mark with the mark's name.
    marks: Vec<(&'static str, cudarc::driver::CudaEvent)>,
}

impl PhaseTimer {
    fn event(stream: &CudaStream) -> Result<cudarc::driver::CudaEvent> {
        stream
            .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv)
    }

    fn new(stream: &Arc<CudaStream>, on: bool) -> Result<Option<Self>> {
        if !on {
            return Ok(None);
        }
        Ok(Some(Self {
            stream: stream.clone(),
            marks: vec![("start", Self::event(stream)?)],
        }))
    }

    fn mark(t: &mut Option<Self>, name: &'static str) -> Result<()> {
        if let Some(t) = t.as_mut() {
            let ev = Self::event(&t.stream)?;
            t.marks.push((name, ev));
        }
        Ok(())
    }

    fn report(t: Option<Self>, what: &str) -> Result<()> {
        let Some(t) = t else { return Ok(()) };
        t.stream.synchronize().map_err(drv)?;
        let mut sums: Vec<(&'static str, f64, usize)> = Vec::new();
        for w in t.marks.windows(2) {
            let (name, ms) = (w[1].0, w[0].1.elapsed_ms(&w[1].1).map_err(drv)? as f64);
            match sums.iter_mut().find(|x| x.0 == name) {
                Some(x) => {
                    x.1 += ms;
                    x.2 += 1;
                }
                None => sums.push((name, ms, 1)),
            }
        }
        let total: f64 = sums.iter().map(|x| x.1).sum();
        eprintln!("[cce-cuda profile] {what}: {total:.2} ms");
        for (name, ms, k) in sums {
            eprintln!("  {name:<24} {ms:9.2} ms  ({k} spans)");
        }
        Ok(())
    }
}

/// The rows `cce_split_scales_*` takes max |G coefficient| over (device addresses of `[N]`
/// arrays, 0 = absent).
#[derive(Clone, Copy)]
struct ScaleRows {
    targets: u64,
    dl_rows: u64,
    dl_scalar: f32,
    dlse: u64,
    lse: u64,
    rest: u64,
    alpha: f32,
    lambda: f32,
    n: i32,
    v: i32,
}

/// What the sparse backward reads and writes besides the workspace (0 = absent).
#[derive(Clone, Copy)]
struct SparseArgs {
    /// Also run the forward rows (lse, loss) in its row pass.
    forward: bool,
    /// f32 `[N]` lse the selection uses (the forward's or the caller's).
    saved_lse: u64,
    /// f32 `[N]` `1 − p_y` saved beside it.
    saved_rest: u64,
    dl_rows: u64,
    dl_scalar: f32,
    dlse: u64,
    e: u64,
    c: u64,
    /// Gradient outputs in the gradient dtype (0 when not computed).
    d_e: u64,
    d_c: u64,
    d_bias: u64,
    delta_fixed: u64,
    /// Tile statistics: tile rows, tile classes, class tiles.
    tile: (i32, i32, i32),
}

enum Mode<'a> {
    Forward,
    ForwardBackward,
    Backward {
        lse: &'a CudaSlice<u8>,
        rest: &'a CudaSlice<u8>,
    },
}

impl DenseEngine {
    /// Compile (or load from the cache) the kernels for the stream's device and create the
    /// cuBLAS handle. Errors: `NoDevice` (no NVRTC / cuBLAS), `Backend`.
    pub fn new(stream: Arc<CudaStream>) -> Result<Self> {
        let ctx = stream.context().clone();
        if !crate::libs::present("cublas") {
            return Err(CceError::NoDevice {
                backend: BACKEND,
                reason:
                    "libcublas (CUDA 13) could not be loaded; add its folder to LD_LIBRARY_PATH"
                        .into(),
            });
        }
        let (major, minor) = ctx.compute_capability().map_err(drv)?;
        if major < 8 {
            return Err(CceError::Unsupported {
                backend: BACKEND,
                what: format!("compute capability {major}.{minor} (chunked-dense needs 8.0+)"),
            });
        }
        let arch = arch_of(major, minor);
        let module = crate::device::module(&ctx, SOURCE, &arch)?;
        let mut names: Vec<String> = Vec::new();
        for dt in ["f32", "f16", "bf16"] {
            names.push(format!("cce_dense_fwd_{dt}"));
            names.push(format!("cce_cls_fwd_{dt}"));
            names.push(format!("cce_dense_bwd_{dt}"));
            names.push(format!("cce_dense_colsum_{dt}"));
            names.push(format!("cce_dense_randn_{dt}"));
            names.push(format!("cce_split_scales_{dt}"));
            names.push(format!("cce_split_gcols_{dt}"));
            names.push(format!("cce_split_de_finish_{dt}"));
            names.push(format!("cce_sparse_select_{dt}"));
            names.push(format!("cce_sparse_select_{dt}_t256"));
            names.push(format!("cce_sparse_select_fwd_{dt}"));
            if dt != "f32" {
                names.push(format!("cce_dense_target_fix_{dt}"));
            }
            let vec = if dt == "f32" { 4 } else { 8 };
            for out in [dt, "f32"] {
                for v in [1, vec] {
                    names.push(format!("cce_sparse_gather_{dt}_{out}_v{v}"));
                    names.push(format!("cce_sparse_gather_{dt}_{out}_v{v}_b32"));
                    names.push(format!("cce_sparse_gather_{dt}_{out}_v{v}_l"));
                    names.push(format!("cce_sparse_gather_{dt}_{out}_v{v}_h"));
                }
            }
            if major >= 9 {
                for cs in CLUSTER_SIZES {
                    names.push(format!("cce_dense_fused_{dt}_c{cs}"));
                }
            }
        }
        let max_smem_optin = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(drv)? as usize;
        let sm_count = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(drv)? as usize;
        // The WGMMA forward is compiled for sm_90a only (`wgmma.cu`: wgmma, setmaxnreg, TMA).
        let wgmma = (major, minor) == (9, 0) && max_smem_optin >= WGMMA_SMEM_OUT_BYTES;
        if wgmma {
            for dt in ["f16", "bf16"] {
                names.push(format!("cce_wgmma_lse_{dt}"));
                names.push(format!("cce_wgmma_lse_combine_{dt}"));
                names.push(format!("cce_wgmma_lse_x_{dt}"));
                names.push(format!("cce_wgmma_gcols_{dt}"));
                names.push(format!("cce_wgmma_gcols_cap_{dt}"));
            }
            for n in [
                "cce_wgmma_lseq_bf16",
                "cce_wgmma_lseq_x_bf16",
                "cce_wgmma_qrows_g_bf16",
                "cce_wgmma_qrows_g_cap_bf16",
            ] {
                names.push(n.into());
            }
        }
        for n in [
            "cce_dense_convert_f16",
            "cce_dense_convert_bf16",
            "cce_dense_sum_rows",
            "cce_dense_stats",
            "cce_dense_random_targets",
            "cce_split_e_to_f16_bf16",
            "cce_dense_bwd_f16s_f16",
            "cce_dense_bwd_f16s_bf16",
            "cce_sparse_count",
            "cce_sparse_tile_sums",
            "cce_sparse_scan_tiles",
            "cce_sparse_scatter",
        ] {
            names.push(n.into());
        }
        let mut funcs = HashMap::new();
        for n in names {
            let f = module.load_function(&n).map_err(drv)?;
            funcs.insert(n, f);
        }
        let mut fused_static_smem = 0usize;
        for (name, f) in &funcs {
            if name.starts_with("cce_wgmma_lse_") && !name.starts_with("cce_wgmma_lse_combine_") {
                f.set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    WGMMA_SMEM_BYTES as i32,
                )
                .map_err(drv)?;
            }
            if name.starts_with("cce_wgmma_gcols_") || name.starts_with("cce_wgmma_lseq_") {
                f.set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    WGMMA_SMEM_OUT_BYTES as i32,
                )
                .map_err(drv)?;
            }
            if name.starts_with("cce_dense_fused_") {
                let st = f
                    .get_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
                    .map_err(drv)? as usize;
                fused_static_smem = fused_static_smem.max(st);
                f.set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    (max_smem_optin - st) as i32,
                )
                .map_err(drv)?;
                if name.ends_with("_c16") {
                    f.set_attribute(
                        CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                        1,
                    )
                    .map_err(drv)?;
                }
            }
        }
        let blas = crate::device::pooled_blas(&stream, CUBLAS_WORKSPACE_BYTES)?;
        Ok(Self {
            ctx,
            stream,
            blas,
            funcs,
            arch,
            max_smem_optin,
            fused_static_smem,
            sm_count,
            wgmma,
            row_stream: std::sync::OnceLock::new(),
            switches: crate::CudaSwitches::default(),
        })
    }

    /// The engine with `switches`' profiling and sparse-backward tuning
    /// ([`crate::CudaSwitches::profile`], `sparse_select_threads`, `sparse_fold_forward`); the
    /// path switches reach the engine through [`DenseConfig`].
    pub fn with_switches(mut self, switches: crate::CudaSwitches) -> Self {
        self.switches = switches;
        self
    }

    /// The stream every operation runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// NVRTC architecture compiled for.
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// Bytes of the engine's own allocations (the cuBLAS workspace).
    pub fn own_bytes(&self) -> u64 {
        CUBLAS_WORKSPACE_BYTES as u64
    }

    fn func(&self, name: &str) -> Result<&CudaFunction> {
        self.funcs
            .get(name)
            .ok_or_else(|| CceError::backend(BACKEND, format!("kernel {name} not loaded")))
    }

    fn ptr(&self, s: &CudaSlice<u8>) -> u64 {
        let (p, _sync) = s.device_ptr(&self.stream);
        p
    }

    fn opt_ptr(&self, s: Option<&CudaSlice<u8>>) -> u64 {
        s.map_or(0, |s| self.ptr(s))
    }

    /// Column-major `C[m, n] = op(A)·op(B) + beta·C` with f32 compute (cuBLAS's view; the
    /// row-major callers below pass the transposed problem). Arguments are raw device addresses
    /// of live allocations on this engine's device, each holding `ld x cols` elements of its
    /// dtype; a GEMM that reads past them faults the context, so the callers check sizes.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &self,
        trans_a: bool,
        trans_b: bool,
        (m, n, k): (usize, usize, usize),
        (a, a_ty, lda): (u64, DType, usize),
        (b, b_ty, ldb): (u64, DType, usize),
        (alpha, beta): (f32, f32),
        (c, c_ty, ldc): (u64, DType, usize),
    ) -> Result<()> {
        let op = |t: bool| {
            if t {
                cublas_sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                cublas_sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        // SAFETY: the handle is bound to self.stream; a, b, c are device pointers of live
        // allocations holding at least (ld x cols) elements of their types (checked by the
        // callers' shapes); alpha and beta are host f32 values (default host pointer mode)
        // matching the f32 compute type; the output does not alias the inputs.
        unsafe {
            cublas_result::gemm_ex(
                *self.blas.handle(),
                op(trans_a),
                op(trans_b),
                to_i32(m, "gemm m")?,
                to_i32(n, "gemm n")?,
                to_i32(k, "gemm k")?,
                &alpha as *const f32 as *const c_void,
                a as *const c_void,
                cuda_type(a_ty)?,
                to_i32(lda, "gemm lda")?,
                b as *const c_void,
                cuda_type(b_ty)?,
                to_i32(ldb, "gemm ldb")?,
                &beta as *const f32 as *const c_void,
                c as *mut c_void,
                cuda_type(c_ty)?,
                to_i32(ldc, "gemm ldc")?,
                cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| CceError::backend(BACKEND, e))
    }

    /// Row-major logits `L[rows, ld] (f32) = E[rows, D] · C[V, D]ᵀ`: column-major
    /// `Lᵀ[V, rows] = op_T(C as [D, V]) · (E as [D, rows])`.
    pub fn gemm_logits(
        &self,
        (v, d, rows): (usize, usize, usize),
        dtype: DType,
        (c, e, l): (u64, u64, u64),
        ld: usize,
    ) -> Result<()> {
        self.gemm(
            true,
            false,
            (v, rows, d),
            (c, dtype, d),
            (e, dtype, d),
            (1.0, 0.0),
            (l, DType::F32, ld),
        )
    }

    /// Row-major `d_e[rows, D] = G[rows, V] · C[V, D]`: column-major
    /// `d_eᵀ[D, rows] = (C as [D, V]) · (G as [V, rows], stride ldg)`.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_de(
        &self,
        (v, d, rows): (usize, usize, usize),
        (dtype, g_ty, out_ty): (DType, DType, DType),
        (c, g, de): (u64, u64, u64),
        ldg: usize,
    ) -> Result<()> {
        self.gemm(
            false,
            false,
            (d, rows, v),
            (c, dtype, d),
            (g, g_ty, ldg),
            (1.0, 0.0),
            (de, out_ty, d),
        )
    }

    /// Row-major `d_c[V, D] = alpha · G[rows, V]ᵀ · E[rows, D] + beta · d_c`: column-major
    /// `d_cᵀ[D, V] = (E as [D, rows]) · op_T(G as [V, rows], stride ldg)`. `dtype` is the type
    /// of `E`.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_dc(
        &self,
        (v, d, rows): (usize, usize, usize),
        (dtype, g_ty, acc_ty): (DType, DType, DType),
        (e, g, dc): (u64, u64, u64),
        ldg: usize,
        (alpha, beta): (f32, f32),
    ) -> Result<()> {
        self.gemm(
            false,
            true,
            (d, v, rows),
            (e, dtype, d),
            (g, g_ty, ldg),
            (alpha, beta),
            (dc, acc_ty, d),
        )
    }

    /// Forward only: loss, lse, side outputs (steps 1-2 per chunk, or per class tile of the
    /// plan's [`cce_core::ClassForward`]; [`DenseStats::forward`] says which).
    pub fn forward(
        &self,
        cfg: &DenseConfig,
        ws: &mut DenseWorkspace,
        inp: &DenseInputs<'_>,
        out: &mut DenseForwardOut<'_>,
    ) -> Result<DenseStats> {
        let mut grads = DenseGradOut::default();
        self.run(cfg, ws, inp, None, Some(out), &mut grads, Mode::Forward)
    }

    /// Forward and backward with 3 GEMMs per chunk.
    pub fn forward_backward(
        &self,
        cfg: &DenseConfig,
        ws: &mut DenseWorkspace,
        inp: &DenseInputs<'_>,
        up: &DenseUpstream<'_>,
        out: &mut DenseForwardOut<'_>,
        grads: &mut DenseGradOut<'_>,
    ) -> Result<DenseStats> {
        self.run(
            cfg,
            ws,
            inp,
            Some(up),
            Some(out),
            grads,
            Mode::ForwardBackward,
        )
    }

    /// Backward from a saved lse and `1 − p_y` (f32 `[N]` each, [`DenseForwardOut`]):
    /// recomputes the logits.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        cfg: &DenseConfig,
        ws: &mut DenseWorkspace,
        inp: &DenseInputs<'_>,
        (lse, rest): (&CudaSlice<u8>, &CudaSlice<u8>),
        up: &DenseUpstream<'_>,
        grads: &mut DenseGradOut<'_>,
    ) -> Result<DenseStats> {
        self.run(
            cfg,
            ws,
            inp,
            Some(up),
            None,
            grads,
            Mode::Backward { lse, rest },
        )
    }

    /// Cluster size and slice (columns per block) of the fused kernel, or `None` when it does
    /// not apply (not Hopper, or the row does not fit 16 blocks' shared memory).
    pub fn fused_layout(&self, cfg: &DenseConfig) -> Option<(usize, usize)> {
        let RowPass::Fused { cluster } = cfg.row_pass else {
            return None;
        };
        if !self.funcs.contains_key("cce_dense_fused_f32_c1") {
            return None;
        }
        let max_dyn = self.max_smem_optin.saturating_sub(self.fused_static_smem);
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

    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        cfg: &DenseConfig,
        ws: &mut DenseWorkspace,
        inp: &DenseInputs<'_>,
        up: Option<&DenseUpstream<'_>>,
        fwd: Option<&mut DenseForwardOut<'_>>,
        grads: &mut DenseGradOut<'_>,
        mode: Mode<'_>,
    ) -> Result<DenseStats> {
        let (n, d, v) = (cfg.n, cfg.d, cfg.v);
        let dt = cfg.dtype;
        let esz = dt.size_bytes();
        let code = dtype_code(dt)?;
        let g_ty = cfg.g_dtype();
        let out_ty = cfg.grad_dtype();
        let ld = ws.ld;
        let ldg = ld * 4 / g_ty.size_bytes();
        let chunk = ws.chunk_rows;
        if ld != cfg.ld() || chunk != cfg.effective_chunk_rows() {
            return Err(CceError::InvalidOption {
                name: "workspace",
                reason: "allocated for another configuration".into(),
            });
        }
        // Buffer size checks (the kernels trust them).
        let need = |s: &CudaSlice<u8>, bytes: usize, what: &'static str| -> Result<()> {
            if s.len() < bytes {
                Err(CceError::ShapeMismatch {
                    what,
                    expected: format!("at least {bytes} bytes"),
                    got: format!("{} bytes", s.len()),
                })
            } else {
                Ok(())
            }
        };
        need(inp.e, n * d * esz, "e")?;
        need(inp.c, v * d * esz, "c")?;
        need(inp.targets, n * 4, "targets")?;
        if let Some(b) = inp.bias {
            need(b, v * esz, "bias")?;
        }
        if inp.bias.is_some() != cfg.has_bias {
            return Err(CceError::InvalidOption {
                name: "bias",
                reason: "config and inputs disagree on the bias".into(),
            });
        }
        let backward = !matches!(mode, Mode::Forward);
        let forward = !matches!(mode, Mode::Backward { .. });
        if let Some(o) = fwd.as_deref() {
            need(
                o.loss,
                if cfg.reduction == Reduction::None {
                    n * 4
                } else {
                    4
                },
                "loss",
            )?;
            need(o.lse, n * 4, "lse")?;
            need(o.rest, n * 4, "rest_mass")?;
            if let Some(x) = o.entropy.as_deref() {
                need(x, n * 4, "entropy")?;
            }
            if let Some(x) = o.argmax.as_deref() {
                need(x, n * 4, "argmax")?;
            }
        } else if forward {
            return Err(CceError::InvalidOption {
                name: "forward outputs",
                reason: "missing".into(),
            });
        }
        let mut upstream_rows = 0u64;
        let mut dl_scalar = 0.0f32;
        let mut dlse_ptr = 0u64;
        if backward {
            let up = up.ok_or_else(|| CceError::InvalidOption {
                name: "upstream",
                reason: "missing".into(),
            })?;
            match up.d_loss {
                DenseDLoss::Scalar(g) => {
                    dl_scalar = match cfg.reduction {
                        Reduction::Mean if inp.n_valid > 0 => g / inp.n_valid as f32,
                        Reduction::Mean => 0.0,
                        _ => g,
                    }
                }
                DenseDLoss::PerRow(s) => {
                    need(s, n * 4, "d_loss")?;
                    upstream_rows = self.ptr(s);
                }
            }
            if let Some(h) = up.d_lse {
                need(h, n * 4, "d_lse")?;
                dlse_ptr = self.ptr(h);
            }
            let missing = |name: &'static str| CceError::InvalidOption {
                name,
                reason: "output missing".into(),
            };
            if cfg.compute_d_e {
                let s = grads.d_e.as_deref().ok_or_else(|| missing("d_e"))?;
                need(s, n * d * out_ty.size_bytes(), "d_e")?;
            }
            if cfg.compute_d_c {
                let s = grads.d_c.as_deref().ok_or_else(|| missing("d_c"))?;
                need(s, v * d * out_ty.size_bytes(), "d_c")?;
                if cfg.has_bias {
                    let s = grads.d_bias.as_deref().ok_or_else(|| missing("d_bias"))?;
                    need(s, v * out_ty.size_bytes(), "d_bias")?;
                }
            }
        }
        if let Mode::Backward { lse, rest } = mode {
            need(lse, n * 4, "lse")?;
            need(rest, n * 4, "rest_mass")?;
        }

        let split = cfg.chunk_classes.is_some();
        // Split dense skips nothing (allowed: "an implementation may skip fewer"): its dense
        // GEMMs gain nothing from zeroed entries, and the threshold's histogram pass cost 3-7%
        // at the seed shape (docs/perf-log.md), so filtered calls run exactly like exact ones.
        let filtering = backward && cfg.filtering() && !split;
        if split && ws.tau.len() < n * 4 {
            return Err(CceError::InvalidOption {
                name: "workspace",
                reason: "allocated for another configuration".into(),
            });
        }
        let tau_ptr = self.ptr(&ws.tau);
        let fused = if matches!(mode, Mode::ForwardBackward) && !split {
            self.fused_layout(cfg)
        } else {
            None
        };
        let softcap = cfg.softcap.unwrap_or(0.0);
        let alpha = cfg.label_smoothing;
        let lambda = cfg.z_loss;
        let filter_on = filtering as i32;
        let delta_fixed =
            (cfg.filter.max_dropped_mass as f64 * cce_core::filter::FIXED_POINT_ONE).floor() as u64;
        let (tile_rows, tile_classes) = (
            to_i32(cfg.tile.0, "tile rows")?,
            to_i32(cfg.tile.1, "tile classes")?,
        );
        let n_ctiles = to_i32(cfg.class_tiles(), "class tiles")?;
        let v_i = to_i32(v, "V")?;
        let ld_i = ld as i64;

        let e_ptr = self.ptr(inp.e);
        let c_ptr = self.ptr(inp.c);
        let bias_ptr = self.opt_ptr(inp.bias);
        let t_ptr = self.ptr(inp.targets);
        let layout = cfg.row_layout();
        let g_mode = if backward { cfg.g_mode() } else { 0 };
        let ws_base = self.ptr(&ws.logits);
        let l_ptr = if split {
            ws_base + layout.logits as u64
        } else {
            ws_base
        };
        if split && ws.logits.len() < layout.end {
            return Err(CceError::InvalidOption {
                name: "workspace",
                reason: "allocated for another configuration".into(),
            });
        }
        let kept_ptr = self.ptr(&ws.kept);
        let dropped_ptr = self.ptr(&ws.dropped);
        let flags_ptr = self.ptr(&ws.flags);
        let edges_ptr = self.ptr(&ws.edges);
        let row_loss_ptr = self.ptr(&ws.row_loss);
        let (lse_ptr, rest_ptr, loss_rows_ptr, ent_ptr, am_ptr) = match fwd.as_deref() {
            Some(o) => (
                self.ptr(o.lse),
                self.ptr(o.rest),
                if cfg.reduction == Reduction::None {
                    self.ptr(o.loss)
                } else {
                    row_loss_ptr
                },
                if cfg.want_entropy {
                    self.opt_ptr(o.entropy.as_deref())
                } else {
                    0
                },
                if cfg.want_argmax {
                    self.opt_ptr(o.argmax.as_deref())
                } else {
                    0
                },
            ),
            None => (0, 0, 0, 0, 0),
        };
        let (saved_lse_ptr, saved_rest_ptr) = match mode {
            Mode::Backward { lse, rest } => (self.ptr(lse), self.ptr(rest)),
            _ => (lse_ptr, rest_ptr),
        };
        let de_ptr = if backward && cfg.compute_d_e {
            self.opt_ptr(grads.d_e.as_deref())
        } else {
            0
        };
        let (dc_acc_ptr, dc_acc_ty) = if backward && cfg.compute_d_c {
            match ws.dc_acc.as_ref() {
                Some(a) => (self.ptr(a), DType::F32),
                None => (self.opt_ptr(grads.d_c.as_deref()), DType::F32),
            }
        } else {
            (0, DType::F32)
        };
        let dbias_acc_ptr = if backward && cfg.compute_d_c && cfg.has_bias {
            match ws.dbias_acc.as_ref() {
                Some(a) => self.ptr(a),
                None => self.opt_ptr(grads.d_bias.as_deref()),
            }
        } else {
            0
        };

        let row_args = RowArgs {
            ld: ld_i,
            v: v_i,
            bias: bias_ptr,
            softcap,
            alpha,
            lambda,
            targets: t_ptr,
            lse: lse_ptr,
            rest: rest_ptr,
            loss_rows: loss_rows_ptr,
            entropy: ent_ptr,
            argmax: am_ptr,
        };
        let try_sparse = backward && split && cfg.sparse.is_some() && cfg.filtering();
        if backward {
            if filtering || try_sparse {
                self.stream.memset_zeros(&mut ws.flags).map_err(drv)?;
                self.stream.memset_zeros(&mut ws.kept).map_err(drv)?;
                self.stream.memset_zeros(&mut ws.dropped).map_err(drv)?;
            }
            if dbias_acc_ptr != 0 {
                match ws.dbias_acc.as_mut() {
                    Some(a) => self.stream.memset_zeros(a).map_err(drv)?,
                    None => {
                        if let Some(b) = grads.d_bias.as_deref_mut() {
                            self.stream.memset_zeros(b).map_err(drv)?
                        }
                    }
                }
            }
        }

        let mut stats = DenseStats {
            chunk_rows: chunk,
            chunks: n.div_ceil(chunk),
            row_pass: Some(match fused {
                Some((cs, _)) => RowPass::Fused { cluster: Some(cs) },
                None => RowPass::TwoPass,
            }),
            filtered: filtering,
            ..Default::default()
        };

        let f_fwd = self.func(&format!("cce_dense_fwd_{code}"))?;
        // Sparse backward first (filtered split-dense calls); `None`: the dense passes below.
        let mut sparse_kept = None;
        // Rows of a first chunk whose logits (and forward rows) a sparse backward that gave
        // way left valid at `l_ptr`: the dense passes start with them instead of recomputing.
        let mut reuse_rows = 0usize;
        if try_sparse {
            let sa = SparseArgs {
                forward,
                saved_lse: saved_lse_ptr,
                saved_rest: saved_rest_ptr,
                dl_rows: upstream_rows,
                dl_scalar,
                dlse: dlse_ptr,
                e: e_ptr,
                c: c_ptr,
                d_e: de_ptr,
                d_c: if cfg.compute_d_c {
                    self.opt_ptr(grads.d_c.as_deref())
                } else {
                    0
                },
                d_bias: if cfg.compute_d_c && cfg.has_bias {
                    self.opt_ptr(grads.d_bias.as_deref())
                } else {
                    0
                },
                delta_fixed,
                tile: (tile_rows, tile_classes, n_ctiles),
            };
            match self.sparse_backward(cfg, ws, &row_args, &sa)? {
                Ok(kept) => {
                    stats.sparse = Some(format!(
                        "sparse backward: {kept} kept entries ({:.1} per row), one logits GEMM",
                        kept as f64 / n as f64
                    ));
                    sparse_kept = Some(kept);
                }
                Err((why, rows)) => {
                    // The sparse backward's logits sit at the start of the scratch; the row
                    // pass's too unless an f16 copy of c comes first (layout.logits > 0).
                    if layout.logits == 0 && rows <= chunk {
                        reuse_rows = rows;
                    }
                    stats.sparse = Some(format!(
                        "dense passes{}: {why}",
                        if reuse_rows > 0 {
                            " (the first chunk's logits reused)"
                        } else {
                            ""
                        }
                    ))
                }
            }
        }
        let sparse_used = sparse_kept.is_some();
        stats.filtered = filtering || sparse_used;
        let f_bwd = self.func(&match g_mode {
            2 => format!("cce_dense_bwd_f16s_{code}"),
            _ => format!("cce_dense_bwd_{code}"),
        })?;
        // Split dense, f16 G for d_e: c in f16 (bf16 inputs: a copy scaled by 2^kc).
        let (c_de_ptr, c_de_scale) = if g_mode == 2 && dt == DType::BF16 && !sparse_used {
            let kc = self.c16_copy(cfg, ws, inp.c, ws_base + layout.c16 as u64)?;
            (ws_base + layout.c16 as u64, 2f32.powi(-kc))
        } else {
            (c_ptr, 1.0f32)
        };
        let tmp_ptr = ws_base + layout.tmp as u64;
        let rs_ptr = ws_base + layout.rs as u64;
        let f_colsum = self.func(&format!("cce_dense_colsum_{code}"))?;
        // Forward only through the fused WGMMA forward where it applies (no logits in memory).
        let mut class_forward_used = false;
        if matches!(mode, Mode::Forward) {
            if let Ok(group) = self.wgmma_forward_rows(cfg, ws.logits.len(), (e_ptr, c_ptr)) {
                stats.forward =
                    Some(self.forward_wgmma(cfg, group, ws_base, &row_args, (e_ptr, c_ptr))?);
                stats.chunk_rows = group;
                stats.chunks = n.div_ceil(group);
                class_forward_used = true;
            }
        }
        // Forward only with the plan's class tiles: the GEMMs and the row reductions overlap.
        if let (Mode::Forward, Some(cf), false) = (&mode, cfg.class_forward, class_forward_used) {
            if ws.logits.len() < cf.bytes(n) {
                return Err(CceError::InvalidOption {
                    name: "workspace",
                    reason: "allocated for another configuration".into(),
                });
            }
            self.forward_by_classes(cfg, cf, ws_base, &row_args, (e_ptr, c_ptr))?;
            stats.forward = Some(format!(
                "forward: {} GEMM tile(s) of {} rows x {} classes through two buffers, row reductions on a second stream",
                n.div_ceil(cf.rows) * v.div_ceil(cf.classes),
                cf.rows.min(n),
                cf.classes.min(v)
            ));
            class_forward_used = true;
        }
        let dense_chunks = if sparse_used || class_forward_used {
            0
        } else {
            n
        };
        // (first row, rows, logits and forward rows already there) per chunk.
        let chunks: Vec<(usize, usize, bool)> = if reuse_rows > 0 {
            std::iter::once((0, reuse_rows, true))
                .chain(
                    (reuse_rows..dense_chunks)
                        .step_by(chunk)
                        .map(|r0| (r0, chunk.min(n - r0), false)),
                )
                .collect()
        } else {
            (0..dense_chunks)
                .step_by(chunk)
                .map(|r0| (r0, chunk.min(n - r0), false))
                .collect()
        };
        if reuse_rows > 0 {
            stats.chunks = chunks.len();
        }
        // Split dense's row pass through the WGMMA epilogue (chunks whose logits a sparse
        // backward left in place keep the row kernels).
        let wg_rows = if split && forward && backward && chunks.iter().any(|c| !c.2) {
            match self.wgmma_rows_unfit(cfg, g_mode, (e_ptr, c_ptr)) {
                None => {
                    let wg_chunks = chunks.iter().filter(|c| !c.2).count();
                    stats.row_pass_note = Some(format!(
                        "row pass: WGMMA GEMM with the lse partials and f16 e^(z - max) in its \
                         epilogue, then G in place ({wg_chunks} chunk(s) of up to {} rows, no f32 \
                         logits in memory)",
                        chunk.min(n)
                    ));
                    // The row kernels write every row's τ (0: split dense's row pass never
                    // filters), which the cuBLAS class pass reads; these chunks write none,
                    // so zero them all (a sparse probe may have left thresholds there).
                    self.stream.memset_zeros(&mut ws.tau).map_err(drv)?;
                    Some(self.tensor_map(dt, c_ptr, v, d, WGMMA_BN)?)
                }
                Some(why) => {
                    stats.row_pass_note = Some(format!(
                        "row pass: cuBLAS f32 logits, forward and backward row kernels (no WGMMA \
                         epilogue: {why})"
                    ));
                    None
                }
            }
        } else {
            None
        };
        let mut prof = if chunks.is_empty() {
            None
        } else {
            PhaseTimer::new(&self.stream, self.switches.profile)?
        };
        for (ci, &(r0, rows, reused)) in chunks.iter().enumerate() {
            let rows_u = rows as u32;
            let e_r = e_ptr + (r0 * d * esz) as u64;
            let off4 = (r0 * 4) as u64;
            let t_r = t_ptr + off4;
            let row0 = r0 as i64;
            // G's row stride in elements: ld for the WGMMA row pass (16-bit q then G, rows of
            // ld·2 bytes), ld·4 / sizeof(G) written over the f32 logits otherwise.
            let mut ldg_c = ldg;
            // The WGMMA row pass's map, for the chunks it takes (not one whose logits are there).
            let wg_tm = if reused { None } else { wg_rows.as_ref() };
            if wg_tm.is_none() && !reused {
                // (1) logits.
                self.gemm_logits((v, d, rows), dt, (c_ptr, e_r, l_ptr), ld)?;
                PhaseTimer::mark(&mut prof, "logits GEMM")?;
            }
            if let Some(tm_c) = wg_tm {
                // (1)+(2)+(3): logits, lse and G without f32 logits.
                self.row_pass_wgmma(
                    cfg,
                    tm_c,
                    (r0, rows, chunk),
                    (e_r, c_ptr, l_ptr, ld),
                    &row_args,
                    (
                        saved_lse_ptr,
                        saved_rest_ptr,
                        upstream_rows,
                        dl_scalar,
                        dlse_ptr,
                    ),
                    &mut prof,
                )?;
                ldg_c = ld;
            } else if let Some((cs, slice)) = fused {
                // (2)+(3) fused.
                let f = self.func(&format!("cce_dense_fused_{code}_c{cs}"))?;
                let slice_i = slice as i32;
                let lse_r = lse_ptr + off4;
                let rest_r = rest_ptr + off4;
                let loss_r = loss_rows_ptr + off4;
                let ent_r = if ent_ptr != 0 { ent_ptr + off4 } else { 0 };
                let am_r = if am_ptr != 0 { am_ptr + off4 } else { 0 };
                let dl_r = if upstream_rows != 0 {
                    upstream_rows + off4
                } else {
                    0
                };
                let dlse_r = if dlse_ptr != 0 { dlse_ptr + off4 } else { 0 };
                let kept_r = kept_ptr + off4;
                let dropped_r = dropped_ptr + off4;
                let cfg_l = LaunchConfig {
                    grid_dim: (rows_u * cs as u32, 1, 1),
                    block_dim: (FUSED_THREADS, 1, 1),
                    shared_mem_bytes: (slice * 4) as u32,
                };
                let mut b = self.stream.launch_builder(f);
                b.arg(&l_ptr)
                    .arg(&ld_i)
                    .arg(&v_i)
                    .arg(&slice_i)
                    .arg(&bias_ptr)
                    .arg(&softcap)
                    .arg(&t_r)
                    .arg(&alpha)
                    .arg(&lambda)
                    .arg(&dl_r)
                    .arg(&dl_scalar)
                    .arg(&dlse_r)
                    .arg(&filter_on)
                    .arg(&edges_ptr)
                    .arg(&delta_fixed)
                    .arg(&lse_r)
                    .arg(&rest_r)
                    .arg(&loss_r)
                    .arg(&ent_r)
                    .arg(&am_r)
                    .arg(&kept_r)
                    .arg(&dropped_r)
                    .arg(&flags_ptr)
                    .arg(&row0)
                    .arg(&tile_rows)
                    .arg(&tile_classes)
                    .arg(&n_ctiles);
                // SAFETY: argument types and order match FUSED_PARAMS in chunked.cu; every
                // pointer is a live device buffer of the checked size (the chunk's rows of the
                // [N] arrays start at offset r0); the grid is rows·cs blocks, a multiple of the
                // compile-time cluster size; dynamic shared memory slice·4 ≤ the attribute set
                // at construction.
                unsafe { b.launch(cfg_l) }.map_err(drv)?;
                PhaseTimer::mark(&mut prof, "fused rows")?;
            } else {
                if forward && !reused {
                    // (2) forward rows.
                    self.fwd_rows(f_fwd, &row_args, r0, rows, l_ptr)?;
                    PhaseTimer::mark(&mut prof, "forward rows")?;
                }
                if backward {
                    // (3) G in place.
                    let lse_r = saved_lse_ptr + off4;
                    let rest_r = saved_rest_ptr + off4;
                    let dl_r = if upstream_rows != 0 {
                        upstream_rows + off4
                    } else {
                        0
                    };
                    let dlse_r = if dlse_ptr != 0 { dlse_ptr + off4 } else { 0 };
                    let kept_r = kept_ptr + off4;
                    let dropped_r = dropped_ptr + off4;
                    let tau_r = if split { tau_ptr + off4 } else { 0u64 };
                    let rs_arg = if g_mode == 2 { rs_ptr } else { 0u64 };
                    let cfg_l = LaunchConfig {
                        grid_dim: (rows_u, 1, 1),
                        block_dim: (BWD_THREADS, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    let mut b = self.stream.launch_builder(f_bwd);
                    b.arg(&l_ptr)
                        .arg(&ld_i)
                        .arg(&v_i)
                        .arg(&bias_ptr)
                        .arg(&softcap)
                        .arg(&t_r)
                        .arg(&lse_r)
                        .arg(&rest_r)
                        .arg(&dl_r)
                        .arg(&dl_scalar)
                        .arg(&dlse_r)
                        .arg(&alpha)
                        .arg(&lambda)
                        .arg(&filter_on)
                        .arg(&edges_ptr)
                        .arg(&delta_fixed)
                        .arg(&kept_r)
                        .arg(&dropped_r)
                        .arg(&flags_ptr)
                        .arg(&row0)
                        .arg(&tile_rows)
                        .arg(&tile_classes)
                        .arg(&n_ctiles)
                        .arg(&tau_r)
                        .arg(&rs_arg);
                    // SAFETY: argument types and order match BWD_PARAMS; L holds the chunk's
                    // logits (stream order); lse rows were written by the forward kernel above
                    // or given by the caller ([N] checked); flags hold row_tiles x class_tiles.
                    unsafe { b.launch(cfg_l) }.map_err(drv)?;
                    PhaseTimer::mark(&mut prof, "backward rows (G)")?;
                }
            }
            if backward {
                // (4) d_e rows of the chunk.
                if cfg.compute_d_e {
                    let de_r = de_ptr + (r0 * d * out_ty.size_bytes()) as u64;
                    match g_mode {
                        0 => self.gemm_de(
                            (v, d, rows),
                            (dt, g_ty, out_ty),
                            (c_ptr, l_ptr, de_r),
                            ldg_c,
                        )?,
                        _ => {
                            // f16 G' (scaled per row) times c in f16 into f32 rows, then
                            // d_e = rows · 2^−s_i · 2^−kc in the gradient dtype.
                            self.gemm(
                                false,
                                false,
                                (d, rows, v),
                                (c_de_ptr, DType::F16, d),
                                (l_ptr, DType::F16, ld * 2),
                                (1.0, 0.0),
                                (tmp_ptr, DType::F32, d),
                            )?;
                            self.de_finish(out_ty, tmp_ptr, rs_ptr, c_de_scale, de_r, (rows, d))?;
                        }
                    }
                    PhaseTimer::mark(&mut prof, "d_e GEMM")?;
                    if dt != DType::F32 {
                        // (4') the target's entry of the 16-bit G, exact in d_e.
                        let g16 = if g_mode == 2 || dt == DType::F16 {
                            1
                        } else {
                            2
                        };
                        let (g_ld, rs) = if g_mode == 2 {
                            (ld * 2, rs_ptr)
                        } else {
                            (ldg_c, 0u64)
                        };
                        let at = |p: u64| if p != 0 { p + off4 } else { 0 };
                        self.target_fix(
                            code,
                            (l_ptr, g_ld, g16, rs),
                            (rows, t_r, saved_lse_ptr + off4, saved_rest_ptr + off4),
                            (at(upstream_rows), dl_scalar, at(dlse_ptr)),
                            (alpha, lambda, v_i, softcap, bias_ptr),
                            (e_r, c_ptr, d),
                            (de_r, out_ty),
                        )?;
                        PhaseTimer::mark(&mut prof, "d_e target entry")?;
                    }
                }
                // (5) d_c += Gᵀ E_r, (6) d_bias (chunked dense; split dense: the class pass).
                if cfg.compute_d_c && !split {
                    let beta = if ci == 0 { 0.0 } else { 1.0 };
                    self.gemm_dc(
                        (v, d, rows),
                        (dt, g_ty, dc_acc_ty),
                        (e_r, l_ptr, dc_acc_ptr),
                        ldg,
                        (1.0, beta),
                    )?;
                    if cfg.has_bias {
                        let ldg_i = ldg as i64;
                        let rows_i = rows as i32;
                        let cfg_l = LaunchConfig {
                            grid_dim: (v.div_ceil(COLSUM_THREADS as usize) as u32, 1, 1),
                            block_dim: (COLSUM_THREADS, 1, 1),
                            shared_mem_bytes: 0,
                        };
                        let mut b = self.stream.launch_builder(f_colsum);
                        let one = 1.0f32;
                        b.arg(&l_ptr)
                            .arg(&ldg_i)
                            .arg(&rows_i)
                            .arg(&v_i)
                            .arg(&dbias_acc_ptr)
                            .arg(&one);
                        // SAFETY: matches COLSUM_PARAMS; G is rows x ldg of g_ty written by the
                        // row kernel (stream order); the accumulator holds V f32 (zeroed).
                        unsafe { b.launch(cfg_l) }.map_err(drv)?;
                    }
                    PhaseTimer::mark(&mut prof, "d_c GEMM (+ d_bias)")?;
                }
            }
        }
        PhaseTimer::report(prof, &format!("dense row pass ({} chunk(s))", chunks.len()))?;

        if split && backward && cfg.compute_d_c && !sparse_used {
            stats.class_pass = Some(self.class_pass(
                cfg,
                ws,
                inp,
                ClassPassArgs {
                    lse: saved_lse_ptr,
                    rest: saved_rest_ptr,
                    dl_rows: upstream_rows,
                    dl_scalar,
                    dlse: dlse_ptr,
                    d_c: self.opt_ptr(grads.d_c.as_deref()),
                    d_bias_acc: dbias_acc_ptr,
                },
            )?);
        }

        // Loss reduction.
        if forward && cfg.reduction != Reduction::None {
            let scale = match cfg.reduction {
                Reduction::Mean if inp.n_valid > 0 => 1.0 / inp.n_valid as f64,
                Reduction::Mean => 0.0,
                _ => 1.0,
            };
            let out = fwd.as_deref().map(|o| self.ptr(o.loss)).unwrap_or(0);
            let n_i = to_i32(n, "N")?;
            let mut b = self.stream.launch_builder(self.func("cce_dense_sum_rows")?);
            b.arg(&row_loss_ptr).arg(&n_i).arg(&scale).arg(&out);
            // SAFETY: matches cce_dense_sum_rows; row_loss holds N f32 written above; out is
            // the [1] f32 loss (checked).
            unsafe {
                b.launch(LaunchConfig {
                    grid_dim: (1, 1, 1),
                    block_dim: (1024, 1, 1),
                    shared_mem_bytes: 0,
                })
            }
            .map_err(drv)?;
        }

        if backward {
            // Final conversions of the f32 accumulators (the sparse products write the
            // gradients directly).
            if cfg.compute_d_c && !cfg.grad_f32 && !sparse_used {
                // The accumulators hold count f32, the outputs count elements (checked sizes).
                let convert =
                    |src: u64, dst: u64, count: usize| self.convert_f32(code, src, dst, count);
                if !split {
                    let dc_out = self.opt_ptr(grads.d_c.as_deref());
                    convert(dc_acc_ptr, dc_out, v * d)?;
                }
                if cfg.has_bias {
                    let db_out = self.opt_ptr(grads.d_bias.as_deref());
                    convert(dbias_acc_ptr, db_out, v)?;
                }
            }
            if filtering || sparse_used {
                let stats_ptr = self.ptr(&ws.stats);
                let n_i = to_i32(n, "N")?;
                let n_flags = (cfg.row_tiles() * cfg.class_tiles()) as i64;
                let mut b = self.stream.launch_builder(self.func("cce_dense_stats")?);
                b.arg(&kept_ptr)
                    .arg(&dropped_ptr)
                    .arg(&t_ptr)
                    .arg(&n_i)
                    .arg(&flags_ptr)
                    .arg(&n_flags)
                    .arg(&stats_ptr);
                // SAFETY: matches cce_dense_stats; kept/dropped/targets hold N values, flags
                // n_flags u32, stats 8 f64.
                unsafe {
                    b.launch(LaunchConfig {
                        grid_dim: (1, 1, 1),
                        block_dim: (1024, 1, 1),
                        shared_mem_bytes: 0,
                    })
                }
                .map_err(drv)?;
                let host = self.read_back::<64>(&ws.stats)?;
                let s: Vec<f64> = host
                    .chunks_exact(8)
                    .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")))
                    .collect();
                let kept = s[0] as u64;
                let active = s[4] as u64;
                let entries = active * v as u64;
                stats.active_rows = active;
                stats.entries_kept = 2 * kept;
                stats.entries_skipped = 2 * entries.saturating_sub(kept);
                let tiles = (cfg.row_tiles() * cfg.class_tiles()) as u64;
                let visited = s[3] as u64;
                stats.tiles_visited = 2 * visited;
                stats.tiles_skipped = 2 * tiles.saturating_sub(visited);
                stats.dropped_mass_max = s[2];
                stats.dropped_mass_mean = if inp.n_valid > 0 {
                    (s[1] / inp.n_valid as f64).min(s[2])
                } else {
                    0.0
                };
            }
        }
        Ok(stats)
    }

    /// Step (2), the forward row kernel, for rows `r0..r0 + rows` of logits at `l_ptr`.
    fn fwd_rows(
        &self,
        f: &CudaFunction,
        a: &RowArgs,
        r0: usize,
        rows: usize,
        l_ptr: u64,
    ) -> Result<()> {
        let (t_r, lse_r, rest_r, loss_r, ent_r, am_r) = a.rows_at(r0);
        let cfg_l = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (FWD_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(f);
        b.arg(&l_ptr)
            .arg(&a.ld)
            .arg(&a.v)
            .arg(&a.bias)
            .arg(&a.softcap)
            .arg(&t_r)
            .arg(&a.alpha)
            .arg(&a.lambda)
            .arg(&lse_r)
            .arg(&rest_r)
            .arg(&loss_r)
            .arg(&ent_r)
            .arg(&am_r);
        // SAFETY: argument types and order match FWD_PARAMS; L holds rows x ld f32 written by
        // the logits GEMM before this launch (stream order); the [N] outputs (checked sizes)
        // are offset to the chunk and hold its rows.
        unsafe { b.launch(cfg_l) }.map_err(drv)?;
        Ok(())
    }

    /// Step (4'), `cce_dense_target_fix_*` for rows `rows` of a chunk whose 16-bit `G` (`g16`:
    /// 1 f16, 2 bf16; row stride `g_ld` elements; stored times `1 / row_scale` when `rs` ≠ 0)
    /// the d_e product has read: adds the rounding residual of each row's target entry times
    /// `c_y` to the chunk's `d_e` rows (`d_e`, in `out_ty`). The per-row arrays are offset to
    /// the chunk; `e_r` is the chunk's first row of `e`.
    #[allow(clippy::too_many_arguments)]
    fn target_fix(
        &self,
        code: &str,
        (g, g_ld, g16, rs): (u64, usize, i32, u64),
        (rows, t_r, lse_r, rest_r): (usize, u64, u64, u64),
        (dl_r, dl_scalar, dlse_r): (u64, f32, u64),
        (alpha, lambda, v_i, softcap, bias): (f32, f32, i32, f32, u64),
        (e_r, c, d): (u64, u64, usize),
        (d_e, out_ty): (u64, DType),
    ) -> Result<()> {
        let f = self.func(&format!("cce_dense_target_fix_{code}"))?;
        let out_kind: i32 = match out_ty {
            DType::F32 => 0,
            DType::F16 => 1,
            _ => 2,
        };
        let (g_ld_i, rows_i, d_i) = (g_ld as i64, to_i32(rows, "rows")?, to_i32(d, "D")?);
        let per_block = TFIX_THREADS as usize / 32;
        let mut b = self.stream.launch_builder(f);
        b.arg(&g)
            .arg(&g_ld_i)
            .arg(&g16)
            .arg(&rs)
            .arg(&t_r)
            .arg(&lse_r)
            .arg(&rest_r)
            .arg(&dl_r)
            .arg(&dl_scalar)
            .arg(&dlse_r)
            .arg(&alpha)
            .arg(&lambda)
            .arg(&v_i)
            .arg(&softcap)
            .arg(&bias)
            .arg(&e_r)
            .arg(&c)
            .arg(&d_i)
            .arg(&d_e)
            .arg(&out_kind)
            .arg(&rows_i);
        // SAFETY: argument types and order match TFIX_PARAMS in chunked.cu; G holds `rows` rows
        // of `g_ld` 16-bit values (the chunk's G, written by the row kernels and read by the d_e
        // product before this launch, stream order; targets < V ≤ g_ld); row_scale 0 or `rows`
        // f32; the per-row arrays and e_r hold the chunk's rows ([N] buffers checked by `run`,
        // offset to the chunk); c V x D and bias V values of the input dtype; d_e holds the
        // chunk's rows x D in out_ty; one warp per row < rows.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (rows.div_ceil(per_block) as u32, 1, 1),
                block_dim: (TFIX_THREADS, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(drv)?;
        Ok(())
    }

    /// Why the WGMMA kernels (`kernels/wgmma.cu`) cannot run `cfg` with inputs at `e`, `c`
    /// over `cols` classes per launch, for the conditions every one of them shares; `None` when
    /// they hold. `on`: the caller's switch (config and environment).
    fn wgmma_unfit(
        &self,
        cfg: &DenseConfig,
        on: bool,
        (e, c): (u64, u64),
        cols: usize,
    ) -> Option<&'static str> {
        let (n, d, v) = (cfg.n, cfg.d, cfg.v);
        Some(if !on {
            "switched off"
        } else if !self.wgmma {
            "not compute capability 9.0"
        } else if !matches!(cfg.dtype, DType::BF16 | DType::F16) {
            "dtype not bf16 / f16"
        } else if cfg.softcap.is_some_and(|s| s > WGMMA_SOFTCAP_MAX) {
            "softcap above 100 (the epilogue's tanh is exact to ~s·2⁻²¹)"
        } else if n == 0 || v == 0 || d == 0 {
            "an empty dimension"
        } else if !d.is_multiple_of(WGMMA_BK) {
            "D not a multiple of 64"
        } else if !e.is_multiple_of(16) || !c.is_multiple_of(16) {
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
    /// `scratch_bytes` of scratch for the float2 partials (`rows x ceil(V / 256)`; all `N` rows
    /// when they fit, else the most multiples of 128 that do), and `e`, `c` the device
    /// addresses of the inputs. `Err(why)` when it does not apply: switched off
    /// ([`DenseConfig::wgmma_forward`]), not compute capability 9.0,
    /// not bf16 / f16, a softcap above [`WGMMA_SOFTCAP_MAX`], label smoothing, entropy or
    /// argmax, `D` not a multiple of 64, inputs not 16-byte aligned, sizes past 32 bits, or less
    /// scratch than 128 rows need (`wgmma_unfit` holds the shared conditions).
    pub fn wgmma_forward_rows(
        &self,
        cfg: &DenseConfig,
        scratch_bytes: usize,
        (e, c): (u64, u64),
    ) -> std::result::Result<usize, String> {
        let (n, v) = (cfg.n, cfg.v);
        let why = if let Some(why) = self.wgmma_unfit(cfg, cfg.wgmma_forward, (e, c), v) {
            why
        } else if cfg.label_smoothing != 0.0 {
            "label smoothing"
        } else if cfg.want_entropy || cfg.want_argmax {
            "entropy / argmax requested"
        } else {
            let fit = scratch_bytes / (v.div_ceil(WGMMA_BN) * 8);
            let group = if fit >= n {
                n
            } else {
                fit / WGMMA_BM * WGMMA_BM
            };
            if group > 0 && i32::try_from(group).is_ok() {
                return Ok(group);
            }
            "scratch holds the partials of fewer than 128 rows"
        };
        Err(why.to_string())
    }

    /// The fused WGMMA forward of a forward-only call (`kernels/wgmma.cu`), `group` rows at a
    /// time ([`DenseEngine::wgmma_forward_rows`]): per row group `cce_wgmma_lse_*` (the logits
    /// GEMM with the per-tile (max, Σexp) in its epilogue, float2 partials at `base`), then
    /// `cce_wgmma_lse_combine_*` (lse, the target logit, the loss rows of `a`), all on the
    /// engine's stream. Returns the `plan_reason` note.
    fn forward_wgmma(
        &self,
        cfg: &DenseConfig,
        group: usize,
        base: u64,
        a: &RowArgs,
        (e, c): (u64, u64),
    ) -> Result<String> {
        let (n, d, v) = (cfg.n, cfg.d, cfg.v);
        let esz = cfg.dtype.size_bytes();
        let code = dtype_code(cfg.dtype)?;
        // Bias or softcap: the epilogue's extended form (`cce_wgmma_lse_x_*`).
        let ext = a.bias != 0 || a.softcap > 0.0;
        let f_lse = self.func(&format!(
            "cce_wgmma_lse{}_{code}",
            if ext { "_x" } else { "" }
        ))?;
        let f_comb = self.func(&format!("cce_wgmma_lse_combine_{code}"))?;
        let n_tiles = v.div_ceil(WGMMA_BN);
        let (v_i, d_i) = (to_i32(v, "V")?, to_i32(d, "D")?);
        let tm_c = self.tensor_map(cfg.dtype, c, v, d, WGMMA_BN)?;
        let (ordered, group_m) = (1i32, WGMMA_GROUP_M);
        let mut grid_max = 0u32;
        for r0 in (0..n).step_by(group) {
            let rows = group.min(n - r0);
            let rows_i = to_i32(rows, "rows")?;
            let e_r = e + (r0 * d * esz) as u64;
            let tm_e = self.tensor_map(cfg.dtype, e_r, rows, d, WGMMA_BM)?;
            let t_r = a.rows_at(r0).0;
            let tiles = rows.div_ceil(WGMMA_BM) * n_tiles;
            let grid = tiles.min(self.sm_count.max(1)) as u32;
            grid_max = grid_max.max(grid);
            let mut b = self.stream.launch_builder(f_lse);
            b.arg(&tm_e)
                .arg(&tm_c)
                .arg(&rows_i)
                .arg(&v_i)
                .arg(&d_i)
                .arg(&base)
                .arg(&group_m)
                .arg(&ordered)
                .arg(&a.bias)
                .arg(&a.softcap)
                .arg(&t_r);
            // SAFETY: argument types and order match WG_LSE_PARAMS in wgmma.cu (two 128-byte
            // tensor maps by value, then i32 N, V, D, the float2 partials, i32 group_m,
            // ordered_epi, the bias (V values of the input dtype, checked by `run`, or 0),
            // f32 softcap and the group's `rows` i32 targets); the maps describe live [rows, D] / [V, D] 16-bit row-major buffers
            // (sizes checked by `run`, addresses 16-byte aligned and D a multiple of 64,
            // checked by `wgmma_forward_rows`), so TMA reads nothing outside them; the partials
            // (rows x n_tiles float2) fit the scratch at `base` (`wgmma_forward_rows`); 384
            // threads and WGMMA_SMEM_BYTES of dynamic shared memory, the attribute set at
            // construction; grid ≤ the tile count, so every CTA has a tile.
            unsafe {
                b.launch(LaunchConfig {
                    grid_dim: (grid, 1, 1),
                    block_dim: (WGMMA_THREADS, 1, 1),
                    shared_mem_bytes: WGMMA_SMEM_BYTES as u32,
                })
            }
            .map_err(drv)?;
            // SAFETY: the partials at `base` hold the group's rows x n_tiles, written by the
            // launch above (stream order); e_r and c are the live bf16 / f16 inputs (checked by
            // `run`), the row arrays of `a` hold N values; no z_y output.
            unsafe {
                self.launch_combine(f_comb, base, (r0, rows, n_tiles), (e_r, c, d), a, 0)?;
            }
        }
        Ok(format!(
            "forward: WGMMA GEMM with the lse in its epilogue ({} row group(s) of up to {} rows x \
             {n_tiles} class tile(s) of {WGMMA_BN}, {grid_max} persistent blocks), a combine pass \
             per row group",
            n.div_ceil(group),
            group.min(n),
        ))
    }

    /// Why split dense's row pass cannot take the WGMMA epilogue (`cce_wgmma_lseq*` and
    /// `cce_wgmma_qrows_g*`, [`DenseConfig::wgmma_rows`]) for `cfg` with inputs at `e`, `c`
    /// and the row pass's `G` mode `g_mode`; `None` when it can. Besides `wgmma_unfit`'s
    /// conditions: bf16 inputs only (f16 `G` would round twice), `G` in the input dtype
    /// (`g_mode` 0: not the f16 `G` of a budget with an f16 copy of `c`), no label smoothing
    /// (the combine has no `Σz`), no entropy or argmax, and at most 65535·8 class tiles (the
    /// `G` pass's grid). The caller checks the mode (forward and backward in one call).
    pub fn wgmma_rows_unfit(
        &self,
        cfg: &DenseConfig,
        g_mode: u8,
        (e, c): (u64, u64),
    ) -> Option<&'static str> {
        if let Some(why) = self.wgmma_unfit(cfg, cfg.wgmma_rows, (e, c), cfg.v) {
            return Some(why);
        }
        Some(if cfg.dtype != DType::BF16 {
            "f16 inputs (f16 G from f16 e^(z - max) would round twice)"
        } else if cfg.softcap.is_some_and(|s| s < WGMMA_ROWS_SOFTCAP_MIN) {
            "softcap under 1 (the G pass's softcap factor comes from the f16 e^(z - max), which \
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

    /// Split dense's row pass for rows `r0..r0 + rows` of a forward-and-backward call through
    /// the WGMMA epilogue (`kernels/wgmma.cu` (3)); `chunk` the plan's chunk rows, whose
    /// `chunk·ld·4`-byte logits region at `l_ptr` holds, in order, q then `G` (`rows x ld`
    /// 16-bit, row stride `ld`), the float2 partials (`rows x ceil(V/256)`) and the target
    /// logits (`rows` f32). Launches `cce_wgmma_lseq[_x]_bf16` (logits, per-tile (max, Σexp),
    /// f16 `e^{z − max}`), `cce_wgmma_lse_combine_bf16` (lse, loss rows and `z_y` of `a`), then
    /// `cce_wgmma_qrows_g[_cap]_bf16` (`G` in place, from the lse at `up.0` with the upstream
    /// gradients `up.1..`; skipped without `d_e`), on the engine's stream. `d_e` then reads `G`
    /// with row stride `ld`.
    /// The caller checked [`DenseEngine::wgmma_rows_unfit`].
    #[allow(clippy::too_many_arguments)]
    fn row_pass_wgmma(
        &self,
        cfg: &DenseConfig,
        tm_c: &TmaDesc,
        (r0, rows, chunk): (usize, usize, usize),
        (e_r, c, l_ptr, ld): (u64, u64, u64, usize),
        a: &RowArgs,
        (lse, rest, dl_rows, dl_scalar, dlse): (u64, u64, u64, f32, u64),
        prof: &mut Option<PhaseTimer>,
    ) -> Result<()> {
        let (d, v) = (cfg.d, cfg.v);
        let n_tiles = v.div_ceil(WGMMA_BN);
        // The three regions fit the chunk's f32 region: 2·ld ≥ 8·n_tiles + 4 for every V ≥ 1
        // (ld ≥ max(V, 8) rounded up to 8).
        let q_bytes = chunk * ld * 2;
        let p_bytes = chunk * n_tiles * 8;
        if rows > chunk || q_bytes + p_bytes + chunk * 4 > chunk * ld * 4 {
            return Err(CceError::InvalidOption {
                name: "workspace",
                reason: "the WGMMA row pass's regions do not fit the logits chunk".into(),
            });
        }
        let (q, partial) = (l_ptr, l_ptr + q_bytes as u64);
        let zy = partial + p_bytes as u64;
        let ext = a.bias != 0 || a.softcap > 0.0;
        let f_lse = self.func(if ext {
            "cce_wgmma_lseq_x_bf16"
        } else {
            "cce_wgmma_lseq_bf16"
        })?;
        let f_comb = self.func("cce_wgmma_lse_combine_bf16")?;
        let f_g = self.func(if a.softcap > 0.0 {
            "cce_wgmma_qrows_g_cap_bf16"
        } else {
            "cce_wgmma_qrows_g_bf16"
        })?;
        let (rows_i, v_i, d_i) = (to_i32(rows, "rows")?, to_i32(v, "V")?, to_i32(d, "D")?);
        let n_tiles_i = to_i32(n_tiles, "class tiles")?;
        let ldq = ld as i64;
        let tm_e = self.tensor_map(cfg.dtype, e_r, rows, d, WGMMA_BM)?;
        let tm_q = self.tensor_map_out(q, rows, v, ld)?;
        let grid = (rows.div_ceil(WGMMA_BM) * n_tiles).min(self.sm_count.max(1)) as u32;
        let (ordered, group_m) = (1i32, WGMMA_GROUP_M);
        let t_r = a.rows_at(r0).0;
        let mut b = self.stream.launch_builder(f_lse);
        b.arg(&tm_e)
            .arg(tm_c)
            .arg(&rows_i)
            .arg(&v_i)
            .arg(&d_i)
            .arg(&partial)
            .arg(&group_m)
            .arg(&ordered)
            .arg(&a.bias)
            .arg(&a.softcap)
            .arg(&t_r)
            .arg(&tm_q);
        // SAFETY: argument types and order match WG_LSEQ_PARAMS in wgmma.cu (WG_LSE_PARAMS, then
        // q's 128-byte tensor map by value); the maps describe live [rows, D] / [V, D] bf16
        // row-major buffers (sizes checked by `run`, 16-byte aligned, D a multiple of 64:
        // `wgmma_rows_unfit`), so TMA reads nothing outside them; q's map ([rows, V] f16, row
        // stride ld·2 bytes, ld ≥ V) and the partials (rows x n_tiles float2) lie in the chunk's
        // logits region (checked above), and TMA stores write nothing outside the map; 384
        // threads and WGMMA_SMEM_OUT_BYTES of dynamic shared memory, the attribute set at
        // construction; grid ≤ the tile count, so every CTA has a tile.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (grid.max(1), 1, 1),
                block_dim: (WGMMA_THREADS, 1, 1),
                shared_mem_bytes: WGMMA_SMEM_OUT_BYTES as u32,
            })
        }
        .map_err(drv)?;
        PhaseTimer::mark(prof, "WGMMA logits + lse partials + q")?;
        // SAFETY: the partials hold rows x n_tiles float2, written by the launch above (stream
        // order); e_r and c are the live bf16 inputs (checked by `run`), the row arrays of `a`
        // hold N values; zy holds `rows` f32 in the chunk's region (checked above).
        unsafe {
            self.launch_combine(f_comb, partial, (r0, rows, n_tiles), (e_r, c, d), a, zy)?;
        }
        PhaseTimer::mark(prof, "combine (lse, loss)")?;
        if !cfg.compute_d_e {
            // G of the row pass only feeds d_e (the class pass recomputes its own).
            return Ok(());
        }
        let off4 = (r0 * 4) as u64;
        let at = |p: u64| if p != 0 { p + off4 } else { 0 };
        let (lse_g, rest_g, dl_r, dlse_r) = (lse + off4, rest + off4, at(dl_rows), at(dlse));
        let warps = WGMMA_QROWS_THREADS as usize / 32;
        let mut b = self.stream.launch_builder(f_g);
        b.arg(&q)
            .arg(&ldq)
            .arg(&v_i)
            .arg(&n_tiles_i)
            .arg(&partial)
            .arg(&lse_g)
            .arg(&zy)
            .arg(&rest_g)
            .arg(&t_r)
            .arg(&dl_r)
            .arg(&dl_scalar)
            .arg(&dlse_r)
            .arg(&a.lambda)
            .arg(&a.softcap);
        // SAFETY: argument types and order match WG_QROWS_PARAMS; q holds rows x ld f16 written
        // by the WGMMA launch (columns < V; a thread's 8-column group ends at or before ld, ld
        // a multiple of 8), rewritten in place as bf16; partials, zy and the lse (written by
        // the combine, or the caller's) hold the chunk's rows; the upstream arrays are [N]
        // offset to r0 or 0; grid (rows, ceil(n_tiles / 8)) with n_tiles / 8 ≤ 65535
        // (`wgmma_rows_unfit`).
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (rows as u32, n_tiles.div_ceil(warps) as u32, 1),
                block_dim: (WGMMA_QROWS_THREADS, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(drv)?;
        PhaseTimer::mark(prof, "G from q")?;
        Ok(())
    }

    /// One launch of `cce_wgmma_lse_combine_*` (`f`) over rows `r0..r0 + rows` (one warp per
    /// row): lse from the float2 partials at `partial` (`rows x n_tiles`), the target logit as
    /// the dot product of the rows of `e_r` (the group's first row) and `c` (`d` columns), the
    /// lse and loss rows of `a` at row `r0`, and the target logits into `zy` (`rows` f32) or
    /// nowhere (0).
    ///
    /// # Safety
    /// `partial` must hold the rows' partials, written before on the engine's stream; `e_r`
    /// (`rows x d`) and `c` (`V x d`) live 16-bit inputs of `f`'s dtype with `d` even; the
    /// per-row arrays of `a` hold at least `r0 + rows` values, its bias `V` or 0; `zy` 0 or
    /// `rows` writable f32.
    unsafe fn launch_combine(
        &self,
        f: &CudaFunction,
        partial: u64,
        (r0, rows, n_tiles): (usize, usize, usize),
        (e_r, c, d): (u64, u64, usize),
        a: &RowArgs,
        zy: u64,
    ) -> Result<()> {
        let (t_r, lse_r, rest_r, loss_r, _, _) = a.rows_at(r0);
        let (rows_i, n_tiles_i, d_i) = (
            to_i32(rows, "rows")?,
            to_i32(n_tiles, "class tiles")?,
            to_i32(d, "D")?,
        );
        let rows_per_block = WGMMA_COMBINE_THREADS as usize / 32;
        let blocks =
            u32::try_from(rows.div_ceil(rows_per_block)).map_err(|_| CceError::ResourceLimit {
                resource: "CUDA grid blocks".into(),
                requested: rows.div_ceil(rows_per_block) as u64,
                max: u32::MAX as u64,
            })?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&partial)
            .arg(&rows_i)
            .arg(&n_tiles_i)
            .arg(&e_r)
            .arg(&c)
            .arg(&d_i)
            .arg(&t_r)
            .arg(&a.lambda)
            .arg(&a.v)
            .arg(&lse_r)
            .arg(&rest_r)
            .arg(&loss_r)
            .arg(&a.bias)
            .arg(&a.softcap)
            .arg(&zy);
        // SAFETY: argument types and order match WG_COMBINE_PARAMS in wgmma.cu; the buffers are
        // as the caller guarantees (this function's contract): partials of `rows` rows, e_r
        // rows x d and c V x d 16-bit values (4-byte aligned: d even), targets (class < V or
        // −1), lse and loss rows offset to r0 with `rows` more, bias V values or 0, zy 0 or
        // `rows` f32.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (WGMMA_COMBINE_THREADS, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(drv)?;
        Ok(())
    }

    /// A 2-D TMA tensor map of the row-major `[rows, d]` 16-bit matrix at `ptr`: boxes of
    /// `box_rows` rows x 64 columns (128 bytes), 128-byte swizzle, zero fill out of bounds
    /// (`wgmma.cu` "Parameters").
    fn tensor_map(
        &self,
        dtype: DType,
        ptr: u64,
        rows: usize,
        d: usize,
        box_rows: usize,
    ) -> Result<TmaDesc> {
        self.encode_map(dtype, ptr, (rows, d, d), box_rows)
    }

    /// The TMA tensor map of an f16 output of the WGMMA epilogues (`wgmma.cu`
    /// `store_f16_tile`): the row-major `[rows, cols]` u16 matrix at `ptr` (16-byte aligned)
    /// with row stride `ld` elements (a multiple of 8, ≥ cols), 64 x 64 boxes, 128-byte swizzle.
    fn tensor_map_out(&self, ptr: u64, rows: usize, cols: usize, ld: usize) -> Result<TmaDesc> {
        self.encode_map(DType::F16, ptr, (rows, cols, ld), 64)
    }

    /// `cuTensorMapEncodeTiled` of the 2-D 16-bit `[rows, cols]` matrix at `ptr` with row stride
    /// `ld` elements: boxes of `box_rows` rows x 64 columns (128 bytes), 128-byte swizzle, zero
    /// fill out of bounds.
    fn encode_map(
        &self,
        dtype: DType,
        ptr: u64,
        (rows, d, ld): (usize, usize, usize),
        box_rows: usize,
    ) -> Result<TmaDesc> {
        use cudarc::driver::sys;
        if !ptr.is_multiple_of(16) || !(ld * 2).is_multiple_of(16) || ld < d {
            return Err(CceError::InvalidOption {
                name: "tensor map",
                reason: format!(
                    "address {ptr:#x} or row stride {ld} not 16-byte aligned, or under {d}"
                ),
            });
        }
        let data_type = match dtype {
            DType::BF16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            DType::F16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            other => {
                return Err(CceError::Unsupported {
                    backend: BACKEND,
                    what: format!("dtype {other} in the WGMMA forward"),
                })
            }
        };
        let dims: [u64; 2] = [d as u64, rows as u64];
        let strides: [u64; 1] = [(ld * 2) as u64];
        let boxes: [u32; 2] = [WGMMA_BK as u32, box_rows as u32];
        let elem_strides: [u32; 2] = [1, 1];
        let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::uninit();
        self.ctx.bind_to_thread().map_err(drv)?;
        // SAFETY: `map` is a writable, 64-byte (here 128-byte) aligned CUtensorMap; the four
        // arrays hold rank (2) entries (strides rank − 1) and live through the call; `ptr` is
        // the 16-byte aligned device address (checked above) of a live [rows, d] buffer of
        // 2-byte elements with the row stride ld·2 bytes (a multiple of 16, checked); box 64 x
        // box_rows (≤ 256) with 64·2 = 128 bytes inner extent, as SWIZZLE_128B requires. The
        // call only encodes the descriptor (it dereferences no device memory).
        unsafe {
            sys::cuTensorMapEncodeTiled(
                map.as_mut_ptr(),
                data_type,
                2,
                ptr as *mut c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                elem_strides.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        }
        .result()
        .map_err(drv)?;
        // SAFETY: cuTensorMapEncodeTiled returned success, so it wrote the whole map.
        let map = unsafe { map.assume_init() };
        Ok(TmaDesc(map.opaque))
    }

    /// The forward of a forward-only call over the class tiles of `cf` (`chunked.cu` "(2')"):
    /// tile `i`'s logits GEMM writes buffer `i mod 2` on the engine's stream, its row
    /// reductions (`cce_cls_fwd_*`) read it on the row stream; events order each buffer's
    /// reuse, and the engine's stream waits for the row stream at the end. `base` is the
    /// scratch (both buffers, then the row state).
    fn forward_by_classes(
        &self,
        cfg: &DenseConfig,
        cf: cce_core::ClassForward,
        base: u64,
        a: &RowArgs,
        (e, c): (u64, u64),
    ) -> Result<()> {
        let (n, d, v) = (cfg.n, cfg.d, cfg.v);
        let esz = cfg.dtype.size_bytes();
        let f = self.func(&format!("cce_cls_fwd_{}", dtype_code(cfg.dtype)?))?;
        let rs = self.row_stream()?;
        let bufs = [base, base + cf.buffer_bytes() as u64];
        let state = base + cf.state_offset() as u64;
        let ldk = cf.ld();
        let ldk_i = ldk as i64;
        let v_i = to_i32(v, "V")?;
        let event = || self.ctx.new_event(None).map_err(drv);
        let gemm_done = [event()?, event()?];
        let rows_done = [event()?, event()?];
        let tiles_per_group = v.div_ceil(cf.classes);
        // Every class tile starts at a multiple of 4 (the bias's 8-byte loads): checked before
        // anything is queued on the row stream.
        if a.bias != 0 && cf.classes < v && !cf.classes.is_multiple_of(4) {
            return Err(CceError::InvalidOption {
                name: "ClassForward",
                reason: format!("{} classes per tile is not a multiple of 4", cf.classes),
            });
        }
        // From here on the row stream may hold queued work on the scratch: whatever happens,
        // the engine's stream waits for it before returning (the caller frees the scratch in
        // the engine's stream order).
        let queued = (|| -> Result<()> {
            let mut i = 0usize;
            for r0 in (0..n).step_by(cf.rows) {
                let rows = cf.rows.min(n - r0);
                let (t_r, lse_r, rest_r, loss_r, ent_r, am_r) = a.rows_at(r0);
                let state_r = state + (r0 * cce_core::plan::CLASS_FORWARD_STATE_BYTES) as u64;
                let rows_i = to_i32(rows, "rows")?;
                for (k, c0) in (0..v).step_by(cf.classes).enumerate() {
                    let kk = cf.classes.min(v - c0);
                    let b = i % 2;
                    if i >= 2 {
                        // Buffer b is free once the row reductions of tile i - 2 have read it.
                        self.stream.wait(&rows_done[b]).map_err(drv)?;
                    }
                    self.gemm_logits(
                        (kk, d, rows),
                        cfg.dtype,
                        (
                            c + (c0 * d * esz) as u64,
                            e + (r0 * d * esz) as u64,
                            bufs[b],
                        ),
                        ldk,
                    )?;
                    gemm_done[b].record(&self.stream).map_err(drv)?;
                    rs.wait(&gemm_done[b]).map_err(drv)?;
                    let (k_i, c0_i) = (to_i32(kk, "classes")?, to_i32(c0, "class")?);
                    let first = (k == 0) as i32;
                    let last = (k + 1 == tiles_per_group) as i32;
                    let mut lb = rs.launch_builder(f);
                    lb.arg(&bufs[b])
                        .arg(&ldk_i)
                        .arg(&k_i)
                        .arg(&c0_i)
                        .arg(&v_i)
                        .arg(&rows_i)
                        .arg(&a.bias)
                        .arg(&a.softcap)
                        .arg(&t_r)
                        .arg(&a.alpha)
                        .arg(&a.lambda)
                        .arg(&state_r)
                        .arg(&first)
                        .arg(&last)
                        .arg(&lse_r)
                        .arg(&rest_r)
                        .arg(&loss_r)
                        .arg(&ent_r)
                        .arg(&am_r);
                    let grid = u32::try_from(rows.div_ceil(CLS_ROWS_PER_BLOCK)).map_err(|_| {
                        CceError::ResourceLimit {
                            resource: "CUDA grid blocks".into(),
                            requested: rows.div_ceil(CLS_ROWS_PER_BLOCK) as u64,
                            max: u32::MAX as u64,
                        }
                    })?;
                    let launch = LaunchConfig {
                        grid_dim: (grid, 1, 1),
                        block_dim: (CLS_THREADS, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    // SAFETY: argument types and order match CLS_PARAMS in chunked.cu; buffer b
                    // holds the tile's rows x ldk f32 logits, written by the GEMM this stream just
                    // waited for; the tile-relative [N] arrays (targets, lse, loss, entropy,
                    // argmax) start at row r0 and hold `rows` more; the state holds 6 f32 per row
                    // at r0 (inside the scratch, checked by the caller); the bias is [V] with c0 a
                    // multiple of 4 (checked before the loop) for its 8-byte loads.
                    unsafe { lb.launch(launch) }.map_err(drv)?;
                    rows_done[b].record(rs).map_err(drv)?;
                    i += 1;
                }
            }
            Ok(())
        })();
        // Everything after (the loss reduction, the caller's reads, freeing) follows the row
        // stream.
        let joined = self.stream.join(rs).map_err(drv);
        queued.and(joined)
    }

    /// `cce_sparse_gather_*` (`f`): output row r of `out` = Σ_k G_k · `src`[idx_k] over the
    /// records `off[r] .. off[r] + cnt[r]` (`cnt` = 0: `off[r + 1] − off[r]`), record k at
    /// `recs + step·k`; `sum_out[r]` = Σ_k G_k when non-zero. Grid: `(row blocks, column
    /// blocks)`, [`GATHER_WARPS`] warps per block, a block per (output row, column block).
    ///
    /// # Safety
    /// `f` is a gather kernel of this engine; every address is a live device buffer: `off`
    /// (and `cnt`) hold a row per output row (`off` one more when `cnt` is 0), every record
    /// they name lies in the records buffer and holds an index < the rows of `src` (`[*, d]`
    /// in the input dtype), `out` holds `out rows x d` and `sum_out` (or 0) `out rows` in the
    /// kernel's output dtype; the records and counts were written earlier on this stream.
    unsafe fn gather(
        &self,
        f: &CudaFunction,
        (off, cnt, recs, step): (u64, u64, u64, i64),
        (src, d, out, sum_out): (u64, i64, u64, u64),
        (rows, col_blocks): (u32, u32),
    ) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        let rows_i = rows as i64;
        let mut b = self.stream.launch_builder(f);
        b.arg(&off)
            .arg(&cnt)
            .arg(&recs)
            .arg(&step)
            .arg(&src)
            .arg(&d)
            .arg(&out)
            .arg(&sum_out)
            .arg(&rows_i);
        // SAFETY: argument types and order match GATHER_PARAMS in chunked.cu; the buffers are
        // as the caller guarantees (# Safety).
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (rows, col_blocks, 1),
                block_dim: (GATHER_WARPS * 32, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(drv)
        .map(|_| ())
    }

    /// The second stream ([`DenseEngine`]'s `row_stream`), made on first use.
    fn row_stream(&self) -> Result<&Arc<CudaStream>> {
        if let Some(s) = self.row_stream.get() {
            return Ok(s);
        }
        self.ctx.bind_to_thread().map_err(drv)?;
        let (_, greatest) = cudarc::driver::result::stream::get_priority_range().map_err(drv)?;
        let s = self.ctx.new_stream_with_priority(greatest).map_err(drv)?;
        Ok(self.row_stream.get_or_init(|| s))
    }

    /// Copy the first `N` bytes of a small device buffer to the host and wait for them (one
    /// host sync). Bytes, not typed values: a host byte array has no alignment to cast from.
    fn read_back<const N: usize>(&self, s: &CudaSlice<u8>) -> Result<[u8; N]> {
        let mut host = [0u8; N];
        self.stream
            .memcpy_dtoh(&s.slice(0..N), &mut host[..])
            .map_err(drv)?;
        self.stream.synchronize().map_err(drv)?;
        Ok(host)
    }

    /// The sparse backward's control words (one host sync): pairs allocated, whether a row's
    /// pairs overflowed, and rows whose select pass 2 re-read the row (candidates did not hold
    /// every kept entry; for the profile).
    fn sparse_ctl(&self, ws: &DenseWorkspace) -> Result<(u64, bool, u32)> {
        let host = self.read_back::<16>(&ws.sparse_ctl)?;
        let counter = u64::from_le_bytes(host[0..8].try_into().expect("8 bytes"));
        let overflow = u32::from_le_bytes(host[8..12].try_into().expect("4 bytes"));
        let full = u32::from_le_bytes(host[12..16].try_into().expect("4 bytes"));
        Ok((counter, overflow != 0, full))
    }

    /// The plan's [`cce_core::SparseBackward`] (`chunked.cu` "Sparse backward"): per row chunk
    /// the logits GEMM, the forward rows (forward calls), the kept pairs, `d_e` rows by
    /// gathering `c` (per chunk, or in one launch after the last chunk on peaked data:
    /// [`cce_core::SparseBackward::defer_d_e`]); then the pairs regrouped by class and `d_c`
    /// (and `d_bias`) by gathering `e`. Returns `Ok(Ok(pairs))`, or `Ok(Err((why, rows)))` when it gives way to the dense
    /// passes: the first chunk keeps more than `max_mean_kept` entries per row, or the pairs
    /// outgrow the capacity. `rows` > 0: it gave way after the first chunk, whose logits (rows
    /// `0..rows`, row stride `ld`, at the start of the scratch) and forward rows stay valid for
    /// the dense passes to reuse; nothing else it wrote is used. Two host syncs (three with
    /// [`crate::CudaSwitches::profile`]).
    fn sparse_backward(
        &self,
        cfg: &DenseConfig,
        ws: &mut DenseWorkspace,
        ra: &RowArgs,
        a: &SparseArgs,
    ) -> Result<std::result::Result<u64, (String, usize)>> {
        let sp = cfg.sparse.ok_or_else(|| CceError::InvalidOption {
            name: "plan.sparse",
            reason: "no sparse backward in the plan".into(),
        })?;
        let (n, d, v) = (cfg.n, cfg.d, cfg.v);
        let dt = cfg.dtype;
        let code = dtype_code(dt)?;
        let out_ty = cfg.grad_dtype();
        let out_code = dtype_code(out_ty)?;
        let ld = ws.ld;
        let scratch = sp.scratch_bytes;
        if ws.logits.len() < scratch
            || ws.sparse_rows.len() < n * 8
            || ws.kept.len() < n * 4
            || ld != cce_core::SparseBackward::ld(v)
        {
            return Err(CceError::InvalidOption {
                name: "workspace",
                reason: "allocated for another configuration".into(),
            });
        }
        let base = self.ptr(&ws.logits);
        // Logits chunk at the start; row records grow down from the end (kernels/chunked.cu).
        let l_ptr = base;
        let recs_end = base + scratch as u64;
        let row_off = self.ptr(&ws.sparse_rows);
        let row_cnt = row_off + (n * 4) as u64;
        let ctl = self.ptr(&ws.sparse_ctl);
        let (counter, overflow) = (ctl, ctl + 8);
        self.stream.memset_zeros(&mut ws.sparse_ctl).map_err(drv)?;
        let mut chunk = sp.probe_rows.clamp(1, n);
        let mut cap = sp.capacity(chunk, v) as u64;
        let f_fwd = self.func(&format!("cce_dense_fwd_{code}"))?;
        // Select blocks of 512 threads (256 with `CudaSwitches::sparse_select_threads`).
        let sel_threads: u32 = if self.switches.sparse_select_threads == 256 {
            256
        } else {
            SEL_THREADS
        };
        // The forward rows fold into select (its pass 1 carries the online lse) when the call
        // wants only lse and loss of them (no entropy, argmax or label smoothing).
        let fold_fwd = a.forward
            && sel_threads == SEL_THREADS
            && ra.entropy == 0
            && ra.argmax == 0
            && ra.alpha == 0.0
            && self.switches.sparse_fold_forward;
        let f_sel_fold = self.func(&format!("cce_sparse_select_fwd_{code}"))?;
        let f_sel = self.func(&if sel_threads == 256 {
            format!("cce_sparse_select_{code}_t256")
        } else {
            format!("cce_sparse_select_{code}")
        })?;
        // Folded chunks: the probe, and the chunks after it unless most of its rows had to be
        // re-read (their candidates against the running max did not fit; then the forward
        // rows and select run apart, which reads each row twice instead of three times).
        let mut fold = fold_fwd;
        let vec16 = 16 / dt.size_bytes();
        let vec = if d % vec16 == 0 { vec16 } else { 1 };
        let f_gather = self.func(&format!("cce_sparse_gather_{code}_{out_code}_v{vec}"))?;
        let f_gather_l = self.func(&format!("cce_sparse_gather_{code}_{out_code}_v{vec}_l"))?;
        let f_gather_h = self.func(&format!("cce_sparse_gather_{code}_{out_code}_v{vec}_h"))?;
        // Gather column slices of 32·vec columns.
        let gy = d.div_ceil(32 * vec) as u32;
        let osz = out_ty.size_bytes();
        let d_i = d as i64;
        let (kept_ptr, dropped_ptr, tau_ptr, flags_ptr, edges_ptr) = (
            self.ptr(&ws.kept),
            self.ptr(&ws.dropped),
            self.ptr(&ws.tau),
            self.ptr(&ws.flags),
            self.ptr(&ws.edges),
        );
        let (tile_rows, tile_classes, n_ctiles) = a.tile;
        let esz = dt.size_bytes();
        let mut timer = PhaseTimer::new(&self.stream, self.switches.profile)?;
        let mut r0 = 0usize;
        // d_e in one launch after the row pass (peaked data), or per chunk (set by the probe).
        let mut defer_de = false;
        while r0 < n {
            let rows = chunk.min(n - r0);
            let e_r = a.e + (r0 * d * esz) as u64;
            self.gemm_logits((v, d, rows), dt, (a.c, e_r, l_ptr), ld)?;
            PhaseTimer::mark(&mut timer, "logits GEMM")?;
            if a.forward && !fold {
                self.fwd_rows(f_fwd, ra, r0, rows, l_ptr)?;
                PhaseTimer::mark(&mut timer, "forward rows")?;
            }
            let off4 = (r0 * 4) as u64;
            let at = |p: u64| if p != 0 { p + off4 } else { 0 };
            // Folded: select writes the forward's lse, rest and loss rows (a.saved_lse is
            // ra.lse in a forward call, a.saved_rest ra.rest).
            let (t_r, lse_r, rest_r, dl_r, dlse_r) = if fold {
                (
                    at(ra.targets),
                    at(ra.lse),
                    at(ra.rest),
                    at(a.dl_rows),
                    at(a.dlse),
                )
            } else {
                (
                    at(ra.targets),
                    at(a.saved_lse),
                    at(a.saved_rest),
                    at(a.dl_rows),
                    at(a.dlse),
                )
            };
            let loss_r = if fold { at(ra.loss_rows) } else { 0 };
            // The probe (first chunk) fills the lse − max histogram, later chunks read it.
            let (gap_hist, use_gap) = (ctl + 16, i32::from(r0 > 0));
            let (off_r, cnt_r, kept_r, dropped_r, tau_r) = (
                row_off + off4,
                row_cnt + off4,
                kept_ptr + off4,
                dropped_ptr + off4,
                tau_ptr + off4,
            );
            let row0 = r0 as i64;
            let mut b = self
                .stream
                .launch_builder(if fold { f_sel_fold } else { f_sel });
            b.arg(&l_ptr)
                .arg(&ra.ld)
                .arg(&ra.v)
                .arg(&ra.bias)
                .arg(&ra.softcap)
                .arg(&t_r)
                .arg(&lse_r)
                .arg(&rest_r)
                .arg(&dl_r)
                .arg(&a.dl_scalar)
                .arg(&dlse_r)
                .arg(&ra.lambda)
                .arg(&edges_ptr)
                .arg(&a.delta_fixed)
                .arg(&cap)
                .arg(&counter)
                .arg(&overflow)
                .arg(&off_r)
                .arg(&cnt_r)
                .arg(&recs_end)
                .arg(&kept_r)
                .arg(&dropped_r)
                .arg(&tau_r)
                .arg(&flags_ptr)
                .arg(&row0)
                .arg(&tile_rows)
                .arg(&tile_classes)
                .arg(&n_ctiles)
                .arg(&loss_r)
                .arg(&gap_hist)
                .arg(&use_gap);
            // SAFETY: argument types and order match SEL_PARAMS; L holds the chunk's logits
            // (stream order); per-row arrays hold N entries and are offset to the chunk (the
            // folded form writes lse and loss rows there, which no other launch in flight
            // touches); the
            // kernel writes a row's records only when its allocation ends within `cap` =
            // `SparseBackward::capacity(chunk)`, which keeps the records between the end of
            // this chunk's logits and the end of the scratch (`scratch_bytes` ≤ the buffer,
            // checked above).
            unsafe {
                b.launch(LaunchConfig {
                    grid_dim: (rows as u32, 1, 1),
                    block_dim: (sel_threads, 1, 1),
                    shared_mem_bytes: 0,
                })
            }
            .map_err(drv)?;
            PhaseTimer::mark(&mut timer, "select")?;
            if r0 == 0 {
                let (pairs, over, reread) = self.sparse_ctl(ws)?;
                fold = fold
                    && (reread as usize) * 4 <= rows
                    && (pairs as f64) <= FOLD_MAX_KEPT * rows as f64;
                let mean = pairs as f64 / rows as f64;
                if over {
                    return Ok(Err((
                        format!(
                            "the first {rows} rows' pairs overflowed the sparse capacity of {cap}"
                        ),
                        rows,
                    )));
                }
                if mean > sp.max_mean_kept as f64 {
                    return Ok(Err((
                        format!(
                            "the first {rows} rows keep {mean:.0} entries per row (filter threshold at dropped mass {:.0e}), above the {} where the sparse products stop paying",
                            cfg.filter.max_dropped_mass, sp.max_mean_kept
                        ),
                        rows,
                    )));
                }
                // Grow the chunks to what the density leaves room for.
                chunk = sp.rows_after_probe(pairs, n, v);
                cap = sp.capacity(chunk, v) as u64;
                if mean * n as f64 > cap as f64 {
                    return Ok(Err((
                        format!(
                            "the first {rows} rows keep {mean:.0} entries per row; all {n} rows would need about {:.0} pairs, over the sparse capacity of {cap}",
                            mean * n as f64
                        ),
                        rows,
                    )));
                }
                defer_de = sp.defer_d_e(mean * n as f64, v);
            }
            if a.d_e != 0 && !defer_de {
                let de_r = a.d_e + (r0 * d * osz) as u64;
                // SAFETY: row offsets/counts were written by the select kernel above (stream
                // order) and index pairs within `cap`, growing down from `recs_end − 8`;
                // classes are < V, so every gathered row lies in c [V, D]; d_e holds N x D of
                // the gradient dtype and is offset to the chunk; no d_bias sum.
                unsafe {
                    self.gather(
                        f_gather,
                        (off_r, cnt_r, recs_end - 8, -1),
                        (a.c, d_i, de_r, 0),
                        (rows as u32, gy),
                    )
                }?;
                PhaseTimer::mark(&mut timer, "d_e gather")?;
            }
            r0 += rows;
        }
        let (pairs, over, _) = self.sparse_ctl(ws)?;
        let mut dc_lists = String::new();
        if over {
            return Ok(Err((
                format!(
                "the pairs outgrew the sparse capacity of {cap} after the first chunk ({pairs} asked)"
                ),
                0,
            )));
        }
        if a.d_e != 0 && defer_de {
            // One warp per row over all rows (a block per row and chunk would be mostly idle).
            let f = self.func(&format!("cce_sparse_gather_{code}_{out_code}_v{vec}_b32"))?;
            let n_ll = n as i64;
            let mut b = self.stream.launch_builder(f);
            b.arg(&row_off)
                .arg(&row_cnt)
                .arg(&recs_end)
                .arg(&a.c)
                .arg(&d_i)
                .arg(&a.d_e)
                .arg(&n_ll);
            // SAFETY: matches ROWS_GATHER_PARAMS in chunked.cu; row offsets and counts hold N
            // entries written by the select kernels (stream order), naming pairs within `cap`
            // that grow down from `recs_end` (no overflow: checked above); classes are < V, so
            // every gathered row lies in c [V, D]; d_e holds N x D of the gradient dtype.
            unsafe {
                b.launch(LaunchConfig {
                    // A warp per row, rows strided over the grid: no more blocks than rows
                    // need.
                    grid_dim: (
                        GATHER_LIGHT_ROW_BLOCKS
                            .min(n.div_ceil(GATHER_LIGHT_THREADS as usize / 32) as u32),
                        gy,
                        1,
                    ),
                    block_dim: (GATHER_LIGHT_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                })
            }
            .map_err(drv)?;
            PhaseTimer::mark(&mut timer, "d_e gather")?;
        }
        if a.d_c != 0 {
            let (counts_off, starts_off, lists_off, end) =
                cce_core::SparseBackward::class_layout(pairs as usize, v);
            if end + 8 * pairs as usize > scratch {
                return Err(CceError::InvalidOption {
                    name: "sparse layout",
                    reason: format!("{pairs} pairs leave no room to regroup them by class"),
                });
            }
            let counts = base + counts_off as u64;
            let ctr = counts + (v * 4) as u64;
            let (starts, lists) = (base + starts_off as u64, base + lists_off as u64);
            let csc = base;
            {
                // counts and the two list counters after them.
                let mut view = ws.logits.slice_mut(counts_off..counts_off + (v + 2) * 4);
                self.stream.memset_zeros(&mut view).map_err(drv)?;
            }
            let rows_cfg = LaunchConfig {
                grid_dim: (n as u32, 1, 1),
                block_dim: (GATHER_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = self.stream.launch_builder(self.func("cce_sparse_count")?);
            b.arg(&row_off).arg(&row_cnt).arg(&recs_end).arg(&counts);
            // SAFETY: matches cce_sparse_count; rows' pairs as written by the select kernels
            // (classes < V, counts holds V u32, zeroed above); the logits are no longer read.
            unsafe { b.launch(rows_cfg) }.map_err(drv)?;
            PhaseTimer::mark(&mut timer, "count by class")?;
            let v_i = v as i32;
            let scan_cfg = LaunchConfig {
                grid_dim: (v.div_ceil(SCAN_TILE) as u32, 1, 1),
                block_dim: (SCAN_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut b = self
                .stream
                .launch_builder(self.func("cce_sparse_tile_sums")?);
            b.arg(&counts).arg(&ctr).arg(&v_i);
            // SAFETY: matches cce_sparse_tile_sums; counts V u32, ctr 2 + ⌈V / SCAN_TILE⌉ u32
            // (class_layout), one block per tile.
            unsafe { b.launch(scan_cfg) }.map_err(drv)?;
            // Classes without records: written as zeros by the light gather where the pairs
            // outnumber the classes (most have records: c/8), else zeroed by one memset (most
            // have none: randn; seed 1.6 → 1.15 ms, session 6 runs 2 and 5).
            let list_empty = i32::from(pairs >= v as u64);
            if list_empty == 0 {
                // SAFETY: d_c holds V x D and d_bias (or 0) V elements of the gradient dtype.
                unsafe {
                    cudarc::driver::result::memset_d8_async(
                        a.d_c,
                        0,
                        v * d * osz,
                        self.stream.cu_stream(),
                    )
                    .map_err(drv)?;
                    if a.d_bias != 0 {
                        cudarc::driver::result::memset_d8_async(
                            a.d_bias,
                            0,
                            v * osz,
                            self.stream.cu_stream(),
                        )
                        .map_err(drv)?;
                    }
                }
            }
            let mut b = self
                .stream
                .launch_builder(self.func("cce_sparse_scan_tiles")?);
            b.arg(&counts)
                .arg(&ctr)
                .arg(&starts)
                .arg(&lists)
                .arg(&v_i)
                .arg(&list_empty);
            // SAFETY: matches cce_sparse_scan_tiles; the tile sums were written by the launch
            // above (stream order); starts V + 1 u32 and lists V u32 (class_layout).
            unsafe { b.launch(scan_cfg) }.map_err(drv)?;
            PhaseTimer::mark(&mut timer, "scan")?;
            let mut b = self.stream.launch_builder(self.func("cce_sparse_scatter")?);
            b.arg(&row_off)
                .arg(&row_cnt)
                .arg(&recs_end)
                .arg(&starts)
                .arg(&counts)
                .arg(&csc);
            // SAFETY: matches cce_sparse_scatter; starts sum to Σ row_cnt ≤ `pairs`, so every
            // position is below `class_layout`'s end, checked above to stay under the row
            // records; the class records overlay only the (no longer read) logits.
            unsafe { b.launch(rows_cfg) }.map_err(drv)?;
            PhaseTimer::mark(&mut timer, "scatter")?;
            let v_ll = v as i64;
            for (f, threads, gx) in [
                (f_gather_l, GATHER_LIGHT_THREADS, GATHER_LIGHT_ROW_BLOCKS),
                (f_gather_h, GATHER_WARPS * 32, GATHER_HEAVY_ROW_BLOCKS),
            ] {
                let mut b = self.stream.launch_builder(f);
                b.arg(&starts)
                    .arg(&csc)
                    .arg(&a.e)
                    .arg(&d_i)
                    .arg(&a.d_c)
                    .arg(&a.d_bias)
                    .arg(&lists)
                    .arg(&ctr)
                    .arg(&v_ll);
                // SAFETY: matches CLASS_GATHER_PARAMS in chunked.cu; the lists name classes
                // < V whose records (starts, scan above) lie in csc and hold rows < N, so
                // gathered rows lie in e [N, D]; d_c V x D, d_bias V (or 0), gradient dtype.
                unsafe {
                    b.launch(LaunchConfig {
                        grid_dim: (gx.min(v as u32), gy, 1),
                        block_dim: (threads, 1, 1),
                        shared_mem_bytes: 0,
                    })
                }
                .map_err(drv)?;
            }
            PhaseTimer::mark(&mut timer, "d_c gather")?;
            if timer.is_some() {
                // Profile only: the light and heavy class counts (one more host sync).
                let mut host = [0u8; 8];
                let off = counts_off + v * 4;
                self.stream
                    .memcpy_dtoh(&ws.logits.slice(off..off + 8), &mut host[..])
                    .map_err(drv)?;
                self.stream.synchronize().map_err(drv)?;
                let word =
                    |i: usize| u32::from_le_bytes([host[i], host[i + 1], host[i + 2], host[i + 3]]);
                dc_lists = format!(", d_c over {} light + {} heavy classes", word(0), word(4));
            }
        }
        if timer.is_some() {
            let (_, _, full) = self.sparse_ctl(ws)?;
            PhaseTimer::report(
                timer,
                &format!("sparse backward ({sel_threads}-thread select, {full} of {n} rows re-read in pass 2{dc_lists})"),
            )?;
        }
        Ok(Ok(pairs))
    }

    /// Split dense: `dst` (f16 `[V, D]`) = `2^kc · c` for bf16 `c`, with `kc` from max |c| so
    /// that max |2^kc · c| ≤ 2^15 (one read-back). Returns `kc`.
    fn c16_copy(
        &self,
        cfg: &DenseConfig,
        ws: &mut DenseWorkspace,
        c: &CudaSlice<u8>,
        dst: u64,
    ) -> Result<i32> {
        let count = cfg.v * cfg.d;
        let max_c = self.abs_max(ws, c, cfg.dtype, count)?;
        let kc = pow2_to(max_c, 15);
        self.to_f16(self.ptr(c), dst, count, 2f32.powi(kc))?;
        Ok(kc)
    }

    /// max |x| over `count` elements of `dtype` (a device reduction and a 4-byte read-back).
    fn abs_max(
        &self,
        ws: &mut DenseWorkspace,
        x: &CudaSlice<u8>,
        dtype: DType,
        count: usize,
    ) -> Result<f32> {
        let x_ptr = self.ptr(x);
        Ok(self.split_scales(ws, (x_ptr, dtype, count), count, None)?.0)
    }

    /// `cce_split_scales_*`: (max |x| over `count` elements of `dtype` at `x`, max |G
    /// coefficient| over the rows of `rows`, 0 without them). One launch sized for
    /// `grid_elems` elements and an 8-byte read-back (one host sync).
    fn split_scales(
        &self,
        ws: &mut DenseWorkspace,
        (x, dtype, count): (u64, DType, usize),
        grid_elems: usize,
        rows: Option<ScaleRows>,
    ) -> Result<(f32, f32)> {
        self.stream.memset_zeros(&mut ws.scales).map_err(drv)?;
        let scales_ptr = self.ptr(&ws.scales);
        let count_i = count as i64;
        let r = rows.unwrap_or(ScaleRows {
            targets: 0,
            dl_rows: 0,
            dl_scalar: 0.0,
            dlse: 0,
            lse: 0,
            rest: 0,
            alpha: 0.0,
            lambda: 0.0,
            n: 0,
            v: 0,
        });
        let mut b = self
            .stream
            .launch_builder(self.func(&format!("cce_split_scales_{}", dtype_code(dtype)?))?);
        b.arg(&x)
            .arg(&count_i)
            .arg(&r.targets)
            .arg(&r.dl_rows)
            .arg(&r.dl_scalar)
            .arg(&r.dlse)
            .arg(&r.lse)
            .arg(&r.rest)
            .arg(&r.alpha)
            .arg(&r.lambda)
            .arg(&r.n)
            .arg(&r.v)
            .arg(&scales_ptr);
        // SAFETY: matches SCALES_PARAMS; x holds `count` elements (the caller's buffer); the
        // row pointers hold N values or are 0 (and N = 0 without rows, so they are not read);
        // out holds 2 u32 (zeroed).
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (grid_elems.div_ceil(256 * 8).clamp(1, 132 * 16) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(drv)?;
        let host = self.read_back::<8>(&ws.scales)?;
        let f32_at =
            |i: usize| f32::from_le_bytes(host[4 * i..4 * i + 4].try_into().expect("4 bytes"));
        Ok((f32_at(0), f32_at(1)))
    }

    /// `dst` (f16) = `src` (bf16) · `scale`, `count` elements.
    fn to_f16(&self, src: u64, dst: u64, count: usize, scale: f32) -> Result<()> {
        let count_i = count as i64;
        let mut b = self
            .stream
            .launch_builder(self.func("cce_split_e_to_f16_bf16")?);
        b.arg(&src).arg(&dst).arg(&count_i).arg(&scale);
        // SAFETY: matches cce_split_e_to_f16_bf16; src holds count bf16, dst count f16 (a
        // workspace region sized for it), disjoint.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (count.div_ceil(256 * 4).clamp(1, 132 * 32) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(drv)
        .map(|_| ())
    }

    /// `d_e` rows (`out_ty`) = f32 rows · per-row scale (or 1) · `cscale`.
    fn de_finish(
        &self,
        out_ty: DType,
        tmp: u64,
        rs: u64,
        cscale: f32,
        de: u64,
        (rows, d): (usize, usize),
    ) -> Result<()> {
        let f = self.func(&format!("cce_split_de_finish_{}", dtype_code(out_ty)?))?;
        let rows_i = rows as i64;
        let d_i = to_i32(d, "D")?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&tmp)
            .arg(&rs)
            .arg(&cscale)
            .arg(&de)
            .arg(&rows_i)
            .arg(&d_i);
        // SAFETY: matches DEF_PARAMS; tmp holds rows·d f32 written by the GEMMs above (stream
        // order), rs rows f32 (or 0), de rows·d elements of out_ty (the chunk's d_e rows).
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: ((rows * d).div_ceil(256).clamp(1, 132 * 64) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(drv)
        .map(|_| ())
    }

    /// `cce_dense_convert_{code}`: `dst[i] = src[i]` for `count` values, f32 to the gradient
    /// dtype `code`. The caller guarantees `src` holds `count` f32 and `dst` `count` elements.
    fn convert_f32(&self, code: &str, src: u64, dst: u64, count: usize) -> Result<()> {
        let f = self.func(&format!("cce_dense_convert_{code}"))?;
        let count_i = count as i64;
        let mut b = self.stream.launch_builder(f);
        b.arg(&src).arg(&dst).arg(&count_i);
        // SAFETY: matches cce_dense_convert_* (f32 source, gradient-dtype destination, i64
        // count); both buffers hold `count` elements (the caller's contract, from checked
        // sizes); the grid strides over the count.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (count.div_ceil(256).min(65535 * 16) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(drv)?;
        Ok(())
    }

    /// Split dense's class pass (`chunked.cu`, "Split dense"): per class chunk, the logits of
    /// all rows recomputed and `G` from the saved lse (f16 with a power-of-two scale, or f32):
    /// one WGMMA kernel with `G` in its epilogue where [`DenseEngine::wgmma_gcols_classes`]
    /// allows (f16 `G` at the start of the scratch, the f16 copy of `e` and the f32 `d_c`
    /// temp at its end: chunks as large as the scratch holds, [`DenseConfig::gcols_layout`]),
    /// else, per chunk of the plan's classes, a cuBLAS logits GEMM and `cce_split_gcols_*`;
    /// then `d_c` of the chunk's classes by GEMM (through the WGMMA epilogue in sub-chunks of
    /// the layout's `dc_classes` when the f32 temp of bf16 outputs holds fewer classes than a
    /// chunk), written in the gradient dtype; `d_bias` added to its f32 accumulator (or the
    /// f32 output, zeroed by the caller). Returns the note of how `G` was computed
    /// ([`DenseStats::class_pass`]).
    fn class_pass(
        &self,
        cfg: &DenseConfig,
        ws: &mut DenseWorkspace,
        inp: &DenseInputs<'_>,
        a: ClassPassArgs,
    ) -> Result<String> {
        let (n, d, v) = (cfg.n, cfg.d, cfg.v);
        let dt = cfg.dtype;
        let esz = dt.size_bytes();
        let code = dtype_code(dt)?;
        let kmax = cfg.chunk_classes.unwrap_or(v).clamp(1, v);
        if kmax > cce_core::plan::SPLIT_DENSE_MAX_CLASSES {
            return Err(CceError::InvalidOption {
                name: "chunk_classes",
                reason: format!(
                    "{kmax} > {} (the plan's largest class chunk, cce_core::plan::SPLIT_DENSE_MAX_CLASSES)",
                    cce_core::plan::SPLIT_DENSE_MAX_CLASSES
                ),
            });
        }
        let ldk = cfg.ld_classes();
        let gdt = cfg.class_pass_dtype();
        let out_ty = cfg.grad_dtype();
        let l_ptr = self.ptr(&ws.logits);
        let e_ptr = self.ptr(inp.e);
        let c_ptr = self.ptr(inp.c);
        // The scratch (byte offsets): through the WGMMA epilogue its layout (f16 G [N, ldg]
        // at 0; the f16 copy of e and the f32 d_c temp of dc_classes classes at the end); else
        // the f32 logits [N, ldk] at 0 (G written over them), e's copy after them, the temp of
        // kmax classes after it.
        let wg = self.wgmma_gcols_classes(cfg, ws.logits.len(), (e_ptr, c_ptr));
        let (g_end, e16_off, tmp_bytes) = match &wg {
            Ok(l) => (
                n * l.ldg * 2,
                l.e16_off,
                if cfg.dc_tmp_bytes() > 0 {
                    l.dc_classes * d * 4
                } else {
                    0
                },
            ),
            Err(_) => (n * ldk * 4, n * ldk * 4, cfg.dc_tmp_bytes()),
        };
        let tmp_off = e16_off + cfg.e16_bytes();
        if g_end > e16_off || ws.logits.len() < tmp_off + tmp_bytes {
            return Err(CceError::InvalidOption {
                name: "workspace",
                reason: "allocated for another configuration".into(),
            });
        }
        let t_ptr = self.ptr(inp.targets);
        let bias_ptr = self.opt_ptr(inp.bias);
        let tau_ptr = self.ptr(&ws.tau);
        let n_i = to_i32(n, "N")?;
        let v_i = to_i32(v, "V")?;

        // Scales: max |e| (bf16 inputs only: the f16 copy) and the bound of |G|.
        // max |e| (bf16 inputs: for the scale of its f16 copy) and max |G coefficient|.
        let e_count = if dt == DType::BF16 { n * d } else { 0 };
        let (max_e, max_g) = self.split_scales(
            ws,
            (e_ptr, dt, e_count),
            n * d,
            Some(ScaleRows {
                targets: t_ptr,
                dl_rows: a.dl_rows,
                dl_scalar: a.dl_scalar,
                dlse: a.dlse,
                lse: a.lse,
                rest: a.rest,
                alpha: cfg.label_smoothing,
                lambda: cfg.z_loss,
                n: n_i,
                v: v_i,
            }),
        )?;
        // Powers of two: max |2^ke · e| ≤ 2^15 and max |2^kg · G| ≤ 2^14 (f16 max 65504).
        let (ke, kg) = if gdt == DType::F16 {
            (
                if dt == DType::BF16 {
                    pow2_to(max_e, 15)
                } else {
                    0
                },
                pow2_to(max_g, 14),
            )
        } else {
            (0, 0)
        };
        let e_scale = 2f32.powi(ke);
        let g_scale = 2f32.powi(kg);
        let alpha = 2f32.powi(-ke - kg);
        let inv_g = 2f32.powi(-kg);

        // E' = f16(2^ke · e) for bf16 inputs.
        let e_op = if dt == DType::BF16 {
            let dst = l_ptr + e16_off as u64;
            self.to_f16(e_ptr, dst, n * d, e_scale)?;
            dst
        } else {
            e_ptr
        };

        let ldg = ldk * 4 / gdt.size_bytes();
        let f_g = self.func(&format!("cce_split_gcols_{code}"))?;
        let f_colsum = self.func(&format!("cce_dense_colsum_{}", dtype_code(gdt)?))?;
        let softcap = cfg.softcap.unwrap_or(0.0);
        let ld_i = ldk as i64;
        // Classes per chunk, G's row stride (elements of gdt), classes per d_c GEMM: through
        // the WGMMA epilogue its layout's (sub-chunks when the f32 d_c temp of bf16 outputs
        // holds fewer classes than a chunk, each starting on a 16-byte column of G); else the
        // plan's chunk, one d_c GEMM per chunk.
        let (step, ldg_step, dc_step) = match &wg {
            Ok(l) => (l.classes, l.ldg, l.dc_classes),
            Err(_) => (kmax, ldg, kmax),
        };
        let tms = match &wg {
            Ok(_) => Some((
                self.tensor_map(dt, e_ptr, n, d, WGMMA_BM)?,
                format!(
                    "cce_wgmma_gcols{}_{code}",
                    if softcap > 0.0 { "_cap" } else { "" }
                ),
            )),
            Err(_) => None,
        };
        let mut prof = PhaseTimer::new(&self.stream, self.switches.profile)?;
        for k0 in (0..v).step_by(step) {
            let kc = step.min(v - k0);
            let kc_i = kc as i32;
            let k0_i = k0 as i32;
            let c_k = c_ptr + (k0 * d * esz) as u64;
            if let Some((tm_e, name)) = &tms {
                // (a)+(b) in one kernel: the chunk's logits stay in registers.
                self.launch_wgmma_gcols(
                    name,
                    (tm_e, self.tensor_map(dt, c_k, kc, d, WGMMA_BN)?),
                    (n, kc, d, k0, v),
                    (l_ptr, ldg_step),
                    (bias_ptr, softcap, t_ptr, a.lse, a.rest),
                    (a.dl_rows, a.dl_scalar, a.dlse),
                    (cfg.label_smoothing, cfg.z_loss, g_scale),
                )?;
                PhaseTimer::mark(&mut prof, "WGMMA logits + G")?;
            } else {
                // (a) logits of the chunk's classes for every row.
                self.gemm_logits((kc, d, n), dt, (c_k, e_ptr, l_ptr), ldk)?;
                PhaseTimer::mark(&mut prof, "logits GEMM")?;
                // (b) G in place.
                let mut b = self.stream.launch_builder(f_g);
                b.arg(&l_ptr)
                    .arg(&ld_i)
                    .arg(&kc_i)
                    .arg(&k0_i)
                    .arg(&v_i)
                    .arg(&bias_ptr)
                    .arg(&softcap)
                    .arg(&t_ptr)
                    .arg(&a.lse)
                    .arg(&a.rest)
                    .arg(&tau_ptr)
                    .arg(&a.dl_rows)
                    .arg(&a.dl_scalar)
                    .arg(&a.dlse)
                    .arg(&cfg.label_smoothing)
                    .arg(&cfg.z_loss)
                    .arg(&g_scale)
                    .arg(&n_i);
                // SAFETY: matches GCOLS_PARAMS; L holds n rows of ldk f32 (ldk a multiple of 8,
                // the workspace 256-byte aligned: 16-byte row starts) written by the GEMM above
                // (stream order); lse / tau / targets / upstream rows hold N values; bias holds V.
                unsafe {
                    b.launch(LaunchConfig {
                        grid_dim: (n.div_ceil(GC_ROWS) as u32, 1, 1),
                        block_dim: (GC_THREADS, 1, 1),
                        shared_mem_bytes: 0,
                    })
                }
                .map_err(drv)?;
                PhaseTimer::mark(&mut prof, "G columns")?;
            }
            // (c) d_c of the chunk, complete (through the f32 temp for a bf16 output), in
            // sub-chunks of at most dc_step classes.
            for s0 in (0..kc).step_by(dc_step) {
                let ks = dc_step.min(kc - s0);
                let g_s = l_ptr + (s0 * gdt.size_bytes()) as u64;
                let dc_k = a.d_c + ((k0 + s0) * d * out_ty.size_bytes()) as u64;
                if cfg.dc_tmp_bytes() > 0 {
                    let tmp = l_ptr + tmp_off as u64;
                    self.gemm_dc(
                        (ks, d, n),
                        (gdt, gdt, DType::F32),
                        (e_op, g_s, tmp),
                        ldg_step,
                        (alpha, 0.0),
                    )?;
                    // tmp holds ks·d ≤ dc_step·d f32 (at tmp_off, size checked above), d_c
                    // rows k0+s0.. hold ks·d gradient elements.
                    self.convert_f32(code, tmp, dc_k, ks * d)?;
                } else {
                    self.gemm_dc(
                        (ks, d, n),
                        (gdt, gdt, out_ty),
                        (e_op, g_s, dc_k),
                        ldg_step,
                        (alpha, 0.0),
                    )?;
                }
            }
            // (d) d_bias of the chunk.
            if cfg.has_bias {
                let ldg_i = ldg_step as i64;
                let acc_k = a.d_bias_acc + (k0 * 4) as u64;
                let mut b = self.stream.launch_builder(f_colsum);
                b.arg(&l_ptr)
                    .arg(&ldg_i)
                    .arg(&n_i)
                    .arg(&kc_i)
                    .arg(&acc_k)
                    .arg(&inv_g);
                // SAFETY: matches COLSUM_PARAMS; G is n x ldg_step of gdt (written above), the
                // accumulator holds V f32 (zeroed), offset to the chunk's kc columns.
                unsafe {
                    b.launch(LaunchConfig {
                        grid_dim: (kc.div_ceil(COLSUM_THREADS as usize) as u32, 1, 1),
                        block_dim: (COLSUM_THREADS, 1, 1),
                        shared_mem_bytes: 0,
                    })
                }
                .map_err(drv)?;
            }
            PhaseTimer::mark(&mut prof, "d_c GEMM (+ convert, d_bias)")?;
        }
        let chunks = v.div_ceil(step);
        PhaseTimer::report(prof, &format!("split dense class pass ({chunks} chunk(s))"))?;
        Ok(match wg {
            Ok(l) => format!(
                "class pass: WGMMA GEMM with G in its epilogue ({chunks} chunk(s) of up to {} \
                 classes, d_c in sub-chunks of up to {} classes, f16 G, no logits in memory)",
                l.classes, l.dc_classes
            ),
            Err(why) => format!(
                "class pass: cuBLAS logits then G ({chunks} chunk(s) of up to {} classes; no \
                 WGMMA epilogue: {why})",
                kmax.min(v)
            ),
        })
    }

    /// Chunks of split dense's class pass through the WGMMA `G` epilogue
    /// (`cce_wgmma_gcols[_cap]_*`) in a scratch buffer of `scratch` bytes (the workspace's,
    /// [`DenseConfig::scratch_bytes`]): its layout, [`DenseConfig::gcols_layout`] (the f16
    /// `G` of up to `classes` classes at byte 0, the f16 copy of `e` and the f32 `d_c` temp of
    /// `dc_classes` classes at the end). `e`, `c`: the device addresses of the inputs. `Err`
    /// says why the epilogue does not apply: switched off ([`DenseConfig::wgmma_gcols`]), not
    /// compute capability 9.0, f32 inputs, a softcap above
    /// [`WGMMA_SOFTCAP_MAX`], an empty dimension, `D` not a multiple of 64, unaligned inputs or
    /// sizes past 32 bits (the tile count of a chunk included), a scratch too small for the
    /// layout, chunks under one 256-class tile. (No `τ`: split dense's row pass never filters,
    /// so `τ = 0`.)
    pub fn wgmma_gcols_classes(
        &self,
        cfg: &DenseConfig,
        scratch: usize,
        (e, c): (u64, u64),
    ) -> std::result::Result<GColsLayout, String> {
        let (n, v) = (cfg.n, cfg.v);
        let layout = cfg.gcols_layout(scratch);
        let kw = layout.map_or(0, |l| l.classes);
        let why = if let Some(why) = self.wgmma_unfit(cfg, cfg.wgmma_gcols, (e, c), kw) {
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

    /// One launch of `cce_wgmma_gcols[_cap]_*` (`kernels/wgmma.cu`): `G[n, kc]` (f16, row stride
    /// `ldg` elements, at `g`) of classes `k0..k0 + kc` from the logits `E · C_kᵀ` computed in
    /// registers, the saved lse, the targets and upstream gradients, scaled by `g_scale`;
    /// persistent grid of at most one block per multiprocessor.
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn launch_wgmma_gcols(
        &self,
        name: &str,
        (tm_e, tm_c): (&TmaDesc, TmaDesc),
        (n, kc, d, k0, v): (usize, usize, usize, usize, usize),
        (g, ldg): (u64, usize),
        (bias, softcap, targets, lse, rest): (u64, f32, u64, u64, u64),
        (dl_rows, dl_scalar, dlse): (u64, f32, u64),
        (alpha, lambda, g_scale): (f32, f32, f32),
    ) -> Result<()> {
        let f = self.func(name)?;
        let tiles = n.div_ceil(WGMMA_BM) * kc.div_ceil(WGMMA_BN);
        let grid = tiles.min(self.sm_count.max(1)) as u32;
        let (n_i, kc_i, d_i) = (to_i32(n, "N")?, to_i32(kc, "classes")?, to_i32(d, "D")?);
        let (k0_i, v_i) = (to_i32(k0, "k0")?, to_i32(v, "V")?);
        let tm_g = self.tensor_map_out(g, n, kc, ldg)?;
        let (group_m, ordered) = (WGMMA_GROUP_M, 1i32);
        let mut b = self.stream.launch_builder(f);
        b.arg(tm_e)
            .arg(&tm_c)
            .arg(&n_i)
            .arg(&kc_i)
            .arg(&d_i)
            .arg(&k0_i)
            .arg(&v_i)
            .arg(&tm_g)
            .arg(&bias)
            .arg(&softcap)
            .arg(&targets)
            .arg(&lse)
            .arg(&rest)
            .arg(&dl_rows)
            .arg(&dl_scalar)
            .arg(&dlse)
            .arg(&alpha)
            .arg(&lambda)
            .arg(&g_scale)
            .arg(&group_m)
            .arg(&ordered);
        // SAFETY: argument types and order match WG_GCOLS_PARAMS in wgmma.cu (two 128-byte
        // tensor maps by value; i32 N, K, D, k0, V; G's tensor map by value; bias, f32
        // softcap, targets, lse, rest; dl_rows, f32 dl_scalar, dlse; f32 α, λ, g_scale; i32 group_m,
        // ordered_epi). The maps describe the live [n, D] and [kc, D] 16-bit row-major inputs
        // (16-byte aligned, D % 64 == 0: `wgmma_gcols_classes`), so TMA reads nothing outside
        // them; G's map is [n, kc] f16 with row stride ldg·2 bytes (ldg ≥ kc a multiple of 8:
        // bytes [0, n·ldg·2) of the scratch, below the f16 copy of e and the d_c temp, checked
        // by `class_pass` against the layout of `DenseConfig::gcols_layout`), and TMA stores
        // write nothing outside it; the per-row arrays hold n values and bias V (checked by
        // `run`); 384 threads and WGMMA_SMEM_OUT_BYTES of dynamic shared memory (the attribute
        // set at construction); grid ≤ the tile count.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (grid, 1, 1),
                block_dim: (WGMMA_THREADS, 1, 1),
                shared_mem_bytes: WGMMA_SMEM_OUT_BYTES as u32,
            })
        }
        .map_err(drv)?;
        Ok(())
    }

    /// Fill `x` (`n` elements of `dtype`) with `mean + std·N(0, 1)` from a counter-based hash
    /// of `(seed, index)` (benches and tests).
    pub fn fill_randn(
        &self,
        x: &mut CudaSlice<u8>,
        dtype: DType,
        n: usize,
        seed: u64,
        mean: f32,
        std: f32,
    ) -> Result<()> {
        if x.len() < n * dtype.size_bytes() {
            return Err(CceError::ShapeMismatch {
                what: "fill_randn",
                expected: format!("{} bytes", n * dtype.size_bytes()),
                got: format!("{} bytes", x.len()),
            });
        }
        let f = self.func(&format!("cce_dense_randn_{}", dtype_code(dtype)?))?;
        let p = self.ptr(x);
        let n_i = n as i64;
        let mut b = self.stream.launch_builder(f);
        b.arg(&p).arg(&n_i).arg(&seed).arg(&mean).arg(&std);
        // SAFETY: matches cce_dense_randn_*; x holds n elements of dtype (checked).
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (n.div_ceil(256).clamp(1, 65535 * 16) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(drv)
        .map(|_| ())
    }

    /// Fill i32 targets `[n]` with hashed classes in `[0, v)`, −1 with probability
    /// `ignore_frac`.
    pub fn random_targets(
        &self,
        t: &mut CudaSlice<u8>,
        n: usize,
        v: usize,
        seed: u64,
        ignore_frac: f32,
    ) -> Result<()> {
        if t.len() < n * 4 {
            return Err(CceError::ShapeMismatch {
                what: "random_targets",
                expected: format!("{} bytes", n * 4),
                got: format!("{} bytes", t.len()),
            });
        }
        let f = self.func("cce_dense_random_targets")?;
        let p = self.ptr(t);
        let n_i = to_i32(n, "N")?;
        let v_i = to_i32(v, "V")?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&p).arg(&n_i).arg(&v_i).arg(&seed).arg(&ignore_frac);
        // SAFETY: matches cce_dense_random_targets; t holds n i32 (checked).
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (n.div_ceil(256) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(drv)
        .map(|_| ())
    }
}

// ----------------------------------------------------------------------------------------------
// Glue to CudaBackend: Backend-trait calls with CudaTensor buffers
// ----------------------------------------------------------------------------------------------

/// A validated `CudaBackend` call handed to the engine (the backend has checked shapes,
/// dtypes, buffer ownership and targets, and made the plan).
pub(crate) struct BackendCall<'a> {
    /// The plan (strategy `ChunkedDense`).
    pub plan: &'a cce_core::Plan,
    /// Rows with a class.
    pub n_valid: usize,
    /// Prepared classes, i32 `[N]` (−1 = ignored).
    pub classes: &'a CudaSlice<u8>,
    /// The inputs.
    pub inputs: &'a cce_core::Inputs<'a, crate::CudaTensor>,
    /// The options.
    pub opts: &'a cce_core::Options,
    /// Forward-only calls may take the fused WGMMA forward ([`DenseConfig::wgmma_forward`]).
    pub wgmma_forward: bool,
    /// Split dense's class pass may take the WGMMA `G` epilogue ([`DenseConfig::wgmma_gcols`]).
    pub wgmma_gcols: bool,
    /// Split dense's row pass may take the WGMMA lse and `e^{z − m}` epilogue
    /// ([`DenseConfig::wgmma_rows`]).
    pub wgmma_rows: bool,
}

type BackendOutputs = (
    Option<cce_core::ForwardOutput<crate::CudaTensor>>,
    Option<cce_core::BackwardOutput<crate::CudaTensor>>,
);

impl DenseEngine {
    fn tensor(&self, shape: Vec<usize>, dtype: DType) -> Result<crate::CudaTensor> {
        let bytes = shape.iter().product::<usize>() * dtype.size_bytes();
        // SAFETY: every output tensor is fully written by the call before it is returned.
        let s =
            unsafe { self.stream.alloc::<u8>(bytes.max(1)) }.map_err(|e| alloc_err(e, bytes))?;
        crate::CudaTensor::from_slice(s, dtype, shape)
    }

    fn base_stats(&self, call: &BackendCall<'_>, workspace_bytes: u64) -> cce_core::CallStats {
        let p = call.plan;
        cce_core::CallStats {
            backend: BACKEND.into(),
            strategy: p.strategy,
            plan_reason: p.reason.clone(),
            n_valid: call.n_valid,
            tiles_total: p.tile_count(),
            tiles_visited: 0,
            tiles_skipped: 0,
            entries_kept: 0,
            entries_skipped: 0,
            dropped_mass_max: 0.0,
            dropped_mass_mean: 0.0,
            filter_eps: p.filter.eps,
            max_dropped_mass: p.filter.max_dropped_mass,
            workspace_bytes,
        }
    }

    /// Forward (`saved` None, `up` None), backward (`saved` Some: the forward's lse and
    /// `rest_mass`), or both (`saved` None, `up` Some).
    pub(crate) fn backend_run(
        &self,
        call: &BackendCall<'_>,
        saved: Option<cce_core::Saved<'_, crate::CudaTensor>>,
        up: Option<&cce_core::Upstream<'_, crate::CudaTensor>>,
    ) -> Result<BackendOutputs> {
        use cce_core::TensorMeta;
        let mut cfg = DenseConfig::from_plan(call.plan, call.opts)?;
        cfg.wgmma_forward = call.wgmma_forward;
        cfg.wgmma_gcols = call.wgmma_gcols;
        cfg.wgmma_rows = call.wgmma_rows;
        if up.is_none() {
            // Forward only: no sparse backward, so none of its workspace.
            cfg.sparse = None;
        } else {
            // Calls with a backward never take the class tiles: none of their buffers.
            cfg.class_forward = None;
        }
        let (n, d, v) = (cfg.n, cfg.d, cfg.v);
        let f32_vec = |t: &crate::CudaTensor, what: &'static str| -> Result<()> {
            if t.dtype() != DType::F32 || t.numel() != n {
                return Err(CceError::ShapeMismatch {
                    what,
                    expected: format!("[{n}] f32"),
                    got: format!("{:?} {}", t.shape(), t.dtype()),
                });
            }
            Ok(())
        };
        let dense_up = match up {
            Some(u) => {
                let d_loss = match u.d_loss {
                    cce_core::DLoss::Scalar(_) if cfg.reduction == Reduction::None => {
                        return Err(CceError::ShapeMismatch {
                            what: "d_loss",
                            expected: format!("per-row [{n}] f32 for reduction none"),
                            got: "a scalar".into(),
                        });
                    }
                    cce_core::DLoss::Scalar(x) => DenseDLoss::Scalar(x),
                    cce_core::DLoss::PerRow(t) => {
                        if cfg.reduction != Reduction::None {
                            return Err(CceError::ShapeMismatch {
                                what: "d_loss",
                                expected: format!("a scalar for reduction {:?}", cfg.reduction),
                                got: format!("{:?}", t.shape()),
                            });
                        }
                        f32_vec(t, "d_loss")?;
                        DenseDLoss::PerRow(t.slice())
                    }
                };
                if let Some(t) = u.d_lse {
                    f32_vec(t, "d_lse")?;
                }
                Some(DenseUpstream {
                    d_loss,
                    d_lse: u.d_lse.map(|t| t.slice()),
                })
            }
            None => None,
        };
        if let Some(sv) = saved {
            f32_vec(sv.lse, "lse")?;
            f32_vec(sv.rest_mass, "rest_mass")?;
        }
        let mut ws = DenseWorkspace::new(self, &cfg)?;
        let inputs = DenseInputs {
            e: call.inputs.e.slice(),
            c: call.inputs.c.slice(),
            bias: call.inputs.bias.map(|b| b.slice()),
            targets: call.classes,
            n_valid: call.n_valid,
        };
        let forward = saved.is_none();
        let backward = up.is_some();
        let mut fwd_t = if forward {
            let loss_shape = if cfg.reduction == Reduction::None {
                vec![n]
            } else {
                vec![]
            };
            Some((
                self.tensor(loss_shape, DType::F32)?,
                self.tensor(vec![n], DType::F32)?,
                self.tensor(vec![n], DType::F32)?,
                if cfg.want_entropy {
                    Some(self.tensor(vec![n], DType::F32)?)
                } else {
                    None
                },
                if cfg.want_argmax {
                    Some(self.tensor(vec![n], DType::I32)?)
                } else {
                    None
                },
            ))
        } else {
            None
        };
        let gdt = cfg.grad_dtype();
        let mut grads_t = if backward {
            Some((
                if cfg.compute_d_e {
                    Some(self.tensor(call.inputs.e.shape().to_vec(), gdt)?)
                } else {
                    None
                },
                if cfg.compute_d_c {
                    Some(self.tensor(vec![v, d], gdt)?)
                } else {
                    None
                },
                if cfg.compute_d_c && cfg.has_bias {
                    Some(self.tensor(vec![v], gdt)?)
                } else {
                    None
                },
            ))
        } else {
            None
        };
        let ws_bytes = ws.bytes() + self.own_bytes();
        let dstats = {
            let mut fo = fwd_t
                .as_mut()
                .map(|(loss, lse, rest, ent, am)| DenseForwardOut {
                    loss: loss.slice_mut(),
                    lse: lse.slice_mut(),
                    rest: rest.slice_mut(),
                    entropy: ent.as_mut().map(|t| t.slice_mut()),
                    argmax: am.as_mut().map(|t| t.slice_mut()),
                });
            let mut go = match grads_t.as_mut() {
                Some((de, dc, db)) => DenseGradOut {
                    d_e: de.as_mut().map(|t| t.slice_mut()),
                    d_c: dc.as_mut().map(|t| t.slice_mut()),
                    d_bias: db.as_mut().map(|t| t.slice_mut()),
                },
                None => DenseGradOut::default(),
            };
            match (&mut fo, saved, dense_up.as_ref()) {
                (Some(fo), None, None) => self.forward(&cfg, &mut ws, &inputs, fo)?,
                (Some(fo), None, Some(u)) => {
                    self.forward_backward(&cfg, &mut ws, &inputs, u, fo, &mut go)?
                }
                (None, Some(sv), Some(u)) => self.backward(
                    &cfg,
                    &mut ws,
                    &inputs,
                    (sv.lse.slice(), sv.rest_mass.slice()),
                    u,
                    &mut go,
                )?,
                _ => {
                    return Err(CceError::InvalidOption {
                        name: "call",
                        reason: "neither forward nor backward".into(),
                    })
                }
            }
        };
        drop(ws);
        let fwd = fwd_t.map(|(loss, lse, rest_mass, entropy, argmax)| -> Result<_> {
            let mut stats = self.base_stats(call, ws_bytes);
            if let Some(note) = &dstats.forward {
                stats.plan_reason = format!("{note}; plan: {}", stats.plan_reason);
            }
            Ok(cce_core::ForwardOutput {
                loss,
                lse,
                rest_mass,
                entropy,
                argmax,
                stats,
            })
        });
        let fwd = fwd.transpose()?;
        let bwd = grads_t.map(|(d_e, d_c, d_bias)| {
            let mut stats = self.base_stats(call, ws_bytes);
            // What ran, before the plan: the sparse backward (or why it gave way), then how
            // the class pass computed G.
            let notes: Vec<&str> = [
                dstats.sparse.as_deref(),
                dstats.row_pass_note.as_deref(),
                dstats.class_pass.as_deref(),
            ]
            .into_iter()
            .flatten()
            .collect();
            if !notes.is_empty() {
                stats.plan_reason = format!("{}; plan: {}", notes.join("; "), stats.plan_reason);
            }
            if dstats.filtered {
                stats.tiles_visited = dstats.tiles_visited;
                stats.tiles_skipped = dstats.tiles_skipped;
                stats.entries_kept = dstats.entries_kept;
                stats.entries_skipped = dstats.entries_skipped;
                stats.dropped_mass_max = dstats.dropped_mass_max;
                stats.dropped_mass_mean = dstats.dropped_mass_mean;
            } else {
                // Nothing skipped: every tile and entry of both filtered products was computed.
                let passes =
                    call.plan.filter.filter_e_grad as u64 + call.plan.filter.filter_c_grad as u64;
                stats.tiles_visited = passes * stats.tiles_total;
                stats.entries_kept = passes * call.n_valid as u64 * v as u64;
            }
            cce_core::BackwardOutput {
                d_e,
                d_c,
                d_bias,
                stats,
            }
        });
        Ok((fwd, bwd))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cce_core::{DeviceLimits, Options, Plan, Problem, StrategyKind, TileShape};

    /// Split dense's configuration as `cce_bench_dense` plans it (limits of `cuda_limits`), or
    /// with its chunks capped like `CudaBackend::with_chunk_cap` (the conformance tests).
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
        let mut plan = Plan::new(&problem, opts, &limits).unwrap();
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
                        check_layout(&cfg, cfg.scratch_bytes());
                        seen += 1;
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
}
