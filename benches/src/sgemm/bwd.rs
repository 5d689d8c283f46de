//! Ablations of cce-wgpu's backward passes (`bwd_de.wgsl` and `bwd_dc.wgsl` with the named
//! main loop, the GPU default) on one chunk as `WgpuBackend::backward` dispatches it, to split
//! their time between the logits tile, the second product and the slab updates:
//! - `bwd-real` (`d_e`) / `dc-real` (`d_c`): the backend's module text unchanged (entry point
//!   `main`): per kept tile the logits tile, G (kept in registers), then per 64-wide slice of
//!   D the product G·C (`d_e`) or Gᵀ·E (`d_c`), G and X panels staged through workgroup
//!   memory, and the slice's read-modify-write of the f32 slab;
//! - `bwd-noslab` / `dc-noslab`: the same with the slab update made only when `P.aux != 0`
//!   (set for the check, 0 when timed): the logits, G and the whole second product stay;
//! - `bwd-noprod` / `dc-noprod`: the D-slice loop (the second product and the slab updates)
//!   run only when `P.aux != 0`: the logits tile and G stay;
//! - `dc-nobias`: `dc-real` with d_c's bias sums compiled out (their eight registers live
//!   across the whole pass), to see what they cost the module; the bias slab stays zero (the
//!   check is of `d_c` only);
//! - `bwd-slab4` / `dc-slab4`: the slab as `array<vec4<f32>>` where aligned;
//! - `bwd-atomic` / `dc-atomic`: the backend's atomic module (`ShaderKind::BwdDeAtomic` /
//!   `BwdDcAtomic`, slab_atomic.wgsl) unchanged: every split adds into ONE slab with f32
//!   atomics (the device needs `SHADER_FLOAT32_ATOMIC`; building fails with a message
//!   otherwise);
//! - `bwd-atomic-co` / `dc-atomic-co`: the backend's coalesced atomic module
//!   (`ShaderKind::BwdDeAtomicCo` / `BwdDcAtomicCo`, slab_atomic_co.wgsl) unchanged: each
//!   row's 8 x 8 block transposed across the row's 8 lanes by subgroup shuffles, so that one
//!   atomic add instruction covers 8 consecutive floats of a row (the device needs
//!   `SUBGROUP` besides `SHADER_FLOAT32_ATOMIC`).
//!
//! The second product's ablations (`prod_named`, the D-slice product of both passes): each is
//! `noslab` (no slab update at run time) with one more part of the product made only when
//! `P.aux != 0` (so the check runs the whole pass), the difference to `bwd-noslab` /
//! `dc-noslab` being what that part costs:
//! - `bwd-nog` / `dc-nog`: no staging of the G panel from the owners' registers into As
//!   (the product reads the panel left in As);
//! - `bwd-nox` / `dc-nox`: no global load of the X panel (C for d_e, E for d_c; the stale
//!   registers are still decoded and stored into Bs);
//! - `bwd-nobar` / `dc-nobar`: no barrier per panel step of the product;
//! - `bwd-nofma` / `dc-nofma`: no depth loop in each panel step (its FMAs and its
//!   workgroup-memory reads): the global loads, the staging and the barriers alone;
//! - `bwd-dynk` / `dc-dynk`: the panel loop of a slice with a trip count the compiler cannot
//!   see (`min(TILE, D + TILE)`, always TILE) instead of the constant TILE/TK steps, so that a
//!   driver that unrolls the constant loop into 8 x 512 FMAs of straight code does not;
//!   computes the same values.
//!
//! And, to weigh the product's live registers (its 64 accumulators beside the 64 of the G
//! block) against the module: `bwd-noprodc` / `dc-noprodc`, the D-slice loop removed from
//! the text (the `noprod` variants only skip it at run time, so they keep the module's
//! registers): logits and G only; its check is that it writes no slab.
//!
//! `:scalar` builds the variant from the scalar main loop's module (`MainLoop::Scalar`: the
//! micro-tile an `array<vec4<f32>, 16>` behind a pointer, grad.wgsl's `prod_slice`) instead
//! of the named one; for `real`, `noslab`, `noprod`, `nobias`, `slab4` and the atomic kinds.
//!
//! `:WGxTK`, `:loop`, `:wide` build the module at another tile shape or named-loop form, as
//! the forward variants' ([`super::fwd::TileShape`]; e.g. `bwd-atomic:16x16`: 128 x 128 tiles
//! of 16 x 16 threads, the wide form). In the wide form the product's ablations gate the
//! wide text's parts (its `fetch_colg`, its written-out depth steps).
//!
//! `:f32` takes f32 inputs instead of bf16; `:wN` launches with N times the target
//! workgroups (N times the splits, each with its own slab, or all into the one slab for the
//! atomic variants); `:tN` launches for N target workgroups instead of the bench's
//! `--fwd-target-workgroups` (`bwd-real:t896,dc-real:t896`: the splits the backend's 512 MiB
//! budget leaves its slabs at 8192 x 2304 x 256000, 7 of `d_e` and 2 of `d_c`, beside the
//! atomic variants at 2048). Every variant runs with `P.aux` 1 on small chunks against the
//! f64 reference of `d_e` or `d_c` (rows' states as [`rows`] sets them), then is timed with
//! `P.aux` 0. Grid as the backend's for one chunk: `d_e` (splits of the class tiles, row
//! tiles) with [`super::fwd::split_tiles`], `d_c` (splits of the row tiles, class tiles)
//! with [`dc_split_tiles`]; one slab per split (one in all for the atomic variants).

