//! Shared pieces of the sampler and slop tests: a toy vocabulary with a greedy longest-match
//! encoder, a model-free "trunk" (logits a deterministic function of the token history, which
//! prefers to follow a script of slop-laden text), a drafter over a draft vocabulary, and the
//! Qwen2.5 vocabulary fixture.
#![allow(dead_code)]

use std::path::PathBuf;

use strata_engine::generate::Session;
use strata_engine::sampler::vocab::SamplerVocab;
use strata_engine::Result;

/// A small vocabulary: id 0 is a control token (prints nothing), then single characters, then
/// words with and without a leading space.
pub struct ToyVocab {
    pub pieces: Vec<String>,
}

pub const WORDS: &[&str] = &[
    "the",
    "cat",
    "sat",
    "on",
    "mat",
    "delve",
    "del",
    "ve",
    "into",
    "a",
    "rich",
    "tapestry",
    "tap",
    "estry",
    "shiver",
    "shivers",
    "down",
    "her",
    "spine",
    "The",
    "Delve",
    "She",
    "would",
    "ing",
    "of",
    "and",
    "in",
    "conclusion",
    "con",
    "clusion",
    "In",
    "testament",
    "to",
    "is",
    "it",
    "It",
    "important",
    "note",
    "that",
    "mix",
    "dog",
    "ran",
    "home",
];

impl ToyVocab {
    pub fn new() -> ToyVocab {
        let mut pieces = vec![String::new()];
        for c in b'a'..=b'z' {
            pieces.push((c as char).to_string());
        }
        for c in b'A'..=b'Z' {
            pieces.push((c as char).to_string());
        }
        for s in [" ", "\n", "\n\n", "  ", ".", ",", "'", "!", " \n", "\t"] {
            pieces.push(s.to_string());
        }
        for w in WORDS {
            for v in [w.to_string(), format!(" {w}")] {
                if !pieces.contains(&v) {
                    pieces.push(v);
                }
            }
        }
        ToyVocab { pieces }
    }

    pub fn id(&self, piece: &str) -> u32 {
        self.pieces
            .iter()
            .position(|p| p == piece)
            .unwrap_or_else(|| panic!("no token {piece:?}")) as u32
    }

    pub fn text(&self, ids: &[u32]) -> String {
        ids.iter()
            .map(|&i| self.pieces[i as usize].as_str())
            .collect()
    }

    pub fn encode_str(&self, text: &str) -> Vec<u32> {
        let b = text.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i < b.len() {
            let best = self
                .pieces
                .iter()
                .enumerate()
                .skip(1)
                .filter(|(_, p)| !p.is_empty() && b[i..].starts_with(p.as_bytes()))
                .max_by_key(|(id, p)| (p.len(), std::cmp::Reverse(*id)))
                .map(|(id, p)| (id, p.len()));
            match best {
                Some((id, n)) => {
                    out.push(id as u32);
                    i += n;
                }
                // Characters outside the vocabulary are dropped (tests only use ASCII).
                None => i += 1,
            }
        }
        out
    }
}

impl SamplerVocab for ToyVocab {
    fn n_vocab(&self) -> usize {
        self.pieces.len()
    }
    fn piece(&self, id: u32) -> Vec<u8> {
        self.pieces
            .get(id as usize)
            .map(|p| p.as_bytes().to_vec())
            .unwrap_or_default()
    }
    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.encode_str(text))
    }
}

