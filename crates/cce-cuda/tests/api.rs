//! The device API a training step calls: a backend on the caller's stream, made per call from
//! the process's module cache, over borrowed device memory, ordered with events against a
//! producer on another stream. Skips without a CUDA device (`CCE_REQUIRE_CUDA=1` fails instead).

mod common;

use cce_core::{Backend, DType, Inputs, Options, Reduction, TensorMeta, Upstream};
use cce_cuda::{CudaBackend, CudaTensor};
use cudarc::driver::CudaStream;
use std::sync::Arc;

/// A bf16 problem, 1000 x 256 x 3000 (partial tiles, several class tiles), 5% ignored rows.
fn case() -> common::Case {
    let mut rng = common::seeded();
    common::random_case(&mut rng, 1000, 256, 3000, DType::BF16, false, 0.05, 4.0)
}

fn f32s(be: &CudaBackend, t: &CudaTensor) -> Vec<f32> {
    be.download(t).unwrap().to_f32_vec()
}

/// Loss, lse, d_e and d_c of a forward+backward on `be` (uploaded from the host case).
fn run(be: &CudaBackend, e: &CudaTensor, c: &CudaTensor, t: &CudaTensor) -> [Vec<f32>; 4] {
    let inputs = Inputs {
        e,
        c,
        bias: None,
        targets: t,
    };
    let opts = Options {
        reduction: Reduction::Sum,
        ..Options::default()
    };
    let (fwd, bwd) = be
        .forward_backward(&inputs, &opts, &Upstream::default())
        .unwrap_or_else(|err| panic!("{err}"));
    [
        f32s(be, &fwd.loss),
        f32s(be, &fwd.lse),
        f32s(be, bwd.d_e.as_ref().unwrap()),
        f32s(be, bwd.d_c.as_ref().unwrap()),
    ]
}

fn upload_case(be: &CudaBackend, k: &common::Case) -> [CudaTensor; 3] {
    [
        be.upload(&k.e).unwrap(),
        be.upload(&k.c).unwrap(),
        be.upload(&k.targets).unwrap(),
    ]
}

fn assert_same(what: &str, a: &[Vec<f32>; 4], b: &[Vec<f32>; 4]) {
    for (name, (x, y)) in ["loss", "lse", "d_e", "d_c"].iter().zip(a.iter().zip(b)) {
        assert_eq!(x.len(), y.len(), "{what}: {name} length");
        let scale = y.iter().fold(1e-30f32, |m, q| m.max(q.abs()));
        let worst = x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
        // Same kernels on the same data: only the run-to-run order of float atomics differs.
        assert!(
            worst <= 1e-3 * scale,
            "{what}: {name} differs by {worst:e} (largest |value| {scale:e})"
        );
    }
}

#[test]
fn a_backend_on_the_callers_stream_matches_its_own_stream() {
    let Some(own) = common::backend("a_backend_on_the_callers_stream_matches_its_own_stream")
    else {
        return;
    };
    let k = case();
    let [e, c, t] = upload_case(&own, &k);
    let expected = run(&own, &e, &c, &t);
    own.synchronize().unwrap();

    let ctx = own.context().clone();
    let caller: Arc<CudaStream> = ctx.new_stream().unwrap();
    let on = CudaBackend::on_stream(caller.clone()).unwrap();
    assert_eq!(on.stream().cu_stream(), caller.cu_stream());
    assert_same("on_stream", &run(&on, &e, &c, &t), &expected);

    // SAFETY: `caller` is a live stream of `ctx` and outlives `raw` (dropped first below);
    // everything runs on that one stream.
    let raw = unsafe { CudaBackend::on_raw_stream(&ctx, caller.cu_stream()) }.unwrap();
    assert_eq!(raw.stream().cu_stream(), caller.cu_stream());
    assert_same("on_raw_stream", &run(&raw, &e, &c, &t), &expected);
    raw.synchronize().unwrap();
    drop(raw);
    caller.synchronize().unwrap();
}

