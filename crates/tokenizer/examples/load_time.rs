//! Times loading a tokenizer and encoding a text (a quick check, not a benchmark suite).
//! usage: load_time MODEL.gguf [TEXT_FILE]
use std::time::Instant;
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let path = args
        .get(1)
        .ok_or("usage: load_time MODEL.gguf [TEXT_FILE]")?;
    let t0 = Instant::now();
    let f = strata_gguf::GgufFile::open(path)?;
    let t1 = Instant::now();
    let d = strata_tokenizer::TokenizerData::from_gguf(&f)?;
    let t2 = Instant::now();
    let tok = strata_tokenizer::Tokenizer::new(d)?;
    let t3 = Instant::now();
    eprintln!(
        "open {:?}  data {:?}  build {:?}",
        t1 - t0,
        t2 - t1,
        t3 - t2
    );
    if let Some(p) = args.get(2) {
        let text = std::fs::read_to_string(p)?;
        let t4 = Instant::now();
        let ids = tok.encode(&text, false, false)?;
        let dt = t4.elapsed();
        eprintln!(
            "{} bytes -> {} tokens in {:?} ({:.1} MB/s)",
            text.len(),
            ids.len(),
            dt,
            text.len() as f64 / dt.as_secs_f64() / 1e6
        );
    }
    Ok(())
}
