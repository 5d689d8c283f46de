//! The SGEMM kernels on a wgpu device: adapter, pipelines (trusted or checked modules, as
//! cce-wgpu builds them), launches, read-back and GPU-timestamp timing.

use super::{wgsl, Dtype, Kernel, Variant};
use wgpu::util::DeviceExt;

/// cce-wgpu's `FLAG_VEC_E | FLAG_VEC_C` (tile_io.wgsl): whole-vec4 loads of e and c.
const FLAG_VEC: u32 = 1024 | 2048;

/// One wgpu device opened for the benchmark.
pub struct Gpu {
    /// The device.
    pub device: wgpu::Device,
    /// Its queue.
    pub queue: wgpu::Queue,
    /// The adapter's description.
    pub info: wgpu::AdapterInfo,
    /// Whether compute passes can write timestamps (`TIMESTAMP_QUERY`).
    pub timestamps: bool,
    /// Whether shaders may add f32 atomically (`SHADER_FLOAT32_ATOMIC`: the backward's
    /// atomic modules, `bwd::BwdKind::Atomic`).
    pub float_atomics: bool,
    /// Whether shaders may use subgroup operations (`SUBGROUP`: the backward's coalesced
    /// atomic modules, `bwd::BwdKind::AtomicCo`).
    pub subgroups: bool,
    /// The limits the device was opened with (the adapter's own).
    pub limits: wgpu::Limits,
}

/// A compiled variant.
pub struct Built {
    /// The variant.
    pub variant: Variant,
    pipeline: wgpu::ComputePipeline,
    /// Seconds the module and pipeline took to build (driver compilation included).
    pub build_s: f64,
}

/// One product ready to dispatch: `C = A·Bᵀ` of `m x n x k` on bound buffers.
pub struct Launch {
    pipeline: wgpu::ComputePipeline,
    bind: wgpu::BindGroup,
    groups: (u32, u32),
    /// FLOP of one dispatch: `2·m·n·k`.
    pub flop: f64,
}

