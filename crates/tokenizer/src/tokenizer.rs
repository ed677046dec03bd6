//! The tokenizer proper: vocabulary, token attributes, special-token rules (which ids end
//! generation, which texts are matched as whole tokens before BPE), encoding and decoding.
//! Behaviour follows llama.cpp's `llama_vocab` so that ids agree with it.

use std::collections::{HashMap, HashSet};

use crate::bpe::{self, Ranks};
use crate::bytes;
use crate::pretok::PreConfig;
use crate::spm;
use crate::vocab::{TokenType, TokenizerData};
use crate::{Result, TokenizerError};

/// Token attributes (llama.cpp's `llama_token_attr` bits).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TokenAttr(pub u32);

impl TokenAttr {
    pub const UNKNOWN: u32 = 1 << 0;
    pub const UNUSED: u32 = 1 << 1;
    pub const NORMAL: u32 = 1 << 2;
    pub const CONTROL: u32 = 1 << 3;
    pub const USER_DEFINED: u32 = 1 << 4;
    pub const BYTE: u32 = 1 << 5;
    pub const LSTRIP: u32 = 1 << 7;
    pub const RSTRIP: u32 = 1 << 8;

    pub fn has(self, bits: u32) -> bool {
        self.0 & bits != 0
    }

    fn from_type(t: TokenType) -> TokenAttr {
        TokenAttr(match t {
            TokenType::Undefined => 0,
            TokenType::Normal => Self::NORMAL,
            TokenType::Unknown => Self::UNKNOWN,
            TokenType::Control => Self::CONTROL,
            TokenType::UserDefined => Self::USER_DEFINED,
            TokenType::Unused => Self::UNUSED,
            TokenType::Byte => Self::BYTE,
        })
    }
}

#[derive(Debug)]
enum Kind {
    Bpe { pre: PreConfig, ranks: Ranks },
    Spm,
}

/// Texts that mark end-of-turn / end-of-generation tokens in the vocabularies llama.cpp knows.
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];
const FIM_PRE_TEXTS: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
];
const FIM_SUF_TEXTS: &[&str] = &[
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
];
const FIM_MID_TEXTS: &[&str] = &[
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
    "<|middle|>",
];
const FIM_PAD_TEXTS: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
const FIM_REP_TEXTS: &[&str] = &[
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
];
const FIM_SEP_TEXTS: &[&str] = &["<|file_sep|>"];

/// A tokenizer built from [`TokenizerData`]. Cheap to share across threads (`&self` only).
#[derive(Debug)]
pub struct Tokenizer {
    kind: Kind,
    texts: Vec<String>,
    scores: Vec<f32>,
    attrs: Vec<TokenAttr>,
    token_to_id: HashMap<String, u32>,
    /// Control, user-defined and unknown tokens, longest text first: the order in which they
    /// are cut out of raw text before the pre-tokenizer sees it.
    specials: Vec<u32>,
    /// Each token's text as bytes, specials included (the `special = true` rendering).
    pieces: Vec<Vec<u8>>,
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    eom: Option<u32>,
    unk: Option<u32>,
    pad: Option<u32>,
    fim: [Option<u32>; 6],
    eog: HashSet<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    clean_spaces: bool,
    model_name: String,
    pre_name: Option<String>,
    chat_template: Option<String>,
}

enum Frag {
    Text(usize, usize),
    Token(u32),
}

impl Tokenizer {
    /// Reads the tokenizer of a GGUF file.
    pub fn from_gguf(f: &strata_gguf::GgufFile) -> Result<Tokenizer> {
        Tokenizer::new(TokenizerData::from_gguf(f)?)
    }

