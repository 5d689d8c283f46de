//! README.md's "One call" example as a user copies it, then its results against the f64
//! oracle (`cce_reference::naive`), so the example's numbers are right, not only finite.

use cut_cross_entropy::{
    linear_cross_entropy, naive, DType, HostTensor, Options, OracleDLoss, Precision,
};

#[test]
fn readme_one_call_runs_and_matches_the_oracle() -> Result<(), cut_cross_entropy::CceError> {
    // --- README.md, "One call", verbatim ---
    // 3 tokens, hidden size 4, vocabulary of 5 classes.
    let e: Vec<f32> = (0..12).map(|i| (i as f32 * 0.37).sin()).collect();
    let c: Vec<f32> = (0..20).map(|i| (i as f32 * 0.11).cos()).collect();
    let e = HostTensor::from_f32(vec![3, 4], &e, DType::F32)?;
    let c = HostTensor::from_f32(vec![5, 4], &c, DType::F32)?;
    let targets = HostTensor::from_i64(vec![1, 4, -100]); // -100: ignored

    let out = linear_cross_entropy(&e, &c, None, &targets, &Options::default())?;
    let loss = out.loss.to_f32_vec()[0];
    assert!(loss.is_finite() && loss > 0.0);
    let d_e = out.d_e.unwrap(); // [3, 4], same dtype as e
    assert_eq!(d_e.to_f32_vec()[8..], [0.0; 4]); // the ignored row has no gradient
    println!("loss {loss}\n{}", out.backward_stats.unwrap());
    // --- end of the example ---

    let o = naive(
        &e,
        &c,
        None,
        &targets,
        &Options::default(),
        &OracleDLoss::Scalar(1.0),
        None,
        Precision::F64,
    )?;
    assert!(
        ((loss as f64) - o.loss[0]).abs() <= 1e-6 * o.loss[0].abs(),
        "{loss} vs {}",
        o.loss[0]
    );
    let close = |ours: &[f32], gt: &[f64]| {
        ours.iter()
            .zip(gt)
            .all(|(&a, &b)| (a as f64 - b).abs() <= 1e-5 * (1.0 + b.abs()))
    };
    assert!(
        close(&d_e.to_f32_vec(), &o.d_e),
        "d_e {:?} vs {:?}",
        d_e,
        o.d_e
    );
    let d_c = out.d_c.unwrap().to_f32_vec();
    assert!(close(&d_c, &o.d_c), "d_c {d_c:?} vs {:?}", o.d_c);
    Ok(())
}
