//! Pre-tokenizers: how a text fragment is cut into words before BPE runs on each word, chosen by
//! `tokenizer.ggml.pre`. The common split expressions (GPT-2, Llama 3, Qwen2, Qwen3.5) are
//! hand-written scanners that follow the expressions' leftmost-alternative semantics over
//! llama.cpp's Unicode classes, so their words match llama.cpp's exactly; the rarer ones run the
//! published expressions through `fancy-regex`.

use crate::unicode::Flags;
use crate::TokenizerError;

/// The split rule of one `tokenizer.ggml.pre` family.
#[derive(Debug)]
pub(crate) enum Splitter {
    /// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
    Gpt2,
    /// `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
    /// with `digits` as the longest digit run (3 for Llama 3, 1 for Qwen2) and, for Qwen3.5,
    /// combining marks counted with letters (`[\p{L}\p{M}]+`).
    Llama3Like {
        digits: usize,
        marks_are_letters: bool,
    },
    /// A list of expressions applied one after the other, each cutting the previous pieces
    /// further (matches and the gaps between them both become pieces).
    Regexes(Vec<fancy_regex::Regex>),
}

/// Settings that a pre-tokenizer name implies besides its split rule (llama.cpp's table).
#[derive(Debug)]
pub(crate) struct PreConfig {
    pub splitter: Splitter,
    /// Take a whole word as one token when the vocabulary has it, before merging.
    pub ignore_merges: bool,
    /// Undo tokenization spaces (" ." → ".", " 's" → "'s", ...) when decoding.
    pub clean_spaces: bool,
    /// The family's default for adding BOS (a GGUF key overrides it).
    pub add_bos: bool,
}

const GPT2_RE: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

impl PreConfig {
    /// The configuration for a `tokenizer.ggml.pre` value of a byte-level BPE vocabulary.
    /// `None` (key absent) means llama.cpp's "default".
    pub(crate) fn for_name(pre: Option<&str>) -> Result<PreConfig, TokenizerError> {
        let cfg = |splitter, ignore_merges, clean_spaces, add_bos| PreConfig {
            splitter,
            ignore_merges,
            clean_spaces,
            add_bos,
        };
        let llama3 = || Splitter::Llama3Like {
            digits: 3,
            marks_are_letters: false,
        };
        let qwen2 = || Splitter::Llama3Like {
            digits: 1,
            marks_are_letters: false,
        };
        let name = pre.unwrap_or("default");
        Ok(match name {
            "default" => cfg(
                regexes(&[
                    r"[\p{P}\$\+<=>\^~\|]+",
                    GPT2_RE,
                    r"\p{N}+",
                    "[0-9][0-9][0-9]",
                ])?,
                false,
                true,
                false,
            ),
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral"
            | "midm-2.0" | "lfm2" | "jina-v5-nano" => cfg(llama3(), true, true, true),
            "dbrx" | "smaug-bpe" => cfg(llama3(), false, true, false),
            "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "solar-open" => {
                cfg(qwen2(), false, false, false)
            }
            "megrez" | "stablelm2" | "hunyuan" => cfg(qwen2(), false, true, false),
            "qwen35" => cfg(
                Splitter::Llama3Like {
                    digits: 1,
                    marks_are_letters: true,
                },
                false,
                false,
                false,
            ),
            "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es"
            | "jina-v2-de" | "a.x-4.0" | "mellum" | "modern-bert" | "exaone4" | "mpt" | "olmo"
            | "jais" | "trillion" | "granite-docling" | "jina-v1-en" | "jina-v2-code"
            | "roberta-bpe" => cfg(Splitter::Gpt2, false, true, false),
            "starcoder" | "refact" | "codeshell" | "exaone" | "minerva-7b" | "mellum2" => {
                cfg(regexes(&[r"\p{N}", GPT2_RE])?, false, true, false)
            }
            "command-r" | "smollm" => cfg(regexes(&[r"\p{N}", GPT2_RE])?, false, false, false),
            "falcon" => cfg(
                regexes(&[r"[\p{P}\$\+<=>\^~\|`]+", GPT2_RE, "[0-9][0-9][0-9]"])?,
                false,
                true,
                false,
            ),
            "deepseek-coder" => cfg(
                regexes(&[
                    r"[\r\n]",
                    r"\s?\p{L}+",
                    r"\s?\p{P}+",
                    "[一-龥ࠀ-一가-퟿]+",
                    r"\p{N}",
                ])?,
                false,
                false,
                false,
            ),
            "deepseek-llm" => cfg(
                regexes(&[
                    "[\r\n]",
                    "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
                    "\\s?[!-/:-~！-／：-～‘-‟　-。]+",
                    "\\s+$",
                    "[一-龥ࠀ-一가-퟿]+",
                    "\\p{N}+",
                ])?,
                false,
                false,
                false,
            ),
            other => return Err(TokenizerError::UnsupportedPreTokenizer(other.to_string())),
        })
    }
}

