// slab_atomic.wgsl: the backward's f32 accumulators as ONE slab that every workgroup adds
// into with f32 atomics (wgpu's SHADER_FLOAT32_ATOMIC; appended to grad.wgsl in the atomic
// modules of bwd_de and bwd_dc, used only for calls that are not `deterministic`).
//
// Parameters
//   binding 5 `slab`  atomic f32, read_write: one slab (`slab_w(w)` = 0 for every workgroup
//                     column; layout of a slab in bwd_de.wgsl / bwd_dc.wgsl), zeroed by the
//                     host before the chunk's first dispatch.
//   binding 8 `bslab` atomic f32, read_write: [n_cls], d_c's bias sums (bwd_dc.wgsl only;
//                     bwd_de.wgsl never touches it, so it is not in that pipeline's layout).
// Tiling
//   None of its own: called per D slice of a kept tile (add_rows4_v) and once per workgroup
//   (add_bias). The workgroups of all splits add into the same floats, in whatever order
//   they reach L2: the sums are f32 sums of the same terms in an unspecified order.
// Thread mapping
//   The calling thread's rows and columns (the including shader).
// Bounds
//   slab: rows of D floats at `base` (with slab_w = 0: inside slab 0) the including shader
//   checks (a row k of add_rows4_v only with its bit of `ok` set), added at base + n0 + jj only
//   for n0 + jj < D; add_one's slab[i] at an index the including shader checks (bwd_coop.wgsl:
//   a row < n_rows or class < n_cls of its chunk, a column < D, inside slab 0); bslab[j] for
//   j < n_cls (bwd_dc.wgsl).

@group(0) @binding(5) var<storage, read_write> slab: array<atomic<f32>>;
@group(0) @binding(8) var<storage, read_write> bslab: array<atomic<f32>>;

// The slab that workgroup column w accumulates into: the one slab.
fn slab_w(w: u32) -> u32 {
    return 0u;
}

// bslab[class j] += s, atomically.
fn add_bias(w: u32, j: u32, s: f32) {
    atomicAdd(&bslab[slab_w(w) * P.n_cls + j], s);
}

// slab[base + n0 + jj] += entry jj of the row (lo, hi) for n0 + jj < D, atomically.
fn add_row8(lo: vec4<f32>, hi: vec4<f32>, base: u32, n0: u32) {
    for (var jj = 0u; jj < 8u; jj++) {
        if n0 + jj < P.d {
            atomicAdd(&slab[base + n0 + jj], pick8(lo, hi, jj));
        }
    }
}

// Adds four rows (lk, hk), k = 0..3, to the slab at floats base + k·D + n0 .. + 7 (n0 + jj < D),
// row k only where bit k of `ok` is set (slab_rmw.wgsl's add_rows4_v, without the loads).
fn add_rows4_v(l0: vec4<f32>, h0: vec4<f32>, l1: vec4<f32>, h1: vec4<f32>, l2: vec4<f32>,
               h2: vec4<f32>, l3: vec4<f32>, h3: vec4<f32>, base: u32, ok: u32, n0: u32) {
    if (ok & 1u) != 0u {
        add_row8(l0, h0, base, n0);
    }
    if (ok & 2u) != 0u {
        add_row8(l1, h1, base + P.d, n0);
    }
    if (ok & 4u) != 0u {
        add_row8(l2, h2, base + 2u * P.d, n0);
    }
    if (ok & 8u) != 0u {
        add_row8(l3, h3, base + 3u * P.d, n0);
    }
}

// slab[i] += v, atomically (the cooperative-matrix backward's adds, bwd_coop.wgsl: one float
// per call, the lanes of a subgroup on two runs of 16 consecutive floats).
fn add_one(i: u32, v: f32) {
    atomicAdd(&slab[i], v);
}