use super::fwd::{split_tiles, Chunk, TileShape};
use super::{gpu, host, Dtype};
use cut_cross_entropy::cce_wgpu::{MainLoop, NamedForm, ShaderKind};

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
    /// `d_c` only: the bias sums compiled out.
    NoBias,
    /// The slab as `array<vec4<f32>>`: a row's 8 floats read and written as two vec4 where
    /// they are 16-byte aligned and inside the row, the scalar path for the rest.
    Slab4,
    /// The backend's atomic module: every split adds into one slab with f32 atomics.
    Atomic,
    /// The backend's coalesced atomic module: [`BwdKind::Atomic`] with each row's adds
    /// transposed across its lanes by subgroup shuffles first.
    AtomicCo,
    /// `NoSlab` without the G panel's staging at run time.
    NoG,
    /// `NoSlab` without the X panel's global loads at run time.
    NoX,
    /// `NoSlab` without the product's barriers at run time.
    NoBar,
    /// `NoSlab` without the product's depth loops (FMAs and panel reads) at run time.
    NoFma,
    /// `NoSlab` with the slice's panel loop at a trip count opaque to the compiler.
    DynK,
    /// The D-slice loop removed from the module text (logits and G only; no slab written).
    NoProdC,
}

impl BwdKind {
    /// Whether the variant adds into one slab with f32 atomics.
    pub fn is_atomic(self) -> bool {
        matches!(self, BwdKind::Atomic | BwdKind::AtomicCo)
    }

    /// Whether the variant is `noslab` with part of the second product made only when
    /// `P.aux != 0` (or, `DynK`, its loop rewritten): the ablations of `prod_named`.
    pub fn is_prod_ablation(self) -> bool {
        matches!(
            self,
            BwdKind::NoG | BwdKind::NoX | BwdKind::NoBar | BwdKind::NoFma | BwdKind::DynK
        )
    }

    /// Whether the variant rewrites text only the named loop's module has (the product
    /// ablations, `noprodc`, `nobias`): no `:scalar`.
    pub fn named_only(self) -> bool {
        self.is_prod_ablation() || matches!(self, BwdKind::NoProdC | BwdKind::NoBias)
    }

    /// The kind's name in a variant name (`bwd-<name>`, `dc-<name>`).
    pub fn name(self) -> &'static str {
        match self {
            BwdKind::Real => "real",
            BwdKind::NoSlab => "noslab",
            BwdKind::NoProd => "noprod",
            BwdKind::NoBias => "nobias",
            BwdKind::Slab4 => "slab4",
            BwdKind::Atomic => "atomic",
            BwdKind::AtomicCo => "atomic-co",
            BwdKind::NoG => "nog",
            BwdKind::NoX => "nox",
            BwdKind::NoBar => "nobar",
            BwdKind::NoFma => "nofma",
            BwdKind::DynK => "dynk",
            BwdKind::NoProdC => "noprodc",
        }
    }

    /// Every kind, in [`BwdKind::name`]'s order.
    pub const ALL: [BwdKind; 13] = [
        BwdKind::Real,
        BwdKind::NoSlab,
        BwdKind::NoProd,
        BwdKind::NoBias,
        BwdKind::Slab4,
        BwdKind::Atomic,
        BwdKind::AtomicCo,
        BwdKind::NoG,
        BwdKind::NoX,
        BwdKind::NoBar,
        BwdKind::NoFma,
        BwdKind::DynK,
        BwdKind::NoProdC,
    ];
}

