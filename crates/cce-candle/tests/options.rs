//! Each option against the materialized f64 computation (candle's own ops and autograd in f64
//! over the `N x V` logits): loss, `d_e`, `d_c`, `d_bias`.
//!
//! Tolerances, relative to the largest reference value of each output: the loss (f32 whatever
//! the inputs) 1e-6 (at most 7e-8 measured); gradients from f32 inputs 5e-6 (our f32 logits
//! GEMM against f64: at most 9e-7 measured); f16 and bf16 inputs are compared with the f64
//! computation *of the same rounded inputs*, so only the rounding of the gradients to the input
//! dtype remains: 2⁻¹⁰ for f16 (at most 3.5e-4 measured) and 2⁻⁷ for bf16 (3.1e-3).

mod common;

use candle_core::{DType, Device, Result, Tensor, Var};
use cce_candle::{linear_cross_entropy, linear_cross_entropy_with_bias, LceOptions, Reduction};
use common::{f64s, reference, rel_err, targets, values};

struct Case {
    name: &'static str,
    n_lead: Vec<usize>,
    d: usize,
    v: usize,
    bias: bool,
    ignore_every: usize,
    opts: LceOptions,
    dtype: DType,
}

fn tol(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 5e-6,
        DType::F16 => 1.0 / 1024.0,
        _ => 1.0 / 128.0,
    }
}

fn run(case: &Case) -> Result<()> {
    let dev = Device::Cpu;
    let n: usize = case.n_lead.iter().product();
    let (d, v) = (case.d, case.v);
    let mut e_shape = case.n_lead.clone();
    e_shape.push(d);
    let e0 =
        Tensor::from_vec(values(n * d, 1, 1.5), e_shape.as_slice(), &dev)?.to_dtype(case.dtype)?;
    let c0 = Tensor::from_vec(values(v * d, 2, 1.0), (v, d), &dev)?.to_dtype(case.dtype)?;
    let b0 = Tensor::from_vec(values(v, 3, 2.0), v, &dev)?.to_dtype(case.dtype)?;
    let t = targets(n, v, 4, case.ignore_every, case.opts.ignore_index);
    let t_tensor = Tensor::from_vec(t.clone(), case.n_lead.as_slice(), &dev)?;
    let weights: Vec<f64> = values(n, 5, 1.0).iter().map(|&x| x as f64 + 1.5).collect();

    let e = Var::from_tensor(&e0)?;
    let c = Var::from_tensor(&c0)?;
    let b = Var::from_tensor(&b0)?;
    let loss = if case.bias {
        linear_cross_entropy_with_bias(&e, &c, &b, &t_tensor, &case.opts)?
    } else {
        linear_cross_entropy(&e, &c, &t_tensor, &case.opts)?
    };
    assert_eq!(loss.dtype(), DType::F32, "{}", case.name);
    let objective = match case.opts.reduction {
        Reduction::None => {
            assert_eq!(loss.dims(), case.n_lead.as_slice(), "{}", case.name);
            let w = Tensor::from_vec(
                weights.iter().map(|&x| x as f32).collect::<Vec<_>>(),
                case.n_lead.as_slice(),
                &dev,
            )?;
            (&loss * w)?.sum_all()?
        }
        _ => {
            assert_eq!(loss.dims(), &[] as &[usize], "{}", case.name);
            loss.clone()
        }
    };
    let grads = objective.backward()?;
    let r = reference(
        &e0,
        &c0,
        case.bias.then_some(&b0),
        &t,
        &case.opts,
        Some(&weights),
    )?;
    let tl = tol(case.dtype);
    // The loss is f32 whatever the inputs: compare it at f32 precision.
    let checks = [
        ("loss", f64s(&loss), r.loss.clone(), 1e-6),
        ("d_e", f64s(grads.get(&e).unwrap()), r.d_e.clone(), tl),
        ("d_c", f64s(grads.get(&c).unwrap()), r.d_c.clone(), tl),
    ];
    for (what, got, want, tl) in checks {
        let err = rel_err(&got, &want);
        println!("{} {what}: {err:.2e}", case.name);
        assert!(
            err <= tl,
            "{} {what}: relative error {err:.3e} > {tl:.1e}",
            case.name
        );
    }
    let g_e = grads.get(&e).unwrap();
    assert_eq!(g_e.dtype(), case.dtype);
    assert_eq!(g_e.dims(), e.dims());
    if case.bias {
        let got = f64s(grads.get(&b).unwrap());
        let err = rel_err(&got, r.d_bias.as_ref().unwrap());
        println!("{} d_bias: {err:.2e}", case.name);
        assert!(err <= tl, "{} d_bias: relative error {err:.3e}", case.name);
    }
    Ok(())
}

