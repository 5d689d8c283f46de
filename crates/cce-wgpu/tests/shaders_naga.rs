//! CPU-only: every shader parses and validates with naga, also after its override constants
//! are applied for each dtype and a few tile configurations, and translates to SPIR-V (the
//! cooperative-matrix shader included, which no CI adapter runs).

use cce_wgpu::{MainLoop, NamedForm, ShaderKind};
use naga::valid::{Capabilities, ValidationFlags, Validator};

/// The named loop's wide forms the test builds (`NamedForm::Wide` texts are per shape).
const WIDE: [(u32, u32); 4] = [(16, 8), (16, 16), (8, 8), (8, 16)];

#[test]
fn every_shader_validates_with_its_overrides() {
    let sources = ShaderKind::ALL.iter().flat_map(|&k| {
        let wide = WIDE
            .iter()
            .filter_map(|&(wg, tk)| NamedForm::wide(wg, tk))
            .filter(move |_| k.effective_main_loop(MainLoop::Named) == MainLoop::Named)
            .map(move |f| (k, MainLoop::Named, f));
        [MainLoop::Scalar, MainLoop::Quad, MainLoop::Named]
            .into_iter()
            .filter(move |&ml| k.effective_main_loop(ml) == ml)
            .map(move |ml| (k, ml, NamedForm::Loop))
            .chain(wide)
    });
    for (kind, main_loop, form) in sources {
        let src = &*kind.source_form(main_loop, form);
        let module = naga::front::wgsl::parse_str(src)
            .unwrap_or_else(|e| panic!("{}: parse error\n{}", kind.name(), e.emit_to_string(src)));
        let info = Validator::new(ValidationFlags::all(), Capabilities::all())
            .validate(&module)
            .unwrap_or_else(|e| {
                panic!(
                    "{}: validation error\n{}",
                    kind.name(),
                    e.emit_to_string(src)
                )
            });
        for dtype in 0..3u32 {
            let shapes: &[(u32, u32)] = match (main_loop, form) {
                // A wide text runs at the shape it is written for.
                (_, NamedForm::Wide { wg, tk }) => &[(wg, tk)][..],
                (MainLoop::Scalar | MainLoop::Named, _) => &[(8, 16), (4, 8), (16, 8), (8, 4)],
                (MainLoop::Quad, _) => &[(8, 16), (4, 8), (16, 32)],
            };
            for &(wg, tk) in shapes {
                let constants: naga::back::PipelineConstants = kind
                    .constants(dtype, wg, tk)
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), v))
                    .collect();
                let (m, i) = naga::back::pipeline_constants::process_overrides(
                    &module,
                    &info,
                    Some((naga::ShaderStage::Compute, "main")),
                    &constants,
                )
                .unwrap_or_else(|e| {
                    panic!(
                        "{}: overrides dtype {dtype} wg {wg} tk {tk}: {e:?}",
                        kind.name()
                    )
                });
                let stage = naga::back::spv::PipelineOptions {
                    shader_stage: naga::ShaderStage::Compute,
                    entry_point: "main".into(),
                };
                let options = naga::back::spv::Options {
                    lang_version: (1, 3),
                    ..Default::default()
                };
                naga::back::spv::write_vec(&m, &i, &options, Some(&stage)).unwrap_or_else(|e| {
                    panic!(
                        "{}: SPIR-V dtype {dtype} wg {wg} tk {tk}: {e:?}",
                        kind.name()
                    )
                });
            }
        }
    }
}

#[test]
fn every_shader_file_opens_with_its_doc_block() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("shaders");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|x| x != "wgsl") {
            continue;
        }
        n += 1;
        let text = std::fs::read_to_string(&path).unwrap();
        let head: String = text
            .lines()
            .take_while(|l| l.starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n");
        for word in ["Parameters", "Tiling", "Thread mapping", "Bounds"] {
            assert!(
                head.contains(word),
                "{} does not open with a '{word}' section",
                path.display()
            );
        }
    }
    assert!(n >= ShaderKind::ALL.len());
}