fn regexes(list: &[&str]) -> Result<Splitter, TokenizerError> {
    let mut out = Vec::with_capacity(list.len());
    for re in list {
        let r = fancy_regex::Regex::new(re).map_err(|e| {
            TokenizerError::Invalid(format!("pre-tokenizer expression {re:?}: {e}"))
        })?;
        out.push(r);
    }
    Ok(Splitter::Regexes(out))
}

impl Splitter {
    /// Cuts `text` into words, returned as byte ranges that cover the text in order.
    pub(crate) fn split(&self, text: &str) -> Result<Vec<(usize, usize)>, TokenizerError> {
        match self {
            Splitter::Regexes(list) => split_regexes(list, text),
            _ => {
                let cps: Vec<(usize, char)> = text.char_indices().collect();
                let lens = match self {
                    Splitter::Gpt2 => scan_gpt2(&cps),
                    Splitter::Llama3Like {
                        digits,
                        marks_are_letters,
                    } => scan_llama3_like(&cps, *digits, *marks_are_letters),
                    Splitter::Regexes(_) => unreachable!("handled above"),
                };
                Ok(lens_to_ranges(&cps, text.len(), &lens))
            }
        }
    }
}

/// Word lengths in code points to byte ranges.
fn lens_to_ranges(cps: &[(usize, char)], n_bytes: usize, lens: &[usize]) -> Vec<(usize, usize)> {
    let byte_at = |i: usize| cps.get(i).map_or(n_bytes, |c| c.0);
    let mut out = Vec::with_capacity(lens.len());
    let mut pos = 0;
    for &len in lens {
        out.push((byte_at(pos), byte_at(pos + len)));
        pos += len;
    }
    out
}

/// Position-indexed view of one fragment: outside it there is no code point and no class, which
/// is how the lookaheads of the expressions see the fragment's ends.
struct Cursor<'a> {
    cps: &'a [(usize, char)],
}

const NONE_CP: u32 = u32::MAX;

impl Cursor<'_> {
    fn cp(&self, i: usize) -> u32 {
        self.cps.get(i).map_or(NONE_CP, |c| c.1 as u32)
    }
    fn flags(&self, i: usize) -> Flags {
        self.cps
            .get(i)
            .map_or(Flags::NONE, |c| Flags::of(c.1 as u32))
    }
    fn len(&self) -> usize {
        self.cps.len()
    }
}

fn lower(cp: u32) -> u32 {
    char::from_u32(cp).map_or(cp, |c| {
        let mut l = c.to_lowercase();
        match (l.next(), l.next()) {
            (Some(x), None) => x as u32,
            _ => cp,
        }
    })
}

