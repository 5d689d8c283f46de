//! [`cce_core::Strategy::ChunkedDense`] and [`cce_core::Strategy::SplitDense`] on CUDA:
//! materialized f32 logits chunks, cuBLAS for the products, custom row kernels
//! (`kernels/dense_common.cu` and the files after it, [`KERNEL_SOURCE`]) for everything
//! between them.
//!
//! Split dense runs a row pass (steps 1-4 below per row chunk, with `G` for `d_e` in f16
//! scaled per row against an f16 copy of `c` when [`DenseConfig::de_f16`], else in the input
//! dtype) and then a class pass per chunk of classes over all rows (logits recomputed, `G` from
//! the saved lse in f16 with one power-of-two scale, `d_c` rows complete against an f16 copy of
//! `e`); see `classes.cu` "Split dense". The power-of-two scales of those f16 operands stay
//! on the device (`cce_split_scales_*` then `cce_split_scales_finish` into the workspace's
//! `scales` region, `scales.rs` `ScaleSet`): the kernels read them through pointers and the
//! `d_c` GEMM its alpha in cuBLAS's device pointer mode, so they cost no host sync. On Hopper
//! the class pass's logits and `G` are one WGMMA kernel whose epilogue writes `G` from the
//! registers (`wgmma.cu` `cce_wgmma_gcols[_cap]_*`, `schedule::wgmma_gcols_classes`);
//! elsewhere a cuBLAS logits GEMM then `cce_split_gcols_*`. On Hopper, a forward-and-backward
//! call with bf16 inputs and bf16 `G` for `d_e` also runs its row pass without f32 logits
//! (steps 1+2+3' below: `wgmma_rows.cu`, `schedule::wgmma_rows_unfit`). Its dense passes skip
//! nothing when the filter is on.
//!
//! Filtered split-dense calls first try the plan's [`cce_core::SparseBackward`]
//! ([`DenseEngine`]'s `sparse_backward`; `sparse.cu` "Sparse backward"): per row chunk the
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
//! Chunked dense with f32 gradients of bf16 inputs (the `d_c` output is the accumulator):
//! where the WGMMA row pass runs (`DenseConfig::row_e16`, `Schedule::row_g16`), each chunk's
//! `G` pass writes f16 `G · 2^kg` instead of bf16, beside an f16 copy of the chunk's rows of
//! `e` times `2^ke` (both powers of two from the chunk's maxima: `scales.rs`' `RowChunk` set,
//! on the device); step 5 is then an f16 x f16 → f32 GEMM with alpha `2^(−ke−kg)` and the
//! `d_bias` sums read f16 `G`; then `cce_g16_to_bf16` turns `G` into bf16 in place for step 4
//! and its target fix. `d_c` thus gets split dense's 11 significand bits (on the shipped real
//! rows 0.021% against bf16 `G`'s 0.13%; docs/perf-log.md session 18). Its entries keep q's
//! rounding, so that path stores q as its q9 code (`wgmma.cu` `q9_code`: 2⁻¹⁰ relative, f32's
//! range; `cce_wgmma_lseq[_x]_q9_bf16`, `cce_wgmma_qrows_g[_cap]_q9_bf16`) instead of bf16.
//!
//! Forward only, on compute capability 9.0 with bf16 / f16 inputs, no label smoothing, entropy
//! or argmax and `D` a multiple of 64 (bias and softcap in the epilogue: `cce_wgmma_lse_x_*`) (`schedule::wgmma_forward_rows`;
//! switch: [`DenseConfig::wgmma_forward`], [`crate::CudaSwitches::wgmma_forward`]), is one fused kernel instead
//! of steps 1-2: `cce_wgmma_lse_*` (`kernels/wgmma.cu`), a persistent TMA + WGMMA GEMM whose
//! epilogue reduces each 128 x 256 tile of logits to per-row (max, Σexp) partials (8 bytes per
//! row and 256 classes in the scratch; the logits never reach memory), then
//! `cce_wgmma_lse_combine_*` per row (lse and the loss, the target logit from the same
//! epilogue: the one thread holding its column writes it), in row groups when the partials of all rows do not fit the scratch (a
//! forward-only call of the backend has at most [`FORWARD_WORKSPACE_CAP`] of workspace:
//! `budget::forward_group_rows` evens the groups out, 4 of 8192 rows at N 32768, V 256000). It
//! measured 0.97-1.0x one cuBLAS logits GEMM at N 32768, D 4096, V 256000 (bf16, H200;
//! `benches/wgmma/NOTES.md`). Elsewhere forward only is steps 1-2,
//! over the plan's [`cce_core::ClassForward`] tiles when it has them
//! (all rows x a chunk of classes per GEMM, two buffers, the row reductions `cce_cls_fwd_*` on
//! a second stream folding each tile into a running lse state; `forward.cu` "(2')"); a
//! backward from a saved lse is 1, 3, 4, 5 (it recomputes the logits: 4 GEMMs with the
//! forward). [`DenseEngine::forward_backward`] runs 3 GEMMs.
//!
//! `G` overwrites the logits chunk in place (16-bit `G` has the row stride `2·ld`), so the
//! workspace is the plan's `chunk_rows · V · 4` bytes plus the f32 `d_c` accumulator. The
//! backend plans within the budget less the cuBLAS workspace ([`CUBLAS_WORKSPACE_BYTES`],
//! [`plan_budget`]), so that a call's reported workspace, both together, stays within
//! it; a forward-only call takes no gradient buffers and fits its scratch within
//! [`FORWARD_WORKSPACE_CAP`] ([`DenseConfig::forward_only`]).
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
//! as `cd − cp·rest − cc` (`dense_common.cu` `g_target`) instead of `e^{z_y − lse} − 1`, which
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
//! Accumulation ([`DenseGradOut::accumulate`], f32 gradients only): every product adds to the
//! outputs' contents instead of overwriting them. Chunked dense's `d_c` GEMM runs with beta = 1
//! from its first chunk and its `d_bias` output is not zeroed (`cce_dense_colsum_*` adds); the
//! `d_e` GEMM of every row chunk runs with beta = 1 (the 16-bit target fix adds in any case),
//! and split dense's `d_e` from f16 `G` (f32 rows, then scaled) is finished with `+=`
//! (`cce_split_de_finish_*`'s `accumulate`); split dense's class pass's `d_c` GEMMs read
//! beta = 1 (on the host, or the scale set's `1.0` word in device pointer mode) and its
//! `d_bias` colsum adds to the unzeroed output. The sparse backward, whose gather kernels
//! write the gradients, is not tried (`schedule::sparse_accumulate_note`).
//!
//! Everything is deterministic: fixed reduction trees, cuBLAS with a fixed workspace (cuBLAS
//! GEMMs are run-to-run deterministic on one device and stream unless split-K atomics are
//! chosen, which cuBLAS does not do by default), the d_c accumulation in chunk order.
//!
//! ## Code layout
//! | file | what |
//! |---|---|
//! | `budget.rs` | the budget's decisions: the plan's share beside the cuBLAS workspace, the forward-only cap and the sizes within it |
//! | `schedule.rs` | every decision of a call from plain data (no CUDA call): the plan and its adjustments, which forward, row pass, class pass, sparse or dense backward, each fallback's reason string |
//! | `exec.rs` | the executor: buffer checks, the schedule, then the passes in order |
//! | `config.rs`, `workspace.rs` | [`DenseConfig`], the scratch layouts and byte tallies, [`DenseWorkspace`] |
//! | `row_pass.rs` | the row chunks: forward rows, `G` in place, `d_e`, chunked dense's `d_c` |
//! | `class_pass.rs` | split dense's class pass |
//! | `sparse.rs` | the sparse backward |
//! | `staircase.rs`, `staircase/` | the staircase backward's device steps (orders, kept tiles, gathers, scatters): decisions and host twins; `launch.rs` on addresses, `checked.rs` on checked buffers |
//! | `stair_pass.rs` | the staircase forward-and-backward of a filtered call (behind `CudaSwitches::staircase`) |
//! | `forward.rs` | forward-only passes: the fused WGMMA forward, the class tiles |
//! | `wgmma.rs` | the WGMMA launches and their TMA tensor maps |
//! | `scales.rs` | scales, f16 copies, conversions, test data |
//! | `launch.rs` | errors, cuBLAS GEMMs, typed kernel parameters and their one launch function, the profile timer |
//! | `glue.rs` | `Backend`-trait calls of [`crate::CudaBackend`] |

