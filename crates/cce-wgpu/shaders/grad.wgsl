// grad.wgsl: the FMA backward's second product from G tiles, its workgroup flags and counters
// (prepended to bwd_de.wgsl and bwd_dc.wgsl after tile_io.wgsl, gemm.wgsl and grad_rows.wgsl,
// which declares bindings 4, 6 and 7 and computes G).
//
// Parameters
//   bindings 4 `rs`, 6 `dropped`, 7 `counters`: declared in grad_rows.wgsl.
//   binding 5 `slab`     f32 accumulators, read_write (layout in the including shader),
//                        declared with its update `add_rows4_v` in slab_rmw.wgsl (a slab per
//                        workgroup column, read-modify-write) or slab_atomic.wgsl (one slab,
//                        f32 atomic adds).
// Tiling
//   The G tile stays in registers: each thread keeps its 8 x 8 block of G for the whole
//   second product, as eight depth vectors (two vec4 each, `gt`): for d_e (X = c) depth
//   vector q is the block's class column tx*8 + q (its 8 rows ty*8..), for d_c (X = e) the
//   block's row ty*8 + q (its 8 classes tx*8..). The second product (see the including
//   shader) multiplies G, as the A operand [k][m], by TILE-wide slices of D of e or c exactly
//   as the logits loop multiplies its panels: per TK-deep step, the G panel (depths k0..,
//   staged from the registers of the threads that own those depths, `put_gp`) in gemm.wgsl's
//   As[buf] and the X panel (fetched from global memory) in Bs[buf], double buffered, one
//   barrier per step, in one pipeline across the tile's slices (each slice's last step stages
//   the next slice's first panels, so only the tile's first X panel is fetched with nothing
//   to overlap it). A pass's workgroup memory is the logits panels As and Bs (panel_a.wgsl,
//   gemm.wgsl: 8 KiB at 8:8) and a few words.
// Thread mapping
//   As tile_io.wgsl: G(i, jj) of the thread's micro-tile replaces acc(i, jj); each thread reads
//   its rows' states from `rs` when it needs them (no workgroup copy). In the product thread
//   (tx, ty) owns output rows m = ty*8.. and columns tx*8.. of the slice, and stages the depth
//   rows own*8 + q (own = tx for d_e, ty for d_c) of each G panel that holds them, at columns
//   other*8.. (other = ty for d_e, tx for d_c).
// Bounds
//   rs[r] and dropped[r] only for r < n_rows; counters[slot*4 + 0..3] with slot = slot_base
//   + workgroup index, below slot_base + grid size (host-checked against the binding);
//   As[(buf*TK + kk)*2WG + 2*other + 1] with buf < 2, kk < TK (put_gp stores only those),
//   other < WG: below 4*TK*WG; the product's As and Bs reads (buf*TK + k)*2WG + 2ty + 1 and
//   + 2tx + 1 likewise; Bs and the panel loads as gemm.wgsl; slab: as slab_rmw.wgsl or
//   slab_atomic.wgsl.
//

// The A panels: the logits tile's, then the G panels (header).
var<workgroup> As: array<vec4<f32>, 4u * TK * WG>;
var<workgroup> flag_a: atomic<u32>;
var<workgroup> flag_u: u32;
var<workgroup> cnt: array<atomic<u32>, 4>;

// Depth vector q (lo, hi) of the thread's G block (q a constant at every call) into the G
// panel of depths k0 .. k0 + TK − 1 in As[buf], when its depth own*8 + q lies in that panel:
// As[buf][own*8 + q − k0][other*8 ..] (header).
fn put_gp(lo: vec4<f32>, hi: vec4<f32>, q: u32, own: u32, other: u32, k0: u32, buf: u32) {
    let kk = own * 8u + q - k0;
    if kk < TK {
        let f = (buf * TK + kk) * 2u * WG + 2u * other;
        As[f] = lo;
        As[f + 1u] = hi;
    }
}

// The G panel of depths k0.. into As[buf] from the thread's depth vectors in gt (as the
// header: gt[2q], gt[2q + 1]), by the threads that own some of those depths.
fn put_gp8(gt: ptr<function, Acc>, own: u32, other: u32, k0: u32, buf: u32) {
    if own * 8u + 8u > k0 && own * 8u < k0 + TK {
        put_gp((*gt)[0], (*gt)[1], 0u, own, other, k0, buf);
        put_gp((*gt)[2], (*gt)[3], 1u, own, other, k0, buf);
        put_gp((*gt)[4], (*gt)[5], 2u, own, other, k0, buf);
        put_gp((*gt)[6], (*gt)[7], 3u, own, other, k0, buf);
        put_gp((*gt)[8], (*gt)[9], 4u, own, other, k0, buf);
        put_gp((*gt)[10], (*gt)[11], 5u, own, other, k0, buf);
        put_gp((*gt)[12], (*gt)[13], 6u, own, other, k0, buf);
        put_gp((*gt)[14], (*gt)[15], 7u, own, other, k0, buf);
    }
}

