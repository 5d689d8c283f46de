// grad.wgsl: G tiles for the backward passes (prepended to bwd_de.wgsl and bwd_dc.wgsl after
// gemm.wgsl).
//
// Parameters
//   binding 4 `rs`       [n_rows] RowState: per-row coefficients and threshold (bwd_prep/tau).
//   binding 5 `slab`     f32 accumulators, read_write (layout in the including shader).
//   binding 6 `dropped`  [n_rows] atomic u32: per-row dropped mass, Σ g0 of skipped entries in
//                        2^-30 units (FLAG_REPORT).
//   binding 7 `counters` [slots, 4] u32: per workgroup (tiles visited, tiles skipped, entries
//                        kept, entries skipped), slot = slot_base + workgroup index.
// Tiling
//   The G tile is TILE x TILE f32 in workgroup memory `Gs` (16 KiB at TILE = 64), laid out as
//   the A operand [k][m] of the second product (see the including shader).
// Thread mapping
//   As gemm.wgsl: G(i, jj) of the thread's micro-tile replaces acc(i, jj).
// Bounds
//   rs[r] and dropped[r] only for r < n_rows; counters[slot*4 + 0..3] with slot = slot_base
//   + workgroup index, below slot_base + grid size (host-checked against the binding); Gs
//   below 16*WG*WG (see the including shader).
//
// G_ij = (a p_ij − c) off the target, gy at it, times dz/dx = 1 − tanh²(x_ij/s) under softcap
// (`dcap`, from the uncapped logit x) (MATH.md, "Backward"); g0 = p off the target, g0y at it
// (cce-core filter.rs); both target values come from the saved rest mass (bwd_prep.wgsl).
// A −inf (masked) logit has p = 0 and G = 0.
// A tile is kept when some entry of an active row has g0 ≥ τ_i (FLAG_FILTER), or, without
// the filter, when any row of the tile is active; the decision is uniform over the workgroup.

@group(0) @binding(4) var<storage, read> rs: array<RowState>;
@group(0) @binding(5) var<storage, read_write> slab: array<f32>;
@group(0) @binding(6) var<storage, read_write> dropped: array<atomic<u32>>;
@group(0) @binding(7) var<storage, read_write> counters: array<u32>;

var<workgroup> Gs: array<vec4<f32>, 16u * WG * WG>;
var<workgroup> flag_a: atomic<u32>;
var<workgroup> flag_u: u32;
var<workgroup> cnt: array<atomic<u32>, 4>;

// Per-thread scratch of a G tile (function-local in the entry point, passed by pointer).
struct Scratch {
    st: array<RowState, 8>,  // rows ty*8 + i of the current row tile
    g0sum: array<f32, 8>,    // Σ g0 of the row's entries in the thread's 8 classes
    n_ent: u32,              // entries (active row, valid class) of the thread
}

// Rows r_base + ty*8 + i of the chunk into `st` (inactive past the end).
fn load_rows(sc: ptr<function, Scratch>, r_base: u32, ty: u32) {
    for (var i = 0u; i < 8u; i++) {
        let r = r_base + ty * 8u + i;
        if r < P.n_rows {
            (*sc).st[i] = rs[r];
        } else {
            (*sc).st[i] = RowState(-1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0u, 0.0, 0u, 0u, 0u);
        }
    }
}

// Replace the logits in acc by G; returns whether this thread needs the tile.
fn grad_tile(acc: ptr<function, Acc>, sc: ptr<function, Scratch>, c_base: u32, tx: u32) -> bool {
    var need = false;
    (*sc).n_ent = 0u;
    for (var i = 0u; i < 8u; i++) {
        (*sc).g0sum[i] = 0.0;
    }
    let filtering = has_flag(FLAG_FILTER);
    for (var jj = 0u; jj < 8u; jj++) {
        let j = c_base + tx * 8u + jj;
        let valid_c = j < P.n_cls;
        var bias = 0.0;
        if valid_c {
            bias = ld_bias(j);
        }
        let gj = i32(P.cls0 + j);
        for (var i = 0u; i < 8u; i++) {
            var g = 0.0;
            let s = (*sc).st[i];
            if valid_c && s.live != 0u {
                (*sc).n_ent += 1u;
                let x = acc_get(acc, i, jj) + bias;
                let z = cap(x);
                var g0 = 0.0;
                if !is_neg_inf(z) {
                    let p = exp(z - s.lse);
                    g0 = p;
                    g = s.a * p - s.c;
                    if gj == s.y {
                        g0 = s.g0y;
                        g = s.gy;
                    }
                    if has_flag(FLAG_SOFTCAP) {
                        g *= dcap(x);
                    }
                }
                if !filtering || g0 >= s.tau {
                    need = true;
                }
                (*sc).g0sum[i] += g0;
            }
            acc_set(acc, i, jj, g);
        }
    }
    return need;
}

// Workgroup-uniform OR of `need`.
fn decide(need: bool, li: u32) -> bool {
    if need {
        atomicOr(&flag_a, 1u);
    }
    workgroupBarrier();
    if li == 0u {
        flag_u = atomicLoad(&flag_a);
        atomicStore(&flag_a, 0u);
    }
    return workgroupUniformLoad(&flag_u) != 0u;
}

fn init_shared(li: u32) {
    if li == 0u {
        atomicStore(&flag_a, 0u);
        for (var k = 0u; k < 4u; k++) {
            atomicStore(&cnt[k], 0u);
        }
    }
    workgroupBarrier();
}

// Adds the workgroup's counts to its slot (after all tiles).
fn flush_counters(li: u32, kept_tiles: u32, skipped_tiles: u32, kept_e: u32, skipped_e: u32,
                  slot: u32) {
    atomicAdd(&cnt[2], kept_e);
    atomicAdd(&cnt[3], skipped_e);
    workgroupBarrier();
    if li == 0u {
        counters[slot * 4u] = kept_tiles;
        counters[slot * 4u + 1u] = skipped_tiles;
        counters[slot * 4u + 2u] = atomicLoad(&cnt[2]);
        counters[slot * 4u + 3u] = atomicLoad(&cnt[3]);
    }
}

fn to_fixed(x: f32) -> u32 {
    return u32(ceil(min(x, 3.0) * FIXED_ONE));
}
