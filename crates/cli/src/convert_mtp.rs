//! `strata convert-mtp`: the MTP head (`mtp.*`) of a qwen4_exp Hugging Face checkpoint as a
//! small GGUF that `--mtp` loads beside the trunk GGUF (published trunk GGUFs carry no head).
//! The conversion itself lives in the `strata-convert` crate; docs/MTP-GGUF.md has
//! the layout.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use strata_convert::{convert_mtp, ConvertOptions, OutType};

#[derive(clap::Args)]
pub struct Args {
    /// The checkpoint directory (config.json and model.safetensors, or the shards listed in
    /// model.safetensors.index.json)
    #[arg(value_name = "HF_DIR")]
    pub dir: PathBuf,
    /// Output GGUF
    #[arg(short = 'o', long, value_name = "MTP.gguf")]
    pub out: PathBuf,
    /// Weight format of the matrices: f32, bf16 or q8_0 (norms and routers stay f32)
    #[arg(long = "type", default_value = "bf16")]
    pub out_type: OutType,
    /// Also copy the trunk's embedding and LM head into the file as the head's own (for trunks
    /// whose shared tensors are quantized more coarsely than the draft should see them)
    #[arg(long)]
    pub include_shared: bool,
    /// List every tensor written
    #[arg(short = 'v', long)]
    pub verbose: bool,
}

/// The checkpoint's files: everything in the folder, since a shard list or a config may name
/// any of them.
fn inputs(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut v = Vec::new();
    for e in std::fs::read_dir(dir).with_context(|| format!("HF_DIR {}", dir.display()))? {
        let p = e
            .with_context(|| format!("listing {}", dir.display()))?
            .path();
        if p.is_file() {
            v.push(p);
        }
    }
    Ok(v)
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    if !args.dir.is_dir() {
        anyhow::bail!(
            "HF_DIR {}: not a folder (give the checkpoint's folder: config.json and *.safetensors)",
            args.dir.display()
        );
    }
    let files = inputs(&args.dir)?;
    let named: Vec<(&str, &Path)> = files.iter().map(|p| ("in HF_DIR", p.as_path())).collect();
    crate::output::check_outputs(&[("-o", &args.out)], &named)?;
    let opts = ConvertOptions {
        out_type: args.out_type,
        include_shared: args.include_shared,
    };
    let (writer, report) = convert_mtp(&args.dir, &opts)
        .with_context(|| format!("converting the MTP head of {}", args.dir.display()))?;
    let mut out = crate::output::OutputFile::create(&args.out)?;
    writer
        .write_to(out.writer())
        .with_context(|| format!("writing {}", args.out.display()))?;
    out.commit()?;
    for n in &report.notes {
        eprintln!("note: {n}");
    }
    if args.verbose {
        for (name, dims, ty) in &report.tensors {
            eprintln!("  {name:<40} {ty:<6} {dims:?}");
        }
    }
    let bytes = std::fs::metadata(&args.out).map(|m| m.len()).unwrap_or(0);
    eprintln!(
        "wrote {}: {} tensors, {:.1} MiB",
        args.out.display(),
        report.tensors.len(),
        bytes as f64 / (1u64 << 20) as f64
    );
    Ok(ExitCode::SUCCESS)
}
