//! End-to-end tests of the `cce` binary: the main job on the real fixture, `repro` with its
//! plot, options, side outputs and saved gradients on small files, `.npy` inputs.

mod common;

use common::*;

#[test]
fn default_run_prints_the_reference_loss() {
    let out = ok(&["run"]);
    let loss = out
        .lines()
        .find(|l| l.starts_with("loss "))
        .unwrap_or_else(|| panic!("no loss line:\n{out}"));
    assert!(loss.contains("2.14276"), "{loss}");
    let reference = out
        .lines()
        .find(|l| l.starts_with("reference "))
        .unwrap_or_else(|| panic!("no reference line:\n{out}"));
    assert!(reference.contains("2.142760"), "{reference}");
    assert!(
        reference.contains("matches to 4 decimals: 2.1428"),
        "{reference}"
    );
    for needle in [
        "N = 1024, D = 576, V = 49152",
        "dtype f32",
        "max |lse - lse_ref|",
        "peak RSS",
        "forward call",
        "backward call",
        "strategy",
        "dropped mass/row",
    ] {
        assert!(out.contains(needle), "missing {needle:?}:\n{out}");
    }
}

#[test]
fn real_rows_with_check_side_outputs_and_saved_grads() {
    let dir = tempfile::tempdir().unwrap();
    let grads = dir.path().join("g.safetensors");
    let out = ok(&[
        "run",
        "--case",
        "real",
        "--n",
        "32",
        "--entropy",
        "--argmax",
        "--filter-eps",
        "off",
        "--check",
        "--save-grads",
        s(&grads),
    ]);
    assert!(out.contains("N = 32, D = 576"), "{out}");
    assert!(out.contains("entropy    min"), "{out}");
    assert!(out.contains("top-1 accuracy"), "{out}");
    assert!(out.contains("filter            off (exact)"), "{out}");
    // Exact f32 against f64: every relative error is small, and the check passes.
    for name in ["loss", "lse", "entropy", "d_e", "d_c"] {
        let rel = check_rel(&out, name);
        assert!(rel < 1e-4, "{name}: rel L2 {rel}\n{out}");
    }
    assert!(
        out.contains("verdict: pass (every output within its tolerance)"),
        "{out}"
    );
    let bytes = std::fs::read(&grads).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8_lossy(&bytes[8..8 + header_len]);
    assert!(
        header.contains("\"d_e\"") && header.contains("\"d_c\""),
        "{header}"
    );
    assert!(
        header.contains("[32,576]") && header.contains("[49152,576]"),
        "{header}"
    );
    assert_eq!(bytes.len(), 8 + header_len + 4 * (32 * 576 + 49152 * 576));
}

#[test]
fn file_with_bias_every_option_and_check() {
    let dir = tempfile::tempdir().unwrap();
    let f = small_file(dir.path(), true);
    let grads = dir.path().join("g.safetensors");
    let out = ok(&[
        "run",
        "--input",
        s(&f),
        "--softcap",
        "20",
        "--reduction",
        "sum",
        "--shift",
        "1",
        "--seq-len",
        "16",
        "--label-smoothing",
        "0.1",
        "--z-loss",
        "1e-4",
        "--filter-eps",
        "1e-3",
        "--max-dropped-mass",
        "1e-2",
        "--no-filter-c-grad",
        "--deterministic",
        "--workspace-budget-mib",
        "64",
        "--ignore-index",
        "-1",
        "--grad-dtype",
        "f32",
        "--check",
        "--save-grads",
        s(&grads),
    ]);
    assert!(out.contains("bias yes"), "{out}");
    assert!(out.contains("dtype f32 (the file's)"), "{out}");
    assert!(out.contains("softcap 20"), "{out}");
    assert!(out.contains("shift 1, seq_len 16"), "{out}");
    assert!(out.contains("(sum over 45 valid rows)"), "{out}");
    assert!(out.contains("| d_bias "), "{out}");
    assert!(
        out.contains("saved      d_e [48, 24], d_c [700, 24], d_bias [700]"),
        "{out}"
    );
    assert!(check_rel(&out, "loss") < 1e-5, "{out}");
    assert!(check_rel(&out, "lse") < 1e-5, "{out}");
}

/// A problem whose f16 gradients overflow under `--reduction sum`: `e = 100` everywhere,
/// `c = 0` (so `p = 1/2` for both classes), every target 0, hence
/// `d_c[0] = Σ_i (1/2 − 1) · 100 = −50 · 2000 = −1e5`, beyond f16's largest finite 65504.
fn overflowing_f16_file(dir: &Path) -> PathBuf {
    let (n, d, v) = (2000usize, 4usize, 2usize);
    let ds = Dataset {
        name: "overflow".into(),
        n,
        d,
        v,
        e: vec![100.0; n * d],
        c: vec![0.0; v * d],
        bias: None,
        targets: vec![0; n],
        lse_ref: None,
        nll_ref: None,
        seq_len: None,
    };
    let p = dir.join("overflow.safetensors");
    save_dataset(&p, &ds).unwrap();
    p
}

