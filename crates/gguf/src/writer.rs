//! Writing GGUF files: metadata and tensors in, a file that `GgufFile` reads back identically
//! out. Tensors are laid out like ggml's writer (in insertion order, each at the running total
//! of padded sizes), so a real file read and written again keeps its offsets.
//!
//! `skip_validation` turns the writer into a tool for building malformed files (tests and
//! fuzz seeds); without it, everything the reader would refuse is refused here first.

use std::collections::HashSet;
use std::io::Write;
use std::path::Path;

use strata_quant::GgmlType;

use crate::error::GgufError;
use crate::reader::{GgufFile, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAX_DIMS, MAX_NAME_BYTES};
use crate::value::{Array, Value};

struct PendingTensor {
    name: String,
    dims: Vec<u64>,
    type_id: u32,
    data: Vec<u8>,
    /// Written in place of the computed offset (malformed files only).
    offset_override: Option<u64>,
    /// A tensor whose bytes the caller writes itself (streaming mode): its size, with `data`
    /// empty.
    deferred: Option<u64>,
}

impl PendingTensor {
    fn len(&self) -> u64 {
        self.deferred.unwrap_or(self.data.len() as u64)
    }
}

/// Where everything goes in a file whose tensor bytes the caller writes itself
/// ([`GgufWriter::add_tensor_deferred`]): the header to write at offset 0, then each tensor's
/// bytes at its absolute offset. Padding between tensors is zeros (a file extended to
/// `file_len` reads as zeros there).
#[derive(Clone, Debug)]
pub struct StreamLayout {
    pub header: Vec<u8>,
    /// Per tensor, in insertion order: (absolute file offset, byte length).
    pub tensors: Vec<(u64, u64)>,
    /// The file's length, the last tensor padded like ggml's writer does.
    pub file_len: u64,
}

/// Builds a GGUF file in memory and writes it out.
pub struct GgufWriter {
    version: u32,
    alignment: u64,
    alignment_set: bool,
    validate: bool,
    kvs: Vec<(String, Value)>,
    tensors: Vec<PendingTensor>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

fn werr(
    what: impl Into<String>,
    expected: impl Into<String>,
    found: impl Into<String>,
) -> GgufError {
    GgufError::Write {
        what: what.into(),
        expected: expected.into(),
        found: found.into(),
    }
}

impl GgufWriter {
    /// A version-3 writer with the default alignment (32).
    pub fn new() -> GgufWriter {
        GgufWriter {
            version: 3,
            alignment: DEFAULT_ALIGNMENT,
            alignment_set: false,
            validate: true,
            kvs: Vec::new(),
            tensors: Vec::new(),
        }
    }

    /// A writer holding a copy of `file`'s version, metadata (in order) and tensors (in order,
    /// same types and bytes). Tensors of unknown type cannot be copied (their size is unknown).
    pub fn from_file(file: &GgufFile) -> Result<GgufWriter, GgufError> {
        let mut w = GgufWriter::new();
        w.version = file.version();
        w.alignment = file.alignment();
        for (k, v) in file.metadata() {
            w.add_kv(k.clone(), v.clone());
        }
        for t in file.tensors() {
            let ty = file.tensor_type(t)?;
            let data = file.tensor_data(t)?.to_vec();
            w.add_tensor_owned(&t.name, &t.dims, ty, data)?;
        }
        Ok(w)
    }

    pub fn version(&mut self, v: u32) -> &mut Self {
        self.version = v;
        self
    }

    /// Sets the alignment; written as `general.alignment` unless it is the default and the key
    /// was not added explicitly.
    pub fn alignment(&mut self, a: u64) -> &mut Self {
        self.alignment = a;
        self.alignment_set = true;
        self
    }

    /// Writes whatever it is given, without the checks the reader makes (for building
    /// malformed files in tests).
    pub fn skip_validation(&mut self) -> &mut Self {
        self.validate = false;
        self
    }

    /// Appends a metadata entry (in order; duplicates are refused at write time).
    pub fn add_kv(&mut self, key: impl Into<String>, value: Value) -> &mut Self {
        self.kvs.push((key.into(), value));
        self
    }

