//! Writes the fuzz seed files (the synthetic seeds plus the tiny model's metadata with shrunk
//! tensors) into the directory given as the first argument, for `cargo fuzz run`.

use std::path::Path;

use strata_gguf::{GgufFile, GgufWriter};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args().nth(1).ok_or("usage: fuzz_seeds DIR")?;
    std::fs::create_dir_all(&dir)?;
    let mut seeds = strata_gguf::fuzzing::seeds();
    let tiny =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/qwen4exp/tiny/model-bf16.gguf");
    let f = GgufFile::open(&tiny)?;
    let mut w = GgufWriter::new();
    for (k, v) in f.metadata() {
        w.add_kv(k.clone(), v.clone());
    }
    for t in f.tensors().iter().take(6) {
        let ty = f.tensor_type(t)?;
        w.add_tensor(
            &t.name,
            &[ty.block_size() as u64],
            ty,
            &vec![7u8; ty.type_size()],
        )?;
    }
    seeds.push(w.to_bytes()?);
    for (i, s) in seeds.iter().enumerate() {
        std::fs::write(Path::new(&dir).join(format!("seed{i}.gguf")), s)?;
    }
    println!("wrote {} seeds to {dir}", seeds.len());
    Ok(())
}
