//! Slop penalties (DESIGN.md §5): the configuration and its JSON form, the slop-list file,
//! the tables compiled against a vocabulary, and the per-sequence state, in the semantics of
//! the draft-path kernel ([`crate::kernels::slop`], the report's `mtp_slop_pen`) so that the
//! sampler and the drafts penalize identically.
//!
//! **Token level** (modes 1 and 2, the kernel's semantics):
//! - each list phrase is tokenized in a few spellings (as written, capitalized, lower case,
//!   each with and without a leading space); a spelling that is one token puts that token on
//!   the penalty list (several entries on one token: the largest penalty), one of two or more
//!   tokens goes to the phrase table;
//! - runs: consecutive blank tokens (non-empty, whitespace only) and consecutive newline
//!   tokens (blank tokens holding a `\n`), classes computed from the vocabulary; once a run
//!   reaches its cap, every token of that class is removed (−∞) until something else comes;
//! - mode 2 also follows the phrase table: while the latest tokens are a proper prefix of a
//!   phrase, that phrase's next token is lowered by its penalty, and removed if it would
//!   complete the phrase; tokens banned at this position by a rewind are removed.
//!
//! **Phrase level** (mode 2): a listed phrase must not appear in the output *text*, however it
//! was tokenized. The generated text is matched as text: ASCII case folded, and a phrase whose
//! first character is a letter or digit only matches at the start of a word (so "delve"
//! matches "Delves" but not "undelve"). When a match completes, the sequence rewinds to the
//! token holding the match's first byte, bans that token at that position and samples again.
//! Matching text rather than token sequences catches every tokenization; the token-level table
//! is what lets the drafts (and the sampler, before it has to rewind) steer away early.
//!
//! Streaming: a token is final once no partial match could still complete over it, so the
//! caller streams [`SlopState::take_commits`] and never retracts text. Rewinds are bounded by
//! `max_rewinds` per sequence; past it, and when every continuation at a position is banned
//! and the token before it was already streamed, generation stops short of the phrase (see
//! [`Accepted`] and [`DeadEnd`]).

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::view::{DraftEdit, LogitEdit};
use super::vocab::SamplerVocab;
use crate::error::{EngineError, Result};
use crate::kernels::slop::{SlopTables, MAX_MATCHES, RUN_LIMIT, STATE_LEN};

/// The default slop list (an editable file in the source tree, built in).
pub const DEFAULT_LIST: &str = include_str!("../../data/slop.txt");
const DEFAULT_LIST_NAME: &str = "the built-in slop list (crates/engine/data/slop.txt)";

/// Which base list a configuration starts from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ListChoice {
    /// The built-in list ([`DEFAULT_LIST`]).
    #[default]
    Default,
    /// No base list: only `entries` and `ban`.
    None,
}

/// One phrase and its penalty (a logit amount; `inf` bans the phrase's tokens outright).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlopEntry {
    pub phrase: String,
    #[serde(with = "penalty_serde")]
    pub penalty: f32,
}

/// JSON has no infinity: an infinite penalty is written as the string "inf".
mod penalty_serde {
    use serde::de::Error;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &f32, s: S) -> Result<S::Ok, S::Error> {
        if v.is_infinite() {
            s.serialize_str("inf")
        } else {
            s.serialize_f32(*v)
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f32, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum P {
            N(f32),
            S(String),
        }
        match P::deserialize(d)? {
            P::N(x) => Ok(x),
            P::S(s) if s == "inf" => Ok(f32::INFINITY),
            P::S(s) => Err(D::Error::custom(format!(
                "penalty {s:?}: expected a number or \"inf\""
            ))),
        }
    }
}

