//! `WgpuBackend`: the `cce_core::Backend` implementation; the passes are in `forward` and
//! `backward`.

use crate::bounds::{check_dispatch, ROW_STATE_BYTES};
use crate::buffers::{Bind, Ctx, WgpuTensor};
use crate::context::{Context, BACKEND};
use crate::pipelines::{flags, Params, ShaderKind};
use cce_core::filter::N_BINS;
use cce_core::plan::Plan;
use cce_core::{
    Backend, BackwardOutput, CallStats, CceError, DType, DeviceLimits, ForwardOutput, HostTensor,
    Inputs, Options, PreparedTargets, Problem, Result, Saved, StrategyKind, TensorMeta, TileShape,
    Upstream,
};
use interop::{BackwardDest, ForwardDest};
use std::sync::Arc;
use wgpu::util::DeviceExt;

mod backward;
mod forward;
pub(crate) mod interop;

/// Kernel configuration: the tile shape of the shaders and how much parallelism to aim for.
///
/// A logits tile is `8·wg x 8·wg` (rows x classes); workgroups have `wg x wg` threads, each
/// owning an 8 x 8 micro-tile; the depth (`D`) loop steps by `tk`. These become the WGSL
/// override constants `WG` and `TK`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelConfig {
    /// Threads per tile side (tile side = 8·wg). Default 8 (64 x 64 tiles).
    pub wg: u32,
    /// Depth step along `D` staged through workgroup memory. Default 16.
    pub tk: u32,
    /// Workgroups a pass aims to launch (the split count along the other dimension follows).
    /// Default 2048 on GPUs, 8 on CPU adapters.
    pub target_workgroups: u32,
    /// Upper bound on the loop iterations (all loops together) one shader invocation runs,
    /// 0 for none. llvmpipe/lavapipe silently cuts an invocation's loops short after 65535
    /// iterations (gallivm's loop limiter), so on CPU adapters the work of a workgroup is
    /// bounded and split over more workgroups. Default 32768 on CPU adapters, 0 on GPUs.
    pub max_loop_iterations: u32,
    /// Whether shader modules keep wgpu's runtime checks (index clamping, loop counters,
    /// integer-division guards). Default false: the kernels' indexing is proven in bounds and
    /// every dispatch's bindings are validated on the host (the argument is in the crate's
    /// `bounds` module); true is for comparing the two and for debugging.
    pub runtime_checks: bool,
}

impl KernelConfig {
    /// Side of a logits tile (rows = classes).
    pub fn tile(&self) -> usize {
        8 * self.wg as usize
    }

    /// Workgroup memory of the largest shader in bytes (bwd_dc: panels, G tile, bias tree).
    pub fn workgroup_bytes(&self) -> u64 {
        let t = self.tile() as u64;
        let panels = 2 * self.tk as u64 * t * 4;
        let hist = t * N_BINS as u64 * 4;
        let g = t * t * 4 + t * self.wg as u64 * 4 + 64;
        let red = t * self.wg as u64 * 32;
        panels + hist.max(g).max(red)
    }
}

/// The wgpu backend. Construction opens one device (the best adapter; `CCE_WGPU_ADAPTER`
/// selects by name) and keeps it, its queue and the compiled pipelines for every later call.
///
/// Strategy: [`cce_core::Strategy::TileOwnership`] (module docs of `cce_core::plan`).
#[derive(Clone)]
pub struct WgpuBackend {
    ctx: Ctx,
    cfg: KernelConfig,
}

impl std::fmt::Debug for WgpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WgpuBackend")
            .field("adapter", &self.ctx.info.name)
            .field("cfg", &self.cfg)
            .finish()
    }
}

fn dtype_code(d: DType) -> u32 {
    match d {
        DType::F16 => 1,
        DType::BF16 => 2,
        _ => 0,
    }
}

fn tiles(len: usize, t: usize) -> usize {
    len.div_ceil(t)
}

