// gemm.wgsl: the logits tile shared by the forward, threshold and backward shaders
// (prepended after common.wgsl).
//
// Parameters
//   binding 1 `e_buf`: e rows of the row chunk, [n_rows, D] row-major, dtype DTYPE, starting at
//                      element `P.e_off`.
//   binding 2 `c_buf`: c rows of the class chunk, [n_cls, D] row-major, from element `P.c_off`.
//   binding 3 `b_buf`: bias of the class chunk, [n_cls], from element `P.b_off` (FLAG_BIAS).
// Tiling
//   A logits tile is TILE x TILE (rows x classes), TILE = 8 * WG (override WG, default 8, so
//   64 x 64). The depth loop walks D in steps of TK (override, default 16) through workgroup
//   memory: As[k][row] and Bs[k][class] panels of TK x TILE f32, stored as vec4.
// Thread mapping
//   WG x WG threads; thread (tx, ty) = local_invocation_id.xy owns the 8 x 8 micro-tile of rows
//   ty*8 .. ty*8+7 and classes tx*8 .. tx*8+7, held in `acc` as acc[2*i + jj/4][jj % 4] for
//   row ty*8+i, class tx*8+jj (f32 accumulation); `acc` is a function-local `Acc` passed by
//   pointer.
// Bounds
//   e: word_of(e_off + r*D + k) only for r < n_rows, k < D (the staging guards), so below
//   the binding's e_off + n_rows*D elements; c likewise with j < n_cls; bias: word_of(b_off + j)
//   only with FLAG_BIAS and j < n_cls. As/Bs: (k*TILE + m)/4 with k < TK, m < TILE, below
//   TK*TILE/4 = TK*WG*2. acc: indices 2i + jj/4 < 16 for i, jj < 8.

override WG: u32 = 8u;
override TK: u32 = 16u;
const MT: u32 = 8u;

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> e_buf: array<u32>;
@group(0) @binding(2) var<storage, read> c_buf: array<u32>;
@group(0) @binding(3) var<storage, read> b_buf: array<u32>;

var<workgroup> As: array<vec4<f32>, TK * WG * 2u>;
var<workgroup> Bs: array<vec4<f32>, TK * WG * 2u>;
// The thread's 8 x 8 micro-tile (a function-local variable of each entry point, passed by
// pointer, so that drivers keep it in registers).
alias Acc = array<vec4<f32>, 16>;

fn tile() -> u32 {
    return WG * MT;
}

fn ld_e(i: u32) -> f32 {
    let j = i + P.e_off;
    return decode(e_buf[word_of(j)], j);
}

fn ld_c(i: u32) -> f32 {
    let j = i + P.c_off;
    return decode(c_buf[word_of(j)], j);
}

// Bias of class `j` of the chunk (0 without bias).
fn ld_bias(j: u32) -> f32 {
    if !has_flag(FLAG_BIAS) {
        return 0.0;
    }
    let k = j + P.b_off;
    return decode(b_buf[word_of(k)], k);
}

// As[k][m] = e[r_base + m][k0 + k] (0 outside the chunk).
fn stage_a_rows_e(r_base: u32, k0: u32, li: u32) {
    let t = tile();
    let nthreads = WG * WG;
    for (var f = li; f < TK * t; f += nthreads) {
        let k = f % TK;
        let m = f / TK;
        let r = r_base + m;
        var v = 0.0;
        if r < P.n_rows && k0 + k < P.d {
            v = ld_e(r * P.d + k0 + k);
        }
        As[(k * t + m) / 4u][m & 3u] = v;
    }
}

// Bs[k][m] = c[c_base + m][k0 + k] (0 outside the chunk).
fn stage_b_rows_c(c_base: u32, k0: u32, li: u32) {
    let t = tile();
    let nthreads = WG * WG;
    for (var f = li; f < TK * t; f += nthreads) {
        let k = f % TK;
        let m = f / TK;
        let j = c_base + m;
        var v = 0.0;
        if j < P.n_cls && k0 + k < P.d {
            v = ld_c(j * P.d + k0 + k);
        }
        Bs[(k * t + m) / 4u][m & 3u] = v;
    }
}

// Bs[k][m] = c[j_base + k][d0 + m] for k < TK (0 outside).
fn stage_b_cols_c(j_base: u32, d0: u32, li: u32) {
    let t = tile();
    let nthreads = WG * WG;
    for (var f = li; f < TK * t; f += nthreads) {
        let m = f % t;
        let k = f / t;
        let j = j_base + k;
        var v = 0.0;
        if j < P.n_cls && d0 + m < P.d {
            v = ld_c(j * P.d + d0 + m);
        }
        Bs[(k * t + m) / 4u][m & 3u] = v;
    }
}

// Bs[k][m] = e[r_base + k][d0 + m] for k < TK (0 outside).
fn stage_b_cols_e(r_base: u32, d0: u32, li: u32) {
    let t = tile();
    let nthreads = WG * WG;
    for (var f = li; f < TK * t; f += nthreads) {
        let m = f % t;
        let k = f / t;
        let r = r_base + k;
        var v = 0.0;
        if r < P.n_rows && d0 + m < P.d {
            v = ld_e(r * P.d + d0 + m);
        }
        Bs[(k * t + m) / 4u][m & 3u] = v;
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

// acc += As^T Bs over one TK panel.
fn mma_panel(acc: ptr<function, Acc>, tx: u32, ty: u32) {
    let t4 = 2u * WG;
    for (var k = 0u; k < TK; k++) {
        outer(acc, As[k * t4 + 2u * ty], As[k * t4 + 2u * ty + 1u], Bs[k * t4 + 2u * tx], Bs[k * t4 + 2u * tx + 1u]);
    }
}

// acc = logits (without bias) of rows r_base.. x classes c_base.. of the chunk.
fn logits_tile(acc: ptr<function, Acc>, r_base: u32, c_base: u32, tx: u32, ty: u32, li: u32) {
    zero_acc(acc);
    for (var k0 = 0u; k0 < P.d; k0 += TK) {
        stage_a_rows_e(r_base, k0, li);
        stage_b_rows_c(c_base, k0, li);
        workgroupBarrier();
        mma_panel(acc, tx, ty);
        workgroupBarrier();
    }
}

// Entry (i, jj) of the thread's micro-tile.
fn acc_get(acc: ptr<function, Acc>, i: u32, jj: u32) -> f32 {
    return (*acc)[2u * i + jj / 4u][jj & 3u];
}

fn acc_set(acc: ptr<function, Acc>, i: u32, jj: u32, v: f32) {
    (*acc)[2u * i + jj / 4u][jj & 3u] = v;
}
