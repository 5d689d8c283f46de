//! Ablations of cce-wgpu's `d_e` pass (`bwd_de.wgsl` with the named main loop, the GPU
//! default) on one chunk as `WgpuBackend::backward` dispatches it, to split its time between
//! the logits tile, the second product and the slab updates:
//! - `bwd-real`: the backend's module text unchanged (entry point `main`): per kept class
//!   tile the logits tile, G (kept in registers), then per 64-wide slice of D the product
//!   G·C (G and C panels staged through workgroup memory) and the slice's read-modify-write
//!   of the f32 slab;
//! - `bwd-noslab`: the same with the slab update made only when `P.aux != 0` (set for the
//!   check, 0 when timed): the logits, G and the whole second product stay;
//! - `bwd-noprod`: the D-slice loop (the second product and the slab updates) run only when
//!   `P.aux != 0`: the logits tile and G stay.
//!
//! `:f32` takes f32 inputs instead of bf16. Every variant runs with `P.aux` 1 on small chunks
//! against the f64 reference of `d_e` (rows' states as [`rows`] sets them), then is timed
//! with `P.aux` 0. Grid (splits, row tiles) with `split_tiles` from
//! [`super::fwd::split_tiles`] (the backend's `d_e` split for one row chunk), one slab per
//! split.

use super::fwd::{split_tiles, Chunk, TILE};
use super::{gpu, host, Dtype};
use cut_cross_entropy::cce_wgpu::{MainLoop, ShaderKind};

/// cce-wgpu's `FLAG_VEC_E | FLAG_VEC_C`.
const FLAG_VEC: u32 = 1024 | 2048;
/// The rows' saved log-sum-exp in [`rows`]: G = exp(z − LSE) off the target.
pub const LSE: f32 = 8.0;
/// The target's G in [`rows`].
pub const GY: f32 = 0.5;

/// What the entry point keeps of the real pass (module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BwdKind {
    /// The real entry point.
    Real,
    /// No slab update at run time.
    NoSlab,
    /// No D-slice loop at run time.
    NoProd,
}

/// One `d_e` variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BwdVariant {
    /// Which ablation.
    pub kind: BwdKind,
    /// Input dtype.
    pub dtype: Dtype,
}

impl BwdVariant {
    /// Parse `bwd-{real|noslab|noprod}[:f32]`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let bad = |why: &str| format!("backward variant {s:?}: {why}");
        let mut parts = s.split(':');
        let kind = match parts.next().unwrap_or_default() {
            "bwd-real" => BwdKind::Real,
            "bwd-noslab" => BwdKind::NoSlab,
            "bwd-noprod" => BwdKind::NoProd,
            _ => return Err(bad("want bwd-real|bwd-noslab|bwd-noprod")),
        };
        let mut v = BwdVariant {
            kind,
            dtype: Dtype::Bf16,
        };
        for flag in parts {
            match flag {
                "f32" => v.dtype = Dtype::F32,
                "bf16" => v.dtype = Dtype::Bf16,
                other => return Err(bad(&format!("unknown flag {other:?}"))),
            }
        }
        Ok(v)
    }

    /// The name [`BwdVariant::parse`] reads back.
    pub fn name(&self) -> String {
        let mut n = match self.kind {
            BwdKind::Real => "bwd-real",
            BwdKind::NoSlab => "bwd-noslab",
            BwdKind::NoProd => "bwd-noprod",
        }
        .to_string();
        if self.dtype == Dtype::F32 {
            n += ":f32";
        }
        n
    }
}

