// bwd_coop.wgsl: the backward's second product by cooperative matrices at 128 x 128 tiles
// (f16 G and e or c, f32 accumulation; cargo feature `coop-matrix`), with the workgroup
// decision, the G staging and the f32 adds into the slab; appended after
// logits_coop128.wgsl (the logits tile and the arrays Ah, Bh, Ct), coop_stage.wgsl,
// common.wgsl, tile_io.wgsl, grad_rows.wgsl and slab_rmw.wgsl or slab_atomic.wgsl, before
// the entry point (bwd_de_coop.wgsl or bwd_dc_coop.wgsl, which sets IS_DC).
//
// Parameters
//   Bindings 0-3 as tile_io.wgsl, 4, 6, 7 as grad_rows.wgsl, 5 (and 8) as slab_rmw.wgsl /
//   slab_atomic.wgsl. DTYPE must be 1 (f16 inputs) and WG 16 (as logits_coop128.wgsl: 256
//   invocations = eight subgroups of exactly 32 lanes; the host runs these pipelines only
//   where it runs that forward). IS_DC (the entry point's const): the product is d_c = Gᵀ·E
//   (depth = the tile's rows) instead of d_e = G·C (depth = the tile's classes).
// Tiling
//   Per kept tile, after logits_tile and grad_rows.wgsl's grad_tile (G in the threads' 8 x 8
//   micro-tiles, f32): G times the tile's power-of-two scale gs (max |gs·G| <= 2^14 over the
//   tile's rows, from their RowState: `g_bound8`, reduced in `decide_coop`) is rounded to
//   f16 into Ah and Bh, split along the product's depth: depths 0..63 in Ah, 64..127 in Bh;
//   d_e stores G[row][class] at row stride GSE = 72 (A = G row-major), d_c stores the same
//   G[row][class] at row stride GSC = 136 (A = Gᵀ column-major). Each subgroup loads its 2 x 8
//   A fragments 16 x 16 (32 output rows x the 128 depths) into registers once per tile. Then
//   for each 128-wide slice of D: the X rows of the tile (c for d_e, e for d_c) in four panels
//   of 32 depths x 128 columns (row stride SX = 136), double-buffered through Ah / Bh (panel
//   p in Ah for p even, Bh for p odd; the next panel, or the next slice's first, is read into
//   registers before a panel's products and stored after them; one barrier per panel);
//   subgroup s computes output rows 32 (s / 2) .. +31 and slice columns 64 (s % 2) .. +63 as
//   2 x 4 f32 accumulators (16 multiply-adds 16 x 16 x 16 per panel). The slice's 8
//   accumulators go to the slab in 8 rounds through the subgroup's own 16 x 16 slot of Ct
//   (store; barrier; each lane reads 8 floats; barrier; the lane adds them, times 1/gs, with
//   add_one). Workgroup memory: logits_coop128.wgsl's 48 KiB; the decision and the counters
//   use Ct's first floats between the hand-overs (no other workgroup variable).
// Thread mapping
//   G staging: invocation (tx, ty) = (li % 16, li / 16) stores its micro-tile's 8 rows of 8
//   f16. X panels: invocation li reads and stores depth rows li/16 and li/16 + 16, columns
//   8 (li % 16) .. +7 (coop_stage.wgsl's fetch8 / put_a / put_b). Fragments: by subgroup
//   (`sg_index`). Hand-over: lane l of subgroup s reads, in round f = 4a + j, the slot's
//   floats 32 q + l, q < 8: output row 32 (s / 2) + 16 a + 2 q + l / 16, slice column
//   64 (s % 2) + 16 j + l % 16 (two runs of 16 consecutive floats per add instruction).
// Bounds
//   Ah / Bh: G stores at (row)·72 + 8 (tx % 8) + x < 128·72 = 9216 (d_e) or
//   (row % 64)·136 + 8 tx + x < 64·136 = 8704 (d_c), both below 10240; A loads start at
//   (32 (s/2) + 16 a)·72 + 16 (q % 4) (d_e; last element (127)·72 + 63 = 9207) or
//   16 (q % 4)·136 + 32 (s/2) + 16 a (d_c; last 63·136 + 127 = 8695); X stores at
//   k·136 + 8 (li % 16) + x with k < 32, x < 8, and B loads at kk·136 + 64 (s % 2) + 16 j,
//   kk in {0, 16}, 16 rows: below 32·136 = 4352. Ct: slots s·256 + 32 q + l < 2048; the
//   decision's Ct[0..16] and the counters' Ct[0..16]. e and c: through fetch8 with `ok` the
//   source row < n_x and its col < D guard. slab: add_one only for an output row < n_out and
//   a column < D, at slab_w(w)·slab_stride + row·D + col (the slab layout of bwd_de.wgsl /
//   bwd_dc.wgsl, host-checked against the binding); rs[r] for r < n_rows.

