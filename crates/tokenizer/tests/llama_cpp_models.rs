//! Every vocabulary test file llama.cpp ships (`models/ggml-vocab-*.gguf` with `.inp`/`.out`),
//! when a llama.cpp source tree is at hand: `$STRATA_LLAMA_CPP_MODELS`, or the reference copy
//! this project was developed next to. Skipped with a message otherwise; the vocabularies the
//! project relies on are also in fixtures/tokenizer and tested in llama_vocab.rs.
//!
//! Vocabularies whose model or pre-tokenizer is not supported are listed and skipped; every
//! supported one must match llama.cpp exactly.

use std::path::PathBuf;

use strata_gguf::GgufFile;
use strata_tokenizer::{Tokenizer, TokenizerData, TokenizerError};

fn models_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("STRATA_LLAMA_CPP_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../../llama-src/llama_cpp_python-0.3.36/vendor/llama.cpp/models")
        });
    dir.is_dir().then_some(dir)
}

#[test]
fn all_llama_cpp_vocab_vectors() {
    let Some(dir) = models_dir() else {
        eprintln!("skipping: no llama.cpp models directory (set STRATA_LLAMA_CPP_MODELS)");
        return;
    };
    let mut names: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.extension().is_some_and(|e| e == "gguf") && p.with_extension("gguf.out").exists()
        })
        .collect();
    names.sort();
    let mut failures = Vec::new();
    let mut checked = Vec::new();
    for path in names {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let data = TokenizerData::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
        let tok = match Tokenizer::new(data) {
            Ok(t) => t,
            Err(
                e @ (TokenizerError::UnsupportedModel(_)
                | TokenizerError::UnsupportedPreTokenizer(_)),
            ) => {
                eprintln!("{name}: skipped ({e})");
                continue;
            }
            Err(e) => panic!("{name}: {e}"),
        };
        let inp = std::fs::read_to_string(path.with_extension("gguf.inp")).unwrap();
        let out = std::fs::read_to_string(path.with_extension("gguf.out")).unwrap();
        let sep = "\n__ggml_vocab_test__\n";
        let mut texts: Vec<&str> = inp.split(sep).collect();
        if inp.ends_with(sep) {
            texts.pop();
        }
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(texts.len(), lines.len(), "{name}");
        let mut bad = 0;
        for (t, l) in texts.iter().zip(&lines) {
            let want: Vec<u32> = l.split_whitespace().map(|x| x.parse().unwrap()).collect();
            let got = tok.encode(t, false, false).unwrap();
            if got != want {
                bad += 1;
                failures.push(format!("{name}: {t:?}\n   got  {got:?}\n   want {want:?}"));
            }
        }
        eprintln!("{name}: {} cases, {bad} differ", texts.len());
        checked.push(name);
    }
    assert!(checked.len() >= 4, "only {checked:?} checked");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