/// The slop stage's settings: the JSON object of a `{"type":"slop", ...}` stage.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlopConfig {
    /// 0 off, 1 token level, 2 phrase level with rewind.
    pub mode: u8,
    #[serde(default)]
    pub list: ListChoice,
    /// Entries added to the base list.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub entries: Vec<SlopEntry>,
    /// Phrases banned outright (penalty `inf`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ban: Vec<String>,
    /// Longest run of newline tokens (0: no cap).
    #[serde(default = "default_newline_cap")]
    pub newline_run_cap: u32,
    /// Longest run of blank tokens (0: no cap).
    #[serde(default = "default_blank_cap")]
    pub blank_run_cap: u32,
    /// Most phrase rewinds per sequence (mode 2).
    #[serde(default = "default_max_rewinds")]
    pub max_rewinds: u32,
}

fn default_newline_cap() -> u32 {
    3
}
fn default_blank_cap() -> u32 {
    4
}
fn default_max_rewinds() -> u32 {
    64
}

impl Default for SlopConfig {
    fn default() -> Self {
        SlopConfig {
            mode: 0,
            list: ListChoice::Default,
            entries: Vec::new(),
            ban: Vec::new(),
            newline_run_cap: default_newline_cap(),
            blank_run_cap: default_blank_cap(),
            max_rewinds: default_max_rewinds(),
        }
    }
}

impl SlopConfig {
    pub fn validate(&self) -> std::result::Result<(), String> {
        if self.mode > 2 {
            return Err(format!("slop mode {}; expected 0, 1 or 2", self.mode));
        }
        for e in &self.entries {
            check_entry(&e.phrase, e.penalty)?;
        }
        for b in &self.ban {
            check_entry(b, f32::INFINITY)?;
        }
        for (what, cap) in [
            ("newline_run_cap", self.newline_run_cap),
            ("blank_run_cap", self.blank_run_cap),
        ] {
            if cap > i32::MAX as u32 {
                return Err(format!("slop {what} {cap} is too large"));
            }
        }
        Ok(())
    }

    /// Every entry in effect, the base list first.
    pub fn all_entries(&self) -> Result<Vec<SlopEntry>> {
        let mut v = match self.list {
            ListChoice::Default => parse_list(DEFAULT_LIST, DEFAULT_LIST_NAME)?,
            ListChoice::None => Vec::new(),
        };
        v.extend(self.entries.iter().cloned());
        v.extend(self.ban.iter().map(|p| SlopEntry {
            phrase: p.clone(),
            penalty: f32::INFINITY,
        }));
        Ok(v)
    }
}

fn check_entry(phrase: &str, penalty: f32) -> std::result::Result<(), String> {
    if phrase.trim().is_empty() {
        return Err("a slop phrase is empty".to_string());
    }
    if penalty.is_nan() || penalty < 0.0 {
        return Err(format!(
            "slop phrase {phrase:?}: penalty {penalty}; expected a number ≥ 0 or inf"
        ));
    }
    Ok(())
}

/// Parses a slop-list file. One entry per line: the phrase as a JSON string (so leading
/// spaces, quotes and `\n` can be written), then whitespace and the penalty, a number ≥ 0 or
/// `inf`. Blank lines and lines starting with `#` are skipped. `source` names the file in
/// errors.
pub fn parse_list(text: &str, source: &str) -> Result<Vec<SlopEntry>> {
    let mut out = Vec::new();
    for (n, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let bad = |what: String| EngineError::Input(format!("{source}:{}: {what}", n + 1));
        if !line.starts_with('"') {
            return Err(bad(format!(
                "expected a quoted phrase then a penalty, e.g. \"delve\" 2.5; found {line:?}"
            )));
        }
        let mut it = serde_json::Deserializer::from_str(line).into_iter::<String>();
        let phrase = match it.next() {
            Some(Ok(p)) => p,
            Some(Err(e)) => return Err(bad(format!("the phrase is not a valid JSON string: {e}"))),
            None => return Err(bad("no phrase".to_string())),
        };
        let rest = line[it.byte_offset()..].trim();
        let penalty = match rest {
            "inf" => f32::INFINITY,
            "" => return Err(bad(format!("phrase {phrase:?} has no penalty"))),
            s => s.parse::<f32>().map_err(|_| {
                bad(format!(
                    "penalty {s:?} of phrase {phrase:?}; expected a number ≥ 0 or inf"
                ))
            })?,
        };
        check_entry(&phrase, penalty).map_err(bad)?;
        out.push(SlopEntry { phrase, penalty });
    }
    Ok(out)
}

