//! Helpers of the WGMMA tests (`tests/wgmma.rs`, `tests/wgmma_chunked.rs`): whether an
//! epilogue should run on this device, an elementwise closeness check, and the pair of
//! backends with the dense row pass through the WGMMA epilogue and through cuBLAS.

use cce_cuda::CudaBackend;

/// Whether a WGMMA epilogue should run on this device (sm_90a); says so on stderr for `test`
/// when not.
pub fn epilogue_expected(be: &CudaBackend, test: &str) -> bool {
    let expected = be.arch() == "sm_90a";
    if !expected {
        eprintln!("{test}: {}: only the fallback is checked", be.arch());
    }
    expected
}

/// |a_i − b_i| ≤ tol · max |b| elementwise.
pub fn close_max(what: &str, a: &[f64], b: &[f64], tol: f64) {
    assert_eq!(a.len(), b.len(), "{what}: length");
    let scale = b.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-30);
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= tol * scale,
            "{what}: [{i}] {x} vs {y} (max {scale})"
        );
    }
}

/// Two backends of `strategy` with chunks capped at `cap` (rows, classes) and `tune` applied:
/// the dense row pass through the WGMMA epilogue, and the cuBLAS row pass (switch off).
pub fn row_pass_pair(
    strategy: cce_core::StrategyKind,
    (rows, classes): (usize, usize),
    tune: impl Fn(CudaBackend) -> CudaBackend,
) -> (CudaBackend, CudaBackend) {
    let make = |on: bool| {
        let be = CudaBackend::new(0)
            .unwrap()
            .with_strategies(&[strategy])
            .unwrap()
            .with_chunk_cap(rows, classes)
            .unwrap();
        tune(be).with_wgmma_rows(on)
    };
    (make(true), make(false))
}

/// |a_i − b_i| ≤ tol · (1 + |b_i|) per row.
pub fn close_rows(what: &str, a: &[f64], b: &[f64], tol: f64) {
    assert_eq!(a.len(), b.len(), "{what}: length");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= tol * (1.0 + y.abs()),
            "{what}: row {i}: {x} vs {y}"
        );
    }
}
