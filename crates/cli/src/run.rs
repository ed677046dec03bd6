//! `strata run`: stream a completion of a prompt, plainly or with MTP speculative decoding
//! (`--mtp`, `--spec N`; qwen4exp).
//!
//! Everything is checked before the first byte of output: the flags (`args`), the model (loaded,
//! with its load-time checks), the prompt (tokenized, against the context) and the speculative
//! settings (against the model). stdout carries the text and nothing else, as llama.cpp's
//! `simple` example prints it: the prompt, then each token as it is chosen, then a newline.
//! Everything else goes to stderr.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use strata_engine::generate::{GenOptions, StopReason};
use strata_engine::qwen4exp;
use strata_engine::sampler::guard::GuardStop;
use strata_engine::sampler::Sampler;
use strata_engine::speculative::{self, DraftVocab, SpecConfig, SpecDecoder};
use strata_engine::Qwen4expOps;
use strata_tokenizer::{StreamDecoder, Tokenizer};

use crate::args::model::ModelArgs;
use crate::args::sampling::{self, SampleArgs};
use crate::args::spec::{SpecArgs, SpecChoice};
use crate::load::{self, Bound, Loaded};
use crate::output::Stream;
use crate::report;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt (special tokens such as <|im_start|> are parsed)
    #[arg(
        short = 'p',
        long,
        required_unless_present = "file",
        conflicts_with = "file"
    )]
    pub prompt: Option<String>,
    /// Read the prompt from a file (UTF-8, as it is)
    #[arg(short = 'f', long, value_name = "PATH")]
    pub file: Option<PathBuf>,
    /// Most tokens to generate
    #[arg(short = 'n', long = "n-predict", default_value_t = 256)]
    pub n_predict: usize,
    /// Do not print the prompt before the completion
    #[arg(long)]
    pub no_echo: bool,
    /// Load, speed (and speculation) report on stderr
    #[arg(short = 'v', long)]
    pub verbose: bool,
    #[command(flatten)]
    pub sample: SampleArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
}

/// The speculative settings bound to the model.
fn spec_config<B: Qwen4expOps>(
    s: &SpecChoice,
    model: &qwen4exp::Model<B>,
    path: &std::path::Path,
) -> Result<SpecConfig> {
    let window = s.window();
    if window > 1 && !model.has_mtp() {
        bail!(
            "--spec {window} needs an MTP head: {} carries no mtp.* tensors; give one with \
             --mtp MTP.gguf (strata convert-mtp makes it)",
            path.display()
        );
    }
    let draft_vocab = match &s.draft_vocab {
        Some(p) => Some(
            DraftVocab::load(p, model.config().n_vocab)
                .with_context(|| format!("--draft-vocab {}", p.display()))?,
        ),
        None => None,
    };
    Ok(SpecConfig {
        window,
        min_p: s.min_p,
        draft_vocab,
    })
}

pub fn run(args: Args) -> Result<ExitCode> {
    // Flags first: nothing is loaded for a command line that is wrong.
    let sampler_cfg = args.sample.resolve()?;
    let spec = args.spec.resolve()?;
    let choice = args.model.resolve()?;
    let text = match (&args.prompt, &args.file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) => {
            crate::output::check_input("--file", f)?;
            let bytes = std::fs::read(f).with_context(|| format!("--file {}", f.display()))?;
            String::from_utf8(bytes)
                .map_err(|e| anyhow::anyhow!("--file {}: not UTF-8 text ({e})", f.display()))?
        }
        (None, None) => bail!("give the prompt with -p TEXT or --file PATH"),
    };

    // The model, its tokenizer and sampler, the prompt against the context.
    let path = choice.path()?;
    let t0 = Instant::now();
    let opened = load::open(&path)?;
    if spec.is_some() && opened.arch != qwen4exp::config::ARCH {
        bail!(
            "MTP speculation needs a qwen4exp model; {} is {}",
            path.display(),
            opened.arch
        );
    }
    let mtp = spec.as_ref().and_then(|s| s.mtp.as_deref());
    let model = Loaded::bind(
        &opened,
        &path,
        choice.threads,
        choice.kv_type,
        mtp,
        choice.ctx_size,
        &choice.backend,
    )?;
    let tok = load::tokenizer(&opened.file, &path, model.n_vocab())?;
    let load_time = t0.elapsed();
    if args.verbose {
        eprintln!("model: {} ({})", path.display(), model.describe());
        eprintln!("backend: {}", model.backend_note);
    }
    let mut sampler = sampling::build(&sampler_cfg, &tok)?;
    let prompt = tok
        .encode(&text, true, true)
        .context("tokenizing the prompt")?;
    let n_ctx = load::n_ctx(choice.ctx_size, model.n_ctx_model())?;
    load::check_context("the prompt", prompt.len(), n_ctx)?;

    let run = Plan {
        tok: &tok,
        prompt: &prompt,
        n_predict: args.n_predict,
        n_ctx,
        echo: !args.no_echo,
        verbose: args.verbose,
        load_time,
    };
    let note = &model.backend_note;
    match (&model.model, &spec) {
        (Bound::Qwen4exp(m), Some(s)) => run.speculative(note, m, s, &path, &mut sampler),
        (Bound::Qwen4expCuda(m), Some(s)) => run.speculative(note, m, s, &path, &mut sampler),
        (Bound::Qwen4expWgpu(m), Some(s)) => run.speculative(note, m, s, &path, &mut sampler),
        _ => run.plain(&model, &mut sampler),
    }
}

