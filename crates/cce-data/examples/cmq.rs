use cce_data::*;
fn main() {
    let ds = load_real_fixture().unwrap();
    let d = ds.d;
    let mut eb = vec![0f64; d];
    for i in 0..ds.n { for k in 0..d { eb[k] += ds.e[i*d+k] as f64 / ds.n as f64; } }
    let mut cm: Vec<f64> = (0..ds.v).map(|j| (0..d).map(|k| ds.c[j*d+k] as f64 * eb[k]).sum()).collect();
    let mean = cm.iter().sum::<f64>() / cm.len() as f64;
    cm.iter_mut().for_each(|x| *x -= mean);
    cm.sort_by(|a, b| b.total_cmp(a));
    let sd = (cm.iter().map(|x| x*x).sum::<f64>() / cm.len() as f64).sqrt();
    println!("mean {mean:.3} sd {sd:.3}");
    for r in [1usize, 2, 5, 10, 30, 100, 300, 1000, 3000, 10000, 24576, 40000, 45000, 48000, 49000, 49152] {
        println!("rank {r:6}: {:8.3}  (-ln r std-scaled: {:.3})", cm[r-1], 0.0);
    }
    // per-row: logit std and rank of max
    // norms
    let en: f64 = (0..ds.n).map(|i| (0..d).map(|k| (ds.e[i*d+k] as f64).powi(2)).sum::<f64>().sqrt()).sum::<f64>() / ds.n as f64;
    let cn: f64 = (0..ds.v).map(|j| (0..d).map(|k| (ds.c[j*d+k] as f64).powi(2)).sum::<f64>().sqrt()).sum::<f64>() / ds.v as f64;
    println!("mean |e| {en:.2}  mean |c| {cn:.3}");
}