/// Token classes of the vocabulary: bit 0 newline, bit 1 blank.
const NEWLINE: u8 = 1;
const BLANK: u8 = 2;

/// Blank: non-empty and whitespace only. Newline: blank and holding a `\n`. (A token such as
/// `}\n` is not a newline token: with it, a cap on newline runs would cut off closing braces.
/// This reading gives 201 newline tokens for the Qwen2.5 vocabulary, the size of the report's
/// table of 200; "any token containing \n" would give 2178.)
fn classify(piece: &[u8]) -> u8 {
    let blank = std::str::from_utf8(piece)
        .map(|s| !s.is_empty() && s.chars().all(char::is_whitespace))
        .unwrap_or(false);
    match (blank, piece.contains(&b'\n')) {
        (true, true) => BLANK | NEWLINE,
        (true, false) => BLANK,
        _ => 0,
    }
}

/// A byte that belongs to a word: ASCII letters, digits, `_`, and any non-ASCII byte (so
/// letters outside ASCII count as word characters).
fn word_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b >= 0x80
}

#[derive(Clone, Debug)]
struct TextPhrase {
    /// Trimmed, ASCII lower case.
    bytes: Vec<u8>,
    /// Only matches at the start of a word.
    word_start: bool,
}

/// Token-level state between steps: the runs and the open phrase matches, exactly the
/// kernel's state array ([`CompiledSlop::kernel_state`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TokenState {
    pub newline_run: i32,
    pub blank_run: i32,
    /// (phrase, tokens matched so far), in the kernel's order.
    pub matches: Vec<(u32, u32)>,
}

/// The slop configuration compiled against a vocabulary; shared by every sequence.
pub struct CompiledSlop {
    mode: u8,
    n_vocab: usize,
    /// Single-token entries: (id, penalty), distinct ids in ascending order.
    pen: Vec<(u32, f32)>,
    class: Vec<u8>,
    newline: Vec<u32>,
    blank: Vec<u32>,
    cap_newline: u32,
    cap_blank: u32,
    /// Token phrases (two tokens or more) and their penalties, in table order.
    phrases: Vec<(Vec<u32>, f32)>,
    /// First token → phrases starting with it, ascending.
    opens: HashMap<u32, Vec<u32>>,
    text: Vec<TextPhrase>,
    /// First byte → text phrases starting with it, ascending.
    text_first: Vec<Vec<u32>>,
    /// Lower-cased token texts (mode 2 only).
    pieces: Vec<Box<[u8]>>,
    max_rewinds: u32,
}

impl std::fmt::Debug for CompiledSlop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompiledSlop")
            .field("mode", &self.mode)
            .field("n_vocab", &self.n_vocab)
            .field("token_penalties", &self.pen.len())
            .field("newline_class", &self.newline.len())
            .field("blank_class", &self.blank.len())
            .field("token_phrases", &self.phrases.len())
            .field("text_phrases", &self.text.len())
            .finish()
    }
}

/// The spellings of a phrase that the token level looks for.
fn spellings(p: &str) -> Vec<String> {
    let mut cap = String::new();
    let mut chars = p.chars();
    if let Some(c) = chars.next() {
        cap.extend(c.to_uppercase());
        cap.push_str(chars.as_str());
    }
    let lower = p.to_lowercase();
    let mut out: Vec<String> = Vec::new();
    for s in [p.to_string(), cap, lower] {
        for v in [s.clone(), format!(" {s}")] {
            if !out.contains(&v) {
                out.push(v);
            }
        }
    }
    out
}

