//! The phrase level on the real default model (Qwen2.5-Coder-0.5B-Instruct Q4_K_M): a phrase
//! the model writes when free, once banned, is not written, and nothing streamed is taken back.
//! Skips with a message when the model is not cached (`strata fetch`).

mod sampler_support;

use std::sync::Arc;

use sampler_support::default_model;
use strata_engine::generate::{GenOptions, Qwen2Session};
use strata_engine::qwen2::{LoadOptions, Model};
use strata_engine::sampler::guard::{self, GuardedGeneration};
use strata_engine::sampler::slop::{ListChoice, SlopConfig};
use strata_engine::sampler::{Pick, Sampler, SamplerConfig, Stage};
use strata_engine::{CpuBackend, KvType};
use strata_gguf::GgufFile;
use strata_tokenizer::Tokenizer;

const PROMPT: &str = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n\
    <|im_start|>user\nWrite a short, vivid story about a lighthouse keeper.<|im_end|>\n\
    <|im_start|>assistant\n";
const N: usize = 48;

/// Phrase-level containment, as the slop stage defines it (ASCII case folded, word start).
fn holds(text: &str, phrase: &str) -> bool {
    let t = text.to_ascii_lowercase();
    let p = phrase.to_ascii_lowercase();
    let word = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b >= 0x80;
    t.match_indices(&p)
        .any(|(s, _)| s == 0 || !word(t.as_bytes()[s - 1]))
}

fn generate(
    model: &Model<CpuBackend>,
    tok: &Tokenizer,
    stages: Vec<Stage>,
) -> (GuardedGeneration, Vec<u32>) {
    let mut sampler = Sampler::with_vocab(
        SamplerConfig {
            stages,
            pick: Pick::Greedy,
        },
        tok,
    )
    .unwrap();
    let prompt = tok.encode(PROMPT, false, true).unwrap();
    let mut session = Qwen2Session::new(model).unwrap();
    let mut streamed = Vec::new();
    let g = guard::generate(
        &mut session,
        &prompt,
        &mut sampler,
        &|t| tok.is_eog(t),
        &GenOptions {
            max_tokens: N,
            prefill_chunk: 512,
        },
        &mut |t| {
            streamed.push(t);
            true
        },
    )
    .unwrap();
    (g, streamed)
}

#[test]
fn banning_a_phrase_the_model_writes() {
    let Some(path) = default_model() else {
        return;
    };
    let file = Arc::new(GgufFile::open(&path).unwrap());
    let tok = Tokenizer::from_gguf(&file).unwrap();
    let model = Model::from_file(
        file,
        CpuBackend::new(2).unwrap(),
        &LoadOptions {
            kv_type: KvType::F16,
        },
    )
    .unwrap();

    let (free, _) = generate(&model, &tok, vec![]);
    let free_text = tok.decode(&free.generation.tokens, false).unwrap();
    // The first two-word phrase (letters only, so a phrase in the matcher's sense) from the
    // fifth word on of what the model writes freely.
    let words: Vec<&str> = free_text.split(' ').collect();
    let alpha = |w: &str| w.len() >= 3 && w.bytes().all(|b| b.is_ascii_alphabetic());
    let i = (4..words.len().saturating_sub(1))
        .find(|&i| alpha(words[i]) && alpha(words[i + 1]))
        .unwrap_or_else(|| panic!("no two-word phrase in {free_text:?}"));
    let phrase = format!("{} {}", words[i], words[i + 1]);
    assert!(holds(&free_text, &phrase), "{phrase:?} in {free_text:?}");

    let ban = |mode: u8| {
        vec![Stage::Slop(SlopConfig {
            mode,
            list: ListChoice::None,
            ban: vec![phrase.clone()],
            ..SlopConfig::default()
        })]
    };
    let (banned, streamed) = generate(&model, &tok, ban(2));
    let text = tok.decode(&banned.generation.tokens, false).unwrap();
    eprintln!(
        "free:   {free_text:?}\nbanned {phrase:?} ({} rewinds): {text:?}",
        banned.rewinds
    );
    assert!(!holds(&text, &phrase), "{phrase:?} in {text:?}");
    assert_ne!(text, free_text);
    // What was streamed is the output, token for token.
    assert_eq!(streamed, banned.generation.tokens);
    // The output agrees with the free run up to where the phrase began.
    let cut = free_text
        .to_ascii_lowercase()
        .find(&phrase.to_ascii_lowercase())
        .unwrap();
    let common = text
        .bytes()
        .zip(free_text.bytes())
        .take_while(|(a, b)| a == b)
        .count();
    assert!(common <= cut + phrase.len(), "{common} > {cut}");
    assert!(
        common >= cut.saturating_sub(16),
        "diverged at {common}, phrase at {cut}"
    );

    // The default list in mode 2 on the same prompt: none of its phrases is written.
    let (g, streamed) = generate(
        &model,
        &tok,
        vec![Stage::Slop(SlopConfig {
            mode: 2,
            ..SlopConfig::default()
        })],
    );
    let text = tok.decode(&g.generation.tokens, false).unwrap();
    let list = strata_engine::sampler::slop::parse_list(
        strata_engine::sampler::slop::DEFAULT_LIST,
        "default",
    )
    .unwrap();
    for e in &list {
        let p = e.phrase.trim();
        let starts_word = p.as_bytes()[0].is_ascii_alphanumeric();
        let t = text.to_ascii_lowercase();
        let found = if starts_word {
            holds(&text, p)
        } else {
            t.contains(&p.to_ascii_lowercase())
        };
        assert!(!found, "{p:?} in {text:?}");
    }
    assert_eq!(streamed, g.generation.tokens);
}
