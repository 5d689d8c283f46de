use super::coop::*;
use super::*;

fn cfg(wg: u32, tk: u32) -> KernelConfig {
    KernelConfig {
        wg,
        tk,
        main_loop: MainLoop::Scalar,
        target_workgroups: 8,
        max_loop_iterations: 0,
        runtime_checks: false,
        cooperative_matrix: false,
        coop_backward: true,
        coop_tile: CoopTile::T128,
        coalesced_adds: true,
    }
}

#[test]
fn the_coop_backward_needs_f16_the_128_forward_and_no_filter() {
    let on = KernelConfig {
        cooperative_matrix: true,
        ..cfg(8, 8)
    };
    let caps = CoopCaps {
        t64: true,
        t128: true,
        t128w: true,
    };
    assert!(coop_backward(&on, caps, 1, false));
    // Whatever the configuration's tiles: the pass runs at 128 x 128.
    assert!(coop_backward(&KernelConfig { wg: 4, ..on }, caps, 1, false));
    // Not for bf16 or f32, not for filtered passes, not when either switch is off.
    assert!(!coop_backward(&on, caps, 2, false));
    assert!(!coop_backward(&on, caps, 0, false));
    assert!(!coop_backward(&on, caps, 1, true));
    let fma = KernelConfig {
        coop_backward: false,
        ..on
    };
    assert!(!coop_backward(&fma, caps, 1, false));
    assert!(!coop_backward(&cfg(8, 8), caps, 1, false));
    // Not on adapters without room for the 128 x 128 forward (the FMA backward there).
    let small = CoopCaps {
        t128: false,
        ..caps
    };
    assert!(!coop_backward(&on, small, 1, false));
    assert!(!coop_backward(&on, CoopCaps::default(), 1, false));
}

#[test]
fn the_documented_shapes_run_and_others_do_not() {
    for (wg, tks) in [
        (8, &[4, 8, 16, 32][..]),
        (16, &[8, 16, 32, 64]),
        (4, &[4, 8, 16]),
    ] {
        for &tk in tks {
            assert_eq!(cfg(wg, tk).shape_error(), None, "{wg}:{tk}");
        }
    }
    for (wg, tk) in [
        (8, 12),
        (8, 64),
        (16, 4),
        (4, 32),
        (0, 16),
        (17, 16),
        (8, 2),
        (1, 8),
    ] {
        assert!(cfg(wg, tk).shape_error().is_some(), "{wg}:{tk}");
    }
    assert_eq!(cfg(1, 4).shape_error(), None);
    let none = KernelConfig {
        target_workgroups: 0,
        ..cfg(8, 16)
    };
    assert!(none.shape_error().is_some());
}

#[test]
fn panel_groups_cover_a_panel() {
    for (wg, tk) in [(8, 16), (16, 8), (4, 4), (1, 4), (3, 12)] {
        let c = cfg(wg, tk);
        assert_eq!(c.shape_error(), None, "{wg}:{tk}");
        let groups = (c.tile() as u32 * tk / 4) as usize;
        assert_eq!((c.panel_groups() * wg * wg) as usize, groups, "{wg}:{tk}");
    }
}

#[test]
fn default_tiles_fit_48_kib_of_workgroup_memory() {
    assert!(cfg(8, 16).workgroup_bytes() <= 48 << 10);
    assert!(cfg(8, 32).workgroup_bytes() > 48 << 10);
    assert!(cfg(16, 8).workgroup_bytes() > 48 << 10);
}

#[test]
fn the_threshold_pass_takes_smaller_tiles_where_its_histogram_does_not_fit() {
    // 128 x 65 u32 of histogram (33,280 B) beside 16:8's 16 KiB or 16:16's 32 KiB of
    // panels: over the H200's 48 KiB and lavapipe's 32 KiB, so the pass runs at 8:8.
    let named = |wg, tk| KernelConfig {
        main_loop: MainLoop::Named,
        ..cfg(wg, tk)
    };
    assert_eq!(named(16, 8).hist_bytes(), 16384 + 33280);
    assert_eq!(named(16, 16).hist_bytes(), 32768 + 33280);
    for max in [32u64 << 10, 48 << 10] {
        assert_eq!(named(16, 8).hist_shape(max), Some((8, 8)), "{max}");
        assert_eq!(named(16, 16).hist_shape(max), Some((8, 8)), "{max}");
        assert_eq!(named(8, 8).hist_shape(max), Some((8, 8)), "{max}");
    }
    assert_eq!(named(8, 16).hist_shape(48 << 10), Some((8, 16)));
    assert_eq!(named(8, 16).hist_shape(32 << 10), Some((8, 8)));
    assert_eq!(named(16, 16).hist_shape(96 << 10), Some((16, 16)));
    assert_eq!(named(16, 16).hist_shape(8 << 10), None);
    // The quad loop keeps tk = 2·wg: 8:16.
    let quad = KernelConfig {
        main_loop: MainLoop::Quad,
        ..cfg(16, 32)
    };
    assert_eq!(quad.hist_shape(48 << 10), Some((8, 16)));
}