/// Which backward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BwdPass {
    /// `d_e` (row-owned, `bwd_de.wgsl`).
    De,
    /// `d_c` (class-owned, `bwd_dc.wgsl`).
    Dc,
}

/// One backward variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BwdVariant {
    /// Which pass.
    pub pass: BwdPass,
    /// Which ablation.
    pub kind: BwdKind,
    /// Input dtype.
    pub dtype: Dtype,
    /// Multiplier of the launch's target workgroups (`:wN`, 1 by default): N times the
    /// splits, so fewer distinct fixed tiles among the resident workgroups.
    pub wmul: u32,
    /// Target workgroups of the launch (`:tN`), in place of the caller's (`None` by default).
    pub target: Option<u32>,
    /// The module's main loop: `MainLoop::Named` (the GPU default), or `MainLoop::Scalar`
    /// with `:scalar`.
    pub main_loop: MainLoop,
    /// The module's tile shape and named-loop form (`:WGxTK`, `:loop`, `:wide`).
    pub shape: TileShape,
}

impl BwdVariant {
    /// Parse `bwd-<kind>[:f32][:wN][:tN][:scalar][:WGxTK][:loop|:wide]` (`d_e`) or
    /// `dc-<kind>[..]` (`d_c`), kind
    /// one of `real`, `noslab`, `noprod`, `slab4`, `atomic`, `atomic-co`, `nog`, `nox`,
    /// `nobar`, `nofma`, `dynk`, `noprodc`, and for `d_c` also `nobias` (module docs).
    pub fn parse(s: &str) -> Result<Self, String> {
        let bad = |why: &str| format!("backward variant {s:?}: {why}");
        let mut parts = s.split(':');
        let head = parts.next().unwrap_or_default();
        let (pass, kind) = head
            .strip_prefix("bwd-")
            .map(|k| (BwdPass::De, k))
            .or_else(|| head.strip_prefix("dc-").map(|k| (BwdPass::Dc, k)))
            .and_then(|(pass, k)| {
                BwdKind::ALL
                    .into_iter()
                    .find(|kind| kind.name() == k)
                    .filter(|&kind| kind != BwdKind::NoBias || pass == BwdPass::Dc)
                    .map(|kind| (pass, kind))
            })
            .ok_or_else(|| {
                bad(
                    "want bwd-<kind> or dc-<kind>, kind real, noslab, noprod, slab4, atomic, \
                     atomic-co, nog, nox, nobar, nofma, dynk, noprodc (d_c also nobias)",
                )
            })?;
        let mut v = BwdVariant {
            pass,
            kind,
            dtype: Dtype::Bf16,
            wmul: 1,
            target: None,
            main_loop: MainLoop::Named,
            shape: TileShape::default(),
        };
        for flag in parts {
            if v.shape.flag(flag).map_err(|e| bad(&e))? {
                continue;
            }
            match flag {
                "f32" => v.dtype = Dtype::F32,
                w if w.starts_with('w') => {
                    v.wmul = w[1..]
                        .parse()
                        .ok()
                        .filter(|&m| (1..=64).contains(&m))
                        .ok_or_else(|| bad("want :wN with N in 1..=64"))?
                }
                t if t.starts_with('t') => {
                    v.target = Some(
                        t[1..]
                            .parse()
                            .ok()
                            .filter(|&n| (1..=1 << 20).contains(&n))
                            .ok_or_else(|| bad("want :tN with N in 1..=2^20"))?,
                    )
                }
                "bf16" => v.dtype = Dtype::Bf16,
                "scalar" => {
                    if kind.named_only() {
                        return Err(bad("this variant rewrites the named loop's module only"));
                    }
                    v.main_loop = MainLoop::Scalar
                }
                other => return Err(bad(&format!("unknown flag {other:?}"))),
            }
        }
        if let Some(e) = v.shape.error(v.main_loop) {
            return Err(bad(&e));
        }
        Ok(v)
    }

    /// The name [`BwdVariant::parse`] reads back.
    pub fn name(&self) -> String {
        let kind = self.kind.name();
        let pass = match self.pass {
            BwdPass::De => "bwd",
            BwdPass::Dc => "dc",
        };
        let mut n = format!("{pass}-{kind}");
        if self.dtype == Dtype::F32 {
            n += ":f32";
        }
        if self.wmul != 1 {
            n += &format!(":w{}", self.wmul);
        }
        if let Some(t) = self.target {
            n += &format!(":t{t}");
        }
        if self.main_loop == MainLoop::Scalar {
            n += ":scalar";
        }
        n + &self.shape.suffix()
    }
}