fn base(name: &'static str) -> Case {
    Case {
        name,
        n_lead: vec![48],
        d: 24,
        v: 157,
        bias: false,
        ignore_every: 0,
        opts: LceOptions::default(),
        dtype: DType::F32,
    }
}

#[test]
fn mean_sum_none() -> Result<()> {
    for reduction in [Reduction::Mean, Reduction::Sum, Reduction::None] {
        run(&Case {
            opts: LceOptions {
                reduction,
                ..Default::default()
            },
            ..base("reduction")
        })?;
    }
    Ok(())
}

#[test]
fn ignored_rows() -> Result<()> {
    for reduction in [Reduction::Mean, Reduction::Sum, Reduction::None] {
        run(&Case {
            ignore_every: 3,
            opts: LceOptions {
                reduction,
                ..Default::default()
            },
            ..base("ignored rows")
        })?;
    }
    // Another ignore_index, as u32 targets would use.
    run(&Case {
        ignore_every: 4,
        opts: LceOptions {
            ignore_index: u32::MAX as i64,
            ..Default::default()
        },
        ..base("ignore_index u32::MAX")
    })
}

#[test]
fn softcap() -> Result<()> {
    run(&Case {
        ignore_every: 5,
        opts: LceOptions {
            softcap: Some(3.0),
            ..Default::default()
        },
        ..base("softcap")
    })
}

#[test]
fn bias() -> Result<()> {
    for reduction in [Reduction::Mean, Reduction::None] {
        run(&Case {
            bias: true,
            ignore_every: 4,
            opts: LceOptions {
                reduction,
                softcap: Some(5.0),
                ..Default::default()
            },
            ..base("bias")
        })?;
    }
    Ok(())
}

#[test]
fn label_smoothing_and_z_loss() -> Result<()> {
    run(&Case {
        ignore_every: 6,
        opts: LceOptions {
            label_smoothing: 0.1,
            ..Default::default()
        },
        ..base("label smoothing")
    })?;
    run(&Case {
        opts: LceOptions {
            z_loss: 1e-2,
            reduction: Reduction::Sum,
            ..Default::default()
        },
        ..base("z-loss")
    })
}

#[test]
fn three_d_e() -> Result<()> {
    for reduction in [Reduction::Mean, Reduction::None] {
        run(&Case {
            n_lead: vec![3, 16],
            ignore_every: 7,
            bias: true,
            opts: LceOptions {
                reduction,
                ..Default::default()
            },
            ..base("3-D e")
        })?;
    }
    Ok(())
}

#[test]
fn half_precision_inputs() -> Result<()> {
    for dtype in [DType::F16, DType::BF16] {
        for reduction in [Reduction::Mean, Reduction::None] {
            run(&Case {
                dtype,
                bias: true,
                ignore_every: 5,
                opts: LceOptions {
                    reduction,
                    label_smoothing: 0.05,
                    ..Default::default()
                },
                ..base("half precision")
            })?;
        }
    }
    Ok(())
}

#[test]
fn u32_and_i32_targets_match_i64() -> Result<()> {
    let dev = Device::Cpu;
    let (n, d, v) = (20, 8, 33);
    let e = Tensor::from_vec(values(n * d, 7, 1.0), (n, d), &dev)?;
    let c = Tensor::from_vec(values(v * d, 8, 1.0), (v, d), &dev)?;
    let t = targets(n, v, 9, 0, -100);
    let opts = LceOptions::default();
    let l64 = linear_cross_entropy(&e, &c, &Tensor::from_vec(t.clone(), n, &dev)?, &opts)?;
    for tt in [DType::U32, DType::I32] {
        let t2 = Tensor::from_vec(t.clone(), n, &dev)?.to_dtype(tt)?;
        let l = linear_cross_entropy(&e, &c, &t2, &opts)?;
        assert_eq!(l.to_scalar::<f32>()?, l64.to_scalar::<f32>()?);
    }
    Ok(())
}

