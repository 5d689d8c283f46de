//! `WgpuBackend`: the `cce_core::Backend` implementation; the passes are in `forward` and
//! `backward`.

use crate::bounds::{check_dispatch, ROW_STATE_BYTES};
use crate::buffers::{Bind, Ctx, WgpuTensor};
use crate::config::{panel_load_flags, KernelConfig};
use crate::context::{Context, BACKEND};
use crate::pipelines::{flags, Params, ShaderKind};
use cce_core::plan::Plan;
use cce_core::{
    Backend, BackwardOutput, CallStats, CceError, DType, DeviceLimits, ForwardOutput, HostTensor,
    Inputs, Options, PreparedTargets, Problem, Result, Saved, StrategyKind, TensorMeta, TileShape,
    Upstream,
};
use interop::{BackwardDest, ForwardDest};
use std::ops::Range;
use std::sync::Arc;
use wgpu::util::DeviceExt;

mod backward;
mod forward;
pub(crate) mod interop;

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

/// The uniforms of a tiled dispatch over rows `rc` and classes `cc` of the call, with the
/// chunks' element offsets `[e, c, bias]` and `per` tiles per split; `base` for the rest.
fn tile_params(
    base: Params,
    rc: &Range<usize>,
    cc: &Range<usize>,
    [e_off, c_off, b_off]: [u32; 3],
    per: usize,
) -> Params {
    Params {
        n_rows: rc.len() as u32,
        n_cls: cc.len() as u32,
        row0: rc.start as u32,
        cls0: cc.start as u32,
        e_off,
        c_off,
        b_off,
        split_tiles: per as u32,
        ..base
    }
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
    /// Copies of `e` / `c` for views that cannot be bound in 16-byte units where they are
    /// ([`WgpuTensor::vec_bindable`]).
    e_copy: Option<WgpuTensor>,
    c_copy: Option<WgpuTensor>,
}

impl Prepared {
    /// The call's inputs with `e` and `c` replaced by their copies where made.
    fn inputs<'a>(&'a self, inputs: &Inputs<'a, WgpuTensor>) -> Inputs<'a, WgpuTensor> {
        Inputs {
            e: self.e_copy.as_ref().unwrap_or(inputs.e),
            c: self.c_copy.as_ref().unwrap_or(inputs.c),
            bias: inputs.bias,
            targets: inputs.targets,
        }
    }
}

impl WgpuBackend {
    /// Open the default adapter with the default [`KernelConfig`].
    ///
    /// Errors: `NoDevice` when no adapter exists, `Backend` when the device request fails.
    pub fn new() -> Result<Self> {
        let ctx = Arc::new(Context::new()?);
        let cfg = Self::default_config(&ctx);
        Self::check_cfg(&ctx, &cfg)?;
        Ok(Self { ctx, cfg })
    }

    /// The default [`KernelConfig`] for a context's adapter and limits
    /// ([`KernelConfig::for_adapter`]).
    pub(crate) fn default_config(ctx: &Context) -> KernelConfig {
        KernelConfig::for_adapter(
            ctx.info.device_type,
            ctx.limits.max_compute_workgroup_storage_size,
        )
    }

    /// Same device, another kernel configuration. Errors: `ResourceLimit` when the tiles do not
    /// fit the adapter's workgroup limits; `InvalidOption` for a shape the shaders cannot run
    /// ([`KernelConfig::shape_error`]).
    pub fn with_config(&self, cfg: KernelConfig) -> Result<Self> {
        Self::check_cfg(&self.ctx, &cfg)?;
        Ok(Self {
            ctx: self.ctx.clone(),
            cfg,
        })
    }

