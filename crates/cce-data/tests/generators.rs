//! Generator tests: parsing, determinism, target entropies, and the `lm` acceptance bands.

use std::time::Instant;

use cce_data::{generate, measure, DataError, Dataset, Distribution, LmParams};

fn gen(dist: &str, n: usize, d: usize, v: usize, seed: u64) -> Dataset {
    let dist: Distribution = dist.parse().unwrap();
    let ds = generate(&dist, n, d, v, seed).unwrap();
    ds.validate().unwrap();
    assert!(ds.targets.iter().all(|&t| t >= 0 && (t as usize) < v));
    assert!(ds.e.iter().chain(&ds.c).all(|x| x.is_finite()));
    ds
}

#[test]
fn parse_and_display() {
    use Distribution::*;
    let cases = [
        ("randn", Randn),
        (
            "c/8",
            Scaled {
                e_scale: 1.0,
                c_scale: 0.125,
            },
        ),
        (
            "e/8",
            Scaled {
                e_scale: 0.125,
                c_scale: 1.0,
            },
        ),
        (
            "c*8",
            Scaled {
                e_scale: 1.0,
                c_scale: 8.0,
            },
        ),
        (
            " E*8 ",
            Scaled {
                e_scale: 8.0,
                c_scale: 1.0,
            },
        ),
        (
            "e*2,c/4",
            Scaled {
                e_scale: 2.0,
                c_scale: 0.25,
            },
        ),
        ("iid", Iid { entropy_nats: 2.5 }),
        ("iid:4", Iid { entropy_nats: 4.0 }),
        ("lm", Lm),
        ("lm:small", LmWith(LmParams::SMALL_VOCAB)),
        ("lm:large", LmWith(LmParams::LARGE_VOCAB)),
    ];
    for (s, want) in cases {
        let got: Distribution = s.parse().unwrap();
        assert_eq!(got, want, "{s}");
        // Display gives a name that parses back to the same distribution.
        assert_eq!(
            got.to_string().parse::<Distribution>().unwrap(),
            want,
            "{s}"
        );
    }
    for bad in [
        "", "gauss", "c/0", "c/-1", "x*8", "c%8", "iid:-1", "iid:abc", "c/",
    ] {
        assert!(
            matches!(
                bad.parse::<Distribution>(),
                Err(DataError::InvalidParameter(_))
            ),
            "{bad}"
        );
    }
    for bad in ["iid:-1", "iid:abc", "iid:inf"] {
        let msg = bad.parse::<Distribution>().unwrap_err().to_string();
        assert!(msg.contains("entropy"), "{bad}: {msg}");
    }
    assert_eq!(LmParams::for_vocab(49152), LmParams::SMALL_VOCAB);
    assert_eq!(LmParams::for_vocab(256000), LmParams::LARGE_VOCAB);
}

#[test]
fn invalid_parameters() {
    let d = Distribution::Randn;
    assert!(matches!(
        generate(&d, 4, 0, 4, 1),
        Err(DataError::InvalidParameter(_))
    ));
    assert!(matches!(
        generate(&d, 4, 4, 0, 1),
        Err(DataError::InvalidParameter(_))
    ));
    let iid = |h| Distribution::Iid { entropy_nats: h };
    assert!(matches!(
        generate(&iid(2.5), 4, 4, 1, 1),
        Err(DataError::InvalidParameter(_))
    ));
    assert!(matches!(
        generate(&iid(5.0), 4, 4, 100, 1),
        Err(DataError::InvalidParameter(_))
    ));
    assert!(matches!(
        generate(&iid(0.0), 4, 4, 100, 1),
        Err(DataError::InvalidParameter(_))
    ));
    let bad = Distribution::LmWith(LmParams {
        topic_keep: 1.5,
        ..LmParams::SMALL_VOCAB
    });
    assert!(matches!(
        generate(&bad, 4, 64, 100, 1),
        Err(DataError::InvalidParameter(_))
    ));
    let bad = Distribution::Scaled {
        e_scale: f32::NAN,
        c_scale: 1.0,
    };
    assert!(matches!(
        generate(&bad, 4, 4, 4, 1),
        Err(DataError::InvalidParameter(_))
    ));
    // measure refuses a hand-made dataset without classes instead of panicking.
    let empty = Dataset {
        name: "empty".into(),
        n: 2,
        d: 3,
        v: 0,
        e: vec![0.0; 6],
        c: vec![],
        bias: None,
        targets: vec![0, 0],
        lse_ref: None,
        nll_ref: None,
        seq_len: None,
    };
    assert!(matches!(
        measure(&empty),
        Err(DataError::InvalidParameter(_))
    ));
    let short = Dataset { v: 1, ..empty };
    assert!(matches!(
        measure(&short),
        Err(DataError::SizeMismatch { .. })
    ));
    // A shape whose size overflows is reported, not attempted.
    assert!(matches!(
        generate(&d, usize::MAX / 2, 4, 4, 1),
        Err(DataError::OutOfMemory { .. })
    ));
}

