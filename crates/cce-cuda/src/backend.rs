//! The CUDA backend: device discovery, input validation and the plan; every call runs the
//! dense strategies of [`crate::dense`] ([`cce_core::Strategy::ChunkedDense`],
//! [`cce_core::Strategy::SplitDense`]), which need libcublas and compute capability 8.0
//! (a device without them is [`CceError::Unsupported`]).
//!
//! Strategy choice (the plan takes the first that fits the budget, in this order):
//! - chunked dense (cuBLAS, 3 GEMMs, an f32 `d_c` accumulator of `4·V·D` bytes) for exact
//!   bf16 / f32 calls (bf16 with f32 gradients asked: split dense's f16 `G` instead): its
//!   products use `G` rounded to the input dtype, as a materialized computation does;
//! - split dense (cuBLAS, 4 GEMMs, no cross-chunk accumulator, so it fits the default 512 MiB
//!   at every shape of PERFORMANCE.md), filtered or exact, every dtype: `d_c` from f16 `G`,
//!   `d_e` from f16 `G` when the budget holds an f16 copy of `c` (else bf16 `G`); filtered
//!   calls (filter on both gradients, no label smoothing, not deterministic) first try the
//!   plan's sparse backward ([`cce_core::SparseBackward`], [`SparseMode`] to force or disable
//!   it), which gives way to the dense passes on data that keeps many entries per row.
//!
//! A budget too small for one tile of split dense's chunks is `ResourceLimit` (the plan's
//! reason lists what each strategy would need).

use crate::dense::{BackendCall, DenseEngine};
use crate::kernels;
use crate::switches::CudaSwitches;
use crate::tensor::CudaTensor;
use cce_core::{
    Backend, BackwardOutput, CceError, DLoss, DType, DeviceLimits, ForwardOutput, HostTensor,
    Inputs, Options, Plan, PreparedTargets, Problem, Result, Saved, StrategyKind, TensorMeta,
    Upstream,
};
use cudarc::driver::sys::{CUdevice_attribute, CUresult};
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

/// A call's validated inputs: problem, plan, prepared targets and their device copy.
struct Prepared {
    problem: Problem,
    plan: Plan,
    targets: PreparedTargets,
    classes: CudaSlice<u8>,
    /// The bias masks some class (a −inf entry).
    masked: bool,
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
        // the class-tiled forward's row kernels (`dense` `forward_by_classes`), which run on
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
    /// device attributes. The dense strategies' cuBLAS handle and its 32 MiB workspace are
    /// lent by a per-context pool on the backend's first dense call and given back when the
    /// backend is dropped. The context's event tracking is left as the caller set it.
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
        if !dense_available(major) {
            return Err(CceError::Unsupported {
                backend: BACKEND,
                what: format!(
                    "{arch}: the CUDA backend needs compute capability 8.0 or newer and \
                     libcublas (its dense strategies); {}",
                    if major < 8 {
                        "this device is older"
                    } else {
                        "libcublas could not be loaded"
                    }
                ),
            });
        }
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
        let name = ctx.name().map_err(drv)?;
        let total = ctx.total_mem().map_err(drv)? as u64;
        let limits = crate::dense::schedule::device_limits(
            &format!("{name} ({arch}, {sm_count} SMs)"),
            total,
            smem_optin as u64,
        );
        let available = limits.strategies.clone();
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
            wgmma_forward: crate::dense::WGMMA_FORWARD_DEFAULT,
            wgmma_gcols: crate::dense::WGMMA_GCOLS_DEFAULT,
            wgmma_rows: crate::dense::WGMMA_ROWS_DEFAULT,
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
    /// [`crate::dense::WGMMA_SOFTCAP_MAX`] (a bias and a softcap are applied in the epilogue,
    /// the softcap as `s − 2s/(e^{2x/s} + 1)`); elsewhere, and with `false`,
    /// the class tiles or row chunks. The call's `plan_reason` says which forward ran. Default
    /// [`crate::dense::WGMMA_FORWARD_DEFAULT`].
    pub fn with_wgmma_forward(mut self, on: bool) -> Self {
        self.wgmma_forward = on;
        self
    }

    /// With `true`, split dense's class pass (the `d_c` half of an exact or dense-fallback
    /// backward) computes each class chunk's `G` in the epilogue of a WGMMA GEMM
    /// (`kernels/wgmma.cu` `cce_wgmma_gcols_*`: f16 `G` written straight from the registers,
    /// no f32 logits in memory) where it applies: compute capability 9.0, bf16 or f16, `D` a
    /// multiple of 64, softcap at most [`crate::dense::WGMMA_SOFTCAP_MAX`]; elsewhere, and with `false`, a cuBLAS logits GEMM then the `G` pass.
    /// The call's `plan_reason` says which ran. Default
    /// [`crate::dense::WGMMA_GCOLS_DEFAULT`].
    pub fn with_wgmma_gcols(mut self, on: bool) -> Self {
        self.wgmma_gcols = on;
        self
    }

