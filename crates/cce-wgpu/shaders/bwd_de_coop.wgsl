// bwd_de_coop.wgsl: the entry point of the cooperative-matrix d_e pass (cargo feature
// `coop-matrix`): row-owned, d_e = G · C by bwd_coop.wgsl's product, 128 x 128 tiles.
//
// Parameters
//   As bwd_de.wgsl (bindings 1-7; `slab` [n_slabs, n_rows, D] f32) and bwd_coop.wgsl.
// Tiling
//   Grid (splits, row tiles of 128 of the chunk); split `s` covers class tiles of 128
//   [s*split_tiles, (s+1)*split_tiles). Per tile: logits_coop128.wgsl's logits tile,
//   grad_rows.wgsl's G, the workgroup's decision and G scale (decide_coop), then G into
//   workgroup memory and bwd_coop.wgsl's product over the slices of D.
// Thread mapping
//   One-dimensional workgroups of WG*WG = 256 invocations; (tx, ty) = (li % WG, li / WG)
//   own the 8 x 8 micro-tile of tile_io.wgsl; the product by subgroup (bwd_coop.wgsl).
// Bounds
//   As bwd_coop.wgsl and grad_rows.wgsl; dropped[r] only for r < n_rows; counters[slot*4 +
//   0..3] with slot = slot_base + workgroup index (host-checked against the binding).

// The product's depth is the tile's classes (bwd_coop.wgsl).
const IS_DC: bool = false;

@compute @workgroup_size(WG * WG, 1, 1)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32, @builtin(subgroup_id) sg: u32,
        @builtin(subgroup_invocation_id) lane: u32) {
    sg_index = min(sg, 7u);
    let t = tile();
    var acc: Acc;
    var sc: Scratch;
    let tx = li % WG;
    let ty = li / WG;
    // Tiles of split `split`; its accumulators are slab `wid.x` (splits run in waves of
    // at most n_slabs workgroup columns).
    let split = P.split_base + wid.x;
    let r_base = wid.y * t;
    let n_ct = (P.n_cls + t - 1u) / t;
    let ct0 = split * P.split_tiles;
    let ct1 = min(ct0 + P.split_tiles, n_ct);
    let report = has_flag(FLAG_REPORT);
    let bound = g_bound8(r_base, ty);

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
        let gs = decide_coop(need, bound, li, lane);
        if gs == 0.0 {
            skipped_tiles += 1u;
            skipped_e += sc.n_ent;
            drop_lo += sc.g0_lo;
            drop_hi += sc.g0_hi;
            continue;
        }
        kept_tiles += 1u;
        kept_e += sc.n_ent;
        put_g(&acc, gs, tx, ty);
        workgroupBarrier();
        coop_product(wid.x, r_base, P.n_rows, false, c_base, P.n_cls, 1.0 / gs, li, lane);
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
    flush_coop(li, lane, kept_tiles, skipped_tiles, kept_e, skipped_e,
               P.slot_base + wid.y * nwg.x + wid.x);
}
