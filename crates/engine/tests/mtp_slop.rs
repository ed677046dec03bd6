//! Speculative decoding under the sampler chain with slop penalties, on the tiny qwen4exp
//! fixture and its MTP head: for slop modes 1 and 2 (phrases taken from the model's own
//! output, so bans and phrase rewinds really happen; the rewinds, and each roll-back path of
//! the controller, are required by `mode_2_rewinds_take_every_rollback_path`), greedy and seeded, windows 2, 4 and 8,
//! with the head's drafts and with drafts forced to the final tokens, the guarded speculative
//! loop emits exactly the plain guarded loop's tokens (the oracle: `sampler::guard::generate`
//! on a one-token-at-a-time session). Penalized drafts never propose a token the sampler bans;
//! unpenalized ones do.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use common::{tiny_dir, Golden};
use strata_engine::generate::{GenOptions, Qwen4expSession};
use strata_engine::qwen4exp::{LoadOptions, Model};
use strata_engine::sampler::guard::{self, GuardStop};
use strata_engine::sampler::penalties::PenaltyParams;
use strata_engine::sampler::slop::{ListChoice, SlopConfig, SlopEntry};
use strata_engine::sampler::vocab::SamplerVocab;
use strata_engine::sampler::{Pick, Sampler, SamplerConfig, Stage};
use strata_engine::speculative::guarded::{self, SpecGeneration};
use strata_engine::speculative::{DraftHook, SpecConfig, SpecDecoder, SpecStats};
use strata_engine::CpuBackend;
use strata_gguf::GgufFile;
use strata_tokenizer::Tokenizer;

type M = Model<CpuBackend>;

const NEW: usize = 40;

fn model() -> M {
    let m = Model::load(
        tiny_dir().join("model-f32.gguf"),
        CpuBackend::new(2).unwrap(),
        &LoadOptions::default(),
    )
    .unwrap();
    common::with_mtp_head(m, &tiny_dir().join("hf"), false)
}

fn tokenizer() -> Tokenizer {
    Tokenizer::from_gguf(&GgufFile::open(tiny_dir().join("model-f32.gguf")).unwrap()).unwrap()
}

fn prompt() -> Vec<u32> {
    Golden::open(tiny_dir().join("golden.safetensors")).ids("input_ids")[..30].to_vec()
}

fn config(mode: u8, pick: &Pick, entries: &[(String, f32)]) -> SamplerConfig {
    let mut stages = vec![
        Stage::Penalties(PenaltyParams {
            last_n: 32,
            repeat: 1.05,
            frequency: 0.0,
            presence: 0.0,
        }),
        Stage::Slop(SlopConfig {
            mode,
            list: ListChoice::None,
            entries: entries
                .iter()
                .map(|(p, v)| SlopEntry {
                    phrase: p.clone(),
                    penalty: *v,
                })
                .collect(),
            newline_run_cap: 2,
            blank_run_cap: 3,
            max_rewinds: 16,
            ..SlopConfig::default()
        }),
    ];
    if let Pick::Draw { .. } = pick {
        stages.extend([Stage::TopK { k: 20 }, Stage::Temperature { t: 0.9 }]);
    }
    SamplerConfig {
        stages,
        pick: pick.clone(),
    }
}

struct Plain {
    tokens: Vec<u32>,
    stop: GuardStop,
    rewinds: u32,
}

fn plain(m: &M, tok: &Tokenizer, cfg: &SamplerConfig) -> Plain {
    plain_on(m, tok, cfg, &prompt())
}

fn plain_on(m: &M, tok: &Tokenizer, cfg: &SamplerConfig, prompt: &[u32]) -> Plain {
    let mut sampler = Sampler::with_vocab(cfg.clone(), tok).unwrap();
    let mut streamed = Vec::new();
    let g = guard::generate(
        &mut Qwen4expSession::new(m).unwrap(),
        prompt,
        &mut sampler,
        &|t| tok.is_eog(t),
        &GenOptions {
            max_tokens: NEW,
            prefill_chunk: 512,
        },
        &mut |t| {
            streamed.push(t);
            true
        },
    )
    .unwrap();
    assert_eq!(streamed, g.generation.tokens);
    Plain {
        tokens: g.generation.tokens,
        stop: g.stop,
        rewinds: g.rewinds,
    }
}

/// Drafts forced to the plain run's final token at each position (so most are accepted, then
/// some are taken back by rewinds); the head's proposals are recorded.
struct Forced {
    truth: Option<Vec<u32>>,
    proposed: Arc<std::sync::Mutex<Vec<u32>>>,
}

