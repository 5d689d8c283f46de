//! End-to-end tests of the `cce` binary on bad input of every kind: a non-zero exit, a clear
//! `error:` message, never a panic.

mod common;

use common::*;

#[test]
fn missing_file() {
    fails(
        &["run", "--input", "/definitely/not/here.safetensors"],
        &["I/O error", "/definitely/not/here.safetensors"],
    );
}

#[test]
fn missing_tensor_name() {
    let fx = fixture();
    fails(
        &["run", "--input", s(&fx), "--targets-name", "labels"],
        &["tensor `labels` not found"],
    );
    fails(
        &["run", "--input", s(&fx), "--e-name", "hidden"],
        &["tensor `hidden` not found"],
    );
}

#[test]
fn wrong_shapes_and_dtypes() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.safetensors");
    let e = vec![0.5f32; 4 * 8];
    let c6 = vec![0.25f32; 16 * 6];
    let c8 = vec![0.25f32; 16 * 8];
    let t = vec![1.0f32; 4];
    let t5 = vec![1.0f32; 5];
    let write = |tensors: &[F32Tensor<'_>]| save_safetensors(&p, tensors, None).unwrap();
    let tensor = |name, shape, data| F32Tensor { name, shape, data };

    // D of E and C differ.
    write(&[
        tensor("E", &[4, 8], &e),
        tensor("C", &[16, 6], &c6),
        tensor("targets", &[4], &t),
    ]);
    fails(
        &["run", "--input", s(&p)],
        &["size mismatch", "D = 8", "D = 6"],
    );
    // E of rank 1.
    write(&[
        tensor("E", &[32], &e),
        tensor("C", &[16, 8], &c8),
        tensor("targets", &[4], &t),
    ]);
    fails(&["run", "--input", s(&p)], &["tensor `E` has shape [32]"]);
    // Float targets.
    write(&[
        tensor("E", &[4, 8], &e),
        tensor("C", &[16, 8], &c8),
        tensor("targets", &[4], &t),
    ]);
    fails(
        &["run", "--input", s(&p)],
        &["tensor `targets` has dtype F32"],
    );
    // A reference of the wrong length.
    write(&[
        tensor("E", &[4, 8], &e),
        tensor("C", &[16, 8], &c8),
        tensor("lse_ref", &[5], &t5),
    ]);
    fails(
        &["run", "--input", s(&p), "--targets-name", "lse_ref"],
        &["lse_ref"],
    );
}

#[test]
fn out_of_range_target_and_non_finite_input() {
    let dir = tempfile::tempdir().unwrap();
    let mut ds = generate(&"randn".parse().unwrap(), 8, 4, 20, 1).unwrap();
    ds.targets[3] = 20;
    let p = dir.path().join("t.safetensors");
    save_dataset(&p, &ds).unwrap();
    fails(
        &["run", "--input", s(&p)],
        &["target out of range at row 3: 20 is not in [0, 20)"],
    );
    ds.targets[3] = 0;
    ds.e[5] = f32::NAN;
    save_dataset(&p, &ds).unwrap();
    fails(&["run", "--input", s(&p)], &["non-finite value"]);
    // --no-check-finite lets the NaN through (forward and backward): a NaN loss, no error.
    let out = ok(&["run", "--input", s(&p), "--no-check-finite"]);
    assert!(out.to_lowercase().contains("nan"), "{out}");
    // ... but a NaN output never passes --check.
    fails(
        &["run", "--input", s(&p), "--no-check-finite", "--check"],
        &["--check: 4 of 4 outputs", "loss (non-finite values)"],
    );
}

