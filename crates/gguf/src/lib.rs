//! strata-gguf: the GGUF container. It owns reading (memory-mapped, zero-copy tensor views,
//! v2 and v3), validating every header field, metadata value and tensor record, and writing
//! files that read back identically. It knows the type table (from strata-quant) only to size
//! tensors; it does no math on tensor data.

mod error;
#[doc(hidden)]
pub mod fuzzing;
mod reader;
mod value;
pub mod writer;

pub use error::GgufError;
pub use reader::{
    GgufFile, TensorInfo, TensorType, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAX_ARRAY_DEPTH, MAX_DIMS,
    MAX_NAME_BYTES,
};
pub use strata_quant::GgmlType;
pub use value::{Array, Value, ValueType};
pub use writer::{GgufWriter, StreamLayout};
