//! # cce-conformance: one conformance suite for every cut cross-entropy backend
//!
//! The checks are written once, generic over [`cce_core::Backend`], and stamped onto each
//! backend by [`conformance_suite!`] (as cubecl's `testgen_all!` does), one `#[test]` per
//! check:
//!
//! ```ignore
//! // crates/cce-reference/tests/conformance.rs (or any test file)
//! use cce_reference::CpuBackend;
//! cce_conformance::conformance_suite!(cpu, CpuBackend::new(), max_work_flop = 6e10);
//!
//! // a GPU backend: skipped without a device unless CCE_REQUIRE_CUDA=1
//! cce_conformance::conformance_suite!(cuda, cce_cuda::CudaBackend::new(), max_work_flop = 1e13);
//! ```
//!
//! The constructor expression may return `Result<B, CceError>` or `B`. On
//! `CceError::NoDevice` the tests print `skipping: ...` and pass, unless the backend is
//! required (`require = true`, or the environment variable `CCE_REQUIRE_<NAME>`, or the one
//! named by `require_env = "..."`, set to a true value). Other `key = value` arguments assign
//! fields of [`SuiteConfig`] (`max_work_flop`, `fixture_max_rows`, `allow_unsupported`,
//! `seed`).
//!
//! ## What is judged
//! Every output (loss, lse, entropy, argmax, `d_e`, `d_c`, `d_bias`) against the f64 ground
//! truth of `cce_reference::naive` on exactly the rounded inputs, with the same-precision
//! naive reference's own error allowed: see [`judge`] for the rule, its tolerances and why
//! they scale as they do. Filtered mode must be explained by the reported dropped mass and
//! respect `max_dropped_mass`; on the real fixture the default must be at least as accurate as
//! the original CCE's default. Bad inputs must give the exact [`cce_core::CceError`] variant;
//! among them a mean over no valid row (every target ignored, or a shift past the sequence),
//! `AllTargetsIgnored`, while sum and none accept such a batch with exact zeros.
//!
//! ## Cases
//! [`matrix`] lists them: hostile shapes, one tile + 1 of the backend's own tile, every
//! reduction, ignored rows, softcap, label smoothing, z-loss, shift, lse upstream, side
//! outputs, peaked / flat / iid / lm data, filtered mode and its variants, the API entry
//! points, determinism, the real fixture; every dtype. Inputs are fresh per run (seeded from the
//! clock and a counter unless `CCE_SEED` is set); a failure prints the seed and the first
//! mismatches ([`report`]).
//!
//! ## Self-test
//! [`OracleBackend`] (the oracle behind the trait) passes the suite, and deliberately broken
//! wrappers of it fail the relevant checks (this crate's `tests/self_test.rs`).

pub mod bad_input;
pub mod case;
pub mod checks;
pub mod config;
pub mod data;
pub mod harness;
pub mod judge;
pub mod matrix;
pub mod numerics;
pub mod oracle_backend;
pub mod report;
pub mod run;

pub use case::{Api, Case, CaseData, Ignored};
pub use checks::{CheckResult, CHECKS};
pub use config::SuiteConfig;
pub use oracle_backend::OracleBackend;
pub use report::{CaseReport, CheckFailure, CheckReport, Mismatch, OutputVerdict};

#[doc(hidden)]
pub use cce_core;

/// Stamp the conformance suite onto a backend: expands to `mod $name { ... }` holding one
/// `#[test]` per check of [`CHECKS`], each building the backend from `$ctor`.
///
/// ```ignore
/// cce_conformance::conformance_suite!(cpu, cce_reference::CpuBackend::new());
/// cce_conformance::conformance_suite!(
///     wgpu,
///     cce_wgpu::WgpuBackend::new(),
///     require_env = "CCE_REQUIRE_WGPU",
///     max_work_flop = 2e8,
///     allow_unsupported = true,
/// );
/// ```
///
/// `$ctor` is evaluated in each test (inside the generated module, which glob-imports its
/// parent) and may return `Result<B, CceError>` or `B`. Each `key = value` assigns the
/// [`SuiteConfig`] field `key` (so `max_work_flop = 6e10`, `fixture_max_rows = 256`,
/// `require = true`, `require_env = "CCE_REQUIRE_GPU"`, `seed = Some(42)`).
#[macro_export]
macro_rules! conformance_suite {
    ($name:ident, $ctor:expr $(, $key:ident = $val:expr)* $(,)?) => {
        #[allow(unused_imports, clippy::module_inception)]
        mod $name {
            use super::*;

            fn __cce_config() -> $crate::SuiteConfig {
                #[allow(unused_mut)]
                let mut cfg = $crate::SuiteConfig::new(stringify!($name));
                $( cfg.$key = $val; )*
                cfg
            }

            fn __cce_backend(
                cfg: &$crate::SuiteConfig,
            ) -> ::core::option::Option<impl $crate::cce_core::Backend> {
                use $crate::harness::ResolveInfallible as _;
                $crate::harness::acquire(cfg, $crate::harness::Ctor($ctor).resolve())
            }

            $crate::__cce_with_checks!($crate::__cce_stamp_checks);
        }
    };
}

/// Internal: the list of checks, handed to the macro `$callback` (the single source of
/// [`CHECKS`] and of the tests [`conformance_suite!`] stamps).
#[doc(hidden)]
#[macro_export]
macro_rules! __cce_with_checks {
    ($($callback:tt)*) => {
        $($callback)*! {
            hostile_shapes,
            one_tile_plus_one,
            reductions,
            ignored_rows,
            softcap,
            label_smoothing,
            z_loss,
            shift,
            d_lse_upstream,
            side_outputs,
            distributions,
            filtered_mode,
            api_paths,
            deterministic,
            real_fixture,
            confident_rows,
            masked_classes,
            softcap_extremes,
            rejects_shape_mismatch,
            rejects_dtype_mismatch,
            rejects_target_out_of_range,
            rejects_all_targets_ignored,
            rejects_non_finite,
            rejects_empty_input,
            rejects_invalid_options,
            rejects_bad_upstream,
        }
    };
}

/// Internal: one `#[test]` per check name (used by [`conformance_suite!`]).
#[doc(hidden)]
#[macro_export]
macro_rules! __cce_stamp_checks {
    ($($check:ident),* $(,)?) => {
        $(
            #[test]
            fn $check() {
                let cfg = __cce_config();
                if let ::core::option::Option::Some(backend) = __cce_backend(&cfg) {
                    $crate::harness::finish(
                        stringify!($check),
                        &cfg,
                        $crate::checks::$check(&backend, &cfg),
                    );
                }
            }
        )*
    };
}