impl CompiledSlop {
    /// Compiles `cfg` against `vocab`: token classes, the token tables and the text phrases.
    pub fn compile(cfg: &SlopConfig, vocab: &dyn SamplerVocab) -> Result<CompiledSlop> {
        cfg.validate().map_err(EngineError::Input)?;
        let n_vocab = vocab.n_vocab();
        let mut class = vec![0u8; n_vocab];
        let mut pieces = Vec::new();
        for (id, c) in class.iter_mut().enumerate() {
            let p = vocab.piece(id as u32);
            *c = classify(&p);
            if cfg.mode == 2 {
                pieces.push(p.to_ascii_lowercase().into_boxed_slice());
            }
        }
        let ids_of = |bit: u8| -> Vec<u32> {
            (0..n_vocab as u32)
                .filter(|&i| class[i as usize] & bit != 0)
                .collect()
        };
        let newline = ids_of(NEWLINE);
        let blank = ids_of(BLANK);

        let mut pen: HashMap<u32, f32> = HashMap::new();
        let mut phrases: Vec<(Vec<u32>, f32)> = Vec::new();
        let mut phrase_at: HashMap<Vec<u32>, usize> = HashMap::new();
        let mut text: Vec<TextPhrase> = Vec::new();
        for e in cfg.all_entries()? {
            let p = e.phrase.trim();
            let bytes = p.as_bytes().to_ascii_lowercase();
            if !text.iter().any(|t| t.bytes == bytes) {
                text.push(TextPhrase {
                    word_start: word_byte(bytes[0]),
                    bytes,
                });
            }
            for s in spellings(p) {
                let toks = vocab.encode(&s)?;
                if let Some(&bad) = toks.iter().find(|&&t| t as usize >= n_vocab) {
                    return Err(EngineError::Input(format!(
                        "slop phrase {s:?} tokenized to id {bad}, outside the vocabulary of {n_vocab}"
                    )));
                }
                match toks.len() {
                    0 => {}
                    1 => {
                        let v = pen.entry(toks[0]).or_insert(e.penalty);
                        *v = v.max(e.penalty);
                    }
                    _ => match phrase_at.get(&toks) {
                        Some(&i) => phrases[i].1 = phrases[i].1.max(e.penalty),
                        None => {
                            phrase_at.insert(toks.clone(), phrases.len());
                            phrases.push((toks, e.penalty));
                        }
                    },
                }
            }
        }
        let mut pen: Vec<(u32, f32)> = pen.into_iter().collect();
        pen.sort_unstable_by_key(|e| e.0);
        let mut opens: HashMap<u32, Vec<u32>> = HashMap::new();
        for (i, (toks, _)) in phrases.iter().enumerate() {
            opens.entry(toks[0]).or_default().push(i as u32);
        }
        let mut text_first = vec![Vec::new(); 256];
        for (i, t) in text.iter().enumerate() {
            text_first[t.bytes[0] as usize].push(i as u32);
        }
        Ok(CompiledSlop {
            mode: cfg.mode,
            n_vocab,
            pen,
            class,
            newline,
            blank,
            cap_newline: cfg.newline_run_cap,
            cap_blank: cfg.blank_run_cap,
            phrases,
            opens,
            text,
            text_first,
            pieces,
            max_rewinds: cfg.max_rewinds,
        })
    }

    pub fn mode(&self) -> u8 {
        self.mode
    }
    pub fn n_vocab(&self) -> usize {
        self.n_vocab
    }
    /// The newline and blank classes (ascending ids).
    pub fn classes(&self) -> (&[u32], &[u32]) {
        (&self.newline, &self.blank)
    }
    /// Single-token penalties (ascending ids).
    pub fn token_penalties(&self) -> &[(u32, f32)] {
        &self.pen
    }
    /// The token phrase table.
    pub fn token_phrases(&self) -> &[(Vec<u32>, f32)] {
        &self.phrases
    }
    pub fn max_rewinds(&self) -> u32 {
        self.max_rewinds
    }

