// bwd_dc.wgsl: backward, class-owned pass: d_c = Gᵀ · E and d_bias = Σ_i G_ij in f32 slabs.
//
// Parameters
//   bindings 0-3: see tile_io.wgsl; 4-7: see grad.wgsl.
//   `slab`  [n_slabs, n_cls, D] f32: slab w accumulates, for the classes of the chunk, Σ over
//           the row tiles of the splits run in workgroup column w (split split_base + w of
//           each wave) of G_tileᵀ · E_tile (read-modify-write, one owner per dispatch).
//   binding 8 `bslab` [n_slabs, n_cls] f32, read_write: Σ_i G_ij likewise.
// Tiling
//   Grid (splits, class tiles of the chunk). Split `s` covers row tiles
//   [s*split_tiles, (s+1)*split_tiles) of the row chunk. Per kept tile: logits tile (same gemm
//   and thread mapping as bwd_de.wgsl, hence the same G and the same skip decision), G tile
//   into Gs[row][class], then for each TILE-wide slice of D: Σ_k Gs[k][class] · E[k][d] over
//   the TILE rows in TK steps (E panels double buffered in Bs, grad.wgsl's `prod_slice`),
//   added to the slab.
// Thread mapping
//   As tile_io.wgsl for the logits; for the d_c product thread (tx, ty) owns classes ty*8.. and
//   columns d0 + tx*8.. of the slice.
// Bounds
//   slab[w*slab_stride + j*D + d] only for j < n_cls, d < D, w = workgroup_id.x, with
//   slab_stride >= n_cls*D; bslab[w*n_cls + j] only for j < n_cls (both host-checked against
//   the grid and binding); bred[(tx*8 + jj)*WG + ty] below 8*WG*WG; the rest as gemm.wgsl and
//   grad.wgsl.

@group(0) @binding(8) var<storage, read_write> bslab: array<f32>;

var<workgroup> bred: array<f32, 8u * WG * WG>;

// G of micro-tile row i (a constant at every call) into Gs[row][class]; returns the row.
fn put_g(acc: ptr<function, Acc>, i: u32, tx: u32, ty: u32) -> array<vec4<f32>, 2> {
    let t4 = 2u * WG;
    let base = (ty * 8u + i) * t4 + 2u * tx;
    let lo = (*acc)[2u * i];
    let hi = (*acc)[2u * i + 1u];
    Gs[base] = lo;
    Gs[base + 1u] = hi;
    return array<vec4<f32>, 2>(lo, hi);
}

// Add micro-tile row i (a constant at every call) of the d_c slice to the slab.
fn add_dc_row(acc: ptr<function, Acc>, i: u32, c_base: u32, w: u32, d0: u32, tx: u32,
              ty: u32) {
    let j = c_base + ty * 8u + i;
    if j < P.n_cls {
        add_row(acc, i, w * P.slab_stride + j * P.d, d0 + tx * 8u);
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
        // The previous tile's reads of `rst` were before its `decide` barrier.
        load_rows(r_base, li);
        logits_tile(&acc, r_base, c_base, tx, ty, li);
        let need = grad_tile(&acc, &sc, c_base, tx, ty);
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
        var g = put_g(&acc, 0u, tx, ty);
        bacc_lo += g[0];
        bacc_hi += g[1];
        g = put_g(&acc, 1u, tx, ty);
        bacc_lo += g[0];
        bacc_hi += g[1];
        g = put_g(&acc, 2u, tx, ty);
        bacc_lo += g[0];
        bacc_hi += g[1];
        g = put_g(&acc, 3u, tx, ty);
        bacc_lo += g[0];
        bacc_hi += g[1];
        g = put_g(&acc, 4u, tx, ty);
        bacc_lo += g[0];
        bacc_hi += g[1];
        g = put_g(&acc, 5u, tx, ty);
        bacc_lo += g[0];
        bacc_hi += g[1];
        g = put_g(&acc, 6u, tx, ty);
        bacc_lo += g[0];
        bacc_hi += g[1];
        g = put_g(&acc, 7u, tx, ty);
        bacc_lo += g[0];
        bacc_hi += g[1];
        for (var d0 = 0u; d0 < P.d; d0 += t) {
            prod_slice(&acc, true, r_base, P.n_rows, d0, tx, ty, li);
            add_dc_row(&acc, 0u, c_base, wid.x, d0, tx, ty);
            add_dc_row(&acc, 1u, c_base, wid.x, d0, tx, ty);
            add_dc_row(&acc, 2u, c_base, wid.x, d0, tx, ty);
            add_dc_row(&acc, 3u, c_base, wid.x, d0, tx, ty);
            add_dc_row(&acc, 4u, c_base, wid.x, d0, tx, ty);
            add_dc_row(&acc, 5u, c_base, wid.x, d0, tx, ty);
            add_dc_row(&acc, 6u, c_base, wid.x, d0, tx, ty);
            add_dc_row(&acc, 7u, c_base, wid.x, d0, tx, ty);
        }
    }

    for (var jj = 0u; jj < 8u; jj++) {
        bred[(tx * 8u + jj) * WG + ty] = pick8(bacc_lo, bacc_hi, jj);
    }
    workgroupBarrier();
    for (var jl = li; jl < t; jl += WG * WG) {
        let j = c_base + jl;
        if j < P.n_cls {
            var s = 0.0;
            for (var k = 0u; k < WG; k++) {
                s += bred[jl * WG + k];
            }
            bslab[wid.x * P.n_cls + j] += s;
        }
    }
    flush_counters(li, kept_tiles, skipped_tiles, kept_e, skipped_e,
                   P.slot_base + wid.y * nwg.x + wid.x);
}
