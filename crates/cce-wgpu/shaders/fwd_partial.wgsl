// fwd_partial.wgsl: forward pass, online log-sum-exp over the class tiles of one split.
//
// Parameters
//   bindings 0-3: see tile_io.wgsl (params, e, c, bias of the current row/class chunk).
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
//   [s*split_tiles, (s+1)*split_tiles) of the chunk. Per tile, in two halves of HR = 4 of its
//   8 rows, each thread reduces each row over its own 8 classes into a Part (max, Σ exp(z −
//   max), ...) stored by `red_put`; after a barrier the owner of each row merges the WG Parts
//   of the row, in tx order, into the row's running state in `rows` (workgroup memory, so no
//   thread keeps state for 8 rows in registers), then a barrier frees the slots. The slots
//   (HR·WG·WG Parts) are the including shader's: the idle logits panels of gemm.wgsl
//   (fwd_red_panels.wgsl) or an array of their own (fwd_red_own.wgsl), so that the forward's
//   workgroup memory stays near the panels' (a 26 KiB forward ran 3.4x slower than the same
//   loop in 2 KiB on the H200). Deterministic, no atomics.
// Thread mapping
//   As tile_io.wgsl: thread (tx, ty) owns rows ty*8.. and classes tx*8.. of each tile; the owner
//   of tile row rl is thread rl mod WG*WG (rows rl = li, li + WG*WG, ...).
// Bounds
//   tgt[r], tlogit[r] and part[r*part_stride + part_base + split] only for r < n_rows, with
//   split = workgroup_id.x < part_stride − part_base (host-checked); slot (ty*HR + i % HR)*WG
//   + tx < HR*WG*WG and, in a fold, s*WG + j with s < WG*HR, j < WG (the slot files' bounds);
//   rows[rl] and ys[rl] with rl < TILE.

@group(0) @binding(4) var<storage, read> tgt: array<i32>;
@group(0) @binding(5) var<storage, read_write> part: array<Part>;
@group(0) @binding(6) var<storage, read_write> tlogit: array<f32>;

// Micro-tile rows per half of a tile's epilogue: slots for HR·WG·WG Parts.
const HR: u32 = 4u;
// Per tile row: the running state over the tiles so far.
var<workgroup> rows: array<Part, 8u * WG>;
// Per tile row: its target (global class), -1 for none or past the chunk.
var<workgroup> ys: array<i32, 8u * WG>;

fn part_empty() -> Part {
    return Part(NEG_BIG, 0.0, 0.0, 0.0, NEG_BIG, NO_INDEX, 0.0, 0u);
}

// Merge of two Parts (b after a: ties of the argmax go to the lower class).
fn merge(a: Part, b: Part) -> Part {
    let m = max(a.m, b.m);
    let fa = exp(a.m - m);
    let fb = exp(b.m - m);
    var av = a.av;
    var ai = a.ai;
    if b.av > av || (b.av == av && b.ai < ai) {
        av = b.av;
        ai = b.ai;
    }
    return Part(m, a.s * fa + b.s * fb, a.w * fa + b.w * fb, a.sz + b.sz, av, ai,
                a.r * fa + b.r * fb, a.mk | b.mk);
}

// The Part of tile row `rl` (chunk row r) over the thread's 8 classes: logits (lo, hi), bias
// (b_lo, b_hi), the first of the 8 classes global index gj0, `n_ok` of them in the chunk.
// Writes the target logit when the row's target is among them.
fn row_part(lo: vec4<f32>, hi: vec4<f32>, b_lo: vec4<f32>, b_hi: vec4<f32>, rl: u32, r: u32,
            gj0: u32, n_ok: u32) -> Part {
    var st = part_empty();
    let y = ys[rl];
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
            st.mk |= MASK_ANY;
            if !is_neg_inf(pick8(b_lo, b_hi, jj)) {
                st.mk |= MASK_NOT_BIAS;
            }
            continue;
        }
        if jj < 4u {
            z_lo[jj] = z;
        } else {
            z_hi[jj - 4u] = z;
        }
        used |= 1u << jj;
        st.sz += z;
        if z > st.av {
            st.av = z;
            st.ai = gj;
        }
        st.m = max(st.m, z);
    }
    for (var jj = 0u; jj < n_ok; jj++) {
        if (used & (1u << jj)) != 0u {
            let z = pick8(z_lo, z_hi, jj);
            let ez = exp(z - st.m);
            st.s += ez;
            st.w += ez * z;
            if i32(gj0 + jj) != y {
                st.r += ez;
            }
        }
    }
    return st;
}

