//! # cce-cuda: the CUDA backend of cut cross-entropy
//!
//! Kernels are CUDA C files under `kernels/`, compiled at run time with NVRTC (CUBIN for the
//! device's architecture, `sm_90a` on Hopper) and cached on disk.
//!
//! - [`chunked`]: [`cce_core::Strategy::ChunkedDense`]: per row chunk, the logits by cuBLAS
//!   into an f32 workspace, lse / loss / `G` by row kernels, `d_e` and `d_c` by cuBLAS.

pub mod chunked;
