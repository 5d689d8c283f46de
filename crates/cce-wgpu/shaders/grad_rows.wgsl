// grad_rows.wgsl: G of a logits tile held as the threads' 8 x 8 micro-tiles (prepended to
// grad.wgsl in the FMA backward modules, and to the cooperative-matrix backward's own files,
// after tile_io.wgsl): each thread turns its micro-tile of logits into G, and says whether it
// needs the tile.
//
// Parameters
//   binding 4 `rs`       [n_rows] RowState: per-row coefficients and threshold (bwd_prep/tau).
//   binding 6 `dropped`  [n_rows] atomic u32: per-row dropped mass, Σ g0 of skipped entries in
//                        2^-30 units (FLAG_REPORT).
//   binding 7 `counters` [slots, 4] u32: per workgroup (tiles visited, tiles skipped, entries
//                        kept, entries skipped), slot = slot_base + workgroup index.
// Tiling
//   None of its own: one micro-tile row at a time (`grad_row`), eight per tile (`grad_tile`).
// Thread mapping
//   As tile_io.wgsl: G(i, jj) of the thread's micro-tile replaces acc(i, jj); each thread reads
//   its rows' states from `rs` when it needs them (no workgroup copy).
// Bounds
//   rs[r] only for r < n_rows; bias through tile_io.wgsl's ld_bias8 (j < n_cls); `dropped` and
//   `counters` are written by the including shaders (their headers).
//
// G_ij = (a p_ij − c) off the target, gy at it, times dz/dx = 1 − tanh²(x_ij/s) under softcap
// (`dcap`, from the uncapped logit x) (MATH.md, "Backward"); g0 = p off the target, g0y at it
// (cce-core filter.rs); both target values come from the saved rest mass (bwd_prep.wgsl).
// A −inf (masked) logit has p = 0 and G = 0.
// A tile is kept when some entry of an active row has g0 ≥ τ_i (FLAG_FILTER), or, without
// the filter, when any row of the tile is active; the decision is uniform over the workgroup.

@group(0) @binding(4) var<storage, read> rs: array<RowState>;
@group(0) @binding(6) var<storage, read_write> dropped: array<atomic<u32>>;
@group(0) @binding(7) var<storage, read_write> counters: array<u32>;

// Per-thread scratch of a G tile (function-local in the entry point, passed by pointer).
struct Scratch {
    g0_lo: vec4<f32>,  // Σ g0 of micro-tile rows 0..3 over the thread's 8 classes
    g0_hi: vec4<f32>,  // rows 4..7
    n_ent: u32,        // entries (active row, valid class) of the thread
}

// G of one micro-tile row and whether the row needs the tile.
struct GRow {
    lo: vec4<f32>,
    hi: vec4<f32>,
    need: bool,
}

// G of micro-tile row i (a constant at every call; chunk row r_base + ty*8 + i) from its
// logits (lo, hi), by value. A row past the chunk is inactive: G = 0, no entries.
fn grad_row_v(lo: vec4<f32>, hi: vec4<f32>, sc: ptr<function, Scratch>, i: u32,
              b: array<vec4<f32>, 2>, r_base: u32, ty: u32, gj0: u32, n_ok: u32) -> GRow {
    let r = r_base + ty * 8u + i;
    var g_lo = vec4<f32>(0.0);
    var g_hi = vec4<f32>(0.0);
    var need = false;
    var g0sum = 0.0;
    var live = false;
    var st: RowState;
    if r < P.n_rows {
        st = rs[r];
        live = st.live != 0u;
    }
    if live {
        let filtering = has_flag(FLAG_FILTER);
        for (var jj = 0u; jj < n_ok; jj++) {
            (*sc).n_ent += 1u;
            let x = pick8(lo, hi, jj) + pick8(b[0], b[1], jj);
            let z = cap(x);
            var g = 0.0;
            var g0 = 0.0;
            if !is_neg_inf(z) {
                let p = exp(z - st.lse);
                g0 = p;
                g = st.a * p - st.c;
                if i32(gj0 + jj) == st.y {
                    g0 = st.g0y;
                    g = st.gy;
                }
                if has_flag(FLAG_SOFTCAP) {
                    g *= dcap(x);
                }
            }
            if !filtering || g0 >= st.tau {
                need = true;
            }
            g0sum += g0;
            if jj < 4u {
                g_lo[jj] = g;
            } else {
                g_hi[jj - 4u] = g;
            }
        }
    }
    if i < 4u {
        (*sc).g0_lo[i] = g0sum;
    } else {
        (*sc).g0_hi[i - 4u] = g0sum;
    }
    return GRow(g_lo, g_hi, need);
}

// Replace micro-tile row i (a constant at every call) of acc by G; returns whether the row
// needs the tile.
fn grad_row(acc: ptr<function, Acc>, sc: ptr<function, Scratch>, i: u32,
            b: array<vec4<f32>, 2>, r_base: u32, ty: u32, gj0: u32, n_ok: u32) -> bool {
    let g = grad_row_v((*acc)[2u * i], (*acc)[2u * i + 1u], sc, i, b, r_base, ty, gj0, n_ok);
    (*acc)[2u * i] = g.lo;
    (*acc)[2u * i + 1u] = g.hi;
    return g.need;
}

// Replace the logits in acc by G (rows r_base + ty*8 .., classes c_base + tx*8 .. of the
// chunk); returns whether this thread needs the tile.
fn grad_tile(acc: ptr<function, Acc>, sc: ptr<function, Scratch>, r_base: u32, c_base: u32,
             tx: u32, ty: u32) -> bool {
    (*sc).n_ent = 0u;
    let j0 = c_base + tx * 8u;
    let b = ld_bias8(j0);
    let n_ok = min(P.n_cls - min(j0, P.n_cls), 8u);
    let gj0 = P.cls0 + j0;
    var need = grad_row(acc, sc, 0u, b, r_base, ty, gj0, n_ok);
    need = grad_row(acc, sc, 1u, b, r_base, ty, gj0, n_ok) || need;
    need = grad_row(acc, sc, 2u, b, r_base, ty, gj0, n_ok) || need;
    need = grad_row(acc, sc, 3u, b, r_base, ty, gj0, n_ok) || need;
    need = grad_row(acc, sc, 4u, b, r_base, ty, gj0, n_ok) || need;
    need = grad_row(acc, sc, 5u, b, r_base, ty, gj0, n_ok) || need;
    need = grad_row(acc, sc, 6u, b, r_base, ty, gj0, n_ok) || need;
    need = grad_row(acc, sc, 7u, b, r_base, ty, gj0, n_ok) || need;
    return need;
}

// Bit k set for the rows first + k < n (k < 4): which of four consecutive rows exist.
fn rows_ok4(first: u32, n: u32) -> u32 {
    return 15u >> (4u - min(n - min(first, n), 4u));
}

fn to_fixed(x: f32) -> u32 {
    return u32(ceil(min(x, 3.0) * FIXED_ONE));
}