#[test]
fn a_backend_per_call_reuses_the_loaded_modules() {
    let Some(first) = common::backend("a_backend_per_call_reuses_the_loaded_modules") else {
        return;
    };
    let stream = first.stream().clone();
    let t0 = std::time::Instant::now();
    for _ in 0..20 {
        let be = CudaBackend::on_stream(stream.clone()).unwrap();
        assert_eq!(be.arch(), first.arch());
    }
    let per_ms = t0.elapsed().as_secs_f64() * 1e3 / 20.0;
    eprintln!("CudaBackend::on_stream: {per_ms:.3} ms per construction");
    // A module load alone takes tens of milliseconds; a construction from the cache does not.
    assert!(per_ms < 20.0, "{per_ms} ms per construction");

    // What a backend per call costs on a dense call (its cuBLAS handle and workspace are made
    // by its first dense call) against calls on one backend: printed for the record.
    let k = case();
    let [e, c, t] = upload_case(&first, &k);
    let inputs = Inputs {
        e: &e,
        c: &c,
        bias: None,
        targets: &t,
    };
    let opts = Options::default();
    let time = |f: &dyn Fn()| {
        first.synchronize().unwrap();
        let t0 = std::time::Instant::now();
        for _ in 0..10 {
            f();
        }
        first.synchronize().unwrap();
        t0.elapsed().as_secs_f64() * 1e3 / 10.0
    };
    first.forward(&inputs, &opts).unwrap();
    let same = time(&|| drop(first.forward(&inputs, &opts).unwrap()));
    let fresh = time(&|| {
        let be = CudaBackend::on_stream(stream.clone()).unwrap();
        drop(be.forward(&inputs, &opts).unwrap());
    });
    eprintln!("forward 1000 x 256 x 3000: {same:.3} ms on one backend, {fresh:.3} ms with a backend per call");
}

#[test]
fn borrowed_memory_is_read_in_place_and_never_freed() {
    let Some(be) = common::backend("borrowed_memory_is_read_in_place_and_never_freed") else {
        return;
    };
    let k = case();
    let [e, c, t] = upload_case(&be, &k);
    let expected = run(&be, &e, &c, &t);
    let stream = be.stream().clone();
    // The caller's memory: cudarc slices of the element types a framework holds.
    let e_host: Vec<half::bf16> = bytemuck::cast_slice(k.e.as_bytes()).to_vec();
    let c_host: Vec<half::bf16> = bytemuck::cast_slice(k.c.as_bytes()).to_vec();
    let t_host: Vec<i64> = bytemuck::cast_slice(k.targets.as_bytes()).to_vec();
    let e_own = stream.clone_htod(&e_host).unwrap();
    let c_own = stream.clone_htod(&c_host).unwrap();
    let t_own = stream.clone_htod(&t_host).unwrap();
    for round in 0..2 {
        // SAFETY: the slices outlive the tensors and every call (synchronized below); all work
        // is on `stream`, where the slices were written; no output aliases them.
        let (be_, bc, bt) = unsafe {
            (
                CudaTensor::borrowed_view(
                    &stream,
                    &e_own.as_view(),
                    DType::BF16,
                    k.e.shape().to_vec(),
                )
                .unwrap(),
                CudaTensor::borrowed_view(
                    &stream,
                    &c_own.as_view(),
                    DType::BF16,
                    k.c.shape().to_vec(),
                )
                .unwrap(),
                CudaTensor::borrowed(
                    &stream,
                    cudarc::driver::DevicePtr::device_ptr(&t_own, &stream).0,
                    DType::I64,
                    vec![k.n],
                )
                .unwrap(),
            )
        };
        assert!(be_.is_borrowed() && !e.is_borrowed());
        assert_same(
            &format!("borrowed, round {round}"),
            &run(&be, &be_, &bc, &bt),
            &expected,
        );
        assert!(
            bt.into_slice().is_err(),
            "a borrowed tensor cannot become an owner"
        );
        drop((be_, bc));
        be.synchronize().unwrap();
    }
    // Dropping the borrowed tensors freed nothing: the caller's memory still holds the inputs.
    assert_eq!(stream.clone_dtoh(&e_own).unwrap(), e_host);
    assert_eq!(stream.clone_dtoh(&t_own).unwrap(), t_host);
}

