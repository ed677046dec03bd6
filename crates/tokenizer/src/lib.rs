//! strata-tokenizer: text ↔ token ids for GGUF models, built from the file's `tokenizer.*`
//! metadata, with llama.cpp's behaviour as the reference (same ids, same special-token rules):
//! byte-level BPE with the pre-tokenizer named by `tokenizer.ggml.pre` (`gpt2` model type),
//! SentencePiece (`llama` model type), special/control/user-defined tokens, BOS/EOS/EOG,
//! detokenization (whole and streaming), and chat templates (`tokenizer.chat_template`, rendered
//! with Hugging Face's Jinja semantics).
//!
//! Pre-tokenizers (`tokenizer.ggml.pre`): the GPT-2, Llama 3, Qwen2 and Qwen3.5 families are
//! hand-written scanners over llama.cpp's Unicode tables; `default`, StarCoder-style, Falcon,
//! DeepSeek-Coder and DeepSeek-LLM run their published expressions through `fancy-regex`. All of
//! them reproduce llama.cpp's test vectors. Other names are refused with an error.

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

#[cfg(test)]
mod tests {
    /// The engine and server share one tokenizer and template across threads.
    #[test]
    fn shareable_across_threads() {
        fn check<T: Send + Sync>() {}
        check::<crate::Tokenizer>();
        check::<crate::ChatTemplate>();
        check::<crate::StreamDecoder>();
    }
}
