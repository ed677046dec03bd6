//! `strata`: the command-line tool. Each subcommand lives in its own module and depends only on
//! the shared modules (`args` for the flags, `load`, `output`, `model_cache`, `report`,
//! `signals`), never on another command; this file parses arguments and reports errors (with
//! their context chain, each OS error once) on stderr. A closed stdout ends any command with
//! status 0.

use clap::{Parser, Subcommand};

mod args;
mod bench;
mod bench_model;
mod chat;
mod convert_mtp;
mod draft_vocab;
mod fetch;
mod inspect;
mod load;
mod logits;
mod model_cache;
mod output;
mod parity;
mod parity_model;
mod report;
mod run;
mod selftest;
mod serve;
mod signals;
mod synth;
mod tokenize;

#[derive(Parser)]
#[command(
    name = "strata",
    version,
    about = "Inference engine for huge Mixture-of-Experts models in GGUF files"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Stream a completion of a prompt (default model when no -m); --mtp/--spec N for MTP
    /// speculative decoding
    Run(run::Args),
    /// Chat with a model using its chat template (default model when no -m)
    Chat(chat::Args),
    /// Show a GGUF file's metadata and tensors, or dump one tensor dequantized to .npy
    Inspect(inspect::Args),
    /// Throughput programs: `bench formats` (block formats), `bench spec` (MTP speculation), `bench model` (pp/tg tokens/s)
    Bench(bench::Args),
    /// Download the default model (Qwen2.5-Coder-0.5B-Instruct Q4_K_M) into the cache, or check
    /// the cached copy (--check)
    Fetch(fetch::Args),
    /// Every position's logits for a prompt, as safetensors (`logits` [positions, vocab])
    Logits(logits::Args),
    /// Tokenize a text with a model's tokenizer; prints the ids as a JSON array
    Tokenize(tokenize::Args),
    /// Bitwise A/B of kernel variants with paired timing: mtp-ab | router-ab | sample | gemv | all;
    /// a whole model's prefill and verify windows against single steps: prompt | verify
    Parity(parity::Args),
    /// Convert the MTP head (mtp.*) of a Hugging Face qwen4_exp checkpoint to a GGUF for --mtp
    ConvertMtp(convert_mtp::Args),
    /// Draft vocabularies for --draft-vocab: `draft-vocab build`
    DraftVocab(draft_vocab::Args),
    /// Write a synthetic qwen4exp GGUF (random valid blocks, full size or scaled) for timing
    Synth(synth::Args),
    /// Every parity suite on one backend, summed up with a verdict to paste back (wgpu by default)
    Selftest(selftest::Args),
    /// Serve the model over HTTP: OpenAI- and Anthropic-compatible API (default model when no -m)
    Serve(serve::Args),
}

/// glibc's allocator serves blocks above a *dynamic* threshold with fresh `mmap`s and returns
/// freed heap tops to the kernel: a forward pass allocates and frees megabyte activations per
/// operation, so each became page faults and zeroed pages again (4–5 % of the 0.5B model's
/// prefill in the kernel). Blocks up to 32 MiB (the largest fixed threshold glibc accepts) now
/// stay in the heap and freed memory is kept for reuse: prefill +9 % on one thread, +14 % on two
/// (docs/PERF.md). Outputs are unchanged (only where memory comes from).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn tune_allocator() {
    // SAFETY: `mallopt` only sets allocator parameters; it is called first thing in `main`,
    // before any other thread exists. A refused value leaves the default (return value 0).
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn tune_allocator() {}

/// The error and its causes, each once: a cause whose text the message already shows (an OS
/// error that a file error quotes) is not repeated.
fn error_text(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let c = cause.to_string();
        if text.contains(&c) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&c);
    }
    text
}

fn main() -> std::process::ExitCode {
    tune_allocator();
    let cli = Cli::parse();
    // `serve` ends on SIGINT/SIGTERM itself (open streams get an error event, then it exits
    // cleanly); every other command takes the signals here to clean up what it was writing.
    // Parsing starts no thread, so the mask is still set before any other thread exists.
    if !matches!(cli.command, Command::Serve(_)) {
        signals::install();
    }
    let result = match cli.command {
        Command::Run(a) => run::run(a),
        Command::Chat(a) => chat::run(a),
        Command::Inspect(a) => inspect::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Fetch(a) => fetch::run(a),
        Command::Logits(a) => logits::run(a),
        Command::Tokenize(a) => tokenize::run(a),
        Command::Parity(a) => parity::run(a),
        Command::ConvertMtp(a) => convert_mtp::run(a),
        Command::DraftVocab(a) => draft_vocab::run(a),
        Command::Synth(a) => synth::run(a),
        Command::Selftest(a) => selftest::run(a),
        Command::Serve(a) => serve::run(a),
    };
    match result {
        Ok(code) => code,
        // `strata … | head`: the reader has what it wanted.
        Err(e) if output::is_reader_gone(&e) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", error_text(&e));
            std::process::ExitCode::FAILURE
        }
    }
}
