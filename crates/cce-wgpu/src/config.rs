//! The kernel configuration and what follows from it, as pure functions: the tile side, which
//! `(wg, tk)` the shaders can run, their workgroup memory, the panel loads per thread, when
//! those loads are vectorized, and the loop iterations one invocation runs.

use crate::pipelines::{flags, Params};
use cce_core::filter::N_BINS;

/// How the FMA shaders stage the logits tile's operands (the main loop over `D`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MainLoop {
    /// logits_scalar.wgsl: each thread loads `2·tk / wg` groups of four elements per operand
    /// and panel and stores them transposed one element at a time; any shape
    /// [`KernelConfig::shape_error`] accepts.
    Scalar,
    /// logits_quad.wgsl: each thread loads one 4 x 4 block per operand and panel (four vec4),
    /// transposes it in registers and stores four vec4 into bank-conflict-free slots; needs
    /// `tk = 2·wg` (one block per thread).
    Quad,
}

impl MainLoop {
    /// Short name (`scalar`, `quad`), as the benchmark's `--configs` spells it.
    pub fn name(self) -> &'static str {
        match self {
            MainLoop::Scalar => "scalar",
            MainLoop::Quad => "quad",
        }
    }
}

/// Kernel configuration: the tile shape of the shaders and how much parallelism to aim for.
///
/// A logits tile is `8·wg x 8·wg` (rows x classes); workgroups have `wg x wg` threads, each
/// owning an 8 x 8 register micro-tile; the depth (`D`) loop steps by `tk` through
/// double-buffered workgroup memory. These become the WGSL override constants `WG` and `TK`.
/// The shapes that run ([`KernelConfig::shape_error`]): `wg` in 1..=16; `tk` a multiple of 4
/// in 4..=64 that divides the tile side, with `2·tk / wg` a whole number of at most 8 (the
/// four-element groups each thread loads per panel). Examples: `wg` 8 with `tk` 4, 8, 16 or
/// 32; `wg` 16 with `tk` 8, 16, 32 or 64; `wg` 4 with `tk` 4, 8 or 16.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelConfig {
    /// Threads per tile side (tile side = 8·wg). Default 8 (64 x 64 tiles).
    pub wg: u32,
    /// Depth step along `D` staged through workgroup memory. Default 16.
    pub tk: u32,
    /// Workgroups a pass aims to launch (the split count along the other dimension follows).
    /// Default 2048 on GPUs, 8 on CPU adapters.
    pub target_workgroups: u32,
    /// How the logits tile's operands are staged ([`MainLoop`]). Default: `Quad` on GPUs
    /// where its 16-deep panels fit, `Scalar` elsewhere ([`KernelConfig::for_adapter`]).
    pub main_loop: MainLoop,
    /// Upper bound on the loop iterations (all loops together) one shader invocation runs,
    /// 0 for none. llvmpipe/lavapipe silently cuts an invocation's loops short after 65535
    /// iterations (gallivm's loop limiter), so on CPU adapters the work of a workgroup is
    /// bounded and split over more workgroups. Default 32768 on CPU adapters, 0 on GPUs.
    pub max_loop_iterations: u32,
    /// Whether shader modules keep wgpu's runtime checks (index clamping, loop counters,
    /// integer-division guards). Default false: the kernels' indexing is proven in bounds and
    /// every dispatch's bindings are validated on the host (crate docs, "Trusted shader
    /// modules"); true is for comparing the two and for debugging.
    pub runtime_checks: bool,
    /// Whether the forward computes its logits tiles by cooperative matrices where it can
    /// (f16 inputs, 64 x 64 tiles, an adapter that offers them, the cargo feature
    /// `coop-matrix`; crate docs, "Cooperative matrix"). Default: on when that feature is
    /// compiled in.
    pub cooperative_matrix: bool,
}

/// Register room for one thread's groups of a panel (`MAXG` in gemm.wgsl).
pub(crate) const MAX_PANEL_GROUPS: u32 = 8;

impl KernelConfig {
    /// Side of a logits tile (rows = classes).
    pub fn tile(&self) -> usize {
        8 * self.wg as usize
    }