    pub(crate) fn check_cfg(ctx: &Context, cfg: &KernelConfig) -> Result<()> {
        if let Some(reason) = cfg.shape_error() {
            return Err(CceError::InvalidOption {
                name: "KernelConfig",
                reason: format!("{reason} ({cfg:?})"),
            });
        }
        // The forward and the backward products run at the config's shape; the threshold
        // pass at its own where the config's does not fit (`KernelConfig::hist_shape`).
        let max = ctx.limits.max_compute_workgroup_storage_size as u64;
        let wgb = cfg.fwd_bytes().max(cfg.grad_bytes());
        let short = if wgb > max {
            Some(wgb)
        } else if cfg.hist_shape(max).is_none() {
            Some(cfg.hist_bytes())
        } else {
            None
        };
        if let Some(requested) = short {
            return Err(CceError::ResourceLimit {
                resource: format!("workgroup memory bytes for tile {}", cfg.tile()),
                requested,
                max,
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

    /// Whether the device has `SHADER_FLOAT32_ATOMIC`, so that backward calls that are not
    /// `deterministic` sum their splits with f32 atomics into one slab per chunk instead of
    /// one slab per split (crate docs, "Passes").
    pub fn has_float_atomics(&self) -> bool {
        self.ctx.float_atomics()
    }

    /// Whether backward calls that are not `deterministic` add into their slab through
    /// subgroup shuffles first (coalesced atomic adds, [`KernelConfig::coalesced_adds`]): the
    /// device has `SHADER_FLOAT32_ATOMIC` and `SUBGROUP` with subgroups that can be 8 or more
    /// wide, the configuration asks for it and its `wg` is a multiple of 8. The shader still
    /// checks the subgroups' lane order and adds scattered where it does not hold.
    pub fn has_coalesced_adds(&self) -> bool {
        self.ctx.float_atomics()
            && crate::config::coalesced_adds(
                self.cfg.coalesced_adds,
                self.ctx.subgroups(),
                self.ctx.info.subgroup_max_size,
                self.cfg.wg,
            )
    }

    /// A report of the adapter for benchmark logs: name, backend, driver, device type, the
    /// features the shaders could use (subgroups with their sizes, f16, f32 atomics,
    /// cooperative matrix), how the backward sums its splits,
    /// the device's workgroup limits, the kernel configuration, and every cooperative-matrix
    /// configuration the adapter lists (`M x N x K`, input and accumulator types; Vulkan:
    /// `vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR`, subgroup scope, as wgpu keeps
    /// them). A backend on a borrowed device ([`WgpuBackend::from_device`]) has no adapter
    /// at hand and reports the device's features instead.
    pub fn adapter_report(&self) -> String {
        let ctx = &self.ctx;
        let i = &ctx.info;
        let mut s = format!(
            "adapter: {} ({:?}, {:?}, driver {} {})\n",
            i.name, i.backend, i.device_type, i.driver, i.driver_info
        );
        let (features, coop) = match &ctx.adapter {
            Some(a) => (a.features(), Some(a.cooperative_matrix_properties())),
            None => (ctx.device.features(), None),
        };
        for (name, f) in [
            ("SUBGROUP", wgpu::Features::SUBGROUP),
            ("SHADER_F16", wgpu::Features::SHADER_F16),
            (
                "SHADER_FLOAT32_ATOMIC",
                wgpu::Features::SHADER_FLOAT32_ATOMIC,
            ),
            (
                "EXPERIMENTAL_COOPERATIVE_MATRIX",
                wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX,
            ),
        ] {
            s += &format!("feature {name}: {}\n", features.contains(f));
        }
        let l = &ctx.limits;
        s += &format!(
            "subgroup sizes: {}..={}\nworkgroup storage: {} bytes, invocations: {}, \
             storage binding: {} bytes\nconfig: {:?}\n",
            i.subgroup_min_size,
            i.subgroup_max_size,
            l.max_compute_workgroup_storage_size,
            l.max_compute_invocations_per_workgroup,
            l.max_storage_buffer_binding_size,
            self.cfg
        );
        s += &format!(
            "backward splits: {}\n",
            if self.has_coalesced_adds() {
                "f32 atomics into one slab, coalesced through subgroup shuffles (per-split \
                 slabs for deterministic calls)"
            } else if ctx.float_atomics() {
                "f32 atomics into one slab (per-split slabs for deterministic calls)"
            } else {
                "per-split slabs (no SHADER_FLOAT32_ATOMIC on the device)"
            }
        );
        let usable = ctx.coop.t64 || ctx.coop.t128 || ctx.coop.t128w;
        let state = if !cfg!(feature = "coop-matrix") {
            "not compiled in (cargo feature coop-matrix)".to_string()
        } else if !usable {
            "compiled in, not usable on this adapter".to_string()
        } else {
            match crate::config::coop_forward(&self.cfg, ctx.coop, 1) {
                Some(t) => format!("on for f16 inputs ({})", t.name()),
                None if self.cfg.cooperative_matrix => {
                    "usable, not with this config's tiles".to_string()
                }
                None => "usable, off in the config".to_string(),
            }
        };
        s += &format!(
            "cooperative-matrix forward: {state} (adapter: coop64 {}, coop128 {}, coop128w {})\n",
            ctx.coop.t64, ctx.coop.t128, ctx.coop.t128w
        );
        s += &format!(
            "cooperative-matrix backward: {}\n",
            if crate::config::coop_backward(&self.cfg, ctx.coop, 1, false) {
                "on for f16 inputs in passes that do not filter (bwd_coop.wgsl, 128 x 128, f16 G)"
            } else {
                "off (the FMA backward)"
            }
        );
        match coop {
            None => s += "cooperative_matrix_properties: (borrowed device, no adapter)\n",
            Some(v) if v.is_empty() => s += "cooperative_matrix_properties: none\n",
            Some(v) => {
                s += &format!(
                    "cooperative_matrix_properties: {} configurations\n",
                    v.len()
                );
                for p in v {
                    s += &format!(
                        "  {}x{}x{} {:?} x {:?} -> {:?}{}\n",
                        p.m_size,
                        p.n_size,
                        p.k_size,
                        p.ab_type,
                        p.ab_type,
                        p.cr_type,
                        if p.saturating_accumulation {
                            " (saturating)"
                        } else {
                            ""
                        }
                    );
                }
            }
        }
        s
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

    /// Loop iterations per thread of one backward tile.
    fn bwd_iters(&self, d: usize) -> usize {
        self.cfg.bwd_iters(d)
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
        let shape = (self.cfg.wg, self.cfg.tk);
        self.run_at(pass, kind, dt, shape, params, binds, grid)
    }

    /// [`WgpuBackend::run`] with the pipeline built for tiles of `shape` = `(wg, tk)`
    /// instead of the config's (the threshold pass where the config's tiles leave its
    /// histogram no room, `KernelConfig::hist_shape`).
    #[allow(clippy::too_many_arguments)]
    fn run_at(
        &self,
        pass: &mut wgpu::ComputePass<'_>,
        kind: ShaderKind,
        dt: u32,
        (wg, tk): (u32, u32),
        params: &Params,
        binds: &[Bind<'_>],
        grid: [u32; 3],
    ) -> Result<()> {
        if grid.contains(&0) {
            return Ok(());
        }
        let mut params = *params;
        if kind.is_tiled() {
            params.flags |= panel_load_flags(&params);
        }
        let params = &params;
        let sizes: Vec<u64> = binds.iter().map(|b| b.size).collect();
        check_dispatch(kind, dt, params, grid, &sizes)
            .map_err(|e| crate::context::backend_err(format!("dispatch refused: {e}")))?;
        let dev = &self.ctx.device;
        let pipe = self.ctx.pipeline(
            kind,
            dt,
            (wg, tk, self.cfg.main_loop),
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
        let mut prof = self.ctx.profiler.lock().unwrap();
        match prof
            .as_mut()
            .filter(|p| p.per_dispatch)
            .and_then(|p| p.next(kind.name()))
        {
            Some((set, q)) => {
                pass.write_timestamp(set, q);
                pass.dispatch_workgroups(grid[0], grid[1], grid[2]);
                pass.write_timestamp(set, q + 1);
            }
            None => pass.dispatch_workgroups(grid[0], grid[1], grid[2]),
        }
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

    /// A compute pass; with profiling on and timestamps per pass (not per dispatch), its
    /// begin and end write a pair labelled `label` (`crate::profile`).
    fn pass<'e>(
        &self,
        enc: &'e mut wgpu::CommandEncoder,
        label: &'static str,
    ) -> wgpu::ComputePass<'e> {
        let mut prof = self.ctx.profiler.lock().unwrap();
        let pair = prof
            .as_mut()
            .filter(|p| !p.per_dispatch)
            .and_then(|p| p.next(label));
        let timestamp_writes = pair.map(|(set, q)| wgpu::ComputePassTimestampWrites {
            query_set: set,
            beginning_of_pass_write_index: Some(q),
            end_of_pass_write_index: Some(q + 1),
        });
        enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some(label),
            timestamp_writes,
        })
    }

    /// Turn GPU timestamps on or off (`on`): per dispatch where the device has
    /// `TIMESTAMP_QUERY_INSIDE_PASSES`, else per compute pass with `TIMESTAMP_QUERY`, read by
    /// [`WgpuBackend::take_pass_times`]. For benchmarks, one calling thread at a time; shared
    /// by every backend on this device. Returns whether timestamps are available (false:
    /// the device lacks `TIMESTAMP_QUERY`, and nothing is recorded).
    pub fn set_profiling(&self, on: bool) -> bool {
        let f = self.ctx.features;
        let mut prof = self.ctx.profiler.lock().unwrap();
        if !on || !f.contains(wgpu::Features::TIMESTAMP_QUERY) {
            *prof = None;
            return on && prof.is_some();
        }
        if prof.is_none() {
            let inside = f.contains(wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES);
            *prof = Some(crate::profile::Profiler::new(&self.ctx.device, inside));
        }
        true
    }

    /// The GPU time per label (shader name per dispatch, or pass label) of the work recorded
    /// since profiling was turned on or since the last call, and the pairs not recorded
    /// because the query set was full (the `profile` module); clears them. Empty while
    /// profiling is off. Waits for the submitted work. Errors: `Backend` on a failed
    /// read-back.
    pub fn take_pass_times(&self) -> Result<(Vec<crate::PassTime>, u64)> {
        let mut prof = self.ctx.profiler.lock().unwrap();
        match prof.as_mut() {
            Some(p) => p.take(&self.ctx),
            None => Ok((Vec::new(), 0)),
        }
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
        let problem = inputs.problem(opts)?;
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
            e_copy: self.vec_copy(inputs.e, "e copy")?,
            c_copy: self.vec_copy(inputs.c, "c copy")?,
        })
    }

    /// A copy of `t` in a buffer of its own when it cannot be bound in 16-byte units where it
    /// lies (recorded and submitted now, so ordered before the call's passes), else `None`.
    fn vec_copy(&self, t: &WgpuTensor, label: &str) -> Result<Option<WgpuTensor>> {
        if t.vec_bindable() {
            return Ok(None);
        }
        let copy = self.ctx.alloc(t.shape().to_vec(), t.dtype(), label)?;
        let mut enc = self.encoder();
        enc.copy_buffer_to_buffer(
            &t.buf,
            t.offset,
            &copy.buf,
            0,
            crate::buffers::padded(t.size_bytes()),
        );
        self.ctx.queue.submit([enc.finish()]);
        Ok(Some(copy))
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

    /// Class chunk `cc` of `c` (rows of `d` elements of `es` bytes) and of `bias` (the
    /// stand-in without one), bound with their element offsets: `[(c, c_off), (bias, b_off)]`.
    fn class_chunk<'a>(
        &'a self,
        inputs: &Inputs<'a, WgpuTensor>,
        cc: &Range<usize>,
        d: usize,
        es: u64,
    ) -> Result<[(Bind<'a>, u32); 2]> {
        let ctx = &self.ctx;
        let c = ctx.range_vec(inputs.c, (cc.start * d) as u64, (cc.len() * d) as u64, es)?;
        let b = match inputs.bias {
            Some(b) => ctx.range(b, cc.start as u64, cc.len() as u64, es)?,
            None => (ctx.whole(&ctx.dummy)?, 0),
        };
        Ok([c, b])
    }

    /// One backward product's dispatches for a pair of chunks: `splits` splits (`waves[0]`) in
    /// waves of `waves[1]`, each workgroup of a wave given the next counter slot from `slot`
    /// on, over `waves[2]` tiles of the owning side (the grid's y); `prm` holds the rest.
    fn run_waves(
        &self,
        pass: &mut wgpu::ComputePass<'_>,
        (kind, dt): (ShaderKind, u32),
        prm: &Params,
        waves: [usize; 3],
        slot: &mut usize,
        binds: &[Bind<'_>],
    ) -> Result<()> {
        let [splits, wave, owned] = waves;
        for w0 in (0..splits).step_by(wave) {
            let nw = wave.min(splits - w0);
            let p = Params {
                split_base: w0 as u32,
                slot_base: u32c(*slot, "counter slots")?,
                ..*prm
            };
            *slot += nw * owned;
            self.run(pass, kind, dt, &p, binds, [nw as u32, owned as u32, 1])?;
        }
        Ok(())
    }

    /// Element `i` of an f32 tensor, read back on its own (a wait; for error paths only).
    fn read_f32(&self, t: &WgpuTensor, i: usize) -> Result<f32> {
        let at = t.offset + 4 * i as u64;
        let back = self
            .ctx
            .submit_and_read(self.encoder(), &[(&t.buf, at, 4)])?;
        Ok(f32::from_le_bytes([
            back[0][0], back[0][1], back[0][2], back[0][3],
        ]))
    }

    /// The error for a non-finite result of finite-looking work under `check_finite`: the
    /// inputs are read back (an error path only) and named as the CPU backend names them
    /// ([`cce_core::problem::locate_non_finite`]; row 0 when none is to blame, as there).
    fn locate_non_finite(&self, inputs: &Inputs<'_, WgpuTensor>, d: usize) -> Result<CceError> {
        let host = |t: &WgpuTensor| -> Result<Vec<f32>> {
            Ok(<Self as Backend>::download(self, t)?.to_f32_vec())
        };
        let bias = inputs.bias.map(host).transpose()?;
        Ok(cce_core::problem::locate_non_finite(
            &host(inputs.e)?,
            &host(inputs.c)?,
            bias.as_deref(),
            d,
            0,
        ))
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

    /// Splits per class chunk for the forward passes at tiles of side `t` (the config's, or
    /// the 128 x 128 cooperative-matrix forward's under a 64 x 64 configuration): `(tiles per
    /// split, splits, first partial column)` per class chunk, and the total partial columns.
    fn class_splits_t(&self, plan: &Plan, t: usize) -> Result<(Vec<ClassSplit>, usize)> {
        self.class_splits_cfg(plan, t, &self.cfg)
    }

    /// [`WgpuBackend::class_splits_t`] for the threshold pass too: tiles of side `t` whose
    /// loop iterations per tile are those of `cfg` (the config's, or the threshold pass's
    /// own shape, `KernelConfig::hist_shape`).
    pub(crate) fn class_splits_cfg(
        &self,
        plan: &Plan,
        t: usize,
        cfg: &KernelConfig,
    ) -> Result<(Vec<ClassSplit>, usize)> {
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
            let cap = self.cap_tiles(cfg.fwd_iters(plan.problem.d));
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
