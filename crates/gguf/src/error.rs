//! The one error type of the container. Every message names the file, what was being read (key,
//! tensor or header field), the byte offset, and what was expected, so a bad file can be
//! diagnosed from the message alone.

/// An error from reading or writing a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{file}: {source}")]
    Io {
        file: String,
        source: std::io::Error,
    },

    /// The bytes at `offset` do not have the shape the format requires.
    #[error("{file}: offset {offset}: {what}: expected {expected}, found {found}")]
    Malformed {
        file: String,
        offset: u64,
        what: String,
        expected: String,
        found: String,
    },

    /// A length or count asks for more bytes than the file has left.
    #[error(
        "{file}: offset {offset}: {what}: needs {needed} bytes but only {available} are left \
         in the file (truncated or corrupt length)"
    )]
    Truncated {
        file: String,
        offset: u64,
        what: String,
        needed: u64,
        available: u64,
    },

    #[error(
        "{file}: offset 4: version field reads {raw:#010x}: this is a big-endian GGUF file; \
         expected a little-endian file (version 2 or 3)"
    )]
    BigEndian { file: String, raw: u32 },

    #[error("{file}: offset {offset}: duplicate {kind} '{name}' (first defined at offset {first}); expected unique {kind}s")]
    Duplicate {
        file: String,
        offset: u64,
        kind: &'static str,
        name: String,
        first: u64,
    },

    /// A tensor whose type id is not in the type table was used.
    #[error(
        "{file}: tensor '{tensor}' ({at}): type id {id} is not a known ggml type; expected an \
         id from the type table"
    )]
    UnknownType {
        file: String,
        tensor: String,
        /// Where: the info record's file offset, or the data offset when the file is unknown.
        at: String,
        id: u32,
    },

    #[error("{file}: tensor '{tensor}' not found; expected a tensor of that name")]
    MissingTensor { file: String, tensor: String },

    #[error("{file}: key '{key}' not found; expected {expected}")]
    MissingKey {
        file: String,
        key: String,
        expected: String,
    },

    /// A metadata value exists but has the wrong type or range for the getter.
    #[error("{file}: key '{key}' (value at offset {offset}): expected {expected}, found {found}")]
    KeyType {
        file: String,
        key: String,
        offset: u64,
        expected: String,
        found: String,
    },

    /// The writer was given something it cannot write as a valid file.
    #[error("gguf writer: {what}: expected {expected}, found {found}")]
    Write {
        what: String,
        expected: String,
        found: String,
    },
}
