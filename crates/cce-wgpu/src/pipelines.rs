//! Shader sources, the uniform `Params` block and the pipeline cache.
//!
//! Every shader is `common.wgsl` + (for the tiled passes) `tile_io.wgsl` + `gemm.wgsl` + the
//! logits main loop (`logits_scalar.wgsl` or `logits_quad.wgsl`) (+ `grad.wgsl`) + its own
//! file(s), concatenated at compile time. Tile shape and dtype are WGSL `override` constants set
//! through `PipelineCompilationOptions::constants` (no string templates).
//!
//! Modules are created without wgpu's runtime checks unless the kernel configuration asks
//! for them ([`runtime_checks`]); the argument that the kernels stay in bounds without them
//! is in the `bounds` module.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Mutex;

use crate::config::MainLoop;

macro_rules! shader {
    ($($f:literal),+) => {
        concat!($(include_str!(concat!("../shaders/", $f)), "\n"),+)
    };
}

/// The compute shaders of the backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ShaderKind {
    /// Forward partials (online log-sum-exp per split).
    FwdPartial,
    /// Forward partials with the logits tile by cooperative matrices (f16 inputs; used only
    /// with the cargo feature `coop-matrix` on adapters that offer it).
    FwdPartialCoop,
    /// Forward merge, per-row loss and side outputs.
    FwdMerge,
    /// Mean/sum of the per-row losses.
    LossReduce,
    /// Per-row backward coefficients.
    BwdPrep,
    /// Threshold pass: per-row histogram of g0.
    BwdHist,
    /// Threshold pass: τ_i from the histogram.
    BwdTau,
    /// Row-owned d_e pass.
    BwdDe,
    /// Class-owned d_c / d_bias pass.
    BwdDc,
    /// Slab sum + analytic term + dtype conversion.
    Finalize,
    /// Column sums for analytic label smoothing.
    WSum,
    /// Dropped-mass statistics.
    StatReduce,
}

impl ShaderKind {
    /// Every shader, for validation tests.
    pub const ALL: [ShaderKind; 12] = [
        ShaderKind::FwdPartial,
        ShaderKind::FwdPartialCoop,
        ShaderKind::FwdMerge,
        ShaderKind::LossReduce,
        ShaderKind::BwdPrep,
        ShaderKind::BwdHist,
        ShaderKind::BwdTau,
        ShaderKind::BwdDe,
        ShaderKind::BwdDc,
        ShaderKind::Finalize,
        ShaderKind::WSum,
        ShaderKind::StatReduce,
    ];