/// The slab update of `add_de_half_v` / `add_dc_half_v`, made only when `P.aux != 0` in the
/// `noslab` variants.
const SLAB_GUARD: &str = "    if ok != 0u {\n        let base = slab_w(w)";
/// The D-slice loop of the entry point (`{begin}`: `prod_begin_named(gt, ` in the named
/// module, `prod_begin(&gt, ` in the scalar one; `{x}`: the pass's X arguments), run only when
/// `P.aux != 0` in the `noprod` variants, removed in the `noprodc` variants.
const SLICE_LOOP: &str = "        {begin}&pb, {x}, tx, ty, li);
        for (var d0 = 0u; d0 < P.d; d0 += t) {
";

/// `prod_named`'s G panel staging (the `nog` variants gate it by `P.aux`).
const PROD_PUT_G: &str = "            put_gp_named(gt, o.x, o.y, nk, buf ^ 1u);\n";
/// `prod_named`'s X panel fetch (the `nox` variants gate it by `P.aux`), and the wide form's.
const PROD_FETCH_X: &str = "        if next {\n            fetch_cols(";
const PROD_FETCH_X_WIDE: &str = "        if next {\n            px0 = fetch_colg(";
/// `prod_named`'s barrier per panel step (the `nobar` variants gate it by `P.aux`).
const PROD_BARRIER: &str = "        workgroupBarrier();\n        buf ^= 1u;\n";
/// `prod_named`'s depth loop of a panel step (the `nofma` variants gate it by `P.aux`), up to
/// the staging of the next panels that follows it; and the wide form's written-out steps.
const PROD_DEPTH: (&str, &str) = (
    "        for (var k = 0u; k < TK; k++) {\n            let ka",
    "        }\n        if next {\n            put_gp_named(",
);
const PROD_DEPTH_WIDE: (&str, &str) = (
    "        let at = buf * TK * W_T4 + ty;\n",
    "        if next {\n            put_gp_named(",
);
/// `prod_named`'s panel loop over a slice (the `dynk` variants give it an opaque trip count).
const PROD_LOOP: &str = "    for (var k0 = 0u; k0 < t; k0 += TK) {\n";

/// `prod_named` of `real` with one rewrite (`what` found exactly once in the function, `to` in
/// its place); the rest of the module unchanged. Panics when `what` is not found once.
fn in_prod(real: &str, what: &str, to: &str) -> String {
    let f = function(real, "prod_named");
    assert_eq!(f.matches(what).count(), 1, "prod_named: {what:?}");
    real.replace(f, &f.replace(what, to))
}

/// `noslab`'s rewrite of `real`: the slab update made only when `P.aux != 0`.
fn no_slab(real: &str) -> String {
    assert_eq!(real.matches(SLAB_GUARD).count(), 1, "add_*_half_v's guard");
    real.replace(
        SLAB_GUARD,
        "    if ok != 0u && P.aux != 0.0 {\n        let base = slab_w(w)",
    )
}

/// slab_rmw.wgsl's slab binding.
const SLAB_DECL: &str = "var<storage, read_write> slab: array<f32>;";

/// slab_rmw.wgsl's `ld_row8` and `st_row8` on a vec4 slab (`Slab4`): two vec4 accesses when
/// the row's 8 floats at base + n0 are 16-byte aligned and below base + D, else float by float
/// (f = slab[i / 4][i % 4]) as slab_rmw.wgsl does them. In bounds wherever grad.wgsl's are: the
/// vec4 path touches floats base + n0 .. + 7 < base + D only.
const SLAB4_ROWS: &str = "fn slab_f(i: u32) -> f32 {
    return slab[i >> 2u][i & 3u];
}

fn ld_row8(base: u32, n0: u32) -> array<vec4<f32>, 2> {
    let o = base + n0;
    if (o & 3u) == 0u && n0 + 8u <= P.d {
        return array<vec4<f32>, 2>(slab[o >> 2u], slab[(o >> 2u) + 1u]);
    }
    let last = base + P.d - 1u;
    return array<vec4<f32>, 2>(
        vec4<f32>(slab_f(min(o, last)), slab_f(min(o + 1u, last)), slab_f(min(o + 2u, last)),
                  slab_f(min(o + 3u, last))),
        vec4<f32>(slab_f(min(o + 4u, last)), slab_f(min(o + 5u, last)),
                  slab_f(min(o + 6u, last)), slab_f(min(o + 7u, last))));
}

