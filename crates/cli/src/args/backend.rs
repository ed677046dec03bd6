//! Where the model runs: `--backend cpu|cuda|auto` and `--device N`.

use anyhow::Result;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendKind {
    /// The CPU backend (always available)
    Cpu,
    /// An NVIDIA GPU through CUDA (driver and NVRTC 13 needed)
    Cuda,
    /// A GPU through wgpu: Metal on macOS, Vulkan elsewhere (lavapipe on a machine without one)
    Wgpu,
    /// CUDA when a usable GPU and its libraries are present, else the CPU
    Auto,
}

/// How a GPU backend processes a prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PrefillMode {
    /// Every prompt row gets exactly the bits of a single decode step
    Exact,
    /// CUDA: the large dense products on the tensor cores by cuBLAS (BF16 inputs, f32 sums),
    /// within a stated tolerance of the exact mode (docs/CUDA.md, "Fast prefill")
    Fast,
}

#[derive(clap::Args, Clone, Debug)]
pub struct BackendArgs {
    /// Where the model runs: cpu, cuda, wgpu, or auto (CUDA when a usable GPU and its
    /// libraries are present, else the CPU; -v says which)
    #[arg(long, value_enum, default_value = "auto")]
    pub backend: BackendKind,
    /// The CUDA device (ordinal) for --backend cuda or auto; for wgpu the adapter's index (0:
    /// STRATA_WGPU_ADAPTER, else the first GPU, else lavapipe)
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub device: usize,
    /// Prompt processing on CUDA: exact (every row the bits of a single decode step) or fast
    /// (the large products by cuBLAS on the tensor cores, within a stated tolerance). Unset:
    /// STRATA_CUDA_FAST_PREFILL=0|1 if given, else fast where cuBLAS loads and the backend
    /// does not batch sequences (STRATA_CUDA_BATCH=1 keeps exact: a batch's rows get their solo
    /// bits only in the exact mode); -v says which. The CPU's prefill is always exact
    #[arg(long, value_enum)]
    pub prefill: Option<PrefillMode>,
}

/// A validated [`BackendArgs`].
#[derive(Clone, Copy, Debug)]
pub struct BackendChoice {
    pub kind: BackendKind,
    pub device: usize,
    pub prefill: Option<PrefillMode>,
}

impl BackendArgs {
    pub fn resolve(&self) -> Result<BackendChoice> {
        Ok(BackendChoice {
            kind: self.backend,
            device: self.device,
            prefill: self.prefill,
        })
    }
}
