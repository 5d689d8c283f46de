// panels_wide.wgsl: the panel staging of the named main loop's wide form (`NamedForm::Wide`,
// the backend's form at 128 x 128 tiles of 16 x 16 threads): the reference SGEMM
// `t128r8k16nu`'s structure (docs/perf-log.md, session 17) for the logits tile and the
// backward's second product. Prepended after tile_io.wgsl; the main loops
// that call these helpers are generated (src/named.rs, `logits_wide`, `prod_wide`). The module
// text holds this file before gemm.wgsl: naga 30 processes a pipeline's overrides in the order
// they are declared and cannot take a named one (these three) after the unnamed ones it makes
// for the panels' array lengths.
//
// Parameters
//   Bindings and flags of tile_io.wgsl; overrides WG, TK (gemm.wgsl), DTYPE (common.wgsl);
//   derived: W_T4 = 2*WG slots per depth row, W_E elements per 16-byte unit (4 for f32, 8 for
//   f16 and bf16), W_UNITS = TILE*TK/W_E units per row panel.
// Tiling
//   gemm.wgsl's double-buffered panels As/Bs, TK depth rows of W_T4 vec4 slots per buffer,
//   with the tile's column groups interleaved: group q (tile columns 4q .. 4q+3) lives in slot
//   (q & 1)*WG + (q >> 1) (`slot_of`), so that the thread's two row groups 2ty, 2ty+1 are
//   slots ty and WG + ty and its two class groups slots tx and WG + tx: a depth step reads
//   As[ty], As[WG + ty] (one address per row of threads) and Bs[tx], Bs[WG + tx] (WG
//   consecutive slots across the threads of a row), as `t128r8k16nu` reads its panels.
//   Row panels (e and c for the logits; depth along D): TILE rows x TK depths in units of
//   W_E consecutive depths of one row, one 16-byte vector load per unit where it is whole and
//   aligned (`load_unit`), element by element otherwise; unit u is tile row
//   `unit_row(u % TILE)`, depths (u / TILE)*W_E .. of the panel, stored transposed one
//   element at a time (`put_unit`). Column panels (the backward's X = e or c over a D slice):
//   TK source rows x TILE columns in groups of four columns (gemm.wgsl's `load4` /
//   `decode4`): group g is depth row g / W_T4 and slot g % W_T4, columns
//   4*group_of_slot(g % W_T4) .. of the slice, one vec4 store (`put_colg`). The G panels
//   (grad.wgsl's depth vectors) go to slots `other` and WG + other (`put_gp_w`).
// Thread mapping
//   Unit or group u of a panel is staged by invocation u % (WG*WG) (the generated loops take
//   u = li + s*WG*WG for each of their slots s). Rows of consecutive units are swizzled
//   (`unit_row`: bits 2-4 of the index to bits 3-5 of the row, bit 5 to bit 2) so that the 32
//   units of a subgroup's store of one element land in 32 different banks (the bank of a
//   unit with row index r is r % 32 when WG is a multiple of 8); the column groups of
//   consecutive invocations are consecutive slots.
// Bounds
//   Sources: `load_unit` reads elements i .. i+nv-1 only (one vec4 of the binding when nv =
//   W_E and i is a multiple of W_E: that vec4 holds exactly those elements), with nv = 0 for
//   rows past the chunk and depths past D; the column groups through gemm.wgsl's `load4`
//   likewise. Workgroup memory: put_unit writes As/Bs[(buf*TK + d)*W_T4 + slot] with buf < 2,
//   d = (u / TILE)*W_E + x < TK (u < W_UNITS, x < W_E), slot < W_T4: below 4*TK*WG, the
//   panels' length; put_colg the same with d = g / W_T4 < TK (g < TK*W_T4); put_gp_w
//   (buf*TK + kk)*W_T4 + other (+ WG) with kk < TK, other < WG. Each slot of a buffer is
//   written once per panel (unit_row is a bijection on 0 .. TILE-1 for TILE a multiple of 64;
//   `NamedForm::wide` needs WG a multiple of 8); src/named.rs's tests enumerate all of it.

