//! Compiled kernels, cached for the process: one NVRTC pipeline and one module cache.
//!
//! Every kernel source of the crate (the tile kernels of [`crate::kernels`], the dense engine's
//! the dense kernel files + `wgmma.cu` of [`crate::dense`]) goes through `compile_cached`: NVRTC
//! compiles it once per (source, architecture) and process to a CUBIN, which is also kept in a
//! disk cache (`CCE_CUDA_CACHE_DIR`, default `$TMPDIR/cce-cuda-kernels`, the crate's only
//! environment variable) keyed by a hash of the source, the options and the NVRTC version, so
//! later processes skip the compile. `module` loads a CUBIN into a context once per
//! (context, source, architecture) and process: a backend made per call
//! ([`crate::CudaBackend::on_stream`]) finds its modules loaded and only looks up its functions.
//!
//! The module cache holds its contexts (`Arc<CudaContext>`, the device's primary context) for
//! the rest of the process, so a cached module never outlives the context it was loaded into.
//!
//! The dense engine's cuBLAS handles and their workspaces come from a pool per context
//! (`pooled_blas`): an engine borrows one for its life and gives it back fenced by an event.

use cce_core::{CceError, Result};
use cudarc::driver::{CudaContext, CudaModule};
use cudarc::nvrtc::{result as nvrtc_result, sys as nvrtc_sys};
use std::collections::HashMap;
use std::ffi::{c_char, CStr, CString};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex, OnceLock};

const BACKEND: &str = "cuda";

/// A kernel source of the crate: a short tag (names the disk-cache file and the module) and
/// the whole translation unit.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Source {
    /// `"cce"` (tile kernels) or `"cce-dense"` (the dense engine).
    pub tag: &'static str,
    /// The translation unit, built on first use.
    pub text: fn() -> String,
}

/// NVRTC options for an architecture such as `sm_90a` (the same for every source).
pub fn compile_options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        "-lineinfo".into(),
    ]
}

/// NVRTC's architecture name for a compute capability: `sm_90a` on Hopper (9.0, where `a`
/// enables wgmma, setmaxnreg and TMA), `sm_{major}{minor}` elsewhere.
pub fn arch_of(major: i32, minor: i32) -> String {
    if (major, minor) == (9, 0) {
        "sm_90a".to_string()
    } else {
        format!("sm_{major}{minor}")
    }
}

/// Whether libnvrtc can be loaded (checked before any NVRTC call: cudarc panics otherwise).
/// `Err` carries the reason.
pub fn nvrtc_available() -> std::result::Result<(), String> {
    if crate::libs::present("nvrtc") {
        Ok(())
    } else {
        Err(
            "libnvrtc (CUDA 13, libnvrtc.so.13) could not be loaded; install the CUDA 13 NVRTC \
             library or the nvidia-cuda-nvrtc==13.0.48 wheel and add its lib folder to \
             LD_LIBRARY_PATH"
                .into(),
        )
    }
}

fn no_nvrtc() -> Result<()> {
    nvrtc_available().map_err(|reason| CceError::NoDevice {
        backend: BACKEND,
        reason,
    })
}

/// NVRTC version `(major, minor)`. Errors: `NoDevice` without libnvrtc.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    no_nvrtc()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present (checked above); both pointers are valid for writes.
    let rc = unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) };
    rc.result().map_err(|e| CceError::backend(BACKEND, e))?;
    Ok((major, minor))
}

/// A failed NVRTC compile: the compiler's log and the options.
#[derive(Debug)]
pub struct CompileFailure {
    /// The source's file name (`cce_kernels.cu`, `dense.cu`).
    pub file: String,
    /// Options passed to NVRTC (the architecture among them).
    pub options: Vec<String>,
    /// NVRTC's log (errors with line numbers of the concatenated source).
    pub log: String,
}

impl std::fmt::Display for CompileFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NVRTC failed to compile {} (options {:?}):\n{}",
            self.file, self.options, self.log
        )
    }
}

impl std::error::Error for CompileFailure {}

