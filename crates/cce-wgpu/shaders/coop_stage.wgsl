// coop_stage.wgsl: the f16 panel staging shared by the 128 x 128 cooperative-matrix forwards
// (appended to logits_coop128.wgsl's and logits_coop128w.wgsl's modules, after their
// declarations of the panel buffers Ah and Bh).
//
// Parameters
//   tile_io.wgsl's bindings and load4 / src_off / src_quad; the including shader's
//   workgroup arrays Ah and Bh (f16).
// Tiling
//   None of its own: eight f16 of one panel row per call (fetch8 from e or c, put_a / put_b
//   into the panel buffers at the including shader's offsets).
// Thread mapping
//   The calling invocation's share (the including shader's fetch_panel / put_panel).
// Bounds
//   fetch8 reads a whole vec4<u32> only when D and the source's element offset are multiples
//   of 8 and the row exists (elements i .. i+7 then lie in the row), else through load4 with
//   `nv` counted from col < D; put_a / put_b write o .. o+7, which the including shader keeps
//   inside its buffers (its Bounds section).

// Bits of f16 element `i` from the word holding it.
fn half_bits(w: u32, i: u32) -> u32 {
    return select(w & 0xffffu, w >> 16u, (i & 1u) == 1u);
}

// Elements i, i+1 (raw words w0, w1) as one word.
fn pair_bits(w0: u32, w1: u32, i: u32) -> u32 {
    return half_bits(w0, i) | (half_bits(w1, i + 1u) << 16u);
}

// The f16 bits of elements i .. i+7 of a source (column col of a row that exists when `ok`),
// 0 for elements past D or outside the chunk.
fn fetch8(is_e: bool, ok: bool, col: u32, i: u32) -> vec4<u32> {
    if !ok || col >= P.d {
        return vec4<u32>(0u);
    }
    if (P.d & 7u) == 0u && (src_off(is_e) & 7u) == 0u {
        return src_quad(is_e, i >> 3u);
    }
    let lo = load4(is_e, i, min(P.d - col, 4u));
    var hi = vec4<u32>(0u);
    if col + 4u < P.d {
        hi = load4(is_e, i + 4u, min(P.d - col - 4u, 4u));
    }
    return vec4<u32>(pair_bits(lo.x, lo.y, i), pair_bits(lo.z, lo.w, i + 2u),
                     pair_bits(hi.x, hi.y, i + 4u), pair_bits(hi.z, hi.w, i + 6u));
}

// Eight f16 (raw words w) into Ah at o .. o+7 (exact: f16 -> f32 -> f16).
fn put_a(o: u32, w: vec4<u32>) {
    let h0 = vec2<f16>(unpack2x16float(w.x));
    let h1 = vec2<f16>(unpack2x16float(w.y));
    let h2 = vec2<f16>(unpack2x16float(w.z));
    let h3 = vec2<f16>(unpack2x16float(w.w));
    Ah[o] = h0.x;
    Ah[o + 1u] = h0.y;
    Ah[o + 2u] = h1.x;
    Ah[o + 3u] = h1.y;
    Ah[o + 4u] = h2.x;
    Ah[o + 5u] = h2.y;
    Ah[o + 6u] = h3.x;
    Ah[o + 7u] = h3.y;
}

// Eight f16 (raw words w) into Bh at o .. o+7 (exact: f16 -> f32 -> f16).
fn put_b(o: u32, w: vec4<u32>) {
    let h0 = vec2<f16>(unpack2x16float(w.x));
    let h1 = vec2<f16>(unpack2x16float(w.y));
    let h2 = vec2<f16>(unpack2x16float(w.z));
    let h3 = vec2<f16>(unpack2x16float(w.w));
    Bh[o] = h0.x;
    Bh[o + 1u] = h0.y;
    Bh[o + 2u] = h1.x;
    Bh[o + 3u] = h1.y;
    Bh[o + 4u] = h2.x;
    Bh[o + 5u] = h2.y;
    Bh[o + 6u] = h3.x;
    Bh[o + 7u] = h3.y;
}
