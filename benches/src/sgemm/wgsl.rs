//! WGSL of the SGEMM variants, generated as text (pure functions, no device).
//!
//! [`tiled`]: the textbook kernel ([`Tiled`]). Parameters: uniform `dims` (m, n, k), `a_buf`
//! `[m, k]` and `b_buf` `[n, k]` as `vec4<f32>` (f32) or `vec4<u32>` (bf16 pairs), `c_buf`
//! `[m, n]` as `vec4<f32>`. Tiling: workgroup (x, y) computes rows `y·T ..` and columns
//! `x·T ..` of `C`; depth panels of `BK` through `As` / `Bs` (`[buf][k][T]` floats as vec4,
//! double buffered: the next panel is loaded into registers while the current one is
//! multiplied, one barrier per panel). Thread mapping: thread (tx, ty) of the `S x S`
//! workgroup (`S = T / R`) owns rows `4·(ty + j·S) + c` and columns `4·(tx + h·S) + c` for
//! `j, h < R/4`, `c < 4` (each depth step reads `R/4` vec4 of each panel: across a warp, the
//! `tx` reads are consecutive and the `ty` reads broadcast); accumulator `i·R/4 + h` holds
//! row `i` of the thread's rows, column vec4 `h`. Loads: 16-byte unit `u = li + s·S²` of a
//! panel is row `u / (BK/E)`, depths `(u % (BK/E))·E ..` (E elements per unit), stored
//! transposed one float at a time. Bounds: none checked in the shader; the host launches only
//! whole tiles and panels ([`Tiled::problem_error`]).
//!
//! [`ours`]: cce-wgpu's forward shader source for a main loop (`ShaderKind::source_with`),
//! with an extra entry point `sgemm_ours` that computes the logits tile through the same
//! function the forward calls (`logits_tile`, or `logits_named`) and stores it to binding 9.

use super::{AccStyle, Dtype, Tiled};
use cut_cross_entropy::cce_wgpu::{MainLoop, ShaderKind};
use std::fmt::Write;

/// Entry point of every generated module (`main` for the tiled kernel).
pub fn entry_point(ours: bool) -> &'static str {
    if ours {
        "sgemm_ours"
    } else {
        "main"
    }
}

const COMP: [&str; 4] = ["x", "y", "z", "w"];

/// Accumulator `n` as the module names it.
fn acc(style: AccStyle, n: u32) -> String {
    match style {
        AccStyle::Array => format!("acc[{n}]"),
        AccStyle::Named => format!("c{n}"),
    }
}