/// Length (2 or 3) of an English contraction starting at `pos` (`'s`, `'t`, `'re`, `'ve`, `'m`,
/// `'ll`, `'d`), optionally case-insensitive.
fn contraction(c: &Cursor, pos: usize, fold_case: bool) -> Option<usize> {
    if c.cp(pos) != '\'' as u32 || pos + 1 >= c.len() {
        return None;
    }
    let f = |cp: u32| if fold_case { lower(cp) } else { cp };
    let is = |cp: u32, ch: char| cp == ch as u32;
    let n1 = f(c.cp(pos + 1));
    if is(n1, 's') || is(n1, 't') || is(n1, 'm') || is(n1, 'd') {
        return Some(2);
    }
    if pos + 2 < c.len() {
        let n2 = f(c.cp(pos + 2));
        if (is(n1, 'r') && is(n2, 'e'))
            || (is(n1, 'v') && is(n2, 'e'))
            || (is(n1, 'l') && is(n2, 'l'))
        {
            return Some(3);
        }
    }
    None
}

/// The trailing whitespace alternatives shared by the GPT-2 and Llama 3 families. `newlines`
/// enables `\s*[\r\n]+` (Llama 3 family). Returns the end of the word.
fn whitespace_run(c: &Cursor, pos: usize, newlines: bool) -> usize {
    let mut n = 0;
    let mut after_last_newline = None;
    while c.flags(pos + n).whitespace() {
        let cp = c.cp(pos + n);
        if cp == '\r' as u32 || cp == '\n' as u32 {
            after_last_newline = Some(pos + n + 1);
        }
        n += 1;
    }
    if newlines {
        if let Some(end) = after_last_newline {
            return end; // \s*[\r\n]+
        }
    }
    if n > 1 && c.cp(pos + n) != NONE_CP {
        return pos + n - 1; // \s+(?!\S): leave the last space to the next word
    }
    if n > 0 {
        return pos + n; // \s+
    }
    pos + 1 // nothing matched: the code point stands alone
}

fn scan_gpt2(cps: &[(usize, char)]) -> Vec<usize> {
    let c = Cursor { cps };
    let mut lens = Vec::new();
    let mut pos = 0;
    while pos < c.len() {
        let start = pos;
        if let Some(n) = contraction(&c, pos, false) {
            pos += n;
        } else {
            let space = c.cp(pos) == ' ' as u32;
            let mut f2 = if space {
                c.flags(pos + 1)
            } else {
                c.flags(pos)
            };
            let other = |f: Flags| !(f.whitespace() || f.letter() || f.number()) && f.any();
            if f2.letter() {
                pos += usize::from(space);
                while f2.letter() {
                    pos += 1;
                    f2 = c.flags(pos);
                }
            } else if f2.number() {
                pos += usize::from(space);
                while f2.number() {
                    pos += 1;
                    f2 = c.flags(pos);
                }
            } else if other(f2) {
                pos += usize::from(space);
                while other(f2) {
                    pos += 1;
                    f2 = c.flags(pos);
                }
            } else {
                pos = whitespace_run(&c, pos, false);
            }
        }
        lens.push(pos - start);
    }
    lens
}

