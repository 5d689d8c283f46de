//! Plumbing of the stamped tests: backend construction (with skip-on-no-device), seeds, and
//! turning a check's result into a pass or a panic.

use crate::config::SuiteConfig;
use crate::report::{CheckFailure, CheckReport};
use cce_core::{Backend, CceError};
use std::sync::atomic::{AtomicU64, Ordering};

/// Wrapper that lets [`crate::conformance_suite!`] accept a constructor expression returning
/// either `Result<B, CceError>` or a plain `B`: `Ctor(expr).resolve()` picks the inherent
/// method for a `Result` and the [`ResolveInfallible`] trait method for a plain backend.
pub struct Ctor<T>(pub T);

impl<B: Backend> Ctor<Result<B, CceError>> {
    /// The constructor's result as is.
    pub fn resolve(self) -> Result<B, CceError> {
        self.0
    }
}

/// Fallback of [`Ctor::resolve`] for constructors that cannot fail.
pub trait ResolveInfallible {
    /// The backend type.
    type Backend;
    /// `Ok(backend)`.
    fn resolve(self) -> Result<Self::Backend, CceError>;
}

impl<B: Backend> ResolveInfallible for Ctor<B> {
    type Backend = B;
    fn resolve(self) -> Result<B, CceError> {
        Ok(self.0)
    }
}

/// Turn a constructor result into a backend, or `None` (after printing "skipping: ...") when
/// there is no device and the configuration does not require one.
///
/// # Panics
/// On `CceError::NoDevice` when the backend is required (`cfg.require` or the environment
/// variable of [`SuiteConfig::require_env_name`]), and on any other constructor error.
pub fn acquire<B: Backend>(cfg: &SuiteConfig, made: Result<B, CceError>) -> Option<B> {
    match made {
        Ok(b) => Some(b),
        Err(err @ CceError::NoDevice { .. }) => {
            if cfg.device_required() {
                panic!(
                    "backend '{}' is required ({} or require = true) but could not be created: {err}",
                    cfg.name,
                    cfg.require_env_name()
                );
            }
            eprintln!(
                "skipping: backend '{}' not available: {err} (set {}=1 to make this a failure)",
                cfg.name,
                cfg.require_env_name()
            );
            None
        }
        Err(err) => panic!("backend '{}' constructor failed: {err}", cfg.name),
    }
}

static SEED_COUNTER: AtomicU64 = AtomicU64::new(0);

/// SplitMix64 finalizer: a well-mixed 64-bit hash of `x`.
pub fn mix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// FNV-1a hash of a string (stable across runs and platforms).
pub fn hash_str(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Base seed of one check: `cfg.seed`, else `CCE_SEED` from the environment (decimal or
/// `0x` hex), else fresh (system time mixed with a process-wide counter). Every failure prints
/// it; rerun with `CCE_SEED=<seed>` to reproduce.
pub fn check_seed(cfg: &SuiteConfig) -> u64 {
    if let Some(s) = cfg.seed {
        return s;
    }
    if let Ok(s) = std::env::var("CCE_SEED") {
        let s = s.trim();
        let parsed = match s.strip_prefix("0x") {
            Some(hex) => u64::from_str_radix(hex, 16).ok(),
            None => s.parse().ok(),
        };
        match parsed {
            Some(v) => return v,
            None => panic!("CCE_SEED='{s}' is not a decimal or 0x-hex u64"),
        }
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let k = SEED_COUNTER.fetch_add(1, Ordering::Relaxed);
    mix64(nanos ^ mix64(k) ^ (std::process::id() as u64) << 32)
}

/// End of a stamped test: print the per-case summary of a passing check (every case in full
/// with `CCE_VERBOSE=1`), panic with the failure report (first mismatches, case, seed)
/// otherwise.
pub fn finish(check: &str, cfg: &SuiteConfig, result: Result<CheckReport, CheckFailure>) {
    match result {
        Ok(report) => {
            eprintln!("{report}");
            if std::env::var_os("CCE_VERBOSE").is_some_and(|v| v != "0") {
                for case in &report.cases {
                    eprintln!("{case}");
                }
            }
        }
        Err(failure) => panic!(
            "{failure}\nreproduce: CCE_SEED={} cargo test -p <crate> {}::{check}",
            failure.seed, cfg.name
        ),
    }
}
