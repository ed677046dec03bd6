//! The engine's error type. Every variant names what it is about (file, key, tensor, layer) and
//! what was expected, so a bad model file or a bad request can be diagnosed from the message.

use strata_quant::GgmlType;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Gguf(#[from] strata_gguf::GgufError),

    #[error(transparent)]
    Quant(#[from] strata_quant::QuantError),

    /// A catalogue kernel refused its inputs, or the variant selection names no variant.
    #[error(transparent)]
    Kernel(#[from] crate::kernels::KernelError),

    #[error("{file}: architecture '{found}' is not supported; expected one of: {expected}")]
    UnsupportedArch {
        file: String,
        found: String,
        expected: String,
    },

    #[error("{file}: key '{key}': {problem}")]
    BadKey {
        file: String,
        key: String,
        problem: String,
    },

    #[error("{file}: tensor '{tensor}' not found; expected {expected}")]
    MissingTensor {
        file: String,
        tensor: String,
        expected: String,
    },

    #[error(
        "{file}: tensor '{tensor}' has shape {found:?} (ggml ne order); expected {expected:?}"
    )]
    TensorShape {
        file: String,
        tensor: String,
        found: Vec<u64>,
        expected: Vec<u64>,
    },

    #[error("{file}: tensor '{tensor}' has type {ty}, which {backend} cannot use for {usage}")]
    UnsupportedType {
        file: String,
        tensor: String,
        ty: String,
        backend: String,
        usage: &'static str,
    },

    /// A shape mismatch between buffers handed to a backend operation (a bug in the caller).
    #[error("{op}: {what}")]
    Shape { op: &'static str, what: String },

    /// A step would write past a fixed-capacity cache (the sequence reached its context).
    #[error("the context is full: {what} would need {needed} positions; its capacity is {capacity} (raise it with --ctx)")]
    ContextFull {
        what: &'static str,
        needed: usize,
        capacity: usize,
    },

    /// A request the model cannot serve (token id out of range, empty batch, ...).
    #[error("{0}")]
    Input(String),
}

impl EngineError {
    pub(crate) fn shape(op: &'static str, what: impl Into<String>) -> Self {
        EngineError::Shape {
            op,
            what: what.into(),
        }
    }
}

/// The name of a weight type for messages, including ids the type table does not know.
pub(crate) fn type_name(ty: Option<GgmlType>, raw: u32) -> String {
    match ty {
        Some(t) => t.name().to_string(),
        None => format!("unknown type id {raw}"),
    }
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;
