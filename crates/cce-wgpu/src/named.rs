//! The WGSL of the `named` main loop ([`MainLoop::Named`](crate::MainLoop::Named)), generated
//! as text: the thread's 8 x 8 micro-tile in sixteen named `vec4<f32>` locals `a0 .. a15`
//! instead of an `array<vec4<f32>, 16>` behind a pointer, so that no accumulator is ever
//! indexed by a loop variable or reached through a pointer (a driver that keeps an indexed
//! function-local array in local memory cannot do so here).
//!
//! What it emits (pure functions of the shader files, unit-tested below):
//! - `struct Tile` (the sixteen accumulators by name) and `fn logits_named(r_base, c_base,
//!   tx, ty, li) -> Tile`: the logits tile of logits_scalar.wgsl (the same workgroup panels
//!   As/Bs, the same `fetch_rows` / `put_rows_a` / `put_rows_b` staging, one barrier per
//!   panel), whose depth step is the 8 x 8 outer product written out: `aN = fma(vec4<f32>(
//!   xH.c), yh, aN)` for `N = 2i + h`, row `i` taking component `c = "xyzw"[i % 4]` of
//!   `xH`, `H = i / 4`;
//! - `fn prod_named(..) -> Tile` (with `put_gp_named`, `prod_begin_named`): grad.wgsl's
//!   `prod_slice` (the backward's second product, the thread's G block kept in registers as
//!   a `Tile` by value and staged into the A panels a TK-deep panel at a time, times a D
//!   slice of e or c) likewise;
//! - `fn fwd_named(wid, lid, li)`: fwd_partial.wgsl's pass (put_row per micro-tile row by
//!   value into the row's running state, fwd_end per row at the end of the split) on that
//!   tile, and the entry point `main`;
//! - [`entry_named`]: the backward entry points (bwd_hist_main.wgsl, bwd_de_main.wgsl,
//!   bwd_dc_main.wgsl) rewritten line by line so that every per-row call takes the row by
//!   value from a named accumulator (the control flow stays that of the `Acc` files).
//!
//! Two forms ([`NamedForm`], picked per tile shape by [`NamedForm::for_shape`]): the text above
//! ([`NamedForm::Loop`], every shape, `8:8` included) and the wide form
//! ([`NamedForm::Wide`], 128 x 128 tiles of 16 x 16 threads): [`logits_wide`] and
//! [`prod_wide`] replace `logits_named` and `prod_named` (same names and signatures, so the
//! passes and entry points above are the same text) with the reference SGEMM `t128r8k16nu`'s
//! structure: the panel's depth steps written out, interleaved panel slots read at
//! `As[ty]`, `As[WG + ty]`, `Bs[tx]`, `Bs[WG + tx]`, and panels_wide.wgsl's loop-free staging
//! from named prefetch words.
//!
//! Micro-tile layout as tile_io.wgsl: `aN` holds what `acc[N]` holds in the other main loops
//! (row `N / 2` of the thread's rows, classes `4·(N % 2) .. +3` of its eight). Bounds: the
//! panel indices are those of logits_scalar.wgsl's `mma_panel` (`(buf·TK + k)·2WG + 2ty + 1`
//! with `buf < 2`, `k < TK`, `ty < WG`: below `4·TK·WG`) and of grad.wgsl's `prod_slice`
//! and `put_gp` (the same indices with `tx` or `ty`, and `kk < TK` for the G panel's stores),
//! see the `bounds` module.

use crate::config::NamedForm;
use std::fmt::Write;

/// Accumulators of the micro-tile (8 rows x two vec4 of classes).
pub const N_ACC: usize = 16;

/// Name of accumulator `n` (< [`N_ACC`]): `a<n>`.
pub fn acc_name(n: usize) -> String {
    format!("a{n}")
}

/// The depth step's update of accumulator `n`: row `n / 2` of the micro-tile takes component
/// `"xyzw"[row % 4]` of the row operand `x0` (rows 0-3) or `x1` (rows 4-7); the class half
/// `n % 2` is `y0` or `y1`.
pub fn fma_line(n: usize) -> String {
    let row = n / 2;
    let comp = ["x", "y", "z", "w"][row % 4];
    format!(
        "a{n} = fma(vec4<f32>(x{}.{comp}), y{}, a{n});",
        row / 4,
        n % 2
    )
}

