//! The CUDA backend: device discovery, kernel module, and the forward / backward passes of
//! [`cce_core::Strategy::TileOwnership`]; calls whose plan is
//! [`cce_core::Strategy::ChunkedDense`] or [`cce_core::Strategy::SplitDense`] go to
//! [`crate::chunked`].
//!
//! Strategy choice (the plan takes the first that fits the budget, in this order):
//! - chunked dense (cuBLAS, 3 GEMMs, an f32 `d_c` accumulator of `4·V·D` bytes) for exact
//!   bf16 / f32 calls: its products use `G` rounded to the input dtype, as a materialized
//!   computation does;
//! - split dense (cuBLAS, 4 GEMMs, no cross-chunk accumulator, so it fits the default 512 MiB
//!   at every shape of PERFORMANCE.md), filtered or exact, every dtype: `d_c` from f16 `G`,
//!   `d_e` from f16 `G` when the budget holds an f16 copy of `c` (else bf16 `G`); filtered
//!   calls (filter on both gradients, no label smoothing, not deterministic) first try the
//!   plan's sparse backward ([`cce_core::SparseBackward`], [`SparseMode`] to force or disable
//!   it), which gives way to the dense passes on data that keeps many entries per row;
//! - tile ownership otherwise (or without libcublas / compute capability 8.0).

use crate::chunked::{BackendCall, DenseEngine};
use crate::kernels;
use crate::switches::CudaSwitches;
use crate::tensor::CudaTensor;
use cce_core::filter::N_BINS;
use cce_core::plan::Pass;
use cce_core::{
    Backend, BackwardOutput, CallStats, CceError, DLoss, DType, DeviceLimits, ForwardOutput,
    GradDType, HostTensor, Inputs, Options, Plan, PreparedTargets, Problem, Reduction, Result,
    Saved, Strategy, StrategyKind, TensorMeta, TileShape, Upstream,
};
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute, CUresult};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DriverError,
    LaunchConfig, PushKernelArg,
};
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

const BACKEND: &str = "cuda";
/// Rows per logits tile (kernels/common.cuh `TILE_M`).
pub const TILE_ROWS: usize = 128;
/// Classes per logits tile (`TILE_N`).
pub const TILE_CLASSES: usize = 128;
/// Threads per block of the tile kernels (`NTHREADS`).
const NTHREADS: u32 = 256;
/// Shared memory of the logits staging (`LOGITS_SMEM_BYTES`: 3 stages of two 128 x 80-byte
/// slices).
const LOGITS_SMEM: u32 = 2 * 3 * 128 * 80;
const HIST_SMEM: u32 = LOGITS_SMEM + (128 * N_BINS as u32 + N_BINS as u32) * 4;

/// Shared bytes of one 128 x 128 operand tile of the backward's second product.
fn xs_bytes(dtype: DType) -> u32 {
    match dtype {
        DType::F32 => 128 * 132 * 4,
        _ => 128 * 136 * 2,
    }
}

/// G tile(s) (`g_bytes`: hi and lo tiles for the 16-bit types) + the region shared by the
/// logits stages and the two B slices (`x_region_bytes`).
fn de_smem(dtype: DType) -> u32 {
    let g = if dtype == DType::F32 { 1 } else { 2 } * xs_bytes(dtype);
    g + (2 * xs_bytes(dtype)).max(LOGITS_SMEM)
}

fn dc_smem(dtype: DType) -> u32 {
    de_smem(dtype) + 2 * 128 * 4
}

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
    /// The chunked-dense engine (cuBLAS handle, its kernels), made on first use.
    dense: OnceLock<DenseEngine>,
    /// Test knob: cap of the dense strategies' chunks (rows, classes).
    chunk_cap: Option<(usize, usize)>,
    /// Test knob: false forces split dense's `d_e` onto bf16 `G` (what a tight budget does).
    split_de_f16: bool,
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

/// Zero pointer for optional (nullable) kernel arguments.
const NULL: u64 = 0;

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

fn cfg(grid: (u32, u32, u32), block: u32, smem: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: smem,
    }
}

fn blocks_for(n: usize, per: usize) -> Result<u32> {
    let b = n.div_ceil(per).max(1);
    u32::try_from(b).map_err(|_| CceError::ResourceLimit {
        resource: "CUDA grid blocks".into(),
        requested: b as u64,
        max: u32::MAX as u64,
    })
}

/// Pick the number of splits of a tile loop for `units` independent blocks so that
/// `units · splits` blocks fill `sm` multiprocessors with the least makespan
/// (`ceil(blocks / sm) · (ceil(tiles / splits) + 2)` tile steps: two steps of overhead per
/// block for its prologue and epilogue), at most `max_splits`.
/// Returns `(splits, tiles_per_split)`.
pub fn choose_splits(units: usize, tiles: usize, sm: usize, max_splits: usize) -> (usize, usize) {
    let max_s = max_splits.min(tiles).clamp(1, 65535);
    let mut best = (u128::MAX, 1usize);
    for s in 1..=max_s {
        let tps = tiles.div_ceil(s);
        let s_eff = tiles.div_ceil(tps);
        let waves = (units * s_eff).div_ceil(sm.max(1));
        let cost = waves as u128 * (tps as u128 + 2);
        if cost < best.0 {
            best = (cost, s_eff);
        }
    }
    let s = best.1;
    (s, tiles.div_ceil(s))
}