    pub fn metadata(&self) -> &[(String, Value)] {
        &self.kvs
    }

    /// Appends a tensor after checking its name, shape and that `data` is exactly its size.
    pub fn add_tensor(
        &mut self,
        name: &str,
        dims: &[u64],
        ty: GgmlType,
        data: &[u8],
    ) -> Result<&mut Self, GgufError> {
        self.add_tensor_owned(name, dims, ty, data.to_vec())
    }

    /// `add_tensor` taking the data by value (no copy).
    pub fn add_tensor_owned(
        &mut self,
        name: &str,
        dims: &[u64],
        ty: GgmlType,
        data: Vec<u8>,
    ) -> Result<&mut Self, GgufError> {
        self.check_tensor(name, dims, ty, Some(data.len() as u64))?;
        self.tensors.push(PendingTensor {
            name: name.to_string(),
            dims: dims.to_vec(),
            type_id: ty.id(),
            data,
            offset_override: None,
            deferred: None,
        });
        Ok(self)
    }

    /// Appends a tensor record whose bytes the caller writes itself at the offset
    /// [`GgufWriter::layout`] gives it (streaming a file far larger than memory). Checked like
    /// `add_tensor`; returns the tensor's size in bytes.
    pub fn add_tensor_deferred(
        &mut self,
        name: &str,
        dims: &[u64],
        ty: GgmlType,
    ) -> Result<u64, GgufError> {
        let len = self.check_tensor(name, dims, ty, None)?;
        self.tensors.push(PendingTensor {
            name: name.to_string(),
            dims: dims.to_vec(),
            type_id: ty.id(),
            data: Vec::new(),
            offset_override: None,
            deferred: Some(len),
        });
        Ok(len)
    }

