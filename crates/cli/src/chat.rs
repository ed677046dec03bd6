//! `strata chat`: an interactive conversation. Each user line is added to the history, the whole
//! history is rendered with the model's chat template, and the sequence keeps its cache between
//! turns: only the tokens after the longest shared prefix run again, so a turn costs its own
//! tokens, not the conversation's.
//!
//! A turn that fails (a line that is not UTF-8, a history that outgrew the context, an error
//! while generating) is reported on stderr and the conversation goes on without it. Before a
//! turn that would not fit, the user is told how many tokens are left; `--ctx-policy` says what
//! happens then: `stop` refuses the turn (offering `/reset`), `drop-oldest` drops the oldest
//! whole turns and runs the rest again.
//!
//! stdout carries only the assistant's replies (one per turn, each ending with a newline); the
//! input prompt marker, notes and `--verbose` reports go to stderr, so a piped conversation
//! reads clean.

use std::io::BufRead;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result};
use strata_engine::generate::{GenOptions, Session, StopReason};
use strata_engine::sampler::Sampler;
use strata_tokenizer::{ChatMessage, ChatTemplate, StreamDecoder, Tokenizer};

use crate::args::model::ModelArgs;
use crate::args::sampling::{self, SampleArgs};
use crate::load;
use crate::output::Stream;
use crate::report;

/// A plain ChatML template for files that carry none.
const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

const COMMANDS: &str = "/reset clears the history, /exit (or Ctrl-D) ends; start a line with // to send one beginning with /";

/// What to do with a turn that does not fit in the context.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum CtxPolicy {
    /// Refuse the turn and say so (`/reset` clears the history)
    Stop,
    /// Drop the oldest whole turns (the system message stays) until it fits
    DropOldest,
}

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
    /// When a turn does not fit in the context: refuse it, or drop the oldest turns
    #[arg(long, value_enum, default_value_t = CtxPolicy::Stop)]
    pub ctx_policy: CtxPolicy,
    /// Speed report on stderr after each reply
    #[arg(short = 'v', long)]
    pub verbose: bool,
    #[command(flatten)]
    pub sample: SampleArgs,
}

pub fn run(args: Args) -> Result<ExitCode> {
    let sampler_cfg = args.sample.resolve()?;
    let choice = args.model.resolve()?;
    let path = choice.path()?;
    let t0 = Instant::now();
    let (model, tok) = load::model(&path, &choice)?;
    let load_time = t0.elapsed();
    let n_ctx = load::n_ctx(choice.ctx_size, model.n_ctx_model())?;
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
    let sampler = sampling::build(&sampler_cfg, &tok)?;
    let session = model.session(n_ctx)?;
    let mut chat = Chat {
        tok: &tok,
        template,
        sampler,
        session,
        history: Vec::new(),
        n_ctx,
        n_predict: args.n_predict,
        policy: args.ctx_policy,
        out: Stream::new(),
    };
    if let Some(s) = &args.system {
        chat.history.push(ChatMessage::new("system", s.clone()));
    }
    let interactive = std::io::IsTerminal::is_terminal(&std::io::stdin());
    if interactive {
        eprintln!("strata chat: {} — {COMMANDS}", model.describe());
    }
    let stdin = std::io::stdin();
    let mut input = stdin.lock();
    let mut line_no = 0usize;
    let mut buf = Vec::new();
    loop {
        if interactive {
            eprint!("> ");
        }
        buf.clear();
        if input.read_until(b'\n', &mut buf).context("reading stdin")? == 0 {
            break;
        }
        line_no += 1;
        let Ok(line) = std::str::from_utf8(&buf) else {
            eprintln!("error: input line {line_no} is not UTF-8 text; it was not sent");
            continue;
        };
        let msg = line.trim_end_matches(['\r', '\n']);
        let msg = match msg.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                chat.history.retain(|m| m.role == "system");
                eprintln!("history cleared");
                continue;
            }
            c if c.starts_with("//") => &msg[msg.find('/').unwrap_or(0) + 1..],
            c if c.starts_with('/') => {
                let name = c.split_whitespace().next().unwrap_or(c);
                eprintln!("unknown command {name}: {COMMANDS}");
                continue;
            }
            _ => msg,
        };
        match chat.turn(msg) {
            Ok(Some(g)) if args.verbose => {
                report::verbose(load_time, &g.generation, &model.backend_note, &chat.sampler);
                report::slop(&g);
            }
            Ok(_) => {}
            Err(e) => eprintln!("error: {e:#} (the conversation goes on without this turn)"),
        }
        if chat.out.gone() {
            break;
        }
    }
    chat.out.finish()?;
    Ok(ExitCode::SUCCESS)
}