impl DraftHook for Forced {
    fn draft(&mut self, position: usize, proposed: u32) -> Option<u32> {
        self.proposed.lock().unwrap().push(proposed);
        match &self.truth {
            Some(t) => Some(t.get(position).copied().unwrap_or(proposed)),
            None => Some(proposed),
        }
    }
}

struct Spec {
    g: SpecGeneration,
    stats: SpecStats,
    proposed: Vec<u32>,
}

fn spec(
    m: &M,
    tok: &Tokenizer,
    cfg: &SamplerConfig,
    window: usize,
    truth: Option<Vec<u32>>,
    penalize: bool,
) -> Spec {
    spec_on(m, tok, cfg, &prompt(), window, truth, penalize)
}

fn spec_on(
    m: &M,
    tok: &Tokenizer,
    cfg: &SamplerConfig,
    prompt: &[u32],
    window: usize,
    truth: Option<Vec<u32>>,
    penalize: bool,
) -> Spec {
    let mut sampler = Sampler::with_vocab(cfg.clone(), tok).unwrap();
    let proposed = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut dec = SpecDecoder::new(
        m,
        SpecConfig {
            window,
            ..SpecConfig::default()
        },
    )
    .unwrap()
    .with_draft_penalties(penalize)
    .with_draft_hook(Forced {
        truth,
        proposed: Arc::clone(&proposed),
    });
    let mut streamed = Vec::new();
    let g = guarded::generate(
        &mut dec,
        prompt,
        &mut sampler,
        &|t| tok.is_eog(t),
        NEW,
        &mut |t| {
            streamed.push(t);
            true
        },
    )
    .unwrap();
    assert_eq!(streamed, g.tokens, "streamed tokens are the output");
    let proposed = proposed.lock().unwrap().clone();
    Spec {
        g,
        stats: dec.stats().clone(),
        proposed,
    }
}

