// fwd_partial.wgsl: forward pass, online log-sum-exp over the class tiles of one split, on a
// logits tile held in 8 x 8 micro-tiles (after fwd_rows.wgsl).
//
// Parameters
//   bindings 0-3: see tile_io.wgsl (params, e, c, bias of the current row/class chunk);
//   bindings 4-6 (`tgt`, `part`, `tlogit`) and the row state: see fwd_rows.wgsl.
// Tiling
//   Grid (splits, row tiles of the chunk). Split `s` covers class tiles
//   [s*split_tiles, (s+1)*split_tiles) of the chunk. Each thread keeps, in registers, a
//   running state (`Run`) for each of its 8 rows over its own 8 classes of every tile of the
//   split, extended tile by tile (`row_step`: one rescale per tile, no workgroup memory, no
//   barrier). At the end of the split the WG states of each row are merged in tx order through
//   the idle panels (`scratch_put` / `scratch_get`: gemm.wgsl's As/Bs, or logits_coop.wgsl's
//   Ct), one micro-tile row at a time (8 rounds of two barriers), and stored. The pass's only
//   workgroup memory is the logits tile's. Deterministic, no atomics.
// Thread mapping
//   As tile_io.wgsl: thread (tx, ty) owns rows ty*8.. and classes tx*8.. of each tile; in the
//   end round of micro-tile row i, thread li < WG merges and stores tile row li*8 + i.
// Bounds
//   tgt[r], tlogit[r] and part[r*part_stride + part_base + split] only for r < n_rows, with
//   split = workgroup_id.x < part_stride − part_base (host-checked); scratch slots
//   ty*WG + tx and li*WG + k with ty, tx, li, k < WG: below WG*WG (the scratch functions state
//   their own bounds for that range).

// row_step of micro-tile row i (rows past the chunk keep their empty state), whose logits
// (lo, hi) the caller passes by value (so no pointer to `acc` crosses a call made more than
// once); the mask bits come shifted to bits 2i, 2i+1 of the caller's word.
fn put_row(st: Run, lo: vec4<f32>, hi: vec4<f32>, i: u32, b: array<vec4<f32>, 2>,
           r_base: u32, ty: u32, gj0: u32, n_ok: u32) -> Step {
    let r = r_base + ty * 8u + i;
    if r >= P.n_rows {
        return Step(st, 0u);
    }
    let o = row_step(st, lo, hi, b[0], b[1], tgt[r], r, gj0, n_ok);
    return Step(o.run, o.mk << (2u * i));
}

// End of the pass for micro-tile row i (called for i = 0..7 in order, by every thread, after
// the split's last logits tile, whose closing barrier frees the panels): the WG states of
// tile row ty*8 + i meet in the scratch, thread li < WG merges those of tile row li*8 + i in
// tx order and stores the row's Part into column `split`. Exact through the scratch: the
// class index and mask bits travel as f32 integers below 2^16.
fn fwd_end(st: Run, mk: u32, i: u32, r_base: u32, split: u32, tx: u32, ty: u32, li: u32) {
    let bits = (mk >> (2u * i)) & 3u;
    scratch_put(ty * WG + tx, vec4<f32>(st.m, st.s, st.w, st.sz),
                vec4<f32>(st.r, f32(st.ai & 0xffffu), f32(st.ai >> 16u), f32(bits)));
    workgroupBarrier();
    if li < WG {
        let r = r_base + li * 8u + i;
        if r < P.n_rows {
            var acc = run_empty();
            var amk = 0u;
            for (var k = 0u; k < WG; k++) {
                let h = scratch_get(li * WG + k);
                let a = h[0];
                let b = h[1];
                let ai = u32(b.y) | (u32(b.z) << 16u);
                acc = merge_run(acc, Run(a.x, a.y, a.z, a.w, b.x, ai));
                amk |= u32(b.w);
            }
            part[r * P.part_stride + P.part_base + split] =
                Part(acc.m, acc.s, acc.w, acc.sz, acc.m, acc.ai, acc.r, amk);
        }
    }
    workgroupBarrier();
}

// The pass for workgroup `wid`, invocation `lid` (index `li`) on a logits tile held in an
// `Acc`; the entry point is fwd_main.wgsl's (FMA logits) or logits_coop.wgsl's
// (cooperative-matrix logits). The named main loop has its own pass (src/named.rs) over the
// same put_row / fwd_end.
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

    var st0 = run_empty();
    var st1 = run_empty();
    var st2 = run_empty();
    var st3 = run_empty();
    var st4 = run_empty();
    var st5 = run_empty();
    var st6 = run_empty();
    var st7 = run_empty();
    var mk = 0u;
    for (var ct = ct0; ct < ct1; ct++) {
        let c_base = ct * t;
        logits_tile(&acc, r_base, c_base, tx, ty, li);
        let j0 = c_base + tx * 8u;
        let b = ld_bias8(j0);
        let n_ok = min(P.n_cls - min(j0, P.n_cls), 8u);
        let gj0 = P.cls0 + j0;
        let s0 = put_row(st0, acc[0], acc[1], 0u, b, r_base, ty, gj0, n_ok);
        let s1 = put_row(st1, acc[2], acc[3], 1u, b, r_base, ty, gj0, n_ok);
        let s2 = put_row(st2, acc[4], acc[5], 2u, b, r_base, ty, gj0, n_ok);
        let s3 = put_row(st3, acc[6], acc[7], 3u, b, r_base, ty, gj0, n_ok);
        let s4 = put_row(st4, acc[8], acc[9], 4u, b, r_base, ty, gj0, n_ok);
        let s5 = put_row(st5, acc[10], acc[11], 5u, b, r_base, ty, gj0, n_ok);
        let s6 = put_row(st6, acc[12], acc[13], 6u, b, r_base, ty, gj0, n_ok);
        let s7 = put_row(st7, acc[14], acc[15], 7u, b, r_base, ty, gj0, n_ok);
        st0 = s0.run;
        st1 = s1.run;
        st2 = s2.run;
        st3 = s3.run;
        st4 = s4.run;
        st5 = s5.run;
        st6 = s6.run;
        st7 = s7.run;
        mk |= s0.mk | s1.mk | s2.mk | s3.mk | s4.mk | s5.mk | s6.mk | s7.mk;
    }
    fwd_end(st0, mk, 0u, r_base, split, tx, ty, li);
    fwd_end(st1, mk, 1u, r_base, split, tx, ty, li);
    fwd_end(st2, mk, 2u, r_base, split, tx, ty, li);
    fwd_end(st3, mk, 3u, r_base, split, tx, ty, li);
    fwd_end(st4, mk, 4u, r_base, split, tx, ty, li);
    fwd_end(st5, mk, 5u, r_base, split, tx, ty, li);
    fwd_end(st6, mk, 6u, r_base, split, tx, ty, li);
    fwd_end(st7, mk, 7u, r_base, split, tx, ty, li);
}
