//! `strata inspect`: a GGUF file's header, metadata (long arrays summarized), tensor table,
//! per-type histogram and bits per weight, as text or JSON; and `--dump`, which writes one
//! tensor dequantized to f32 as a NumPy .npy file (shape = ggml `ne` reversed).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context};
use serde_json::{json, Value as Json};
use strata_gguf::{Array, GgufFile, TensorInfo, Value};

#[derive(clap::Args)]
pub struct Args {
    /// The GGUF file
    pub file: PathBuf,
    /// Print JSON instead of text
    #[arg(long)]
    pub json: bool,
    /// Write this tensor, dequantized to f32, as a .npy file (needs --out)
    #[arg(long, value_name = "TENSOR", requires = "out")]
    pub dump: Option<String>,
    /// Where --dump writes its .npy file
    #[arg(long, value_name = "OUT.npy", requires = "dump")]
    pub out: Option<PathBuf>,
    /// Show at most this many elements of each metadata array
    #[arg(long, default_value_t = 8)]
    pub array_items: usize,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    crate::output::check_input("FILE", &args.file)?;
    if let Some(out) = &args.out {
        // Before the input is mapped: truncating a mapped file kills the process (SIGBUS).
        crate::output::check_outputs(&[("--out", out)], &[("FILE", &args.file)])?;
    }
    let f = GgufFile::open(&args.file)?;
    if let (Some(name), Some(out)) = (&args.dump, &args.out) {
        let t = f.require_tensor(name)?;
        dump_npy(&f, t, out)?;
        eprintln!(
            "wrote {} ({} {:?} → f32, numpy shape {:?})",
            out.display(),
            t.ty,
            t.dims,
            t.shape_rev()
        );
        return Ok(ExitCode::SUCCESS);
    }
    let report = Report::new(&f);
    if args.json {
        let s = serde_json::to_string_pretty(&report.to_json(&f, args.array_items))?;
        crate::outln!("{s}")?;
    } else {
        let mut out = std::io::BufWriter::new(std::io::stdout().lock());
        // `strata inspect f.gguf | head` is normal use: a closed pipe ends it quietly (main).
        report
            .print(&f, args.array_items, &mut out)
            .and_then(|()| Ok(out.flush()?))
            .map_err(|e| match e.downcast::<std::io::Error>() {
                Ok(io) => crate::output::stdout_error(io),
                Err(e) => e,
            })?;
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Default)]
struct TypeRow {
    count: u64,
    elements: u64,
    bytes: u64,
}

struct Report {
    by_type: BTreeMap<String, TypeRow>,
    elements: u64,
    bytes: u64,
}

impl Report {
    fn new(f: &GgufFile) -> Report {
        let mut by_type: BTreeMap<String, TypeRow> = BTreeMap::new();
        let (mut elements, mut bytes) = (0u64, 0u64);
        for t in f.tensors() {
            let row = by_type.entry(t.ty.to_string()).or_default();
            row.count += 1;
            row.elements = row.elements.saturating_add(t.n_elements);
            row.bytes = row.bytes.saturating_add(t.n_bytes);
            elements = elements.saturating_add(t.n_elements);
            bytes = bytes.saturating_add(t.n_bytes);
        }
        Report {
            by_type,
            elements,
            bytes,
        }
    }

    fn bpw(bytes: u64, elements: u64) -> f64 {
        if elements == 0 {
            0.0
        } else {
            bytes as f64 * 8.0 / elements as f64
        }
    }

