//! Kernel sources and their NVRTC compilation.
//!
//! The kernels are CUDA C files under `crates/cce-cuda/kernels/`, embedded with `include_str!`
//! and concatenated into one translation unit (`common.cuh` first). NVRTC compiles it to a
//! CUBIN for the device's architecture (`sm_90a` on H100/H200, where `a` enables the
//! architecture-specific instructions), once per architecture and process; the CUBIN is also
//! kept in a disk cache (`CCE_CUDA_CACHE_DIR`, default `$TMPDIR/cce-cuda-kernels`) keyed by a
//! hash of the source, the options and the NVRTC version, so later processes skip the compile.
//!
//! No CUDA header is needed: 16-bit floats are carried as `unsigned short` and converted with
//! bit shifts or `cvt` PTX, tensor-core products use `mma.sync` / `ldmatrix` PTX.

use cce_core::CceError;
use cudarc::nvrtc::{result as nvrtc_result, sys as nvrtc_sys};
use std::collections::HashMap;
use std::ffi::{c_char, CStr, CString};
use std::hash::{Hash, Hasher};
use std::sync::{Mutex, OnceLock};

/// The kernel files, in the order they are concatenated: the backend's own module holds the
/// device-side data generators only (the loss runs in [`crate::chunked`]'s module).
pub const KERNEL_FILES: &[(&str, &str)] = &[
    ("common.cuh", include_str!("../kernels/common.cuh")),
    ("util.cu", include_str!("../kernels/util.cu")),
];

/// Every `extern "C"` kernel symbol of the module (loaded at backend construction).
pub const KERNEL_SYMBOLS: &[&str] = &[
    "cce_fill_randn_f32",
    "cce_fill_randn_f16",
    "cce_fill_randn_bf16",
    "cce_fill_targets",
];

/// The whole translation unit handed to NVRTC.
pub fn kernel_source() -> String {
    let mut s = String::new();
    for (name, text) in KERNEL_FILES {
        s.push_str(&format!("// ---- {name} ----\n"));
        s.push_str(text);
        s.push('\n');
    }
    s
}

/// NVRTC options for an architecture such as `sm_90a`.
pub fn compile_options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        "-lineinfo".into(),
    ]
}

/// Whether libnvrtc can be loaded (checked before any NVRTC call: cudarc panics otherwise).
/// `Err` carries the reason.
pub fn nvrtc_available() -> Result<(), String> {
    // SAFETY: only tries to dlopen the library by its candidate names; no symbol is called.
    if unsafe { nvrtc_sys::is_culib_present() } {
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

/// NVRTC version `(major, minor)`.
pub fn nvrtc_version() -> Result<(i32, i32), CceError> {
    nvrtc_available().map_err(|reason| CceError::NoDevice {
        backend: "cuda",
        reason,
    })?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present (checked above); both pointers are valid for writes.
    let rc = unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) };
    rc.result().map_err(|e| CceError::backend("cuda", e))?;
    Ok((major, minor))
}

/// A failed NVRTC compile: the compiler's log and the options.
#[derive(Debug)]
pub struct CompileFailure {
    /// Architecture compiled for.
    pub arch: String,
    /// Options passed to NVRTC.
    pub options: Vec<String>,
    /// NVRTC's log (errors with line numbers of the concatenated source).
    pub log: String,
}

impl std::fmt::Display for CompileFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NVRTC failed to compile the cce kernels for {} (options {:?}):\n{}",
            self.arch, self.options, self.log
        )
    }
}

impl std::error::Error for CompileFailure {}

