//! A framework's device and buffers: `WgpuBackend::from_device` on a device this test opens
//! gives the results of `WgpuBackend::new` bit for bit and leaves the device's own error
//! handler in place; views at offsets that are not binding-aligned are read and written in
//! place (inputs and outputs of forward and backward) without touching the bytes around them;
//! bad views and destinations are typed errors.
//!
//! Without an adapter the tests print "skipping: <reason>" and pass, unless
//! `CCE_REQUIRE_WGPU=1` (CI), where they fail.

use cce_core::{
    Backend, CceError, DLoss, DType, HostTensor, Inputs, Options, Reduction, Saved, TensorMeta,
    Upstream,
};
use cce_wgpu::{BackwardDest, ForwardDest, WgpuBackend, WgpuTensor};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

/// The backend that opens its own device (the reference of these tests).
fn own() -> Option<&'static WgpuBackend> {
    static B: OnceLock<Result<WgpuBackend, String>> = OnceLock::new();
    match B.get_or_init(|| WgpuBackend::new().map_err(|e| e.to_string())) {
        Ok(b) => Some(b),
        Err(e) => {
            if std::env::var("CCE_REQUIRE_WGPU").as_deref() == Ok("1") {
                panic!("CCE_REQUIRE_WGPU=1 but no wgpu backend: {e}");
            }
            println!("skipping: {e}");
            None
        }
    }
}

/// A device and queue opened by the test on the adapter `own` uses, with the adapter's
/// limits (as cubecl-wgpu requests them), and an uncaptured-error handler counting errors.
fn test_device(own: &WgpuBackend) -> (wgpu::Device, wgpu::Queue, Arc<AtomicUsize>) {
    test_device_with(own, wgpu::Features::empty())
}

/// [`test_device`] with those of `features` the adapter has.
fn test_device_with(
    own: &WgpuBackend,
    features: wgpu::Features,
) -> (wgpu::Device, wgpu::Queue, Arc<AtomicUsize>) {
    let want = own.adapter_info();
    let instance =
        wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
    let adapter = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::all()))
        .into_iter()
        .find(|a| a.get_info().name == want.name && a.get_info().backend == want.backend)
        .expect("the adapter of WgpuBackend::new");
    let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
        label: Some("test device"),
        required_features: adapter.features() & features,
        required_limits: adapter.limits(),
        ..Default::default()
    }))
    .expect("request_device");
    let errors = Arc::new(AtomicUsize::new(0));
    let count = errors.clone();
    device.on_uncaptured_error(Arc::new(move |_e: wgpu::Error| {
        count.fetch_add(1, Ordering::SeqCst);
    }));
    (device, queue, errors)
}

/// Inputs of one problem: `N` not a multiple of the tile, a bias, per-row upstream gradients.
struct Data {
    e: HostTensor,
    c: HostTensor,
    bias: HostTensor,
    y: HostTensor,
    g_rows: HostTensor,
    h_rows: HostTensor,
}

fn data(dtype: DType) -> Data {
    let (n, d, v) = (150, 40, 300);
    let wave = |len: usize, a: f32, s: f32| (0..len).map(|i| (i as f32 * a).sin() * s).collect();
    let e: Vec<f32> = wave(n * d, 0.37, 1.0);
    let c: Vec<f32> = wave(v * d, 0.11, 0.3);
    let b: Vec<f32> = wave(v, 0.7, 0.5);
    let y = (0..n)
        .map(|i| {
            if i % 9 == 4 {
                -100
            } else {
                (i * 37 % v) as i64
            }
        })
        .collect();
    let g: Vec<f32> = wave(n, 0.3, 0.5).iter().map(|x| x + 1.0).collect();
    let h: Vec<f32> = wave(n, 0.9, 0.2);
    Data {
        e: HostTensor::from_f32(vec![n, d], &e, dtype).unwrap(),
        c: HostTensor::from_f32(vec![v, d], &c, dtype).unwrap(),
        bias: HostTensor::from_f32(vec![v], &b, dtype).unwrap(),
        y: HostTensor::from_i64(y),
        g_rows: HostTensor::from_f32(vec![n], &g, DType::F32).unwrap(),
        h_rows: HostTensor::from_f32(vec![n], &h, DType::F32).unwrap(),
    }
}

