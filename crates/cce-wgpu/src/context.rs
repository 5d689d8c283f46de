//! The device context: adapter, device, queue, pipeline cache, error handling and readback.

use crate::bounds::MAX_BINDING_BYTES;
use crate::config::{coop_capable, CoopCaps};
use crate::pipelines::{PipelineCache, ShaderKind};
use cce_core::{CceError, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

pub(crate) const BACKEND: &str = "wgpu";

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A wgpu error or device loss, boxed into `CceError::Backend`.
#[derive(Debug)]
pub struct WgpuError(pub String);

impl std::fmt::Display for WgpuError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for WgpuError {}

pub(crate) fn backend_err(msg: impl Into<String>) -> CceError {
    CceError::backend(BACKEND, WgpuError(msg.into()))
}

/// One device and everything built on it, shared by the backend and its tensors.
pub(crate) struct Context {
    /// Unique id, to recognize this context's tensors.
    pub id: u64,
    pub info: wgpu::AdapterInfo,
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub limits: wgpu::Limits,
    pub features: wgpu::Features,
    pub pipelines: PipelineCache,
    /// The adapter the device was opened on (`None` on a borrowed device).
    pub adapter: Option<wgpu::Adapter>,
    /// Which cooperative-matrix forwards the device can run (`config::coop_capable`).
    pub coop: CoopCaps,
    /// Whether this context opened the device (and installed the callbacks below), or borrows
    /// a device someone else opened ([`Context::borrow`]).
    pub owns_device: bool,
    /// Set by the device-lost callback (never, on a borrowed device).
    lost: Arc<Mutex<Option<String>>>,
    /// Errors that escaped every error scope (none are collected on a borrowed device).
    uncaptured: Arc<Mutex<Vec<String>>>,
    /// 256-byte read-only stand-in for absent optional inputs.
    pub dummy: wgpu::Buffer,
    /// Bytes allocated since the current call's error scopes were pushed.
    pub call_bytes: AtomicU64,
    /// Timestamps while profiling is on (`crate::profile`).
    pub profiler: Mutex<Option<crate::profile::Profiler>>,
}

/// The adapter this crate opens among `adapters`: `CCE_WGPU_ADAPTER` (substring of the
/// adapter name, any case) if set, else the first discrete GPU, then integrated, virtual, CPU
/// (lavapipe), other; `None` when no adapter matches. Public so that tools opening their own
/// device (the benches' reference SGEMM) measure the same adapter.
pub fn pick_adapter(adapters: Vec<wgpu::Adapter>) -> Option<wgpu::Adapter> {
    let want = std::env::var("CCE_WGPU_ADAPTER").ok();
    let rank = |t: wgpu::DeviceType| match t {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Cpu => 3,
        wgpu::DeviceType::Other => 4,
    };
    adapters
        .into_iter()
        .filter(|a| {
            want.as_ref()
                .is_none_or(|w| a.get_info().name.to_lowercase().contains(&w.to_lowercase()))
        })
        .min_by_key(|a| rank(a.get_info().device_type))
}

impl Context {
    /// Open the best adapter with its own limits and the features we can use.
    /// Errors: `NoDevice` (no adapter), `Backend` (device request failed).
    pub fn new() -> Result<Self> {
        let instance =
            wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
        let adapters = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::all()));
        let n = adapters.len();
        let adapter = pick_adapter(adapters).ok_or_else(|| CceError::NoDevice {
            backend: BACKEND,
            reason: if n == 0 {
                "no wgpu adapter found (is a Vulkan driver installed? on Linux without a GPU: \
                 apt-get install mesa-vulkan-drivers libvulkan1)"
                    .into()
            } else {
                format!("{n} adapter(s), none matches CCE_WGPU_ADAPTER")
            },
        })?;
        let info = adapter.get_info();
        // Timestamps only serve the opt-in profiling (`crate::profile`); f32 atomics the
        // backward's non-deterministic path (`config::accumulation`).
        let mut wanted = wgpu::Features::SHADER_F16
            | wgpu::Features::SUBGROUP
            | wgpu::Features::SHADER_FLOAT32_ATOMIC
            | wgpu::Features::TIMESTAMP_QUERY
            | wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES;
        if cfg!(feature = "coop-matrix") {
            wanted |= wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX;
        }
        let features = adapter.features() & wanted;
        let limits = adapter.limits();
        let experimental = if features.contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX) {
            // SAFETY: wgpu's experimental features may hold implementation bugs (the
            // token's docs); this one is requested only when the caller compiled in the
            // off-by-default `coop-matrix` feature, and is used only by the cooperative-matrix
            // shaders (logits_coop*.wgsl, bwd_coop.wgsl).
            unsafe { wgpu::ExperimentalFeatures::enabled() }
        } else {
            wgpu::ExperimentalFeatures::disabled()
        };
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("cce-wgpu"),
            required_features: features,
            required_limits: limits.clone(),
            experimental_features: experimental,
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        }))
        .map_err(|e| backend_err(format!("request_device on {}: {e}", info.name)))?;
        let lost = Arc::new(Mutex::new(None));
        {
            let lost = lost.clone();
            device.set_device_lost_callback(move |reason, msg| {
                *lost.lock().unwrap() = Some(format!("device lost ({reason:?}): {msg}"));
            });
        }
        let uncaptured = Arc::new(Mutex::new(Vec::new()));
        {
            let un = uncaptured.clone();
            device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
                un.lock().unwrap().push(e.to_string());
            }));
        }
        let mut ctx = Self::build(
            info, device, queue, limits, features, true, lost, uncaptured,
        );
        ctx.coop = coop_capable(
            features,
            &adapter.cooperative_matrix_properties(),
            (ctx.info.subgroup_min_size, ctx.info.subgroup_max_size),
            ctx.limits.max_compute_workgroup_storage_size,
            ctx.limits.max_compute_invocations_per_workgroup,
        );
        ctx.adapter = Some(adapter);
        Ok(ctx)
    }

    /// A context on a device and queue someone else opened (a framework's), with the limits
    /// and features that device was created with (f32 atomics only where the owner requested
    /// `SHADER_FLOAT32_ATOMIC`; without them the backward keeps its per-split slabs). Installs no device-lost or uncaptured-error
    /// callback: wgpu keeps one of each per device, and the owner's (cubecl's, for burn) must
    /// stay in place. Errors of our calls are still caught by the error scopes of
    /// [`Context::scoped`] (thread-local in wgpu, so they see only our thread's work); a lost
    /// device surfaces as a failed poll or buffer mapping, reported as `Backend` errors.
    ///
    /// Errors: `Backend` when the device rejects the context's one small buffer.
    pub fn borrow(device: wgpu::Device, queue: wgpu::Queue) -> Result<Self> {
        let info = device.adapter_info();
        let limits = device.limits();
        let features = device.features()
            & (wgpu::Features::SHADER_F16
                | wgpu::Features::SUBGROUP
                | wgpu::Features::SHADER_FLOAT32_ATOMIC);
        let none = Arc::new(Mutex::new(None));
        let empty = Arc::new(Mutex::new(Vec::new()));
        // Scoped, so that a failure is ours to report, not the owner's uncaptured handler's.
        let oom = device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let validation = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let ctx = Self::build(info, device, queue, limits, features, false, none, empty);
        let v = pollster::block_on(validation.pop());
        let o = pollster::block_on(oom.pop());
        match v.or(o) {
            Some(e) => Err(backend_err(format!(
                "from_device on {}: {e}",
                ctx.info.name
            ))),
            None => Ok(ctx),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        info: wgpu::AdapterInfo,
        device: wgpu::Device,
        queue: wgpu::Queue,
        limits: wgpu::Limits,
        features: wgpu::Features,
        owns_device: bool,
        lost: Arc<Mutex<Option<String>>>,
        uncaptured: Arc<Mutex<Vec<String>>>,
    ) -> Self {
        let dummy = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("dummy"),
            size: 256,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        Self {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            info,
            device,
            queue,
            limits,
            features,
            pipelines: PipelineCache::default(),
            adapter: None,
            coop: CoopCaps::default(),
            owns_device,
            lost,
            uncaptured,
            dummy,
            call_bytes: AtomicU64::new(0),
            profiler: Mutex::new(None),
        }
    }

    /// The pipeline of `kind` for dtype code and tile config `(wg, tk, main loop)`, with
    /// wgpu's runtime checks when `checked`.
    pub fn pipeline(
        &self,
        kind: ShaderKind,
        dtype: u32,
        tile: (u32, u32, crate::config::MainLoop),
        checked: bool,
    ) -> wgpu::ComputePipeline {
        self.pipelines.get(&self.device, kind, dtype, tile, checked)
    }

    /// Whether the device has `SUBGROUP` (the backward's coalesced atomic modules).
    pub fn subgroups(&self) -> bool {
        self.features.contains(wgpu::Features::SUBGROUP)
    }

    /// Whether the device has `SHADER_FLOAT32_ATOMIC` (the backward's atomic modules).
    pub fn float_atomics(&self) -> bool {
        self.features
            .contains(wgpu::Features::SHADER_FLOAT32_ATOMIC)
    }

    /// Largest storage binding in bytes: the adapter's, capped at
    /// [`MAX_BINDING_BYTES`] so that shader indices fit u32.
    pub fn max_binding(&self) -> u64 {
        self.limits
            .max_storage_buffer_binding_size
            .min(self.limits.max_buffer_size)
            .min(MAX_BINDING_BYTES)
    }

    /// Run `f` inside out-of-memory, validation and internal error scopes, so that any wgpu
    /// error of the call becomes a typed `CceError` (never a panic of the default handler).
    /// An out-of-memory error reports the bytes the call had allocated.
    pub fn scoped<T>(&self, what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        self.call_bytes.store(0, Ordering::Relaxed);
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let internal = self.device.push_error_scope(wgpu::ErrorFilter::Internal);
        let validation = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let out = f();
        let v = pollster::block_on(validation.pop());
        let i = pollster::block_on(internal.pop());
        let o = pollster::block_on(oom.pop());
        self.check_lost()?;
        if o.is_some() {
            return Err(CceError::OutOfMemory {
                backend: BACKEND,
                requested_bytes: self.call_bytes.load(Ordering::Relaxed),
            });
        }
        if let Some(e) = v.or(i) {
            return Err(backend_err(format!("{what}: {e}")));
        }
        if let Some(e) = self.uncaptured.lock().unwrap().pop() {
            return Err(backend_err(format!("{what}: {e}")));
        }
        out
    }

    /// `Backend` error if the device was lost.
    pub fn check_lost(&self) -> Result<()> {
        match self.lost.lock().unwrap().as_ref() {
            Some(msg) => Err(backend_err(msg.clone())),
            None => Ok(()),
        }
    }

    /// Submit `encoder` after appending copies of `(buffer, offset, size)` ranges into one
    /// staging buffer, wait, and return the bytes of each range. Sizes and offsets are
    /// multiples of 4.
    pub fn submit_and_read(
        &self,
        mut encoder: wgpu::CommandEncoder,
        ranges: &[(&wgpu::Buffer, u64, u64)],
    ) -> Result<Vec<Vec<u8>>> {
        let total: u64 = ranges.iter().map(|r| r.2).sum();
        if total == 0 {
            self.queue.submit([encoder.finish()]);
            self.wait()?;
            return Ok(ranges.iter().map(|_| Vec::new()).collect());
        }
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("staging"),
            size: total,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut at = 0;
        for &(buf, off, size) in ranges {
            if size > 0 {
                encoder.copy_buffer_to_buffer(buf, off, &staging, at, size);
            }
            at += size;
        }
        self.queue.submit([encoder.finish()]);
        let result: Arc<Mutex<Option<std::result::Result<(), wgpu::BufferAsyncError>>>> =
            Arc::new(Mutex::new(None));
        {
            let result = result.clone();
            staging.map_async(wgpu::MapMode::Read, .., move |r| {
                *result.lock().unwrap() = Some(r);
            });
        }
        self.wait()?;
        // Another thread's poll may have picked up the completion and be about to run our
        // callback: poll until it has run.
        let start = std::time::Instant::now();
        let outcome = loop {
            if let Some(r) = result.lock().unwrap().take() {
                break r;
            }
            if start.elapsed() > std::time::Duration::from_secs(600) {
                return Err(backend_err("map_async did not complete within 600 s"));
            }
            self.device
                .poll(wgpu::PollType::Poll)
                .map_err(|e| backend_err(format!("poll: {e}")))?;
            self.check_lost()?;
            std::thread::yield_now();
        };
        outcome.map_err(|e| backend_err(format!("map_async: {e}")))?;
        let view = staging
            .get_mapped_range(..)
            .map_err(|e| backend_err(format!("get_mapped_range: {e}")))?;
        let mut out = Vec::with_capacity(ranges.len());
        let mut at = 0usize;
        for &(_, _, size) in ranges {
            out.push(view[at..at + size as usize].to_vec());
            at += size as usize;
        }
        drop(view);
        staging.unmap();
        Ok(out)
    }

    /// Block until the queue is idle. Errors: `Backend` on poll failure or device loss.
    pub fn wait(&self) -> Result<()> {
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| backend_err(format!("poll: {e}")))?;
        self.check_lost()
    }
}
