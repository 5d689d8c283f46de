//! The workspace's memory: a stream-ordered memory pool of the engine's device that keeps what
//! a call freed for the next call.
//!
//! The workspace is allocated and freed once per call (`cuMemAllocAsync` on the engine's
//! stream). The device's default pool returns freed memory to the system at each
//! synchronization (its release threshold is 0), so the next call maps its workspace again:
//! on the H200 that cost 0.35 ms of a 6.39 ms call on the 12288 real rows and 0.18 ms of a
//! 1.37 ms call on 1024 rows (docs/perf-log.md, session 16). An own pool whose release
//! threshold is unbounded keeps the memory mapped between calls instead: what it holds is the
//! largest workspace one call took at a time (at most that call's budget; 0.46 GiB with the
//! default budget), until the engine is dropped. The device's default pool, which callers may
//! use themselves, is left as it is. [`crate::CudaSwitches::keep_workspace`] turns it off.

use super::*;
use cudarc::driver::{result, sys};

/// A memory pool on one device whose freed memory stays reserved for the next allocation.
#[derive(Debug)]
pub(crate) struct WorkspacePool {
    pool: sys::CUmemoryPool,
}

// SAFETY: a CUmemoryPool handle names a driver object that the driver API lets any thread use;
// this type only allocates from it (stream-ordered, on the caller's stream) and destroys it once.
unsafe impl Send for WorkspacePool {}
// SAFETY: as for Send: no method mutates Rust-side state.
unsafe impl Sync for WorkspacePool {}

impl WorkspacePool {
    /// A pool of device memory on `ctx`'s device that never returns freed memory to the system
    /// before it is dropped, or `None` where the device has no stream-ordered allocator.
    /// Errors: `Backend` from the driver.
    pub(crate) fn new(ctx: &CudaContext) -> Result<Option<Self>> {
        if !ctx.has_async_alloc() {
            return Ok(None);
        }
        // SAFETY: an all-zero CUmemPoolProps is valid plain data (no handle types, no
        // security attributes, no size limit); the allocation type and location are set below.
        let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        let device = i32::try_from(ctx.ordinal()).map_err(|_| {
            CceError::backend(BACKEND, "device ordinal does not fit a 32-bit location id")
        })?;
        // CUmemLocation is { CUmemLocationType type (i32), int id } in every CUDA 12 and 13
        // binding (13.2 names the id through a union), so it is written as two i32.
        let location = std::ptr::addr_of_mut!(props.location).cast::<[i32; 2]>();
        // SAFETY: `location` points to the props' CUmemLocation, 8 bytes of two 32-bit fields.
        unsafe {
            location.write([
                sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE as i32,
                device,
            ])
        };
        // SAFETY: props is a valid CUmemPoolProps (above).
        let pool = unsafe { result::mem_pool::create(&props) }.map_err(drv)?;
        let made = Self { pool };
        let mut keep = u64::MAX;
        // SAFETY: the pool was just created; RELEASE_THRESHOLD takes a u64 (cuuint64_t).
        unsafe {
            result::mem_pool::set_attribute(
                made.pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut keep as *mut u64).cast(),
            )
        }
        .map_err(drv)?;
        Ok(Some(made))
    }

    /// `bytes` of uninitialized device memory from the pool, ordered on `stream` (freed back to
    /// the pool, on its stream, when the slice is dropped). Errors: the driver's (out of memory).
    pub(crate) fn alloc(
        &self,
        stream: &Arc<CudaStream>,
        bytes: usize,
    ) -> std::result::Result<CudaSlice<u8>, cudarc::driver::DriverError> {
        stream.context().bind_to_thread()?;
        // SAFETY: the pool and the stream are valid; the memory is uninitialized, and the
        // workspace writes every byte before reading it (DenseWorkspace::new).
        let ptr = unsafe { result::mem_pool::alloc_async(self.pool, bytes, stream.cu_stream()) }?;
        // SAFETY: `ptr` is a live allocation of `bytes` bytes; the slice frees it with
        // cuMemFreeAsync on `stream` (the context has stream-ordered allocation, checked in
        // `new`), which returns it to this pool.
        Ok(unsafe { stream.upgrade_device_ptr::<u8>(ptr, bytes) })
    }
}

impl Drop for WorkspacePool {
    fn drop(&mut self) {
        // SAFETY: the pool is destroyed once; allocations still outstanding (none, as each
        // call frees its workspace) would be released when freed, as the driver documents.
        let _ = unsafe { result::mem_pool::destroy(self.pool) };
    }
}