/// Deterministic, so that two backends (one with f32 atomics, one without) give the same bits.
fn options(reduction: Reduction) -> Options {
    Options {
        reduction,
        deterministic: true,
        label_smoothing: 0.1,
        softcap: Some(20.0),
        ..Options::exact()
    }
}

/// The bytes of every output: loss, lse, rest_mass, d_e, d_c, d_bias.
type Outs = Vec<Vec<u8>>;

/// Forward and backward on tensors the backend uploads and allocates.
fn run_plain(b: &WgpuBackend, x: &Data, opts: &Options) -> Outs {
    let up = |t: &HostTensor| b.upload(t).unwrap();
    let (e, c, bias, y) = (up(&x.e), up(&x.c), up(&x.bias), up(&x.y));
    let (g, h) = (up(&x.g_rows), up(&x.h_rows));
    let inputs = Inputs {
        e: &e,
        c: &c,
        bias: Some(&bias),
        targets: &y,
    };
    let fwd = b.forward(&inputs, opts).unwrap();
    let per_row = opts.reduction == Reduction::None;
    let upstream = Upstream {
        d_loss: if per_row {
            DLoss::PerRow(&g)
        } else {
            DLoss::Scalar(0.75)
        },
        d_lse: per_row.then_some(&h),
    };
    let saved = Saved {
        lse: &fwd.lse,
        rest_mass: &fwd.rest_mass,
    };
    let bwd = b.backward(&inputs, opts, saved, &upstream).unwrap();
    let down = |t: &WgpuTensor| b.download(t).unwrap().as_bytes().to_vec();
    let grads = [bwd.d_e, bwd.d_c, bwd.d_bias].map(|t| down(&t.unwrap()));
    let mut outs = vec![down(&fwd.loss), down(&fwd.lse), down(&fwd.rest_mass)];
    outs.extend(grads);
    outs
}

const SENTINEL: u8 = 0xa5;

/// Regions of one buffer: each tensor at `4 + k·align` (never binding-aligned when the
/// alignment exceeds 4), 8 sentinel bytes or more between them.
struct Layout {
    offsets: Vec<u64>,
    sizes: Vec<u64>,
    total: u64,
}

fn layout(sizes: &[u64], align: u64) -> Layout {
    let mut at = 0u64;
    let mut offsets = Vec::new();
    for &s in sizes {
        let off = at.next_multiple_of(align) + 4;
        offsets.push(off);
        at = off + s.next_multiple_of(4) + 8;
    }
    Layout {
        offsets,
        sizes: sizes.to_vec(),
        total: at.next_multiple_of(align) + align,
    }
}

