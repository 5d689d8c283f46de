//! The forward shader itself and ablations of it (issue 21, "where the forward loses 5x"):
//! cce-wgpu's `fwd_partial` pipeline source (`ShaderKind::FwdPartial.source_with`) with extra
//! entry points that drop one piece of the real pass at a time, dispatched on the real
//! bindings with the real `Params` and grid of one class chunk, GPU-timestamped like the
//! SGEMM variants, and checked against f64 on the host.
//!
//! Variants (`fwd-KIND[:scalar][:t1][:f32]`):
//! - `fwd-real`: the module's own entry point `main` (main loop + softmax epilogue + partial
//!   and target-logit writes) from the backend's module text unchanged, exactly what
//!   `WgpuBackend::forward` dispatches per class chunk;
//! - `fwd-nowrite`: the same pass with no global write at run time: the target-logit store
//!   taken out of `row_step`, the partials stored only when `P.aux != 0` (set for the check,
//!   0 when timed), so the epilogue's running states and end reduction stay;
//! - `fwd-loopwg`: the tile loop and main loop with the epilogue replaced by eight per-row
//!   running sums in registers, reduced across the row's threads once at the end through the
//!   real pass's `fwd_end` (the panels as scratch), so the workgroup memory is the real
//!   pass's;
//! - `fwd-loop`: the same with the end reduction through a 2 KiB array of its own (the
//!   panels plus 2 KiB of workgroup memory, as the `ours` SGEMM entry point);
//! - `:scalar`: the `Acc`-array main loop (`logits_tile`) instead of the named one
//!   (`logits_named`, the GPU default); `:t1`: one class tile per workgroup (`split_tiles`
//!   1, a grid of class tiles x row tiles, as the `ours` SGEMM) instead of the backend's
//!   split; `:f32`: f32 inputs instead of bf16;
//! - `:WGxTK` (e.g. `:16x16`): the module at tiles of `WG x WG` threads and `TK`-deep panels
//!   (default `8x8`, the backend's default), the named loop in the form the backend
//!   generates for that shape (`NamedForm::for_shape`: the wide form at `wg` 16); `:loop` /
//!   `:wide` force the named loop's loop form or wide form (`NamedForm`) at any shape that
//!   has it;
//! - `:padN` (`fwd-real` only): the real pass with N KiB of workgroup memory added (an
//!   array each thread writes one vec4 of before the pass and reads another thread's after
//!   it, [`pad_source`]), so that the forward runs with the footprint of another shader (the
//!   backward's `d_e` pass has 20 KiB at `8:8`, the forward 8: `:pad12`).
//!
//! Parameters: bindings as fwd_partial.wgsl (0 params, 1 e `[n_rows, d]`, 2 c `[n_cls, d]`,
//! 3 bias (none: a 256-byte stand-in), 4 targets `[n_rows]` i32, 5 partials
//! `[n_rows, splits]` Part, 6 target logits `[n_rows]` f32); `Params` with the chunk at
//! `row0 = cls0 = 0`, `v_total = n_cls`, `FLAG_VEC_E | FLAG_VEC_C` (d a multiple of 4).
//! Tiling and thread mapping: fwd_partial.wgsl's (`8·WG` x `8·WG` tiles, WG x WG threads: 64 x
//! 64 and 8 x 8 by default); the grid (splits, row tiles) with `split_tiles` from
//! [`split_tiles`].

use super::{gpu, host, Dtype};
use cut_cross_entropy::cce_wgpu::{KernelConfig, MainLoop, NamedForm, ShaderKind};
use std::fmt::Write;

/// cce-wgpu's tile side at `wg` 8 (the default [`TileShape`]).
pub const TILE: u32 = 64;

/// The tile shape and named-loop form a forward or backward variant's module is built for:
/// `:WGxTK` (threads per tile side, panel depth; default `8x8`), `:loop` / `:wide` (the
/// named loop's [`NamedForm`]; default: the backend's for the shape).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TileShape {
    /// Threads per tile side (`KernelConfig::wg`).
    pub wg: u32,
    /// Panel depth (`KernelConfig::tk`).
    pub tk: u32,
    /// `Some(true)`: the wide form, `Some(false)`: the loop form, `None`: the backend's.
    pub form: Option<bool>,
}

