//! Probe.
fn main() {
    let inst = wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle());
    let adapters = pollster::block_on(inst.enumerate_adapters(wgpu::Backends::all()));
    for a in adapters {
        println!("{:?}", a.get_info());
        println!("{:?}", a.features());
        println!("{:#?}", a.limits());
    }
    let src = r#"
override WG: u32 = 8u;
override TK: u32 = 16u;
var<workgroup> sm: array<f32, WG * TK * 8u>;
@group(0) @binding(0) var<storage, read_write> out: array<f32>;
@compute @workgroup_size(WG, WG)
fn main(@builtin(local_invocation_index) li: u32) {
  sm[li] = f32(li);
  workgroupBarrier();
  out[li] = sm[(li + 1u) % (WG*WG)] + tanh(1.0);
}
"#;
    let m = naga::front::wgsl::parse_str(src).unwrap();
    let info = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::all(),
    )
    .validate(&m);
    println!("validate: {:?}", info.as_ref().err());
    let inf = info.unwrap();
    let (m2, _i2) = naga::back::pipeline_constants::process_overrides(
        &m,
        &inf,
        None,
        &[("WG".to_string(), 4.0)].into_iter().collect(),
    )
    .unwrap();
    println!("{}", m2.global_variables.len());
}