// Row stride (f16) of d_e's G halves (64 classes each: G[row][class], A row-major).
const GSE: u32 = 72u;
// Row stride (f16) of d_c's G halves (64 rows each: G[row][class], A = Gᵀ column-major).
const GSC: u32 = 136u;
// Row stride (f16) of an X panel: 128 columns of the D slice and 8 of padding.
const SX: u32 = 136u;

// An invocation's share of an X panel: depth rows li/16 (w0) and li/16 + 16 (w1), eight
// columns each, as raw f16 bits.
struct XFetch {
    w0: vec4<u32>,
    w1: vec4<u32>,
}

// The share of the X panel of source rows j0 .. j0 + 31 (of n_x in the chunk) and columns
// d0 .. d0 + 127 (zeros past n_x and past D).
fn fetch_x(is_e: bool, j0: u32, n_x: u32, d0: u32, li: u32) -> XFetch {
    let j = j0 + (li >> 4u);
    let col = d0 + 8u * (li & 15u);
    let off = src_off(is_e);
    return XFetch(fetch8(is_e, j < n_x, col, off + j * P.d + col),
                  fetch8(is_e, j + 16u < n_x, col, off + (j + 16u) * P.d + col));
}

// A fetched share into Ah (the panels of even index).
fn put_xa(f: XFetch, li: u32) {
    let o = (li >> 4u) * SX + 8u * (li & 15u);
    put_a(o, f.w0);
    put_a(o + 16u * SX, f.w1);
}

// A fetched share into Bh (the panels of odd index).
fn put_xb(f: XFetch, li: u32) {
    let o = (li >> 4u) * SX + 8u * (li & 15u);
    put_b(o, f.w0);
    put_b(o + 16u * SX, f.w1);
}

// The largest |G| bound of the thread's eight rows r_base + ty*8 .. (|a| + |c| + |gy|: p <= 1
// and the softcap factor <= 1; 0 for rows past the chunk or not live).
fn g_bound8(r_base: u32, ty: u32) -> f32 {
    var b = 0.0;
    for (var i = 0u; i < 8u; i++) {
        let r = r_base + ty * 8u + i;
        if r < P.n_rows {
            let st = rs[r];
            if st.live != 0u {
                b = max(b, abs(st.a) + abs(st.c) + abs(st.gy));
            }
        }
    }
    return b;
}

// The power of two 2^s with 2^s·bound <= 2^14 (1 for a bound that is 0 or not finite).
fn g_scale(bound: f32) -> f32 {
    if !(bound > 0.0) || !(bound < 3.0e38) {
        return 1.0;
    }
    let s = clamp(14 - i32(ceil(log2(bound))), -100, 100);
    return exp2(f32(s));
}

