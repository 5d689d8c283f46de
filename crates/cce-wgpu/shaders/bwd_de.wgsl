// bwd_de.wgsl: backward, row-owned pass: d_e = G · C accumulated in f32 slabs.
//
// Parameters
//   bindings 0-3: see tile_io.wgsl; 4-7: see grad.wgsl.
//   `slab` [n_slabs, n_rows, D] f32: slab w accumulates, for the rows of the chunk, Σ over the
//          class tiles of the splits run in workgroup column w (split split_base + w of each
//          wave) of G_tile · C_tile (read-modify-write, one owner per element per dispatch).
// Tiling
//   Grid (splits, row tiles of the chunk). Split `s` covers class tiles
//   [s*split_tiles, (s+1)*split_tiles) of the class chunk. Per kept tile: logits tile (gemm),
//   G tile into Gs[class][row], then for each TILE-wide slice of D: Σ_k Gs[k][row] · C[k][d]
//   over the TILE classes in TK steps (C panels double buffered in Bs, grad.wgsl's
//   `prod_slice`), added to the slab.
// Thread mapping
//   As tile_io.wgsl for the logits; for the d_e product thread (tx, ty) owns rows ty*8.. and
//   columns d0 + tx*8.. of the slice.
// Bounds
//   slab[w*slab_stride + r*D + d] only for r < n_rows, d < D and w = workgroup_id.x, with
//   slab_stride >= n_rows*D (host-checked against the grid and binding); Gs element
//   (tx*8 + jj)*TILE + ty*8 + i below TILE*TILE = 64*WG*WG floats; e, c, bias and the rest as
//   gemm.wgsl and grad.wgsl.

// G of micro-tile row i (a constant at every call) into Gs[class][row] (transposed).
fn put_g_t(acc: ptr<function, Acc>, i: u32, tx: u32, ty: u32) {
    let t = tile();
    let lo = (*acc)[2u * i];
    let hi = (*acc)[2u * i + 1u];
    for (var jj = 0u; jj < 8u; jj++) {
        let f = (tx * 8u + jj) * t + ty * 8u + i;
        Gs[f >> 2u][f & 3u] = pick8(lo, hi, jj);
    }
}

// Add micro-tile row i (a constant at every call) of the d_e slice to the slab.
fn add_de_row(acc: ptr<function, Acc>, i: u32, r_base: u32, w: u32, d0: u32, tx: u32,
              ty: u32) {
    let r = r_base + ty * 8u + i;
    if r < P.n_rows {
        add_row(acc, i, w * P.slab_stride + r * P.d, d0 + tx * 8u);
    }
}

@compute @workgroup_size(WG, WG, 1)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let t = tile();
    var acc: Acc;
    var sc: Scratch;
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

    load_rows(r_base, li);
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
        let need = grad_tile(&acc, &sc, c_base, tx, ty);
        if !decide(need, li) {
            skipped_tiles += 1u;
            skipped_e += sc.n_ent;
            drop_lo += sc.g0_lo;
            drop_hi += sc.g0_hi;
            continue;
        }
        kept_tiles += 1u;
        kept_e += sc.n_ent;
        put_g_t(&acc, 0u, tx, ty);
        put_g_t(&acc, 1u, tx, ty);
        put_g_t(&acc, 2u, tx, ty);
        put_g_t(&acc, 3u, tx, ty);
        put_g_t(&acc, 4u, tx, ty);
        put_g_t(&acc, 5u, tx, ty);
        put_g_t(&acc, 6u, tx, ty);
        put_g_t(&acc, 7u, tx, ty);
        for (var d0 = 0u; d0 < P.d; d0 += t) {
            prod_slice(&acc, false, c_base, P.n_cls, d0, tx, ty, li);
            add_de_row(&acc, 0u, r_base, wid.x, d0, tx, ty);
            add_de_row(&acc, 1u, r_base, wid.x, d0, tx, ty);
            add_de_row(&acc, 2u, r_base, wid.x, d0, tx, ty);
            add_de_row(&acc, 3u, r_base, wid.x, d0, tx, ty);
            add_de_row(&acc, 4u, r_base, wid.x, d0, tx, ty);
            add_de_row(&acc, 5u, r_base, wid.x, d0, tx, ty);
            add_de_row(&acc, 6u, r_base, wid.x, d0, tx, ty);
            add_de_row(&acc, 7u, r_base, wid.x, d0, tx, ty);
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
