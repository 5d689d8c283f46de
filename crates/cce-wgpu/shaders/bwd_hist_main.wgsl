// bwd_hist_main.wgsl: the entry point of bwd_hist.wgsl's pass with the logits tile in an `Acc`
// (the scalar and quad main loops; the named loop's entry point is generated, src/named.rs).
//
// Parameters
//   As bwd_hist.wgsl.
// Tiling
//   As bwd_hist.wgsl.
// Thread mapping
//   As bwd_hist.wgsl.
// Bounds
//   As bwd_hist.wgsl: its accesses are that header's.

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
    workgroupBarrier();

    for (var ct = ct0; ct < ct1; ct++) {
        let c_base = ct * t;
        logits_tile(&acc, r_base, c_base, tx, ty, li);
        let j0 = c_base + tx * 8u;
        let b = ld_bias8(j0);
        let n_ok = min(P.n_cls - min(j0, P.n_cls), 8u);
        let gj0 = P.cls0 + j0;
        hist_row(&acc, 0u, b, r_base, ty, gj0, n_ok);
        hist_row(&acc, 1u, b, r_base, ty, gj0, n_ok);
        hist_row(&acc, 2u, b, r_base, ty, gj0, n_ok);
        hist_row(&acc, 3u, b, r_base, ty, gj0, n_ok);
        hist_row(&acc, 4u, b, r_base, ty, gj0, n_ok);
        hist_row(&acc, 5u, b, r_base, ty, gj0, n_ok);
        hist_row(&acc, 6u, b, r_base, ty, gj0, n_ok);
        hist_row(&acc, 7u, b, r_base, ty, gj0, n_ok);
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
