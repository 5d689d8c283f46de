// logits_coop128w.wgsl: the forward partials by cooperative matrices (f16 inputs, f32
// accumulation) at 128 x 128 tiles with 64 x 64 per subgroup, and that pipeline's entry
// point (cargo feature `coop-matrix`). It opens the module (before common.wgsl, tile_io.wgsl
// and fwd_rows.wgsl), since its `enable` directives must come first; its pass replaces
// fwd_partial.wgsl's (it keeps fwd_rows.wgsl's row state and update).
//
// Parameters
//   Bindings of tile_io.wgsl and fwd_rows.wgsl. DTYPE must be 1 (f16: e and c are staged as
//   f16 exactly, through unpack2x16float and back); WG must be 16 (tile() = 128; the host
//   sets it for this pipeline whatever the kernel configuration's wg). 128 invocations =
//   four subgroups of 32: the host runs it only on adapters whose subgroups are exactly 32
//   wide, that list a 16 x 16 x 16 f16 x f16 -> f32 configuration and that allow
//   COOP128W_WORKGROUP_BYTES of workgroup memory.
//   Panels are read as whole vec4<u32> (eight f16) when D and the source's element offset are
//   multiples of 8 (decided here from P.d, P.e_off, P.c_off), else element by element through
//   tile_io.wgsl's load4.
// Tiling
//   Grid (splits, row tiles of the chunk), as fwd_partial.wgsl: split `s` covers class tiles
//   [s*split_tiles, (s+1)*split_tiles) of the chunk. Per tile the depth loop walks D in
//   panels of KC (override: 32, or 16 for the FwdPartialCoop128W16 pipeline),
//   double-buffered in workgroup memory as f16: Ah[buf][row][k] and Bh[buf][class][k], 128
//   rows of KC depths each with a row stride of SA = KC + 8 (80 or 48 bytes: the eight rows
//   one fragment load reads per phase fall in distinct 16-byte bank groups). Panel p + 1 is
//   read from e and c into registers before panel p's products and stored into the other
//   buffer after them, then one barrier per panel. Subgroup s computes tile rows
//   64 (s / 2) .. +63 and classes 64 (s % 2) .. +63 as 4 x 4 fragments of 16 x 16 with f32
//   accumulators: per 16-deep step it loads 4 A and 4 B fragments for 16 multiply-adds (0.5
//   fragment loads per multiply-add), 2 KC multiply-adds per panel between barriers.
//   After the last panel, eight rounds (a, h) = (r / 2, r % 2) hand the fragments to the row
//   state through Ct: every subgroup stores its fragments (a, 2h) and (a, 2h + 1)
//   column-major (stride 16) into its two 16 x 16 slots of Ct; barrier; every lane reads 16
//   logits of one row from one slot and extends a tile-local row state (fwd_rows.wgsl's
//   row_step, 8 classes at a time); barrier. After rounds (a, 0) and (a, 1) the two lanes that
//   share row a's state swap it (subgroupShuffleXor 1), and the one that keeps that row
//   merges it into its running state for the split: two rows per lane, so the running states
//   take 12 registers per invocation instead of fwd_partial.wgsl's 48. At the end of the split
//   the class halves' states (subgroups 2u + 1 and 2u) meet through Ct (`part` is written by
//   the subgroups 2u). Deterministic, no atomics.
//   Workgroup memory: 2 x 2 x 128 x 40 f16 + 8 x 256 f32 = 49152 bytes
//   (config::COOP128W_WORKGROUP_BYTES; at KC = 16 the panels use 2 x 2 x 128 x 24 of them).
// Thread mapping
//   Staging: invocation li reads and stores rows li/GR + RS*t (t < GR), depths
//   8 (li % GR) .. +7, of e (Ah) and of c (Bh), with GR = KC/8 groups of eight depths per row
//   and RS = 128/GR: GR vec4<u32> per operand and panel (4 at KC = 32, 2 at KC = 16). Fragments and row states:
//   by subgroup s (`subgroup_id`, clamped to 3: u = s / 2, v = s % 2) and lane l
//   (`subgroup_invocation_id`, clamped to 31: rho = l / 2, q = l % 2). In round (a, h) lane l
//   reads tile row 64u + 16a + rho, classes 64v + 32h + 16q .. +15 (slot 2s + q, rows rho);
//   its tile-local state of row a is kept by the lane with q = a / 2, as running state
//   k = a % 2, so lane l keeps tile rows 64u + 32q + 16k + rho (k < 2).
// Bounds
//   e and c: whole vec4<u32> e_buf[i >> 3] only when the row is in the chunk (< n_rows,
//   < n_cls), col < D, and D and the offset are multiples of 8 (so col + 8 <= D and
//   i = off + row*D + col is a multiple of 8: elements i .. i+7 lie in the row, below the
//   binding's offset + rows*D elements); else through load4 with `nv` counted from the same
//   guards (tile_io.wgsl). Ah/Bh: stores at b*PANEL + (m + RS*t)*SA + 8g + x with b < 2,
//   m < RS, t < GR, g < GR, x < 8: at most PANEL + 127*SA + KC - 1 < 2*PANEL = 256*SA <= 10240;
//   fragment loads start at b*PANEL + (64u + 16i)*SA + kk (u < 2, i < 4, kk < KC a multiple
//   of 16) and read 16 rows of stride SA, 16 elements each: at most
//   PANEL + 127*SA + KC - 1 < 2*PANEL. Ct: fragment stores at
//   512s + 256x (s < 4, x < 2), 16 columns of stride 16: below 2048; lane reads at
//   512s + 256q + 16x + rho (q < 2, x < 16, rho < 16): at most 2047; the end-of-split
//   scratch at 8 ((32u + l)*2 + k) + 0..7 (u < 2, l < 32, k < 2): below 1024. tgt[r],
//   tlogit[r] and part[r*part_stride + part_base + split] only for r < n_rows, with
//   split = workgroup_id.x < part_stride − part_base (host-checked).