/// The slab update of `add_de_half_v`, made only when `P.aux != 0` in `bwd-noslab`.
const SLAB_GUARD: &str = "    if ok != 0u {\n        add_rows4_v(";
/// The D-slice loop of the named entry point, run only when `P.aux != 0` in `bwd-noprod`.
const SLICE_LOOP: &str = "        prod_begin_named(gt, &pb, false, c_base, P.n_cls, tx, ty, li);
        for (var d0 = 0u; d0 < P.d; d0 += t) {
";

/// The `d_e` module of variant `kind` (the backend's named module, rewritten as the module
/// docs say). Panics when the backend's text no longer has what it rewrites (unit-tested).
pub fn source(kind: BwdKind) -> String {
    let real = ShaderKind::BwdDe.source_with(MainLoop::Named).into_owned();
    match kind {
        BwdKind::Real => real,
        BwdKind::NoSlab => {
            assert_eq!(real.matches(SLAB_GUARD).count(), 1, "add_de_half_v's guard");
            real.replace(
                SLAB_GUARD,
                "    if ok != 0u && P.aux != 0.0 {\n        add_rows4_v(",
            )
        }
        BwdKind::NoProd => {
            assert_eq!(real.matches(SLICE_LOOP).count(), 1, "the D-slice loop");
            real.replace(
                SLICE_LOOP,
                "        let d_end = select(0u, P.d, P.aux != 0.0);
        if d_end != 0u {
            prod_begin_named(gt, &pb, false, c_base, P.n_cls, tx, ty, li);
        }
        for (var d0 = 0u; d0 < d_end; d0 += t) {
",
            )
        }
    }
}

/// The rows' states (`RowState`, 12 words each, common.wgsl) of a chunk: target y, lse
/// [`LSE`], a = 1, gy = [`GY`], c = 0, g = 1, τ = 0, live (0 for ignored rows), g0y = 0; so
/// G = exp(z − LSE) off the target and [`GY`] at it.
pub fn rows(tgt: &[i32]) -> Vec<u32> {
    tgt.iter()
        .flat_map(|&y| {
            [
                y as u32,
                LSE.to_bits(),
                1f32.to_bits(),
                GY.to_bits(),
                0,
                1f32.to_bits(),
                0,
                u32::from(y >= 0),
                0,
                0,
                0,
                0,
            ]
        })
        .collect()
}

/// A built variant.
pub struct BwdBuilt {
    /// The variant.
    pub variant: BwdVariant,
    pipeline: wgpu::ComputePipeline,
}

/// A launch of a variant on a chunk with its slabs.
pub struct BwdLaunch {
    /// Timed with `P.aux` 0.
    pub timed: gpu::Launch,
    /// The same with `P.aux` 1, for the check.
    pub checked: gpu::Launch,
    slab: wgpu::Buffer,
    /// Splits (slabs) and class tiles per split.
    pub splits: (u32, u32),
}

impl BwdBuilt {
    /// Build `v`'s pipeline (trusted, as cce-wgpu builds its modules). Errors: validation.
    pub fn new(g: &gpu::Gpu, v: BwdVariant) -> Result<Self, String> {
        // The module is cce-wgpu's d_e source, whose trusted use its `bounds` module argues
        // (accesses guarded by `P.n_rows`, `P.n_cls`, `P.d`; e, c, bias bindings of at least
        // the chunk's rows · d elements rounded up to 16 bytes; `rs` and `dropped` of n_rows
        // entries; the slab of splits · slab_stride floats with slab_stride = n_rows · d; the
        // counters of 4 words per workgroup), with the ablations only narrowing when the
        // product and the slab updates run; `BwdBuilt::launch` binds buffers of those sizes.
        let constants = ShaderKind::BwdDe.constants(v.dtype.cce_code(), 8, 8);
        let pipeline = g.pipeline(&v.name(), source(v.kind), "main", &constants, false)?;
        Ok(Self {
            variant: v,
            pipeline,
        })
    }

    /// Bind `chunk` with the backend's split for `target_workgroups`. Errors: a chunk of
    /// another dtype, or a device error.
    pub fn launch(
        &self,
        g: &gpu::Gpu,
        chunk: &Chunk,
        target_workgroups: u32,
    ) -> Result<BwdLaunch, String> {
        let v = self.variant;
        if chunk.dtype() != v.dtype {
            return Err(format!("{}: chunk of another dtype", v.name()));
        }
        let (n, nc, d) = chunk.shape;
        let per = split_tiles(n, nc, target_workgroups, false);
        let nsplit = nc.div_ceil(TILE).div_ceil(per);
        let row_tiles = n.div_ceil(TILE);
        let stride = u64::from(n) * u64::from(d);
        let slab = g.storage("d_e slabs", 4 * u64::from(nsplit) * stride)?;
        let rs = g.upload("row states", bytemuck::cast_slice(&rows(&chunk.tgt)))?;
        let dropped = g.storage("dropped", 4 * u64::from(n))?;
        let counters = g.storage("counters", 16 * u64::from(nsplit * row_tiles))?;
        let slab_stride = u32::try_from(stride).map_err(|_| "slab stride over u32".to_string())?;
        let params = |aux: f32| -> Vec<u32> {
            // cce-wgpu's `Params` (28 words, common.wgsl's order).
            let mut p = vec![0u32; 28];
            p[0] = n; // n_rows
            p[1] = nc; // n_cls
            p[2] = d; // d
            p[3] = nc; // v_total
            p[9] = FLAG_VEC; // flags
            p[10] = per; // split_tiles
            p[14] = slab_stride; // slab_stride
            p[24] = aux.to_bits(); // aux
            p
        };
        // The real pass's two products.
        let flop = 4.0 * f64::from(n) * f64::from(nc) * f64::from(d);
        let groups = (nsplit, row_tiles);
        let mk = |aux: f32| -> Result<gpu::Launch, String> {
            let ubuf = g.uniform(bytemuck::cast_slice(&params(aux)))?;
            let [e, c, b, _] = chunk.buffers();
            let all = [
                (0, &ubuf),
                (1, e),
                (2, c),
                (3, b),
                (4, &rs),
                (5, &slab),
                (6, &dropped),
                (7, &counters),
            ];
            g.launch_with(&self.pipeline, &all, groups, flop)
        };
        let (timed, checked) = (mk(0.0), mk(1.0));
        Ok(BwdLaunch {
            timed: timed?,
            checked: checked?,
            slab,
            splits: (nsplit, per),
        })
    }
}

impl BwdLaunch {
    /// Dispatch the checked launch once on zeroed slabs and read them (`[splits, n_rows,
    /// d]` f32).
    pub fn run(&self, g: &gpu::Gpu) -> Result<Vec<f32>, String> {
        let back = g.run_read(&self.checked, &[(&self.slab, self.slab.size())])?;
        Ok(bytemuck::pod_collect_to_vec(&back[0]))
    }
}

/// Worst error of `d_e` (the slabs summed) over `rows` against the f64 reference, as a
/// multiple of its tolerance (<= 1 passes), with a description of the worst entry.
pub fn check(chunk: &Chunk, nsplit: u32, slab: &[f32], rows: &[usize]) -> (f64, String) {
    let (n, nc, d) = chunk.shape;
    let (n, nc, k) = (n as usize, nc as usize, d as usize);
    let tol = host::tolerance(k);
    let mut worst = (0.0f64, String::from("no entry checked"));
    for &r in rows {
        let a = &chunk.e[r * k..(r + 1) * k];
        let y = chunk.tgt[r];
        let mut want = vec![0.0f64; k];
        let mut bound = vec![1e-30f64; k];
        if y >= 0 {
            for j in 0..nc {
                let b = &chunk.c[j * k..(j + 1) * k];
                let (mut z, mut abs) = (0.0f64, 0.0f64);
                for t in 0..k {
                    let p = f64::from(a[t]) * f64::from(b[t]);
                    z += p;
                    abs += p.abs();
                }
                let (gv, gerr) = if j as i32 == y {
                    (f64::from(GY), 0.0)
                } else {
                    let gv = (z - f64::from(LSE)).exp();
                    (gv, gv * (tol * abs + 1e-5))
                };
                for t in 0..k {
                    want[t] += gv * f64::from(b[t]);
                    bound[t] += (gerr + 1e-5 * gv) * f64::from(b[t]).abs();
                }
            }
        }
        for t in 0..k {
            let got: f64 = (0..nsplit as usize)
                .map(|w| f64::from(slab[(w * n + r) * k + t]))
                .sum();
            let ratio = (got - want[t]).abs() / bound[t];
            if ratio > worst.0 || !ratio.is_finite() {
                worst = (
                    if ratio.is_finite() {
                        ratio
                    } else {
                        f64::INFINITY
                    },
                    format!("row {r} column {t}: {got} vs {}", want[t]),
                );
            }
        }
    }
    worst
}

#[cfg(test)]
mod tests {
    use super::*;
    use naga::valid::{Capabilities, ValidationFlags, Validator};

    #[test]
    fn names_round_trip() {
        for s in ["bwd-real", "bwd-noslab:f32", "bwd-noprod"] {
            assert_eq!(BwdVariant::parse(s).unwrap().name(), s);
        }
        assert!(BwdVariant::parse("bwd-fast").is_err());
        assert!(BwdVariant::parse("bwd-real:x").is_err());
    }

    #[test]
    fn every_module_validates() {
        for kind in [BwdKind::Real, BwdKind::NoSlab, BwdKind::NoProd] {
            let src = source(kind);
            let module = naga::front::wgsl::parse_str(&src)
                .unwrap_or_else(|e| panic!("{}", e.emit_to_string(&src)));
            Validator::new(ValidationFlags::all(), Capabilities::all())
                .validate(&module)
                .unwrap_or_else(|e| panic!("{}", e.emit_to_string(&src)));
            assert_eq!(
                src.matches("P.aux != 0.0").count(),
                usize::from(kind != BwdKind::Real)
            );
        }
    }

    /// Every variant on small chunks (ragged tiles, several slices and splits) against f64,
    /// and its timed launch writing no slab where it should not, on the adapter (lavapipe
    /// here).
    #[test]
    fn every_variant_matches_the_f64_reference() {
        let g = match gpu::Gpu::open() {
            Ok(g) => g,
            Err(e) if std::env::var_os("CCE_REQUIRE_WGPU").is_none() => {
                eprintln!("skipping: {e}");
                return;
            }
            Err(e) => panic!("CCE_REQUIRE_WGPU set and {e}"),
        };
        for (s, shape) in [(70, 300, 136), (130, 136, 72)].into_iter().enumerate() {
            for (i, name) in ["bwd-real", "bwd-noslab", "bwd-noprod", "bwd-real:f32"]
                .iter()
                .enumerate()
            {
                let v = BwdVariant::parse(name).unwrap();
                let chunk = Chunk::new(&g, shape, v.dtype, (10 * s + i) as u64).unwrap();
                let b = BwdBuilt::new(&g, v).unwrap();
                let l = b.launch(&g, &chunk, 8).unwrap();
                assert!(l.splits.0 > 1, "{shape:?}: one split");
                let slab = l.run(&g).unwrap();
                let rows: Vec<usize> = (0..shape.0 as usize).collect();
                let (ratio, what) = check(&chunk, l.splits.0, &slab, &rows);
                assert!(
                    ratio <= 1.0,
                    "{name} {shape:?}: {ratio:.2} x tolerance at {what}"
                );
                // The check sees a missing slab.
                let (bad, _) = check(&chunk, l.splits.0 - 1, &slab, &rows);
                assert!(bad > 1.0, "{name}: the check missed a slab");
                if v.kind != BwdKind::Real {
                    let fresh = b.launch(&g, &chunk, 8).unwrap();
                    let back = g
                        .run_read(&fresh.timed, &[(&fresh.slab, fresh.slab.size())])
                        .unwrap();
                    assert!(back[0].iter().all(|&x| x == 0), "{name} wrote the slab");
                }
            }
        }
    }
}
