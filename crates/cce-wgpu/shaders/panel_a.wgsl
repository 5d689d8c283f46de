// panel_a.wgsl: the A panels of the passes whose workgroup memory holds nothing else of that
// size (the forward partials and the threshold pass; prepended after gemm.wgsl). The backward
// products declare a larger As in grad.wgsl, which also holds their G tile.
//
// Parameters
//   Overrides WG and TK of tile_io.wgsl and gemm.wgsl.
// Tiling
//   gemm.wgsl's double-buffered A panels: As[buf][k][m], 4*TK*WG vec4 (8 KiB at 8:16, 4 KiB
//   at 8:8).
// Thread mapping
//   None here (gemm.wgsl's and the main loop's).
// Bounds
//   gemm.wgsl's: every A panel index is below 4*TK*WG, the array's length.

var<workgroup> As: array<vec4<f32>, 4u * TK * WG>;