#[test]
fn check_fails_with_status_1_when_an_output_is_outside_its_tolerance() {
    let dir = tempfile::tempdir().unwrap();
    let f = overflowing_f16_file(dir.path());
    let grads = dir.path().join("g.safetensors");
    let args = [
        "run",
        "--input",
        s(&f),
        "--dtype",
        "f16",
        "--reduction",
        "sum",
        "--check",
        "--save-grads",
        s(&grads),
    ];
    let out = cce(&args);
    let (so, se) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "stdout:\n{so}\nstderr:\n{se}");
    assert!(!se.contains("panicked"), "{se}");
    assert!(
        se.starts_with("error: --check: 1 of 4 outputs outside their tolerance"),
        "{se}"
    );
    assert!(se.contains("d_c (non-finite values)"), "{se}");
    let row = |name: &str| {
        so.lines()
            .find(|l| l.trim_start().starts_with(&format!("| {name} ")))
            .unwrap_or_else(|| panic!("no check row for {name}:\n{so}"))
            .to_string()
    };
    assert!(row("d_c").ends_with("FAIL |"), "{so}");
    for name in ["loss", "lse", "d_e"] {
        assert!(row(name).ends_with("pass |"), "{so}");
    }
    assert!(so.contains("verdict: FAIL (1 of 4 outputs"), "{so}");
    // The gradients are saved all the same (they are what to look at).
    assert!(grads.is_file());
    // f32 gradients hold -1e5: every output passes, exit 0.
    let out = ok(&[
        "run",
        "--input",
        s(&f),
        "--dtype",
        "f16",
        "--reduction",
        "sum",
        "--grad-dtype",
        "f32",
        "--check",
    ]);
    assert!(out.contains("verdict: pass"), "{out}");
    assert!(!out.contains("FAIL"), "{out}");
}

#[test]
fn reduction_none_bf16_forward_only_and_generated_cases() {
    let out = ok(&[
        "run",
        "--case",
        "c/8",
        "--n",
        "40",
        "--d",
        "32",
        "--v",
        "300",
        "--seed",
        "5",
        "--reduction",
        "none",
        "--dtype",
        "bf16",
        "--no-backward",
    ]);
    assert!(out.contains("c/8 N=40 D=32 V=300 seed=5"), "{out}");
    assert!(out.contains("loss       [40] per row"), "{out}");
    assert!(out.contains("dtype bf16 (from --dtype)"), "{out}");
    assert!(!out.contains("backward call"), "{out}");
    let out = ok(&[
        "run",
        "--case",
        "iid:1.5",
        "--n",
        "16",
        "--d",
        "8",
        "--v",
        "100",
        "--reduction",
        "none",
        "--filter-eps",
        "off",
        "--check",
    ]);
    assert!(check_rel(&out, "d_e") < 1e-4, "{out}");
}

/// Writes a little-endian C-order `.npy` file (format 1.0).
fn write_npy(path: &Path, descr: &str, shape: &[usize], data: &[u8]) {
    let shape_s = match shape {
        [a] => format!("({a},)"),
        _ => format!(
            "({})",
            shape
                .iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let mut header =
        format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape_s}, }}");
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn npy_input_and_its_errors() {
    let dir = tempfile::tempdir().unwrap();
    let (n, d, v) = (6usize, 4usize, 10usize);
    let f32s = |k: usize, scale: f32| -> Vec<u8> {
        (0..k)
            .flat_map(|i| (((i * 7919) % 13) as f32 * scale - 0.3).to_le_bytes())
            .collect()
    };
    let e = dir.path().join("e.npy");
    let c = dir.path().join("c.npy");
    let t = dir.path().join("t.npy");
    write_npy(&e, "<f4", &[n, d], &f32s(n * d, 0.1));
    write_npy(&c, "<f4", &[v, d], &f32s(v * d, 0.05));
    let targets: Vec<u8> = (0..n as i64)
        .flat_map(|i| (i % v as i64).to_le_bytes())
        .collect();
    write_npy(&t, "<i8", &[n], &targets);
    let out = ok(&[
        "run",
        "--npy-e",
        s(&e),
        "--npy-c",
        s(&c),
        "--npy-targets",
        s(&t),
        "--check",
    ]);
    assert!(out.contains("N = 6, D = 4, V = 10"), "{out}");

    // c with the wrong D.
    let c_bad = dir.path().join("c_bad.npy");
    write_npy(&c_bad, "<f4", &[v, d + 1], &f32s(v * (d + 1), 0.05));
    fails(
        &[
            "run",
            "--npy-e",
            s(&e),
            "--npy-c",
            s(&c_bad),
            "--npy-targets",
            s(&t),
        ],
        &["size mismatch"],
    );
    // A missing file.
    let missing = dir.path().join("missing.npy");
    fails(
        &[
            "run",
            "--npy-e",
            s(&missing),
            "--npy-c",
            s(&c),
            "--npy-targets",
            s(&t),
        ],
        &["missing.npy"],
    );
    // A truncated file.
    let short = dir.path().join("short.npy");
    let full = std::fs::read(&e).unwrap();
    std::fs::write(&short, &full[..full.len() - 9]).unwrap();
    fails(
        &[
            "run",
            "--npy-e",
            s(&short),
            "--npy-c",
            s(&c),
            "--npy-targets",
            s(&t),
        ],
        &["short.npy"],
    );
    // --npy-e alone.
    fails(&["run", "--npy-e", s(&e)], &["--npy-c"]);
}

