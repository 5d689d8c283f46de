// gemm.wgsl: the double-buffered workgroup panels of the f32 FMA products, shared by the
// forward, threshold and backward shaders (prepended after common.wgsl and tile_io.wgsl);
// the logits tile's main loop follows in logits_scalar.wgsl or logits_quad.wgsl (the
// configuration's `MainLoop`).
//
// Parameters
//   Bindings and flags of tile_io.wgsl; override TK.
// Tiling
//   The depth loop walks D in panels of TK (override, a multiple of 4 dividing TILE,
//   default 16) through workgroup memory, double buffered: while the panel in half `buf` of
//   As/Bs is multiplied out, the next panel is loaded from global memory into registers
//   (raw words, `Pref`), then decoded and stored into the other half; one barrier per panel.
//   Panel layout: As[buf][k][m] (k < TK, m < TILE, four m per vec4), Bs likewise; As is
//   declared by the including pass (panel_a.wgsl or grad.wgsl), Bs here.
//   A panel is TILE*TK/4 groups of four consecutive elements of one source row (along D for
//   the logits' row panels, along the D slice for the backward's column panels); thread li
//   loads groups li + s*WG*WG for s < NG = 2*TK/WG (an integer <= MAXG, host-checked).
// Thread mapping
//   As tile_io.wgsl; `outer` adds one depth step of the thread's 8 x 8 micro-tile.
// Bounds
//   Groups are valid (`nv` > 0) only for source rows in the chunk and columns < D, and read
//   through tile_io.wgsl's `load4`. As/Bs: ((buf*TK + k)*TILE + m)/4 with buf < 2, k < TK,
//   m < TILE, below 2*TK*TILE/4 = 4*TK*WG. Pref: index s < NG <= MAXG. Scratch slots q < WG*WG
//   <= 4*TK*WG (WG <= 2*TK since NG = 2*TK/WG >= 1).

override TK: u32 = 16u;
// Groups of four elements one thread loads per panel.
override NG: u32 = 2u * TK / WG;
// Register room for a thread's groups of one panel (NG <= MAXG, host-checked).
const MAXG: u32 = 8u;

// The A panels `As` (at least 4*TK*WG vec4) are declared by the including pass: panel_a.wgsl
// (exactly that) or grad.wgsl (16*WG*WG vec4, which also hold the backward's G tile).
var<workgroup> Bs: array<vec4<f32>, 4u * TK * WG>;
// Raw words of a thread's groups of one panel: word x of group s holds element x.
alias Pref = array<vec4<u32>, MAXG>;

// A group: element index of its first element in the source binding, valid elements, and
// its place in the panel (k: depth row, m: first tile column of the four).
struct Grp {
    i: u32,
    nv: u32,
    k: u32,
    m: u32,
}

// Group g of a row panel: source rows base.. (n_src of them exist), depth k0..; the group is
// tile row m = g / (TK/4), depths k0 + 4q .. +3 with q = g % (TK/4). In the panel it fills
// column m of depth rows 4q .. 4q+3.
fn rows_group(is_e: bool, base: u32, n_src: u32, k0: u32, g: u32) -> Grp {
    let m = g / (TK / 4u);
    let k = 4u * (g % (TK / 4u));
    let col = k0 + k;
    var nv = 0u;
    if base + m < n_src && col < P.d {
        nv = min(P.d - col, 4u);
    }
    return Grp(src_off(is_e) + (base + m) * P.d + col, nv, k, m);
}

// Group g of a column panel: source rows j_base + k for k < TK (n_src exist), columns
// d0 + 4q .. +3 of the D slice with k = g / (TILE/4), q = g % (TILE/4). In the panel it fills
// columns 4q .. 4q+3 of depth row k.
fn cols_group(is_e: bool, j_base: u32, n_src: u32, d0: u32, g: u32) -> Grp {
    let t4 = 2u * WG;
    let k = g / t4;
    let m = 4u * (g % t4);
    let col = d0 + m;
    var nv = 0u;
    if j_base + k < n_src && col < P.d {
        nv = min(P.d - col, 4u);
    }
    return Grp(src_off(is_e) + (j_base + k) * P.d + col, nv, k, m);
}