fn st_row8(lo: vec4<f32>, hi: vec4<f32>, base: u32, n0: u32) {
    let o = base + n0;
    if (o & 3u) == 0u && n0 + 8u <= P.d {
        slab[o >> 2u] = lo;
        slab[(o >> 2u) + 1u] = hi;
        return;
    }
    for (var jj = 0u; jj < 8u; jj++) {
        if n0 + jj < P.d {
            let i = o + jj;
            slab[i >> 2u][i & 3u] = pick8(lo, hi, jj);
        }
    }
}
";

/// Function `name` (from `fn name(` to its closing `}` at column 0) of `src`.
fn function<'a>(src: &'a str, name: &str) -> &'a str {
    let at = src
        .find(&format!("\nfn {name}("))
        .unwrap_or_else(|| panic!("no fn {name}"))
        + 1;
    let len = src[at..].find("\n}\n").expect("a closing brace") + 3;
    &src[at..at + len]
}

/// The backend's shader of `pass`, with f32 atomics for [`BwdKind::Atomic`], coalesced for
/// [`BwdKind::AtomicCo`].
fn shader(pass: BwdPass, kind: BwdKind) -> ShaderKind {
    match (pass, kind) {
        (BwdPass::De, BwdKind::Atomic) => ShaderKind::BwdDeAtomic,
        (BwdPass::Dc, BwdKind::Atomic) => ShaderKind::BwdDcAtomic,
        (BwdPass::De, BwdKind::AtomicCo) => ShaderKind::BwdDeAtomicCo,
        (BwdPass::Dc, BwdKind::AtomicCo) => ShaderKind::BwdDcAtomicCo,
        (BwdPass::De, _) => ShaderKind::BwdDe,
        (BwdPass::Dc, _) => ShaderKind::BwdDc,
    }
}

/// The module of `pass`'s variant `kind` in the named main loop's loop form
/// ([`source_with`]).
pub fn source(pass: BwdPass, kind: BwdKind) -> String {
    source_with(pass, kind, MainLoop::Named, NamedForm::Loop)
}