    /// The state after `tok` follows `s` (the kernel's `advance`).
    pub fn advance(&self, s: &TokenState, tok: u32) -> TokenState {
        let c = self.class.get(tok as usize).copied().unwrap_or(0);
        let bump = |run: i32, hit: bool| if hit { (run + 1).min(RUN_LIMIT) } else { 0 };
        let mut out = TokenState {
            newline_run: bump(s.newline_run, c & NEWLINE != 0),
            blank_run: bump(s.blank_run, c & BLANK != 0),
            matches: Vec::new(),
        };
        if self.mode < 2 {
            return out;
        }
        for &(p, m) in &s.matches {
            let ph = &self.phrases[p as usize].0;
            if ph[m as usize] == tok
                && (m as usize) + 1 < ph.len()
                && out.matches.len() < MAX_MATCHES
            {
                out.matches.push((p, m + 1));
            }
        }
        if let Some(ps) = self.opens.get(&tok) {
            for &p in ps {
                if out.matches.len() < MAX_MATCHES {
                    out.matches.push((p, 1));
                }
            }
        }
        out
    }

    /// The token-level penalties for the next token (the kernel's `apply`, same order of
    /// operations, so the same bits).
    pub fn penalize(&self, s: &TokenState, banned: &[u32], e: &mut dyn LogitEdit) {
        if self.mode == 0 {
            return;
        }
        for &(id, p) in &self.pen {
            e.edit(id, &mut |l: &mut f32| *l -= p);
        }
        let remove = &mut |l: &mut f32| *l = f32::NEG_INFINITY;
        for (run, cap, class) in [
            (s.newline_run, self.cap_newline, &self.newline),
            (s.blank_run, self.cap_blank, &self.blank),
        ] {
            if cap > 0 && run >= cap as i32 {
                for &id in class.iter() {
                    e.edit(id, remove);
                }
            }
        }
        if self.mode < 2 {
            return;
        }
        for &(p, m) in &s.matches {
            let (ph, pen) = &self.phrases[p as usize];
            let next = ph[m as usize];
            if m as usize + 1 == ph.len() {
                e.edit(next, remove);
            } else {
                e.edit(next, &mut |l: &mut f32| *l -= *pen);
            }
        }
        for &b in banned {
            e.edit(b, remove);
        }
    }

    /// The kernel's tables for a draft vocabulary (`inverse`: full id → draft index or −1;
    /// identity for the full vocabulary).
    pub fn kernel_tables(&self, inverse: Vec<i32>) -> SlopTables {
        let mut phrase_tokens = Vec::new();
        let mut phrase_start = vec![0i32];
        for (ph, _) in &self.phrases {
            phrase_tokens.extend(ph.iter().map(|&t| t as i32));
            phrase_start.push(phrase_tokens.len() as i32);
        }
        SlopTables {
            inverse,
            pen_ids: self.pen.iter().map(|e| e.0 as i32).collect(),
            pen_vals: self.pen.iter().map(|e| e.1).collect(),
            newline: self.newline.iter().map(|&t| t as i32).collect(),
            blank: self.blank.iter().map(|&t| t as i32).collect(),
            phrase_tokens,
            phrase_start,
            phrase_pen: self.phrases.iter().map(|e| e.1).collect(),
            cap_newline: self.cap_newline as i32,
            cap_blank: self.cap_blank as i32,
        }
    }

    /// `s` as the kernel's state array.
    pub fn kernel_state(s: &TokenState) -> Vec<i32> {
        let mut v = vec![0i32; STATE_LEN];
        v[0] = s.newline_run;
        v[1] = s.blank_run;
        v[2] = s.matches.len() as i32;
        for (i, &(p, m)) in s.matches.iter().enumerate() {
            v[3 + 2 * i] = p as i32;
            v[4 + 2 * i] = m as i32;
        }
        v
    }
}