#[test]
fn borrowed_rejects_null_misaligned_and_short_memory() {
    let Some(be) = common::backend("borrowed_rejects_null_misaligned_and_short_memory") else {
        return;
    };
    let stream = be.stream().clone();
    let mem = stream.alloc_zeros::<u8>(4096).unwrap();
    let base = cudarc::driver::DevicePtr::device_ptr(&mem, &stream).0;
    // SAFETY: each call fails its checks before the address is used.
    unsafe {
        let err = CudaTensor::borrowed(&stream, 0, DType::F32, vec![4]).unwrap_err();
        assert!(err.to_string().contains("null"), "{err}");
        let err = CudaTensor::borrowed(&stream, base + 8, DType::BF16, vec![4]).unwrap_err();
        assert!(err.to_string().contains("aligned"), "{err}");
        let err =
            CudaTensor::borrowed_view(&stream, &mem.slice(..64), DType::F32, vec![32]).unwrap_err();
        assert!(err.to_string().contains("128 bytes"), "{err}");
    }
    // i64 targets need only their element alignment.
    // SAFETY: 8 i64 at base + 8 lie inside the 4096-byte allocation, which outlives `t`.
    let t = unsafe { CudaTensor::borrowed(&stream, base + 8, DType::I64, vec![8]) }.unwrap();
    assert_eq!(t.shape(), &[8]);
    drop(t);
    be.synchronize().unwrap();
}

#[test]
fn a_call_on_a_caller_stream_waits_for_a_producer_stream_through_an_event() {
    let Some(own) = common::backend("a_call_on_a_caller_stream_waits_for_a_producer_stream") else {
        return;
    };
    let ctx = own.context().clone();
    let (n, d, v) = (4096, 1024, 32000);
    let produce = |be: &CudaBackend| -> [CudaTensor; 3] {
        let mut e = be.alloc_tensor(vec![n, d], DType::BF16).unwrap();
        let mut c = be.alloc_tensor(vec![v, d], DType::BF16).unwrap();
        be.fill_randn(&mut e, 1, 0.0, 0.2).unwrap();
        be.fill_randn(&mut c, 2, 0.0, 0.2).unwrap();
        let t = be.random_targets(n, v, 0.05, -100, 3).unwrap();
        [e, c, t]
    };
    // In one stream: the reference.
    let [e, c, t] = produce(&own);
    let expected = run(&own, &e, &c, &t);
    own.synchronize().unwrap();
    drop((e, c, t));

    // A producer stream fills the inputs (kernels still running when the call is enqueued);
    // the caller's non-blocking stream waits for an event recorded after them.
    let producer = CudaBackend::on_stream(ctx.new_stream().unwrap()).unwrap();
    let caller = CudaBackend::on_stream(ctx.new_stream().unwrap()).unwrap();
    let [e, c, t] = produce(&producer);
    let ready = producer.stream().record_event(None).unwrap();
    caller.stream().wait(&ready).unwrap();
    let got = run(&caller, &e, &c, &t);
    assert_same("two streams", &got, &expected);
    // The inputs were allocated on the producer's stream, which frees them on drop: it waits
    // for the caller's stream first.
    let done = caller.stream().record_event(None).unwrap();
    producer.stream().wait(&done).unwrap();
    drop((e, c, t));
    producer.synchronize().unwrap();
}

#[test]
fn switches_are_one_explicit_value() {
    let Some(be) = common::backend("switches_are_one_explicit_value") else {
        return;
    };
    assert_eq!(be.switches(), cce_cuda::CudaSwitches::default());
    let s = cce_cuda::CudaSwitches {
        wgmma_rows: false,
        profile: true,
        sparse: cce_cuda::SparseMode::Off,
        ..Default::default()
    };
    let be = be.with_switches(s);
    assert_eq!(be.switches(), s);
    let be = be.with_wgmma_gcols(false);
    assert_eq!(
        be.switches(),
        cce_cuda::CudaSwitches {
            wgmma_gcols: false,
            ..s
        }
    );
}

/// The forward's required outputs as caller buffers (no side outputs).
fn into<'a>(
    loss: &'a mut CudaTensor,
    lse: &'a mut CudaTensor,
    rest_mass: &'a mut CudaTensor,
) -> cce_cuda::ForwardInto<'a> {
    cce_cuda::ForwardInto {
        loss,
        lse,
        rest_mass,
        entropy: None,
        argmax: None,
    }
}

