//! The cooperative-matrix part of the kernel configuration, as pure functions: which
//! cooperative-matrix forward a configuration asks for ([`CoopTile`]), what those shaders
//! need of the workgroup (memory, invocations), which of them an adapter can run
//! ([`coop_capable`]), and which one a call runs ([`coop_forward`], [`coop_backward`]).

use super::KernelConfig;

/// Which cooperative-matrix forward runs where [`KernelConfig::cooperative_matrix`] is on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CoopTile {
    /// logits_coop.wgsl: 64 x 64 tiles, 64 invocations (two subgroups of 32 x 64), 32-deep
    /// f16 panels staged element by element with two barriers per panel, 24 KiB of workgroup
    /// memory; needs the configuration's `wg` = 8.
    T64,
    /// logits_coop128.wgsl: 128 x 128 tiles whatever the configuration's `wg`, 256 invocations
    /// (eight subgroups of 32 x 64), double-buffered 32-deep f16 panels read eight elements
    /// per load with one barrier per panel, 48 KiB of workgroup memory. The backward and the other dtypes keep the
    /// configuration's tiles.
    T128,
    /// logits_coop128w.wgsl: 128 x 128 tiles whatever the configuration's `wg`, 128
    /// invocations (four subgroups of 64 x 64: 0.5 fragment loads per multiply-add against
    /// 0.75), the panels of [`CoopTile::T128`], 48 KiB of workgroup memory, and two running
    /// row states per invocation (kept by one of the two lanes that share a row). Where the
    /// adapter cannot run it, [`CoopTile::T128`]'s rules apply.
    T128W,
    /// [`CoopTile::T128W`] with 16-deep panels (its `KC` override): 16 fewer prefetch
    /// registers per invocation, one barrier per 16 multiply-adds per subgroup instead of 32.
    T128W16,
}

impl CoopTile {
    /// Short name (`coop64`, `coop128`, `coop128w`, `coop128w16`), as the benchmark's
    /// `--configs` spells it.
    pub fn name(self) -> &'static str {
        match self {
            CoopTile::T64 => "coop64",
            CoopTile::T128 => "coop128",
            CoopTile::T128W => "coop128w",
            CoopTile::T128W16 => "coop128w16",
        }
    }
}

/// Workgroup memory of the cooperative-matrix forward (logits_coop.wgsl's f16 panels and f32
/// tile, which also holds fwd_partial.wgsl's end-of-split row merge), in bytes, at 64 x 64
/// tiles.
pub(crate) const COOP_WORKGROUP_BYTES: u64 = 2 * 64 * 32 * 2 + 64 * 64 * 4;

/// Tile side of the 128 x 128 cooperative-matrix forward ([`CoopTile::T128`]).
pub(crate) const COOP128_TILE: usize = 128;

/// Workgroup memory of the 128 x 128 cooperative-matrix forward, in bytes: logits_coop128.wgsl's
/// two buffers of f16 panels for e and c (128 rows of 40 = 32 depths + 8 of padding) and its
/// f32 hand-over `Ct` (eight 16 x 16 fragment slots, which also hold fwd_partial.wgsl's
/// end-of-split row merge): 40 KiB + 8 KiB.
pub(crate) const COOP128_WORKGROUP_BYTES: u64 = 2 * 2 * 128 * 40 * 2 + 8 * 16 * 16 * 4;

/// Invocations per workgroup of the 128 x 128 cooperative-matrix forward.
pub(crate) const COOP128_INVOCATIONS: u32 = 256;

/// Workgroup memory of the 128 x 128 cooperative-matrix forward with 64 x 64 per subgroup, in
/// bytes: logits_coop128w.wgsl's panels (as [`COOP128_WORKGROUP_BYTES`]') and its f32
/// hand-over `Ct` (two 16 x 16 fragment slots per subgroup, which also hold the end-of-split
/// merge of the class halves): 40 KiB + 8 KiB.
pub(crate) const COOP128W_WORKGROUP_BYTES: u64 = 2 * 2 * 128 * 40 * 2 + 4 * 2 * 16 * 16 * 4;

/// Invocations per workgroup of the 128 x 128 cooperative-matrix forward with 64 x 64 per
/// subgroup.
pub(crate) const COOP128W_INVOCATIONS: u32 = 128;