/// The WGSL of the textbook kernel (module docs) for `dtype`.
pub fn tiled(t: &Tiled, dtype: Dtype) -> String {
    let (tile, r, bk) = (t.tile, t.micro, t.bk);
    let e = dtype.per_vec4();
    let s = t.side();
    let threads = t.threads();
    let units = t.units(dtype);
    let nl = t.loads_per_thread(dtype);
    let guarded = units < threads;
    let rv = r / 4;
    let nacc = r * rv;
    let src = match dtype {
        Dtype::F32 => "f32",
        Dtype::Bf16 => "u32",
    };
    let mut w = String::new();
    let _ = write!(
        w,
        "// Textbook SGEMM C = A·B^T: {tile} x {tile} tile, {r} x {r} per thread, BK {bk}, \
         {dtype} inputs, {acc:?} accumulators{unroll}.
struct Dims {{ m: u32, n: u32, k: u32, pad: u32 }}
@group(0) @binding(0) var<uniform> dims: Dims;
@group(0) @binding(1) var<storage, read> a_buf: array<vec4<{src}>>;
@group(0) @binding(2) var<storage, read> b_buf: array<vec4<{src}>>;
@group(0) @binding(3) var<storage, read_write> c_buf: array<vec4<f32>>;

const T4: u32 = {t4}u;
const BK: u32 = {bk}u;
const S: u32 = {s}u;
var<workgroup> As: array<vec4<f32>, {panel}>;
var<workgroup> Bs: array<vec4<f32>, {panel}>;

@compute @workgroup_size({s}, {s}, 1)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {{
    let tx = lid.x;
    let ty = lid.y;
    let row0 = wid.y * {tile}u;
    let col0 = wid.x * {tile}u;
    let kq = dims.k / {e}u;
",
        dtype = dtype.name(),
        acc = t.acc,
        unroll = if t.unroll_k {
            ", depth loop written out"
        } else {
            ""
        },
        t4 = tile / 4,
        panel = 2 * bk * tile / 4,
    );
    for l in 0..nl {
        let _ = write!(
            w,
            "    let u{l} = li + {off}u;
    let lm{l} = u{l} / {upr}u;
    let lk{l} = (u{l} % {upr}u) * {e}u;
    let ga{l} = (row0 + lm{l}) * kq + lk{l} / {e}u;
    let gb{l} = (col0 + lm{l}) * kq + lk{l} / {e}u;
    var pa{l}: vec4<{src}>;
    var pb{l}: vec4<{src}>;
",
            off = l * threads,
            upr = bk / e,
        );
    }
    match t.acc {
        AccStyle::Array => {
            let _ = writeln!(w, "    var acc: array<vec4<f32>, {nacc}>;");
        }
        AccStyle::Named => {
            for n in 0..nacc {
                let _ = writeln!(w, "    var c{n} = vec4<f32>(0.0);");
            }
        }
    }
    let load = |w: &mut String, k0: &str, ind: &str| {
        for l in 0..nl {
            let body =
                format!("pa{l} = a_buf[ga{l} + {k0} / {e}u]; pb{l} = b_buf[gb{l} + {k0} / {e}u];");
            if guarded {
                let _ = writeln!(w, "{ind}if u{l} < {units}u {{ {body} }}");
            } else {
                let _ = writeln!(w, "{ind}{body}");
            }
        }
    };
    let store = |w: &mut String, buf: &str, ind: &str| {
        for l in 0..nl {
            let mut body = String::new();
            for x in 0..e {
                let (a, b) = match dtype {
                    Dtype::F32 => (
                        format!("pa{l}.{}", COMP[x as usize]),
                        format!("pb{l}.{}", COMP[x as usize]),
                    ),
                    Dtype::Bf16 => {
                        let c = COMP[(x / 2) as usize];
                        if x % 2 == 0 {
                            (
                                format!("bitcast<f32>(pa{l}.{c} << 16u)"),
                                format!("bitcast<f32>(pb{l}.{c} << 16u)"),
                            )
                        } else {
                            (
                                format!("bitcast<f32>(pa{l}.{c} & 0xffff0000u)"),
                                format!("bitcast<f32>(pb{l}.{c} & 0xffff0000u)"),
                            )
                        }
                    }
                };
                let _ = write!(
                    body,
                    "{ind}    As[(({buf}) * BK + lk{l} + {x}u) * T4 + (lm{l} >> 2u)][lm{l} & 3u] = {a};\n\
                     {ind}    Bs[(({buf}) * BK + lk{l} + {x}u) * T4 + (lm{l} >> 2u)][lm{l} & 3u] = {b};\n"
                );
            }
            if guarded {
                let _ = write!(w, "{ind}if u{l} < {units}u {{\n{body}{ind}}}\n");
            } else {
                let _ = write!(w, "{ind}{{\n{body}{ind}}}\n");
            }
        }
    };
    let step = |w: &mut String, k: &str, ind: &str| {
        let _ = writeln!(w, "{ind}let o = base + ({k}) * T4;");
        for j in 0..rv {
            let _ = writeln!(w, "{ind}let x{j} = As[o + ty + {}u];", j * s);
        }
        for h in 0..rv {
            let _ = writeln!(w, "{ind}let y{h} = Bs[o + tx + {}u];", h * s);
        }
        for i in 0..r {
            for h in 0..rv {
                let n = acc(t.acc, i * rv + h);
                let _ = writeln!(
                    w,
                    "{ind}{n} = fma(vec4<f32>(x{}.{}), y{h}, {n});",
                    i / 4,
                    COMP[(i % 4) as usize]
                );
            }
        }
    };
    load(&mut w, "0u", "    ");
    store(&mut w, "0u", "    ");
    w.push_str(
        "    workgroupBarrier();
    var buf = 0u;
    for (var k0 = 0u; k0 < dims.k; k0 += BK) {
        let more = k0 + BK < dims.k;
        if more {
",
    );
    load(&mut w, "(k0 + BK)", "            ");
    w.push_str("        }\n        let base = buf * BK * T4;\n");
    if t.unroll_k {
        for k in 0..bk {
            w.push_str("        {\n");
            step(&mut w, &format!("{k}u"), "            ");
            w.push_str("        }\n");
        }
    } else {
        w.push_str("        for (var k = 0u; k < BK; k++) {\n");
        step(&mut w, "k", "            ");
        w.push_str("        }\n");
    }
    w.push_str("        if more {\n");
    store(&mut w, "buf ^ 1u", "            ");
    w.push_str("        }\n        workgroupBarrier();\n        buf ^= 1u;\n    }\n");
    // Epilogue: row i of the thread's rows, column vec4 h.
    w.push_str("    let n4 = dims.n / 4u;\n");
    for i in 0..r {
        let _ = writeln!(
            w,
            "    let r{i} = (row0 + 4u * (ty + {}u) + {}u) * n4 + col0 / 4u + tx;",
            (i / 4) * s,
            i % 4
        );
        for h in 0..rv {
            let _ = writeln!(
                w,
                "    c_buf[r{i} + {}u] = {};",
                h * s,
                acc(t.acc, i * rv + h)
            );
        }
    }
    w.push_str("}\n");
    w
}

/// Binding of `sgemm_ours`'s output (above the forward shader's own 0..=6).
pub const OURS_OUT_BINDING: u32 = 9;

/// cce-wgpu's forward shader source for `main_loop` with the entry point `sgemm_ours`
/// (module docs): the tile of rows `wid.y·64 ..` and classes `wid.x·64 ..` computed by the
/// forward's own tile function, stored row by row to `sgemm_out` (rows past `P.n_rows` and
/// classes past `P.n_cls` skipped; `n_cls` a multiple of 4). Overrides `DTYPE`, `WG`, `TK`.
pub fn ours(main_loop: MainLoop) -> String {
    let mut w = ShaderKind::FwdPartial.source_with(main_loop).into_owned();
    let _ = write!(
        w,
        "
// --- cce-bench-sgemm: the logits tile stored as it is (no softmax epilogue).
@group(0) @binding({OURS_OUT_BINDING}) var<storage, read_write> sgemm_out: array<vec4<f32>>;

fn sgemm_put(r: u32, c: u32, lo: vec4<f32>, hi: vec4<f32>) {{
    if r < P.n_rows {{
        let o = (r * P.n_cls + c) / 4u;
        if c < P.n_cls {{ sgemm_out[o] = lo; }}
        if c + 4u < P.n_cls {{ sgemm_out[o + 1u] = hi; }}
    }}
}}

@compute @workgroup_size(WG, WG, 1)
fn sgemm_ours(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>,
              @builtin(local_invocation_index) li: u32) {{
    let r_base = wid.y * tile();
    let c_base = wid.x * tile();
    let r = r_base + lid.y * MT;
    let c = c_base + lid.x * MT;
"
    );
    if main_loop == MainLoop::Named {
        w.push_str("    let t = logits_named(r_base, c_base, lid.x, lid.y, li);\n");
        for i in 0..8 {
            let _ = writeln!(
                w,
                "    sgemm_put(r + {i}u, c, t.a{}, t.a{});",
                2 * i,
                2 * i + 1
            );
        }
    } else {
        w.push_str("    var acc: Acc;\n    logits_tile(&acc, r_base, c_base, lid.x, lid.y, li);\n");
        for i in 0..8 {
            let _ = writeln!(
                w,
                "    sgemm_put(r + {i}u, c, acc[{}], acc[{}]);",
                2 * i,
                2 * i + 1
            );
        }
    }
    w.push_str("}\n");
    w
}

/// Override constants of the `ours` module for `main_loop` and `dtype` (`DTYPE`, `WG`, `TK`).
pub fn ours_constants(main_loop: MainLoop, dtype: Dtype) -> Vec<(&'static str, f64)> {
    let (wg, tk) = super::ours_wg_tk(main_loop);
    ShaderKind::FwdPartial.constants(dtype.cce_code(), wg, tk)
}

#[cfg(test)]
mod tests {
    use super::*;
    use naga::valid::{Capabilities, ValidationFlags, Validator};

    fn validates(src: &str) {
        let module = naga::front::wgsl::parse_str(src)
            .unwrap_or_else(|e| panic!("parse error\n{}\n{src}", e.emit_to_string(src)));
        Validator::new(ValidationFlags::all(), Capabilities::all())
            .validate(&module)
            .unwrap_or_else(|e| panic!("validation error\n{}", e.emit_to_string(src)));
    }

    #[test]
    fn every_kernel_parses_and_validates() {
        for name in [
            "t128r8k8",
            "t128r8k8n",
            "t128r8k16u",
            "t64r4k16",
            "t64r4k8",
            "t128r8k8:bf16",
            "t128r8k16nu:bf16",
            "t64r4k8:bf16",
        ] {
            let v = super::super::Variant::parse(name).unwrap();
            let super::super::Kernel::Tiled(t) = v.kernel else {
                unreachable!()
            };
            validates(&tiled(&t, v.dtype));
        }
        for ml in [MainLoop::Scalar, MainLoop::Named, MainLoop::Quad] {
            validates(&ours(ml));
        }
    }

    #[test]
    fn named_accumulators_leave_no_array() {
        let t = Tiled {
            tile: 128,
            micro: 8,
            bk: 8,
            acc: AccStyle::Named,
            unroll_k: true,
        };
        let src = tiled(&t, Dtype::F32);
        assert!(!src.contains("acc["));
        assert_eq!(src.matches("fma(").count(), 16 * 8);
        assert!(src.contains("c15 = fma(vec4<f32>(x1.w), y1, c15);"));
    }
}