fn u64s(bytes: &[u8]) -> Vec<u64> {
    bytes
        .chunks_exact(8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
        .collect()
}

/// A call's validated inputs: problem, plan, prepared targets and their device copy.
struct Prepared {
    problem: Problem,
    plan: Plan,
    targets: PreparedTargets,
    classes: CudaSlice<u8>,
    vec_ok: i32,
    softcap: f32,
}

/// Bookkeeping of the workspace a call allocates: bytes live now and the peak.
#[derive(Default)]
struct Workspace {
    live: u64,
    peak: u64,
}

impl Workspace {
    fn add(&mut self, bytes: usize) {
        self.live += bytes as u64;
        self.peak = self.peak.max(self.live);
    }
    fn release(&mut self, bytes: usize) {
        self.live = self.live.saturating_sub(bytes as u64);
    }
}

impl CudaBackend {
    /// Open device `ordinal` (its primary context, as PyTorch and candle use it) with a new
    /// non-blocking stream of its own, compile (or fetch from the process caches) the kernels
    /// for its architecture and load them.
    ///
    /// The stream does not synchronize with the legacy default stream: work the caller enqueues
    /// elsewhere is ordered before a call only through an event the backend's stream waits for
    /// (see [`CudaBackend::on_stream`] for the ordering contract).
    ///
    /// Errors: `NoDevice` when libcuda or libnvrtc is missing or no device is visible (checked
    /// before any CUDA call, since cudarc panics on a missing library), or `ordinal` is out of
    /// range; `Backend` for driver errors and for kernels that fail to compile (with NVRTC's log).
    pub fn new(ordinal: usize) -> Result<Self> {
        let count = probe()?;
        if ordinal >= count {
            return Err(CceError::NoDevice {
                backend: BACKEND,
                reason: format!("device {ordinal} requested, {count} visible"),
            });
        }
        let ctx = CudaContext::new(ordinal).map_err(drv)?;
        // SAFETY: this context handle is the backend's own (the tracking flag belongs to this
        // `Arc<CudaContext>`, not to the driver's context). Every allocation and launch of this
        // backend goes to its one stream, so stream order alone orders all accesses, except
        // the class-tiled forward's row kernels (chunked.rs `forward_by_classes`), which run on
        // a second stream through raw device addresses only and are ordered by explicit events
        // both ways, the main stream waiting for that stream before the call returns; no
        // `CudaSlice` is used on another stream.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(drv)?;
        Self::build(ctx, stream)
    }

    /// A backend that enqueues all its work on `stream`: a framework's stream (candle's
    /// `CudaDevice::cuda_stream()`, or PyTorch's current stream through
    /// [`CudaBackend::on_raw_stream`]), so that a call needs no synchronization with the
    /// training step around it.
    ///
    /// Ordering contract: every kernel, copy, allocation and free of a call is enqueued on
    /// `stream`, in program order. Inputs produced on another stream must be ordered before
    /// the call by the caller (record an event on the producing stream and make `stream` wait
    /// for it); consumers of the outputs on another stream wait for an event recorded on
    /// `stream` after the call. Some calls still read small results back to the host (the
    /// prepared targets, statistics) and so wait for `stream` to reach that point.
    ///
    /// Cheap to call per step: the compiled modules are cached per (context, architecture)
    /// for the process ([`crate::device`]); a construction looks up its kernel functions and
    /// device attributes. The dense strategies' cuBLAS handle and workspace are made on the
    /// backend's first dense call. The context's event tracking is left as the caller set it.
    ///
    /// Errors: those of [`CudaBackend::new`].
    pub fn on_stream(stream: Arc<CudaStream>) -> Result<Self> {
        probe()?;
        let ctx = stream.context().clone();
        Self::build(ctx, stream)
    }

    /// A backend on a stream owned by other code (PyTorch's
    /// `torch.cuda.current_stream(device).cuda_stream`, a `CUstream` of another library),
    /// wrapped with `CudaContext::wrap_borrowed_stream`: dropping the backend does not destroy
    /// it. Same ordering contract as [`CudaBackend::on_stream`].
    ///
    /// # Safety
    /// - `cu_stream` is a live stream of `ctx`'s context (for PyTorch: the device's primary
    ///   context, which `CudaContext::new(ordinal)` retains);
    /// - its owner keeps it alive while the backend, or a tensor it allocated, may be used;
    /// - the caller orders work submitted by the stream's owner with the backend's work (as
    ///   on any shared stream: program order on the stream does it).
    ///
    /// Errors: those of [`CudaBackend::new`].
    pub unsafe fn on_raw_stream(
        ctx: &Arc<CudaContext>,
        cu_stream: cudarc::driver::sys::CUstream,
    ) -> Result<Self> {
        // SAFETY: forwarded to the caller (this function's contract).
        let stream = unsafe { ctx.wrap_borrowed_stream(cu_stream) };
        Self::on_stream(stream)
    }

    /// The backend on `stream` of `ctx`: kernels from the process caches, device limits.
    fn build(ctx: Arc<CudaContext>, stream: Arc<CudaStream>) -> Result<Self> {
        let (major, minor) = ctx.compute_capability().map_err(drv)?;
        let arch = crate::device::arch_of(major, minor);
        let module = crate::device::module(&ctx, kernels::SOURCE, &arch)?;
        let attr = |a: CUdevice_attribute| ctx.attribute(a).map_err(drv);
        let sm_count = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as usize;
        let smem_optin =
            attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
        let mut funcs = HashMap::new();
        for &name in kernels::KERNEL_SYMBOLS {
            let f = module.load_function(name).map_err(drv)?;
            funcs.insert(name, f);
        }
        for dt in [DType::F32, DType::F16, DType::BF16] {
            let needs = [
                (format!("cce_forward_{dt}"), LOGITS_SMEM),
                (format!("cce_hist_{dt}"), HIST_SMEM),
                (format!("cce_backward_de_{dt}"), de_smem(dt)),
                (format!("cce_backward_dc_{dt}"), dc_smem(dt)),
            ];
            for (name, bytes) in needs {
                if bytes as i32 > smem_optin {
                    return Err(CceError::ResourceLimit {
                        resource: format!("shared memory per block for {name}"),
                        requested: bytes as u64,
                        max: smem_optin as u64,
                    });
                }
                funcs[name.as_str()]
                    .set_attribute(
                        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        bytes as i32,
                    )
                    .map_err(drv)?;
            }
        }
        let name = ctx.name().map_err(drv)?;
        let total = ctx.total_mem().map_err(drv)? as u64;
        let limits = DeviceLimits {
            name: format!("{name} ({arch}, {sm_count} SMs)"),
            max_buffer_bytes: total,
            max_block_memory_bytes: smem_optin as u64,
            max_threads_per_block: NTHREADS,
            max_grid: [i32::MAX as u32, 65535, 65535],
            // Kernels index elements with 64-bit offsets; rows and classes are 32-bit.
            index_bits: 64,
            tile: TileShape {
                rows: TILE_ROWS,
                classes: TILE_CLASSES,
                depth: 32,
            },
            // The dense strategies need libcublas and compute capability 8.0+ (module docs).
            strategies: vec![StrategyKind::TileOwnership],
            // Forward-only calls of the dense strategies run over class tiles (chunked.rs).
            class_forward: true,
        };
        let available = if dense_available(major) {
            vec![
                StrategyKind::ChunkedDense,
                StrategyKind::SplitDense,
                StrategyKind::TileOwnership,
            ]
        } else {
            vec![StrategyKind::TileOwnership]
        };
        let mut limits = limits;
        limits.strategies = available.clone();
        Ok(Self {
            ctx,
            stream,
            _module: module,
            funcs,
            limits,
            sm_count,
            arch,
            dense: OnceLock::new(),
            available,
            chunk_cap: None,
            split_de_f16: true,
            sparse: SparseMode::Auto,
            wgmma_forward: crate::chunked::WGMMA_FORWARD_DEFAULT,
            wgmma_gcols: crate::chunked::WGMMA_GCOLS_DEFAULT,
            wgmma_rows: crate::chunked::WGMMA_ROWS_DEFAULT,
            engine_switches: CudaSwitches::default(),
        })
    }

    /// Every switch at once ([`CudaSwitches`]: which paths a call may take, profiling); the
    /// `with_*` methods below set one each. Set before the first call (the dense engine takes
    /// its profiling and tuning switches when the first dense call makes it).
    pub fn with_switches(mut self, switches: CudaSwitches) -> Self {
        self.sparse = switches.sparse;
        self.wgmma_forward = switches.wgmma_forward;
        self.wgmma_gcols = switches.wgmma_gcols;
        self.wgmma_rows = switches.wgmma_rows;
        self.split_de_f16 = switches.split_de_f16;
        self.engine_switches = switches;
        self
    }

    /// The switches in effect ([`CudaBackend::with_switches`]).
    pub fn switches(&self) -> CudaSwitches {
        CudaSwitches {
            sparse: self.sparse,
            wgmma_forward: self.wgmma_forward,
            wgmma_gcols: self.wgmma_gcols,
            wgmma_rows: self.wgmma_rows,
            split_de_f16: self.split_de_f16,
            ..self.engine_switches
        }
    }

    /// How filtered split-dense calls use the plan's sparse backward ([`SparseMode`]).
    /// Default [`SparseMode::Auto`].
    pub fn with_sparse(mut self, mode: SparseMode) -> Self {
        self.sparse = mode;
        self
    }

    /// With `true`, forward-only calls of the dense strategies run the fused WGMMA forward
    /// (`kernels/wgmma.cu`: the logits GEMM with the log-sum-exp in its epilogue, no logits
    /// in memory) where it applies: compute capability 9.0, bf16 or f16, no label smoothing,
    /// entropy or argmax, `D` a multiple of 64, softcap at most
    /// [`crate::chunked::WGMMA_SOFTCAP_MAX`] (a bias and a softcap are applied in the epilogue,
    /// the softcap as `s − 2s/(e^{2x/s} + 1)`); elsewhere, and with `false`,
    /// the class tiles or row chunks. The call's `plan_reason` says which forward ran. Default
    /// [`crate::chunked::WGMMA_FORWARD_DEFAULT`].
    pub fn with_wgmma_forward(mut self, on: bool) -> Self {
        self.wgmma_forward = on;
        self
    }

    /// With `true`, split dense's class pass (the `d_c` half of an exact or dense-fallback
    /// backward) computes each class chunk's `G` in the epilogue of a WGMMA GEMM
    /// (`kernels/wgmma.cu` `cce_wgmma_gcols_*`: f16 `G` written straight from the registers,
    /// no f32 logits in memory) where it applies: compute capability 9.0, bf16 or f16, `D` a
    /// multiple of 64, softcap at most [`crate::chunked::WGMMA_SOFTCAP_MAX`]; elsewhere, and with `false`, a cuBLAS logits GEMM then the `G` pass.
    /// The call's `plan_reason` says which ran. Default
    /// [`crate::chunked::WGMMA_GCOLS_DEFAULT`].
    pub fn with_wgmma_gcols(mut self, on: bool) -> Self {
        self.wgmma_gcols = on;
        self
    }

    /// With `true`, split dense's row pass of a forward-and-backward call (the `d_e` half of an
    /// exact or dense-fallback call) computes each row chunk's logits in a WGMMA GEMM whose
    /// epilogue writes the per-tile (max, Σexp) and each `e^{z − m}` as f16
    /// (`kernels/wgmma.cu` `cce_wgmma_lseq_*`), then the lse and `G` in place
    /// (`cce_wgmma_qrows_g_*`), where it applies: compute capability 9.0, bf16 inputs and `G`,
    /// `D` a multiple of 64, no label smoothing, entropy or argmax, softcap at most
    /// [`crate::chunked::WGMMA_SOFTCAP_MAX`]; elsewhere, and with `false`, a cuBLAS f32 logits
    /// GEMM and the forward and backward row kernels. The call's `plan_reason` says which ran.
    /// Default [`crate::chunked::WGMMA_ROWS_DEFAULT`].
    pub fn with_wgmma_rows(mut self, on: bool) -> Self {
        self.wgmma_rows = on;
        self
    }

    /// With `false`, split dense computes `d_e` from bf16 `G` (bf16 inputs) even where the
    /// budget holds the f16 copy of `c`: the path the default budget takes at large shapes,
    /// for tests on small ones. Default `true`.
    pub fn with_split_de_f16(mut self, allow: bool) -> Self {
        self.split_de_f16 = allow;
        self
    }

    /// Cap the chunks of the dense strategies at `rows` rows and `classes` classes (rounded
    /// down to whole tiles, at least one): more chunks than the budget needs, so that small
    /// problems exercise the chunk loops (tests). Errors: `InvalidOption` for a zero cap.
    pub fn with_chunk_cap(mut self, rows: usize, classes: usize) -> Result<Self> {
        if rows == 0 || classes == 0 {
            return Err(CceError::InvalidOption {
                name: "chunk_cap",
                reason: "rows and classes must be at least 1".into(),
            });
        }
        self.chunk_cap = Some((
            rows.max(TILE_ROWS) / TILE_ROWS * TILE_ROWS,
            classes.max(TILE_CLASSES) / TILE_CLASSES * TILE_CLASSES,
        ));
        Ok(self)
    }

    /// Set the strategies the plan may choose to `kinds` (in preference order), keeping only
    /// those this device supports; e.g. `[SplitDense, TileOwnership]` to leave out the
    /// chunked-dense strategy (bf16 `G`) even where the budget holds its accumulator.
    /// Errors: `InvalidOption` when none is left.
    pub fn with_strategies(mut self, kinds: &[StrategyKind]) -> Result<Self> {
        let have = self.available.clone();
        let keep: Vec<StrategyKind> = kinds.iter().copied().filter(|k| have.contains(k)).collect();
        if keep.is_empty() {
            return Err(CceError::InvalidOption {
                name: "strategies",
                reason: format!("none of {kinds:?} is available (device supports {have:?})"),
            });
        }
        self.limits.strategies = keep;
        Ok(self)
    }

    /// The CUDA context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every call of this backend runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Architecture the kernels were compiled for (`sm_90a` on H100/H200).
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// Streaming multiprocessors of the device.
    pub fn sm_count(&self) -> usize {
        self.sm_count
    }

    /// Block until all work of this backend's stream is done.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(drv)
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

    fn tptr(&self, t: &CudaTensor) -> u64 {
        self.ptr(&t.data)
    }

    /// Allocate `bytes` (at least 1) of uninitialized device memory.
    fn alloc_raw(&self, bytes: usize) -> Result<CudaSlice<u8>> {
        // SAFETY: the memory is uninitialized; every caller writes it (kernel or memset) before
        // any read, in stream order.
        unsafe { self.stream.alloc::<u8>(bytes.max(1)) }.map_err(|e| alloc_err(e, bytes))
    }

    fn alloc_zeroed_raw(&self, bytes: usize) -> Result<CudaSlice<u8>> {
        self.stream
            .alloc_zeros::<u8>(bytes.max(1))
            .map_err(|e| alloc_err(e, bytes))
    }

    fn ws_zeroed(&self, ws: &mut Workspace, bytes: usize) -> Result<CudaSlice<u8>> {
        ws.add(bytes);
        self.alloc_zeroed_raw(bytes)
    }

    fn ws_alloc(&self, ws: &mut Workspace, bytes: usize) -> Result<CudaSlice<u8>> {
        ws.add(bytes);
        self.alloc_raw(bytes)
    }

    fn memset_zero(&self, s: &mut CudaSlice<u8>) -> Result<()> {
        self.stream.memset_zeros(s).map_err(drv)
    }

    /// A new tensor of `shape` x `dtype`, uninitialized (its contents are unspecified until
    /// written). Errors: `OutOfMemory`; `ResourceLimit` when the shape's size overflows.
    pub fn alloc_tensor(&self, shape: Vec<usize>, dtype: DType) -> Result<CudaTensor> {
        let bytes = cce_core::checked_bytes(&shape, dtype)?;
        CudaTensor::from_slice(self.alloc_raw(bytes)?, dtype, shape)
    }

    /// A new zero-filled tensor. Errors: `OutOfMemory`; `ResourceLimit` when the shape's size
    /// overflows.
    pub fn zeros(&self, shape: Vec<usize>, dtype: DType) -> Result<CudaTensor> {
        let bytes = cce_core::checked_bytes(&shape, dtype)?;
        CudaTensor::from_slice(self.alloc_zeroed_raw(bytes)?, dtype, shape)
    }

    /// Fill a float tensor with `mean + std · N(0, 1)` values generated on the device from
    /// `seed` (counter-based: the value of element `i` depends only on `seed` and `i`).
    /// Errors: `DTypeMismatch` for integer tensors.
    pub fn fill_randn(&self, t: &mut CudaTensor, seed: u64, mean: f32, std: f32) -> Result<()> {
        if !t.dtype().is_float() {
            return Err(CceError::DTypeMismatch {
                what: "fill_randn",
                expected: "f32, f16 or bf16".into(),
                got: t.dtype(),
            });
        }
        let name = format!("cce_fill_randn_{}", t.dtype());
        let n = t.numel() as i64;
        let p = self.tptr(t);
        let c = cfg((4 * self.sm_count as u32, 1, 1), 256, 0);
        // SAFETY: `p` addresses `n` elements of the tensor's dtype; the kernel writes only
        // indices < n; launched on the backend stream that owns the allocation.
        unsafe { launch!(self, &name, c, p, n, seed, mean, std) }
    }

    /// Random targets `[n]` i64, uniform in `[0, v)`, with about `ignore_fraction` of them set
    /// to `ignore_index`, generated on the device from `seed`.
    pub fn random_targets(
        &self,
        n: usize,
        v: usize,
        ignore_fraction: f64,
        ignore_index: i64,
        seed: u64,
    ) -> Result<CudaTensor> {
        let t = self.alloc_tensor(vec![n], DType::I64)?;
        let p = self.tptr(&t);
        let permille = (ignore_fraction * 1000.0).round().clamp(0.0, 1000.0) as i32;
        let c = cfg((4 * self.sm_count as u32, 1, 1), 256, 0);
        let (n64, v32) = (n as i64, v as i32);
        // SAFETY: `p` addresses n i64 values; the kernel writes indices < n only.
        unsafe {
            launch!(
                self,
                "cce_fill_targets",
                c,
                p,
                n64,
                seed,
                v32,
                permille,
                ignore_index
            )
        }?;
        Ok(t)
    }

    fn check_owned(&self, what: &'static str, t: &CudaTensor) -> Result<()> {
        if t.cu_ctx() != self.ctx.cu_ctx() as usize {
            return Err(CceError::ForeignBuffer {
                backend: BACKEND,
                what,
            });
        }
        Ok(())
    }

    fn prepare(&self, inputs: &Inputs<'_, CudaTensor>, opts: &Options) -> Result<Prepared> {
        self.check_owned("e", inputs.e)?;
        self.check_owned("c", inputs.c)?;
        self.check_owned("targets", inputs.targets)?;
        if let Some(b) = inputs.bias {
            self.check_owned("bias", b)?;
        }
        let problem = Problem::new(
            inputs.e,
            inputs.c,
            inputs.bias.map(|b| b as &dyn TensorMeta),
            inputs.targets,
            opts,
        )?;
        // Chunked dense rounds G to the input dtype for both products: on real data
        // that costs d_c 0.13% against the original filter's 0.05% (docs/perf-log.md), and f16
        // G under a mean is subnormal; so filtered and f16 calls skip it. Split dense keeps
        // f16 G for d_c in every dtype.
        let filtered = cce_core::FilterRule::resolve(opts, problem.dtype).enabled;
        let mut limits = self.limits.clone();
        let mut notes = Vec::new();
        if limits.strategies.len() > 1
            && limits.strategies.contains(&StrategyKind::ChunkedDense)
            && (filtered || problem.dtype == DType::F16)
        {
            limits
                .strategies
                .retain(|k| *k != StrategyKind::ChunkedDense);
            notes.push(
                "chunked-dense is used for exact bf16 / f32 calls only (its products use G in the input dtype)",
            );
        }
        let mut plan = Plan::new(&problem, opts, &limits)?;
        for note in notes {
            plan.reason.push_str(&format!(" ({note})"));
        }
        if let Some((cap_rows, cap_classes)) = self.chunk_cap {
            cap_plan_chunks(&mut plan, cap_rows, cap_classes);
        }
        match (self.sparse, plan.sparse.as_mut()) {
            (SparseMode::Off, Some(_)) => {
                plan.sparse = None;
                plan.reason
                    .push_str(" (sparse backward off: with_sparse(SparseMode::Off))");
            }
            (SparseMode::Always, Some(sp)) => {
                sp.max_mean_kept = problem.v;
                plan.reason
                    .push_str(" (sparse backward at any density: with_sparse(SparseMode::Always))");
            }
            _ => {}
        }
        if let Strategy::SplitDense { de_f16, .. } = &mut plan.strategy {
            if *de_f16 && !self.split_de_f16 && problem.dtype == DType::BF16 {
                *de_f16 = false;
                plan.reason
                    .push_str(" (d_e from bf16 G: with_split_de_f16(false))");
            }
        }
        // Targets are read back (4N or 8N bytes) to validate them and name a bad row; the
        // prepared classes (shift and ignore_index applied, -1 = ignored) go back as i32.
        let raw = self
            .download(inputs.targets)?
            .to_i64_vec()
            .ok_or_else(|| CceError::backend(BACKEND, "targets are not integers"))?;
        let targets = PreparedTargets::new(&raw, &problem, opts)?;
        let classes = self
            .stream
            .clone_htod(bytemuck::cast_slice::<i32, u8>(&targets.classes))
            .map_err(|e| alloc_err(e, problem.n * 4))?;
        let vec = 16 / problem.dtype.size_bytes();
        Ok(Prepared {
            problem,
            plan,
            targets,
            classes,
            vec_ok: (problem.d % vec == 0) as i32,
            softcap: opts.softcap.unwrap_or(0.0),
        })
    }

    fn base_stats(&self, p: &Prepared, workspace_bytes: u64) -> CallStats {
        CallStats {
            backend: BACKEND.into(),
            strategy: p.plan.strategy,
            plan_reason: p.plan.reason.clone(),
            n_valid: p.targets.n_valid,
            tiles_total: p.plan.tile_count(),
            tiles_visited: 0,
            tiles_skipped: 0,
            entries_kept: 0,
            entries_skipped: 0,
            dropped_mass_max: 0.0,
            dropped_mass_mean: 0.0,
            filter_eps: p.plan.filter.eps,
            max_dropped_mass: p.plan.filter.max_dropped_mass,
            workspace_bytes,
        }
    }

    /// With `check_finite`, read the lse back (4N bytes) and report the first non-finite input
    /// behind a non-finite lse.
    fn check_finite_lse(
        &self,
        inputs: &Inputs<'_, CudaTensor>,
        opts: &Options,
        p: &Prepared,
        lse: &CudaTensor,
    ) -> Result<()> {
        if opts.check_finite {
            let host = self.download(lse)?.to_f32_vec();
            if let Some((row, value)) = cce_core::problem::first_non_finite(host) {
                return Err(self.locate_non_finite(inputs, p, row, value));
            }
        }
        Ok(())
    }

    /// The chunked-dense engine when the plan chose [`Strategy::ChunkedDense`] (made and its
    /// kernels compiled on first use), else `None`.
    fn dense_engine(&self, p: &Prepared) -> Result<Option<&DenseEngine>> {
        if !matches!(
            p.plan.strategy,
            Strategy::ChunkedDense { .. } | Strategy::SplitDense { .. }
        ) {
            return Ok(None);
        }
        if let Some(e) = self.dense.get() {
            return Ok(Some(e));
        }
        let engine = DenseEngine::new(self.stream.clone())?.with_switches(self.engine_switches);
        // A concurrent first call may have won the race; either engine is equivalent.
        let _ = self.dense.set(engine);
        Ok(self.dense.get())
    }

    /// Locate the first non-finite input behind a non-finite lse of `row` (error path only).
    fn locate_non_finite(
        &self,
        inputs: &Inputs<'_, CudaTensor>,
        p: &Prepared,
        row: usize,
        lse: f32,
    ) -> CceError {
        let d = p.problem.d;
        let first_bad = |t: &CudaTensor| -> Option<(usize, f32)> {
            self.download(t)
                .ok()
                .and_then(|h| cce_core::problem::first_non_finite(h.to_f32_vec()))
        };
        if let Ok(h) = self.download(inputs.e) {
            let vals = h.to_f32_vec();
            if let Some((k, v)) = vals[row * d..(row + 1) * d]
                .iter()
                .enumerate()
                .find(|(_, x)| !x.is_finite())
            {
                return CceError::NonFinite {
                    what: "e",
                    index: row * d + k,
                    row,
                    value: *v,
                };
            }
        }
        if let Some(b) = inputs.bias {
            if let Some((index, value)) = first_bad(b) {
                return CceError::NonFinite {
                    what: "bias",
                    index,
                    row: index,
                    value,
                };
            }
        }
        if let Some((index, value)) = first_bad(inputs.c) {
            return CceError::NonFinite {
                what: "c",
                index,
                row: index / d,
                value,
            };
        }
        CceError::NonFinite {
            what: "lse (the logits overflow)",
            index: row,
            row,
            value: lse,
        }
    }

    fn run_forward(
        &self,
        inputs: &Inputs<'_, CudaTensor>,
        opts: &Options,
        p: &Prepared,
    ) -> Result<ForwardOutput<CudaTensor>> {
        let Problem { n, v, d, dtype, .. } = p.problem;
        let mut ws = Workspace::default();
        let n_rtiles = n.div_ceil(TILE_ROWS);
        let n_ctiles = v.div_ceil(TILE_CLASSES);
        let (splits, tps) = choose_splits(n_rtiles, n_ctiles, self.sm_count, 64);
        let part = self.ws_alloc(&mut ws, 6 * splits * n * 4)?;
        let z_target = self.ws_zeroed(&mut ws, n * 4)?;
        let lse = self.alloc_tensor(vec![n], DType::F32)?;
        let loss_rows = self.alloc_tensor(vec![n], DType::F32)?;
        let entropy = if opts.side_outputs.entropy {
            Some(self.alloc_tensor(vec![n], DType::F32)?)
        } else {
            None
        };
        let argmax = if opts.side_outputs.argmax {
            Some(self.alloc_tensor(vec![n], DType::I32)?)
        } else {
            None
        };
        let (e_p, c_p) = (self.tptr(inputs.e), self.tptr(inputs.c));
        let bias_p = inputs.bias.map_or(NULL, |b| self.tptr(b));
        let cls_p = self.ptr(&p.classes);
        let (part_p, zt_p) = (self.ptr(&part), self.ptr(&z_target));
        let (n32, v32, d32, tps32) = (n as i32, v as i32, d as i32, tps as i32);
        let c = cfg((n_rtiles as u32, splits as u32, 1), NTHREADS, LOGITS_SMEM);
        let name = format!("cce_forward_{dtype}");
        // SAFETY: e [N, D], c [V, D], bias [V] hold the problem's dtype and sizes (validated by
        // Problem::new); classes holds N i32; part holds 6·splits·N f32 and z_target N f32. The
        // kernel reads rows < N and classes < V only and writes part[.., split, row < N] and
        // z_target[row < N]. Everything is on the backend stream, after the uploads.
        unsafe {
            launch!(
                self, &name, c, e_p, c_p, bias_p, cls_p, n32, v32, d32, p.vec_ok, p.softcap, tps32,
                part_p, zt_p
            )
        }?;
        let alpha = opts.label_smoothing;
        let lambda = opts.z_loss;
        let (lse_p, lr_p) = (self.tptr(&lse), self.tptr(&loss_rows));
        let ent_p = entropy.as_ref().map_or(NULL, |t| self.tptr(t));
        let am_p = argmax.as_ref().map_or(NULL, |t| self.tptr(t));
        let splits32 = splits as i32;
        let c = cfg((blocks_for(n, 256)?, 1, 1), 256, 0);
        // SAFETY: part was fully written for rows < N by the forward kernel (every split has at
        // least one class tile); lse, loss_rows, entropy and argmax hold N elements; one thread
        // per row < N.
        unsafe {
            launch!(
                self,
                "cce_forward_finalize",
                c,
                part_p,
                splits32,
                n32,
                v32,
                cls_p,
                zt_p,
                alpha,
                lambda,
                lse_p,
                lr_p,
                ent_p,
                am_p
            )
        }?;
        let loss = match opts.reduction {
            Reduction::None => loss_rows,
            r => {
                let out = self.alloc_tensor(vec![], DType::F32)?;
                let scale = if r == Reduction::Mean {
                    if p.targets.n_valid == 0 {
                        // `prepare` has rejected a mean over no valid row
                        // (`PreparedTargets::new`); an error, not a silent 0, regardless.
                        return Err(CceError::all_targets_ignored(n, opts));
                    }
                    1.0 / p.targets.n_valid as f32
                } else {
                    1.0
                };
                let o = self.tptr(&out);
                // SAFETY: loss_rows holds N f32 written above; out holds one f32; one block.
                unsafe {
                    launch!(
                        self,
                        "cce_sum_f32",
                        cfg((1, 1, 1), 1024, 0),
                        lr_p,
                        n32,
                        scale,
                        o
                    )
                }?;
                out
            }
        };
        self.check_finite_lse(inputs, opts, p, &lse)?;
        drop(part);
        drop(z_target);
        Ok(ForwardOutput {
            loss,
            lse,
            rest_mass: self.zeros(vec![n], DType::F32)?,
            entropy,
            argmax,
            stats: self.base_stats(p, ws.peak),
        })
    }

    #[allow(clippy::too_many_lines)]
    fn run_backward(
        &self,
        inputs: &Inputs<'_, CudaTensor>,
        opts: &Options,
        p: &Prepared,
        lse: &CudaTensor,
        upstream: &Upstream<'_, CudaTensor>,
    ) -> Result<BackwardOutput<CudaTensor>> {
        let Problem { n, v, d, dtype, .. } = p.problem;
        if p.targets.n_valid == 0 && opts.reduction == Reduction::Mean {
            // `prepare` has rejected a mean over no valid row (`PreparedTargets::new`); an
            // error, not zero gradients, regardless.
            return Err(CceError::all_targets_ignored(n, opts));
        }
        let f32_vec = |t: &CudaTensor, what: &'static str| -> Result<()> {
            self.check_owned(what, t)?;
            if t.dtype() != DType::F32 || t.numel() != n {
                return Err(CceError::ShapeMismatch {
                    what,
                    expected: format!("[{n}] f32"),
                    got: format!("{:?} {}", t.shape(), t.dtype()),
                });
            }
            Ok(())
        };
        f32_vec(lse, "lse")?;
        let (dloss_rows, dloss_scalar) = match upstream.d_loss {
            DLoss::Scalar(_) if opts.reduction == Reduction::None => {
                return Err(CceError::ShapeMismatch {
                    what: "d_loss",
                    expected: format!("per-row [{n}] f32 for reduction none"),
                    got: "a scalar".into(),
                });
            }
            DLoss::Scalar(x) => (None, x),
            DLoss::PerRow(t) => {
                if opts.reduction != Reduction::None {
                    return Err(CceError::ShapeMismatch {
                        what: "d_loss",
                        expected: format!("a scalar for reduction {:?}", opts.reduction),
                        got: format!("{:?}", t.shape()),
                    });
                }
                f32_vec(t, "d_loss")?;
                (Some(t), 0.0)
            }
        };
        if let Some(t) = upstream.d_lse {
            f32_vec(t, "d_lse")?;
        }
        let out_dtype = if opts.grad_dtype == GradDType::F32 {
            DType::F32
        } else {
            dtype
        };
        let out_kind: i32 = match out_dtype {
            DType::F32 => 0,
            DType::F16 => 1,
            _ => 2,
        };
        let filter = p.plan.filter;
        let mut ws = Workspace::default();
        let mut d_e = if opts.compute_d_e {
            Some(self.alloc_tensor(inputs.e.shape().to_vec(), out_dtype)?)
        } else {
            None
        };
        let mut d_c = if opts.compute_d_c {
            Some(self.alloc_tensor(vec![v, d], out_dtype)?)
        } else {
            None
        };
        let mut d_bias = if opts.compute_d_c && inputs.bias.is_some() {
            Some(self.alloc_tensor(vec![v], out_dtype)?)
        } else {
            None
        };
        // All rows ignored (sum or none: a mean was rejected above) and no lse gradient: every
        // gradient is exactly zero.
        if p.targets.n_valid == 0 && upstream.d_lse.is_none() {
            for t in [&mut d_e, &mut d_c, &mut d_bias].into_iter().flatten() {
                self.memset_zero(&mut t.data)?;
            }
            return Ok(BackwardOutput {
                d_e,
                d_c,
                d_bias,
                stats: self.base_stats(p, 0),
            });
        }
        let (n32, v32, d32) = (n as i32, v as i32, d as i32);
        let (e_p, c_p) = (self.tptr(inputs.e), self.tptr(inputs.c));
        let bias_p = inputs.bias.map_or(NULL, |b| self.tptr(b));
        let cls_p = self.ptr(&p.classes);
        let lse_p = self.tptr(lse);

        // Row coefficients of G and the power-of-two scales.
        let rowc = self.ws_alloc(&mut ws, 5 * n * 4)?;
        let gscale = self.ws_zeroed(&mut ws, 4)?;
        let (rowc_p, gs_p) = (self.ptr(&rowc), self.ptr(&gscale));
        let gmul: f32 = match opts.reduction {
            Reduction::Mean if p.targets.n_valid > 0 => 1.0 / p.targets.n_valid as f32,
            _ => 1.0,
        };
        let dl_p = dloss_rows.map_or(NULL, |t| self.tptr(t));
        let dlse_p = upstream.d_lse.map_or(NULL, |t| self.tptr(t));
        let (alpha, lambda) = (opts.label_smoothing, opts.z_loss);
        // SAFETY: classes, lse, d_loss, d_lse hold N values (checked above); rowc holds 5N f32,
        // gscale one u32 (zeroed); one thread per row < N.
        unsafe {
            launch!(
                self,
                "cce_row_coefs",
                cfg((blocks_for(n, 256)?, 1, 1), 256, 0),
                cls_p,
                lse_p,
                n32,
                v32,
                dl_p,
                dloss_scalar,
                gmul,
                dlse_p,
                alpha,
                lambda,
                rowc_p,
                gs_p
            )
        }?;

        // Threshold pass (filter on): histogram of g0 per row, then tau.
        let n_rtiles = n.div_ceil(TILE_ROWS);
        let n_ctiles = v.div_ceil(TILE_CLASSES);
        let mut tau = None;
        let mut dropped_de = None;
        let mut dropped_dc = None;
        let mut counters = None;
        if filter.enabled && p.plan.passes.contains(&Pass::Threshold) {
            let hist = self.ws_zeroed(&mut ws, n * N_BINS * 4)?;
            let edges: Vec<f32> = (0..N_BINS).map(|k| filter.edge(k)).collect();
            let edges_d = self
                .stream
                .clone_htod(bytemuck::cast_slice::<f32, u8>(&edges))
                .map_err(|e| alloc_err(e, N_BINS * 4))?;
            ws.add(N_BINS * 4);
            let t = self.ws_alloc(&mut ws, n * 4)?;
            let (splits, tps) = choose_splits(n_rtiles, n_ctiles, self.sm_count, 64);
            let (hist_p, edges_p, tau_p) = (self.ptr(&hist), self.ptr(&edges_d), self.ptr(&t));
            let name = format!("cce_hist_{dtype}");
            let tps32 = tps as i32;
            let eps = filter.eps;
            // SAFETY: inputs as in the forward; lse holds N f32; rowc 5N f32 written by
            // cce_row_coefs above (stream order); edges N_BINS f32; hist N·N_BINS u32 zeroed;
            // the kernel adds only to rows < N. HIST_SMEM was set as the function's
            // dynamic shared memory limit at construction.
            unsafe {
                launch!(
                    self,
                    &name,
                    cfg((n_rtiles as u32, splits as u32, 1), NTHREADS, HIST_SMEM),
                    e_p,
                    c_p,
                    bias_p,
                    cls_p,
                    lse_p,
                    n32,
                    v32,
                    d32,
                    p.vec_ok,
                    p.softcap,
                    eps,
                    rowc_p,
                    edges_p,
                    tps32,
                    hist_p
                )
            }?;
            let delta = filter.max_dropped_mass;
            // SAFETY: hist written above (stream order); tau holds N f32; one thread per row.
            unsafe {
                launch!(
                    self,
                    "cce_threshold",
                    cfg((blocks_for(n, 256)?, 1, 1), 256, 0),
                    hist_p,
                    cls_p,
                    n32,
                    delta,
                    edges_p,
                    tau_p
                )
            }?;
            drop(hist);
            ws.release(n * N_BINS * 4);
            tau = Some(t);
            dropped_de = Some(self.ws_zeroed(&mut ws, n * 8)?);
            dropped_dc = Some(self.ws_zeroed(&mut ws, n * 8)?);
            counters = Some(self.ws_zeroed(&mut ws, 4 * 8)?);
        }
        let tau_p = tau.as_ref().map_or(NULL, |t| self.ptr(t));
        let cnt_p = counters.as_ref().map_or(NULL, |t| self.ptr(t));

        // Label smoothing: analytic rank-1 term (no softcap) or dense inside G (softcap).
        let analytic = filter.label_smoothing_analytic;
        let dense_ls: i32 = (alpha > 0.0 && !analytic) as i32;
        let colsum = |ws: &mut Workspace, src: u64, rows: usize, w: u64| -> Result<CudaSlice<u8>> {
            let rps = rows.div_ceil(64).max(1);
            let segs = rows.div_ceil(rps);
            let partial = self.ws_alloc(ws, segs * d * 8)?;
            let out = self.ws_alloc(ws, d * 4)?;
            let (pp, op) = (self.ptr(&partial), self.ptr(&out));
            let (rows32, rps32, segs32) = (rows as i32, rps as i32, segs as i32);
            let name = format!("cce_colsum_{dtype}");
            // SAFETY: src holds rows x D elements of dtype; w (nullable) holds `rows` f32;
            // partial holds segs x D f64, out D f32; threads cover d < D and rows < `rows`.
            unsafe {
                launch!(
                    self,
                    &name,
                    cfg((blocks_for(d, 256)?, segs as u32, 1), 256, 0),
                    src,
                    rows32,
                    d32,
                    w,
                    rps32,
                    pp
                )
            }?;
            // SAFETY: partial written above; out holds D f32.
            unsafe {
                launch!(
                    self,
                    "cce_colsum_finish",
                    cfg((blocks_for(d, 256)?, 1, 1), 256, 0),
                    pp,
                    segs32,
                    d32,
                    op
                )
            }?;
            drop(partial);
            ws.release(segs * d * 8);
            Ok(out)
        };

        let budget = opts.workspace_budget_bytes.max(p.plan.workspace_bytes);

        // d_e pass: row-owned.
        if let Some(de) = d_e.as_mut() {
            let csum = if analytic && alpha > 0.0 {
                Some(colsum(&mut ws, c_p, v, NULL)?)
            } else {
                None
            };
            let csum_p = csum.as_ref().map_or(NULL, |t| self.ptr(t));
            let de_p = self.tptr(de);
            let esz = out_dtype.size_bytes() as u64;
            let name = format!("cce_backward_de_{dtype}");
            let filter_on = filter.filter_e_grad as i32;
            let dropped_p = dropped_de.as_ref().map_or(NULL, |t| self.ptr(t));
            for chunk in &p.plan.row_chunks {
                let rc = chunk.len();
                let rtiles = rc.div_ceil(TILE_ROWS);
                let per_split = (rc * d * 4) as u64;
                let avail = budget.saturating_sub(ws.live);
                let max_s = (avail / per_split.max(1)).max(1) as usize;
                let (splits, tps) = choose_splits(rtiles, n_ctiles, self.sm_count, max_s.min(64));
                let in_place = out_dtype == DType::F32 && splits == 1;
                let acc = if in_place {
                    None
                } else {
                    Some(self.ws_zeroed(&mut ws, splits * rc * d * 4)?)
                };
                let out_p = de_p + chunk.start as u64 * d as u64 * esz;
                let acc_p = match &acc {
                    Some(a) => self.ptr(a),
                    None => {
                        // SAFETY: out_p .. + rc·D·4 bytes lies inside d_e (f32, [N, D]).
                        unsafe {
                            cudarc::driver::result::memset_d8_async(
                                out_p,
                                0,
                                rc * d * 4,
                                self.stream.cu_stream(),
                            )
                        }
                        .map_err(drv)?;
                        out_p
                    }
                };
                let (rb32, rc32, tps32) = (chunk.start as i32, rc as i32, tps as i32);
                // SAFETY: inputs as in the forward; rowc 5N f32 and tau N f32 (or null with the
                // filter off) written above; acc holds splits x rc x D f32 zeroed, and block
                // (bx, by) writes only rows [bx·128, +128) of split by; dropped N u64 and
                // counters 4 u64 zeroed; dynamic smem limit set at construction.
                unsafe {
                    launch!(
                        self,
                        &name,
                        cfg((rtiles as u32, splits as u32, 1), NTHREADS, de_smem(dtype)),
                        e_p,
                        c_p,
                        bias_p,
                        cls_p,
                        lse_p,
                        rowc_p,
                        tau_p,
                        n32,
                        v32,
                        d32,
                        p.vec_ok,
                        p.softcap,
                        dense_ls,
                        filter_on,
                        rb32,
                        rc32,
                        tps32,
                        acc_p,
                        dropped_p,
                        cnt_p
                    )
                }?;
                let splits32 = splits as i32;
                let stride = (rc * d) as i64;
                let scale_p = rowc_p + ((3 * n + chunk.start) * 4) as u64;
                let coef_p = if csum.is_some() {
                    rowc_p + ((2 * n + chunk.start) * 4) as u64
                } else {
                    NULL
                };
                let zero = 0.0f32;
                // SAFETY: acc (or d_e itself in place: each element is read, then written by
                // the same thread) holds splits x rc x D f32; rowc slices hold rc f32 from the
                // chunk start; csum D f32; out_p addresses rc x D elements of d_e.
                unsafe {
                    launch!(
                        self,
                        "cce_finalize",
                        cfg((blocks_for(rc * d, 256)?.min(65535 * 8), 1, 1), 256, 0),
                        acc_p,
                        splits32,
                        stride,
                        rc32,
                        d32,
                        scale_p,
                        NULL,
                        coef_p,
                        zero,
                        csum_p,
                        out_p,
                        out_kind
                    )
                }?;
                if acc.is_some() {
                    ws.release(splits * rc * d * 4);
                }
                drop(acc);
            }
        }

        // d_c / d_bias pass: class-owned.
        if d_c.is_some() {
            let (esum, gsum) = if analytic && alpha > 0.0 {
                let g_p = rowc_p + (4 * n * 4) as u64;
                let esum = colsum(&mut ws, e_p, n, g_p)?;
                let gsum = self.ws_alloc(&mut ws, 4)?;
                let gsum_p = self.ptr(&gsum);
                let one = 1.0f32;
                // SAFETY: g is N f32 inside rowc; gsum holds one f32; one block.
                unsafe {
                    launch!(
                        self,
                        "cce_sum_f32",
                        cfg((1, 1, 1), 1024, 0),
                        g_p,
                        n32,
                        one,
                        gsum_p
                    )
                }?;
                (Some(esum), Some(gsum))
            } else {
                (None, None)
            };
            let esum_p = esum.as_ref().map_or(NULL, |t| self.ptr(t));
            let gsum_p = gsum.as_ref().map_or(NULL, |t| self.ptr(t));
            let dc_p = d_c.as_ref().map_or(NULL, |t| self.tptr(t));
            let db_p = d_bias.as_ref().map_or(NULL, |t| self.tptr(t));
            let esz = out_dtype.size_bytes() as u64;
            let name = format!("cce_backward_dc_{dtype}");
            let filter_on = filter.filter_c_grad as i32;
            let dropped_p = dropped_dc.as_ref().map_or(NULL, |t| self.ptr(t));
            for chunk in &p.plan.class_chunks {
                let cc = chunk.len();
                let ctiles = cc.div_ceil(TILE_CLASSES);
                let per_split = (cc * d * 4 + cc * 4) as u64;
                let avail = budget.saturating_sub(ws.live);
                let max_s = (avail / per_split.max(1)).max(1) as usize;
                let (splits, tps) = choose_splits(ctiles, n_rtiles, self.sm_count, max_s.min(64));
                let in_place = out_dtype == DType::F32 && splits == 1;
                let out_p = dc_p + chunk.start as u64 * d as u64 * esz;
                let acc = if in_place {
                    None
                } else {
                    Some(self.ws_zeroed(&mut ws, splits * cc * d * 4)?)
                };
                let acc_p = match &acc {
                    Some(a) => self.ptr(a),
                    None => {
                        // SAFETY: out_p .. + cc·D·4 bytes lies inside d_c (f32, [V, D]).
                        unsafe {
                            cudarc::driver::result::memset_d8_async(
                                out_p,
                                0,
                                cc * d * 4,
                                self.stream.cu_stream(),
                            )
                        }
                        .map_err(drv)?;
                        out_p
                    }
                };
                let bpart = self.ws_alloc(&mut ws, splits * cc * 4)?;
                let bpart_p = self.ptr(&bpart);
                let (cb32, cc32, tps32) = (chunk.start as i32, cc as i32, tps as i32);
                // SAFETY: as the d_e pass, with block (bx, by) owning classes [bx·128, +128) of
                // split by in acc (splits x cc x D f32) and bpart (splits x cc f32, every entry
                // written by its owner); gscale written by cce_row_coefs.
                unsafe {
                    launch!(
                        self,
                        &name,
                        cfg((ctiles as u32, splits as u32, 1), NTHREADS, dc_smem(dtype)),
                        e_p,
                        c_p,
                        bias_p,
                        cls_p,
                        lse_p,
                        rowc_p,
                        tau_p,
                        gs_p,
                        n32,
                        v32,
                        d32,
                        p.vec_ok,
                        p.softcap,
                        dense_ls,
                        filter_on,
                        cb32,
                        cc32,
                        tps32,
                        acc_p,
                        bpart_p,
                        dropped_p,
                        cnt_p
                    )
                }?;
                let splits32 = splits as i32;
                let coef = alpha / v as f32;
                // SAFETY: acc (or d_c in place) holds splits x cc x D f32; esum D f32; out_p
                // addresses cc x D elements of d_c; gscale one u32.
                unsafe {
                    launch!(
                        self,
                        "cce_finalize",
                        cfg((blocks_for(cc * d, 256)?.min(65535 * 8), 1, 1), 256, 0),
                        acc_p,
                        splits32,
                        (cc * d) as i64,
                        cc32,
                        d32,
                        NULL,
                        gs_p,
                        NULL,
                        coef,
                        esum_p,
                        out_p,
                        out_kind
                    )
                }?;
                if db_p != NULL {
                    let bout = db_p + chunk.start as u64 * esz;
                    let one = 1i32;
                    // SAFETY: bpart holds splits x cc f32 (all written); gsum one f32 (or null);
                    // bout addresses cc elements of d_bias.
                    unsafe {
                        launch!(
                            self,
                            "cce_finalize",
                            cfg((blocks_for(cc, 256)?, 1, 1), 256, 0),
                            bpart_p,
                            splits32,
                            cc as i64,
                            cc32,
                            one,
                            NULL,
                            gs_p,
                            NULL,
                            coef,
                            gsum_p,
                            bout,
                            out_kind
                        )
                    }?;
                }
                if acc.is_some() {
                    ws.release(splits * cc * d * 4);
                }
                ws.release(splits * cc * 4);
                drop(acc);
                drop(bpart);
            }
        }

        let mut stats = self.base_stats(p, ws.peak);
        if let Some(cnt) = &counters {
            let host: Vec<u8> = self.stream.clone_dtoh(cnt).map_err(drv)?;
            self.synchronize()?;
            let c: Vec<u64> = u64s(&host[..32]);
            stats.tiles_visited = c[0];
            stats.tiles_skipped = c[1];
            stats.entries_kept = c[2];
            stats.entries_skipped = c[3];
            let src = if filter.filter_e_grad && opts.compute_d_e {
                dropped_de.as_ref()
            } else {
                dropped_dc.as_ref()
            };
            if let Some(dr) = src {
                let host: Vec<u8> = self.stream.clone_dtoh(dr).map_err(drv)?;
                let fixed: Vec<u64> = u64s(&host[..n * 8]);
                let mut max = 0.0f64;
                let mut sum = 0.0f64;
                for (i, &x) in fixed.iter().enumerate() {
                    if p.targets.classes[i] >= 0 {
                        let m = x as f64 / (1u64 << 40) as f64;
                        max = max.max(m);
                        sum += m;
                    }
                }
                stats.dropped_mass_max = max;
                stats.dropped_mass_mean = if p.targets.n_valid > 0 {
                    sum / p.targets.n_valid as f64
                } else {
                    0.0
                };
            }
        } else {
            self.synchronize()?;
        }
        Ok(BackwardOutput {
            d_e,
            d_c,
            d_bias,
            stats,
        })
    }
}