impl Default for TileShape {
    fn default() -> Self {
        TileShape {
            wg: 8,
            tk: 8,
            form: None,
        }
    }
}

impl TileShape {
    /// Side of the logits tile.
    pub fn tile(&self) -> u32 {
        8 * self.wg
    }

    /// Take `flag` if it is one of the shape's (`WGxTK`, `loop`, `wide`): `Ok(true)`; another
    /// flag: `Ok(false)`; a malformed `WGxTK`: an error.
    pub fn flag(&mut self, flag: &str) -> Result<bool, String> {
        match flag {
            "loop" => self.form = Some(false),
            "wide" => self.form = Some(true),
            f => {
                let Some((a, b)) = f.split_once('x') else {
                    return Ok(false);
                };
                let num = |x: &str| x.parse::<u32>().map_err(|e| format!("{f:?}: {e}"));
                self.wg = num(a)?;
                self.tk = num(b)?;
            }
        }
        Ok(true)
    }

    /// Why the backend's shaders cannot run this shape with `main_loop`, if they cannot
    /// (`KernelConfig::shape_error`; a form asked for needs the named loop, the wide form a
    /// shape `NamedForm::wide` takes).
    pub fn error(&self, main_loop: MainLoop) -> Option<String> {
        let cfg = KernelConfig {
            wg: self.wg,
            tk: self.tk,
            main_loop,
            ..KernelConfig::for_adapter(wgpu::DeviceType::Cpu, u32::MAX)
        };
        if let Some(e) = cfg.shape_error() {
            return Some(e);
        }
        match self.form {
            Some(_) if main_loop != MainLoop::Named => {
                Some("loop / wide are forms of the named loop".into())
            }
            Some(true) if NamedForm::wide(self.wg, self.tk).is_none() => Some(format!(
                "no wide form at {}x{} (wg and tk multiples of 8)",
                self.wg, self.tk
            )),
            _ => None,
        }
    }

    /// The named loop's form of a module with `main_loop` at this shape.
    pub fn named_form(&self, main_loop: MainLoop) -> NamedForm {
        if main_loop != MainLoop::Named {
            return NamedForm::Loop;
        }
        match self.form {
            None => NamedForm::for_shape(self.wg, self.tk),
            Some(true) => NamedForm::wide(self.wg, self.tk).unwrap_or(NamedForm::Loop),
            Some(false) => NamedForm::Loop,
        }
    }

    /// The flags [`TileShape::flag`] reads back (empty for the default).
    pub fn suffix(&self) -> String {
        let mut n = String::new();
        if (self.wg, self.tk) != (8, 8) {
            let _ = write!(n, ":{}x{}", self.wg, self.tk);
        }
        match self.form {
            Some(true) => n += ":wide",
            Some(false) => n += ":loop",
            None => {}
        }
        n
    }
}
/// cce-wgpu's `FLAG_VEC_E | FLAG_VEC_C`.
const FLAG_VEC: u32 = 1024 | 2048;
/// Words of one `Part` (common.wgsl).
const PART_WORDS: usize = 8;

/// What the entry point keeps of the real pass (module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FwdKind {
    /// The real entry point `main`.
    Real,
    /// No global writes at run time.
    NoWrite,
    /// Tile loop + main loop, per-row sums, the real pass's end reduction.
    LoopWg,
    /// Tile loop + main loop, per-row sums, 2 KiB of workgroup memory of its own.
    Loop,
}

/// One forward variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FwdVariant {
    /// Which entry point.
    pub kind: FwdKind,
    /// The logits tile's main loop: `Named` (default) or `Scalar`.
    pub main_loop: MainLoop,
    /// One class tile per workgroup instead of the backend's split.
    pub one_tile: bool,
    /// Input dtype.
    pub dtype: Dtype,
    /// KiB of workgroup memory added to the real pass (`:padN`; 0: none).
    pub pad_kib: u32,
    /// The module's tile shape and named-loop form (`:WGxTK`, `:loop`, `:wide`).
    pub shape: TileShape,
}

