//! The qwen4exp fixture models' own tokenizer (`qwen35` pre-tokenizer, 305 tokens): the prompt
//! segments from fixtures' README, joined by EOS, must give the golden `input_ids` that
//! transformers (and llama.cpp) used.

use std::path::{Path, PathBuf};

use strata_gguf::GgufFile;
use strata_tokenizer::Tokenizer;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn golden_ids(path: &Path) -> Vec<u32> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor("input_ids").unwrap();
    assert_eq!(t.dtype(), safetensors::Dtype::I64);
    t.data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect()
}

fn prompt_ids(tok: &Tokenizer, segments: &[&str], parse_special: bool) -> Vec<u32> {
    let eos = tok.eos().unwrap();
    let mut ids = Vec::new();
    for (i, s) in segments.iter().enumerate() {
        if i > 0 {
            ids.push(eos);
        }
        ids.extend(tok.encode(s, true, parse_special).unwrap());
    }
    ids
}

#[test]
fn tiny_prompt_matches_golden_input_ids() {
    let dir = repo().join("fixtures/qwen4exp/tiny");
    let tok = Tokenizer::from_gguf(&GgufFile::open(dir.join("model-f32.gguf")).unwrap()).unwrap();
    assert_eq!(tok.pre(), Some("qwen35"));
    assert_eq!(tok.eos(), Some(300));
    let ids = prompt_ids(
        &tok,
        &[
            "The river keeps its own time.",
            "A lighthouse keeper counts the ships that pass at night, and writes each name in a small blue book.",
        ],
        false,
    );
    let golden = golden_ids(&dir.join("golden.safetensors"));
    assert_eq!(golden.len(), 80);
    assert!(ids.len() >= 80, "{} ids", ids.len());
    assert_eq!(&ids[..80], &golden[..]);
}

#[test]
fn small_prompt_matches_golden_input_ids() {
    let dir = repo().join("../shared/fixtures/qwen4exp/small");
    if !dir.join("q8_0.gguf").exists() {
        eprintln!("skipping: {} not present", dir.display());
        return;
    }
    let tok = Tokenizer::from_gguf(&GgufFile::open(dir.join("q8_0.gguf")).unwrap()).unwrap();
    let ids = prompt_ids(
        &tok,
        &[
            "The old lighthouse stands at the edge of the harbour. Every night the keeper writes the weather in a log.",
            "<|im_start|>user\nWhat does the keeper write?<|im_end|>\n<|im_start|>assistant\n",
        ],
        true,
    );
    assert_eq!(ids, golden_ids(&dir.join("golden.safetensors")));
}
