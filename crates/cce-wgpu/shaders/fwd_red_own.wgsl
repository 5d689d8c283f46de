// fwd_red_own.wgsl: the slots of fwd_partial.wgsl's row reduction in an array of their own,
// for the cooperative-matrix forward (logits_coop.wgsl, whose f16 panels are not gemm.wgsl's).
//
// Parameters
//   None of its own: the override WG.
// Tiling
//   HR·WG·WG Parts (one half of a tile's rows).
// Thread mapping
//   As fwd_partial.wgsl.
// Bounds
//   Slot idx < HR·WG·WG (fwd_partial.wgsl).

var<workgroup> red: array<Part, HR * WG * WG>;

fn red_put(idx: u32, st: Part) {
    red[idx] = st;
}

fn red_get(idx: u32) -> Part {
    return red[idx];
}
