// common.wgsl: declarations shared by every cce-wgpu shader (prepended to each file).
//
// Parameters
//   `Params` (uniform, binding 0 of every shader): sizes and offsets of the chunk a dispatch
//   works on, flags, and option scalars. Field order matches `Params` in src/pipelines.rs.
//   Element offsets (`e_off`, `c_off`, `b_off`, `out_off`) are in elements of the bound
//   buffer's dtype, relative to the (256-byte aligned) start of the binding.
// Tiling
//   None here (see gemm.wgsl).
// Thread mapping
//   None here.
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

// z = s tanh(x / s) under softcap, else x. Only finite logits are capped: one that
// overflowed f32 stays infinite (or NaN), so the lse check reports the overflow.
fn cap(x: f32) -> f32 {
    if has_flag(FLAG_SOFTCAP) && is_finite(x) {
        // Clamped: tanh(15) is 1 in f32, and some drivers overflow on large arguments.
        return P.softcap * tanh(clamp(x / P.softcap, -15.0, 15.0));
    }
    return x;
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
    pad0: u32,
    pad1: u32,
}

// Backward coefficients of one row: G_ij = (a p_ij − b [j = y] − c) · softcap factor.
struct RowState {
    y: i32,       // target class (global index) or -1
    lse: f32,     // saved lse
    a: f32,       // g (1 + 2 λ lse) + h
    b: f32,       // g (1 − α)
    c: f32,       // g α / V, or 0 when label smoothing is analytic
    g: f32,       // upstream gradient of the row's loss (0 at ignored rows)
    tau: f32,     // filter threshold τ_i (0: skip nothing)
    live: u32,  // 1 when the row's G is not identically 0
}
