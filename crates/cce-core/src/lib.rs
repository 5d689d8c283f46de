//! # cce-core: the contract of cut cross-entropy
//!
//! Shapes, options, validation, filter thresholds, the blocking plan, call statistics and the
//! backend trait of a library that computes the cross-entropy loss of a language model's output
//! layer, and its gradients, without holding the `N x V` logits. No GPU dependency.
//!
//! ## The math (Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models",
//! arXiv 2411.09009, sections 3-4)
//!
//! Inputs: `e` `[N, D]` (hidden states), `c` `[V, D]` (classifier), optional `bias` `[V]`,
//! `targets` `[N]` (class index or `ignore_index`). For a valid row `i` and class `j`:
//!
//! - `x_ij = e_i · c_j + bias_j`, accumulated in f32 or wider (never rounded to the input dtype);
//! - `z_ij = s · tanh(x_ij / s)` with softcap `s`, else `x_ij`;
//! - `lse_i = log Σ_j exp(z_ij)` (online log-sum-exp, paper section 4.2);
//! - `ℓ_i = lse_i − (1−α) z_{i,y_i} − (α/V) Σ_j z_ij + λ lse_i²` (label smoothing `α`, z-loss `λ`).
//!
//! Backward (paper section 4.3), with upstream gradient `g_i` and optional `h_i = ∂L/∂lse_i`:
//!
//! - `p_ij = exp(z_ij − lse_i)`;
//! - `G_ij = g_i [(1 + 2λ lse_i) p_ij − (1−α)[j = y_i] − α/V] + h_i p_ij`, times
//!   `1 − (z_ij/s)²` under softcap;
//! - `d_e = G · C`, `d_c = Gᵀ · E`, `d_bias_j = Σ_i G_ij`.
//!
//! Gradient filtering (paper section 4.3, "gradient filtering"): entries with
//! `|p_ij − [j = y_i]| < filter_eps` may be skipped; this crate adds a per-row bound
//! `max_dropped_mass` on the probability of the skipped entries ([`filter`]).
//!
//! ## Modules
//! - [`dtype`]: element types and their filter thresholds.
//! - [`tensor`]: host tensors and the [`tensor::TensorMeta`] trait every buffer implements.
//! - [`options`]: the options of a call.
//! - [`problem`]: shape/dtype validation and target preparation (shift, ignore_index).
//! - [`filter`]: the filter rule (per-row threshold from a probability histogram).
//! - [`plan`]: the blocking plan, pure data.
//! - [`stats`]: what a call did (the answer to "why is this call slow").
//! - [`backend`]: the trait all backends implement.
//! - [`error`]: the typed errors.

pub mod backend;
pub mod dtype;
pub mod error;
pub mod filter;
pub mod options;
pub mod plan;
pub mod problem;
pub mod stats;
pub mod tensor;
pub mod tolerance;

pub use backend::{
    Backend, BackwardOutput, DLoss, ForwardBackward, ForwardOutput, Inputs, Saved, Upstream,
};
pub use dtype::DType;
pub use error::{CceError, Result};
pub use filter::FilterRule;
pub use options::{FilterEps, GradDType, Options, Reduction, SideOutputs};
pub use plan::{
    ClassForward, DeviceLimits, Plan, SparseBackward, Strategy, StrategyKind, TileShape,
};
pub use problem::{PreparedTargets, Problem};
pub use stats::CallStats;
pub use tensor::{checked_bytes, checked_numel, try_filled, HostData, HostTensor, TensorMeta};
