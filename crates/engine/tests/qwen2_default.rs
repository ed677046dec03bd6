//! qwen2 on the default model (Qwen2.5-Coder-0.5B-Instruct Q4_K_M, `strata fetch`) against
//! llama.cpp's logits for the same file and prompt (fixtures/llamacpp), plus the determinism
//! contracts (prefill = decode, rollback = never having gone on) on the real weights. Skips with
//! a message when the model is not cached.

mod common;

use std::path::PathBuf;

use common::default_model;

use strata_engine::generate::{self, GenOptions, Qwen2Session, Session, StopReason};
use strata_engine::qwen2::{LoadOptions, Model};
use strata_engine::sampler::{Sampler, SamplerConfig};
use strata_engine::{CpuBackend, EngineError, KvType};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/llamacpp")
        .join(name)
}

fn load(kv: KvType) -> Option<Model<CpuBackend>> {
    let path = default_model()?;
    let backend = CpuBackend::new(2).unwrap();
    Some(Model::load(&path, backend, &LoadOptions { kv_type: kv }).unwrap())
}

/// Per position of the prompt: llama.cpp's top ids and the logits at them.
type TopRows = Vec<(Vec<usize>, Vec<f32>)>;

/// The prompt and its rows from one of the fixture JSON files.
fn positions(name: &str) -> (Vec<u32>, TopRows) {
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture(name)).unwrap()).unwrap();
    let nums = |a: &serde_json::Value| -> Vec<f64> {
        a.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect()
    };
    let ids = nums(&v["input_ids"])
        .into_iter()
        .map(|x| x as u32)
        .collect();
    let rows = v["positions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                nums(&r["ids"]).into_iter().map(|x| x as usize).collect(),
                nums(&r["logits"]).into_iter().map(|x| x as f32).collect(),
            )
        })
        .collect();
    (ids, rows)
}

#[test]
fn logits_match_llama_cpp_and_the_exact_reference() {
    let Some(model) = load(KvType::F16) else {
        return;
    };
    let (ids, llama) = positions("qwen25_capital_top.json");
    let (exact_ids, exact) = positions("qwen25_capital_exact.json");
    assert_eq!(ids, exact_ids);
    let mut st = model.new_state().unwrap();
    let out = model.forward(&mut st, &ids).unwrap();
    assert_eq!(out.rows(), ids.len());
    let (mut vs_llama, mut ours_err, mut llama_err) = (0f32, 0f32, 0f32);
    for (p, ((want_ids, want), (_, ex))) in llama.iter().zip(&exact).enumerate() {
        let got = out.row(p).unwrap();
        for ((&id, &w), &e) in want_ids.iter().zip(want).zip(ex) {
            vs_llama = vs_llama.max((got[id] - w).abs());
            ours_err = ours_err.max((got[id] - e).abs());
            llama_err = llama_err.max((w - e).abs());
        }
        // The same token wins, unless llama.cpp's top two are closer than the noise.
        let ours = strata_engine::sampler::argmax(got).unwrap() as usize;
        if want[0] - want[1] > 0.5 {
            assert_eq!(ours, want_ids[0], "position {p}: argmax");
        }
        // llama.cpp's top 5 are our top 5 as a set, where its 5th and 6th are well apart.
        if want[4] - want[5] > 0.5 {
            let mut idx: Vec<usize> = (0..got.len()).collect();
            idx.sort_by(|&a, &b| got[b].total_cmp(&got[a]));
            let mut ours5 = idx[..5].to_vec();
            let mut theirs5 = want_ids[..5].to_vec();
            ours5.sort_unstable();
            theirs5.sort_unstable();
            assert_eq!(ours5, theirs5, "position {p}: top-5 set");
        }
    }
    eprintln!(
        "max |Δlogit| over llama.cpp's top 20 at {} positions: vs llama.cpp {vs_llama:.3}; \
         vs the exact reference: ours {ours_err:.3}, llama.cpp {llama_err:.3}",
        ids.len()
    );
    // Both engines round activations to Q8_0/Q8_K before every product, and a rounding flip in
    // a Q8 block shifts this model's logits by a few tenths: llama.cpp sits 0.34 from the
    // float64 reference, and differs from itself by 0.16 between batched and one-token runs.
    // So: as close to the exact answer as llama.cpp is (25% slack for which blocks flip),
    // and within the two engines' combined distance of llama.cpp. A real error (a missing
    // bias, a wrong RoPE pairing) moves logits by whole units.
    assert!(
        ours_err <= 1.25 * llama_err,
        "ours {ours_err} from the exact reference, llama.cpp {llama_err}"
    );
    assert!(
        vs_llama < 0.6,
        "largest difference from llama.cpp {vs_llama}"
    );
}

