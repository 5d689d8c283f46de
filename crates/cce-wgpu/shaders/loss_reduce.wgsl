// loss_reduce.wgsl: mean/sum reduction of the per-row losses, one row chunk per dispatch.
//
// Parameters
//   binding 0 `P`: n_rows of the chunk; flags FLAG_LAST on the last chunk; aux = scale
//                  (1/n_valid for mean, 1 for sum; a mean over no valid row is rejected on the
//                  host, CceError::AllTargetsIgnored).
//   binding 1 `loss_rows` [n_rows] f32: per-row losses (0 at ignored rows).
//   binding 2 `out`       [1] f32, read_write: running sum; on the last chunk, sum * scale.
//                         The first chunk's dispatch starts from 0 (FLAG_FIRST).
// Tiling
//   One workgroup of 256 threads; thread t sums rows t, t+256, ... in order, then a fixed
//   tree in workgroup memory (deterministic).
// Thread mapping
//   local_invocation_index = t.
// Bounds
//   loss_rows[r] for r < n_rows (loop bound); out[0]; sh[t + h] below 256 (t < h <= 128).

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> loss_rows: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

var<workgroup> sh: array<f32, 256>;

@compute @workgroup_size(256, 1, 1)
fn main(@builtin(local_invocation_index) t: u32) {
    var acc = 0.0;
    for (var r = t; r < P.n_rows; r += 256u) {
        acc += loss_rows[r];
    }
    sh[t] = acc;
    workgroupBarrier();
    for (var h = 128u; h > 0u; h >>= 1u) {
        if t < h {
            sh[t] += sh[t + h];
        }
        workgroupBarrier();
    }
    if t == 0u {
        var prev = out[0];
        if has_flag(FLAG_FIRST) {
            prev = 0.0;
        }
        var total = prev + sh[0];
        if has_flag(FLAG_LAST) {
            total *= P.aux;
        }
        out[0] = total;
    }
}
