//! The conformance harness: the shared backend, seeded random inputs, `Case`, and the judging of
//! one case's forward and backward outputs against the f64 oracle (part of the `conformance`
//! test binary; the cases live in its root, `tiles` and `errors`).

use cce_core::{
    Backend, DLoss, DType, GradDType, HostTensor, Inputs, Options, Reduction, SideOutputs,
    TensorMeta, Upstream,
};
use cce_reference::naive::{naive, Oracle, OracleDLoss, Precision};
use cce_wgpu::WgpuBackend;
use std::sync::OnceLock;

/// The adapter's backend, made once per process; `None` (after printing "skipping: <reason>")
/// without one, a panic instead under `CCE_REQUIRE_WGPU=1`.
pub(crate) fn backend() -> Option<&'static WgpuBackend> {
    static B: OnceLock<Result<WgpuBackend, String>> = OnceLock::new();
    match B.get_or_init(|| WgpuBackend::new().map_err(|e| e.to_string())) {
        Ok(b) => Some(b),
        Err(e) => {
            if std::env::var("CCE_REQUIRE_WGPU").as_deref() == Ok("1") {
                panic!("CCE_REQUIRE_WGPU=1 but no wgpu backend: {e}");
            }
            println!("skipping: {e}");
            None
        }
    }
}

/// Base seed of this test process: `CCE_TEST_SEED` if set, else the clock (fresh inputs on
/// every run). Printed with each failure.
fn base_seed() -> u64 {
    static S: OnceLock<u64> = OnceLock::new();
    *S.get_or_init(|| match std::env::var("CCE_TEST_SEED") {
        Ok(s) => s.parse().expect("CCE_TEST_SEED must be an integer"),
        Err(_) => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64,
    })
}

