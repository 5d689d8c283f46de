// logits_coop.wgsl: the forward partials' logits tile by cooperative matrices (f16 inputs,
// f32 accumulation), and that pipeline's entry point (cargo feature `coop-matrix`). It opens
// the module (before common.wgsl), since its `enable` directives must come first.
//
// Parameters
//   Bindings of tile_io.wgsl and fwd_partial.wgsl. DTYPE must be 1 (f16: e and c are staged
//   as f16 exactly); WG must be 8 (64 x 64 tiles, 64 invocations = two subgroups of 32: the
//   host runs this pipeline only on adapters whose subgroups are exactly 32 wide and that
//   list a 16 x 16 x 16 f16 x f16 -> f32 configuration).
// Tiling
//   The depth loop walks D in panels of KC = 32 staged as f16 through workgroup memory:
//   Ah[row][k] and Bh[class][k], 64 x KC each, laid out as in e and c. Subgroup s computes
//   tile rows 32s .. 32s+31 as 2 x 4 fragments of 16 x 16 with f32 accumulators, two
//   16-deep multiply-adds per panel. At the end the fragments are stored to Ct[row][class]
//   (f32), from which each invocation reads its 8 x 8 micro-tile into `acc`, so
//   fwd_partial.wgsl's epilogue runs unchanged.
// Thread mapping
//   Staging: invocation li loads groups g = li + 64s (s < 8) of four elements, tile row
//   g / (KC/4), depths 4 (g % (KC/4)) .. +3, of e and of c. Fragments: by subgroup
//   (`subgroup_id`). Micro-tile: as tile_io.wgsl, with (tx, ty) = (li mod WG, li / WG) of a
//   one-dimensional workgroup of WG*WG invocations.
// Bounds
//   e and c through tile_io.wgsl's load4, with `nv` counted from the row (< n_rows, < n_cls)
//   and column (< D) guards. Ah/Bh: m*KC + k + x < 64*KC. Fragment loads start at row
//   32s + 16a (a < 2) or class 16b (b < 4) and depth kk <= KC - 16 and read 16 rows of
//   stride KC: below 64*KC. Ct: fragment stores at (32s + 16a)*64 + 16b, 16 rows of stride
//   64: below 4096; micro-tile reads (ty*8 + i)*64 + tx*8 + x < 4096. Scratch: 8q + 7 < 4096
//   for slots q < 512 (the forward uses q < WG*WG = 64).

enable f16;
enable wgpu_cooperative_matrix;

// Depth of a staged panel.
const KC: u32 = 32u;

var<workgroup> Ah: array<f16, 2048>;
var<workgroup> Bh: array<f16, 2048>;
var<workgroup> Ct: array<f32, 4096>;
// This invocation's subgroup (set by the entry point).
var<private> sg_index: u32;

// Panel k0 .. k0+KC of the tile's e rows into Ah and c rows into Bh (0 outside the chunk).
fn stage_coop(r_base: u32, c_base: u32, k0: u32, li: u32) {
    for (var s = 0u; s < 8u; s++) {
        let g = li + s * 64u;
        let m = g / (KC / 4u);
        let k = 4u * (g % (KC / 4u));
        let col = k0 + k;
        var ne = 0u;
        var nc = 0u;
        if col < P.d {
            if r_base + m < P.n_rows {
                ne = min(P.d - col, 4u);
            }
            if c_base + m < P.n_cls {
                nc = min(P.d - col, 4u);
            }
        }
        let ie = P.e_off + (r_base + m) * P.d + col;
        let ic = P.c_off + (c_base + m) * P.d + col;
        let ve = decode4(load4(true, ie, ne), ie);
        let vc = decode4(load4(false, ic, nc), ic);
        for (var x = 0u; x < 4u; x++) {
            Ah[m * KC + k + x] = f16(ve[x]);
            Bh[m * KC + k + x] = f16(vc[x]);
        }
    }
}