    fn print(&self, f: &GgufFile, items: usize, o: &mut impl Write) -> anyhow::Result<()> {
        writeln!(o, "file:         {}", f.name())?;
        writeln!(o, "version:      {}", f.version())?;
        writeln!(o, "architecture: {}", f.architecture().unwrap_or("(none)"))?;
        writeln!(o, "alignment:    {}", f.alignment())?;
        writeln!(o, "data offset:  {}", f.data_offset())?;
        writeln!(
            o,
            "file size:    {} ({})",
            f.file_size(),
            human(f.file_size())
        )?;
        writeln!(o)?;
        writeln!(o, "metadata ({} keys):", f.metadata().len())?;
        let kw = f.metadata().iter().map(|(k, _)| k.len()).max().unwrap_or(0);
        for (k, v) in f.metadata() {
            writeln!(
                o,
                "  {k:kw$}  {:<22} {}",
                type_label(v),
                text_value(v, items)
            )?;
        }
        writeln!(o)?;
        writeln!(o, "tensors ({}):", f.tensors().len())?;
        let nw = f
            .tensors()
            .iter()
            .map(|t| t.name.len())
            .max()
            .unwrap_or(4)
            .max(4);
        writeln!(
            o,
            "  {:nw$}  {:<8} {:<24} {:>14} {:>14} {:>14}",
            "name", "type", "ne", "elements", "bytes", "offset"
        )?;
        for t in f.tensors() {
            writeln!(
                o,
                "  {:nw$}  {:<8} {:<24} {:>14} {:>14} {:>14}",
                t.name,
                t.ty.to_string(),
                format!("{:?}", t.dims),
                t.n_elements,
                t.n_bytes,
                t.offset
            )?;
        }
        writeln!(o)?;
        writeln!(o, "types:")?;
        writeln!(
            o,
            "  {:<10} {:>7} {:>16} {:>16} {:>8}",
            "type", "tensors", "elements", "bytes", "bpw"
        )?;
        for (ty, r) in &self.by_type {
            writeln!(
                o,
                "  {:<10} {:>7} {:>16} {:>16} {:>8.4}",
                ty,
                r.count,
                r.elements,
                r.bytes,
                Self::bpw(r.bytes, r.elements)
            )?;
        }
        writeln!(o)?;
        writeln!(
            o,
            "total: {} tensors, {} elements, {} bytes ({}), {:.4} bits per weight",
            f.tensors().len(),
            self.elements,
            self.bytes,
            human(self.bytes),
            Self::bpw(self.bytes, self.elements)
        )?;
        Ok(())
    }

    fn to_json(&self, f: &GgufFile, items: usize) -> Json {
        let metadata: Vec<Json> = f
            .metadata()
            .iter()
            .map(|(k, v)| json!({ "key": k, "type": type_label(v), "value": json_value(v, items) }))
            .collect();
        let tensors: Vec<Json> = f
            .tensors()
            .iter()
            .map(|t| {
                json!({
                    "name": t.name, "type": t.ty.to_string(), "type_id": t.ty.id(), "ne": t.dims,
                    "n_elements": t.n_elements, "n_bytes": t.n_bytes, "offset": t.offset,
                })
            })
            .collect();
        let types: serde_json::Map<String, Json> = self
            .by_type
            .iter()
            .map(|(ty, r)| {
                let v = json!({ "tensors": r.count, "elements": r.elements, "bytes": r.bytes,
                                "bits_per_weight": Self::bpw(r.bytes, r.elements) });
                (ty.clone(), v)
            })
            .collect();
        json!({
            "file": f.name(), "version": f.version(), "architecture": f.architecture().ok(),
            "alignment": f.alignment(), "data_offset": f.data_offset(), "file_size": f.file_size(),
            "metadata": metadata, "tensors": tensors, "types": types,
            "total": { "tensors": f.tensors().len(), "elements": self.elements, "bytes": self.bytes,
                       "bits_per_weight": Self::bpw(self.bytes, self.elements) },
        })
    }
}

fn human(b: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = b as f64;
    let mut i = 0;
    while x >= 1024.0 && i + 1 < U.len() {
        x /= 1024.0;
        i += 1;
    }
    format!("{x:.2} {}", U[i])
}

fn type_label(v: &Value) -> String {
    match v {
        Value::Array(a) => format!("[{}; {}]", a.elem_type(), a.len()),
        v => v.value_type().to_string(),
    }
}

fn text_value(v: &Value, items: usize) -> String {
    match v {
        Value::Array(a) => text_array(a, items),
        Value::String(s) => format!("{:?}", truncate(s, 120)),
        v => v.to_string(),
    }
}

fn truncate(s: &str, max_chars: usize) -> String {
    if s.chars().count() <= max_chars {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(max_chars).collect();
        t.push('…');
        t
    }
}

