//! # cce-cuda: the CUDA backend of cut cross-entropy
//!
//! Computes the cross-entropy loss of an LM head, `loss = CE(e·cᵀ (+ bias, softcap), targets)`,
//! and its gradients `d_e = G·c`, `d_c = Gᵀ·e`, `d_bias = Σ_i G` without materializing the
//! `N x V` logits (Wijmans et al., arXiv 2411.09009; the contract is `cce_core` and MATH.md).
//!
//! | concept | here |
//! |---|---|
//! | buffer | [`CudaTensor`]: one device allocation + dtype + row-major shape |
//! | device, stream | [`CudaBackend`] enqueues everything on one stream: its own non-blocking stream ([`CudaBackend::new`]) or the caller's ([`CudaBackend::on_stream`], [`CudaBackend::on_raw_stream`]); the caller orders its producers and consumers with events |
//! | kernels | `kernels/*.cu`, embedded, compiled by NVRTC to a CUBIN for the device (`sm_90a` on H100/H200), cached on disk and, with the loaded modules, per (context, architecture) for the process ([`device`]) |
//! | strategy | [`cce_core::Strategy::TileOwnership`]: recomputing tile-owned passes, no float atomics, bitwise repeatable; [`cce_core::Strategy::ChunkedDense`] ([`chunked`]): row chunks of materialized f32 logits, cuBLAS for the three products, for exact calls whose budget holds an f32 `d_c` accumulator; [`cce_core::Strategy::SplitDense`] ([`chunked`]): a row pass for `d_e` and a class pass for `d_c`, 4 cuBLAS GEMMs, no cross-chunk accumulator (the default within 0.5 GiB); order and rules in [`backend`] |
//!
//! ## Passes (kernels/*.cu)
//! - **forward** (`cce_forward_<dtype>`): grid = row tiles x class splits; each block walks
//!   its class tiles with an online log-sum-exp per row (paper section 4.2), also `Σ z`
//!   (label smoothing), `Σ p (z − max)` (entropy), argmax and the target logit; the split
//!   partials are merged in a fixed order (`cce_forward_finalize`), the loss reduced in f64.
//! - **threshold** (`cce_hist_<dtype>`, `cce_threshold`), filter on: per-row histogram of
//!   `g0 = |p − onehot|` over the bins of [`cce_core::FilterRule`] (integer atomics on
//!   `FilterRule::mass_to_fixed` masses), then `τ_i` with the rule's own algorithm on the device.
//! - **d_e** (`cce_backward_de_<dtype>`): a block owns a row tile, loops over the class tiles,
//!   recomputes the logits, builds `G` (MATH.md "Backward"), skips a tile when every entry of
//!   its active rows has `g0 < τ_i`, else adds `G · c` to its f32 accumulator rows.
//! - **d_c / d_bias** (`cce_backward_dc_<dtype>`): the same, class-owned: `Gᵀ · e`.
//! - Label smoothing without softcap is the analytic rank-1 term (column sums of `c` and of
//!   `g_i e_i`), so the filter still applies; with softcap it goes through `G` (filter off).
//!
//! Logits and every accumulation are f32; f16/bf16 products use tensor cores (`mma.sync`
//! m16n8k16 with f32 accumulators), f32 inputs use f32 FMA. The logits are never rounded to the
//! input dtype (more exact than PyTorch's bf16 `e @ c.T`). For the second product `G` is split
//! into hi + lo parts in the input dtype (16-bit types) after an exact power-of-two scaling
//! (so f16 neither overflows nor flushes small entries); gradients are returned in the input
//! dtype or f32.
//!
//! Targets are read back to the host (`4N`/`8N` bytes) to apply `shift` and `ignore_index` and
//! to report a bad row by index ([`cce_core::PreparedTargets`]); the prepared i32 classes go
//! back to the device. With `check_finite`, the lse vector (`4N` bytes) is read back after the
//! forward; only when it holds a NaN/Inf are the inputs read to locate the bad element.

pub mod backend;
pub mod chunked;
pub mod device;
pub mod kernels;
pub mod libs;
pub mod switches;
pub mod tensor;

pub use backend::{probe, CudaBackend, SparseMode};
/// The cudarc this crate is built with (its streams, contexts and slices are what
/// [`CudaBackend::on_stream`] and [`CudaTensor::borrowed_view`] take).
pub use cudarc;
pub use switches::CudaSwitches;
pub use tensor::required_alignment;
pub use tensor::CudaTensor;
