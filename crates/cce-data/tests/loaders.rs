//! Loader and writer tests: every error class, on small files written into a temp dir.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use cce_data::{
    load_npy, load_safetensors, load_safetensors_split, save_dataset, save_safetensors, DataError,
    Dataset, F32Tensor, NpyPaths, TensorNames,
};
use npyz::WriterBuilder;
use safetensors::tensor::TensorView;
use safetensors::Dtype;

/// A tensor to write: name, dtype, shape, little-endian bytes.
type T = (&'static str, Dtype, Vec<usize>, Vec<u8>);

fn f32s(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}
fn bf16s(x: &[f32]) -> Vec<u8> {
    x.iter()
        .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
        .collect()
}
fn f16s(x: &[f32]) -> Vec<u8> {
    x.iter()
        .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
        .collect()
}
fn i32s(x: &[i32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}
fn i64s(x: &[i64]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn write_st(dir: &Path, file: &str, tensors: &[T]) -> PathBuf {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, dt, s, b)| {
            (
                n.to_string(),
                TensorView::new(*dt, s.clone(), b).expect("valid view"),
            )
        })
        .collect();
    let bytes = safetensors::serialize(views, None).expect("serialize");
    let p = dir.join(file);
    std::fs::write(&p, bytes).expect("write");
    p
}

// A valid small problem: N = 3, D = 4, V = 5.
fn e_vals() -> Vec<f32> {
    (0..12).map(|i| (i as f32 - 5.0) * 0.25).collect()
}
fn c_vals() -> Vec<f32> {
    (0..20).map(|i| (i as f32) * 0.125 - 1.0).collect()
}
fn good() -> Vec<T> {
    vec![
        ("E", Dtype::F32, vec![3, 4], f32s(&e_vals())),
        ("C", Dtype::F32, vec![5, 4], f32s(&c_vals())),
        ("targets", Dtype::I64, vec![3], i64s(&[0, 4, -100])),
    ]
}
fn with(mut base: Vec<T>, t: T) -> Vec<T> {
    base.retain(|x| x.0 != t.0);
    base.push(t);
    base
}
fn without(mut base: Vec<T>, name: &str) -> Vec<T> {
    base.retain(|x| x.0 != name);
    base
}
fn load(dir: &Path, tensors: &[T]) -> Result<Dataset, DataError> {
    let p = write_st(dir, "t.safetensors", tensors);
    load_safetensors(&p, &TensorNames::default())
}

#[test]
fn safetensors_valid_encodings() {
    let dir = tempfile::tempdir().unwrap();
    let ds = load(dir.path(), &good()).unwrap();
    assert_eq!((ds.n, ds.d, ds.v), (3, 4, 5));
    assert_eq!(ds.e, e_vals());
    assert_eq!(ds.c, c_vals());
    assert_eq!(ds.targets, vec![0, 4, -100]);
    assert!(ds.bias.is_none() && ds.lse_ref.is_none());

    // bf16 E, f16 C, i32 targets, bias, refs; E given as [1, 3, 4] (flattened).
    let e = e_vals();
    let t = vec![
        ("E", Dtype::BF16, vec![1, 3, 4], bf16s(&e)),
        ("C", Dtype::F16, vec![5, 4], f16s(&c_vals())),
        ("targets", Dtype::I32, vec![1, 3], i32s(&[1, 2, 3])),
        (
            "bias",
            Dtype::BF16,
            vec![5],
            bf16s(&[0.5, -0.5, 1.0, 2.0, -3.0]),
        ),
        ("lse_ref", Dtype::F32, vec![3], f32s(&[1.0, 2.0, 3.0])),
        ("nll_ref", Dtype::F32, vec![3], f32s(&[0.1, 0.2, 0.3])),
    ];
    let ds = load(dir.path(), &t).unwrap();
    assert_eq!((ds.n, ds.d, ds.v), (3, 4, 5));
    assert_eq!(ds.e, e); // these values are exact in bf16
    assert_eq!(ds.c, c_vals());
    assert_eq!(ds.targets, vec![1, 2, 3]);
    assert_eq!(ds.bias.as_deref(), Some(&[0.5, -0.5, 1.0, 2.0, -3.0][..]));
    assert_eq!(ds.lse_ref.as_deref(), Some(&[1.0, 2.0, 3.0][..]));
    assert_eq!(ds.nll_ref.as_deref(), Some(&[0.1, 0.2, 0.3][..]));
    assert!(ds.name.contains("BF16"), "{}", ds.name);
}

#[test]
fn safetensors_q8_decode() {
    // V = 2, D = 40: two blocks per row, the second partial.
    let (v, d) = (2usize, 40usize);
    let codes: Vec<i8> = (0..v * d)
        .map(|i| ((i as i32 * 37) % 255 - 127) as i8)
        .collect();
    let scales = [0.5f32, 0.0078125, 2.0, 0.25];
    let t = vec![
        ("E", Dtype::F32, vec![1, d], f32s(&vec![1.0; d])),
        (
            "C_q8",
            Dtype::I8,
            vec![v, d],
            codes.iter().map(|&c| c as u8).collect(),
        ),
        ("C_scale", Dtype::F16, vec![v, 2], f16s(&scales)),
        ("targets", Dtype::I32, vec![1], i32s(&[1])),
    ];
    let dir = tempfile::tempdir().unwrap();
    let ds = load(dir.path(), &t).unwrap();
    for j in 0..v {
        for k in 0..d {
            assert_eq!(
                ds.c[j * d + k],
                scales[j * 2 + k / 32] * codes[j * d + k] as f32
            );
        }
    }
    assert!(ds.name.contains("Q8_0"));
}

#[test]
fn safetensors_custom_names_and_split() {
    let dir = tempfile::tempdir().unwrap();
    let names = TensorNames {
        e: "hidden".into(),
        c: "head".into(),
        targets: "labels".into(),
        bias: String::new(),
        ..TensorNames::default()
    };
    let data = write_st(
        dir.path(),
        "data.safetensors",
        &[
            ("hidden", Dtype::F32, vec![3, 4], f32s(&e_vals())),
            ("labels", Dtype::I64, vec![3], i64s(&[1, 1, 1])),
            // Ignored: the bias name is empty.
            ("bias", Dtype::F64, vec![1], vec![0; 8]),
        ],
    );
    let head = write_st(
        dir.path(),
        "head.safetensors",
        &[("head", Dtype::F32, vec![5, 4], f32s(&c_vals()))],
    );
    let ds = load_safetensors_split(&data, &head, &names).unwrap();
    assert_eq!((ds.n, ds.d, ds.v), (3, 4, 5));
    assert_eq!(ds.c, c_vals());
    // The head is not in the data file.
    assert!(matches!(
        load_safetensors(&data, &names),
        Err(DataError::MissingTensor { ref name, .. }) if name.starts_with("head")
    ));
}

#[test]
fn safetensors_missing_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for (tensors, want) in [
        (without(good(), "E"), "E"),
        (without(good(), "targets"), "targets"),
        (without(good(), "C"), "C (or C_q8 with C_scale)"),
        (
            with(
                without(good(), "C"),
                ("C_q8", Dtype::I8, vec![5, 4], vec![1; 20]),
            ),
            "C_scale",
        ),
    ] {
        match load(d, &tensors) {
            Err(DataError::MissingTensor { name, .. }) => assert_eq!(name, want),
            other => panic!("expected MissingTensor({want}), got {other:?}"),
        }
    }
}