    /// Full WGSL source (common prelude included) with the default main loop of the logits
    /// tile ([`MainLoop::Scalar`]); [`ShaderKind::source_with`] picks it.
    pub fn source(self) -> &'static str {
        self.source_with(MainLoop::Scalar)
    }

    /// Full WGSL source with `main_loop`'s logits tile (logits_scalar.wgsl or
    /// logits_quad.wgsl after gemm.wgsl; shaders without FMA panels ignore it).
    pub fn source_with(self, main_loop: MainLoop) -> &'static str {
        // The FMA-tiled shaders: common, tile_io, gemm, the main loop, then their own files.
        macro_rules! tiled {
            ($($f:literal),+) => {
                match main_loop {
                    MainLoop::Scalar => shader!(
                        "common.wgsl", "tile_io.wgsl", "gemm.wgsl", "logits_scalar.wgsl", $($f),+
                    ),
                    MainLoop::Quad => shader!(
                        "common.wgsl", "tile_io.wgsl", "gemm.wgsl", "logits_quad.wgsl", $($f),+
                    ),
                }
            };
        }
        match self {
            ShaderKind::FwdPartial => tiled!("fwd_partial.wgsl", "fwd_main.wgsl"),
            // The `enable` directives of logits_coop.wgsl must open the module.
            ShaderKind::FwdPartialCoop => shader!(
                "logits_coop.wgsl",
                "common.wgsl",
                "tile_io.wgsl",
                "fwd_partial.wgsl"
            ),
            ShaderKind::FwdMerge => shader!("common.wgsl", "fwd_merge.wgsl"),
            ShaderKind::LossReduce => shader!("common.wgsl", "loss_reduce.wgsl"),
            ShaderKind::BwdPrep => shader!("common.wgsl", "bwd_prep.wgsl"),
            ShaderKind::BwdHist => tiled!("bwd_hist.wgsl"),
            ShaderKind::BwdTau => shader!("common.wgsl", "bwd_tau.wgsl"),
            ShaderKind::BwdDe => tiled!("grad.wgsl", "bwd_de.wgsl"),
            ShaderKind::BwdDc => tiled!("grad.wgsl", "bwd_dc.wgsl"),
            ShaderKind::Finalize => shader!("common.wgsl", "finalize.wgsl"),
            ShaderKind::WSum => shader!("common.wgsl", "wsum.wgsl"),
            ShaderKind::StatReduce => shader!("common.wgsl", "stat_reduce.wgsl"),
        }
    }

    /// Whether the shader computes logits tiles (includes tile_io.wgsl: the `WG` override,
    /// e and c bound as vec4).
    pub fn is_tiled(self) -> bool {
        self.has_panels() || self == ShaderKind::FwdPartialCoop
    }

    /// Whether the shader includes gemm.wgsl (the FMA panels: the `TK` override).
    pub fn has_panels(self) -> bool {
        matches!(
            self,
            ShaderKind::FwdPartial | ShaderKind::BwdHist | ShaderKind::BwdDe | ShaderKind::BwdDc
        )
    }

    /// Short name for labels.
    pub fn name(self) -> &'static str {
        match self {
            ShaderKind::FwdPartial => "fwd_partial",
            ShaderKind::FwdPartialCoop => "fwd_partial_coop",
            ShaderKind::FwdMerge => "fwd_merge",
            ShaderKind::LossReduce => "loss_reduce",
            ShaderKind::BwdPrep => "bwd_prep",
            ShaderKind::BwdHist => "bwd_hist",
            ShaderKind::BwdTau => "bwd_tau",
            ShaderKind::BwdDe => "bwd_de",
            ShaderKind::BwdDc => "bwd_dc",
            ShaderKind::Finalize => "finalize",
            ShaderKind::WSum => "wsum",
            ShaderKind::StatReduce => "stat_reduce",
        }
    }

    /// Override constants of a pipeline: `DTYPE` always, `WG` for tiled shaders, `TK` for
    /// those with FMA panels.
    pub fn constants(self, dtype_code: u32, wg: u32, tk: u32) -> Vec<(&'static str, f64)> {
        let mut c = vec![("DTYPE", dtype_code as f64)];
        if self.is_tiled() {
            c.push(("WG", wg as f64));
        }
        if self.has_panels() {
            c.push(("TK", tk as f64));
        }
        c
    }
}

/// Flag bits of `Params::flags` (mirror of the `FLAG_*` constants in common.wgsl and
/// gemm.wgsl).
pub mod flags {
    /// Softcap on.
    pub const SOFTCAP: u32 = 1;
    /// Bias given.
    pub const BIAS: u32 = 2;
    /// Filter applies in this pass.
    pub const FILTER: u32 = 4;
    /// This pass reports the dropped mass.
    pub const REPORT: u32 = 8;
    /// Upstream d_loss per row.
    pub const DLOSS_ROWS: u32 = 16;
    /// Upstream d_lse given.
    pub const DLSE: u32 = 32;
    /// Label smoothing handled analytically.
    pub const LS_ANALYTIC: u32 = 64;
    /// Last chunk of a reduction.
    pub const LAST: u32 = 128;
    /// Weighted sums (wsum: by g; finalize: per-row coefficient).
    pub const WEIGHTED: u32 = 256;
    /// First chunk of a reduction.
    pub const FIRST: u32 = 512;
    /// Panel loads of e read four elements at a time (gemm.wgsl `FLAG_VEC_E`).
    pub const VEC_E: u32 = 1024;
    /// Panel loads of c read four elements at a time (gemm.wgsl `FLAG_VEC_C`).
    pub const VEC_C: u32 = 2048;
}

