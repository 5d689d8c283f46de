// fwd_coop128_main.wgsl: the entry point of the 128 x 128 cooperative-matrix forward
// (logits_coop128.wgsl's logits tile, fwd_partial.wgsl's pass).
//
// Parameters
//   As logits_coop128.wgsl and fwd_partial.wgsl.
// Tiling
//   As logits_coop128.wgsl.
// Thread mapping
//   As logits_coop128.wgsl: one-dimensional workgroups of WG*WG = 256 invocations.
// Bounds
//   As logits_coop128.wgsl and fwd_partial.wgsl: its accesses are theirs.

// One-dimensional (subgroup builtins need it); (tx, ty) = (li mod WG, li / WG) as in the
// WG x WG layout of the other tiled shaders.
@compute @workgroup_size(WG * WG, 1, 1)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32,
        @builtin(subgroup_id) sg: u32) {
    sg_index = min(sg, 7u);
    fwd_partial(wid, vec3<u32>(li % WG, li / WG, 0u), li);
}
