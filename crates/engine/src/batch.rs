//! The rows of one step split into sequences (issue 15): a batch runs several sequences'
//! rows — decode tokens, verify windows, prefill chunks — through one forward pass. The
//! row-parallel work (norms, every matrix product, router, experts, the LM head) runs once over
//! all rows; the work that reads a sequence's own state (attention over its cache, the GDN and
//! conv recurrences, the indexer's blocks, the PLE history) runs on each sequence's rows in
//! turn ([`Split::each`]). Every operation gives a row the bits it would get alone (DESIGN.md
//! §3), so each sequence in a batch gets exactly its solo bits.
//!
//! A [`Split`] is built inside the step from the step's inputs (the per-sequence views are
//! `ids_range` views, the row slots are uploaded with the inputs), so a batched step stays
//! capturable: its operations depend only on the sequences' row counts.

use crate::backend::{Backend, DeviceBuf, StepInputs};
use crate::error::{EngineError, Result};

/// One sequence's part of a batched step.
struct Part<B: Backend> {
    len: usize,
    /// The step's inputs for this sequence's rows (views of the whole step's).
    inputs: StepInputs<B>,
    /// The rows `start..start + len` of the step, where this part's results go back.
    slots: B::Ids,
    /// Where this part's logits rows go in the step's output (its last row, or all of them).
    out: B::Ids,
    /// Logits of the last row only.
    last_only: bool,
}

/// How a step's rows split into sequences; [`Split::one`] for a step of one sequence (nothing
/// is split or joined: the solo pass runs exactly its old operations).
pub struct Split<B: Backend> {
    parts: Vec<Part<B>>,
    lens: Vec<usize>,
    out_rows: usize,
}

impl<B: Backend> Split<B> {
    /// A step whose rows are all one sequence's.
    pub fn one() -> Self {
        Split {
            parts: Vec::new(),
            lens: Vec::new(),
            out_rows: 0,
        }
    }

    /// The rows of `all` as consecutive parts of `lens` rows, each wanting the logits of its
    /// last row only or of every row (`last_only`). Call inside the step (it uploads the row
    /// slots beside the step's inputs).
    pub fn new(b: &B, all: &StepInputs<B>, lens: &[usize], last_only: &[bool]) -> Result<Self> {
        if lens.len() != last_only.len()
            || lens.contains(&0)
            || lens.iter().sum::<usize>() != all.rows()
        {
            return Err(EngineError::shape(
                "batch",
                format!("parts of {lens:?} rows of a step of {}", all.rows()),
            ));
        }
        if lens.len() == 1 {
            return Ok(Self::one());
        }
        let mut parts = Vec::with_capacity(lens.len());
        let (mut start, mut out) = (0usize, 0usize);
        for (&len, &last) in lens.iter().zip(last_only) {
            let slots: Vec<u32> = (start..start + len).map(|r| r as u32).collect();
            let n_out = if last { 1 } else { len };
            let outs: Vec<u32> = (out..out + n_out).map(|r| r as u32).collect();
            parts.push(Part {
                len,
                inputs: all.range(b, start, len)?,
                slots: b.upload_ids(&slots)?,
                out: b.upload_ids(&outs)?,
                last_only: last,
            });
            start += len;
            out += n_out;
        }
        Ok(Split {
            parts,
            lens: lens.to_vec(),
            out_rows: out,
        })
    }

    /// Sequences in the step.
    pub fn sequences(&self) -> usize {
        self.parts.len().max(1)
    }

    /// Whether the step is one sequence's.
    pub fn is_one(&self) -> bool {
        self.parts.is_empty()
    }

    /// Sequence `i`'s step inputs (`all` itself for a step of one sequence).
    pub fn inputs<'a>(&'a self, all: &'a StepInputs<B>, i: usize) -> &'a StepInputs<B> {
        match self.parts.get(i) {
            Some(p) => &p.inputs,
            None => all,
        }
    }

    /// Runs `f` on each sequence's rows of `xs` (whole buffers, handed over: a part may keep
    /// them, as a replay log does) with that sequence's index and step inputs, and joins the
    /// results back into the step's row order. `f` returns one row per input row.
    pub fn each(
        &self,
        b: &B,
        all: &StepInputs<B>,
        xs: Vec<B::Buf>,
        mut f: impl FnMut(usize, &StepInputs<B>, Vec<B::Buf>) -> Result<B::Buf>,
    ) -> Result<B::Buf> {
        if self.is_one() {
            return f(0, all, xs);
        }
        let mut split: Vec<std::vec::IntoIter<B::Buf>> = xs
            .into_iter()
            .map(|x| b.split_rows(x, &self.lens).map(Vec::into_iter))
            .collect::<Result<_>>()?;
        let mut ys = Vec::with_capacity(self.parts.len());
        for (i, p) in self.parts.iter().enumerate() {
            let mine = split
                .iter_mut()
                .map(|s| s.next().ok_or_else(|| EngineError::shape("batch", "split")))
                .collect::<Result<Vec<_>>>()?;
            let y = f(i, &p.inputs, mine)?;
            if y.rows() != p.len {
                return Err(EngineError::shape(
                    "batch",
                    format!("{} rows back from a part of {}", y.rows(), p.len),
                ));
            }
            ys.push(y);
        }
        self.join(b, all.rows(), ys, |p| &p.slots)
    }

    /// The rows whose logits the step returns: each sequence's last row, or all its rows.
    /// `x` is every row of the step.
    pub fn output_rows(&self, b: &B, x: B::Buf) -> Result<B::Buf> {
        if self.is_one() || self.parts.iter().all(|p| !p.last_only) {
            return Ok(x);
        }
        let parts = b.split_rows(x, &self.lens)?;
        let ys = parts
            .into_iter()
            .zip(&self.parts)
            .map(|(y, p)| if p.last_only { b.last_row(y) } else { Ok(y) })
            .collect::<Result<Vec<_>>>()?;
        self.join(b, self.out_rows, ys, |p| &p.out)
    }

    /// Rows of the step's output that belong to sequence `i` (`start`, `len`), given the
    /// output has one row per sequence's wanted row.
    pub fn output_range(&self, i: usize, total: usize) -> (usize, usize) {
        if self.is_one() {
            return (0, total);
        }
        let start = self.parts[..i]
            .iter()
            .map(|p| if p.last_only { 1 } else { p.len })
            .sum();
        let p = &self.parts[i];
        (start, if p.last_only { 1 } else { p.len })
    }

    fn join(
        &self,
        b: &B,
        rows: usize,
        ys: Vec<B::Buf>,
        at: impl Fn(&Part<B>) -> &B::Ids,
    ) -> Result<B::Buf> {
        let cols = ys.first().map_or(0, |y| y.cols());
        let mut out = b.zeros(rows, cols)?;
        for (y, p) in ys.iter().zip(&self.parts) {
            b.write_rows(&mut out, y, at(p))?;
        }
        Ok(out)
    }
}

/// The `seq` of a batched step's key: the batch's composition (each sequence's id, rows and
/// what it wants back: bit 0 its last logits only, the other bits the model's own — hidden
/// rows, a replay log), hashed (FNV-1a), so the same composition gives the same key and
/// different ones differ.
pub fn batch_key(parts: &[(u64, usize, u32)]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |v: u64| {
        for byte in v.to_le_bytes() {
            h ^= u64::from(byte);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    for &(id, rows, wants) in parts {
        eat(id);
        eat(rows as u64);
        eat(u64::from(wants));
    }
    h
}
