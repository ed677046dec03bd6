//! Parsing and validating a GGUF file (v2 and v3) into `GgufFile`: header, metadata, tensor
//! infos and the layout of the data section. Every count read from the file is checked against
//! the bytes left before anything is allocated for it, so a corrupt length is an error rather
//! than an out-of-memory abort.

use std::collections::HashMap;
use std::path::Path;

use strata_quant::GgmlType;

use crate::error::GgufError;
use crate::value::{Array, Value, ValueType};

/// Alignment of the data section and of every tensor when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's limit on tensor names (the name must be shorter than this, in bytes).
pub const MAX_NAME_BYTES: usize = 64;
/// ggml's limit on tensor dimensions.
pub const MAX_DIMS: usize = 4;
/// How deep arrays of arrays may nest. Real files use at most 2; the limit keeps recursion off
/// the stack-overflow path for hostile files.
pub const MAX_ARRAY_DEPTH: usize = 8;
pub const ALIGNMENT_KEY: &str = "general.alignment";

/// A tensor's element type: known to the type table, or an id kept so the file still opens and
/// refused only when the tensor is used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorType {
    Known(GgmlType),
    Unknown(u32),
}

impl TensorType {
    pub fn from_id(id: u32) -> TensorType {
        GgmlType::from_id(id).map_or(TensorType::Unknown(id), TensorType::Known)
    }

    pub fn id(self) -> u32 {
        match self {
            TensorType::Known(t) => t.id(),
            TensorType::Unknown(id) => id,
        }
    }
}

impl std::fmt::Display for TensorType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TensorType::Known(t) => write!(f, "{t}"),
            TensorType::Unknown(id) => write!(f, "unknown({id})"),
        }
    }
}

/// One tensor's description from the tensor-info section.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml `ne`: `dims[0]` is the contiguous axis.
    pub dims: Vec<u64>,
    pub ty: TensorType,
    /// Offset of the data relative to the start of the data section.
    pub offset: u64,
    pub n_elements: u64,
    /// Bytes of data; 0 when the type is unknown.
    pub n_bytes: u64,
}

impl TensorInfo {
    /// ggml's `ne[i]`: 1 past the stored dimensions.
    pub fn ne(&self, i: usize) -> u64 {
        self.dims.get(i).copied().unwrap_or(1)
    }

    /// Rows of `ne0` elements: the product of `dims[1..]`.
    pub fn n_rows(&self) -> u64 {
        self.dims
            .iter()
            .skip(1)
            .fold(1u64, |a, &d| a.saturating_mul(d))
    }

    /// The shape in NumPy order (outermost first): reversed `dims`.
    pub fn shape_rev(&self) -> Vec<u64> {
        self.dims.iter().rev().copied().collect()
    }

    /// The known element type, or an error naming the tensor and the unknown id.
    pub fn ggml_type(&self) -> Result<GgmlType, GgufError> {
        match self.ty {
            TensorType::Known(t) => Ok(t),
            TensorType::Unknown(id) => Err(GgufError::UnknownType {
                file: String::from("<file not known here; GgufFile::tensor_type names it>"),
                tensor: self.name.clone(),
                at: format!("data at data-section offset {}", self.offset),
                id,
            }),
        }
    }
}

/// 64 bytes with 64-byte alignment: owned buffers are built from these so tensor data sits at
/// the same alignment as in a page-aligned map (callers may cast f32 data in place).
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C, align(64))]
struct Line([u8; 64]);

enum Storage {
    Mmap(memmap2::Mmap),
    Owned { lines: Vec<Line>, len: usize },
}

impl Storage {
    fn owned(bytes: &[u8]) -> Storage {
        let mut lines = vec![Line([0; 64]); bytes.len().div_ceil(64)];
        let flat: &mut [u8] = bytemuck::cast_slice_mut(&mut lines);
        flat[..bytes.len()].copy_from_slice(bytes);
        Storage::Owned {
            lines,
            len: bytes.len(),
        }
    }

    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mmap(m) => m,
            Storage::Owned { lines, len } => {
                let flat: &[u8] = bytemuck::cast_slice(lines);
                &flat[..*len]
            }
        }
    }
}

