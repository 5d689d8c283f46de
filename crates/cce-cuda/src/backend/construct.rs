//! Making a [`CudaBackend`]: on a device, on a stream; its switches and test knobs; device
//! buffers and test data.

use super::*;

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
        Ok(Self::build(ctx, stream)?.with_checks(Checks::Eager))
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
    /// `stream` after the call. Checks are [`Checks::Deferred`]: a call reads nothing back
    /// (the targets are prepared and checked on the device; errors and the device's counts
    /// wait in [`CudaBackend::status`]), except a filtered call that tries the sparse backward,
    /// whose choice reads the kept-entry count (skipped while the stream captures a graph).
    /// [`CudaBackend::with_checks`] with [`Checks::Eager`] reads the checks at every call.
    ///
    /// Capturing a call in a CUDA graph: make one call outside the capture first (the first
    /// call on a context lends the cuBLAS handle and loads the kernels), then capture; the
    /// call's allocations become the graph's memory nodes.
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
        Ok(Self::build(ctx, stream)?.with_checks(Checks::Deferred))
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
    pub(super) fn build(ctx: Arc<CudaContext>, stream: Arc<CudaStream>) -> Result<Self> {
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
        let status = stream
            .alloc_zeros::<u8>(status::STATUS_BYTES)
            .map_err(|e| alloc_err(e, status::STATUS_BYTES))?;
        Ok(Self {
            ctx,
            stream,
            _module: module,
            funcs,
            limits,
            sm_count,
            arch,
            cc: (major, minor),
            dense: OnceLock::new(),
            available,
            chunk_cap: None,
            split_de_f16: true,
            chunked_f32_grads: false,
            dc_in_grad_dtype: false,
            sparse: SparseMode::Auto,
            wgmma_forward: crate::dense::WGMMA_FORWARD_DEFAULT,
            wgmma_gcols: crate::dense::WGMMA_GCOLS_DEFAULT,
            wgmma_rows: crate::dense::WGMMA_ROWS_DEFAULT,
            engine_switches: CudaSwitches::default(),
            status,
            checks: Checks::Eager,
            last_filtered: AtomicBool::new(false),
            sparse_memory: Default::default(),
        })
    }

    /// When the calls' device-side checks reach the host ([`Checks`]): at every call
    /// (`Eager`, one stream synchronization per check point) or when [`CudaBackend::status`]
    /// is asked (`Deferred`, no host read in a call).
    pub fn with_checks(mut self, checks: Checks) -> Self {
        self.checks = checks;
        self
    }

    /// [`CudaBackend::with_checks`] on a backend in place (a backend kept for many calls, whose
    /// caller chooses per call).
    pub fn set_checks(&mut self, checks: Checks) {
        self.checks = checks;
    }

    /// The backend's [`Checks`].
    pub fn checks(&self) -> Checks {
        self.checks
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
        self.chunked_f32_grads = switches.chunked_f32_grads;
        self.dc_in_grad_dtype = switches.dc_in_grad_dtype;
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
            chunked_f32_grads: self.chunked_f32_grads,
            dc_in_grad_dtype: self.dc_in_grad_dtype,
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

    /// With `true`, exact calls of bf16 inputs with f32 gradients run chunked dense where its
    /// row chunks are long even where its `d_c` comes from bf16 `G` (no WGMMA row pass):
    /// faster, less accurate `d_c` on confident rows ([`CudaSwitches::chunked_f32_grads`] has
    /// the measured trade; where the WGMMA row pass runs, chunked dense is taken without it).
    /// Default `false`.
    pub fn with_chunked_f32_grads(mut self, on: bool) -> Self {
        self.chunked_f32_grads = on;
        self
    }

    /// With `true`, exact calls of bf16 inputs with bf16 gradients whose budget holds no f32
    /// `V x D` accumulator run chunked dense (3 GEMMs) with `d_c` accumulated in the bf16
    /// output, rounded once per row chunk, instead of split dense (4 GEMMs): Liger's trade
    /// ([`CudaSwitches::dc_in_grad_dtype`] has the measured error and time). Default `false`.
    pub fn with_dc_in_grad_dtype(mut self, on: bool) -> Self {
        self.dc_in_grad_dtype = on;
        self
    }

    /// [`CudaBackend::with_dc_in_grad_dtype`] on a backend in place (a backend kept for many
    /// calls, whose caller chooses per call: the switch is read when a call is planned).
    pub fn set_dc_in_grad_dtype(&mut self, on: bool) {
        self.dc_in_grad_dtype = on;
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

    pub(super) fn func(&self, name: &str) -> Result<&CudaFunction> {
        self.funcs
            .get(name)
            .ok_or_else(|| CceError::backend(BACKEND, format!("kernel {name} not loaded")))
    }

    pub(super) fn ptr(&self, s: &CudaSlice<u8>) -> u64 {
        let (p, _sync) = s.device_ptr(&self.stream);
        p
    }

    pub(super) fn tptr(&self, t: &CudaTensor) -> u64 {
        self.ptr(&t.data)
    }

    /// Allocate `bytes` (at least 1) of uninitialized device memory.
    pub(super) fn alloc_raw(&self, bytes: usize) -> Result<CudaSlice<u8>> {
        // SAFETY: the memory is uninitialized; every caller writes it (kernel or memset) before
        // any read, in stream order.
        unsafe { self.stream.alloc::<u8>(bytes.max(1)) }.map_err(|e| alloc_err(e, bytes))
    }

    pub(super) fn alloc_zeroed_raw(&self, bytes: usize) -> Result<CudaSlice<u8>> {
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
}

/// Whether the dense strategies can run: libcublas loads and compute capability ≥ 8.0.
pub(super) fn dense_available(major: i32) -> bool {
    major >= 8 && crate::libs::present("cublas")
}