/// Forward and backward with every input and output a view into one buffer of the device.
fn run_views(b: &WgpuBackend, x: &Data, opts: &Options) -> Outs {
    let per_row = opts.reduction == Reduction::None;
    let n = x.e.shape()[0];
    let loss_n = if per_row { n } else { 1 };
    let dt = x.e.dtype();
    let ins = [&x.e, &x.c, &x.bias, &x.y, &x.g_rows, &x.h_rows];
    let mut sizes: Vec<u64> = ins.iter().map(|t| t.as_bytes().len() as u64).collect();
    // loss, lse, rest_mass, d_e, d_c, d_bias
    let out_shapes = [
        (vec![loss_n], DType::F32),
        (vec![n], DType::F32),
        (vec![n], DType::F32),
        (x.e.shape().to_vec(), dt),
        (x.c.shape().to_vec(), dt),
        (x.bias.shape().to_vec(), dt),
    ];
    sizes.extend(
        out_shapes
            .iter()
            .map(|(s, d)| (s.iter().product::<usize>() * d.size_bytes()) as u64),
    );
    let align = b.device().limits().min_storage_buffer_offset_alignment as u64;
    let lay = layout(&sizes, align.max(8));
    let buf = b.device().create_buffer(&wgpu::BufferDescriptor {
        label: Some("framework pool"),
        size: lay.total,
        usage: wgpu::BufferUsages::STORAGE
            | wgpu::BufferUsages::COPY_SRC
            | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    b.queue()
        .write_buffer(&buf, 0, &vec![SENTINEL; lay.total as usize]);
    for (t, &off) in ins.iter().zip(&lay.offsets) {
        let mut bytes = t.as_bytes().to_vec();
        bytes.resize(bytes.len().next_multiple_of(4), SENTINEL);
        b.queue().write_buffer(&buf, off, &bytes);
    }
    let view = |k: usize, dtype: DType, shape: Vec<usize>| -> WgpuTensor {
        b.view(&buf, lay.offsets[k], dtype, shape).unwrap()
    };
    let [e, c, bias, y, g, h] =
        std::array::from_fn(|k| view(k, ins[k].dtype(), ins[k].shape().to_vec()));
    let [loss, lse, rest, d_e, d_c, d_bias] =
        std::array::from_fn(|k| view(6 + k, out_shapes[k].1, out_shapes[k].0.clone()));
    let inputs = Inputs {
        e: &e,
        c: &c,
        bias: Some(&bias),
        targets: &y,
    };
    let fdest = ForwardDest {
        loss: Some(loss),
        lse: Some(lse),
        rest_mass: Some(rest),
    };
    let fwd = b.forward_into(&inputs, opts, &fdest).unwrap();
    assert_eq!(
        fwd.lse.offset(),
        lay.offsets[7],
        "lse comes back as the view"
    );
    let upstream = Upstream {
        d_loss: if per_row {
            DLoss::PerRow(&g)
        } else {
            DLoss::Scalar(0.75)
        },
        d_lse: per_row.then_some(&h),
    };
    let saved = Saved {
        lse: &fwd.lse,
        rest_mass: &fwd.rest_mass,
    };
    let bdest = BackwardDest {
        d_e: Some(d_e),
        d_c: Some(d_c),
        d_bias: Some(d_bias),
    };
    let bwd = b
        .backward_into(&inputs, opts, saved, &upstream, &bdest)
        .unwrap();
    assert_eq!(bwd.d_c.unwrap().offset(), lay.offsets[10]);

    // The whole buffer back: the outputs, and the sentinels around every region intact.
    let whole = b
        .view(&buf, 0, DType::I32, vec![lay.total as usize / 4])
        .unwrap();
    let all = b.download(&whole).unwrap().as_bytes().to_vec();
    let mut covered = vec![false; all.len()];
    for (&off, &size) in lay.offsets.iter().zip(&lay.sizes) {
        let end = (off + size.next_multiple_of(4)) as usize;
        covered[off as usize..end]
            .iter_mut()
            .for_each(|c| *c = true);
    }
    for (i, (&byte, &cov)) in all.iter().zip(&covered).enumerate() {
        assert!(
            cov || byte == SENTINEL,
            "byte {i} outside every view changed"
        );
    }
    (6..12)
        .map(|k| {
            let off = lay.offsets[k] as usize;
            all[off..off + lay.sizes[k] as usize].to_vec()
        })
        .collect()
}

fn assert_same(what: &str, a: &Outs, b: &Outs) {
    let names = ["loss", "lse", "rest_mass", "d_e", "d_c", "d_bias"];
    for ((name, x), y) in names.iter().zip(a).zip(b) {
        assert_eq!(x, y, "{what}: {name} differs");
    }
}

#[test]
fn from_device_gives_the_results_of_new() {
    let Some(own) = own() else { return };
    let (device, queue, errors) = test_device(own);
    let borrowed = WgpuBackend::from_device(device.clone(), queue).unwrap();
    assert!(own.owns_device() && !borrowed.owns_device());
    assert_eq!(borrowed.config(), own.config());
    for dtype in [DType::F32, DType::BF16] {
        for reduction in [Reduction::Mean, Reduction::None] {
            let (x, opts) = (data(dtype), options(reduction));
            let what = format!("{dtype} {reduction:?}");
            assert_same(
                &what,
                &run_plain(own, &x, &opts),
                &run_plain(&borrowed, &x, &opts),
            );
        }
    }
    // The device's own uncaptured-error handler is still the one installed: our calls sent it
    // nothing, and an error outside them reaches it.
    assert_eq!(errors.load(Ordering::SeqCst), 0);
    let _bad = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("invalid on purpose"),
        size: 16,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::MAP_WRITE,
        mapped_at_creation: false,
    });
    assert_eq!(errors.load(Ordering::SeqCst), 1);
}

