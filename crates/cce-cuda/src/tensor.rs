//! Device tensors: one device allocation (owned, or borrowed from the caller) with a dtype and
//! a row-major shape.

use cce_core::{CceError, DType, Result, TensorMeta};
use cudarc::driver::{CudaSlice, CudaStream, CudaView, DevicePtr};
use std::mem::ManuallyDrop;
use std::sync::Arc;

/// A contiguous row-major tensor in device memory: the CUDA backend's buffer type.
///
/// The storage is raw bytes (`CudaSlice<u8>`, at least `numel · dtype.size_bytes()` long);
/// the dtype and shape say how kernels read it. It is either owned (made by the backend or
/// [`CudaTensor::from_slice`], freed on drop) or borrowed ([`CudaTensor::borrowed`],
/// [`CudaTensor::borrowed_view`]: a framework's memory, used in place and never freed here).
/// Every operation of [`crate::CudaBackend`] runs on the backend's one stream, so work on a
/// tensor is ordered by that stream; a caller that writes the storage from another stream
/// orders it with an event the backend's stream waits for.
#[derive(Debug)]
pub struct CudaTensor {
    /// Freed on drop when owned; leaked (left to its owner) when borrowed (`Drop`).
    pub(crate) data: ManuallyDrop<CudaSlice<u8>>,
    borrowed: bool,
    dtype: DType,
    shape: Vec<usize>,
}

impl Drop for CudaTensor {
    fn drop(&mut self) {
        // SAFETY: `data` is taken exactly once, here, and never used again.
        let data = unsafe { ManuallyDrop::take(&mut self.data) };
        if self.borrowed {
            // The memory belongs to the caller: give the address back without freeing it.
            let _ = data.leak();
        }
    }
}

/// Byte alignment a borrowed tensor's address must have: 16 for float tensors (the kernels
/// load rows with 16-byte vector loads and TMA where `D` allows it; every CUDA allocator
/// returns 256-byte aligned memory), the element size for integer tensors.
pub fn required_alignment(dtype: DType) -> usize {
    if dtype.is_float() {
        16
    } else {
        dtype.size_bytes()
    }
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
        Ok(Self {
            data: ManuallyDrop::new(data),
            borrowed: false,
            dtype,
            shape,
        })
    }

    /// A tensor over device memory that the caller owns (a framework's tensor: a candle
    /// `CudaSlice`, a PyTorch `data_ptr()`, a DLPack pointer), used in place: no copy, and the
    /// memory is never freed by this crate (dropping the tensor only forgets the address).
    ///
    /// `ptr` is the device address of element 0 of a contiguous row-major `shape` x `dtype`
    /// array; `stream` is the stream the backend that uses the tensor runs on
    /// ([`crate::CudaBackend::stream`]).
    ///
    /// Errors: `InvalidOption` when `ptr` is null (with elements) or not aligned to
    /// [`required_alignment`]`(dtype)`.
    ///
    /// # Safety
    /// - Size: `ptr` addresses at least `numel · dtype.size_bytes()` bytes of one device
    ///   allocation of `stream`'s context (the device the backend runs on).
    /// - Lifetime: the memory stays allocated until every call that uses the tensor has
    ///   completed on `stream` (not merely returned: calls are asynchronous), and until the
    ///   tensor is dropped.
    /// - Stream order: writes to the memory from other streams (the producer of an input) are
    ///   ordered before the call (an event recorded after them, waited for by `stream`), and
    ///   reads or writes of the memory elsewhere after the call wait for an event recorded on
    ///   `stream` after it (an output, or an input the caller reuses).
    /// - Aliasing: an output tensor does not overlap any other input or output of the call.
    pub unsafe fn borrowed(
        stream: &Arc<CudaStream>,
        ptr: u64,
        dtype: DType,
        shape: Vec<usize>,
    ) -> Result<Self> {
        let bytes = shape.iter().product::<usize>() * dtype.size_bytes();
        if ptr == 0 && bytes > 0 {
            return Err(CceError::InvalidOption {
                name: "device pointer",
                reason: format!("null address for {shape:?} x {dtype}"),
            });
        }
        let align = required_alignment(dtype);
        if !ptr.is_multiple_of(align as u64) {
            return Err(CceError::InvalidOption {
                name: "device pointer",
                reason: format!(
                    "address {ptr:#x} of a {dtype} tensor is not {align}-byte aligned (the \
                     kernels' vector loads need it)"
                ),
            });
        }
        // SAFETY: the caller guarantees `bytes` valid bytes at `ptr` for as long as the tensor
        // (and the calls using it) live; the slice is leaked on drop, never freed (`Drop`).
        let data = unsafe { stream.upgrade_device_ptr::<u8>(ptr, bytes) };
        Ok(Self {
            data: ManuallyDrop::new(data),
            borrowed: true,
            dtype,
            shape,
        })
    }

    /// [`CudaTensor::borrowed`] over a cudarc view (e.g. candle's `CudaSlice<bf16>` sliced at
    /// the tensor's start offset), which checks the size: the view holds at least
    /// `numel · dtype.size_bytes()` bytes.
    ///
    /// Errors: `ShapeMismatch` when the view is smaller than `shape` x `dtype`; those of
    /// [`CudaTensor::borrowed`].
    ///
    /// # Safety
    /// As [`CudaTensor::borrowed`] for lifetime, stream order and aliasing: the view's memory
    /// outlives every call using the tensor on `stream`, and writes on the view's own stream
    /// are ordered before the call by the caller.
    pub unsafe fn borrowed_view<T>(
        stream: &Arc<CudaStream>,
        view: &CudaView<'_, T>,
        dtype: DType,
        shape: Vec<usize>,
    ) -> Result<Self> {
        let need = shape.iter().product::<usize>() * dtype.size_bytes();
        let have = view.len() * std::mem::size_of::<T>();
        if have < need {
            return Err(CceError::ShapeMismatch {
                what: "borrowed view",
                expected: format!("{need} bytes for {shape:?} x {dtype}"),
                got: format!("{have} bytes"),
            });
        }
        let (ptr, _sync) = view.device_ptr(stream);
        // SAFETY: the view holds `need` bytes (checked); lifetime and order are the caller's
        // (this function's contract).
        unsafe { Self::borrowed(stream, ptr, dtype, shape) }
    }

    /// Whether the memory belongs to the caller ([`CudaTensor::borrowed`]): never freed here.
    pub fn is_borrowed(&self) -> bool {
        self.borrowed
    }

    /// The underlying allocation (bytes).
    pub fn slice(&self) -> &CudaSlice<u8> {
        &self.data
    }

    /// Mutable access to the underlying allocation (bytes).
    pub fn slice_mut(&mut self) -> &mut CudaSlice<u8> {
        &mut self.data
    }

    /// Give up the tensor, keeping the allocation. Errors: `Unsupported` for a borrowed
    /// tensor (its memory is the caller's, and a `CudaSlice` would free it).
    pub fn into_slice(self) -> Result<CudaSlice<u8>> {
        if self.borrowed {
            return Err(CceError::Unsupported {
                backend: "cuda",
                what: "into_slice of a borrowed tensor (its memory belongs to the caller)".into(),
            });
        }
        let mut this = ManuallyDrop::new(self);
        // SAFETY: `this` is never dropped (ManuallyDrop), so `data` is taken exactly once.
        let data = unsafe { ManuallyDrop::take(&mut this.data) };
        drop(std::mem::take(&mut this.shape));
        Ok(data)
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
        let mut this = self;
        this.shape = shape;
        Ok(this)
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
