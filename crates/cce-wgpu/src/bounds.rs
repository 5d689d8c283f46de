//! What a dispatch may touch: the byte extent of every storage binding a shader reads or
//! writes, derived from the dispatch's [`Params`] and grid, and checked against the bound
//! ranges before the dispatch is recorded ([`check_dispatch`]).
//!
//! # Indexing safety of the trusted shader modules
//!
//! The shader modules are created without wgpu's runtime checks
//! ([`crate::pipelines::runtime_checks`]): no clamping of array indices, no loop counters, no
//! guards on integer division. That is sound because:
//!
//! 1. **Storage buffers.** Every storage access of a shader is either guarded in the WGSL by
//!    the chunk's sizes (`r < P.n_rows`, `j < P.n_cls`, `k < P.d`, ...) or indexed by a value
//!    that those guards and the grid bound; each shader's header states its access pattern
//!    under "Bounds". [`extent`] mirrors that pattern on the host: the largest byte any
//!    invocation of the dispatch may touch in each binding, computed in u64 from the same
//!    `Params` and grid the shader sees. [`check_dispatch`] refuses (a `Backend` error, never
//!    a dispatch) any binding smaller than its extent, and any `Params` that break an
//!    invariant a shader assumes (a partial column past the stride, an odd 16-bit output
//!    offset, a zero divisor).
//! 2. **32-bit indices do not wrap.** Every binding is at most
//!    [`MAX_BINDING_BYTES`] `< 2^32` bytes, so a u32 word index is `< 2^30` and a 16-bit
//!    element index `< 2^31`; every index a shader forms is a sum of non-negative terms no
//!    larger than the final index, which [`extent`] bounds by the binding size.
//! 3. **Loops terminate.** Every loop bound is a chunk size (`< 2^31`, item 2) or a constant
//!    and every step is at least 1 and at most 1024, so no loop counter wraps.
//! 4. **Integer divisors are never 0.** The divisors are constants, the overrides `WG`, `TK`
//!    and the tile side `8·WG` (validated `>= 1` by the backend's config check), and `P.d` in
//!    `finalize.wgsl` (checked `>= 1` here whenever the shader divides by it).
//! 5. **Workgroup and function-local arrays** are indexed by local invocation ids, loop
//!    counters with constant bounds, and the overrides, in ranges stated in each shader's
//!    header; their sizes are derived from the same overrides. Both main loops of the logits
//!    tile (logits_scalar.wgsl, logits_quad.wgsl) read e and c only through tile_io.wgsl's
//!    guarded `load4`, so their storage extents are the same; the quad loop's panel indices
//!    hold for `tk = 2·wg` only, which `KernelConfig::shape_error` enforces and the config
//!    tests enumerate (`quad_panel_indices_stay_in_the_panels`).
//!
//! The hostile-shape tests (`tests/conformance.rs`) run every pass at edge sizes (1 x 1 x 1,
//! sizes one past a tile, odd `D`, odd element offsets of 16-bit views) against the f64
//! oracle, so an out-of-bounds read that returned garbage would fail them.

use crate::pipelines::{flags, Params, ShaderKind};
use cce_core::filter::N_BINS;

/// Largest storage binding the backend creates (just under 4 GiB), so that every u32 index
/// formed in a shader fits (module docs, item 2).
pub(crate) const MAX_BINDING_BYTES: u64 = (1u64 << 32) - 256;

/// Bytes of one `Part` (common.wgsl).
const PART_BYTES: u64 = 32;
/// Bytes of one `RowState` (common.wgsl).
pub(crate) const ROW_STATE_BYTES: u64 = 48;

/// Bytes of the u32 words holding elements `0 .. end` of a float array of dtype code `dtype`
/// (0: f32, one element per word; 1, 2: f16, bf16, two per word).
fn float_bytes(dtype: u32, end: u64) -> u64 {
    if dtype == 0 {
        4 * end
    } else {
        4 * end.div_ceil(2)
    }
}

