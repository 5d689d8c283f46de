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
//! Targets are read back to the host (`4N`/`8N` bytes) to apply `shift` and `ignore_index` and
//! to report a bad row by index ([`cce_core::PreparedTargets`]); the prepared i32 classes go
//! back to the device. With `check_finite`, the lse vector (`4N` bytes) is read back after the
//! forward; only when it holds a NaN/Inf are the inputs read to locate the bad element.

pub mod backend;
pub mod dense;
pub mod device;
pub mod kernels;
pub mod libs;
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
