//! A tiny LM head trained for 5 steps twice from the same start, with candle-nn's own SGD and
//! AdamW: once with our fused loss, once with candle's materialized one
//! (`candle_nn::loss::cross_entropy` on `e.matmul(c.t())`, ignore_index emulated by keeping
//! the valid rows only). Step by step, the losses, the gradients and the updated parameters
//! must agree.
//!
//! Tolerances (f32): loss 1e-6 relative (at most 2e-7 measured); gradients 5e-6 relative to
//! the largest entry of each gradient (both sides compute f32 logits, ours with f64 row
//! accumulators, candle's with f32 ones: at most 4.4e-7 measured); parameters relative to their
//! largest entry after every step, 5e-6 with SGD (2e-7 measured), 1e-4 with AdamW, whose
//! normalized update turns the rounding of gradient entries near its ε into updates of up to lr
//! (8e-6 measured).

mod common;

use candle_core::{DType, Device, Result, Tensor, Var};
use candle_nn::optim::{AdamW, Optimizer, ParamsAdamW, SGD};
use cce_candle::{linear_cross_entropy, LceOptions};
use common::{f64s, rel_err, targets, values};

const N: usize = 64;
const D: usize = 32;
const V: usize = 300;
const K: usize = 16;

/// One optimizer step from a gradient store.
type Step = Box<dyn FnMut(&candle_core::backprop::GradStore) -> Result<()>>;

/// The parameters of one model: `w` produces `e = tanh(x·wᵀ)`, `c` is the LM head.
struct Model {
    w: Var,
    c: Var,
}

impl Model {
    fn new(dev: &Device) -> Result<Self> {
        Ok(Self {
            w: Var::from_tensor(&Tensor::from_vec(values(D * K, 1, 0.5), (D, K), dev)?)?,
            c: Var::from_tensor(&Tensor::from_vec(values(V * D, 2, 0.5), (V, D), dev)?)?,
        })
    }

    fn hidden(&self, x: &Tensor) -> Result<Tensor> {
        x.matmul(&self.w.t()?)?.tanh()
    }
}

/// candle's loss: the materialized logits of the valid rows, `candle_nn::loss::cross_entropy`.
fn candle_loss(e: &Tensor, c: &Tensor, t: &[i64]) -> Result<Tensor> {
    let keep: Vec<u32> = (0..t.len() as u32)
        .filter(|&i| t[i as usize] != -100)
        .collect();
    let labels: Vec<u32> = keep.iter().map(|&i| t[i as usize] as u32).collect();
    let dev = e.device();
    let rows = Tensor::from_vec(keep.clone(), keep.len(), dev)?;
    let logits = e.index_select(&rows, 0)?.matmul(&c.t()?)?;
    candle_nn::loss::cross_entropy(&logits, &Tensor::from_vec(labels, keep.len(), dev)?)
}

fn train(adamw: bool) -> Result<()> {
    let dev = Device::Cpu;
    let x = Tensor::from_vec(values(N * K, 3, 2.0), (N, K), &dev)?;
    let t = targets(N, V, 4, 5, -100);
    let t_tensor = Tensor::from_vec(t.clone(), N, &dev)?;
    let (ours, theirs) = (Model::new(&dev)?, Model::new(&dev)?);
    let opt = |m: &Model| -> Result<Step> {
        let vars = vec![m.w.clone(), m.c.clone()];
        Ok(if adamw {
            let mut o = AdamW::new(
                vars,
                ParamsAdamW {
                    lr: 1e-2,
                    ..Default::default()
                },
            )?;
            Box::new(move |g| o.step(g))
        } else {
            let mut o = SGD::new(vars, 0.5)?;
            Box::new(move |g| o.step(g))
        })
    };
    let (mut step_ours, mut step_theirs) = (opt(&ours)?, opt(&theirs)?);
    // AdamW's first steps move an entry by about lr·g/(|g| + ε): where |g| is near ε (1e-8),
    // the rounding of g shows in the update at a scale of lr.
    let param_tol = if adamw { 1e-4 } else { 5e-6 };
    let mut first = None;
    for step in 0..5 {
        let lo = linear_cross_entropy(
            &ours.hidden(&x)?,
            &ours.c,
            &t_tensor,
            &LceOptions::default(),
        )?;
        let lt = candle_loss(&theirs.hidden(&x)?, &theirs.c, &t)?;
        assert_eq!(lo.dtype(), DType::F32);
        let (a, b) = (lo.to_scalar::<f32>()?, lt.to_scalar::<f32>()?);
        let err = ((a - b) / b).abs();
        println!("adamw={adamw} step {step}: loss {a} (candle {b}), rel {err:.1e}");
        assert!(err < 1e-6, "step {step}: loss {a} vs {b}");
        first.get_or_insert(a);
        let (go, gt) = (lo.backward()?, lt.backward()?);
        for (name, vo, vt) in [("w", &ours.w, &theirs.w), ("c", &ours.c, &theirs.c)] {
            let err = rel_err(&f64s(go.get(vo).unwrap()), &f64s(gt.get(vt).unwrap()));
            println!("  d_{name}: rel {err:.1e}");
            assert!(err < 5e-6, "step {step}: d_{name} relative error {err:.2e}");
        }
        step_ours(&go)?;
        step_theirs(&gt)?;
        for (name, vo, vt) in [("w", &ours.w, &theirs.w), ("c", &ours.c, &theirs.c)] {
            let err = rel_err(&f64s(vo.as_tensor()), &f64s(vt.as_tensor()));
            println!("  {name} after the step: rel {err:.1e}");
            assert!(
                err < param_tol,
                "step {step}: {name} relative error {err:.2e}"
            );
        }
    }
    // It trained.
    let last = linear_cross_entropy(
        &ours.hidden(&x)?,
        &ours.c,
        &t_tensor,
        &LceOptions::default(),
    )?
    .to_scalar::<f32>()?;
    assert!(last < first.unwrap(), "{last} !< {first:?}");
    Ok(())
}

#[test]
fn five_sgd_steps_match_candle() -> Result<()> {
    train(false)
}

#[test]
fn five_adamw_steps_match_candle() -> Result<()> {
    train(true)
}