/// Names of the storage bindings of `kind`, bindings 1, 2, ... in order (binding 0 is the
/// uniform `Params`).
pub(crate) fn binding_names(kind: ShaderKind) -> &'static [&'static str] {
    const GEMM: [&str; 3] = ["e", "c", "bias"];
    match kind {
        ShaderKind::FwdPartial | ShaderKind::FwdPartialCoop => {
            &[GEMM[0], GEMM[1], GEMM[2], "tgt", "part", "tlogit"]
        }
        ShaderKind::BwdHist => &[GEMM[0], GEMM[1], GEMM[2], "rs", "edges", "hist"],
        ShaderKind::BwdDe => &[
            GEMM[0], GEMM[1], GEMM[2], "rs", "slab", "dropped", "counters",
        ],
        ShaderKind::BwdDc => &[
            GEMM[0], GEMM[1], GEMM[2], "rs", "slab", "dropped", "counters", "bslab",
        ],
        ShaderKind::FwdMerge => &[
            "part", "tgt", "tlogit", "lse", "loss", "ent", "amax", "bad", "rest",
        ],
        ShaderKind::LossReduce => &["loss_rows", "out"],
        ShaderKind::BwdPrep => &["tgt", "lse", "dloss", "dlse", "rs", "rest"],
        ShaderKind::BwdTau => &["hist", "edges", "rs"],
        ShaderKind::WSum => &["x", "rs", "out"],
        ShaderKind::Finalize => &["slab", "vec", "rs", "out"],
        ShaderKind::StatReduce => &["dropped", "tgt", "out"],
    }
}