/// A checked run, ready to write.
struct Plan<'a> {
    tok: &'a Tokenizer,
    prompt: &'a [u32],
    n_predict: usize,
    n_ctx: usize,
    echo: bool,
    verbose: bool,
    load_time: Duration,
}

impl Plan<'_> {
    /// The prompt's text, as llama.cpp prints it (special tokens' text too).
    fn echo(&self, out: &mut Stream, dec: &mut StreamDecoder) -> Result<()> {
        if self.echo {
            let mut text = String::new();
            for &id in self.prompt {
                text.push_str(&dec.push(self.tok, id)?);
            }
            text.push_str(&dec.flush());
            out.write(&text);
        }
        Ok(())
    }

    fn plain(&self, model: &Loaded, sampler: &mut Sampler) -> Result<ExitCode> {
        let mut session = model.session(self.n_ctx)?;
        let mut out = Stream::new();
        let mut dec = StreamDecoder::new(true);
        self.echo(&mut out, &mut dec)?;
        let mut tok_err = None;
        let opts = GenOptions {
            max_tokens: self.n_predict,
            ..Default::default()
        };
        // The guarded loop: slop's phrase level may rewind; text is streamed once final.
        let gg = strata_engine::sampler::guard::generate(
            session.as_mut(),
            self.prompt,
            sampler,
            &|id| self.tok.is_eog(id),
            &opts,
            &mut |id| match dec.push(self.tok, id) {
                Ok(s) => out.write(&s),
                Err(e) => {
                    tok_err = Some(e);
                    false
                }
            },
        )?;
        if let Some(e) = tok_err {
            return Err(e).context("detokenizing");
        }
        let rest = dec.flush();
        out.write(&format!("{rest}\n"));
        out.finish()?;
        if gg.generation.stop == StopReason::ContextFull {
            report::context_full(self.n_ctx);
        }
        if self.verbose {
            report::verbose(self.load_time, &gg.generation, &model.backend_note, sampler);
            report::slop(&gg);
        }
        Ok(ExitCode::SUCCESS)
    }

    /// Through the speculative controller, with the guarded loop's semantics: penalties and
    /// slop (modes 1 and 2, with phrase rewinds and held-back streaming) on the verify rows and
    /// on the drafts.
    fn speculative<B: Qwen4expOps>(
        &self,
        backend: &str,
        model: &qwen4exp::Model<B>,
        spec: &SpecChoice,
        path: &std::path::Path,
        sampler: &mut Sampler,
    ) -> Result<ExitCode> {
        let mut dec = SpecDecoder::new(model, spec_config(spec, model, path)?)?;
        // The controller knows no context limit of its own: the budget stops at it.
        let room = self.n_ctx - self.prompt.len();
        let budget = self.n_predict.min(room);
        let mut out = Stream::new();
        let mut text = StreamDecoder::new(true);
        self.echo(&mut out, &mut text)?;
        let mut tok_err = None;
        let t1 = Instant::now();
        let generated = speculative::guarded::generate(
            &mut dec,
            self.prompt,
            sampler,
            &|id| self.tok.is_eog(id),
            budget,
            &mut |id| match text.push(self.tok, id) {
                Ok(s) => out.write(&s),
                Err(e) => {
                    tok_err = Some(e);
                    false
                }
            },
        )?;
        let total = t1.elapsed();
        if let Some(e) = tok_err {
            return Err(e).context("detokenizing");
        }
        out.write(&format!("{}\n", text.flush()));
        out.finish()?;
        let hit_context = budget < self.n_predict
            && generated.tokens.len() >= budget
            && matches!(generated.stop, GuardStop::Plain(StopReason::MaxTokens));
        if hit_context {
            report::context_full(self.n_ctx);
        }
        if self.verbose {
            let s = dec.stats();
            let n = generated.tokens.len().saturating_sub(1);
            let decode = total.saturating_sub(s.prefill_time);
            eprintln!(
                "prompt: {} tokens in {:.3} s; decode: {n} tokens in {:.3} s ({:.2} tokens/s); load {:.2} s on {}",
                self.prompt.len(),
                s.prefill_time.as_secs_f64(),
                decode.as_secs_f64(),
                n as f64 / decode.as_secs_f64().max(1e-9),
                self.load_time.as_secs_f64(),
                backend
            );
            eprintln!("{}", s.report());
            eprintln!(
                "stop: {}; {} slop rewinds; sampler {}",
                if hit_context {
                    "context full".to_string()
                } else {
                    report::stop_text(generated.stop)
                },
                generated.rewinds,
                sampler.config().to_json()
            );
        }
        Ok(ExitCode::SUCCESS)
    }
}