#[test]
fn the_quad_loop_needs_one_block_per_thread() {
    let quad = |wg, tk| KernelConfig {
        main_loop: MainLoop::Quad,
        ..cfg(wg, tk)
    };
    for (wg, tk) in [(8, 16), (4, 8), (2, 4), (16, 32)] {
        assert_eq!(quad(wg, tk).shape_error(), None, "{wg}:{tk}");
        // One 4 x 4 block per thread and operand: (TILE/4) * (TK/4) blocks.
        let blocks = (quad(wg, tk).tile() as u32 / 4) * (tk / 4);
        assert_eq!(blocks, wg * wg, "{wg}:{tk}");
    }
    for (wg, tk) in [(8, 8), (8, 32), (4, 4)] {
        assert!(quad(wg, tk).shape_error().is_some(), "{wg}:{tk}");
    }
}

#[test]
fn the_named_loop_runs_every_scalar_shape_in_the_same_memory() {
    // Same staging as the scalar loop: same shapes, panels and loop iterations.
    for wg in 0..=17 {
        for tk in 0..=68 {
            let s = cfg(wg, tk);
            let n = KernelConfig {
                main_loop: MainLoop::Named,
                ..s
            };
            assert_eq!(s.shape_error(), n.shape_error(), "{wg}:{tk}");
            if s.shape_error().is_none() {
                assert_eq!(s.workgroup_bytes(), n.workgroup_bytes());
                assert_eq!(s.fwd_iters(2304), n.fwd_iters(2304));
            }
        }
    }
    assert_eq!(MainLoop::Named.name(), "named");
}

#[test]
fn quad_panel_indices_stay_in_the_panels() {
    // logits_quad.wgsl's stores and reads, enumerated: every index below 4*TK*WG, every
    // slot of a depth row written exactly once per panel.
    for wg in [2u32, 4, 8, 16] {
        let tk = 2 * wg;
        let (s, len) = (2 * wg, 4 * tk * wg);
        for buf in 0..2 {
            let mut hits = vec![0u32; len as usize];
            for li in 0..wg * wg {
                let (mb, kb) = (li % s, li / s);
                let o = (buf * tk + 4 * kb) * s + (mb & 1) * wg + (mb >> 1);
                for x in 0..4 {
                    let at = o + x * s;
                    assert!(at < len, "{wg} {li} {x}");
                    hits[at as usize] += 1;
                }
            }
            let half = &hits[(buf * len / 2) as usize..((buf + 1) * len / 2) as usize];
            assert!(half.iter().all(|&h| h == 1), "wg {wg} buf {buf}");
            for k in 0..tk {
                for t in 0..wg {
                    let o = (buf * tk + k) * s;
                    assert!(o + wg + t < len);
                }
            }
        }
        // The two quads of thread t are slots t and WG + t.
        for t in 0..wg {
            let slot = |q: u32| (q & 1) * wg + (q >> 1);
            assert_eq!((slot(2 * t), slot(2 * t + 1)), (t, wg + t));
        }
    }
}