#[test]
fn safetensors_wrong_dtype() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let q8 = |codes: Dtype, scale: Dtype| {
        let mut t = without(good(), "C");
        t.push((
            "C_q8",
            codes,
            vec![5, 4],
            vec![1; 20 * (codes.bitsize() / 8)],
        ));
        t.push((
            "C_scale",
            scale,
            vec![5, 1],
            vec![0; 5 * (scale.bitsize() / 8)],
        ));
        t
    };
    for (tensors, want) in [
        (
            with(good(), ("E", Dtype::I32, vec![3, 4], vec![0; 48])),
            "E",
        ),
        (
            with(good(), ("E", Dtype::F64, vec![3, 4], vec![0; 96])),
            "E",
        ),
        (with(good(), ("C", Dtype::I8, vec![5, 4], vec![0; 20])), "C"),
        (
            with(good(), ("targets", Dtype::F32, vec![3], vec![0; 12])),
            "targets",
        ),
        (
            with(good(), ("targets", Dtype::U8, vec![3], vec![0; 3])),
            "targets",
        ),
        (
            with(good(), ("bias", Dtype::I64, vec![5], vec![0; 40])),
            "bias",
        ),
        (
            with(good(), ("lse_ref", Dtype::I32, vec![3], vec![0; 12])),
            "lse_ref",
        ),
        (q8(Dtype::U8, Dtype::F16), "C_q8"),
        (q8(Dtype::I8, Dtype::I16), "C_scale"),
    ] {
        match load(d, &tensors) {
            Err(DataError::WrongDtype { name, .. }) => assert_eq!(name, want),
            other => panic!("expected WrongDtype({want}), got {other:?}"),
        }
    }
}

