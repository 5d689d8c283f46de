//! Helpers of the `cce` binary's end-to-end tests: run it, read its report, write small
//! input files. Each test file uses some of them.
#![allow(dead_code, unused_imports)]

pub use std::path::{Path, PathBuf};
pub use std::process::{Command, Output};

pub use cce_data::{generate, save_dataset, save_safetensors, Dataset, F32Tensor};

pub fn cce(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cce"))
        .args(args)
        .output()
        .expect("the cce binary runs")
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Asserts success and returns stdout.
pub fn ok(args: &[&str]) -> String {
    let out = cce(args);
    let (so, se) = (text(&out.stdout), text(&out.stderr));
    assert!(
        out.status.success(),
        "cce {args:?} failed ({:?})\nstdout:\n{so}\nstderr:\n{se}",
        out.status
    );
    assert!(!se.contains("panicked"), "stderr: {se}");
    so
}

/// The lines of `out` that start with `prefix` after their indentation.
pub fn lines_starting<'a>(out: &'a str, prefix: &str) -> Vec<&'a str> {
    out.lines()
        .filter(|l| l.trim_start().starts_with(prefix))
        .collect()
}

/// Asserts a clean failure whose stderr contains every one of `needles`; returns stderr.
pub fn fails(args: &[&str], needles: &[&str]) -> String {
    let out = cce(args);
    let (so, se) = (text(&out.stdout), text(&out.stderr));
    assert!(
        !out.status.success(),
        "cce {args:?} should fail\nstdout:\n{so}\nstderr:\n{se}"
    );
    assert_ne!(out.status.code(), Some(101), "exit 101 is a panic: {se}");
    assert!(!se.contains("panicked"), "cce {args:?} panicked:\n{se}");
    assert!(
        se.starts_with("error:"),
        "stderr should start with `error:`:\n{se}"
    );
    for n in needles {
        assert!(se.contains(n), "cce {args:?}: stderr lacks {n:?}:\n{se}");
    }
    se
}

pub fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/smollm2_lce_real_1k.safetensors")
}

pub fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 temp path")
}

/// A small generated problem (optionally with a bias), saved as f32 safetensors with i64
/// targets.
pub fn small_file(dir: &Path, bias: bool) -> PathBuf {
    let mut ds: Dataset = generate(&"lm".parse().unwrap(), 48, 24, 700, 3).unwrap();
    if bias {
        ds.bias = Some((0..ds.v).map(|j| ((j % 7) as f32 - 3.0) * 0.25).collect());
    }
    let p = dir.join(if bias {
        "small_bias.safetensors"
    } else {
        "small.safetensors"
    });
    save_dataset(&p, &ds).unwrap();
    p
}

/// The relative L2 error of one output in the `--check` table.
pub fn check_rel(out: &str, name: &str) -> f64 {
    let row = out
        .lines()
        .find(|l| l.trim_start().starts_with(&format!("| {name} ")))
        .unwrap_or_else(|| panic!("no check row for {name}:\n{out}"));
    row.split('|').nth(2).unwrap().trim().parse().unwrap()
}
