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
//   As tile_io.wgsl; each thread reads its rows' states from `rs` when it needs them.
// Bounds
//   rs[r] and hist[r*N_BINS + b] only for r < n_rows, b < N_BINS; edges[k] with k < N_BINS
//   (bin_of's loops keep 0 <= k <= N_BINS − 1); sh[rl*N_BINS + k] below 8*WG*N_BINS with
//   rl < TILE = 8*WG.

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

// Histogram entries of micro-tile row i (a constant at every call) over the thread's classes.
fn hist_row(acc: ptr<function, Acc>, i: u32, b: array<vec4<f32>, 2>, r_base: u32, ty: u32,
            gj0: u32, n_ok: u32) {
    hist_row_v((*acc)[2u * i], (*acc)[2u * i + 1u], i, b, r_base, ty, gj0, n_ok);
}

// hist_row of the logits row (lo, hi), by value (chunk row r_base + ty*8 + i; a row past
// the chunk is inactive).
fn hist_row_v(lo: vec4<f32>, hi: vec4<f32>, i: u32, b: array<vec4<f32>, 2>, r_base: u32,
              ty: u32, gj0: u32, n_ok: u32) {
    let rl = ty * 8u + i;
    let r = r_base + rl;
    if r >= P.n_rows {
        return;
    }
    let st = rs[r];
    if st.live == 0u {
        return;
    }
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
