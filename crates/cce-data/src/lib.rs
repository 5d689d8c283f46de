//! Data for cut-cross-entropy: real fixtures, file loaders, seeded generators and logit
//! statistics.
//!
//! Everything here works on plain Rust types: a [`Dataset`] holds `e` `[N, D]`, `c`
//! `[V, D]` (row-major `f32`), an optional `bias` `[V]`, `targets` `[N]` (`i64`) and optional
//! reference values, all exact in f32 (bf16/f16 inputs are widened exactly and the real
//! fixture's Q8_0 head is decoded exactly).
//!
//! - **Loading**: [`load_safetensors`] (tensor names from [`TensorNames`]; `E` bf16/f16/f32,
//!   the head as bf16/f16/f32 or Q8_0 codes + scales, `targets` i32/i64, optional `bias`,
//!   `lse_ref`, `nll_ref`), [`load_safetensors_split`] (rows and head from two files),
//!   [`load_npy`] (one `.npy` per tensor), [`load_real_fixture`] (the shipped SmolLM2-135M
//!   fixture, `data/smollm2_lce_real_1k.safetensors`) and [`load_real_e12k`] (the 12k-row
//!   file, when [`e12k_path`] finds it). Every failure is a typed [`DataError`]; nothing
//!   panics on bad files.
//! - **Saving**: [`save_safetensors`] writes named f32 tensors (gradients), [`save_dataset`]
//!   a whole dataset.
//! - **Generating**: [`generate`] draws a dataset from a [`Distribution`] (`randn`, `c/8`,
//!   `e*8`, ..., `iid`, `lm`) with a seed; deterministic and independent of the thread count.
//! - **Measuring**: [`measure`] computes the [`LogitStats`] of CASES.md (entropy, significant
//!   entries, tile occupancy, tail mass, ...) blockwise, and
//!   [`LogitStats::check_lm_bands`] compares them with the acceptance bands of `lm`.
//!
//! # Memory and time
//!
//! A [`Dataset`] holds `4·(N·D + V·D) + 8·N` bytes: the seed shape (N = 32768, D = 4096,
//! V = 256000) takes 4.5 GiB in f32, the real fixture 115 MiB. Logits are never held whole:
//! generators and [`measure`] work on blocks of rows x all classes of at most 32 MiB per
//! worker (the `iid` calibration holds up to 256 MiB of sample logits). Every pass over the
//! logits is an `N x V x D` f32 matmul (`matrixmultiply` sgemm, ~25 GMAC/s per core) plus
//! about one f64 `exp` per logit: `iid` and `lm` generation (targets sampled from the
//! softmax) and [`measure`] each cost one such pass, ~4 s per core for 1024 x 49152 x 576
//! and ~20 CPU-minutes for the seed shape's 34 TMAC. Random streams are per row / per class /
//! per target, so results do not depend on the number of threads; they are reproducible for
//! a given `Cargo.lock` (the `rand` family of crates fixes the streams).
//!
//! ```no_run
//! use cce_data::{generate, load_real_fixture, measure, Distribution};
//!
//! let real = load_real_fixture()?;
//! println!("{}", measure(&real)?);
//! let lm = generate(&"lm".parse::<Distribution>()?, 4096, 576, 49152, 7)?;
//! for check in measure(&lm)?.check_lm_bands() {
//!     println!("{check}");
//! }
//! # Ok::<(), cce_data::DataError>(())
//! ```

mod dataset;
mod error;
mod fixture;
mod gen;
mod logits;
mod npy;
mod st;
mod stats;

pub use dataset::Dataset;
pub use error::{DataError, Result};
pub use fixture::{
    e12k_path, fixture_path, load_real_e12k, load_real_fixture, DATA_DIR_ENV, E12K_ENV, E12K_FILE,
    FIXTURE_FILE,
};
pub use gen::{generate, Distribution, LmParams, DEFAULT_IID_ENTROPY};
pub use npy::{load_npy, NpyPaths};
pub use st::{
    load_safetensors, load_safetensors_split, save_dataset, save_safetensors, F32Tensor,
    TensorNames, Q8_BLOCK,
};
pub use stats::{measure, BandCheck, LogitStats, SIGNIFICANT_P};