#[test]
fn the_default_panel_depth_follows_the_workgroup_memory() {
    let gpu = KernelConfig::for_adapter(wgpu::DeviceType::DiscreteGpu, 48 << 10);
    assert_eq!(
        (gpu.wg, gpu.tk, gpu.main_loop, gpu.max_loop_iterations),
        (8, 8, MainLoop::Named, 0)
    );
    assert_eq!(gpu.shape_error(), None);
    let small = KernelConfig::for_adapter(wgpu::DeviceType::DiscreteGpu, 16 << 10);
    assert_eq!(
        (small.wg, small.tk, small.main_loop),
        (8, 4, MainLoop::Scalar)
    );
    let cpu = KernelConfig::for_adapter(wgpu::DeviceType::Cpu, 32 << 10);
    assert_eq!((cpu.wg, cpu.tk, cpu.target_workgroups), (8, 8, 8));
    assert!(cpu.workgroup_bytes() <= 32 << 10);
    assert_eq!(cpu.shape_error(), None);
}

#[test]
fn cooperative_matrix_only_for_f16_on_capable_adapters() {
    let both = CoopCaps {
        t64: true,
        t128: true,
        t128w: true,
    };
    let on = KernelConfig {
        cooperative_matrix: true,
        ..cfg(8, 16)
    };
    assert_eq!(coop_forward(&on, both, 1), Some(CoopTile::T128));
    assert_eq!(coop_forward(&on, both, 2), None);
    assert_eq!(coop_forward(&on, CoopCaps::default(), 1), None);
    assert_eq!(coop_forward(&cfg(8, 16), both, 1), None);
    let old = KernelConfig {
        coop_tile: CoopTile::T64,
        ..on
    };
    assert_eq!(coop_forward(&old, both, 1), Some(CoopTile::T64));
    // The 128 x 128 forward takes any wg; the 64 x 64 one only 64 x 64 tiles.
    let wide = KernelConfig { wg: 4, ..on };
    assert_eq!(coop_forward(&wide, both, 1), Some(CoopTile::T128));
    assert_eq!(coop_forward(&KernelConfig { wg: 4, ..old }, both, 1), None);
    // The 64 x 64 per subgroup forward where asked and runnable, else the 128 x 128 one.
    let w = KernelConfig {
        coop_tile: CoopTile::T128W,
        ..on
    };
    assert_eq!(coop_forward(&w, both, 1), Some(CoopTile::T128W));
    assert_eq!(
        coop_forward(&KernelConfig { wg: 4, ..w }, both, 1),
        Some(CoopTile::T128W)
    );
    assert_eq!(coop_forward(&w, both, 2), None);
    let no_w = CoopCaps {
        t128w: false,
        ..both
    };
    assert_eq!(coop_forward(&w, no_w, 1), Some(CoopTile::T128));
    assert_eq!(coop_forward(&on, no_w, 1), Some(CoopTile::T128));
    assert_eq!(CoopTile::T128W.name(), "coop128w");
    let w16 = KernelConfig {
        coop_tile: CoopTile::T128W16,
        ..on
    };
    assert_eq!(coop_forward(&w16, both, 1), Some(CoopTile::T128W16));
    assert_eq!(coop_forward(&w16, no_w, 1), Some(CoopTile::T128));
    assert_eq!(CoopTile::T128W16.name(), "coop128w16");
    // Without room for the 128 x 128 forwards, the 64 x 64 one.
    let small = CoopCaps {
        t64: true,
        t128: false,
        t128w: false,
    };
    assert_eq!(coop_forward(&w, small, 1), Some(CoopTile::T64));
    assert_eq!(coop_forward(&on, small, 1), Some(CoopTile::T64));
    assert_eq!(coop_forward(&wide, small, 1), None);
    let f16_f32 = wgpu::CooperativeMatrixProperties {
        m_size: 16,
        n_size: 16,
        k_size: 16,
        ab_type: wgpu::CooperativeScalarType::F16,
        cr_type: wgpu::CooperativeScalarType::F32,
        saturating_accumulation: false,
    };
    let all = wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX
        | wgpu::Features::SHADER_F16
        | wgpu::Features::SUBGROUP;
    let feat = cfg!(feature = "coop-matrix");
    let capable = coop_capable(all, &[f16_f32], (32, 32), 48 << 10, 1024);
    assert_eq!(
        capable,
        CoopCaps {
            t64: feat,
            t128: feat,
            t128w: feat
        }
    );
    let f16_f16 = wgpu::CooperativeMatrixProperties {
        cr_type: wgpu::CooperativeScalarType::F16,
        ..f16_f32
    };
    let none = CoopCaps::default();
    assert_eq!(
        coop_capable(all, &[f16_f16], (32, 32), 48 << 10, 1024),
        none
    );
    assert_eq!(
        coop_capable(all, &[f16_f32], (16, 64), 48 << 10, 1024),
        none
    );
    assert_eq!(
        coop_capable(
            wgpu::Features::SHADER_F16,
            &[f16_f32],
            (32, 32),
            48 << 10,
            1024
        ),
        none
    );
    let short = COOP_WORKGROUP_BYTES as u32 - 4;
    assert_eq!(coop_capable(all, &[f16_f32], (32, 32), short, 1024), none);
    let below_128 = COOP128_WORKGROUP_BYTES as u32 - 4;
    assert_eq!(
        coop_capable(all, &[f16_f32], (32, 32), below_128, 1024),
        CoopCaps {
            t64: feat,
            t128: false,
            t128w: false
        }
    );
    assert_eq!(
        coop_capable(all, &[f16_f32], (32, 32), 48 << 10, 128),
        CoopCaps {
            t64: feat,
            t128: false,
            t128w: feat
        }
    );
    assert_eq!(
        coop_capable(all, &[f16_f32], (32, 32), 48 << 10, 64),
        CoopCaps {
            t64: feat,
            t128: false,
            t128w: false
        }
    );
}