    /// The default configuration for an adapter of type `device` whose workgroups may hold
    /// `max_workgroup_bytes`: the first of [`default_shapes`] that fits; few workgroups and
    /// bounded loops on CPU adapters (lavapipe).
    pub fn for_adapter(device: wgpu::DeviceType, max_workgroup_bytes: u32) -> Self {
        let cpu = device == wgpu::DeviceType::Cpu;
        let shapes = default_shapes(cpu);
        let with = |&(wg, tk, main_loop): &(u32, u32, MainLoop)| KernelConfig {
            wg,
            tk,
            main_loop,
            target_workgroups: if cpu { 8 } else { 2048 },
            max_loop_iterations: if cpu { 32768 } else { 0 },
            runtime_checks: false,
            cooperative_matrix: cfg!(feature = "coop-matrix"),
        };
        shapes
            .iter()
            .map(with)
            .find(|c| c.workgroup_bytes() <= max_workgroup_bytes as u64)
            .unwrap_or_else(|| with(shapes.last().expect("default_shapes is not empty")))
    }

    /// Groups of four elements one thread loads per panel (`NG` in gemm.wgsl), when the
    /// shape runs.
    pub(crate) fn panel_groups(&self) -> u32 {
        2 * self.tk / self.wg.max(1)
    }

    /// Why the shaders cannot run this `(wg, tk, target_workgroups)`, or `None` when they can
    /// (the rule is in the type's docs; adapter limits are checked separately).
    pub fn shape_error(&self) -> Option<String> {
        let (wg, tk) = (self.wg, self.tk);
        if !(1..=16).contains(&wg) {
            return Some(format!("wg = {wg} is not in 1..=16"));
        }
        if !(4..=64).contains(&tk) || !tk.is_multiple_of(4) {
            return Some(format!("tk = {tk} is not a multiple of 4 in 4..=64"));
        }
        if !(self.tile() as u32).is_multiple_of(tk) {
            return Some(format!(
                "tk = {tk} does not divide the tile side {}",
                self.tile()
            ));
        }
        if !(2 * tk).is_multiple_of(wg) || 2 * tk / wg > MAX_PANEL_GROUPS {
            return Some(format!(
                "2·tk / wg = {}/{wg} is not a whole number of at most {MAX_PANEL_GROUPS} \
                 panel groups per thread",
                2 * tk
            ));
        }
        if self.main_loop == MainLoop::Quad && tk != 2 * wg {
            return Some(format!(
                "the quad main loop needs tk = 2·wg (one 4 x 4 block per thread), got {wg}:{tk}"
            ));
        }
        if self.target_workgroups == 0 {
            return Some("target_workgroups = 0".into());
        }
        None
    }

    /// Workgroup memory of the largest shader in bytes: the double-buffered panels plus the
    /// largest of the forward's row reduction, the threshold histogram, and the backward's
    /// G tile (with d_c's bias tree).
    pub fn workgroup_bytes(&self) -> u64 {
        let t = self.tile() as u64;
        let wg = self.wg as u64;
        let panels = 2 * 2 * self.tk as u64 * t * 4;
        let fwd = t * wg * 32 + t * 32 + t * 4;
        let hist = t * N_BINS as u64 * 4 + t * 48;
        let dc = t * t * 4 + t * 48 + t * wg * 4 + 64;
        panels + fwd.max(hist).max(dc)
    }

    /// Loop iterations per thread of one depth panel of the logits tile: loading and storing
    /// two operands' groups (four scalar loads each at most) and the TK-step product. An
    /// upper bound for both main loops: the quad loop's 8 row loads of at most 4 scalar
    /// loads each stay below `20·ng` since it runs only with `ng = 2·tk / wg = 4`.
    fn step_iters(&self) -> usize {
        let ng = self.panel_groups() as usize;
        20 * ng + self.tk as usize + 1
    }

    /// Loop iterations per thread of one forward or threshold tile of depth `d`.
    pub(crate) fn fwd_iters(&self, d: usize) -> usize {
        (d.div_ceil(self.tk as usize) + 1) * self.step_iters() + 256
    }