// Workgroup-uniform: the tile's G scale when some invocation needs the tile, else 0. Ct is
// free (logits_tile ends with a barrier); its floats 0..16 are read before the next write.
fn decide_coop(need: bool, bound: f32, li: u32, lane: u32) -> f32 {
    let any = subgroupAny(need);
    let bmax = subgroupMax(bound);
    if lane == 0u {
        Ct[sg_index] = select(0.0, 1.0, any);
        Ct[8u + sg_index] = bmax;
    }
    workgroupBarrier();
    if li == 0u {
        var k = 0.0;
        var b = 0.0;
        for (var q = 0u; q < 8u; q++) {
            k = max(k, Ct[q]);
            b = max(b, Ct[8u + q]);
        }
        Ct[16u] = select(0.0, g_scale(b), k > 0.0);
    }
    return workgroupUniformLoad(&Ct[16u]);
}

// Row (lo, hi) of the thread's G block times gs, as eight f16 at o of Ah (h = 0) or Bh.
fn put_g8(h: u32, o: u32, lo: vec4<f32>, hi: vec4<f32>, gs: f32) {
    let a = vec4<f16>(lo * gs);
    let b = vec4<f16>(hi * gs);
    if h == 0u {
        Ah[o] = a.x;
        Ah[o + 1u] = a.y;
        Ah[o + 2u] = a.z;
        Ah[o + 3u] = a.w;
        Ah[o + 4u] = b.x;
        Ah[o + 5u] = b.y;
        Ah[o + 6u] = b.z;
        Ah[o + 7u] = b.w;
    } else {
        Bh[o] = a.x;
        Bh[o + 1u] = a.y;
        Bh[o + 2u] = a.z;
        Bh[o + 3u] = a.w;
        Bh[o + 4u] = b.x;
        Bh[o + 5u] = b.y;
        Bh[o + 6u] = b.z;
        Bh[o + 7u] = b.w;
    }
}

// The thread's G block (rows ty*8 + i, classes tx*8 + jj) times gs into the G halves (header).
fn put_g(acc: ptr<function, Acc>, gs: f32, tx: u32, ty: u32) {
    var h = tx >> 3u;
    var o = ty * 8u * GSE + (tx & 7u) * 8u;
    var st = GSE;
    if IS_DC {
        h = ty >> 3u;
        o = (ty & 7u) * 8u * GSC + tx * 8u;
        st = GSC;
    }
    put_g8(h, o, (*acc)[0], (*acc)[1], gs);
    put_g8(h, o + st, (*acc)[2], (*acc)[3], gs);
    put_g8(h, o + 2u * st, (*acc)[4], (*acc)[5], gs);
    put_g8(h, o + 3u * st, (*acc)[6], (*acc)[7], gs);
    put_g8(h, o + 4u * st, (*acc)[8], (*acc)[9], gs);
    put_g8(h, o + 5u * st, (*acc)[10], (*acc)[11], gs);
    put_g8(h, o + 6u * st, (*acc)[12], (*acc)[13], gs);
    put_g8(h, o + 7u * st, (*acc)[14], (*acc)[15], gs);
}

// Adds the lane's eight floats v of fragment (a, j) of the slice at d0 to the slab, times inv
// (hand-over mapping in the header); rows past n_out and columns past D left out.
fn add_frag(v: array<f32, 8>, a: u32, j: u32, w: u32, out_base: u32, n_out: u32, d0: u32,
            inv: f32, lane: u32) {
    let col = d0 + 64u * (sg_index & 1u) + 16u * j + (lane & 15u);
    if col >= P.d {
        return;
    }
    let m0 = out_base + 32u * (sg_index >> 1u) + 16u * a + (lane >> 4u);
    let base = slab_w(w) * P.slab_stride + col;
    for (var q = 0u; q < 8u; q++) {
        let m = m0 + 2u * q;
        if m < n_out {
            add_one(base + m * P.d, v[q] * inv);
        }
    }
}

