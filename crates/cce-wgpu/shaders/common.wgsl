// common.wgsl: declarations shared by every cce-wgpu shader (prepended to each file).
//
// Parameters
//   `Params` (uniform, binding 0 of every shader): sizes and offsets of the chunk a dispatch
//   works on, flags, and option scalars. Field order matches `Params` in src/pipelines.rs.
//   Element offsets (`e_off`, `c_off`, `b_off`, `out_off`) are in elements of the bound
//   buffer's dtype, relative to the (256-byte aligned) start of the binding.
// Tiling
//   None here (see tile_io.wgsl and gemm.wgsl).
// Thread mapping
//   None here.
// Bounds
//   No storage access here. Workgroup and storage arrays of every shader are indexed as its
//   own header states; the host checks each binding against the extent the shader may touch
//   (src/bounds.rs) before every dispatch, so modules are created without wgpu's runtime
//   checks.
//
// dtype override `DTYPE`: 0 = f32 (one element per u32 word), 1 = f16, 2 = bf16 (two elements
// per u32 word, element 2k in the low half). Storage buffers of floats are `array<u32>` for all
// three, so no `enable f16` is needed and bf16 is converted with shifts.

struct Params {
    n_rows: u32,      // rows (tokens) in this row chunk
    n_cls: u32,       // classes in this class chunk
    d: u32,           // hidden size D
    v_total: u32,     // vocabulary size V
    row0: u32,        // global index of the chunk's first row
    cls0: u32,        // global index of the chunk's first class
    e_off: u32,       // element offset of e[row0, 0] in the e binding
    c_off: u32,       // element offset of c[cls0, 0] in the c binding
    b_off: u32,       // element offset of bias[cls0] in the bias binding
    flags: u32,       // FLAG_* bits
    split_tiles: u32, // tiles per split (class tiles for row-owned passes, row tiles for class-owned)
    part_base: u32,   // first partial column of this class chunk (forward)
    part_stride: u32, // partial columns per row (forward)
    slot_base: u32,   // first counter slot of this dispatch
    slab_stride: u32, // elements per accumulator slab
    n_slabs: u32,     // slabs to sum (finalize)
    out_off: u32,     // element offset of the first output element in the out binding
    delta_fixed: u32, // max_dropped_mass in 2^-30 units
    n_units: u32,     // work items of a 1-D dispatch
    split_base: u32,  // split index of the dispatch's first workgroup column (backward waves)
    softcap: f32,     // softcap s (FLAG_SOFTCAP)
    ls_alpha: f32,    // label smoothing alpha
    z_loss: f32,      // z-loss weight lambda
    eps: f32,         // resolved filter_eps
    aux: f32,         // pass-specific scalar (g for scalar d_loss, alpha/V in finalize, scale)
    pad1: f32,
    pad2: f32,
    pad3: f32,
}

const FLAG_SOFTCAP: u32 = 1u;
const FLAG_BIAS: u32 = 2u;
const FLAG_FILTER: u32 = 4u;
const FLAG_REPORT: u32 = 8u;
const FLAG_DLOSS_ROWS: u32 = 16u;
const FLAG_DLSE: u32 = 32u;
const FLAG_LS_ANALYTIC: u32 = 64u;
const FLAG_LAST: u32 = 128u;
const FLAG_WEIGHTED: u32 = 256u;
const FLAG_FIRST: u32 = 512u;

// Stand-in for -inf (WGSL math may assume finite values).
const NEG_BIG: f32 = -3.0e38;
// 2^30: fixed-point scale of probability mass (cce_core::filter::FIXED_POINT_ONE).
const FIXED_ONE: f32 = 1073741824.0;
// Histogram bins (cce_core::filter::N_BINS).
const N_BINS: u32 = 65u;

override DTYPE: u32 = 0u;

fn has_flag(f: u32) -> bool {
    return (P.flags & f) != 0u;
}

// Element `i` of a float array stored as u32 words in dtype DTYPE, given the word holding it.
fn decode(w: u32, i: u32) -> f32 {
    if DTYPE == 0u {
        return bitcast<f32>(w);
    }
    let h = select(w & 0xffffu, w >> 16u, (i & 1u) == 1u);
    if DTYPE == 1u {
        return unpack2x16float(h).x;
    }
    return bitcast<f32>(h << 16u);
}

// Word index of element `i`.
fn word_of(i: u32) -> u32 {
    if DTYPE == 0u {
        return i;
    }
    return i >> 1u;
}

// f32 -> bf16 bits, round to nearest even, NaN kept quiet.
fn f32_to_bf16(x: f32) -> u32 {
    let u = bitcast<u32>(x);
    if (u & 0x7fffffffu) > 0x7f800000u {
        return ((u >> 16u) | 0x40u) & 0xffffu;
    }
    return ((u + 0x7fffu + ((u >> 16u) & 1u)) >> 16u) & 0xffffu;
}