/// A borrowed device takes the backward's f32 atomics exactly when its owner requested
/// `SHADER_FLOAT32_ATOMIC`, and gives the deterministic results of `new` either way.
#[test]
fn from_device_detects_float_atomics_from_the_device() {
    let Some(own) = own() else { return };
    let (device, queue, _) = test_device_with(own, wgpu::Features::SHADER_FLOAT32_ATOMIC);
    let with = WgpuBackend::from_device(device, queue).unwrap();
    let (device, queue, _) = test_device(own);
    let without = WgpuBackend::from_device(device, queue).unwrap();
    assert_eq!(with.has_float_atomics(), own.has_float_atomics());
    assert!(!without.has_float_atomics());
    println!("f32 atomics on this adapter: {}", own.has_float_atomics());
    let (x, opts) = (data(DType::BF16), options(Reduction::Mean));
    let plain = run_plain(own, &x, &opts);
    assert_same("atomics requested", &plain, &run_plain(&with, &x, &opts));
    assert_same("no atomics", &plain, &run_plain(&without, &x, &opts));
    // The coalesced adds need SUBGROUP on the owner's device besides the f32 atomics.
    assert!(!with.has_coalesced_adds() && !without.has_coalesced_adds());
    let both = wgpu::Features::SHADER_FLOAT32_ATOMIC | wgpu::Features::SUBGROUP;
    let (device, queue, _) = test_device_with(own, both);
    let co = WgpuBackend::from_device(device, queue).unwrap();
    assert_eq!(co.has_coalesced_adds(), own.has_coalesced_adds());
    println!(
        "coalesced adds on this adapter: {}",
        own.has_coalesced_adds()
    );
    assert_same("coalesced adds", &plain, &run_plain(&co, &x, &opts));
}

#[test]
fn views_at_unaligned_offsets_read_and_write_in_place() {
    let Some(own) = own() else { return };
    let (device, queue, errors) = test_device(own);
    let borrowed = WgpuBackend::from_device(device, queue).unwrap();
    let align = borrowed
        .device()
        .limits()
        .min_storage_buffer_offset_alignment;
    eprintln!("min_storage_buffer_offset_alignment = {align}");
    for dtype in [DType::F32, DType::BF16] {
        for reduction in [Reduction::Mean, Reduction::None] {
            let (x, opts) = (data(dtype), options(reduction));
            let what = format!("views, {dtype} {reduction:?}");
            assert_same(
                &what,
                &run_plain(own, &x, &opts),
                &run_views(&borrowed, &x, &opts),
            );
        }
    }
    assert_eq!(errors.load(Ordering::SeqCst), 0);
}

