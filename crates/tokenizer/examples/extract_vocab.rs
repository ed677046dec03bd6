//! Writes a vocabulary-only copy of a GGUF file: all metadata (architecture, hyper-parameters,
//! `tokenizer.*`), no tensors — the shape of llama.cpp's `ggml-vocab-*.gguf` test files, which
//! llama.cpp loads with `vocab_only`. Used to make the Qwen2.5-Coder vocabulary fixture.
//!
//! usage: cargo run --release -p strata-tokenizer --example extract_vocab -- IN.gguf OUT.gguf

use strata_gguf::{GgufFile, GgufWriter};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let (Some(input), Some(output)) = (args.get(1), args.get(2)) else {
        return Err("usage: extract_vocab IN.gguf OUT.gguf".into());
    };
    let f = GgufFile::open(input)?;
    let mut w = GgufWriter::new();
    for (k, v) in f.metadata() {
        w.add_kv(k.clone(), v.clone());
    }
    w.write_file(output)?;
    // Reading it back checks that the copy parses and kept every key.
    let back = GgufFile::open(output)?;
    if back.metadata() != f.metadata() {
        return Err("the written file's metadata differs from the input's".into());
    }
    eprintln!(
        "{output}: {} keys, {} bytes",
        back.metadata().len(),
        back.file_size()
    );
    Ok(())
}
