//! One case of the matrix: sizes, dtype, data distribution, ignored rows, options, upstream
//! gradients and which API entry point is exercised.

use crate::data::{self, Dist};
use cce_core::options::{FilterEps, GradDType, Reduction};
use cce_core::{DType, FilterRule, HostTensor, Options};
use rand::Rng;
use std::fmt;

/// Which targets are set to `ignore_index`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Ignored {
    /// None.
    No,
    /// Each row independently with this probability (at least one row stays valid when
    /// `N > 1`).
    Fraction(f64),
    /// Every row.
    All,
}

/// How the backend is called.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// `Backend::forward_backward`.
    Fused,
    /// `Backend::forward`, then `Backend::backward` with the forward's own `lse`.
    Separate,
    /// `Backend::forward` only (no gradients judged).
    ForwardOnly,
}

/// The upstream gradient of the loss used by a case.
#[derive(Clone, Debug, PartialEq)]
pub enum DLossData {
    /// Mean/sum: a scalar.
    Scalar(f32),
    /// None: one value per row.
    PerRow(Vec<f32>),
}

/// A case of the conformance matrix.
#[derive(Clone, Debug, PartialEq)]
pub struct Case {
    /// Short free-text label (what the case is about).
    pub label: String,
    /// Rows.
    pub n: usize,
    /// Hidden size.
    pub d: usize,
    /// Classes.
    pub v: usize,
    /// Pass `e` as `[B, N/B, D]` (and targets as `[B, N/B]`) when set.
    pub batch: Option<usize>,
    /// dtype of `e`, `c`, `bias`.
    pub dtype: DType,
    /// With a bias `[V]`.
    pub bias: bool,
    /// Data distribution.
    pub dist: Dist,
    /// Ignored rows.
    pub ignored: Ignored,
    /// Targets as i32 (else i64).
    pub targets_i32: bool,
    /// Options of the call.
    pub opts: Options,
    /// Pass a random upstream gradient of the lse (`h_i`).
    pub d_lse: bool,
    /// Entry point.
    pub api: Api,
}

impl Case {
    /// A plain exact case: peaked data, no bias, mean reduction, fused API, i64 targets.
    pub fn new(label: impl Into<String>, n: usize, d: usize, v: usize, dtype: DType) -> Self {
        Self {
            label: label.into(),
            n,
            d,
            v,
            batch: None,
            dtype,
            bias: false,
            dist: Dist::Peaked,
            ignored: Ignored::No,
            targets_i32: false,
            opts: Options::exact(),
            d_lse: false,
            api: Api::Fused,
        }
    }

    /// Builder: set the bias flag.
    pub fn bias(mut self, on: bool) -> Self {
        self.bias = on;
        self
    }
    /// Builder: set the distribution.
    pub fn dist(mut self, dist: Dist) -> Self {
        self.dist = dist;
        self
    }
    /// Builder: set the ignored rows.
    pub fn ignored(mut self, ignored: Ignored) -> Self {
        self.ignored = ignored;
        self
    }
    /// Builder: replace the options.
    pub fn opts(mut self, opts: Options) -> Self {
        self.opts = opts;
        self
    }
    /// Builder: edit the options.
    pub fn with(mut self, f: impl FnOnce(&mut Options)) -> Self {
        f(&mut self.opts);
        self
    }
    /// Builder: default filtered options (keeps the other option fields).
    pub fn filtered(mut self) -> Self {
        self.opts.filter_eps = FilterEps::Auto;
        self.opts.max_dropped_mass = Options::default().max_dropped_mass;
        self
    }
    /// Builder: set the API entry point.
    pub fn api(mut self, api: Api) -> Self {
        self.api = api;
        self
    }
    /// Builder: with an upstream gradient of the lse.
    pub fn d_lse(mut self, on: bool) -> Self {
        self.d_lse = on;
        self
    }

    /// Whether the resolved filter may skip entries in this case.
    pub fn filtered_mode(&self) -> bool {
        FilterRule::resolve(&self.opts, self.dtype).enabled
    }

    /// Backend work of the case in FLOP (`2·N·V·D` per GEMM; 1 GEMM forward-only, else 3).
    pub fn work_flop(&self) -> f64 {
        let g = 2.0 * self.n as f64 * self.v as f64 * self.d as f64;
        if self.api == Api::ForwardOnly {
            g
        } else {
            3.0 * g
        }
    }

    /// Shrink rows (then classes) so that [`Case::work_flop`] fits `max_flop`, keeping
    /// `N` a multiple of `seq_len`/batch when set and `V mod 128` unchanged where possible.
    pub fn fit_work(mut self, max_flop: f64) -> Self {
        let unit = self
            .opts
            .seq_len
            .or(self.batch.map(|b| self.n / b))
            .unwrap_or(1);
        while self.work_flop() > max_flop && self.n >= 2 * unit.max(8) {
            self.n = (self.n / 2).div_ceil(unit) * unit;
            if let Some(b) = self.batch {
                self.batch = Some((self.n / unit).max(1).min(b));
            }
        }
        while self.work_flop() > max_flop && self.v > 256 {
            let keep = self.v % 128;
            self.v = ((self.v / 2) / 128).max(1) * 128 + keep;
        }
        self
    }