/// The largest byte (exclusive) that any invocation of a dispatch of `kind` with dtype code
/// `dtype`, uniforms `p` and `grid` workgroups may access in storage binding `binding`
/// (1-based, as in the WGSL), relative to the binding's start; 0 when the binding is not
/// accessed (an absent optional input). Errors: a description of a broken invariant of `p`.
pub(crate) fn extent(
    kind: ShaderKind,
    dtype: u32,
    p: &Params,
    grid: [u32; 3],
    binding: u32,
) -> Result<u64, String> {
    let has = |f: u32| p.flags & f != 0;
    let rows = p.n_rows as u64;
    let cls = p.n_cls as u64;
    let d = p.d as u64;
    let workgroups = grid[0] as u64;
    let e = || float_bytes(dtype, p.e_off as u64 + rows * d);
    let c = || float_bytes(dtype, p.c_off as u64 + cls * d);
    // gemm.wgsl binds e and c as vec4<u32>: whole 16-byte units.
    let e16 = || e().div_ceil(16) * 16;
    let c16 = || c().div_ceil(16) * 16;
    let bias = || {
        if has(flags::BIAS) {
            float_bytes(dtype, p.b_off as u64 + cls)
        } else {
            0
        }
    };
    let per_row = |bytes: u64| bytes * rows;
    let counters = || 16 * (p.slot_base as u64 + workgroups * grid[1] as u64);
    let slab = |owned: u64| -> Result<u64, String> {
        if (p.slab_stride as u64) < owned * d {
            return Err(format!(
                "slab stride {} below the {} elements a slab holds",
                p.slab_stride,
                owned * d
            ));
        }
        Ok(4 * workgroups * p.slab_stride as u64)
    };
    let gemm = |b: u32| match b {
        1 => Some(e16()),
        2 => Some(c16()),
        3 => Some(bias()),
        _ => None,
    };
    let out = match (kind, binding) {
        (ShaderKind::FwdPartial | ShaderKind::FwdPartialCoop | ShaderKind::BwdHist, 1..=3) => {
            gemm(binding)
        }
        (ShaderKind::BwdDe | ShaderKind::BwdDc, 1..=3) => gemm(binding),
        (ShaderKind::FwdPartial | ShaderKind::FwdPartialCoop, 4 | 6) => Some(per_row(4)),
        (ShaderKind::FwdPartial | ShaderKind::FwdPartialCoop, 5) => {
            if p.part_base as u64 + workgroups > p.part_stride as u64 {
                return Err(format!(
                    "partial columns {} + {} splits past the stride {}",
                    p.part_base, workgroups, p.part_stride
                ));
            }
            Some(per_row(PART_BYTES * p.part_stride as u64))
        }
        (ShaderKind::BwdHist, 4) => Some(per_row(ROW_STATE_BYTES)),
        (ShaderKind::BwdHist, 5) => Some(4 * N_BINS as u64),
        (ShaderKind::BwdHist, 6) => Some(per_row(4 * N_BINS as u64)),
        (ShaderKind::BwdDe | ShaderKind::BwdDc, 4) => Some(per_row(ROW_STATE_BYTES)),
        (ShaderKind::BwdDe, 5) => Some(slab(rows)?),
        (ShaderKind::BwdDc, 5) => Some(slab(cls)?),
        (ShaderKind::BwdDe | ShaderKind::BwdDc, 6) => {
            Some(if has(flags::REPORT) { per_row(4) } else { 0 })
        }
        (ShaderKind::BwdDe | ShaderKind::BwdDc, 7) => Some(counters()),
        (ShaderKind::BwdDc, 8) => Some(4 * workgroups * cls),
        (ShaderKind::FwdMerge, 1) => Some(per_row(PART_BYTES * p.part_stride as u64)),
        (ShaderKind::FwdMerge, 2..=7 | 9) => Some(per_row(4)),
        (ShaderKind::FwdMerge, 8) => Some(12),
        (ShaderKind::LossReduce, 1) => Some(per_row(4)),
        (ShaderKind::LossReduce, 2) => Some(4),
        (ShaderKind::BwdPrep, 1 | 2 | 6) => Some(per_row(4)),
        (ShaderKind::BwdPrep, 3) => Some(if has(flags::DLOSS_ROWS) {
            per_row(4)
        } else {
            0
        }),
        (ShaderKind::BwdPrep, 4) => Some(if has(flags::DLSE) { per_row(4) } else { 0 }),
        (ShaderKind::BwdPrep, 5) => Some(per_row(ROW_STATE_BYTES)),
        (ShaderKind::BwdTau, 1) => Some(per_row(4 * N_BINS as u64)),
        (ShaderKind::BwdTau, 2) => Some(4 * N_BINS as u64),
        (ShaderKind::BwdTau, 3) => Some(per_row(ROW_STATE_BYTES)),
        (ShaderKind::WSum, 1) => Some(e()),
        (ShaderKind::WSum, 2) => Some(if has(flags::WEIGHTED) {
            per_row(ROW_STATE_BYTES)
        } else {
            0
        }),
        (ShaderKind::WSum, 3) => Some(4 * (d + 1)),
        (ShaderKind::Finalize, _) => Some(finalize_extent(dtype, p, binding)?),
        (ShaderKind::StatReduce, 1 | 2) => Some(per_row(4)),
        (ShaderKind::StatReduce, 3) => Some(8),
        _ => None,
    };
    out.ok_or_else(|| format!("{} has no storage binding {binding}", kind.name()))
}