impl Gpu {
    /// Open the adapter cce-wgpu would pick, with its own limits, and `TIMESTAMP_QUERY`,
    /// `SHADER_FLOAT32_ATOMIC` and `SUBGROUP` where offered (cce-wgpu asks for the last two
    /// too). Errors: no adapter, or the device request failed
    /// (as text).
    pub fn open() -> Result<Self, String> {
        let instance =
            wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
        let adapters = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::all()));
        let adapter =
            cut_cross_entropy::cce_wgpu::pick_adapter(adapters).ok_or("no wgpu adapter")?;
        let info = adapter.get_info();
        let features = adapter.features()
            & (wgpu::Features::TIMESTAMP_QUERY
                | wgpu::Features::SHADER_FLOAT32_ATOMIC
                | wgpu::Features::SUBGROUP);
        let limits = adapter.limits();
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("cce-bench-sgemm"),
            required_features: features,
            required_limits: limits.clone(),
            experimental_features: wgpu::ExperimentalFeatures::disabled(),
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        }))
        .map_err(|e| format!("request_device on {}: {e}", info.name))?;
        Ok(Self {
            device,
            queue,
            info,
            timestamps: features.contains(wgpu::Features::TIMESTAMP_QUERY),
            float_atomics: features.contains(wgpu::Features::SHADER_FLOAT32_ATOMIC),
            subgroups: features.contains(wgpu::Features::SUBGROUP),
            limits,
        })
    }

    /// Run `f` inside validation and out-of-memory error scopes; their errors as text.
    fn scoped<T>(&self, what: &str, f: impl FnOnce() -> T) -> Result<T, String> {
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let val = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let out = f();
        let v = pollster::block_on(val.pop());
        let o = pollster::block_on(oom.pop());
        match v.or(o) {
            Some(e) => Err(format!("{what}: {e}")),
            None => Ok(out),
        }
    }

    /// A storage buffer holding `bytes` (a multiple of 4).
    pub fn upload(&self, label: &str, bytes: &[u8]) -> Result<wgpu::Buffer, String> {
        self.scoped(label, || {
            self.device
                .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some(label),
                    contents: bytes,
                    usage: wgpu::BufferUsages::STORAGE,
                })
        })
    }

    /// An output buffer of `elems` f32 (rounded up to 16 bytes), copyable for read-back.
    pub fn output(&self, elems: usize) -> Result<wgpu::Buffer, String> {
        let size = ((4 * elems as u64).div_ceil(16).max(1)) * 16;
        self.scoped("output", || {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("c"),
                size,
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            })
        })
    }

    /// Compile `variant`: its WGSL as a module with or without wgpu's runtime checks (as
    /// cce-wgpu's `pipelines::runtime_checks`), then the compute pipeline.
    /// Errors: a kernel that does not fit the device (workgroup memory, threads), or a
    /// validation error.
    pub fn build(&self, variant: Variant) -> Result<Built, String> {
        let start = std::time::Instant::now();
        let (source, constants) = match variant.kernel {
            Kernel::Tiled(t) => {
                if t.workgroup_bytes() > u64::from(self.limits.max_compute_workgroup_storage_size)
                    || t.threads() > self.limits.max_compute_invocations_per_workgroup
                {
                    return Err(format!(
                        "{}: {} B of workgroup memory, {} threads: over the device's limits",
                        variant.name(),
                        t.workgroup_bytes(),
                        t.threads()
                    ));
                }
                (wgsl::tiled(&t, variant.dtype), Vec::new())
            }
            Kernel::Ours(ml) => (wgsl::ours(ml), wgsl::ours_constants(ml, variant.dtype)),
        };
        let name = variant.name();
        let entry = wgsl::entry_point(matches!(variant.kernel, Kernel::Ours(_)));
        // SAFETY (of the trusted module `pipeline` builds): the tiled kernel indexes its
        // workgroup arrays with constants and thread ids below their sizes, and reads and
        // writes only rows and columns of whole tiles, which `launch` dispatches only for
        // shapes `Tiled::problem_error` accepts, on buffers of exactly those sizes; its loops
        // run to `dims.k` in steps of BK >= 4, and it divides by constants only. The `ours`
        // kernels are cce-wgpu's forward source (its `bounds` module's argument: every access
        // guarded by `P.n_rows`, `P.n_cls` and `P.d`, bindings of m·k and n·k elements rounded
        // up to 16 bytes, as `launch` binds them) plus a store guarded by `P.n_rows` and
        // `P.n_cls` into an m x n output.
        let pipeline = self.pipeline(&name, source, entry, &constants, variant.checked)?;
        Ok(Built {
            variant,
            pipeline,
            build_s: start.elapsed().as_secs_f64(),
        })
    }

    /// A compute pipeline of entry point `entry` of the WGSL `source` with override
    /// `constants`, its module built with wgpu's runtime checks when `checked` (else trusted,
    /// as cce-wgpu builds its modules). The caller vouches for a trusted module: its accesses
    /// stay in bounds for the launches it makes, its loops end, it divides by no zero.
    /// Errors: validation (as text).
    pub fn pipeline(
        &self,
        name: &str,
        source: String,
        entry: &str,
        constants: &[(&str, f64)],
        checked: bool,
    ) -> Result<wgpu::ComputePipeline, String> {
        let checks = if checked {
            wgpu::ShaderRuntimeChecks::checked()
        } else {
            wgpu::ShaderRuntimeChecks::unchecked()
        };
        self.scoped(name, || {
            let desc = wgpu::ShaderModuleDescriptor {
                label: Some(name),
                source: wgpu::ShaderSource::Wgsl(source.into()),
            };
            // SAFETY: without runtime checks a shader must not index out of bounds, loop
            // forever or divide an integer by zero; every caller of `pipeline` states why its
            // source and launches keep to that (`build`; `fwd::FwdVariant::build`).
            let module = unsafe { self.device.create_shader_module_trusted(desc, checks) };
            self.device
                .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(name),
                    layout: None,
                    module: &module,
                    entry_point: Some(entry),
                    compilation_options: wgpu::PipelineCompilationOptions {
                        constants,
                        zero_initialize_workgroup_memory: false,
                    },
                    cache: None,
                })
        })
    }

    /// A zeroed read-write storage buffer of `size` bytes (a multiple of 4), copyable for
    /// read-back.
    pub fn storage(&self, label: &str, size: u64) -> Result<wgpu::Buffer, String> {
        self.scoped(label, || {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: size.div_ceil(16).max(1) * 16,
                usage: wgpu::BufferUsages::STORAGE
                    | wgpu::BufferUsages::COPY_SRC
                    | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        })
    }

    /// A uniform buffer holding `bytes`.
    pub fn uniform(&self, bytes: &[u8]) -> Result<wgpu::Buffer, String> {
        self.scoped("uniform", || {
            self.device
                .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some("params"),
                    contents: bytes,
                    usage: wgpu::BufferUsages::UNIFORM,
                })
        })
    }

    /// A launch of `pipeline` with bind group 0 made of `buffers` (binding, buffer) and a
    /// `groups.0 x groups.1` grid doing `flop` per dispatch. Errors: validation (as text).
    pub fn launch_with(
        &self,
        pipeline: &wgpu::ComputePipeline,
        buffers: &[(u32, &wgpu::Buffer)],
        groups: (u32, u32),
        flop: f64,
    ) -> Result<Launch, String> {
        self.scoped("launch", || {
            let entries: Vec<wgpu::BindGroupEntry<'_>> = buffers
                .iter()
                .map(|&(binding, b)| wgpu::BindGroupEntry {
                    binding,
                    resource: b.as_entire_binding(),
                })
                .collect();
            let bind = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some("launch"),
                layout: &pipeline.get_bind_group_layout(0),
                entries: &entries,
            });
            Launch {
                pipeline: pipeline.clone(),
                bind,
                groups,
                flop,
            }
        })
    }

    /// Dispatch `l` once and wait; then the first `bytes` of each of `srcs`.
    pub fn run_read(
        &self,
        l: &Launch,
        srcs: &[(&wgpu::Buffer, u64)],
    ) -> Result<Vec<Vec<u8>>, String> {
        self.scoped("run", || -> Result<Vec<Vec<u8>>, String> {
            let mut enc = self.device.create_command_encoder(&Default::default());
            self.dispatch(&mut enc, l, None);
            self.queue.submit([enc.finish()]);
            srcs.iter()
                .map(|&(b, bytes)| {
                    let enc = self.device.create_command_encoder(&Default::default());
                    self.submit_and_read(enc, b, bytes)
                })
                .collect()
        })?
    }

    /// Bind `a` (`m x k`), `b` (`n x k`) in the variant's dtype and `c` (`m x n` f32) for
    /// `built`. Errors: a shape the variant does not handle, buffers smaller than the shape.
    pub fn launch(
        &self,
        built: &Built,
        (a, b, c): (&wgpu::Buffer, &wgpu::Buffer, &wgpu::Buffer),
        (m, n, k): (u32, u32, u32),
    ) -> Result<Launch, String> {
        let v = built.variant;
        if let Some(e) = v.problem_error(m, n, k) {
            return Err(format!("{}: {e}", v.name()));
        }
        let bytes =
            |rows: u32| (u64::from(rows) * u64::from(k) * v.dtype.bytes()).div_ceil(16) * 16;
        if a.size() < bytes(m) || b.size() < bytes(n) || c.size() < 4 * u64::from(m) * u64::from(n)
        {
            return Err(format!("{}: buffers smaller than {m}x{n}x{k}", v.name()));
        }
        let (uniform, out_binding, groups): (Vec<u32>, u32, (u32, u32)) = match v.kernel {
            Kernel::Tiled(t) => (vec![m, n, k, 0], 3, (n / t.tile, m / t.tile)),
            Kernel::Ours(_) => {
                // cce-wgpu's `Params` (28 words): n_rows, n_cls, d, ..., flags at word 9.
                let mut p = vec![0u32; 28];
                (p[0], p[1], p[2], p[9]) = (m, n, k, FLAG_VEC);
                let t = v.tile();
                (p, wgsl::OURS_OUT_BINDING, (n.div_ceil(t), m.div_ceil(t)))
            }
        };
        self.scoped("launch", || {
            let ubuf = self
                .device
                .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some("dims"),
                    contents: bytemuck::cast_slice(&uniform),
                    usage: wgpu::BufferUsages::UNIFORM,
                });
            let bind = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some("sgemm"),
                layout: &built.pipeline.get_bind_group_layout(0),
                entries: &[
                    wgpu::BindGroupEntry {
                        binding: 0,
                        resource: ubuf.as_entire_binding(),
                    },
                    wgpu::BindGroupEntry {
                        binding: 1,
                        resource: a.as_entire_binding(),
                    },
                    wgpu::BindGroupEntry {
                        binding: 2,
                        resource: b.as_entire_binding(),
                    },
                    wgpu::BindGroupEntry {
                        binding: out_binding,
                        resource: c.as_entire_binding(),
                    },
                ],
            });
            Launch {
                pipeline: built.pipeline.clone(),
                bind,
                groups,
                flop: 2.0 * f64::from(m) * f64::from(n) * f64::from(k),
            }
        })
    }

    fn dispatch(
        &self,
        enc: &mut wgpu::CommandEncoder,
        l: &Launch,
        ts: Option<(&wgpu::QuerySet, u32)>,
    ) {
        let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some("sgemm"),
            timestamp_writes: ts.map(|(set, q)| wgpu::ComputePassTimestampWrites {
                query_set: set,
                beginning_of_pass_write_index: Some(q),
                end_of_pass_write_index: Some(q + 1),
            }),
        });
        pass.set_pipeline(&l.pipeline);
        pass.set_bind_group(0, &l.bind, &[]);
        pass.dispatch_workgroups(l.groups.0, l.groups.1, 1);
    }

    fn wait(&self) -> Result<(), String> {
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map(|_| ())
            .map_err(|e| format!("poll: {e}"))
    }

    /// Submit `enc` after copying `src` (`bytes` long) into a mapped buffer; its bytes.
    fn submit_and_read(
        &self,
        mut enc: wgpu::CommandEncoder,
        src: &wgpu::Buffer,
        bytes: u64,
    ) -> Result<Vec<u8>, String> {
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("read-back"),
            size: bytes,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        enc.copy_buffer_to_buffer(src, 0, &staging, 0, bytes);
        self.queue.submit([enc.finish()]);
        let (tx, rx) = std::sync::mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            let _ = tx.send(r);
        });
        self.wait()?;
        rx.recv()
            .map_err(|e| format!("map_async: {e}"))?
            .map_err(|e| format!("map_async: {e}"))?;
        let view = staging
            .get_mapped_range(..)
            .map_err(|e| format!("get_mapped_range: {e}"))?;
        Ok(view.to_vec())
    }

    /// Dispatch once and read `C` back (`m·n` f32).
    pub fn run(&self, l: &Launch, c: &wgpu::Buffer, elems: usize) -> Result<Vec<f32>, String> {
        let bytes = (4 * elems as u64).div_ceil(4) * 4;
        let back = self.scoped("run", || {
            let mut enc = self.device.create_command_encoder(&Default::default());
            self.dispatch(&mut enc, l, None);
            self.submit_and_read(enc, c, bytes)
        })??;
        Ok(bytemuck::pod_collect_to_vec(&back))
    }

    /// `warmup` untimed dispatches, then `reps` timed ones: GPU milliseconds of each from the
    /// timestamps around its compute pass, or (without `TIMESTAMP_QUERY`) wall milliseconds
    /// of one submit-and-wait each.
    pub fn time(&self, l: &Launch, warmup: usize, reps: usize) -> Result<Vec<f64>, String> {
        self.scoped("time", || -> Result<Vec<f64>, String> {
            let mut enc = self.device.create_command_encoder(&Default::default());
            for _ in 0..warmup {
                self.dispatch(&mut enc, l, None);
            }
            self.queue.submit([enc.finish()]);
            self.wait()?;
            if !self.timestamps {
                return (0..reps)
                    .map(|_| {
                        let t = std::time::Instant::now();
                        let mut enc = self.device.create_command_encoder(&Default::default());
                        self.dispatch(&mut enc, l, None);
                        self.queue.submit([enc.finish()]);
                        self.wait()?;
                        Ok(t.elapsed().as_secs_f64() * 1e3)
                    })
                    .collect();
            }
            let n = 2 * reps as u32;
            let set = self.device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("sgemm timestamps"),
                ty: wgpu::QueryType::Timestamp,
                count: n,
            });
            let resolve = self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("timestamps"),
                size: 8 * u64::from(n),
                usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            });
            let mut enc = self.device.create_command_encoder(&Default::default());
            for r in 0..reps as u32 {
                self.dispatch(&mut enc, l, Some((&set, 2 * r)));
            }
            enc.resolve_query_set(&set, 0..n, &resolve, 0);
            let back = self.submit_and_read(enc, &resolve, 8 * u64::from(n))?;
            let ticks: Vec<u64> = bytemuck::pod_collect_to_vec(&back);
            let period = f64::from(self.queue.get_timestamp_period());
            Ok(ticks
                .chunks(2)
                .map(|p| p[1].saturating_sub(p[0]) as f64 * period * 1e-6)
                .collect())
        })?
    }
}