// Slots of a depth row of a panel.
override W_T4: u32 = 2u * WG;
// Elements of one 16-byte unit of a row panel: 4 f32, 8 f16 or bf16.
override W_E: u32 = 4u + 4u * ((DTYPE + 1u) / 2u);
// Units of one row panel (TILE rows x TK depths).
override W_UNITS: u32 = 8u * WG * TK / W_E;

// Slot of tile-column group q (< W_T4) in a depth row.
fn slot_of(q: u32) -> u32 {
    return (q & 1u) * WG + (q >> 1u);
}

// Tile-column group held by slot s (< W_T4): the inverse of slot_of.
fn group_of_slot(s: u32) -> u32 {
    return select(2u * (s - WG) + 1u, 2u * s, s < WG);
}

// Tile row of unit row index r (< TILE): bits 0-1 kept, bits 2-4 to 3-5, bit 5 to 2, bits 6..
// kept (a bijection on 0 .. TILE-1 when TILE is a multiple of 64).
fn unit_row(r: u32) -> u32 {
    return (r & 3u) | (((r >> 2u) & 7u) << 3u) | (((r >> 5u) & 1u) << 2u) | ((r >> 6u) << 6u);
}

// Bits of element k of a source: the word (f32) or its 16-bit half (f16, bf16); 0 and no read
// unless `ok`.
fn elem_bits(is_e: bool, k: u32, ok: bool) -> u32 {
    if !ok {
        return 0u;
    }
    let w = src_word(is_e, word_of(k));
    if DTYPE == 0u {
        return w;
    }
    return select(w & 0xffffu, w >> 16u, (k & 1u) == 1u);
}

// Raw words of the W_E elements i .. of a source of which the first nv exist (the others 0),
// packed as an aligned vector of the source holds them: element x in word x (f32), in half
// x % 2 of word x / 2 (f16, bf16). One vector load where whole and aligned.
fn load_unit(is_e: bool, i: u32, nv: u32) -> vec4<u32> {
    if nv == W_E && i % W_E == 0u {
        return src_quad(is_e, i / W_E);
    }
    if DTYPE == 0u {
        return vec4<u32>(elem_bits(is_e, i, nv > 0u), elem_bits(is_e, i + 1u, nv > 1u),
                         elem_bits(is_e, i + 2u, nv > 2u), elem_bits(is_e, i + 3u, nv > 3u));
    }
    return vec4<u32>(elem_bits(is_e, i, nv > 0u) | (elem_bits(is_e, i + 1u, nv > 1u) << 16u),
                     elem_bits(is_e, i + 2u, nv > 2u) | (elem_bits(is_e, i + 3u, nv > 3u) << 16u),
                     elem_bits(is_e, i + 4u, nv > 4u) | (elem_bits(is_e, i + 5u, nv > 5u) << 16u),
                     elem_bits(is_e, i + 6u, nv > 6u) | (elem_bits(is_e, i + 7u, nv > 7u) << 16u));
}

// Element x (< W_E, a constant at every call) of a unit's words.
fn unit_elem(w: vec4<u32>, x: u32) -> f32 {
    if DTYPE == 0u {
        return bitcast<f32>(w[x & 3u]);
    }
    let v = w[(x >> 1u) & 3u];
    let h = select(v & 0xffffu, v >> 16u, (x & 1u) == 1u);
    if DTYPE == 1u {
        return unpack2x16float(h).x;
    }
    return bitcast<f32>(h << 16u);
}

// Unit u (< W_UNITS) of a row panel of source rows base.. (n_src of them in the chunk),
// depths k0..: its raw words, zeros for a row past the chunk and depths past D.
fn fetch_unit(is_e: bool, base: u32, n_src: u32, k0: u32, u: u32) -> vec4<u32> {
    let t = tile();
    let m = unit_row(u % t);
    let col = k0 + (u / t) * W_E;
    var nv = 0u;
    if base + m < n_src && col < P.d {
        nv = min(P.d - col, W_E);
    }
    return load_unit(is_e, src_off(is_e) + (base + m) * P.d + col, nv);
}