#[test]
fn coop128_indices_stay_in_their_arrays() {
    // logits_coop128.wgsl's workgroup indices, enumerated (its header, "Bounds").
    const KC: u32 = 32;
    const SA: u32 = 40;
    const PANEL: u32 = 128 * SA;
    assert_eq!(COOP128_WORKGROUP_BYTES, 49152);
    assert_eq!(
        COOP128_WORKGROUP_BYTES,
        (2 * 2 * PANEL * 2 + 2048 * 4) as u64
    );
    // Panel stores: every depth slot of every row of a buffer written exactly once.
    for buf in 0..2 {
        let mut hits = vec![0u32; 2 * PANEL as usize];
        for li in 0..COOP128_INVOCATIONS {
            let o = buf * PANEL + (li >> 2) * SA + 8 * (li & 3);
            for row in [o, o + 64 * SA] {
                for x in 0..8 {
                    hits[(row + x) as usize] += 1;
                }
            }
        }
        for m in 0..128 {
            for k in 0..SA {
                let at = (buf * PANEL + m * SA + k) as usize;
                assert_eq!(hits[at], u32::from(k < KC), "buf {buf} row {m} depth {k}");
            }
        }
    }
    // Fragment loads: 16 rows of stride SA, 16 elements, inside the buffer, inside the
    // panel's KC depths.
    for s in 0..8u32 {
        let (ra, cb) = ((s >> 1) * 32 * SA, (s & 1) * 64 * SA);
        for kk in [0, 16] {
            for start in [
                ra,
                ra + 16 * SA,
                cb,
                cb + 16 * SA,
                cb + 32 * SA,
                cb + 48 * SA,
            ] {
                let last = start + kk + 15 * SA + 15;
                assert!(last < PANEL);
                assert!((start + kk) % SA + 15 < KC);
            }
        }
    }
    // The hand-over: in round f each subgroup's slot holds its fragment f; each invocation
    // reads one 8 x 8 block of one slot in one round, and the 32 blocks of a round cover
    // the eight slots' 8 x 256 elements exactly once.
    let mut hits = vec![[0u32; 2048]; 8];
    let mut per_round = [0u32; 8];
    for li in 0..COOP128_INVOCATIONS {
        let (tx, ty) = (li % 16, li / 16);
        let f = 4 * ((ty >> 1) & 1) + ((tx >> 1) & 3);
        per_round[f as usize] += 1;
        let o = (2 * (ty >> 2) + (tx >> 3)) * 256 + (ty & 1) * 128 + (tx & 1) * 8;
        // The block is fragment f of subgroup 2 (ty / 4) + tx / 8: tile rows ty*8 + i and
        // classes tx*8 + x.
        let s = 2 * (ty >> 2) + (tx >> 3);
        let (row0, cls0) = (32 * (s >> 1) + 16 * (f / 4), 64 * (s & 1) + 16 * (f % 4));
        for i in 0..8 {
            for x in 0..8 {
                let at = o + 16 * i + x;
                hits[f as usize][at as usize] += 1;
                let (r, c) = ((at % 256) / 16, at % 16);
                assert_eq!((row0 + r, cls0 + c), (ty * 8 + i, tx * 8 + x));
            }
        }
    }
    assert!(hits.iter().all(|round| round.iter().all(|&h| h == 1)));
    assert_eq!(per_round, [32; 8]);
    // The end-of-split merge's slots q < WG*WG = 256: 8q + 7 < 2048.
    const { assert!(8 * (COOP128_INVOCATIONS - 1) + 7 < 2048) };
}

