// slab_atomic_co.wgsl: slab_atomic.wgsl's f32 atomic adds made coalesced through subgroup
// shuffles (appended to a module holding slab_atomic.wgsl, whose `add_rows4_v` the host renames
// `add_rows4_scattered`, pipelines.rs; needs wgpu's SUBGROUP besides SHADER_FLOAT32_ATOMIC).
//
// Parameters
//   slab_atomic.wgsl's bindings (`slab`, `bslab`); the entry point passes its
//   local_invocation_index and @builtin(subgroup_size) to `co_init` first (the host adds both
//   to the entry point).
// Tiling
//   None of its own: add_rows4_v is called per D slice of a kept tile with four rows of the
//   thread's 8 x 8 block, as slab_atomic.wgsl's. In the scattered form one subgroup-wide
//   atomic add of a row touches one float in each of 8 different 32-byte sectors per row
//   (the lanes of a row hold columns 8 apart); here the row's 64 floats of its 8 lanes are
//   first transposed across those lanes (an 8 x 8 transpose in three butterfly stages of
//   subgroupShuffleXor, masks 4, 2, 1: 3 vec4 shuffles per row), so that add j of lane t
//   adds column 8j + t of the 8 lanes' 64: one add instruction covers 8 consecutive floats
//   (one sector) per row.
// Thread mapping
//   The lanes t = tx & 7 of one row group (tx = 8q .. 8q + 7, one ty) exchange values. That
//   needs the lanes of a row group to be subgroup lanes l ^ 1, l ^ 2, l ^ 4 of each other;
//   `co_init` checks it once per invocation at the entry point, where every invocation is
//   active: WG a multiple of 8 (so li ^ m, m < 8, is the same ty and tx ^ m), a subgroup at
//   least 8 wide and full (subgroupAdd(1) = subgroup_size), and subgroupShuffleXor(li, m) =
//   li ^ m for m = 1, 2, 4 in every lane; the verdict is subgroup-uniform (subgroupAll), and
//   a subgroup that fails it adds as slab_atomic.wgsl does. The shuffles run in the caller's
//   branches on the row's validity (`ok`), which are uniform over a row group, so every
//   lane a shuffle reads is active.
// Bounds
//   As slab_atomic.wgsl: row k of add_rows4_v only with its bit of `ok` set, column
//   n0 − 8t + t + 8j (the same 64 columns of the row group as the scattered form) added only
//   below D.

// Whether this invocation's subgroup takes the coalesced adds (set by co_init, uniform over
// the subgroup).
var<private> co_on: bool;

// Decide co_on (header, "Thread mapping"); called by every invocation at the entry point.
fn co_init(li: u32, sg_size: u32) {
    let p1 = subgroupShuffleXor(li, 1u) == (li ^ 1u);
    let p2 = subgroupShuffleXor(li, 2u) == (li ^ 2u);
    let p4 = subgroupShuffleXor(li, 4u) == (li ^ 4u);
    let full = subgroupAdd(1u) == sg_size;
    let shaped = (WG % 8u) == 0u && sg_size >= 8u;
    co_on = subgroupAll(shaped & full & p1 & p2 & p4);
}

// The 8 x 8 transpose across the lanes t of a row group: lane t's row (lo, hi) holds columns
// 8t .. 8t + 7 of the group's 64; the result's entry j is lane j's entry t. Each stage m swaps
// entry j of lane t with entry j ^ m of lane t ^ m where bits m of t and j differ.
fn co_transpose(lo_in: vec4<f32>, hi_in: vec4<f32>, t: u32) -> array<vec4<f32>, 2> {
    var lo = lo_in;
    var hi = hi_in;
    // m = 4: entries j and j + 4 (lo against hi).
    let b4 = (t & 4u) != 0u;
    let r4 = subgroupShuffleXor(select(hi, lo, b4), 4u);
    lo = select(lo, r4, b4);
    hi = select(r4, hi, b4);
    // m = 2: entries (0, 2), (1, 3) of lo and of hi.
    let b2 = (t & 2u) != 0u;
    let r2 = subgroupShuffleXor(select(vec4<f32>(lo.zw, hi.zw), vec4<f32>(lo.xy, hi.xy), b2),
                                2u);
    lo = select(vec4<f32>(lo.xy, r2.xy), vec4<f32>(r2.xy, lo.zw), b2);
    hi = select(vec4<f32>(hi.xy, r2.zw), vec4<f32>(r2.zw, hi.zw), b2);
    // m = 1: entries (0, 1), (2, 3) of lo and of hi.
    let b1 = (t & 1u) != 0u;
    let r1 = subgroupShuffleXor(select(vec4<f32>(lo.yw, hi.yw), vec4<f32>(lo.xz, hi.xz), b1),
                                1u);
    lo = select(vec4<f32>(lo.x, r1.x, lo.z, r1.y), vec4<f32>(r1.x, lo.y, r1.y, lo.w), b1);
    hi = select(vec4<f32>(hi.x, r1.z, hi.z, r1.w), vec4<f32>(r1.z, hi.y, r1.w, hi.w), b1);
    return array<vec4<f32>, 2>(lo, hi);
}

// One row (lo, hi) of the thread (columns n0 .. n0 + 7, lane t of its row group) added at the
// slab row `base`, coalesced: after the transpose, add j of lane t goes to column
// n0 − 8t + 8j + t, for columns below D.
fn co_add_row(lo: vec4<f32>, hi: vec4<f32>, base: u32, n0: u32, t: u32) {
    let q = co_transpose(lo, hi, t);
    let c0 = n0 - 8u * t + t;
    for (var j = 0u; j < 8u; j++) {
        let col = c0 + 8u * j;
        if col < P.d {
            atomicAdd(&slab[base + col], pick8(q[0], q[1], j));
        }
    }
}

// Adds four rows (lk, hk), k = 0..3, to the slab at floats base + k·D + n0 .. + 7 (n0 + jj < D),
// row k only where bit k of `ok` is set: coalesced where co_on, else slab_atomic.wgsl's adds.
// n0 = d0 + 8·tx with d0 a multiple of the tile 8·WG, so that (n0 / 8) & 7 = tx & 7 (WG a
// multiple of 8 wherever co_on).
fn add_rows4_v(l0: vec4<f32>, h0: vec4<f32>, l1: vec4<f32>, h1: vec4<f32>, l2: vec4<f32>,
               h2: vec4<f32>, l3: vec4<f32>, h3: vec4<f32>, base: u32, ok: u32, n0: u32) {
    if !co_on {
        add_rows4_scattered(l0, h0, l1, h1, l2, h2, l3, h3, base, ok, n0);
        return;
    }
    let t = (n0 >> 3u) & 7u;
    if (ok & 1u) != 0u {
        co_add_row(l0, h0, base, n0, t);
    }
    if (ok & 2u) != 0u {
        co_add_row(l1, h1, base + P.d, n0, t);
    }
    if (ok & 4u) != 0u {
        co_add_row(l2, h2, base + 2u * P.d, n0, t);
    }
    if (ok & 8u) != 0u {
        co_add_row(l3, h3, base + 3u * P.d, n0, t);
    }
}
