//! The crate's error type.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum TokenizerError {
    #[error(transparent)]
    Gguf(#[from] strata_gguf::GgufError),
    #[error("{file}: metadata key `{key}`: {what}")]
    Metadata {
        file: String,
        key: String,
        what: String,
    },
    #[error("unsupported tokenizer model `{0}` (supported: gpt2 = byte-level BPE, llama = SentencePiece)")]
    UnsupportedModel(String),
    #[error("unsupported pre-tokenizer `{0}` (tokenizer.ggml.pre)")]
    UnsupportedPreTokenizer(String),
    #[error("invalid vocabulary: {0}")]
    Invalid(String),
    #[error("token id {id} is out of range (vocabulary of {n_vocab} tokens)")]
    TokenOutOfRange { id: u32, n_vocab: usize },
    #[error(
        "the vocabulary has no token for byte 0x{0:02X}, needed to encode text it cannot merge"
    )]
    NoByteToken(u8),
    #[error("the model has no {0} token, but it was asked to add one")]
    MissingSpecial(&'static str),
    #[error("chat template: {0}")]
    Template(String),
}
