//! qwen4exp on the CPU against the small fixture's quantized files (read from
//! `../shared/fixtures/qwen4exp/small`, skipped when absent): transformers on each file's
//! dequantized weights (the reference QSA rule), and llama.cpp on the file itself (its QSA rule).

mod common;

use common::{compare, small_dir, Golden};
use strata_engine::qwen4exp::{LoadOptions, Model, Want};
use strata_engine::{CpuBackend, KvType, QsaRule};

const VARIANTS: [&str; 3] = ["q2_0-mix", "q8_0", "iq-mix"];

fn logits(
    dir: &std::path::Path,
    variant: &str,
    rule: QsaRule,
    kv_type: KvType,
    tokens: &[u32],
) -> Vec<f32> {
    let path = dir.join(format!("{variant}.gguf"));
    let opts = LoadOptions {
        qsa_rule: rule,
        kv_type,
        ..LoadOptions::default()
    };
    let model = Model::load(&path, CpuBackend::new(2).unwrap(), &opts)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut st = model.new_state().unwrap();
    model
        .forward_with(&mut st, tokens, Want::default())
        .unwrap()
        .logits
}

#[test]
fn small_quantized_match_transformers_on_dequantized_weights() {
    let Some(dir) = small_dir() else { return };
    let tokens = Golden::open(dir.join("golden.safetensors")).ids("input_ids");
    let g = Golden::open(dir.join("golden_llamacpp.safetensors"));
    let mut failures = vec![];
    for v in VARIANTS {
        let (shape, want) = g.f32(&format!("{v}.hf_dequant_logits"));
        let got = logits(&dir, v, QsaRule::Reference, KvType::F32, &tokens);
        let d = compare(&got, &want, shape[1], 0.0);
        let agree = 1.0 - d.argmax_mismatch.len() as f32 / d.rows as f32;
        eprintln!(
            "small {v} vs transformers on dequantized weights: max|Δ| {:.3e}, mean {:.3e}, argmax {:.1}%",
            d.max_abs,
            d.mean_abs,
            100.0 * agree
        );
        if d.mean_abs > 1e-2 || agree < 0.95 {
            failures.push(format!(
                "{v}: mean|Δ| {:.3e}, argmax {:.1}%",
                d.mean_abs,
                100.0 * agree
            ));
        }
    }
    assert!(failures.is_empty(), "{failures:?}");
}

#[test]
fn small_quantized_llamacpp_rule_match_llamacpp() {
    let Some(dir) = small_dir() else { return };
    let tokens = Golden::open(dir.join("golden.safetensors")).ids("input_ids");
    let g = Golden::open(dir.join("golden_llamacpp.safetensors"));
    let mut failures = vec![];
    for v in VARIANTS {
        let (shape, want) = g.f32(&format!("{v}.llamacpp_logits"));
        for kv in [KvType::F32, KvType::F16] {
            let got = logits(&dir, v, QsaRule::LlamaCpp, kv, &tokens);
            let d = compare(&got, &want, shape[1], 0.0);
            eprintln!(
                "small {v} (llamacpp rule, {kv:?} KV) vs llama.cpp: max|Δ| {:.3e}, mean {:.3e}, argmax mismatches {:?}",
                d.max_abs, d.mean_abs, d.argmax_mismatch
            );
            if d.mean_abs > 3e-3 {
                failures.push(format!("{v} ({kv:?} KV): mean|Δ| {:.3e}", d.mean_abs));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:?}");
}