    pub fn new(d: TokenizerData) -> Result<Tokenizer> {
        let n = d.tokens.len();
        if n == 0 {
            return Err(TokenizerError::Invalid(
                "the vocabulary has no tokens".into(),
            ));
        }
        if u32::try_from(n).is_err() {
            return Err(TokenizerError::Invalid(format!(
                "{n} tokens do not fit 32-bit ids"
            )));
        }
        let is_spm = match d.model.as_str() {
            "gpt2" => false,
            "llama" => true,
            other => return Err(TokenizerError::UnsupportedModel(other.to_string())),
        };

        let mut texts = Vec::with_capacity(n);
        let mut token_to_id = HashMap::with_capacity(n);
        for (i, t) in d.tokens.iter().enumerate() {
            // An empty token could never be matched or printed; llama.cpp renames it the same way.
            let text = if t.is_empty() {
                format!("[EMPTY_{i}]")
            } else {
                t.clone()
            };
            if token_to_id.insert(text.clone(), i as u32).is_some() {
                return Err(TokenizerError::Invalid(format!(
                    "token {i} {text:?} appears twice in the vocabulary"
                )));
            }
            texts.push(text);
        }
        let mut attrs: Vec<TokenAttr> = (0..n)
            .map(|i| match d.token_types.get(i) {
                Some(&t) => TokenAttr::from_type(TokenType::from_i32(t)),
                None if d.token_types.is_empty() => TokenAttr(TokenAttr::NORMAL),
                None => TokenAttr(0),
            })
            .collect();
        let scores = if d.scores.is_empty() {
            vec![0.0; n]
        } else {
            d.scores.clone()
        };

        let (kind, mut add_bos, mut add_space_prefix, clean_spaces) = if is_spm {
            (Kind::Spm, true, true, false)
        } else {
            let pre = PreConfig::for_name(d.pre.as_deref())?;
            let ranks = Ranks::new(&d.merges)?;
            if ranks.is_empty() {
                return Err(TokenizerError::Invalid(
                    "a BPE vocabulary without merges".into(),
                ));
            }
            let (add_bos, clean) = (pre.add_bos, pre.clean_spaces);
            (Kind::Bpe { pre, ranks }, add_bos, false, clean)
        };
        if let Some(v) = d.add_space_prefix {
            add_space_prefix = v;
        }

        // Special ids: per-model defaults, replaced by the file's values when those are in range.
        let in_range = |id: Option<u32>| id.filter(|&i| (i as usize) < n);
        let (def_bos, def_eos, def_unk) = if is_spm {
            (Some(1), Some(2), Some(0))
        } else {
            (Some(11), Some(11), None)
        };
        let pick = |file: Option<u32>, default: Option<u32>| in_range(file).or(in_range(default));
        let bos = pick(d.bos_id, def_bos);
        let eos = pick(d.eos_id, def_eos);
        let unk = pick(d.unk_id, def_unk);
        let pad = in_range(d.pad_id);
        let mut eot = in_range(d.eot_id);
        let mut eom = in_range(d.eom_id);
        let mut fim = [
            in_range(d.fim_pre_id),
            in_range(d.fim_suf_id),
            in_range(d.fim_mid_id),
            in_range(d.fim_pad_id),
            in_range(d.fim_rep_id),
            in_range(d.fim_sep_id),
        ];
        add_bos = d.add_bos.unwrap_or(add_bos);
        let add_eos = d.add_eos.unwrap_or(false);

        // Detect EOT/EOM/FIM tokens by their text where the file does not name them; a token
        // found this way is made a control token. llama.cpp takes whichever its hash map yields
        // first; we take the list's order (which gives its choices on the Qwen vocabularies).
        let make_control = |attrs: &mut Vec<TokenAttr>, id: u32| {
            if let Some(a) = attrs.get_mut(id as usize) {
                a.0 |= TokenAttr::CONTROL;
            }
        };
        let find = |list: &[&str]| -> Option<u32> {
            list.iter().find_map(|t| token_to_id.get(*t).copied())
        };
        if eot.is_none() {
            eot = find(EOT_TEXTS);
            if let Some(id) = eot {
                make_control(&mut attrs, id);
            }
        }
        if eom.is_none() {
            eom = find(&["<|eom_id|>"]);
            if let Some(id) = eom {
                make_control(&mut attrs, id);
            }
        }
        let fim_lists = [
            FIM_PRE_TEXTS,
            FIM_SUF_TEXTS,
            FIM_MID_TEXTS,
            FIM_PAD_TEXTS,
            FIM_REP_TEXTS,
            FIM_SEP_TEXTS,
        ];
        for (slot, list) in fim.iter_mut().zip(fim_lists) {
            if slot.is_none() {
                *slot = find(list);
                if let Some(id) = *slot {
                    make_control(&mut attrs, id);
                }
            }
        }
        // Control tokens named "unused…" are placeholders.
        for (a, t) in attrs.iter_mut().zip(&texts) {
            if a.has(TokenAttr::CONTROL) && t.contains("unused") {
                a.0 |= TokenAttr::UNUSED;
            }
        }

        let mut eog: HashSet<u32> = fim[3..].iter().flatten().copied().collect();
        for t in EOG_TEXTS {
            if let Some(&id) = token_to_id.get(*t) {
                eog.insert(id);
                make_control(&mut attrs, id);
            }
        }
        // gpt-oss structure tokens are printed like text.
        for t in ["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"] {
            if let Some(&id) = token_to_id.get(t) {
                attrs[id as usize] = TokenAttr(TokenAttr::USER_DEFINED);
            }
        }
        eog.extend([eos, eot, eom].into_iter().flatten());
        // o200k-harmony / solar-open: "<|end|>" ends a message, not the generation.
        let eog_has =
            |eog: &HashSet<u32>, t: &str| token_to_id.get(t).is_some_and(|id| eog.contains(id));
        let h = |t: &str| eog_has(&eog, t);
        if ((h("<|return|>") && h("<|call|>")) || (h("<|calls|>") && h("<|flush|>")))
            && h("<|end|>")
        {
            if let Some(&id) = token_to_id.get("<|end|>") {
                eog.remove(&id);
                attrs[id as usize] = TokenAttr(TokenAttr::USER_DEFINED);
            }
        }
        // Gemma 4 / PLaMo: "</s>" is an ordinary token there.
        let h = |t: &str| eog_has(&eog, t);
        if (h("<|tool_response>") || h("<|plamo:eos|>")) && h("</s>") {
            if let Some(&id) = token_to_id.get("</s>") {
                eog.remove(&id);
                attrs[id as usize] = TokenAttr(TokenAttr::NORMAL);
            }
        }

        let mut specials: Vec<u32> = (0..n as u32)
            .filter(|&i| {
                attrs[i as usize]
                    .has(TokenAttr::CONTROL | TokenAttr::USER_DEFINED | TokenAttr::UNKNOWN)
            })
            .collect();
        specials.sort_by(|&a, &b| {
            texts[b as usize]
                .len()
                .cmp(&texts[a as usize].len())
                .then(a.cmp(&b))
        });

        let mut tok = Tokenizer {
            kind,
            texts,
            scores,
            attrs,
            token_to_id,
            specials,
            pieces: Vec::new(),
            bos,
            eos,
            eot,
            eom,
            unk,
            pad,
            fim,
            eog,
            add_bos,
            add_eos,
            add_space_prefix,
            clean_spaces,
            model_name: d.model.clone(),
            pre_name: d.pre.clone(),
            chat_template: d.chat_template.clone(),
        };
        tok.pieces = (0..n as u32).map(|i| tok.render_piece(i)).collect();

        // Per-model strip rules, applied after the pieces are built (they only affect how the
        // text around a special token is cut).
        let name = d.model_name.as_deref().unwrap_or("").to_lowercase();
        if name.contains("phi-3") || name.contains("phi3") {
            for &id in &tok.specials {
                tok.attrs[id as usize].0 |= TokenAttr::RSTRIP;
            }
            if let Some(&id) = tok.token_to_id.get("</s>") {
                tok.attrs[id as usize].0 |= TokenAttr::RSTRIP;
            }
            for t in ["<unk>", "<s>", "<|endoftext|>"] {
                if let Some(&id) = tok.token_to_id.get(t) {
                    tok.attrs[id as usize].0 &= !TokenAttr::RSTRIP;
                }
            }
        }
        Ok(tok)
    }