#[test]
fn coop_backward_indices_stay_in_their_arrays() {
    // bwd_coop.wgsl's workgroup indices, enumerated (its header, "Tiling" and "Bounds"):
    // Ah and Bh hold 10240 f16 each, Ct 2048 f32.
    const ARRAY: u32 = 10240;
    let (gse, gsc, sx) = (72u32, 136u32, 136u32);
    for dc in [false, true] {
        // G staging: (half, index) of tile row r, class j, written once each.
        let mut at = std::collections::HashMap::new();
        for li in 0..COOP128_INVOCATIONS {
            let (tx, ty) = (li % 16, li / 16);
            let (h, o, st) = if dc {
                (ty >> 3, (ty & 7) * 8 * gsc + tx * 8, gsc)
            } else {
                (tx >> 3, ty * 8 * gse + (tx & 7) * 8, gse)
            };
            for i in 0..8 {
                for x in 0..8 {
                    let idx = o + i * st + x;
                    assert!(idx < ARRAY);
                    assert!(at.insert((h, idx), (ty * 8 + i, tx * 8 + x)).is_none());
                }
            }
        }
        assert_eq!(at.len(), 128 * 128);
        // A fragments: subgroup s, row fragment a, depth fragment q; element (m, k) is G
        // at output row / class ra + 16a + m and depth 16q + k.
        for s in 0..8u32 {
            let ra = 32 * (s >> 1);
            for a in 0..2 {
                for q in 0..8 {
                    for m in 0..16 {
                        for k in 0..16 {
                            let (h, idx) = if dc {
                                (q / 4, 16 * (q % 4) * gsc + ra + 16 * a + k * gsc + m)
                            } else {
                                (q / 4, (ra + 16 * a) * gse + 16 * (q % 4) + m * gse + k)
                            };
                            let (out, depth) = (ra + 16 * a + m, 16 * q + k);
                            let want = if dc { (depth, out) } else { (out, depth) };
                            assert_eq!(at.get(&(h, idx)), Some(&want), "dc {dc} s {s}");
                        }
                    }
                }
            }
        }
    }
    // X panels: every (depth row, column) of a 32 x 128 panel stored once; B fragments
    // (rows kk.., columns nb + 16j..) inside the stored part.
    let mut hits = vec![0u32; 32 * sx as usize];
    for li in 0..COOP128_INVOCATIONS {
        let o = (li >> 4) * sx + 8 * (li & 15);
        for row in [o, o + 16 * sx] {
            for x in 0..8 {
                hits[(row + x) as usize] += 1;
            }
        }
    }
    for k in 0..32 {
        for n in 0..sx {
            assert_eq!(hits[(k * sx + n) as usize], u32::from(n < 128));
        }
    }
    for s in 0..8u32 {
        let nb = 64 * (s & 1);
        for kk in [0, 16] {
            for j in 0..4 {
                let start = kk * sx + nb + 16 * j;
                assert!((start % sx) + 15 < 128 && start + 15 * sx + 15 < 32 * sx);
            }
        }
    }
    // Hand-over: lane l reads slot floats 32q + l = row (2q + l/16), column l % 16 of
    // the row-major 16 x 16 fragment; the 32 lanes read the slot once.
    let mut seen = [0u32; 256];
    for l in 0..32u32 {
        for q in 0..8 {
            let (r, c) = (2 * q + l / 16, l % 16);
            assert_eq!(32 * q + l, 16 * r + c);
            seen[(32 * q + l) as usize] += 1;
        }
    }
    assert!(seen.iter().all(|&n| n == 1));
}

