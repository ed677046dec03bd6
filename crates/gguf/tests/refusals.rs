//! One test per class of malformed file the reader must refuse. Each builds the bad file (with
//! the writer's unchecked mode or a byte edit of a valid file) and checks that the error names
//! the file, the key or tensor, the offset and what was expected.

use strata_gguf::{Array, GgmlType, GgufError, GgufFile, GgufWriter, TensorType, Value};

const FILE: &str = "bad.gguf";

fn open(bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
    GgufFile::from_bytes(bytes, FILE)
}

/// The error message, after checking it names the file and an offset.
fn refuse(bytes: Vec<u8>) -> String {
    let e = open(bytes).map(|_| ()).expect_err("file should be refused");
    let m = e.to_string();
    assert!(m.starts_with(FILE), "message does not name the file: {m}");
    assert!(m.contains("offset"), "message does not name an offset: {m}");
    m
}

fn has(m: &str, parts: &[&str]) {
    for p in parts {
        assert!(m.contains(p), "message lacks {p:?}: {m}");
    }
}

fn unchecked() -> GgufWriter {
    let mut w = GgufWriter::new();
    w.skip_validation();
    w.add_kv("general.architecture", Value::String("t".into()));
    w
}

fn valid() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", Value::String("t".into()));
    w.add_kv("k.u32", Value::U32(5));
    w.add_tensor("a", &[32, 2], GgmlType::Q8_0, &[0u8; 68])
        .unwrap();
    w.add_tensor("b", &[4], GgmlType::F32, &[0u8; 16]).unwrap();
    w.to_bytes().unwrap()
}

/// File offset of the first metadata value type field (header 24 bytes + key string).
const FIRST_KV_TYPE_AT: usize = 24 + 8 + "general.architecture".len();

#[test]
fn valid_baseline_opens() {
    let f = open(valid()).unwrap();
    assert_eq!(f.tensors().len(), 2);
}

#[test]
fn bad_magic() {
    let mut b = valid();
    b[0] = b'X';
    has(&refuse(b), &["offset 0", "magic", "\"GGUF\""]);
}

#[test]
fn big_endian() {
    let mut b = valid();
    b[4..8].copy_from_slice(&3u32.to_be_bytes());
    has(&refuse(b), &["big-endian", "offset 4", "little-endian"]);
}

#[test]
fn version_1_and_unknown_versions() {
    for (v, what) in [(1u32, "obsolete"), (4, "version 4"), (0, "version 0")] {
        let mut b = valid();
        b[4..8].copy_from_slice(&v.to_le_bytes());
        has(&refuse(b), &["offset 4", "expected version 2 or 3", what]);
    }
}

#[test]
fn truncated_anywhere() {
    let b = valid();
    // Every prefix that cuts into the header or into tensor data is refused and none panics;
    // only the last tensor's trailing padding (16 bytes after the 16-byte tensor "b") may go.
    for n in 0..b.len() - 16 {
        let m = refuse(b[..n].to_vec());
        assert!(m.contains("needs") || m.contains("expected"), "{m}");
    }
    for n in b.len() - 16..b.len() {
        assert_eq!(
            open(b[..n].to_vec()).unwrap().tensor_bytes("b").unwrap(),
            &[0u8; 16]
        );
    }
    let m = refuse(b[..60].to_vec());
    has(
        &m,
        &[
            "offset 56",
            "'general.architecture' value: string length",
            "needs 8 bytes",
            "only 4",
        ],
    );
}

