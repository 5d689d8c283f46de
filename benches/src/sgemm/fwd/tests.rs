use super::*;
use naga::valid::{Capabilities, ValidationFlags, Validator};

#[test]
fn names_round_trip() {
    for s in [
        "fwd-real",
        "fwd-nowrite:scalar",
        "fwd-loopwg:t1",
        "fwd-loop:scalar:t1:f32",
        "fwd-real:pad12",
        "fwd-real:scalar:f32:pad4",
        "fwd-real:16x16",
        "fwd-real:16x8:loop",
        "fwd-loop:8x16:wide:t1",
        "fwd-real:16x16:pad4",
    ] {
        assert_eq!(FwdVariant::parse(s).unwrap().name(), s);
    }
    assert_eq!(
        FwdVariant::parse("fwd-real:8x8").unwrap().name(),
        "fwd-real"
    );
    assert!(
        FwdVariant::parse("fwd-real:16x4").is_err(),
        "2·tk / wg not whole"
    );
    assert!(
        FwdVariant::parse("fwd-real:4x8:wide").is_err(),
        "no wide form"
    );
    assert!(
        FwdVariant::parse("fwd-real:scalar:wide").is_err(),
        "a named form"
    );
    assert!(
        FwdVariant::parse("fwd-real:16x16:pad1").is_err(),
        "256 slots in 64"
    );
    assert!(FwdVariant::parse("fwd-real:axb").is_err());
    assert!(FwdVariant::parse("fwd-fast").is_err());
    assert!(FwdVariant::parse("fwd-real:x").is_err());
    assert!(FwdVariant::parse("fwd-loop:pad4").is_err());
    assert!(FwdVariant::parse("fwd-real:pad0").is_err());
    assert!(FwdVariant::parse("fwd-real:padx").is_err());
}

#[test]
fn splits_follow_the_backend() {
    // 8192 rows (128 row tiles), 29120 classes (455 tiles), 2048 workgroups: 16 splits of
    // 29 tiles, as WgpuBackend::class_splits for the first class chunk at 256000 classes.
    assert_eq!(split_tiles(8192, 29120, 2048, false, 64), 29);
    assert_eq!(29120u32.div_ceil(64).div_ceil(29), 16);
    assert_eq!(split_tiles(8192, 8192, 2048, false, 64), 8);
    assert_eq!(split_tiles(8192, 8192, 2048, true, 64), 1);
    assert_eq!(split_tiles(200, 300, 8, false, 64), 3);
    // 128 x 128 tiles: 64 row tiles, 228 class tiles, 32 splits of 8 tiles (the last 4).
    assert_eq!(split_tiles(8192, 29120, 2048, false, 128), 8);
    assert_eq!(29120u32.div_ceil(128).div_ceil(8), 29);
}

#[test]
fn every_module_validates() {
    let wide = NamedForm::wide(16, 16).unwrap();
    for (ml, form) in [
        (MainLoop::Named, NamedForm::Loop),
        (MainLoop::Scalar, NamedForm::Loop),
        (MainLoop::Named, wide),
    ] {
        let src = source(ml, form);
        let module = naga::front::wgsl::parse_str(&src)
            .unwrap_or_else(|e| panic!("{}", e.emit_to_string(&src)));
        Validator::new(ValidationFlags::all(), Capabilities::all())
            .validate(&module)
            .unwrap_or_else(|e| panic!("{}", e.emit_to_string(&src)));
        for entry in ["main", "fwd_nowrite", "fwd_loop", "fwd_loopwg"] {
            assert!(
                module.entry_points.iter().any(|e| e.name == entry),
                "{entry}"
            );
        }
        // The no-write pass stores no target logit, and its partials only for the check.
        assert!(function(&src, "row_step_nw").contains("i32(gj) == y"));
        assert!(!function(&src, "row_step_nw").contains("tlogit"));
        assert!(function(&src, "fwd_end_nw").contains("P.aux != 0.0"));
        let padded = pad_source(ml, form, 12);
        let module = naga::front::wgsl::parse_str(&padded)
            .unwrap_or_else(|e| panic!("{}", e.emit_to_string(&padded)));
        Validator::new(ValidationFlags::all(), Capabilities::all())
            .validate(&module)
            .unwrap_or_else(|e| panic!("{}", e.emit_to_string(&padded)));
        assert!(padded.contains("array<vec4<f32>, 768u>"), "12 KiB");
        assert!(module.entry_points.iter().any(|e| e.name == "fwd_pad"));
    }
}

/// Every variant on small chunks (ragged tiles, several tiles per split and one) against
/// f64, on the adapter (lavapipe here).
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
    let names = [
        "fwd-real",
        "fwd-real:scalar:t1",
        "fwd-nowrite",
        "fwd-nowrite:scalar",
        "fwd-loopwg",
        "fwd-loop:t1",
        "fwd-loop:scalar:f32",
        "fwd-real:f32",
        "fwd-real:pad12",
        "fwd-real:scalar:pad4",
        // 128 x 128 tiles (the wide form), and the wide form at 64 x 64 and 16-deep
        // panels (four f32 units per invocation).
        "fwd-real:16x8",
        "fwd-real:16x16",
        "fwd-real:16x16:f32",
        "fwd-loop:16x8:loop:f32",
        "fwd-real:8x16:wide:f32",
        "fwd-nowrite:8x8:wide",
    ];
    for (s, shape) in [(200, 300, 72), (70, 136, 264)].into_iter().enumerate() {
        for (i, name) in names.iter().enumerate() {
            let v = FwdVariant::parse(name).unwrap();
            let chunk = Chunk::new(&g, shape, v.dtype, (10 * s + i) as u64).unwrap();
            let b = FwdBuilt::new(&g, v).unwrap();
            let l = b.launch(&g, &chunk, 8).unwrap();
            let out = l.run(&g, shape.0).unwrap();
            let rows: Vec<usize> = (0..shape.0 as usize).collect();
            let (ratio, what) = check(v, &chunk, l.splits, &out, &rows);
            assert!(
                ratio <= 1.0,
                "{name} {shape:?}: {ratio:.2} x tolerance at {what}"
            );
            // The check sees a misplaced split (the output read as one tile per split).
            if l.splits.1 > 1 {
                let (bad, _) = check(v, &chunk, (l.splits.0, 1), &out, &rows);
                assert!(bad > 1.0, "{name}: the check missed a wrong split");
            }
            // The timed launch of an ablation writes no partials.
            if !matches!(v.kind, FwdKind::Real) {
                let fresh = b.launch(&g, &chunk, 8).unwrap();
                let back = g
                    .run_read(&fresh.timed, &[(&fresh.part, fresh.part.size())])
                    .unwrap();
                assert!(back[0].iter().all(|&x| x == 0), "{name} wrote partials");
            }
        }
    }
}
