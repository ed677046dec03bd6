//! The sampler flags (llama.cpp's names and defaults) and the chain they describe, as the JSON
//! form the server takes per request. Every value is checked against its documented range
//! (docs/SAMPLING.md) before anything else happens; `--sampler JSON` is checked by the engine's
//! `SamplerConfig::validate`, which names the stage, the field and the range.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use strata_engine::sampler::dry::{self, DryParams};
use strata_engine::sampler::penalties::PenaltyParams;
use strata_engine::sampler::slop::{parse_list, ListChoice, SlopConfig};
use strata_engine::sampler::{Pick, Sampler, SamplerConfig, Stage};
use strata_tokenizer::Tokenizer;

use super::{check_f32, check_i64};

/// The default order of the chain (llama.cpp's names; `slop` is strata's).
pub const DEFAULT_ORDER: &str = "penalties;dry;slop;top_k;top_p;min_p;temperature";

/// The sampling chain's knobs. Negative numbers are taken as values (`--temp -1`), then
/// refused or accepted by range like any other value.
#[derive(clap::Args, Clone, Debug)]
#[command(next_help_heading = "Sampling (ranges: docs/SAMPLING.md)")]
pub struct SampleArgs {
    /// Temperature, ≥ 0; 0 is greedy (ties to the lower token id)
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true)]
    pub temp: f32,
    /// Keep the k most likely tokens (0: off)
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p, in (0, 1] (1: off)
    #[arg(long, default_value_t = 0.95, allow_negative_numbers = true)]
    pub top_p: f32,
    /// Keep tokens at least this fraction as likely as the best one, in [0, 1] (0: off)
    #[arg(long, default_value_t = 0.05, allow_negative_numbers = true)]
    pub min_p: f32,
    /// Seed of the draws (default: from the clock; printed with --verbose)
    #[arg(long)]
    pub seed: Option<u64>,
    /// A whole sampler chain as JSON (replaces the options above), e.g.
    /// '{"stages":[{"type":"top_k","k":20},{"type":"temperature","t":0.7}],"pick":{"type":"draw","seed":1}}'
    #[arg(long, value_name = "JSON")]
    pub sampler: Option<String>,
    /// Repetition penalty over the last --repeat-last-n tokens, > 0 (1: off)
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub repeat_penalty: f32,
    /// Tokens the penalties look back over (-1: all, 0: off)
    #[arg(long, default_value_t = 64, allow_negative_numbers = true)]
    pub repeat_last_n: i64,
    /// Subtracted per occurrence in the window, any finite number (0: off)
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    /// Subtracted once for any occurrence in the window, any finite number (0: off)
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    /// DRY strength, ≥ 0 (0: off)
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub dry_multiplier: f32,
    /// DRY growth per token of repeat past the allowed length, ≥ 1
    #[arg(long, default_value_t = 1.75, allow_negative_numbers = true)]
    pub dry_base: f32,
    /// Longest repeat DRY leaves alone
    #[arg(long, default_value_t = 2)]
    pub dry_allowed_length: u32,
    /// Tokens DRY searches (-1: all, 0: off)
    #[arg(long, default_value_t = -1, allow_negative_numbers = true)]
    pub dry_penalty_last_n: i64,
    /// A DRY sequence breaker (repeatable; replaces the defaults "\n", ":", "\"", "*")
    #[arg(long, value_name = "TEXT")]
    pub dry_sequence_breaker: Vec<String>,
    /// Order of the chain, names separated by ';' or ',' (stages left out do not run)
    #[arg(long, value_name = "LIST", default_value = DEFAULT_ORDER)]
    pub samplers: String,
    /// Slop penalties: 0 off, 1 token level (penalties and newline/blank run caps), 2 phrase
    /// level with rewinds (no listed phrase is ever written). Default: 0, or 2 when
    /// --slop-phrase or --slop-list is given
    #[arg(long, value_name = "0|1|2")]
    pub slop_mode: Option<u8>,
    /// A slop list replacing the built-in one: one `"phrase" penalty` per line (see
    /// crates/engine/data/slop.txt); `none` for no list (only --slop-phrase), `default` for
    /// the built-in one
    #[arg(long, value_name = "FILE")]
    pub slop_list: Option<PathBuf>,
    /// A phrase banned outright (repeatable), on top of the list
    #[arg(long, value_name = "TEXT")]
    pub slop_phrase: Vec<String>,
    /// Longest run of newline tokens under slop (0: no cap)
    #[arg(long, default_value_t = 3)]
    pub slop_newline_run: u32,
    /// Longest run of blank (whitespace-only) tokens under slop (0: no cap)
    #[arg(long, default_value_t = 4)]
    pub slop_blank_run: u32,
    /// Most phrase rewinds per reply under slop mode 2; past it the reply ends before the phrase
    #[arg(long, default_value_t = 64)]
    pub slop_max_rewinds: u32,
}