fn text(tok: &Tokenizer, ids: &[u32]) -> String {
    let bytes: Vec<u8> = ids.iter().flat_map(|&t| tok.piece(t)).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The text of `ids[k..k + len]` when it is whole UTF-8 (two bytes at least for two tokens), not blank, and
/// matchable where it stands (a phrase starting with a letter or digit matches only at a word
/// start): the model's own text, so the phrase is sure to come up.
fn phrase_at(tok: &Tokenizer, ids: &[u32], k: usize, len: usize) -> Option<String> {
    let bytes: Vec<u8> = ids
        .get(k..k + len)?
        .iter()
        .flat_map(|&t| tok.piece(t))
        .collect();
    let s = String::from_utf8(bytes).ok()?;
    let first = *s.as_bytes().first()?;
    let before = ids.get(..k).and_then(|b| b.last()).map(|&t| tok.piece(t));
    let at_word_start = before
        .and_then(|p| p.last().copied())
        .is_none_or(|b| !b.is_ascii_alphanumeric() && b != b'_' && b < 0x80);
    let ok = s.len() >= len.min(2)
        && !s.trim().is_empty()
        && s.trim() == s
        && (!first.is_ascii_alphanumeric() || at_word_start);
    ok.then_some(s)
}

/// Phrases the model hits with `pick`: a single token of the free (slop-off) run banned
/// outright (token level, modes 1 and 2), then, from the output under that ban, a phrase that
/// starts inside a token and ends in the next (only the text matcher sees it, so mode 2 must
/// rewind), the first such candidate with which the plain mode-2 run does rewind.
fn phrases(m: &M, tok: &Tokenizer, pick: &Pick) -> Vec<(String, f32)> {
    let free = plain(m, tok, &config(0, pick, &[]));
    let first = (2..free.tokens.len())
        .find_map(|k| phrase_at(tok, &free.tokens, k, 1))
        .expect("a token to ban in the free output");
    let mut out = vec![(first, f32::INFINITY)];
    let banned = plain(m, tok, &config(1, pick, &out));
    let ids = &banned.tokens;
    for (k, span) in (1..ids.len().saturating_sub(2)).flat_map(|k| [(k, 2), (k, 3)]) {
        let a = tok.piece(ids[k]);
        let rest: Vec<u8> = ids[k + 1..k + span]
            .iter()
            .flat_map(|&t| tok.piece(t))
            .collect();
        for cut in 0..a.len() {
            let mut ph = a[cut..].to_vec();
            ph.extend_from_slice(&rest);
            let Ok(ph) = String::from_utf8(ph) else {
                continue;
            };
            if ph.len() < 2 || ph.trim() != ph || ph.chars().any(|c| c.is_control()) {
                continue;
            }
            let mut cand = out.clone();
            cand.push((ph, f32::INFINITY));
            if plain(m, tok, &config(2, pick, &cand)).rewinds > 0 {
                out = cand;
                return out;
            }
        }
    }
    // On the tiny fixture this search seldom finds one (the mode-1 text it searches is not
    // the mode-2 path); `mode_2_rewinds_take_every_rollback_path` covers the rewinds.
    eprintln!("no phrase makes mode 2 rewind: {:?}", text(tok, ids));
    out
}

fn picks() -> [Pick; 2] {
    [Pick::Greedy, Pick::Draw { seed: 1234 }]
}

#[test]
fn speculative_equals_plain_with_slop_modes_1_and_2() {
    let m = model();
    let tok = tokenizer();
    let mut rewinding = 0;
    for pick in picks() {
        let entries = phrases(&m, &tok, &pick);
        let free = plain(&m, &tok, &config(0, &pick, &[]));
        for mode in [1u8, 2] {
            let cfg = config(mode, &pick, &entries);
            let want = plain(&m, &tok, &cfg);
            let what = format!("mode {mode} {pick:?} phrases {entries:?}");
            // The list acted on this run.
            assert_ne!(
                want.tokens, free.tokens,
                "{what}: the penalties changed nothing"
            );
            if mode == 2 {
                if want.rewinds > 0 {
                    rewinding += 1;
                }
                let lower = text(&tok, &want.tokens).to_lowercase();
                for (p, v) in &entries {
                    if v.is_infinite() {
                        assert!(
                            !lower.contains(&p.to_lowercase()),
                            "{what}: {p:?} in output"
                        );
                    }
                }
            }
            let mut truth = prompt();
            truth.extend_from_slice(&want.tokens);
            for window in [2usize, 4, 8] {
                for forced in [false, true] {
                    let got = spec(&m, &tok, &cfg, window, forced.then(|| truth.clone()), true);
                    let label = format!("{what} window {window} forced {forced}");
                    assert_eq!(
                        got.g.tokens,
                        want.tokens,
                        "{label}:\n{:?}\n{:?}",
                        text(&tok, &got.g.tokens),
                        text(&tok, &want.tokens)
                    );
                    assert_eq!(got.g.stop, want.stop, "{label}");
                    assert_eq!(got.g.rewinds, want.rewinds, "{label}");
                    if forced {
                        // Acceptance paths: most forced drafts are taken.
                        let a = got.stats.acceptance_all().unwrap_or(0.0);
                        assert!(a > 0.5, "{label}: acceptance {a}");
                        assert!(got.stats.tokens_per_pass() > 1.3, "{label}");
                    }
                }
            }
        }
    }
    eprintln!("mode-2 runs with rewinds: {rewinding} of 2");
}

/// With the drafts penalized, the head never proposes a token that the sampler removes
/// outright; without, it does (the same words are the head's favourites), and the output is
/// the same either way.
#[test]
fn penalized_drafts_never_propose_banned_tokens() {
    let m = model();
    let tok = tokenizer();
    let pick = Pick::Greedy;
    let base = config(1, &pick, &[]);
    let free = spec(&m, &tok, &base, 4, None, false);
    // The head's favourite words.
    let mut counts: HashMap<u32, usize> = HashMap::new();
    for &t in &free.proposed {
        *counts.entry(t).or_default() += 1;
    }
    let mut fav: Vec<(u32, usize)> = counts.into_iter().collect();
    fav.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let words: Vec<(String, f32)> = fav
        .iter()
        .filter_map(|&(t, _)| {
            let p = tok.piece(t);
            let w = p.strip_prefix(b" ").unwrap_or(&p);
            (!w.is_empty() && w.iter().all(|b| b.is_ascii_alphanumeric()))
                .then(|| (String::from_utf8_lossy(w).into_owned(), f32::INFINITY))
        })
        .take(4)
        .collect();
    assert!(!words.is_empty(), "no word among the head's proposals");
    for mode in [1u8, 2] {
        let cfg = config(mode, &pick, &words);
        let sampler = Sampler::with_vocab(cfg.clone(), &tok).unwrap();
        let banned: Vec<u32> = sampler
            .slop()
            .unwrap()
            .token_penalties()
            .iter()
            .filter(|(_, p)| p.is_infinite())
            .map(|&(t, _)| t)
            .collect();
        assert!(
            fav.iter().take(8).any(|(t, _)| banned.contains(t)),
            "mode {mode}: the bans miss the head's favourites"
        );
        let on = spec(&m, &tok, &cfg, 4, None, true);
        let off = spec(&m, &tok, &cfg, 4, None, false);
        let bad_on = on.proposed.iter().filter(|t| banned.contains(t)).count();
        let bad_off = off.proposed.iter().filter(|t| banned.contains(t)).count();
        assert_eq!(
            bad_on, 0,
            "mode {mode}: penalized drafts proposed banned tokens"
        );
        assert!(
            bad_off > 0,
            "mode {mode}: unpenalized drafts never hit a ban"
        );
        assert_eq!(on.g.tokens, off.g.tokens, "mode {mode}");
        let want = plain(&m, &tok, &cfg);
        assert_eq!(on.g.tokens, want.tokens, "mode {mode}");
        let (a_on, a_off) = (
            on.stats.acceptance_all().unwrap_or(0.0),
            off.stats.acceptance_all().unwrap_or(0.0),
        );
        eprintln!("mode {mode}: acceptance {a_on:.3} with penalized drafts, {a_off:.3} without");
        assert!(a_on >= a_off, "mode {mode}: {a_on} < {a_off}");
    }
}

/// Word bytes as the phrase matcher reads them (`sampler::slop`): a phrase starting with one
/// matches only after a byte that is not one.
fn word_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b >= 0x80
}

