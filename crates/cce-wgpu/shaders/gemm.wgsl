// gemm.wgsl: the logits tile and the panel machinery shared by the forward, threshold and
// backward shaders (prepended after common.wgsl).
//
// Parameters
//   binding 1 `e_buf`: e rows of the row chunk, [n_rows, D] row-major, dtype DTYPE, starting at
//                      element `P.e_off`; bound as vec4<u32> (the host rounds the binding up to
//                      whole 16-byte units).
//   binding 2 `c_buf`: c rows of the class chunk, [n_cls, D] row-major, from element `P.c_off`,
//                      likewise.
//   binding 3 `b_buf`: bias of the class chunk, [n_cls], from element `P.b_off` (FLAG_BIAS).
//   FLAG_VEC_E / FLAG_VEC_C: e / c are read four elements per load (one vec4<u32> for f32,
//   half of one for f16/bf16); the host sets them when D and the element offset are multiples
//   of 4 (`vec_loads` in src/backend.rs), else each element is read alone.
// Tiling
//   A logits tile is TILE x TILE (rows x classes), TILE = 8 * WG (override WG, default 8, so
//   64 x 64). The depth loop walks D in panels of TK (override, a multiple of 4 dividing TILE,
//   default 16) through workgroup memory, double buffered: while the panel in half `buf` of
//   As/Bs is multiplied out, the next panel is loaded from global memory into registers
//   (raw words, `Pref`), then decoded and stored into the other half; one barrier per panel.
//   Panel layout: As[buf][k][m] (k < TK, m < TILE, four m per vec4), Bs likewise.
//   A panel is TILE*TK/4 groups of four consecutive elements of one source row (along D for
//   the logits' row panels, along the D slice for the backward's column panels); thread li
//   loads groups li + s*WG*WG for s < NG = 2*TK/WG (an integer <= MAXG, host-checked).
// Thread mapping
//   WG x WG threads; thread (tx, ty) = local_invocation_id.xy owns the 8 x 8 micro-tile of rows
//   ty*8 .. ty*8+7 and classes tx*8 .. tx*8+7, held in `acc` as acc[2*i + jj/4][jj % 4] for
//   row ty*8+i, class tx*8+jj (f32 accumulation); `acc` is a function-local `Acc` passed by
//   pointer and indexed only by constants (the epilogues take one row's two vec4 at a time),
//   so that drivers keep it in registers.
// Bounds
//   e: words of elements e_off + r*D + k only for r < n_rows, k < D (`nv` counts the valid
//   elements of a group; a vec4 load only when all four are valid), so below the binding's
//   e_off + n_rows*D elements rounded up to 16 bytes; c likewise with j < n_cls; bias:
//   word_of(b_off + j) only with FLAG_BIAS and j < n_cls. As/Bs: ((buf*TK + k)*TILE + m)/4
//   with buf < 2, k < TK, m < TILE, below 2*TK*TILE/4 = 4*TK*WG. Pref: index s < NG <= MAXG.
//   acc: constant indices < 16.

override WG: u32 = 8u;
override TK: u32 = 16u;
const MT: u32 = 8u;
// Groups of four elements one thread loads per panel.
override NG: u32 = 2u * TK / WG;
// Register room for a thread's groups of one panel (NG <= MAXG, host-checked).
const MAXG: u32 = 8u;

const FLAG_VEC_E: u32 = 1024u;
const FLAG_VEC_C: u32 = 2048u;

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> e_buf: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> c_buf: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> b_buf: array<u32>;

var<workgroup> As: array<vec4<f32>, 4u * TK * WG>;
var<workgroup> Bs: array<vec4<f32>, 4u * TK * WG>;
// The thread's 8 x 8 micro-tile (a function-local variable of each entry point, passed by
// pointer).
alias Acc = array<vec4<f32>, 16>;
// Raw words of a thread's groups of one panel: word x of group s holds element x.
alias Pref = array<vec4<u32>, MAXG>;

fn tile() -> u32 {
    return WG * MT;
}

// Bias of class `j` of the chunk (0 without bias).
fn ld_bias(j: u32) -> f32 {
    if !has_flag(FLAG_BIAS) {
        return 0.0;
    }
    let k = j + P.b_off;
    return decode(b_buf[word_of(k)], k);
}

// Bias of the classes j0 .. j0+7 of the chunk (0 past n_cls), as two vec4.
fn ld_bias8(j0: u32) -> array<vec4<f32>, 2> {
    var lo = vec4<f32>(0.0);
    var hi = vec4<f32>(0.0);
    if has_flag(FLAG_BIAS) {
        for (var x = 0u; x < 4u; x++) {
            if j0 + x < P.n_cls {
                lo[x] = ld_bias(j0 + x);
            }
            if j0 + 4u + x < P.n_cls {
                hi[x] = ld_bias(j0 + 4u + x);
            }
        }
    }
    return array<vec4<f32>, 2>(lo, hi);
}

// Entry x < 8 of the pair (lo, hi).
fn pick8(lo: vec4<f32>, hi: vec4<f32>, x: u32) -> f32 {
    return select(hi, lo, x < 4u)[x & 3u];
}

// One source of the panels: e (`is_e`) or c.
fn src_word(is_e: bool, w: u32) -> u32 {
    if is_e {
        return e_buf[w >> 2u][w & 3u];
    }
    return c_buf[w >> 2u][w & 3u];
}

fn src_quad(is_e: bool, q: u32) -> vec4<u32> {
    if is_e {
        return e_buf[q];
    }
    return c_buf[q];
}

fn src_off(is_e: bool) -> u32 {
    return select(P.c_off, P.e_off, is_e);
}

fn src_vec(is_e: bool) -> bool {
    return has_flag(select(FLAG_VEC_C, FLAG_VEC_E, is_e));
}

// Raw words of elements i .. i+3 of a source, of which the first `nv` exist (word 0, which
// decodes to 0.0, for the others).
fn load4(is_e: bool, i: u32, nv: u32) -> vec4<u32> {
    if nv == 0u {
        return vec4<u32>(0u);
    }
    if nv == 4u && src_vec(is_e) {
        if DTYPE == 0u {
            return src_quad(is_e, i >> 2u);
        }
        let q = src_quad(is_e, i >> 3u);
        let h = select(q.xy, q.zw, (i & 4u) != 0u);
        return vec4<u32>(h.x, h.x, h.y, h.y);
    }
    var w = vec4<u32>(0u);
    for (var x = 0u; x < nv; x++) {
        w[x] = src_word(is_e, word_of(i + x));
    }
    return w;
}

// Elements i .. i+3 from their raw words.
fn decode4(w: vec4<u32>, i: u32) -> vec4<f32> {
    return vec4<f32>(decode(w.x, i), decode(w.y, i + 1u), decode(w.z, i + 2u),
                     decode(w.w, i + 3u));
}

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

// Store a column panel of e (`is_e`) or c into Bs[buf] (as it lies: one vec4 per group).
fn put_cols_b(pf: ptr<function, Pref>, is_e: bool, j_base: u32, n_src: u32, d0: u32, li: u32,
              buf: u32) {
    let t = tile();
    for (var s = 0u; s < NG; s++) {
        let gr = cols_group(is_e, j_base, n_src, d0, li + s * WG * WG);
        Bs[((buf * TK + gr.k) * t + gr.m) >> 2u] = decode4((*pf)[s], gr.i);
    }
}

fn zero_acc(acc: ptr<function, Acc>) {
    for (var i = 0u; i < 16u; i++) {
        (*acc)[i] = vec4<f32>(0.0);
    }
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