    /// Draw the inputs of this case from `seed`.
    pub fn materialize(&self, seed: u64) -> CaseData {
        let (n, d, v) = (self.n, self.d, self.v);
        let raw = data::generate(self.dist, n, d, v, self.bias, seed);
        let mut r = data::rng(seed, 0x7a11);
        let ii = self.opts.ignore_index;
        let mut targets = raw.targets.clone();
        match self.ignored {
            Ignored::No => {}
            Ignored::All => targets.iter_mut().for_each(|t| *t = ii),
            Ignored::Fraction(f) => {
                for t in targets.iter_mut() {
                    if r.random::<f64>() < f {
                        *t = ii;
                    }
                }
                if n > 1 && targets.iter().all(|&t| t == ii) {
                    targets[0] = raw.targets[0];
                }
            }
        }
        let e_shape = match self.batch {
            Some(b) => vec![b, n / b, d],
            None => vec![n, d],
        };
        let t_shape = e_shape[..e_shape.len() - 1].to_vec();
        let e = HostTensor::from_f32(e_shape, &raw.e, self.dtype).expect("float dtype");
        let c = HostTensor::from_f32(vec![v, d], &raw.c, self.dtype).expect("float dtype");
        let bias = raw
            .bias
            .as_ref()
            .map(|b| HostTensor::from_f32(vec![v], b, self.dtype).expect("float dtype"));
        let targets = if self.targets_i32 {
            HostTensor::from_i32(targets.iter().map(|&t| t as i32).collect())
        } else {
            HostTensor::from_i64(targets)
        }
        .reshape(t_shape)
        .expect("targets shape");
        let d_loss = match self.opts.reduction {
            Reduction::None => DLossData::PerRow(
                (0..n)
                    .map(|_| {
                        let x: f32 = r.random_range(0.1..1.5);
                        if r.random::<bool>() {
                            x
                        } else {
                            -x
                        }
                    })
                    .collect(),
            ),
            _ => DLossData::Scalar(r.random_range(0.5..2.0)),
        };
        let d_lse = self
            .d_lse
            .then(|| (0..n).map(|_| r.random_range(-0.5f32..0.5)).collect());
        CaseData {
            e,
            c,
            bias,
            targets,
            d_loss,
            d_lse,
        }
    }
}

impl fmt::Display for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let o = &self.opts;
        write!(
            f,
            "[{}] N={} D={} V={} {}",
            self.label, self.n, self.d, self.v, self.dtype
        )?;
        if let Some(b) = self.batch {
            write!(f, " e=[{b},{},{}]", self.n / b, self.d)?;
        }
        write!(f, " {}", self.dist.name())?;
        if self.bias {
            write!(f, " bias")?;
        }
        match self.ignored {
            Ignored::No => {}
            Ignored::Fraction(p) => write!(f, " ignored={:.0}%", 100.0 * p)?,
            Ignored::All => write!(f, " all-ignored")?,
        }
        if o.ignore_index != -100 {
            write!(f, " ignore_index={}", o.ignore_index)?;
        }
        if self.targets_i32 {
            write!(f, " targets=i32")?;
        }
        write!(f, " reduction={:?}", o.reduction)?;
        if let Some(s) = o.softcap {
            write!(f, " softcap={s}")?;
        }
        if o.label_smoothing > 0.0 {
            write!(f, " label_smoothing={}", o.label_smoothing)?;
        }
        if o.z_loss > 0.0 {
            write!(f, " z_loss={}", o.z_loss)?;
        }
        if o.shift > 0 {
            write!(f, " shift={} seq_len={:?}", o.shift, o.seq_len)?;
        }
        if self.d_lse {
            write!(f, " d_lse")?;
        }
        if o.side_outputs.entropy || o.side_outputs.argmax {
            write!(
                f,
                " side(entropy={},argmax={})",
                o.side_outputs.entropy, o.side_outputs.argmax
            )?;
        }
        if o.grad_dtype == GradDType::F32 {
            write!(f, " grads=f32")?;
        }
        if !o.compute_d_e || !o.compute_d_c {
            write!(f, " compute(d_e={},d_c={})", o.compute_d_e, o.compute_d_c)?;
        }
        if o.deterministic {
            write!(f, " deterministic")?;
        }
        match o.filter_eps {
            FilterEps::Off => write!(f, " exact")?,
            FilterEps::Auto => write!(f, " filtered(auto, δ={:e})", o.max_dropped_mass)?,
            FilterEps::Value(v) => write!(f, " filtered(eps={v:e}, δ={:e})", o.max_dropped_mass)?,
        }
        if !o.filter_e_grad || !o.filter_c_grad {
            write!(
                f,
                " filter(d_e={},d_c={})",
                o.filter_e_grad, o.filter_c_grad
            )?;
        }
        write!(
            f,
            " {}",
            match self.api {
                Api::Fused => "forward_backward",
                Api::Separate => "forward+backward",
                Api::ForwardOnly => "forward-only",
            }
        )
    }
}

/// The host inputs of a materialized case.
#[derive(Clone, Debug)]
pub struct CaseData {
    /// `e`, in the case dtype.
    pub e: HostTensor,
    /// `c`, in the case dtype.
    pub c: HostTensor,
    /// `bias`, in the case dtype.
    pub bias: Option<HostTensor>,
    /// Targets (i32 or i64), `ignore_index` applied.
    pub targets: HostTensor,
    /// Upstream gradient of the loss.
    pub d_loss: DLossData,
    /// Upstream gradient of the lse.
    pub d_lse: Option<Vec<f32>>,
}