#[test]
fn outputs_written_into_the_callers_buffers_match_and_the_workspace_is_known_before() {
    let Some(be) = common::backend(
        "outputs_written_into_the_callers_buffers_match_and_the_workspace_is_known_before",
    ) else {
        return;
    };
    let k = case();
    let [e, c, t] = upload_case(&be, &k);
    let inputs = Inputs {
        e: &e,
        c: &c,
        bias: None,
        targets: &t,
    };
    let opts = Options {
        reduction: Reduction::Sum,
        deterministic: true,
        ..Options::default()
    };
    let (n, d, v) = (1000, 256, 3000);
    let (fwd, bwd) = be
        .forward_backward(&inputs, &opts, &Upstream::default())
        .unwrap();
    let mut loss = be.zeros(vec![], DType::F32).unwrap();
    let mut lse = be.zeros(vec![n], DType::F32).unwrap();
    let mut rest = be.zeros(vec![n], DType::F32).unwrap();
    let mut d_e = be.zeros(vec![n, d], DType::BF16).unwrap();
    let mut d_c = be.zeros(vec![v, d], DType::BF16).unwrap();
    let (fs, bs) = be
        .forward_backward_into(
            &inputs,
            &opts,
            &Upstream::default(),
            into(&mut loss, &mut lse, &mut rest),
            cce_cuda::GradsInto {
                d_e: Some(&mut d_e),
                d_c: Some(&mut d_c),
                d_bias: None,
                accumulate: false,
            },
        )
        .unwrap();
    for (what, ours, theirs) in [
        ("loss", &loss, &fwd.loss),
        ("lse", &lse, &fwd.lse),
        ("rest_mass", &rest, &fwd.rest_mass),
        ("d_e", &d_e, bwd.d_e.as_ref().unwrap()),
        ("d_c", &d_c, bwd.d_c.as_ref().unwrap()),
    ] {
        assert_eq!(f32s(&be, ours), f32s(&be, theirs), "{what} (deterministic)");
    }
    assert_eq!(fs.workspace_bytes, fwd.stats.workspace_bytes);
    assert_eq!(
        be.workspace_bytes(&inputs, &opts, true).unwrap(),
        bs.workspace_bytes,
        "the query gives what the call reports"
    );
    let fwd_only = be.forward(&inputs, &opts).unwrap();
    assert_eq!(
        be.workspace_bytes(&inputs, &opts, false).unwrap(),
        fwd_only.stats.workspace_bytes
    );
    // Within the budget, the cuBLAS workspace counted; a forward-only call within the
    // forward-only cap beside it.
    let cublas = cce_cuda::dense::CUBLAS_WORKSPACE_BYTES as u64;
    assert!(bs.workspace_bytes <= opts.workspace_budget_bytes, "{bs}");
    assert!(fwd_only.stats.workspace_bytes <= cce_cuda::dense::FORWARD_WORKSPACE_CAP + cublas);
    // A buffer of the wrong size or dtype, or a side output nobody asked for: typed errors.
    let mut short = be.zeros(vec![n - 1], DType::F32).unwrap();
    let err = be
        .forward_into(&inputs, &opts, into(&mut loss, &mut short, &mut rest))
        .unwrap_err();
    assert!(
        matches!(err, cce_core::CceError::ShapeMismatch { .. }),
        "{err}"
    );
    let mut ent = be.zeros(vec![n], DType::F32).unwrap();
    let err = be
        .forward_into(
            &inputs,
            &opts,
            cce_cuda::ForwardInto {
                entropy: Some(&mut ent),
                ..into(&mut loss, &mut lse, &mut rest)
            },
        )
        .unwrap_err();
    assert!(
        matches!(err, cce_core::CceError::InvalidOption { .. }),
        "{err}"
    );
}