fn u32c(x: usize, what: &str) -> Result<u32> {
    u32::try_from(x).map_err(|_| CceError::ResourceLimit {
        resource: format!("{what} (32-bit shader index)"),
        requested: x as u64,
        max: u32::MAX as u64,
    })
}

/// Splits of a chunk of `n_tiles` tiles into at most `want` contiguous pieces of at most
/// `cap` tiles (the cap wins): `(tiles per split, splits)`.
fn split(n_tiles: usize, want: usize, cap: usize) -> (usize, usize) {
    let want = want.clamp(1, n_tiles.max(1));
    let per = n_tiles.div_ceil(want).clamp(1, cap.max(1));
    (per, n_tiles.div_ceil(per).max(1))
}

/// `(tiles per split, splits, first partial column)` of one class chunk.
type ClassSplit = (usize, usize, usize);

/// What a validated call needs on the device.
struct Prepared {
    problem: Problem,
    plan: Plan,
    tgt: wgpu::Buffer,
    n_valid: usize,
    /// The prepared targets on the host (to name a masked target's class).
    targets: PreparedTargets,
}

impl WgpuBackend {
    /// Open the default adapter with the default [`KernelConfig`].
    ///
    /// Errors: `NoDevice` when no adapter exists, `Backend` when the device request fails.
    pub fn new() -> Result<Self> {
        let ctx = Arc::new(Context::new()?);
        let cfg = Self::default_config(&ctx.info);
        Self::check_cfg(&ctx, &cfg)?;
        Ok(Self { ctx, cfg })
    }

    /// The default [`KernelConfig`] for an adapter: 64 x 64 tiles; few workgroups and bounded
    /// loops on CPU adapters (lavapipe).
    pub(crate) fn default_config(info: &wgpu::AdapterInfo) -> KernelConfig {
        let cpu = info.device_type == wgpu::DeviceType::Cpu;
        KernelConfig {
            wg: 8,
            tk: 16,
            target_workgroups: if cpu { 8 } else { 2048 },
            max_loop_iterations: if cpu { 32768 } else { 0 },
            runtime_checks: false,
        }
    }

    /// Same device, another kernel configuration. Errors: `ResourceLimit` when the tiles do not
    /// fit the adapter's workgroup limits; `InvalidOption` for `wg` not in 1..=16 or `tk` not in
    /// 1..=64.
    pub fn with_config(&self, cfg: KernelConfig) -> Result<Self> {
        Self::check_cfg(&self.ctx, &cfg)?;
        Ok(Self {
            ctx: self.ctx.clone(),
            cfg,
        })
    }

    pub(crate) fn check_cfg(ctx: &Context, cfg: &KernelConfig) -> Result<()> {
        if !(1..=16).contains(&cfg.wg) || !(1..=64).contains(&cfg.tk) || cfg.target_workgroups == 0
        {
            return Err(CceError::InvalidOption {
                name: "KernelConfig",
                reason: format!("wg in 1..=16, tk in 1..=64, target_workgroups > 0; got {cfg:?}"),
            });
        }
        let wgb = cfg.workgroup_bytes();
        if wgb > ctx.limits.max_compute_workgroup_storage_size as u64 {
            return Err(CceError::ResourceLimit {
                resource: format!("workgroup memory bytes for tile {}", cfg.tile()),
                requested: wgb,
                max: ctx.limits.max_compute_workgroup_storage_size as u64,
            });
        }
        let threads = cfg.wg * cfg.wg;
        if threads > ctx.limits.max_compute_invocations_per_workgroup {
            return Err(CceError::ResourceLimit {
                resource: "invocations per workgroup".into(),
                requested: threads as u64,
                max: ctx.limits.max_compute_invocations_per_workgroup as u64,
            });
        }
        // Per-row arrays of a row chunk are bound at offsets of whole tiles of rows.
        let align = ctx.limits.min_storage_buffer_offset_alignment as usize;
        if !(cfg.tile() * 4).is_multiple_of(align) {
            return Err(CceError::Unsupported {
                backend: BACKEND,
                what: format!("storage offset alignment {align} with tile {}", cfg.tile()),
            });
        }
        Ok(())
    }

