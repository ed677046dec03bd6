//! `strata inspect` end to end on the fixture models: `--dump` output checked against the HF
//! checkpoint the GGUF files were converted from, `--json` checked against facts read
//! independently (the checkpoint's config, the file's raw header bytes, the file size).

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value as Json;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn strata(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(args)
        .output()
        .expect("run strata")
}

/// A .npy file (version 1, '<f4', C order): shape and data.
fn read_npy(path: &Path) -> (Vec<usize>, Vec<f32>) {
    let b = std::fs::read(path).unwrap();
    assert_eq!(&b[..8], b"\x93NUMPY\x01\x00");
    let hlen = u16::from_le_bytes([b[8], b[9]]) as usize;
    assert_eq!((10 + hlen) % 64, 0, "data not 64-byte aligned");
    let header = std::str::from_utf8(&b[10..10 + hlen]).unwrap();
    assert!(
        header.contains("'descr': '<f4'") && header.contains("'fortran_order': False"),
        "{header}"
    );
    let shape_s = header
        .split("'shape': (")
        .nth(1)
        .unwrap()
        .split(')')
        .next()
        .unwrap();
    let shape: Vec<usize> = shape_s
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect();
    let data: Vec<f32> = b[10 + hlen..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(data.len(), shape.iter().product::<usize>());
    (shape, data)
}

/// One BF16 tensor of a safetensors file, widened to f32 (exact), with its shape.
fn read_hf_bf16(path: &Path, name: &str) -> (Vec<usize>, Vec<f32>) {
    let b = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let h: Json = serde_json::from_slice(&b[8..8 + n]).unwrap();
    let e = &h[name];
    assert_eq!(e["dtype"], "BF16", "{name}");
    let shape: Vec<usize> = e["shape"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as usize)
        .collect();
    let s = e["data_offsets"][0].as_u64().unwrap() as usize + 8 + n;
    let t = e["data_offsets"][1].as_u64().unwrap() as usize + 8 + n;
    let data = b[s..t]
        .chunks_exact(2)
        .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16))
        .collect();
    (shape, data)
}

const HF_EMBED: &str = "model.language_model.embed_tokens.weight";

