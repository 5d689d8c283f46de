//! Builds cut cross-entropy's CUDA backend with cudarc configured as candle-core's `cuda`
//! feature configures it (Cargo.toml says why this crate exists). The function below only
//! proves that the two share one cudarc: a stream made through cudarc, as candle holds one
//! (`CudaDevice::cuda_stream()`), is what [`CudaBackend::on_stream`] takes.

use std::sync::Arc;

use cudarc::driver::CudaStream;
use cut_cross_entropy::cuda::CudaBackend;

/// A backend on the caller's `stream` (e.g. candle's). Errors as [`CudaBackend::on_stream`].
pub fn backend_on(stream: Arc<CudaStream>) -> cut_cross_entropy::Result<CudaBackend> {
    CudaBackend::on_stream(stream)
}
