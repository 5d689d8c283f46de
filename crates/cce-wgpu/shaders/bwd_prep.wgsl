// bwd_prep.wgsl: backward pass, per-row coefficients of G (MATH.md, "Backward").
//
// Parameters
//   binding 0 `P`: n_rows; flags FLAG_DLOSS_ROWS (upstream d_loss per row), FLAG_DLSE
//                  (upstream d_lse given), FLAG_LS_ANALYTIC; aux = g for a scalar d_loss
//                  (d_out / n_valid for mean, d_out for sum and none); ls_alpha, z_loss, v_total.
//   binding 1 `tgt`   [n_rows] i32: prepared targets (-1 ignored).
//   binding 2 `lse`   [n_rows] f32: saved lse.
//   binding 3 `dloss` [n_rows] f32: upstream ∂L/∂loss_i (read only with FLAG_DLOSS_ROWS).
//   binding 4 `dlse`  [n_rows] f32: upstream ∂L/∂lse_i (read only with FLAG_DLSE).
//   binding 5 `rs`    [n_rows] RowState out (common.wgsl), tau = 0, with
//                     G_ij = (a p_ij − b [j = y] − c) · softcap factor,
//                     a = g (1 + 2λ lse) + h, b = g (1 − α), c = g α / V (0 when analytic).
// Tiling
//   None: one thread per row.
// Thread mapping
//   global_invocation_id.x = row of the chunk; 64 threads per workgroup.

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> tgt: array<i32>;
@group(0) @binding(2) var<storage, read> lse_in: array<f32>;
@group(0) @binding(3) var<storage, read> dloss: array<f32>;
@group(0) @binding(4) var<storage, read> dlse: array<f32>;
@group(0) @binding(5) var<storage, read_write> rs: array<RowState>;

@compute @workgroup_size(64, 1, 1)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let r = gid.x;
    if r >= P.n_rows {
        return;
    }
    let y = tgt[r];
    let lse = lse_in[r];
    var g = 0.0;
    if y >= 0 {
        g = P.aux;
        if has_flag(FLAG_DLOSS_ROWS) {
            g = dloss[r];
        }
    }
    var h = 0.0;
    if has_flag(FLAG_DLSE) {
        h = dlse[r];
    }
    let a = g * (1.0 + 2.0 * P.z_loss * lse) + h;
    let b = g * (1.0 - P.ls_alpha);
    var c = g * P.ls_alpha / f32(P.v_total);
    if has_flag(FLAG_LS_ANALYTIC) {
        c = 0.0;
    }
    var live = 0u;
    if g != 0.0 || h != 0.0 {
        live = 1u;
    }
    rs[r] = RowState(y, lse, a, b, c, g, 0.0, live);
}