enable f16;
enable wgpu_cooperative_matrix;

// Depth of a staged panel: 32, or 16 (the FwdPartialCoop128W16 pipeline).
override KC: u32 = 32u;
// Row stride of a panel (f16): KC and 8 of padding.
override SA: u32 = KC + 8u;
// Elements of one panel buffer: 128 rows of stride SA.
override PANEL: u32 = 128u * SA;
// Groups of eight depths in a panel row (4 or 2), and the rows between the rows one
// invocation stages (32 or 64).
override GR: u32 = KC / 8u;
override RS: u32 = 128u / GR;
// Side of the tile.
const T128: u32 = 128u;

// Two panel buffers at KC = 32 (2 x 128 x 40); KC = 16 uses the first 2 x 128 x 24.
var<workgroup> Ah: array<f16, 10240>;
var<workgroup> Bh: array<f16, 10240>;
var<workgroup> Ct: array<f32, 2048>;
// This invocation's subgroup (at most 3) and lane in it (at most 31), set by the entry point.
var<private> sg_index: u32;
var<private> lane: u32;

// One invocation's share of a panel, as raw f16 bits (two per word, element 2k low): rows
// li/GR + RS*t of e (a_t) and of c (b_t), t < GR, eight depths each (zeros for t >= GR).
struct Fetch {
    a0: vec4<u32>,
    a1: vec4<u32>,
    a2: vec4<u32>,
    a3: vec4<u32>,
    b0: vec4<u32>,
    b1: vec4<u32>,
    b2: vec4<u32>,
    b3: vec4<u32>,
}

// Row m (< 128) of the tile's e rows (`is_e`) or c rows at depths col .. col+7.
fn fetch_row(is_e: bool, base: u32, m: u32, col: u32) -> vec4<u32> {
    let n = select(P.n_cls, P.n_rows, is_e);
    let i = src_off(is_e) + (base + m) * P.d + col;
    return fetch8(is_e, base + m < n, col, i);
}

// This invocation's share of panel k0 .. k0+KC of the tile's e rows and c rows.
fn fetch_panel(r_base: u32, c_base: u32, k0: u32, li: u32) -> Fetch {
    let m = li / GR;
    let col = k0 + 8u * (li % GR);
    var f = Fetch();
    f.a0 = fetch_row(true, r_base, m, col);
    f.a1 = fetch_row(true, r_base, m + RS, col);
    f.b0 = fetch_row(false, c_base, m, col);
    f.b1 = fetch_row(false, c_base, m + RS, col);
    if GR > 2u {
        f.a2 = fetch_row(true, r_base, m + 2u * RS, col);
        f.a3 = fetch_row(true, r_base, m + 3u * RS, col);
        f.b2 = fetch_row(false, c_base, m + 2u * RS, col);
        f.b3 = fetch_row(false, c_base, m + 3u * RS, col);
    }
    return f;
}

