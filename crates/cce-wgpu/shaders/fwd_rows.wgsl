// fwd_rows.wgsl: the forward partials' per-row online log-sum-exp state and its update, shared
// by the micro-tile pass (fwd_partial.wgsl, the named pass of src/named.rs) and the
// cooperative-matrix pass of logits_coop128w.wgsl.
//
// Parameters
//   binding 4 `tgt`    [n_rows] i32: prepared target class of each row (global index), -1 ignored.
//   binding 5 `part`   [n_rows, part_stride] Part (common.wgsl), read_write: per (row, split)
//                      the online log-sum-exp state and argmax; column `part_base + split`.
//   binding 6 `tlogit` [n_rows] f32, read_write: z at the row's target class (written by the
//                      one invocation whose classes hold it; −inf when masked).
// A −inf logit (a class masked by the bias) has p = 0: it adds nothing to the sums and never
// becomes the running max (which stays at the finite stand-in NEG_BIG), so a tile or a row
// whose every logit is masked gives s = 0, never NaN; `mk` records it. The running max is also
// the largest z (`av` of the Part); a NaN logit never becomes it (`z > m` is false) and makes
// s NaN, so the merge reports the row.
// Tiling
//   None of its own: `row_step` extends one row's state by up to 8 classes in registers;
//   `merge_run` merges two states (the later classes second).
// Thread mapping
//   None of its own (the callers').
// Bounds
//   tgt[r] and tlogit[r] for the r < n_rows its callers pass.

@group(0) @binding(4) var<storage, read> tgt: array<i32>;
@group(0) @binding(5) var<storage, read_write> part: array<Part>;
@group(0) @binding(6) var<storage, read_write> tlogit: array<f32>;

// A thread's running state of one row over the classes it has seen: a Part without `av` (the
// largest z is `m`) and `mk` (kept by the caller, two bits per row, in one word for all 8).
struct Run {
    m: f32,  // running max of z (NEG_BIG: none yet)
    s: f32,  // Σ exp(z − m)
    w: f32,  // Σ exp(z − m) · z
    sz: f32, // Σ z
    r: f32,  // Σ_{j≠y} exp(z − m)
    ai: u32, // class of the largest z (global index, lowest on ties), NO_INDEX if none
}

// `row_step`'s result: the extended state and the MASK_* bits of the classes it added.
struct Step {
    run: Run,
    mk: u32,
}

fn run_empty() -> Run {
    return Run(NEG_BIG, 0.0, 0.0, 0.0, 0.0, NO_INDEX);
}

// Merge of two states (argmax ties go to the lower class).
fn merge_run(a: Run, b: Run) -> Run {
    let m = max(a.m, b.m);
    let fa = exp(a.m - m);
    let fb = exp(b.m - m);
    var ai = a.ai;
    if b.m > a.m || (b.m == a.m && b.ai < a.ai) {
        ai = b.ai;
    }
    return Run(m, a.s * fa + b.s * fb, a.w * fa + b.w * fb, a.sz + b.sz, a.r * fa + b.r * fb,
               ai);
}

// The state `st` of chunk row r (target y) extended by the thread's 8 classes of one tile:
// logits (lo, hi), bias (b_lo, b_hi), the first class's global index gj0 (above every class of
// `st`), `n_ok` of them in the chunk. Writes the target logit when the row's target is among
// them.
fn row_step(st: Run, lo: vec4<f32>, hi: vec4<f32>, b_lo: vec4<f32>, b_hi: vec4<f32>, y: i32,
            r: u32, gj0: u32, n_ok: u32) -> Step {
    var m = st.m;
    var ai = st.ai;
    var sz = st.sz;
    var mk = 0u;
    var z_lo = vec4<f32>(0.0);
    var z_hi = vec4<f32>(0.0);
    var used = 0u;
    for (var jj = 0u; jj < n_ok; jj++) {
        let x = pick8(lo, hi, jj) + pick8(b_lo, b_hi, jj);
        let z = cap(x);
        let gj = gj0 + jj;
        if i32(gj) == y {
            tlogit[r] = z;
        }
        if is_neg_inf(z) {
            mk |= MASK_ANY;
            if !is_neg_inf(pick8(b_lo, b_hi, jj)) {
                mk |= MASK_NOT_BIAS;
            }
            continue;
        }
        if jj < 4u {
            z_lo[jj] = z;
        } else {
            z_hi[jj - 4u] = z;
        }
        used |= 1u << jj;
        sz += z;
        // Strictly larger: of equal logits the lowest class (seen first) stays.
        if z > m {
            m = z;
            ai = gj;
        }
    }
    let f = exp(st.m - m);
    var s = st.s * f;
    var w = st.w * f;
    var rr = st.r * f;
    for (var jj = 0u; jj < n_ok; jj++) {
        if (used & (1u << jj)) != 0u {
            let z = pick8(z_lo, z_hi, jj);
            let ez = exp(z - m);
            s += ez;
            w += ez * z;
            if i32(gj0 + jj) != y {
                rr += ez;
            }
        }
    }
    return Step(Run(m, s, w, sz, rr, ai), mk);
}