/// Compile `source` (named `file` in NVRTC's log) with `options` to a CUBIN, without any
/// cache. Errors: `NoDevice` without libnvrtc, `Backend` with a [`CompileFailure`] (the
/// compiler log) when it does not compile.
pub fn nvrtc_compile(source: &str, file: &str, options: &[String]) -> Result<Vec<u8>> {
    no_nvrtc()?;
    let be = |e: nvrtc_result::NvrtcError| CceError::backend(BACKEND, e);
    let src = CString::new(source).map_err(|e| CceError::backend(BACKEND, e))?;
    let name = CString::new(file).map_err(|e| CceError::backend(BACKEND, e))?;
    let prog = nvrtc_result::create_program(&src, Some(&name)).map_err(be)?;
    struct Guard(nvrtc_sys::nvrtcProgram);
    impl Drop for Guard {
        fn drop(&mut self) {
            // SAFETY: the program was created above and is destroyed exactly once, here.
            let _ = unsafe { nvrtc_result::destroy_program(self.0) };
        }
    }
    let g = Guard(prog);
    // SAFETY: `g.0` is a live program; the options are plain strings cudarc turns into C strings.
    if let Err(e) = unsafe { nvrtc_result::compile_program(g.0, options) } {
        // SAFETY: live program; NVRTC NUL-terminates the log it sized.
        let log = unsafe { nvrtc_result::get_program_log(g.0) }
            .map(|raw| {
                // SAFETY: `raw` holds the NUL-terminated log written by NVRTC.
                unsafe { CStr::from_ptr(raw.as_ptr() as *const c_char) }
                    .to_string_lossy()
                    .into_owned()
            })
            .unwrap_or_else(|_| format!("(no log: {e:?})"));
        return Err(CceError::backend(
            BACKEND,
            CompileFailure {
                file: file.to_string(),
                options: options.to_vec(),
                log,
            },
        ));
    }
    let mut size = 0usize;
    // SAFETY: live, successfully compiled program; `size` is a valid out pointer.
    unsafe { nvrtc_sys::nvrtcGetCUBINSize(g.0, &mut size) }
        .result()
        .map_err(be)?;
    let mut cubin = vec![0u8; size];
    // SAFETY: the buffer holds exactly the size NVRTC reported.
    unsafe { nvrtc_sys::nvrtcGetCUBIN(g.0, cubin.as_mut_ptr() as *mut c_char) }
        .result()
        .map_err(be)?;
    Ok(cubin)
}

fn poisoned<T>(_: T) -> CceError {
    CceError::backend(BACKEND, "kernel cache lock poisoned")
}

