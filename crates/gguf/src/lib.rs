//! strata-gguf