#[test]
fn safetensors_wrong_shape() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut q8 = without(good(), "C");
    q8.push(("C_q8", Dtype::I8, vec![5, 4], vec![1; 20]));
    q8.push(("C_scale", Dtype::F16, vec![5], vec![0; 10]));
    for (tensors, want) in [
        (
            with(good(), ("E", Dtype::F32, vec![12], f32s(&e_vals()))),
            "E",
        ),
        (with(good(), ("E", Dtype::F32, vec![3, 0], vec![])), "E"),
        (
            with(good(), ("C", Dtype::F32, vec![5, 2, 2], f32s(&c_vals()))),
            "C",
        ),
        (with(good(), ("C", Dtype::F32, vec![0, 4], vec![])), "C"),
        (
            with(good(), ("bias", Dtype::F32, vec![5, 1], f32s(&[0.0; 5]))),
            "bias",
        ),
        (q8, "C_scale"),
    ] {
        match load(d, &tensors) {
            Err(DataError::WrongShape { name, .. }) => assert_eq!(name, want),
            other => panic!("expected WrongShape({want}), got {other:?}"),
        }
    }
}

#[test]
fn safetensors_size_mismatch() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mut q8 = without(good(), "C");
    q8.push(("C_q8", Dtype::I8, vec![5, 4], vec![1; 20]));
    q8.push(("C_scale", Dtype::F16, vec![5, 2], vec![0; 20]));
    for tensors in [
        with(good(), ("C", Dtype::F32, vec![4, 5], f32s(&c_vals()))),
        with(good(), ("targets", Dtype::I64, vec![4], i64s(&[0; 4]))),
        with(good(), ("bias", Dtype::F32, vec![4], f32s(&[0.0; 4]))),
        with(good(), ("lse_ref", Dtype::F32, vec![2], f32s(&[0.0; 2]))),
        with(good(), ("nll_ref", Dtype::F32, vec![5], f32s(&[0.0; 5]))),
        q8,
    ] {
        assert!(
            matches!(load(d, &tensors), Err(DataError::SizeMismatch { .. })),
            "{:?}",
            load(d, &tensors)
        );
    }
}

#[test]
fn safetensors_corrupt_and_io() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let p = write_st(d, "ok.safetensors", &good());
    let bytes = std::fs::read(&p).unwrap();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("empty", vec![]),
        ("short", vec![1, 2, 3]),
        ("truncated data", bytes[..bytes.len() - 7].to_vec()),
        ("truncated header", bytes[..20].to_vec()),
        ("header too long", {
            let mut b = bytes.clone();
            b[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
            b
        }),
        ("garbage header", {
            let mut b = bytes.clone();
            for x in &mut b[8..30] {
                *x = b'#';
            }
            b
        }),
    ];
    for (what, b) in cases {
        let q = d.join(format!("{}.safetensors", what.replace(' ', "_")));
        std::fs::write(&q, b).unwrap();
        match load_safetensors(&q, &TensorNames::default()) {
            Err(DataError::Corrupt { format, .. }) => assert_eq!(format, "safetensors"),
            other => panic!("{what}: expected Corrupt, got {other:?}"),
        }
    }
    match load_safetensors(d.join("absent.safetensors"), &TensorNames::default()) {
        Err(DataError::Io { source, .. }) => {
            assert_eq!(source.kind(), std::io::ErrorKind::NotFound)
        }
        other => panic!("expected Io, got {other:?}"),
    }
    // A directory is not a file either.
    assert!(matches!(
        load_safetensors(d, &TensorNames::default()),
        Err(DataError::Io { .. })
    ));
}