/// The forward-only workspace at large shapes: within [`cce_cuda::dense::FORWARD_WORKSPACE_CAP`]
/// beside the cuBLAS workspace (0.44 GiB once at 32768 x 4096 x 256000, queried here without a
/// call), and a forward-only call whose partials need more than the cap: on sm_90 the fused
/// WGMMA forward in 2 row groups of 8192 rows, elsewhere the class tiles; its lse against the
/// forward-and-backward call's.
#[test]
fn a_forward_only_call_stays_within_the_forward_cap() {
    let Some(be) = common::backend("a_forward_only_call_stays_within_the_forward_cap") else {
        return;
    };
    let cap =
        cce_cuda::dense::FORWARD_WORKSPACE_CAP + cce_cuda::dense::CUBLAS_WORKSPACE_BYTES as u64;
    let budget = Options::default().workspace_budget_bytes;
    let (n, d, v) = (32768, 4096, 256000);
    let e = be.zeros(vec![n, d], DType::BF16).unwrap();
    let c = be.zeros(vec![v, d], DType::BF16).unwrap();
    let t = be.zeros(vec![n], DType::I64).unwrap();
    let seed = Inputs {
        e: &e,
        c: &c,
        bias: None,
        targets: &t,
    };
    for opts in [Options::default(), Options::exact()] {
        let fwd = be.workspace_bytes(&seed, &opts, false).unwrap();
        let bwd = be.workspace_bytes(&seed, &opts, true).unwrap();
        eprintln!("{n}x{d}x{v}: forward-only {fwd} B, with a backward {bwd} B");
        assert!(fwd <= cap && bwd <= budget, "{fwd} {bwd}");
    }
    drop((e, c, t));
    let mut rng = common::seeded();
    let k = common::random_case(&mut rng, 16384, 64, 256000, DType::BF16, false, 0.0, 4.0);
    let [e, c, t] = upload_case(&be, &k);
    let inputs = Inputs {
        e: &e,
        c: &c,
        bias: None,
        targets: &t,
    };
    let opts = Options::exact();
    let f = be.forward(&inputs, &opts).unwrap();
    let reason = &f.stats.plan_reason;
    eprintln!("16384x64x256000 forward: {reason}");
    assert_eq!(
        be.workspace_bytes(&inputs, &opts, false).unwrap(),
        f.stats.workspace_bytes
    );
    assert!(f.stats.workspace_bytes <= cap, "{}", f.stats);
    if reason.starts_with("forward: WGMMA") {
        assert!(
            reason.contains("(2 row group(s) of up to 8192 rows"),
            "{reason}"
        );
    }
    let (g, _) = be
        .forward_backward(&inputs, &opts, &Upstream::default())
        .unwrap();
    let (a, b) = (f32s(&be, &f.lse), f32s(&be, &g.lse));
    let worst = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs() / y.abs().max(1.0))
        .fold(0f32, f32::max);
    assert!(worst <= 1e-4, "lse differs by {worst:e} (relative)");
}

#[test]
fn a_kept_workspace_gives_the_bits_of_a_fresh_one_and_is_reused() {
    let Some(own) = common::backend("a_kept_workspace_gives_the_bits_of_a_fresh_one") else {
        return;
    };
    let k = case();
    let [e, c, t] = upload_case(&own, &k);
    let fresh = CudaBackend::new(0)
        .unwrap()
        .with_switches(cce_cuda::CudaSwitches {
            keep_workspace: false,
            ..Default::default()
        });
    let want = run(&fresh, &e, &c, &t);
    // The default keeps the workspace in the engine's pool: the first call fills it, the next
    // ones reuse it (with the sparse probe's and the dense passes' layouts in between).
    assert!(own.switches().keep_workspace);
    for call in 0..3 {
        assert_same(
            &format!("kept workspace, call {call}"),
            &run(&own, &e, &c, &t),
            &want,
        );
    }
    let (free_before, _) = cudarc::driver::result::mem_get_info().unwrap();
    run(&own, &e, &c, &t);
    own.synchronize().unwrap();
    let (free_after, _) = cudarc::driver::result::mem_get_info().unwrap();
    // Nothing more is reserved by a call once the pool holds its workspace (outputs freed).
    assert!(
        free_after + (64 << 20) >= free_before,
        "a call with a kept workspace reserved {} more bytes",
        free_before.saturating_sub(free_after)
    );
}
