//! Prints the logit statistics of the real fixture or of a generated dataset.
//!
//! ```text
//! cargo run --release -p cce-data --example stats -- real
//! cargo run --release -p cce-data --example stats -- e12k
//! cargo run --release -p cce-data --example stats -- lm 4096 576 49152 [seed]
//! LM=row_corr=0.95,peak_prior=0 cargo run --release -p cce-data --example stats -- lm
//! ```
//!
//! Any distribution name of `cce_data::Distribution` works in place of `lm`; with `LM` set,
//! the `lm` preset for V is used with the listed fields overridden (clusters, slope_mu,
//! slope_sigma, peak_mu, peak_sigma, bulk_std, unigram_std, topic_keep, zipf, row_corr,
//! peak_prior). The acceptance bands of CASES.md are printed after the table.

use std::time::Instant;

use cce_data::{
    e12k_path, fixture_path, generate, load_real_e12k, load_real_fixture, measure, Distribution,
};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let what = args.first().map_or("real", String::as_str);
    let num =
        |i: usize, default: usize| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(default);
    let t = Instant::now();
    let ds = match what {
        "real" => load_real_fixture()?,
        "e12k" => load_real_e12k(e12k_path().ok_or("12k-row file not found")?, fixture_path())?,
        dist => {
            let mut dist: Distribution = dist.parse()?;
            if let Ok(o) = std::env::var("LM") {
                let mut p = cce_data::LmParams::for_vocab(num(3, 49152));
                for kv in o.split(',').filter(|s| !s.is_empty()) {
                    let (k, v) = kv.split_once('=').ok_or("LM=key=value,...")?;
                    let x: f64 = v.parse()?;
                    match k {
                        "clusters" => p.clusters = x as usize,
                        "slope_mu" => p.slope_mu = x,
                        "slope_sigma" => p.slope_sigma = x,
                        "peak_mu" => p.peak_mu = x,
                        "peak_sigma" => p.peak_sigma = x,
                        "bulk_std" => p.bulk_std = x,
                        "unigram_std" => p.unigram_std = x,
                        "topic_keep" => p.topic_keep = x,
                        "zipf" => p.zipf_exponent = x,
                        "row_corr" => p.row_corr = x,
                        "peak_prior" => p.peak_prior = x,
                        _ => return Err(format!("unknown LM key {k}").into()),
                    }
                }
                dist = Distribution::LmWith(p);
            }
            let seed = args.get(4).and_then(|s| s.parse().ok()).unwrap_or(1);
            generate(&dist, num(1, 4096), num(2, 576), num(3, 49152), seed)?
        }
    };
    println!("{} ({:.2} s)", ds.name, t.elapsed().as_secs_f64());
    let t = Instant::now();
    let s = measure(&ds)?;
    println!("measured in {:.2} s\n{s}", t.elapsed().as_secs_f64());
    for b in s.check_lm_bands() {
        println!("{b}");
    }
    Ok(())
}
