//! Token ids against llama.cpp: its own test vectors (`*.inp` / `*.out` from llama.cpp's
//! `models/`, produced by its tokenizer) on the vocabularies they belong to, and a corpus of
//! English, other scripts, code, numbers, emoji and whitespace runs tokenized by
//! `llama-tokenize` on the Qwen2.5-Coder vocabulary (see `tools/make_corpus_fixture.py`).

use std::path::PathBuf;

use strata_gguf::GgufFile;
use strata_tokenizer::{StreamDecoder, Tokenizer, TokenizerData};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tokenizer")
}

fn data(file: &str) -> TokenizerData {
    let path = fixtures().join(file);
    let f = GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    TokenizerData::from_gguf(&f).unwrap()
}

fn qwen_coder() -> Tokenizer {
    Tokenizer::new(data("qwen25-coder-vocab.gguf")).unwrap()
}

/// llama.cpp's test format: inputs separated by `\n__ggml_vocab_test__\n`, one line of
/// space-separated ids per input.
fn vectors(inp: &str, out: &str) -> Vec<(String, Vec<u32>)> {
    let inp = std::fs::read_to_string(fixtures().join(inp)).unwrap();
    let out = std::fs::read_to_string(fixtures().join(out)).unwrap();
    let mut texts: Vec<&str> = inp.split("\n__ggml_vocab_test__\n").collect();
    // A separator at the very end closes the last input rather than opening an empty one.
    if inp.ends_with("\n__ggml_vocab_test__\n") {
        texts.pop();
    }
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(texts.len(), lines.len(), "input and output counts differ");
    texts
        .iter()
        .zip(lines)
        .map(|(t, l)| {
            (
                t.to_string(),
                l.split_whitespace().map(|x| x.parse().unwrap()).collect(),
            )
        })
        .collect()
}

