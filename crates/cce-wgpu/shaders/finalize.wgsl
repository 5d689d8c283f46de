// finalize.wgsl: gradient output of one chunk: Σ of the f32 slabs, plus the analytic
// label-smoothing term, rounded once to the output dtype (DTYPE).
//
// Parameters
//   binding 0 `P`: n_units = elements of the chunk (rows · D, or classes for d_bias); d = row
//                  length of `vec`; n_slabs, slab_stride; out_off = element offset of the chunk
//                  in the out binding (even for 2-byte dtypes); aux = α / V; flags:
//                  FLAG_LS_ANALYTIC with FLAG_WEIGHTED: value −= aux · g_row · vec[col] (d_e);
//                  FLAG_LS_ANALYTIC alone: value −= aux · vec[col] (d_c, d_bias).
//   binding 1 `slab` [n_slabs, slab_stride] f32: partial sums.
//   binding 2 `vec`  f32 from element e_off: Σ_j c_j (d_e), Σ_i g_i e_i (d_c) or Σ_i g_i
//                    (d_bias, e_off = D).
//   binding 3 `rs`   [rows] RowState: g of each row (d_e only).
//   binding 4 `out`  u32 words of dtype DTYPE, read_write.
//   binding 5 `status` [5] atomic u32, read_write: the backward's status words (backend
//                    status.rs); word 4 is set to 0 when a value written is NaN or ±inf (in
//                    f32, before the output dtype's rounding), the CPU backward's overflow check.
// Tiling
//   None. For 2-byte dtypes one thread writes one whole u32 word (two elements), so no two
//   threads touch the same word; chunk boundaries fall on even elements.
// Thread mapping
//   global_invocation_id.x + 65535*64*global_invocation_id.y = unit (element or word).
// Bounds
//   slab[s*slab_stride + idx] with s < n_slabs, idx < n_units; vec_in[e_off + idx % d] and
//   rs[idx / d] only under FLAG_LS_ANALYTIC (d >= 1, host-checked); out[out_off + u] (f32) or
//   out[out_off/2 + u] (16-bit, out_off even, host-checked) for units below n_units;
//   status[4].

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> slab: array<f32>;
@group(0) @binding(2) var<storage, read> vec_in: array<f32>;
@group(0) @binding(3) var<storage, read> rs: array<RowState>;
@group(0) @binding(4) var<storage, read_write> out: array<u32>;
@group(0) @binding(5) var<storage, read_write> status: array<atomic<u32>>;

// The gradient value `v`, with status word 4 set when it is not finite.
fn checked(v: f32) -> f32 {
    if !is_finite(v) {
        atomicStore(&status[4], 0u);
    }
    return v;
}

fn value(idx: u32) -> f32 {
    var v = 0.0;
    for (var s = 0u; s < P.n_slabs; s++) {
        v += slab[s * P.slab_stride + idx];
    }
    if has_flag(FLAG_LS_ANALYTIC) {
        let col = idx % P.d;
        var coef = P.aux;
        if has_flag(FLAG_WEIGHTED) {
            coef *= rs[idx / P.d].g;
        }
        v -= coef * vec_in[P.e_off + col];
    }
    return v;
}

@compute @workgroup_size(64, 1, 1)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let u = gid.x + gid.y * 65535u * 64u;
    if DTYPE == 0u {
        if u < P.n_units {
            out[P.out_off + u] = bitcast<u32>(checked(value(u)));
        }
        return;
    }
    let i0 = 2u * u;
    if i0 >= P.n_units {
        return;
    }
    let lo = checked(value(i0));
    var hi = 0.0;
    if i0 + 1u < P.n_units {
        hi = checked(value(i0 + 1u));
    }
    out[P.out_off / 2u + u] = encode2(lo, hi);
}
