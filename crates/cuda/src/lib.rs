//! strata-cuda: the CUDA backend of the kernel catalogue (DESIGN.md §2, §4). It owns the
//! device context and stream, the kernel modules (`kernels/*.cu`, compiled by NVRTC for the
//! device's architecture at start and cached on disk), device buffers, event timing, and one
//! launch function per catalogue op and variant. Kernel semantics are those of
//! `strata_engine::kernels`; variant names come from its registry. [`model`] holds the
//! launchers of the model operations of both families (semantics: the CPU backend), the
//! pieces a CUDA backend is assembled from.
//!
//! The crate builds and its tests pass on machines without CUDA: libraries are loaded at run
//! time (cudarc's dynamic loading), their absence is looked for before cudarc is asked, and
//! becomes [`CudaError::DriverMissing`] / [`CudaError::NvrtcMissing`].

pub mod nvrtc;
pub mod sources;

/// Errors of the CUDA backend; each names the call or module and what was expected.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("CUDA driver not available: {0}")]
    DriverMissing(String),
    #[error("NVRTC not available: {0}")]
    NvrtcMissing(String),
    /// libcublas (CUDA 13) could not be loaded: the fast prefill (`--prefill fast`) needs it.
    #[error("cuBLAS not available: {0}")]
    BlasMissing(String),
    #[error("NVRTC, module {module}: {what}")]
    Nvrtc { module: String, what: String },
    #[error("CUDA call {call} failed: {what}")]
    Driver { call: String, what: String },
    #[error("kernel {kernel}: {what}")]
    Launch { kernel: String, what: String },
    #[error("{0}")]
    Kernel(#[from] strata_engine::kernels::KernelError),
    /// A `STRATA_CUDA_*` switch with a value other than 0 or 1.
    #[error("{var}={value}: expected 0 (off) or 1 (on)")]
    Setting { var: &'static str, value: String },
    /// A switch override (`strata_cuda::device::set_switch`) that cannot be made.
    #[error("switch {name}: {why}")]
    Switch { name: String, why: &'static str },
}

pub mod backend;
pub mod device;
pub mod model;
pub mod ops;
pub mod record;

pub use backend::CudaBackend;
pub use device::{ensure_driver, Gpu, Graph, KernelTime, ModuleLoad};
