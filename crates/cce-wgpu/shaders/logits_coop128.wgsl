// logits_coop128.wgsl: the forward partials' logits tile by cooperative matrices (f16 inputs,
// f32 accumulation) at 128 x 128 tiles (cargo feature `coop-matrix`), shared by the forward
// (entry point fwd_coop128_main.wgsl) and the cooperative-matrix backward (bwd_coop.wgsl).
// It opens the module (before common.wgsl), since its `enable` directives must come first.
//
// Parameters
//   Bindings of tile_io.wgsl and fwd_partial.wgsl. DTYPE must be 1 (f16: e and c are staged
//   as f16 exactly, through unpack2x16float and back); WG must be 16 (128 x 128 tiles, 256 invocations =
//   eight subgroups of 32; the host sets WG = 16 for this pipeline whatever the kernel
//   configuration's wg, and runs it only on adapters whose subgroups are exactly 32 wide,
//   that list a 16 x 16 x 16 f16 x f16 -> f32 configuration and that allow 256 invocations
//   and COOP128_WORKGROUP_BYTES of workgroup memory).
//   Panels are read as whole vec4<u32> (eight f16) when D and the source's element offset are
//   multiples of 8 (decided here from P.d, P.e_off, P.c_off), else element by element through
//   tile_io.wgsl's load4.
// Tiling
//   The depth loop walks D in panels of KC = 32, double-buffered in workgroup memory as f16:
//   Ah[buf][row][k] and Bh[buf][class][k], 128 rows of KC depths each with a row stride of
//   SA = 40 (80 bytes: the eight rows one fragment load reads per phase fall in distinct
//   banks). Panel p + 1 is read from e and c into registers before panel p's products and
//   stored into the other buffer after them, then one barrier per panel. Subgroup s computes
//   tile rows 32 (s / 2) .. +31 and classes 64 (s % 2) .. +63 as 2 x 4 fragments of 16 x 16
//   with f32 accumulators: 16 multiply-adds of 16 x 16 x 16 per panel between barriers.
//   After the last panel the fragments go to fwd_partial.wgsl's 8 x 8 micro-tiles (`acc`)
//   through Ct, eight rounds of (every subgroup stores its fragment f into its own 16 x 16
//   slot of Ct; barrier; the 32 invocations whose micro-tile lies in fragment f of some
//   subgroup read it; barrier), so the epilogue runs unchanged. Workgroup memory:
//   2 x 2 x 128 x 40 f16 + 8 x 256 f32 = 49152 bytes (config::COOP128_WORKGROUP_BYTES).
// Thread mapping
//   Staging: invocation li reads and stores rows li/4 and li/4 + 64, depths 8 (li % 4) .. +7,
//   of e (Ah) and of c (Bh): two vec4<u32> per operand and panel. Fragments: by subgroup
//   (`subgroup_id`, clamped to 7). Micro-tile: as tile_io.wgsl, with (tx, ty) =
//   (li mod WG, li / WG) of a one-dimensional workgroup of WG*WG invocations; its rows
//   ty*8 .. +7 and classes tx*8 .. +7 lie in fragment f = 4 ((ty/2) % 2) + (tx/2) % 4 of
//   subgroup 2 (ty/4) + tx/8.
// Bounds
//   e and c: whole vec4<u32> e_buf[i >> 3] only when the row is in the chunk (< n_rows,
//   < n_cls), col < D, and D and the offset are multiples of 8 (so col + 8 <= D and
//   i = off + row*D + col is a multiple of 8: elements i .. i+7 lie in the row, below the
//   binding's offset + rows*D elements); else through load4 with `nv` counted from the same
//   guards (tile_io.wgsl). Ah/Bh: stores at b*5120 + m*SA + 8q + x with b < 2, m < 128,
//   q < 4, x < 8: below 10240; fragment loads start at b*5120 + (32 (s/2) + 16a)*SA + kk
//   (s < 8, a < 2, kk in {0, 16}) or b*5120 + (64 (s%2) + 16j)*SA + kk (j < 4) and read 16
//   rows of stride SA, 16 elements each: at most b*5120 + 127*SA + 16 + 15 < 10240.
//   Ct: fragment stores at s*256 (s < 8), 16 rows of stride 16: below 2048; micro-tile reads
//   (2 (ty/4) + tx/8)*256 + ((ty%2)*8 + i)*16 + (tx%2)*8 + x with ty, tx < 16, i, x < 8:
//   at most 7*256 + 15*16 + 15 = 2047. Scratch: 8q + 7 < 2048 for slots q < 256 (the
//   forward uses q < WG*WG = 256).