#[test]
fn repro_at_a_tiny_size_writes_a_png() {
    let dir = tempfile::tempdir().unwrap();
    let png = dir.path().join("repro.png");
    let out = ok(&[
        "repro",
        "--n",
        "32",
        "--d",
        "16",
        "--v",
        "512",
        "--repeats",
        "1",
        "--plot",
        s(&png),
    ]);
    for case in ["regular", "c/8", "e/8", "c*8", "e*8", "lm"] {
        assert!(
            out.lines().any(|l| l.starts_with(&format!("| {case} "))),
            "no row for {case}:\n{out}"
        );
    }
    assert!(out.contains("vs regular") && out.contains("1.00x"), "{out}");
    assert!(
        out.contains("tiles skipped") && out.contains("entropy (nats)"),
        "{out}"
    );
    let bytes = std::fs::read(&png).unwrap();
    assert!(bytes.len() > 1000, "PNG of {} bytes", bytes.len());
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
}

#[test]
fn repro_bad_values() {
    fails(
        &["repro", "--cases", "regular,nope"],
        &["unknown distribution `nope`"],
    );
    fails(&["repro", "--repeats", "0"], &["--repeats"]);
    fails(&["repro", "--n", "0"], &["--n, --d and --v must be >= 1"]);
    fails(
        &["repro", "--filter-eps", "2"],
        &["invalid option filter_eps"],
    );
    let dir = tempfile::tempdir().unwrap();
    let png = dir.path().join("no/such/dir/x.png");
    fails(
        &[
            "repro",
            "--n",
            "8",
            "--d",
            "8",
            "--v",
            "64",
            "--repeats",
            "1",
            "--cases",
            "regular",
            "--plot",
            s(&png),
        ],
        &["--plot"],
    );
}

/// A problem shorter than a tile (N = 5, the CPU plan's tiles have 64 rows): the strategy
/// label names the 5 rows of its one chunk, not the 64 of a tile.
#[test]
fn strategy_label_names_the_rows_of_a_short_problem() {
    let args = ["run", "--case", "lm", "--n", "5", "--d", "16", "--v", "64"];
    let out = ok(&args);
    let strategies = lines_starting(&out, "strategy ");
    assert_eq!(strategies.len(), 2, "{out}");
    for line in strategies {
        assert!(
            line.contains("strategy          chunked-dense(5 rows) (chunked-dense: 5-row"),
            "{line}"
        );
        assert!(!line.contains("64 rows"), "{line}");
    }
}

#[test]
fn vocab_parallel_ranks_give_the_single_device_call() {
    // Real rows over 3 ranks (V = 49152, 16384 classes each), judged against the f64 oracle.
    let out = ok(&["run", "--vocab-parallel", "3", "--n", "128", "--check"]);
    assert!(
        out.contains("cpu-vocab-parallel (3 ranks as threads"),
        "{out}"
    );
    assert!(out.contains("verdict: pass"), "{out}");
    // A file with a bias, V = 700 over 4 ranks, every option that changes the merge.
    let dir = tempfile::tempdir().unwrap();
    let f = small_file(dir.path(), true);
    let out = ok(&[
        "run",
        "--input",
        s(&f),
        "--vocab-parallel",
        "4",
        "--softcap",
        "20",
        "--label-smoothing",
        "0.1",
        "--z-loss",
        "1e-3",
        "--shift",
        "1",
        "--seq-len",
        "16",
        "--entropy",
        "--argmax",
        "--check",
    ]);
    assert!(out.contains("verdict: pass"), "{out}");
    fails(
        &["run", "--vocab-parallel", "2", "--backend", "wgpu"],
        &["--vocab-parallel 2: the ranks are simulated on the CPU"],
    );
}