/// The folder of the disk cache: `CCE_CUDA_CACHE_DIR`, else `$TMPDIR/cce-cuda-kernels`.
fn cache_dir() -> std::path::PathBuf {
    std::env::var_os("CCE_CUDA_CACHE_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("cce-cuda-kernels"))
}

/// The CUBIN of `source` for `arch`, through the process cache and the disk cache (module
/// docs). Errors: those of [`nvrtc_compile`].
pub(crate) fn compile_cached(source: Source, arch: &str) -> Result<Arc<Vec<u8>>> {
    type Cubins = HashMap<(&'static str, String), Arc<Vec<u8>>>;
    static CUBINS: OnceLock<Mutex<Cubins>> = OnceLock::new();
    let cubins = CUBINS.get_or_init(Default::default);
    let key = (source.tag, arch.to_string());
    if let Some(c) = cubins.lock().map_err(poisoned)?.get(&key) {
        return Ok(c.clone());
    }
    let version = nvrtc_version()?;
    let text = (source.text)();
    let options = compile_options(arch);
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (&text, &options, version).hash(&mut h);
    let file = format!("{}-{arch}-{:016x}.cubin", source.tag, h.finish());
    let dir = cache_dir();
    let path = dir.join(&file);
    let cubin = match std::fs::read(&path) {
        Ok(bytes) if !bytes.is_empty() => bytes,
        _ => {
            let bytes = nvrtc_compile(&text, &format!("{}.cu", source.tag), &options)?;
            // The disk cache is best effort: a read-only or missing folder only costs a compile.
            if std::fs::create_dir_all(&dir).is_ok() {
                let tmp = dir.join(format!("{file}.{}", std::process::id()));
                if std::fs::write(&tmp, &bytes).is_ok() {
                    let _ = std::fs::rename(&tmp, &path);
                }
            }
            bytes
        }
    };
    let cubin = Arc::new(cubin);
    cubins.lock().map_err(poisoned)?.insert(key, cubin.clone());
    Ok(cubin)
}

/// `source` compiled for `arch` and loaded into `ctx`, once per (context, source, arch) and
/// process. Errors: those of [`compile_cached`]; `Backend` when the driver refuses the CUBIN.
pub(crate) fn module(
    ctx: &Arc<CudaContext>,
    source: Source,
    arch: &str,
) -> Result<Arc<CudaModule>> {
    type Modules = HashMap<(usize, &'static str, String), (Arc<CudaContext>, Arc<CudaModule>)>;
    static MODULES: OnceLock<Mutex<Modules>> = OnceLock::new();
    let modules = MODULES.get_or_init(Default::default);
    let key = (ctx.cu_ctx() as usize, source.tag, arch.to_string());
    // Held across the load, so two threads making their first backend load a module once.
    let mut map = modules.lock().map_err(poisoned)?;
    if let Some((_, m)) = map.get(&key) {
        return Ok(m.clone());
    }
    let cubin = compile_cached(source, arch)?;
    let m = ctx
        .load_module(cudarc::nvrtc::Ptx::from_binary(cubin.to_vec()))
        .map_err(|e| CceError::backend(BACKEND, e))?;
    map.insert(key, (ctx.clone(), m.clone()));
    Ok(m)
}

/// A cuBLAS handle and its workspace, lent from a per-context pool for as long as a dense
/// engine lives: a backend made per call takes the handle the previous one gave back instead
/// of creating one (and allocating its workspace) per call.
///
/// Taking a handle points it at the taker's stream, which first waits for an event recorded
/// on the previous user's stream when it was given back, so the workspace is never used by
/// two streams at once. The pool keeps, per context and for the process, as many handles
/// (each with its workspace) as engines were alive at once.
pub(crate) struct PooledBlas {
    entry: Option<BlasEntry>,
    key: usize,
}

struct BlasEntry {
    blas: cudarc::cublas::CudaBlas,
    /// The stream the handle is on while lent.
    stream: Arc<cudarc::driver::CudaStream>,
    /// The workspace (never freed while pooled: the pool lives for the process).
    _ws: cudarc::driver::CudaSlice<u8>,
    ws_ptr: u64,
    ws_bytes: usize,
    /// Recorded on the last user's stream after its work, when the handle was given back.
    ready: Option<cudarc::driver::CudaEvent>,
}

type BlasPool = HashMap<usize, Vec<BlasEntry>>;

fn blas_pool() -> &'static Mutex<BlasPool> {
    static POOL: OnceLock<Mutex<BlasPool>> = OnceLock::new();
    POOL.get_or_init(Default::default)
}

fn blas_err(e: cudarc::cublas::result::CublasError) -> CceError {
    CceError::backend(BACKEND, e)
}

/// A cuBLAS handle on `stream` with a workspace of `ws_bytes`, from the pool of `stream`'s
/// context or new. Errors: `Backend` (cuBLAS, driver), `OutOfMemory` for a new workspace.
pub(crate) fn pooled_blas(
    stream: &Arc<cudarc::driver::CudaStream>,
    ws_bytes: usize,
) -> Result<PooledBlas> {
    use cudarc::driver::DevicePtr;
    let key = stream.context().cu_ctx() as usize;
    let taken = blas_pool()
        .lock()
        .map_err(poisoned)?
        .get_mut(&key)
        .and_then(|v| {
            let i = v.iter().position(|e| e.ws_bytes == ws_bytes)?;
            Some(v.swap_remove(i))
        });
    let entry = match taken {
        Some(mut e) => {
            // A completed event needs no wait (and a stream capturing a CUDA graph may not
            // wait on work recorded outside the capture). The query is a call a capture in
            // the global mode (PyTorch's default) forbids: made in the relaxed mode.
            if let Some(ev) = e.ready.take() {
                let pending = {
                    let _relaxed = RelaxedCapture::enter()?;
                    !ev.is_complete()
                };
                if pending {
                    stream
                        .wait(&ev)
                        .map_err(|err| CceError::backend(BACKEND, err))?;
                }
            }
            // SAFETY: the handle is this engine's alone (taken out of the pool), and `stream`
            // waits for the work its previous user enqueued (the event above).
            unsafe { e.blas.set_stream(stream.clone()) }.map_err(blas_err)?;
            e.stream = stream.clone();
            e
        }
        None => {
            // A handle made while `stream` captures a CUDA graph (a caller's first call on its
            // capture stream): its creation and workspace must stay outside the graph, since
            // the pool lends them to later calls. The workspace is then allocated on a stream
            // of its own (a stream-ordered allocation on the capturing stream would become a
            // memory node of the graph, remapped by its replays) and waited for; cuBLAS's own
            // setup allocations are allowed by the relaxed capture mode.
            use cudarc::driver::sys::CUstreamCaptureStatus as Capture;
            let capturing = !matches!(
                stream.capture_status(),
                Ok(Capture::CU_STREAM_CAPTURE_STATUS_NONE)
            );
            let _relaxed = if capturing {
                Some(RelaxedCapture::enter()?)
            } else {
                None
            };
            let alloc_stream = if capturing {
                stream
                    .context()
                    .new_stream()
                    .map_err(|e| CceError::backend(BACKEND, e))?
            } else {
                stream.clone()
            };
            let blas = cudarc::cublas::CudaBlas::new(stream.clone()).map_err(blas_err)?;
            // SAFETY: cuBLAS only uses the workspace as scratch; it writes before it reads.
            let ws = unsafe { alloc_stream.alloc::<u8>(ws_bytes) }.map_err(|e| {
                if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                    CceError::OutOfMemory {
                        backend: BACKEND,
                        requested_bytes: ws_bytes as u64,
                    }
                } else {
                    CceError::backend(BACKEND, e)
                }
            })?;
            if capturing {
                alloc_stream
                    .synchronize()
                    .map_err(|e| CceError::backend(BACKEND, e))?;
            }
            // The pointer read on the allocating stream: no wait of `stream` on an event
            // recorded outside its capture.
            let ws_ptr = ws.device_ptr(&alloc_stream).0;
            BlasEntry {
                blas,
                stream: stream.clone(),
                _ws: ws,
                ws_ptr,
                ws_bytes,
                ready: None,
            }
        }
    };
    // cublasSetStream resets the handle's workspace to cuBLAS's own: set ours after it.
    // SAFETY: the handle is live; the workspace is a device allocation of `ws_bytes` that
    // lives as long as the entry (the pool never frees it).
    unsafe {
        cudarc::cublas::sys::cublasSetWorkspace_v2(
            *entry.blas.handle(),
            entry.ws_ptr as *mut std::ffi::c_void,
            ws_bytes,
        )
    }
    .result()
    .map_err(blas_err)?;
    Ok(PooledBlas {
        entry: Some(entry),
        key,
    })
}

/// While alive, this thread's stream-capture mode is relaxed
/// (`cuThreadExchangeStreamCaptureMode`): calls that a capture in the global or thread-local
/// mode forbids (a query of an event recorded outside the capture, setup calls such as
/// loading a kernel) are allowed, as they are outside a capture. Dropping it restores the
/// thread's previous mode. For a library call made while its caller captures a graph
/// (PyTorch's `torch.cuda.graph` captures in the global mode).
pub struct RelaxedCapture {
    previous: cudarc::driver::sys::CUstreamCaptureMode,
}

impl RelaxedCapture {
    /// Relax this thread's capture mode until the guard is dropped. Errors: `Backend` for a
    /// driver error.
    pub fn enter() -> Result<Self> {
        let mut mode = cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: `mode` is a valid, writable mode value; the call swaps it with the thread's.
        unsafe { cudarc::driver::sys::cuThreadExchangeStreamCaptureMode(&mut mode) }
            .result()
            .map_err(|e| CceError::backend(BACKEND, e))?;
        Ok(Self { previous: mode })
    }
}

impl Drop for RelaxedCapture {
    fn drop(&mut self) {
        let mut mode = self.previous;
        // SAFETY: as in `enter`; restores the mode this guard replaced.
        let _ = unsafe { cudarc::driver::sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
    }
}

impl PooledBlas {
    /// The cuBLAS handle (on the stream it was lent for).
    pub(crate) fn handle(&self) -> &cudarc::cublas::sys::cublasHandle_t {
        // The entry is taken only by Drop.
        match &self.entry {
            Some(e) => e.blas.handle(),
            None => unreachable!("a PooledBlas holds its entry until dropped"),
        }
    }
}

impl Drop for PooledBlas {
    fn drop(&mut self) {
        let Some(mut e) = self.entry.take() else {
            return;
        };
        let stream = e.stream.clone();
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING);
        // A handle whose last work cannot be fenced is destroyed instead of pooled. Work
        // captured in a CUDA graph is not fenced (an event recorded in a capture cannot be
        // queried): it runs when the graph is replayed, and a replay must be ordered with the
        // library's other calls on the context like any of them.
        use cudarc::driver::sys::CUstreamCaptureStatus as Capture;
        match stream.capture_status() {
            Ok(Capture::CU_STREAM_CAPTURE_STATUS_NONE) => {
                let Ok(ev) = stream.record_event(flags) else {
                    return;
                };
                e.ready = Some(ev);
            }
            Ok(_) => e.ready = None,
            Err(_) => return,
        }
        // Point the handle at the legacy default stream while pooled, so that it holds no
        // reference to the caller's stream (a borrowed one may be destroyed meanwhile).
        let idle = stream.context().default_stream();
        // SAFETY: no work is enqueued through the handle until it is taken again, and taking
        // it sets the taker's stream first.
        if unsafe { e.blas.set_stream(idle.clone()) }.is_err() {
            return;
        }
        e.stream = idle;
        if let Ok(mut pool) = blas_pool().lock() {
            pool.entry(self.key).or_default().push(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arch_names() {
        assert_eq!(arch_of(9, 0), "sm_90a");
        assert_eq!(arch_of(8, 0), "sm_80");
        assert_eq!(arch_of(8, 9), "sm_89");
        assert!(compile_options("sm_80").contains(&"--gpu-architecture=sm_80".to_string()));
    }
}