/// SplitMix64: the tests' deterministic randomness.
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform in [-1, 1) from a hash.
pub fn unit(h: u64) -> f32 {
    ((mix(h) >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = mix(self.0);
        self.0
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    pub fn unit(&mut self) -> f32 {
        unit(self.next())
    }
}

/// Logits as a deterministic function of the history: noise keyed by the last tokens and the
/// length, plus a strong preference for the script's next token (the script index is the
/// number of tokens after the prompt, so a detour rejoins the script).
#[derive(Clone)]
pub struct Trunk {
    pub n_vocab: usize,
    pub prompt_len: usize,
    pub script: Vec<u32>,
    pub seed: u64,
    pub bonus: f32,
    pub noise: f32,
}

impl Trunk {
    pub fn logits(&self, history: &[u32]) -> Vec<f32> {
        let mut h = self.seed ^ (history.len() as u64).wrapping_mul(0x1000_0000_01B3);
        for &t in history.iter().rev().take(3) {
            h = mix(h ^ u64::from(t));
        }
        let mut l: Vec<f32> = (0..self.n_vocab as u64)
            .map(|i| self.noise * unit(h ^ i.wrapping_mul(0x2545_F491_4F6C_DD1D)))
            .collect();
        l[0] = f32::NEG_INFINITY; // the control token is never chosen
        if history.len() >= self.prompt_len && !self.script.is_empty() {
            let k = (history.len() - self.prompt_len) % self.script.len();
            l[self.script[k] as usize] += self.bonus;
        }
        l
    }
}

/// A [`Session`] over a [`Trunk`].
pub struct FakeSession {
    pub trunk: Trunk,
    pub tokens: Vec<u32>,
    pub n_ctx: usize,
    pub feeds: usize,
}

impl FakeSession {
    pub fn new(trunk: Trunk) -> Self {
        FakeSession {
            trunk,
            tokens: Vec::new(),
            n_ctx: 4096,
            feeds: 0,
        }
    }
}

impl Session for FakeSession {
    fn n_vocab(&self) -> usize {
        self.trunk.n_vocab
    }
    fn n_ctx(&self) -> usize {
        self.n_ctx
    }
    fn tokens(&self) -> &[u32] {
        &self.tokens
    }
    fn feed(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.tokens.extend_from_slice(tokens);
        self.feeds += 1;
        Ok(self.trunk.logits(&self.tokens))
    }
    fn rewind(&mut self, pos: usize) -> Result<()> {
        assert!(pos <= self.tokens.len());
        self.tokens.truncate(pos);
        Ok(())
    }
}

/// A draft vocabulary: every `keep`-th id of `n_vocab` missing, ids in a shuffled order.
pub fn draft_vocab(n_vocab: usize, seed: u64, drop_every: usize) -> (Vec<u32>, Vec<i32>) {
    let mut ids: Vec<u32> = (0..n_vocab as u32)
        .filter(|&i| drop_every == 0 || i as usize % drop_every != 1)
        .collect();
    let mut r = Rng(seed);
    for i in (1..ids.len()).rev() {
        let j = r.below(i + 1);
        ids.swap(i, j);
    }
    let mut inverse = vec![-1i32; n_vocab];
    for (d, &id) in ids.iter().enumerate() {
        inverse[id as usize] = d as i32;
    }
    (ids, inverse)
}

/// The Qwen2.5 vocabulary fixture in the repository.
pub fn qwen_vocab() -> strata_tokenizer::Tokenizer {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/tokenizer/qwen25-coder-vocab.gguf");
    let f = strata_gguf::GgufFile::open(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    strata_tokenizer::Tokenizer::from_gguf(&f).unwrap()
}

/// The default model (Qwen2.5-Coder-0.5B-Instruct Q4_K_M) when cached, as the CLI finds it.
pub fn default_model() -> Option<PathBuf> {
    const MODEL_FILE: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let path = env("STRATA_DEFAULT_MODEL").or_else(|| {
        env("STRATA_CACHE")
            .map(|d| d.join("models"))
            .or_else(|| env("XDG_CACHE_HOME").map(|d| d.join("strata/models")))
            .or_else(|| env("HOME").map(|d| d.join(".cache/strata/models")))
            .map(|d| d.join(MODEL_FILE))
    })?;
    if path.exists() {
        Some(path)
    } else {
        eprintln!(
            "SKIP: {} not found (run `strata fetch` to cache the default model)",
            path.display()
        );
        None
    }
}