/// The seed of a draw when none is given.
fn clock_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

impl SampleArgs {
    /// Every flag against its range, whether or not its stage will run (a value out of range
    /// is a mistake even where it would be a no-op).
    fn check_ranges(&self) -> Result<()> {
        check_f32(
            "--temp",
            self.temp,
            |t| t >= 0.0 && t.is_finite(),
            "a number ≥ 0 (0: greedy)",
        )?;
        check_f32(
            "--top-p",
            self.top_p,
            |p| p > 0.0 && p <= 1.0,
            "a number in (0, 1] (1: off)",
        )?;
        check_f32(
            "--min-p",
            self.min_p,
            |p| (0.0..=1.0).contains(&p),
            "a number in [0, 1] (0: off)",
        )?;
        check_f32(
            "--repeat-penalty",
            self.repeat_penalty,
            |r| r > 0.0 && r.is_finite(),
            "a number > 0 (1: off)",
        )?;
        check_i64(
            "--repeat-last-n",
            self.repeat_last_n,
            -1,
            "-1 (all), 0 (off) or a count",
        )?;
        for (flag, v) in [
            ("--frequency-penalty", self.frequency_penalty),
            ("--presence-penalty", self.presence_penalty),
        ] {
            check_f32(flag, v, f32::is_finite, "a finite number (0: off)")?;
        }
        check_f32(
            "--dry-multiplier",
            self.dry_multiplier,
            |m| m >= 0.0 && m.is_finite(),
            "a number ≥ 0 (0: off)",
        )?;
        check_f32(
            "--dry-base",
            self.dry_base,
            |b| b >= 1.0 && b.is_finite(),
            "a number ≥ 1",
        )?;
        check_i64(
            "--dry-penalty-last-n",
            self.dry_penalty_last_n,
            -1,
            "-1 (all), 0 (off) or a count",
        )?;
        if self.dry_sequence_breaker.iter().any(String::is_empty) {
            bail!("--dry-sequence-breaker \"\": a breaker must not be empty");
        }
        if let Some(m) = self.slop_mode.filter(|&m| m > 2) {
            bail!("--slop-mode {m}: out of range; expected 0, 1 or 2");
        }
        for (flag, v) in [
            ("--slop-newline-run", self.slop_newline_run),
            ("--slop-blank-run", self.slop_blank_run),
        ] {
            if v > i32::MAX as u32 {
                bail!(
                    "{flag} {v}: out of range; expected 0 (no cap) to {}",
                    i32::MAX
                );
            }
        }
        Ok(())
    }

    fn slop(&self) -> Result<SlopConfig> {
        let mode = match self.slop_mode {
            Some(m) => m,
            None if self.slop_list.is_some() || !self.slop_phrase.is_empty() => 2,
            None => 0,
        };
        let (list, entries) = match &self.slop_list {
            Some(p) if p.as_os_str() == "none" => (ListChoice::None, Vec::new()),
            Some(p) if p.as_os_str() == "default" => (ListChoice::Default, Vec::new()),
            Some(p) => {
                crate::output::check_input("--slop-list", p)?;
                let text = std::fs::read_to_string(p)
                    .with_context(|| format!("--slop-list {}", p.display()))?;
                (
                    ListChoice::None,
                    parse_list(&text, &p.display().to_string())?,
                )
            }
            None => (ListChoice::Default, Vec::new()),
        };
        let c = SlopConfig {
            mode,
            list,
            entries,
            ban: self.slop_phrase.clone(),
            newline_run_cap: self.slop_newline_run,
            blank_run_cap: self.slop_blank_run,
            max_rewinds: self.slop_max_rewinds,
        };
        c.validate().map_err(anyhow::Error::msg)?;
        Ok(c)
    }