// The thread's place in the G panels: (own, other) = (tx, ty) for d_e (X = c), (ty, tx) for
// d_c (X = e, `is_e`).
fn g_own(is_e: bool, tx: u32, ty: u32) -> vec2<u32> {
    return select(vec2<u32>(tx, ty), vec2<u32>(ty, tx), is_e);
}

// The first panels of a tile's first D slice (d0 = 0): G depths 0.. from gt and X = e
// (`is_e`) or c, rows j_base.., n_src of them in the chunk, into half 0, then a barrier. The
// caller's last reads of As/Bs are behind a barrier. Later slices find their first panels
// staged by the previous slice's last step (prod_slice).
fn prod_begin(gt: ptr<function, Acc>, pb: ptr<function, Pref>, is_e: bool, j_base: u32,
              n_src: u32, tx: u32, ty: u32, li: u32) {
    let o = g_own(is_e, tx, ty);
    fetch_cols(pb, is_e, j_base, n_src, 0u, li);
    put_gp8(gt, o.x, o.y, 0u, 0u);
    put_cols_b(pb, is_e, j_base, n_src, 0u, li, 0u);
    workgroupBarrier();
}

// The half holding the first panels of the slice at d0: the slices' panels run as one
// sequence of TILE/TK panels per slice, alternating halves (0 for every shape the host
// accepts: TILE/TK = 16/NG with NG in {1, 2, 4, 8}).
fn slice_buf(d0: u32) -> u32 {
    let t = tile();
    return ((d0 / t) * (t / TK)) & 1u;
}

// acc = Σ_k G[k][m] · X[j_base + k][d0 + n] over the TILE depths k of the tile (m: the
// thread's rows ty*8.., n: its columns tx*8.. of the D slice at d0; G from the threads'
// registers `gt`), X = e (`is_e`) or c with n_src rows in the chunk; the G and X panels
// double buffered through As and Bs as in logits_tile, in one pipeline over all the slices of
// the tile: the slice's first panels are already staged (prod_begin for d0 = 0, else the
// previous slice), and its last step stages the next slice's first panels (`pb` carries the
// X panel's raw words between calls). Ends with a barrier; between two slices the caller
// touches no workgroup memory.
fn prod_slice(acc: ptr<function, Acc>, gt: ptr<function, Acc>, pb: ptr<function, Pref>,
              is_e: bool, j_base: u32, n_src: u32, d0: u32, tx: u32, ty: u32, li: u32) {
    let t = tile();
    let t4 = 2u * WG;
    let o = g_own(is_e, tx, ty);
    zero_acc(acc);
    var buf = slice_buf(d0);
    for (var k0 = 0u; k0 < t; k0 += TK) {
        // The next panels: this slice's next TK depths, or the next slice's first.
        let more = k0 + TK < t;
        let next = more || d0 + t < P.d;
        let nk = select(0u, k0 + TK, more);
        let nd = select(d0 + t, d0, more);
        if next {
            fetch_cols(pb, is_e, j_base + nk, n_src, nd, li);
        }
        for (var k = 0u; k < TK; k++) {
            let ka = (buf * TK + k) * t4 + 2u * ty;
            let kb = (buf * TK + k) * t4 + 2u * tx;
            outer(acc, As[ka], As[ka + 1u], Bs[kb], Bs[kb + 1u]);
        }
        if next {
            put_gp8(gt, o.x, o.y, nk, buf ^ 1u);
            put_cols_b(pb, is_e, j_base + nk, n_src, nd, li, buf ^ 1u);
        }
        workgroupBarrier();
        buf ^= 1u;
    }
}

// Workgroup-uniform OR of `need`.
fn decide(need: bool, li: u32) -> bool {
    if need {
        atomicOr(&flag_a, 1u);
    }
    workgroupBarrier();
    if li == 0u {
        flag_u = atomicLoad(&flag_a);
        atomicStore(&flag_a, 0u);
    }
    return workgroupUniformLoad(&flag_u) != 0u;
}

fn init_shared(li: u32) {
    if li == 0u {
        atomicStore(&flag_a, 0u);
        for (var k = 0u; k < 4u; k++) {
            atomicStore(&cnt[k], 0u);
        }
    }
    workgroupBarrier();
}

// Adds the workgroup's counts to its slot (after all tiles).
fn flush_counters(li: u32, kept_tiles: u32, skipped_tiles: u32, kept_e: u32, skipped_e: u32,
                  slot: u32) {
    atomicAdd(&cnt[2], kept_e);
    atomicAdd(&cnt[3], skipped_e);
    workgroupBarrier();
    if li == 0u {
        counters[slot * 4u] = kept_tiles;
        counters[slot * 4u + 1u] = skipped_tiles;
        counters[slot * 4u + 2u] = atomicLoad(&cnt[2]);
        counters[slot * 4u + 3u] = atomicLoad(&cnt[3]);
    }
}
