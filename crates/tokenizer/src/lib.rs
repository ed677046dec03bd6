//! strata-tokenizer: text ↔ token ids for GGUF models, built from the file's `tokenizer.*`
//! metadata, with llama.cpp's behaviour as the reference (same ids, same special-token rules):
//! byte-level BPE with the pre-tokenizer named by `tokenizer.ggml.pre` (`gpt2` model type),
//! SentencePiece (`llama` model type), special/control/user-defined tokens, BOS/EOS/EOG,
//! detokenization (whole and streaming), and chat templates (`tokenizer.chat_template`, rendered
//! with Hugging Face's Jinja semantics).

mod bpe;
mod bytes;
mod chat;
mod error;
mod pretok;
mod spm;
mod stream;
mod tokenizer;
mod unicode;
mod unicode_tables;
mod vocab;

pub use chat::{ChatMessage, ChatTemplate};
pub use error::TokenizerError;
pub use stream::StreamDecoder;
pub use tokenizer::{TokenAttr, Tokenizer};
pub use vocab::{TokenType, TokenizerData};

pub type Result<T, E = TokenizerError> = std::result::Result<T, E>;