    /// Loop iterations per thread of one backward tile (logits, G, then the d_e or d_c product
    /// over the `d / tile` slices of D).
    pub(crate) fn bwd_iters(&self, d: usize) -> usize {
        let t = self.tile();
        let tk = self.tk as usize;
        let ng = self.panel_groups() as usize;
        let per_slice = (t.div_ceil(tk) + 1) * (10 * ng + tk + 1) + 128;
        self.fwd_iters(d) + d.div_ceil(t) * per_slice + 128
    }
}

/// The default `(wg, tk, main loop)` candidates, best first, of a GPU or a CPU adapter
/// (`cpu`); [`KernelConfig::for_adapter`] takes the first whose workgroup memory fits. GPUs:
/// the scalar loop 8-deep, then 4-deep (on the H200 through Vulkan, 8192 x 2304 x 256000 c/8:
/// `8:8` ran the forward in 0.855x the time of `8:16` in session 15, and in 0.863x the time of
/// the quad loop `8:16:quad` in session 16, docs/perf-log.md). The quad loop stays selectable
/// (`KernelConfig::main_loop`). CPU adapters keep the scalar loop 8-deep (the lavapipe timings
/// of the tests).
pub fn default_shapes(cpu: bool) -> &'static [(u32, u32, MainLoop)] {
    if cpu {
        &[(8, 8, MainLoop::Scalar), (8, 4, MainLoop::Scalar)]
    } else {
        &[(8, 8, MainLoop::Scalar), (8, 4, MainLoop::Scalar)]
    }
}

/// Whether panel loads of a source with row length `d` whose chunk starts at element
/// `elem_off` of its binding read four elements at a time: every group of four then starts
/// at a multiple of 4 elements (16 bytes for f32, 8 for f16/bf16) and lies in one row.
pub(crate) fn vec_loads(d: usize, elem_off: u32) -> bool {
    d.is_multiple_of(4) && elem_off.is_multiple_of(4)
}

/// Workgroup memory of the cooperative-matrix forward (logits_coop.wgsl's f16 panels and f32
/// tile, fwd_partial.wgsl's row reduction), in bytes, at 64 x 64 tiles.
pub(crate) const COOP_WORKGROUP_BYTES: u64 = 2 * 64 * 32 * 2 + 64 * 64 * 4 + 64 * 8 * 32 + 64 * 36;

/// Whether an adapter can run logits_coop.wgsl: the cargo feature compiled in, the device
/// features it needs (cooperative matrix, f16, subgroups), subgroups exactly 32 wide (two per
/// 64-invocation workgroup), a 16 x 16 x 16 f16 x f16 -> f32 configuration listed, and room for
/// its workgroup memory.
pub(crate) fn coop_capable(
    features: wgpu::Features,
    configs: &[wgpu::CooperativeMatrixProperties],
    subgroup_sizes: (u32, u32),
    max_workgroup_bytes: u32,
) -> bool {
    let need = wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX
        | wgpu::Features::SHADER_F16
        | wgpu::Features::SUBGROUP;
    cfg!(feature = "coop-matrix")
        && features.contains(need)
        && subgroup_sizes == (32, 32)
        && COOP_WORKGROUP_BYTES <= max_workgroup_bytes as u64
        && configs.iter().any(|p| {
            (p.m_size, p.n_size, p.k_size) == (16, 16, 16)
                && p.ab_type == wgpu::CooperativeScalarType::F16
                && p.cr_type == wgpu::CooperativeScalarType::F32
        })
}

/// Whether a forward call runs the cooperative-matrix logits: asked for, possible on the
/// adapter, f16 inputs (staged as f16 exactly; bf16 and f32 would be rounded), 64 x 64 tiles.
pub(crate) fn use_cooperative_matrix(cfg: &KernelConfig, capable: bool, dtype_code: u32) -> bool {
    cfg.cooperative_matrix && capable && dtype_code == 1 && cfg.wg == 8
}

