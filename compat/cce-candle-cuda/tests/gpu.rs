//! On a GPU: the CUDA path against `cce_candle`'s CPU path (itself matched to candle's
//! materialized loss in `crates/cce-candle/tests`), loss and gradients, then 5 SGD steps.
//! Skips without a CUDA device unless `CCE_REQUIRE_CUDA=1`.
//!
//! Tolerances relative to the largest CPU value: f32 inputs 1e-4 (the CUDA backend's f32
//! products run in f32 FMA with another summation order); bf16 inputs 2e-2 (`G` rounded to
//! 16 bits for the tensor-core products, `cce_core::GradDType`).

use candle_core::{DType, Device, Result, Tensor, Var};
use cce_candle::Reduction;
use cce_candle_cuda::{linear_cross_entropy, linear_cross_entropy_with_bias, LceOptions};

fn gpu() -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) if std::env::var("CCE_REQUIRE_CUDA").as_deref() == Ok("1") => {
            panic!("CCE_REQUIRE_CUDA=1 and no CUDA device: {e}")
        }
        Err(e) => {
            eprintln!("skipped: no CUDA device ({e})");
            None
        }
    }
}

fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    let f = |t: &Tensor| -> Vec<f64> {
        t.to_device(&Device::Cpu)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    let (a, b) = (f(a), f(b));
    let scale = b.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-30);
    a.iter()
        .zip(&b)
        .fold(0.0f64, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

/// Loss, d_e, d_c (and d_bias) on `dev`.
fn run(
    dev: &Device,
    dtype: DType,
    bias: bool,
    opts: &LceOptions,
) -> Result<(Tensor, Tensor, Tensor, Option<Tensor>)> {
    let (n, d, v) = (256, 64, 1000);
    let e = Var::from_tensor(
        &Tensor::from_vec(values(n * d, 1, 1.5), (4, n / 4, d), dev)?.to_dtype(dtype)?,
    )?;
    let c =
        Var::from_tensor(&Tensor::from_vec(values(v * d, 2, 1.0), (v, d), dev)?.to_dtype(dtype)?)?;
    let b = Var::from_tensor(&Tensor::from_vec(values(v, 3, 1.0), v, dev)?.to_dtype(dtype)?)?;
    let t: Vec<i64> = (0..n as i64)
        .map(|i| {
            if i % 7 == 6 {
                -100
            } else {
                (i * 37) % v as i64
            }
        })
        .collect();
    let t = Tensor::from_vec(t, (4, n / 4), dev)?;
    let loss = if bias {
        linear_cross_entropy_with_bias(&e, &c, &b, &t, opts)?
    } else {
        linear_cross_entropy(&e, &c, &t, opts)?
    };
    let objective = match opts.reduction {
        Reduction::None => {
            let w = Tensor::from_vec(values(n, 4, 1.0), (4, n / 4), dev)?;
            (&loss * w)?.sum_all()?
        }
        _ => loss.clone(),
    };
    let g = objective.backward()?;
    Ok((
        loss,
        g.get(&e).unwrap().clone(),
        g.get(&c).unwrap().clone(),
        bias.then(|| g.get(&b).unwrap().clone()),
    ))
}

#[test]
fn cuda_matches_cpu() -> Result<()> {
    let Some(gpu) = gpu() else { return Ok(()) };
    for (dtype, tol) in [(DType::F32, 1e-4), (DType::BF16, 2e-2)] {
        for (bias, reduction) in [(false, Reduction::Mean), (true, Reduction::None)] {
            let opts = LceOptions {
                reduction,
                softcap: bias.then_some(20.0),
                ..Default::default()
            };
            let a = run(&gpu, dtype, bias, &opts)?;
            let b = run(&Device::Cpu, dtype, bias, &opts)?;
            let pairs = [
                ("loss", &a.0, &b.0),
                ("d_e", &a.1, &b.1),
                ("d_c", &a.2, &b.2),
            ];
            for (what, x, y) in pairs {
                let err = rel_err(x, y);
                println!("{dtype:?} bias={bias} {what}: {err:.2e}");
                assert!(err < tol, "{dtype:?} bias={bias} {what}: {err:.2e}");
            }
            if let (Some(x), Some(y)) = (&a.3, &b.3) {
                assert!(rel_err(x, y) < tol);
            }
        }
    }
    Ok(())
}

#[test]
fn five_sgd_steps_on_the_gpu_follow_the_cpu() -> Result<()> {
    let Some(gpu) = gpu() else { return Ok(()) };
    let (n, d, v, lr) = (64, 32, 300, 0.5);
    let mut losses = vec![];
    for dev in [&gpu, &Device::Cpu] {
        let c = Var::from_tensor(&Tensor::from_vec(values(v * d, 5, 0.5), (v, d), dev)?)?;
        let e = Tensor::from_vec(values(n * d, 6, 1.0), (n, d), dev)?;
        let t = Tensor::from_vec(
            (0..n as u32)
                .map(|i| (i * 7) % v as u32)
                .collect::<Vec<_>>(),
            n,
            dev,
        )?;
        let mut l = vec![];
        for _ in 0..5 {
            let loss = linear_cross_entropy(&e, &c, &t, &LceOptions::default())?;
            l.push(loss.to_device(&Device::Cpu)?.to_scalar::<f32>()?);
            let g = loss.backward()?;
            c.set(&(c.as_tensor() - (g.get(&c).unwrap() * lr)?)?)?;
        }
        losses.push(l);
    }
    for (x, y) in losses[0].iter().zip(&losses[1]) {
        assert!(((x - y) / y).abs() < 1e-5, "{:?}", losses);
    }
    assert!(losses[0][4] < losses[0][0]);
    Ok(())
}