fn fetch_rows(pf: ptr<function, Pref>, is_e: bool, base: u32, n_src: u32, k0: u32, li: u32) {
    for (var s = 0u; s < NG; s++) {
        let gr = rows_group(is_e, base, n_src, k0, li + s * WG * WG);
        (*pf)[s] = load4(is_e, gr.i, gr.nv);
    }
}

fn fetch_cols(pf: ptr<function, Pref>, is_e: bool, j_base: u32, n_src: u32, d0: u32, li: u32) {
    for (var s = 0u; s < NG; s++) {
        let gr = cols_group(is_e, j_base, n_src, d0, li + s * WG * WG);
        (*pf)[s] = load4(is_e, gr.i, gr.nv);
    }
}

// Store a column panel of e (`is_e`) or c into Bs[buf] (as it lies: one vec4 per group).
fn put_cols_b(pf: ptr<function, Pref>, is_e: bool, j_base: u32, n_src: u32, d0: u32, li: u32,
              buf: u32) {
    let t = tile();
    for (var s = 0u; s < NG; s++) {
        let gr = cols_group(is_e, j_base, n_src, d0, li + s * WG * WG);
        Bs[((buf * TK + gr.k) * t + gr.m) >> 2u] = decode4((*pf)[s], gr.i);
    }
}

// The panels as scratch for a pass's own reduction once its products are done (after the
// barrier that closes its last panel, before the next product's first store): slot q holds
// two vec4, As[q] and Bs[q]; q < 4*TK*WG (callers use q < WG*WG, and WG <= 2*TK is
// host-checked).
fn scratch_put(q: u32, a: vec4<f32>, b: vec4<f32>) {
    As[q] = a;
    Bs[q] = b;
}

fn scratch_get(q: u32) -> array<vec4<f32>, 2> {
    return array<vec4<f32>, 2>(As[q], Bs[q]);
}

// acc[i][j] += a[i] * b[j] for one depth step.
fn outer(acc: ptr<function, Acc>, a0: vec4<f32>, a1: vec4<f32>, b0: vec4<f32>, b1: vec4<f32>) {
    (*acc)[0] = fma(vec4<f32>(a0.x), b0, (*acc)[0]);
    (*acc)[1] = fma(vec4<f32>(a0.x), b1, (*acc)[1]);
    (*acc)[2] = fma(vec4<f32>(a0.y), b0, (*acc)[2]);
    (*acc)[3] = fma(vec4<f32>(a0.y), b1, (*acc)[3]);
    (*acc)[4] = fma(vec4<f32>(a0.z), b0, (*acc)[4]);
    (*acc)[5] = fma(vec4<f32>(a0.z), b1, (*acc)[5]);
    (*acc)[6] = fma(vec4<f32>(a0.w), b0, (*acc)[6]);
    (*acc)[7] = fma(vec4<f32>(a0.w), b1, (*acc)[7]);
    (*acc)[8] = fma(vec4<f32>(a1.x), b0, (*acc)[8]);
    (*acc)[9] = fma(vec4<f32>(a1.x), b1, (*acc)[9]);
    (*acc)[10] = fma(vec4<f32>(a1.y), b0, (*acc)[10]);
    (*acc)[11] = fma(vec4<f32>(a1.y), b1, (*acc)[11]);
    (*acc)[12] = fma(vec4<f32>(a1.z), b0, (*acc)[12]);
    (*acc)[13] = fma(vec4<f32>(a1.z), b1, (*acc)[13]);
    (*acc)[14] = fma(vec4<f32>(a1.w), b0, (*acc)[14]);
    (*acc)[15] = fma(vec4<f32>(a1.w), b1, (*acc)[15]);
}