/// Shrink the chunks of a dense plan to at most `rows` x `classes` (whole tiles).
fn cap_plan_chunks(plan: &mut Plan, rows: usize, classes: usize) {
    let (n, v) = (plan.problem.n, plan.problem.v);
    let chunks = |total: usize, c: usize| -> Vec<std::ops::Range<usize>> {
        (0..total.div_ceil(c))
            .map(|i| i * c..((i + 1) * c).min(total))
            .collect()
    };
    match &mut plan.strategy {
        Strategy::ChunkedDense { chunk_rows } => {
            *chunk_rows = (*chunk_rows).min(rows);
            plan.row_chunks = chunks(n, *chunk_rows);
        }
        Strategy::SplitDense {
            chunk_rows,
            chunk_classes,
            ..
        } => {
            *chunk_rows = (*chunk_rows).min(rows);
            *chunk_classes = (*chunk_classes).min(classes);
            plan.row_chunks = chunks(n, *chunk_rows);
            plan.class_chunks = chunks(v, *chunk_classes);
            if let Some(sp) = plan.sparse.as_mut() {
                sp.max_rows = sp.max_rows.min(rows).max(sp.probe_rows);
            }
        }
        Strategy::TileOwnership => return,
    }
    if let Some(cf) = plan.forward.as_mut() {
        // rows and classes are whole tiles, so the tiles keep the plan's alignment.
        cf.rows = cf.rows.min(rows);
        cf.classes = cf.classes.min(classes);
    }
    plan.reason.push_str(&format!(
        " (chunks capped at {rows} rows, {classes} classes)"
    ));
}