// A fetched share into the panel buffer starting at element `base` (0 or PANEL).
fn put_panel(base: u32, f: Fetch, li: u32) {
    let o = base + (li / GR) * SA + 8u * (li % GR);
    put_a(o, f.a0);
    put_a(o + RS * SA, f.a1);
    put_b(o, f.b0);
    put_b(o + RS * SA, f.b1);
    if GR > 2u {
        put_a(o + 2u * RS * SA, f.a2);
        put_a(o + 3u * RS * SA, f.a3);
        put_b(o + 2u * RS * SA, f.b2);
        put_b(o + 3u * RS * SA, f.b3);
    }
}

// Round (a, h) of the hand-over for this lane: tile row 64u + 16a + rho, classes
// 64v + 32h + 16q .. +15, read from its slot of Ct (column-major, stride 16) and added to the
// tile-local state `t` of that row; the mask bits come shifted to bits 2a, 2a+1.
fn take16(t: Run, a: u32, h: u32, r_base: u32, c_base: u32) -> Step {
    let rho = lane >> 1u;
    let q = lane & 1u;
    let o = sg_index * 512u + q * 256u + rho;
    let lo0 = vec4<f32>(Ct[o], Ct[o + 16u], Ct[o + 32u], Ct[o + 48u]);
    let hi0 = vec4<f32>(Ct[o + 64u], Ct[o + 80u], Ct[o + 96u], Ct[o + 112u]);
    let lo1 = vec4<f32>(Ct[o + 128u], Ct[o + 144u], Ct[o + 160u], Ct[o + 176u]);
    let hi1 = vec4<f32>(Ct[o + 192u], Ct[o + 208u], Ct[o + 224u], Ct[o + 240u]);
    let r = r_base + 64u * (sg_index >> 1u) + 16u * a + rho;
    if r >= P.n_rows {
        return Step(t, 0u);
    }
    let j0 = c_base + 64u * (sg_index & 1u) + 32u * h + 16u * q;
    let y = tgt[r];
    let b0 = ld_bias8(j0);
    let b1 = ld_bias8(j0 + 8u);
    let n0 = min(P.n_cls - min(j0, P.n_cls), 8u);
    let n1 = min(P.n_cls - min(j0 + 8u, P.n_cls), 8u);
    let s0 = row_step(t, lo0, hi0, b0[0], b0[1], y, r, P.cls0 + j0, n0);
    let s1 = row_step(s0.run, lo1, hi1, b1[0], b1[1], y, r, P.cls0 + j0 + 8u, n1);
    return Step(s1.run, (s0.mk | s1.mk) << (2u * a));
}

// Row a's tile-local state of this lane merged with its partner's (lane l ^ 1: the other
// 16-class quarters), the lower classes (q = 0) first; every lane of the subgroup calls it.
fn pair_merge(t: Run) -> Run {
    let o = Run(subgroupShuffleXor(t.m, 1u), subgroupShuffleXor(t.s, 1u),
                subgroupShuffleXor(t.w, 1u), subgroupShuffleXor(t.sz, 1u),
                subgroupShuffleXor(t.r, 1u), subgroupShuffleXor(t.ai, 1u));
    if (lane & 1u) == 0u {
        return merge_run(t, o);
    }
    return merge_run(o, t);
}

// Running state `p` (tile row a of this lane when it keeps row a: q = a / 2) extended by the
// tile's merged state `t` of row a; unchanged for the other lane.
fn keep(p: Run, t: Run, a: u32) -> Run {
    if (lane & 1u) != (a >> 1u) {
        return p;
    }
    return merge_run(p, t);
}

