use super::*;
use naga::valid::{Capabilities, ValidationFlags, Validator};

#[test]
fn names_round_trip() {
    for s in [
        "bwd-real",
        "bwd-noslab:f32",
        "bwd-noprod",
        "dc-real",
        "dc-noslab",
        "dc-noprod:f32",
        "dc-nobias",
        "bwd-slab4",
        "dc-slab4:f32",
        "dc-real:w3",
        "bwd-atomic",
        "dc-atomic:f32",
        "bwd-real:t896",
        "dc-atomic:w2:t64",
        "bwd-atomic-co",
        "dc-atomic-co:f32:w2",
        "bwd-nog",
        "dc-nox:f32",
        "bwd-nobar",
        "dc-nofma",
        "bwd-dynk:t16",
        "dc-noprodc",
        "bwd-noslab:scalar",
        "dc-noprod:f32:scalar",
        "bwd-atomic:16x16",
        "dc-atomic-co:16x8",
        "bwd-nofma:16x16",
        "dc-real:f32:8x16:wide",
        "bwd-noslab:16x8:loop",
    ] {
        assert_eq!(BwdVariant::parse(s).unwrap().name(), s);
    }
    assert!(BwdVariant::parse("bwd-real:scalar:16x8:wide").is_err());
    assert!(BwdVariant::parse("bwd-real:16x4").is_err());
    assert!(BwdVariant::parse("bwd-nog:scalar").is_err());
    assert!(BwdVariant::parse("bwd-noprodc:scalar").is_err());
    assert!(BwdVariant::parse("dc-nobias:scalar").is_err());
    assert_eq!(
        BwdVariant::parse("bwd-real:scalar").unwrap().main_loop,
        MainLoop::Scalar
    );
    assert!(BwdVariant::parse("bwd-fast").is_err());
    assert!(BwdVariant::parse("bwd-nobias").is_err());
    assert!(BwdVariant::parse("dc-real:w0").is_err());
    assert!(BwdVariant::parse("dc-real:wx").is_err());
    assert!(BwdVariant::parse("bwd-real:x").is_err());
    assert!(BwdVariant::parse("bwd-real:t0").is_err());
    assert!(BwdVariant::parse("bwd-real:tx").is_err());
    assert_eq!(BwdVariant::parse("dc-real:t896").unwrap().target, Some(896));
}

#[test]
fn every_module_validates() {
    let mut modules = Vec::new();
    for pass in [BwdPass::De, BwdPass::Dc] {
        for kind in BwdKind::ALL {
            if kind == BwdKind::NoBias && pass == BwdPass::De {
                continue;
            }
            modules.push((pass, kind, MainLoop::Named));
            if !kind.named_only() {
                modules.push((pass, kind, MainLoop::Scalar));
            }
        }
    }
    let wide = NamedForm::wide(16, 16).unwrap();
    let modules = modules.into_iter().flat_map(|(pass, kind, ml)| {
        let forms = if ml == MainLoop::Named {
            vec![NamedForm::Loop, wide]
        } else {
            vec![NamedForm::Loop]
        };
        forms.into_iter().map(move |f| (pass, kind, ml, f))
    });
    for (pass, kind, main_loop, form) in modules {
        let src = source_with(pass, kind, main_loop, form);
        assert_eq!(
            src.matches("array<vec4<f32>>;").count(),
            usize::from(kind == BwdKind::Slab4),
            "{pass:?} {kind:?}"
        );
        let atomic = kind.is_atomic();
        assert_eq!(
            src.matches("fn co_transpose(").count(),
            usize::from(kind == BwdKind::AtomicCo)
        );
        assert_eq!(src.matches("fn ld_row8(").count(), usize::from(!atomic));
        assert_eq!(
            src.matches("array<atomic<f32>>;").count(),
            2 * usize::from(atomic)
        );
        let module = naga::front::wgsl::parse_str(&src)
            .unwrap_or_else(|e| panic!("{}", e.emit_to_string(&src)));
        Validator::new(ValidationFlags::all(), Capabilities::all())
            .validate(&module)
            .unwrap_or_else(|e| panic!("{}", e.emit_to_string(&src)));
        // noslab, noprod and dynk gate one thing by P.aux, the other product ablations
        // two (the slab update and their part of the product).
        let gates = match kind {
            BwdKind::NoSlab | BwdKind::NoProd | BwdKind::DynK => 1,
            k if k.is_prod_ablation() => 2,
            _ => 0,
        };
        assert_eq!(
            src.matches("P.aux != 0.0").count(),
            gates,
            "{pass:?} {kind:?}"
        );
        assert_eq!(
            src.matches("let kt = min(t, P.d + t);").count(),
            usize::from(kind == BwdKind::DynK)
        );
        assert_eq!(
            src.matches("for (var d0 = 0u; d0 < 0u;").count(),
            usize::from(kind == BwdKind::NoProdC)
        );
        assert_eq!(
            src.matches("bacc_lo += ").count(),
            // The named entry point sums the bias row by row, the scalar one in g_bias.
            if pass == BwdPass::Dc && kind != BwdKind::NoBias && main_loop == MainLoop::Named {
                8
            } else {
                0
            }
        );
    }
}