#[test]
fn hostile_shapes() {
    for dist in ["randn", "c/8", "iid", "lm"] {
        for (n, d, v) in [
            (1, 1, 1),
            (252, 123, 507),
            (129, 257, 129),
            (3, 2, 255),
            (0, 8, 16),
        ] {
            if dist == "iid" && v == 1 {
                continue; // no entropy > 0 exists with one class
            }
            let ds = gen(dist, n, d, v, 5);
            assert_eq!((ds.n, ds.d, ds.v), (n, d, v));
        }
    }
}

#[test]
fn deterministic_and_seed_dependent() {
    for dist in ["randn", "e*8", "iid", "lm"] {
        let a = gen(dist, 100, 48, 700, 11);
        let b = gen(dist, 100, 48, 700, 11);
        let c = gen(dist, 100, 48, 700, 12);
        assert_eq!(a, b, "{dist}: same seed, same data");
        assert_ne!(a.e, c.e, "{dist}");
        assert_ne!(a.c, c.c, "{dist}");
        assert_ne!(a.targets, c.targets, "{dist}");
        // Independent of the number of threads.
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let three = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        let x = one.install(|| gen(dist, 100, 48, 700, 11));
        let y = three.install(|| gen(dist, 100, 48, 700, 11));
        assert_eq!(x, a, "{dist}: 1 thread");
        assert_eq!(y, a, "{dist}: 3 threads");
    }
}

#[test]
fn randn_is_near_one_hot_and_scaled_variants_order() {
    let (n, d, v) = (128, 4096, 8192);
    let h = |dist: &str| measure(&gen(dist, n, d, v, 3)).unwrap();
    let randn = h("randn");
    // Near one-hot (logit std sqrt(D) = 64): CASES.md's ~0.1 nats.
    assert!(
        randn.entropy_mean < 0.2,
        "randn entropy {}",
        randn.entropy_mean
    );
    assert!(randn.max_prob_mean > 0.9, "{}", randn.max_prob_mean);
    let c8 = h("c/8");
    let cx8 = h("c*8");
    // c/8 flattens the softmax (the seed's slow case), c*8 sharpens it further.
    assert!(
        c8.entropy_mean > 0.5 && c8.entropy_mean < 3.0,
        "c/8 entropy {}",
        c8.entropy_mean
    );
    assert!(
        cx8.entropy_mean < randn.entropy_mean + 1e-9,
        "c*8 entropy {}",
        cx8.entropy_mean
    );
    // The logit std is ~sqrt(D) times the scales.
    assert!(
        (randn.row_logit_std / (d as f64).sqrt() - 1.0).abs() < 0.1,
        "{}",
        randn.row_logit_std
    );
}