/// [`extent`] of `finalize.wgsl`, which reads `n_units` elements of each slab and writes them
/// to `out` in the output dtype.
fn finalize_extent(dtype: u32, p: &Params, binding: u32) -> Result<u64, String> {
    let units = p.n_units as u64;
    let ls = p.flags & flags::LS_ANALYTIC != 0;
    let weighted = p.flags & flags::WEIGHTED != 0;
    if !(1..=4).contains(&binding) {
        return Err(format!("finalize has no storage binding {binding}"));
    }
    if ls && p.d == 0 {
        return Err("finalize divides by d = 0".into());
    }
    if units == 0 {
        return Ok(0);
    }
    Ok(match binding {
        1 => {
            let slabs = (p.n_slabs as u64).max(1);
            4 * ((slabs - 1) * p.slab_stride as u64 + units)
        }
        2 if ls => 4 * (p.e_off as u64 + p.d as u64),
        3 if ls && weighted => ROW_STATE_BYTES * units.div_ceil(p.d as u64),
        2 | 3 => 0,
        4 if dtype == 0 => 4 * (p.out_off as u64 + units),
        // Binding 4 (checked in 1..=4 above), 16-bit output.
        _ => {
            if !p.out_off.is_multiple_of(2) {
                return Err(format!(
                    "16-bit output at the odd element offset {}",
                    p.out_off
                ));
            }
            4 * (p.out_off as u64 / 2 + units.div_ceil(2))
        }
    })
}

