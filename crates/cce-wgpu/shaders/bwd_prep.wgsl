// bwd_prep.wgsl: backward pass, per-row coefficients of G (MATH.md, "Backward").
//
// Parameters
//   binding 0 `P`: n_rows; row0 = first row of the chunk; flags FLAG_DLOSS_ROWS (upstream d_loss per row), FLAG_DLSE
//                  (upstream d_lse given), FLAG_LS_ANALYTIC; aux = g for a scalar d_loss
//                  (d_out / n_valid for mean, d_out for sum and none); ls_alpha, z_loss, v_total.
//   binding 1 `tgt`   [n_rows] i32: prepared targets (-1 ignored).
//   binding 2 `lse`   [n_rows] f32: saved lse.
//   binding 3 `dloss` [n_rows] f32: upstream ∂L/∂loss_i (read only with FLAG_DLOSS_ROWS).
//   binding 4 `dlse`  [n_rows] f32: upstream ∂L/∂lse_i (read only with FLAG_DLSE).
//   binding 5 `rs`    [n_rows] RowState out (common.wgsl), tau = 0, with
//                     G_ij = (a p_ij − c) · softcap factor off the target,
//                     a = g (1 + 2λ lse) + h, c = g α / V (0 when analytic), and at the target
//                     gy = g (α − rest + 2λ lse (1 − rest)) + h (1 − rest) − c, which is
//                     a p_y − g (1 − α) − c with p_y = 1 − rest rearranged so that a confident
//                     row (rest → 0) does not cancel; g0y = max(rest, |w − p_y|) with
//                     w − 1 = −(g (α + 2λ lse) + h) / a (the p at which the target's G vanishes,
//                     cce-core filter.rs; w = 0 when a = 0).
//   binding 6 `rest`  [n_rows] f32: saved rest mass 1 − p_y (the forward's `rest_mass`).
//   binding 7 `status` [5] atomic u32, read_write: the backward's status words (backend
//                     status.rs), u32::MAX until a check fails; here atomicMin of the row
//                     (row0 + r) into word 0 for an lse that is NaN, +inf, or −inf at a valid
//                     row; 1 for a non-finite rest; 2 for a non-finite dloss (FLAG_DLOSS_ROWS);
//                     3 for a non-finite dlse (FLAG_DLSE) — cce-core's check_saved_finite and
//                     check_upstream_finite, every row ignored or not.
// Tiling
//   None: one thread per row.
// Thread mapping
//   global_invocation_id.x = row of the chunk; 64 threads per workgroup.
// Bounds
//   Per-row arrays at r < n_rows (guard); dloss and dlse only under their flags (otherwise
//   the binding is a 256-byte stand-in that is never read); status[0..3].

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> tgt: array<i32>;
@group(0) @binding(2) var<storage, read> lse_in: array<f32>;
@group(0) @binding(3) var<storage, read> dloss: array<f32>;
@group(0) @binding(4) var<storage, read> dlse: array<f32>;
@group(0) @binding(5) var<storage, read_write> rs: array<RowState>;
@group(0) @binding(6) var<storage, read> rest_in: array<f32>;
@group(0) @binding(7) var<storage, read_write> status: array<atomic<u32>>;

// Word `k` of the status takes the row when `bad` (the first bad row of the call wins).
fn report_row(bad: bool, k: u32, r: u32) {
    if bad {
        atomicMin(&status[k], P.row0 + r);
    }
}

@compute @workgroup_size(64, 1, 1)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let r = gid.x;
    if r >= P.n_rows {
        return;
    }
    let y = tgt[r];
    let lse = lse_in[r];
    let rest = rest_in[r];
    // −inf is the lse of a row whose every class is masked: only an ignored row may have it.
    report_row(!is_finite(lse) && !(is_neg_inf(lse) && y < 0), 0u, r);
    report_row(!is_finite(rest), 1u, r);
    var g = 0.0;
    if has_flag(FLAG_DLOSS_ROWS) {
        let gr = dloss[r];
        report_row(!is_finite(gr), 2u, r);
        if y >= 0 {
            g = gr;
        }
    } else if y >= 0 {
        g = P.aux;
    }
    var h = 0.0;
    if has_flag(FLAG_DLSE) {
        h = dlse[r];
        report_row(!is_finite(h), 3u, r);
    }
    let a = g * (1.0 + 2.0 * P.z_loss * lse) + h;
    var c = g * P.ls_alpha / f32(P.v_total);
    if has_flag(FLAG_LS_ANALYTIC) {
        c = 0.0;
    }
    var live = 0u;
    if g != 0.0 || h != 0.0 {
        live = 1u;
    }
    var gy = 0.0;
    var g0y = 0.0;
    if y >= 0 {
        let py = 1.0 - rest;
        gy = g * ((P.ls_alpha - rest) + 2.0 * P.z_loss * lse * py) + h * py - c;
        var w1 = -1.0;
        if a != 0.0 {
            w1 = -(g * (P.ls_alpha + 2.0 * P.z_loss * lse) + h) / a;
        }
        g0y = max(rest, abs(w1 + rest));
    }
    rs[r] = RowState(y, lse, a, gy, c, g, 0.0, live, g0y, 0u, 0u, 0u);
}