#[test]
fn save_roundtrip_and_errors() {
    #[cfg(unix)]
    use std::os::unix::fs::FileTypeExt;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let de = [1.5f32, -2.0, 3.25, 0.0, 1e-30, -7.0];
    let db = [0.5f32, 0.25];
    let p = d.join("grads.safetensors");
    let meta = HashMap::from([("what".to_string(), "test".to_string())]);
    save_safetensors(
        &p,
        &[
            F32Tensor {
                name: "d_e",
                shape: &[2, 3],
                data: &de,
            },
            F32Tensor {
                name: "d_bias",
                shape: &[2],
                data: &db,
            },
        ],
        Some(meta),
    )
    .unwrap();
    let bytes = std::fs::read(&p).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor("d_e").unwrap();
    assert_eq!((t.dtype(), t.shape()), (Dtype::F32, &[2usize, 3][..]));
    assert_eq!(t.data(), &f32s(&de)[..]);
    assert_eq!(st.tensor("d_bias").unwrap().data(), &f32s(&db)[..]);
    assert!(!d.join("grads.safetensors.partial").exists());

    assert!(matches!(
        save_safetensors(
            &p,
            &[F32Tensor {
                name: "x",
                shape: &[4],
                data: &de
            }],
            None
        ),
        Err(DataError::SizeMismatch { .. })
    ));
    assert!(matches!(
        save_safetensors(
            &p,
            &[
                F32Tensor {
                    name: "x",
                    shape: &[6],
                    data: &de
                },
                F32Tensor {
                    name: "x",
                    shape: &[2],
                    data: &db
                }
            ],
            None
        ),
        Err(DataError::InvalidParameter(_))
    ));
    assert!(matches!(
        save_safetensors(d.join("no/such/dir/g.safetensors"), &[], None),
        Err(DataError::Io { .. })
    ));
    // A symbolic link keeps pointing at the file, which gets the new contents; a path that is
    // not a regular file (a directory, a device) is refused, not replaced.
    let one = [F32Tensor {
        name: "d_bias",
        shape: &[2],
        data: &db,
    }];
    #[cfg(unix)]
    {
        let link = d.join("link.safetensors");
        std::os::unix::fs::symlink(&p, &link).unwrap();
        save_safetensors(&link, &one, None).unwrap();
        assert!(std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        let st_bytes = std::fs::read(&p).unwrap();
        let st = safetensors::SafeTensors::deserialize(&st_bytes).unwrap();
        assert!(st.tensor("d_e").is_err() && st.tensor("d_bias").is_ok());
        let null = std::path::Path::new("/dev/null");
        if null.exists() {
            assert!(matches!(
                save_safetensors(null, &one, None),
                Err(DataError::InvalidParameter(_))
            ));
            assert!(null.metadata().unwrap().file_type().is_char_device());
        }
    }
    let sub = d.join("a_directory");
    std::fs::create_dir(&sub).unwrap();
    assert!(matches!(
        save_safetensors(&sub, &one, None),
        Err(DataError::InvalidParameter(_))
    ));
    assert!(sub.is_dir());

    // A whole dataset round-trips bit-exactly.
    let ds = Dataset {
        name: "tiny".into(),
        n: 3,
        d: 4,
        v: 5,
        e: e_vals(),
        c: c_vals(),
        bias: Some(vec![0.1, 0.2, 0.3, 0.4, f32::MIN_POSITIVE]),
        targets: vec![4, -100, 0],
        lse_ref: Some(vec![1.0, 2.0, 3.0]),
        nll_ref: None,
        seq_len: None,
    };
    let q = d.join("ds.safetensors");
    save_dataset(&q, &ds).unwrap();
    let back = load_safetensors(&q, &TensorNames::default()).unwrap();
    assert_eq!(
        (
            back.n,
            back.d,
            back.v,
            &back.e,
            &back.c,
            &back.bias,
            &back.targets,
            &back.lse_ref,
            &back.nll_ref
        ),
        (
            ds.n,
            ds.d,
            ds.v,
            &ds.e,
            &ds.c,
            &ds.bias,
            &ds.targets,
            &ds.lse_ref,
            &ds.nll_ref
        )
    );
    let mut bad = ds.clone();
    bad.targets.pop();
    assert!(matches!(
        save_dataset(&q, &bad),
        Err(DataError::SizeMismatch { .. })
    ));
}

// ---- NumPy ----

/// The same `.npy` with its shape `(5, 4, )` rewritten to `(99999, 99999, )` (10^10 elements)
/// and the header length kept, so that only the data is short.
fn huge_header(bytes: &[u8]) -> Vec<u8> {
    let pos = bytes
        .windows(8)
        .position(|w| w == b"(5, 4, )")
        .unwrap_or_else(|| {
            panic!(
                "shape in header: {}",
                String::from_utf8_lossy(&bytes[..bytes.len().min(128)])
            )
        });
    let nl = pos
        + bytes[pos..]
            .iter()
            .position(|&c| c == b'\n')
            .expect("header end");
    let mut b = bytes[..pos].to_vec();
    b.extend_from_slice(b"(99999, 99999, )");
    let mut tail = bytes[pos + 8..nl].to_vec();
    let grown = 16 - 8;
    assert!(tail.ends_with(&[b' '; 8]), "header padding");
    tail.truncate(tail.len() - grown);
    b.extend_from_slice(&tail);
    b.extend_from_slice(&bytes[nl..]);
    assert_eq!(b.len(), bytes.len());
    b
}

fn npy<T: npyz::AutoSerialize + Clone>(
    dir: &Path,
    file: &str,
    shape: &[u64],
    data: &[T],
    fortran: bool,
) -> PathBuf {
    let p = dir.join(file);
    let f = std::fs::File::create(&p).unwrap();
    let order = if fortran {
        npyz::Order::Fortran
    } else {
        npyz::Order::C
    };
    let mut w = npyz::WriteOptions::new()
        .default_dtype()
        .shape(shape)
        .order(order)
        .writer(std::io::BufWriter::new(f))
        .begin_nd()
        .unwrap();
    w.extend(data.iter().cloned()).unwrap();
    w.finish().unwrap();
    p
}

fn npy_good(d: &Path) -> NpyPaths {
    NpyPaths {
        e: npy(d, "e.npy", &[3, 4], &e_vals(), false),
        c: npy(d, "c.npy", &[5, 4], &c_vals(), false),
        targets: npy(d, "t.npy", &[3], &[0i64, 1, 4], false),
        bias: Some(npy(d, "b.npy", &[5], &[1.0f32, 2.0, 3.0, 4.0, 5.0], false)),
    }
}

#[test]
fn npy_valid() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let ds = load_npy(&npy_good(d)).unwrap();
    assert_eq!((ds.n, ds.d, ds.v), (3, 4, 5));
    assert_eq!((ds.e.clone(), ds.c.clone()), (e_vals(), c_vals()));
    assert_eq!(ds.targets, vec![0, 1, 4]);
    assert_eq!(ds.bias.as_deref(), Some(&[1.0, 2.0, 3.0, 4.0, 5.0][..]));

    // f16 e, Fortran-order c, i32 targets of shape [1, 3], no bias.
    let c = c_vals();
    let mut cf = vec![0f32; 20];
    for j in 0..5 {
        for k in 0..4 {
            cf[j + 5 * k] = c[j * 4 + k];
        }
    }
    let e16: Vec<half::f16> = e_vals().iter().map(|&x| half::f16::from_f32(x)).collect();
    let paths = NpyPaths {
        e: npy(d, "e16.npy", &[3, 4], &e16, false),
        c: npy(d, "cf.npy", &[5, 4], &cf, true),
        targets: npy(d, "t32.npy", &[1, 3], &[2i32, 2, 2], false),
        bias: None,
    };
    let ds = load_npy(&paths).unwrap();
    assert_eq!((ds.e.clone(), ds.c.clone()), (e_vals(), c_vals()));
    assert_eq!(ds.targets, vec![2, 2, 2]);
    assert!(ds.bias.is_none());
}

