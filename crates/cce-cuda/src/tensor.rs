//! Device tensors: one device allocation with a dtype and a row-major shape.

use cce_core::{CceError, DType, Result, TensorMeta};
use cudarc::driver::{CudaSlice, DevicePtr};

/// A contiguous row-major tensor in device memory: the CUDA backend's buffer type.
///
/// The storage is raw bytes (`CudaSlice<u8>`, `numel · dtype.size_bytes()` long, at least one
/// byte); the dtype and shape say how kernels read it. Every operation of
/// [`crate::CudaBackend`] runs on the backend's one stream, so work on a tensor is ordered by
/// that stream; a caller that writes the storage from another stream must synchronize first.
#[derive(Debug)]
pub struct CudaTensor {
    pub(crate) data: CudaSlice<u8>,
    dtype: DType,
    shape: Vec<usize>,
}

impl CudaTensor {
    /// Wrap a device allocation. Errors: `ShapeMismatch` when the allocation holds fewer bytes
    /// than `shape` needs in `dtype`, `ResourceLimit` when that size overflows `usize`
    /// ([`cce_core::checked_bytes`]).
    pub fn from_slice(data: CudaSlice<u8>, dtype: DType, shape: Vec<usize>) -> Result<Self> {
        let need = cce_core::checked_bytes(&shape, dtype)?;
        if data.len() < need {
            return Err(CceError::ShapeMismatch {
                what: "device allocation",
                expected: format!("{need} bytes for {shape:?} x {dtype}"),
                got: format!("{} bytes", data.len()),
            });
        }
        Ok(Self { data, dtype, shape })
    }

    /// The underlying allocation (bytes).
    pub fn slice(&self) -> &CudaSlice<u8> {
        &self.data
    }

    /// Mutable access to the underlying allocation (bytes).
    pub fn slice_mut(&mut self) -> &mut CudaSlice<u8> {
        &mut self.data
    }

    /// Give up the tensor, keeping the allocation.
    pub fn into_slice(self) -> CudaSlice<u8> {
        self.data
    }

    /// Bytes of the tensor's elements (`numel · dtype.size_bytes()`).
    pub fn nbytes(&self) -> usize {
        self.numel() * self.dtype.size_bytes()
    }

    /// Same storage viewed with another shape of the same element count (`ShapeMismatch`
    /// otherwise).
    pub fn reshape(self, shape: Vec<usize>) -> Result<Self> {
        if shape.iter().product::<usize>() != self.numel() {
            return Err(CceError::ShapeMismatch {
                what: "reshape",
                expected: format!("{} elements", self.numel()),
                got: format!("{shape:?}"),
            });
        }
        Ok(Self { shape, ..self })
    }

    /// Raw device address of the first element (for interop with other CUDA code).
    pub fn device_ptr(&self) -> u64 {
        let (p, _sync) = self.data.device_ptr(self.data.stream());
        p
    }

    /// The context's raw handle, to check that a tensor belongs to a backend's device.
    pub(crate) fn cu_ctx(&self) -> usize {
        self.data.context().cu_ctx() as usize
    }
}

impl TensorMeta for CudaTensor {
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
}