#[test]
fn coop128w_indices_stay_in_their_arrays() {
    // logits_coop128w.wgsl's workgroup indices, enumerated (its header, "Bounds"), at
    // both panel depths (its KC override: 32, and 16 for CoopTile::T128W16).
    const ARRAY: u32 = 10240;
    assert_eq!(COOP128W_WORKGROUP_BYTES, 49152);
    assert_eq!(COOP128W_WORKGROUP_BYTES, (2 * ARRAY * 2 + 2048 * 4) as u64);
    for kc in [32u32, 16] {
        let sa = kc + 8;
        let panel = 128 * sa;
        let (gr, rs) = (kc / 8, 128 / (kc / 8));
        assert!(2 * panel <= ARRAY);
        // Panel stores: every depth slot of every row of a buffer written exactly once.
        for buf in 0..2 {
            let mut hits = vec![0u32; 2 * panel as usize];
            for li in 0..COOP128W_INVOCATIONS {
                let o = buf * panel + (li / gr) * sa + 8 * (li % gr);
                for t in 0..gr {
                    for x in 0..8 {
                        hits[(o + rs * t * sa + x) as usize] += 1;
                    }
                }
            }
            for m in 0..128 {
                for k in 0..sa {
                    let at = (buf * panel + m * sa + k) as usize;
                    assert_eq!(
                        hits[at],
                        u32::from(k < kc),
                        "kc {kc} buf {buf} row {m} k {k}"
                    );
                }
            }
        }
        // Fragment loads: 16 rows of stride SA, 16 elements, inside the buffer, inside
        // the panel's KC depths; the eight 16-byte rows of a load phase in distinct bank
        // groups.
        for s in 0..4u32 {
            let (ra, cb) = ((s >> 1) * 64 * sa, (s & 1) * 64 * sa);
            for kk in (0..kc).step_by(16) {
                for i in 0..4 {
                    for start in [ra + 16 * i * sa, cb + 16 * i * sa] {
                        assert!(start + kk + 15 * sa + 15 < panel);
                        assert!((start + kk) % sa + 15 < kc);
                    }
                }
            }
        }
        let groups: std::collections::BTreeSet<u32> =
            (0..8).map(|r| (r * sa * 2 / 16) % 8).collect();
        assert_eq!(groups.len(), 8, "kc {kc}");
    }
    // The hand-over: in round (a, h) subgroup s stores its fragments (a, 2h + x),
    // x < 2, column-major at stride 16 into slot 2s + x (Ct[(2s + x)*256 + 16 col + row]);
    // lane l reads Ct[512s + 256q + rho + 16x], x < 16, as tile row 64u + 16a + rho and
    // class 64v + 32h + 16q + x (take16). Every logit of the tile is read once.
    let mut seen = vec![0u32; 128 * 128];
    for s in 0..4u32 {
        let (u, v) = (s >> 1, s & 1);
        for (a, h) in (0..8u32).map(|r| (r / 2, r % 2)) {
            // What the two stores put where: slot element -> (tile row, class).
            let mut ct = vec![None; 2048];
            for x in 0..2 {
                let (row0, cls0) = (64 * u + 16 * a, 64 * v + 16 * (2 * h + x));
                for col in 0..16 {
                    for row in 0..16 {
                        let at = ((2 * s + x) * 256 + 16 * col + row) as usize;
                        assert!(at < 2048 && at < (2 * s + 2) as usize * 256);
                        ct[at] = Some((row0 + row, cls0 + col));
                    }
                }
            }
            for l in 0..32u32 {
                let (rho, q) = (l >> 1, l & 1);
                let o = 512 * s + 256 * q + rho;
                let r = 64 * u + 16 * a + rho;
                let j0 = 64 * v + 32 * h + 16 * q;
                for x in 0..16 {
                    let at = (o + 16 * x) as usize;
                    assert_eq!(ct[at], Some((r, j0 + x)), "s {s} round {a},{h} lane {l}");
                    seen[(r * 128 + j0 + x) as usize] += 1;
                }
            }
        }
    }
    assert!(seen.iter().all(|&n| n == 1));
    // Row states: lane l of subgroup s reads rows 64u + 16a + rho; row a is kept by the
    // lane with q = a / 2 as state k = a % 2 (store_row's 64u + 32q + 16k + rho); each
    // tile row is kept once per class half, and the two halves of a row share a scratch
    // slot (32u + l)*2 + k below 128.
    let mut kept = vec![[0u32; 2]; 128];
    let mut slots = vec![0u32; 128];
    for s in 0..4u32 {
        let (u, v) = (s >> 1, s & 1);
        for l in 0..32u32 {
            let (rho, q) = (l >> 1, l & 1);
            for k in 0..2 {
                let a = 2 * q + k;
                let row = 64 * u + 32 * q + 16 * k + rho;
                assert_eq!(row, 64 * u + 16 * a + rho);
                kept[row as usize][v as usize] += 1;
                let slot = (32 * u + l) * 2 + k;
                assert!(8 * slot + 7 < 1024);
                if v == 1 {
                    slots[slot as usize] += 1;
                }
            }
        }
    }
    assert!(kept.iter().all(|&k| k == [1, 1]));
    assert!(slots.iter().all(|&n| n == 1));
}