    /// Checks a tensor's name, shape and (when given) data length; returns its size in bytes.
    fn check_tensor(
        &self,
        name: &str,
        dims: &[u64],
        ty: GgmlType,
        data_len: Option<u64>,
    ) -> Result<u64, GgufError> {
        let size = || -> Option<u64> {
            let n = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d))?;
            (n / ty.block_size() as u64).checked_mul(ty.type_size() as u64)
        };
        if !self.validate {
            if let Some(l) = data_len {
                return Ok(l);
            }
            return size().ok_or_else(|| {
                werr(
                    format!("tensor '{name}'"),
                    "a size that fits in u64",
                    format!("{dims:?}"),
                )
            });
        }
        let what = || format!("tensor '{name}'");
        if name.len() >= MAX_NAME_BYTES {
            return Err(werr(
                what(),
                format!("a name shorter than {MAX_NAME_BYTES} bytes"),
                format!("{} bytes", name.len()),
            ));
        }
        if dims.len() > MAX_DIMS {
            return Err(werr(
                what(),
                format!("at most {MAX_DIMS} dims"),
                format!("{dims:?}"),
            ));
        }
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(werr(
                what(),
                "a unique tensor name",
                "a second tensor of that name",
            ));
        }
        let n = dims
            .iter()
            .try_fold(1u64, |a, &d| {
                a.checked_mul(d).filter(|&n| n <= i64::MAX as u64)
            })
            .ok_or_else(|| {
                werr(
                    what(),
                    "an element count that fits in i64",
                    format!("{dims:?}"),
                )
            })?;
        let bs = ty.block_size() as u64;
        let ne0 = dims.first().copied().unwrap_or(1);
        if ne0 % bs != 0 {
            return Err(werr(
                what(),
                format!("ne[0] a multiple of {ty}'s block size {bs}"),
                format!("ne[0] = {ne0}"),
            ));
        }
        let bytes = (n / bs).checked_mul(ty.type_size() as u64);
        match (bytes, data_len) {
            (Some(b), None) => Ok(b),
            (Some(b), Some(l)) if b == l => Ok(b),
            (_, l) => Err(werr(
                what(),
                format!(
                    "{} bytes of data for {ty} {dims:?}",
                    bytes.map_or("too many".into(), |b| b.to_string())
                ),
                l.map_or("no size".into(), |l| format!("{l} bytes")),
            )),
        }
    }

    /// Appends a tensor record with no checks: any type id (including unknown ones), any data
    /// length, and optionally a recorded offset different from where the data is placed.
    pub fn add_tensor_raw(
        &mut self,
        name: &str,
        dims: &[u64],
        type_id: u32,
        data: Vec<u8>,
        offset_override: Option<u64>,
    ) -> &mut Self {
        self.tensors.push(PendingTensor {
            name: name.to_string(),
            dims: dims.to_vec(),
            type_id,
            data,
            offset_override,
            deferred: None,
        });
        self
    }

    /// The alignment the file will use, after reconciling `alignment()` with a
    /// `general.alignment` entry, and whether the key must be appended.
    fn effective_alignment(&self) -> Result<(u64, bool), GgufError> {
        let kv = self
            .kvs
            .iter()
            .find(|(k, _)| k == ALIGNMENT_KEY)
            .map(|(_, v)| v);
        let valid = |a: u64| a != 0 && a.is_power_of_two() && a <= u64::from(u32::MAX);
        match kv {
            Some(Value::U32(a)) if valid(u64::from(*a)) => {
                if self.validate && self.alignment_set && u64::from(*a) != self.alignment {
                    return Err(werr(
                        ALIGNMENT_KEY,
                        format!("the alignment set on the writer ({})", self.alignment),
                        format!("{a}"),
                    ));
                }
                Ok((u64::from(*a), false))
            }
            Some(v) => {
                if self.validate {
                    return Err(werr(
                        ALIGNMENT_KEY,
                        "a u32 nonzero power of two",
                        format!("{} {v}", v.describe()),
                    ));
                }
                Ok((
                    if valid(self.alignment) {
                        self.alignment
                    } else {
                        DEFAULT_ALIGNMENT
                    },
                    false,
                ))
            }
            None => {
                if !valid(self.alignment) {
                    if self.validate {
                        return Err(werr(
                            "alignment",
                            "a nonzero power of two below 2^32",
                            self.alignment.to_string(),
                        ));
                    }
                    return Ok((DEFAULT_ALIGNMENT, false));
                }
                Ok((
                    self.alignment,
                    self.alignment_set && self.alignment != DEFAULT_ALIGNMENT,
                ))
            }
        }
    }

    /// Everything before the data section, padded, plus each tensor's data offset.
    fn header(&self) -> Result<(Vec<u8>, u64), GgufError> {
        if self.validate {
            if self.version != 2 && self.version != 3 {
                return Err(werr("version", "2 or 3", self.version.to_string()));
            }
            let mut seen = HashSet::new();
            for (k, _) in &self.kvs {
                if !seen.insert(k.as_str()) {
                    return Err(werr(
                        format!("metadata key '{k}'"),
                        "unique keys",
                        "a second entry",
                    ));
                }
            }
        }
        let (alignment, add_key) = self.effective_alignment()?;
        let mut h = Vec::new();
        h.extend_from_slice(b"GGUF");
        h.extend_from_slice(&self.version.to_le_bytes());
        h.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        h.extend_from_slice(&(self.kvs.len() as u64 + u64::from(add_key)).to_le_bytes());
        for (k, v) in &self.kvs {
            put_str(&mut h, k);
            h.extend_from_slice(&v.value_type().id().to_le_bytes());
            put_value(&mut h, v);
        }
        if add_key {
            let v = Value::U32(alignment as u32);
            put_str(&mut h, ALIGNMENT_KEY);
            h.extend_from_slice(&v.value_type().id().to_le_bytes());
            put_value(&mut h, &v);
        }
        let mut running = 0u64;
        for t in &self.tensors {
            put_str(&mut h, &t.name);
            h.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                h.extend_from_slice(&d.to_le_bytes());
            }
            h.extend_from_slice(&t.type_id.to_le_bytes());
            h.extend_from_slice(&t.offset_override.unwrap_or(running).to_le_bytes());
            running = pad(running + t.len(), alignment);
        }
        if !self.tensors.is_empty() {
            h.resize(pad(h.len() as u64, alignment) as usize, 0);
        }
        Ok((h, alignment))
    }

    /// The header and every tensor's place, for a caller that writes the tensor bytes itself
    /// (positional writes, in any order, from any number of threads).
    pub fn layout(&self) -> Result<StreamLayout, GgufError> {
        let (header, alignment) = self.header()?;
        let base = header.len() as u64;
        let mut running = 0u64;
        let mut tensors = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            tensors.push((base + running, t.len()));
            running = pad(running + t.len(), alignment);
        }
        Ok(StreamLayout {
            header,
            tensors,
            file_len: base + running,
        })
    }

    /// Writes the whole file to `out`.
    pub fn write_to(&self, out: &mut impl Write) -> Result<(), GgufError> {
        if let Some(t) = self.tensors.iter().find(|t| t.deferred.is_some()) {
            return Err(werr(
                format!("tensor '{}'", t.name),
                "its data (write_to writes whole files)",
                "a deferred tensor: write it through layout()",
            ));
        }
        let (header, alignment) = self.header()?;
        let io = |source| GgufError::Io {
            file: "<gguf writer output>".into(),
            source,
        };
        out.write_all(&header).map_err(io)?;
        let zeros = vec![0u8; alignment as usize];
        for t in &self.tensors {
            out.write_all(&t.data).map_err(io)?;
            // Like ggml, the last tensor is padded too.
            let padding = pad(t.data.len() as u64, alignment) - t.data.len() as u64;
            out.write_all(&zeros[..padding as usize]).map_err(io)?;
        }
        Ok(())
    }

    pub fn to_bytes(&self) -> Result<Vec<u8>, GgufError> {
        let mut v = Vec::new();
        self.write_to(&mut v)?;
        Ok(v)
    }

    /// Writes the file at `path` (through a buffer; errors name the path).
    pub fn write_file(&self, path: impl AsRef<Path>) -> Result<(), GgufError> {
        let path = path.as_ref();
        let name = path.display().to_string();
        let io = |source| GgufError::Io {
            file: name.clone(),
            source,
        };
        let f = std::fs::File::create(path).map_err(io)?;
        let mut w = std::io::BufWriter::new(f);
        self.write_to(&mut w).map_err(|e| match e {
            GgufError::Io { source, .. } => io(source),
            e => e,
        })?;
        w.flush().map_err(io)
    }
}