/// The `VEC_E` / `VEC_C` flags of a tiled shader's dispatch ([`vec_loads`] of each source).
pub(crate) fn panel_load_flags(p: &Params) -> u32 {
    let d = p.d as usize;
    let mut f = 0;
    if vec_loads(d, p.e_off) {
        f |= flags::VEC_E;
    }
    if vec_loads(d, p.c_off) {
        f |= flags::VEC_C;
    }
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(wg: u32, tk: u32) -> KernelConfig {
        KernelConfig {
            wg,
            tk,
            main_loop: MainLoop::Scalar,
            target_workgroups: 8,
            max_loop_iterations: 0,
            runtime_checks: false,
            cooperative_matrix: false,
        }
    }

    #[test]
    fn the_documented_shapes_run_and_others_do_not() {
        for (wg, tks) in [
            (8, &[4, 8, 16, 32][..]),
            (16, &[8, 16, 32, 64]),
            (4, &[4, 8, 16]),
        ] {
            for &tk in tks {
                assert_eq!(cfg(wg, tk).shape_error(), None, "{wg}:{tk}");
            }
        }
        for (wg, tk) in [
            (8, 12),
            (8, 64),
            (16, 4),
            (4, 32),
            (0, 16),
            (17, 16),
            (8, 2),
            (1, 8),
        ] {
            assert!(cfg(wg, tk).shape_error().is_some(), "{wg}:{tk}");
        }
        assert_eq!(cfg(1, 4).shape_error(), None);
        let none = KernelConfig {
            target_workgroups: 0,
            ..cfg(8, 16)
        };
        assert!(none.shape_error().is_some());
    }

    #[test]
    fn panel_groups_cover_a_panel() {
        for (wg, tk) in [(8, 16), (16, 8), (4, 4), (1, 4), (3, 12)] {
            let c = cfg(wg, tk);
            assert_eq!(c.shape_error(), None, "{wg}:{tk}");
            let groups = (c.tile() as u32 * tk / 4) as usize;
            assert_eq!((c.panel_groups() * wg * wg) as usize, groups, "{wg}:{tk}");
        }
    }

    #[test]
    fn default_tiles_fit_48_kib_of_workgroup_memory() {
        assert!(cfg(8, 16).workgroup_bytes() <= 48 << 10);
        assert!(cfg(8, 32).workgroup_bytes() > 48 << 10);
        assert!(cfg(16, 8).workgroup_bytes() > 48 << 10);
    }

    #[test]
    fn the_quad_loop_needs_one_block_per_thread() {
        let quad = |wg, tk| KernelConfig {
            main_loop: MainLoop::Quad,
            ..cfg(wg, tk)
        };
        for (wg, tk) in [(8, 16), (4, 8), (2, 4), (16, 32)] {
            assert_eq!(quad(wg, tk).shape_error(), None, "{wg}:{tk}");
            // One 4 x 4 block per thread and operand: (TILE/4) * (TK/4) blocks.
            let blocks = (quad(wg, tk).tile() as u32 / 4) * (tk / 4);
            assert_eq!(blocks, wg * wg, "{wg}:{tk}");
        }
        for (wg, tk) in [(8, 8), (8, 32), (4, 4)] {
            assert!(quad(wg, tk).shape_error().is_some(), "{wg}:{tk}");
        }
    }

    #[test]
    fn quad_panel_indices_stay_in_the_panels() {
        // logits_quad.wgsl's stores and reads, enumerated: every index below 4*TK*WG, every
        // slot of a depth row written exactly once per panel.
        for wg in [2u32, 4, 8, 16] {
            let tk = 2 * wg;
            let (s, len) = (2 * wg, 4 * tk * wg);
            for buf in 0..2 {
                let mut hits = vec![0u32; len as usize];
                for li in 0..wg * wg {
                    let (mb, kb) = (li % s, li / s);
                    let o = (buf * tk + 4 * kb) * s + (mb & 1) * wg + (mb >> 1);
                    for x in 0..4 {
                        let at = o + x * s;
                        assert!(at < len, "{wg} {li} {x}");
                        hits[at as usize] += 1;
                    }
                }
                let half = &hits[(buf * len / 2) as usize..((buf + 1) * len / 2) as usize];
                assert!(half.iter().all(|&h| h == 1), "wg {wg} buf {buf}");
                for k in 0..tk {
                    for t in 0..wg {
                        let o = (buf * tk + k) * s;
                        assert!(o + wg + t < len);
                    }
                }
            }
            // The two quads of thread t are slots t and WG + t.
            for t in 0..wg {
                let slot = |q: u32| (q & 1) * wg + (q >> 1);
                assert_eq!((slot(2 * t), slot(2 * t + 1)), (t, wg + t));
            }
        }
    }

    #[test]
    fn the_default_panel_depth_follows_the_workgroup_memory() {
        let gpu = KernelConfig::for_adapter(wgpu::DeviceType::DiscreteGpu, 48 << 10);
        assert_eq!(
            (gpu.wg, gpu.tk, gpu.main_loop, gpu.max_loop_iterations),
            (8, 8, MainLoop::Scalar, 0)
        );
        assert_eq!(gpu.shape_error(), None);
        let small = KernelConfig::for_adapter(wgpu::DeviceType::DiscreteGpu, 16 << 10);
        assert_eq!(
            (small.wg, small.tk, small.main_loop),
            (8, 4, MainLoop::Scalar)
        );
        let cpu = KernelConfig::for_adapter(wgpu::DeviceType::Cpu, 32 << 10);
        assert_eq!((cpu.wg, cpu.tk, cpu.target_workgroups), (8, 8, 8));
        assert!(cpu.workgroup_bytes() <= 32 << 10);
        assert_eq!(cpu.shape_error(), None);
    }

    #[test]
    fn cooperative_matrix_only_for_f16_on_capable_adapters() {
        let on = KernelConfig {
            cooperative_matrix: true,
            ..cfg(8, 16)
        };
        assert!(use_cooperative_matrix(&on, true, 1));
        assert!(!use_cooperative_matrix(&on, true, 2));
        assert!(!use_cooperative_matrix(&on, false, 1));
        assert!(!use_cooperative_matrix(&cfg(8, 16), true, 1));
        let wide = KernelConfig { wg: 4, ..on };
        assert!(!use_cooperative_matrix(&wide, true, 1));
        let f16_f32 = wgpu::CooperativeMatrixProperties {
            m_size: 16,
            n_size: 16,
            k_size: 16,
            ab_type: wgpu::CooperativeScalarType::F16,
            cr_type: wgpu::CooperativeScalarType::F32,
            saturating_accumulation: false,
        };
        let all = wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX
            | wgpu::Features::SHADER_F16
            | wgpu::Features::SUBGROUP;
        let capable = coop_capable(all, &[f16_f32], (32, 32), 48 << 10);
        assert_eq!(capable, cfg!(feature = "coop-matrix"));
        let f16_f16 = wgpu::CooperativeMatrixProperties {
            cr_type: wgpu::CooperativeScalarType::F16,
            ..f16_f32
        };
        assert!(!coop_capable(all, &[f16_f16], (32, 32), 48 << 10));
        assert!(!coop_capable(all, &[f16_f32], (16, 64), 48 << 10));
        assert!(!coop_capable(
            wgpu::Features::SHADER_F16,
            &[f16_f32],
            (32, 32),
            48 << 10
        ));
        assert!(!coop_capable(all, &[f16_f32], (32, 32), 32 << 10));
    }

    #[test]
    fn vector_loads_need_d_and_offset_multiples_of_4() {
        assert!(vec_loads(2304, 0));
        assert!(vec_loads(64, 128));
        assert!(!vec_loads(2303, 0));
        assert!(!vec_loads(64, 2));
    }

    #[test]
    fn each_source_gets_its_own_flag() {
        let p = Params {
            d: 8,
            e_off: 4,
            c_off: 2,
            ..Params::default()
        };
        assert_eq!(panel_load_flags(&p), flags::VEC_E);
        let q = Params { d: 6, ..p };
        assert_eq!(panel_load_flags(&q), 0);
    }

    #[test]
    fn loop_iterations_grow_with_d_and_stay_under_the_limiter_at_4096() {
        let c = cfg(8, 16);
        assert!(c.fwd_iters(64) < c.fwd_iters(128));
        assert!(c.bwd_iters(4096) < 65535);
        assert!(c.bwd_iters(8192) > 65535);
    }
}
