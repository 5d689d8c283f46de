//! End-to-end tests of the `cce` binary's report of its environment: the strategy label, the
//! memory lines, the backend line (wgpu adapter, software driver), refused seeds.

mod common;

use common::*;

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
        // The backward holds the 512 x 8192 f32 logits chunk (16 MiB); the RSS growth can be a
        // little less (pages the allocator had already touched are reused: 15.9 MiB seen on CI),
        // so half of it is the bound.
        assert!(growth >= 8.0 * 1024.0 * 1024.0, "{call}");
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
