//! `WgpuBackend`: the `cce_core::Backend` implementation (forward and backward orchestration).

use crate::buffers::{Bind, Ctx, WgpuTensor};
use crate::context::{Context, BACKEND};
use crate::pipelines::{flags, Params, ShaderKind};
use cce_core::filter::{FilterRule, FIXED_POINT_ONE, N_BINS};
use cce_core::plan::Plan;
use cce_core::problem::check_masked_targets;
use cce_core::{
    Backend, BackwardOutput, CallStats, CceError, DLoss, DType, DeviceLimits, ForwardOutput,
    GradDType, HostTensor, Inputs, Options, PreparedTargets, Problem, Reduction, Result, Saved,
    StrategyKind, TensorMeta, TileShape, Upstream,
};
use std::ops::Range;
use std::sync::Arc;
use wgpu::util::DeviceExt;

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

/// Bytes of one `RowState` (common.wgsl).
const ROW_STATE_BYTES: u64 = 48;

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

/// Splits of a chunk of `n_tiles` tiles into at most `want` contiguous pieces:
/// `(tiles per split, splits)`.
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
        let cpu = ctx.info.device_type == wgpu::DeviceType::Cpu;
        let cfg = KernelConfig {
            wg: 8,
            tk: 16,
            target_workgroups: if cpu { 8 } else { 2048 },
            max_loop_iterations: if cpu { 32768 } else { 0 },
        };
        Self::check_cfg(&ctx, &cfg)?;
        Ok(Self { ctx, cfg })
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

    fn check_cfg(ctx: &Context, cfg: &KernelConfig) -> Result<()> {
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

    /// Record one dispatch: binding 0 = `params`, then `binds` in order.
    fn run(
        &self,
        pass: &mut wgpu::ComputePass<'_>,
        kind: ShaderKind,
        dt: u32,
        params: &Params,
        binds: &[Bind<'_>],
        grid: [u32; 3],
    ) {
        if grid.contains(&0) {
            return;
        }
        let dev = &self.ctx.device;
        let pipe = self.ctx.pipeline(kind, dt, self.cfg.wg, self.cfg.tk);
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

    fn forward_impl(
        &self,
        inputs: &Inputs<'_, WgpuTensor>,
        opts: &Options,
    ) -> Result<ForwardOutput<WgpuTensor>> {
        let prep = self.prepare(inputs, opts)?;
        let p = prep.problem;
        let plan = &prep.plan;
        let (n, d) = (p.n, p.d);
        let t = self.t();
        let dt = dtype_code(p.dtype);
        let es = p.dtype.size_bytes() as u64;
        let ctx = &self.ctx;
        let (splits, stride) = self.class_splits(plan)?;
        let max_rc = plan.row_chunks.iter().map(|r| r.len()).max().unwrap_or(1);

        let part = ctx.raw_buffer((max_rc * stride * 32) as u64, "partials")?;
        let tlogit = ctx.raw_buffer(4 * n as u64, "target logits")?;
        let lse = ctx.alloc(vec![n], DType::F32, "lse")?;
        let rest_mass = ctx.alloc(vec![n], DType::F32, "rest mass")?;
        let loss_rows = ctx.alloc(vec![n], DType::F32, "loss rows")?;
        let ent = ctx.alloc(vec![n], DType::F32, "entropy")?;
        let amax = ctx.alloc(vec![n], DType::I32, "argmax")?;
        let bad = ctx.upload_bytes(bytemuck::cast_slice(&[u32::MAX; 4]), "bad rows")?;
        let loss_scalar = if opts.reduction == Reduction::None {
            None
        } else {
            Some(ctx.alloc(vec![], DType::F32, "loss")?)
        };
        let workspace = part.size() + tlogit.size() + 4 * n as u64 * 2;
        let scale = match opts.reduction {
            Reduction::Mean if prep.n_valid > 0 => 1.0 / prep.n_valid as f32,
            // `prepare` has rejected a mean over no valid row (`PreparedTargets::new`).
            Reduction::Mean => return Err(CceError::all_targets_ignored(n, opts)),
            _ => 1.0,
        };

        let mut enc = self.encoder();
        {
            let mut pass = Self::pass(&mut enc, "forward");
            let n_rc = plan.row_chunks.len();
            for (ri, rc) in plan.row_chunks.iter().enumerate() {
                let rows = rc.len();
                let (e_b, e_off) = ctx.range(
                    &inputs.e.buffer,
                    (rc.start * d) as u64,
                    (rows * d) as u64,
                    es,
                )?;
                let tgt_b = ctx.aligned(&prep.tgt, rc.start as u64, rows as u64, 4)?;
                let tl_b = ctx.aligned(&tlogit, rc.start as u64, rows as u64, 4)?;
                let part_b = ctx.whole(&part)?;
                for (ci, cc) in plan.class_chunks.iter().enumerate() {
                    let (c_b, c_off) = ctx.range(
                        &inputs.c.buffer,
                        (cc.start * d) as u64,
                        (cc.len() * d) as u64,
                        es,
                    )?;
                    let (b_b, b_off) = match inputs.bias {
                        Some(b) => ctx.range(&b.buffer, cc.start as u64, cc.len() as u64, es)?,
                        None => (ctx.whole(&ctx.dummy)?, 0),
                    };
                    let (per, nsplit, base) = splits[ci];
                    let prm = Params {
                        n_rows: rows as u32,
                        n_cls: cc.len() as u32,
                        row0: rc.start as u32,
                        cls0: cc.start as u32,
                        e_off,
                        c_off,
                        b_off,
                        split_tiles: per as u32,
                        part_base: base as u32,
                        part_stride: stride as u32,
                        ..self.base_params(&p, opts)
                    };
                    self.run(
                        &mut pass,
                        ShaderKind::FwdPartial,
                        dt,
                        &prm,
                        &[e_b, c_b, b_b, tgt_b, part_b, tl_b],
                        [nsplit as u32, tiles(rows, t) as u32, 1],
                    );
                }
                let prm = Params {
                    n_rows: rows as u32,
                    row0: rc.start as u32,
                    part_stride: stride as u32,
                    ..self.base_params(&p, opts)
                };
                let lr_b = ctx.aligned(&loss_rows.buffer, rc.start as u64, rows as u64, 4)?;
                self.run(
                    &mut pass,
                    ShaderKind::FwdMerge,
                    dt,
                    &prm,
                    &[
                        part_b,
                        tgt_b,
                        tl_b,
                        ctx.aligned(&lse.buffer, rc.start as u64, rows as u64, 4)?,
                        lr_b,
                        ctx.aligned(&ent.buffer, rc.start as u64, rows as u64, 4)?,
                        ctx.aligned(&amax.buffer, rc.start as u64, rows as u64, 4)?,
                        ctx.whole(&bad)?,
                        ctx.aligned(&rest_mass.buffer, rc.start as u64, rows as u64, 4)?,
                    ],
                    Self::grid_1d(rows),
                );
                if let Some(ls) = &loss_scalar {
                    let mut f = 0;
                    if ri == 0 {
                        f |= flags::FIRST;
                    }
                    if ri + 1 == n_rc {
                        f |= flags::LAST;
                    }
                    let prm = Params {
                        n_rows: rows as u32,
                        flags: f,
                        aux: scale,
                        ..Params::default()
                    };
                    self.run(
                        &mut pass,
                        ShaderKind::LossReduce,
                        dt,
                        &prm,
                        &[lr_b, ctx.whole(&ls.buffer)?],
                        [1, 1, 1],
                    );
                }
            }
        }
        let back = ctx.submit_and_read(enc, &[(&bad, 0, 16)])?;
        let bad_row = |k: usize| {
            let row = u32::from_le_bytes(back[0][4 * k..4 * k + 4].try_into().unwrap());
            (row != u32::MAX).then_some(row as usize)
        };
        if let Some(row) = bad_row(0).filter(|_| opts.check_finite) {
            let enc = self.encoder();
            let v = ctx.submit_and_read(enc, &[(&lse.buffer, row as u64 * 4, 4)])?;
            let value = f32::from_le_bytes(v[0][..4].try_into().unwrap());
            return Err(CceError::NonFinite {
                what: "lse (a NaN or Inf in e, c or bias of this row, or a -inf in e or c)",
                index: row,
                row,
                // A −inf in e or c leaves a finite lse (the logit passed for a masked one).
                value: if value.is_finite() {
                    f32::NEG_INFINITY
                } else {
                    value
                },
            });
        }
        let (masked_target, any_masked) = (bad_row(1), bad_row(2));
        check_masked_targets(&prep.targets, opts, |i| {
            (Some(i) == masked_target, Some(i) == any_masked)
        })?;
        let loss = match loss_scalar {
            Some(l) => l,
            None => loss_rows,
        };
        Ok(ForwardOutput {
            loss,
            lse,
            rest_mass,
            entropy: opts.side_outputs.entropy.then_some(ent),
            argmax: opts.side_outputs.argmax.then_some(amax),
            stats: self.stats(&prep, workspace),
        })
    }

    #[allow(clippy::too_many_lines)]
    fn backward_impl(
        &self,
        inputs: &Inputs<'_, WgpuTensor>,
        opts: &Options,
        saved: Saved<'_, WgpuTensor>,
        upstream: &Upstream<'_, WgpuTensor>,
    ) -> Result<BackwardOutput<WgpuTensor>> {
        let lse = saved.lse;
        let prep = self.prepare(inputs, opts)?;
        let p = prep.problem;
        let plan = &prep.plan;
        let rule: FilterRule = plan.filter;
        let (n, d, v) = (p.n, p.d, p.v);
        let t = self.t();
        let dt = dtype_code(p.dtype);
        let es = p.dtype.size_bytes() as u64;
        let ctx = &self.ctx;
        let check_rows = |b: &WgpuTensor, what: &'static str| -> Result<()> {
            ctx.check_own(b, what)?;
            if b.shape().iter().product::<usize>() != n || b.dtype() != DType::F32 {
                return Err(CceError::ShapeMismatch {
                    what,
                    expected: format!("[{n}] f32"),
                    got: format!("{:?} {}", b.shape(), b.dtype()),
                });
            }
            Ok(())
        };
        check_rows(lse, "lse")?;
        check_rows(saved.rest_mass, "rest_mass")?;
        let bad_dloss = |what: &str| CceError::ShapeMismatch {
            what: "d_loss",
            expected: format!("per-row [{n}] f32 for reduction none, a scalar otherwise"),
            got: format!("{what} with reduction {:?}", opts.reduction),
        };
        let (g_scalar, dloss_rows) = match upstream.d_loss {
            DLoss::Scalar(_) if opts.reduction == Reduction::None => {
                return Err(bad_dloss("scalar"));
            }
            DLoss::Scalar(g) => {
                cce_core::problem::check_upstream_finite("d_loss", [g])?;
                let g = match opts.reduction {
                    Reduction::Mean if prep.n_valid > 0 => g / prep.n_valid as f32,
                    // `prepare` has rejected a mean over no valid row (`PreparedTargets::new`).
                    Reduction::Mean => return Err(CceError::all_targets_ignored(n, opts)),
                    _ => g,
                };
                (g, None)
            }
            DLoss::PerRow(_) if opts.reduction != Reduction::None => {
                return Err(bad_dloss("per-row tensor"));
            }
            DLoss::PerRow(b) => {
                check_rows(b, "d_loss")?;
                (0.0, Some(b))
            }
        };
        if let Some(h) = upstream.d_lse {
            check_rows(h, "d_lse")?;
        }
        if opts.check_finite {
            // The per-row upstream gradients are read back (4N bytes each) and checked before
            // any work: a NaN there would otherwise vanish in the kernels' zero tests.
            let named = [("d_loss", dloss_rows), ("d_lse", upstream.d_lse)];
            for (what, b) in named {
                if let Some(b) = b {
                    let host = <Self as Backend>::download(self, b)?;
                    cce_core::problem::check_upstream_finite(what, host.to_f32_vec())?;
                }
            }
        }
        let out_dtype = if opts.grad_dtype == GradDType::F32 {
            DType::F32
        } else {
            p.dtype
        };
        let out_dt = dtype_code(out_dtype);
        let want_de = opts.compute_d_e;
        let want_dc = opts.compute_d_c;
        let ls_analytic = rule.label_smoothing_analytic && opts.label_smoothing > 0.0;
        let filter_e = rule.filter_e_grad && want_de;
        let filter_c = rule.filter_c_grad && want_dc;
        let need_hist = filter_e || filter_c;
        let max_rc = plan.row_chunks.iter().map(|r| r.len()).max().unwrap_or(1);
        let max_cc = plan.class_chunks.iter().map(|c| c.len()).max().unwrap_or(1);
        let budget = opts.workspace_budget_bytes;

        // Per-row state, threshold histogram, dropped mass, counters.
        let rs = ctx.raw_buffer(ROW_STATE_BYTES * n as u64, "row state")?;
        let hist = if need_hist {
            Some(ctx.raw_buffer(4 * (N_BINS * n) as u64, "histogram")?)
        } else {
            None
        };
        let edges: Vec<f32> = (0..N_BINS).map(|k| rule.edge(k)).collect();
        let edges_b = ctx.upload_bytes(bytemuck::cast_slice(&edges), "edges")?;
        let dropped = ctx.raw_buffer(4 * n as u64, "dropped mass")?;
        let stat = ctx.raw_buffer(8, "dropped stats")?;
        let mut workspace = rs.size() + hist.as_ref().map_or(0, |h| h.size()) + dropped.size();

        // Splits and slabs.
        let de_split = {
            let max_rt = plan
                .row_chunks
                .iter()
                .map(|r| tiles(r.len(), t))
                .max()
                .unwrap_or(1);
            let max_ct = plan
                .class_chunks
                .iter()
                .map(|c| tiles(c.len(), t))
                .max()
                .unwrap_or(1);
            let slab = (max_rc * d * 4) as u64;
            let room = budget.saturating_sub(workspace) / slab.max(1);
            let fit = (ctx.max_binding() / slab.max(1)).max(1);
            (self.cfg.target_workgroups as usize)
                .div_ceil(max_rt)
                .min(max_ct)
                .min(room.max(1) as usize)
                .min(fit as usize)
                .max(1)
        };
        let dc_split = {
            let max_ct = plan
                .class_chunks
                .iter()
                .map(|c| tiles(c.len(), t))
                .max()
                .unwrap_or(1);
            let max_rt = plan
                .row_chunks
                .iter()
                .map(|r| tiles(r.len(), t))
                .max()
                .unwrap_or(1);
            let slab = (max_cc * d * 4) as u64;
            let room = budget.saturating_sub(workspace) / slab.max(1);
            let fit = (ctx.max_binding() / slab.max(1)).max(1);
            (self.cfg.target_workgroups as usize)
                .div_ceil(max_ct)
                .min(max_rt)
                .min(room.max(1) as usize)
                .min(fit as usize)
                .max(1)
        };
        // Splits per chunk (capped per workgroup), slabs, and counter slots: every workgroup of
        // the d_e and d_c passes.
        let bcap = self.cap_tiles(self.bwd_iters(d));
        let de_splits: Vec<(usize, usize)> = plan
            .class_chunks
            .iter()
            .map(|cc| split(tiles(cc.len(), t), de_split, bcap))
            .collect();
        let dc_splits: Vec<(usize, usize)> = plan
            .row_chunks
            .iter()
            .map(|rc| split(tiles(rc.len(), t), dc_split, bcap))
            .collect();
        // Slabs: at most the budgeted split count; more splits run in waves over the same slabs.
        let de_slabs = de_splits
            .iter()
            .map(|x| x.1)
            .max()
            .unwrap_or(1)
            .min(de_split);
        let dc_slabs = dc_splits
            .iter()
            .map(|x| x.1)
            .max()
            .unwrap_or(1)
            .min(dc_split);
        let mut de_slots = 0usize;
        let mut dc_slots = 0usize;
        for (ri, rc) in plan.row_chunks.iter().enumerate() {
            for (ci, cc) in plan.class_chunks.iter().enumerate() {
                de_slots += de_splits[ci].1 * tiles(rc.len(), t);
                dc_slots += dc_splits[ri].1 * tiles(cc.len(), t);
            }
        }
        let n_slots = (if want_de { de_slots } else { 0 }) + (if want_dc { dc_slots } else { 0 });
        let counters = ctx.raw_buffer(16 * n_slots.max(1) as u64, "counters")?;
        workspace += counters.size();

        let d_e = if want_de {
            Some(ctx.alloc(inputs.e.shape().to_vec(), out_dtype, "d_e")?)
        } else {
            None
        };
        let d_c = if want_dc {
            Some(ctx.alloc(vec![v, d], out_dtype, "d_c")?)
        } else {
            None
        };
        let d_bias = if want_dc && p.has_bias {
            Some(ctx.alloc(vec![v], out_dtype, "d_bias")?)
        } else {
            None
        };
        let csum = if ls_analytic && want_de {
            Some(ctx.raw_buffer(4 * (d + 1) as u64, "sum of c")?)
        } else {
            None
        };
        let esum = if ls_analytic && want_dc {
            Some(ctx.raw_buffer(4 * (d + 1) as u64, "sum of g e")?)
        } else {
            None
        };

        let base = self.base_params(&p, opts);
        let mut enc = self.encoder();

        // 1. Row state (and, with the filter, the threshold pass).
        {
            let mut pass = Self::pass(&mut enc, "backward prep");
            for rc in &plan.row_chunks {
                let rows = rc.len();
                let mut f = 0;
                if dloss_rows.is_some() {
                    f |= flags::DLOSS_ROWS;
                }
                if upstream.d_lse.is_some() {
                    f |= flags::DLSE;
                }
                if ls_analytic {
                    f |= flags::LS_ANALYTIC;
                }
                let prm = Params {
                    n_rows: rows as u32,
                    flags: f,
                    aux: g_scalar,
                    ..base
                };
                let dl = match dloss_rows {
                    Some(b) => ctx.aligned(&b.buffer, rc.start as u64, rows as u64, 4)?,
                    None => ctx.whole(&ctx.dummy)?,
                };
                let dh = match upstream.d_lse {
                    Some(b) => ctx.aligned(&b.buffer, rc.start as u64, rows as u64, 4)?,
                    None => ctx.whole(&ctx.dummy)?,
                };
                self.run(
                    &mut pass,
                    ShaderKind::BwdPrep,
                    dt,
                    &prm,
                    &[
                        ctx.aligned(&prep.tgt, rc.start as u64, rows as u64, 4)?,
                        ctx.aligned(&lse.buffer, rc.start as u64, rows as u64, 4)?,
                        dl,
                        dh,
                        ctx.aligned(&rs, rc.start as u64, rows as u64, ROW_STATE_BYTES)?,
                        ctx.aligned(&saved.rest_mass.buffer, rc.start as u64, rows as u64, 4)?,
                    ],
                    Self::grid_1d(rows),
                );
            }
            if let Some(hist) = &hist {
                let (splits, _) = self.class_splits(plan)?;
                for rc in &plan.row_chunks {
                    let rows = rc.len();
                    let (e_b, e_off) = ctx.range(
                        &inputs.e.buffer,
                        (rc.start * d) as u64,
                        (rows * d) as u64,
                        es,
                    )?;
                    let rs_b = ctx.aligned(&rs, rc.start as u64, rows as u64, ROW_STATE_BYTES)?;
                    let h_b = ctx.aligned(hist, rc.start as u64, rows as u64, 4 * N_BINS as u64)?;
                    for (ci, cc) in plan.class_chunks.iter().enumerate() {
                        let (c_b, c_off) = ctx.range(
                            &inputs.c.buffer,
                            (cc.start * d) as u64,
                            (cc.len() * d) as u64,
                            es,
                        )?;
                        let (b_b, b_off) = match inputs.bias {
                            Some(b) => {
                                ctx.range(&b.buffer, cc.start as u64, cc.len() as u64, es)?
                            }
                            None => (ctx.whole(&ctx.dummy)?, 0),
                        };
                        let (per, nsplit, _) = splits[ci];
                        let prm = Params {
                            n_rows: rows as u32,
                            n_cls: cc.len() as u32,
                            row0: rc.start as u32,
                            cls0: cc.start as u32,
                            e_off,
                            c_off,
                            b_off,
                            split_tiles: per as u32,
                            eps: rule.eps,
                            ..base
                        };
                        self.run(
                            &mut pass,
                            ShaderKind::BwdHist,
                            dt,
                            &prm,
                            &[e_b, c_b, b_b, rs_b, ctx.whole(&edges_b)?, h_b],
                            [nsplit as u32, tiles(rows, t) as u32, 1],
                        );
                    }
                    let delta_fixed =
                        (rule.max_dropped_mass as f64 * FIXED_POINT_ONE).floor() as u64;
                    let prm = Params {
                        n_rows: rows as u32,
                        delta_fixed: delta_fixed.min(u32::MAX as u64) as u32,
                        ..base
                    };
                    self.run(
                        &mut pass,
                        ShaderKind::BwdTau,
                        dt,
                        &prm,
                        &[h_b, ctx.whole(&edges_b)?, rs_b],
                        Self::grid_1d(rows),
                    );
                }
            }
            // Column sums for analytic label smoothing, over pieces of at most `piece` rows
            // (one loop iteration per row in the shader).
            let piece = match self.cfg.max_loop_iterations {
                0 => usize::MAX,
                m => (m as usize / 2 / t * t).max(t),
            };
            let pieces = |r: &Range<usize>| -> Vec<Range<usize>> {
                (r.start..r.end)
                    .step_by(piece.min(r.len()).max(1))
                    .map(|s| s..(s + piece).min(r.end))
                    .collect()
            };
            if let Some(cs) = &csum {
                for cc in plan.class_chunks.iter().flat_map(pieces) {
                    let (c_b, c_off) = ctx.range(
                        &inputs.c.buffer,
                        (cc.start * d) as u64,
                        (cc.len() * d) as u64,
                        es,
                    )?;
                    let prm = Params {
                        n_rows: cc.len() as u32,
                        e_off: c_off,
                        flags: 0,
                        ..base
                    };
                    self.run(
                        &mut pass,
                        ShaderKind::WSum,
                        dt,
                        &prm,
                        &[c_b, ctx.whole(&ctx.dummy)?, ctx.whole(cs)?],
                        Self::grid_1d(d + 1),
                    );
                }
            }
            if let Some(es_buf) = &esum {
                for rc in plan.row_chunks.iter().flat_map(pieces) {
                    let rows = rc.len();
                    let (e_b, e_off) = ctx.range(
                        &inputs.e.buffer,
                        (rc.start * d) as u64,
                        (rows * d) as u64,
                        es,
                    )?;
                    let prm = Params {
                        n_rows: rows as u32,
                        e_off,
                        flags: flags::WEIGHTED,
                        ..base
                    };
                    self.run(
                        &mut pass,
                        ShaderKind::WSum,
                        dt,
                        &prm,
                        &[
                            e_b,
                            ctx.aligned(&rs, rc.start as u64, rows as u64, ROW_STATE_BYTES)?,
                            ctx.whole(es_buf)?,
                        ],
                        Self::grid_1d(d + 1),
                    );
                }
            }
        }

        let mut slot = 0usize;
        // 2. d_e, row-owned.
        if let Some(d_e) = &d_e {
            let slab_stride = max_rc * d;
            let slab = ctx.raw_buffer((de_slabs * slab_stride * 4) as u64, "d_e slabs")?;
            workspace += slab.size();
            let mut f = base.flags;
            if filter_e {
                f |= flags::FILTER | flags::REPORT;
            }
            for rc in &plan.row_chunks {
                let rows = rc.len();
                enc.clear_buffer(&slab, 0, None);
                let mut pass = Self::pass(&mut enc, "d_e");
                let (e_b, e_off) = ctx.range(
                    &inputs.e.buffer,
                    (rc.start * d) as u64,
                    (rows * d) as u64,
                    es,
                )?;
                let rs_b = ctx.aligned(&rs, rc.start as u64, rows as u64, ROW_STATE_BYTES)?;
                let dr_b = ctx.aligned(&dropped, rc.start as u64, rows as u64, 4)?;
                for (ci, cc) in plan.class_chunks.iter().enumerate() {
                    let (c_b, c_off) = ctx.range(
                        &inputs.c.buffer,
                        (cc.start * d) as u64,
                        (cc.len() * d) as u64,
                        es,
                    )?;
                    let (b_b, b_off) = match inputs.bias {
                        Some(b) => ctx.range(&b.buffer, cc.start as u64, cc.len() as u64, es)?,
                        None => (ctx.whole(&ctx.dummy)?, 0),
                    };
                    let (per, ns) = de_splits[ci];
                    for w0 in (0..ns).step_by(de_slabs) {
                        let nw = de_slabs.min(ns - w0);
                        let prm = Params {
                            n_rows: rows as u32,
                            n_cls: cc.len() as u32,
                            row0: rc.start as u32,
                            cls0: cc.start as u32,
                            e_off,
                            c_off,
                            b_off,
                            flags: f,
                            split_tiles: per as u32,
                            split_base: w0 as u32,
                            slot_base: u32c(slot, "counter slots")?,
                            slab_stride: u32c(rows * d, "slab stride")?,
                            ..base
                        };
                        slot += nw * tiles(rows, t);
                        self.run(
                            &mut pass,
                            ShaderKind::BwdDe,
                            dt,
                            &prm,
                            &[
                                e_b,
                                c_b,
                                b_b,
                                rs_b,
                                ctx.whole(&slab)?,
                                dr_b,
                                ctx.whole(&counters)?,
                            ],
                            [nw as u32, tiles(rows, t) as u32, 1],
                        );
                    }
                }
                let (o_b, o_off) = ctx.range(
                    &d_e.buffer,
                    (rc.start * d) as u64,
                    (rows * d) as u64,
                    out_dtype.size_bytes() as u64,
                )?;
                let mut ff = 0;
                if let Some(_cs) = &csum {
                    ff |= flags::LS_ANALYTIC | flags::WEIGHTED;
                }
                let prm = Params {
                    n_rows: rows as u32,
                    d: d as u32,
                    n_units: u32c(rows * d, "elements of a chunk")?,
                    n_slabs: de_slabs as u32,
                    slab_stride: u32c(rows * d, "slab stride")?,
                    out_off: o_off,
                    flags: ff,
                    aux: opts.label_smoothing / v as f32,
                    ..Params::default()
                };
                let units = if out_dt == 0 {
                    rows * d
                } else {
                    (rows * d).div_ceil(2)
                };
                self.run(
                    &mut pass,
                    ShaderKind::Finalize,
                    out_dt,
                    &prm,
                    &[
                        ctx.whole(&slab)?,
                        ctx.whole(csum.as_ref().unwrap_or(&ctx.dummy))?,
                        rs_b,
                        o_b,
                    ],
                    Self::grid_1d(units),
                );
            }
        }

        // 3. d_c and d_bias, class-owned.
        if let Some(d_c) = &d_c {
            let slab_stride = max_cc * d;
            let slab = ctx.raw_buffer((dc_slabs * slab_stride * 4) as u64, "d_c slabs")?;
            let bslab = ctx.raw_buffer((dc_slabs * max_cc * 4) as u64, "d_bias slabs")?;
            workspace += slab.size() + bslab.size();
            let mut f = base.flags;
            if filter_c {
                f |= flags::FILTER;
                if !filter_e {
                    f |= flags::REPORT;
                }
            }
            for cc in &plan.class_chunks {
                let ncls = cc.len();
                enc.clear_buffer(&slab, 0, None);
                enc.clear_buffer(&bslab, 0, None);
                let mut pass = Self::pass(&mut enc, "d_c");
                let (c_b, c_off) = ctx.range(
                    &inputs.c.buffer,
                    (cc.start * d) as u64,
                    (ncls * d) as u64,
                    es,
                )?;
                let (b_b, b_off) = match inputs.bias {
                    Some(b) => ctx.range(&b.buffer, cc.start as u64, ncls as u64, es)?,
                    None => (ctx.whole(&ctx.dummy)?, 0),
                };
                for (ri, rc) in plan.row_chunks.iter().enumerate() {
                    let rows = rc.len();
                    let (e_b, e_off) = ctx.range(
                        &inputs.e.buffer,
                        (rc.start * d) as u64,
                        (rows * d) as u64,
                        es,
                    )?;
                    let rs_b = ctx.aligned(&rs, rc.start as u64, rows as u64, ROW_STATE_BYTES)?;
                    let dr_b = ctx.aligned(&dropped, rc.start as u64, rows as u64, 4)?;
                    let (per, ns) = dc_splits[ri];
                    for w0 in (0..ns).step_by(dc_slabs) {
                        let nw = dc_slabs.min(ns - w0);
                        let prm = Params {
                            n_rows: rows as u32,
                            n_cls: ncls as u32,
                            row0: rc.start as u32,
                            cls0: cc.start as u32,
                            e_off,
                            c_off,
                            b_off,
                            flags: f,
                            split_tiles: per as u32,
                            split_base: w0 as u32,
                            slot_base: u32c(slot, "counter slots")?,
                            slab_stride: u32c(ncls * d, "slab stride")?,
                            ..base
                        };
                        slot += nw * tiles(ncls, t);
                        self.run(
                            &mut pass,
                            ShaderKind::BwdDc,
                            dt,
                            &prm,
                            &[
                                e_b,
                                c_b,
                                b_b,
                                rs_b,
                                ctx.whole(&slab)?,
                                dr_b,
                                ctx.whole(&counters)?,
                                ctx.whole(&bslab)?,
                            ],
                            [nw as u32, tiles(ncls, t) as u32, 1],
                        );
                    }
                }
                let osz = out_dtype.size_bytes() as u64;
                let units = |k: usize| if out_dt == 0 { k } else { k.div_ceil(2) };
                let ff = if esum.is_some() {
                    flags::LS_ANALYTIC
                } else {
                    0
                };
                let alpha_v = opts.label_smoothing / v as f32;
                let (o_b, o_off) =
                    ctx.range(&d_c.buffer, (cc.start * d) as u64, (ncls * d) as u64, osz)?;
                let prm = Params {
                    d: d as u32,
                    n_units: u32c(ncls * d, "elements of a chunk")?,
                    n_slabs: dc_slabs as u32,
                    slab_stride: u32c(ncls * d, "slab stride")?,
                    out_off: o_off,
                    flags: ff,
                    aux: alpha_v,
                    ..Params::default()
                };
                let ev = match &esum {
                    Some(b) => ctx.whole(b)?,
                    None => ctx.whole(&ctx.dummy)?,
                };
                self.run(
                    &mut pass,
                    ShaderKind::Finalize,
                    out_dt,
                    &prm,
                    &[ctx.whole(&slab)?, ev, ctx.whole(&ctx.dummy)?, o_b],
                    Self::grid_1d(units(ncls * d)),
                );
                if let Some(db) = &d_bias {
                    let (o_b, o_off) = ctx.range(&db.buffer, cc.start as u64, ncls as u64, osz)?;
                    // The bias term reads Σ_i g_i, stored at index D of `esum`.
                    let ev = match &esum {
                        Some(b) => ctx.whole(b)?,
                        None => ctx.whole(&ctx.dummy)?,
                    };
                    let prm = Params {
                        d: 1,
                        e_off: d as u32,
                        n_units: ncls as u32,
                        n_slabs: dc_slabs as u32,
                        slab_stride: ncls as u32,
                        out_off: o_off,
                        flags: ff,
                        aux: alpha_v,
                        ..Params::default()
                    };
                    self.run(
                        &mut pass,
                        ShaderKind::Finalize,
                        out_dt,
                        &prm,
                        &[ctx.whole(&bslab)?, ev, ctx.whole(&ctx.dummy)?, o_b],
                        Self::grid_1d(units(ncls)),
                    );
                }
            }
        }

        // 4. Statistics.
        let report = filter_e || filter_c;
        if report {
            let mut pass = Self::pass(&mut enc, "stats");
            for (ri, rc) in plan.row_chunks.iter().enumerate() {
                let rows = rc.len();
                let prm = Params {
                    n_rows: rows as u32,
                    flags: if ri == 0 { flags::FIRST } else { 0 },
                    ..Params::default()
                };
                self.run(
                    &mut pass,
                    ShaderKind::StatReduce,
                    dt,
                    &prm,
                    &[
                        ctx.aligned(&dropped, rc.start as u64, rows as u64, 4)?,
                        ctx.aligned(&prep.tgt, rc.start as u64, rows as u64, 4)?,
                        ctx.whole(&stat)?,
                    ],
                    [1, 1, 1],
                );
            }
        }
        let ranges: Vec<(&wgpu::Buffer, u64, u64)> = if report {
            vec![(&counters, 0, 16 * n_slots as u64), (&stat, 0, 8)]
        } else {
            vec![]
        };
        let back = ctx.submit_and_read(enc, &ranges)?;
        let mut stats = self.stats(&prep, workspace);
        if report {
            let words: &[u32] = bytemuck::cast_slice(&back[0]);
            // Only passes that filter count (de slots first, then dc slots).
            let (de_range, dc_range): (Range<usize>, Range<usize>) = {
                let de_n = if want_de { de_slots } else { 0 };
                (0..de_n, de_n..n_slots)
            };
            let mut add = |r: Range<usize>| {
                for s in r {
                    stats.tiles_visited += words[4 * s] as u64;
                    stats.tiles_skipped += words[4 * s + 1] as u64;
                    stats.entries_kept += words[4 * s + 2] as u64;
                    stats.entries_skipped += words[4 * s + 3] as u64;
                }
            };
            if filter_e {
                add(de_range);
            }
            if filter_c {
                add(dc_range);
            }
            let st: &[u32] = bytemuck::cast_slice(&back[1]);
            stats.dropped_mass_max = st[0] as f64 / FIXED_POINT_ONE;
            let sum = f32::from_bits(st[1]) as f64;
            // The max is a fixed-point (rounded up) reduction and the sum an f32 one: clamp so
            // that rounding never reports a mean above the max.
            stats.dropped_mass_mean = if prep.n_valid > 0 {
                (sum / prep.n_valid as f64).min(stats.dropped_mass_max)
            } else {
                0.0
            };
        }
        Ok(BackwardOutput {
            d_e,
            d_c,
            d_bias,
            stats,
        })
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
        self.ctx
            .scoped("forward", || self.forward_impl(inputs, opts))
    }

    fn backward(
        &self,
        inputs: &Inputs<'_, WgpuTensor>,
        opts: &Options,
        saved: Saved<'_, WgpuTensor>,
        upstream: &Upstream<'_, WgpuTensor>,
    ) -> Result<BackwardOutput<WgpuTensor>> {
        self.ctx.scoped("backward", || {
            self.backward_impl(inputs, opts, saved, upstream)
        })
    }
}

#[allow(dead_code)]
fn _assert_send_sync() {
    fn f<T: Send + Sync>() {}
    f::<WgpuTensor>();
}