/// Whether the dense strategies can run: libcublas loads and compute capability ≥ 8.0.
fn dense_available(major: i32) -> bool {
    major >= 8 && crate::libs::present("cublas")
}

fn dense_call<'a>(
    p: &'a Prepared,
    inputs: &'a Inputs<'a, CudaTensor>,
    opts: &'a Options,
    (wgmma_forward, wgmma_gcols, wgmma_rows): (bool, bool, bool),
) -> BackendCall<'a> {
    BackendCall {
        plan: &p.plan,
        n_valid: p.targets.n_valid,
        classes: &p.classes,
        inputs,
        opts,
        wgmma_forward,
        wgmma_gcols,
        wgmma_rows,
    }
}

impl Backend for CudaBackend {
    type Buffer = CudaTensor;

    fn name(&self) -> &'static str {
        BACKEND
    }

    fn limits(&self) -> DeviceLimits {
        self.limits.clone()
    }

    fn upload(&self, host: &HostTensor) -> Result<CudaTensor> {
        let bytes = host.as_bytes();
        let mut slice = self.alloc_raw(bytes.len())?;
        if !bytes.is_empty() {
            let mut view = slice.slice_mut(..bytes.len());
            self.stream.memcpy_htod(bytes, &mut view).map_err(drv)?;
        }
        CudaTensor::from_slice(slice, host.dtype(), host.shape().to_vec())
    }

    fn download(&self, buf: &CudaTensor) -> Result<HostTensor> {
        let nbytes = buf.nbytes();
        let mut host = vec![0u8; nbytes];
        if nbytes > 0 {
            let view = buf.data.slice(..nbytes);
            self.stream.memcpy_dtoh(&view, &mut host).map_err(drv)?;
            self.stream.synchronize().map_err(drv)?;
        }
        HostTensor::from_bytes(buf.shape().to_vec(), buf.dtype(), &host)
    }

    fn forward(
        &self,
        inputs: &Inputs<'_, CudaTensor>,
        opts: &Options,
    ) -> Result<ForwardOutput<CudaTensor>> {
        let p = self.prepare(inputs, opts)?;
        if let Some(engine) = self.dense_engine(&p)? {
            let (fwd, _) = engine.backend_run(
                &dense_call(
                    &p,
                    inputs,
                    opts,
                    (self.wgmma_forward, self.wgmma_gcols, self.wgmma_rows),
                ),
                None,
                None,
            )?;
            let fwd = fwd.ok_or_else(|| CceError::backend(BACKEND, "no forward output"))?;
            self.check_finite_lse(inputs, opts, &p, &fwd.lse)?;
            return Ok(fwd);
        }
        self.run_forward(inputs, opts, &p)
    }

    fn backward(
        &self,
        inputs: &Inputs<'_, CudaTensor>,
        opts: &Options,
        saved: Saved<'_, CudaTensor>,
        upstream: &Upstream<'_, CudaTensor>,
    ) -> Result<BackwardOutput<CudaTensor>> {
        let p = self.prepare(inputs, opts)?;
        self.check_owned("rest_mass", saved.rest_mass)?;
        saved.check(p.plan.problem.n)?;
        let lse = saved.lse;
        if let Some(engine) = self.dense_engine(&p)? {
            self.check_owned("lse", lse)?;
            let (_, bwd) = engine.backend_run(
                &dense_call(
                    &p,
                    inputs,
                    opts,
                    (self.wgmma_forward, self.wgmma_gcols, self.wgmma_rows),
                ),
                Some(lse),
                Some(upstream),
            )?;
            return bwd.ok_or_else(|| CceError::backend(BACKEND, "no backward output"));
        }
        self.run_backward(inputs, opts, &p, lse, upstream)
    }

    fn forward_backward(
        &self,
        inputs: &Inputs<'_, CudaTensor>,
        opts: &Options,
        upstream: &Upstream<'_, CudaTensor>,
    ) -> Result<(ForwardOutput<CudaTensor>, BackwardOutput<CudaTensor>)> {
        let p = self.prepare(inputs, opts)?;
        if let Some(engine) = self.dense_engine(&p)? {
            // One call: 3 GEMMs per row chunk (the logits are not recomputed).
            let (fwd, bwd) = engine.backend_run(
                &dense_call(
                    &p,
                    inputs,
                    opts,
                    (self.wgmma_forward, self.wgmma_gcols, self.wgmma_rows),
                ),
                None,
                Some(upstream),
            )?;
            let fwd = fwd.ok_or_else(|| CceError::backend(BACKEND, "no forward output"))?;
            let bwd = bwd.ok_or_else(|| CceError::backend(BACKEND, "no backward output"))?;
            self.check_finite_lse(inputs, opts, &p, &fwd.lse)?;
            return Ok((fwd, bwd));
        }
        let fwd = self.run_forward(inputs, opts, &p)?;
        let bwd = self.run_backward(inputs, opts, &p, &fwd.lse, upstream)?;
        Ok((fwd, bwd))
    }
}

#[cfg(test)]
mod tests {
    use super::choose_splits;

    #[test]
    fn splits_fill_the_machine() {
        // 64 row tiles on 132 SMs: two splits make one full wave.
        assert_eq!(choose_splits(64, 2004, 132, 64).0, 2);
        // Enough blocks already: no split.
        assert_eq!(choose_splits(1320, 10, 132, 64).0, 1);
        // Never more splits than tiles.
        assert_eq!(choose_splits(1, 3, 132, 64).0, 3);
        let (s, tps) = choose_splits(7, 1, 132, 64);
        assert_eq!((s, tps), (1, 1));
    }
}