    /// The kernel configuration.
    pub fn config(&self) -> KernelConfig {
        self.cfg
    }

    /// Adapter name, vendor, driver and backend.
    pub fn adapter_info(&self) -> &wgpu::AdapterInfo {
        &self.ctx.info
    }

    /// The device (for callers that create their own buffers).
    pub fn device(&self) -> &wgpu::Device {
        &self.ctx.device
    }

    /// The queue.
    pub fn queue(&self) -> &wgpu::Queue {
        &self.ctx.queue
    }

    /// Whether the device has `SHADER_F16` (not needed by these shaders, which carry f16 as
    /// packed u32 words; reported for information).
    pub fn has_shader_f16(&self) -> bool {
        self.ctx.features.contains(wgpu::Features::SHADER_F16)
    }

    /// Block until all submitted work is done (for timing). Errors: `Backend`.
    pub fn synchronize(&self) -> Result<()> {
        self.ctx.wait()
    }

    fn t(&self) -> usize {
        self.cfg.tile()
    }

    /// Most tiles one workgroup may walk when each costs `iters` loop iterations per thread.
    fn cap_tiles(&self, iters: usize) -> usize {
        match self.cfg.max_loop_iterations {
            0 => usize::MAX,
            m => (m as usize / iters.max(1)).max(1),
        }
    }

    /// Loop iterations per thread of one depth step of the logits tile (two staging loops,
    /// the TK-step product, the step itself).
    fn step_iters(&self) -> usize {
        let t = self.t();
        let wg2 = (self.cfg.wg * self.cfg.wg) as usize;
        let tk = self.cfg.tk as usize;
        2 * (tk * t).div_ceil(wg2) + tk + 1
    }

    /// Loop iterations per thread of one forward / threshold tile.
    fn fwd_iters(&self, d: usize) -> usize {
        d.div_ceil(self.cfg.tk as usize) * self.step_iters() + 256
    }

    /// Loop iterations per thread of one backward tile (logits, G, the d_e or d_c product).
    fn bwd_iters(&self, d: usize) -> usize {
        let t = self.t();
        let tk = self.cfg.tk as usize;
        let slices = d.div_ceil(t);
        let per_slice = t.div_ceil(tk) * (self.step_iters() - tk) + t.div_ceil(tk) * tk + 128;
        self.fwd_iters(d) + slices * per_slice + 128
    }

    /// `Unsupported` when one tile alone exceeds the adapter's loop budget.
    fn check_iters(&self, d: usize) -> Result<()> {
        let m = self.cfg.max_loop_iterations as usize;
        if m > 0 && self.bwd_iters(d) > 65535 {
            return Err(CceError::Unsupported {
                backend: BACKEND,
                what: format!(
                    "D = {d} on {} (one tile needs {} loop iterations, over the driver's 65535)",
                    self.ctx.info.name,
                    self.bwd_iters(d)
                ),
            });
        }
        Ok(())
    }

