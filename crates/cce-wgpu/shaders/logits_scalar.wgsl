// logits_scalar.wgsl: the `scalar` main loop of the logits tile (prepended after gemm.wgsl):
// row panels stored transposed one element at a time.
//
// Parameters
//   Bindings and flags of tile_io.wgsl; TK of gemm.wgsl (any shape KernelConfig allows).
// Tiling
//   gemm.wgsl's double-buffered panels, As[buf][k][m] / Bs[buf][k][m], four m per vec4 in
//   order; one barrier per panel; each thread stores its NG groups per operand as four scalar
//   stores each (transposing the depth-contiguous source into the depth-major panel).
// Thread mapping
//   As tile_io.wgsl; the product reads vec4s 2ty, 2ty+1 of As and 2tx, 2tx+1 of Bs per depth.
// Bounds
//   Group indices and the loads as gemm.wgsl; As/Bs: ((buf*TK + k + x)*TILE + m)/4 with
//   buf < 2, k + x < TK, m < TILE, below 4*TK*WG; reads (buf*TK + k)*2WG + 2ty + 1 likewise.

// Store a row panel of e into As[buf] (transposed: depth-major).
fn put_rows_a(pf: ptr<function, Pref>, base: u32, n_src: u32, k0: u32, li: u32, buf: u32) {
    let t = tile();
    for (var s = 0u; s < NG; s++) {
        let gr = rows_group(true, base, n_src, k0, li + s * WG * WG);
        let v = decode4((*pf)[s], gr.i);
        for (var x = 0u; x < 4u; x++) {
            let f = (buf * TK + gr.k + x) * t + gr.m;
            As[f >> 2u][f & 3u] = v[x];
        }
    }
}

// Store a row panel of c into Bs[buf] (transposed: depth-major).
fn put_rows_b(pf: ptr<function, Pref>, base: u32, n_src: u32, k0: u32, li: u32, buf: u32) {
    let t = tile();
    for (var s = 0u; s < NG; s++) {
        let gr = rows_group(false, base, n_src, k0, li + s * WG * WG);
        let v = decode4((*pf)[s], gr.i);
        for (var x = 0u; x < 4u; x++) {
            let f = (buf * TK + gr.k + x) * t + gr.m;
            Bs[f >> 2u][f & 3u] = v[x];
        }
    }
}

// acc += As[buf]^T Bs[buf] over one TK panel.
fn mma_panel(acc: ptr<function, Acc>, buf: u32, tx: u32, ty: u32) {
    let t4 = 2u * WG;
    for (var k = 0u; k < TK; k++) {
        let o = (buf * TK + k) * t4;
        outer(acc, As[o + 2u * ty], As[o + 2u * ty + 1u], Bs[o + 2u * tx], Bs[o + 2u * tx + 1u]);
    }
}

// acc = logits (without bias) of rows r_base.. x classes c_base.. of the chunk. Starts by
// writing As/Bs (the caller's earlier reads of them are behind a barrier) and ends with a
// barrier.
fn logits_tile(acc: ptr<function, Acc>, r_base: u32, c_base: u32, tx: u32, ty: u32, li: u32) {
    zero_acc(acc);
    var pa: Pref;
    var pb: Pref;
    fetch_rows(&pa, true, r_base, P.n_rows, 0u, li);
    fetch_rows(&pb, false, c_base, P.n_cls, 0u, li);
    put_rows_a(&pa, r_base, P.n_rows, 0u, li, 0u);
    put_rows_b(&pb, c_base, P.n_cls, 0u, li, 0u);
    workgroupBarrier();
    var buf = 0u;
    for (var k0 = 0u; k0 < P.d; k0 += TK) {
        let more = k0 + TK < P.d;
        if more {
            fetch_rows(&pa, true, r_base, P.n_rows, k0 + TK, li);
            fetch_rows(&pb, false, c_base, P.n_cls, k0 + TK, li);
        }
        mma_panel(acc, buf, tx, ty);
        if more {
            put_rows_a(&pa, r_base, P.n_rows, k0 + TK, li, buf ^ 1u);
            put_rows_b(&pb, c_base, P.n_cls, k0 + TK, li, buf ^ 1u);
        }
        workgroupBarrier();
        buf ^= 1u;
    }
}
