//! `strata tokenize`: a model's tokenizer on a text, printing the ids as a JSON array (or one
//! `id -> 'piece'` line per token). Defaults follow llama.cpp's `llama-tokenize`: special tokens
//! written in the text are parsed, BOS is added when the model asks for it, and the output has
//! the same shape, so the two can be diffed.

use std::fmt::Write;
use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use strata_gguf::GgufFile;
use strata_tokenizer::Tokenizer;

#[derive(clap::Args)]
pub struct Args {
    /// The model GGUF file (default: the cached default model, see `strata fetch`)
    #[arg(short = 'm', long, value_name = "MODEL.gguf")]
    pub model: Option<PathBuf>,
    /// Text to tokenize
    #[arg(short = 'p', long, conflicts_with_all = ["file", "stdin"])]
    pub text: Option<String>,
    /// Read the text from a file (bytes as they are, no escape processing)
    #[arg(short = 'f', long, value_name = "PATH", conflicts_with = "stdin")]
    pub file: Option<PathBuf>,
    /// Read the text from standard input
    #[arg(long)]
    pub stdin: bool,
    /// Do not add BOS/EOS even when the model asks for them
    #[arg(long)]
    pub no_bos: bool,
    /// Tokenize special-token texts (e.g. `<|im_start|>`) as plain text
    #[arg(long)]
    pub no_parse_special: bool,
    /// Print `id -> 'piece'` lines instead of the JSON array
    #[arg(long)]
    pub pieces: bool,
    /// Print the number of tokens after the ids
    #[arg(long)]
    pub show_count: bool,
}

pub fn run(args: Args) -> Result<ExitCode> {
    let text = match (&args.text, &args.file, args.stdin) {
        (Some(t), _, _) => t.clone(),
        (None, Some(p), _) => {
            let bytes = std::fs::read(p).with_context(|| format!("reading {}", p.display()))?;
            String::from_utf8(bytes)
                .with_context(|| format!("{} is not UTF-8 text", p.display()))?
        }
        (None, None, true) => {
            let mut s = String::new();
            std::io::stdin()
                .read_to_string(&mut s)
                .context("reading standard input as UTF-8 text")?;
            s
        }
        (None, None, false) => bail!("give the text with --text, --file or --stdin"),
    };
    let model = match &args.model {
        Some(m) => {
            crate::output::check_input("-m", m)?;
            m.clone()
        }
        None => crate::model_cache::default_model_path(false)?,
    };
    let file = GgufFile::open(&model)?;
    let tok = Tokenizer::from_gguf(&file)
        .with_context(|| format!("reading the tokenizer of {}", model.display()))?;
    let ids = tok
        .encode(&text, !args.no_bos, !args.no_parse_special)
        .context("tokenizing")?;

    let mut text = String::new();
    if args.pieces {
        for &id in &ids {
            let piece = String::from_utf8_lossy(tok.token_to_piece(id, true)?).into_owned();
            writeln!(text, "{id:6} -> '{piece}'")?;
        }
    } else {
        let list: Vec<String> = ids.iter().map(u32::to_string).collect();
        writeln!(text, "[{}]", list.join(", "))?;
    }
    if args.show_count {
        writeln!(text, "Total number of tokens: {}", ids.len())?;
    }
    crate::output::print(&text)?;
    Ok(ExitCode::SUCCESS)
}