/// The uniform block of every shader (`struct Params` in common.wgsl, same field order).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Params {
    pub n_rows: u32,
    pub n_cls: u32,
    pub d: u32,
    pub v_total: u32,
    pub row0: u32,
    pub cls0: u32,
    pub e_off: u32,
    pub c_off: u32,
    pub b_off: u32,
    pub flags: u32,
    pub split_tiles: u32,
    pub part_base: u32,
    pub part_stride: u32,
    pub slot_base: u32,
    pub slab_stride: u32,
    pub n_slabs: u32,
    pub out_off: u32,
    pub delta_fixed: u32,
    pub n_units: u32,
    pub split_base: u32,
    pub softcap: f32,
    pub ls_alpha: f32,
    pub z_loss: f32,
    pub eps: f32,
    pub aux: f32,
    pub pad1: f32,
    pub pad2: f32,
    pub pad3: f32,
}

/// The runtime checks wgpu compiles into a module: all of them when `checked`, else none
/// (no index clamping, no loop counters, no integer-division guards; the ray-query and
/// mesh-shader checks concern stages these shaders do not use).
pub fn runtime_checks(checked: bool) -> wgpu::ShaderRuntimeChecks {
    if checked {
        wgpu::ShaderRuntimeChecks::checked()
    } else {
        wgpu::ShaderRuntimeChecks::unchecked()
    }
}

/// Pipeline key: shader, dtype code, workgroup side, depth step, main loop, runtime checks.
type Key = (ShaderKind, u32, u32, u32, MainLoop, bool);

/// Shader modules and compute pipelines, built once per device and reused.
#[derive(Default)]
pub struct PipelineCache {
    modules: Mutex<HashMap<(ShaderKind, MainLoop, bool), wgpu::ShaderModule>>,
    pipelines: Mutex<HashMap<Key, wgpu::ComputePipeline>>,
}

impl PipelineCache {
    /// The pipeline for `kind` specialized to `dtype_code`, `wg`, `tk`, with `main_loop`'s
    /// logits tile, from a module with wgpu's runtime checks when `checked` (built on first
    /// use).
    pub fn get(
        &self,
        device: &wgpu::Device,
        kind: ShaderKind,
        dtype_code: u32,
        (wg, tk, main_loop): (u32, u32, MainLoop),
        checked: bool,
    ) -> wgpu::ComputePipeline {
        // Shaders without FMA panels have one source: one module and pipeline for both loops.
        let main_loop = if kind.has_panels() {
            main_loop
        } else {
            MainLoop::Scalar
        };
        let key = (kind, dtype_code, wg, tk, main_loop, checked);
        if let Some(p) = self.pipelines.lock().unwrap().get(&key) {
            return p.clone();
        }
        let module = {
            let mut mods = self.modules.lock().unwrap();
            mods.entry((kind, main_loop, checked))
                .or_insert_with(|| {
                    let desc = wgpu::ShaderModuleDescriptor {
                        label: Some(kind.name()),
                        source: wgpu::ShaderSource::Wgsl(Cow::Borrowed(
                            kind.source_with(main_loop),
                        )),
                    };
                    // SAFETY: without runtime checks a shader must not index out of bounds,
                    // loop forever or divide an integer by zero. Every storage access of these
                    // shaders is guarded or bounded by the dispatch's `Params`, which
                    // `bounds::check_dispatch` validates against the bound ranges before each
                    // dispatch; indices fit u32 because bindings are capped below 4 GiB; loop
                    // bounds are chunk sizes below 2^31 with steps of 1..=1024; divisors are
                    // constants, the overrides validated >= 1 by `WgpuBackend::check_cfg`, or
                    // `P.d` checked >= 1 (the `bounds` module docs give the full argument).
                    unsafe { device.create_shader_module_trusted(desc, runtime_checks(checked)) }
                })
                .clone()
        };
        let constants = kind.constants(dtype_code, wg, tk);
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(kind.name()),
            layout: None,
            module: &module,
            entry_point: Some("main"),
            compilation_options: wgpu::PipelineCompilationOptions {
                constants: &constants,
                zero_initialize_workgroup_memory: false,
            },
            cache: None,
        });
        self.pipelines.lock().unwrap().insert(key, pipeline.clone());
        pipeline
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unchecked_modules_drop_the_checks_that_cost_time() {
        let off = runtime_checks(false);
        assert!(!off.bounds_checks && !off.force_loop_bounding && !off.int_div_checks);
        let on = runtime_checks(true);
        assert!(on.bounds_checks && on.force_loop_bounding && on.int_div_checks);
    }
}