/// An open, validated GGUF file. Tensor data is borrowed straight from the map (or the owned
/// buffer), never copied.
pub struct GgufFile {
    name: String,
    storage: Storage,
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Vec<(String, Value)>,
    /// File offset of each metadata value (parallel to `metadata`), for error messages.
    kv_offsets: Vec<u64>,
    kv_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    /// File offset of each tensor's info record (parallel to `tensors`).
    tensor_info_offsets: Vec<u64>,
    tensor_index: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("name", &self.name)
            .field("version", &self.version)
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .field("n_kv", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .finish()
    }
}

/// A bounds-checked little-endian reader over the file bytes. Errors carry the file name and
/// the offset of the field that failed.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    file: &'a str,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    fn truncated(&self, what: &dyn Fn() -> String, needed: u64) -> GgufError {
        GgufError::Truncated {
            file: self.file.to_string(),
            offset: self.pos as u64,
            what: what(),
            needed,
            available: self.remaining() as u64,
        }
    }

    fn malformed(&self, offset: usize, what: String, expected: String, found: String) -> GgufError {
        GgufError::Malformed {
            file: self.file.to_string(),
            offset: offset as u64,
            what,
            expected,
            found,
        }
    }

    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(self.truncated(what, n as u64));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], GgufError> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Checks that `count` elements of at least `min_size` bytes each can still fit, and returns
    /// the count as usize. This is the guard before every allocation sized by a file count.
    fn check_count(
        &self,
        count: u64,
        min_size: usize,
        what: &dyn Fn() -> String,
    ) -> Result<usize, GgufError> {
        let needed = count.checked_mul(min_size as u64);
        match needed {
            Some(n) if n <= self.remaining() as u64 => Ok(count as usize),
            _ => Err(self.truncated(
                &|| format!("{} (count {count})", what()),
                needed.unwrap_or(u64::MAX),
            )),
        }
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, GgufError> {
        let at = self.pos;
        let len = self.u64(&|| format!("{}: string length", what()))?;
        let len = self.check_count(len, 1, &|| format!("{}: string bytes", what()))?;
        let bytes = self.take(len, what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(e) => Err(self.malformed(
                at + 8 + e.valid_up_to(),
                what(),
                "a UTF-8 string".into(),
                format!("invalid UTF-8 at byte {} of {len}", e.valid_up_to()),
            )),
        }
    }

    fn value_type(&mut self, what: &dyn Fn() -> String) -> Result<ValueType, GgufError> {
        let at = self.pos;
        let id = self.u32(what)?;
        ValueType::from_id(id).ok_or_else(|| {
            self.malformed(
                at,
                what(),
                "a value type id 0..=12".into(),
                format!("type id {id}"),
            )
        })
    }

    fn value(
        &mut self,
        ty: ValueType,
        depth: usize,
        what: &dyn Fn() -> String,
    ) -> Result<Value, GgufError> {
        let at = self.pos;
        Ok(match ty {
            ValueType::U8 => Value::U8(u8::from_le_bytes(self.array(what)?)),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.array(what)?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(what)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(what)?)),
            ValueType::U32 => Value::U32(u32::from_le_bytes(self.array(what)?)),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(what)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(what)?)),
            ValueType::U64 => Value::U64(u64::from_le_bytes(self.array(what)?)),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(what)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(what)?)),
            ValueType::Bool => {
                let [b] = self.array::<1>(what)?;
                Value::Bool(self.bool_byte(b, at, what)?)
            }
            ValueType::String => Value::String(self.string(what)?),
            ValueType::Array => Value::Array(self.array_value(depth, what)?),
        })
    }

    fn bool_byte(&self, b: u8, at: usize, what: &dyn Fn() -> String) -> Result<bool, GgufError> {
        match b {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(self.malformed(at, what(), "a bool byte 0 or 1".into(), format!("{b}"))),
        }
    }

    fn array_value(&mut self, depth: usize, what: &dyn Fn() -> String) -> Result<Array, GgufError> {
        let header_at = self.pos;
        if depth >= MAX_ARRAY_DEPTH {
            return Err(self.malformed(
                header_at,
                what(),
                format!("arrays nested at most {MAX_ARRAY_DEPTH} deep"),
                "deeper nesting".into(),
            ));
        }
        let ety = self.value_type(&|| format!("{}: array element type", what()))?;
        let n = self.u64(&|| format!("{}: array length", what()))?;
        let n = self.check_count(n, ety.min_size(), &|| format!("{}: array of {ety}", what()))?;
        macro_rules! fixed {
            ($variant:ident, $t:ty) => {{
                const S: usize = std::mem::size_of::<$t>();
                let bytes = self.take(n * S, what)?;
                Array::$variant(
                    bytes
                        .chunks_exact(S)
                        .map(|c| {
                            let mut a = [0u8; S];
                            a.copy_from_slice(c);
                            <$t>::from_le_bytes(a)
                        })
                        .collect(),
                )
            }};
        }
        Ok(match ety {
            ValueType::U8 => Array::U8(self.take(n, what)?.to_vec()),
            ValueType::I8 => fixed!(I8, i8),
            ValueType::U16 => fixed!(U16, u16),
            ValueType::I16 => fixed!(I16, i16),
            ValueType::U32 => fixed!(U32, u32),
            ValueType::I32 => fixed!(I32, i32),
            ValueType::F32 => fixed!(F32, f32),
            ValueType::U64 => fixed!(U64, u64),
            ValueType::I64 => fixed!(I64, i64),
            ValueType::F64 => fixed!(F64, f64),
            ValueType::Bool => {
                let at = self.pos;
                let bytes = self.take(n, what)?;
                let mut v = Vec::with_capacity(n);
                for (i, &b) in bytes.iter().enumerate() {
                    v.push(self.bool_byte(b, at + i, &|| format!("{}[{i}]", what()))?);
                }
                Array::Bool(v)
            }
            ValueType::String => {
                let mut v = Vec::with_capacity(n);
                for i in 0..n {
                    v.push(self.string(&|| format!("{}[{i}]", what()))?);
                }
                Array::String(v)
            }
            ValueType::Array => {
                let mut v = Vec::with_capacity(n);
                for i in 0..n {
                    v.push(self.array_value(depth + 1, &|| format!("{}[{i}]", what()))?);
                }
                Array::Array(v)
            }
        })
    }
}

