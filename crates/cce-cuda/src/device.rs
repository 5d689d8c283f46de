//! Compiled kernels, cached for the process: one NVRTC pipeline and one module cache.
//!
//! Every kernel source of the crate (the tile kernels of [`crate::kernels`], the dense engine's
//! `chunked.cu` + `wgmma.cu` of [`crate::chunked`]) goes through `compile_cached`: NVRTC
//! compiles it once per (source, architecture) and process to a CUBIN, which is also kept in a
//! disk cache (`CCE_CUDA_CACHE_DIR`, default `$TMPDIR/cce-cuda-kernels`, the crate's only
//! environment variable) keyed by a hash of the source, the options and the NVRTC version, so
//! later processes skip the compile. `module` loads a CUBIN into a context once per
//! (context, source, architecture) and process: a backend made per call
//! ([`crate::CudaBackend::on_stream`]) finds its modules loaded and only looks up its functions.
//!
//! The module cache holds its contexts (`Arc<CudaContext>`, the device's primary context) for
//! the rest of the process, so a cached module never outlives the context it was loaded into.

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
    /// The source's file name (`cce_kernels.cu`, `chunked.cu`).
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