struct Chat<'a> {
    tok: &'a Tokenizer,
    template: ChatTemplate,
    sampler: Sampler,
    session: Box<dyn Session + 'a>,
    history: Vec<ChatMessage>,
    n_ctx: usize,
    n_predict: usize,
    policy: CtxPolicy,
    out: Stream,
}

impl Chat<'_> {
    fn render(&self, history: &[ChatMessage]) -> Result<Vec<u32>> {
        let text = self
            .template
            .render(history, true, &serde_json::Map::new())
            .context("rendering the chat template")?;
        self.tok
            .encode(&text, true, true)
            .context("tokenizing the conversation")
    }

    /// The conversation with `msg` as the next user turn, made to fit the context under the
    /// policy; Ok(None) when the turn is refused (the reason is printed).
    fn fit(&mut self, msg: &str) -> Result<Option<(Vec<ChatMessage>, Vec<u32>)>> {
        let mut history = self.history.clone();
        history.push(ChatMessage::new("user", msg));
        let mut dropped = 0;
        loop {
            let prompt = self.render(&history)?;
            if prompt.len() < self.n_ctx {
                if dropped > 0 {
                    eprintln!(
                        "note: dropped the {dropped} oldest turn(s) to fit the context of {} tokens",
                        self.n_ctx
                    );
                }
                let left = self.n_ctx - prompt.len();
                if left < self.n_predict {
                    eprintln!(
                        "note: {left} tokens are left in the context of {}; the reply may be cut \
                         (/reset clears the history)",
                        self.n_ctx
                    );
                }
                return Ok(Some((history, prompt)));
            }
            // The oldest whole turn: its user message and the replies up to the next one.
            let first = history.iter().position(|m| m.role != "system");
            let next_user = first.and_then(|f| {
                history[f + 1..]
                    .iter()
                    .position(|m| m.role == "user")
                    .map(|i| f + 1 + i)
            });
            match (self.policy, first, next_user) {
                (CtxPolicy::DropOldest, Some(f), Some(n)) => {
                    history.drain(f..n);
                    dropped += 1;
                }
                (CtxPolicy::DropOldest, _, _) => {
                    eprintln!(
                        "error: this message alone needs {} tokens and the context holds {}; \
                         it was not sent",
                        prompt.len(),
                        self.n_ctx
                    );
                    return Ok(None);
                }
                (CtxPolicy::Stop, _, _) => {
                    let used = self.render(&self.history).map(|p| p.len()).unwrap_or(0);
                    eprintln!(
                        "error: this turn needs {} tokens; the context holds {} and the history \
                         uses {used}, so {} are left. It was not sent: /reset clears the history, \
                         or start chat with --ctx-policy drop-oldest",
                        prompt.len(),
                        self.n_ctx,
                        self.n_ctx.saturating_sub(used)
                    );
                    return Ok(None);
                }
            }
        }
    }

    /// One turn; the history changes only when it succeeds.
    fn turn(
        &mut self,
        msg: &str,
    ) -> Result<Option<strata_engine::sampler::guard::GuardedGeneration>> {
        let Some((mut history, prompt)) = self.fit(msg)? else {
            return Ok(None);
        };
        let opts = GenOptions {
            max_tokens: self.n_predict,
            ..Default::default()
        };
        let mut dec = StreamDecoder::new(false);
        let mut tok_err = None;
        let (tok, out) = (self.tok, &mut self.out);
        // The guarded loop: slop's phrase level may rewind; text is streamed once final.
        let gg = strata_engine::sampler::guard::generate(
            self.session.as_mut(),
            &prompt,
            &mut self.sampler,
            &|id| tok.is_eog(id),
            &opts,
            &mut |id| match dec.push(tok, id) {
                Ok(s) => out.write(&s),
                Err(e) => {
                    tok_err = Some(e);
                    false
                }
            },
        );
        let gg = match gg {
            Ok(g) => g,
            Err(e) => {
                // Whatever part of a reply was shown ends its line.
                self.out.write("\n");
                return Err(e.into());
            }
        };
        let rest = dec.flush();
        self.out.write(&format!("{rest}\n"));
        if let Some(e) = tok_err {
            return Err(e).context("detokenizing");
        }
        match gg.generation.stop {
            StopReason::ContextFull => eprintln!(
                "note: the reply was cut at the context limit ({} tokens): /reset clears the \
                 history, or start chat with --ctx-policy drop-oldest",
                self.n_ctx
            ),
            StopReason::MaxTokens => eprintln!(
                "note: the reply was cut at the -n limit of {} tokens",
                self.n_predict
            ),
            _ => {}
        }
        let reply = self
            .tok
            .decode(&gg.generation.tokens, false)
            .context("detokenizing the reply")?;
        history.push(ChatMessage::new("assistant", reply));
        self.history = history;
        Ok(Some(gg))
    }
}