mod budget;
mod call_plan;
mod class_pass;
mod config;
mod exec;
mod forward;
mod glue;
mod launch;
mod pool;
mod row_pass;
mod scales;
pub(crate) mod schedule;
mod sparse;
pub(crate) mod sparse_memory;
mod stair_pass;
pub mod staircase;
mod wgmma;
mod workspace;

pub use budget::plan_budget;
pub use call_plan::dc_in_grad_dtype;
pub use config::{
    DenseConfig, PathSwitches, RowPass, CLUSTER_SIZES, FORWARD_WORKSPACE_CAP,
    WGMMA_FORWARD_DEFAULT, WGMMA_GCOLS_DEFAULT, WGMMA_ROWS_DEFAULT, WGMMA_ROWS_SOFTCAP_MIN,
    WGMMA_SOFTCAP_MAX,
};
pub(crate) use glue::{workspace_bytes, BackendCall};
pub use launch::{GemmScalars, CUBLAS_WORKSPACE_BYTES};
pub use workspace::DenseWorkspace;
pub(crate) use workspace::GColsLayout;

use class_pass::*;
use exec::*;
use launch::*;
use row_pass::*;
use scales::*;
use sparse::*;
use wgmma::*;

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

/// The kernel source: the dense kernel files in order (`kernels/dense_common.cu`, `forward.cu`,
/// `rows.cu`, `classes.cu`, `dense_util.cu`, `sparse.cu`, `sparse_gather.cu`, `staircase.cu`), then
/// `kernels/wgmma.cu` (the WGMMA GEMMs) and `kernels/wgmma_rows.cu` (their dense row pass),
/// compiled only for sm_90a; one NVRTC module.
pub const KERNEL_SOURCE: &str = concat!(
    include_str!("../../kernels/dense_common.cu"),
    include_str!("../../kernels/forward.cu"),
    include_str!("../../kernels/rows.cu"),
    include_str!("../../kernels/classes.cu"),
    include_str!("../../kernels/dense_util.cu"),
    include_str!("../../kernels/sparse.cu"),
    include_str!("../../kernels/sparse_gather.cu"),
    include_str!("../../kernels/staircase.cu"),
    include_str!("../../kernels/wgmma.cu"),
    include_str!("../../kernels/wgmma_rows.cu")
);

