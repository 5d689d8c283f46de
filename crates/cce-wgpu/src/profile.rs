//! Opt-in GPU timestamps of the backend's work, for benchmarks: with profiling on
//! ([`crate::WgpuBackend::set_profiling`]), every dispatch (where the device offers
//! `TIMESTAMP_QUERY_INSIDE_PASSES`) or else every compute pass (`TIMESTAMP_QUERY`) writes a
//! begin and an end timestamp into one query set; [`crate::WgpuBackend::take_pass_times`]
//! resolves them and sums the time per label (shader or pass name). Off by default: then
//! nothing is recorded and the passes carry no timestamp writes.
//!
//! Times are the GPU's timestamps (ns via the queue's timestamp period) between the begin and
//! end writes; dispatches of one pass may overlap on the GPU, so their sum can exceed the
//! pass's wall time. Meant for one thread at a time: concurrent calls share the query set.

use crate::context::backend_err;
use cce_core::Result;

/// Begin/end pairs one query set holds (wgpu's limit is 4096 queries per set).
pub(crate) const MAX_PAIRS: u32 = 2048;

/// Where timestamps go while profiling is on.
pub(crate) struct Profiler {
    set: wgpu::QuerySet,
    /// Label of each recorded pair, in query order (pair k: queries 2k, 2k+1).
    labels: Vec<&'static str>,
    /// Pairs asked for past [`MAX_PAIRS`] (not recorded).
    dropped: u64,
    /// Whether timestamps go around each dispatch (else around each pass).
    pub(crate) per_dispatch: bool,
}

/// Time per label, as [`crate::WgpuBackend::take_pass_times`] returns it.
#[derive(Clone, Debug, PartialEq)]
pub struct PassTime {
    /// Shader name (`fwd_partial`, `bwd_de`, ...) per dispatch, or pass label per pass.
    pub label: String,
    /// Sum of end − begin over the recorded pairs, in milliseconds.
    pub ms: f64,
    /// Pairs recorded.
    pub count: usize,
}

impl Profiler {
    pub(crate) fn new(device: &wgpu::Device, per_dispatch: bool) -> Self {
        let set = device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some("cce timestamps"),
            ty: wgpu::QueryType::Timestamp,
            count: 2 * MAX_PAIRS,
        });
        Self {
            set,
            labels: Vec::new(),
            dropped: 0,
            per_dispatch,
        }
    }

    /// The next pair's query indices for `label`, or `None` when the set is full.
    pub(crate) fn next(&mut self, label: &'static str) -> Option<(&wgpu::QuerySet, u32)> {
        if self.labels.len() as u32 >= MAX_PAIRS {
            self.dropped += 1;
            return None;
        }
        self.labels.push(label);
        Some((&self.set, 2 * (self.labels.len() as u32 - 1)))
    }

    /// Resolve the recorded pairs (their work submitted before), read them back and clear.
    /// Errors: `Backend` when the read-back fails.
    pub(crate) fn take(&mut self, ctx: &crate::context::Context) -> Result<(Vec<PassTime>, u64)> {
        let n = 2 * self.labels.len() as u32;
        let dropped = std::mem::take(&mut self.dropped);
        if n == 0 {
            return Ok((Vec::new(), dropped));
        }
        let bytes = 8 * n as u64;
        let resolve = ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("timestamps"),
            size: bytes,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let mut enc = ctx
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("timestamps"),
            });
        enc.resolve_query_set(&self.set, 0..n, &resolve, 0);
        let back = ctx.submit_and_read(enc, &[(&resolve, 0, bytes)])?;
        let ticks: &[u64] = bytemuck::try_cast_slice(&back[0])
            .map_err(|e| backend_err(format!("timestamps: {e}")))?;
        let period = ctx.queue.get_timestamp_period() as f64;
        let mut out: Vec<PassTime> = Vec::new();
        for (k, label) in self.labels.drain(..).enumerate() {
            let dt = ticks[2 * k + 1].saturating_sub(ticks[2 * k]) as f64 * period * 1e-6;
            match out.iter_mut().find(|p| p.label == label) {
                Some(p) => {
                    p.ms += dt;
                    p.count += 1;
                }
                None => out.push(PassTime {
                    label: label.to_string(),
                    ms: dt,
                    count: 1,
                }),
            }
        }
        Ok((out, dropped))
    }
}
