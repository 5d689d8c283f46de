//! CPU-only: the dense engine's kernels (`dense::KERNEL_SOURCE`) compile with NVRTC for sm_90a
//! (with the cluster-fused kernels) and sm_80 (without), through the engine's own code path.
//! Skips when libnvrtc cannot be loaded, unless CCE_REQUIRE_NVRTC=1 (CI).

use cce_cuda::dense::{compile_options, compile_uncached, CLUSTER_SIZES, KERNEL_SOURCE};

fn nvrtc_present(test: &str) -> bool {
    if cce_cuda::kernels::nvrtc_available().is_ok() {
        return true;
    }
    if std::env::var("CCE_REQUIRE_NVRTC").as_deref() == Ok("1") {
        panic!("CCE_REQUIRE_NVRTC=1 but NVRTC is missing");
    }
    eprintln!("skipping {test}: NVRTC missing");
    false
}

fn has_symbol(cubin: &[u8], sym: &str) -> bool {
    let needle = format!("{sym}\0");
    cubin.windows(needle.len()).any(|w| w == needle.as_bytes())
}

#[test]
fn chunked_kernels_compile_for_sm_90a_and_sm_80() {
    if !nvrtc_present("chunked_kernels_compile_for_sm_90a_and_sm_80") {
        return;
    }
    for arch in ["sm_90a", "sm_80"] {
        let t0 = std::time::Instant::now();
        let cubin = compile_uncached(KERNEL_SOURCE, &compile_options(arch))
            .unwrap_or_else(|e| panic!("{arch}: {e}"));
        eprintln!(
            "chunked.cu for {arch}: {} bytes in {:.1} s",
            cubin.len(),
            t0.elapsed().as_secs_f64()
        );
        assert_eq!(&cubin[..4], b"\x7fELF");
        for sym in [
            "cce_split_e_to_f16_bf16",
            "cce_split_scales_finish",
            "cce_dense_bwd_f16s_f16",
            "cce_dense_bwd_f16s_bf16",
            "cce_dense_target_fix_f16",
            "cce_dense_target_fix_bf16",
        ] {
            assert!(has_symbol(&cubin, sym), "{arch}: {sym} missing");
        }
        for dt in ["f32", "f16", "bf16"] {
            for k in ["fwd", "bwd", "colsum", "randn"] {
                let sym = format!("cce_dense_{k}_{dt}");
                assert!(has_symbol(&cubin, &sym), "{arch}: {sym} missing");
            }
            for k in ["scales", "gcols", "de_finish"] {
                let sym = format!("cce_split_{k}_{dt}");
                assert!(has_symbol(&cubin, &sym), "{arch}: {sym} missing");
            }
            for cs in CLUSTER_SIZES {
                let sym = format!("cce_dense_fused_{dt}_c{cs}");
                assert_eq!(has_symbol(&cubin, &sym), arch == "sm_90a", "{arch}: {sym}");
            }
            // The WGMMA kernels (wgmma.cu): sm_90a only, 16-bit inputs only.
            for k in ["lse", "lse_x", "lse_combine", "gcols", "gcols_cap"] {
                let sym = format!("cce_wgmma_{k}_{dt}");
                let want = arch == "sm_90a" && dt != "f32";
                assert_eq!(has_symbol(&cubin, &sym), want, "{arch}: {sym}");
            }
            // Split dense's WGMMA row pass: bf16 only.
            for k in ["lseq", "lseq_x", "qrows_g", "qrows_g_cap"] {
                let sym = format!("cce_wgmma_{k}_{dt}");
                let want = arch == "sm_90a" && dt == "bf16";
                assert_eq!(has_symbol(&cubin, &sym), want, "{arch}: {sym}");
            }
        }
    }
    for section in ["Parameters", "Tiling", "Thread mapping"] {
        assert!(
            KERNEL_SOURCE[..1500].contains(section),
            "chunked.cu does not open with a '{section}' section"
        );
    }
}
