//! strata-convert: turns checkpoints of other formats into GGUF files the engine loads. Today
//! that is the MTP head of a Hugging Face qwen4_exp checkpoint ([`mtp`]); the engine itself reads
//! only GGUF and does not depend on safetensors.

pub mod mtp;

pub use mtp::{convert_mtp, ConvertOptions, OutType};