#[test]
fn npy_errors() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let g = npy_good(d);

    // Io: missing file.
    let p = NpyPaths {
        c: d.join("absent.npy"),
        ..g.clone()
    };
    assert!(matches!(load_npy(&p), Err(DataError::Io { .. })));

    // Corrupt: bad magic, truncated data, truncated header.
    let bytes = std::fs::read(&g.c).unwrap();
    for (name, b) in [
        ("garbage.npy", b"not a numpy file at all".to_vec()),
        ("trunc.npy", bytes[..bytes.len() - 5].to_vec()),
        ("trunch.npy", bytes[..12].to_vec()),
        ("huge.npy", huge_header(&bytes)),
    ] {
        std::fs::write(d.join(name), b).unwrap();
        let p = NpyPaths {
            c: d.join(name),
            ..g.clone()
        };
        match load_npy(&p) {
            Err(DataError::Corrupt { format, reason, .. }) => {
                assert_eq!(format, "npy");
                if name == "huge.npy" {
                    assert!(reason.contains("needs"), "{reason}");
                }
            }
            other => panic!("{name}: expected Corrupt, got {other:?}"),
        }
    }

    // WrongDtype.
    let e64 = NpyPaths {
        e: npy(d, "e64.npy", &[3, 4], &[0f64; 12], false),
        ..g.clone()
    };
    let ei = NpyPaths {
        e: npy(d, "ei.npy", &[3, 4], &[0i32; 12], false),
        ..g.clone()
    };
    let tf = NpyPaths {
        targets: npy(d, "tf.npy", &[3], &[0f32; 3], false),
        ..g.clone()
    };
    let tu = NpyPaths {
        targets: npy(d, "tu.npy", &[3], &[0u8; 3], false),
        ..g.clone()
    };
    for (p, want) in [(e64, "e"), (ei, "e"), (tf, "targets"), (tu, "targets")] {
        match load_npy(&p) {
            Err(DataError::WrongDtype { name, .. }) => assert_eq!(name, want),
            other => panic!("expected WrongDtype({want}), got {other:?}"),
        }
    }

    // WrongShape.
    let e1 = NpyPaths {
        e: npy(d, "e1.npy", &[12], &e_vals(), false),
        ..g.clone()
    };
    let c3 = NpyPaths {
        c: npy(d, "c3.npy", &[5, 2, 2], &c_vals(), false),
        ..g.clone()
    };
    let b2 = NpyPaths {
        bias: Some(npy(d, "b2.npy", &[5, 1], &[0f32; 5], false)),
        ..g.clone()
    };
    for (p, want) in [(e1, "e"), (c3, "c"), (b2, "bias")] {
        match load_npy(&p) {
            Err(DataError::WrongShape { name, .. }) => assert_eq!(name, want),
            other => panic!("expected WrongShape({want}), got {other:?}"),
        }
    }

    // SizeMismatch.
    let cd = NpyPaths {
        c: npy(d, "cd.npy", &[4, 5], &c_vals(), false),
        ..g.clone()
    };
    let tn = NpyPaths {
        targets: npy(d, "tn.npy", &[4], &[0i64; 4], false),
        ..g.clone()
    };
    let bv = NpyPaths {
        bias: Some(npy(d, "bv.npy", &[4], &[0f32; 4], false)),
        ..g.clone()
    };
    for p in [cd, tn, bv] {
        assert!(
            matches!(load_npy(&p), Err(DataError::SizeMismatch { .. })),
            "{:?}",
            load_npy(&p)
        );
    }
}