/// `e` and `c` as views that end at the end of buffers whose sizes are not multiples of 16
/// bytes: the shaders bind them in 16-byte units, so the backend reads them through copies,
/// with the results of tensors it allocated.
#[test]
fn views_ending_off_a_16_byte_boundary_give_the_same_results() {
    let Some(b) = own() else { return };
    for dtype in [DType::F32, DType::BF16] {
        let x = data(dtype);
        let opts = options(Reduction::Mean);
        let tail_view = |t: &HostTensor, off: u64| -> WgpuTensor {
            let bytes = t.as_bytes();
            let size = off + bytes.len() as u64;
            assert!(!size.is_multiple_of(16) && size.is_multiple_of(4));
            let buf = b.device().create_buffer(&wgpu::BufferDescriptor {
                label: Some("tail"),
                size,
                usage: wgpu::BufferUsages::STORAGE
                    | wgpu::BufferUsages::COPY_SRC
                    | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            b.queue().write_buffer(&buf, off, bytes);
            b.view(&buf, off, t.dtype(), t.shape().to_vec()).unwrap()
        };
        let (e, c) = (tail_view(&x.e, 4), tail_view(&x.c, 8));
        let up = |t: &HostTensor| b.upload(t).unwrap();
        let (bias, y) = (up(&x.bias), up(&x.y));
        let inputs = Inputs {
            e: &e,
            c: &c,
            bias: Some(&bias),
            targets: &y,
        };
        let (fwd, bwd) = b
            .forward_backward(&inputs, &opts, &Upstream::default())
            .unwrap();
        let down = |t: &WgpuTensor| b.download(t).unwrap().as_bytes().to_vec();
        let mut outs = vec![down(&fwd.loss), down(&fwd.lse), down(&fwd.rest_mass)];
        outs.extend([bwd.d_e, bwd.d_c, bwd.d_bias].map(|t| down(&t.unwrap())));
        let plain = {
            let (e, c) = (up(&x.e), up(&x.c));
            let inputs = Inputs {
                e: &e,
                c: &c,
                bias: Some(&bias),
                targets: &y,
            };
            let (fwd, bwd) = b
                .forward_backward(&inputs, &opts, &Upstream::default())
                .unwrap();
            let mut o = vec![down(&fwd.loss), down(&fwd.lse), down(&fwd.rest_mass)];
            o.extend([bwd.d_e, bwd.d_c, bwd.d_bias].map(|t| down(&t.unwrap())));
            o
        };
        assert_same(&format!("tail views, {dtype}"), &plain, &outs);
    }
}

#[test]
fn bad_views_and_destinations_are_typed_errors() {
    let Some(b) = own() else { return };
    let usage =
        wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST;
    let buffer = |size: u64, usage| {
        b.device().create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size,
            usage,
            mapped_at_creation: false,
        })
    };
    let buf = buffer(1024, usage);
    let err = b.view(&buf, 2, DType::BF16, vec![8]).unwrap_err();
    assert!(matches!(err, CceError::InvalidOption { .. }), "{err}");
    let err = b.view(&buf, 1000, DType::F32, vec![8]).unwrap_err();
    assert!(matches!(err, CceError::ShapeMismatch { .. }), "{err}");
    let err = b
        .view(
            &buffer(64, wgpu::BufferUsages::STORAGE),
            0,
            DType::F32,
            vec![4],
        )
        .unwrap_err();
    assert!(matches!(err, CceError::InvalidOption { .. }), "{err}");
    // An odd f16 count still needs its last word: 3 elements at 1020 need bytes up to 1028.
    assert!(b.view(&buf, 1020, DType::F16, vec![3]).is_err());
    assert!(b.view(&buf, 1016, DType::F16, vec![3]).is_ok());

    let x = data(DType::F32);
    let up = |t: &HostTensor| b.upload(t).unwrap();
    let (e, c, y) = (up(&x.e), up(&x.c), up(&x.y));
    let inputs = Inputs {
        e: &e,
        c: &c,
        bias: None,
        targets: &y,
    };
    let opts = Options::exact();
    let n = x.e.shape()[0];
    let wrong_dtype = ForwardDest {
        lse: Some(b.view(&buf, 4, DType::I32, vec![n]).unwrap()),
        ..Default::default()
    };
    let err = b.forward_into(&inputs, &opts, &wrong_dtype).unwrap_err();
    assert!(matches!(err, CceError::DTypeMismatch { .. }), "{err}");
    let wrong_size = ForwardDest {
        rest_mass: Some(b.view(&buf, 4, DType::F32, vec![n - 1]).unwrap()),
        ..Default::default()
    };
    let err = b.forward_into(&inputs, &opts, &wrong_size).unwrap_err();
    assert!(matches!(err, CceError::ShapeMismatch { .. }), "{err}");
    let (device, queue, _) = test_device(b);
    let other = WgpuBackend::from_device(device, queue).unwrap();
    let foreign = ForwardDest {
        loss: Some(
            other
                .upload(&HostTensor::from_f32(vec![1], &[0.0], DType::F32).unwrap())
                .unwrap(),
        ),
        ..Default::default()
    };
    let err = b.forward_into(&inputs, &opts, &foreign).unwrap_err();
    assert!(matches!(err, CceError::ForeignBuffer { .. }), "{err}");
}