/// A phrase that makes the plain mode-2 loop rewind at generated index `at`.
struct Rewinding {
    phrase: String,
    penalty: f32,
    at: usize,
}

/// Phrases that the free mode-2 output `pre` (no list) contains through a tokenization the
/// token level does not know: text starting inside (or at) token `g` and ending with token
/// `g + len - 1`, at a place where the text matcher can see it. Each is kept only when the
/// plain loop with that phrase listed follows `pre` up to `g` and then rewinds there (token
/// `g` banned and sampled again), so the rewind is the one the speculative loop must mirror.
/// Alternates infinite and finite penalties (the text level rewinds on either).
fn rewinding_phrases(
    m: &M,
    tok: &Tokenizer,
    pick: &Pick,
    prompt: &[u32],
    pre: &[u32],
    want: usize,
) -> Vec<Rewinding> {
    let lower: Vec<Vec<u8>> = pre
        .iter()
        .map(|&t| tok.piece(t).to_ascii_lowercase())
        .collect();
    let mut found: Vec<Rewinding> = Vec::new();
    let mut g = 1;
    'outer: while g + 1 < pre.len() && found.len() < want {
        for len in [2usize, 3] {
            if g + len > pre.len() {
                continue;
            }
            let a = tok.piece(pre[g]);
            let rest: Vec<u8> = pre[g + 1..g + len]
                .iter()
                .flat_map(|&t| tok.piece(t))
                .collect();
            // Ends inside the last token too (the match completes at that byte).
            let last = tok.piece(pre[g + len - 1]).len();
            let ends = (rest.len() + 1 - last.min(rest.len())..=rest.len()).rev();
            for (cut, end) in (0..a.len()).flat_map(|c| ends.clone().map(move |e| (c, e))) {
                let mut bytes = a[cut..].to_vec();
                bytes.extend_from_slice(&rest[..end]);
                let Ok(ph) = String::from_utf8(bytes) else {
                    continue;
                };
                if ph.len() < 2 || ph.trim() != ph || ph.chars().any(|c| c.is_control()) {
                    continue;
                }
                // The matcher's word-start rule, on the lower-cased text before the phrase.
                let before = if cut > 0 {
                    lower[g].get(cut - 1).copied()
                } else {
                    lower[..g].iter().rev().find_map(|p| p.last().copied())
                };
                let first = ph.as_bytes()[0].to_ascii_lowercase();
                if word_byte(first) && before.is_some_and(word_byte) {
                    continue;
                }
                let penalty = if found.len().is_multiple_of(2) {
                    f32::INFINITY
                } else {
                    4.0
                };
                let cfg = config(2, pick, &[(ph.clone(), penalty)]);
                let with = plain_on(m, tok, &cfg, prompt);
                if with.rewinds > 0
                    && with.tokens.get(..g) == pre.get(..g)
                    && with.tokens.get(g) != pre.get(g)
                {
                    found.push(Rewinding {
                        phrase: ph,
                        penalty,
                        at: g,
                    });
                    g += len;
                    continue 'outer;
                }
            }
        }
        g += 1;
    }
    found
}

