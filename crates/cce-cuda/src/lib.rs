//! # cce-cuda: the CUDA backend of cut cross-entropy
//!
//! Computes the cross-entropy loss of an LM head, `loss = CE(e·cᵀ (+ bias, softcap), targets)`,
//! and its gradients `d_e = G·c`, `d_c = Gᵀ·e`, `d_bias = Σ_i G` without materializing the
//! `N x V` logits (Wijmans et al., arXiv 2411.09009; the contract is `cce_core` and MATH.md).
//!
//! | concept | here |
//! |---|---|
//! | buffer | [`CudaTensor`]: one device allocation + dtype + row-major shape, owned or borrowed from the caller in place ([`CudaTensor::borrowed`], [`CudaTensor::borrowed_view`]) |
//! | switches | [`CudaSwitches`]: one explicit value that forces or disables paths and turns profiling on (no environment variable on a call's path; only the kernel cache's folder, [`device`]) |
//! | device, stream | [`CudaBackend`] enqueues everything on one stream: its own non-blocking stream ([`CudaBackend::new`]) or the caller's ([`CudaBackend::on_stream`], [`CudaBackend::on_raw_stream`]); the caller orders its producers and consumers with events |
//! | kernels | `kernels/*.cu`, embedded, compiled by NVRTC to a CUBIN for the device (`sm_90a` on H100/H200), cached on disk and, with the loaded modules, per (context, architecture) for the process ([`device`]) |
//! | strategy | [`cce_core::Strategy::ChunkedDense`] ([`dense`]): row chunks of materialized f32 logits, cuBLAS for the three products, for exact calls whose budget holds an f32 `d_c` accumulator; [`cce_core::Strategy::SplitDense`] ([`dense`]): a row pass for `d_e` and a class pass for `d_c`, 4 cuBLAS GEMMs (or WGMMA GEMMs with the row reductions in their epilogues on Hopper), no cross-chunk accumulator (the default within 0.5 GiB); order and rules in [`backend`]. Both need compute capability 8.0 and libcublas |
//!
//! ## Passes
//! The row and class passes, their kernels (`kernels/*.cu`, `kernels/wgmma.cu`) and the
//! sparse backward are described in [`dense`]. Logits and every accumulation are f32; the
//! logits are never rounded to the input dtype (more exact than PyTorch's bf16 `e @ c.T`).
//!
//! ## Checks and host synchronization
//! Targets are prepared and checked on the device (`kernels/prepare.cu`: `shift` and
//! `ignore_index` applied, out-of-range and bias-masked targets, the valid rows, a scalar
//! upstream spread over the rows, non-finite per-row upstream and lse with `check_finite`);
//! what the checks find goes to the backend's status buffer. [`Checks::Eager`] (a backend on
//! its own stream) reads it at each call and fails the call with the typed error, naming the
//! first bad row as the CPU backend does; [`Checks::Deferred`] (a backend on a caller's
//! stream) reads nothing in a call: [`CudaBackend::status`] reports the first recorded error or
//! the last call's valid rows and filter counts. Without a host read a call can be captured in
//! a CUDA graph; the one read left on the deferred path is the sparse backward's choice
//! (filtered split-dense calls), which a capturing stream skips for the dense passes.
//!
//! ```no_run
//! # fn main() -> cce_core::Result<()> {
//! use cce_core::{DType, Inputs, Options, Upstream};
//! use cce_cuda::{CudaBackend, CudaTensor, ForwardInto, GradsInto};
//! let own = CudaBackend::new(0)?;
//! let stream = own.context().new_stream().map_err(|e| cce_core::CceError::backend("cuda", e))?;
//! let be = CudaBackend::on_stream(stream)?; // the training step's stream: deferred checks
//! let (n, d, v) = (4096, 1024, 32000);
//! let (e, c) = (be.zeros(vec![n, d], DType::BF16)?, be.zeros(vec![v, d], DType::BF16)?);
//! let t = be.random_targets(n, v, 0.0, -100, 1)?;
//! let inputs = Inputs { e: &e, c: &c, bias: None, targets: &t };
//! let opts = Options::default();
//! let workspace = be.workspace_bytes(&inputs, &opts, true)?; // known before the call
//! let mut loss = be.zeros(vec![], DType::F32)?;
//! let (mut lse, mut rest) = (be.zeros(vec![n], DType::F32)?, be.zeros(vec![n], DType::F32)?);
//! let (mut d_e, mut d_c) = (be.zeros(vec![n, d], DType::BF16)?, be.zeros(vec![v, d], DType::BF16)?);
//! let (fs, _bs) = be.forward_backward_into(
//!     &inputs,
//!     &opts,
//!     &Upstream::default(),
//!     ForwardInto { loss: &mut loss, lse: &mut lse, rest_mass: &mut rest, entropy: None, argmax: None },
//!     GradsInto { d_e: Some(&mut d_e), d_c: Some(&mut d_c), ..Default::default() },
//! )?; // enqueued: nothing read back
//! assert!(fs.workspace_bytes <= workspace);
//! let report = be.status()?; // waits for the stream: a bad target would be its error here
//! println!("{} valid rows", report.n_valid);
//! # Ok(())
//! # }
//! ```

pub mod backend;
pub mod dense;
pub mod device;
pub mod kernels;
pub mod libs;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod switches;
pub mod tensor;

pub use backend::{
    probe, Checks, CudaBackend, DeviceReport, FilterCounts, ForwardInto, GradsInto, SparseMode,
};
/// The cudarc this crate is built with (its streams, contexts and slices are what
/// [`CudaBackend::on_stream`] and [`CudaTensor::borrowed_view`] take).
pub use cudarc;
pub use switches::CudaSwitches;
pub use tensor::required_alignment;
pub use tensor::CudaTensor;
