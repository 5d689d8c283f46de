// bwd_tau.wgsl: threshold pass, per-row threshold τ_i from the histogram
// (cce_core::filter::FilterRule::threshold, in exact integer arithmetic).
//
// Parameters
//   binding 0 `P`: n_rows; delta_fixed = floor(max_dropped_mass · 2^30).
//   binding 1 `hist`  [n_rows, N_BINS] u32: fixed-point mass per bin (bwd_hist.wgsl).
//   binding 2 `edges` [N_BINS] f32: bin upper edges.
//   binding 3 `rs`    [n_rows] RowState, read_write: `tau` is set.
// Tiling
//   None: one thread per row. τ_i = edge(k) for the smallest k such that the mass of bins
//   k.. is ≤ δ, else 0 (skip nothing).
// Thread mapping
//   global_invocation_id.x = row of the chunk; 64 threads per workgroup.
// Bounds
//   hist[r*N_BINS + k] and rs[r] for r < n_rows (guard), k < N_BINS; edges[best] only when
//   best < N_BINS.

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> hist: array<u32>;
@group(0) @binding(2) var<storage, read> edges: array<f32>;
@group(0) @binding(3) var<storage, read_write> rs: array<RowState>;

@compute @workgroup_size(64, 1, 1)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let r = gid.x;
    if r >= P.n_rows {
        return;
    }
    var below = 0u;
    var best = N_BINS;
    for (var kk = 0u; kk < N_BINS; kk++) {
        let k = N_BINS - 1u - kk;
        below += hist[r * N_BINS + k];
        if below <= P.delta_fixed {
            best = k;
        } else {
            break;
        }
    }
    var tau = 0.0;
    if best < N_BINS {
        tau = edges[best];
    }
    rs[r].tau = tau;
}