    /// The chain the flags describe, in `--samplers` order, without the stages whose settings
    /// make them no-ops; `--sampler JSON` replaces it all. A temperature of 0 is greedy: the
    /// filters and temperature go, the logit edits (penalties, DRY, slop) stay.
    pub fn resolve(&self) -> Result<SamplerConfig> {
        if let Some(json) = &self.sampler {
            return SamplerConfig::from_json(json).context("--sampler");
        }
        self.check_ranges()?;
        let greedy = self.temp == 0.0;
        let mut stages = Vec::new();
        for name in self
            .samplers
            .split([';', ','])
            .map(str::trim)
            .filter(|s| !s.is_empty())
        {
            let stage = match name {
                "penalties" => Some(Stage::Penalties(PenaltyParams {
                    last_n: self.repeat_last_n,
                    repeat: self.repeat_penalty,
                    frequency: self.frequency_penalty,
                    presence: self.presence_penalty,
                }))
                .filter(|s| !matches!(s, Stage::Penalties(p) if p.is_neutral())),
                "dry" => Some(Stage::Dry(DryParams {
                    multiplier: self.dry_multiplier,
                    base: self.dry_base,
                    allowed_length: self.dry_allowed_length,
                    last_n: self.dry_penalty_last_n,
                    sequence_breakers: if self.dry_sequence_breaker.is_empty() {
                        dry::default_breakers()
                    } else {
                        self.dry_sequence_breaker.clone()
                    },
                }))
                .filter(|s| !matches!(s, Stage::Dry(p) if p.is_neutral())),
                "slop" => Some(Stage::Slop(self.slop()?))
                    .filter(|s| !matches!(s, Stage::Slop(c) if c.mode == 0)),
                "top_k" => (!greedy && self.top_k > 0).then_some(Stage::TopK { k: self.top_k }),
                "top_p" => (!greedy && self.top_p < 1.0).then_some(Stage::TopP {
                    p: self.top_p,
                    min_keep: 1,
                }),
                "min_p" => (!greedy && self.min_p > 0.0).then_some(Stage::MinP {
                    p: self.min_p,
                    min_keep: 1,
                }),
                "temperature" => {
                    (!greedy && self.temp != 1.0).then_some(Stage::Temperature { t: self.temp })
                }
                other => bail!(
                    "--samplers: unknown stage {other:?}; expected names from {DEFAULT_ORDER}"
                ),
            };
            if let Some(s) = stage {
                if stages.contains(&s) {
                    bail!("--samplers names {name:?} twice");
                }
                stages.push(s);
            }
        }
        let pick = if greedy {
            Pick::Greedy
        } else {
            Pick::Draw {
                seed: self.seed.unwrap_or_else(clock_seed),
            }
        };
        let c = SamplerConfig { stages, pick };
        c.validate()?;
        Ok(c)
    }
}

/// The sampler for a resolved chain, bound to the model's vocabulary (DRY breakers, slop
/// phrases and classes).
pub fn build(config: &SamplerConfig, tok: &Tokenizer) -> Result<Sampler> {
    Sampler::with_vocab(config.clone(), tok).context("building the sampler")
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        s: SampleArgs,
    }

    fn resolve(args: &[&str]) -> Result<SamplerConfig> {
        let mut v = vec!["t"];
        v.extend_from_slice(args);
        T::try_parse_from(v)
            .map_err(anyhow::Error::from)?
            .s
            .resolve()
    }

    #[test]
    fn out_of_range_values_name_flag_value_and_range() {
        for (args, want) in [
            (
                &["--top-p", "2"][..],
                "--top-p 2: out of range; expected a number in (0, 1]",
            ),
            (&["--top-p", "nan"], "--top-p NaN"),
            (&["--min-p", "nan"], "--min-p NaN"),
            (&["--min-p", "5"], "--min-p 5"),
            (
                &["--temp", "-1"],
                "--temp -1: out of range; expected a number ≥ 0",
            ),
            (&["--temp=-1"], "--temp -1"),
            (&["--repeat-penalty", "0"], "--repeat-penalty 0"),
            (&["--presence-penalty", "inf"], "--presence-penalty inf"),
            (&["--dry-base", "0.5"], "--dry-base 0.5"),
            (&["--repeat-last-n", "-2"], "--repeat-last-n -2"),
            (&["--slop-mode", "3"], "--slop-mode 3"),
        ] {
            let e = resolve(args).unwrap_err().to_string();
            assert!(e.starts_with(want), "{args:?}: {e}");
        }
    }

    #[test]
    fn negative_values_are_values() {
        let c = resolve(&["--presence-penalty", "-0.5", "--temp", "0"]).unwrap();
        assert_eq!(c.pick, Pick::Greedy);
        assert!(matches!(&c.stages[..], [Stage::Penalties(p)] if p.presence == -0.5));
    }

    #[test]
    fn the_json_chain_is_range_checked_too() {
        for (json, want) in [
            (
                r#"{"stages":[{"type":"top_p","p":2}],"pick":{"type":"greedy"}}"#,
                "top_p 2",
            ),
            (
                r#"{"stages":[{"type":"min_p","p":-0.5}],"pick":{"type":"greedy"}}"#,
                "min_p -0.5",
            ),
            (
                r#"{"stages":[{"type":"temperature","t":-1}],"pick":{"type":"greedy"}}"#,
                "temperature -1",
            ),
        ] {
            let e = format!("{:#}", resolve(&["--sampler", json]).unwrap_err());
            assert!(
                e.starts_with("--sampler: ") && e.contains(want),
                "{json}: {e}"
            );
        }
    }
}