    /// The text a token prints as when specials are shown.
    fn render_piece(&self, id: u32) -> Vec<u8> {
        let i = id as usize;
        let attr = self.attrs[i];
        let text = &self.texts[i];
        if attr.has(TokenAttr::UNKNOWN | TokenAttr::CONTROL | TokenAttr::USER_DEFINED) {
            return text.as_bytes().to_vec();
        }
        if attr.has(TokenAttr::NORMAL) {
            return match self.kind {
                Kind::Spm => text.replace('\u{2581}', " ").into_bytes(),
                Kind::Bpe { .. } => {
                    let mut out = Vec::with_capacity(text.len());
                    for c in text.chars() {
                        match bytes::char_to_byte(c) {
                            Some(b) => out.push(b),
                            None => {
                                // Not a byte-level character: llama.cpp prints a marker.
                                out.extend_from_slice(b"[UNK_BYTE_0x");
                                let mut buf = [0u8; 4];
                                for b in c.encode_utf8(&mut buf).bytes() {
                                    out.extend_from_slice(format!("{b:02x}").as_bytes());
                                }
                                out.extend_from_slice(text.as_bytes());
                                out.push(b']');
                            }
                        }
                    }
                    out
                }
            };
        }
        if attr.has(TokenAttr::BYTE) {
            return hex_byte(text).map(|b| vec![b]).unwrap_or_default();
        }
        Vec::new()
    }