#[test]
fn dump_f32_and_bf16_embeddings_equal_the_hf_checkpoint() {
    let tiny = repo().join("fixtures/qwen4exp/tiny");
    let (hf_shape, hf) = read_hf_bf16(&tiny.join("hf/model.safetensors"), HF_EMBED);
    let dir = std::env::temp_dir().join(format!("strata-inspect-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for file in ["model-f32.gguf", "model-bf16.gguf"] {
        let out = dir.join(format!("{file}.npy"));
        let o = strata(&[
            "inspect",
            tiny.join(file).to_str().unwrap(),
            "--dump",
            "token_embd.weight",
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let (shape, data) = read_npy(&out);
        // HF [vocab, hidden] is ggml ne [hidden, vocab]: numpy shape is ne reversed.
        assert_eq!(shape, hf_shape, "{file}");
        assert!(
            data == hf,
            "{file}: dumped token_embd differs from the HF embedding"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn dump_q8_0_embedding_is_within_quantization_error_of_hf() {
    let small = repo().join("../shared/fixtures/qwen4exp/small");
    if !small.join("q8_0.gguf").exists() {
        eprintln!("skipping: {} not found", small.display());
        return;
    }
    let (hf_shape, hf) = read_hf_bf16(&small.join("hf/model.safetensors"), HF_EMBED);
    let out = std::env::temp_dir().join(format!("strata-inspect-q8-{}.npy", std::process::id()));
    let o = strata(&[
        "inspect",
        small.join("q8_0.gguf").to_str().unwrap(),
        "--dump",
        "token_embd.weight",
        "--out",
        out.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    if !o.status.success() && stderr.contains("not implemented") {
        eprintln!("skipping: Q8_0 dequantization not available yet: {stderr}");
        return;
    }
    assert!(o.status.success(), "{stderr}");
    let (shape, data) = read_npy(&out);
    let _ = std::fs::remove_file(&out);
    assert_eq!(shape, hf_shape);
    // Q8_0: d = amax/127 per 32 values (stored as f16), q = round(x/d); so |q·d − x| ≤ d/2 plus
    // the f16 rounding of d.
    for (i, (got, want)) in data.chunks(32).zip(hf.chunks(32)).enumerate() {
        let amax = want.iter().fold(0f32, |a, &x| a.max(x.abs()));
        let tol = amax / 127.0 * 0.5 * 1.01 + amax * 1e-3;
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() <= tol, "block {i}: {g} vs {w} (tol {tol})");
        }
    }
}

#[test]
fn json_report_matches_independent_facts() {
    let tiny = repo().join("fixtures/qwen4exp/tiny");
    let path = tiny.join("model-f32.gguf");
    let o = strata(&["inspect", "--json", path.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let j: Json = serde_json::from_slice(&o.stdout).unwrap();
    let raw = std::fs::read(&path).unwrap();
    let config: Json =
        serde_json::from_slice(&std::fs::read(tiny.join("hf/config.json")).unwrap()).unwrap();
    let text = if config["text_config"].is_object() {
        &config["text_config"]
    } else {
        &config
    };
    assert_eq!(j["architecture"], "qwen4exp");
    assert_eq!(j["file_size"].as_u64().unwrap(), raw.len() as u64);
    assert_eq!(
        j["version"].as_u64().unwrap(),
        u32::from_le_bytes(raw[4..8].try_into().unwrap()) as u64
    );
    let n_tensors = u64::from_le_bytes(raw[8..16].try_into().unwrap());
    assert_eq!(j["total"]["tensors"].as_u64().unwrap(), n_tensors);
    assert_eq!(j["tensors"].as_array().unwrap().len() as u64, n_tensors);
    // An all-f32 file: 32 bits per weight, 4 bytes per element.
    assert_eq!(j["total"]["bits_per_weight"].as_f64().unwrap(), 32.0);
    assert_eq!(
        j["total"]["bytes"].as_u64().unwrap(),
        4 * j["total"]["elements"].as_u64().unwrap()
    );
    let embd = j["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "token_embd.weight")
        .unwrap();
    assert_eq!(embd["ne"][0], text["hidden_size"]);
    assert_eq!(embd["ne"][1], text["vocab_size"]);
    // Long arrays are summarized: the 320-token vocabulary shows its length and a short head.
    let tokens = j["metadata"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["key"] == "tokenizer.ggml.tokens")
        .unwrap();
    assert_eq!(tokens["value"]["len"], text["vocab_size"]);
    assert_eq!(tokens["value"]["head"].as_array().unwrap().len(), 8);
}

#[test]
fn text_report_and_errors_name_the_file_and_tensor() {
    let path = repo().join("fixtures/qwen4exp/tiny/model-bf16.gguf");
    let p = path.to_str().unwrap();
    let o = strata(&["inspect", p]);
    assert!(o.status.success());
    let s = String::from_utf8(o.stdout).unwrap();
    assert!(s.contains("architecture: qwen4exp"), "{s}");
    assert!(
        s.lines()
            .any(|l| l.trim_start().starts_with("BF16") && l.trim_end().ends_with("16.0000")),
        "{s}"
    );
    assert!(s.contains("bits per weight"), "{s}");
    let o = strata(&[
        "inspect",
        p,
        "--dump",
        "no.such.tensor",
        "--out",
        "/dev/null",
    ]);
    assert!(!o.status.success());
    let e = String::from_utf8(o.stderr).unwrap();
    assert!(e.contains(p) && e.contains("'no.such.tensor'"), "{e}");
    let o = strata(&["inspect", "/nonexistent/file.gguf"]);
    assert!(String::from_utf8(o.stderr)
        .unwrap()
        .contains("/nonexistent/file.gguf"));
}
