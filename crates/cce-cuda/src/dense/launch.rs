//! The engine's launch plumbing: error mapping, dtype codes, 32-bit argument checks, the cuBLAS
//! GEMMs (alpha / beta on the host or in device memory), host read-backs and the per-phase
//! profile timer.

use super::*;

/// cuBLAS workspace (Hopper kernels want up to 32 MiB).
pub const CUBLAS_WORKSPACE_BYTES: usize = 32 << 20;

pub(super) fn drv(e: DriverError) -> CceError {
    CceError::backend(BACKEND, e)
}

pub(super) fn alloc_err(e: DriverError, bytes: usize) -> CceError {
    if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        CceError::OutOfMemory {
            backend: BACKEND,
            requested_bytes: bytes as u64,
        }
    } else {
        drv(e)
    }
}

pub(super) fn dtype_code(dt: DType) -> Result<&'static str> {
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

pub(super) fn cuda_type(dt: DType) -> Result<cublas_sys::cudaDataType> {
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

pub(super) fn to_i32(x: usize, what: &str) -> Result<i32> {
    i32::try_from(x).map_err(|_| CceError::ResourceLimit {
        resource: format!("{what} (32-bit cuBLAS / kernel argument)"),
        requested: x as u64,
        max: i32::MAX as u64,
    })
}

/// Device time per phase, for "why is this call slow" ([`crate::CudaSwitches::profile`]): an
/// event at each mark, the interval since the previous mark summed under the mark's name,
/// printed to stderr by [`PhaseTimer::report`]. Off (no events) without the switch.
pub(super) struct PhaseTimer {
    pub(super) stream: Arc<CudaStream>,
    /// The start event, then one event per mark with the mark's name.
    pub(super) marks: Vec<(&'static str, cudarc::driver::CudaEvent)>,
}

impl PhaseTimer {
    pub(super) fn event(stream: &CudaStream) -> Result<cudarc::driver::CudaEvent> {
        stream
            .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv)
    }

    pub(super) fn new(stream: &Arc<CudaStream>, on: bool) -> Result<Option<Self>> {
        if !on {
            return Ok(None);
        }
        Ok(Some(Self {
            stream: stream.clone(),
            marks: vec![("start", Self::event(stream)?)],
        }))
    }

    pub(super) fn mark(t: &mut Option<Self>, name: &'static str) -> Result<()> {
        if let Some(t) = t.as_mut() {
            let ev = Self::event(&t.stream)?;
            t.marks.push((name, ev));
        }
        Ok(())
    }

    pub(super) fn report(t: Option<Self>, what: &str) -> Result<()> {
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

/// The `alpha` and `beta` of a GEMM ([`DenseEngine::gemm_with`]): host values, or the device
/// addresses of f32 values written before on the engine's stream (cuBLAS reads them when the
/// GEMM runs: no host sync, so a call stays capturable in a CUDA graph).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum GemmScalars {
    /// `(alpha, beta)` on the host (cuBLAS's host pointer mode, its default).
    Host(f32, f32),
    /// Device addresses of one f32 each (cuBLAS's device pointer mode for this GEMM only).
    Device {
        /// `alpha`'s address.
        alpha: u64,
        /// `beta`'s address.
        beta: u64,
    },
}

impl From<(f32, f32)> for GemmScalars {
    fn from((alpha, beta): (f32, f32)) -> Self {
        Self::Host(alpha, beta)
    }
}

impl DenseEngine {
    /// Column-major `C[m, n] = op(A)·op(B) + beta·C` with f32 compute (cuBLAS's view; the
    /// row-major callers below pass the transposed problem). Arguments are raw device addresses
    /// of live allocations on this engine's device, each holding `ld x cols` elements of its
    /// dtype; a GEMM that reads past them faults the context, so the callers check sizes.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &self,
        trans_a: bool,
        trans_b: bool,
        mnk: (usize, usize, usize),
        a: (u64, DType, usize),
        b: (u64, DType, usize),
        (alpha, beta): (f32, f32),
        c: (u64, DType, usize),
    ) -> Result<()> {
        let s = GemmScalars::Host(alpha, beta);
        self.gemm_with(trans_a, trans_b, mnk, a, b, s, c)
    }

    /// [`Self::gemm`] with `alpha` and `beta` as [`GemmScalars`]: device addresses switch the
    /// handle to cuBLAS's device pointer mode for this GEMM and back to host mode after it
    /// (also when the GEMM fails). The handle is this engine's alone; a call must not run
    /// concurrently with another GEMM of the same engine (the pointer mode is handle state).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_with(
        &self,
        trans_a: bool,
        trans_b: bool,
        (m, n, k): (usize, usize, usize),
        (a, a_ty, lda): (u64, DType, usize),
        (b, b_ty, ldb): (u64, DType, usize),
        scalars: GemmScalars,
        (c, c_ty, ldc): (u64, DType, usize),
    ) -> Result<()> {
        let op = |t: bool| {
            if t {
                cublas_sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                cublas_sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        // Every fallible conversion before the pointer mode changes: nothing returns early
        // between the switch to device mode and the switch back.
        let (m, n, k) = (
            to_i32(m, "gemm m")?,
            to_i32(n, "gemm n")?,
            to_i32(k, "gemm k")?,
        );
        let (lda, ldb, ldc) = (
            to_i32(lda, "gemm lda")?,
            to_i32(ldb, "gemm ldb")?,
            to_i32(ldc, "gemm ldc")?,
        );
        let (a_ty, b_ty, c_ty) = (cuda_type(a_ty)?, cuda_type(b_ty)?, cuda_type(c_ty)?);
        let host = match scalars {
            GemmScalars::Host(alpha, beta) => [alpha, beta],
            GemmScalars::Device { .. } => [0.0; 2],
        };
        let (alpha_p, beta_p, device) = match scalars {
            GemmScalars::Host(..) => (
                &host[0] as *const f32 as *const c_void,
                &host[1] as *const f32 as *const c_void,
                false,
            ),
            GemmScalars::Device { alpha, beta } => {
                (alpha as *const c_void, beta as *const c_void, true)
            }
        };
        if device {
            self.pointer_mode(cublas_sys::cublasPointerMode_t::CUBLAS_POINTER_MODE_DEVICE)?;
        }
        // SAFETY: the handle is bound to self.stream; a, b, c are device pointers of live
        // allocations holding at least (ld x cols) elements of their types (checked by the
        // callers' shapes); alpha and beta are f32 (the compute type) on the host (`host`,
        // alive across the call) in host pointer mode, or device addresses of one f32 each
        // written before on this stream in device pointer mode (set just above); the output
        // does not alias the inputs.
        let r = unsafe {
            cublas_result::gemm_ex(
                *self.blas.handle(),
                op(trans_a),
                op(trans_b),
                m,
                n,
                k,
                alpha_p,
                a as *const c_void,
                a_ty,
                lda,
                b as *const c_void,
                b_ty,
                ldb,
                beta_p,
                c as *mut c_void,
                c_ty,
                ldc,
                cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| CceError::backend(BACKEND, e));
        if device {
            let restored =
                self.pointer_mode(cublas_sys::cublasPointerMode_t::CUBLAS_POINTER_MODE_HOST);
            r?;
            restored
        } else {
            r
        }
    }

    /// Set the cuBLAS handle's pointer mode (how `alpha` / `beta` are passed).
    fn pointer_mode(&self, mode: cublas_sys::cublasPointerMode_t) -> Result<()> {
        // SAFETY: the handle is live (held by self.blas) and this engine's alone; the mode
        // only changes how later calls on it read their scalars.
        unsafe { cublas_sys::cublasSetPointerMode_v2(*self.blas.handle(), mode) }
            .result()
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

    /// Row-major `d_e[rows, D] = alpha · G[rows, V] · C[V, D] + beta · d_e`: column-major
    /// `d_eᵀ[D, rows] = (C as [D, V]) · (G as [V, rows], stride ldg)`. `(alpha, beta)` host
    /// values (a tuple: `(1.0, 0.0)` overwrites, `(1.0, 1.0)` adds) or device addresses
    /// ([`GemmScalars`]).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_de(
        &self,
        (v, d, rows): (usize, usize, usize),
        (dtype, g_ty, out_ty): (DType, DType, DType),
        (c, g, de): (u64, u64, u64),
        ldg: usize,
        scalars: impl Into<GemmScalars>,
    ) -> Result<()> {
        self.gemm_with(
            false,
            false,
            (d, rows, v),
            (c, dtype, d),
            (g, g_ty, ldg),
            scalars.into(),
            (de, out_ty, d),
        )
    }

    /// Row-major `d_c[V, D] = alpha · G[rows, V]ᵀ · E[rows, D] + beta · d_c`: column-major
    /// `d_cᵀ[D, V] = (E as [D, rows]) · op_T(G as [V, rows], stride ldg)`. `dtype` is the type
    /// of `E`; `(alpha, beta)` host values (a tuple) or device addresses ([`GemmScalars`]).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_dc(
        &self,
        (v, d, rows): (usize, usize, usize),
        (dtype, g_ty, acc_ty): (DType, DType, DType),
        (e, g, dc): (u64, u64, u64),
        ldg: usize,
        scalars: impl Into<GemmScalars>,
    ) -> Result<()> {
        self.gemm_with(
            false,
            true,
            (d, v, rows),
            (e, dtype, d),
            (g, g_ty, ldg),
            scalars.into(),
            (dc, acc_ty, d),
        )
    }

    /// Copy the first `N` bytes of a small device buffer to the host and wait for them (one
    /// host sync). Bytes, not typed values: a host byte array has no alignment to cast from.
    pub(super) fn read_back<const N: usize>(&self, s: &CudaSlice<u8>) -> Result<[u8; N]> {
        let mut host = [0u8; N];
        self.stream
            .memcpy_dtoh(&s.slice(0..N), &mut host[..])
            .map_err(drv)?;
        self.stream.synchronize().map_err(drv)?;
        Ok(host)
    }
}

/// A kernel's parameter struct and its [`KernelParams`] impl from one list of fields, in the
/// order of the kernel's parameter list: `push` pushes them in the order they are declared,
/// so the struct is the one place that order is written; call sites fill it by name.
macro_rules! kernel_params {
    ($(#[$meta:meta])* $name:ident { $($(#[$fmeta:meta])* $field:ident: $ty:ty),+ $(,)? }) => {
        $(#[$meta])*
        pub(super) struct $name {
            $($(#[$fmeta])* pub(super) $field: $ty),+
        }

        impl KernelParams for $name {
            fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>) {
                $(b.arg(&self.$field);)+
            }
        }
    };
}
pub(super) use kernel_params;

/// A kernel's parameters as one typed value: `push` adds them to a launch in the order of the
/// kernel's parameter list (the `*_PARAMS` macro of its `.cu` file).
pub(super) trait KernelParams {
    /// Push every parameter, in order.
    fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>);
}

impl DenseEngine {
    /// Launch `f` on `stream` with `params` over the grid `cfg`.
    ///
    /// # Safety
    /// `params` is the parameter struct written for `f`'s kernel (its `push` matches the
    /// kernel's parameter list in types and order); every device address in it is a live
    /// buffer holding at least what the kernel reads or writes over `cfg`'s grid, written
    /// before on `stream` (or ordered before it by an event) where the kernel reads it; `cfg`
    /// is within the kernel's launch bounds, and its dynamic shared memory within the
    /// function's attribute.
    pub(super) unsafe fn launch_params<P: KernelParams>(
        &self,
        stream: &CudaStream,
        f: &CudaFunction,
        cfg: LaunchConfig,
        params: &P,
    ) -> Result<()> {
        let mut b = stream.launch_builder(f);
        params.push(&mut b);
        // SAFETY: the caller's contract (this function's # Safety): the arguments match the
        // kernel and every buffer they name is live and large enough for the grid.
        unsafe { b.launch(cfg) }.map_err(drv)?;
        Ok(())
    }
}