/// The same tensors and metadata give the same bytes, whatever order the metadata map
/// iterates in (each `HashMap` has its own random hasher), and the file reads back.
#[test]
fn saved_bytes_do_not_depend_on_the_metadata_map_order() {
    let dir = tempfile::tempdir().unwrap();
    let de = [1.5f32, -2.0, 3.25, 0.0, 1e-30, -7.0];
    let dc = [0.5f32, 0.25, -1.0];
    let tensors = [
        F32Tensor {
            name: "d_e",
            shape: &[2, 3],
            data: &de,
        },
        F32Tensor {
            name: "d_c",
            shape: &[3],
            data: &dc,
        },
    ];
    let entries: Vec<(String, String)> = (0..16)
        .map(|k| (format!("key{k}"), format!("value \"{k}\"")))
        .collect();
    let mut files = Vec::new();
    for run in 0..4 {
        let meta: HashMap<String, String> = if run % 2 == 0 {
            entries.iter().cloned().collect()
        } else {
            entries.iter().rev().cloned().collect()
        };
        let p = dir.path().join(format!("g{run}.safetensors"));
        save_safetensors(&p, &tensors, Some(meta)).unwrap();
        files.push(std::fs::read(&p).unwrap());
    }
    for f in &files[1..] {
        assert!(f == &files[0], "files differ byte for byte");
    }
    let st = safetensors::SafeTensors::deserialize(&files[0]).unwrap();
    assert_eq!(st.tensor("d_e").unwrap().data(), &f32s(&de)[..]);
    assert_eq!(st.tensor("d_c").unwrap().data(), &f32s(&dc)[..]);
    let (_, m) = safetensors::SafeTensors::read_metadata(&files[0]).unwrap();
    let meta = m.metadata().as_ref().unwrap();
    assert_eq!(meta.len(), 16);
    assert_eq!(meta["key3"], "value \"3\"");
    // The data starts at a multiple of 8 bytes.
    let header_len = u64::from_le_bytes(files[0][..8].try_into().unwrap()) as usize;
    assert_eq!((8 + header_len) % 8, 0);
}
