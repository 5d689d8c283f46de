// bwd_hist.wgsl: threshold pass, per-row histogram of g0 over the filter bins (g0 = p off the
// target, the row's g0y at it, from the saved rest mass; cce-core filter.rs). A −inf
// (masked) logit has g0 = 0 and adds nothing.
//
// Parameters
//   bindings 0-3: see gemm.wgsl. P.eps = resolved filter_eps (> 0).
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
//   As gemm.wgsl.
// Bounds
//   rs[r] and hist[r*N_BINS + b] only for r < n_rows, b < N_BINS; edges[k] with k < N_BINS
//   (bin_of's loops keep 0 <= k <= N_BINS − 1); sh[(ty*8 + i)*N_BINS + k] below
//   8*WG*N_BINS.

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
    var y: array<i32, 8>;
    var lse: array<f32, 8>;
    var g0y: array<f32, 8>;
    var act: array<bool, 8>;
    for (var i = 0u; i < 8u; i++) {
        let r = r_base + ty * 8u + i;
        act[i] = false;
        y[i] = -1;
        lse[i] = 0.0;
        g0y[i] = 0.0;
        if r < P.n_rows {
            let st = rs[r];
            act[i] = st.live != 0u;
            y[i] = st.y;
            lse[i] = st.lse;
            g0y[i] = st.g0y;
        }
    }
    workgroupBarrier();

    for (var ct = ct0; ct < ct1; ct++) {
        let c_base = ct * t;
        logits_tile(&acc, r_base, c_base, tx, ty, li);
        for (var jj = 0u; jj < 8u; jj++) {
            let j = c_base + tx * 8u + jj;
            if j >= P.n_cls {
                continue;
            }
            let bias = ld_bias(j);
            let gj = i32(P.cls0 + j);
            for (var i = 0u; i < 8u; i++) {
                if !act[i] {
                    continue;
                }
                let z = cap(acc_get(&acc, i, jj) + bias);
                if is_neg_inf(z) {
                    continue;
                }
                var g0 = exp(z - lse[i]);
                if gj == y[i] {
                    g0 = g0y[i];
                }
                if g0 < P.eps {
                    let k = bin_of(g0);
                    atomicAdd(&sh[(ty * 8u + i) * N_BINS + k], u32(ceil(g0 * FIXED_ONE)));
                }
            }
        }
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