enable f16;
enable wgpu_cooperative_matrix;

// Depth of a staged panel.
const KC: u32 = 32u;
// Row stride of a panel (f16): KC and 8 of padding.
const SA: u32 = 40u;
// Elements of one panel buffer: 128 rows of stride SA.
const PANEL: u32 = 5120u;

var<workgroup> Ah: array<f16, 10240>;
var<workgroup> Bh: array<f16, 10240>;
var<workgroup> Ct: array<f32, 2048>;
// This invocation's subgroup (set by the entry point, at most 7).
var<private> sg_index: u32;

// One invocation's share of a panel, as raw f16 bits (two per word, element 2k low): rows
// li/4 (a0, b0) and li/4 + 64 (a1, b1) of e (a) and c (b), eight depths each.
struct Fetch {
    a0: vec4<u32>,
    a1: vec4<u32>,
    b0: vec4<u32>,
    b1: vec4<u32>,
}

// This invocation's share of panel k0 .. k0+KC of the tile's e rows and c rows.
fn fetch_panel(r_base: u32, c_base: u32, k0: u32, li: u32) -> Fetch {
    let m = li >> 2u;
    let col = k0 + 8u * (li & 3u);
    let r = r_base + m;
    let c = c_base + m;
    let e0 = P.e_off + r * P.d + col;
    let e1 = P.e_off + (r + 64u) * P.d + col;
    let c0 = P.c_off + c * P.d + col;
    let c1 = P.c_off + (c + 64u) * P.d + col;
    return Fetch(fetch8(true, r < P.n_rows, col, e0), fetch8(true, r + 64u < P.n_rows, col, e1),
                 fetch8(false, c < P.n_cls, col, c0),
                 fetch8(false, c + 64u < P.n_cls, col, c1));
}

// A fetched share into the panel buffer starting at element `base` (0 or PANEL).
fn put_panel(base: u32, f: Fetch, li: u32) {
    let o = base + (li >> 2u) * SA + 8u * (li & 3u);
    put_a(o, f.a0);
    put_a(o + 64u * SA, f.a1);
    put_b(o, f.b0);
    put_b(o + 64u * SA, f.b1);
}

// Micro-tile row i (a constant at every call) from Ct at element o (the row's first class).
fn ct_row(acc: ptr<function, Acc>, i: u32, o: u32) {
    let x = o + 16u * i;
    (*acc)[2u * i] = vec4<f32>(Ct[x], Ct[x + 1u], Ct[x + 2u], Ct[x + 3u]);
    (*acc)[2u * i + 1u] = vec4<f32>(Ct[x + 4u], Ct[x + 5u], Ct[x + 6u], Ct[x + 7u]);
}

// The micro-tile of invocation (tx, ty) from Ct when it lies in fragment f of the subgroups'
// slots (round f of the hand-over).
fn ct_take(acc: ptr<function, Acc>, f: u32, tx: u32, ty: u32) {
    if 4u * ((ty >> 1u) & 1u) + ((tx >> 1u) & 3u) != f {
        return;
    }
    let o = (2u * (ty >> 2u) + (tx >> 3u)) * 256u + (ty & 1u) * 128u + (tx & 1u) * 8u;
    ct_row(acc, 0u, o);
    ct_row(acc, 1u, o);
    ct_row(acc, 2u, o);
    ct_row(acc, 3u, o);
    ct_row(acc, 4u, o);
    ct_row(acc, 5u, o);
    ct_row(acc, 6u, o);
    ct_row(acc, 7u, o);
}