#[test]
fn mean_over_no_valid_row_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let p = small_file(dir.path(), false);
    // A shift as long as the sequence (all 48 rows, or 16-row sequences) drops every target.
    for args in [
        &["--shift", "48"][..],
        &["--shift", "16", "--seq-len", "16"][..],
        &["--shift", "1000", "--no-backward"][..],
    ] {
        let shift = args[1];
        let mut full = vec!["run", "--input", s(&p)];
        full.extend_from_slice(args);
        let se = fails(
            &full,
            &[
                "all targets ignored",
                "none of the 48 rows has a target",
                "ignore_index -100",
                &format!("shift {shift}"),
                "mean over valid rows is undefined",
                "reduction = sum",
            ],
        );
        assert_eq!(cce(&full).status.code(), Some(1), "{se}");
    }
    // Every target equal to ignore_index.
    let mut ds = generate(&"randn".parse().unwrap(), 8, 4, 20, 1).unwrap();
    ds.targets = vec![-100; 8];
    let q = dir.path().join("ignored.safetensors");
    save_dataset(&q, &ds).unwrap();
    fails(
        &["run", "--input", s(&q)],
        &["all targets ignored", "none of the 8 rows", "shift 0"],
    );
    // Sum and none accept such a batch: loss 0 over 0 rows.
    let out = ok(&[
        "run",
        "--input",
        s(&p),
        "--shift",
        "48",
        "--reduction",
        "sum",
    ]);
    assert!(
        out.contains("loss       0.000000  (sum over 0 valid rows)"),
        "{out}"
    );
    let out = ok(&["run", "--input", s(&q), "--reduction", "none"]);
    assert!(
        out.contains("no valid row (mean undefined), sum 0.000000"),
        "{out}"
    );
    let out = ok(&["run", "--input", s(&q), "--reduction", "sum", "--argmax"]);
    assert!(
        out.contains("top-1 accuracy undefined (no valid row)"),
        "{out}"
    );
}

#[test]
fn options_that_cannot_work_fail_before_the_call() {
    let dir = tempfile::tempdir().unwrap();
    let p = small_file(dir.path(), false);
    let g = dir.path().join("g.safetensors");
    fails(
        &[
            "run",
            "--input",
            s(&p),
            "--save-grads",
            s(&g),
            "--no-d-e",
            "--no-d-c",
        ],
        &["--save-grads: no gradient would be computed"],
    );
    // A directory is refused, not replaced (checked before the call).
    fails(
        &["run", "--input", s(&p), "--save-grads", s(dir.path())],
        &["not a writable file path"],
    );
    let txt = dir.path().join("plot.txt");
    fails(&["repro", "--plot", s(&txt)], &["--plot", "PNG", ".png"]);
    assert!(!txt.exists());
    // A classifier name given on the command line must exist (no silent Q8_0 fallback).
    fails(&["run", "--input", s(&p), "--c-name", "nope"], &["nope"]);
}

#[test]
fn corrupt_and_truncated_files() {
    let dir = tempfile::tempdir().unwrap();
    let fx = std::fs::read(fixture()).unwrap();
    let trunc = dir.path().join("trunc.safetensors");
    std::fs::write(&trunc, &fx[..fx.len() / 3]).unwrap();
    fails(
        &["run", "--input", s(&trunc)],
        &["trunc.safetensors", "corrupt or truncated"],
    );
    let tiny = dir.path().join("tiny.safetensors");
    std::fs::write(&tiny, &fx[..5]).unwrap();
    fails(&["run", "--input", s(&tiny)], &["corrupt or truncated"]);
    let junk = dir.path().join("junk.safetensors");
    std::fs::write(
        &junk,
        b"this is not a safetensors file at all, not even close",
    )
    .unwrap();
    fails(&["run", "--input", s(&junk)], &["corrupt or truncated"]);
    let empty = dir.path().join("empty.safetensors");
    std::fs::write(&empty, b"").unwrap();
    fails(&["run", "--input", s(&empty)], &["corrupt or truncated"]);
}