fn scan_llama3_like(cps: &[(usize, char)], digits: usize, marks_are_letters: bool) -> Vec<usize> {
    let c = Cursor { cps };
    let wordish = |f: Flags| f.letter() || (marks_are_letters && f.mark());
    let mut lens = Vec::new();
    let push = |lens: &mut Vec<usize>, from: usize, to: usize| {
        if to > from {
            lens.push(to - from);
        }
    };
    let mut pos = 0;
    while pos < c.len() {
        let start = pos;
        let cp = c.cp(pos);
        let f = c.flags(pos);
        if let Some(n) = contraction(&c, pos, true) {
            pos += n;
            push(&mut lens, start, pos);
            continue;
        }
        // [^\r\n\p{L}\p{N}]?\p{L}+ : one optional non-letter, non-digit lead, then letters.
        if !(cp == '\r' as u32 || cp == '\n' as u32 || f.number())
            && (wordish(f) || wordish(c.flags(pos + 1)))
        {
            pos += 1;
            while wordish(c.flags(pos)) {
                pos += 1;
            }
            push(&mut lens, start, pos);
            continue;
        }
        // \p{N}{1,digits}
        if f.number() {
            let mut run_start = pos;
            while c.flags(pos).number() {
                pos += 1;
                if pos - run_start >= digits {
                    push(&mut lens, run_start, pos);
                    run_start = pos;
                }
            }
            push(&mut lens, run_start, pos);
            continue;
        }
        // ' ?[^\s\p{L}\p{N}]+[\r\n]*'
        let other = |f: Flags| !(f.whitespace() || wordish(f) || f.number()) && f.any();
        let space = cp == ' ' as u32;
        let mut f2 = if space { c.flags(pos + 1) } else { f };
        if !(f2.whitespace() || wordish(f2) || f2.number()) && f.any() {
            pos += usize::from(space);
            while other(f2) {
                pos += 1;
                f2 = c.flags(pos);
            }
            while c.cp(pos) == '\r' as u32 || c.cp(pos) == '\n' as u32 {
                pos += 1;
            }
            push(&mut lens, start, pos);
            continue;
        }
        pos = whitespace_run(&c, pos, true);
        push(&mut lens, start, pos);
    }
    lens
}

fn split_regexes(
    list: &[fancy_regex::Regex],
    text: &str,
) -> Result<Vec<(usize, usize)>, TokenizerError> {
    let mut pieces = vec![(0, text.len())];
    for re in list {
        let mut next = Vec::with_capacity(pieces.len());
        for &(a, b) in &pieces {
            let piece = text.get(a..b).unwrap_or("");
            let mut last = 0;
            for m in re.find_iter(piece) {
                let m = m.map_err(|e| {
                    TokenizerError::Invalid(format!("pre-tokenizer expression failed: {e}"))
                })?;
                if m.start() > last {
                    next.push((a + last, a + m.start()));
                }
                if m.end() > m.start() {
                    next.push((a + m.start(), a + m.end()));
                }
                last = m.end();
            }
            if last < piece.len() {
                next.push((a + last, b));
            }
        }
        pieces = next;
    }
    Ok(pieces)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(s: &Splitter, text: &str) -> Vec<String> {
        s.split(text)
            .unwrap()
            .into_iter()
            .map(|(a, b)| text[a..b].to_string())
            .collect()
    }

    #[test]
    fn qwen2_words() {
        let s = Splitter::Llama3Like {
            digits: 1,
            marks_are_letters: false,
        };
        assert_eq!(words(&s, "Hello, world!"), ["Hello", ",", " world", "!"]);
        assert_eq!(words(&s, "I'LL 123"), ["I", "'LL", " ", "1", "2", "3"]);
        assert_eq!(words(&s, "a  \n\n b"), ["a", "  \n\n", " b"]);
        assert_eq!(words(&s, "x   y  "), ["x", "  ", " y", "  "]);
    }

    #[test]
    fn llama3_digit_groups() {
        let s = Splitter::Llama3Like {
            digits: 3,
            marks_are_letters: false,
        };
        assert_eq!(words(&s, "1234567"), ["123", "456", "7"]);
    }

    #[test]
    fn gpt2_words() {
        let s = Splitter::Gpt2;
        assert_eq!(
            words(&s, "Hello world's 42!!"),
            ["Hello", " world", "'s", " 42", "!!"]
        );
    }

    #[test]
    fn qwen35_keeps_marks_with_letters() {
        let q35 = Splitter::Llama3Like {
            digits: 1,
            marks_are_letters: true,
        };
        let q2 = Splitter::Llama3Like {
            digits: 1,
            marks_are_letters: false,
        };
        let text = "e\u{301}te\u{301}";
        assert_eq!(words(&q35, text).len(), 1);
        assert!(words(&q2, text).len() > 1);
    }
}
