//! `strata tokenize` end to end: ids as llama.cpp's `llama-tokenize` prints them (the corpus
//! fixture holds its output), on the vocabulary fixture and, when it is cached, on the real
//! default model (same vocabulary).

use std::path::PathBuf;
use std::process::Command;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn strata(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

fn corpus() -> Vec<(String, Vec<u32>, Vec<u32>)> {
    let s = std::fs::read_to_string(repo().join("fixtures/tokenizer/qwen25_corpus.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&s).unwrap();
    let ids = |x: &serde_json::Value| -> Vec<u32> {
        x.as_array()
            .unwrap()
            .iter()
            .map(|i| i.as_u64().unwrap() as u32)
            .collect()
    };
    v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["text"].as_str().unwrap().to_string(),
                ids(&c["ids"]),
                ids(&c["ids_parse_special"]),
            )
        })
        .collect()
}

fn check_model(model: &str) {
    // One directory per call: the tests of this file run in parallel in one process, and one
    // removing a shared directory while the other writes into it failed CI once.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("strata-tokenize-{}-{call}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // A sample of the corpus (each run loads the 151k-token vocabulary; the whole corpus is
    // checked through the library in strata-tokenizer's tests).
    let sample = corpus()
        .into_iter()
        .enumerate()
        .filter(|(i, c)| i % 9 == 0 || c.0.starts_with("<|"));
    for (i, (text, plain, special)) in sample {
        let path = dir.join(format!("{i}.txt"));
        std::fs::write(&path, &text).unwrap();
        let p = path.to_str().unwrap();
        for (extra, want) in [(Some("--no-parse-special"), &plain), (None, &special)] {
            let mut args = vec!["tokenize", "-m", model, "-f", p];
            args.extend(extra);
            let (ok, out, err) = strata(&args);
            assert!(ok, "{err}");
            let got: Vec<u32> = serde_json::from_str(out.trim()).unwrap();
            assert_eq!(&got, want, "{text:?} {extra:?}");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn tokenize_prints_llama_cpp_ids() {
    let model = repo().join("fixtures/tokenizer/qwen25-coder-vocab.gguf");
    let model = model.to_str().unwrap();
    let (ok, out, err) = strata(&["tokenize", "-m", model, "--text", "Hello world"]);
    assert!(ok, "{err}");
    assert_eq!(out, "[9707, 1879]\n");
    check_model(model);
}

#[test]
fn tokenize_on_the_cached_default_model() {
    let cached = std::env::var_os("STRATA_CACHE")
        .map(|c| PathBuf::from(c).join("models"))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/strata/models")))
        .map(|d| d.join("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"));
    match cached {
        Some(p) if p.exists() => check_model(p.to_str().unwrap()),
        _ => eprintln!("skipping: the default model is not cached (run `strata fetch`)"),
    }
}

#[test]
fn tokenize_errors_name_the_problem() {
    let (ok, _, err) = strata(&["tokenize", "-m", "/nonexistent/model.gguf", "--text", "x"]);
    assert!(!ok && err.contains("/nonexistent/model.gguf"), "{err}");
}
