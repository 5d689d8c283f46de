// slab_rmw.wgsl: the backward's f32 accumulators as one slab per workgroup column, updated by
// read-modify-write (the deterministic path; appended to grad.wgsl in bwd_de and bwd_dc).
//
// Parameters
//   binding 5 `slab`  f32, read_write: [n_slabs, slab_stride]; slab w (`slab_w(w)` = w, the
//                     workgroup column) is owned by the workgroups of column w of one dispatch
//                     (layout of a slab in bwd_de.wgsl / bwd_dc.wgsl).
//   binding 8 `bslab` f32, read_write: [n_slabs, n_cls], d_c's bias sums (bwd_dc.wgsl only;
//                     bwd_de.wgsl never touches it, so it is not in that pipeline's layout).
// Tiling
//   None of its own: called per D slice of a kept tile (add_rows4_v) and once per workgroup
//   (add_bias). A float has one writer per dispatch: the workgroups of one column cover
//   disjoint rows (d_e) or classes (d_c) of its slab, and each thread its own 8 columns of
//   its own rows; dispatches are ordered, so the sums run in a fixed order.
// Thread mapping
//   The calling thread's rows and columns (the including shader).
// Bounds
//   slab: rows of D floats at `base` the including shader checks (a row k of add_rows4_v only
//   with its bit of `ok` set), read at base + min(n0 + jj, D − 1) and written at base + n0 +
//   jj only for n0 + jj < D; add_one's slab[i] at an index the including shader checks
//   (bwd_coop.wgsl: a row < n_rows or class < n_cls of its chunk, a column < D, inside slab w);
//   bslab[w*n_cls + j] for j < n_cls (bwd_dc.wgsl).

@group(0) @binding(5) var<storage, read_write> slab: array<f32>;
@group(0) @binding(8) var<storage, read_write> bslab: array<f32>;

// The slab that workgroup column w accumulates into.
fn slab_w(w: u32) -> u32 {
    return w;
}

// bslab[slab w][class j] += s.
fn add_bias(w: u32, j: u32, s: f32) {
    bslab[slab_w(w) * P.n_cls + j] += s;
}

// The slab's 8 floats of one row at base + n0 .. + 7, the indices past D clamped to the row's
// last float (base + D − 1), so that every load is in bounds and none sits in a branch.
fn ld_row8(base: u32, n0: u32) -> array<vec4<f32>, 2> {
    let last = base + P.d - 1u;
    let o = base + n0;
    return array<vec4<f32>, 2>(
        vec4<f32>(slab[min(o, last)], slab[min(o + 1u, last)], slab[min(o + 2u, last)],
                  slab[min(o + 3u, last)]),
        vec4<f32>(slab[min(o + 4u, last)], slab[min(o + 5u, last)], slab[min(o + 6u, last)],
                  slab[min(o + 7u, last)]));
}

// slab[base + n0 + jj] = entry jj of the row (lo, hi) for n0 + jj < D.
fn st_row8(lo: vec4<f32>, hi: vec4<f32>, base: u32, n0: u32) {
    for (var jj = 0u; jj < 8u; jj++) {
        if n0 + jj < P.d {
            slab[base + n0 + jj] = pick8(lo, hi, jj);
        }
    }
}

// Adds four rows (lk, hk), k = 0..3, to the slab at floats base + k·D + n0 .. + 7 (n0 + jj < D),
// row k only where bit k of `ok` is set: the 32 loads first, then the stores, so that the
// loads are in flight together instead of each waiting behind the previous store.
fn add_rows4_v(l0: vec4<f32>, h0: vec4<f32>, l1: vec4<f32>, h1: vec4<f32>, l2: vec4<f32>,
               h2: vec4<f32>, l3: vec4<f32>, h3: vec4<f32>, base: u32, ok: u32, n0: u32) {
    let z = array<vec4<f32>, 2>(vec4<f32>(0.0), vec4<f32>(0.0));
    var q0 = z;
    var q1 = z;
    var q2 = z;
    var q3 = z;
    if (ok & 1u) != 0u {
        q0 = ld_row8(base, n0);
    }
    if (ok & 2u) != 0u {
        q1 = ld_row8(base + P.d, n0);
    }
    if (ok & 4u) != 0u {
        q2 = ld_row8(base + 2u * P.d, n0);
    }
    if (ok & 8u) != 0u {
        q3 = ld_row8(base + 3u * P.d, n0);
    }
    if (ok & 1u) != 0u {
        st_row8(l0 + q0[0], h0 + q0[1], base, n0);
    }
    if (ok & 2u) != 0u {
        st_row8(l1 + q1[0], h1 + q1[1], base + P.d, n0);
    }
    if (ok & 4u) != 0u {
        st_row8(l2 + q2[0], h2 + q2[1], base + 2u * P.d, n0);
    }
    if (ok & 8u) != 0u {
        st_row8(l3 + q3[0], h3 + q3[1], base + 3u * P.d, n0);
    }
}

// slab[i] += v (the cooperative-matrix backward's adds, bwd_coop.wgsl: one float per call; the
// float's one writer of the dispatch is the calling invocation).
fn add_one(i: u32, v: f32) {
    slab[i] = slab[i] + v;
}
