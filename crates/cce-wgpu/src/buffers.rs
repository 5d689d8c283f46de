//! Device tensors and binding ranges.

use crate::context::{backend_err, Context, BACKEND};
use cce_core::{CceError, DType, HostTensor, Result, TensorMeta};
use std::num::NonZeroU64;
use std::sync::Arc;

/// A tensor in device memory: a range of one `wgpu::Buffer` (usages STORAGE | COPY_SRC |
/// COPY_DST), row-major and contiguous, with its dtype and shape.
///
/// Layout: f32/i32 one element per 4 bytes; f16/bf16 two elements per u32 word, element
/// `2k` in the low half (little endian, the host layout); i64 8 bytes. The tensor's bytes start
/// at [`WgpuTensor::offset`] (a multiple of 4) and span the byte size rounded up to a multiple
/// of 4 (at least 4). A tensor the backend allocated owns its whole buffer (offset 0); a view
/// ([`crate::WgpuBackend::view`]) is a range of a buffer someone else allocated.
#[derive(Clone)]
pub struct WgpuTensor {
    pub(crate) buf: wgpu::Buffer,
    /// Byte offset of element 0 in `buf`.
    pub(crate) offset: u64,
    dtype: DType,
    shape: Vec<usize>,
    pub(crate) ctx_id: u64,
}

impl std::fmt::Debug for WgpuTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WgpuTensor")
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("offset", &self.offset)
            .field("buffer_bytes", &self.buf.size())
            .finish()
    }
}

impl TensorMeta for WgpuTensor {
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
}

impl WgpuTensor {
    /// The underlying buffer (for callers that bind it in their own pipelines); the tensor's
    /// bytes start at [`WgpuTensor::offset`].
    pub fn buffer(&self) -> &wgpu::Buffer {
        &self.buf
    }

    /// Byte offset of element 0 in [`WgpuTensor::buffer`]: 0 for a tensor the backend
    /// allocated, the view's offset (a multiple of 4) for a view.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// A tensor over `buf` from byte `offset` on, tagged with the context `ctx_id`.
    pub(crate) fn from_parts(
        buf: wgpu::Buffer,
        offset: u64,
        dtype: DType,
        shape: Vec<usize>,
        ctx_id: u64,
    ) -> Self {
        Self {
            buf,
            offset,
            dtype,
            shape,
            ctx_id,
        }
    }

    /// Data size in bytes (`numel · dtype size`, without the padding to 4).
    pub fn size_bytes(&self) -> u64 {
        self.numel() as u64 * self.dtype.size_bytes() as u64
    }

    /// Whether the tensor's bytes rounded up to a 16-byte boundary lie in its buffer, so that
    /// any range of it can be bound as `array<vec4<u32>>` ([`Context::range_vec`]); always
    /// true for tensors the backend allocated, false only for a view that ends within the
    /// last 16 bytes of a buffer whose size is not a multiple of 16.
    pub(crate) fn vec_bindable(&self) -> bool {
        padded16(self.offset + self.size_bytes()) <= self.buf.size()
    }
}

pub(crate) fn padded(bytes: u64) -> u64 {
    bytes.div_ceil(4).max(1) * 4
}

/// `bytes` rounded up to whole 16-byte units (at least one): the size of every buffer the
/// backend allocates, so that any range of one can be bound as `array<vec4<u32>>`.
pub(crate) fn padded16(bytes: u64) -> u64 {
    bytes.div_ceil(16).max(1) * 16
}

impl Context {
    /// A zero-filled device tensor. Errors: `ResourceLimit` past `max_buffer_size` or when the
    /// shape's size overflows ([`cce_core::checked_bytes`]).
    pub(crate) fn alloc(&self, shape: Vec<usize>, dtype: DType, label: &str) -> Result<WgpuTensor> {
        let size = padded16(cce_core::checked_bytes(&shape, dtype)? as u64);
        let buf = self.raw_buffer(size, label)?;
        Ok(WgpuTensor {
            buf,
            offset: 0,
            dtype,
            shape,
            ctx_id: self.id,
        })
    }

