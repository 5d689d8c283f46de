//! Scratch: forward lse against the f64 oracle for one shape (N D V from args).
use cce_core::{Backend, DType, HostTensor, Inputs, Options};
use cce_reference::naive::{naive, OracleDLoss, Precision};
fn main() {
    let a: Vec<usize> = std::env::args()
        .skip(1)
        .map(|x| x.parse().unwrap())
        .collect();
    let (n, d, v) = (a[0], a[1], a[2]);
    let mut s = 12345u64;
    let mut r = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 11) as f32 / (1u64 << 53) as f32 - 0.5
    };
    let e: Vec<f32> = (0..n * d).map(|_| r()).collect();
    let c: Vec<f32> = (0..v * d).map(|_| r()).collect();
    let y: Vec<i64> = (0..n as i64).map(|i| (i * 7919) % v as i64).collect();
    let e = HostTensor::from_f32(vec![n, d], &e, DType::F32).unwrap();
    let c = HostTensor::from_f32(vec![v, d], &c, DType::F32).unwrap();
    let y = HostTensor::from_i64(y);
    let b = cce_wgpu::WgpuBackend::new().unwrap();
    let b = if a.len() > 3 {
        b.with_config(cce_wgpu::KernelConfig {
            target_workgroups: a[3] as u32,
            max_loop_iterations: a[4] as u32,
            ..b.config()
        })
        .unwrap()
    } else {
        b
    };
    let (eb, cb, yb) = (
        b.upload(&e).unwrap(),
        b.upload(&c).unwrap(),
        b.upload(&y).unwrap(),
    );
    let back = b.download(&cb).unwrap();
    println!("c round trip equal: {}", back == c);
    let opts = Options::exact();
    let f = b
        .forward(
            &Inputs {
                e: &eb,
                c: &cb,
                bias: None,
                targets: &yb,
            },
            &opts,
        )
        .unwrap();
    let lse = b.download(&f.lse).unwrap().to_f64_vec();
    let gt = naive(
        &e,
        &c,
        None,
        &y,
        &opts,
        &OracleDLoss::Scalar(1.0),
        None,
        Precision::F64,
    )
    .unwrap();
    let mut worst = (0.0, 0);
    for i in 0..n {
        let err = (lse[i] - gt.lse[i]).abs();
        if err > worst.0 {
            worst = (err, i);
        }
    }
    println!(
        "{n}x{d}x{v}: max |lse err| {:.3e} at row {} (ours {}, gt {})",
        worst.0, worst.1, lse[worst.1], gt.lse[worst.1]
    );
}
