//! Eager or recompute, on candle's CPU device (crate README, "Eager or recompute").
//!
//! - recompute (what the crate does): the op's forward runs our forward (loss, lse, rest mass);
//!   `backward()` runs our backward from them, recomputing the logits;
//! - eager (the alternative): the op's forward would run our forward and our backward with a
//!   unit upstream gradient, and `backward()` would only scale `d_e` and `d_c` by the upstream
//!   scalar. Timed here with the same CPU backend calls on candle's storage, plus the scaling
//!   and the gradient accumulation candle's backprop does on either path (a zero tensor plus
//!   the returned gradient).
//!
//! `cargo run --release -p cce-candle --example eager_vs_recompute [N D V reps]`
//! (default 1024 256 16384 3); prints the median of `reps` runs of each phase, milliseconds.

use candle_core::{DType, Device, Storage, Tensor, Var};
use cce_candle::{linear_cross_entropy, LceOptions};
use cce_core::{DLoss, Inputs, Upstream};
use cce_reference::{CpuBackend, HostSlice, HostView};
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn ms<T>(f: impl FnOnce() -> T) -> (T, f64) {
    let t0 = Instant::now();
    let r = f();
    (r, t0.elapsed().as_secs_f64() * 1e3)
}

fn main() -> candle_core::Result<()> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("N D V reps"))
        .collect();
    let [n, d, v, reps] = match args.as_slice() {
        [] => [1024, 256, 16384, 3],
        [n, d, v] => [*n, *d, *v, 3],
        [n, d, v, r] => [*n, *d, *v, *r],
        _ => panic!("usage: N D V [reps]"),
    };
    let dev = Device::Cpu;
    let e = Var::from_tensor(&(Tensor::randn(0f32, 1.0, (n, d), &dev)?))?;
    let c = Var::from_tensor(&(Tensor::randn(0f32, 0.1, (v, d), &dev)?))?;
    let t = Tensor::rand(0f32, v as f32, n, &dev)?
        .to_dtype(DType::U32)?
        .to_dtype(DType::I64)?;
    let opts = LceOptions::default();
    println!("N {n} D {d} V {v}, f32, exact gradients, {reps} runs, median ms");

    // Recompute: the crate's path through candle.
    let (mut fwd, mut bwd) = (vec![], vec![]);
    for _ in 0..reps {
        let (loss, f) = ms(|| linear_cross_entropy(&e, &c, &t, &opts));
        let loss = loss?;
        let (g, b) = ms(|| loss.backward());
        g?;
        fwd.push(f);
        bwd.push(b);
    }
    let (rf, rb) = (median(fwd), median(bwd));
    println!(
        "recompute: forward {rf:.1}  backward {rb:.1}  total {:.1}",
        rf + rb
    );

    // Eager: our forward and backward (unit upstream) in the forward; a scaling in backward.
    let (es, _) = e.storage_and_layout();
    let (cs, _) = c.storage_and_layout();
    let (ts, _) = t.storage_and_layout();
    let (Storage::Cpu(es), Storage::Cpu(cs), Storage::Cpu(ts)) = (&*es, &*cs, &*ts) else {
        unreachable!()
    };
    let ev = HostView::new(vec![n, d], HostSlice::F32(es.as_slice::<f32>()?)).unwrap();
    let cv = HostView::new(vec![v, d], HostSlice::F32(cs.as_slice::<f32>()?)).unwrap();
    let tv = HostView::new(vec![n], HostSlice::I64(ts.as_slice::<i64>()?)).unwrap();
    let inputs = Inputs {
        e: &ev,
        c: &cv,
        bias: None,
        targets: &tv,
    };
    let o = opts.to_options();
    let backend = CpuBackend::new();
    let (mut fwd, mut bwd, mut ours_f) = (vec![], vec![], vec![]);
    for _ in 0..reps {
        let ((d_e, d_c), f) = ms(|| {
            let (out, of) = ms(|| backend.forward_host(&inputs, &o).unwrap());
            ours_f.push(of);
            let lse = HostView::new(
                vec![n],
                HostSlice::F32(match out.lse.data() {
                    cce_core::HostData::F32(x) => x,
                    _ => unreachable!(),
                }),
            )
            .unwrap();
            let rest = HostView::new(
                vec![n],
                HostSlice::F32(match out.rest_mass.data() {
                    cce_core::HostData::F32(x) => x,
                    _ => unreachable!(),
                }),
            )
            .unwrap();
            let saved = cce_core::Saved {
                lse: &lse,
                rest_mass: &rest,
            };
            let up = Upstream {
                d_loss: DLoss::Scalar(1.0),
                d_lse: None,
            };
            let g = backend.backward_host(&inputs, &o, saved, &up).unwrap();
            let vecs = |t: cce_core::HostTensor| match t.into_data() {
                cce_core::HostData::F32(x) => x,
                _ => unreachable!(),
            };
            (
                Tensor::from_vec(vecs(g.d_e.unwrap()), (n, d), &dev).unwrap(),
                Tensor::from_vec(vecs(g.d_c.unwrap()), (v, d), &dev).unwrap(),
            )
        });
        let (_, b) = ms(|| {
            // The upstream scalar's scaling, then what candle's backprop does with a returned
            // gradient (a zero accumulator plus the gradient), as on the recompute path.
            let s = 0.5f64;
            let acc = |g: &Tensor| g.zeros_like()?.add(&g.affine(s, 0.0)?);
            (acc(&d_e).unwrap(), acc(&d_c).unwrap())
        });
        fwd.push(f);
        bwd.push(b);
    }
    let (ef, eb, of) = (median(fwd), median(bwd), median(ours_f));
    println!(
        "eager:     forward {ef:.1} (our forward {of:.1}, then our backward {:.1})  \
         backward {eb:.1}  total {:.1}",
        ef - of,
        ef + eb
    );
    println!(
        "held from forward to backward: recompute {} KiB (lse, rest mass), eager {} KiB (d_e, d_c)",
        8 * n / 1024,
        4 * (n + v) * d / 1024
    );
    Ok(())
}
