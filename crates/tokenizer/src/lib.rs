//! strata-tokenizer
