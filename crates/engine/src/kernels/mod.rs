//! CPU versions of the report's kernel catalogue (DESIGN.md §4) and the run-time registry of
//! kernel variants (DESIGN.md §2.1).
//!
//! Every kernel here is a plain function over slices with a `baseline` (the simple,
//! obviously-right version) and an `optimized` variant that must produce the same bits; the unit
//! tests of each module bind the pair on random inputs that include −0.0, denormals and large
//! magnitudes. The CUDA backend (`strata-cuda`) implements the same catalogue with the same
//! semantics, and the parity harness (`strata-parity`) checks both against these functions.
//!
//! The float semantics are part of each kernel's contract, because the CUDA versions reproduce
//! them: no fused multiply-add unless a kernel says so, norms reduce in the fixed
//! [`norm::reduce_lanes`] order, activation images are ggml's CPU-backend quantizers.

pub mod actq;
pub mod embed;
pub mod gemv;
pub mod norm;
pub mod pick;
pub mod registry;
pub mod route;
pub mod slop;
pub mod testdata;

pub use actq::ActFmt;
pub use registry::{Op, Variant, BASELINE, OPTIMIZED};

/// Errors of the CPU kernels and the variant registry.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum KernelError {
    #[error("{kernel}: {what} holds {got} elements, expected {expected}")]
    Length {
        kernel: &'static str,
        what: &'static str,
        got: usize,
        expected: usize,
    },
    #[error("{kernel}: {what}")]
    Invalid { kernel: &'static str, what: String },
    #[error("{kernel}: {source}")]
    Quant {
        kernel: &'static str,
        #[source]
        source: strata_quant::QuantError,
    },
    #[error("unknown kernel op '{op}' in {origin} (known ops: {known})")]
    UnknownOp {
        op: String,
        origin: &'static str,
        known: String,
    },
    #[error("kernel op '{op}' has no variant '{variant}' in {origin} (known: {known})")]
    UnknownVariant {
        op: String,
        variant: String,
        origin: &'static str,
        known: String,
    },
    #[error(
        "malformed kernel selection '{entry}' in {origin}: expected op=variant[,op=variant...]"
    )]
    Malformed { entry: String, origin: &'static str },
}

/// Checks a slice length, naming the kernel and the argument.
pub(crate) fn check_len(
    kernel: &'static str,
    what: &'static str,
    got: usize,
    expected: usize,
) -> Result<(), KernelError> {
    if got != expected {
        return Err(KernelError::Length {
            kernel,
            what,
            got,
            expected,
        });
    }
    Ok(())
}

pub(crate) fn invalid(kernel: &'static str, what: impl Into<String>) -> KernelError {
    KernelError::Invalid {
        kernel,
        what: what.into(),
    }
}