// The lane's eight floats of its subgroup's Ct slot (hand-over mapping in the header).
fn take_frag(lane: u32) -> array<f32, 8> {
    let o = sg_index * 256u + lane;
    return array<f32, 8>(Ct[o], Ct[o + 32u], Ct[o + 64u], Ct[o + 96u], Ct[o + 128u],
                         Ct[o + 160u], Ct[o + 192u], Ct[o + 224u]);
}

// The second product of a kept tile whose G (times gs = 1/inv) the caller has stored into the
// halves (put_g) and then passed a barrier: the output rows out_base .. (n_out in the chunk:
// the tile's rows for d_e, its classes for d_c) of slab column w get Σ_k G·X over the tile's
// 128 depths, X the rows x_base .. (n_x in the chunk) of e (`x_is_e`) or c. Ends with a
// barrier after its last workgroup access.
fn coop_product(w: u32, out_base: u32, n_out: u32, x_is_e: bool, x_base: u32, n_x: u32,
                inv: f32, li: u32, lane: u32) {
    // The subgroup's first output row in the A fragments, first column in a slice.
    let ra = 32u * (sg_index >> 1u);
    let nb = 64u * (sg_index & 1u);
    var a00 = coop_mat16x16<f16, A>();
    var a01 = coop_mat16x16<f16, A>();
    var a02 = coop_mat16x16<f16, A>();
    var a03 = coop_mat16x16<f16, A>();
    var a04 = coop_mat16x16<f16, A>();
    var a05 = coop_mat16x16<f16, A>();
    var a06 = coop_mat16x16<f16, A>();
    var a07 = coop_mat16x16<f16, A>();
    var a10 = coop_mat16x16<f16, A>();
    var a11 = coop_mat16x16<f16, A>();
    var a12 = coop_mat16x16<f16, A>();
    var a13 = coop_mat16x16<f16, A>();
    var a14 = coop_mat16x16<f16, A>();
    var a15 = coop_mat16x16<f16, A>();
    var a16 = coop_mat16x16<f16, A>();
    var a17 = coop_mat16x16<f16, A>();
    if IS_DC {
        a00 = coopLoad<coop_mat16x16<f16, A>>(&Ah[0u * GSC + ra + 0u], GSC);
        a01 = coopLoad<coop_mat16x16<f16, A>>(&Ah[16u * GSC + ra + 0u], GSC);
        a02 = coopLoad<coop_mat16x16<f16, A>>(&Ah[32u * GSC + ra + 0u], GSC);
        a03 = coopLoad<coop_mat16x16<f16, A>>(&Ah[48u * GSC + ra + 0u], GSC);
        a04 = coopLoad<coop_mat16x16<f16, A>>(&Bh[0u * GSC + ra + 0u], GSC);
        a05 = coopLoad<coop_mat16x16<f16, A>>(&Bh[16u * GSC + ra + 0u], GSC);
        a06 = coopLoad<coop_mat16x16<f16, A>>(&Bh[32u * GSC + ra + 0u], GSC);
        a07 = coopLoad<coop_mat16x16<f16, A>>(&Bh[48u * GSC + ra + 0u], GSC);
        a10 = coopLoad<coop_mat16x16<f16, A>>(&Ah[0u * GSC + ra + 16u], GSC);
        a11 = coopLoad<coop_mat16x16<f16, A>>(&Ah[16u * GSC + ra + 16u], GSC);
        a12 = coopLoad<coop_mat16x16<f16, A>>(&Ah[32u * GSC + ra + 16u], GSC);
        a13 = coopLoad<coop_mat16x16<f16, A>>(&Ah[48u * GSC + ra + 16u], GSC);
        a14 = coopLoad<coop_mat16x16<f16, A>>(&Bh[0u * GSC + ra + 16u], GSC);
        a15 = coopLoad<coop_mat16x16<f16, A>>(&Bh[16u * GSC + ra + 16u], GSC);
        a16 = coopLoad<coop_mat16x16<f16, A>>(&Bh[32u * GSC + ra + 16u], GSC);
        a17 = coopLoad<coop_mat16x16<f16, A>>(&Bh[48u * GSC + ra + 16u], GSC);
    } else {
        a00 = coopLoadT<coop_mat16x16<f16, A>>(&Ah[(ra + 0u) * GSE + 0u], GSE);
        a01 = coopLoadT<coop_mat16x16<f16, A>>(&Ah[(ra + 0u) * GSE + 16u], GSE);
        a02 = coopLoadT<coop_mat16x16<f16, A>>(&Ah[(ra + 0u) * GSE + 32u], GSE);
        a03 = coopLoadT<coop_mat16x16<f16, A>>(&Ah[(ra + 0u) * GSE + 48u], GSE);
        a04 = coopLoadT<coop_mat16x16<f16, A>>(&Bh[(ra + 0u) * GSE + 0u], GSE);
        a05 = coopLoadT<coop_mat16x16<f16, A>>(&Bh[(ra + 0u) * GSE + 16u], GSE);
        a06 = coopLoadT<coop_mat16x16<f16, A>>(&Bh[(ra + 0u) * GSE + 32u], GSE);
        a07 = coopLoadT<coop_mat16x16<f16, A>>(&Bh[(ra + 0u) * GSE + 48u], GSE);
        a10 = coopLoadT<coop_mat16x16<f16, A>>(&Ah[(ra + 16u) * GSE + 0u], GSE);
        a11 = coopLoadT<coop_mat16x16<f16, A>>(&Ah[(ra + 16u) * GSE + 16u], GSE);
        a12 = coopLoadT<coop_mat16x16<f16, A>>(&Ah[(ra + 16u) * GSE + 32u], GSE);
        a13 = coopLoadT<coop_mat16x16<f16, A>>(&Ah[(ra + 16u) * GSE + 48u], GSE);
        a14 = coopLoadT<coop_mat16x16<f16, A>>(&Bh[(ra + 16u) * GSE + 0u], GSE);
        a15 = coopLoadT<coop_mat16x16<f16, A>>(&Bh[(ra + 16u) * GSE + 16u], GSE);
        a16 = coopLoadT<coop_mat16x16<f16, A>>(&Bh[(ra + 16u) * GSE + 32u], GSE);
        a17 = coopLoadT<coop_mat16x16<f16, A>>(&Bh[(ra + 16u) * GSE + 48u], GSE);
    }
    // Every subgroup's A fragments are loaded before the first X panel overwrites Ah.
    workgroupBarrier();
    put_xa(fetch_x(x_is_e, x_base, n_x, 0u, li), li);
    workgroupBarrier();
    for (var d0 = 0u; d0 < P.d; d0 += 128u) {
        var o0 = coop_mat16x16<f32, C>();
        var o1 = coop_mat16x16<f32, C>();
        var o2 = coop_mat16x16<f32, C>();
        var o3 = coop_mat16x16<f32, C>();
        var o4 = coop_mat16x16<f32, C>();
        var o5 = coop_mat16x16<f32, C>();
        var o6 = coop_mat16x16<f32, C>();
        var o7 = coop_mat16x16<f32, C>();
        // Panel 0 (depths 0 .. 31) in Ah; panel 1 in flight.
        {
            let nx = fetch_x(x_is_e, x_base + 32u, n_x, d0, li);
            let b0 = coopLoadT<coop_mat16x16<f16, B>>(&Ah[nb + 0u], SX);
            let b1 = coopLoadT<coop_mat16x16<f16, B>>(&Ah[nb + 16u], SX);
            let b2 = coopLoadT<coop_mat16x16<f16, B>>(&Ah[nb + 32u], SX);
            let b3 = coopLoadT<coop_mat16x16<f16, B>>(&Ah[nb + 48u], SX);
            o0 = coopMultiplyAdd(a00, b0, o0);
            o1 = coopMultiplyAdd(a00, b1, o1);
            o2 = coopMultiplyAdd(a00, b2, o2);
            o3 = coopMultiplyAdd(a00, b3, o3);
            o4 = coopMultiplyAdd(a10, b0, o4);
            o5 = coopMultiplyAdd(a10, b1, o5);
            o6 = coopMultiplyAdd(a10, b2, o6);
            o7 = coopMultiplyAdd(a10, b3, o7);
            let b4 = coopLoadT<coop_mat16x16<f16, B>>(&Ah[16u * SX + nb + 0u], SX);
            let b5 = coopLoadT<coop_mat16x16<f16, B>>(&Ah[16u * SX + nb + 16u], SX);
            let b6 = coopLoadT<coop_mat16x16<f16, B>>(&Ah[16u * SX + nb + 32u], SX);
            let b7 = coopLoadT<coop_mat16x16<f16, B>>(&Ah[16u * SX + nb + 48u], SX);
            o0 = coopMultiplyAdd(a01, b4, o0);
            o1 = coopMultiplyAdd(a01, b5, o1);
            o2 = coopMultiplyAdd(a01, b6, o2);
            o3 = coopMultiplyAdd(a01, b7, o3);
            o4 = coopMultiplyAdd(a11, b4, o4);
            o5 = coopMultiplyAdd(a11, b5, o5);
            o6 = coopMultiplyAdd(a11, b6, o6);
            o7 = coopMultiplyAdd(a11, b7, o7);
            // The other buffer was last read before the previous barrier.
            put_xb(nx, li);
            workgroupBarrier();
        }
        // Panel 1 (depths 32 .. 63) in Bh; panel 2 in flight.
        {
            let nx = fetch_x(x_is_e, x_base + 64u, n_x, d0, li);
            let b0 = coopLoadT<coop_mat16x16<f16, B>>(&Bh[nb + 0u], SX);
            let b1 = coopLoadT<coop_mat16x16<f16, B>>(&Bh[nb + 16u], SX);
            let b2 = coopLoadT<coop_mat16x16<f16, B>>(&Bh[nb + 32u], SX);
            let b3 = coopLoadT<coop_mat16x16<f16, B>>(&Bh[nb + 48u], SX);
            o0 = coopMultiplyAdd(a02, b0, o0);
            o1 = coopMultiplyAdd(a02, b1, o1);
            o2 = coopMultiplyAdd(a02, b2, o2);
            o3 = coopMultiplyAdd(a02, b3, o3);
            o4 = coopMultiplyAdd(a12, b0, o4);
            o5 = coopMultiplyAdd(a12, b1, o5);
            o6 = coopMultiplyAdd(a12, b2, o6);
            o7 = coopMultiplyAdd(a12, b3, o7);
            let b4 = coopLoadT<coop_mat16x16<f16, B>>(&Bh[16u * SX + nb + 0u], SX);
            let b5 = coopLoadT<coop_mat16x16<f16, B>>(&Bh[16u * SX + nb + 16u], SX);
            let b6 = coopLoadT<coop_mat16x16<f16, B>>(&Bh[16u * SX + nb + 32u], SX);
            let b7 = coopLoadT<coop_mat16x16<f16, B>>(&Bh[16u * SX + nb + 48u], SX);
            o0 = coopMultiplyAdd(a03, b4, o0);
            o1 = coopMultiplyAdd(a03, b5, o1);
            o2 = coopMultiplyAdd(a03, b6, o2);
            o3 = coopMultiplyAdd(a03, b7, o3);
            o4 = coopMultiplyAdd(a13, b4, o4);
            o5 = coopMultiplyAdd(a13, b5, o5);
            o6 = coopMultiplyAdd(a13, b6, o6);
            o7 = coopMultiplyAdd(a13, b7, o7);
            // The other buffer was last read before the previous barrier.
            put_xa(nx, li);
            workgroupBarrier();
        }
        // Panel 2 (depths 64 .. 95) in Ah; panel 3 in flight.
        {
            let nx = fetch_x(x_is_e, x_base + 96u, n_x, d0, li);
            let b0 = coopLoadT<coop_mat16x16<f16, B>>(&Ah[nb + 0u], SX);
            let b1 = coopLoadT<coop_mat16x16<f16, B>>(&Ah[nb + 16u], SX);
            let b2 = coopLoadT<coop_mat16x16<f16, B>>(&Ah[nb + 32u], SX);
            let b3 = coopLoadT<coop_mat16x16<f16, B>>(&Ah[nb + 48u], SX);
            o0 = coopMultiplyAdd(a04, b0, o0);
            o1 = coopMultiplyAdd(a04, b1, o1);
            o2 = coopMultiplyAdd(a04, b2, o2);
            o3 = coopMultiplyAdd(a04, b3, o3);
            o4 = coopMultiplyAdd(a14, b0, o4);
            o5 = coopMultiplyAdd(a14, b1, o5);
            o6 = coopMultiplyAdd(a14, b2, o6);
            o7 = coopMultiplyAdd(a14, b3, o7);
            let b4 = coopLoadT<coop_mat16x16<f16, B>>(&Ah[16u * SX + nb + 0u], SX);
            let b5 = coopLoadT<coop_mat16x16<f16, B>>(&Ah[16u * SX + nb + 16u], SX);
            let b6 = coopLoadT<coop_mat16x16<f16, B>>(&Ah[16u * SX + nb + 32u], SX);
            let b7 = coopLoadT<coop_mat16x16<f16, B>>(&Ah[16u * SX + nb + 48u], SX);
            o0 = coopMultiplyAdd(a05, b4, o0);
            o1 = coopMultiplyAdd(a05, b5, o1);
            o2 = coopMultiplyAdd(a05, b6, o2);
            o3 = coopMultiplyAdd(a05, b7, o3);
            o4 = coopMultiplyAdd(a15, b4, o4);
            o5 = coopMultiplyAdd(a15, b5, o5);
            o6 = coopMultiplyAdd(a15, b6, o6);
            o7 = coopMultiplyAdd(a15, b7, o7);
            // The other buffer was last read before the previous barrier.
            put_xb(nx, li);
            workgroupBarrier();
        }
        // Panel 3 (depths 96 .. 127) in Bh; the next slice's panel 0 (zeros past D) in flight.
        {
            let nx = fetch_x(x_is_e, x_base, n_x, d0 + 128u, li);
            let b0 = coopLoadT<coop_mat16x16<f16, B>>(&Bh[nb + 0u], SX);
            let b1 = coopLoadT<coop_mat16x16<f16, B>>(&Bh[nb + 16u], SX);
            let b2 = coopLoadT<coop_mat16x16<f16, B>>(&Bh[nb + 32u], SX);
            let b3 = coopLoadT<coop_mat16x16<f16, B>>(&Bh[nb + 48u], SX);
            o0 = coopMultiplyAdd(a06, b0, o0);
            o1 = coopMultiplyAdd(a06, b1, o1);
            o2 = coopMultiplyAdd(a06, b2, o2);
            o3 = coopMultiplyAdd(a06, b3, o3);
            o4 = coopMultiplyAdd(a16, b0, o4);
            o5 = coopMultiplyAdd(a16, b1, o5);
            o6 = coopMultiplyAdd(a16, b2, o6);
            o7 = coopMultiplyAdd(a16, b3, o7);
            let b4 = coopLoadT<coop_mat16x16<f16, B>>(&Bh[16u * SX + nb + 0u], SX);
            let b5 = coopLoadT<coop_mat16x16<f16, B>>(&Bh[16u * SX + nb + 16u], SX);
            let b6 = coopLoadT<coop_mat16x16<f16, B>>(&Bh[16u * SX + nb + 32u], SX);
            let b7 = coopLoadT<coop_mat16x16<f16, B>>(&Bh[16u * SX + nb + 48u], SX);
            o0 = coopMultiplyAdd(a07, b4, o0);
            o1 = coopMultiplyAdd(a07, b5, o1);
            o2 = coopMultiplyAdd(a07, b6, o2);
            o3 = coopMultiplyAdd(a07, b7, o3);
            o4 = coopMultiplyAdd(a17, b4, o4);
            o5 = coopMultiplyAdd(a17, b5, o5);
            o6 = coopMultiplyAdd(a17, b6, o6);
            o7 = coopMultiplyAdd(a17, b7, o7);
            // The other buffer was last read before the previous barrier.
            put_xa(nx, li);
            workgroupBarrier();
        }
        // The accumulators to the slab through the subgroup's Ct slot, one per round.
        let slot = sg_index * 256u;
        coopStoreT(o0, &Ct[slot], 16u);
        workgroupBarrier();
        let v0 = take_frag(lane);
        workgroupBarrier();
        add_frag(v0, 0u, 0u, w, out_base, n_out, d0, inv, lane);
        coopStoreT(o1, &Ct[slot], 16u);
        workgroupBarrier();
        let v1 = take_frag(lane);
        workgroupBarrier();
        add_frag(v1, 0u, 1u, w, out_base, n_out, d0, inv, lane);
        coopStoreT(o2, &Ct[slot], 16u);
        workgroupBarrier();
        let v2 = take_frag(lane);
        workgroupBarrier();
        add_frag(v2, 0u, 2u, w, out_base, n_out, d0, inv, lane);
        coopStoreT(o3, &Ct[slot], 16u);
        workgroupBarrier();
        let v3 = take_frag(lane);
        workgroupBarrier();
        add_frag(v3, 0u, 3u, w, out_base, n_out, d0, inv, lane);
        coopStoreT(o4, &Ct[slot], 16u);
        workgroupBarrier();
        let v4 = take_frag(lane);
        workgroupBarrier();
        add_frag(v4, 1u, 0u, w, out_base, n_out, d0, inv, lane);
        coopStoreT(o5, &Ct[slot], 16u);
        workgroupBarrier();
        let v5 = take_frag(lane);
        workgroupBarrier();
        add_frag(v5, 1u, 1u, w, out_base, n_out, d0, inv, lane);
        coopStoreT(o6, &Ct[slot], 16u);
        workgroupBarrier();
        let v6 = take_frag(lane);
        workgroupBarrier();
        add_frag(v6, 1u, 2u, w, out_base, n_out, d0, inv, lane);
        coopStoreT(o7, &Ct[slot], 16u);
        workgroupBarrier();
        let v7 = take_frag(lane);
        workgroupBarrier();
        add_frag(v7, 1u, 3u, w, out_base, n_out, d0, inv, lane);
    }
}

// Adds the workgroup's entry counts (kept_e, skipped_e summed over its invocations, through
// Ct: exact below 2^24 per subgroup) and tile counts to its counter slot, after its last tile
// (whose last workgroup access is behind a barrier).
fn flush_coop(li: u32, lane: u32, kept_tiles: u32, skipped_tiles: u32, kept_e: u32,
              skipped_e: u32, slot: u32) {
    let ke = subgroupAdd(kept_e);
    let se = subgroupAdd(skipped_e);
    workgroupBarrier();
    if lane == 0u {
        Ct[2u * sg_index] = f32(ke);
        Ct[2u * sg_index + 1u] = f32(se);
    }
    workgroupBarrier();
    if li == 0u {
        var a = 0u;
        var b = 0u;
        for (var q = 0u; q < 8u; q++) {
            a += u32(Ct[2u * q]);
            b += u32(Ct[2u * q + 1u]);
        }
        counters[slot * 4u] = kept_tiles;
        counters[slot * 4u + 1u] = skipped_tiles;
        counters[slot * 4u + 2u] = a;
        counters[slot * 4u + 3u] = b;
    }
}