/// The module of `pass`'s variant `kind` built on `main_loop`'s module (the backend's, its
/// named loop in `form`, rewritten as the module docs say). Panics when the backend's text no
/// longer has what it rewrites (unit-tested), for `NoBias` of `d_e`, or for a
/// [`BwdKind::named_only`] kind on another loop than `MainLoop::Named`.
pub fn source_with(pass: BwdPass, kind: BwdKind, main_loop: MainLoop, form: NamedForm) -> String {
    let x = match pass {
        BwdPass::De => "false, c_base, P.n_cls",
        BwdPass::Dc => "true, r_base, P.n_rows",
    };
    let begin = match main_loop {
        MainLoop::Named => "prod_begin_named(gt, ",
        _ => "prod_begin(&gt, ",
    };
    let real = shader(pass, kind).source_form(main_loop, form).into_owned();
    let wide = matches!(form, NamedForm::Wide { .. });
    let slice_loop = SLICE_LOOP.replace("{x}", x).replace("{begin}", begin);
    assert!(
        main_loop == MainLoop::Named || !kind.named_only(),
        "{kind:?}: an ablation of the named loop"
    );
    match kind {
        BwdKind::Real | BwdKind::Atomic | BwdKind::AtomicCo => real,
        BwdKind::NoSlab => no_slab(&real),
        BwdKind::NoProd => {
            assert_eq!(real.matches(&slice_loop).count(), 1, "the D-slice loop");
            real.replace(
                &slice_loop,
                &format!(
                    "        let d_end = select(0u, P.d, P.aux != 0.0);
        if d_end != 0u {{
            {begin}&pb, {x}, tx, ty, li);
        }}
        for (var d0 = 0u; d0 < d_end; d0 += t) {{
"
                ),
            )
        }
        BwdKind::NoProdC => {
            assert_eq!(real.matches(&slice_loop).count(), 1, "the D-slice loop");
            real.replace(
                &slice_loop,
                "        for (var d0 = 0u; d0 < 0u; d0 += t) {\n",
            )
        }
        BwdKind::NoG => in_prod(
            &no_slab(&real),
            PROD_PUT_G,
            &format!("            if P.aux != 0.0 {{\n    {PROD_PUT_G}            }}\n"),
        ),
        BwdKind::NoX if wide => in_prod(
            &no_slab(&real),
            PROD_FETCH_X_WIDE,
            "        if next && P.aux != 0.0 {\n            px0 = fetch_colg(",
        ),
        BwdKind::NoX => in_prod(
            &no_slab(&real),
            PROD_FETCH_X,
            "        if next && P.aux != 0.0 {\n            fetch_cols(",
        ),
        BwdKind::NoBar => in_prod(
            &no_slab(&real),
            PROD_BARRIER,
            "        if P.aux != 0.0 {\n            workgroupBarrier();\n        }\n        buf ^= 1u;\n",
        ),
        BwdKind::NoFma => {
            let src = no_slab(&real);
            let f = function(&src, "prod_named");
            let (open, close) = if wide { PROD_DEPTH_WIDE } else { PROD_DEPTH };
            assert_eq!(f.matches(open).count(), 1, "prod_named's depth loop");
            assert_eq!(f.matches(close).count(), 1, "prod_named's depth loop end");
            let g = f
                .replace(open, &format!("        if P.aux != 0.0 {{\n{open}"))
                .replace(close, &format!("        }}\n{close}"));
            src.replace(f, &g)
        }
        BwdKind::DynK => in_prod(
            &no_slab(&real),
            PROD_LOOP,
            "    let kt = min(t, P.d + t);\n    for (var k0 = 0u; k0 < kt; k0 += TK) {\n",
        ),
        BwdKind::NoBias => {
            assert_eq!(pass, BwdPass::Dc, "nobias is a d_c variant");
            for acc in ["bacc_lo += ", "bacc_hi += "] {
                assert_eq!(real.matches(acc).count(), 8, "{acc}");
            }
            real.replace("bacc_lo += ", "_ = ")
                .replace("bacc_hi += ", "_ = ")
        }
        BwdKind::Slab4 => {
            assert_eq!(real.matches(SLAB_DECL).count(), 1, "the slab binding");
            let (ld, st) = (function(&real, "ld_row8"), function(&real, "st_row8"));
            real.replace(ld, "").replace(st, SLAB4_ROWS).replace(
                SLAB_DECL,
                "var<storage, read_write> slab: array<vec4<f32>>;",
            )
        }
    }
}

/// Row tiles per split of the backend's `d_c` pass for one chunk of `n_rows` x `n_cls` at
/// `target_workgroups` and tiles of side `tile` (its `dc_split` with no memory cap): enough
/// splits that splits x class tiles reaches the target, at most one per row tile.
pub fn dc_split_tiles(n_rows: u32, n_cls: u32, target_workgroups: u32, tile: u32) -> u32 {
    let (rt, ct) = (n_rows.div_ceil(tile), n_cls.div_ceil(tile));
    let want = target_workgroups.div_ceil(ct.max(1)).clamp(1, rt.max(1));
    rt.div_ceil(want).max(1)
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
    /// Splits and tiles per split (class tiles for `d_e`, row tiles for `d_c`).
    pub splits: (u32, u32),
    /// Slabs the launch writes: one per split, or one for the atomic variants.
    pub slabs: u32,
}

impl BwdBuilt {
    /// Build `v`'s pipeline (trusted, as cce-wgpu builds its modules). Errors: validation.
    pub fn new(g: &gpu::Gpu, v: BwdVariant) -> Result<Self, String> {
        // The module is cce-wgpu's d_e or d_c source, whose trusted use its `bounds` module
        // argues (accesses guarded by `P.n_rows`, `P.n_cls`, `P.d`; e, c, bias bindings of at
        // least the chunk's rows · d elements rounded up to 16 bytes; `rs` and `dropped` of
        // n_rows entries; the slab of splits · slab_stride floats with slab_stride = n_rows · d
        // for d_e, n_cls · d for d_c, one slab for the atomic modules; d_c's bias slab of
        // splits (or one) · n_cls floats; the counters of 4 words per workgroup), with the
        // ablations only narrowing when the product, the slab updates and the bias sums run;
        // `BwdBuilt::launch` binds buffers of those sizes.
        let form = v.shape.named_form(v.main_loop);
        Self::with_source(g, v, source_with(v.pass, v.kind, v.main_loop, form))
    }

    /// [`BwdBuilt::new`] of the module text `src` (`v`'s, or a rewrite of it that keeps its
    /// bindings and bounds). Errors: validation, or a device without the features `v` needs.
    fn with_source(g: &gpu::Gpu, v: BwdVariant, src: String) -> Result<Self, String> {
        let shader = shader(v.pass, v.kind);
        if v.kind == BwdKind::NoBias && v.pass == BwdPass::De {
            return Err(format!("{}: nobias is a d_c variant", v.name()));
        }
        if v.kind.is_atomic() && !g.float_atomics {
            return Err(format!(
                "{}: the device has no SHADER_FLOAT32_ATOMIC ({})",
                v.name(),
                g.info.name
            ));
        }
        if v.kind == BwdKind::AtomicCo && !g.subgroups {
            return Err(format!(
                "{}: the device has no SUBGROUP ({})",
                v.name(),
                g.info.name
            ));
        }
        let constants = shader.constants(v.dtype.cce_code(), v.shape.wg, v.shape.tk);
        let pipeline = g.pipeline(&v.name(), src, "main", &constants, false)?;
        Ok(Self {
            variant: v,
            pipeline,
        })
    }

    /// Bind `chunk` with the backend's split for `target_workgroups` (the variant's `:tN` in
    /// its place, times its `:wN`). Errors: a chunk of another dtype, or a device error.
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
        let tile = v.shape.tile();
        let (row_tiles, cls_tiles) = (n.div_ceil(tile), nc.div_ceil(tile));
        let target_workgroups = v.target.unwrap_or(target_workgroups).saturating_mul(v.wmul);
        // (tiles per split, splits, the grid's y extent, floats per slab).
        let (per, nsplit, gy, stride) = match v.pass {
            BwdPass::De => {
                let per = split_tiles(n, nc, target_workgroups, false, tile);
                let stride = u64::from(n) * u64::from(d);
                (per, cls_tiles.div_ceil(per), row_tiles, stride)
            }
            BwdPass::Dc => {
                let per = dc_split_tiles(n, nc, target_workgroups, tile);
                let stride = u64::from(nc) * u64::from(d);
                (per, row_tiles.div_ceil(per), cls_tiles, stride)
            }
        };
        let slabs = if v.kind.is_atomic() { 1 } else { nsplit };
        // Whole vec4s, for `Slab4`'s binding.
        let slab = g.storage(
            "slabs",
            (4 * u64::from(slabs) * stride).next_multiple_of(16),
        )?;
        let bslab = g.storage("bias slabs", 4 * u64::from(slabs) * u64::from(nc))?;
        let rs = g.upload("row states", bytemuck::cast_slice(&rows(&chunk.tgt)))?;
        let dropped = g.storage("dropped", 4 * u64::from(n))?;
        let counters = g.storage("counters", 16 * u64::from(nsplit * gy))?;
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
        let groups = (nsplit, gy);
        let mk = |aux: f32| -> Result<gpu::Launch, String> {
            let ubuf = g.uniform(bytemuck::cast_slice(&params(aux)))?;
            let [e, c, b, _] = chunk.buffers();
            let mut all = vec![
                (0, &ubuf),
                (1, e),
                (2, c),
                (3, b),
                (4, &rs),
                (5, &slab),
                (6, &dropped),
                (7, &counters),
            ];
            if v.pass == BwdPass::Dc {
                all.push((8, &bslab));
            }
            g.launch_with(&self.pipeline, &all, groups, flop)
        };
        let (timed, checked) = (mk(0.0), mk(1.0));
        Ok(BwdLaunch {
            timed: timed?,
            checked: checked?,
            slab,
            splits: (nsplit, per),
            slabs,
        })
    }
}