/// xorshift64* with Box-Muller normals: never-zero inputs, one stream per case.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(case: u64) -> Self {
        Rng((base_seed() ^ case.wrapping_mul(0x9e37_79b9_7f4a_7c15)) | 1)
    }
    pub(crate) fn u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub(crate) fn unif(&mut self) -> f64 {
        ((self.u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    pub(crate) fn normal(&mut self) -> f64 {
        let (a, b) = (self.unif(), self.unif());
        (-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()
    }
    pub(crate) fn normals(&mut self, n: usize, scale: f64) -> Vec<f32> {
        (0..n).map(|_| (self.normal() * scale) as f32).collect()
    }
}

/// One conformance case: an `n x d` by `v x d` problem in `dtype`, its inputs' shape and
/// scale, its `Options`, and the kernel configuration it runs with (`None`: the backend's).
#[derive(Clone, Debug)]
pub(crate) struct Case {
    name: &'static str,
    n: usize,
    d: usize,
    v: usize,
    pub(crate) dtype: DType,
    pub(crate) bias: bool,
    pub(crate) ignore_frac: f64,
    e_scale: f64,
    pub(crate) c_scale: f64,
    pub(crate) opts: Options,
    pub(crate) d_lse: bool,
    /// `e` as `[B, T, D]` with this `T`.
    pub(crate) seq: Option<usize>,
    /// Filtered mode must skip something.
    pub(crate) expect_skips: bool,
    /// Targets drawn from the first `k` classes, and a bias of −20 on every other class (a
    /// crude unigram prior: whole class tiles become skippable).
    pub(crate) hot_classes: Option<usize>,
    /// Run with this `KernelConfig::target_workgroups` (few workgroups, long loops).
    pub(crate) workgroups: Option<u32>,
    /// Rows aimed at their target: `e_i = aim · c_{y_i} + 0.1 · e_i` (p_target rounds to 1).
    pub(crate) aim: Option<f32>,
    /// Run with this main loop (`Quad` at 64 x 64 tiles and 16-deep panels, `Named` at the
    /// adapter's default shape).
    pub(crate) main_loop: Option<cce_wgpu::MainLoop>,
    /// Run with this panel depth `KernelConfig::tk` (4 at 8 x 8 threads: the smallest panels
    /// the forward's end-of-split row merge borrows, 2·tk = wg).
    pub(crate) tk: Option<u32>,
    /// Run with this cooperative-matrix forward (`KernelConfig::coop_tile`; f16 cases on
    /// adapters that run it, the FMA forward elsewhere).
    pub(crate) coop_tile: Option<cce_wgpu::CoopTile>,
    /// Run with this `KernelConfig::coalesced_adds` (the backward's atomic adds through
    /// subgroup shuffles, where the adapter allows them).
    pub(crate) coalesced: Option<bool>,
    /// Run with this `KernelConfig::wg` (16: 128 x 128 tiles of 256 threads; with `tk`).
    pub(crate) wg: Option<u32>,
    /// Run with this `KernelConfig::coop_backward` (the cooperative-matrix backward, off by
    /// default).
    pub(crate) coop_backward: Option<bool>,
}

impl Case {
    pub(crate) fn new(name: &'static str, n: usize, d: usize, v: usize, dtype: DType) -> Self {
        Self {
            name,
            n,
            d,
            v,
            dtype,
            bias: false,
            ignore_frac: 0.0,
            e_scale: 1.0,
            c_scale: 1.0 / (d as f64).sqrt() * 2.0,
            opts: Options {
                side_outputs: SideOutputs {
                    entropy: true,
                    argmax: true,
                },
                ..Options::exact()
            },
            d_lse: false,
            seq: None,
            expect_skips: false,
            hot_classes: None,
            workgroups: None,
            aim: None,
            main_loop: None,
            tk: None,
            coop_tile: None,
            coalesced: None,
            wg: None,
            coop_backward: None,
        }
    }
    pub(crate) fn with(mut self, f: impl FnOnce(&mut Self)) -> Self {
        f(&mut self);
        self
    }
}

/// The failures of one case, one message each.
struct Report {
    failures: Vec<String>,
}

impl Report {
    /// Per element: |ours − gt| ≤ |ref − gt| + tol·max(1,|gt|) + extra(i).
    #[allow(clippy::too_many_arguments)]
    fn check(
        &mut self,
        case: &str,
        what: &str,
        ours: &[f64],
        gt: &[f64],
        rf: &[f64],
        tol: f64,
        extra: impl Fn(usize) -> f64,
    ) {
        assert_eq!(ours.len(), gt.len(), "{case} {what}: length");
        let mut bad = Vec::new();
        let (mut num, mut den) = (0.0f64, 0.0f64);
        for i in 0..gt.len() {
            let err = (ours[i] - gt[i]).abs();
            let bound = (rf[i] - gt[i]).abs() + tol * gt[i].abs().max(1.0) + extra(i);
            num += err * err;
            den += gt[i] * gt[i];
            if err.is_nan() || err > bound {
                bad.push((i, ours[i], gt[i], rf[i], err, bound));
            }
        }
        let rel = if den > 0.0 {
            (num / den).sqrt()
        } else {
            num.sqrt()
        };
        println!("  {case:<28} {what:<8} rel err {rel:.3e}");
        if !bad.is_empty() {
            let mut s = format!(
                "{case}: {what}: {} of {} elements out of bound (rel err {rel:.3e}); first:",
                bad.len(),
                gt.len()
            );
            for (i, o, g, r, e, b) in bad.iter().take(5) {
                s += &format!(
                    "\n    [{i}] ours {o:.8e} gt {g:.8e} ref {r:.8e} |err| {e:.3e} > bound {b:.3e}"
                );
            }
            self.failures.push(s);
        }
    }
}

/// `t` downloaded as f64 values.
pub(crate) fn f64s(b: &WgpuBackend, t: &cce_wgpu::WgpuTensor) -> Vec<f64> {
    b.download(t).unwrap().to_f64_vec()
}

/// Run one case through forward and backward and judge every output.
fn run_case(b: &WgpuBackend, case: &Case, seed: u64) -> Vec<String> {
    let owned;
    let b = if case.workgroups.is_some()
        || case.main_loop.is_some()
        || case.tk.is_some()
        || case.coop_tile.is_some()
        || case.coalesced.is_some()
        || case.wg.is_some()
        || case.coop_backward.is_some()
    {
        let mut cfg = b.config();
        if let Some(on) = case.coop_backward {
            cfg.coop_backward = on;
        }
        if let Some(wg) = case.wg {
            cfg.wg = wg;
        }
        if let Some(co) = case.coalesced {
            cfg.coalesced_adds = co;
        }
        if let Some(t) = case.coop_tile {
            cfg.coop_tile = t;
        }
        if let Some(tk) = case.tk {
            cfg.tk = tk;
        }
        if let Some(w) = case.workgroups {
            cfg.target_workgroups = w;
        }
        if let Some(ml) = case.main_loop {
            cfg.main_loop = ml;
        }
        owned = if case.main_loop == Some(cce_wgpu::MainLoop::Quad) {
            quad(b, cfg)
        } else {
            b.with_config(cfg).unwrap()
        };
        &owned
    } else {
        b
    };
    let mut rng = Rng::new(seed);
    let (n, d, v, dt) = (case.n, case.d, case.v, case.dtype);
    let e_shape = match case.seq {
        Some(t) => vec![n / t, t, d],
        None => vec![n, d],
    };
    let mut e_raw = rng.normals(n * d, case.e_scale);
    let c_raw = rng.normals(v * d, case.c_scale);
    let c = HostTensor::from_f32(vec![v, d], &c_raw, dt).unwrap();
    let hot = case.hot_classes.unwrap_or(v);
    let bias = case.bias.then(|| {
        let mut b = rng.normals(v, 0.5);
        b.iter_mut().skip(hot).for_each(|x| *x -= 20.0);
        HostTensor::from_f32(vec![v], &b, dt).unwrap()
    });
    let ignore = case.opts.ignore_index;
    let y: Vec<i64> = (0..n)
        .map(|_| {
            if rng.unif() < case.ignore_frac {
                ignore
            } else {
                (rng.u64() % hot as u64) as i64
            }
        })
        .collect();
    if let Some(aim) = case.aim {
        for (i, &yi) in y.iter().enumerate() {
            if yi >= 0 {
                for k in 0..d {
                    e_raw[i * d + k] = aim * c_raw[yi as usize * d + k] + 0.1 * e_raw[i * d + k];
                }
            }
        }
    }
    let e = HostTensor::from_f32(e_shape, &e_raw, dt).unwrap();
    let y = HostTensor::from_i64(y);
    let opts = &case.opts;
    let per_row = opts.reduction == Reduction::None;
    let g_rows: Vec<f32> = (0..n).map(|_| (0.5 + rng.unif()) as f32).collect();
    let h_rows: Vec<f32> = (0..n).map(|_| (rng.normal() * 0.3) as f32).collect();
    let d_out = 0.75f32;
    let oracle_dl = if per_row {
        OracleDLoss::PerRow(g_rows.iter().map(|&x| x as f64).collect())
    } else {
        OracleDLoss::Scalar(d_out as f64)
    };
    let h64: Vec<f64> = h_rows.iter().map(|&x| x as f64).collect();
    let h_opt = case.d_lse.then_some(&h64[..]);
    let run = |p| naive(&e, &c, bias.as_ref(), &y, opts, &oracle_dl, h_opt, p).unwrap();
    let gt: Oracle = run(Precision::F64);
    let rf: Oracle = run(Precision::SameDtype);

    let eb = b.upload(&e).unwrap();
    let cb = b.upload(&c).unwrap();
    let bb = bias.as_ref().map(|x| b.upload(x).unwrap());
    let yb = b.upload(&y).unwrap();
    let inputs = Inputs {
        e: &eb,
        c: &cb,
        bias: bb.as_ref(),
        targets: &yb,
    };
    let fwd = b.forward(&inputs, opts).unwrap();
    let gb = b
        .upload(&HostTensor::new(vec![n], cce_core::HostData::F32(g_rows.clone())).unwrap())
        .unwrap();
    let hb = b
        .upload(&HostTensor::new(vec![n], cce_core::HostData::F32(h_rows.clone())).unwrap())
        .unwrap();
    let up = Upstream {
        d_loss: if per_row {
            DLoss::PerRow(&gb)
        } else {
            DLoss::Scalar(d_out)
        },
        d_lse: case.d_lse.then_some(&hb),
    };
    let bwd = b.backward(&inputs, opts, fwd.saved(), &up).unwrap();
    println!("  {:<28} plan: {}", case.name, bwd.stats.plan_reason);

    let mut rep = Report { failures: vec![] };
    let tol = dt.tolerance();
    let name = case.name;
    let zero = |_| 0.0;
    rep.check(
        name,
        "loss",
        &f64s(b, &fwd.loss),
        &gt.loss,
        &rf.loss,
        tol,
        zero,
    );
    rep.check(name, "lse", &f64s(b, &fwd.lse), &gt.lse, &rf.lse, tol, zero);
    if let Some(ent) = &fwd.entropy {
        rep.check(
            name,
            "entropy",
            &f64s(b, ent),
            &gt.entropy,
            &rf.entropy,
            tol,
            zero,
        );
    }
    if let Some(am) = &fwd.argmax {
        let ours = b.download(am).unwrap().to_i64_vec().unwrap();
        // Logits of the f64 oracle are not returned: accept a different index only when the
        // oracle's own same-dtype argmax also differs (a near tie).
        for (i, &o) in ours.iter().enumerate() {
            if o != gt.argmax[i] as i64 && rf.argmax[i] == gt.argmax[i] {
                rep.failures.push(format!(
                    "{name}: argmax row {i}: ours {o} gt {}",
                    gt.argmax[i]
                ));
                break;
            }
        }
    }

    // Filtered mode: the skipped entries bound the error.
    let st = &bwd.stats;
    let dm = st.dropped_mass_max;
    if st.filter_eps > 0.0 {
        assert!(
            dm <= st.max_dropped_mass as f64 * (1.0 + 1e-6) + 1e-9,
            "{name}: dropped mass {dm} > bound {}",
            st.max_dropped_mass
        );
        println!(
            "  {name:<28} filter: {} tiles visited, {} skipped, dropped max {:.2e} mean {:.2e}",
            st.tiles_visited, st.tiles_skipped, st.dropped_mass_max, st.dropped_mass_mean
        );
    }
    if case.expect_skips {
        assert!(
            st.tiles_skipped > 0,
            "{name}: expected skipped tiles, stats:\n{st}"
        );
    }
    let ev = e.to_f64_vec();
    let cv = c.to_f64_vec();
    let lam = opts.z_loss as f64;
    let coef: Vec<f64> = (0..n)
        .map(|i| {
            let g = match &oracle_dl {
                _ if gt.row_loss[i] == 0.0 && y.to_i64_vec().unwrap()[i] == ignore => 0.0,
                OracleDLoss::PerRow(gv) => gv[i].abs(),
                OracleDLoss::Scalar(s) => match opts.reduction {
                    Reduction::Mean => s.abs() / gt.n_valid.max(1) as f64,
                    _ => s.abs(),
                },
            };
            g * (1.0 + 2.0 * lam * gt.lse[i].abs()) + h_opt.map_or(0.0, |h| h[i].abs())
        })
        .collect();
    let cmax = cv.iter().fold(0.0f64, |a, &x| a.max(x.abs()));
    let gtol = if opts.grad_dtype == GradDType::F32 {
        // Gradients in f32 are judged at f32 resolution on top of the input's error.
        tol.min(1e-3)
    } else {
        tol
    };
    if let Some(de) = &bwd.d_e {
        assert_eq!(de.shape(), e.shape());
        let extra = |k: usize| coef[k / d] * dm * cmax;
        rep.check(name, "d_e", &f64s(b, de), &gt.d_e, &rf.d_e, gtol, extra);
    }
    if let Some(dc) = &bwd.d_c {
        let colb: Vec<f64> = (0..d)
            .map(|k| (0..n).map(|i| coef[i] * ev[i * d + k].abs()).sum::<f64>() * dm)
            .collect();
        let extra = |k: usize| colb[k % d];
        rep.check(name, "d_c", &f64s(b, dc), &gt.d_c, &rf.d_c, gtol, extra);
    }
    match (&bwd.d_bias, &gt.d_bias) {
        (Some(db), Some(g)) => {
            let sb: f64 = coef.iter().sum::<f64>() * dm;
            let r = rf.d_bias.as_ref().unwrap();
            rep.check(name, "d_bias", &f64s(b, db), g, r, gtol, |_| sb);
        }
        (None, None) => {}
        _ if !opts.compute_d_c => {}
        _ => rep
            .failures
            .push(format!("{name}: d_bias presence differs")),
    }
    rep.failures
        .into_iter()
        .map(|f| format!("{f}\n    (rerun with CCE_TEST_SEED={})", base_seed()))
        .collect()
}

/// Run every case (seeds 1, 2, …) and fail with all their failures at once.
pub(crate) fn run_all(cases: &[Case]) {
    let Some(b) = backend() else { return };
    let mut failures = Vec::new();
    for (k, case) in cases.iter().enumerate() {
        failures.extend(run_case(b, case, k as u64 + 1));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// `b` with the quad main loop on `cfg`: 64 x 64 tiles and 16-deep panels where they fit,
/// else 32 x 32 and 8-deep (lavapipe's 32 KiB of workgroup memory).
pub(crate) fn quad(b: &WgpuBackend, cfg: cce_wgpu::KernelConfig) -> WgpuBackend {
    let with = |wg, tk| {
        b.with_config(cce_wgpu::KernelConfig {
            wg,
            tk,
            main_loop: cce_wgpu::MainLoop::Quad,
            ..cfg
        })
    };
    with(8, 16).or_else(|_| with(4, 8)).unwrap()
}
