//! SentencePiece (BPE flavour, as llama.cpp runs it): start from UTF-8 characters and
//! repeatedly merge the adjacent pair whose concatenation is the vocabulary token with the
//! highest score, leftmost first on ties; characters that never become tokens fall back to
//! byte tokens (`<0xXX>`).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

struct Cand {
    score: f32,
    left: usize,
    size: usize,
}

impl PartialEq for Cand {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Cand {}
impl PartialOrd for Cand {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Cand {
    /// Max-heap order: higher score first, then the lower left index.
    fn cmp(&self, o: &Self) -> Ordering {
        self.score
            .total_cmp(&o.score)
            .then_with(|| o.left.cmp(&self.left))
    }
}

#[derive(Clone, Copy)]
struct Sym {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// Splits `text` (already whitespace-escaped) into the pieces SentencePiece settles on.
/// Each piece is either a vocabulary token or a single character that is not one.
pub(crate) fn merge_text<'t>(
    text: &'t str,
    token_to_id: &HashMap<String, u32>,
    scores: &[f32],
) -> Vec<&'t str> {
    let mut syms: Vec<Sym> = Vec::with_capacity(text.len());
    let mut iter = text.char_indices().peekable();
    while let Some((i, c)) = iter.next() {
        let idx = syms.len();
        syms.push(Sym {
            start: i,
            len: c.len_utf8(),
            prev: idx.checked_sub(1),
            next: iter.peek().map(|_| idx + 1),
        });
    }
    let mut queue = BinaryHeap::new();
    let push = |queue: &mut BinaryHeap<Cand>, syms: &[Sym], l: Option<usize>, r: Option<usize>| {
        if let (Some(l), Some(r)) = (l, r) {
            let (a, b) = (&syms[l], &syms[r]);
            let joined = &text[a.start..b.start + b.len];
            if let Some(&id) = token_to_id.get(joined) {
                let score = scores.get(id as usize).copied().unwrap_or(0.0);
                queue.push(Cand {
                    score,
                    left: l,
                    size: joined.len(),
                });
            }
        }
    };
    for i in 1..syms.len() {
        push(&mut queue, &syms, Some(i - 1), Some(i));
    }
    while let Some(c) = queue.pop() {
        let l = c.left;
        let Some(r) = syms[l].next else { continue };
        if syms[l].len == 0 || syms[r].len == 0 || syms[l].len + syms[r].len != c.size {
            continue;
        }
        syms[l].len += syms[r].len;
        syms[r].len = 0;
        syms[l].next = syms[r].next;
        if let Some(n) = syms[r].next {
            syms[n].prev = Some(l);
        }
        push(&mut queue, &syms, syms[l].prev, Some(l));
        push(&mut queue, &syms, Some(l), syms[l].next);
    }
    syms.iter()
        .filter(|s| s.len > 0)
        .map(|s| &text[s.start..s.start + s.len])
        .collect()
}