/// A light view of the token-level state for the draft chain: start it at the sequence's
/// state ([`SlopState::cursor`]), penalize a draft's logits, advance by the draft, repeat. The
/// sequence's own state is untouched.
#[derive(Clone, Debug)]
pub struct DraftCursor<'a> {
    slop: &'a CompiledSlop,
    state: TokenState,
    /// Tokens banned at the cursor's position (only at the sequence's own position).
    banned: &'a [u32],
}

impl<'a> DraftCursor<'a> {
    pub fn new(slop: &'a CompiledSlop, state: TokenState, banned: &'a [u32]) -> Self {
        DraftCursor {
            slop,
            state,
            banned,
        }
    }

    pub fn state(&self) -> &TokenState {
        &self.state
    }

    pub fn banned(&self) -> &[u32] {
        self.banned
    }

    pub fn penalize(&self, e: &mut dyn LogitEdit) {
        self.slop.penalize(&self.state, self.banned, e);
    }

    /// Penalizes draft logits (`inverse`: full id → draft index or −1).
    pub fn penalize_draft(&self, draft_logits: &mut [f32], inverse: &[i32]) {
        self.penalize(&mut DraftEdit {
            logits: draft_logits,
            inverse,
        });
    }

    /// Moves on by one token.
    pub fn advance(&mut self, tok: u32) {
        self.state = self.slop.advance(&self.state, tok);
        self.banned = &[];
    }
}

/// What [`SlopState::accept`] decided about a sampled token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accepted {
    /// The token stays.
    Kept,
    /// It completed a listed phrase: the state is back at `position` (the token holding the
    /// phrase's first byte), where `banned` is now forbidden. Roll the model back to
    /// `position` and sample there again.
    Rewound { position: usize, banned: u32 },
    /// It completed a phrase but the rewind budget is spent: the state is cut back to
    /// `position` and generation must end there (the phrase never reaches the output).
    Exhausted { position: usize },
}

/// What to do when every continuation at the current position is banned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeadEnd {
    /// The previous token (not yet streamed) is banned in turn: roll back to `position`.
    Rewound { position: usize, banned: u32 },
    /// Nothing can be rewound (the previous token was streamed, it was the first generated
    /// token, or the budget is spent): generation ends here.
    Stop,
}

/// The slop state of one sequence: per generated token, the token-level state, the text so
/// far and the open partial text matches, so a rewind is a truncation; plus the bans that
/// rewinds placed and how much has been streamed.
#[derive(Clone, Debug)]
pub struct SlopState {
    slop: Arc<CompiledSlop>,
    /// Position of the first generated token.
    start: usize,
    /// Follow the text (mode 2, when the caller can rewind).
    track_text: bool,
    tokens: Vec<u32>,
    /// `tok[i]`, `text_len[i]`, `partial[i]`: state after `tokens[..i]`.
    tok: Vec<TokenState>,
    text_len: Vec<usize>,
    partial: Vec<Vec<(u32, u32)>>,
    text: Vec<u8>,
    /// `bans[i]`: tokens forbidden at position `start + i`.
    bans: Vec<Vec<u32>>,
    rewinds: u32,
    streamed: usize,
}

impl SlopState {
    /// A sequence whose generated tokens start at `start`.
    pub fn new(slop: Arc<CompiledSlop>, start: usize) -> SlopState {
        let track_text = slop.mode == 2;
        SlopState {
            slop,
            start,
            track_text,
            tokens: Vec::new(),
            tok: vec![TokenState::default()],
            text_len: vec![0],
            partial: vec![Vec::new()],
            text: Vec::new(),
            bans: Vec::new(),
            rewinds: 0,
            streamed: 0,
        }
    }

    /// A state for a caller that cannot rewind: token level only (no text is followed).
    pub(crate) fn without_text(slop: Arc<CompiledSlop>, start: usize) -> SlopState {
        let mut s = SlopState::new(slop, start);
        s.track_text = false;
        s
    }

