//! CPU-only: every kernel of the backend's own module compiles with NVRTC for sm_90a and sm_80
//! (the architectures the crate supports) through the backend's own code path.
//! Skips (with a message) when libnvrtc cannot be loaded, unless CCE_REQUIRE_NVRTC=1 (CI),
//! where a missing NVRTC fails.

use cce_cuda::kernels;

#[test]
fn every_kernel_compiles_for_sm_90a_and_sm_80() {
    if let Err(reason) = kernels::nvrtc_available() {
        if std::env::var("CCE_REQUIRE_NVRTC").as_deref() == Ok("1") {
            panic!("CCE_REQUIRE_NVRTC=1 but NVRTC is missing: {reason}");
        }
        eprintln!("skipping every_kernel_compiles_for_sm_90a_and_sm_80: {reason}");
        return;
    }
    let (major, minor) = kernels::nvrtc_version().unwrap();
    let source = kernels::kernel_source();
    for arch in ["sm_90a", "sm_80"] {
        let t0 = std::time::Instant::now();
        let cubin = kernels::compile_uncached(&source, arch, &kernels::compile_options(arch))
            .unwrap_or_else(|e| panic!("{arch}: {e}"));
        eprintln!(
            "NVRTC {major}.{minor}: {} kernels compiled for {arch} in {:.1} s, CUBIN {} bytes",
            kernels::KERNEL_SYMBOLS.len(),
            t0.elapsed().as_secs_f64(),
            cubin.len()
        );
        assert_eq!(&cubin[..4], b"\x7fELF", "NVRTC output is not a CUBIN (ELF)");
        for sym in kernels::KERNEL_SYMBOLS {
            let needle = format!("{sym}\0");
            assert!(
                cubin.windows(needle.len()).any(|w| w == needle.as_bytes()),
                "{arch}: symbol {sym} missing from the CUBIN"
            );
        }
    }
    // Every kernel file opens with its documentation block.
    for (name, text) in kernels::KERNEL_FILES {
        for section in ["Parameters", "Tiling", "Thread mapping"] {
            assert!(text.contains(section), "{name} lacks a '{section}' section");
        }
    }
}

#[test]
fn a_broken_kernel_reports_the_compiler_log() {
    if kernels::nvrtc_available().is_err() {
        eprintln!("skipping a_broken_kernel_reports_the_compiler_log: NVRTC missing");
        return;
    }
    let err = kernels::compile_uncached(
        "extern \"C\" __global__ void k() { undefined_symbol(); }",
        "sm_90a",
        &kernels::compile_options("sm_90a"),
    )
    .unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("undefined_symbol"), "{msg}");
}

/// Fill the on-disk kernel cache (`CCE_CUDA_CACHE_DIR`) through the backend's cached path, so a
/// device run can carry the CUBIN instead of compiling (scripts/device-cuda.sh uses it).
#[test]
fn fill_kernel_cache() {
    if kernels::nvrtc_available().is_err() || std::env::var_os("CCE_CUDA_CACHE_DIR").is_none() {
        eprintln!("skipping fill_kernel_cache: NVRTC missing or CCE_CUDA_CACHE_DIR unset");
        return;
    }
    let cubin = kernels::compile_cubin("sm_90a").unwrap_or_else(|e| panic!("{e}"));
    assert!(!cubin.is_empty());
}
