//! Kernel sources and their NVRTC compilation.
//!
//! The kernels are CUDA C files under `crates/cce-cuda/kernels/`, embedded with `include_str!`
//! and concatenated into one translation unit (`common.cuh` first). NVRTC compiles it to a
//! CUBIN for the device's architecture (`sm_90a` on H100/H200, where `a` enables the
//! architecture-specific instructions), through the crate's one NVRTC pipeline and its process
//! and disk caches ([`crate::device`]).
//!
//! No CUDA header is needed: 16-bit floats are carried as `unsigned short` and converted with
//! bit shifts or `cvt` PTX, tensor-core products use `mma.sync` / `ldmatrix` PTX.

use cce_core::CceError;

/// The kernel files, in the order they are concatenated: the backend's own module holds the
/// call's device-side preparation and checks (`prepare.cu`) and the data generators (the
/// loss runs in [`crate::dense`]'s module).
pub const KERNEL_FILES: &[(&str, &str)] = &[
    ("common.cuh", include_str!("../kernels/common.cuh")),
    ("util.cu", include_str!("../kernels/util.cu")),
    ("prepare.cu", include_str!("../kernels/prepare.cu")),
];

/// Every `extern "C"` kernel symbol of the module (loaded at backend construction).
pub const KERNEL_SYMBOLS: &[&str] = &[
    "cce_fill_randn_f32",
    "cce_fill_randn_f16",
    "cce_fill_randn_bf16",
    "cce_fill_targets",
    "cce_prepare_targets_i32",
    "cce_prepare_targets_i64",
    "cce_prepare_bias_masked",
    "cce_check_rows_finite",
    "cce_prepare_finish",
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

pub use crate::device::{compile_options, nvrtc_available, nvrtc_version, CompileFailure};

/// This module's source for the process caches of [`crate::device`].
pub(crate) const SOURCE: crate::device::Source = crate::device::Source {
    tag: "cce",
    text: kernel_source,
};

/// Compile every kernel for `arch` (e.g. `sm_90a`) to a CUBIN with NVRTC, through the process
/// and disk caches ([`crate::device`]). Errors: `NoDevice` when libnvrtc is missing, `Backend`
/// with the compiler log when a kernel does not compile.
pub fn compile_cubin(arch: &str) -> Result<Vec<u8>, CceError> {
    Ok(crate::device::compile_cached(SOURCE, arch)?.to_vec())
}

/// Compile without any cache (the CPU-only compile test); the architecture is the one named
/// in `options` ([`compile_options`]).
pub fn compile_uncached(
    source: &str,
    _arch: &str,
    options: &[String],
) -> Result<Vec<u8>, CceError> {
    crate::device::nvrtc_compile(source, "cce_kernels.cu", options)
}