fn text_array(a: &Array, items: usize) -> String {
    let shown: Vec<String> = (0..a.len().min(items))
        .filter_map(|i| a.get(i))
        .map(|v| text_value(&v, items))
        .collect();
    let more = if a.len() > items {
        format!(", … ({} more)", a.len() - items)
    } else {
        String::new()
    };
    format!("[{}{more}]", shown.join(", "))
}

fn json_value(v: &Value, items: usize) -> Json {
    match v {
        Value::U8(x) => json!(x),
        Value::I8(x) => json!(x),
        Value::U16(x) => json!(x),
        Value::I16(x) => json!(x),
        Value::U32(x) => json!(x),
        Value::I32(x) => json!(x),
        Value::F32(x) => json!(x),
        Value::Bool(x) => json!(x),
        Value::String(x) => json!(x),
        Value::U64(x) => json!(x),
        Value::I64(x) => json!(x),
        Value::F64(x) => json!(x),
        Value::Array(a) => {
            let head: Vec<Json> = (0..a.len().min(items))
                .filter_map(|i| a.get(i))
                .map(|v| json_value(&v, items))
                .collect();
            if a.len() > items {
                json!({ "elem_type": a.elem_type().name(), "len": a.len(), "head": head })
            } else {
                Json::Array(head)
            }
        }
    }
}

/// Writes `t` dequantized to f32 as a .npy (format 1.0, little-endian f32, C order) with the
/// NumPy shape `ne` reversed. Rows are dequantized in chunks so a multi-GiB tensor does not
/// need a second multi-GiB buffer.
fn dump_npy(f: &GgufFile, t: &TensorInfo, out: &Path) -> anyhow::Result<()> {
    let ty = f.tensor_type(t)?;
    let data = f.tensor_data(t)?;
    let ne0 = usize::try_from(t.ne(0))?;
    let n_rows = usize::try_from(t.n_rows())?;
    let row_bytes = ty.row_bytes(ne0).with_context(|| {
        format!(
            "{}: tensor '{}': ne0 {ne0} is not whole {ty} blocks",
            f.name(),
            t.name
        )
    })?;
    if row_bytes.checked_mul(n_rows) != Some(data.len()) {
        bail!(
            "{}: tensor '{}': {} bytes of data, expected {n_rows} rows of {row_bytes}",
            f.name(),
            t.name,
            data.len()
        );
    }
    let mut file = crate::output::OutputFile::create(out)?;
    let w = file.writer();
    w.write_all(&npy_header(&t.shape_rev()))?;
    let rows_per_chunk = (1usize << 20).checked_div(ne0).unwrap_or(1).max(1);
    let mut buf = vec![0f32; ne0 * rows_per_chunk.min(n_rows.max(1))];
    let mut bytes = Vec::with_capacity(buf.len() * 4);
    let mut row = 0;
    while row < n_rows && ne0 > 0 {
        let rows = rows_per_chunk.min(n_rows - row);
        let src = &data[row * row_bytes..(row + rows) * row_bytes];
        let dst = &mut buf[..rows * ne0];
        strata_quant::dequantize(ty, src, dst)
            .with_context(|| format!("{}: tensor '{}': dequantizing {ty}", f.name(), t.name))?;
        bytes.clear();
        bytes.extend(dst.iter().flat_map(|x| x.to_le_bytes()));
        w.write_all(&bytes)
            .with_context(|| format!("writing {}", out.display()))?;
        row += rows;
    }
    file.commit()
}

/// A .npy version 1.0 header for little-endian f32 in C order, padded so the data starts at a
/// multiple of 64 bytes (as NumPy writes it).
fn npy_header(shape: &[u64]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(u64::to_string).collect();
    let shape = match dims.len() {
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    };
    let mut dict = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}");
    let unpadded = 10 + dict.len() + 1;
    dict.push_str(&" ".repeat(unpadded.next_multiple_of(64) - unpadded));
    dict.push('\n');
    let mut h = b"\x93NUMPY\x01\x00".to_vec();
    h.extend_from_slice(&(dict.len() as u16).to_le_bytes());
    h.extend_from_slice(dict.as_bytes());
    h
}