// One invocation's pass (invocation `li` of the workgroup `wid`).
fn fwd_pass(wid: vec3<u32>, li: u32) {
    let split = wid.x;
    let r_base = wid.y * T128;
    let n_ct = (P.n_cls + T128 - 1u) / T128;
    let ct0 = split * P.split_tiles;
    let ct1 = min(ct0 + P.split_tiles, n_ct);
    // The subgroup's first tile row (times SA) and first class (times SA) in a panel.
    let ra = (sg_index >> 1u) * 64u * SA;
    let cb = (sg_index & 1u) * 64u * SA;
    let slot = sg_index * 512u;
    let np = (P.d + KC - 1u) / KC;
    var p0 = run_empty();
    var p1 = run_empty();
    var mk = 0u;
    for (var ct = ct0; ct < ct1; ct++) {
        let c_base = ct * T128;
        var c0 = coop_mat16x16<f32, C>();
        var c1 = coop_mat16x16<f32, C>();
        var c2 = coop_mat16x16<f32, C>();
        var c3 = coop_mat16x16<f32, C>();
        var c4 = coop_mat16x16<f32, C>();
        var c5 = coop_mat16x16<f32, C>();
        var c6 = coop_mat16x16<f32, C>();
        var c7 = coop_mat16x16<f32, C>();
        var c8 = coop_mat16x16<f32, C>();
        var c9 = coop_mat16x16<f32, C>();
        var c10 = coop_mat16x16<f32, C>();
        var c11 = coop_mat16x16<f32, C>();
        var c12 = coop_mat16x16<f32, C>();
        var c13 = coop_mat16x16<f32, C>();
        var c14 = coop_mat16x16<f32, C>();
        var c15 = coop_mat16x16<f32, C>();
        put_panel(0u, fetch_panel(r_base, c_base, 0u, li), li);
        workgroupBarrier();
        for (var p = 0u; p < np; p++) {
            // Panel p + 1 (zeros past D) in flight during panel p's products.
            let nxt = fetch_panel(r_base, c_base, (p + 1u) * KC, li);
            let base = (p & 1u) * PANEL;
            for (var kk = 0u; kk < KC; kk += 16u) {
                let a0 = coopLoadT<coop_mat16x16<f16, A>>(&Ah[base + ra + kk], SA);
                let a1 = coopLoadT<coop_mat16x16<f16, A>>(&Ah[base + ra + 16u * SA + kk], SA);
                let a2 = coopLoadT<coop_mat16x16<f16, A>>(&Ah[base + ra + 32u * SA + kk], SA);
                let a3 = coopLoadT<coop_mat16x16<f16, A>>(&Ah[base + ra + 48u * SA + kk], SA);
                let b0 = coopLoad<coop_mat16x16<f16, B>>(&Bh[base + cb + kk], SA);
                let b1 = coopLoad<coop_mat16x16<f16, B>>(&Bh[base + cb + 16u * SA + kk], SA);
                let b2 = coopLoad<coop_mat16x16<f16, B>>(&Bh[base + cb + 32u * SA + kk], SA);
                let b3 = coopLoad<coop_mat16x16<f16, B>>(&Bh[base + cb + 48u * SA + kk], SA);
                c0 = coopMultiplyAdd(a0, b0, c0);
                c1 = coopMultiplyAdd(a0, b1, c1);
                c2 = coopMultiplyAdd(a0, b2, c2);
                c3 = coopMultiplyAdd(a0, b3, c3);
                c4 = coopMultiplyAdd(a1, b0, c4);
                c5 = coopMultiplyAdd(a1, b1, c5);
                c6 = coopMultiplyAdd(a1, b2, c6);
                c7 = coopMultiplyAdd(a1, b3, c7);
                c8 = coopMultiplyAdd(a2, b0, c8);
                c9 = coopMultiplyAdd(a2, b1, c9);
                c10 = coopMultiplyAdd(a2, b2, c10);
                c11 = coopMultiplyAdd(a2, b3, c11);
                c12 = coopMultiplyAdd(a3, b0, c12);
                c13 = coopMultiplyAdd(a3, b1, c13);
                c14 = coopMultiplyAdd(a3, b2, c14);
                c15 = coopMultiplyAdd(a3, b3, c15);
            }
            // The other buffer was last read before the previous barrier.
            put_panel(PANEL - base, nxt, li);
            workgroupBarrier();
        }
        // The hand-over, round (a, h) storing fragments c(4a + 2h) and c(4a + 2h + 1).
        coopStore(c0, &Ct[slot], 16u);
        coopStore(c1, &Ct[slot + 256u], 16u);
        workgroupBarrier();
        var s = take16(run_empty(), 0u, 0u, r_base, c_base);
        mk |= s.mk;
        workgroupBarrier();
        coopStore(c2, &Ct[slot], 16u);
        coopStore(c3, &Ct[slot + 256u], 16u);
        workgroupBarrier();
        s = take16(s.run, 0u, 1u, r_base, c_base);
        mk |= s.mk;
        workgroupBarrier();
        p0 = keep(p0, pair_merge(s.run), 0u);
        coopStore(c4, &Ct[slot], 16u);
        coopStore(c5, &Ct[slot + 256u], 16u);
        workgroupBarrier();
        s = take16(run_empty(), 1u, 0u, r_base, c_base);
        mk |= s.mk;
        workgroupBarrier();
        coopStore(c6, &Ct[slot], 16u);
        coopStore(c7, &Ct[slot + 256u], 16u);
        workgroupBarrier();
        s = take16(s.run, 1u, 1u, r_base, c_base);
        mk |= s.mk;
        workgroupBarrier();
        p1 = keep(p1, pair_merge(s.run), 1u);
        coopStore(c8, &Ct[slot], 16u);
        coopStore(c9, &Ct[slot + 256u], 16u);
        workgroupBarrier();
        s = take16(run_empty(), 2u, 0u, r_base, c_base);
        mk |= s.mk;
        workgroupBarrier();
        coopStore(c10, &Ct[slot], 16u);
        coopStore(c11, &Ct[slot + 256u], 16u);
        workgroupBarrier();
        s = take16(s.run, 2u, 1u, r_base, c_base);
        mk |= s.mk;
        workgroupBarrier();
        p0 = keep(p0, pair_merge(s.run), 2u);
        coopStore(c12, &Ct[slot], 16u);
        coopStore(c13, &Ct[slot + 256u], 16u);
        workgroupBarrier();
        s = take16(run_empty(), 3u, 0u, r_base, c_base);
        mk |= s.mk;
        workgroupBarrier();
        coopStore(c14, &Ct[slot], 16u);
        coopStore(c15, &Ct[slot + 256u], 16u);
        workgroupBarrier();
        s = take16(s.run, 3u, 1u, r_base, c_base);
        mk |= s.mk;
        workgroupBarrier();
        p1 = keep(p1, pair_merge(s.run), 3u);
    }
    fwd_end_w(p0, p1, mk, r_base, split);
}