/// `struct Tile` and `fn logits_named` (module docs).
pub fn logits_named() -> String {
    let mut s = String::new();
    s.push_str(
        "// The thread's 8 x 8 micro-tile of one logits tile: aN = acc[N] of tile_io.wgsl.\n\
         struct Tile {\n",
    );
    for n in 0..N_ACC {
        let _ = writeln!(s, "    a{n}: vec4<f32>,");
    }
    s.push_str(
        "}\n\n\
         // Logits (without bias) of rows r_base.. x classes c_base.. of the chunk, in named\n\
         // accumulators. Starts by writing As/Bs (the caller's earlier reads of them are behind\n\
         // a barrier) and ends with a barrier.\n\
         fn logits_named(r_base: u32, c_base: u32, tx: u32, ty: u32, li: u32) -> Tile {\n",
    );
    s.push_str(&zeroed());
    s.push_str(
        "    var pa: Pref;
    var pb: Pref;
    fetch_rows(&pa, true, r_base, P.n_rows, 0u, li);
    fetch_rows(&pb, false, c_base, P.n_cls, 0u, li);
    put_rows_a(&pa, r_base, P.n_rows, 0u, li, 0u);
    put_rows_b(&pb, c_base, P.n_cls, 0u, li, 0u);
    workgroupBarrier();
    var buf = 0u;
    for (var k0 = 0u; k0 < P.d; k0 += TK) {
        let more = k0 + TK < P.d;
        if more {
            fetch_rows(&pa, true, r_base, P.n_rows, k0 + TK, li);
            fetch_rows(&pb, false, c_base, P.n_cls, k0 + TK, li);
        }
        for (var k = 0u; k < TK; k++) {
            let o = (buf * TK + k) * 2u * WG;
            let x0 = As[o + 2u * ty];
            let x1 = As[o + 2u * ty + 1u];
            let y0 = Bs[o + 2u * tx];
            let y1 = Bs[o + 2u * tx + 1u];
",
    );
    s.push_str(&fmas());
    s.push_str(
        "        }
        if more {
            put_rows_a(&pa, r_base, P.n_rows, k0 + TK, li, buf ^ 1u);
            put_rows_b(&pb, c_base, P.n_cls, k0 + TK, li, buf ^ 1u);
        }
        workgroupBarrier();
        buf ^= 1u;
    }
",
    );
    s.push_str(&returned());
    s
}

/// The sixteen accumulators declared and zeroed.
fn zeroed() -> String {
    (0..N_ACC)
        .map(|n| format!("    var a{n} = vec4<f32>(0.0);\n"))
        .collect()
}

/// The depth step's sixteen FMAs ([`fma_line`]), inside the depth loop.
fn fmas() -> String {
    (0..N_ACC)
        .map(|n| format!("            {}\n", fma_line(n)))
        .collect()
}

/// `return Tile(a0, .., a15);` and the function's closing brace.
fn returned() -> String {
    let names: Vec<String> = (0..N_ACC).map(acc_name).collect();
    format!("    return Tile({});\n}}\n", names.join(", "))
}

/// `fn put_gp_named`, `fn prod_begin_named` and `fn prod_named(gt, pb, is_e, j_base, n_src,
/// d0, tx, ty, li) -> Tile`: grad.wgsl's `put_gp8`, `prod_begin` and `prod_slice` (Σ_k G[k][m]
/// · X[j_base + k][d0 + n], the G panels staged from the threads' depth vectors `gt` into As,
/// the X panels by `fetch_cols` / `put_cols_b` into Bs, double buffered) with the G block a
/// `Tile` by value (`gt.a{2q}`, `gt.a{2q + 1}`: depth vector q) and the product in named
/// accumulators, with the same written-out depth step. Needs grad.wgsl before it.
pub fn prod_named() -> String {
    let mut s = String::from(
        "// grad.wgsl's put_gp8 on a G block by value.
fn put_gp_named(gt: Tile, own: u32, other: u32, k0: u32, buf: u32) {
    if own * 8u + 8u > k0 && own * 8u < k0 + TK {
",
    );
    for q in 0..N_ACC / 2 {
        let _ = writeln!(
            s,
            "        put_gp(gt.a{}, gt.a{}, {q}u, own, other, k0, buf);",
            2 * q,
            2 * q + 1
        );
    }
    s.push_str(
        "    }
}

// grad.wgsl's prod_begin on a G block by value.
fn prod_begin_named(gt: Tile, pb: ptr<function, Pref>, is_e: bool, j_base: u32, n_src: u32,
                    tx: u32, ty: u32, li: u32) {
    let o = g_own(is_e, tx, ty);
    fetch_cols(pb, is_e, j_base, n_src, 0u, li);
    put_gp_named(gt, o.x, o.y, 0u, 0u);
    put_cols_b(pb, is_e, j_base, n_src, 0u, li, 0u);
    workgroupBarrier();
}

// grad.wgsl's prod_slice in named accumulators (the d_e / d_c product of a D slice).
fn prod_named(gt: Tile, pb: ptr<function, Pref>, is_e: bool, j_base: u32, n_src: u32, d0: u32,
              tx: u32, ty: u32, li: u32) -> Tile {
    let t = tile();
    let t4 = 2u * WG;
    let o = g_own(is_e, tx, ty);
",
    );
    s.push_str(&zeroed());
    s.push_str(
        "    var buf = slice_buf(d0);
    for (var k0 = 0u; k0 < t; k0 += TK) {
        let more = k0 + TK < t;
        let next = more || d0 + t < P.d;
        let nk = select(0u, k0 + TK, more);
        let nd = select(d0 + t, d0, more);
        if next {
            fetch_cols(pb, is_e, j_base + nk, n_src, nd, li);
        }
        for (var k = 0u; k < TK; k++) {
            let ka = (buf * TK + k) * t4 + 2u * ty;
            let kb = (buf * TK + k) * t4 + 2u * tx;
            let x0 = As[ka];
            let x1 = As[ka + 1u];
            let y0 = Bs[kb];
            let y1 = Bs[kb + 1u];
",
    );
    s.push_str(&fmas());
    s.push_str(
        "        }
        if next {
            put_gp_named(gt, o.x, o.y, nk, buf ^ 1u);
            put_cols_b(pb, is_e, j_base + nk, n_src, nd, li, buf ^ 1u);
        }
        workgroupBarrier();
        buf ^= 1u;
    }
",
    );
    s.push_str(&returned());
    s
}

/// The depth steps of one panel written out (the wide form): `tk` blocks, step `k` reading
/// `As[at + k·W_T4]`, `As[at + k·W_T4 + WG]`, `Bs[bt + k·W_T4]`, `Bs[bt + k·W_T4 + WG]`
/// (panels_wide.wgsl's interleaved slots; `at` = the buffer's first slot + `ty`, `bt` the
/// same + `tx`) into `x0`, `x1`, `y0`, `y1`, then the sixteen FMAs ([`fma_line`]).
fn written_steps(tk: u32) -> String {
    let mut s = String::new();
    for k in 0..tk {
        let _ = writeln!(
            s,
            "        {{
            let x0 = As[at + {k}u * W_T4];
            let x1 = As[at + {k}u * W_T4 + WG];
            let y0 = Bs[bt + {k}u * W_T4];
            let y1 = Bs[bt + {k}u * W_T4 + WG];"
        );
        for n in 0..N_ACC {
            let _ = writeln!(s, "            {}", fma_line(n));
        }
        s.push_str("        }\n");
    }
    s
}

/// Slots (units or column groups per invocation and operand) of the wide form's panels at
/// `wg:tk`: `2·tk / wg` (the f32 row panels' units and the column panels' groups; f16/bf16
/// row panels have half as many units, `W_UNITS`).
fn wide_slots(wg: u32, tk: u32) -> u32 {
    2 * tk / wg
}

/// The condition under which slot `s` of a row panel holds a unit (`u = li + s·WG²` below
/// `W_UNITS`), or `None` when it does for every dtype (`(s + 1)·wg <= tk`: the f16/bf16
/// panels' `wg·tk` units per `wg²` invocations). Its first term is an override expression,
/// constant in the pipeline.
fn unit_guard(wg: u32, tk: u32, s: u32) -> Option<String> {
    ((s + 1) * wg > tk)
        .then(|| format!("{s}u * WG * WG < W_UNITS && li + {s}u * WG * WG < W_UNITS"))
}

/// `fn logits_named` in the wide form ([`NamedForm::Wide`](crate::NamedForm::Wide), text for
/// `wg:tk`): the same signature and result as [`logits_named`], the panels staged by
/// panels_wide.wgsl's `fetch_unit` / `put_unit` from named prefetch words `pa<s>` / `pb<s>`
/// (one `vec4<u32>` per slot and operand, slot `s` = unit `li + s·WG²`), the depth steps
/// written out ([`written_steps`]), double buffered with one barrier per panel.
pub fn logits_wide(wg: u32, tk: u32) -> String {
    let ns = wide_slots(wg, tk);
    let per_slot = |body: &dyn Fn(u32) -> String, ind: &str| -> String {
        let mut out = String::new();
        for sl in 0..ns {
            let b = body(sl);
            match unit_guard(wg, tk, sl) {
                Some(g) => {
                    let _ = writeln!(out, "{ind}if {g} {{");
                    for l in b.lines() {
                        let _ = writeln!(out, "{ind}    {l}");
                    }
                    let _ = writeln!(out, "{ind}}}");
                }
                None => {
                    for l in b.lines() {
                        let _ = writeln!(out, "{ind}{l}");
                    }
                }
            }
        }
        out
    };
    let fetch = |k0: &'static str| {
        move |sl: u32| {
            format!(
                "pa{sl} = fetch_unit(true, r_base, P.n_rows, {k0}, li + {sl}u * WG * WG);\n\
                 pb{sl} = fetch_unit(false, c_base, P.n_cls, {k0}, li + {sl}u * WG * WG);"
            )
        }
    };
    let put = |buf: &'static str| {
        move |sl: u32| {
            format!(
                "put_unit(true, pa{sl}, li + {sl}u * WG * WG, {buf});\n\
                 put_unit(false, pb{sl}, li + {sl}u * WG * WG, {buf});"
            )
        }
    };
    let mut s = String::new();
    let _ = writeln!(
        s,
        "// The thread's 8 x 8 micro-tile of one logits tile: aN = acc[N] of tile_io.wgsl.
struct Tile {{"
    );
    for n in 0..N_ACC {
        let _ = writeln!(s, "    a{n}: vec4<f32>,");
    }
    let _ = writeln!(
        s,
        "}}

// Logits (without bias) of rows r_base.. x classes c_base.. of the chunk, in named
// accumulators; the wide form (panels_wide.wgsl), written for WG = {wg}, TK = {tk}: {ns}
// unit slot(s) per operand, {tk} depth steps per panel written out. Starts by writing As/Bs
// (the caller's earlier reads of them are behind a barrier) and ends with a barrier.
fn logits_named(r_base: u32, c_base: u32, tx: u32, ty: u32, li: u32) -> Tile {{"
    );
    s.push_str(&zeroed());
    for sl in 0..ns {
        let _ = writeln!(
            s,
            "    var pa{sl} = vec4<u32>(0u);\n    var pb{sl} = vec4<u32>(0u);"
        );
    }
    s.push_str(&per_slot(&fetch("0u"), "    "));
    s.push_str(&per_slot(&put("0u"), "    "));
    s.push_str(
        "    workgroupBarrier();
    var buf = 0u;
    for (var k0 = 0u; k0 < P.d; k0 += TK) {
        let more = k0 + TK < P.d;
        if more {
",
    );
    s.push_str(&per_slot(&fetch("k0 + TK"), "            "));
    s.push_str(
        "        }
        let at = buf * TK * W_T4 + ty;
        let bt = buf * TK * W_T4 + tx;
",
    );
    s.push_str(&written_steps(tk));
    s.push_str("        if more {\n");
    s.push_str(&per_slot(&put("buf ^ 1u"), "            "));
    s.push_str(
        "        }
        workgroupBarrier();
        buf ^= 1u;
    }
",
    );
    s.push_str(&returned());
    s
}

/// [`prod_named`]'s three functions (`put_gp_named`, `prod_begin_named`, `prod_named`, same
/// signatures; the `pb` argument unused) in the wide form, text for `wg:tk`: the G panels
/// through panels_wide.wgsl's `put_gp_w` (interleaved slots), the X panels in column groups
/// (`fetch_colg` / `put_colg`) from named prefetch words `px<s>` (group `li + s·WG²`, `2·tk /
/// wg` of them, every one a group of the panel), the depth steps written out.
pub fn prod_wide(wg: u32, tk: u32) -> String {
    let ns = wide_slots(wg, tk);
    let mut s = String::from(
        "// grad.wgsl's put_gp8 on a G block by value, in the wide form's slots.
fn put_gp_named(gt: Tile, own: u32, other: u32, k0: u32, buf: u32) {
    if own * 8u + 8u > k0 && own * 8u < k0 + TK {
",
    );
    for q in 0..N_ACC / 2 {
        let _ = writeln!(
            s,
            "        put_gp_w(gt.a{}, gt.a{}, {q}u, own, other, k0, buf);",
            2 * q,
            2 * q + 1
        );
    }
    s.push_str(
        "    }
}

// grad.wgsl's prod_begin on a G block by value, in the wide form (`pb` unused).
fn prod_begin_named(gt: Tile, pb: ptr<function, Pref>, is_e: bool, j_base: u32, n_src: u32,
                    tx: u32, ty: u32, li: u32) {
    let o = g_own(is_e, tx, ty);
",
    );
    for sl in 0..ns {
        let _ = writeln!(
            s,
            "    let px{sl} = fetch_colg(is_e, j_base, n_src, 0u, li + {sl}u * WG * WG);"
        );
    }
    s.push_str("    put_gp_named(gt, o.x, o.y, 0u, 0u);\n");
    for sl in 0..ns {
        let _ = writeln!(
            s,
            "    put_colg(px{sl}, is_e, j_base, n_src, 0u, li + {sl}u * WG * WG, 0u);"
        );
    }
    let _ = writeln!(
        s,
        "    workgroupBarrier();
}}

// grad.wgsl's prod_slice in named accumulators (the d_e / d_c product of a D slice), in the
// wide form written for WG = {wg}, TK = {tk} (`pb` unused: the X panel's words are the
// locals px<s>).
fn prod_named(gt: Tile, pb: ptr<function, Pref>, is_e: bool, j_base: u32, n_src: u32, d0: u32,
              tx: u32, ty: u32, li: u32) -> Tile {{
    let t = tile();
    let o = g_own(is_e, tx, ty);"
    );
    s.push_str(&zeroed());
    for sl in 0..ns {
        let _ = writeln!(s, "    var px{sl} = vec4<u32>(0u);");
    }
    s.push_str(
        "    var buf = slice_buf(d0);
    for (var k0 = 0u; k0 < t; k0 += TK) {
        let more = k0 + TK < t;
        let next = more || d0 + t < P.d;
        let nk = select(0u, k0 + TK, more);
        let nd = select(d0 + t, d0, more);
        if next {
",
    );
    for sl in 0..ns {
        let _ = writeln!(
            s,
            "            px{sl} = fetch_colg(is_e, j_base + nk, n_src, nd, li + {sl}u * WG * WG);"
        );
    }
    s.push_str(
        "        }
        let at = buf * TK * W_T4 + ty;
        let bt = buf * TK * W_T4 + tx;
",
    );
    s.push_str(&written_steps(tk));
    s.push_str(
        "        if next {
            put_gp_named(gt, o.x, o.y, nk, buf ^ 1u);
",
    );
    for sl in 0..ns {
        let _ = writeln!(
            s,
            "            put_colg(px{sl}, is_e, j_base + nk, n_src, nd, li + {sl}u * WG * WG, buf ^ 1u);"
        );
    }
    s.push_str(
        "        }
        workgroupBarrier();
        buf ^= 1u;
    }
",
    );
    s.push_str(&returned());
    s
}

/// `struct Tile` and `fn logits_named` of `form`: [`logits_named`] or [`logits_wide`].
pub fn logits_for(form: NamedForm) -> String {
    match form {
        NamedForm::Loop => logits_named(),
        NamedForm::Wide { wg, tk } => logits_wide(wg, tk),
    }
}

/// The backward's second product of `form`: [`prod_named`] or [`prod_wide`].
pub fn prod_for(form: NamedForm) -> String {
    match form {
        NamedForm::Loop => prod_named(),
        NamedForm::Wide { wg, tk } => prod_wide(wg, tk),
    }
}

/// The micro-tile row `N` of a call `name(&acc, Nu, ...)` on `line` and the arguments after
/// it (`", ...);"`), when the line is such a call.
fn row_call<'a>(line: &'a str, name: &str) -> Option<(usize, &'a str)> {
    let rest = line
        .trim_start()
        .strip_prefix(name)?
        .strip_prefix("(&acc, ")?;
    let (n, tail) = rest.split_once("u")?;
    Some((n.parse().ok()?, tail))
}

/// An entry point written for an `Acc` (bwd_hist_main.wgsl, bwd_de_main.wgsl,
/// bwd_dc_main.wgsl) rewritten line by line for the named accumulators: the logits tile
/// from `logits_named` (`tl`), G rows from grad.wgsl's `grad_row_v` (`g0 .. g7`, what
/// `grad_tile` does row by row), the G block's depth vectors as a `Tile` `gt` (bwd_de.wgsl's
/// `g_cols`: the block transposed; bwd_dc.wgsl's `g_rows`: the rows), d_c's bias sums row by
/// row (`g_bias`), the D-slice product from [`prod_named`] (`p`), and every per-row call by
/// value (`hist_row_v`; `add_de_half_v`, `add_dc_half_v` with the eight accumulators of four
/// rows) with constant names. Panics on a line that still names the accumulator (the unit
/// tests run it on every such file).
pub fn entry_named(acc_main: &str) -> String {
    let mut out = String::new();
    // The file's header (the `Acc` entry point's docs) is left out.
    let body = acc_main
        .lines()
        .skip_while(|l| l.is_empty() || l.starts_with("//"));
    for line in body {
        let t = line.trim_start();
        let ind = &line[..line.len() - t.len()];
        let mut emit = |x: String| {
            out.push_str(ind);
            out.push_str(&x);
            out.push('\n');
        };
        if t == "var acc: Acc;" || t == "var gt: Acc;" {
            continue;
        } else if let Some(args) = t.strip_prefix("logits_tile(&acc, ") {
            emit(format!("let tl = logits_named({args}"));
        } else if let Some(args) = t.strip_prefix("prod_slice(&acc, &gt, ") {
            emit(format!("let p = prod_named(gt, {args}"));
        } else if let Some(args) = t.strip_prefix("prod_begin(&gt, ") {
            emit(format!("prod_begin_named(gt, {args}"));
        } else if t == "g_cols(&acc, &gt);" {
            // Depth vector q: class column q of rows 0..3 (a{2q}) and 4..7 (a{2q + 1}).
            let cols: Vec<String> = (0..N_ACC)
                .map(|n| {
                    let (q, h) = (n / 2, n % 2);
                    let half = if q < 4 { "lo" } else { "hi" };
                    let c = ["x", "y", "z", "w"][q % 4];
                    let rows: Vec<String> = (4 * h..4 * h + 4)
                        .map(|i| format!("g{i}.{half}.{c}"))
                        .collect();
                    format!("vec4<f32>({})", rows.join(", "))
                })
                .collect();
            emit(format!("let gt = Tile({});", cols.join(", ")));
        } else if t == "g_rows(&acc, &gt);" {
            let rows: Vec<String> = (0..N_ACC / 2)
                .map(|i| format!("g{i}.lo, g{i}.hi"))
                .collect();
            emit(format!("let gt = Tile({});", rows.join(", ")));
        } else if t == "g_bias(&acc, &bacc_lo, &bacc_hi);" {
            for i in 0..N_ACC / 2 {
                emit(format!("bacc_lo += g{i}.lo;"));
                emit(format!("bacc_hi += g{i}.hi;"));
            }
        } else if t == "let need = grad_tile(&acc, &sc, r_base, c_base, tx, ty);" {
            // grad.wgsl's grad_tile, row by row by value.
            emit("sc.n_ent = 0u;".into());
            emit("let g_j0 = c_base + tx * 8u;".into());
            emit("let g_b = ld_bias8(g_j0);".into());
            emit("let g_n = min(P.n_cls - min(g_j0, P.n_cls), 8u);".into());
            emit("let g_gj0 = P.cls0 + g_j0;".into());
            for i in 0..N_ACC / 2 {
                emit(format!(
                    "let g{i} = grad_row_v(tl.a{}, tl.a{}, &sc, {i}u, g_b, r_base, ty, g_gj0, g_n);",
                    2 * i,
                    2 * i + 1
                ));
            }
            let needs: Vec<String> = (0..N_ACC / 2).map(|i| format!("g{i}.need")).collect();
            emit(format!("let need = {};", needs.join(" || ")));
        } else if let Some((i, tail)) = row_call(t, "hist_row") {
            emit(format!(
                "hist_row_v(tl.a{}, tl.a{}, {i}u{tail}",
                2 * i,
                2 * i + 1
            ));
        } else if let Some((h, tail)) =
            row_call(t, "add_de_half").or_else(|| row_call(t, "add_dc_half"))
        {
            // Four rows (eight accumulators) of the product by value.
            let f = if t.starts_with("add_de") {
                "add_de"
            } else {
                "add_dc"
            };
            let rows: Vec<String> = (8 * h..8 * h + 8).map(|n| format!("p.a{n}")).collect();
            emit(format!("{f}_half_v({}, {h}u{tail}", rows.join(", ")));
        } else {
            assert!(
                !(t.contains("&acc")
                    || t.contains("acc[")
                    || t.contains("Acc")
                    || t.contains("g["))
                    || t.starts_with("//"),
                "entry_named: no rule for {t:?}"
            );
            emit(t.to_string());
        }
    }
    out
}

/// fwd_partial.wgsl's pass on [`logits_named`]'s tile, and the entry point `main` (module
/// docs): the eight rows' running states `st0 .. st7` and the mask word `mk` in named locals,
/// extended per tile by `put_row` on the row's two accumulators by value, merged across the
/// row's threads once per split by `fwd_end`.
pub fn fwd_named() -> String {
    let mut s = String::from(
        "// fwd_partial.wgsl's pass with the named accumulators (fwd_partial.wgsl's helpers).
fn fwd_named(wid: vec3<u32>, lid: vec3<u32>, li: u32) {
    let t = tile();
    let tx = lid.x;
    let ty = lid.y;
    let split = wid.x;
    let r_base = wid.y * t;
    let n_ct = (P.n_cls + t - 1u) / t;
    let ct0 = split * P.split_tiles;
    let ct1 = min(ct0 + P.split_tiles, n_ct);

",
    );
    for i in 0..N_ACC / 2 {
        let _ = writeln!(s, "    var st{i} = run_empty();");
    }
    s.push_str(
        "    var mk = 0u;
    for (var ct = ct0; ct < ct1; ct++) {
        let c_base = ct * t;
        let tl = logits_named(r_base, c_base, tx, ty, li);
        let j0 = c_base + tx * 8u;
        let b = ld_bias8(j0);
        let n_ok = min(P.n_cls - min(j0, P.n_cls), 8u);
        let gj0 = P.cls0 + j0;
",
    );
    for i in 0..N_ACC / 2 {
        let _ = writeln!(
            s,
            "        let s{i} = put_row(st{i}, tl.a{}, tl.a{}, {i}u, b, r_base, ty, gj0, n_ok);",
            2 * i,
            2 * i + 1
        );
    }
    for i in 0..N_ACC / 2 {
        let _ = writeln!(s, "        st{i} = s{i}.run;");
    }
    let masks: Vec<String> = (0..N_ACC / 2).map(|i| format!("s{i}.mk")).collect();
    let _ = writeln!(
        s,
        "        mk |= {};
    }}",
        masks.join(" | ")
    );
    for i in 0..N_ACC / 2 {
        let _ = writeln!(
            s,
            "    fwd_end(st{i}, mk, {i}u, r_base, split, tx, ty, li);"
        );
    }
    s.push_str(
        "}

@compute @workgroup_size(WG, WG, 1)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    fwd_named(wid, lid, li);
}
",
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_outer_product_matches_the_acc_layout() {
        // gemm.wgsl's `outer`: acc[2i + h] += a[i] * b[h], a = (a0.xyzw, a1.xyzw).
        assert_eq!(fma_line(0), "a0 = fma(vec4<f32>(x0.x), y0, a0);");
        assert_eq!(fma_line(1), "a1 = fma(vec4<f32>(x0.x), y1, a1);");
        assert_eq!(fma_line(7), "a7 = fma(vec4<f32>(x0.w), y1, a7);");
        assert_eq!(fma_line(8), "a8 = fma(vec4<f32>(x1.x), y0, a8);");
        assert_eq!(fma_line(15), "a15 = fma(vec4<f32>(x1.w), y1, a15);");
        let outer = include_str!("../shaders/gemm.wgsl");
        for n in 0..N_ACC {
            let (row, half) = (n / 2, n % 2);
            let theirs = format!(
                "(*acc)[{n}] = fma(vec4<f32>(a{}.{}), b{half}, (*acc)[{n}]);",
                row / 4,
                ["x", "y", "z", "w"][row % 4]
            );
            assert!(outer.contains(&theirs), "{theirs}");
        }
    }

    #[test]
    fn sixteen_named_accumulators_no_array_no_pointer() {
        let src = logits_named() + &fwd_named();
        for n in 0..N_ACC {
            assert!(
                src.contains(&format!("    var a{n} = vec4<f32>(0.0);")),
                "a{n}"
            );
            assert_eq!(src.matches(&format!(" a{n} = fma(")).count(), 1, "a{n}");
            assert!(src.contains(&format!("tl.a{n},")), "epilogue reads a{n}");
        }
        assert!(!src.contains("Acc"), "no Acc array");
        assert!(!src.contains("ptr<function"), "no pointer parameter");
        assert!(!src.contains("&a"), "no pointer to an accumulator");
        assert!(!src.contains("array<"), "no array");
        // One loop over depth panels and one over the panel's depth: none over the micro-tile.
        assert_eq!(logits_named().matches("for (").count(), 2);
        assert_eq!(fwd_named().matches("for (").count(), 1);
    }

    #[test]
    fn named_panel_reads_stay_in_the_panels() {
        // The generated reads, as text, and their indices enumerated over every shape the
        // named loop runs: below the panels' 4·TK·WG vec4.
        let src = logits_named();
        for read in [
            "let o = (buf * TK + k) * 2u * WG;",
            "let x0 = As[o + 2u * ty];",
            "let x1 = As[o + 2u * ty + 1u];",
            "let y0 = Bs[o + 2u * tx];",
            "let y1 = Bs[o + 2u * tx + 1u];",
        ] {
            assert!(src.contains(read), "{read}");
        }
        assert_eq!(src.matches("As[").count() + src.matches("Bs[").count(), 4);
        let mut shapes = 0;
        for wg in 1..=16u32 {
            for tk in (4..=64u32).step_by(4) {
                let cfg = crate::KernelConfig {
                    wg,
                    tk,
                    main_loop: crate::MainLoop::Named,
                    target_workgroups: 8,
                    max_loop_iterations: 0,
                    runtime_checks: false,
                    cooperative_matrix: false,
                    coop_backward: true,
                    coop_tile: crate::CoopTile::T128,
                    coalesced_adds: true,
                };
                if cfg.shape_error().is_some() {
                    continue;
                }
                shapes += 1;
                let len = 4 * tk * wg;
                for buf in 0..2 {
                    for k in 0..tk {
                        let o = (buf * tk + k) * 2 * wg;
                        for t in 0..wg {
                            assert!(o + 2 * t + 1 < len, "{wg}:{tk} buf {buf} k {k} t {t}");
                        }
                    }
                }
            }
        }
        assert!(shapes >= 10, "{shapes}");
    }

    // panels_wide.wgsl's index functions, as the shader writes them.
    fn unit_row(r: u32) -> u32 {
        (r & 3) | (((r >> 2) & 7) << 3) | (((r >> 5) & 1) << 2) | ((r >> 6) << 6)
    }
    fn slot_of(q: u32, wg: u32) -> u32 {
        (q & 1) * wg + (q >> 1)
    }
    fn group_of_slot(sl: u32, wg: u32) -> u32 {
        if sl < wg {
            2 * sl
        } else {
            2 * (sl - wg) + 1
        }
    }
    /// put_unit's (vec4 index, component) of element x of unit u.
    fn put_unit_at(u: u32, x: u32, buf: u32, (wg, tk, e): (u32, u32, u32)) -> (u32, u32) {
        let t = 8 * wg;
        let r = u % t;
        let slot = ((r >> 5) & 1) * wg + (((r >> 2) & 7) | ((r >> 6) << 3));
        let f = (buf * tk + (u / t) * e) * 2 * wg + slot;
        (f + x * 2 * wg, r & 3)
    }

    /// The wide forms the tests enumerate: every shape `NamedForm::wide` accepts.
    fn wide_shapes() -> Vec<(u32, u32)> {
        let v: Vec<(u32, u32)> = (1..=16)
            .flat_map(|wg| (4..=64).step_by(4).map(move |tk| (wg, tk)))
            .filter(|&(wg, tk)| NamedForm::wide(wg, tk).is_some())
            .collect();
        assert_eq!(
            v,
            [
                (8, 8),
                (8, 16),
                (8, 32),
                (16, 8),
                (16, 16),
                (16, 32),
                (16, 64)
            ]
        );
        v
    }

    #[test]
    fn wide_row_panels_are_written_once_and_read_as_the_micro_tile() {
        for (wg, tk) in wide_shapes() {
            let (t, len) = (8 * wg, 4 * tk * wg);
            // unit_row is a bijection on the tile's rows; put_unit's slot is slot_of(row / 4).
            let mut rows: Vec<u32> = (0..t).map(unit_row).collect();
            for r in 0..t {
                let m = unit_row(r);
                let (f, c) = put_unit_at(r, 0, 0, (wg, tk, 4));
                assert_eq!((f, c), (slot_of(m >> 2, wg), m & 3), "{wg}:{tk} r {r}");
            }
            rows.sort_unstable();
            assert!(rows.iter().copied().eq(0..t), "{wg}:{tk}");
            for e in [4u32, 8] {
                let units = t * tk / e;
                // Every slot component of a buffer once, holding tile row m at depth d.
                for buf in 0..2 {
                    let mut hits = vec![None; 4 * len as usize];
                    for u in 0..units {
                        for x in 0..e {
                            let (f, c) = put_unit_at(u, x, buf, (wg, tk, e));
                            assert!(f < len, "{wg}:{tk} e {e} u {u} x {x}");
                            let at = (4 * f + c) as usize;
                            assert_eq!(hits[at], None, "{wg}:{tk} e {e} written twice");
                            hits[at] = Some((unit_row(u % t), (u / t) * e + x));
                        }
                    }
                    let half =
                        &hits[(2 * buf * tk * wg * 4) as usize..][..(2 * tk * wg * 4) as usize];
                    assert!(
                        half.iter().all(Option::is_some),
                        "{wg}:{tk} e {e} buf {buf}"
                    );
                    // The depth step's reads: thread ty's x0 (slot ty) and x1 (slot WG + ty)
                    // hold tile rows 8ty .. 8ty + 7 in order, at depth k.
                    for ty in 0..wg {
                        for k in 0..tk {
                            let at = buf * tk * 2 * wg + ty + k * 2 * wg;
                            for (v, slot) in [(0, at), (1, at + wg)] {
                                for c in 0..4 {
                                    let got = hits[(4 * slot + c) as usize];
                                    assert_eq!(got, Some((8 * ty + 4 * v + c, k)), "{wg}:{tk}");
                                }
                            }
                        }
                    }
                }
                // A subgroup's store of one element: 32 consecutive units, 32 banks.
                for u0 in (0..units).step_by(32) {
                    let mut banks: Vec<u32> = (u0..u0 + 32)
                        .map(|u| {
                            let (f, c) = put_unit_at(u, 0, 0, (wg, tk, e));
                            (4 * f + c) % 32
                        })
                        .collect();
                    banks.sort_unstable();
                    banks.dedup();
                    assert_eq!(banks.len(), 32, "{wg}:{tk} e {e} u0 {u0}");
                }
                // The slots of every invocation cover every unit, the guards exactly those.
                let ns = wide_slots(wg, tk);
                let mut covered = vec![0u32; units as usize];
                for li in 0..wg * wg {
                    for sl in 0..ns {
                        let u = li + sl * wg * wg;
                        let live = u < units;
                        if unit_guard(wg, tk, sl).is_none() {
                            assert!(live, "{wg}:{tk} e {e} slot {sl} unguarded");
                        }
                        if live {
                            covered[u as usize] += 1;
                        }
                    }
                }
                assert!(covered.iter().all(|&n| n == 1), "{wg}:{tk} e {e}");
            }
        }
    }

    #[test]
    fn wide_column_and_g_panels_fill_the_interleaved_slots() {
        for (wg, tk) in wide_shapes() {
            let (t4, len) = (2 * wg, 4 * tk * wg);
            for sl in 0..t4 {
                assert_eq!(slot_of(group_of_slot(sl, wg), wg), sl);
            }
            // put_colg: group g to depth row g / T4, slot g % T4 (below the panels), the
            // slice's columns 4·group_of_slot(..) once per depth row; every group of the
            // panel staged by one slot of one invocation.
            let ns = wide_slots(wg, tk);
            assert_eq!(ns * wg * wg, tk * t4, "{wg}:{tk}");
            for buf in 0..2 {
                let mut cols = vec![vec![0u32; (8 * wg) as usize]; tk as usize];
                for g in 0..tk * t4 {
                    let (k, s) = (g / t4, g % t4);
                    assert!((buf * tk + k) * t4 + s < len);
                    for x in 0..4 {
                        cols[k as usize][(4 * group_of_slot(s, wg) + x) as usize] += 1;
                    }
                }
                assert!(cols.iter().flatten().all(|&n| n == 1), "{wg}:{tk}");
            }
            // Consecutive invocations store consecutive slots (8 of them per 128 bytes).
            for g0 in (0..tk * t4).step_by(8) {
                let mut q: Vec<u32> = (g0..g0 + 8).map(|g| (g % t4) % 8).collect();
                q.sort_unstable();
                q.dedup();
                assert_eq!(q.len(), 8);
            }
            // put_gp_w: the G block's columns other*8 .. +3 and +4 .. +7 are groups 2·other
            // and 2·other + 1: slots other and WG + other, what thread ty = other reads.
            for other in 0..wg {
                assert_eq!(slot_of(2 * other, wg), other);
                assert_eq!(slot_of(2 * other + 1, wg), wg + other);
                assert!((tk + tk - 1) * t4 + wg + other < len);
            }
        }
    }

    #[test]
    fn the_wide_form_writes_out_its_depth_steps() {
        for (wg, tk) in wide_shapes() {
            let logits = logits_wide(wg, tk);
            let prod = prod_wide(wg, tk);
            for src in [&logits, &prod] {
                assert_eq!(src.matches("= fma(").count(), 16 * tk as usize, "{wg}:{tk}");
                assert!(!src.contains("k < TK"), "no loop over the panel's depth");
                assert!(!src.contains("array<") && !src.contains("Acc"));
                for k in 0..tk {
                    for read in [
                        format!("let x0 = As[at + {k}u * W_T4];"),
                        format!("let x1 = As[at + {k}u * W_T4 + WG];"),
                        format!("let y0 = Bs[bt + {k}u * W_T4];"),
                        format!("let y1 = Bs[bt + {k}u * W_T4 + WG];"),
                    ] {
                        assert_eq!(src.matches(&read).count(), 1, "{wg}:{tk} {read}");
                    }
                }
            }
            assert_eq!(logits.matches("for (").count(), 1, "the panel loop only");
            assert_eq!(prod.matches("for (").count(), 1, "the panel loop only");
            let ns = wide_slots(wg, tk) as usize;
            assert_eq!(logits.matches("fetch_unit(true,").count(), 2 * ns);
            assert_eq!(logits.matches("put_unit(false,").count(), 2 * ns);
            assert_eq!(prod.matches("fetch_colg(").count(), 2 * ns);
            assert_eq!(prod.matches("put_colg(").count(), 2 * ns);
            assert_eq!(prod.matches("put_gp_w(").count(), 8);
            // Same functions as the loop form, so the entry points are the same text.
            let f = "fn logits_named(r_base: u32, c_base: u32, tx: u32, ty: u32, li: u32) -> Tile";
            assert!(logits.contains(f) && logits_named().contains(f));
            for f in ["fn prod_named(", "fn prod_begin_named(", "fn put_gp_named("] {
                assert!(prod.contains(f) && prod_named().contains(f), "{f}");
            }
        }
        assert_eq!(logits_for(NamedForm::Loop), logits_named());
        assert_eq!(prod_for(NamedForm::Loop), prod_named());
    }

    const ACC_MAINS: [(&str, &str); 3] = [
        ("bwd_hist", include_str!("../shaders/bwd_hist_main.wgsl")),
        ("bwd_de", include_str!("../shaders/bwd_de_main.wgsl")),
        ("bwd_dc", include_str!("../shaders/bwd_dc_main.wgsl")),
    ];

    #[test]
    fn the_backward_entry_points_name_no_accumulator_array() {
        for (name, acc_main) in ACC_MAINS {
            let src = entry_named(acc_main);
            assert!(acc_main.contains("var acc: Acc;"), "{name}");
            for gone in [
                "Acc",
                "&acc",
                "acc[",
                "ptr<function",
                "logits_tile(",
                "prod_slice(",
            ] {
                assert!(!src.contains(gone), "{name}: {gone}");
            }
            assert_eq!(src.matches("@compute").count(), 1, "{name}");
            assert_eq!(src.matches("let tl = logits_named(").count(), 1, "{name}");
            // Every row of every tile reaches its by-value call once, by constant names.
            let calls: &[(&str, &str)] = match name {
                "bwd_hist" => &[("hist_row_v(tl.a{lo}, tl.a{hi}, {i}u,", "")],
                "bwd_de" => &[
                    ("grad_row_v(tl.a{lo}, tl.a{hi}, &sc, {i}u,", ""),
                    // Row i is component i % 4 of the depth vectors' lo or hi half.
                    ("g{i}.lo.x", ""),
                    ("g{i}.hi.w", ""),
                ],
                _ => &[
                    ("grad_row_v(tl.a{lo}, tl.a{hi}, &sc, {i}u,", ""),
                    ("g{i}.lo, g{i}.hi", "bacc_lo += g{i}.lo;"),
                ],
            };
            // The slice's rows reach the slab four at a time, each half once.
            let add = if name == "bwd_de" { "add_de" } else { "add_dc" };
            for h in (0..2).filter(|_| name != "bwd_hist") {
                let rows: Vec<String> = (8 * h..8 * h + 8).map(|n| format!("p.a{n}")).collect();
                let call = format!("{add}_half_v({}, {h}u,", rows.join(", "));
                assert_eq!(src.matches(&call).count(), 1, "{name}: {call}");
            }
            // The G block goes into the product by value, once per tile.
            if name != "bwd_hist" {
                assert_eq!(src.matches("let gt = Tile(").count(), 1, "{name}");
                assert_eq!(src.matches("prod_begin_named(gt, ").count(), 1, "{name}");
                assert_eq!(src.matches("let p = prod_named(gt, ").count(), 1, "{name}");
            }
            for i in 0..8 {
                let fill = |c: &str| {
                    c.replace("{lo}", &(2 * i).to_string())
                        .replace("{hi}", &(2 * i + 1).to_string())
                        .replace("{i}", &i.to_string())
                };
                for (call, then) in calls {
                    assert_eq!(
                        src.matches(&fill(call)).count(),
                        1,
                        "{name}: {}",
                        fill(call)
                    );
                    if !then.is_empty() {
                        assert_eq!(src.matches(&fill(then)).count(), 1, "{name}");
                    }
                }
            }
        }
        // The d_e / d_c product: named accumulators, prod_slice's reads.
        let prod = prod_named();
        for read in [
            "let x0 = As[ka];",
            "let x1 = As[ka + 1u];",
            "let y0 = Bs[kb];",
        ] {
            assert!(prod.contains(read), "{read}");
        }
        assert!(!prod.contains("array<") && !prod.contains("Acc"));
        let prod_slice =
            include_str!("../shaders/grad.wgsl").replace("put_gp8(gt, ", "put_gp_named(gt, ");
        for index in [
            "let ka = (buf * TK + k) * t4 + 2u * ty;",
            "let kb = (buf * TK + k) * t4 + 2u * tx;",
            "put_gp_named(gt, o.x, o.y, nk, buf ^ 1u);",
        ] {
            assert!(
                prod.contains(index) && prod_slice.contains(index),
                "{index}"
            );
        }
    }

    #[test]
    fn every_row_reaches_the_epilogue_once() {
        let src = fwd_named();
        for i in 0..8 {
            // Row i's state is extended by its own accumulators, kept, and ended once.
            let call = format!("put_row(st{i}, tl.a{}, tl.a{}, {i}u,", 2 * i, 2 * i + 1);
            assert_eq!(src.matches(&call).count(), 1, "{call}");
            assert_eq!(src.matches(&format!("st{i} = s{i}.run;")).count(), 1);
            assert!(src.contains(&format!(" s{i}.mk")), "mask of row {i}");
            let end = format!("fwd_end(st{i}, mk, {i}u,");
            assert_eq!(src.matches(&end).count(), 1, "{end}");
        }
        assert_eq!(src.matches("put_row(").count(), 8);
        assert_eq!(src.matches("fwd_end(").count(), 8);
    }
}
