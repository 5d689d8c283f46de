// bwd_de.wgsl: backward, row-owned pass: d_e = G · C accumulated in f32 slabs.
//
// Parameters
//   bindings 0-3: see tile_io.wgsl; 4-7: see grad.wgsl.
//   `slab` [n_slabs, n_rows, D] f32: slab slab_w(w) accumulates, for the rows of the chunk, Σ
//          over the class tiles of the splits run in workgroup column w (split split_base + w
//          of each wave) of G_tile · C_tile: with slab_rmw.wgsl slab w (read-modify-write, one
//          owner per element per dispatch), with slab_atomic.wgsl the one slab 0 (atomic adds
//          of every split).
// Tiling
//   Grid (splits, row tiles of the chunk). Split `s` covers class tiles
//   [s*split_tiles, (s+1)*split_tiles) of the class chunk. Per kept tile: logits tile (gemm),
//   G in registers, its block columns as depth vectors (`g_cols`: depth = class), then for
//   each TILE-wide slice of D: Σ_k G[k][row] · C[k][d] over the TILE classes in TK steps (G
//   and C panels double buffered in As and Bs, grad.wgsl's `prod_slice`), added to the slab.
// Thread mapping
//   As tile_io.wgsl for the logits; for the d_e product thread (tx, ty) owns rows ty*8.. and
//   columns d0 + tx*8.. of the slice.
// Bounds
//   slab[slab_w(w)*slab_stride + r*D + d] only for r < n_rows, d < D and w = workgroup_id.x
//   (slab_w(w) = w, or 0 for the atomic slab), with slab_stride >= n_rows*D (host-checked
//   against the grid and binding): add_de_half_v passes
//   grad.wgsl's add_rows4_v the rows r < n_rows only; workgroup memory, e, c, bias and the
//   rest as gemm.wgsl and grad.wgsl.

// The thread's G block (rows in acc) as grad.wgsl's depth vectors for d_e: gt[2q], gt[2q + 1]
// = class column q of rows 0..3, 4..7.
fn g_cols(acc: ptr<function, Acc>, gt: ptr<function, Acc>) {
    for (var q = 0u; q < 8u; q++) {
        let h = q >> 2u;
        let c = q & 3u;
        (*gt)[2u * q] = vec4<f32>((*acc)[h][c], (*acc)[2u + h][c], (*acc)[4u + h][c],
                                  (*acc)[6u + h][c]);
        (*gt)[2u * q + 1u] = vec4<f32>((*acc)[8u + h][c], (*acc)[10u + h][c],
                                       (*acc)[12u + h][c], (*acc)[14u + h][c]);
    }
}

// Add micro-tile rows 4h .. 4h + 3 (h a constant at every call) of the d_e slice to the slab.
fn add_de_half(acc: ptr<function, Acc>, h: u32, r_base: u32, w: u32, d0: u32, tx: u32,
               ty: u32) {
    let n = 8u * h;
    add_de_half_v((*acc)[n], (*acc)[n + 1u], (*acc)[n + 2u], (*acc)[n + 3u], (*acc)[n + 4u],
                  (*acc)[n + 5u], (*acc)[n + 6u], (*acc)[n + 7u], h, r_base, w, d0, tx, ty);
}

// add_de_half of the four rows (lk, hk), by value: chunk rows r_base + ty*8 + 4h + k, those
// past the chunk left out.
fn add_de_half_v(l0: vec4<f32>, h0: vec4<f32>, l1: vec4<f32>, h1: vec4<f32>, l2: vec4<f32>,
                 h2: vec4<f32>, l3: vec4<f32>, h3: vec4<f32>, h: u32, r_base: u32, w: u32,
                 d0: u32, tx: u32, ty: u32) {
    let r = r_base + ty * 8u + 4u * h;
    let ok = rows_ok4(r, P.n_rows);
    if ok != 0u {
        let base = slab_w(w) * P.slab_stride + r * P.d;
        add_rows4_v(l0, h0, l1, h1, l2, h2, l3, h3, base, ok, d0 + tx * 8u);
    }
}
