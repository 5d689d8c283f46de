// bwd_de.wgsl: backward, row-owned pass: d_e = G · C accumulated in f32 slabs.
//
// Parameters
//   bindings 0-3: see gemm.wgsl; 4-7: see grad.wgsl.
//   `slab` [n_slabs, n_rows, D] f32: slab w accumulates, for the rows of the chunk, Σ over the
//          class tiles of the splits run in workgroup column w (split split_base + w of each
//          wave) of G_tile · C_tile (read-modify-write, one owner per element per dispatch).
// Tiling
//   Grid (splits, row tiles of the chunk). Split `s` covers class tiles
//   [s*split_tiles, (s+1)*split_tiles) of the class chunk. Per kept tile: logits tile (gemm),
//   G tile into Gs[class][row], then for each TILE-wide slice of D: Σ_k Gs[k][row] · C[k][d]
//   over the TILE classes in TK steps (C panel staged in Bs), added to the slab.
// Thread mapping
//   As gemm.wgsl for the logits; for the d_e product thread (tx, ty) owns rows ty*8.. and
//   columns d0 + tx*8.. of the slice.
// Bounds
//   slab[w*slab_stride + r*D + d] only for r < n_rows, d < D and w = workgroup_id.x, with
//   slab_stride >= n_rows*D (host-checked against the grid and binding); Gs[(tx*8 + jj)*2WG
//   + 2ty + 1] below 16*WG*WG; e, c, bias and the rest as gemm.wgsl and grad.wgsl.

@compute @workgroup_size(WG, WG, 1)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let t = tile();
    var acc: Acc;
    var sc: Scratch;
    let t4 = 2u * WG;
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
    load_rows(&sc, r_base, ty);
    var drop_acc: array<f32, 8>;
    for (var i = 0u; i < 8u; i++) {
        drop_acc[i] = 0.0;
    }
    var kept_tiles = 0u;
    var skipped_tiles = 0u;
    var kept_e = 0u;
    var skipped_e = 0u;

    for (var ct = ct0; ct < ct1; ct++) {
        let c_base = ct * t;
        logits_tile(&acc, r_base, c_base, tx, ty, li);
        let need = grad_tile(&acc, &sc, c_base, tx);
        if !decide(need, li) {
            skipped_tiles += 1u;
            skipped_e += sc.n_ent;
            for (var i = 0u; i < 8u; i++) {
                drop_acc[i] += sc.g0sum[i];
            }
            continue;
        }
        kept_tiles += 1u;
        kept_e += sc.n_ent;
        for (var jj = 0u; jj < 8u; jj++) {
            let base = (tx * 8u + jj) * t4 + 2u * ty;
            Gs[base] = vec4<f32>(acc_get(&acc, 0u, jj), acc_get(&acc, 1u, jj), acc_get(&acc, 2u, jj), acc_get(&acc, 3u, jj));
            Gs[base + 1u] = vec4<f32>(acc_get(&acc, 4u, jj), acc_get(&acc, 5u, jj), acc_get(&acc, 6u, jj), acc_get(&acc, 7u, jj));
        }
        workgroupBarrier();
        for (var d0 = 0u; d0 < P.d; d0 += t) {
            zero_acc(&acc);
            for (var k0 = 0u; k0 < t; k0 += TK) {
                stage_b_cols_c(c_base + k0, d0, li);
                workgroupBarrier();
                for (var k = 0u; k < TK; k++) {
                    let ka = (k0 + k) * t4 + 2u * ty;
                    let kb = k * t4 + 2u * tx;
                    outer(&acc, Gs[ka], Gs[ka + 1u], Bs[kb], Bs[kb + 1u]);
                }
                workgroupBarrier();
            }
            for (var i = 0u; i < 8u; i++) {
                let r = r_base + ty * 8u + i;
                if r >= P.n_rows {
                    continue;
                }
                let row = wid.x * P.slab_stride + r * P.d;
                for (var jj = 0u; jj < 8u; jj++) {
                    let d = d0 + tx * 8u + jj;
                    if d < P.d {
                        slab[row + d] += acc_get(&acc, i, jj);
                    }
                }
            }
        }
    }

    if report {
        for (var i = 0u; i < 8u; i++) {
            let r = r_base + ty * 8u + i;
            if r < P.n_rows && drop_acc[i] > 0.0 {
                atomicAdd(&dropped[r], to_fixed(drop_acc[i]));
            }
        }
    }
    flush_counters(li, kept_tiles, skipped_tiles, kept_e, skipped_e,
                   P.slot_base + wid.y * nwg.x + wid.x);
}