fn pad(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

fn put_str(h: &mut Vec<u8>, s: &str) {
    h.extend_from_slice(&(s.len() as u64).to_le_bytes());
    h.extend_from_slice(s.as_bytes());
}

fn put_value(h: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => h.push(*x),
        Value::I8(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::U16(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => h.push(u8::from(*x)),
        Value::String(s) => put_str(h, s),
        Value::Array(a) => put_array(h, a),
        Value::U64(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => h.extend_from_slice(&x.to_le_bytes()),
    }
}

fn put_array(h: &mut Vec<u8>, a: &Array) {
    h.extend_from_slice(&a.elem_type().id().to_le_bytes());
    h.extend_from_slice(&(a.len() as u64).to_le_bytes());
    macro_rules! each {
        ($v:expr) => {
            for x in $v {
                h.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match a {
        Array::U8(v) => h.extend_from_slice(v),
        Array::I8(v) => each!(v),
        Array::U16(v) => each!(v),
        Array::I16(v) => each!(v),
        Array::U32(v) => each!(v),
        Array::I32(v) => each!(v),
        Array::F32(v) => each!(v),
        Array::Bool(v) => h.extend(v.iter().map(|&b| u8::from(b))),
        Array::String(v) => v.iter().for_each(|s| put_str(h, s)),
        Array::Array(v) => v.iter().for_each(|x| put_array(h, x)),
        Array::U64(v) => each!(v),
        Array::I64(v) => each!(v),
        Array::F64(v) => each!(v),
    }
}
