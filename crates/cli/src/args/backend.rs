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
}

/// A validated [`BackendArgs`].
#[derive(Clone, Copy, Debug)]
pub struct BackendChoice {
    pub kind: BackendKind,
    pub device: usize,
}

impl BackendArgs {
    pub fn resolve(&self) -> Result<BackendChoice> {
        Ok(BackendChoice {
            kind: self.backend,
            device: self.device,
        })
    }
}
