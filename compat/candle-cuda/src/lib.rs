//! Builds cut cross-entropy's CUDA backend with cudarc configured as candle-core's `cuda`
//! feature configures it (Cargo.toml says why this crate exists). The functions below only
//! prove that the two share one cudarc: a stream made through cudarc, as candle holds one, is
//! the type [`CudaBackend`] runs on.

use std::sync::Arc;

use cudarc::driver::CudaStream;
use cut_cross_entropy::cce_cuda::CudaBackend;

/// Whether `backend` runs on `stream` (e.g. candle's `CudaDevice::cuda_stream()`).
pub fn runs_on(backend: &CudaBackend, stream: &Arc<CudaStream>) -> bool {
    backend.stream().cu_stream() == stream.cu_stream()
}