/// `Err` with the first binding of the dispatch that is smaller than the shader may access,
/// or the first broken invariant of `p`; `sizes` are the bound ranges' byte sizes, bindings
/// 1, 2, ... in order.
pub(crate) fn check_dispatch(
    kind: ShaderKind,
    dtype: u32,
    p: &Params,
    grid: [u32; 3],
    sizes: &[u64],
) -> Result<(), String> {
    let names = binding_names(kind);
    if sizes.len() != names.len() {
        return Err(format!(
            "{}: {} storage bindings given, the shader has {}",
            kind.name(),
            sizes.len(),
            names.len()
        ));
    }
    for (i, (&size, name)) in sizes.iter().zip(names).enumerate() {
        let binding = i as u32 + 1;
        let need = extent(kind, dtype, p, grid, binding)
            .map_err(|e| format!("{}: binding {binding} ({name}): {e}", kind.name()))?;
        if need > size || size > MAX_BINDING_BYTES {
            return Err(format!(
                "{}: binding {binding} ({name}) holds {size} bytes, the dispatch may access \
                 {need} (at most {MAX_BINDING_BYTES} per binding)",
                kind.name()
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fwd(rows: u32, cls: u32, d: u32) -> Params {
        Params {
            n_rows: rows,
            n_cls: cls,
            d,
            part_stride: 4,
            ..Params::default()
        }
    }

    #[test]
    fn float_bytes_round_16_bit_elements_up_to_words() {
        assert_eq!(float_bytes(0, 5), 20);
        assert_eq!(float_bytes(1, 5), 12);
        assert_eq!(float_bytes(2, 4), 8);
        assert_eq!(float_bytes(2, 0), 0);
    }

    #[test]
    fn gemm_inputs_cover_the_chunk_from_the_offset() {
        let p = Params {
            e_off: 3,
            c_off: 1,
            ..fwd(10, 7, 5)
        };
        // Whole 16-byte units: 53 and 18 words.
        assert_eq!(
            extent(ShaderKind::FwdPartial, 0, &p, [2, 1, 1], 1),
            Ok(4 * 56)
        );
        assert_eq!(
            extent(ShaderKind::FwdPartial, 2, &p, [2, 1, 1], 2),
            Ok(4 * 20)
        );
        assert_eq!(extent(ShaderKind::WSum, 2, &p, [2, 1, 1], 1), Ok(4 * 27));
        // No bias flag: the dummy binding is never read.
        assert_eq!(extent(ShaderKind::FwdPartial, 0, &p, [2, 1, 1], 3), Ok(0));
        let pb = Params {
            flags: flags::BIAS,
            b_off: 1,
            ..p
        };
        assert_eq!(extent(ShaderKind::BwdDc, 1, &pb, [2, 1, 1], 3), Ok(4 * 4));
    }

    #[test]
    fn partial_columns_past_the_stride_are_refused() {
        let p = Params {
            part_base: 3,
            ..fwd(10, 7, 5)
        };
        assert!(extent(ShaderKind::FwdPartial, 0, &p, [1, 1, 1], 5).is_ok());
        assert!(extent(ShaderKind::FwdPartial, 0, &p, [2, 1, 1], 5).is_err());
    }

    #[test]
    fn slabs_and_counters_follow_the_grid() {
        let p = Params {
            slab_stride: 50,
            slot_base: 6,
            ..fwd(10, 7, 5)
        };
        assert_eq!(extent(ShaderKind::BwdDe, 0, &p, [3, 2, 1], 5), Ok(4 * 150));
        assert_eq!(extent(ShaderKind::BwdDe, 0, &p, [3, 2, 1], 7), Ok(16 * 12));
        // A d_c slab holds n_cls x d = 35 elements: a stride of 30 is refused.
        let q = Params {
            slab_stride: 30,
            ..p
        };
        assert!(extent(ShaderKind::BwdDc, 0, &q, [1, 1, 1], 5).is_err());
        assert_eq!(extent(ShaderKind::BwdDc, 0, &p, [3, 1, 1], 8), Ok(4 * 21));
    }

    #[test]
    fn finalize_refuses_odd_16_bit_offsets_and_zero_divisors() {
        let p = Params {
            n_units: 5,
            n_slabs: 2,
            slab_stride: 8,
            out_off: 4,
            d: 5,
            ..Params::default()
        };
        assert_eq!(
            extent(ShaderKind::Finalize, 0, &p, [1, 1, 1], 1),
            Ok(4 * 13)
        );
        assert_eq!(extent(ShaderKind::Finalize, 1, &p, [1, 1, 1], 4), Ok(4 * 5));
        assert_eq!(extent(ShaderKind::Finalize, 0, &p, [1, 1, 1], 4), Ok(4 * 9));
        let odd = Params { out_off: 3, ..p };
        assert!(extent(ShaderKind::Finalize, 2, &odd, [1, 1, 1], 4).is_err());
        assert!(extent(ShaderKind::Finalize, 0, &odd, [1, 1, 1], 4).is_ok());
        let ls = Params {
            flags: flags::LS_ANALYTIC | flags::WEIGHTED,
            d: 0,
            ..p
        };
        assert!(extent(ShaderKind::Finalize, 0, &ls, [1, 1, 1], 2).is_err());
        let ls = Params { d: 2, ..ls };
        assert_eq!(
            extent(ShaderKind::Finalize, 0, &ls, [1, 1, 1], 3),
            Ok(48 * 3)
        );
    }

    #[test]
    fn a_binding_smaller_than_its_extent_is_refused() {
        let p = fwd(10, 7, 5);
        let sizes = [208, 144, 4, 40, 32 * 40, 40];
        assert_eq!(
            check_dispatch(ShaderKind::FwdPartial, 0, &p, [4, 1, 1], &sizes),
            Ok(())
        );
        let short = [192, 144, 4, 40, 32 * 40, 40];
        let err = check_dispatch(ShaderKind::FwdPartial, 0, &p, [4, 1, 1], &short).unwrap_err();
        assert!(err.contains("binding 1 (e)"), "{err}");
        assert!(check_dispatch(ShaderKind::FwdPartial, 0, &p, [4, 1, 1], &sizes[..5]).is_err());
        let huge = [MAX_BINDING_BYTES + 16, 144, 4, 40, 32 * 40, 40];
        assert!(check_dispatch(ShaderKind::FwdPartial, 0, &p, [4, 1, 1], &huge).is_err());
    }

    #[test]
    fn every_shader_names_its_bindings() {
        for kind in ShaderKind::ALL {
            let n = binding_names(kind).len() as u32;
            let p = Params {
                slab_stride: 1,
                ..fwd(1, 1, 1)
            };
            for b in 1..=n {
                assert!(extent(kind, 0, &p, [1, 1, 1], b).is_ok(), "{kind:?} {b}");
            }
            assert!(extent(kind, 0, &p, [1, 1, 1], n + 1).is_err(), "{kind:?}");
        }
    }
}