    /// Record one dispatch: binding 0 = `params`, then `binds` in order. Errors: `Backend`
    /// when a binding is smaller than the shader may access with these `params` and `grid`
    /// ([`check_dispatch`]: an internal invariant broken, refused rather than dispatched).
    fn run(
        &self,
        pass: &mut wgpu::ComputePass<'_>,
        kind: ShaderKind,
        dt: u32,
        params: &Params,
        binds: &[Bind<'_>],
        grid: [u32; 3],
    ) -> Result<()> {
        if grid.contains(&0) {
            return Ok(());
        }
        let sizes: Vec<u64> = binds.iter().map(|b| b.size).collect();
        check_dispatch(kind, dt, params, grid, &sizes)
            .map_err(|e| crate::context::backend_err(format!("dispatch refused: {e}")))?;
        let dev = &self.ctx.device;
        let pipe = self.ctx.pipeline(
            kind,
            dt,
            (self.cfg.wg, self.cfg.tk),
            self.cfg.runtime_checks,
        );
        let ubuf = dev.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("params"),
            contents: bytemuck::bytes_of(params),
            usage: wgpu::BufferUsages::UNIFORM,
        });
        let mut entries = vec![wgpu::BindGroupEntry {
            binding: 0,
            resource: ubuf.as_entire_binding(),
        }];
        entries.extend(binds.iter().enumerate().map(|(i, b)| b.entry(i as u32 + 1)));
        let bg = dev.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(kind.name()),
            layout: &pipe.get_bind_group_layout(0),
            entries: &entries,
        });
        pass.set_pipeline(&pipe);
        pass.set_bind_group(0, &bg, &[]);
        pass.dispatch_workgroups(grid[0], grid[1], grid[2]);
        Ok(())
    }

    /// A 1-D grid of `units` threads in workgroups of 64 (folded into y past 65535 groups).
    fn grid_1d(units: usize) -> [u32; 3] {
        let groups = units.div_ceil(64);
        if groups <= 65535 {
            [groups as u32, 1, 1]
        } else {
            [65535, groups.div_ceil(65535) as u32, 1]
        }
    }

    fn encoder(&self) -> wgpu::CommandEncoder {
        self.ctx
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("cce") })
    }

    fn pass<'e>(enc: &'e mut wgpu::CommandEncoder, label: &str) -> wgpu::ComputePass<'e> {
        enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some(label),
            timestamp_writes: None,
        })
    }

    /// Validate inputs, read back and prepare targets, compute the plan.
    fn prepare(&self, inputs: &Inputs<'_, WgpuTensor>, opts: &Options) -> Result<Prepared> {
        for (t, what) in [
            (inputs.e, "e"),
            (inputs.c, "c"),
            (inputs.targets, "targets"),
        ] {
            self.ctx.check_own(t, what)?;
        }
        if let Some(b) = inputs.bias {
            self.ctx.check_own(b, "bias")?;
        }
        let problem = Problem::new(
            inputs.e,
            inputs.c,
            inputs.bias.map(|b| b as &dyn TensorMeta),
            inputs.targets,
            opts,
        )?;
        let raw = self.ctx.download(inputs.targets)?;
        let raw = raw.to_i64_vec().ok_or_else(|| CceError::DTypeMismatch {
            what: "targets",
            expected: "i32 or i64".into(),
            got: raw.dtype(),
        })?;
        let prepared = PreparedTargets::new(&raw, &problem, opts)?;
        let tgt = self
            .ctx
            .upload_bytes(bytemuck::cast_slice(&prepared.classes), "targets")?;
        let plan = Plan::new(&problem, opts, &self.limits())?;
        self.check_iters(problem.d)?;
        Ok(Prepared {
            problem,
            plan,
            tgt,
            n_valid: prepared.n_valid,
            targets: prepared,
        })
    }

    fn base_flags(&self, p: &Problem, opts: &Options) -> u32 {
        let mut f = 0;
        if opts.softcap.is_some() {
            f |= flags::SOFTCAP;
        }
        if p.has_bias {
            f |= flags::BIAS;
        }
        f
    }

    fn base_params(&self, p: &Problem, opts: &Options) -> Params {
        Params {
            d: p.d as u32,
            v_total: p.v as u32,
            flags: self.base_flags(p, opts),
            softcap: opts.softcap.unwrap_or(1.0),
            ls_alpha: opts.label_smoothing,
            z_loss: opts.z_loss,
            ..Params::default()
        }
    }

    fn stats(&self, prep: &Prepared, workspace_bytes: u64) -> CallStats {
        CallStats {
            backend: BACKEND.into(),
            strategy: prep.plan.strategy,
            plan_reason: prep.plan.reason.clone(),
            n_valid: prep.n_valid,
            tiles_total: prep.plan.tile_count(),
            tiles_visited: 0,
            tiles_skipped: 0,
            entries_kept: 0,
            entries_skipped: 0,
            dropped_mass_max: 0.0,
            dropped_mass_mean: 0.0,
            filter_eps: prep.plan.filter.eps,
            max_dropped_mass: prep.plan.filter.max_dropped_mass,
            workspace_bytes,
        }
    }

    /// Splits per class chunk for the forward / threshold passes: `(tiles per split, splits,
    /// first partial column)` per class chunk, and the total partial columns.
    fn class_splits(&self, plan: &Plan) -> Result<(Vec<ClassSplit>, usize)> {
        let t = self.t();
        let max_rt = plan
            .row_chunks
            .iter()
            .map(|r| tiles(r.len(), t))
            .max()
            .unwrap_or(1);
        let max_rc = plan.row_chunks.iter().map(|r| r.len()).max().unwrap_or(1);
        let mut want = (self.cfg.target_workgroups as usize)
            .div_ceil(max_rt)
            .max(1);
        loop {
            let mut out = Vec::new();
            let mut base = 0;
            let cap = self.cap_tiles(self.fwd_iters(plan.problem.d));
            for cc in &plan.class_chunks {
                let (per, n) = split(tiles(cc.len(), t), want, cap);
                out.push((per, n, base));
                base += n;
            }
            let bytes = (max_rc * base * 32) as u64;
            if bytes <= self.ctx.max_binding() {
                return Ok((out, base));
            }
            if want == 1 || out.iter().all(|x| x.1 == 1) {
                return Err(CceError::ResourceLimit {
                    resource: "bytes of the forward partials of one row chunk".into(),
                    requested: bytes,
                    max: self.ctx.max_binding(),
                });
            }
            want /= 2;
        }
    }
}