impl BwdLaunch {
    /// Dispatch the checked launch once on zeroed slabs and read them (`[slabs, n_rows, d]`
    /// f32, `n_cls` for `d_c`).
    pub fn run(&self, g: &gpu::Gpu) -> Result<Vec<f32>, String> {
        let back = g.run_read(&self.checked, &[(&self.slab, self.slab.size())])?;
        Ok(bytemuck::pod_collect_to_vec(&back[0]))
    }
}

/// `G`'s entry of row `a` and class `b` (class index `j`, the row's target `y`) as the
/// checked passes form it from the fixed [`LSE`], and the bound of its f32 error: the target's
/// [`GY`] exactly.
fn g_entry(a: &[f32], b: &[f32], j: usize, y: i32, tol: f64) -> (f64, f64) {
    if j as i32 == y {
        return (f64::from(GY), 0.0);
    }
    let (mut z, mut abs) = (0.0f64, 0.0f64);
    for (x, w) in a.iter().zip(b) {
        let p = f64::from(*x) * f64::from(*w);
        z += p;
        abs += p.abs();
    }
    let gv = (z - f64::from(LSE)).exp();
    (gv, gv * (tol * abs + 1e-5))
}

/// Folds one output row (`what`) into `worst`: `got(t)` against `want[t]` within `bound[t]`,
/// as a multiple of the bound (a non-finite ratio counts as infinite).
fn fold_worst(
    worst: &mut (f64, String),
    got: impl Fn(usize) -> f64,
    (want, bound): (&[f64], &[f64]),
    what: &str,
) {
    for t in 0..want.len() {
        let g = got(t);
        let ratio = (g - want[t]).abs() / bound[t];
        if ratio > worst.0 || !ratio.is_finite() {
            let ratio = if ratio.is_finite() {
                ratio
            } else {
                f64::INFINITY
            };
            *worst = (ratio, format!("{what} column {t}: {g} vs {}", want[t]));
        }
    }
}

