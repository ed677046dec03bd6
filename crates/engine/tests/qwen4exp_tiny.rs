//! qwen4exp on the CPU against the tiny fixture: transformers' goldens (f32 and bf16 GGUFs),
//! llama.cpp's QSA rule against llama.cpp's own logits, prefill = decode bit for bit, roll-back,
//! the zero-`compress_ratios` converter fault, and named errors for broken files.

mod common;

use std::sync::Arc;

use common::{compare, tiny_dir, Golden};
use strata_engine::qwen4exp::{LoadOptions, Model, Want};
use strata_engine::{CpuBackend, EngineError, FloatActivations, KvType, QsaRule};
use strata_gguf::GgufFile;

fn load(file: &str, opts: &LoadOptions) -> Model<CpuBackend> {
    let path = tiny_dir().join(file);
    Model::load(&path, CpuBackend::new(2).unwrap(), opts)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn prompt() -> Vec<u32> {
    Golden::open(tiny_dir().join("golden.safetensors")).ids("input_ids")
}

fn run_all(model: &Model<CpuBackend>, tokens: &[u32], want: Want) -> strata_engine::Outputs {
    let mut st = model.new_state().unwrap();
    model.forward_with(&mut st, tokens, want).unwrap()
}

#[test]
fn tiny_f32_matches_transformers_per_layer_and_logits() {
    let model = load("model-f32.gguf", &LoadOptions::default());
    let g = Golden::open(tiny_dir().join("golden.safetensors"));
    let out = run_all(
        &model,
        &prompt(),
        Want {
            layer_out: true,
            hidden: true,
            ..Want::default()
        },
    );
    assert_eq!(
        out.hidden.as_ref(),
        out.layer_out.last(),
        "hidden = the last layer's output"
    );
    for (i, got) in out.layer_out.iter().enumerate() {
        let (shape, want) = g.f32(&format!("layer_out.{i}"));
        let d = compare(got, &want, shape[1], 0.0);
        eprintln!(
            "tiny f32 layer_out.{i}: max|Δ| {:.3e} (max|ref| {:.3})",
            d.max_abs, d.max_ref
        );
        assert!(
            d.max_abs <= 1e-4 * d.max_ref,
            "layer {i}: max|Δ| {:.3e} > 1e-4 × {:.3}",
            d.max_abs,
            d.max_ref
        );
    }
    let (shape, want) = g.f32("logits");
    let d = compare(&out.logits, &want, shape[1], 0.0);
    eprintln!(
        "tiny f32 logits: max|Δ| {:.3e}, mean {:.3e}, max|ref| {:.3}",
        d.max_abs, d.mean_abs, d.max_ref
    );
    assert!(
        d.max_abs <= 1e-4 * d.max_ref,
        "max|Δ| {:.3e} > 1e-4 × {:.3}",
        d.max_abs,
        d.max_ref
    );
    assert!(
        d.argmax_mismatch.is_empty(),
        "argmax differs at rows {:?}",
        d.argmax_mismatch
    );
}

#[test]
fn tiny_bf16_exact_activations_match_transformers() {
    // With f32 activations the bf16 file computes exactly what the f32 file does (the fixture's
    // weights are bf16 values), so the same tight bound applies: this checks the BF16 reads.
    let path = tiny_dir().join("model-bf16.gguf");
    let backend = CpuBackend::new(2)
        .unwrap()
        .with_float_activations(FloatActivations::F32);
    let model = Model::load(&path, backend, &LoadOptions::default()).unwrap();
    let (shape, want) = Golden::open(tiny_dir().join("golden.safetensors")).f32("logits");
    let out = run_all(&model, &prompt(), Want::default());
    let d = compare(&out.logits, &want, shape[1], 0.0);
    eprintln!(
        "tiny bf16 (f32 activations) logits: max|Δ| {:.3e}, mean {:.3e}",
        d.max_abs, d.mean_abs
    );
    assert!(
        d.max_abs <= 2e-2 && d.max_abs <= 1e-4 * d.max_ref,
        "max|Δ| {:.3e}",
        d.max_abs
    );
    assert!(
        d.argmax_mismatch.is_empty(),
        "argmax differs at rows {:?}",
        d.argmax_mismatch
    );
}

#[test]
fn tiny_bf16_paired_activations_match_transformers() {
    // The default (DESIGN.md §3): activations rounded to BF16 before BF16 dot products, as
    // llama.cpp does. That moves logits by ~4e-3 per position, and more where the rounding flips
    // a discrete choice (the README measures the same for llama.cpp: up to 0.1).
    let model = load("model-bf16.gguf", &LoadOptions::default());
    let (shape, want) = Golden::open(tiny_dir().join("golden.safetensors")).f32("logits");
    let out = run_all(&model, &prompt(), Want::default());
    let v = shape[1];
    let d = compare(&out.logits, &want, v, 2e-2);
    let over: Vec<usize> = (0..shape[0])
        .filter(|&r| {
            compare(
                &out.logits[r * v..(r + 1) * v],
                &want[r * v..(r + 1) * v],
                v,
                0.0,
            )
            .max_abs
                > 2e-2
        })
        .collect();
    eprintln!(
        "tiny bf16 (paired activations) logits: max|Δ| {:.3e}, mean {:.3e}, rows over 2e-2: {over:?}, argmax mismatches {:?}",
        d.max_abs, d.mean_abs, d.argmax_mismatch
    );
    assert!(d.mean_abs <= 5e-3, "mean|Δ| {:.3e}", d.mean_abs);
    assert!(
        over.len() * 20 <= shape[0],
        "{} of {} rows over 2e-2",
        over.len(),
        shape[0]
    );
    assert!(
        d.argmax_mismatch_clear.is_empty(),
        "argmax differs at clear rows {:?}",
        d.argmax_mismatch_clear
    );
}

#[test]
fn tiny_llamacpp_rule_matches_llamacpp() {
    let g = Golden::open(tiny_dir().join("golden_llamacpp.safetensors"));
    for kv_type in [KvType::F32, KvType::F16] {
        let opts = LoadOptions {
            qsa_rule: QsaRule::LlamaCpp,
            kv_type,
            ..LoadOptions::default()
        };
        for (file, name) in [
            ("model-f32.gguf", "f32.logits"),
            ("model-bf16.gguf", "bf16.logits"),
        ] {
            let model = load(file, &opts);
            let (shape, want) = g.f32(name);
            let out = run_all(&model, &prompt(), Want::default());
            let d = compare(&out.logits, &want, shape[1], 0.0);
            eprintln!(
                "tiny {file} (llamacpp rule, {kv_type:?} KV) vs llama.cpp {name}: max|Δ| {:.3e}, mean {:.3e}",
                d.max_abs, d.mean_abs
            );
            assert!(d.mean_abs <= 3e-3, "{file}: mean|Δ| {:.3e}", d.mean_abs);
            if kv_type == KvType::F16 {
                // llama.cpp's cache is F16: with it, only arithmetic order is left.
                assert!(
                    d.max_abs <= 1e-4 * d.max_ref,
                    "{file}: max|Δ| {:.3e}",
                    d.max_abs
                );
                assert!(
                    d.argmax_mismatch.is_empty(),
                    "{file}: argmax differs at {:?}",
                    d.argmax_mismatch
                );
            }
        }
    }
    // The float64 emulation of llama.cpp's rule isolates the selection rule from llama.cpp's own
    // arithmetic: the f32 file must follow it as closely as it follows transformers.
    let opts = LoadOptions {
        qsa_rule: QsaRule::LlamaCpp,
        ..LoadOptions::default()
    };
    let model = load("model-f32.gguf", &opts);
    let (shape, want) = g.f32("f32.qsa_emulation_logits");
    let out = run_all(&model, &prompt(), Want::default());
    let d = compare(&out.logits, &want, shape[1], 0.0);
    eprintln!(
        "tiny f32 (llamacpp rule) vs float64 emulation: max|Δ| {:.3e}",
        d.max_abs
    );
    assert!(d.max_abs <= 1e-4 * d.max_ref, "max|Δ| {:.3e}", d.max_abs);
}

#[test]
fn tiny_reference_and_llamacpp_rules_differ() {
    // The fixture's prompt makes QSA sparse from position 11, so the two rules must disagree
    // somewhere; if they did not, the rule option would be a no-op.
    let a = run_all(
        &load("model-f32.gguf", &LoadOptions::default()),
        &prompt(),
        Want::default(),
    );
    let opts = LoadOptions {
        qsa_rule: QsaRule::LlamaCpp,
        ..LoadOptions::default()
    };
    let b = run_all(&load("model-f32.gguf", &opts), &prompt(), Want::default());
    let d = compare(&a.logits, &b.logits, a.n_vocab, 0.0);
    assert!(d.max_abs > 1e-3, "rules agree to {:.3e}", d.max_abs);
}

#[test]
fn tiny_prefill_equals_token_by_token_bitwise() {
    let tokens = prompt();
    for file in ["model-f32.gguf", "model-bf16.gguf"] {
        let model = load(file, &LoadOptions::default());
        let all = run_all(&model, &tokens, Want::default());
        let mut st = model.new_state().unwrap();
        let mut one = Vec::new();
        for &t in &tokens {
            one.extend(model.forward(&mut st, &[t]).unwrap().logits);
        }
        assert!(
            all.logits
                .iter()
                .zip(&one)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{file}: prefill != decode"
        );
        let last = run_all(
            &model,
            &tokens,
            Want {
                last_only: true,
                ..Want::default()
            },
        );
        assert_eq!(last.rows(), 1);
        assert_eq!(last.row(0), all.row(tokens.len() - 1), "{file}: last_only");
        // A last-logits prefill leaves the state of the full pass (its last layer, attention,
        // runs the rows before the last only as far as the caches): every state buffer equal.
        let n = tokens.len();
        let mut full = model.new_state().unwrap();
        model.forward(&mut full, &tokens[..n - 1]).unwrap();
        let mut part = model.new_state().unwrap();
        let want = Want {
            last_only: true,
            ..Want::default()
        };
        let p = model
            .forward_with(&mut part, &tokens[..n - 1], want)
            .unwrap();
        assert_eq!(p.row(0), all.row(n - 2), "{file}: last_only row");
        assert_eq!(
            model.state_buffers(&full).unwrap(),
            model.state_buffers(&part).unwrap(),
            "{file}: last_only state"
        );
        let next = model.forward(&mut part, &tokens[n - 1..]).unwrap();
        assert_eq!(next.row(0), all.row(n - 1), "{file}: step after last_only");
        // Uneven chunks (crossing QSA block and PLE conv boundaries) give the same bits too.
        let mut st = model.new_state().unwrap();
        let mut chunked = Vec::new();
        let mut at = 0;
        for len in [7usize, 1, 16, 3, 5].iter().cycle() {
            if at >= tokens.len() {
                break;
            }
            let end = (at + len).min(tokens.len());
            chunked.extend(model.forward(&mut st, &tokens[at..end]).unwrap().logits);
            at = end;
        }
        assert!(
            all.logits
                .iter()
                .zip(&chunked)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{file}: chunked != one-shot"
        );
    }
}

#[test]
fn tiny_results_do_not_depend_on_the_thread_count() {
    let tokens = prompt();
    let path = tiny_dir().join("model-bf16.gguf");
    let runs: Vec<Vec<f32>> = [1usize, 2, 3]
        .iter()
        .map(|&t| {
            let model =
                Model::load(&path, CpuBackend::new(t).unwrap(), &LoadOptions::default()).unwrap();
            run_all(&model, &tokens, Want::default()).logits
        })
        .collect();
    for r in &runs[1..] {
        assert!(r
            .iter()
            .zip(&runs[0])
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}

#[test]
fn tiny_checkpoint_restore_rolls_back_exactly() {
    let tokens = prompt();
    let model = load("model-f32.gguf", &LoadOptions::default());
    let reference = run_all(&model, &tokens, Want::default());
    let mut st = model.new_state().unwrap();
    model.forward(&mut st, &tokens[..37]).unwrap();
    let cp = model.checkpoint(&st).unwrap();
    // Speculate on wrong tokens, then roll back and continue with the real ones.
    model
        .forward(&mut st, &[1, 2, 3, 4, 5, 6, 7, 8, 9])
        .unwrap();
    model.restore(&mut st, &cp).unwrap();
    assert_eq!(st.position(), 37);
    let rest = model.forward(&mut st, &tokens[37..]).unwrap();
    let v = reference.n_vocab;
    assert!(
        rest.logits
            .iter()
            .zip(&reference.logits[37 * v..])
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "logits after restore differ from an uninterrupted run"
    );
}

/// The file's bytes with `from` replaced by `to` (same length) at its first occurrence.
fn patched(file: &str, from: &[u8], to: &[u8]) -> Vec<u8> {
    assert_eq!(from.len(), to.len());
    let mut bytes = std::fs::read(tiny_dir().join(file)).unwrap();
    let at = bytes
        .windows(from.len())
        .position(|w| w == from)
        .expect("pattern in file");
    bytes[at..at + to.len()].copy_from_slice(to);
    bytes
}

/// GGUF string encoding: u64 length then bytes.
fn gguf_str(s: &str) -> Vec<u8> {
    let mut v = (s.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(s.as_bytes());
    v
}

fn load_bytes(bytes: Vec<u8>, opts: &LoadOptions) -> Result<Model<CpuBackend>, EngineError> {
    let file = Arc::new(GgufFile::from_bytes(bytes, "patched.gguf")?);
    Model::from_file(file, CpuBackend::new(2).unwrap(), opts)
}

/// `qwen4exp.attention.compress_ratios` = [0, 0, 0, 4] rewritten to all zeros.
fn zero_ratios() -> Vec<u8> {
    let mut from = gguf_str("qwen4exp.attention.compress_ratios");
    from.extend_from_slice(&9u32.to_le_bytes()); // array
    let bytes = std::fs::read(tiny_dir().join("model-f32.gguf")).unwrap();
    let at = bytes
        .windows(from.len())
        .position(|w| w == from.as_slice())
        .expect("key in file")
        + from.len();
    let elem = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
    let count = u64::from_le_bytes(bytes[at + 4..at + 12].try_into().unwrap()) as usize;
    let size = match elem {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4 | 5 => 4,
        10 | 11 => 8,
        t => panic!("unexpected array element type {t}"),
    };
    let mut out = bytes.clone();
    let vals = &mut out[at + 12..at + 12 + count * size];
    assert!(
        vals.iter().any(|&b| b != 0),
        "the fixture has a nonzero ratio"
    );
    vals.fill(0);
    out
}

#[test]
fn tiny_zero_compress_ratios_warn_and_use_the_documented_ratio() {
    let normal = run_all(
        &load("model-f32.gguf", &LoadOptions::default()),
        &prompt(),
        Want::default(),
    );
    let model = load_bytes(zero_ratios(), &LoadOptions::default()).unwrap();
    let warn = model.warnings().join("\n");
    eprintln!("warning: {warn}");
    assert!(
        warn.contains("compress_ratios") && warn.contains("[3]") && warn.contains("ratio 4"),
        "{warn}"
    );
    let fixed = run_all(&model, &prompt(), Want::default());
    assert!(normal
        .logits
        .iter()
        .zip(&fixed.logits)
        .all(|(a, b)| a.to_bits() == b.to_bits()));

    // --qsa-ratio replaces the default: blocks of 8 with a budget of 8 select differently.
    let opts = LoadOptions {
        qsa_rule: QsaRule::Reference,
        qsa_ratio: Some(8),
        ..LoadOptions::default()
    };
    let model = load_bytes(zero_ratios(), &opts).unwrap();
    assert!(model.warnings().join("\n").contains("--qsa-ratio"));
    let other = run_all(&model, &prompt(), Want::default());
    assert!(compare(&other.logits, &normal.logits, normal.n_vocab, 0.0).max_abs > 1e-3);
}

#[test]
fn tiny_broken_files_give_named_errors() {
    let f = "model-f32.gguf";
    let opts = LoadOptions::default();
    let err = |bytes: Vec<u8>| {
        load_bytes(bytes, &opts)
            .err()
            .expect("load must fail")
            .to_string()
    };

    let e = err(patched(
        f,
        &gguf_str("blk.3.attn_v.weight"),
        &gguf_str("blk.3.attn_x.weight"),
    ));
    assert!(
        e.contains("blk.3.attn_v.weight") && e.contains("not found"),
        "{e}"
    );

    let e = err(patched(
        f,
        &gguf_str("qwen4exp.ssm.conv_kernel"),
        &gguf_str("qwen4exp.ssm.conv_kernex"),
    ));
    assert!(e.contains("qwen4exp.ssm.conv_kernel"), "{e}");

    let mut arch = gguf_str("general.architecture");
    arch.extend_from_slice(&8u32.to_le_bytes());
    let (mut from, mut to) = (arch.clone(), arch);
    from.extend_from_slice(&gguf_str("qwen4exp"));
    to.extend_from_slice(&gguf_str("qwen4exq"));
    let e = err(patched(f, &from, &to));
    assert!(e.contains("qwen4exq") && e.contains("not supported"), "{e}");

    // attn_k {64, 64} declared as {32, 128}: the data still fits, the shape is wrong.
    let mut from = gguf_str("blk.3.attn_k.weight");
    from.extend_from_slice(&2u32.to_le_bytes());
    let mut to = from.clone();
    from.extend_from_slice(&64u64.to_le_bytes());
    from.extend_from_slice(&64u64.to_le_bytes());
    to.extend_from_slice(&32u64.to_le_bytes());
    to.extend_from_slice(&128u64.to_le_bytes());
    let e = err(patched(f, &from, &to));
    assert!(
        e.contains("blk.3.attn_k.weight") && e.contains("[32, 128]") && e.contains("[64, 64]"),
        "{e}"
    );

    // attn_v F32 relabelled I32 (same size): not a type a matrix product can use.
    let mut from = gguf_str("blk.3.attn_v.weight");
    from.extend_from_slice(&2u32.to_le_bytes());
    from.extend_from_slice(&64u64.to_le_bytes());
    from.extend_from_slice(&64u64.to_le_bytes());
    let mut to = from.clone();
    from.extend_from_slice(&0u32.to_le_bytes());
    to.extend_from_slice(&26u32.to_le_bytes());
    let e = err(patched(f, &from, &to));
    assert!(
        e.contains("blk.3.attn_v.weight") && e.contains("I32"),
        "{e}"
    );

    // A bad request is an error too, not a panic.
    let model = load(f, &opts);
    let mut st = model.new_state().unwrap();
    let e = model
        .forward(&mut st, &[0, 320])
        .expect_err("out-of-range token")
        .to_string();
    assert!(e.contains("320"), "{e}");
}
