//! Byte-level BPE on one pre-tokenized word: start from single characters of the byte-level
//! spelling and repeatedly merge the adjacent pair with the best (lowest) merge rank, leftmost
//! first on ties, until no ranked pair remains.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use crate::TokenizerError;

/// Merge ranks keyed by the interned ids of the two sides, so that looking a pair up needs no
/// allocation.
#[derive(Debug, Default)]
pub(crate) struct Ranks {
    parts: HashMap<String, u32>,
    pairs: HashMap<(u32, u32), u32>,
}

impl Ranks {
    /// Parses `"left right"` merges (the split is the first space after the first byte, so a
    /// left side may itself start with a space). The first occurrence of a pair keeps its rank.
    pub(crate) fn new(merges: &[String]) -> Result<Ranks, TokenizerError> {
        let mut r = Ranks::default();
        for (rank, m) in merges.iter().enumerate() {
            let split = m
                .as_bytes()
                .iter()
                .skip(1)
                .position(|&b| b == b' ')
                .map(|p| p + 1);
            let Some(at) = split else {
                // llama.cpp keeps such a line as an empty pair that can never match.
                continue;
            };
            let (l, r_) = (&m[..at], &m[at + 1..]);
            let li = r.intern(l);
            let ri = r.intern(r_);
            let rank = u32::try_from(rank)
                .map_err(|_| TokenizerError::Invalid("more than 2^32 merges".into()))?;
            r.pairs.entry((li, ri)).or_insert(rank);
        }
        Ok(r)
    }

    fn intern(&mut self, s: &str) -> u32 {
        let n = self.parts.len() as u32;
        *self.parts.entry(s.to_string()).or_insert(n)
    }

    fn rank(&self, left: &str, right: &str) -> Option<u32> {
        let l = self.parts.get(left)?;
        let r = self.parts.get(right)?;
        self.pairs.get(&(*l, *r)).copied()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }
}

#[derive(Clone, Copy)]
struct Sym {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// Splits `word` (a byte-level spelling) into the substrings BPE settles on, in order.
pub(crate) fn merge_word<'w>(word: &'w str, ranks: &Ranks) -> Vec<&'w str> {
    let mut syms: Vec<Sym> = Vec::with_capacity(word.len());
    let mut iter = word.char_indices().peekable();
    while let Some((i, c)) = iter.next() {
        let idx = syms.len();
        syms.push(Sym {
            start: i,
            len: c.len_utf8(),
            prev: idx.checked_sub(1),
            next: iter.peek().map(|_| idx + 1),
        });
    }
    let text = |s: &Sym| &word[s.start..s.start + s.len];
    // (rank, left index, left len, right len): a queued pair is stale once either side changed
    // length, since a symbol only ever grows by absorbing its right neighbour.
    let mut queue: BinaryHeap<Reverse<(u32, usize, usize, usize)>> = BinaryHeap::new();
    let push = |queue: &mut BinaryHeap<_>, syms: &[Sym], l: Option<usize>, r: Option<usize>| {
        if let (Some(l), Some(r)) = (l, r) {
            let (sl, sr) = (&syms[l], &syms[r]);
            if let Some(rank) = ranks.rank(text(sl), text(sr)) {
                queue.push(Reverse((rank, l, sl.len, sr.len)));
            }
        }
    };
    for i in 1..syms.len() {
        push(&mut queue, &syms, Some(i - 1), Some(i));
    }
    while let Some(Reverse((_, l, llen, rlen))) = queue.pop() {
        let Some(r) = syms[l].next else { continue };
        if syms[l].len != llen || syms[r].len != rlen || llen == 0 || rlen == 0 {
            continue;
        }
        syms[l].len += rlen;
        syms[r].len = 0;
        syms[l].next = syms[r].next;
        if let Some(n) = syms[r].next {
            syms[n].prev = Some(l);
        }
        push(&mut queue, &syms, syms[l].prev, Some(l));
        push(&mut queue, &syms, Some(l), syms[l].next);
    }
    syms.iter().filter(|s| s.len > 0).map(text).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_by_rank_then_leftmost() {
        let merges: Vec<String> = ["a b", "b c", "ab c"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let r = Ranks::new(&merges).unwrap();
        assert_eq!(merge_word("abc", &r), ["abc"]);
        assert_eq!(merge_word("bcab", &r), ["bc", "ab"]);
        assert_eq!(merge_word("xyz", &r), ["x", "y", "z"]);
        // "aaa" with only "a a": the leftmost pair wins the tie.
        let r2 = Ranks::new(&["a a".to_string()]).unwrap();
        assert_eq!(merge_word("aaa", &r2), ["aa", "a"]);
    }
}