#[test]
fn non_contiguous_e_and_shift() -> Result<()> {
    // e as the transpose of a [D, N] tensor: made contiguous (a copy) before the op.
    let dev = Device::Cpu;
    let (n, d, v) = (24, 8, 40);
    let et = Var::from_tensor(&Tensor::from_vec(values(n * d, 11, 1.0), (d, n), &dev)?)?;
    let c = Tensor::from_vec(values(v * d, 12, 1.0), (v, d), &dev)?;
    let t = targets(n, v, 13, 0, -100);
    let opts = LceOptions {
        shift: 1,
        seq_len: Some(12),
        ..Default::default()
    };
    let e = et.t()?;
    assert!(!e.is_contiguous());
    let loss = linear_cross_entropy(&e, &c, &Tensor::from_vec(t.clone(), n, &dev)?, &opts)?;
    let grads = loss.backward()?;
    // The reference with the shift applied to the targets by hand.
    let shifted: Vec<i64> = (0..n)
        .map(|i| if i % 12 == 11 { -100 } else { t[i + 1] })
        .collect();
    let r = reference(
        &e.contiguous()?,
        &c,
        None,
        &shifted,
        &LceOptions::default(),
        None,
    )?;
    assert!(rel_err(&f64s(&loss), &r.loss) < 2e-6);
    let d_e = f64s(&grads.get(&et).unwrap().t()?.contiguous()?);
    assert!(rel_err(&d_e, &r.d_e) < 2e-5);
    Ok(())
}

#[test]
fn filtered_backward_is_close() -> Result<()> {
    // The filter is opt-in: at ε = Auto with the default per-row bound the gradients stay
    // within the dropped mass of the exact ones.
    let dev = Device::Cpu;
    let (n, d, v) = (32, 16, 500);
    let e = Var::from_tensor(&Tensor::from_vec(values(n * d, 21, 3.0), (n, d), &dev)?)?;
    let c = Var::from_tensor(&Tensor::from_vec(values(v * d, 22, 1.0), (v, d), &dev)?)?;
    let t = Tensor::from_vec(targets(n, v, 23, 0, -100), n, &dev)?;
    let exact = linear_cross_entropy(&e, &c, &t, &LceOptions::default())?.backward()?;
    let filtered = linear_cross_entropy(
        &e,
        &c,
        &t,
        &LceOptions {
            filter_eps: cce_candle::FilterEps::Auto,
            ..Default::default()
        },
    )?
    .backward()?;
    for var in [&e, &c] {
        let err = rel_err(
            &f64s(filtered.get(var).unwrap()),
            &f64s(exact.get(var).unwrap()),
        );
        assert!(err < 1e-2, "{err}");
    }
    Ok(())
}

#[test]
fn only_needed_gradients() -> Result<()> {
    // e a plain tensor (no variable upstream): only d_c is computed and returned.
    let dev = Device::Cpu;
    let (n, d, v) = (8, 4, 10);
    let e = Tensor::from_vec(values(n * d, 31, 1.0), (n, d), &dev)?;
    let c = Var::from_tensor(&Tensor::from_vec(values(v * d, 32, 1.0), (v, d), &dev)?)?;
    let t = Tensor::from_vec(targets(n, v, 33, 0, -100), n, &dev)?;
    let grads = linear_cross_entropy(&e, &c, &t, &LceOptions::default())?.backward()?;
    assert!(grads.get(&e).is_none());
    assert_eq!(grads.get(&c).unwrap().dims(), &[v, d]);
    Ok(())
}

/// `Reduction::None` returns e's leading dims, also when `targets` is given flat (`[N]`)
/// (`LceOptions::reduction`).
#[test]
fn none_with_flat_targets_is_shaped_like_e() -> Result<()> {
    let dev = Device::Cpu;
    let e = Tensor::from_vec(values(2 * 3 * 4, 1, 1.0), (2, 3, 4), &dev)?;
    let c = Tensor::from_vec(values(5 * 4, 2, 1.0), (5, 4), &dev)?;
    let y = Tensor::new(&[1i64, 4, -100, 0, 2, 3], &dev)?;
    let opts = LceOptions {
        reduction: Reduction::None,
        ..Default::default()
    };
    let loss = linear_cross_entropy(&e, &c, &y, &opts)?;
    assert_eq!(loss.dims(), &[2, 3]);
    let flat = linear_cross_entropy(&e, &c, &y.reshape((2, 3))?, &opts)?;
    assert_eq!(
        loss.flatten_all()?.to_vec1::<f32>()?,
        flat.flatten_all()?.to_vec1::<f32>()?
    );
    Ok(())
}