impl FwdVariant {
    /// Parse `fwd-{real|nowrite|loopwg|loop}[:scalar][:WGxTK][:loop|:wide][:t1][:f32][:padN]`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let bad = |why: &str| format!("forward variant {s:?}: {why}");
        let mut parts = s.split(':');
        let kind = match parts.next().unwrap_or_default() {
            "fwd-real" => FwdKind::Real,
            "fwd-nowrite" => FwdKind::NoWrite,
            "fwd-loopwg" => FwdKind::LoopWg,
            "fwd-loop" => FwdKind::Loop,
            _ => return Err(bad("want fwd-real|fwd-nowrite|fwd-loopwg|fwd-loop")),
        };
        let mut v = FwdVariant {
            kind,
            main_loop: MainLoop::Named,
            one_tile: false,
            dtype: Dtype::Bf16,
            pad_kib: 0,
            shape: TileShape::default(),
        };
        for flag in parts {
            if v.shape.flag(flag).map_err(|e| bad(&e))? {
                continue;
            }
            if let Some(n) = flag.strip_prefix("pad") {
                v.pad_kib = match n.parse::<u32>() {
                    Ok(k) if (1..=64).contains(&k) => k,
                    _ => return Err(bad("padN wants N KiB in 1..=64")),
                };
                if kind != FwdKind::Real {
                    return Err(bad("padN applies to fwd-real only"));
                }
                continue;
            }
            match flag {
                "scalar" => v.main_loop = MainLoop::Scalar,
                "named" => v.main_loop = MainLoop::Named,
                "t1" => v.one_tile = true,
                "f32" => v.dtype = Dtype::F32,
                "bf16" => v.dtype = Dtype::Bf16,
                other => return Err(bad(&format!("unknown flag {other:?}"))),
            }
        }
        if let Some(e) = v.shape.error(v.main_loop) {
            return Err(bad(&e));
        }
        // pad_source's slots below WG².
        if v.pad_kib > 0 && 64 * v.pad_kib < v.shape.wg * v.shape.wg {
            return Err(bad("padN wants N KiB >= WG² / 64"));
        }
        Ok(v)
    }

    /// The name [`FwdVariant::parse`] reads back.
    pub fn name(&self) -> String {
        let mut n = match self.kind {
            FwdKind::Real => "fwd-real",
            FwdKind::NoWrite => "fwd-nowrite",
            FwdKind::LoopWg => "fwd-loopwg",
            FwdKind::Loop => "fwd-loop",
        }
        .to_string();
        if self.main_loop == MainLoop::Scalar {
            n += ":scalar";
        }
        n += &self.shape.suffix();
        if self.one_tile {
            n += ":t1";
        }
        if self.dtype == Dtype::F32 {
            n += ":f32";
        }
        if self.pad_kib > 0 {
            let _ = write!(n, ":pad{}", self.pad_kib);
        }
        n
    }

    /// The entry point's name in [`source`]'s (or [`pad_source`]'s) module.
    pub fn entry(&self) -> &'static str {
        match self.kind {
            FwdKind::Real if self.pad_kib > 0 => "fwd_pad",
            FwdKind::Real => "main",
            FwdKind::NoWrite => "fwd_nowrite",
            FwdKind::LoopWg => "fwd_loopwg",
            FwdKind::Loop => "fwd_loop",
        }
    }

    /// The bindings its entry point uses (an automatic layout holds only those).
    pub fn bindings(&self) -> &'static [u32] {
        match self.kind {
            FwdKind::Real => &[0, 1, 2, 3, 4, 5, 6],
            FwdKind::NoWrite => &[0, 1, 2, 3, 4, 5],
            FwdKind::LoopWg => &[0, 1, 2, 5],
            FwdKind::Loop => &[0, 1, 2, 5],
        }
    }

    /// Whether the variant computes the full partials (else only `sz`, the sum of logits).
    pub fn full_parts(&self) -> bool {
        matches!(self.kind, FwdKind::Real | FwdKind::NoWrite)
    }
}

/// Tiles per split of a chunk of `n_rows x n_cls` at tiles of side `tile`: 1 for `one_tile`,
/// else as `WgpuBackend::class_splits` for one row chunk without a loop budget (GPUs): the
/// chunk's class tiles cut into about `target_workgroups / row tiles` contiguous splits.
pub fn split_tiles(
    n_rows: u32,
    n_cls: u32,
    target_workgroups: u32,
    one_tile: bool,
    tile: u32,
) -> u32 {
    if one_tile {
        return 1;
    }
    let (rt, ct) = (n_rows.div_ceil(tile), n_cls.div_ceil(tile));
    let want = target_workgroups.div_ceil(rt.max(1)).clamp(1, ct.max(1));
    ct.div_ceil(want).max(1)
}