    /// With `true`, split dense's row pass of a forward-and-backward call (the `d_e` half of an
    /// exact or dense-fallback call) computes each row chunk's logits in a WGMMA GEMM whose
    /// epilogue writes the per-tile (max, Σexp) and each `e^{z − m}` as f16
    /// (`kernels/wgmma.cu` `cce_wgmma_lseq_*`), then the lse and `G` in place
    /// (`cce_wgmma_qrows_g_*`), where it applies: compute capability 9.0, bf16 inputs and `G`,
    /// `D` a multiple of 64, no label smoothing, entropy or argmax, softcap at least
    /// [`crate::dense::WGMMA_ROWS_SOFTCAP_MIN`] and at most
    /// [`crate::dense::WGMMA_SOFTCAP_MAX`]; elsewhere, and with `false`, a cuBLAS f32 logits
    /// GEMM and the forward and backward row kernels. The call's `plan_reason` says which ran.
    /// Default [`crate::dense::WGMMA_ROWS_DEFAULT`].
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
    /// those this device supports (chunked and split dense); e.g. `[SplitDense]` to leave out
    /// the chunked-dense strategy (bf16 `G`) even where the budget holds its accumulator.
    /// Calls that chunked dense does not take (filtered, f16) run split dense.
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
        let knobs = crate::dense::schedule::PlanKnobs {
            chunk_cap: self.chunk_cap,
            sparse: self.sparse,
            split_de_f16: self.split_de_f16,
        };
        let plan = crate::dense::schedule::plan_call(&problem, opts, &self.limits, knobs)?;
        // Targets are read back (4N or 8N bytes) to validate them and name a bad row; the
        // prepared classes (shift and ignore_index applied, -1 = ignored) go back as i32.
        let raw = self
            .download(inputs.targets)?
            .to_i64_vec()
            .ok_or_else(|| CceError::backend(BACKEND, "targets are not integers"))?;
        let targets = PreparedTargets::new(&raw, &problem, opts)?;
        let masked = match inputs.bias {
            Some(b) => self.check_targets_unmasked(b, &targets, opts)?,
            None => false,
        };
        let classes = self
            .stream
            .clone_htod(bytemuck::cast_slice::<i32, u8>(&targets.classes))
            .map_err(|e| alloc_err(e, problem.n * 4))?;
        Ok(Prepared {
            problem,
            plan,
            targets,
            classes,
            masked,
        })
    }

    /// A −inf `bias` entry masks its class (p = 0, a valid input); a valid row whose target it
    /// masks has an infinite loss, as has a row with any masked class under label smoothing:
    /// `TargetMasked` / `InvalidOption` naming the first such row
    /// ([`cce_core::problem::check_masked_targets`]). Reads the bias back (`V` elements).
    /// Returns whether the bias masks any class.
    fn check_targets_unmasked(
        &self,
        bias: &CudaTensor,
        targets: &PreparedTargets,
        opts: &Options,
    ) -> Result<bool> {
        let host = self.download(bias)?.to_f32_vec();
        if !host.contains(&f32::NEG_INFINITY) {
            return Ok(false);
        }
        cce_core::problem::check_masked_targets(targets, opts, |i| {
            (host[targets.classes[i] as usize] == f32::NEG_INFINITY, true)
        })?;
        Ok(true)
    }

    /// The upstream gradients must be finite (NaN or ±inf there would spread through every
    /// gradient): `NonFinite` naming `d_loss` or `d_lse` and the first bad row
    /// ([`cce_core::problem::check_upstream_finite`], the rule every backend applies). A scalar
    /// is always checked; per-row arrays (read back, 4N bytes each) with `check_finite`.
    fn check_upstream(&self, opts: &Options, upstream: &Upstream<'_, CudaTensor>) -> Result<()> {
        use cce_core::problem::check_upstream_finite;
        if let DLoss::Scalar(value) = upstream.d_loss {
            check_upstream_finite("d_loss", [value])?;
        }
        if !opts.check_finite {
            return Ok(());
        }
        let per_row = match upstream.d_loss {
            DLoss::PerRow(t) => Some(("d_loss", t)),
            DLoss::Scalar(_) => None,
        };
        for (what, t) in per_row
            .into_iter()
            .chain(upstream.d_lse.map(|t| ("d_lse", t)))
        {
            self.check_owned(what, t)?;
            check_upstream_finite(what, self.download(t)?.to_f32_vec())?;
        }
        Ok(())
    }

    /// With `check_finite`, read the lse back (4N bytes) and report the first non-finite input
    /// behind a non-finite lse. An ignored row whose every class is masked by the bias has lse
    /// −inf, which is not an error (without a masking bias, a −inf lse comes from −inf in `e`
    /// or `c`, which is).
    fn check_finite_lse(
        &self,
        inputs: &Inputs<'_, CudaTensor>,
        opts: &Options,
        p: &Prepared,
        lse: &CudaTensor,
    ) -> Result<()> {
        if opts.check_finite {
            let host = self.download(lse)?.to_f32_vec();
            let classes = &p.targets.classes;
            // Ignored rows may have lse −inf (every class masked); anything else non-finite is
            // an error.
            let masked_ignored =
                |i: usize, x: f32| p.masked && x == f32::NEG_INFINITY && classes[i] < 0;
            let bad = host
                .iter()
                .enumerate()
                .find(|&(i, x)| !(x.is_finite() || masked_ignored(i, *x)));
            if let Some((row, &value)) = bad {
                return Err(self.locate_non_finite(inputs, p, row, value));
            }
        }
        Ok(())
    }

    /// The dense engine (made and its kernels compiled on first use).
    fn dense_engine(&self) -> Result<&DenseEngine> {
        if let Some(e) = self.dense.get() {
            return Ok(e);
        }
        let engine = DenseEngine::new(self.stream.clone())?.with_switches(self.engine_switches);
        // A concurrent first call may have won the race; either engine is equivalent.
        let _ = self.dense.set(engine);
        self.dense
            .get()
            .ok_or_else(|| CceError::backend(BACKEND, "dense engine not made"))
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
            // −inf masks a class (valid input); NaN and +inf are errors.
            let bad = self.download(b).ok().and_then(|h| {
                h.to_f32_vec()
                    .into_iter()
                    .enumerate()
                    .find(|(_, x)| x.is_nan() || *x == f32::INFINITY)
            });
            if let Some((index, value)) = bad {
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
}

/// Whether the dense strategies can run: libcublas loads and compute capability ≥ 8.0.
fn dense_available(major: i32) -> bool {
    major >= 8 && crate::libs::present("cublas")
}

/// Outputs of a dense-engine call: the forward's and the backward's, each when asked.
type DenseOutputs = (
    Option<ForwardOutput<CudaTensor>>,
    Option<BackwardOutput<CudaTensor>>,
);

impl CudaBackend {
    /// The dense engine's call for `p`: the forward (unless `saved` is given, a backward from the
    /// saved state), and the backward when `upstream` is given; the engine is made on first use.
    fn run_dense(
        &self,
        p: &Prepared,
        inputs: &Inputs<'_, CudaTensor>,
        opts: &Options,
        saved: Option<Saved<'_, CudaTensor>>,
        upstream: Option<&Upstream<'_, CudaTensor>>,
    ) -> Result<DenseOutputs> {
        let switches = (self.wgmma_forward, self.wgmma_gcols, self.wgmma_rows);
        self.dense_engine()?
            .backend_run(&dense_call(p, inputs, opts, switches), saved, upstream)
    }
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
        let (fwd, _) = self.run_dense(&p, inputs, opts, None, None)?;
        let fwd = fwd.ok_or_else(|| CceError::backend(BACKEND, "no forward output"))?;
        self.check_finite_lse(inputs, opts, &p, &fwd.lse)?;
        Ok(fwd)
    }

    fn backward(
        &self,
        inputs: &Inputs<'_, CudaTensor>,
        opts: &Options,
        saved: Saved<'_, CudaTensor>,
        upstream: &Upstream<'_, CudaTensor>,
    ) -> Result<BackwardOutput<CudaTensor>> {
        let p = self.prepare(inputs, opts)?;
        self.check_owned("lse", saved.lse)?;
        self.check_owned("rest_mass", saved.rest_mass)?;
        saved.check(p.problem.n)?;
        self.check_upstream(opts, upstream)?;
        let (_, bwd) = self.run_dense(&p, inputs, opts, Some(saved), Some(upstream))?;
        bwd.ok_or_else(|| CceError::backend(BACKEND, "no backward output"))
    }

    fn forward_backward(
        &self,
        inputs: &Inputs<'_, CudaTensor>,
        opts: &Options,
        upstream: &Upstream<'_, CudaTensor>,
    ) -> Result<(ForwardOutput<CudaTensor>, BackwardOutput<CudaTensor>)> {
        let p = self.prepare(inputs, opts)?;
        self.check_upstream(opts, upstream)?;
        // One call: the logits are not recomputed between the forward and the backward.
        let (fwd, bwd) = self.run_dense(&p, inputs, opts, None, Some(upstream))?;
        let fwd = fwd.ok_or_else(|| CceError::backend(BACKEND, "no forward output"))?;
        let bwd = bwd.ok_or_else(|| CceError::backend(BACKEND, "no backward output"))?;
        self.check_finite_lse(inputs, opts, &p, &fwd.lse)?;
        Ok((fwd, bwd))
    }
}
