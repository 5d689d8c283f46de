// stat_reduce.wgsl: per-row dropped-mass statistics over the valid rows of one row chunk.
//
// Parameters
//   binding 0 `P`: n_rows of the chunk; FLAG_FIRST on the first chunk.
//   binding 1 `dropped` [n_rows] u32: dropped mass per row in 2^-30 units.
//   binding 2 `tgt`     [n_rows] i32: prepared targets (-1 ignored; those rows are skipped).
//   binding 3 `out`     [2] u32, read_write: max over rows (2^-30 units) and the running sum
//                       as f32 bits (mass units).
// Tiling
//   One workgroup of 256 threads, strided rows then a fixed tree (deterministic).
// Thread mapping
//   local_invocation_index = t.
// Bounds
//   dropped[r], tgt[r] for r < n_rows (loop bound); out[0..1]; smax/ssum[t] and [t + h] below
//   256 (h <= 128 only for t < h).

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> dropped: array<u32>;
@group(0) @binding(2) var<storage, read> tgt: array<i32>;
@group(0) @binding(3) var<storage, read_write> out: array<u32>;

var<workgroup> smax: array<u32, 256>;
var<workgroup> ssum: array<f32, 256>;

@compute @workgroup_size(256, 1, 1)
fn main(@builtin(local_invocation_index) t: u32) {
    var mx = 0u;
    var sm = 0.0;
    for (var r = t; r < P.n_rows; r += 256u) {
        if tgt[r] >= 0 {
            let v = dropped[r];
            mx = max(mx, v);
            sm += f32(v) / FIXED_ONE;
        }
    }
    smax[t] = mx;
    ssum[t] = sm;
    workgroupBarrier();
    for (var h = 128u; h > 0u; h >>= 1u) {
        if t < h {
            smax[t] = max(smax[t], smax[t + h]);
            ssum[t] += ssum[t + h];
        }
        workgroupBarrier();
    }
    if t == 0u {
        var pm = out[0];
        var ps = bitcast<f32>(out[1]);
        if has_flag(FLAG_FIRST) {
            pm = 0u;
            ps = 0.0;
        }
        out[0] = max(pm, smax[0]);
        out[1] = bitcast<u32>(ps + ssum[0]);
    }
}
