// wsum.wgsl: column sums for the analytic label-smoothing terms (MATH.md, "Backward"):
// out[d] += Σ_r w_r X[r][d] over the rows of one chunk, and out[D] += Σ_r w_r.
//
// Parameters
//   binding 0 `P`: n_rows (rows of X in this chunk), d; e_off = element offset of X[0][0];
//                  FLAG_WEIGHTED: w_r = rs[r].g (X = e, gives Σ_i g_i e_i and Σ_i g_i), else
//                  w_r = 1 (X = c, gives Σ_j c_j).
//   binding 1 `x`   [n_rows, D] dtype DTYPE (u32 words).
//   binding 2 `rs`  [n_rows] RowState (read with FLAG_WEIGHTED).
//   binding 3 `out` [D + 1] f32, read_write: running sums over chunks (dispatched in order).
// Tiling
//   None; each thread walks its column over the chunk's rows in order (deterministic).
// Thread mapping
//   global_invocation_id.x = column d (d = D: the sum of weights).
// Bounds
//   x at e_off + r*D + d for r < n_rows, d < D; rs[r] only with FLAG_WEIGHTED; out[d] for
//   d <= D (guard), out holding D + 1 floats.

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> x_buf: array<u32>;
@group(0) @binding(2) var<storage, read> rs: array<RowState>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64, 1, 1)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let d = gid.x;
    if d > P.d {
        return;
    }
    let weighted = has_flag(FLAG_WEIGHTED);
    var s = 0.0;
    for (var r = 0u; r < P.n_rows; r++) {
        var w = 1.0;
        if weighted {
            w = rs[r].g;
        }
        if d == P.d {
            s += w;
        } else if w != 0.0 {
            let i = P.e_off + r * P.d + d;
            s += w * decode(x_buf[word_of(i)], i);
        }
    }
    out[d] += s;
}