// Two values packed into one word of dtype DTYPE (f16 or bf16).
fn encode2(lo: f32, hi: f32) -> u32 {
    if DTYPE == 1u {
        return pack2x16float(vec2<f32>(lo, hi));
    }
    return f32_to_bf16(lo) | (f32_to_bf16(hi) << 16u);
}

fn is_finite(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7f800000u) != 0x7f800000u;
}

// −inf by its bits (a masked logit: p = 0). Compared as bits, since WGSL math may assume
// finite values.
const NEG_INF_BITS: u32 = 0xff800000u;
fn is_neg_inf(x: f32) -> bool {
    return bitcast<u32>(x) == NEG_INF_BITS;
}

// tanh(u) with full relative accuracy for every u: the builtin loses it for small |u|
// (tanh(u) = u(1 + O(u²)) then comes out of a difference of exponentials), which a large
// softcap s turns into large relative errors of z = s·tanh(x/s). For |u| < 0.625 the odd
// minimax polynomial of Cephes' tanhf (relative error ~1 ulp), else (1 − e)/(1 + e) with
// e = e^{−2|u|} ≤ 0.29 (no cancellation, and no overflow for large |u|).
fn tanh_acc(u: f32) -> f32 {
    let a = abs(u);
    if a < 0.625 {
        let z = u * u;
        let p = ((((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z
            + 1.33314422036e-1) * z - 3.33332819422e-1) * z;
        return u + u * p;
    }
    let e = exp(-2.0 * a);
    let t = (1.0 - e) / (1.0 + e);
    return select(t, -t, u < 0.0);
}

// z = s tanh(x / s) under softcap, else x. Only finite logits are capped: one that
// overflowed f32 stays infinite (or NaN), so the lse check reports the overflow, and a −inf
// (masked) logit stays masked.
fn cap(x: f32) -> f32 {
    if has_flag(FLAG_SOFTCAP) && is_finite(x) {
        return P.softcap * tanh_acc(x / P.softcap);
    }
    return x;
}

// dz/dx = 1 − tanh²(x/s) under softcap, as 4e/(1 + e)² with e = e^{−2|x/s|}: 1 − tanh² would
// cancel for large |x/s| (small caps), this does not (0 for a −inf logit).
fn dcap(x: f32) -> f32 {
    let e = exp(-2.0 * abs(x / P.softcap));
    return 4.0 * e / ((1.0 + e) * (1.0 + e));
}

// −log(1 − r) for r in [0, 1/2] with full relative accuracy (WGSL has no log1p):
// 2 atanh(t), t = r / (2 − r) ≤ 1/3, by its series 2(t + t³/3 + t⁵/5 + ...), 9 terms
// ((1/9)^9 / 19 < 2⁻³⁰).
fn neg_log1m(r: f32) -> f32 {
    let t = r / (2.0 - r);
    let t2 = t * t;
    var s = 1.0 / 19.0;
    for (var k = 8; k >= 0; k--) {
        s = 1.0 / f32(2 * k + 1) + t2 * s;
    }
    return 2.0 * t * s;
}

// "No argmax yet": larger than any class index, and not a NaN pattern when bitcast to f32.
const NO_INDEX: u32 = 0x3fffffffu;

// Forward partial of one (row, split): online log-sum-exp state and argmax.
struct Part {
    m: f32,   // running max of z
    s: f32,   // Σ exp(z − m)
    w: f32,   // Σ exp(z − m) · z
    sz: f32,  // Σ z
    av: f32,  // largest z
    ai: u32,  // its class (global index), NO_INDEX if none
    r: f32,   // Σ_{j≠y} exp(z − m): the non-target part of s, so 1 − p_y = r / s
    mk: u32,  // MASK_* bits of the row's −inf logits
}

// A logit of the row is −inf (masked).
const MASK_ANY: u32 = 1u;
// A logit of the row is −inf although its bias is not (a −inf in e or c, or an overflow).
const MASK_NOT_BIAS: u32 = 2u;

// Backward coefficients of one row: G_ij = (a p_ij − c) · softcap factor off the target,
// gy · softcap factor at it.
struct RowState {
    y: i32,       // target class (global index) or -1
    lse: f32,     // saved lse
    a: f32,       // g (1 + 2 λ lse) + h
    gy: f32,      // the target's G before the softcap factor, from the saved rest mass
                  // (bwd_prep.wgsl), without cancellation on confident rows
    c: f32,       // g α / V, or 0 when label smoothing is analytic
    g: f32,       // upstream gradient of the row's loss (0 at ignored rows)
    tau: f32,     // filter threshold τ_i (0: skip nothing)
    live: u32,    // 1 when the row's G is not identically 0
    g0y: f32,     // the target's g0 (cce-core filter.rs), from the rest mass
    pad0: u32,
    pad1: u32,
    pad2: u32,
}