#[test]
fn atomics_only_for_non_deterministic_calls_on_devices_that_have_them() {
    assert_eq!(accumulation(true, false), Accumulation::Atomic);
    assert_eq!(accumulation(true, true), Accumulation::Slabs);
    assert_eq!(accumulation(false, false), Accumulation::Slabs);
    assert_eq!(accumulation(false, true), Accumulation::Slabs);
}

#[test]
fn coalesced_adds_need_subgroups_of_8_and_rows_of_8_lanes() {
    // The H200 (subgroups of 32) and lavapipe here (8) at wg 8 and 16.
    assert!(coalesced_adds(true, true, 32, 8));
    assert!(coalesced_adds(true, true, 8, 16));
    // Off when not asked for, without SUBGROUP, with subgroups under 8, at wg 4 or 12.
    assert!(!coalesced_adds(false, true, 32, 8));
    assert!(!coalesced_adds(true, false, 32, 8));
    assert!(!coalesced_adds(true, true, 4, 8));
    assert!(!coalesced_adds(true, true, 32, 4));
    assert!(!coalesced_adds(true, true, 32, 12));
}

#[test]
fn only_the_slabs_are_capped_by_the_budget() {
    // The H200's chunk at 8192 x 2304 x 256000 (session 19): 128 row tiles and 455 class
    // tiles; d_e's slab 75.5 MB, d_c's 268 MB; the default budget of 512 MiB.
    let room = (512u64 << 20, 2u64 << 30);
    let (de_slab, dc_slab) = (8192 * 2304 * 4, 29120 * 2304 * 4);
    let slabs = Accumulation::Slabs;
    let atomic = Accumulation::Atomic;
    assert_eq!(bwd_splits(slabs, 2048, (128, 455), de_slab, room), 7);
    assert_eq!(bwd_splits(slabs, 2048, (455, 128), dc_slab, room), 2);
    assert_eq!(bwd_splits(atomic, 2048, (128, 455), de_slab, room), 16);
    assert_eq!(bwd_splits(atomic, 2048, (455, 128), dc_slab, room), 5);
    // At most one split per tile, at least one split.
    assert_eq!(bwd_splits(atomic, 2048, (1, 3), de_slab, room), 3);
    assert_eq!(bwd_splits(atomic, 1, (4096, 3), de_slab, room), 1);
    assert_eq!(bwd_splits(slabs, 2048, (128, 455), de_slab, (0, 0)), 1);
    // A binding holds at most max_binding / slab of them.
    let wide = (u64::MAX, 3 * de_slab);
    assert_eq!(bwd_splits(slabs, 2048, (128, 455), de_slab, wide), 3);
}

#[test]
fn vector_loads_need_d_and_offset_multiples_of_4() {
    assert!(vec_loads(2304, 0));
    assert!(vec_loads(64, 128));
    assert!(!vec_loads(2303, 0));
    assert!(!vec_loads(64, 2));
}

#[test]
fn each_source_gets_its_own_flag() {
    let p = Params {
        d: 8,
        e_off: 4,
        c_off: 2,
        ..Params::default()
    };
    assert_eq!(panel_load_flags(&p), flags::VEC_E);
    let q = Params { d: 6, ..p };
    assert_eq!(panel_load_flags(&q), 0);
}

#[test]
fn loop_iterations_grow_with_d_and_stay_under_the_limiter_at_4096() {
    let c = cfg(8, 16);
    assert!(c.fwd_iters(64) < c.fwd_iters(128));
    assert!(c.bwd_iters(4096) < 65535);
    assert!(c.bwd_iters(8192) > 65535);
}
