//! PLE n-gram row ids (spec §5.2): pure integer hashing of the token history on the host.
//!
//! Context tokens `c_0 = x_t, c_1 = x_{t−1}, …`; `c_s` (s ≥ 1) becomes EOS once the walk back
//! meets the sequence start or an EOS, so the context never reaches past the last EOS strictly
//! before t (the virtual history before the start is all EOS).

use crate::error::{EngineError, Result};

use super::config::PleConfig;

/// Row ids into the n-gram table for each of `new` (continuing `history`), head-major per token:
/// `[t0 head 0, t0 head 1, …, t1 head 0, …]`.
pub(crate) fn row_ids(p: &PleConfig, history: &[u32], new: &[u32]) -> Result<Vec<u32>> {
    let n_heads = p.n_heads();
    let mut out = Vec::with_capacity(new.len() * n_heads);
    let mut ctx = vec![0u64; p.ngram_size];
    for (i, &tok) in new.iter().enumerate() {
        let at = |back: usize| -> Option<u32> {
            // token `back` positions before new[i]
            if back <= i {
                Some(new[i - back])
            } else {
                let j = back - i;
                history.len().checked_sub(j).map(|k| history[k])
            }
        };
        ctx[0] = u64::from(tok);
        let mut cut = false;
        for (s, c) in ctx.iter_mut().enumerate().skip(1) {
            let t = if cut { None } else { at(s) };
            cut = cut || t.is_none() || t == Some(p.eos);
            *c = if cut {
                u64::from(p.eos)
            } else {
                u64::from(t.unwrap_or(p.eos))
            };
        }
        for n in 2..=p.ngram_size {
            let mixed = ctx
                .iter()
                .zip(&p.multipliers)
                .take(n)
                .fold(0u64, |h, (&c, &m)| h ^ c.wrapping_mul(m));
            for j in 0..p.heads_per_ngram {
                let head = (n - 2) * p.heads_per_ngram + j;
                let row = mixed % p.vocab_sizes[head] + p.offsets[head];
                out.push(u32::try_from(row).map_err(|_| {
                    EngineError::Input(format!(
                        "PLE row {row} of head {head} does not fit a 32-bit row index"
                    ))
                })?);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> PleConfig {
        PleConfig {
            layer: 1,
            ngram_size: 3,
            heads_per_ngram: 1,
            conv_kernel: 4,
            eos: 9,
            head_dim: 1,
            multipliers: vec![3, 5, 7],
            offsets: vec![0, 1000],
            vocab_sizes: vec![1000, 1000],
        }
    }

    /// The spec's definition, written out per position over the whole sequence.
    fn by_definition(p: &PleConfig, seq: &[u32]) -> Vec<u32> {
        let mut out = vec![];
        for t in 0..seq.len() {
            let mut c = vec![seq[t] as u64];
            for s in 1..p.ngram_size {
                let reset = t < s || seq[t - s..t].contains(&p.eos);
                c.push(if reset {
                    p.eos as u64
                } else {
                    seq[t - s] as u64
                });
            }
            let h2 = (c[0] * 3) ^ (c[1] * 5);
            let h3 = h2 ^ (c[2] * 7);
            out.push((h2 % 1000) as u32);
            out.push((h3 % 1000 + 1000) as u32);
        }
        out
    }

    #[test]
    fn eos_rule_and_split_history_agree_with_the_definition() {
        let p = cfg();
        let seq = [4u32, 6, 9, 2, 9, 9, 1, 3, 5];
        let want = by_definition(&p, &seq);
        assert_eq!(row_ids(&p, &[], &seq).unwrap(), want);
        for split in 0..seq.len() {
            let mut got = row_ids(&p, &[], &seq[..split]).unwrap();
            got.extend(row_ids(&p, &seq[..split], &seq[split..]).unwrap());
            assert_eq!(got, want, "split at {split}");
        }
    }
}