/// The micro-tile's accumulator `n` as the entry point names it.
fn acc(ml: MainLoop, n: usize) -> String {
    match ml {
        MainLoop::Named => format!("tl.a{n}"),
        _ => format!("acc[{n}]"),
    }
}

/// The logits tile of rows `r_base` x classes `c_base` into `tl` / `acc`.
fn tile_call(ml: MainLoop) -> &'static str {
    match ml {
        MainLoop::Named => "let tl = logits_named(r_base, c_base, tx, ty, li);",
        _ => "logits_tile(&acc, r_base, c_base, tx, ty, li);",
    }
}

/// Function `name` (from `fn name(` to its closing `}` at column 0) of `src`.
fn function<'a>(src: &'a str, name: &str) -> &'a str {
    let at = src
        .find(&format!("\nfn {name}("))
        .unwrap_or_else(|| panic!("fwd source has no fn {name}"))
        + 1;
    let end = at
        + src[at..]
            .find("\n}\n")
            .unwrap_or_else(|| panic!("fn {name} does not end"))
        + 3;
    &src[at..end]
}

/// The forward module for `main_loop` (its named loop in `form`) with the entry points of
/// every [`FwdKind`] appended.
pub fn source(main_loop: MainLoop, form: NamedForm) -> String {
    let mut w = ShaderKind::FwdPartial
        .source_form(main_loop, form)
        .into_owned();
    // row_step / put_row without the target-logit store.
    let row_step = function(&w, "row_step");
    assert!(
        row_step.contains("tlogit[r] = z;"),
        "row_step stores tlogit"
    );
    let row_step_nw = row_step
        .replace("fn row_step(", "fn row_step_nw(")
        .replace("tlogit[r] = z;", "");
    let put_row = function(&w, "put_row");
    assert!(put_row.contains("row_step("), "put_row calls row_step");
    let put_row_nw = put_row
        .replace("fn put_row(", "fn put_row_nw(")
        .replace("row_step(", "row_step_nw(");
    // fwd_end, storing only when P.aux != 0.
    let fwd_end = function(&w, "fwd_end");
    let store = "        if r < P.n_rows {\n";
    assert!(fwd_end.contains(store), "fwd_end guards its store by row");
    let fwd_end_nw = fwd_end
        .replace("fn fwd_end(", "fn fwd_end_nw(")
        .replace(store, "        if r < P.n_rows && P.aux != 0.0 {\n");
    let head = "\
    let t = tile();
    let tx = lid.x;
    let ty = lid.y;
    let split = wid.x;
    let r_base = wid.y * t;
    let n_ct = (P.n_cls + t - 1u) / t;
    let ct0 = split * P.split_tiles;
    let ct1 = min(ct0 + P.split_tiles, n_ct);
";
    let acc_decl = if main_loop == MainLoop::Named {
        ""
    } else {
        "    var acc: Acc;\n"
    };
    let sig = "(@builtin(workgroup_id) wid: vec3<u32>, \
               @builtin(local_invocation_id) lid: vec3<u32>, \
               @builtin(local_invocation_index) li: u32)";
    let _ = write!(
        w,
        "
// --- cce-bench-sgemm: ablations of the forward pass (benches/src/sgemm/fwd.rs).
{row_step_nw}
{put_row_nw}
{fwd_end_nw}
@compute @workgroup_size(WG, WG, 1)
fn fwd_nowrite{sig} {{
{head}{acc_decl}",
    );
    for i in 0..8 {
        let _ = writeln!(w, "    var st{i} = run_empty();");
    }
    let _ = write!(
        w,
        "    var mk = 0u;
    for (var ct = ct0; ct < ct1; ct++) {{
        let c_base = ct * t;
        {call}
        let j0 = c_base + tx * 8u;
        let b = ld_bias8(j0);
        let n_ok = min(P.n_cls - min(j0, P.n_cls), 8u);
        let gj0 = P.cls0 + j0;
",
        call = tile_call(main_loop)
    );
    for i in 0..8 {
        let _ = writeln!(
            w,
            "        let s{i} = put_row_nw(st{i}, {}, {}, {i}u, b, r_base, ty, gj0, n_ok);\n        \
             st{i} = s{i}.run;\n        mk |= s{i}.mk;",
            acc(main_loop, 2 * i),
            acc(main_loop, 2 * i + 1)
        );
    }
    w.push_str("    }\n");
    for i in 0..8 {
        let _ = writeln!(
            w,
            "    fwd_end_nw(st{i}, mk, {i}u, r_base, split, tx, ty, li);"
        );
    }
    w.push_str("}\n");

    // The two loop variants: per-row sums of the thread's classes over the split's tiles.
    w.push_str(
        "
// Per (tile row, tx): the thread's sum of its classes' logits (fwd_loop).
var<workgroup> lsum: array<f32, 8u * WG * WG>;
",
    );
    for (entry, own) in [("fwd_loop", true), ("fwd_loopwg", false)] {
        let _ = write!(
            w,
            "
@compute @workgroup_size(WG, WG, 1)
fn {entry}{sig} {{
{head}{acc_decl}"
        );
        for i in 0..8 {
            let _ = writeln!(w, "    var s{i} = 0.0;");
        }
        let _ = writeln!(
            w,
            "    for (var ct = ct0; ct < ct1; ct++) {{\n        let c_base = ct * t;\n        {}",
            tile_call(main_loop)
        );
        for i in 0..8 {
            let _ = writeln!(
                w,
                "        s{i} += dot({}, vec4<f32>(1.0)) + dot({}, vec4<f32>(1.0));",
                acc(main_loop, 2 * i),
                acc(main_loop, 2 * i + 1)
            );
        }
        w.push_str("    }\n");
        if !own {
            // The real pass's end: the sums as the runs' Σz, merged through the panels.
            for i in 0..8 {
                let _ = writeln!(
                    w,
                    "    fwd_end_nw(Run(NEG_BIG, 0.0, 0.0, s{i}, 0.0, NO_INDEX), 0u, {i}u, \
                     r_base, split, tx, ty, li);"
                );
            }
            w.push_str("}\n");
            continue;
        }
        for i in 0..8 {
            let _ = writeln!(w, "    lsum[(ty * 8u + {i}u) * WG + tx] = s{i};");
        }
        w.push_str(
            "    workgroupBarrier();
    for (var rl = li; rl < t; rl += WG * WG) {
        var sz = 0.0;
        for (var k = 0u; k < WG; k++) {
            sz += lsum[rl * WG + k];
        }
        let r = r_base + rl;
        if r < P.n_rows && P.aux != 0.0 {
            part[r * P.part_stride + P.part_base + split] =
                Part(NEG_BIG, 0.0, 0.0, sz, NEG_BIG, NO_INDEX, 0.0, 0u);
        }
    }
}
",
        );
    }
    w
}

/// The backend's forward module for `main_loop` with the entry point `fwd_pad`: the real
/// pass (`fwd_named` or `fwd_partial`, the bodies of `main`) with `kib` KiB of workgroup
/// memory added. Thread `li` writes slot `li` of the array before the pass and, only when
/// `P.aux < -1` (never in the bench), stores slot `(li + 1) % WG²` into `tlogit[0]` after it:
/// the array is live across the pass, so the driver allocates it, and the pass computes
/// exactly what `main` does. Bounds: slots below `WG² <= 64·kib` ([`FwdVariant::parse`]
/// checks it).
pub fn pad_source(main_loop: MainLoop, form: NamedForm, kib: u32) -> String {
    let mut w = ShaderKind::FwdPartial
        .source_form(main_loop, form)
        .into_owned();
    let pass = match main_loop {
        MainLoop::Named => "fwd_named",
        _ => "fwd_partial",
    };
    let _ = write!(
        w,
        "
// --- cce-bench-sgemm: fwd-real with {kib} KiB of workgroup memory added (fwd.rs, `:padN`).
var<workgroup> wg_pad: array<vec4<f32>, {n}u>;

@compute @workgroup_size(WG, WG, 1)
fn fwd_pad(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>,
           @builtin(local_invocation_index) li: u32) {{
    wg_pad[li] = vec4<f32>(P.aux);
    {pass}(wid, lid, li);
    if P.aux < -1.0 {{
        tlogit[0] = wg_pad[(li + 1u) % (WG * WG)].x;
    }}
}}
",
        n = 64 * kib
    );
    w
}

/// Override constants of the forward pipeline for `dtype` at `shape`'s `wg:tk`.
pub fn constants(dtype: Dtype, shape: TileShape) -> Vec<(&'static str, f64)> {
    ShaderKind::FwdPartial.constants(dtype.cce_code(), shape.wg, shape.tk)
}

/// The forward's bindings of one chunk and its inputs' values on the host.
pub struct Chunk {
    /// Rows, classes, depth.
    pub shape: (u32, u32, u32),
    /// e's values as the GPU sees them (`[n_rows, d]`).
    pub e: Vec<f32>,
    /// c's values (`[n_cls, d]`).
    pub c: Vec<f32>,
    /// Target class per row (-1: ignored).
    pub tgt: Vec<i32>,
    bufs: [wgpu::Buffer; 4],
    dtype: Dtype,
}

impl Chunk {
    /// The input dtype.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// The e, c, bias (a stand-in) and target buffers, as bindings 1-4 of the forward.
    pub fn buffers(&self) -> &[wgpu::Buffer; 4] {
        &self.bufs
    }

    /// Fresh inputs of `n_rows x n_cls x d` in `dtype` (e uniform in [-1, 1), c in
    /// [-1/8, 1/8), targets uniform over the chunk's classes with every 7th row ignored) and
    /// their buffers (bias: a 256-byte stand-in, as the backend binds without bias).
    /// Errors: `d` not a multiple of 4, or a device error.
    pub fn new(
        g: &gpu::Gpu,
        (n_rows, n_cls, d): (u32, u32, u32),
        dtype: Dtype,
        seed: u64,
    ) -> Result<Self, String> {
        if !d.is_multiple_of(4) || n_rows == 0 || n_cls == 0 {
            return Err(format!(
                "{n_rows}x{n_cls}x{d}: the forward variants take d a multiple of 4"
            ));
        }
        let (n, v, k) = (n_rows as usize, n_cls as usize, d as usize);
        let e = host::operand(&host::uniform(n * k, 2 * seed + 1), dtype);
        let mut cv = host::uniform(v * k, 2 * seed + 2);
        cv.iter_mut().for_each(|x| *x /= 8.0);
        let c = host::operand(&cv, dtype);
        drop(cv);
        let tgt: Vec<i32> = host::uniform(n, 2 * seed + 3)
            .iter()
            .enumerate()
            .map(|(r, &u)| {
                if r % 7 == 3 {
                    -1
                } else {
                    (((u + 1.0) * 0.5 * v as f32) as i32).clamp(0, n_cls as i32 - 1)
                }
            })
            .collect();
        let bufs = [
            g.upload("e", &e.bytes)?,
            g.upload("c", &c.bytes)?,
            g.upload("bias", &[0u8; 256])?,
            g.upload("targets", bytemuck::cast_slice(&tgt))?,
        ];
        Ok(Self {
            shape: (n_rows, n_cls, d),
            e: e.values,
            c: c.values,
            tgt,
            bufs,
            dtype,
        })
    }
}

/// A built variant.
pub struct FwdBuilt {
    /// The variant.
    pub variant: FwdVariant,
    pipeline: wgpu::ComputePipeline,
}

/// A launch of a variant on a chunk with its outputs.
pub struct FwdLaunch {
    /// Timed with `P.aux` 0 (no partials written by the ablations).
    pub timed: gpu::Launch,
    /// The same with `P.aux` 1, for the check.
    pub checked: gpu::Launch,
    part: wgpu::Buffer,
    tlogit: wgpu::Buffer,
    /// Splits (partial columns) and tiles per split.
    pub splits: (u32, u32),
}

impl FwdBuilt {
    /// Build `v`'s pipeline (trusted, as cce-wgpu builds its modules). Errors: validation.
    pub fn new(g: &gpu::Gpu, v: FwdVariant) -> Result<Self, String> {
        // The module is cce-wgpu's forward source, whose trusted use its `bounds` module
        // argues (accesses guarded by `P.n_rows`, `P.n_cls`, `P.d`; bindings of at least
        // the chunk's rows · d elements rounded up to 16 bytes; `part` at least
        // n_rows · part_stride Parts with split < part_stride), plus entry points with the same
        // guards (`lsum` indexed by (ty·8 + i)·WG + tx < 8·WG·WG and rl·WG + k with
        // rl < TILE, k < WG; the end reduction's scratch as the real pass's), launched by
        // `FwdBuilt::launch` on buffers of those sizes.
        // `fwd-real` runs the backend's module text unchanged (no appended entry points).
        // `:padN` adds an entry point whose only extra access is `pad_source`'s array.
        let form = v.shape.named_form(v.main_loop);
        let src = match v.kind {
            FwdKind::Real if v.pad_kib > 0 => pad_source(v.main_loop, form, v.pad_kib),
            FwdKind::Real => ShaderKind::FwdPartial
                .source_form(v.main_loop, form)
                .into_owned(),
            _ => source(v.main_loop, form),
        };
        let constants = constants(v.dtype, v.shape);
        let pipeline = g.pipeline(&v.name(), src, v.entry(), &constants, false)?;
        Ok(Self {
            variant: v,
            pipeline,
        })
    }

    /// Bind `chunk` for this variant with the backend's split for `target_workgroups`.
    /// Errors: a chunk of another dtype, or a device error.
    pub fn launch(
        &self,
        g: &gpu::Gpu,
        chunk: &Chunk,
        target_workgroups: u32,
    ) -> Result<FwdLaunch, String> {
        let v = self.variant;
        if chunk.dtype != v.dtype {
            return Err(format!("{}: chunk of another dtype", v.name()));
        }
        let (n, nc, d) = chunk.shape;
        let tile = v.shape.tile();
        let per = split_tiles(n, nc, target_workgroups, v.one_tile, tile);
        let nsplit = nc.div_ceil(tile).div_ceil(per);
        let part = g.storage(
            "partials",
            u64::from(n) * u64::from(nsplit) * PART_WORDS as u64 * 4,
        )?;
        let tlogit = g.storage("target logits", 4 * u64::from(n))?;
        let params = |aux: f32| -> Vec<u32> {
            // cce-wgpu's `Params` (28 words, common.wgsl's order).
            let mut p = vec![0u32; 28];
            p[0] = n; // n_rows
            p[1] = nc; // n_cls
            p[2] = d; // d
            p[3] = nc; // v_total
            p[9] = FLAG_VEC; // flags
            p[10] = per; // split_tiles
            p[12] = nsplit; // part_stride
            p[24] = aux.to_bits(); // aux
            p
        };
        let flop = 2.0 * f64::from(n) * f64::from(nc) * f64::from(d);
        let groups = (nsplit, n.div_ceil(tile));
        let mk = |aux: f32| -> Result<gpu::Launch, String> {
            let ubuf = g.uniform(bytemuck::cast_slice(&params(aux)))?;
            let [e, c, b, t] = &chunk.bufs;
            let all = [
                (0, &ubuf),
                (1, e),
                (2, c),
                (3, b),
                (4, t),
                (5, &part),
                (6, &tlogit),
            ];
            // An automatic layout holds only the bindings the entry point uses.
            let used: Vec<(u32, &wgpu::Buffer)> = all
                .into_iter()
                .filter(|(i, _)| v.bindings().contains(i))
                .collect();
            g.launch_with(&self.pipeline, &used, groups, flop)
        };
        let (timed, checked) = (mk(0.0), mk(1.0));
        Ok(FwdLaunch {
            timed: timed?,
            checked: checked?,
            part,
            tlogit,
            splits: (nsplit, per),
        })
    }
}

/// The partials and target logits of one checked dispatch.
pub struct FwdOut {
    /// `[n_rows, splits]` Parts as 8 words each.
    pub part: Vec<u32>,
    /// `[n_rows]` target logits (written only where the target lies in the chunk).
    pub tlogit: Vec<f32>,
}

impl FwdLaunch {
    /// Dispatch the checked launch once and read its outputs.
    pub fn run(&self, g: &gpu::Gpu, n_rows: u32) -> Result<FwdOut, String> {
        let back = g.run_read(
            &self.checked,
            &[
                (&self.part, self.part.size()),
                (&self.tlogit, 4 * u64::from(n_rows)),
            ],
        )?;
        Ok(FwdOut {
            part: bytemuck::pod_collect_to_vec(&back[0]),
            tlogit: bytemuck::pod_collect_to_vec(&back[1]),
        })
    }
}

/// Worst error over `rows` of `out` against the f64 reference, as a multiple of its
/// tolerance (<= 1 passes), with a description of the worst entry. Checked per (row, split):
/// `sz` (Σ z) always; for [`FwdVariant::full_parts`] also the max `m`, the lse `m + ln s`,
/// the argmax value and class, and (`fwd-real`) the target logit.
pub fn check(
    v: FwdVariant,
    chunk: &Chunk,
    (nsplit, per): (u32, u32),
    out: &FwdOut,
    rows: &[usize],
) -> (f64, String) {
    let (n, nc, d) = chunk.shape;
    let (_, nc, k) = (n as usize, nc as usize, d as usize);
    let tol = host::tolerance(k);
    let mut worst = (0.0f64, String::from("no entry checked"));
    let mut note = |ratio: f64, what: String| {
        if ratio > worst.0 || !ratio.is_finite() {
            worst = (
                if ratio.is_finite() {
                    ratio
                } else {
                    f64::INFINITY
                },
                what,
            );
        }
    };
    for &r in rows {
        let a = &chunk.e[r * k..(r + 1) * k];
        let z: Vec<(f64, f64)> = (0..nc)
            .map(|j| {
                let b = &chunk.c[j * k..(j + 1) * k];
                let (mut s, mut abs) = (0.0f64, 0.0f64);
                for t in 0..k {
                    let p = f64::from(a[t]) * f64::from(b[t]);
                    s += p;
                    abs += p.abs();
                }
                (s, tol * abs + 1e-30)
            })
            .collect();
        for s in 0..nsplit as usize {
            let lo = s * per as usize * v.shape.tile() as usize;
            let hi = ((s + 1) * per as usize * v.shape.tile() as usize).min(nc);
            let zs = &z[lo..hi];
            let p = &out.part[(r * nsplit as usize + s) * PART_WORDS..][..PART_WORDS];
            let f = |i: usize| f64::from(f32::from_bits(p[i]));
            let sz: f64 = zs.iter().map(|x| x.0).sum();
            let sz_tol: f64 = zs.iter().map(|x| x.1 + 1e-6 * x.0.abs()).sum::<f64>() + 1e-6;
            note(
                (f(3) - sz).abs() / sz_tol,
                format!("row {r} split {s} sz {} vs {sz}", f(3)),
            );
            if !v.full_parts() {
                continue;
            }
            let zerr = zs.iter().map(|x| x.1).fold(0.0, f64::max);
            let (jm, m) = zs
                .iter()
                .enumerate()
                .fold(
                    (0, f64::NEG_INFINITY),
                    |b, (j, x)| if x.0 > b.1 { (j, x.0) } else { b },
                );
            let lse = m + zs.iter().map(|x| (x.0 - m).exp()).sum::<f64>().ln();
            let got_lse = f(0) + f(1).ln();
            note(
                (f(0) - m).abs() / zerr,
                format!("row {r} split {s} m {} vs {m}", f(0)),
            );
            note(
                (got_lse - lse).abs() / (zerr + 2e-6 * (1.0 + lse.abs())),
                format!("row {r} split {s} lse {got_lse} vs {lse}"),
            );
            note(
                (f(4) - m).abs() / zerr,
                format!("row {r} split {s} argmax value {} vs {m}", f(4)),
            );
            let ai = p[5] as usize;
            let ai_ok = ai >= lo && ai < hi && z[ai].0 >= m - 2.0 * zerr;
            note(
                if ai_ok { 0.0 } else { f64::INFINITY },
                format!(
                    "row {r} split {s} argmax class {ai}, want {} (lo {lo})",
                    lo + jm
                ),
            );
        }
        if v.kind == FwdKind::Real {
            if let Ok(y) = usize::try_from(chunk.tgt[r]) {
                let (zy, ty) = z[y];
                let got = f64::from(out.tlogit[r]);
                note(
                    (got - zy).abs() / ty,
                    format!("row {r} target logit {got} vs {zy}"),
                );
            }
        }
    }
    worst
}

#[cfg(test)]
mod tests;
