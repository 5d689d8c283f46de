// fwd_merge.wgsl: forward pass, per-row merge of the split partials, loss and side outputs.
//
// Parameters
//   binding 0 `P`: n_rows, row0, part_stride, v_total, ls_alpha, z_loss of the row chunk.
//   binding 1 `part`    [n_rows, part_stride] Part: partials of fwd_partial.wgsl.
//   binding 2 `tgt`     [n_rows] i32: prepared targets (-1 ignored).
//   binding 3 `tlogit`  [n_rows] f32: z at the target class.
//   binding 4 `lse`     [n_rows] f32 out: log Σ_j exp(z_ij) (nats).
//   binding 5 `loss`    [n_rows] f32 out: ℓ_i = lse − (1−α) z_y − (α/V) Σ_j z_ij + λ lse², 0 at
//                       ignored rows (MATH.md, "Forward").
//   binding 6 `ent`     [n_rows] f32 out: entropy lse − Σ_j p_ij z_ij.
//   binding 7 `amax`    [n_rows] i32 out: argmax (lowest index on ties).
//   binding 8 `bad`     [4] atomic u32: smallest global row (u32::MAX for none) whose
//                       [0] lse is NaN or +inf, or that holds a −inf logit whose bias is not
//                       −inf (a −inf in e or c); [1] valid target is masked (its logit is
//                       −inf); [2] valid target has any masked class (an error only under
//                       label smoothing, checked by the host).
//   binding 9 `rest`    [n_rows] f32 out: 1 − p_y = Σ_{j≠y} e^{z−m} / Σ_j e^{z−m}, without
//                       cancellation; 0 at ignored rows.
// The loss is −log p_y + α (z_y − Σ_j z_ij / V) + λ lse²; −log p_y is −log(1 − rest) by
// `neg_log1m` when p_y ≥ 1/2 (lse − z_y would cancel on a confident row), else lse − z_y.
// A row whose every class is masked has lse −inf (only an ignored row may; a valid one has a
// masked target).
// Tiling
//   None: one thread per row; partials merged in column order (deterministic).
// Thread mapping
//   global_invocation_id.x = row of the chunk; 64 threads per workgroup.
// Bounds
//   Per-row arrays at r < n_rows (guard); part[r*part_stride + k] with k < part_stride;
//   bad[0..2] of 4 words.

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> part: array<Part>;
@group(0) @binding(2) var<storage, read> tgt: array<i32>;
@group(0) @binding(3) var<storage, read> tlogit: array<f32>;
@group(0) @binding(4) var<storage, read_write> lse_out: array<f32>;
@group(0) @binding(5) var<storage, read_write> loss_out: array<f32>;
@group(0) @binding(6) var<storage, read_write> ent_out: array<f32>;
@group(0) @binding(7) var<storage, read_write> amax_out: array<i32>;
@group(0) @binding(8) var<storage, read_write> bad: array<atomic<u32>>;
@group(0) @binding(9) var<storage, read_write> rest_out: array<f32>;

@compute @workgroup_size(64, 1, 1)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let r = gid.x;
    if r >= P.n_rows {
        return;
    }
    var bm = NEG_BIG;
    for (var k = 0u; k < P.part_stride; k++) {
        bm = max(bm, part[r * P.part_stride + k].m);
    }
    var bs = 0.0;
    var bw = 0.0;
    var br = 0.0;
    var bmk = 0u;
    var bsz = 0.0;
    var av = NEG_BIG;
    var ai = NO_INDEX;
    for (var k = 0u; k < P.part_stride; k++) {
        let st = part[r * P.part_stride + k];
        let f = exp(st.m - bm);
        bs += st.s * f;
        bw += st.w * f;
        br += st.r * f;
        bmk |= st.mk;
        bsz += st.sz;
        if st.av > av || (st.av == av && st.ai < ai) {
            av = st.av;
            ai = st.ai;
        }
    }
    let y = tgt[r];
    let all_masked = bs == 0.0 && (bmk & MASK_ANY) != 0u;
    var lse = bm + log(bs);
    var ent = lse - bw / bs;
    if all_masked {
        lse = bitcast<f32>(NEG_INF_BITS);
        ent = 0.0;
        ai = 0u;
    }
    lse_out[r] = lse;
    ent_out[r] = ent;
    amax_out[r] = i32(ai);
    var loss = 0.0;
    var rest = 0.0;
    if y >= 0 && !all_masked {
        rest = br / bs;
        let zy = tlogit[r];
        var ce = lse - zy;
        if rest < 0.5 {
            ce = neg_log1m(rest);
        }
        let a = P.ls_alpha;
        var smoothing = 0.0;
        if a != 0.0 {
            smoothing = a * (zy - bsz / f32(P.v_total));
        }
        loss = ce + smoothing + P.z_loss * lse * lse;
    }
    loss_out[r] = loss;
    rest_out[r] = rest;
    if (!is_finite(lse) && !all_masked) || (bmk & MASK_NOT_BIAS) != 0u {
        atomicMin(&bad[0], P.row0 + r);
    }
    if y >= 0 && (all_masked || is_neg_inf(tlogit[r])) {
        atomicMin(&bad[1], P.row0 + r);
    }
    if y >= 0 && (bmk & MASK_ANY) != 0u {
        atomicMin(&bad[2], P.row0 + r);
    }
}
