//! `strata logits` end to end on the tiny fixture: the written file against transformers'
//! golden logits (token ids), and `--text` against the golden prompt's own token ids.

use std::path::{Path, PathBuf};
use std::process::Command;

use safetensors::{Dtype, SafeTensors};

fn tiny() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/qwen4exp/tiny")
}

fn f32s(st: &SafeTensors, name: &str) -> (Vec<usize>, Vec<f32>) {
    let t = st.tensor(name).unwrap();
    assert_eq!(t.dtype(), Dtype::F32);
    (
        t.shape().to_vec(),
        t.data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
    )
}

fn ids(st: &SafeTensors, name: &str) -> Vec<i64> {
    let t = st.tensor(name).unwrap();
    assert_eq!(t.dtype(), Dtype::I64);
    t.data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[test]
fn logits_from_token_ids_match_transformers() {
    let golden = std::fs::read(tiny().join("golden.safetensors")).unwrap();
    let golden = SafeTensors::deserialize(&golden).unwrap();
    let prompt = ids(&golden, "input_ids");
    let list = prompt
        .iter()
        .map(|t| t.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let out =
        std::env::temp_dir().join(format!("strata-logits-{}.safetensors", std::process::id()));
    let model = tiny().join("model-f32.gguf");
    let run = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args([
            "logits",
            "-m",
            model.to_str().unwrap(),
            "--tokens",
            &list,
            "--threads",
            "2",
            "--out",
            out.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let bytes = std::fs::read(&out).unwrap();
    std::fs::remove_file(&out).ok();
    let got = SafeTensors::deserialize(&bytes).unwrap();
    let (shape, logits) = f32s(&got, "logits");
    let (want_shape, want) = f32s(&golden, "logits");
    assert_eq!(shape, want_shape);
    assert_eq!(ids(&got, "input_ids"), prompt);
    let max_ref = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    let max_d = logits
        .iter()
        .zip(&want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(max_d <= 1e-4 * max_ref, "max|Δ| {max_d:e}");
}

#[test]
fn logits_from_text_tokenizes_like_the_fixture() {
    // The fixture's prompt begins with this sentence, then EOS (`<|endoftext|>`, a special token).
    let golden = std::fs::read(tiny().join("golden.safetensors")).unwrap();
    let golden = SafeTensors::deserialize(&golden).unwrap();
    let prompt = ids(&golden, "input_ids");
    let out = std::env::temp_dir().join(format!(
        "strata-logits-text-{}.safetensors",
        std::process::id()
    ));
    let model = tiny().join("model-f32.gguf");
    let run = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args([
            "logits",
            "-m",
            model.to_str().unwrap(),
            "--text",
            "The river keeps its own time.<|endoftext|>",
            "--out",
        ])
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let bytes = std::fs::read(&out).unwrap();
    std::fs::remove_file(&out).ok();
    let got = SafeTensors::deserialize(&bytes).unwrap();
    let got_ids = ids(&got, "input_ids");
    assert_eq!(got_ids.last(), Some(&300), "ends with EOS");
    assert_eq!(got_ids, prompt[..got_ids.len()]);
    let (shape, _) = f32s(&got, "logits");
    assert_eq!(shape, vec![got_ids.len(), 320]);
}

#[test]
fn logits_rejects_a_bad_token_with_a_message() {
    let model = tiny().join("model-f32.gguf");
    let out = std::env::temp_dir().join("strata-logits-never-written.safetensors");
    let run = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args([
            "logits",
            "-m",
            model.to_str().unwrap(),
            "--tokens",
            "1,99999",
            "--out",
            out.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(!run.status.success());
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(err.contains("99999"), "{err}");
}
