//! The CUDA backend's switches: one explicit value that forces or disables its paths, set by
//! tests and benchmarks (the bench binaries from their command line); no environment variable
//! is read on a call's path.

use crate::backend::SparseMode;

/// Threads per block of the sparse backward's selection kernel, by default.
pub const SPARSE_SELECT_THREADS: u32 = 512;

/// Which paths the CUDA backend may take, and what it reports. [`CudaSwitches::default`] is
/// what a user wants: every fast path where it applies, no profiling. Set on a backend with
/// [`crate::CudaBackend::with_switches`]; each call's `CallStats::plan_reason` names the path
/// taken and the switch that disabled one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudaSwitches {
    /// How filtered split-dense calls use the plan's sparse backward. Default
    /// [`SparseMode::Auto`].
    pub sparse: SparseMode,
    /// Forward-only dense calls run the fused WGMMA forward (the logits GEMM with the
    /// log-sum-exp in its epilogue) where it applies (Hopper, bf16/f16, `D` a multiple of 64).
    /// Default `true`.
    pub wgmma_forward: bool,
    /// Split dense's class pass computes `G` in a WGMMA GEMM's epilogue where it applies.
    /// Default `true`.
    pub wgmma_gcols: bool,
    /// Split dense's row pass computes the lse partials and f16 `e^{z − m}` in a WGMMA GEMM's
    /// epilogue where it applies. Default `true`.
    pub wgmma_rows: bool,
    /// Split dense may compute `d_e` from f16 `G` where the budget holds an f16 copy of `c`;
    /// `false` forces bf16 `G` (what a tight budget does). Default `true`.
    pub split_de_f16: bool,
    /// Exact calls of bf16 inputs with f32 gradients may run chunked dense (3 GEMMs, `d_c`
    /// accumulated in the f32 output, nothing `V x D` in the workspace) where its row chunks
    /// are long (`dense::call_plan::chunked_f32_grads_pay`) even where `d_c` would come from
    /// bf16 `G` (0.13% on real rows; the `d_c` rows of confident rows' targets 2.6-3.5e-3 off
    /// against the 1e-3 per-row bound of f32 gradients). Without it such calls take chunked
    /// dense only where its WGMMA row pass runs (Hopper, 16-byte aligned inputs): `d_c` then
    /// comes from f16 `G` made from a 10-significant-bit q against an f16 copy of each chunk's
    /// `e` (real rows 0.015%; confident rows' targets' `d_c` rows 7.5e-4 to 1.1e-3 at margin 20,
    /// up to 2.3e-2 at margin 40 where those rows are sums of entries of e⁻⁴⁰; H200,
    /// docs/perf-log.md session 19),
    /// at 1.11-1.52x the 3-GEMM floor within 0.5 GiB against split dense's 1.50-1.73x.
    /// Default `false`.
    pub chunked_f32_grads: bool,
    /// Exact calls of bf16 inputs with bf16 gradients and `d_c` whose budget (less the cuBLAS
    /// workspace) cannot hold an f32 `V x D` accumulator run chunked dense, 3 GEMMs, with
    /// `d_c` accumulated across its row chunks in the caller's bf16 `d_c` (each chunk's
    /// product summed in f32, the running sum rounded to bf16 once per chunk: Liger's trade)
    /// instead of split dense's 4 GEMMs (`dense::call_plan::dc_in_grad_dtype`). Its error
    /// grows with the number of row chunks (`N` over ~`0.9·budget / (2·V)` rows per chunk
    /// on Hopper). Default `false`.
    pub dc_in_grad_dtype: bool,
    /// Print the device time per phase of the sparse backward and the dense passes to stderr
    /// (events on the stream, and a synchronization at the end of each pass). Default `false`.
    pub profile: bool,
    /// Threads per block of the sparse backward's selection: 512 (default) or 256. With 256
    /// the forward rows are not folded into the selection.
    pub sparse_select_threads: u32,
    /// The sparse backward of a forward-and-backward call folds the forward rows into its
    /// selection pass where it can. Default `true`; `false` runs them separately (benchmarks).
    pub sparse_fold_forward: bool,
    /// The dense engine allocates its workspace from its own memory pool, which keeps the
    /// memory mapped between calls (at most the largest workspace of one call; freed when the
    /// backend is dropped) instead of mapping it again on each call. Default `true`; `false`
    /// takes the stream's pool, which returns freed memory at each synchronization.
    pub keep_workspace: bool,
    /// Filtered forward-and-backward calls on Hopper (16-bit inputs, `D` a multiple of 64, no
    /// label smoothing, entropy or argmax, not accumulating, not under a graph capture) run the
    /// staircase (`dense/stair_pass.rs`: the classes by batch-mean logit, each row keeping a
    /// prefix of 256-class tiles within its dropped-mass budget, the rows sorted by it, dense
    /// GEMMs per class chunk over the rows that keep it; docs/perf-log.md sessions 23-24)
    /// instead of split dense: at once where the plan has no sparse try, else once the sparse
    /// try gave way (peaked rows finish in the sparse backward). Default `true`; `false` takes
    /// split dense (or the exact call's plan) after a sparse try that gave way.
    pub staircase: bool,
}

