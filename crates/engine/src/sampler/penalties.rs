//! The `penalties` stage: repetition, frequency and presence penalties over the last n tokens
//! of the sequence (prompt included), with llama.cpp's arithmetic so a run can be compared
//! with it: a token seen `c` times in the window has its logit divided by `repeat` when
//! positive (multiplied when not, so a penalty never makes a token likelier), then lowered by
//! `c·frequency + presence`.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::view::LogitEdit;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PenaltyParams {
    /// How many of the latest tokens count: −1 the whole history, 0 none (the stage is off).
    #[serde(default = "default_last_n")]
    pub last_n: i64,
    /// Repetition penalty (1: off).
    #[serde(default = "one")]
    pub repeat: f32,
    /// Subtracted once per occurrence (0: off).
    #[serde(default)]
    pub frequency: f32,
    /// Subtracted once if the token occurs at all (0: off).
    #[serde(default)]
    pub presence: f32,
}

fn default_last_n() -> i64 {
    64
}

fn one() -> f32 {
    1.0
}

impl Default for PenaltyParams {
    fn default() -> Self {
        PenaltyParams {
            last_n: default_last_n(),
            repeat: 1.0,
            frequency: 0.0,
            presence: 0.0,
        }
    }
}

impl PenaltyParams {
    /// True when the stage changes nothing.
    pub fn is_neutral(&self) -> bool {
        self.last_n == 0 || (self.repeat == 1.0 && self.frequency == 0.0 && self.presence == 0.0)
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.last_n < -1 {
            return Err(format!(
                "penalties last_n {}; expected -1 (all), 0 (off) or a count",
                self.last_n
            ));
        }
        if !(self.repeat.is_finite() && self.repeat > 0.0) {
            return Err(format!(
                "repeat penalty {}; expected a number above 0 (1 is off)",
                self.repeat
            ));
        }
        if !self.frequency.is_finite() || !self.presence.is_finite() {
            return Err(format!(
                "frequency {} / presence {} penalty; expected finite numbers",
                self.frequency, self.presence
            ));
        }
        Ok(())
    }
}

/// The window of `history` that `last_n` selects.
pub(crate) fn window(history: &[u32], last_n: i64) -> &[u32] {
    match last_n {
        n if n < 0 => history,
        n => &history[history.len().saturating_sub(n as usize)..],
    }
}

/// Applies the penalties for the tokens of `history`'s window.
pub fn apply(p: &PenaltyParams, history: &[u32], e: &mut dyn LogitEdit) {
    if p.is_neutral() {
        return;
    }
    let mut count: HashMap<u32, u32> = HashMap::new();
    for &t in window(history, p.last_n) {
        *count.entry(t).or_insert(0) += 1;
    }
    for (&id, &c) in &count {
        e.edit(id, &mut |l: &mut f32| {
            if *l <= 0.0 {
                *l *= p.repeat;
            } else {
                *l /= p.repeat;
            }
            *l -= c as f32 * p.frequency + p.presence;
        });
    }
}
