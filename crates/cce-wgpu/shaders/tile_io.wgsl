// tile_io.wgsl: what every logits-tile shader shares (prepended after common.wgsl): the
// bindings of e, c and bias, the tile side, the micro-tile type, and reads of e, c and bias.
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
//   of 4 (`vec_loads` in src/config.rs), else each element is read alone.
// Tiling
//   A logits tile is TILE x TILE (rows x classes), TILE = 8 * WG (override WG, default 8, so
//   64 x 64); how it is computed is gemm.wgsl's (FMA) or logits_coop.wgsl's (cooperative
//   matrix).
// Thread mapping
//   WG x WG threads; thread (tx, ty) = local_invocation_id.xy owns the 8 x 8 micro-tile of rows
//   ty*8 .. ty*8+7 and classes tx*8 .. tx*8+7, held in `acc` as acc[2*i + jj/4][jj % 4] for
//   row ty*8+i, class tx*8+jj (f32); `acc` is a function-local `Acc` passed by pointer and
//   indexed only by constants (the epilogues take one row's two vec4 at a time), so that
//   drivers keep it in registers.
// Bounds
//   `load4` reads the words of elements i .. i+3 of e or c only for the `nv` of them its
//   caller found valid (row in the chunk, column < D), and a whole vec4 only when all four
//   are, so below the binding's offset + rows*D elements rounded up to 16 bytes; bias:
//   word_of(b_off + j) only with FLAG_BIAS and j < n_cls. acc: constant indices < 16.

override WG: u32 = 8u;
const MT: u32 = 8u;

const FLAG_VEC_E: u32 = 1024u;
const FLAG_VEC_C: u32 = 2048u;

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> e_buf: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> c_buf: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> b_buf: array<u32>;

// The thread's 8 x 8 micro-tile (a function-local variable of each entry point, passed by
// pointer).
alias Acc = array<vec4<f32>, 16>;

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

fn zero_acc(acc: ptr<function, Acc>) {
    for (var i = 0u; i < 16u; i++) {
        (*acc)[i] = vec4<f32>(0.0);
    }
}

