// fwd_partial.wgsl: forward pass, online log-sum-exp over the class tiles of one split.
//
// Parameters
//   bindings 0-3: see gemm.wgsl (params, e, c, bias of the current row/class chunk).
//   binding 4 `tgt`    [n_rows] i32: prepared target class of each row (global index), -1 ignored.
//   binding 5 `part`   [n_rows, part_stride] Part (common.wgsl), read_write: per (row, split)
//                      the online log-sum-exp state and argmax; column `part_base + split`.
//   binding 6 `tlogit` [n_rows] f32, read_write: z at the row's target class (written by the
//                      one workgroup whose tiles hold it; −inf when masked).
// A −inf logit (a class masked by the bias) has p = 0: it adds nothing to the sums and never
// becomes the running max (which stays at the finite stand-in NEG_BIG), so a tile or a row
// whose every logit is masked gives s = 0, never NaN; `mk` records it.
// Tiling
//   Grid (splits, row tiles of the chunk). Split `s` covers class tiles
//   [s*split_tiles, (s+1)*split_tiles) of the chunk; each thread keeps an online
//   (max, sum, ...) state per row over its own 8 classes of every tile, merged across the WG
//   threads of a row in fixed order at the end (deterministic, no atomics).
// Thread mapping
//   As gemm.wgsl: thread (tx, ty) owns rows ty*8.. and classes tx*8.. of each tile.
// Bounds
//   tgt[r], tlogit[r] and part[r*part_stride + part_base + split] only for r < n_rows, with
//   split = workgroup_id.x < part_stride − part_base (host-checked); red[rl*WG + k] with
//   rl < TILE = 8*WG, k < WG.

@group(0) @binding(4) var<storage, read> tgt: array<i32>;
@group(0) @binding(5) var<storage, read_write> part: array<Part>;
@group(0) @binding(6) var<storage, read_write> tlogit: array<f32>;

// Per (row of tile, tx): the thread's state.
var<workgroup> red: array<Part, 8u * WG * WG>;

@compute @workgroup_size(WG, WG, 1)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    let t = tile();
    var acc: Acc;
    let tx = lid.x;
    let ty = lid.y;
    let split = wid.x;
    let r_base = wid.y * t;
    let n_ct = (P.n_cls + t - 1u) / t;
    let ct0 = split * P.split_tiles;
    let ct1 = min(ct0 + P.split_tiles, n_ct);

    var y: array<i32, 8>;
    var m: array<f32, 8>;
    var s: array<f32, 8>;
    var w: array<f32, 8>;
    var sz: array<f32, 8>;
    var amv: array<f32, 8>;
    var ami: array<u32, 8>;
    var rr: array<f32, 8>;
    var mk: array<u32, 8>;
    for (var i = 0u; i < 8u; i++) {
        let r = r_base + ty * 8u + i;
        y[i] = -1;
        if r < P.n_rows {
            y[i] = tgt[r];
        }
        m[i] = NEG_BIG;
        s[i] = 0.0;
        w[i] = 0.0;
        sz[i] = 0.0;
        amv[i] = NEG_BIG;
        ami[i] = NO_INDEX;
        rr[i] = 0.0;
        mk[i] = 0u;
    }

    for (var ct = ct0; ct < ct1; ct++) {
        let c_base = ct * t;
        logits_tile(&acc, r_base, c_base, tx, ty, li);
        var bias: array<f32, 8>;
        var ok: array<bool, 8>;
        for (var jj = 0u; jj < 8u; jj++) {
            let j = c_base + tx * 8u + jj;
            ok[jj] = j < P.n_cls;
            bias[jj] = 0.0;
            if ok[jj] {
                bias[jj] = ld_bias(j);
            }
        }
        for (var i = 0u; i < 8u; i++) {
            let r = r_base + ty * 8u + i;
            var z: array<f32, 8>;
            var use_z: array<bool, 8>;
            var lm = NEG_BIG;
            for (var jj = 0u; jj < 8u; jj++) {
                use_z[jj] = false;
                if ok[jj] {
                    let zz = cap(acc_get(&acc, i, jj) + bias[jj]);
                    z[jj] = zz;
                    let gj = P.cls0 + c_base + tx * 8u + jj;
                    if i32(gj) == y[i] && r < P.n_rows {
                        tlogit[r] = zz;
                    }
                    if is_neg_inf(zz) {
                        mk[i] |= MASK_ANY;
                        if !is_neg_inf(bias[jj]) {
                            mk[i] |= MASK_NOT_BIAS;
                        }
                        continue;
                    }
                    use_z[jj] = true;
                    sz[i] += zz;
                    if zz > amv[i] {
                        amv[i] = zz;
                        ami[i] = gj;
                    }
                    lm = max(lm, zz);
                }
            }
            if lm > m[i] {
                let f = exp(m[i] - lm);
                s[i] *= f;
                w[i] *= f;
                rr[i] *= f;
                m[i] = lm;
            }
            for (var jj = 0u; jj < 8u; jj++) {
                if use_z[jj] {
                    let ez = exp(z[jj] - m[i]);
                    s[i] += ez;
                    w[i] += ez * z[jj];
                    if i32(P.cls0 + c_base + tx * 8u + jj) != y[i] {
                        rr[i] += ez;
                    }
                }
            }
        }
    }

    for (var i = 0u; i < 8u; i++) {
        let rl = ty * 8u + i;
        red[rl * WG + tx] = Part(m[i], s[i], w[i], sz[i], amv[i], ami[i], rr[i], mk[i]);
    }
    workgroupBarrier();
    for (var rl = li; rl < t; rl += WG * WG) {
        let r = r_base + rl;
        if r < P.n_rows {
            var bm = NEG_BIG;
            for (var k = 0u; k < WG; k++) {
                bm = max(bm, red[rl * WG + k].m);
            }
            var bs = 0.0;
            var bw = 0.0;
            var bsz = 0.0;
            var av = NEG_BIG;
            var ai = NO_INDEX;
            var br = 0.0;
            var bmk = 0u;
            for (var k = 0u; k < WG; k++) {
                let st = red[rl * WG + k];
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
            part[r * P.part_stride + P.part_base + split] = Part(bm, bs, bw, bsz, av, ai, br, bmk);
        }
    }
}