/// The coalesced modules with their scattered fallback taken out, on the adapter: they
/// match f64 only if every subgroup took the shuffles (lavapipe's subgroups of 8 here,
/// NVIDIA's of 32 on the device); D = 132 leaves rows off 32-byte alignment and a last
/// slice of 4 columns.
#[test]
fn coalesced_adds_match_without_their_fallback() {
    let g = match gpu::Gpu::open() {
        Ok(g) => g,
        Err(e) if std::env::var_os("CCE_REQUIRE_WGPU").is_none() => {
            eprintln!("skipping: {e}");
            return;
        }
        Err(e) => panic!("CCE_REQUIRE_WGPU set and {e}"),
    };
    if !(g.float_atomics && g.subgroups) {
        eprintln!(
            "skipping: no SHADER_FLOAT32_ATOMIC or SUBGROUP on {}",
            g.info.name
        );
        return;
    }
    const FALLBACK: &str = "add_rows4_scattered(l0, h0, l1, h1, l2, h2, l3, h3, base, ok, n0);";
    for (i, name) in [
        "bwd-atomic-co",
        "dc-atomic-co",
        "bwd-atomic-co:f32",
        // Rows of 16 threads: each 8-lane row group one half of a row.
        "bwd-atomic-co:16x8",
        "dc-atomic-co:16x8:f32",
    ]
    .iter()
    .enumerate()
    {
        let v = BwdVariant::parse(name).unwrap();
        let form = v.shape.named_form(v.main_loop);
        let src = source_with(v.pass, v.kind, v.main_loop, form);
        assert_eq!(src.matches(FALLBACK).count(), 1, "{name}: the fallback");
        let b = BwdBuilt::with_source(&g, v, src.replace(FALLBACK, "")).unwrap();
        for (s, shape) in [(70, 300, 136), (130, 136, 72), (70, 136, 132)]
            .into_iter()
            .enumerate()
        {
            let chunk = Chunk::new(&g, shape, v.dtype, (100 + 10 * i + s) as u64).unwrap();
            let l = b.launch(&g, &chunk, 8).unwrap();
            let slab = l.run(&g).unwrap();
            let (ratio, what) = check_all(v, &chunk, l.slabs, &slab);
            assert!(
                ratio <= 1.0,
                "{name} without fallback {shape:?}: {ratio:.2} x tolerance at {what}"
            );
        }
    }
}