/// Which cooperative-matrix forwards an adapter can run ([`coop_capable`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct CoopCaps {
    /// logits_coop.wgsl (64 x 64 tiles).
    pub t64: bool,
    /// logits_coop128.wgsl (128 x 128 tiles).
    pub t128: bool,
    /// logits_coop128w.wgsl (128 x 128 tiles, 64 x 64 per subgroup, either panel depth).
    pub t128w: bool,
}

/// Which of logits_coop.wgsl, logits_coop128.wgsl and logits_coop128w.wgsl an adapter can run:
/// for all, the cargo feature compiled in, the device features they need (cooperative matrix,
/// f16, subgroups), subgroups exactly 32 wide (two, eight or four full ones per workgroup), and
/// a 16 x 16 x 16 f16 x f16 -> f32 configuration listed; then room for each one's workgroup
/// memory, and its invocations per workgroup (256, 128: `max_invocations`) for the 128 x 128
/// ones.
pub(crate) fn coop_capable(
    features: wgpu::Features,
    configs: &[wgpu::CooperativeMatrixProperties],
    subgroup_sizes: (u32, u32),
    max_workgroup_bytes: u32,
    max_invocations: u32,
) -> CoopCaps {
    let need = wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX
        | wgpu::Features::SHADER_F16
        | wgpu::Features::SUBGROUP;
    let base = cfg!(feature = "coop-matrix")
        && features.contains(need)
        && subgroup_sizes == (32, 32)
        && configs.iter().any(|p| {
            (p.m_size, p.n_size, p.k_size) == (16, 16, 16)
                && p.ab_type == wgpu::CooperativeScalarType::F16
                && p.cr_type == wgpu::CooperativeScalarType::F32
        });
    CoopCaps {
        t64: base && COOP_WORKGROUP_BYTES <= max_workgroup_bytes as u64,
        t128: base
            && COOP128_WORKGROUP_BYTES <= max_workgroup_bytes as u64
            && COOP128_INVOCATIONS <= max_invocations,
        t128w: base
            && COOP128W_WORKGROUP_BYTES <= max_workgroup_bytes as u64
            && COOP128W_INVOCATIONS <= max_invocations,
    }
}

/// The cooperative-matrix forward a call runs, if any: asked for, f16 inputs (staged as f16
/// exactly; bf16 and f32 would be rounded), then the configuration's [`CoopTile`] where the
/// adapter can run it (`caps`); the 64 x 64 one also needs the configuration's 64 x 64 tiles.
/// The 128 x 128 ones fall back to the 64 x 64 one on adapters without room for them
/// ([`CoopTile::T128W`] and [`CoopTile::T128W16`] first to [`CoopTile::T128`]).
pub(crate) fn coop_forward(
    cfg: &KernelConfig,
    caps: CoopCaps,
    dtype_code: u32,
) -> Option<CoopTile> {
    if !cfg.cooperative_matrix || dtype_code != 1 {
        return None;
    }
    let t64 = (caps.t64 && cfg.wg == 8).then_some(CoopTile::T64);
    match cfg.coop_tile {
        t @ (CoopTile::T128W | CoopTile::T128W16) if caps.t128w => Some(t),
        CoopTile::T128W | CoopTile::T128W16 | CoopTile::T128 if caps.t128 => Some(CoopTile::T128),
        _ => t64,
    }
}

/// Whether a backward pass (`d_e` or `d_c`) runs its products by cooperative matrices
/// (bwd_coop.wgsl, 128 x 128 tiles): [`KernelConfig::cooperative_matrix`] and
/// [`KernelConfig::coop_backward`] on, f16 inputs (`dtype_code` 1), an adapter that runs the
/// 128 x 128 forward (`caps.t128`: the same 48 KiB, 256 invocations, subgroups of 32 and
/// 16 x 16 x 16 f16 configuration), and a pass that does not filter (`filtered`: the
/// filtered passes keep the FMA backward, whose 64 x 64 skip decisions and counters the
/// statistics are stated in).
pub(crate) fn coop_backward(
    cfg: &KernelConfig,
    caps: CoopCaps,
    dtype_code: u32,
    filtered: bool,
) -> bool {
    cfg.cooperative_matrix && cfg.coop_backward && dtype_code == 1 && caps.t128 && !filtered
}
