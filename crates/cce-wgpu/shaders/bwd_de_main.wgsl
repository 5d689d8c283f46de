// bwd_de_main.wgsl: the entry point of bwd_de.wgsl's pass with the logits tile in an `Acc`
// (the scalar and quad main loops; the named loop's entry point is generated, src/named.rs).
//
// Parameters
//   As bwd_de.wgsl.
// Tiling
//   As bwd_de.wgsl.
// Thread mapping
//   As bwd_de.wgsl.
// Bounds
//   As bwd_de.wgsl: its accesses are that header's.

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
    let r_base = wid.y * t;
    let n_ct = (P.n_cls + t - 1u) / t;
    let ct0 = split * P.split_tiles;
    let ct1 = min(ct0 + P.split_tiles, n_ct);
    let report = has_flag(FLAG_REPORT);

    init_shared(li);
    var drop_lo = vec4<f32>(0.0);
    var drop_hi = vec4<f32>(0.0);
    var kept_tiles = 0u;
    var skipped_tiles = 0u;
    var kept_e = 0u;
    var skipped_e = 0u;

    for (var ct = ct0; ct < ct1; ct++) {
        let c_base = ct * t;
        logits_tile(&acc, r_base, c_base, tx, ty, li);
        let need = grad_tile(&acc, &sc, r_base, c_base, tx, ty);
        if !decide(need, li) {
            skipped_tiles += 1u;
            skipped_e += sc.n_ent;
            drop_lo += sc.g0_lo;
            drop_hi += sc.g0_hi;
            continue;
        }
        kept_tiles += 1u;
        kept_e += sc.n_ent;
        var gt: Acc;
        g_cols(&acc, &gt);
        prod_begin(&gt, &pb, false, c_base, P.n_cls, tx, ty, li);
        for (var d0 = 0u; d0 < P.d; d0 += t) {
            prod_slice(&acc, &gt, &pb, false, c_base, P.n_cls, d0, tx, ty, li);
            add_de_half(&acc, 0u, r_base, wid.x, d0, tx, ty);
            add_de_half(&acc, 1u, r_base, wid.x, d0, tx, ty);
        }
    }

    if report {
        for (var i = 0u; i < 8u; i++) {
            let r = r_base + ty * 8u + i;
            let dm = pick8(drop_lo, drop_hi, i);
            if r < P.n_rows && dm > 0.0 {
                atomicAdd(&dropped[r], to_fixed(dm));
            }
        }
    }
    flush_counters(li, kept_tiles, skipped_tiles, kept_e, skipped_e,
                   P.slot_base + wid.y * nwg.x + wid.x);
}