    /// A zero-filled storage buffer of `size` bytes (multiple of 4).
    pub(crate) fn raw_buffer(&self, size: u64, label: &str) -> Result<wgpu::Buffer> {
        if size > self.limits.max_buffer_size {
            return Err(CceError::ResourceLimit {
                resource: format!("bytes of one wgpu buffer ({label})"),
                requested: size,
                max: self.limits.max_buffer_size,
            });
        }
        self.call_bytes
            .fetch_add(size, std::sync::atomic::Ordering::Relaxed);
        Ok(self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        }))
    }

    /// Upload host bytes into a new buffer.
    pub(crate) fn upload_bytes(&self, bytes: &[u8], label: &str) -> Result<wgpu::Buffer> {
        let size = padded16(bytes.len() as u64);
        let buffer = self.raw_buffer(size, label)?;
        if !bytes.is_empty() {
            let whole = bytes.len() / 4 * 4;
            if whole > 0 {
                self.queue.write_buffer(&buffer, 0, &bytes[..whole]);
            }
            if whole < bytes.len() {
                let mut tail = [0u8; 4];
                tail[..bytes.len() - whole].copy_from_slice(&bytes[whole..]);
                self.queue.write_buffer(&buffer, whole as u64, &tail);
            }
        }
        Ok(buffer)
    }

    /// Host tensor to device tensor.
    pub(crate) fn upload(&self, host: &HostTensor) -> Result<WgpuTensor> {
        let buf = self.upload_bytes(host.as_bytes(), "tensor")?;
        Ok(WgpuTensor {
            buf,
            offset: 0,
            dtype: host.dtype(),
            shape: host.shape().to_vec(),
            ctx_id: self.id,
        })
    }

    /// Device tensor to host tensor.
    pub(crate) fn download(&self, t: &WgpuTensor) -> Result<HostTensor> {
        self.check_own(t, "tensor")?;
        let size = padded(t.size_bytes());
        let enc = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        let bytes = self
            .submit_and_read(enc, &[(&t.buf, t.offset, size)])?
            .pop()
            .unwrap_or_default();
        HostTensor::from_bytes(
            t.shape().to_vec(),
            t.dtype(),
            &bytes[..t.size_bytes() as usize],
        )
    }

    /// `ForeignBuffer` unless `t` was made by this context.
    pub(crate) fn check_own(&self, t: &WgpuTensor, what: &'static str) -> Result<()> {
        if t.ctx_id != self.id {
            return Err(CceError::ForeignBuffer {
                backend: BACKEND,
                what,
            });
        }
        Ok(())
    }

    /// A binding of elements `start .. start + count` (each `elem_bytes`) of `at`: the offset
    /// is aligned down to the storage offset alignment, and the remainder is returned in
    /// elements for the shader to add. Errors: `ResourceLimit` when the range exceeds the
    /// largest storage binding.
    pub(crate) fn range<'a>(
        &self,
        at: impl Into<At<'a>>,
        start: u64,
        count: u64,
        elem_bytes: u64,
    ) -> Result<(Bind<'a>, u32)> {
        let At { buf, offset } = at.into();
        let align = self.limits.min_storage_buffer_offset_alignment as u64;
        let start_b = offset + start * elem_bytes;
        let base = start_b / align * align;
        let residual = (start_b - base) / elem_bytes;
        let end_b = (offset + padded((start + count) * elem_bytes)).min(buf.size());
        let size = end_b.saturating_sub(base).max(4);
        if size > self.max_binding() {
            return Err(CceError::ResourceLimit {
                resource: "bytes of one wgpu storage binding".into(),
                requested: size,
                max: self.max_binding(),
            });
        }
        Ok((
            Bind {
                buf,
                offset: base,
                size,
            },
            residual as u32,
        ))
    }

    /// Like [`Context::range`], for a binding read as `array<vec4<u32>>` (gemm.wgsl's e and
    /// c): the start aligned to 16 bytes as well and the size rounded up to whole 16-byte
    /// units, so that every element of the range lies in a vec4 of the binding. Errors:
    /// `ResourceLimit` past the largest binding; `Backend` when the rounded range passes the
    /// buffer's end (the backend copies such a tensor first, [`WgpuTensor::vec_bindable`]).
    pub(crate) fn range_vec<'a>(
        &self,
        at: impl Into<At<'a>>,
        start: u64,
        count: u64,
        elem_bytes: u64,
    ) -> Result<(Bind<'a>, u32)> {
        let At { buf, offset } = at.into();
        let align = (self.limits.min_storage_buffer_offset_alignment as u64).max(16);
        let start_b = offset + start * elem_bytes;
        let base = start_b / align * align;
        let residual = (start_b - base) / elem_bytes;
        let end_b = padded16(offset + (start + count) * elem_bytes);
        if end_b > buf.size() {
            return Err(backend_err(format!(
                "a 16-byte binding of bytes {start_b}..{end_b} passes the buffer's end ({})",
                buf.size()
            )));
        }
        let size = end_b - base;
        if size > self.max_binding() {
            return Err(CceError::ResourceLimit {
                resource: "bytes of one wgpu storage binding".into(),
                requested: size,
                max: self.max_binding(),
            });
        }
        Ok((
            Bind {
                buf,
                offset: base,
                size,
            },
            residual as u32,
        ))
    }

    /// Like [`Context::range`] but the start must be aligned (per-row arrays whose chunks
    /// start at multiples of the tile rows). Errors: `Backend` if it is not.
    pub(crate) fn aligned<'a>(
        &self,
        at: impl Into<At<'a>>,
        start: u64,
        count: u64,
        elem_bytes: u64,
    ) -> Result<Bind<'a>> {
        let at = at.into();
        let (b, residual) = self.range(at, start, count, elem_bytes)?;
        if residual != 0 {
            return Err(backend_err(format!(
                "binding offset {} not aligned to {} bytes",
                at.offset + start * elem_bytes,
                self.limits.min_storage_buffer_offset_alignment
            )));
        }
        Ok(b)
    }

    /// Whether a binding may start at byte `offset` (the storage offset alignment).
    pub(crate) fn is_bind_aligned(&self, offset: u64) -> bool {
        offset.is_multiple_of(self.limits.min_storage_buffer_offset_alignment as u64)
    }

    /// The whole buffer.
    pub(crate) fn whole<'a>(&self, buf: &'a wgpu::Buffer) -> Result<Bind<'a>> {
        if buf.size() > self.max_binding() {
            return Err(CceError::ResourceLimit {
                resource: "bytes of one wgpu storage binding".into(),
                requested: buf.size(),
                max: self.max_binding(),
            });
        }
        Ok(Bind {
            buf,
            offset: 0,
            size: buf.size(),
        })
    }
}

/// Where a tensor's elements start: a buffer and the byte offset of element 0 in it.
#[derive(Clone, Copy)]
pub(crate) struct At<'a> {
    pub buf: &'a wgpu::Buffer,
    pub offset: u64,
}

impl<'a> From<&'a wgpu::Buffer> for At<'a> {
    fn from(buf: &'a wgpu::Buffer) -> Self {
        At { buf, offset: 0 }
    }
}

impl<'a> From<&'a WgpuTensor> for At<'a> {
    fn from(t: &'a WgpuTensor) -> Self {
        At {
            buf: &t.buf,
            offset: t.offset,
        }
    }
}

/// A buffer range bound to one binding slot.
#[derive(Clone, Copy)]
pub(crate) struct Bind<'a> {
    pub buf: &'a wgpu::Buffer,
    pub offset: u64,
    pub size: u64,
}

impl Bind<'_> {
    pub fn entry(&self, binding: u32) -> wgpu::BindGroupEntry<'_> {
        wgpu::BindGroupEntry {
            binding,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: self.buf,
                offset: self.offset,
                size: NonZeroU64::new(self.size),
            }),
        }
    }
}

/// Shared handle, so tensors can outlive a borrowed backend.
pub(crate) type Ctx = Arc<Context>;