/// Median of `v` (the mean of the middle two for an even count; NaN when empty).
pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let h = v.len() / 2;
    if v.len() % 2 == 1 {
        v[h]
    } else {
        0.5 * (v[h - 1] + v[h])
    }
}

/// Bytes of an `rows x k` operand in `dtype` as the kernels bind it (rounded up to 16).
pub fn operand_bytes(rows: u32, k: u32, dtype: Dtype) -> u64 {
    (u64::from(rows) * u64::from(k) * dtype.bytes())
        .div_ceil(16)
        .max(1)
        * 16
}

#[cfg(test)]
mod tests {
    use super::super::{host, Variant};
    use super::*;

    /// The device, or `None` (skipped) when there is no adapter and `CCE_REQUIRE_WGPU` is
    /// unset.
    fn gpu() -> Option<Gpu> {
        match Gpu::open() {
            Ok(g) => Some(g),
            Err(e) if std::env::var_os("CCE_REQUIRE_WGPU").is_none() => {
                eprintln!("skipping: {e}");
                None
            }
            Err(e) => panic!("CCE_REQUIRE_WGPU set and {e}"),
        }
    }

    /// Every variant at `m x n x k` against the f64 reference, fresh inputs per variant.
    fn check(g: &Gpu, names: &[&str], (m, n, k): (u32, u32, u32)) {
        for (s, name) in names.iter().enumerate() {
            let v = Variant::parse(name).unwrap();
            let (mu, nu, ku) = (m as usize, n as usize, k as usize);
            let a = host::operand(&host::uniform(mu * ku, 11 + s as u64), v.dtype);
            let b = host::operand(&host::uniform(nu * ku, 97 + s as u64), v.dtype);
            let (ab, bb) = (
                g.upload("a", &a.bytes).unwrap(),
                g.upload("b", &b.bytes).unwrap(),
            );
            let cb = g.output(mu * nu).unwrap();
            let built = match g.build(v) {
                Ok(b) => b,
                Err(e) if e.contains("over the device's limits") => {
                    eprintln!("skipping {e}");
                    continue;
                }
                Err(e) => panic!("{e}"),
            };
            let l = g.launch(&built, (&ab, &bb, &cb), (m, n, k)).unwrap();
            let c = g.run(&l, &cb, mu * nu).unwrap();
            let at = host::sample(mu, nu, 4096);
            let (err, (i, j)) = host::worst_error(&a.values, &b.values, &c, (nu, ku), at);
            assert!(
                err <= host::tolerance(ku),
                "{name} {m}x{n}x{k}: error {err:.3e} at ({i}, {j}), got {}",
                c[i * nu + j]
            );
        }
    }

