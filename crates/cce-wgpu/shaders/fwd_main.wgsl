// fwd_main.wgsl: the entry point of the forward partials with FMA logits (fwd_partial.wgsl's
// pass on gemm.wgsl's logits tile).
//
// Parameters
//   As fwd_partial.wgsl.
// Tiling
//   As fwd_partial.wgsl and gemm.wgsl.
// Thread mapping
//   WG x WG threads, as tile_io.wgsl.
// Bounds
//   No access of its own.

@compute @workgroup_size(WG, WG, 1)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    fwd_partial(wid, lid, li);
}