#[test]
fn iid_hits_its_entropy() {
    for (h, n, d, v) in [
        (2.5, 512, 256, 16384),
        (4.0, 256, 128, 4096),
        (1.0, 256, 64, 2000),
    ] {
        let dist = Distribution::Iid { entropy_nats: h };
        let ds = generate(&dist, n, d, v, 21).unwrap();
        let s = measure(&ds).unwrap();
        assert!(
            (s.entropy_mean - h).abs() < 0.1,
            "iid:{h} measured {}",
            s.entropy_mean
        );
        // No shared prior: mean logits per class barely vary compared with a row's logits.
        assert!(s.class_mean_logit_std < 0.25 * s.row_logit_std, "{s}");
    }
}

/// The `lm` generator at the real shape lands in every acceptance band of CASES.md.
/// Costs two 4096 x 49152 x 576 f32 matmuls (~116 GMAC each: target sampling and measuring).
#[test]
fn lm_lands_in_every_band() {
    let t = Instant::now();
    let ds = gen("lm", 4096, 576, 49152, 1);
    let t_gen = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let s = measure(&ds).unwrap();
    let t_stats = t.elapsed().as_secs_f64();
    eprintln!("lm 4096 x 576 x 49152: generated in {t_gen:.1} s, measured in {t_stats:.1} s\n{s}");
    let checks = s.check_lm_bands();
    for c in &checks {
        eprintln!("{c}");
    }
    let out: Vec<_> = checks.iter().filter(|c| !c.ok).collect();
    assert!(out.is_empty(), "out of band: {out:#?}");
    // Realistic magnitudes: |e| in the tens to hundreds, |c| around one.
    let norm = |x: &[f32]| x.iter().map(|&y| y as f64 * y as f64).sum::<f64>().sqrt();
    let en = (0..ds.n).map(|i| norm(ds.e_row(i))).sum::<f64>() / ds.n as f64;
    let cn = (0..ds.v).map(|j| norm(ds.c_row(j))).sum::<f64>() / ds.v as f64;
    assert!(
        (50.0..1000.0).contains(&en) && (0.2..3.0).contains(&cn),
        "|e| {en}, |c| {cn}"
    );
}

/// A mid-size large-vocabulary case (preset 2): generation and measurement at V = 128256.
#[test]
fn lm_mid_size_large_vocab() {
    let ds = gen("lm", 256, 512, 128256, 2);
    let s = measure(&ds).unwrap();
    eprintln!("{s}");
    assert!(s.entropy_mean > 1.2 && s.entropy_mean < 3.5, "{s}");
    assert!(
        s.significant_mean > 40.0 && s.significant_mean < 300.0,
        "{s}"
    );
    assert!(s.significant_frac < 0.003, "{s}");
}

/// The seed shape (N = 32768, D = 4096, V = 256000): 4.5 GiB of f32. Not run by default
/// (memory and time); `cargo test -p cce-data --release -- --ignored seed_shape`.
#[test]
#[ignore]
fn seed_shape() {
    let (n, d, v) = (32768, 4096, 256000);
    let t = Instant::now();
    let ds = generate(&Distribution::Randn, n, d, v, 1).unwrap();
    eprintln!(
        "randn seed shape generated in {:.1} s ({} MiB)",
        t.elapsed().as_secs_f64(),
        ds.bytes() >> 20
    );
    assert_eq!((ds.e.len(), ds.c.len()), (n * d, v * d));
    drop(ds);
    // lm at the seed's D and V (preset 2) on a few rows: targets sampled, then measured.
    let t = Instant::now();
    let ds = generate(&Distribution::Lm, 128, d, v, 1).unwrap();
    let t_gen = t.elapsed().as_secs_f64();
    let s = measure(&ds).unwrap();
    eprintln!(
        "lm 128 x 4096 x 256000: generated in {t_gen:.1} s, measured in {:.1} s\n{s}",
        t.elapsed().as_secs_f64() - t_gen
    );
    assert!(s.entropy_mean > 1.0 && s.entropy_mean < 3.5, "{s}");
}