#[test]
fn huge_counts_refused_before_allocation() {
    let mut b = valid();
    b[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    has(
        &refuse(b),
        &[
            "metadata key/value count",
            "needs 18446744073709551615 bytes",
        ],
    );
    let mut b = valid();
    b[8..16].copy_from_slice(&(1u64 << 60).to_le_bytes());
    has(&refuse(b), &["tensor count", "count 1152921504606846976"]);
    // An array of 2^61 strings would need 2^64 bytes of lengths alone.
    let mut w = unchecked();
    w.add_kv("k.arr", Value::Array(Array::String(vec!["x".into()])));
    let mut b = w.to_bytes().unwrap();
    let at = b.windows(5).position(|x| x == b"k.arr").unwrap() + 5 + 4 + 4;
    b[at..at + 8].copy_from_slice(&(1u64 << 61).to_le_bytes());
    has(
        &refuse(b),
        &["'k.arr'", "array of string", "count 2305843009213693952"],
    );
    // A string length past the end of the file.
    let mut b = valid();
    b[24..32].copy_from_slice(&(u64::MAX - 3).to_le_bytes());
    has(
        &refuse(b),
        &["offset 32", "metadata key #0", "string bytes"],
    );
}

#[test]
fn unknown_value_type() {
    let mut b = valid();
    b[FIRST_KV_TYPE_AT..FIRST_KV_TYPE_AT + 4].copy_from_slice(&13u32.to_le_bytes());
    has(
        &refuse(b),
        &[
            &format!("offset {FIRST_KV_TYPE_AT}"),
            "'general.architecture' value type",
            "0..=12",
            "type id 13",
        ],
    );
}

#[test]
fn bad_bool_and_bad_utf8() {
    let mut w = unchecked();
    w.add_kv("k.bool", Value::Bool(true));
    let mut b = w.to_bytes().unwrap();
    let at = b.windows(6).position(|x| x == b"k.bool").unwrap() + 6 + 4;
    b[at] = 2;
    has(
        &refuse(b),
        &[
            &format!("offset {at}"),
            "'k.bool'",
            "bool byte 0 or 1",
            "found 2",
        ],
    );

    let mut w = unchecked();
    w.add_kv("k.s", Value::String("abcd".into()));
    let mut b = w.to_bytes().unwrap();
    let at = b.windows(4).position(|x| x == b"abcd").unwrap();
    b[at + 2] = 0xff;
    has(
        &refuse(b),
        &[&format!("offset {}", at + 2), "'k.s'", "UTF-8"],
    );
}

#[test]
fn arrays_nested_too_deep() {
    let mut a = Array::U8(vec![1]);
    for _ in 0..strata_gguf::MAX_ARRAY_DEPTH {
        a = Array::Array(vec![a]);
    }
    let mut w = unchecked();
    w.add_kv("k.deep", Value::Array(a.clone()));
    has(
        &refuse(w.to_bytes().unwrap()),
        &["'k.deep'", "nested at most 8 deep"],
    );
    // One level less is fine.
    let Array::Array(inner) = a else {
        unreachable!()
    };
    let mut w = unchecked();
    w.add_kv("k.deep", Value::Array(inner[0].clone()));
    open(w.to_bytes().unwrap()).unwrap();
}

#[test]
fn duplicate_key_and_tensor_name() {
    let mut w = unchecked();
    w.add_kv("k.dup", Value::U8(1))
        .add_kv("k.dup", Value::U8(2));
    has(
        &refuse(w.to_bytes().unwrap()),
        &["duplicate metadata key 'k.dup'", "first defined at offset"],
    );
    let mut w = unchecked();
    w.add_tensor_raw("t", &[4], 0, vec![0; 16], None)
        .add_tensor_raw("t", &[4], 0, vec![0; 16], None);
    has(
        &refuse(w.to_bytes().unwrap()),
        &["duplicate tensor name 't'"],
    );
    // The checked writer refuses both too.
    let mut w = GgufWriter::new();
    w.add_kv("k", Value::U8(1)).add_kv("k", Value::U8(1));
    assert!(w.to_bytes().unwrap_err().to_string().contains("'k'"));
    let mut w = GgufWriter::new();
    w.add_tensor("t", &[1], GgmlType::F32, &[0; 4]).unwrap();
    assert!(w.add_tensor("t", &[1], GgmlType::F32, &[0; 4]).is_err());
}

#[test]
fn long_name_and_too_many_dims() {
    let long = "n".repeat(64);
    let mut w = unchecked();
    w.add_tensor_raw(&long, &[4], 0, vec![0; 16], None);
    has(
        &refuse(w.to_bytes().unwrap()),
        &["tensor #0 name", "shorter than 64 bytes", "64 bytes"],
    );
    let mut w = unchecked();
    w.add_tensor_raw("t5", &[1, 1, 1, 1, 1], 0, vec![0; 4], None);
    has(
        &refuse(w.to_bytes().unwrap()),
        &["'t5' n_dims", "at most 4", "found 5"],
    );
    assert!(GgufWriter::new()
        .add_tensor(&long, &[1], GgmlType::F32, &[0; 4])
        .is_err());
}

#[test]
fn negative_and_overflowing_dims() {
    let mut w = unchecked();
    w.add_tensor_raw("neg", &[4, u64::MAX], 0, vec![0; 16], None);
    has(
        &refuse(w.to_bytes().unwrap()),
        &["'neg' ne[1]", "0..=i64::MAX", "(-1 as i64)"],
    );
    let mut w = unchecked();
    w.add_tensor_raw("big", &[1 << 32, 1 << 32], 0, vec![0; 16], None);
    has(
        &refuse(w.to_bytes().unwrap()),
        &["'big' shape", "fits in i64"],
    );
    // Fits in i64 as elements but not in u64 as bytes.
    let mut w = unchecked();
    w.add_tensor_raw("bytes", &[1 << 31, 1 << 31], 0, vec![0; 16], None);
    has(
        &refuse(w.to_bytes().unwrap()),
        &["'bytes' byte size", "fits in u64"],
    );
}

#[test]
fn row_not_whole_blocks() {
    let mut w = unchecked();
    w.add_tensor_raw("q", &[48, 2], GgmlType::Q8_0.id(), vec![0; 102], None);
    has(
        &refuse(w.to_bytes().unwrap()),
        &["'q' ne[0]", "multiple of Q8_0's block size 32", "found 48"],
    );
}

#[test]
fn unaligned_out_of_bounds_and_overlapping_offsets() {
    let mut w = unchecked();
    w.add_tensor_raw("u", &[4], 0, vec![0; 16], Some(8));
    has(
        &refuse(w.to_bytes().unwrap()),
        &["'u' data offset", "multiple of the alignment 32", "found 8"],
    );

    let mut w = unchecked();
    w.add_tensor_raw("oob", &[4], 0, vec![0; 16], Some(1 << 40));
    has(
        &refuse(w.to_bytes().unwrap()),
        &["tensor 'oob'", "inside the data section"],
    );
    let mut w = unchecked();
    w.add_tensor_raw("wrap", &[4], 0, vec![0; 16], Some(!31u64));
    has(
        &refuse(w.to_bytes().unwrap()),
        &["tensor 'wrap'", "inside the data section"],
    );

    let mut w = unchecked();
    w.add_tensor_raw("x", &[64], 0, vec![0; 256], None)
        .add_tensor_raw("y", &[64], 0, vec![0; 256], Some(32));
    has(
        &refuse(w.to_bytes().unwrap()),
        &["tensor 'x'", "overlaps tensor 'y' at data offset 32"],
    );
}

#[test]
fn data_size_that_does_not_match_the_type() {
    // A third-party 128-element "Q2_0" block of 34 bytes: ggml's Q2_0 (64 / 18) needs 36 bytes
    // for 128 elements, so the recorded shape overruns the end of the file.
    let mut w = unchecked();
    w.add_tensor_raw("q2", &[128], GgmlType::Q2_0.id(), vec![0; 34], None);
    let mut b = w.to_bytes().unwrap();
    b.truncate(b.len() - 30); // the 34 bytes and no padding
    has(
        &refuse(b),
        &[
            "tensor 'q2' (Q2_0 [128])",
            "36 bytes inside the data section",
        ],
    );
    // Data larger than the shape says: the extra space is refused as unexplained.
    let mut w = unchecked();
    w.add_tensor_raw("big", &[4], 0, vec![0; 64], None)
        .add_tensor_raw("next", &[4], 0, vec![0; 16], None);
    has(
        &refuse(w.to_bytes().unwrap()),
        &["tensor 'big'", "48 unexplained bytes", "next tensor 'next'"],
    );
}

#[test]
fn truncated_data_section() {
    let b = valid();
    let m = refuse(b[..b.len() - 40].to_vec());
    has(&m, &["tensor 'b'", "inside the data section"]);
}

#[test]
fn bad_alignment_key() {
    for (v, what) in [
        (Value::U64(32), "expected a u32, found u64"),
        (Value::U32(48), "nonzero power of two, found 48"),
        (Value::U32(0), "nonzero power of two, found 0"),
    ] {
        let mut w = unchecked();
        w.add_kv("general.alignment", v.clone());
        has(
            &refuse(w.to_bytes().unwrap()),
            &["'general.alignment'", what],
        );
        // The checked writer refuses it before writing.
        let mut w = GgufWriter::new();
        w.add_kv("general.alignment", v);
        assert!(w.to_bytes().is_err());
    }
    let mut w = unchecked();
    w.add_kv("general.alignment", Value::U32(64));
    w.add_tensor_raw("t", &[4], 0, vec![0; 16], Some(32));
    has(
        &refuse(w.to_bytes().unwrap()),
        &["'t' data offset", "multiple of the alignment 64"],
    );
}

#[test]
fn unknown_tensor_type_kept_until_used() {
    let mut w = unchecked();
    w.add_tensor_raw("weird", &[16], 4, vec![0; 40], None);
    w.add_tensor_raw("fine", &[4], 0, vec![1; 16], None);
    let f = open(w.to_bytes().unwrap()).unwrap();
    let t = f.tensor("weird").unwrap();
    assert_eq!(t.ty, TensorType::Unknown(4));
    assert_eq!(t.n_bytes, 0);
    assert_eq!(f.tensor_bytes("fine").unwrap(), &[1u8; 16]);
    for m in [
        f.tensor_bytes("weird").unwrap_err().to_string(),
        f.tensor_type(t).unwrap_err().to_string(),
    ] {
        has(
            &m,
            &[
                FILE,
                "tensor 'weird'",
                "offset",
                "type id 4 is not a known ggml type",
            ],
        );
    }
    has(
        &t.ggml_type().unwrap_err().to_string(),
        &["tensor 'weird'", "type id 4"],
    );
    assert!(GgufWriter::from_file(&f).is_err());
}