/// Mode-2 rewinds in the real speculative controller: phrases the output only reaches
/// through a tokenization the token level cannot pre-empt, so the phrase level completes a
/// match and rewinds. With drafts forced to the pre-rewind path (the phrase inside the
/// windows), to the final path, and the head's own, and windows 2, 4 and 8, the rewinds land
/// inside a window, at a window's start and further back (a rebuild); every run must equal
/// the plain guarded loop (tokens, stop, rewind count) and each roll-back path must run.
#[test]
fn mode_2_rewinds_take_every_rollback_path() {
    let m = model();
    let tok = tokenizer();
    let golden = Golden::open(tiny_dir().join("golden.safetensors")).ids("input_ids");
    let prompts = [
        golden[..30].to_vec(),
        golden[3..19].to_vec(),
        golden[..9].to_vec(),
        golden[12..].to_vec(),
    ];
    let (mut rewinds, mut in_window, mut at_start, mut rebuilt) = (0u64, 0u64, 0u64, 0u64);
    let mut phrases_used = 0;
    for pick in picks() {
        let mut of_pick = 0;
        for (pi, prompt) in prompts.iter().enumerate() {
            let pre = plain_on(&m, &tok, &config(2, &pick, &[]), prompt);
            assert_eq!(pre.rewinds, 0);
            let found = rewinding_phrases(&m, &tok, &pick, prompt, &pre.tokens, 3);
            eprintln!(
                "{pick:?} prompt {pi}: {} phrases, {:?}",
                found.len(),
                text(&tok, &pre.tokens)
            );
            for r in &found {
                phrases_used += 1;
                of_pick += 1;
                let cfg = config(2, &pick, &[(r.phrase.clone(), r.penalty)]);
                let want = plain_on(&m, &tok, &cfg, prompt);
                let what = format!(
                    "{pick:?} prompt {pi} phrase {:?} ({}) at {}",
                    r.phrase, r.penalty, r.at
                );
                assert!(want.rewinds > 0, "{what}");
                let lower = text(&tok, &want.tokens).to_ascii_lowercase();
                if r.penalty.is_infinite() {
                    assert!(!lower.contains(&r.phrase.to_ascii_lowercase()), "{what}");
                }
                let path = |t: &[u32]| {
                    let mut v = prompt.clone();
                    v.extend_from_slice(t);
                    v
                };
                let truths = [
                    ("pre-rewind", Some(path(&pre.tokens))),
                    ("final", Some(path(&want.tokens))),
                    ("head", None),
                ];
                for window in [2usize, 4, 8] {
                    for (name, truth) in &truths {
                        let got = spec_on(&m, &tok, &cfg, prompt, window, truth.clone(), true);
                        let label = format!("{what} window {window} drafts {name}");
                        assert_eq!(got.g.tokens, want.tokens, "{label}");
                        assert_eq!(got.g.stop, want.stop, "{label}");
                        assert_eq!(got.g.rewinds, want.rewinds, "{label}");
                        let s = &got.stats;
                        // Every rewind was rolled back by exactly one path (two rewinds in
                        // one pass count once).
                        let paths = s.rewinds_in_window + s.rewinds_at_start + s.rewinds_rebuilt;
                        assert!(
                            paths >= 1 && paths <= u64::from(got.g.rewinds),
                            "{label}: {paths} roll-backs for {} rewinds",
                            got.g.rewinds
                        );
                        rewinds += u64::from(got.g.rewinds);
                        in_window += s.rewinds_in_window;
                        at_start += s.rewinds_at_start;
                        rebuilt += s.rewinds_rebuilt;
                    }
                }
            }
        }
        assert!(of_pick > 0, "{pick:?}: no phrase makes mode 2 rewind");
    }
    eprintln!(
        "{phrases_used} rewinding phrases; speculative rewinds {rewinds}: rolled back in window \
         {in_window}, at window start {at_start}, rebuilt {rebuilt}"
    );
    assert!(phrases_used >= 4, "too few rewinding phrases found");
    assert!(rewinds > 0);
    assert!(in_window > 0, "no rewind rolled back inside a window");
    assert!(at_start > 0, "no rewind rolled back to a window start");
    assert!(rebuilt > 0, "no rewind rebuilt the states");
}
