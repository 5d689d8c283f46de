// logits_quad.wgsl: the `quad` main loop of the logits tile (prepended after gemm.wgsl): each
// invocation stages one 4 x 4 block of each operand per panel, transposed in registers and
// stored as four vec4.
//
// Parameters
//   Bindings and flags of tile_io.wgsl; TK of gemm.wgsl with TK = 2*WG (host-checked,
//   `MainLoop::Quad` in src/config.rs), so that a panel of TILE x TK holds exactly WG*WG
//   blocks of 4 x 4.
// Tiling
//   gemm.wgsl's double-buffered As/Bs, one barrier per panel. Panel layout: As[buf][k][slot]
//   (vec4 units, k < TK, slot < 2*WG) where the column quad q (tile columns 4q .. 4q+3) sits in
//   slot (q & 1)*WG + (q >> 1): a thread's two quads 2t, 2t+1 are slots t and WG + t, so the
//   product's vec4 reads are consecutive across the warp (no bank conflicts), and the stores
//   of a warp fill consecutive slots.
// Thread mapping
//   As tile_io.wgsl for the product. Staging: invocation li owns block (mb, kb) =
//   (li % 2WG, li / 2WG): source rows base + 4mb .. +3 at depths k0 + 4kb .. +3, read as four
//   `load4` (one per row, 16 bytes of f32, coalesced into 32-byte sectors by the two kb of a
//   warp), decoded, transposed and stored as the four depth rows of quad mb. The prefetched
//   words stay in a struct of named vec4 (no function-local array, no dynamic index).
// Bounds
//   Loads as gemm.wgsl's groups: a row is read only when < n_src and only the columns < D
//   (`nv`), through `load4`. mb < 2WG and kb < TK/4 because li < WG*WG = 2WG * TK/4. As/Bs:
//   (buf*TK + 4kb + x)*2WG + slot with buf < 2, 4kb + x < TK, slot < 2WG, below 4*TK*WG (the
//   arrays' length); the product reads (buf*TK + k)*2WG + WG + t with k < TK, t < WG, likewise.

// The raw words of one staging block: row r of the block in `w<r>`, the element index of
// row 0's first element in `i0` (row r's is i0 + r*D).
struct Quad {
    i0: u32,
    w0: vec4<u32>,
    w1: vec4<u32>,
    w2: vec4<u32>,
    w3: vec4<u32>,
}

// Raw words of elements i .. i+3 of row `row` (n_src rows exist) with `nv` valid columns.
fn q_row(is_e: bool, row: u32, n_src: u32, i: u32, nv: u32) -> vec4<u32> {
    return load4(is_e, i, select(0u, nv, row < n_src));
}

// The staging block of invocation li for the row panel at depth k0 of source rows base..
fn q_fetch(is_e: bool, base: u32, n_src: u32, k0: u32, li: u32) -> Quad {
    let m = base + 4u * (li % (2u * WG));
    let col = k0 + 4u * (li / (2u * WG));
    var nv = 0u;
    if col < P.d {
        nv = min(P.d - col, 4u);
    }
    let i0 = src_off(is_e) + m * P.d + col;
    return Quad(i0, q_row(is_e, m, n_src, i0, nv), q_row(is_e, m + 1u, n_src, i0 + P.d, nv),
                q_row(is_e, m + 2u, n_src, i0 + 2u * P.d, nv),
                q_row(is_e, m + 3u, n_src, i0 + 3u * P.d, nv));
}

// Store invocation li's block `q` into As[buf] (`to_a`) or Bs[buf], transposed.
fn q_put(to_a: bool, q: Quad, buf: u32, li: u32) {
    let mb = li % (2u * WG);
    let kb = li / (2u * WG);
    let r0 = decode4(q.w0, q.i0);
    let r1 = decode4(q.w1, q.i0 + P.d);
    let r2 = decode4(q.w2, q.i0 + 2u * P.d);
    let r3 = decode4(q.w3, q.i0 + 3u * P.d);
    let s = 2u * WG;
    let o = (buf * TK + 4u * kb) * s + (mb & 1u) * WG + (mb >> 1u);
    let k0 = vec4<f32>(r0.x, r1.x, r2.x, r3.x);
    let k1 = vec4<f32>(r0.y, r1.y, r2.y, r3.y);
    let k2 = vec4<f32>(r0.z, r1.z, r2.z, r3.z);
    let k3 = vec4<f32>(r0.w, r1.w, r2.w, r3.w);
    if to_a {
        As[o] = k0;
        As[o + s] = k1;
        As[o + 2u * s] = k2;
        As[o + 3u * s] = k3;
    } else {
        Bs[o] = k0;
        Bs[o + s] = k1;
        Bs[o + 2u * s] = k2;
        Bs[o + 3u * s] = k3;
    }
}

// acc += As[buf]^T Bs[buf] over one TK panel (the permuted slots of the header).
fn q_mma(acc: ptr<function, Acc>, buf: u32, tx: u32, ty: u32) {
    for (var k = 0u; k < TK; k++) {
        let o = (buf * TK + k) * 2u * WG;
        outer(acc, As[o + ty], As[o + WG + ty], Bs[o + tx], Bs[o + WG + tx]);
    }
}

// acc = logits (without bias) of rows r_base.. x classes c_base.. of the chunk. Starts by
// writing As/Bs (the caller's earlier reads of them are behind a barrier) and ends with a
// barrier.
fn logits_tile(acc: ptr<function, Acc>, r_base: u32, c_base: u32, tx: u32, ty: u32, li: u32) {
    *acc = Acc();
    var qa = q_fetch(true, r_base, P.n_rows, 0u, li);
    var qb = q_fetch(false, c_base, P.n_cls, 0u, li);
    q_put(true, qa, 0u, li);
    q_put(false, qb, 0u, li);
    workgroupBarrier();
    var buf = 0u;
    for (var k0 = 0u; k0 < P.d; k0 += TK) {
        let more = k0 + TK < P.d;
        if more {
            qa = q_fetch(true, r_base, P.n_rows, k0 + TK, li);
            qb = q_fetch(false, c_base, P.n_cls, k0 + TK, li);
        }
        q_mma(acc, buf, tx, ty);
        if more {
            q_put(true, qa, buf ^ 1u, li);
            q_put(false, qb, buf ^ 1u, li);
        }
        workgroupBarrier();
        buf ^= 1u;
    }
}
