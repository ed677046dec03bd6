//! `strata draft-vocab build`: a draft vocabulary for `--draft-vocab` (raw little-endian i32
//! token ids) made of the most frequent tokens of a corpus under a model's tokenizer, plus the
//! end-of-generation tokens, in ascending id order.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context};
use strata_engine::speculative::DraftVocab;
use strata_gguf::GgufFile;
use strata_tokenizer::Tokenizer;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    pub what: What,
}

#[derive(clap::Subcommand)]
pub enum What {
    /// Count the tokens of a corpus and keep the most frequent
    Build(BuildArgs),
}

#[derive(clap::Args)]
pub struct BuildArgs {
    /// The model whose tokenizer (and vocabulary size) the vocabulary is for
    #[arg(short = 'm', long, value_name = "MODEL.gguf")]
    pub model: PathBuf,
    /// Text files to count tokens in (UTF-8)
    #[arg(long, value_name = "FILE", num_args = 1.., required = true)]
    pub corpus: Vec<PathBuf>,
    /// Number of token ids to keep
    #[arg(long)]
    pub size: usize,
    /// Output file (raw little-endian i32 ids)
    #[arg(short = 'o', long, value_name = "FILE")]
    pub out: PathBuf,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    match args.what {
        What::Build(a) => build(a),
    }
}

fn build(a: BuildArgs) -> anyhow::Result<ExitCode> {
    if a.size == 0 {
        bail!("--size 0: out of range; expected at least 1 token id");
    }
    crate::output::check_input("-m", &a.model)?;
    let mut inputs = vec![("-m", a.model.as_path())];
    for c in &a.corpus {
        crate::output::check_input("--corpus", c)?;
        inputs.push(("--corpus", c.as_path()));
    }
    crate::output::check_outputs(&[("-o", &a.out)], &inputs)?;
    let file = GgufFile::open(&a.model)?;
    let tok = Tokenizer::from_gguf(&file)
        .with_context(|| format!("reading the tokenizer of {}", a.model.display()))?;
    // The draft's LM head has the model's rows, which may be more than the tokenizer's tokens.
    let n_vocab = file
        .tensor("output.weight")
        .or_else(|| file.tensor("token_embd.weight"))
        .map(|t| t.ne(1) as usize)
        .unwrap_or(0)
        .max(tok.n_vocab());
    let mut counts = vec![0u64; n_vocab];
    let mut total = 0u64;
    for path in &a.corpus {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let ids = tok
            .encode(&text, false, false)
            .with_context(|| format!("tokenizing {}", path.display()))?;
        for id in ids {
            if let Some(c) = counts.get_mut(id as usize) {
                *c += 1;
                total += 1;
            }
        }
    }
    if total == 0 {
        bail!("the corpus has no tokens");
    }
    let eog = tok.eog_ids();
    let v = DraftVocab::by_frequency(&counts, a.size.min(n_vocab), &eog)?;
    let covered: u64 = v.ids().iter().map(|&i| counts[i as usize]).sum();
    let mut out = crate::output::OutputFile::create(&a.out)?;
    std::io::Write::write_all(out.writer(), &v.to_bytes())
        .with_context(|| format!("writing {}", a.out.display()))?;
    out.commit()?;
    eprintln!(
        "wrote {}: {} token ids of {n_vocab} ({} end-of-generation), covering {:.2}% of the corpus's {total} tokens",
        a.out.display(),
        v.len(),
        eog.len(),
        100.0 * covered as f64 / total as f64
    );
    Ok(ExitCode::SUCCESS)
}