pub use crate::device::{arch_of, compile_options};

/// This module's source for the process caches of [`crate::device`].
pub(crate) const SOURCE: crate::device::Source = crate::device::Source {
    tag: "cce-dense",
    text: || KERNEL_SOURCE.to_string(),
};

/// Compile [`KERNEL_SOURCE`] (the dense kernel files + `wgmma.cu`) for `arch` to a CUBIN with NVRTC, through the process and
/// disk caches ([`crate::device`]). Errors: `NoDevice` when libnvrtc cannot be loaded,
/// `Backend` with the compiler log when the source does not compile.
pub fn compile_cubin(arch: &str) -> Result<Vec<u8>> {
    Ok(crate::device::compile_cached(SOURCE, arch)?.to_vec())
}

/// Compile without the cache. Returns the CUBIN.
pub fn compile_uncached(source: &str, options: &[String]) -> Result<Vec<u8>> {
    crate::device::nvrtc_compile(source, "dense.cu", options)
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
    /// Rows with a class (used when `device_status` is 0).
    pub n_valid: usize,
    /// Device address of the backend's status buffer (`kernels/prepare.cu`), or 0. When set,
    /// a mean's count of valid rows is read there on the device, and the filter statistics
    /// are written there instead of being read back ([`DenseStats::stats_on_device`]).
    pub device_status: u64,
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
    /// Add the gradients to the outputs' contents instead of overwriting them (f32 gradients
    /// only, [`DenseConfig::grad_f32`], else `InvalidOption`): every product runs with
    /// beta = 1, `d_bias` is not zeroed first, the sparse backward is not tried.
    pub accumulate: bool,
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
    /// The filter's counts went to the status buffer ([`DenseInputs::device_status`]): the
    /// count fields below are 0 and the backend reads the counts there.
    pub stats_on_device: bool,
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
    /// The sparse backward gave way and the call stopped there
    /// ([`DenseConfig::stop_on_give_way`]): nothing it wrote is an output.
    pub gave_way_stop: bool,
}