/// Every variant on small chunks (ragged tiles, several slices and splits) against f64,
/// and its timed launch writing no slab where it should not, on the adapter (lavapipe
/// here).
#[test]
fn every_variant_matches_the_f64_reference() {
    let g = match gpu::Gpu::open() {
        Ok(g) => g,
        Err(e) if std::env::var_os("CCE_REQUIRE_WGPU").is_none() => {
            eprintln!("skipping: {e}");
            return;
        }
        Err(e) => panic!("CCE_REQUIRE_WGPU set and {e}"),
    };
    // D = 132: the last slice's row segments past D − 8 (Slab4's scalar path; the chunks
    // take D % 4 = 0, so no segment is off 16-byte alignment here).
    for (s, shape) in [(70, 300, 136), (130, 136, 72), (70, 136, 132)]
        .into_iter()
        .enumerate()
    {
        for (i, name) in [
            "bwd-real",
            "bwd-noslab",
            "bwd-noprod",
            "bwd-real:f32",
            "dc-real",
            "dc-noslab",
            "dc-noprod",
            "dc-nobias",
            "dc-real:f32",
            "bwd-slab4",
            "dc-slab4",
            "dc-real:w2",
            "bwd-atomic",
            "dc-atomic",
            "bwd-atomic:f32:t16",
            "dc-atomic:w2",
            "bwd-real:t16",
            "bwd-atomic-co",
            "dc-atomic-co",
            "bwd-atomic-co:f32:t16",
            "dc-atomic-co:w2",
            "bwd-nog",
            "bwd-nox",
            "bwd-nobar",
            "bwd-nofma",
            "bwd-dynk",
            "bwd-noprodc",
            "dc-nog",
            "dc-nox",
            "dc-nobar",
            "dc-nofma:f32",
            "dc-dynk",
            "dc-noprodc",
            "bwd-noslab:scalar",
            "bwd-noprod:scalar",
            "dc-real:scalar",
            // 128 x 128 tiles (the wide form; 16:16's 32 KiB + 24 B of workgroup memory
            // is over lavapipe's 32 KiB), the loop form there, and the wide form at 64 x
            // 64 (16-deep panels: four column groups and f32 units per invocation).
            "bwd-real:16x8",
            "dc-real:16x8:f32",
            "bwd-atomic:16x8:f32",
            "dc-atomic-co:16x8",
            "bwd-noslab:16x8:loop",
            "bwd-nox:16x8",
            "dc-nofma:16x8",
            "bwd-nog:16x8",
            "dc-dynk:16x8",
            "bwd-real:8x16:wide:f32",
            "dc-atomic:8x16:wide",
            "bwd-nofma:8x8:wide",
        ]
        .iter()
        .enumerate()
        {
            let v = BwdVariant::parse(name).unwrap();
            if (v.kind.is_atomic() && !g.float_atomics)
                || (v.kind == BwdKind::AtomicCo && !g.subgroups)
            {
                eprintln!(
                    "{name}: skipped, no SHADER_FLOAT32_ATOMIC or SUBGROUP on {}",
                    g.info.name
                );
                assert!(BwdBuilt::new(&g, v).is_err());
                continue;
            }
            let chunk = Chunk::new(&g, shape, v.dtype, (10 * s + i) as u64).unwrap();
            let b = BwdBuilt::new(&g, v).unwrap();
            let l = b.launch(&g, &chunk, 8).unwrap();
            // (d_c at 128 x 128 tiles has one row tile at 70 rows.)
            assert!(
                l.splits.0 > 1 || v.shape.tile() > 64,
                "{shape:?}: one split"
            );
            let slab = l.run(&g).unwrap();
            let (ratio, what) = check_all(v, &chunk, l.slabs, &slab);
            assert!(
                ratio <= 1.0,
                "{name} {shape:?}: {ratio:.2} x tolerance at {what}"
            );
            if v.kind == BwdKind::NoProdC {
                continue;
            }
            // The check sees a missing slab.
            let (bad, _) = check_all(v, &chunk, l.slabs - 1, &slab);
            assert!(bad > 1.0, "{name}: the check missed a slab");
            if matches!(v.kind, BwdKind::NoSlab | BwdKind::NoProd) || v.kind.is_prod_ablation() {
                let fresh = b.launch(&g, &chunk, 8).unwrap();
                let back = g
                    .run_read(&fresh.timed, &[(&fresh.slab, fresh.slab.size())])
                    .unwrap();
                assert!(back[0].iter().all(|&x| x == 0), "{name} wrote the slab");
            }
        }
    }
}
