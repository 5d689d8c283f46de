// bwd_hist.wgsl: threshold pass, per-row histogram of g0 over the filter bins (g0 = p off the
// target, the row's g0y at it, from the saved rest mass; cce-core filter.rs). A −inf
// (masked) logit has g0 = 0 and adds nothing.
//
// Parameters
//   bindings 0-3: see tile_io.wgsl. P.eps = resolved filter_eps (> 0).
//   binding 4 `rs`    [n_rows] RowState: y, lse, active of each row (bwd_prep.wgsl).
//   binding 5 `edges` [N_BINS] f32: bin upper edges eps·2^(−k/4), computed on the host
//                     exactly as cce_core::filter::FilterRule::edge.
//   binding 6 `hist`  [n_rows, N_BINS] atomic u32, read_write: Σ ceil(g0 · 2^30) of the row's
//                     entries with g0 < eps, per bin (cce_core::filter::FilterRule::mass_to_fixed).
// Tiling
//   Grid (splits, row tiles of the chunk) as fwd_partial.wgsl; each workgroup accumulates a
//   TILE x N_BINS histogram in workgroup memory with u32 atomics and adds its non-zero bins to
//   `hist` at the end (integer sums: order-independent, deterministic).
// Thread mapping
//   As tile_io.wgsl; the row states of the tile are loaded once into `rst` by threads
//   li, li + WG*WG, ...
// Bounds
//   rs[r] and hist[r*N_BINS + b] only for r < n_rows, b < N_BINS; edges[k] with k < N_BINS
//   (bin_of's loops keep 0 <= k <= N_BINS − 1); sh[rl*N_BINS + k] below 8*WG*N_BINS and
//   rst[rl] with rl < TILE = 8*WG.

@group(0) @binding(4) var<storage, read> rs: array<RowState>;
@group(0) @binding(5) var<storage, read> edges: array<f32>;
@group(0) @binding(6) var<storage, read_write> hist: array<atomic<u32>>;

var<workgroup> sh: array<atomic<u32>, 8u * WG * N_BINS>;

fn bin_of(g0: f32) -> u32 {
    if g0 <= 0.0 {
        return N_BINS - 1u;
    }
    let kf = clamp(floor(-4.0 * log2(g0 / P.eps)), 0.0, f32(N_BINS - 1u));
    // The min keeps edges[] in bounds whatever the float conversion gives.
    var k = min(u32(kf), N_BINS - 1u);
    while k > 0u && g0 >= edges[k] {
        k -= 1u;
    }
    while k < N_BINS - 1u && g0 < edges[k + 1u] {
        k += 1u;
    }
    return k;
}

// Row state of the tile's rows (inactive past the chunk).
var<workgroup> rst: array<RowState, 8u * WG>;

// Histogram entries of micro-tile row i (a constant at every call) over the thread's classes.
fn hist_row(acc: ptr<function, Acc>, i: u32, b: array<vec4<f32>, 2>, ty: u32, gj0: u32,
            n_ok: u32) {
    let rl = ty * 8u + i;
    let st = rst[rl];
    if st.live == 0u {
        return;
    }
    let lo = (*acc)[2u * i];
    let hi = (*acc)[2u * i + 1u];
    for (var jj = 0u; jj < n_ok; jj++) {
        let z = cap(pick8(lo, hi, jj) + pick8(b[0], b[1], jj));
        if is_neg_inf(z) {
            continue;
        }
        var g0 = exp(z - st.lse);
        if i32(gj0 + jj) == st.y {
            g0 = st.g0y;
        }
        if g0 < P.eps {
            let k = bin_of(g0);
            atomicAdd(&sh[rl * N_BINS + k], u32(ceil(g0 * FIXED_ONE)));
        }
    }
}

@compute @workgroup_size(WG, WG, 1)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    let t = tile();
    var acc: Acc;
    let tx = lid.x;
    let ty = lid.y;
    let split = wid.x;
    let r_base = wid.y * t;
    let n_ct = (P.n_cls + t - 1u) / t;
    let ct0 = split * P.split_tiles;
    let ct1 = min(ct0 + P.split_tiles, n_ct);

    for (var f = li; f < t * N_BINS; f += WG * WG) {
        atomicStore(&sh[f], 0u);
    }
    for (var rl = li; rl < t; rl += WG * WG) {
        let r = r_base + rl;
        if r < P.n_rows {
            rst[rl] = rs[r];
        } else {
            rst[rl] = RowState(-1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0u, 0.0, 0u, 0u, 0u);
        }
    }
    workgroupBarrier();

    for (var ct = ct0; ct < ct1; ct++) {
        let c_base = ct * t;
        logits_tile(&acc, r_base, c_base, tx, ty, li);
        let j0 = c_base + tx * 8u;
        let b = ld_bias8(j0);
        let n_ok = min(P.n_cls - min(j0, P.n_cls), 8u);
        let gj0 = P.cls0 + j0;
        hist_row(&acc, 0u, b, ty, gj0, n_ok);
        hist_row(&acc, 1u, b, ty, gj0, n_ok);
        hist_row(&acc, 2u, b, ty, gj0, n_ok);
        hist_row(&acc, 3u, b, ty, gj0, n_ok);
        hist_row(&acc, 4u, b, ty, gj0, n_ok);
        hist_row(&acc, 5u, b, ty, gj0, n_ok);
        hist_row(&acc, 6u, b, ty, gj0, n_ok);
        hist_row(&acc, 7u, b, ty, gj0, n_ok);
    }
    workgroupBarrier();
    for (var f = li; f < t * N_BINS; f += WG * WG) {
        let v = atomicLoad(&sh[f]);
        let r = r_base + f / N_BINS;
        if v != 0u && r < P.n_rows {
            atomicAdd(&hist[r * N_BINS + f % N_BINS], v);
        }
    }
}