/// The compiled kernels, the cuBLAS handle and its workspace, on one stream.
pub struct DenseEngine {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// cuBLAS handle and workspace, lent by the per-context pool ([`crate::device`]).
    blas: crate::device::PooledBlas,
    funcs: HashMap<String, CudaFunction>,
    arch: String,
    /// What the device offers the schedule (compute capability, multiprocessors, shared
    /// memory); the WGMMA kernels are loaded where [`schedule::DeviceFacts::wgmma`] holds.
    facts: schedule::DeviceFacts,
    /// The second stream of class-tiled forwards (made on first use, highest priority so that
    /// its row reductions get multiprocessors as the GEMM's blocks retire).
    row_stream: std::sync::OnceLock<Arc<CudaStream>>,
    /// Profiling and the sparse backward's tuning ([`DenseEngine::with_switches`]).
    switches: crate::CudaSwitches,
    /// Where each sparse try's outcome is recorded (shared with the backend, which plans the
    /// next call from it: [`sparse_memory`]).
    sparse_memory: Arc<std::sync::Mutex<sparse_memory::SparseMemory>>,
    /// The workspace's memory pool ([`pool`]), made by the first call that uses it; `None`
    /// inside where the device has no stream-ordered allocator (the stream's pool is used).
    pool: std::sync::OnceLock<Option<pool::WorkspacePool>>,
}

impl std::fmt::Debug for DenseEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DenseEngine")
            .field("arch", &self.arch)
            .field("kernels", &self.funcs.len())
            .finish()
    }
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
        let max_smem_optin = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(drv)? as usize;
        let sm_count = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(drv)? as usize;
        let mut facts = schedule::DeviceFacts {
            major,
            minor,
            sm_count,
            max_smem_optin,
            fused_static_smem: 0,
        };
        let mut funcs = HashMap::new();
        for n in kernel_names(&facts) {
            let f = module.load_function(&n).map_err(drv)?;
            funcs.insert(n, f);
        }
        facts.fused_static_smem = set_attributes(&funcs, max_smem_optin)?;
        let blas = crate::device::pooled_blas(&stream, CUBLAS_WORKSPACE_BYTES)?;
        Ok(Self {
            ctx,
            stream,
            blas,
            funcs,
            arch,
            facts,
            row_stream: std::sync::OnceLock::new(),
            switches: crate::CudaSwitches::default(),
            sparse_memory: Default::default(),
            pool: std::sync::OnceLock::new(),
        })
    }

    /// Cluster size and slice (columns per block) of the fused row kernel for `cfg`, or `None`
    /// when it does not apply (not asked, not Hopper, or the row does not fit 16 blocks'
    /// shared memory).
    pub fn fused_layout(&self, cfg: &DenseConfig) -> Option<(usize, usize)> {
        schedule::fused_layout(cfg, &self.facts)
    }

    /// The engine with `switches`' profiling and sparse-backward tuning
    /// ([`crate::CudaSwitches::profile`], `sparse_select_threads`, `sparse_fold_forward`); the
    /// path switches reach the engine through [`DenseConfig`].
    pub fn with_switches(mut self, switches: crate::CudaSwitches) -> Self {
        self.switches = switches;
        self
    }

    /// `bytes` of uninitialized workspace memory on the engine's stream: from the engine's pool
    /// ([`pool`], made on first use) with [`crate::CudaSwitches::keep_workspace`] outside a
    /// CUDA graph capture, else from the stream's.
    pub(super) fn alloc_workspace(&self, bytes: usize) -> Result<CudaSlice<u8>> {
        let own = if self.switches.keep_workspace && !self.capturing()? {
            if self.pool.get().is_none() {
                // A concurrent first call may have set it; either pool is equivalent.
                let _ = self.pool.set(pool::WorkspacePool::new(&self.ctx)?);
            }
            self.pool.get().and_then(Option::as_ref)
        } else {
            None
        };
        match own {
            Some(p) => p.alloc(&self.stream, bytes),
            // SAFETY: the caller writes every byte before reading it (DenseWorkspace::new).
            None => unsafe { self.stream.alloc::<u8>(bytes) },
        }
        .map_err(|e| alloc_err(e, bytes))
    }

    /// The engine recording its sparse tries' outcomes into `memory` (the backend's, which
    /// plans the next calls from it).
    pub(crate) fn with_sparse_memory(
        mut self,
        memory: Arc<std::sync::Mutex<sparse_memory::SparseMemory>>,
    ) -> Self {
        self.sparse_memory = memory;
        self
    }

    /// Record a sparse try of `cfg`'s key: `gave_way` when it gave way to the dense passes.
    pub(crate) fn record_sparse(&self, cfg: &DenseConfig, gave_way: bool) {
        let key = sparse_memory::SparseKey::new(
            (cfg.n, cfg.d, cfg.v),
            cfg.dtype,
            cfg.has_bias,
            cfg.softcap,
            &cfg.filter,
        );
        // A poisoned lock (a panic while recording) only loses the history.
        if let Ok(mut m) = self.sparse_memory.lock() {
            m.record(key, gave_way);
        }
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
}