impl Default for CudaSwitches {
    fn default() -> Self {
        Self {
            sparse: SparseMode::Auto,
            wgmma_forward: true,
            wgmma_gcols: true,
            wgmma_rows: true,
            split_de_f16: true,
            chunked_f32_grads: false,
            dc_in_grad_dtype: false,
            profile: false,
            sparse_select_threads: SPARSE_SELECT_THREADS,
            sparse_fold_forward: true,
            keep_workspace: true,
            staircase: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_engines_defaults() {
        let s = CudaSwitches::default();
        assert_eq!(s.wgmma_forward, crate::dense::WGMMA_FORWARD_DEFAULT);
        assert_eq!(s.wgmma_gcols, crate::dense::WGMMA_GCOLS_DEFAULT);
        assert_eq!(s.wgmma_rows, crate::dense::WGMMA_ROWS_DEFAULT);
        assert!(!s.profile && s.sparse_fold_forward && s.split_de_f16 && !s.chunked_f32_grads);
    }

    /// Only the kernel cache's folder (`device.rs`) comes from the environment.
    #[test]
    fn no_environment_variable_is_read_on_a_call_path() {
        let needle = concat!("std::", "env");
        for (file, src) in [
            ("backend/mod.rs", include_str!("backend/mod.rs")),
            ("backend/checks.rs", include_str!("backend/checks.rs")),
            ("backend/construct.rs", include_str!("backend/construct.rs")),
            ("backend/run.rs", include_str!("backend/run.rs")),
            ("dense/mod.rs", include_str!("dense/mod.rs")),
            ("dense/class_pass.rs", include_str!("dense/class_pass.rs")),
            ("dense/config.rs", include_str!("dense/config.rs")),
            ("dense/exec.rs", include_str!("dense/exec.rs")),
            ("dense/glue.rs", include_str!("dense/glue.rs")),
            ("dense/launch.rs", include_str!("dense/launch.rs")),
            ("dense/row_pass.rs", include_str!("dense/row_pass.rs")),
            ("dense/scales.rs", include_str!("dense/scales.rs")),
            ("dense/schedule.rs", include_str!("dense/schedule.rs")),
            ("dense/sparse.rs", include_str!("dense/sparse.rs")),
            ("dense/wgmma.rs", include_str!("dense/wgmma.rs")),
            ("dense/workspace.rs", include_str!("dense/workspace.rs")),
            (
                "dense/schedule_tests.rs",
                include_str!("dense/schedule_tests.rs"),
            ),
            ("kernels.rs", include_str!("kernels.rs")),
            ("libs.rs", include_str!("libs.rs")),
            ("lib.rs", include_str!("lib.rs")),
            ("switches.rs", include_str!("switches.rs")),
            ("tensor.rs", include_str!("tensor.rs")),
        ] {
            assert!(!src.contains(needle), "{file} reads the environment");
        }
        assert_eq!(include_str!("device.rs").matches(needle).count(), 2);
    }
}
