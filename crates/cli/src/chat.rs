//! `strata chat`: an interactive conversation. Each user line is added to the history, the whole
//! history is rendered with the model's chat template, and the sequence keeps its cache between
//! turns: only the tokens after the longest shared prefix run again, so a turn costs its own
//! tokens, not the conversation's.
//!
//! stdout carries only the assistant's replies (one per turn, each ending with a newline); the
//! input prompt marker and `--verbose` reports go to stderr, so a piped conversation reads clean.

use std::io::BufRead;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result};
use strata_engine::generate::GenOptions;
use strata_tokenizer::{ChatMessage, ChatTemplate, StreamDecoder};

use crate::run::{self, ModelArgs, Out, SampleArgs};

/// A plain ChatML template for files that carry none.
const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// A system message at the head of the conversation (default: the template's own)
    #[arg(short = 's', long)]
    pub system: Option<String>,
    /// Most tokens per reply
    #[arg(short = 'n', long = "n-predict", default_value_t = 1024)]
    pub n_predict: usize,
    #[command(flatten)]
    pub sample: SampleArgs,
    /// Speed report on stderr after each reply
    #[arg(short = 'v', long)]
    pub verbose: bool,
}

pub fn run(args: Args) -> Result<ExitCode> {
    let path = run::model_path(&args.model)?;
    let t0 = Instant::now();
    let (model, tok) = run::load(&path, &args.model)?;
    let load_time = t0.elapsed();
    let template = match ChatTemplate::from_tokenizer(&tok)
        .with_context(|| format!("compiling the chat template of {}", path.display()))?
    {
        Some(t) => t,
        None => {
            eprintln!(
                "warning: {} has no chat template; using ChatML",
                path.display()
            );
            let text = |id: Option<u32>| {
                id.and_then(|i| tok.token_text(i).ok())
                    .unwrap_or("")
                    .to_string()
            };
            ChatTemplate::new(CHATML, &text(tok.bos()), &text(tok.eos()))?
        }
    };
    let mut sampler = args.sample.build_for(&tok)?;
    let mut session = model.session()?;
    let mut history: Vec<ChatMessage> = Vec::new();
    if let Some(s) = &args.system {
        history.push(ChatMessage::new("system", s.clone()));
    }
    let interactive = std::io::IsTerminal::is_terminal(&std::io::stdin());
    if interactive {
        eprintln!(
            "strata chat: {} — /reset clears the history, /exit or Ctrl-D ends",
            model.describe()
        );
    }
    let opts = GenOptions {
        max_tokens: args.n_predict,
        ..Default::default()
    };
    let mut out = Out::new();
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    loop {
        if interactive {
            eprint!("> ");
        }
        let Some(line) = lines.next() else { break };
        let line = line.context("reading stdin")?;
        let msg = line.trim_end_matches(['\r', '\n']);
        match msg.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                history.retain(|m| m.role == "system");
                continue;
            }
            _ => {}
        }
        history.push(ChatMessage::new("user", msg));
        let text = template
            .render(&history, true, &serde_json::Map::new())
            .context("rendering the chat template")?;
        let prompt = tok
            .encode(&text, true, true)
            .context("tokenizing the conversation")?;
        let mut dec = StreamDecoder::new(false);
        let mut tok_err = None;
        // The guarded loop: slop's phrase level may rewind; text is streamed once final.
        let gg = strata_engine::sampler::guard::generate(
            session.as_mut(),
            &prompt,
            &mut sampler,
            &|id| tok.is_eog(id),
            &opts,
            &mut |id| match dec.push(&tok, id) {
                Ok(s) => out.write(&s),
                Err(e) => {
                    tok_err = Some(e);
                    false
                }
            },
        )?;
        let g = &gg.generation;
        if let Some(e) = tok_err {
            return Err(e).context("detokenizing");
        }
        let rest = dec.flush();
        if !out.write(&format!("{rest}\n")) {
            break;
        }
        let reply = tok
            .decode(&g.tokens, false)
            .context("detokenizing the reply")?;
        history.push(ChatMessage::new("assistant", reply));
        if args.verbose {
            run::report(load_time, g, model.threads(), &sampler);
            crate::sampling_args::report_slop(&gg);
        }
    }
    out.finish()?;
    Ok(ExitCode::SUCCESS)
}