/// The kernels the engine loads on a device of `facts`: every dtype's row, class-pass, sparse
/// and utility kernels; the cluster-fused row kernels from compute capability 9.0; the WGMMA
/// kernels where [`schedule::DeviceFacts::wgmma`] holds (compiled for sm_90a only:
/// `wgmma.cu` uses wgmma, setmaxnreg and TMA).
fn kernel_names(facts: &schedule::DeviceFacts) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for dt in ["f32", "f16", "bf16"] {
        for k in [
            "cce_dense_fwd",
            "cce_cls_fwd",
            "cce_dense_bwd",
            "cce_dense_colsum",
            "cce_dense_randn",
            "cce_split_scales",
            "cce_split_gcols",
            "cce_split_de_finish",
            "cce_sparse_select",
            "cce_stair_col_sums",
            "cce_stair_class_keys",
            "cce_stair_scatter_rows",
        ] {
            names.push(format!("{k}_{dt}"));
        }
        names.push(format!("cce_sparse_select_{dt}_t256"));
        names.push(format!("cce_sparse_select_fwd_{dt}"));
        if dt != "f32" {
            names.push(format!("cce_dense_target_fix_{dt}"));
        }
        let vec = if dt == "f32" { 4 } else { 8 };
        for out in [dt, "f32"] {
            for v in [1, vec] {
                for tail in ["", "_b32", "_l", "_h"] {
                    names.push(format!("cce_sparse_gather_{dt}_{out}_v{v}{tail}"));
                }
            }
        }
        if facts.fused_kernels() {
            for cs in CLUSTER_SIZES {
                names.push(format!("cce_dense_fused_{dt}_c{cs}"));
            }
        }
    }
    if facts.wgmma() {
        for dt in ["f16", "bf16"] {
            for k in [
                "cce_wgmma_lse",
                "cce_wgmma_lse_combine",
                "cce_wgmma_lse_x",
                "cce_wgmma_gcols",
                "cce_wgmma_gcols_cap",
            ] {
                names.push(format!("{k}_{dt}"));
            }
        }
        for n in [
            "cce_wgmma_lseq_bf16",
            "cce_wgmma_lseq_x_bf16",
            "cce_wgmma_qrows_g_bf16",
            "cce_wgmma_qrows_g_cap_bf16",
            "cce_wgmma_lseq_q9_bf16",
            "cce_wgmma_lseq_x_q9_bf16",
            "cce_wgmma_qrows_g_q9_bf16",
            "cce_wgmma_qrows_g_cap_q9_bf16",
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
        "cce_split_scales_finish",
        "cce_g16_to_bf16",
        "cce_dense_bwd_f16s_f16",
        "cce_dense_bwd_f16s_bf16",
        "cce_sparse_count",
        "cce_sparse_tile_sums",
        "cce_sparse_scan_tiles",
        "cce_sparse_scatter",
        "cce_stair_mean",
        "cce_stair_row_keys",
        "cce_stair_bitonic_local",
        "cce_stair_bitonic_step",
        "cce_stair_perm",
        "cce_stair_kept_rows",
        "cce_stair_chunk_rows",
        "cce_stair_place_tiles",
        "cce_stair_gather_u32",
        "cce_stair_gather_u16",
        "cce_stair_map_targets",
        "cce_stair_gather_rows16",
    ] {
        names.push(n.into());
    }
    names
}