#[test]
fn prefill_equals_decode_and_rollback_is_exact() {
    let Some(model) = load(KvType::F16) else {
        return;
    };
    let ids = [785u32, 6722, 315, 9625, 374, 12095, 13];
    let mut batch = model.new_state().unwrap();
    let all = model.forward(&mut batch, &ids).unwrap();
    let mut single = model.new_state().unwrap();
    for (i, &t) in ids.iter().enumerate() {
        let out = model.forward(&mut single, &[t]).unwrap();
        assert_eq!(
            out.row(0).unwrap(),
            all.row(i).unwrap(),
            "position {i}: decode differs from prefill"
        );
    }
    // Back to position 3, then forward again: the same bits as the first time.
    model.truncate(&mut single, 3).unwrap();
    assert_eq!(single.position(), 3);
    assert_eq!(single.tokens(), &ids[..3]);
    let again = model.forward_with(&mut single, &ids[3..], true).unwrap();
    assert_eq!(again.rows(), 1);
    assert_eq!(again.row(0).unwrap(), all.row(ids.len() - 1).unwrap());
}

#[test]
fn generation_reuses_the_cached_prefix() {
    let Some(model) = load(KvType::F16) else {
        return;
    };
    let prompt = [785u32, 6722, 315, 9625, 374];
    let run = |s: &mut dyn Session, p: &[u32]| {
        let mut sampler = Sampler::new(SamplerConfig::greedy()).unwrap();
        let opts = GenOptions {
            max_tokens: 6,
            prefill_chunk: 2,
        };
        generate::generate(s, p, &mut sampler, &|_| false, &opts, &mut |_| true).unwrap()
    };
    let mut fresh = Qwen2Session::new(&model).unwrap();
    let a = run(&mut fresh, &prompt);
    assert_eq!(a.stop, StopReason::MaxTokens);
    assert_eq!(a.tokens.len(), 6);
    assert_eq!(a.timings.prompt_tokens, 5);
    // " Paris" is what llama.cpp's greedy run says next (fixtures/llamacpp/qwen25_capital.txt).
    assert_eq!(a.tokens[0], 12095);
    // The same session now holds prompt + 5 fed tokens; a longer prompt sharing that prefix runs
    // only its new tokens and continues exactly as a fresh session would.
    let mut longer = prompt.to_vec();
    longer.extend_from_slice(&a.tokens);
    let b = run(&mut fresh, &longer);
    assert_eq!(b.timings.reused_tokens, prompt.len() + 5);
    assert_eq!(b.timings.prompt_tokens, 1);
    let mut other = Qwen2Session::new(&model).unwrap();
    let c = run(&mut other, &longer);
    assert_eq!(b.tokens, c.tokens);
    // A prompt that diverges early rolls the cache back.
    let d = run(&mut fresh, &[785, 6722, 315, 9856]);
    assert_eq!(d.timings.reused_tokens, 3);
}

#[test]
fn bad_requests_are_errors() {
    let tiny = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/qwen4exp/tiny/model-f32.gguf");
    let err = Model::load(&tiny, CpuBackend::new(1).unwrap(), &LoadOptions::default())
        .err()
        .expect("a qwen4exp file is not a qwen2 model");
    assert!(
        matches!(err, EngineError::UnsupportedArch { ref found, .. } if found == "qwen4exp"),
        "{err}"
    );
    let Some(model) = load(KvType::F32) else {
        return;
    };
    let mut st = model.new_state().unwrap();
    let n_vocab = model.config().n_vocab as u32;
    let err = model.forward(&mut st, &[1, n_vocab]).unwrap_err();
    assert!(err.to_string().contains("out of range"), "{err}");
    assert_eq!(st.position(), 0);
    assert!(model.forward(&mut st, &[]).is_err());
}
