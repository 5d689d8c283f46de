//! # cce-wgpu: cut cross-entropy on any GPU that speaks Vulkan, Metal or DX12
//!
//! A [`cce_core::Backend`] written as WGSL compute shaders on wgpu 30: the loss of an LM head,
//! `CE(E·Cᵀ (+ bias, softcap), targets)`, and its gradients `d_e = G·C`, `d_c = Gᵀ·E`,
//! `d_bias = Σ_i G`, without materializing the `N x V` logits (Wijmans et al.,
//! arXiv 2411.09009; the formulas are in the `cce_core` crate docs and MATH.md).
//!
//! | concept | here |
//! |---|---|
//! | device buffer | [`WgpuTensor`]: a `wgpu::Buffer` + byte offset + dtype + shape |
//! | device, queue, pipelines | one context per [`WgpuBackend`], built once, shared by clones |
//! | a framework's device | [`WgpuBackend::from_device`]; its buffers as [`WgpuBackend::view`]s, outputs written into them by [`WgpuBackend::forward_into`] / [`WgpuBackend::backward_into`] |
//! | tile shape | [`KernelConfig`] → WGSL `override` constants `WG`, `TK` |
//! | dtype | WGSL `override DTYPE`: f32, f16 and bf16 all stored as `array<u32>` |
//! | errors | wgpu error scopes → `CceError::{OutOfMemory, Backend}`; no adapter → `NoDevice` |
//!
//! ## Passes (strategy `TileOwnership` of [`cce_core::plan`])
//! 1. `fwd_partial` + `fwd_merge` (+ `loss_reduce`): online log-sum-exp over class tiles, one
//!    partial per (row, split), merged in fixed order; loss, entropy, argmax.
//! 2. `bwd_prep`: per-row coefficients of `G`; with the filter on, `bwd_hist` + `bwd_tau`
//!    build each row's histogram of `g0 = |p − onehot|` with u32 atomics and derive `τ_i`
//!    ([`cce_core::FilterRule`]).
//! 3. `bwd_de` (row-owned) and `bwd_dc` (class-owned): recompute the logits tile, form `G`,
//!    skip the tile when every entry of an active row has `g0 < τ_i`, accumulate in f32, then
//!    `finalize` sums the slabs, adds the analytic label-smoothing term and rounds once to the
//!    output dtype. A chunk's class tiles (`d_e`) or row tiles (`d_c`) are cut into splits run
//!    by separate workgroups; their sums meet in one of two ways
//!    ([`WgpuBackend::has_float_atomics`]):
//!    - on devices with `SHADER_FLOAT32_ATOMIC` (Vulkan `VK_EXT_shader_atomic_float`, Metal
//!      3), for calls that are not `Options::deterministic`: every split adds into one f32
//!      slab per chunk with `atomicAdd` on `atomic<f32>`, and the splits are as many as the
//!      kernel configuration's `target_workgroups` asks; with
//!      [`KernelConfig::coalesced_adds`] (off by default) where the device also has
//!      `SUBGROUP` (subgroups 8 or more wide, `wg` a multiple of 8,
//!      [`WgpuBackend::has_coalesced_adds`]) each row's 8 x 8 block of a thread is first
//!      transposed across the row's 8 lanes by subgroup shuffles, so that one add instruction
//!      of a subgroup covers 8 consecutive floats of a row (one 32-byte sector) instead of 8
//!      floats 8 apart;
//!    - otherwise: one f32 slab per split, owned by its workgroups (no float atomics), summed
//!      by `finalize` in split order; the splits are capped by the workspace budget's room
//!      for their slabs.
//!
//! Work is cut into row and class chunks by the plan so that no binding exceeds the adapter's
//! `max_storage_buffer_binding_size`. Results are bitwise repeatable for a given device and
//! config when the call is `deterministic` or the device lacks f32 atomics; otherwise the
//! gradients' f32 sums run in an order that varies from run to run (the loss and lse never
//! depend on it).
//!
//! ## Trusted shader modules
//! Shader modules are created with `create_shader_module_trusted` and none of wgpu's runtime
//! checks (index clamping, loop counters, integer-division guards), which cost time in the
//! inner loops. Every storage access of every shader is guarded by the chunk's sizes or bounded
//! by the dispatch's uniforms (each shader's header, "Bounds"), and before each dispatch the
//! host checks every bound range against the largest byte the shader may touch with those
//! uniforms, refusing the dispatch with a `Backend` error otherwise. Bindings stay below
//! 4 GiB, so 32-bit indices do not wrap. [`KernelConfig::runtime_checks`] restores the checks.
//!
//! ## Cooperative matrix
//! With the cargo feature `coop-matrix` (off by default: wgpu's and naga's support is
//! experimental), the backend requests `EXPERIMENTAL_COOPERATIVE_MATRIX` where the adapter
//! offers it, and the forward of f16 inputs computes its logits tiles with 16 x 16 x 16
//! f16 x f16 -> f32 cooperative matrices on adapters with 32-wide subgroups that list that
//! configuration: by default at 128 x 128 tiles (logits_coop128.wgsl, 256 invocations, 48 KiB
//! of workgroup memory), at 128 x 128 with 64 x 64 per subgroup (logits_coop128w.wgsl, 128
//! invocations, 48 KiB) or at 64 x 64 (logits_coop.wgsl) where [`KernelConfig::coop_tile`]
//! asks for it, or the 64 x 64 one where the adapter has no room for the larger ones; everything else, and every
//! other dtype, keeps the f32 FMA kernels. With [`KernelConfig::coop_backward`] (off by default
//! until it has run on a GPU), where the 128 x 128 forward runs, the backward's `d_e` and
//! `d_c` passes of f16 inputs run by cooperative matrices too (bwd_coop.wgsl, 128 x 128
//! tiles): each recomputes its logits tile as the forward
//! does, forms G in f32, and multiplies **G rounded to f16** (times a power-of-two scale per
//! tile that puts the tile's largest possible |G| at 2^14, undone in f32 after the product) by
//! the f16 rows of c or e with f32 accumulation into the same f32 slabs (per-split, or f32
//! atomics); the contract allows the f16 rounding of G for f16 inputs (the CUDA backend does
//! the same); `d_bias` sums the f32 G. Passes that filter keep the FMA backward.
//! [`KernelConfig::cooperative_matrix`] turns it all off per backend,
//! [`KernelConfig::coop_backward`] the backward alone; [`WgpuBackend::adapter_report`] says
//! whether it is in use.
//!
//! ## dtypes
//! f32, f16 and bf16 inputs are read as packed u32 words (`unpack2x16float` for f16, shifts
//! for bf16), so neither `SHADER_F16` nor a bf16 type is required; logits and every
//! accumulation are f32. Gradients come back in the input dtype (or f32 per
//! `Options::grad_dtype`), rounded to nearest even.

mod backend;
mod bounds;
mod buffers;
mod config;
mod context;
mod named;
mod pipelines;
mod profile;
mod status;

pub use backend::interop::{BackwardDest, ForwardDest};
pub use backend::WgpuBackend;
pub use buffers::WgpuTensor;
pub use config::{default_shapes, CoopTile, KernelConfig, MainLoop, NamedForm};
pub use context::{pick_adapter, WgpuError};
pub use pipelines::ShaderKind;
pub use profile::PassTime;
