//! Benchmarks: the bench binaries under `src/bin`, and what they share.

/// The CUDA backend's switches ([`cce_cuda::CudaSwitches`]) as command-line flags, flattened
/// into each CUDA bench binary's command line: a path is forced or profiled by a flag of the
/// run, never by an environment variable.
#[cfg(feature = "cuda-dense")]
#[derive(clap::Args, Debug, Clone)]
pub struct SwitchArgs {
    /// Print the device time per phase of the sparse backward and the dense passes to stderr.
    #[arg(long)]
    pub profile: bool,
    /// Forward-only calls without the fused WGMMA forward (class tiles or row chunks instead).
    #[arg(long)]
    pub no_wgmma_forward: bool,
    /// Split dense's class pass without the WGMMA `G` epilogue (cuBLAS logits, then `G`).
    #[arg(long)]
    pub no_wgmma_gcols: bool,
    /// Split dense's row pass without the WGMMA epilogue (cuBLAS f32 logits, row kernels).
    #[arg(long)]
    pub no_wgmma_rows: bool,
    /// Threads per block of the sparse backward's selection: 512 or 256.
    #[arg(long, default_value_t = cce_cuda::switches::SPARSE_SELECT_THREADS)]
    pub select_threads: u32,
    /// Run the sparse backward's forward rows separately instead of in its selection pass.
    #[arg(long)]
    pub separate_sparse_forward: bool,
    /// Remember a sparse try that gave way: the next calls of the key run as the exact call
    /// (`cce_cuda::SparseMode::Remember`).
    #[arg(long)]
    pub remember_give_way: bool,
    /// Exact bf16 calls whose budget holds no f32 `d_c` accumulator: chunked dense with `d_c`
    /// accumulated in the bf16 output (`cce_cuda::CudaSwitches::dc_in_grad_dtype`).
    #[arg(long)]
    pub dc_in_grad_dtype: bool,
    /// Map the workspace again on every call (the stream's pool) instead of keeping it in the
    /// engine's own pool (`cce_cuda::CudaSwitches::keep_workspace` off).
    #[arg(long)]
    pub no_keep_workspace: bool,
    /// Filtered forward-and-backward calls without the staircase backward (the sparse try and
    /// split dense instead; `cce_cuda::CudaSwitches::staircase` off).
    #[arg(long)]
    pub no_staircase: bool,
}

#[cfg(feature = "cuda-dense")]
impl SwitchArgs {
    /// The switches these flags set, the rest at their defaults.
    pub fn switches(&self) -> cce_cuda::CudaSwitches {
        cce_cuda::CudaSwitches {
            profile: self.profile,
            wgmma_forward: !self.no_wgmma_forward,
            wgmma_gcols: !self.no_wgmma_gcols,
            wgmma_rows: !self.no_wgmma_rows,
            sparse_select_threads: self.select_threads,
            sparse_fold_forward: !self.separate_sparse_forward,
            keep_workspace: !self.no_keep_workspace,
            dc_in_grad_dtype: self.dc_in_grad_dtype,
            staircase: !self.no_staircase,
            sparse: if self.remember_give_way {
                cce_cuda::SparseMode::Remember
            } else {
                cce_cuda::SparseMode::Auto
            },
            ..Default::default()
        }
    }
}

#[cfg(feature = "wgpu")]
pub mod sgemm;
