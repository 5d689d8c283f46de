//! The CUDA backend: device discovery, input validation and the plan; every call runs the
//! dense strategies of [`crate::dense`] ([`cce_core::Strategy::ChunkedDense`],
//! [`cce_core::Strategy::SplitDense`]), which need libcublas and compute capability 8.0
//! (a device without them is [`CceError::Unsupported`]).
//!
//! Strategy choice (the plan takes the first that fits the budget, in this order):
//! - chunked dense (3 GEMMs; an f32 `d_c` accumulator of `4·V·D` bytes, or the f32 `d_c`
//!   output itself when f32 gradients are asked) for exact bf16 / f32 calls: its products use
//!   `G` rounded to the input dtype, as a materialized computation does (bf16 inputs with f32
//!   gradients, where the row chunks hold at least 256 rows of f32 logits: where its WGMMA row
//!   pass writes f16 `G` for `d_c` against an f16 copy of each chunk's `e`; elsewhere split
//!   dense, unless [`CudaSwitches::chunked_f32_grads`] allows bf16 `G`; bf16 gradients within a
//!   budget that holds no f32 accumulator: with [`CudaSwitches::dc_in_grad_dtype`], `d_c`
//!   accumulated in the bf16 output); its row pass through the WGMMA epilogue keeps 16-bit `q`
//!   and fits about twice the plan's rows per chunk;
//! - split dense (cuBLAS, 4 GEMMs, no cross-chunk accumulator, so it fits the default 512 MiB
//!   at every shape of PERFORMANCE.md), filtered or exact, every dtype: `d_c` from f16 `G`,
//!   `d_e` from f16 `G` when the budget holds an f16 copy of `c` (else bf16 `G`); filtered
//!   calls (filter on both gradients, no label smoothing, not deterministic) first try the
//!   plan's sparse backward ([`cce_core::SparseBackward`], [`SparseMode`] to force or disable
//!   it), which gives way to the dense passes on data that keeps many entries per row.
//!
//! A budget too small for one tile of split dense's chunks is `ResourceLimit` (the plan's
//! reason lists what each strategy would need).

/// Launch a kernel: `launch!(self, "symbol", cfg, arg, ...)` with every argument a value that
/// implements `DeviceRepr` (pointers are passed as `u64`). Must be used inside `unsafe`.
macro_rules! launch {
    ($self:expr, $name:expr, $cfg:expr, $($arg:expr),+ $(,)?) => {{
        let f = $self.func($name)?;
        $self
            .stream
            .launch_builder(f)
            $(.arg(&$arg))+
            .launch($cfg)
            .map(|_| ())
            .map_err(drv)
    }};
}

mod checks;
mod construct;
mod into;
mod run;
mod shard_rows;
mod status;

pub use into::{ForwardInto, GradsInto};
pub(crate) use status::STATS_OFFSET;
pub use status::{Checks, DeviceReport, FilterCounts};

use crate::dense::{BackendCall, DenseEngine};

use crate::kernels;

use crate::switches::CudaSwitches;

use crate::tensor::CudaTensor;

use cce_core::{
    Backend, BackwardOutput, CallStats, CceError, DLoss, DType, DeviceLimits, ForwardOutput,
    HostTensor, Inputs, Options, Plan, Problem, Result, Saved, StrategyKind, TensorMeta, Upstream,
};

use cudarc::driver::sys::{CUdevice_attribute, CUresult};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DriverError,
    LaunchConfig, PushKernelArg,
};

use std::collections::HashMap;

use std::sync::atomic::AtomicBool;

use std::sync::{Arc, OnceLock};

const BACKEND: &str = "cuda";

/// Rows per logits tile (kernels/common.cuh `TILE_M`).
pub const TILE_ROWS: usize = 128;

/// Classes per logits tile (`TILE_N`).
pub const TILE_CLASSES: usize = 128;

/// Threads per block of the data generators (`util.cu`).
pub(crate) const NTHREADS: u32 = 256;

/// Map a driver error to the typed error (`OutOfMemory` keeps the requested size).
fn drv(e: DriverError) -> CceError {
    CceError::backend(BACKEND, e)
}

fn alloc_err(e: DriverError, bytes: usize) -> CceError {
    if e.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        CceError::OutOfMemory {
            backend: BACKEND,
            requested_bytes: bytes as u64,
        }
    } else {
        drv(e)
    }
}

