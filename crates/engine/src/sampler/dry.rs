//! The `dry` stage ("Don't Repeat Yourself", after koboldcpp's sampler as llama.cpp carries it):
//! a token that would extend a verbatim repeat of an earlier stretch of the window is lowered
//! by `multiplier · base^(n − allowed_length)`, where `n` is the length of the repeat it would
//! continue, for `n ≥ allowed_length`.
//!
//! A sequence breaker stops repeats: a repeat may not reach back across the latest breaker
//! token, and a breaker token itself is never penalized. A token is a breaker when its text
//! contains one of the breaker strings. (llama.cpp also matches a breaker string spread over
//! several tokens; strata does not, which only matters for multi-token breakers.)
//!
//! The repeat lengths come from the Z-function of the reversed window: `z[k]` is how many
//! tokens before the latest one agree with the tokens before position `len − k`, which is the
//! repeat that token `window[len − k]` would continue. Linear in the window.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::penalties::window;
use super::view::LogitEdit;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DryParams {
    /// Strength (0: off).
    pub multiplier: f32,
    /// Growth per token of repeat beyond the allowed length (≥ 1).
    #[serde(default = "default_base")]
    pub base: f32,
    /// Longest repeat left alone.
    #[serde(default = "default_allowed")]
    pub allowed_length: u32,
    /// How many of the latest tokens are searched: −1 the whole history, 0 none (off).
    #[serde(default = "default_last_n")]
    pub last_n: i64,
    /// Strings whose tokens break repeats.
    #[serde(default = "default_breakers")]
    pub sequence_breakers: Vec<String>,
}

fn default_base() -> f32 {
    1.75
}
fn default_allowed() -> u32 {
    2
}
fn default_last_n() -> i64 {
    -1
}
/// llama.cpp's defaults.
pub fn default_breakers() -> Vec<String> {
    ["\n", ":", "\"", "*"]
        .iter()
        .map(|s| s.to_string())
        .collect()
}

impl Default for DryParams {
    fn default() -> Self {
        DryParams {
            multiplier: 0.0,
            base: default_base(),
            allowed_length: default_allowed(),
            last_n: default_last_n(),
            sequence_breakers: default_breakers(),
        }
    }
}

impl DryParams {
    pub fn is_neutral(&self) -> bool {
        self.multiplier == 0.0 || self.last_n == 0
    }

    pub fn validate(&self) -> Result<(), String> {
        if !(self.multiplier.is_finite() && self.multiplier >= 0.0) {
            return Err(format!(
                "dry multiplier {}; expected a number ≥ 0 (0 is off)",
                self.multiplier
            ));
        }
        if !(self.base.is_finite() && self.base >= 1.0) {
            return Err(format!("dry base {}; expected a number ≥ 1", self.base));
        }
        if self.last_n < -1 {
            return Err(format!(
                "dry last_n {}; expected -1 (all), 0 (off) or a count",
                self.last_n
            ));
        }
        if self.sequence_breakers.iter().any(|s| s.is_empty()) {
            return Err("dry sequence breakers must not be empty strings".to_string());
        }
        Ok(())
    }
}

/// The breaker tokens: sorted ids whose text contains a breaker string.
pub fn breaker_ids(p: &DryParams, n_vocab: usize, piece: &dyn Fn(u32) -> Vec<u8>) -> Vec<u32> {
    if p.sequence_breakers.is_empty() {
        return Vec::new();
    }
    let pats: Vec<&[u8]> = p.sequence_breakers.iter().map(|s| s.as_bytes()).collect();
    (0..n_vocab as u32)
        .filter(|&id| {
            let t = piece(id);
            pats.iter().any(|p| t.windows(p.len()).any(|w| w == *p))
        })
        .collect()
}

/// Z-function of `s` read backwards: `z[k]` = length of the longest common suffix of `s` and
/// `s[..len − k]` (`z[0]` = len).
fn reverse_z(s: &[u32]) -> Vec<usize> {
    let n = s.len();
    let at = |i: usize| s[n - 1 - i];
    let mut z = vec![0usize; n];
    if n == 0 {
        return z;
    }
    z[0] = n;
    let (mut l, mut r) = (0usize, 0usize); // [l, r): the rightmost match window found so far
    for k in 1..n {
        let mut m = if k < r { z[k - l].min(r - k) } else { 0 };
        while k + m < n && at(m) == at(k + m) {
            m += 1;
        }
        z[k] = m;
        if k + m > r {
            l = k;
            r = k + m;
        }
    }
    z
}

/// The penalty per token id that the window's repeats call for (test and draft helper too).
pub fn penalties(p: &DryParams, breakers: &[u32], history: &[u32]) -> HashMap<u32, f32> {
    let mut out = HashMap::new();
    if p.is_neutral() {
        return out;
    }
    let w = window(history, p.last_n);
    let n = w.len();
    let allowed = p.allowed_length as usize;
    if n <= allowed {
        return out;
    }
    let is_breaker = |t: u32| breakers.binary_search(&t).is_ok();
    // A repeat may not reach back past the latest breaker.
    let limit = w.iter().rev().position(|&t| is_breaker(t)).unwrap_or(n);
    if limit < allowed {
        return out;
    }
    let z = reverse_z(w);
    let mut longest: HashMap<u32, usize> = HashMap::new();
    for (k, &zk) in z.iter().enumerate().skip(1) {
        let len = zk.min(limit);
        if len >= allowed {
            let next = w[n - k];
            let e = longest.entry(next).or_insert(0);
            *e = (*e).max(len);
        }
    }
    // Keep base^exp finite: exp ≤ ln(f32::MAX) / ln(base).
    let max_exp = if p.base > 1.000_001 {
        (88.722_84f32 / p.base.ln()) as i64
    } else {
        0
    };
    for (id, len) in longest {
        if is_breaker(id) {
            continue;
        }
        let mut exp = len as i64 - allowed as i64;
        if max_exp > 0 && exp > max_exp {
            exp = max_exp;
        }
        // In f64 then rounded once, as C++'s pow(float, int) promotes.
        let pen = f64::from(p.multiplier) * f64::from(p.base).powf(exp as f64);
        out.insert(id, pen as f32);
    }
    out
}

/// Applies the stage: each penalized token's logit minus its penalty.
pub fn apply(p: &DryParams, breakers: &[u32], history: &[u32], e: &mut dyn LogitEdit) {
    for (id, pen) in penalties(p, breakers, history) {
        e.edit(id, &mut |l: &mut f32| *l -= pen);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reverse_z_matches_brute_force() {
        let s = [1u32, 2, 3, 3, 2, 3, 9, 1, 2, 3];
        let z = reverse_z(&s);
        for (k, &zk) in z.iter().enumerate() {
            let n = s.len();
            let brute = (0..n - k)
                .take_while(|&m| s[n - 1 - m] == s[n - 1 - k - m])
                .count();
            assert_eq!(zk, brute, "k {k}");
        }
    }
}