fn align_up(x: u64, a: u64) -> Option<u64> {
    // `a` is a nonzero power of two (checked where it is read).
    x.checked_add(a - 1).map(|v| v & !(a - 1))
}

impl GgufFile {
    /// Maps `path` and validates it.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
        let path = path.as_ref();
        let name = path.display().to_string();
        let io = |source| GgufError::Io {
            file: name.clone(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let storage = if len == 0 {
            Storage::owned(&[])
        } else {
            // SAFETY: the map is read-only and lives as long as `GgufFile`; like every mmap
            // reader we rely on the file not being truncated or rewritten while it is open.
            Storage::Mmap(unsafe { memmap2::Mmap::map(&file) }.map_err(io)?)
        };
        Self::parse(storage, name)
    }

    /// Validates a file held in memory (tests, fuzzing, generated files). `name` is used in
    /// error messages. The bytes are copied into a 64-byte-aligned buffer, so tensor data has
    /// the same alignment as in a mapped file.
    pub fn from_bytes(bytes: Vec<u8>, name: &str) -> Result<GgufFile, GgufError> {
        Self::parse(Storage::owned(&bytes), name.to_string())
    }

    fn bytes(&self) -> &[u8] {
        self.storage.bytes()
    }

    fn parse(storage: Storage, name: String) -> Result<GgufFile, GgufError> {
        let parsed = parse_layout(storage.bytes(), &name)?;
        Ok(GgufFile {
            name,
            storage,
            version: parsed.version,
            alignment: parsed.alignment,
            data_offset: parsed.data_offset,
            metadata: parsed.metadata,
            kv_offsets: parsed.kv_offsets,
            kv_index: parsed.kv_index,
            tensors: parsed.tensors,
            tensor_info_offsets: parsed.tensor_info_offsets,
            tensor_index: parsed.tensor_index,
        })
    }

    /// The file name used in error messages (the path as given to `open`).
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute file offset of the data section.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// Size of the whole file in bytes.
    pub fn file_size(&self) -> u64 {
        self.bytes().len() as u64
    }

    /// Metadata in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.kv_index
            .get(key)
            .and_then(|&i| self.metadata.get(i))
            .map(|(_, v)| v)
    }

