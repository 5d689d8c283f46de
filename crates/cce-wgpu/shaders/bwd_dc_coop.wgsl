// bwd_dc_coop.wgsl: the entry point of the cooperative-matrix d_c pass (cargo feature
// `coop-matrix`): class-owned, d_c = Gᵀ · E by bwd_coop.wgsl's product and d_bias = Σ_i G_ij
// (f32, from the unrounded G), 128 x 128 tiles.
//
// Parameters
//   As bwd_dc.wgsl (bindings 1-8; `slab` [n_slabs, n_cls, D] f32, `bslab` [n_slabs, n_cls])
//   and bwd_coop.wgsl.
// Tiling
//   Grid (splits, class tiles of 128 of the chunk); split `s` covers row tiles of 128
//   [s*split_tiles, (s+1)*split_tiles). Per tile as bwd_de_coop.wgsl, with the product's depth
//   the tile's rows; each invocation sums its G block's rows into its 8 classes' bias sums,
//   reduced over the 16 invocations of a class column through Ct after the last tile.
// Thread mapping
//   As bwd_de_coop.wgsl.
// Bounds
//   As bwd_coop.wgsl and grad_rows.wgsl; dropped[r] only for r < n_rows; counters as
//   bwd_de_coop.wgsl; the bias reduction's Ct[(tx*8 + jj)*16 + ty] < 128*16 = 2048 and
//   Ct[jl*16 + k] with jl < 128, k < 16; bslab through add_bias for j < n_cls.

// The product's depth is the tile's rows (bwd_coop.wgsl).
const IS_DC: bool = true;

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
    let split = P.split_base + wid.x;
    let c_base = wid.y * t;
    let n_rt = (P.n_rows + t - 1u) / t;
    let rt0 = split * P.split_tiles;
    let rt1 = min(rt0 + P.split_tiles, n_rt);
    let report = has_flag(FLAG_REPORT);

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
        let gs = decide_coop(need, g_bound8(r_base, ty), li, lane);
        if gs == 0.0 {
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
        for (var i = 0u; i < 8u; i++) {
            bacc_lo += acc[2u * i];
            bacc_hi += acc[2u * i + 1u];
        }
        put_g(&acc, gs, tx, ty);
        workgroupBarrier();
        coop_product(wid.x, c_base, P.n_cls, true, r_base, P.n_rows, 1.0 / gs, li, lane);
    }

    // The bias sums of the tile's classes: the 16 invocations of class column tx through Ct.
    workgroupBarrier();
    for (var jj = 0u; jj < 8u; jj++) {
        Ct[(tx * 8u + jj) * WG + ty] = pick8(bacc_lo, bacc_hi, jj);
    }
    workgroupBarrier();
    if li < t {
        let j = c_base + li;
        if j < P.n_cls {
            var s = 0.0;
            for (var k = 0u; k < WG; k++) {
                s += Ct[li * WG + k];
            }
            add_bias(wid.x, j, s);
        }
    }
    flush_coop(li, lane, kept_tiles, skipped_tiles, kept_e, skipped_e,
               P.slot_base + wid.y * nwg.x + wid.x);
}