/// Check, without touching CUDA beyond loading libraries, that a CUDA device can be used:
/// libcuda and libnvrtc load and at least one device is visible. `Err(NoDevice)` says why.
pub fn probe() -> Result<usize> {
    let no = |reason: String| CceError::NoDevice {
        backend: BACKEND,
        reason,
    };
    if !crate::libs::present("cuda") {
        return Err(no(
            "the CUDA driver library (libcuda.so) could not be loaded: no NVIDIA driver".into(),
        ));
    }
    kernels::nvrtc_available().map_err(no)?;
    let count = CudaContext::device_count()
        .map_err(|e| no(format!("the CUDA driver reports no usable device ({e:?})")))?;
    if count <= 0 {
        return Err(no("the CUDA driver sees 0 devices".into()));
    }
    Ok(count as usize)
}

/// How a filtered split-dense call uses the plan's [`cce_core::SparseBackward`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum SparseMode {
    /// As planned: tried first, the dense passes when it does not pay or does not fit.
    #[default]
    Auto,
    /// Never: the dense passes (benchmarks of the dense path with the filter on).
    Off,
    /// At any density: gives way only when the pairs do not fit (tests on small shapes,
    /// where every row keeps more than `V / 256` entries).
    Always,
    /// As [`SparseMode::Auto`], and the backend remembers a try that gave way: the next calls
    /// of the same key (shape, dtype, bias, softcap, filter) are planned as the exact call
    /// (no probe, chunked dense where the budget holds it; `dense/sparse_memory.rs`), which
    /// spares them the probe's cost on data where the sparse backward does not pay. Opt-in:
    /// consecutive calls of one key then take different paths, so their gradients differ at
    /// the gradient dtype's rounding (a run is not bitwise repeatable, and a captured CUDA
    /// graph may hold another path than the eager calls around it).
    Remember,
}

/// The CUDA backend (module docs of the crate).
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    _module: Arc<CudaModule>,
    funcs: HashMap<&'static str, CudaFunction>,
    limits: DeviceLimits,
    sm_count: usize,
    arch: String,
    /// Compute capability (major, minor).
    cc: (i32, i32),
    /// The chunked-dense engine (cuBLAS handle, its kernels), made on first use.
    dense: OnceLock<DenseEngine>,
    /// Test knob: cap of the dense strategies' chunks (rows, classes).
    chunk_cap: Option<(usize, usize)>,
    /// Test knob: false forces split dense's `d_e` onto bf16 `G` (what a tight budget does).
    split_de_f16: bool,
    /// Knob: chunked dense for exact f32 gradients of bf16 inputs ([`CudaSwitches::chunked_f32_grads`]).
    chunked_f32_grads: bool,
    /// Knob: `d_c` accumulated in the gradient dtype ([`CudaSwitches::dc_in_grad_dtype`]).
    dc_in_grad_dtype: bool,
    /// Test and bench knob: how the plan's sparse backward is used.
    sparse: SparseMode,
    /// Forward-only dense calls take the fused WGMMA forward where it applies.
    wgmma_forward: bool,
    /// Split dense's class pass takes the WGMMA `G` epilogue where it applies.
    wgmma_gcols: bool,
    wgmma_rows: bool,
    /// The dense engine's profiling and sparse-backward tuning ([`CudaSwitches`]).
    engine_switches: CudaSwitches,
    /// Strategies this device supports (`limits.strategies` is the chosen subset).
    available: Vec<StrategyKind>,
    /// The device status (`status.rs`): each call's checks and counts, the first error.
    status: CudaSlice<u8>,
    /// When the device status reaches the host.
    checks: Checks,
    /// The last call wrote filter counts into the status.
    last_filtered: AtomicBool,
    /// What the last sparse try of each call key did (recorded by the dense engine): a
    /// filtered call whose last try gave way is planned as the exact call.
    sparse_memory: Arc<std::sync::Mutex<crate::dense::sparse_memory::SparseMemory>>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("device", &self.limits.name)
            .field("arch", &self.arch)
            .field("sm_count", &self.sm_count)
            .finish()
    }
}

fn cfg(grid: (u32, u32, u32), block: u32, smem: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: smem,
    }
}

/// A call's validated inputs: problem, plan, and the targets prepared on the device.
struct Prepared {
    problem: Problem,
    plan: Plan,
    /// The plan (and options) the call switches to when its sparse backward gives way
    /// (`crate::dense::schedule::give_way_plan`).
    give_way: Option<(Plan, Options)>,
    /// i32 `[N]`: each row's class, −1 when ignored (`kernels/prepare.cu`).
    classes: CudaSlice<u8>,
    /// f32 `[N]`: a scalar upstream `d_loss` spread over the rows (scaled by the mean's
    /// count of valid rows on the device); `None` without a backward or with per-row `d_loss`.
    dl: Option<CudaSlice<u8>>,
    /// Rows with a valid target, when the status was read ([`Checks::Eager`]).
    n_valid: Option<usize>,
}