// row_part of micro-tile row i, whose logits (lo, hi) the caller passes by value (so no
// pointer to `acc` crosses a call made more than once).
fn put_row(lo: vec4<f32>, hi: vec4<f32>, i: u32, b: array<vec4<f32>, 2>, r_base: u32, tx: u32,
           ty: u32, gj0: u32, n_ok: u32) {
    let rl = ty * 8u + i;
    let r = r_base + rl;
    var st = part_empty();
    if r < P.n_rows {
        st = row_part(lo, hi, b[0], b[1], rl, r, gj0, n_ok);
    }
    red_put((ty * HR + i % HR) * WG + tx, st);
}

// Start of the pass over rows r_base.. (invocation `li`): targets into `ys`, empty running
// states into `rows`; ends with a barrier.
fn fwd_begin(r_base: u32, li: u32) {
    for (var rl = li; rl < tile(); rl += WG * WG) {
        let r = r_base + rl;
        ys[rl] = -1;
        if r < P.n_rows {
            ys[rl] = tgt[r];
        }
        rows[rl] = part_empty();
    }
    workgroupBarrier();
}

// After every thread's `put_row` of micro-tile rows p0..p0 + HR of one tile: the row owners
// merge the half's Parts into `rows`, between two barriers (the slots are then free for the
// next half, or, in fwd_red_panels.wgsl, the panels for the next tile's logits). The first
// half's `put_row` must follow a barrier after the tile's last read of the panels
// (the barrier the passes put before their first `put_row`).
fn fwd_fold_half(li: u32, p0: u32) {
    workgroupBarrier();
    for (var s = li; s < WG * HR; s += WG * WG) {
        let rl = (s / HR) * 8u + p0 + s % HR;
        var st = rows[rl];
        for (var j = 0u; j < WG; j++) {
            st = merge(st, red_get(s * WG + j));
        }
        rows[rl] = st;
    }
    workgroupBarrier();
}

// End of the pass: the running states of rows r_base.. into column `split` of `part`.
fn fwd_end(r_base: u32, split: u32, li: u32) {
    workgroupBarrier();
    for (var rl = li; rl < tile(); rl += WG * WG) {
        let r = r_base + rl;
        if r < P.n_rows {
            part[r * P.part_stride + P.part_base + split] = rows[rl];
        }
    }
}

// The pass for workgroup `wid`, invocation `lid` (index `li`) on a logits tile held in an
// `Acc`; the entry point is fwd_main.wgsl's (FMA logits) or logits_coop.wgsl's
// (cooperative-matrix logits). The named main loop has its own pass (src/named.rs) over the
// same fwd_begin / put_row / fwd_fold / fwd_end.
fn fwd_partial(wid: vec3<u32>, lid: vec3<u32>, li: u32) {
    let t = tile();
    var acc: Acc;
    let tx = lid.x;
    let ty = lid.y;
    let split = wid.x;
    let r_base = wid.y * t;
    let n_ct = (P.n_cls + t - 1u) / t;
    let ct0 = split * P.split_tiles;
    let ct1 = min(ct0 + P.split_tiles, n_ct);

    fwd_begin(r_base, li);
    for (var ct = ct0; ct < ct1; ct++) {
        let c_base = ct * t;
        logits_tile(&acc, r_base, c_base, tx, ty, li);
        let j0 = c_base + tx * 8u;
        let b = ld_bias8(j0);
        let n_ok = min(P.n_cls - min(j0, P.n_cls), 8u);
        let gj0 = P.cls0 + j0;
        workgroupBarrier();
        put_row(acc[0], acc[1], 0u, b, r_base, tx, ty, gj0, n_ok);
        put_row(acc[2], acc[3], 1u, b, r_base, tx, ty, gj0, n_ok);
        put_row(acc[4], acc[5], 2u, b, r_base, tx, ty, gj0, n_ok);
        put_row(acc[6], acc[7], 3u, b, r_base, tx, ty, gj0, n_ok);
        fwd_fold_half(li, 0u);
        put_row(acc[8], acc[9], 4u, b, r_base, tx, ty, gj0, n_ok);
        put_row(acc[10], acc[11], 5u, b, r_base, tx, ty, gj0, n_ok);
        put_row(acc[12], acc[13], 6u, b, r_base, tx, ty, gj0, n_ok);
        put_row(acc[14], acc[15], 7u, b, r_base, tx, ty, gj0, n_ok);
        fwd_fold_half(li, 4u);
    }
    fwd_end(r_base, split, li);
}