// Micro-tile row i (a constant at every call) from Ct.
fn ct_row(acc: ptr<function, Acc>, i: u32, tx: u32, ty: u32) {
    let o = (ty * 8u + i) * 64u + tx * 8u;
    (*acc)[2u * i] = vec4<f32>(Ct[o], Ct[o + 1u], Ct[o + 2u], Ct[o + 3u]);
    (*acc)[2u * i + 1u] = vec4<f32>(Ct[o + 4u], Ct[o + 5u], Ct[o + 6u], Ct[o + 7u]);
}

// Ct as the forward's end-of-pass scratch (fwd_partial.wgsl; after logits_tile's closing
// barrier): slot q < 512 holds two vec4 at Ct[8q ..].
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
    let r0 = 32u * sg_index;
    var c0 = coop_mat16x16<f32, C>();
    var c1 = coop_mat16x16<f32, C>();
    var c2 = coop_mat16x16<f32, C>();
    var c3 = coop_mat16x16<f32, C>();
    var c4 = coop_mat16x16<f32, C>();
    var c5 = coop_mat16x16<f32, C>();
    var c6 = coop_mat16x16<f32, C>();
    var c7 = coop_mat16x16<f32, C>();
    for (var k0 = 0u; k0 < P.d; k0 += KC) {
        stage_coop(r_base, c_base, k0, li);
        workgroupBarrier();
        for (var kk = 0u; kk < KC; kk += 16u) {
            let a0 = coopLoadT<coop_mat16x16<f16, A>>(&Ah[r0 * KC + kk], KC);
            let a1 = coopLoadT<coop_mat16x16<f16, A>>(&Ah[(r0 + 16u) * KC + kk], KC);
            let b0 = coopLoad<coop_mat16x16<f16, B>>(&Bh[kk], KC);
            let b1 = coopLoad<coop_mat16x16<f16, B>>(&Bh[16u * KC + kk], KC);
            let b2 = coopLoad<coop_mat16x16<f16, B>>(&Bh[32u * KC + kk], KC);
            let b3 = coopLoad<coop_mat16x16<f16, B>>(&Bh[48u * KC + kk], KC);
            c0 = coopMultiplyAdd(a0, b0, c0);
            c1 = coopMultiplyAdd(a0, b1, c1);
            c2 = coopMultiplyAdd(a0, b2, c2);
            c3 = coopMultiplyAdd(a0, b3, c3);
            c4 = coopMultiplyAdd(a1, b0, c4);
            c5 = coopMultiplyAdd(a1, b1, c5);
            c6 = coopMultiplyAdd(a1, b2, c6);
            c7 = coopMultiplyAdd(a1, b3, c7);
        }
        workgroupBarrier();
    }
    coopStoreT(c0, &Ct[r0 * 64u], 64u);
    coopStoreT(c1, &Ct[r0 * 64u + 16u], 64u);
    coopStoreT(c2, &Ct[r0 * 64u + 32u], 64u);
    coopStoreT(c3, &Ct[r0 * 64u + 48u], 64u);
    coopStoreT(c4, &Ct[(r0 + 16u) * 64u], 64u);
    coopStoreT(c5, &Ct[(r0 + 16u) * 64u + 16u], 64u);
    coopStoreT(c6, &Ct[(r0 + 16u) * 64u + 32u], 64u);
    coopStoreT(c7, &Ct[(r0 + 16u) * 64u + 48u], 64u);
    workgroupBarrier();
    ct_row(acc, 0u, tx, ty);
    ct_row(acc, 1u, tx, ty);
    ct_row(acc, 2u, tx, ty);
    ct_row(acc, 3u, tx, ty);
    ct_row(acc, 4u, tx, ty);
    ct_row(acc, 5u, tx, ty);
    ct_row(acc, 6u, tx, ty);
    ct_row(acc, 7u, tx, ty);
    workgroupBarrier();
}

// One-dimensional (subgroup builtins need it); (tx, ty) = (li mod WG, li / WG) as in the
// WG x WG layout of the other tiled shaders.
@compute @workgroup_size(WG * WG, 1, 1)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32,
        @builtin(subgroup_id) sg: u32) {
    sg_index = sg;
    fwd_partial(wid, vec3<u32>(li % WG, li / WG, 0u), li);
}