impl Backend for WgpuBackend {
    type Buffer = WgpuTensor;

    fn name(&self) -> &'static str {
        BACKEND
    }

    /// Binding size (not buffer size) bounds the chunks: `max_buffer_bytes` is the adapter's
    /// `max_storage_buffer_binding_size` (128 MiB on lavapipe, 2 GiB on the H200).
    fn limits(&self) -> DeviceLimits {
        let l = &self.ctx.limits;
        let t = self.t();
        DeviceLimits {
            name: self.ctx.info.name.clone(),
            max_buffer_bytes: self.ctx.max_binding(),
            max_block_memory_bytes: l.max_compute_workgroup_storage_size as u64,
            max_threads_per_block: l.max_compute_invocations_per_workgroup,
            max_grid: [l.max_compute_workgroups_per_dimension; 3],
            index_bits: 32,
            tile: TileShape {
                rows: t,
                classes: t,
                depth: self.cfg.tk as usize,
            },
            strategies: vec![StrategyKind::TileOwnership],
            class_forward: false,
        }
    }

    fn upload(&self, host: &HostTensor) -> Result<WgpuTensor> {
        self.ctx.scoped("upload", || self.ctx.upload(host))
    }

    fn download(&self, buf: &WgpuTensor) -> Result<HostTensor> {
        self.ctx.scoped("download", || self.ctx.download(buf))
    }

    fn forward(
        &self,
        inputs: &Inputs<'_, WgpuTensor>,
        opts: &Options,
    ) -> Result<ForwardOutput<WgpuTensor>> {
        self.forward_into(inputs, opts, &ForwardDest::default())
    }

    fn backward(
        &self,
        inputs: &Inputs<'_, WgpuTensor>,
        opts: &Options,
        saved: Saved<'_, WgpuTensor>,
        upstream: &Upstream<'_, WgpuTensor>,
    ) -> Result<BackwardOutput<WgpuTensor>> {
        self.backward_into(inputs, opts, saved, upstream, &BackwardDest::default())
    }
}

#[allow(dead_code)]
fn _assert_send_sync() {
    fn f<T: Send + Sync>() {}
    f::<WgpuTensor>();
}