/// Worst error of `d_e` (the `slabs` slabs `[slabs, n_rows, d]` summed) over `rows` against the f64 reference, as a
/// multiple of its tolerance (<= 1 passes), with a description of the worst entry.
pub fn check(chunk: &Chunk, slabs: u32, slab: &[f32], rows: &[usize]) -> (f64, String) {
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
                let (gv, gerr) = g_entry(a, b, j, y, tol);
                for t in 0..k {
                    want[t] += gv * f64::from(b[t]);
                    bound[t] += (gerr + 1e-5 * gv) * f64::from(b[t]).abs();
                }
            }
        }
        let got = |t: usize| -> f64 {
            (0..slabs as usize)
                .map(|w| f64::from(slab[(w * n + r) * k + t]))
                .sum()
        };
        fold_worst(&mut worst, got, (&want, &bound), &format!("row {r}"));
    }
    worst
}

/// Worst error of `d_c` (the slabs `[slabs, n_cls, d]` summed) over `classes` against the
/// f64 reference (`d_c[j] = Σ_r G[r][j] · e[r]`, rows of ignored targets left out), as a
/// multiple of its tolerance (<= 1 passes), with a description of the worst entry.
pub fn check_dc(chunk: &Chunk, slabs: u32, slab: &[f32], classes: &[usize]) -> (f64, String) {
    let (n, nc, d) = chunk.shape;
    let (n, nc, k) = (n as usize, nc as usize, d as usize);
    let tol = host::tolerance(k);
    let mut worst = (0.0f64, String::from("no entry checked"));
    for &j in classes {
        let b = &chunk.c[j * k..(j + 1) * k];
        let mut want = vec![0.0f64; k];
        let mut bound = vec![1e-30f64; k];
        for r in 0..n {
            let y = chunk.tgt[r];
            if y < 0 {
                continue;
            }
            let a = &chunk.e[r * k..(r + 1) * k];
            let (gv, gerr) = g_entry(a, b, j, y, tol);
            for t in 0..k {
                want[t] += gv * f64::from(a[t]);
                bound[t] += (gerr + 1e-5 * gv) * f64::from(a[t]).abs();
            }
        }
        let got = |t: usize| -> f64 {
            (0..slabs as usize)
                .map(|w| f64::from(slab[(w * nc + j) * k + t]))
                .sum()
        };
        fold_worst(&mut worst, got, (&want, &bound), &format!("class {j}"));
    }
    worst
}

/// [`check`] (every row) or [`check_dc`] (every class) as `v`'s pass needs; for
/// [`BwdKind::NoProdC`], which computes no product, that the slab stays zero (0, or infinity
/// at the first nonzero float).
pub fn check_all(v: BwdVariant, chunk: &Chunk, slabs: u32, slab: &[f32]) -> (f64, String) {
    let (n, nc, _) = chunk.shape;
    if v.kind == BwdKind::NoProdC {
        return match slab.iter().position(|&x| x != 0.0) {
            None => (0.0, String::from("the slab stays zero")),
            Some(i) => (
                f64::INFINITY,
                format!("slab float {i} written: {}", slab[i]),
            ),
        };
    }
    match v.pass {
        BwdPass::De => check(chunk, slabs, slab, &(0..n as usize).collect::<Vec<_>>()),
        BwdPass::Dc => check_dc(chunk, slabs, slab, &(0..nc as usize).collect::<Vec<_>>()),
    }
}

#[cfg(test)]
mod tests;
