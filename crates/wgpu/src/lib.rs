//! strata-wgpu: the portable GPU backend. wgpu 30 with WGSL compute shaders runs the kernel
//! catalogue of `strata_engine::kernels` on Vulkan (NVIDIA, Mesa's lavapipe on a CPU-only
//! machine) and Metal (Apple). This crate owns the adapter choice and its limits
//! ([`device`]), the WGSL sources ([`shaders`]), one launch builder per catalogue op ([`ops`]),
//! and the whole-model backend of the engine's boundary ([`backend`], [`qwen4exp`]).
//!
//! Numerics (DESIGN.md §3): every kernel states its agreement with the CPU reference. The
//! norms, activation images, embeddings, slop penalties and pick are meant to be bit-exact
//! (products kept out of driver FMA contraction, correctly rounded division and square root
//! in integer arithmetic); route differs only through `exp`, GEMV through its summation order,
//! both within stated bounds. Baseline and optimized variants are bitwise equal on one adapter,
//! and no reduction uses subgroup operations, so the subgroup size (8 on lavapipe, 32 on
//! NVIDIA) cannot change a bit.

pub mod backend;
pub mod device;
pub mod ops;
pub mod qwen4exp;
pub mod shaders;

pub use backend::{
    Counters, KernelStat, NormKernel, ProductKernel, WBuf, WIds, WRoutes, WWeight, WgpuBackend,
};
pub use device::{list_adapters, Buf, GpuProfile, HostTimes, Launch, Wgpu};
pub use qwen4exp::WSelection;

/// Errors of the wgpu backend (never a panic for a missing adapter or a bad shape).
#[derive(Debug, thiserror::Error)]
pub enum WgpuError {
    #[error("no wgpu adapter: {0}")]
    NoAdapter(String),
    #[error("wgpu device: {0}")]
    Device(String),
    #[error("shader {module}: {msg}")]
    Shader { module: String, msg: String },
    #[error("{kernel}: {what}")]
    Launch { kernel: String, what: String },
    #[error("{what}: {bytes} bytes exceed the adapter's storage-binding limit of {limit} bytes")]
    TooLarge {
        what: String,
        bytes: u64,
        limit: u64,
    },
    #[error("wgpu validation: {0}")]
    Validation(String),
    #[error("buffer map: {0}")]
    Map(String),
    #[error("a lock of the wgpu backend was poisoned")]
    Poisoned,
    /// A `STRATA_WGPU_*` setting with a value the backend does not know.
    #[error("{var}={value}: {expected}")]
    Setting {
        var: &'static str,
        value: String,
        expected: String,
    },
    #[error(transparent)]
    Kernel(#[from] strata_engine::kernels::KernelError),
}