    /// File offset of `key`'s value, for callers that report their own errors about a value.
    pub fn key_offset(&self, key: &str) -> Option<u64> {
        self.kv_index
            .get(key)
            .and_then(|&i| self.kv_offsets.get(i))
            .copied()
    }

    fn require(&self, key: &str, expected: &str) -> Result<&Value, GgufError> {
        self.get(key).ok_or_else(|| GgufError::MissingKey {
            file: self.name.clone(),
            key: key.to_string(),
            expected: expected.to_string(),
        })
    }

    /// An error saying `key` holds something other than `expected`.
    pub fn key_error(
        &self,
        key: &str,
        expected: impl Into<String>,
        found: impl Into<String>,
    ) -> GgufError {
        GgufError::KeyType {
            file: self.name.clone(),
            key: key.to_string(),
            offset: self.key_offset(key).unwrap_or(0),
            expected: expected.into(),
            found: found.into(),
        }
    }

    fn int_of<T: TryFrom<i128>>(
        &self,
        key: &str,
        v: &Value,
        expected: &str,
    ) -> Result<T, GgufError> {
        match v.as_i128() {
            Some(i) => T::try_from(i)
                .map_err(|_| self.key_error(key, expected, format!("{} {i}", v.describe()))),
            None => Err(self.key_error(key, expected, v.describe())),
        }
    }