    // ---- queries ----

    pub fn n_vocab(&self) -> usize {
        self.texts.len()
    }
    /// `gpt2` or `llama`.
    pub fn model(&self) -> &str {
        &self.model_name
    }
    /// `tokenizer.ggml.pre`, if the file set it.
    pub fn pre(&self) -> Option<&str> {
        self.pre_name.as_deref()
    }
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }
    pub fn eot(&self) -> Option<u32> {
        self.eot
    }
    pub fn eom(&self) -> Option<u32> {
        self.eom
    }
    pub fn unk(&self) -> Option<u32> {
        self.unk
    }
    pub fn pad(&self) -> Option<u32> {
        self.pad
    }
    /// FIM ids: prefix, suffix, middle, pad, repo, file separator.
    pub fn fim(&self) -> [Option<u32>; 6] {
        self.fim
    }
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }
    /// Whether generating `id` ends the generation (EOS, EOT, EOM, FIM pad/repo/separator and
    /// the end-of-turn tokens llama.cpp knows by text).
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }
    /// All end-of-generation ids, sorted.
    pub fn eog_ids(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self.eog.iter().copied().collect();
        v.sort_unstable();
        v
    }
    pub fn is_control(&self, id: u32) -> bool {
        self.attr(id).is_ok_and(|a| a.has(TokenAttr::CONTROL))
    }
    pub fn attr(&self, id: u32) -> Result<TokenAttr> {
        self.attrs
            .get(id as usize)
            .copied()
            .ok_or(self.out_of_range(id))
    }
    /// The vocabulary entry of `id` as stored (byte-level spelling for BPE).
    pub fn token_text(&self, id: u32) -> Result<&str> {
        self.texts
            .get(id as usize)
            .map(String::as_str)
            .ok_or(self.out_of_range(id))
    }
    pub fn token_score(&self, id: u32) -> Result<f32> {
        self.scores
            .get(id as usize)
            .copied()
            .ok_or(self.out_of_range(id))
    }
    /// The id of a vocabulary entry, by its stored text.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.token_to_id.get(text).copied()
    }
    /// `tokenizer.chat_template`, if the file has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    fn out_of_range(&self, id: u32) -> TokenizerError {
        TokenizerError::TokenOutOfRange {
            id,
            n_vocab: self.texts.len(),
        }
    }

    // ---- encoding ----

    /// Text to ids. `add_special` adds BOS/EOS where the model asks for them; `parse_special`
    /// lets control tokens written in the text (e.g. `<|im_start|>`) become those tokens —
    /// without it they are tokenized as plain text. User-defined tokens are always matched.
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<u32>> {
        let frags = self.partition(text, parse_special);
        let mut out = Vec::new();
        match &self.kind {
            Kind::Bpe { pre, ranks } => {
                if add_special && self.add_bos {
                    out.push(self.bos.ok_or(TokenizerError::MissingSpecial("BOS"))?);
                }
                for f in &frags {
                    match *f {
                        Frag::Token(id) => out.push(id),
                        Frag::Text(a, b) => self.encode_bpe(&text[a..b], pre, ranks, &mut out)?,
                    }
                }
                if add_special && self.add_eos {
                    out.push(self.eos.ok_or(TokenizerError::MissingSpecial("EOS"))?);
                }
            }
            Kind::Spm => {
                if add_special && self.add_bos {
                    out.push(self.bos.ok_or(TokenizerError::MissingSpecial("BOS"))?);
                }
                // A space is prefixed to text at the start and after each special token.
                let mut prev_special = true;
                for f in &frags {
                    match *f {
                        Frag::Token(id) => {
                            out.push(id);
                            prev_special = true;
                        }
                        Frag::Text(a, b) => {
                            let mut s = String::with_capacity(b - a + 3);
                            if self.add_space_prefix && prev_special {
                                s.push(' ');
                            }
                            s.push_str(&text[a..b]);
                            let s = s.replace(' ', "\u{2581}");
                            self.encode_spm(&s, &mut out)?;
                            prev_special = false;
                        }
                    }
                }
                if add_special && self.add_eos {
                    out.push(self.eos.ok_or(TokenizerError::MissingSpecial("EOS"))?);
                }
            }
        }
        Ok(out)
    }

    /// Cuts special tokens out of `text`, longest first, each at every occurrence.
    fn partition(&self, text: &str, parse_special: bool) -> Vec<Frag> {
        let mut frags = Vec::new();
        if text.is_empty() {
            return frags;
        }
        frags.push(Frag::Text(0, text.len()));
        let is_space = |b: u8| matches!(b, b' ' | b'\t' | b'\n' | 0x0B | 0x0C | b'\r');
        for &id in &self.specials {
            let attr = self.attrs[id as usize];
            if !parse_special && attr.has(TokenAttr::CONTROL | TokenAttr::UNKNOWN) {
                continue;
            }
            let needle = self.texts[id as usize].as_str();
            if !frags
                .iter()
                .any(|f| matches!(*f, Frag::Text(a, b) if text[a..b].contains(needle)))
            {
                continue;
            }
            let mut next = Vec::with_capacity(frags.len() + 2);
            for f in frags {
                let Frag::Text(mut a, b) = f else {
                    next.push(f);
                    continue;
                };
                while let Some(rel) = text[a..b].find(needle) {
                    let m = a + rel;
                    let mut left_end = m;
                    if attr.has(TokenAttr::LSTRIP) {
                        while left_end > a && is_space(text.as_bytes()[left_end - 1]) {
                            left_end -= 1;
                        }
                    }
                    if left_end > a {
                        next.push(Frag::Text(a, left_end));
                    }
                    next.push(Frag::Token(id));
                    a = m + needle.len();
                    if attr.has(TokenAttr::RSTRIP) {
                        while a < b && is_space(text.as_bytes()[a]) {
                            a += 1;
                        }
                    }
                }
                if a < b {
                    next.push(Frag::Text(a, b));
                }
            }
            frags = next;
        }
        frags
    }

    fn encode_bpe(
        &self,
        text: &str,
        pre: &PreConfig,
        ranks: &Ranks,
        out: &mut Vec<u32>,
    ) -> Result<()> {
        let mut word = String::new();
        for (a, b) in pre.splitter.split(text)? {
            word.clear();
            bytes::encode_into(&text.as_bytes()[a..b], &mut word);
            if pre.ignore_merges {
                if let Some(&id) = self.token_to_id.get(word.as_str()) {
                    out.push(id);
                    continue;
                }
            }
            for piece in bpe::merge_word(&word, ranks) {
                match self.token_to_id.get(piece) {
                    Some(&id) => out.push(id),
                    None => {
                        // Not in the vocabulary: llama.cpp looks each byte of the spelling up
                        // as a one-byte token and drops those it cannot find.
                        for b in piece.bytes() {
                            let s = [b];
                            if let Some(&id) = std::str::from_utf8(&s)
                                .ok()
                                .and_then(|s| self.token_to_id.get(s))
                            {
                                out.push(id);
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn encode_spm(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        for piece in spm::merge_text(text, &self.token_to_id, &self.scores) {
            if let Some(&id) = self.token_to_id.get(piece) {
                out.push(id);
                continue;
            }
            for &b in piece.as_bytes() {
                out.push(self.byte_token(b)?);
            }
        }
        Ok(())
    }

    /// The token that stands for one raw byte (SentencePiece byte fallback).
    fn byte_token(&self, b: u8) -> Result<u32> {
        if let Some(&id) = self.token_to_id.get(format!("<0x{b:02X}>").as_str()) {
            return Ok(id);
        }
        let s = [b];
        std::str::from_utf8(&s)
            .ok()
            .and_then(|s| self.token_to_id.get(s))
            .copied()
            .ok_or(TokenizerError::NoByteToken(b))
    }

    // ---- decoding ----

    /// The bytes one token stands for. With `special` false, control and unknown tokens print
    /// as nothing. A byte-level token may hold part of a UTF-8 sequence.
    pub fn token_to_piece(&self, id: u32, special: bool) -> Result<&[u8]> {
        let attr = self.attr(id)?;
        if !special && attr.has(TokenAttr::UNKNOWN | TokenAttr::CONTROL) {
            return Ok(&[]);
        }
        Ok(&self.pieces[id as usize])
    }

    /// Ids to bytes, as llama.cpp's detokenizer does: SentencePiece's leading space is dropped
    /// from the first piece, and for vocabularies that ask for it, tokenization spaces are
    /// cleaned up (" ." → "."). `special` prints control tokens.
    pub fn decode_bytes(&self, ids: &[u32], special: bool) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        let mut remove_space = self.add_space_prefix;
        for &id in ids {
            let mut piece = self.token_to_piece(id, special)?;
            if remove_space {
                if let Some(rest) = piece.strip_prefix(b" ") {
                    piece = rest;
                }
            }
            remove_space = false;
            out.extend_from_slice(piece);
        }
        if self.clean_spaces {
            clean_up_spaces(&mut out);
        }
        Ok(out)
    }

    /// Ids to text; bytes that are not valid UTF-8 become U+FFFD.
    pub fn decode(&self, ids: &[u32], special: bool) -> Result<String> {
        Ok(String::from_utf8_lossy(&self.decode_bytes(ids, special)?).into_owned())
    }
}

fn hex_byte(text: &str) -> Option<u8> {
    let h = text.get(3..5)?;
    u8::from_str_radix(h, 16).ok()
}

/// llama.cpp's three clean-up passes, in place on bytes: drop a space before `?!.,`; turn
/// `" ' "` into `"'"`; drop the space before `'s`, `'m`, `'re`, `'ve`.
fn clean_up_spaces(t: &mut Vec<u8>) {
    // Pass 1.
    let n1 = t.len();
    let mut total = usize::from(n1 > 0);
    for i in 1..n1 {
        let x = t[i];
        if t[i - 1] == b' ' && matches!(x, b'?' | b'!' | b'.' | b',') {
            total -= 1;
        }
        t[total] = x;
        total += 1;
    }
    t.truncate(total);
    // Pass 2.
    let n2 = t.len();
    let mut total = usize::from(n2 > 0);
    let mut i = 1;
    while i < n2 {
        let x = t[i];
        if x == b'\'' && i + 1 < n2 && t[i - 1] == b' ' && t[i + 1] == b' ' {
            total -= 1;
            i += 1;
            t[i] = 0;
        }
        t[total] = x;
        total += 1;
        i += 1;
    }
    t.truncate(total);
    // Pass 3.
    let n3 = t.len();
    let mut total = usize::from(n3 > 0);
    for i in 1..n3 {
        let x = t[i];
        if t[i - 1] == b' ' && x == b'\'' && i + 1 < n3 {
            let x1 = t[i + 1];
            if x1 == b's' || x1 == b'm' {
                total -= 1;
            } else if x1 != b't' && x1 != b'd' && i + 2 < n3 {
                let x2 = t[i + 2];
                if (x1 == b'r' || x1 == b'v') && x2 == b'e' {
                    total -= 1;
                }
            }
        }
        t[total] = x;
        total += 1;
    }
    t.truncate(total);
}

#[cfg(test)]
mod tests {
    use super::clean_up_spaces;

    fn clean(s: &str) -> String {
        let mut v = s.as_bytes().to_vec();
        clean_up_spaces(&mut v);
        String::from_utf8(v).unwrap()
    }

    #[test]
    fn clean_up_matches_the_three_passes() {
        assert_eq!(clean("Hello , world !"), "Hello, world!");
        assert_eq!(clean("a ' b"), "a'b");
        assert_eq!(
            clean("it 's I 'm we 're you 've I 'll he 'd don 't"),
            "it's I'm we're you've I 'll he 'd don 't"
        );
    }
}
