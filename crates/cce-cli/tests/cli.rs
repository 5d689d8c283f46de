//! End-to-end tests of the `cce` binary: the main job on the real fixture, `repro` with its
//! plot, options and side outputs on small files, and bad input of every kind (non-zero exit,
//! a clear `error:` message, never a panic).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use cce_data::{generate, save_dataset, save_safetensors, Dataset, F32Tensor};

fn cce(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cce"))
        .args(args)
        .output()
        .expect("the cce binary runs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Asserts success and returns stdout.
fn ok(args: &[&str]) -> String {
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
fn lines_starting<'a>(out: &'a str, prefix: &str) -> Vec<&'a str> {
    out.lines()
        .filter(|l| l.trim_start().starts_with(prefix))
        .collect()
}

/// Asserts a clean failure whose stderr contains every one of `needles`; returns stderr.
fn fails(args: &[&str], needles: &[&str]) -> String {
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

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/smollm2_lce_real_1k.safetensors")
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 temp path")
}

/// A small generated problem (optionally with a bias), saved as f32 safetensors with i64
/// targets.
fn small_file(dir: &Path, bias: bool) -> PathBuf {
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
fn check_rel(out: &str, name: &str) -> f64 {
    let row = out
        .lines()
        .find(|l| l.trim_start().starts_with(&format!("| {name} ")))
        .unwrap_or_else(|| panic!("no check row for {name}:\n{out}"));
    row.split('|').nth(2).unwrap().trim().parse().unwrap()
}

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

/// The value of `key` followed by a size (`12.5 MiB`, `80 B`) in `line`, in bytes.
fn size_after(line: &str, key: &str) -> f64 {
    let rest = &line[line
        .find(key)
        .unwrap_or_else(|| panic!("{key:?} in {line}"))
        + key.len()..];
    let mut words = rest.split_whitespace();
    let x: f64 = words
        .next()
        .unwrap()
        .trim_start_matches('+')
        .parse()
        .unwrap();
    let unit = words.next().unwrap().trim_end_matches([')', ':', ',', ';']);
    let k = ["B", "KiB", "MiB", "GiB", "TiB"]
        .iter()
        .position(|u| *u == unit)
        .unwrap_or_else(|| panic!("unit {unit:?} in {line}"));
    x * 1024f64.powi(k as i32)
}

/// On the CPU the workspace of the call statistics is the plan's figure, not an allocation: the
/// report says so and prints the call's measured RSS growth, which a user can compare with the
/// process's peak RSS.
#[test]
fn cpu_memory_lines_separate_the_plan_workspace_from_the_measured_rss() {
    let out = ok(&[
        "run", "--case", "lm", "--n", "512", "--d", "64", "--v", "8192",
    ]);
    let line = |prefix: &str| -> &str {
        lines_starting(&out, prefix)
            .first()
            .copied()
            .unwrap_or_else(|| panic!("no line {prefix:?}:\n{out}"))
    };
    let peak = line("memory ");
    assert!(
        peak.contains("peak RSS") && peak.contains("(process VmHWM)"),
        "{peak}"
    );
    let process_peak = size_after(peak, "peak RSS ");
    let call = line("call RSS ");
    assert!(call.contains("the cpu backend's host buffers"), "{call}");
    if call.contains("at its peak") {
        let (before, at_peak) = (size_after(call, "call RSS "), size_after(call, "before, "));
        let growth = size_after(call, "at its peak (");
        assert!(
            at_peak <= process_peak && before <= at_peak,
            "{call}\n{peak}"
        );
        // fmt_bytes rounds to 0.1 of its unit.
        assert!(
            (at_peak - before - growth).abs() <= 0.06 * at_peak,
            "{call}"
        );
        // The backward holds the 512 x 8192 f32 logits chunk (16 MiB) at least.
        assert!(growth >= 16.0 * 1024.0 * 1024.0, "{call}");
    }
    let plan = line("plan workspace forward ");
    assert!(
        plan.contains("on cpu not allocated as such, the call RSS above is the measured figure"),
        "{plan}"
    );
    // The statistics' workspace lines say the same, and no bare "workspace" line is left.
    let stats = lines_starting(&out, "plan workspace    ");
    assert_eq!(stats.len(), 2, "{out}");
    for l in stats {
        assert!(
            l.ends_with("bytes (the plan's figure, not an allocation on cpu: see memory)"),
            "{l}"
        );
    }
    assert!(
        !out.lines()
            .any(|l| l.trim_start().starts_with("workspace ")),
        "{out}"
    );
    assert!(!out.contains("; workspace forward"), "{out}");
}

#[test]
fn seed_is_refused_on_real_data() {
    // The fixture is fixed data: a seed would be silently ignored, so it is an error (like
    // --d and --v there).
    fails(
        &["run", "--case", "real", "--seed", "3"],
        &["--seed 3", "generated cases", "nothing to seed"],
    );
    // Files and the default input are real data too: --seed needs a generated --case.
    fails(&["run", "--seed", "3"], &["--seed", "--case"]);
    fails(
        &["run", "--input", s(&fixture()), "--seed", "3"],
        &["--seed 3", "a file is fixed data", "nothing to seed"],
    );
    // So are --d and --v (clap's `requires` misses them next to --input, which conflicts
    // with --case).
    fails(
        &["run", "--input", s(&fixture()), "--d", "8"],
        &["--d and --v apply to generated cases", "its own shape"],
    );
    // A generated case takes it.
    let out = ok(&[
        "run", "--case", "randn", "--n", "8", "--d", "8", "--v", "32", "--seed", "3",
    ]);
    assert!(out.contains("seed=3"), "{out}");
}

/// With a wgpu adapter the backend line names it, and says so when it is a CPU (software)
/// device such as lavapipe, which `--backend auto` picks on a machine without a GPU.
#[cfg(feature = "wgpu")]
#[test]
fn backend_line_names_the_wgpu_adapter_and_a_software_one() {
    let info = match cut_cross_entropy::cce_wgpu::WgpuBackend::new() {
        Ok(b) => b.adapter_info().clone(),
        Err(e) => {
            if std::env::var("CCE_REQUIRE_WGPU").as_deref() == Ok("1") {
                panic!("CCE_REQUIRE_WGPU=1 but no wgpu backend: {e}");
            }
            println!("skipping: {e}");
            return;
        }
    };
    let software = info.device_type == wgpu::DeviceType::Cpu;
    // `auto` prefers CUDA when that is built (and may find a device).
    let names: &[&str] = if cfg!(feature = "cuda") {
        &["wgpu"]
    } else {
        &["wgpu", "auto"]
    };
    for name in names {
        let out = ok(&[
            "run",
            "--backend",
            name,
            "--case",
            "lm",
            "--n",
            "16",
            "--d",
            "16",
            "--v",
            "64",
            "--no-backward",
        ]);
        let line = out
            .lines()
            .find(|l| l.starts_with("backend "))
            .unwrap_or_else(|| panic!("no backend line:\n{out}"));
        assert!(
            line.contains(&format!("wgpu ({}", info.name)),
            "{line} ({info:?})"
        );
        assert_eq!(
            line.contains("a software vulkan driver: CPU speed"),
            software,
            "{line} ({info:?})"
        );
    }
}

/// With `XDG_RUNTIME_DIR` unset, empty or relative, Mesa's Vulkan device-selection layer had
/// libwayland print `error: XDG_RUNTIME_DIR is invalid or not set in the environment.` twice
/// on stderr before the report; `cce` now points the variable at a private directory of its own
/// (under `TMPDIR`) and removes that on exit.
#[cfg(feature = "wgpu")]
#[test]
fn wgpu_without_xdg_runtime_dir_prints_no_loader_complaint() {
    // Whether there is an adapter, asked of the binary with a usable XDG_RUNTIME_DIR (asked in
    // this process, the loader would print its complaint into the test's output).
    let tmp = tempfile::tempdir().unwrap();
    let probe = Command::new(env!("CARGO_BIN_EXE_cce"))
        .args([
            "run",
            "--backend",
            "wgpu",
            "--case",
            "lm",
            "--n",
            "5",
            "--d",
            "16",
        ])
        .args(["--v", "64", "--no-backward"])
        .env("XDG_RUNTIME_DIR", tmp.path())
        .output()
        .expect("the cce binary runs");
    if !probe.status.success() {
        let se = text(&probe.stderr);
        if std::env::var("CCE_REQUIRE_WGPU").as_deref() == Ok("1") {
            panic!("CCE_REQUIRE_WGPU=1 but no wgpu backend: {se}");
        }
        assert!(se.contains("no wgpu adapter"), "{se}");
        println!("skipping: {se}");
        return;
    }
    for value in [None, Some(""), Some("relative/dir")] {
        let tmp = tempfile::tempdir().unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_cce"));
        cmd.args([
            "run",
            "--backend",
            "wgpu",
            "--case",
            "lm",
            "--n",
            "5",
            "--d",
            "16",
            "--v",
            "64",
            "--no-backward",
        ])
        .env("TMPDIR", tmp.path());
        match value {
            None => cmd.env_remove("XDG_RUNTIME_DIR"),
            Some(v) => cmd.env("XDG_RUNTIME_DIR", v),
        };
        let out = cmd.output().expect("the cce binary runs");
        let (so, se) = (text(&out.stdout), text(&out.stderr));
        assert!(out.status.success(), "{value:?}: {se}");
        assert!(so.contains("backend    wgpu ("), "{value:?}:\n{so}");
        assert!(
            !se.contains("XDG_RUNTIME_DIR"),
            "XDG_RUNTIME_DIR={value:?}: stderr:\n{se}"
        );
        // The private directory is gone.
        let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
        assert!(left.is_empty(), "{value:?}: left in TMPDIR: {left:?}");
    }
}

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

/// A small cap makes the softcap's derivative `e^{−2|x/s|}` amplify logit rounding by `2/s`:
/// the CPU backend must still pass `--check` at `--softcap 1e-3` on real rows (issue 17,
/// item 3).
#[test]
fn check_passes_with_a_small_softcap_on_the_cpu() {
    let out = ok(&["run", "--softcap", "1e-3", "--check", "--n", "32"]);
    assert!(
        out.contains("verdict: pass (every output within its tolerance)"),
        "{out}"
    );
}

/// The same bias of 1e4 on every class leaves loss and gradients unchanged mathematically but
/// not in f32 (the saved lse is ~1e4): `--check` passes with a widened gradient tolerance and
/// says why (issue 17, item 10).
#[test]
fn check_says_why_a_common_logit_offset_widens_the_tolerance() {
    let dir = tempfile::tempdir().unwrap();
    let mut ds: Dataset = generate(&"lm".parse().unwrap(), 48, 24, 700, 3).unwrap();
    ds.bias = Some(vec![1e4; ds.v]);
    let p = dir.path().join("offset.safetensors");
    save_dataset(&p, &ds).unwrap();
    let out = ok(&["run", "--input", s(&p), "--check", "--filter-eps", "off"]);
    assert!(out.contains("gradient tolerance widened"), "{out}");
    assert!(out.contains("common logit offset"), "{out}");
    assert!(
        out.contains("verdict: pass (every output within its tolerance)"),
        "{out}"
    );
}

/// Two identical `--deterministic` runs write byte-identical gradient files (`cmp` proves
/// determinism: the safetensors header, metadata included, is written in a fixed order).
#[test]
fn deterministic_runs_write_identical_gradient_files() {
    let dir = tempfile::tempdir().unwrap();
    let f = small_file(dir.path(), true);
    let files: Vec<Vec<u8>> = (0..2)
        .map(|k| {
            let g = dir.path().join(format!("g{k}.safetensors"));
            ok(&[
                "run",
                "--input",
                s(&f),
                "--deterministic",
                "--save-grads",
                s(&g),
            ]);
            std::fs::read(&g).unwrap()
        })
        .collect();
    assert!(
        files[0] == files[1],
        "two --deterministic runs wrote different gradient files"
    );
}

/// A generated case past the library's row limit, or larger than the memory, fails at once
/// with the library's typed error or a memory message: nothing is generated first (generating
/// 2³¹ rows took 16 GB and minutes).
#[test]
fn generated_sizes_are_validated_before_generating() {
    let t0 = std::time::Instant::now();
    fails(
        &[
            "run",
            "--case",
            "randn",
            "--n",
            "2147483648",
            "--d",
            "1",
            "--v",
            "2",
        ],
        &[
            "resource limit exceeded",
            "rows N",
            "2147483648",
            "2147483647",
        ],
    );
    fails(
        &[
            "run",
            "--case",
            "randn",
            "--n",
            "1024",
            "--d",
            "1",
            "--v",
            "2147483648",
        ],
        &["vocabulary V"],
    );
    fails(
        &[
            "run",
            "--case",
            "randn",
            "--n",
            "1000000000",
            "--d",
            "100000",
            "--v",
            "2",
        ],
        &["host memory", "use a smaller"],
    );
    let elapsed = t0.elapsed();
    // Each run is a process start and a few checks; 5 s for three of them leaves room for a
    // loaded machine while generating even the first case takes far longer.
    assert!(
        elapsed.as_secs_f64() < 5.0,
        "three size errors took {elapsed:?}"
    );
}

/// `cce run` on a file whose `e` is `[B, T, D]` with `--shift 1` follows the library's one
/// rule (the sequence length is `T`, from the shape): the same rows, loss and gradient as
/// `linear_cross_entropy` on the same tensors. It treated the batch as one sequence of `B·T`
/// rows before.
#[test]
fn three_dim_e_with_shift_matches_the_library() {
    use cut_cross_entropy::{linear_cross_entropy, DType, HostTensor, Options, Reduction};
    let dir = tempfile::tempdir().unwrap();
    let (b, t, d) = (3usize, 4usize, 8usize);
    let mut ds: Dataset = generate(&"lm".parse().unwrap(), b * t, d, 50, 7).unwrap();
    ds.seq_len = Some(t);
    let f = dir.path().join("bt.safetensors");
    save_dataset(&f, &ds).unwrap();
    let grads = dir.path().join("g.safetensors");
    let e = HostTensor::from_f32(vec![b, t, d], &ds.e, DType::F32).unwrap();
    let c = HostTensor::from_f32(vec![ds.v, d], &ds.c, DType::F32).unwrap();
    let y = HostTensor::from_i64(ds.targets.clone());
    for reduction in ["mean", "sum"] {
        let out = ok(&[
            "run",
            "--input",
            s(&f),
            "--shift",
            "1",
            "--reduction",
            reduction,
            "--save-grads",
            s(&grads),
        ]);
        assert!(
            out.contains("sequences  e [3, 4, 8]: 3 sequences of 4 rows"),
            "{out}"
        );
        let opts = Options {
            shift: 1,
            reduction: if reduction == "sum" {
                Reduction::Sum
            } else {
                Reduction::Mean
            },
            ..Options::default()
        };
        let lib = linear_cross_entropy(&e, &c, None, &y, &opts).unwrap();
        let loss = lib.loss.to_f32_vec()[0];
        // 3 sequences of 4 rows, the last row of each dropped: 9 rows, not 11.
        let line = format!("loss       {loss:.6}  ({reduction} over 9 valid rows)");
        assert!(out.contains(&line), "want {line:?}:\n{out}");
        let saved = std::fs::read(&grads).unwrap();
        let st = safetensors::SafeTensors::deserialize(&saved).unwrap();
        let d_e = st.tensor("d_e").unwrap();
        assert_eq!(d_e.shape(), &[b, t, d][..]);
        let got: Vec<f32> = d_e
            .data()
            .chunks_exact(4)
            .map(|x| f32::from_le_bytes(x.try_into().unwrap()))
            .collect();
        assert_eq!(got, lib.d_e.unwrap().to_f32_vec(), "{reduction}: d_e");
    }
    // --n cutting a sequence with --shift is refused, not paired across sequences.
    fails(
        &["run", "--input", s(&f), "--shift", "1", "--n", "6"],
        &["sequences of 4 rows", "--n 6 cuts one"],
    );
    // Without a shift the sequences do not matter: --n 6 runs.
    ok(&["run", "--input", s(&f), "--n", "6"]);
}

/// `--check` judges `d_e` and `d_c` row by row too and prints the worst rows: here a confident
/// row (E = [[1]], C = [[16], [0]], target 0: `1 − p_y ≈ 1.1e-7`), whose gradient must be as
/// accurate as any other row's.
#[test]
fn check_judges_gradients_per_row() {
    let dir = tempfile::tempdir().unwrap();
    let ds = Dataset {
        name: "confident".into(),
        n: 1,
        d: 1,
        v: 2,
        e: vec![1.0],
        c: vec![16.0, 0.0],
        bias: None,
        targets: vec![0],
        lse_ref: None,
        nll_ref: None,
        seq_len: None,
    };
    let f = dir.path().join("confident.safetensors");
    save_dataset(&f, &ds).unwrap();
    let out = ok(&["run", "--input", s(&f), "--filter-eps", "off", "--check"]);
    let rows = lines_starting(&out, "| d_e ");
    assert!(
        rows.iter()
            .any(|l| l.contains("0 of 1") && l.ends_with("pass |")),
        "{out}"
    );
    assert!(
        lines_starting(&out, "| d_c ")
            .iter()
            .any(|l| l.contains("0 of 2")),
        "{out}"
    );
    assert!(out.contains("per row: |ours_i - oracle_i|"), "{out}");
    assert!(out.contains("verdict: pass"), "{out}");
}