    pub fn get_u32(&self, key: &str) -> Result<u32, GgufError> {
        const E: &str = "an integer that fits in u32";
        self.int_of(key, self.require(key, E)?, E)
    }

    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        const E: &str = "an integer that fits in u64";
        self.int_of(key, self.require(key, E)?, E)
    }

    pub fn get_i64(&self, key: &str) -> Result<i64, GgufError> {
        const E: &str = "an integer that fits in i64";
        self.int_of(key, self.require(key, E)?, E)
    }

    pub fn get_i32(&self, key: &str) -> Result<i32, GgufError> {
        const E: &str = "an integer that fits in i32";
        self.int_of(key, self.require(key, E)?, E)
    }

    /// f32 values; f64 values are accepted and rounded to f32.
    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        const E: &str = "f32 (or f64)";
        match self.require(key, E)? {
            Value::F32(v) => Ok(*v),
            Value::F64(v) => Ok(*v as f32),
            v => Err(self.key_error(key, E, v.describe())),
        }
    }

    pub fn get_f64(&self, key: &str) -> Result<f64, GgufError> {
        const E: &str = "f64 (or f32)";
        match self.require(key, E)? {
            Value::F32(v) => Ok(f64::from(*v)),
            Value::F64(v) => Ok(*v),
            v => Err(self.key_error(key, E, v.describe())),
        }
    }

    pub fn get_bool(&self, key: &str) -> Result<bool, GgufError> {
        const E: &str = "bool";
        match self.require(key, E)? {
            Value::Bool(v) => Ok(*v),
            v => Err(self.key_error(key, E, v.describe())),
        }
    }

    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        const E: &str = "string";
        match self.require(key, E)? {
            Value::String(v) => Ok(v),
            v => Err(self.key_error(key, E, v.describe())),
        }
    }

    pub fn get_u32_or(&self, key: &str, default: u32) -> Result<u32, GgufError> {
        if self.get(key).is_none() {
            return Ok(default);
        }
        self.get_u32(key)
    }

    pub fn get_u64_or(&self, key: &str, default: u64) -> Result<u64, GgufError> {
        if self.get(key).is_none() {
            return Ok(default);
        }
        self.get_u64(key)
    }

    pub fn get_f32_or(&self, key: &str, default: f32) -> Result<f32, GgufError> {
        if self.get(key).is_none() {
            return Ok(default);
        }
        self.get_f32(key)
    }

    pub fn get_bool_or(&self, key: &str, default: bool) -> Result<bool, GgufError> {
        if self.get(key).is_none() {
            return Ok(default);
        }
        self.get_bool(key)
    }

    /// The array stored at `key`.
    pub fn get_array(&self, key: &str) -> Result<&Array, GgufError> {
        const E: &str = "an array";
        match self.require(key, E)? {
            Value::Array(a) => Ok(a),
            v => Err(self.key_error(key, E, v.describe())),
        }
    }

    fn int_array<T: TryFrom<i128>>(&self, key: &str, expected: &str) -> Result<Vec<T>, GgufError> {
        let a = match self.require(key, expected)? {
            Value::Array(a) => a,
            v => return Err(self.key_error(key, expected, v.describe())),
        };
        let ints = a
            .ints()
            .ok_or_else(|| self.key_error(key, expected, a.describe()))?;
        ints.into_iter()
            .enumerate()
            .map(|(i, x)| {
                T::try_from(x)
                    .map_err(|_| self.key_error(key, expected, format!("element {i} = {x}")))
            })
            .collect()
    }

    /// An array of any integer type whose elements all fit in u32.
    pub fn get_array_u32(&self, key: &str) -> Result<Vec<u32>, GgufError> {
        self.int_array(key, "an array of integers that fit in u32")
    }

    pub fn get_array_i32(&self, key: &str) -> Result<Vec<i32>, GgufError> {
        self.int_array(key, "an array of integers that fit in i32")
    }

    pub fn get_array_u64(&self, key: &str) -> Result<Vec<u64>, GgufError> {
        self.int_array(key, "an array of integers that fit in u64")
    }

    pub fn get_array_i64(&self, key: &str) -> Result<Vec<i64>, GgufError> {
        self.int_array(key, "an array of integers that fit in i64")
    }

    /// An array of f32 (f64 arrays are accepted and rounded).
    pub fn get_array_f32(&self, key: &str) -> Result<Vec<f32>, GgufError> {
        const E: &str = "an array of f32";
        match self.get_array(key)? {
            Array::F32(v) => Ok(v.clone()),
            Array::F64(v) => Ok(v.iter().map(|&x| x as f32).collect()),
            a => Err(self.key_error(key, E, a.describe())),
        }
    }

    /// An array of strings, borrowed.
    pub fn get_array_str(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        Ok(self
            .get_array_strings(key)?
            .iter()
            .map(String::as_str)
            .collect())
    }

    /// An array of strings without building a new vector (for 150k-entry vocabularies).
    pub fn get_array_strings(&self, key: &str) -> Result<&[String], GgufError> {
        const E: &str = "an array of string";
        match self.get_array(key)? {
            Array::String(v) => Ok(v),
            a => Err(self.key_error(key, E, a.describe())),
        }
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Result<&str, GgufError> {
        self.get_str("general.architecture")
    }

    /// Tensor infos in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index
            .get(name)
            .and_then(|&i| self.tensors.get(i))
    }

    /// The tensor named `name`, or an error naming the file and the tensor.
    pub fn require_tensor(&self, name: &str) -> Result<&TensorInfo, GgufError> {
        self.tensor(name).ok_or_else(|| GgufError::MissingTensor {
            file: self.name.clone(),
            tensor: name.to_string(),
        })
    }

    /// File offset of the tensor's info record.
    pub fn tensor_info_offset(&self, name: &str) -> Option<u64> {
        self.tensor_index
            .get(name)
            .and_then(|&i| self.tensor_info_offsets.get(i))
            .copied()
    }

    /// The tensor's element type, or an error naming this file, the tensor and the unknown id.
    pub fn tensor_type(&self, t: &TensorInfo) -> Result<GgmlType, GgufError> {
        match t.ty {
            TensorType::Known(ty) => Ok(ty),
            TensorType::Unknown(id) => Err(GgufError::UnknownType {
                file: self.name.clone(),
                tensor: t.name.clone(),
                at: format!(
                    "info record at offset {}",
                    self.tensor_info_offset(&t.name).unwrap_or(0)
                ),
                id,
            }),
        }
    }

    /// The tensor's bytes, borrowed from the map. Refuses tensors of unknown type.
    pub fn tensor_data(&self, t: &TensorInfo) -> Result<&[u8], GgufError> {
        self.tensor_type(t)?;
        let start = self.data_offset.checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(t.n_bytes));
        let bytes = self.bytes();
        match (start, end) {
            (Some(s), Some(e)) if e <= bytes.len() as u64 => Ok(&bytes[s as usize..e as usize]),
            _ => Err(GgufError::Truncated {
                file: self.name.clone(),
                offset: start.unwrap_or(u64::MAX),
                what: format!("tensor '{}' data", t.name),
                needed: t.n_bytes,
                available: (bytes.len() as u64).saturating_sub(start.unwrap_or(u64::MAX)),
            }),
        }
    }

    /// The bytes of the tensor named `name`.
    pub fn tensor_bytes(&self, name: &str) -> Result<&[u8], GgufError> {
        self.tensor_data(self.require_tensor(name)?)
    }

    /// Sum of the data bytes of all tensors of known type.
    pub fn total_tensor_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.n_bytes).sum()
    }
}