#[test]
fn bad_flag_values() {
    fails(
        &["run", "--reduction", "foo"],
        &["'foo'", "--reduction", "unknown reduction"],
    );
    fails(
        &["run", "--filter-eps", "-1"],
        &["invalid option filter_eps", "(0, 1]"],
    );
    fails(&["run", "--filter-eps", "abc"], &["filter_eps 'abc'"]);
    fails(
        &["run", "--backend", "nope"],
        &["'nope'", "--backend", "cpu"],
    );
    fails(&["run", "--dtype", "f8"], &["'f8'", "--dtype"]);
    fails(
        &["run", "--label-smoothing", "1.5"],
        &["invalid option label_smoothing"],
    );
    fails(&["run", "--z-loss", "-1"], &["invalid option z_loss"]);
    fails(&["run", "--softcap", "0"], &["invalid option softcap"]);
    fails(
        &["run", "--max-dropped-mass", "2"],
        &["invalid option max_dropped_mass"],
    );
    fails(&["run", "--seq-len", "0"], &["invalid option seq_len"]);
    fails(&["run", "--case", "nope"], &["unknown distribution `nope`"]);
    fails(&["run", "--n", "5000"], &["--n 5000", "1024 rows"]);
    fails(&["run", "--case", "real", "--v", "10"], &["--d and --v"]);
    fails(&["run", "--d", "10"], &["--case"]);
    fails(
        &[
            "run", "--case", "randn", "--n", "8", "--d", "0", "--v", "10",
        ],
        &["D and V must be >= 1"],
    );
    fails(
        &[
            "run", "--case", "iid:50", "--n", "8", "--d", "4", "--v", "10",
        ],
        &["iid entropy"],
    );
    fails(&["run", "--seq-len", "1000"], &["seq_len"]);
    fails(
        &["run", "--no-backward", "--save-grads", "x.safetensors"],
        &["--save-grads"],
    );
    fails(
        &["run", "--input", "a.safetensors", "--case", "lm"],
        &["--case"],
    );
    if !cfg!(feature = "cuda") {
        fails(&["run", "--backend", "cuda"], &["--features cuda"]);
    }
    if !cfg!(feature = "wgpu") {
        fails(&["repro", "--backend", "wgpu"], &["--features wgpu"]);
    }
}

#[test]
fn unwritable_save_grads() {
    let dir = tempfile::tempdir().unwrap();
    let f = small_file(dir.path(), false);
    let g = dir.path().join("no/such/dir/g.safetensors");
    fails(
        &["run", "--input", s(&f), "--save-grads", s(&g)],
        &["--save-grads", "not a writable file path"],
    );
    fails(
        &["run", "--input", s(&f), "--save-grads", s(dir.path())],
        &["--save-grads", "not a writable file path"],
    );
    let g = dir.path().join("g.safetensors");
    fails(
        &[
            "run",
            "--input",
            s(&f),
            "--no-d-e",
            "--no-d-c",
            "--save-grads",
            s(&g),
        ],
        &["no gradient would be computed"],
    );
}

#[test]
fn closed_stdout_is_not_a_panic() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_cce"))
        .args([
            "repro",
            "--n",
            "16",
            "--d",
            "16",
            "--v",
            "256",
            "--repeats",
            "1",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let se = text(&out.stderr);
    assert!(out.status.success(), "{se}");
    assert!(!se.contains("panicked"), "{se}");
}

/// `--save-grads` naming an input file (the same path, or another spelling of it) would
/// overwrite the input with the gradients: refused before any work, the input left intact.
#[test]
fn save_grads_over_an_input_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let f = small_file(dir.path(), false);
    let before = std::fs::read(&f).unwrap();
    let other_spelling = dir.path().join(".").join(f.file_name().unwrap());
    for out in [f.clone(), other_spelling] {
        fails(
            &["run", "--input", s(&f), "--save-grads", s(&out)],
            &["--save-grads", "is an input"],
        );
    }
    assert_eq!(
        std::fs::read(&f).unwrap(),
        before,
        "the input was overwritten"
    );
    // The shipped fixture (no --input) is an input too.
    let fx = fixture();
    fails(
        &["run", "--n", "4", "--save-grads", s(&fx)],
        &["--save-grads", "is an input"],
    );
}
