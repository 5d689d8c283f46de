// bwd_dc_main.wgsl: the entry point of bwd_dc.wgsl's pass with the logits tile in an `Acc`
// (the scalar and quad main loops; the named loop's entry point is generated, src/named.rs).
//
// Parameters
//   As bwd_dc.wgsl.
// Tiling
//   As bwd_dc.wgsl.
// Thread mapping
//   As bwd_dc.wgsl.
// Bounds
//   As bwd_dc.wgsl: its accesses are that header's.

@compute @workgroup_size(WG, WG, 1)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let t = tile();
    var acc: Acc;
    var sc: Scratch;
    var pb: Pref;
    let tx = lid.x;
    let ty = lid.y;
    // Tiles of split `split`; its accumulators are slab `wid.x` (splits run in waves of
    // at most n_slabs workgroup columns).
    let split = P.split_base + wid.x;
    let c_base = wid.y * t;
    let n_rt = (P.n_rows + t - 1u) / t;
    let rt0 = split * P.split_tiles;
    let rt1 = min(rt0 + P.split_tiles, n_rt);
    let report = has_flag(FLAG_REPORT);

    init_shared(li);
    var bacc_lo = vec4<f32>(0.0);
    var bacc_hi = vec4<f32>(0.0);
    var kept_tiles = 0u;
    var skipped_tiles = 0u;
    var kept_e = 0u;
    var skipped_e = 0u;

    for (var rt = rt0; rt < rt1; rt++) {
        let r_base = rt * t;
        logits_tile(&acc, r_base, c_base, tx, ty, li);
        let need = grad_tile(&acc, &sc, r_base, c_base, tx, ty);
        if !decide(need, li) {
            skipped_tiles += 1u;
            skipped_e += sc.n_ent;
            if report {
                for (var i = 0u; i < 8u; i++) {
                    let r = r_base + ty * 8u + i;
                    let dm = pick8(sc.g0_lo, sc.g0_hi, i);
                    if r < P.n_rows && dm > 0.0 {
                        atomicAdd(&dropped[r], to_fixed(dm));
                    }
                }
            }
            continue;
        }
        kept_tiles += 1u;
        kept_e += sc.n_ent;
        g_bias(&acc, &bacc_lo, &bacc_hi);
        var gt: Acc;
        g_rows(&acc, &gt);
        prod_begin(&gt, &pb, true, r_base, P.n_rows, tx, ty, li);
        for (var d0 = 0u; d0 < P.d; d0 += t) {
            prod_slice(&acc, &gt, &pb, true, r_base, P.n_rows, d0, tx, ty, li);
            add_dc_half(&acc, 0u, c_base, wid.x, d0, tx, ty);
            add_dc_half(&acc, 1u, c_base, wid.x, d0, tx, ty);
        }
    }

    // The tile loop's last panel reads are behind a barrier (prod_slice's or logits_tile's).
    for (var jj = 0u; jj < 8u; jj++) {
        bred_put((tx * 8u + jj) * WG + ty, pick8(bacc_lo, bacc_hi, jj));
    }
    workgroupBarrier();
    for (var jl = li; jl < t; jl += WG * WG) {
        let j = c_base + jl;
        if j < P.n_cls {
            var s = 0.0;
            for (var k = 0u; k < WG; k++) {
                s += bred_get(jl * WG + k);
            }
            add_bias(wid.x, j, s);
        }
    }
    flush_counters(li, kept_tiles, skipped_tiles, kept_e, skipped_e,
                   P.slot_base + wid.y * nwg.x + wid.x);
}