// Unit u (< W_UNITS) of a row panel, words w, into half buf of As (`is_a`) or Bs, transposed:
// element x at depth row (u / TILE)*W_E + x, the slot of its row's group, component row % 4.
fn put_unit(is_a: bool, w: vec4<u32>, u: u32, buf: u32) {
    let t = tile();
    let r = u % t;
    // slot_of(unit_row(r) >> 2).
    let slot = ((r >> 5u) & 1u) * WG + (((r >> 2u) & 7u) | ((r >> 6u) << 3u));
    let f = (buf * TK + (u / t) * W_E) * W_T4 + slot;
    let c = r & 3u;
    if is_a {
        As[f][c] = unit_elem(w, 0u);
        As[f + W_T4][c] = unit_elem(w, 1u);
        As[f + 2u * W_T4][c] = unit_elem(w, 2u);
        As[f + 3u * W_T4][c] = unit_elem(w, 3u);
        if W_E > 4u {
            As[f + 4u * W_T4][c] = unit_elem(w, 4u);
            As[f + 5u * W_T4][c] = unit_elem(w, 5u);
            As[f + 6u * W_T4][c] = unit_elem(w, 6u);
            As[f + 7u * W_T4][c] = unit_elem(w, 7u);
        }
    } else {
        Bs[f][c] = unit_elem(w, 0u);
        Bs[f + W_T4][c] = unit_elem(w, 1u);
        Bs[f + 2u * W_T4][c] = unit_elem(w, 2u);
        Bs[f + 3u * W_T4][c] = unit_elem(w, 3u);
        if W_E > 4u {
            Bs[f + 4u * W_T4][c] = unit_elem(w, 4u);
            Bs[f + 5u * W_T4][c] = unit_elem(w, 5u);
            Bs[f + 6u * W_T4][c] = unit_elem(w, 6u);
            Bs[f + 7u * W_T4][c] = unit_elem(w, 7u);
        }
    }
}

// Element index and valid elements of column group g (< TK*W_T4) of a column panel: source
// row j_base + g / W_T4 (n_src of them in the chunk), columns d0 + 4*group_of_slot(g % W_T4)
// .. of the slice.
fn colg(is_e: bool, j_base: u32, n_src: u32, d0: u32, g: u32) -> vec2<u32> {
    let k = g / W_T4;
    let col = d0 + 4u * group_of_slot(g % W_T4);
    var nv = 0u;
    if j_base + k < n_src && col < P.d {
        nv = min(P.d - col, 4u);
    }
    return vec2<u32>(src_off(is_e) + (j_base + k) * P.d + col, nv);
}

// Column group g's raw words (gemm.wgsl's load4).
fn fetch_colg(is_e: bool, j_base: u32, n_src: u32, d0: u32, g: u32) -> vec4<u32> {
    let c = colg(is_e, j_base, n_src, d0, g);
    return load4(is_e, c.x, c.y);
}

// Column group g (words w) into half buf of Bs: depth row g / W_T4, slot g % W_T4.
fn put_colg(w: vec4<u32>, is_e: bool, j_base: u32, n_src: u32, d0: u32, g: u32, buf: u32) {
    let c = colg(is_e, j_base, n_src, d0, g);
    Bs[(buf * TK + g / W_T4) * W_T4 + g % W_T4] = decode4(w, c.x);
}

// grad.wgsl's put_gp in the interleaved slots: depth vector q (lo, hi) of the thread's G block
// into the G panel of depths k0 .. k0 + TK − 1 in As[buf] when its depth own*8 + q lies in it:
// lo (columns other*8 .. +3, group 2·other) in slot `other`, hi in slot WG + other.
fn put_gp_w(lo: vec4<f32>, hi: vec4<f32>, q: u32, own: u32, other: u32, k0: u32, buf: u32) {
    let kk = own * 8u + q - k0;
    if kk < TK {
        let f = (buf * TK + kk) * W_T4 + other;
        As[f] = lo;
        As[f + WG] = hi;
    }
}
