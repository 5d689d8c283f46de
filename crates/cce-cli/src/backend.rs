//! Opening the backend `--backend` names, with a description for the report that says what it
//! runs on: `wgpu (NVIDIA H200)`, or `wgpu (llvmpipe (LLVM 15.0.7, 256 bits), a software
//! vulkan driver: CPU speed)` when the adapter is a CPU device such as lavapipe.

use cut_cross_entropy::{backend_by_name, HostBackend};

use crate::error::CliResult;

/// A backend and its description for the `backend` line of the report.
pub struct Opened {
    /// The backend.
    pub backend: Box<dyn HostBackend>,
    /// Its name, with the adapter for wgpu (and a warning on a CPU adapter).
    pub description: String,
}

impl Opened {
    fn plain(backend: Box<dyn HostBackend>) -> Self {
        let description = backend.name().to_string();
        Self {
            backend,
            description,
        }
    }
}

/// The backend `name` names (`cpu`, `cuda`, `wgpu`, `auto`), as
/// [`cut_cross_entropy::backend_by_name`] picks it.
///
/// With the `wgpu` feature, `wgpu` and `auto` open `cce_wgpu::WgpuBackend`
/// here (after CUDA for `auto`, as `backend_by_name` does) so that the adapter's name and type
/// reach the report; the boxed backend alone does not carry them.
///
/// Errors: those of `backend_by_name` (a backend not built in, no device).
pub fn open(name: &str) -> CliResult<Opened> {
    #[cfg(feature = "wgpu")]
    if name == "wgpu" || name == "auto" {
        #[cfg(feature = "cuda")]
        if name == "auto" {
            if let Ok(b) = backend_by_name("cuda") {
                return Ok(Opened::plain(b));
            }
        }
        return match cut_cross_entropy::cce_wgpu::WgpuBackend::new() {
            Ok(b) => {
                let description = describe_wgpu(b.adapter_info());
                Ok(Opened {
                    backend: Box::new(b),
                    description,
                })
            }
            Err(e) if name == "wgpu" => Err(e.into()),
            Err(_) => Ok(Opened::plain(backend_by_name("cpu")?)),
        };
    }
    Ok(Opened::plain(backend_by_name(name)?))
}

/// `k` ranks simulated as threads on the CPU, each with its shard of the vocabulary
/// ([`cut_cross_entropy::SimulatedVocabParallel`]); `backend` must be `cpu`.
///
/// Errors: another backend named.
pub fn vocab_parallel(backend: &str, k: usize) -> CliResult<Opened> {
    if backend != "cpu" {
        return Err(crate::error::CliError::msg(format!(
            "--vocab-parallel {k}: the ranks are simulated on the CPU; drop --backend {backend}"
        )));
    }
    Ok(Opened {
        backend: Box::new(cut_cross_entropy::SimulatedVocabParallel::new(k)),
        description: format!(
            "cpu-vocab-parallel ({k} ranks as threads, the vocabulary split evenly)"
        ),
    })
}

/// `wgpu (<adapter>)`, and on a CPU adapter (wgpu's `DeviceType::Cpu`: lavapipe / llvmpipe,
/// SwiftShader) `wgpu (<adapter>, a software <api> driver: CPU speed)`.
#[cfg(feature = "wgpu")]
pub fn describe_wgpu(info: &wgpu::AdapterInfo) -> String {
    if info.device_type == wgpu::DeviceType::Cpu {
        format!(
            "wgpu ({}, a software {} driver: CPU speed)",
            info.name, info.backend
        )
    } else {
        format!("wgpu ({})", info.name)
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::*;

    #[test]
    fn a_cpu_adapter_is_called_software() {
        let mut info = wgpu::AdapterInfo::new(wgpu::DeviceType::Cpu, wgpu::Backend::Vulkan);
        info.name = "llvmpipe (LLVM 15.0.7, 256 bits)".into();
        assert_eq!(
            describe_wgpu(&info),
            "wgpu (llvmpipe (LLVM 15.0.7, 256 bits), a software vulkan driver: CPU speed)"
        );
        let mut info = wgpu::AdapterInfo::new(wgpu::DeviceType::DiscreteGpu, wgpu::Backend::Vulkan);
        info.name = "NVIDIA H200".into();
        assert_eq!(describe_wgpu(&info), "wgpu (NVIDIA H200)");
    }
}