    #[test]
    fn every_kernel_matches_the_f64_product() {
        let Some(g) = gpu() else { return };
        let names = [
            "t128r8k8",
            "t128r8k8n",
            "t128r8k16u",
            "t64r8k8",
            "t64r4k16",
            "t64r4k8:checked",
            "t128r8k16:bf16",
            "t128r8k8nu:bf16",
            "ours-scalar",
            "ours-named",
            "ours-quad",
            "ours-named:bf16",
            "ours-scalar:checked",
        ];
        check(&g, &names, (256, 256, 256));
        // Several panels of a deeper product, tiles in both directions.
        check(&g, &["t128r8k8", "t64r4k16:bf16"], (128, 256, 1152));
    }

    #[test]
    fn ours_handles_ragged_shapes() {
        let Some(g) = gpu() else { return };
        check(
            &g,
            &["ours-scalar", "ours-named", "ours-quad:bf16"],
            (200, 136, 72),
        );
    }

    #[test]
    fn tiled_refuses_partial_tiles() {
        let Some(g) = gpu() else { return };
        let built = g.build(Variant::parse("t64r4k16").unwrap()).unwrap();
        let buf = g.output(200 * 136).unwrap();
        let e = g
            .launch(&built, (&buf, &buf, &buf), (200, 136, 72))
            .err()
            .unwrap();
        assert!(e.contains("multiples of 64"), "{e}");
        assert_eq!(median(vec![3.0, 1.0, 2.0, 10.0]), 2.5);
    }
}