fn check_vectors(tok: &Tokenizer, inp: &str, out: &str, lossless: bool) {
    let cases = vectors(inp, out);
    assert!(cases.len() > 20);
    let mut failures = Vec::new();
    for (text, want) in &cases {
        let got = tok.encode(text, false, false).unwrap();
        if &got != want {
            failures.push(format!("{text:?}\n   got  {got:?}\n   want {want:?}"));
        }
        if lossless {
            assert_eq!(
                &tok.decode(want, false).unwrap(),
                text,
                "decode of llama.cpp's ids"
            );
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases differ:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn qwen2_matches_llama_cpp_vectors() {
    // The Qwen2.5-Coder vocabulary equals ggml-vocab-qwen2.gguf in every normal token and
    // merge (they differ only in added tokens above 151645), so llama.cpp's qwen2 vectors apply.
    let tok = qwen_coder();
    assert_eq!(tok.pre(), Some("qwen2"));
    check_vectors(&tok, "qwen2.inp", "qwen2.out", true);
}

#[test]
fn qwen35_matches_llama_cpp_vectors() {
    // ggml-vocab-qwen35.gguf is ggml-vocab-qwen2.gguf with `tokenizer.ggml.pre` = qwen35.
    let mut d = data("qwen25-coder-vocab.gguf");
    d.pre = Some("qwen35".into());
    let tok = Tokenizer::new(d).unwrap();
    check_vectors(&tok, "qwen35.inp", "qwen35.out", true);
}

#[test]
fn gpt2_matches_llama_cpp_vectors() {
    let tok = Tokenizer::new(data("ggml-vocab-gpt-2.gguf")).unwrap();
    check_vectors(
        &tok,
        "ggml-vocab-gpt-2.gguf.inp",
        "ggml-vocab-gpt-2.gguf.out",
        false,
    );
}

#[test]
fn llama_spm_matches_llama_cpp_vectors() {
    let tok = Tokenizer::new(data("ggml-vocab-llama-spm.gguf")).unwrap();
    assert_eq!(tok.model(), "llama");
    check_vectors(
        &tok,
        "ggml-vocab-llama-spm.gguf.inp",
        "ggml-vocab-llama-spm.gguf.out",
        false,
    );
    // SentencePiece: BOS is added by default, and decoding drops the prefix space.
    let ids = tok.encode("Hello world", true, false).unwrap();
    assert_eq!(ids.first().copied(), tok.bos());
    assert_eq!(tok.decode(&ids[1..], false).unwrap(), "Hello world");
}

#[derive(serde::Deserialize)]
struct Corpus {
    cases: Vec<CorpusCase>,
}

#[derive(serde::Deserialize)]
struct CorpusCase {
    text: String,
    ids: Vec<u32>,
    ids_parse_special: Vec<u32>,
}

fn corpus() -> Corpus {
    let s = std::fs::read_to_string(fixtures().join("qwen25_corpus.json")).unwrap();
    serde_json::from_str(&s).unwrap()
}

#[test]
fn qwen25_coder_corpus_matches_llama_tokenize() {
    let tok = qwen_coder();
    let corpus = corpus();
    assert!(corpus.cases.len() >= 50);
    let mut failures = Vec::new();
    for c in &corpus.cases {
        for (parse, want) in [(false, &c.ids), (true, &c.ids_parse_special)] {
            // The vocabulary does not add BOS, so add_special changes nothing here.
            let got = tok.encode(&c.text, true, parse).unwrap();
            if &got != want {
                failures.push(format!(
                    "parse_special={parse} {:?}\n   got  {got:?}\n   want {want:?}",
                    c.text
                ));
            }
        }
        assert_eq!(tok.decode(&c.ids_parse_special, true).unwrap(), c.text);
    }
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn stream_decoder_emits_valid_text_that_adds_up() {
    let tok = qwen_coder();
    for c in corpus().cases {
        let mut d = StreamDecoder::new(true);
        let mut text = String::new();
        let mut held_back = false;
        for &id in &c.ids_parse_special {
            text.push_str(&d.push(&tok, id).unwrap());
            held_back |= d.has_pending();
        }
        text.push_str(&d.flush());
        assert_eq!(text, c.text);
        // Emoji and CJK are split inside characters by the byte-level vocabulary.
        if c.text.starts_with("👍🏽") {
            assert!(held_back, "expected a token that ends mid-character");
        }
    }
}

#[test]
fn qwen25_coder_special_tokens() {
    let tok = qwen_coder();
    assert_eq!(tok.n_vocab(), 151936);
    assert_eq!(tok.bos(), Some(151643));
    assert_eq!(tok.eos(), Some(151645));
    assert!(!tok.add_bos());
    // The end-of-generation set llama.cpp prints for this vocabulary: EOS, <|endoftext|>, the
    // FIM pad / repo / file-separator tokens, and "</s>" (an ordinary token in Qwen's
    // vocabulary that llama.cpp's text rule promotes).
    assert_eq!(
        tok.eog_ids(),
        vec![128247, 151643, 151645, 151662, 151663, 151664]
    );
    assert_eq!(tok.eot(), Some(151645));
    assert!(tok.is_eog(151645) && !tok.is_eog(151644) && !tok.is_eog(9707));
    assert!(tok.is_control(151644));
    // Control tokens print only when asked; user-defined ones always.
    assert_eq!(tok.token_to_piece(151644, false).unwrap(), b"");
    assert_eq!(tok.token_to_piece(151644, true).unwrap(), b"<|im_start|>");
    assert_eq!(tok.token_to_piece(151657, false).unwrap(), b"<tool_call>");
    // A byte-level token for a lone continuation byte.
    assert_eq!(tok.token_to_piece(247, false).unwrap().len(), 1);
    assert!(tok.token_to_piece(151936, false).is_err());
    assert_eq!(tok.fim()[0], tok.token_id("<|fim_prefix|>"));
}

#[test]
fn bad_metadata_is_an_error_naming_the_key() {
    use strata_gguf::{Array, GgufWriter, Value};
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", Value::String("qwen2".into()));
    w.add_kv("tokenizer.ggml.model", Value::String("gpt2".into()));
    w.add_kv(
        "tokenizer.ggml.tokens",
        Value::Array(Array::String(vec!["a".into(), "b".into()])),
    );
    w.add_kv("tokenizer.ggml.eos_token_id", Value::String("oops".into()));
    let f = GgufFile::from_bytes(w.to_bytes().unwrap(), "bad.gguf").unwrap();
    let e = TokenizerData::from_gguf(&f).unwrap_err().to_string();
    assert!(e.contains("tokenizer.ggml.eos_token_id"), "{e}");

    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", Value::String("qwen2".into()));
    w.add_kv("tokenizer.ggml.model", Value::String("gpt2".into()));
    w.add_kv(
        "tokenizer.ggml.tokens",
        Value::Array(Array::String(vec!["a".into(), "b".into()])),
    );
    w.add_kv(
        "tokenizer.ggml.token_type",
        Value::Array(Array::I32(vec![1])),
    );
    let f = GgufFile::from_bytes(w.to_bytes().unwrap(), "short.gguf").unwrap();
    let e = TokenizerData::from_gguf(&f).unwrap_err().to_string();
    assert!(e.contains("token_type") && e.contains("short.gguf"), "{e}");

    // An unknown pre-tokenizer is refused rather than guessed.
    let mut d = data("qwen25-coder-vocab.gguf");
    d.pre = Some("no-such-pre".into());
    let e = Tokenizer::new(d).unwrap_err().to_string();
    assert!(e.contains("no-such-pre"), "{e}");
}