/// Set the loaded kernels' shared-memory attributes: the WGMMA kernels' dynamic shared memory,
/// the fused row kernels' (all the device allows beside their static shared memory; clusters
/// of 16 blocks allowed). Returns the fused kernels' largest static shared memory (0 without
/// them).
fn set_attributes(funcs: &HashMap<String, CudaFunction>, max_smem_optin: usize) -> Result<usize> {
    let dyn_smem = CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
    let mut fused_static_smem = 0usize;
    for (name, f) in funcs {
        if name.starts_with("cce_wgmma_lse_") && !name.starts_with("cce_wgmma_lse_combine_") {
            f.set_attribute(dyn_smem, WGMMA_SMEM_BYTES as i32)
                .map_err(drv)?;
        }
        if name.starts_with("cce_wgmma_gcols_") || name.starts_with("cce_wgmma_lseq_") {
            f.set_attribute(dyn_smem, WGMMA_SMEM_OUT_BYTES as i32)
                .map_err(drv)?;
        }
        if name.starts_with("cce_dense_fused_") {
            let st = f
                .get_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
                .map_err(drv)? as usize;
            fused_static_smem = fused_static_smem.max(st);
            f.set_attribute(dyn_smem, (max_smem_optin - st) as i32)
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
    Ok(fused_static_smem)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel of [`KERNEL_SOURCE`] (`extern "C" __global__` functions written out by
    /// name) is loaded on an H200: a kernel missing
    /// from [`kernel_names`] fails only when a call first asks for it, on the device.
    #[test]
    fn every_kernel_of_the_source_is_loaded_on_hopper() {
        let h200 = schedule::DeviceFacts {
            major: 9,
            minor: 0,
            sm_count: 132,
            max_smem_optin: 227 << 10,
            fused_static_smem: 0,
        };
        let names = kernel_names(&h200);
        let mut missing = Vec::new();
        for part in KERNEL_SOURCE.split("extern \"C\" __global__").skip(1) {
            // `void [__launch_bounds__(...)] NAME(`: the identifier before the first '(' that
            // follows the launch bounds.
            let mut head = part.trim_start().trim_start_matches("void").trim_start();
            while let Some(rest) = ["__launch_bounds__(", "__cluster_dims__("]
                .iter()
                .find_map(|a| head.strip_prefix(a))
            {
                head = rest[rest.find(')').unwrap() + 1..].trim_start();
            }
            let name: String = head
                .trim_start()
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            // Names built by macros (a parameter in capitals, or ending in `##`) are not in
            // the text whole.
            let macro_name = name.chars().all(|c| c.is_ascii_uppercase() || c == '_');
            if name.is_empty() || macro_name || head.trim_start()[name.len()..].starts_with("##") {
                continue;
            }
            if !names.iter().any(|n| n == &name) {
                missing.push(name);
            }
        }
        assert!(missing.is_empty(), "not in kernel_names: {missing:?}");
    }
}