    pub fn compiled(&self) -> &Arc<CompiledSlop> {
        &self.slop
    }
    pub fn start(&self) -> usize {
        self.start
    }
    /// The position of the next token.
    pub fn position(&self) -> usize {
        self.start + self.tokens.len()
    }
    /// Generated tokens so far (streamed or held back).
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
    pub fn rewinds(&self) -> u32 {
        self.rewinds
    }
    /// Generated tokens handed out by [`SlopState::take_commits`] so far.
    pub fn streamed(&self) -> usize {
        self.streamed
    }
    pub fn token_state(&self) -> &TokenState {
        self.tok.last().unwrap_or(&self.tok[0])
    }
    /// Tokens banned at the current position.
    pub fn banned_here(&self) -> &[u32] {
        self.bans
            .get(self.tokens.len())
            .map(|v| v.as_slice())
            .unwrap_or(&[])
    }

    /// The cursor at the current position.
    pub fn cursor(&self) -> DraftCursor<'_> {
        DraftCursor::new(&self.slop, self.token_state().clone(), self.banned_here())
    }

    /// The cursor for a sequence whose tokens are `history` (prompt included): the recorded
    /// state at the longest common prefix, advanced over the rest. Bans apply only when
    /// `history` ends on the recorded path.
    pub fn cursor_for(&self, history: &[u32]) -> DraftCursor<'_> {
        if history.len() < self.start {
            return DraftCursor::new(&self.slop, TokenState::default(), &[]);
        }
        let gen = &history[self.start..];
        let common = self
            .tokens
            .iter()
            .zip(gen)
            .take_while(|(a, b)| a == b)
            .count();
        let banned = if common == gen.len() {
            self.bans.get(common).map(|v| v.as_slice()).unwrap_or(&[])
        } else {
            &[]
        };
        let mut c = DraftCursor::new(&self.slop, self.tok[common].clone(), banned);
        for &t in &gen[common..] {
            c.advance(t);
        }
        c
    }

    /// Penalizes the logits of the next token.
    pub fn penalize(&self, e: &mut dyn LogitEdit) {
        self.slop
            .penalize(self.token_state(), self.banned_here(), e);
    }

    /// Penalizes draft logits for the next token (`inverse`: full id → draft index or −1).
    pub fn penalize_draft(&self, draft_logits: &mut [f32], inverse: &[i32]) {
        self.cursor().penalize_draft(draft_logits, inverse);
    }

    /// Appends `tok`; returns the byte offset (in the generated text) where a completed
    /// phrase starts, the earliest if several complete.
    fn push(&mut self, tok: u32) -> Option<usize> {
        let next = self.slop.advance(self.token_state(), tok);
        self.tok.push(next);
        self.tokens.push(tok);
        let mut hit: Option<usize> = None;
        let mut partial = self.partial.last().cloned().unwrap_or_default();
        if self.track_text {
            let slop = Arc::clone(&self.slop);
            let piece: &[u8] = slop.pieces.get(tok as usize).map_or(&[], |p| &p[..]);
            for &b in piece {
                let at = self.text.len();
                let mut next: Vec<(u32, u32)> = Vec::with_capacity(partial.len() + 1);
                let mut done = |start: usize| {
                    hit = Some(hit.map_or(start, |h| h.min(start)));
                };
                for &(p, k) in &partial {
                    let ph = &slop.text[p as usize].bytes;
                    if ph[k as usize] == b {
                        if k as usize + 1 == ph.len() {
                            done(at + 1 - ph.len());
                        } else {
                            next.push((p, k + 1));
                        }
                    }
                }
                let boundary = at == 0 || !word_byte(self.text[at - 1]);
                for &p in &slop.text_first[b as usize] {
                    let ph = &slop.text[p as usize];
                    if ph.word_start && !boundary {
                        continue;
                    }
                    if ph.bytes.len() == 1 {
                        done(at);
                    } else {
                        next.push((p, 1));
                    }
                }
                self.text.push(b);
                partial = next;
            }
        }
        self.text_len.push(self.text.len());
        self.partial.push(partial);
        hit
    }

    /// Drops every token from `position` on; bans at `position` stay, later ones go.
    fn truncate_to(&mut self, position: usize) {
        let keep = position.saturating_sub(self.start).min(self.tokens.len());
        self.tokens.truncate(keep);
        self.tok.truncate(keep + 1);
        self.text_len.truncate(keep + 1);
        self.partial.truncate(keep + 1);
        self.text.truncate(self.text_len[keep]);
        self.bans.truncate(keep + 1);
    }

    fn ban(&mut self, index: usize, tok: u32) {
        if self.bans.len() <= index {
            self.bans.resize(index + 1, Vec::new());
        }
        if !self.bans[index].contains(&tok) {
            self.bans[index].push(tok);
        }
    }

    /// Records a sampled token and checks the phrase level (module doc).
    pub fn accept(&mut self, tok: u32) -> Accepted {
        let Some(start_byte) = self.push(tok) else {
            return Accepted::Kept;
        };
        // The token holding the first byte: the last i with text_len[i] ≤ start_byte.
        let i = self.text_len.partition_point(|&l| l <= start_byte) - 1;
        let position = self.start + i;
        let first = self.tokens[i];
        debug_assert!(i >= self.streamed, "a rewind would retract streamed text");
        if self.rewinds >= self.slop.max_rewinds {
            self.truncate_to(position);
            return Accepted::Exhausted { position };
        }
        self.rewinds += 1;
        self.truncate_to(position);
        self.ban(i, first);
        Accepted::Rewound {
            position,
            banned: first,
        }
    }

    /// Records a token without the phrase level (a caller that cannot rewind).
    pub fn push_token(&mut self, tok: u32) {
        self.push(tok);
    }

    /// Called when every continuation at the current position is banned (module doc).
    pub fn dead_end(&mut self) -> DeadEnd {
        let n = self.tokens.len();
        if n == 0 || n - 1 < self.streamed || self.rewinds >= self.slop.max_rewinds {
            return DeadEnd::Stop;
        }
        let i = n - 1;
        let tok = self.tokens[i];
        self.rewinds += 1;
        self.truncate_to(self.start + i);
        self.ban(i, tok);
        DeadEnd::Rewound {
            position: self.start + i,
            banned: tok,
        }
    }

    /// Generated-token indices (from the first generated token) that became final since the
    /// last call: every token that no open partial match reaches into.
    pub fn take_commits(&mut self) -> Range<usize> {
        let n = self.tokens.len();
        let hold = self
            .partial
            .last()
            .into_iter()
            .flatten()
            .map(|&(_, k)| self.text.len() - k as usize)
            .min()
            .unwrap_or(self.text.len());
        // Tokens whose text ends at or before `hold`.
        let ready = self.text_len[1..].partition_point(|&l| l <= hold).min(n);
        let from = self.streamed;
        self.streamed = self.streamed.max(ready);
        from..self.streamed
    }

    /// Everything not streamed yet (at the end of generation: a partial match that never
    /// completed is plain text).
    pub fn flush(&mut self) -> Range<usize> {
        let from = self.streamed;
        self.streamed = self.tokens.len().max(from);
        from..self.streamed
    }

    /// Brings a state that follows a sequence without rewinding in line with `history`:
    /// truncates to the longest common prefix, then records the rest. Restarts at the end of
    /// `history` when it no longer starts where this state does or jumps ahead by more than a
    /// verify window (a new prompt).
    pub(crate) fn sync(&mut self, history: &[u32]) {
        const MAX_JUMP: usize = 16;
        if history.len() < self.start || history.len() > self.position() + MAX_JUMP {
            *self = SlopState::without_text(Arc::clone(&self.slop), history.len());
            return;
        }
        let gen = &history[self.start..];
        let common = self
            .tokens
            .iter()
            .zip(gen)
            .take_while(|(a, b)| a == b)
            .count();
        if common < self.tokens.len() {
            self.truncate_to(self.start + common);
            self.streamed = self.streamed.min(common);
        }
        for &t in &gen[common..] {
            self.push(t);
        }
    }
}