// Ct as the forward's end-of-pass scratch (fwd_partial.wgsl; after logits_tile's closing
// barrier): slot q < 256 holds two vec4 at Ct[8q ..].
fn scratch_put(q: u32, a: vec4<f32>, b: vec4<f32>) {
    for (var x = 0u; x < 4u; x++) {
        Ct[8u * q + x] = a[x];
        Ct[8u * q + 4u + x] = b[x];
    }
}

fn scratch_get(q: u32) -> array<vec4<f32>, 2> {
    let o = 8u * q;
    return array<vec4<f32>, 2>(vec4<f32>(Ct[o], Ct[o + 1u], Ct[o + 2u], Ct[o + 3u]),
                               vec4<f32>(Ct[o + 4u], Ct[o + 5u], Ct[o + 6u], Ct[o + 7u]));
}

// acc = logits (without bias) of rows r_base.. x classes c_base.. of the chunk (the contract
// of gemm.wgsl's logits_tile: starts by writing workgroup memory, ends with a barrier).
fn logits_tile(acc: ptr<function, Acc>, r_base: u32, c_base: u32, tx: u32, ty: u32, li: u32) {
    // The subgroup's first tile row (times SA) and first class (times SA) in a panel.
    let ra = (sg_index >> 1u) * 32u * SA;
    let cb = (sg_index & 1u) * 64u * SA;
    var c0 = coop_mat16x16<f32, C>();
    var c1 = coop_mat16x16<f32, C>();
    var c2 = coop_mat16x16<f32, C>();
    var c3 = coop_mat16x16<f32, C>();
    var c4 = coop_mat16x16<f32, C>();
    var c5 = coop_mat16x16<f32, C>();
    var c6 = coop_mat16x16<f32, C>();
    var c7 = coop_mat16x16<f32, C>();
    put_panel(0u, fetch_panel(r_base, c_base, 0u, li), li);
    workgroupBarrier();
    let np = (P.d + KC - 1u) / KC;
    for (var p = 0u; p < np; p++) {
        // Panel p + 1 (zeros past D) in flight during panel p's products.
        let nxt = fetch_panel(r_base, c_base, (p + 1u) * KC, li);
        let base = (p & 1u) * PANEL;
        for (var kk = 0u; kk < KC; kk += 16u) {
            let a0 = coopLoadT<coop_mat16x16<f16, A>>(&Ah[base + ra + kk], SA);
            let a1 = coopLoadT<coop_mat16x16<f16, A>>(&Ah[base + ra + 16u * SA + kk], SA);
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
        }
        // The other buffer was last read before the previous barrier.
        put_panel(PANEL - base, nxt, li);
        workgroupBarrier();
    }
    // Every entry of `acc` is written in exactly one round below; zeroed here so that the
    // compiler sees the previous tile's values dead during the main loop.
    *acc = Acc();
    let slot = sg_index * 256u;
    coopStoreT(c0, &Ct[slot], 16u);
    workgroupBarrier();
    ct_take(acc, 0u, tx, ty);
    workgroupBarrier();
    coopStoreT(c1, &Ct[slot], 16u);
    workgroupBarrier();
    ct_take(acc, 1u, tx, ty);
    workgroupBarrier();
    coopStoreT(c2, &Ct[slot], 16u);
    workgroupBarrier();
    ct_take(acc, 2u, tx, ty);
    workgroupBarrier();
    coopStoreT(c3, &Ct[slot], 16u);
    workgroupBarrier();
    ct_take(acc, 3u, tx, ty);
    workgroupBarrier();
    coopStoreT(c4, &Ct[slot], 16u);
    workgroupBarrier();
    ct_take(acc, 4u, tx, ty);
    workgroupBarrier();
    coopStoreT(c5, &Ct[slot], 16u);
    workgroupBarrier();
    ct_take(acc, 5u, tx, ty);
    workgroupBarrier();
    coopStoreT(c6, &Ct[slot], 16u);
    workgroupBarrier();
    ct_take(acc, 6u, tx, ty);
    workgroupBarrier();
    coopStoreT(c7, &Ct[slot], 16u);
    workgroupBarrier();
    ct_take(acc, 7u, tx, ty);
    workgroupBarrier();
}
