// bwd_dc.wgsl: backward, class-owned pass: d_c = Gᵀ · E and d_bias = Σ_i G_ij in f32 slabs.
//
// Parameters
//   bindings 0-3: see tile_io.wgsl; 4-7: see grad.wgsl.
//   `slab`  [n_slabs, n_cls, D] f32: slab slab_w(w) accumulates, for the classes of the
//           chunk, Σ over the row tiles of the splits run in workgroup column w (split
//           split_base + w of each wave) of G_tileᵀ · E_tile: with slab_rmw.wgsl slab w
//           (read-modify-write, one owner per dispatch), with slab_atomic.wgsl the one slab 0
//           (atomic adds of every split).
//   binding 8 `bslab` [n_slabs, n_cls] f32, read_write: Σ_i G_ij likewise (`add_bias`).
// Tiling
//   Grid (splits, class tiles of the chunk). Split `s` covers row tiles
//   [s*split_tiles, (s+1)*split_tiles) of the row chunk. Per kept tile: logits tile (same gemm
//   and thread mapping as bwd_de.wgsl, hence the same G and the same skip decision), G in
//   registers, its block rows as depth vectors (`g_rows`: depth = row), then for each
//   TILE-wide slice of D: Σ_k G[k][class] · E[k][d] over the TILE rows in TK steps (G and E
//   panels double buffered in As and Bs, grad.wgsl's `prod_slice`), added to the slab.
// Thread mapping
//   As tile_io.wgsl for the logits; for the d_c product thread (tx, ty) owns classes ty*8.. and
//   columns d0 + tx*8.. of the slice.
// Bounds
//   slab[slab_w(w)*slab_stride + j*D + d] only for j < n_cls, d < D, w = workgroup_id.x
//   (slab_w(w) = w, or 0 for the atomic slab), with slab_stride >= n_cls*D (add_dc_half_v
//   passes add_rows4_v the classes j < n_cls only); bslab[slab_w(w)*n_cls + j] only for
//   j < n_cls (both host-checked against
//   the grid and binding); the bias reduction's floats (tx*8 + jj)*WG + ty and jl*WG + k
//   below 8*WG*WG <= 16*TK*WG, the floats of Bs (WG <= 2*TK since NG >= 1); the rest as
//   gemm.wgsl and grad.wgsl.

// Float f of Bs, the bias reduction's scratch after the pass's last product (whose closing
// barrier frees the panels).
fn bred_put(f: u32, v: f32) {
    Bs[f >> 2u][f & 3u] = v;
}

fn bred_get(f: u32) -> f32 {
    return Bs[f >> 2u][f & 3u];
}

// Adds the thread's 8 G rows (in acc), in row order, to its bias sums (lo, hi).
fn g_bias(acc: ptr<function, Acc>, lo: ptr<function, vec4<f32>>, hi: ptr<function, vec4<f32>>) {
    for (var i = 0u; i < 8u; i++) {
        *lo += (*acc)[2u * i];
        *hi += (*acc)[2u * i + 1u];
    }
}

// The thread's G block (rows in acc) as grad.wgsl's depth vectors for d_c: gt[2q], gt[2q + 1]
// = row q (its classes 0..3, 4..7), i.e. acc as it is.
fn g_rows(acc: ptr<function, Acc>, gt: ptr<function, Acc>) {
    for (var n = 0u; n < 16u; n++) {
        (*gt)[n] = (*acc)[n];
    }
}

// Add micro-tile rows 4h .. 4h + 3 (h a constant at every call) of the d_c slice to the slab.
fn add_dc_half(acc: ptr<function, Acc>, h: u32, c_base: u32, w: u32, d0: u32, tx: u32,
               ty: u32) {
    let n = 8u * h;
    add_dc_half_v((*acc)[n], (*acc)[n + 1u], (*acc)[n + 2u], (*acc)[n + 3u], (*acc)[n + 4u],
                  (*acc)[n + 5u], (*acc)[n + 6u], (*acc)[n + 7u], h, c_base, w, d0, tx, ty);
}

// add_dc_half of the four rows (lk, hk), by value: chunk classes c_base + ty*8 + 4h + k,
// those past the chunk left out.
fn add_dc_half_v(l0: vec4<f32>, h0: vec4<f32>, l1: vec4<f32>, h1: vec4<f32>, l2: vec4<f32>,
                 h2: vec4<f32>, l3: vec4<f32>, h3: vec4<f32>, h: u32, c_base: u32, w: u32,
                 d0: u32, tx: u32, ty: u32) {
    let j = c_base + ty * 8u + 4u * h;
    let ok = rows_ok4(j, P.n_cls);
    if ok != 0u {
        let base = slab_w(w) * P.slab_stride + j * P.d;
        add_rows4_v(l0, h0, l1, h1, l2, h2, l3, h3, base, ok, d0 + tx * 8u);
    }
}