/// Compile every kernel for `arch` (e.g. `sm_90a`) to a CUBIN with NVRTC, through the process
/// and disk caches. Errors: `NoDevice` when libnvrtc is missing, `Backend` with the compiler
/// log when a kernel does not compile.
pub fn compile_cubin(arch: &str) -> Result<Vec<u8>, CceError> {
    static CACHE: OnceLock<Mutex<HashMap<String, Vec<u8>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(c) = cache.lock().map_err(poisoned)?.get(arch) {
        return Ok(c.clone());
    }
    let version = nvrtc_version()?;
    let source = kernel_source();
    let options = compile_options(arch);
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (&source, &options, version).hash(&mut h);
    let key = format!("cce-{arch}-{:016x}.cubin", h.finish());
    let dir = std::env::var_os("CCE_CUDA_CACHE_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("cce-cuda-kernels"));
    let path = dir.join(&key);
    let cubin = match std::fs::read(&path) {
        Ok(bytes) if !bytes.is_empty() => bytes,
        _ => {
            let bytes = compile_uncached(&source, arch, &options)?;
            // The disk cache is best effort: a read-only or missing folder only costs a compile.
            if std::fs::create_dir_all(&dir).is_ok() {
                let tmp = dir.join(format!("{key}.{}", std::process::id()));
                if std::fs::write(&tmp, &bytes).is_ok() {
                    let _ = std::fs::rename(&tmp, &path);
                }
            }
            bytes
        }
    };
    cache
        .lock()
        .map_err(poisoned)?
        .insert(arch.to_string(), cubin.clone());
    Ok(cubin)
}

fn poisoned<T>(_: T) -> CceError {
    CceError::backend("cuda", "kernel cache lock poisoned")
}

/// Compile without any cache (used by [`compile_cubin`] and the CPU-only compile test).
pub fn compile_uncached(source: &str, arch: &str, options: &[String]) -> Result<Vec<u8>, CceError> {
    nvrtc_available().map_err(|reason| CceError::NoDevice {
        backend: "cuda",
        reason,
    })?;
    let src = CString::new(source).map_err(|e| CceError::backend("cuda", e))?;
    let name = CString::new("cce_kernels.cu").map_err(|e| CceError::backend("cuda", e))?;
    let prog = nvrtc_result::create_program(&src, Some(&name))
        .map_err(|e| CceError::backend("cuda", e))?;
    struct Guard(nvrtc_sys::nvrtcProgram);
    impl Drop for Guard {
        fn drop(&mut self) {
            // SAFETY: the program was created by create_program and is destroyed exactly once.
            let _ = unsafe { nvrtc_result::destroy_program(self.0) };
        }
    }
    let guard = Guard(prog);
    // SAFETY: `prog` is a live program (guard); options are valid C strings built by cudarc.
    let compiled = unsafe { nvrtc_result::compile_program(guard.0, options) };
    if let Err(e) = compiled {
        // SAFETY: live program; the log is NUL-terminated by NVRTC.
        let log = unsafe { nvrtc_result::get_program_log(guard.0) }
            .map(|raw| {
                // SAFETY: NVRTC writes a NUL-terminated string into the buffer it sized.
                unsafe { CStr::from_ptr(raw.as_ptr() as *const c_char) }
                    .to_string_lossy()
                    .into_owned()
            })
            .unwrap_or_else(|_| format!("(no log: {e:?})"));
        return Err(CceError::backend(
            "cuda",
            CompileFailure {
                arch: arch.to_string(),
                options: options.to_vec(),
                log,
            },
        ));
    }
    let mut size = 0usize;
    // SAFETY: live, successfully compiled program; `size` is a valid out pointer.
    unsafe { nvrtc_sys::nvrtcGetCUBINSize(guard.0, &mut size) }
        .result()
        .map_err(|e| CceError::backend("cuda", e))?;
    let mut cubin = vec![0u8; size];
    // SAFETY: the buffer holds exactly the size NVRTC reported.
    unsafe { nvrtc_sys::nvrtcGetCUBIN(guard.0, cubin.as_mut_ptr() as *mut c_char) }
        .result()
        .map_err(|e| CceError::backend("cuda", e))?;
    Ok(cubin)
}
