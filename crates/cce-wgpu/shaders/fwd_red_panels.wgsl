// fwd_red_panels.wgsl: the slots of fwd_partial.wgsl's row reduction in the logits panels of
// gemm.wgsl (idle during a tile's epilogue), for the FMA forward (scalar, quad and named main
// loops).
//
// Parameters
//   None of its own: As, Bs of gemm.wgsl and the overrides WG, TK.
// Tiling
//   A Part is two vec4<f32> (m, s, w, sz) and (av, ai bits, r, mk bits). The HR·WG·WG Parts
//   of a half take 2·HR·WG·WG vec4: first As (4·TK·WG), then Bs (4·TK·WG), then `red_x`,
//   whose size is what the panels lack (at least 2, none used when TK ≥ WG).
// Thread mapping
//   As fwd_partial.wgsl (each thread stores its own slots; row owners read WG of them).
// Bounds
//   Slot idx < HR·WG·WG (fwd_partial.wgsl): vec4 f = 2·idx, f + 1 below 2·HR·WG·WG; As[f] for
//   f < 4·TK·WG, Bs[f − 4·TK·WG] below 8·TK·WG, else red_x[f − 8·TK·WG] below its size.

// The vec4 the panels lack for a half's Parts (2·HR·WG·WG with HR = 4), and 2 more, so that
// the array is never empty.
var<workgroup> red_x: array<vec4<f32>, max(8u * WG * WG, 8u * TK * WG) - 8u * TK * WG + 2u>;

fn red_store4(f: u32, x: vec4<f32>) {
    let pa = 4u * TK * WG;
    if f < pa {
        As[f] = x;
    } else if f < 2u * pa {
        Bs[f - pa] = x;
    } else {
        red_x[f - 2u * pa] = x;
    }
}

fn red_load4(f: u32) -> vec4<f32> {
    let pa = 4u * TK * WG;
    if f < pa {
        return As[f];
    } else if f < 2u * pa {
        return Bs[f - pa];
    }
    return red_x[f - 2u * pa];
}

fn red_put(idx: u32, st: Part) {
    red_store4(2u * idx, vec4<f32>(st.m, st.s, st.w, st.sz));
    red_store4(2u * idx + 1u, vec4<f32>(st.av, bitcast<f32>(st.ai), st.r, bitcast<f32>(st.mk)));
}

fn red_get(idx: u32) -> Part {
    let a = red_load4(2u * idx);
    let b = red_load4(2u * idx + 1u);
    return Part(a.x, a.y, a.z, a.w, b.x, bitcast<u32>(b.y), b.z, bitcast<u32>(b.w));
}