struct Parsed {
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Vec<(String, Value)>,
    kv_offsets: Vec<u64>,
    kv_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_info_offsets: Vec<u64>,
    tensor_index: HashMap<String, usize>,
}

fn parse_layout(buf: &[u8], file: &str) -> Result<Parsed, GgufError> {
    let mut c = Cursor { buf, pos: 0, file };
    let magic = c.array::<4>(&|| "magic".into())?;
    if &magic != b"GGUF" {
        return Err(c.malformed(
            0,
            "magic".into(),
            "the bytes \"GGUF\"".into(),
            format!("{magic:02x?}"),
        ));
    }
    let version = c.u32(&|| "version".into())?;
    if version != 0 && version & 0xFFFF == 0 {
        return Err(GgufError::BigEndian {
            file: file.to_string(),
            raw: version,
        });
    }
    if version != 2 && version != 3 {
        let found = if version == 1 {
            "version 1 (obsolete: 32-bit lengths; convert the file with a current tool)".to_string()
        } else {
            format!("version {version}")
        };
        return Err(c.malformed(4, "version".into(), "version 2 or 3".into(), found));
    }
    let n_tensors = c.u64(&|| "tensor count".into())?;
    let n_kv = c.u64(&|| "metadata key/value count".into())?;
    // A key/value takes at least 8 (key length) + 4 (type) + 1 bytes; a tensor info at least
    // 8 (name length) + 4 (n_dims) + 4 (type) + 8 (offset).
    let n_kv = c.check_count(n_kv, 13, &|| "metadata key/value count".into())?;

    let mut metadata = Vec::with_capacity(n_kv);
    let mut kv_offsets = Vec::with_capacity(n_kv);
    let mut key_at = Vec::with_capacity(n_kv);
    let mut kv_index = HashMap::with_capacity(n_kv);
    for i in 0..n_kv {
        let at = c.pos;
        let key = c.string(&|| format!("metadata key #{i}"))?;
        if let Some(&j) = kv_index.get(&key) {
            let first: &u64 = key_at.get(j).unwrap_or(&0);
            return Err(GgufError::Duplicate {
                file: file.to_string(),
                offset: at as u64,
                kind: "metadata key",
                name: key,
                first: *first,
            });
        }
        let what = || format!("metadata key '{key}' value");
        let ty = c.value_type(&|| format!("metadata key '{key}' value type"))?;
        let value_at = c.pos as u64;
        let value = c.value(ty, 0, &what)?;
        kv_index.insert(key.clone(), i);
        key_at.push(at as u64);
        kv_offsets.push(value_at);
        metadata.push((key, value));
    }

    let alignment = match kv_index
        .get(ALIGNMENT_KEY)
        .and_then(|&i| metadata.get(i).map(|kv| (i, &kv.1)))
    {
        None => DEFAULT_ALIGNMENT,
        Some((i, v)) => {
            let at = kv_offsets.get(i).copied().unwrap_or(0) as usize;
            match v {
                Value::U32(a) if *a != 0 && a.is_power_of_two() => u64::from(*a),
                Value::U32(a) => {
                    return Err(c.malformed(
                        at,
                        format!("metadata key '{ALIGNMENT_KEY}'"),
                        "a nonzero power of two".into(),
                        format!("{a}"),
                    ))
                }
                other => {
                    return Err(c.malformed(
                        at,
                        format!("metadata key '{ALIGNMENT_KEY}'"),
                        "a u32".into(),
                        other.describe(),
                    ))
                }
            }
        }
    };

    let n_tensors = c.check_count(n_tensors, 24, &|| "tensor count".into())?;
    let mut tensors: Vec<TensorInfo> = Vec::with_capacity(n_tensors);
    let mut tensor_info_offsets = Vec::with_capacity(n_tensors);
    let mut tensor_index: HashMap<String, usize> = HashMap::with_capacity(n_tensors);
    for i in 0..n_tensors {
        let at = c.pos;
        let name_len_at = c.pos;
        let name_len = c.u64(&|| format!("tensor #{i} name length"))?;
        if name_len >= MAX_NAME_BYTES as u64 {
            return Err(c.malformed(
                name_len_at,
                format!("tensor #{i} name"),
                format!("a name shorter than {MAX_NAME_BYTES} bytes"),
                format!("{name_len} bytes"),
            ));
        }
        c.pos = name_len_at;
        let name = c.string(&|| format!("tensor #{i} name"))?;
        if let Some(&j) = tensor_index.get(&name) {
            return Err(GgufError::Duplicate {
                file: file.to_string(),
                offset: at as u64,
                kind: "tensor name",
                name,
                first: tensor_info_offsets.get(j).copied().unwrap_or(0),
            });
        }
        let what_t = |field: &str| format!("tensor '{name}' {field}");
        let n_dims_at = c.pos;
        let n_dims = c.u32(&|| what_t("n_dims"))?;
        if n_dims as usize > MAX_DIMS {
            return Err(c.malformed(
                n_dims_at,
                what_t("n_dims"),
                format!("at most {MAX_DIMS}"),
                n_dims.to_string(),
            ));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        let mut n_elements: u64 = 1;
        for d in 0..n_dims as usize {
            let dim_at = c.pos;
            let ne = c.u64(&|| what_t(&format!("ne[{d}]")))?;
            // ggml stores ne as i64: larger values are negative there.
            if ne > i64::MAX as u64 {
                return Err(c.malformed(
                    dim_at,
                    what_t(&format!("ne[{d}]")),
                    "a dimension in 0..=i64::MAX".into(),
                    format!("{ne} ({} as i64)", ne as i64),
                ));
            }
            dims.push(ne);
            n_elements = n_elements
                .checked_mul(ne)
                .filter(|&n| n <= i64::MAX as u64)
                .ok_or_else(|| {
                    c.malformed(
                        dim_at,
                        what_t("shape"),
                        "an element count that fits in i64".into(),
                        format!("dims {dims:?} overflow"),
                    )
                })?;
        }
        let type_at = c.pos;
        let ty = TensorType::from_id(c.u32(&|| what_t("type"))?);
        let offset_at = c.pos;
        let offset = c.u64(&|| what_t("offset"))?;
        let n_bytes = match ty {
            TensorType::Unknown(_) => 0,
            TensorType::Known(gt) => {
                let bs = gt.block_size() as u64;
                let ne0 = dims.first().copied().unwrap_or(1);
                if ne0 % bs != 0 {
                    return Err(c.malformed(
                        type_at,
                        what_t("ne[0]"),
                        format!("a multiple of {gt}'s block size {bs}"),
                        ne0.to_string(),
                    ));
                }
                (n_elements / bs)
                    .checked_mul(gt.type_size() as u64)
                    .ok_or_else(|| {
                        c.malformed(
                            type_at,
                            what_t("byte size"),
                            "a size that fits in u64".into(),
                            format!("dims {dims:?} of {gt}"),
                        )
                    })?
            }
        };
        if offset % alignment != 0 {
            return Err(c.malformed(
                offset_at,
                what_t("data offset"),
                format!("a multiple of the alignment {alignment}"),
                offset.to_string(),
            ));
        }
        tensor_index.insert(name.clone(), i);
        tensor_info_offsets.push(at as u64);
        tensors.push(TensorInfo {
            name,
            dims,
            ty,
            offset,
            n_elements,
            n_bytes,
        });
    }

    let infos_end = c.pos as u64;
    // Like ggml: without tensors there is no data section and no padding to require.
    let data_offset = if n_tensors == 0 {
        infos_end
    } else {
        align_up(infos_end, alignment).ok_or_else(|| {
            c.malformed(
                c.pos,
                "data section start".into(),
                "an offset that fits in u64".into(),
                "overflow".into(),
            )
        })?
    };
    let file_len = buf.len() as u64;
    if n_tensors > 0 && data_offset > file_len {
        return Err(GgufError::Truncated {
            file: file.to_string(),
            offset: infos_end,
            what: format!("padding to the data section (alignment {alignment})"),
            needed: data_offset - infos_end,
            available: file_len - infos_end,
        });
    }
    check_data_layout(
        file,
        &tensors,
        &tensor_info_offsets,
        data_offset,
        file_len.saturating_sub(data_offset),
        alignment,
    )?;

    Ok(Parsed {
        version,
        alignment,
        data_offset,
        metadata,
        kv_offsets,
        kv_index,
        tensors,
        tensor_info_offsets,
        tensor_index,
    })
}

/// Every tensor must lie inside the data section, no two may overlap, and (because the type id
/// alone does not always determine the layout; FORMATS.md) the space up to the next tensor or
/// the end of the file must be the tensor's size plus less than one alignment of padding.
fn check_data_layout(
    file: &str,
    tensors: &[TensorInfo],
    info_offsets: &[u64],
    data_offset: u64,
    data_len: u64,
    alignment: u64,
) -> Result<(), GgufError> {
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by_key(|&i| tensors.get(i).map(|t| (t.offset, t.n_bytes)));
    let info_at = |i: usize| info_offsets.get(i).copied().unwrap_or(0);
    let err = |i: usize, t: &TensorInfo, expected: String, found: String| GgufError::Malformed {
        file: file.to_string(),
        offset: info_at(i),
        what: format!(
            "tensor '{}' ({} {:?}) data at data offset {}",
            t.name, t.ty, t.dims, t.offset
        ),
        expected,
        found,
    };
    for (k, &i) in order.iter().enumerate() {
        let Some(t) = tensors.get(i) else { continue };
        let end = t.offset.checked_add(t.n_bytes);
        match end {
            Some(e) if e <= data_len => {}
            _ => {
                return Err(err(
                    i,
                    t,
                    format!("{} bytes inside the data section", t.n_bytes),
                    format!(
                        "the data section (file offset {data_offset}) has {data_len} bytes, so only {} are left",
                        data_len.saturating_sub(t.offset)
                    ),
                ))
            }
        }
        let end = end.unwrap_or(u64::MAX);
        if matches!(t.ty, TensorType::Unknown(_)) {
            continue;
        }
        let next = order
            .get(k + 1)
            .and_then(|&j| tensors.get(j).map(|n| (j, n)));
        let limit = match next {
            Some((_, n)) => n.offset,
            None => data_len,
        };
        if limit < end {
            let (_, n) = next.map_or((i, t), |x| x);
            return Err(err(
                i,
                t,
                format!("{} bytes that do not overlap other tensors", t.n_bytes),
                format!(
                    "it overlaps tensor '{}' at data offset {}",
                    n.name, n.offset
                ),
            ));
        }
        if limit - end >= alignment {
            let after = match next {
                Some((_, n)) => format!(
                    "the next tensor '{}' starts at data offset {}",
                    n.name, n.offset
                ),
                None => format!("the file ends at data offset {data_len}"),
            };
            return Err(err(
                i,
                t,
                format!(
                    "{} bytes followed by less than {alignment} bytes of padding",
                    t.n_bytes
                ),
                format!(
                    "{} unexplained bytes: {after} (type or shape does not match the data)",
                    limit - end
                ),
            ));
        }
    }
    Ok(())
}