// The state `p` (running state k of this lane) and its mask bits in scratch slot `q`.
fn scratch_put_w(q: u32, p: Run, bits: u32) {
    let o = 8u * q;
    Ct[o] = p.m;
    Ct[o + 1u] = p.s;
    Ct[o + 2u] = p.w;
    Ct[o + 3u] = p.sz;
    Ct[o + 4u] = p.r;
    Ct[o + 5u] = f32(p.ai & 0xffffu);
    Ct[o + 6u] = f32(p.ai >> 16u);
    Ct[o + 7u] = f32(bits);
}

// Running state k of this lane (tile row 64u + 32q + 16k + rho, the classes of subgroup
// 2u) merged with subgroup 2u + 1's from scratch slot `q`, stored into column `split`.
fn store_row(p: Run, bits: u32, k: u32, q: u32, r_base: u32, split: u32) {
    let r = r_base + 64u * (sg_index >> 1u) + 32u * (lane & 1u) + 16u * k + (lane >> 1u);
    if r >= P.n_rows {
        return;
    }
    let o = 8u * q;
    let ai = u32(Ct[o + 5u]) | (u32(Ct[o + 6u]) << 16u);
    let other = Run(Ct[o], Ct[o + 1u], Ct[o + 2u], Ct[o + 3u], Ct[o + 4u], ai);
    let acc = merge_run(p, other);
    let amk = bits | u32(Ct[o + 7u]);
    part[r * P.part_stride + P.part_base + split] =
        Part(acc.m, acc.s, acc.w, acc.sz, acc.m, acc.ai, acc.r, amk);
}

// End of the split (every invocation, after the last tile's closing barrier): the running
// states of subgroup 2u + 1 (classes 64 .. 127 of each tile) meet those of subgroup 2u in Ct,
// which merges and stores them. Exact through Ct: the class index and mask bits travel as f32
// integers below 2^16.
fn fwd_end_w(p0: Run, p1: Run, mk: u32, r_base: u32, split: u32) {
    // Mask bits of rows a = 2q + k: this lane's and its partner's quarters.
    let m2 = mk | subgroupShuffleXor(mk, 1u);
    let sh = 4u * (lane & 1u);
    let bits0 = (m2 >> sh) & 3u;
    let bits1 = (m2 >> (sh + 2u)) & 3u;
    let q = ((sg_index >> 1u) * 32u + lane) * 2u;
    if (sg_index & 1u) == 1u {
        scratch_put_w(q, p0, bits0);
        scratch_put_w(q + 1u, p1, bits1);
    }
    workgroupBarrier();
    if (sg_index & 1u) == 0u {
        store_row(p0, bits0, 0u, q, r_base, split);
        store_row(p1, bits1, 1u, q + 1u, r_base, split);
    }
}

// One-dimensional (subgroup builtins need it).
@compute @workgroup_size(128, 1, 1)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32,
        @builtin(subgroup_id) sg: u32, @builtin(subgroup_invocation_id) sl: u32) {
    sg_index = min(sg, 3u);
    lane = min(sl, 31u);
    fwd_pass(wid, li);
}
