//! Writer ↔ reader round trips: synthetic files with every value type (arrays of arrays
//! included) and every tensor type, and real files, which must come back byte for byte.

use std::path::{Path, PathBuf};

use strata_gguf::{Array, GgmlType, GgufFile, GgufWriter, TensorType, Value};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn every_value() -> Vec<(String, Value)> {
    vec![
        (
            "general.architecture".into(),
            Value::String("testarch".into()),
        ),
        ("t.u8".into(), Value::U8(200)),
        ("t.i8".into(), Value::I8(-100)),
        ("t.u16".into(), Value::U16(60000)),
        ("t.i16".into(), Value::I16(-30000)),
        ("t.u32".into(), Value::U32(4_000_000_000)),
        ("t.i32".into(), Value::I32(-2_000_000_000)),
        ("t.f32".into(), Value::F32(-1.5e-7)),
        ("t.bool".into(), Value::Bool(true)),
        ("t.str".into(), Value::String("héllo ✓ \u{0}".into())),
        ("t.u64".into(), Value::U64(u64::MAX)),
        ("t.i64".into(), Value::I64(i64::MIN)),
        ("t.f64".into(), Value::F64(std::f64::consts::PI)),
        ("t.a.u8".into(), Value::Array(Array::U8(vec![1, 2, 255]))),
        ("t.a.i8".into(), Value::Array(Array::I8(vec![-1, 2]))),
        ("t.a.u16".into(), Value::Array(Array::U16(vec![1, 65535]))),
        ("t.a.i16".into(), Value::Array(Array::I16(vec![-1, 3]))),
        ("t.a.u32".into(), Value::Array(Array::U32(vec![7, 8, 9]))),
        ("t.a.i32".into(), Value::Array(Array::I32(vec![-7, 8]))),
        (
            "t.a.f32".into(),
            Value::Array(Array::F32(vec![0.5, -0.0, f32::INFINITY])),
        ),
        (
            "t.a.bool".into(),
            Value::Array(Array::Bool(vec![true, false])),
        ),
        (
            "t.a.str".into(),
            Value::Array(Array::String(vec!["a".into(), String::new(), "ü b".into()])),
        ),
        ("t.a.u64".into(), Value::Array(Array::U64(vec![u64::MAX]))),
        (
            "t.a.i64".into(),
            Value::Array(Array::I64(vec![i64::MIN, 0])),
        ),
        ("t.a.f64".into(), Value::Array(Array::F64(vec![1e300]))),
        ("t.a.empty".into(), Value::Array(Array::I32(vec![]))),
        (
            "t.a.nested".into(),
            Value::Array(Array::Array(vec![
                Array::U32(vec![1, 2]),
                Array::String(vec!["x".into()]),
                Array::Array(vec![Array::F32(vec![]), Array::Bool(vec![true])]),
            ])),
        ),
    ]
}

/// Deterministic pseudo-random bytes (xorshift) so tensor data is not all one value.
fn bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s as u8
        })
        .collect()
}

#[test]
fn synthetic_file_round_trips_every_value_and_type() {
    for (version, alignment) in [(3u32, 32u64), (2, 64), (3, 1), (3, 4096)] {
        let mut w = GgufWriter::new();
        w.version(version).alignment(alignment);
        for (k, v) in every_value() {
            w.add_kv(k, v);
        }
        let mut expect = Vec::new();
        for (i, &ty) in strata_quant::types::TYPES.iter().map(|t| &t.ty).enumerate() {
            let dims = [ty.block_size() as u64 * 3, 2, 1 + (i as u64 % 3)];
            let n = dims.iter().product::<u64>() as usize / ty.block_size() * ty.type_size();
            let data = bytes(n, i as u64 + 1);
            w.add_tensor(&format!("t{i}.{ty}"), &dims, ty, &data)
                .unwrap();
            expect.push((format!("t{i}.{ty}"), dims.to_vec(), ty, data));
        }
        w.add_tensor("scalar0d", &[], GgmlType::F32, &1.25f32.to_le_bytes())
            .unwrap();
        w.add_tensor("empty", &[0, 4], GgmlType::F32, &[]).unwrap();
        let raw = w.to_bytes().unwrap();
        let f = GgufFile::from_bytes(raw.clone(), "synthetic").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(f.version(), version);
        assert_eq!(f.alignment(), alignment);
        let mut want = every_value();
        if alignment != 32 {
            want.push(("general.alignment".into(), Value::U32(alignment as u32)));
        }
        assert_eq!(f.metadata(), &want[..]);
        assert_eq!(f.tensors().len(), expect.len() + 2);
        for (name, dims, ty, data) in &expect {
            let t = f.tensor(name).unwrap();
            assert_eq!(&t.dims, dims);
            assert_eq!(t.ty, TensorType::Known(*ty));
            assert_eq!(t.offset % alignment, 0);
            assert_eq!(f.tensor_bytes(name).unwrap(), &data[..]);
            // In memory, tensor data keeps the file's alignment (up to the buffer's 64 bytes).
            let addr = f.tensor_bytes(name).unwrap().as_ptr() as usize;
            assert_eq!(addr % alignment.min(64) as usize, 0, "{name}");
        }
        assert_eq!(f.tensor_bytes("scalar0d").unwrap(), 1.25f32.to_le_bytes());
        let e = f.tensor("empty").unwrap();
        assert_eq!((e.n_elements, e.n_bytes, e.n_rows(), e.ne(3)), (0, 0, 4, 1));
        // Written again from what was read: the same bytes.
        let again = GgufWriter::from_file(&f).unwrap().to_bytes().unwrap();
        assert!(
            again == raw,
            "re-written file differs (v{version}, alignment {alignment})"
        );
    }
}

#[test]
fn getters_convert_integers_that_fit_and_refuse_others() {
    let mut w = GgufWriter::new();
    for (k, v) in every_value() {
        w.add_kv(k, v);
    }
    let f = GgufFile::from_bytes(w.to_bytes().unwrap(), "getters.gguf").unwrap();
    assert_eq!(f.get_u32("t.u8").unwrap(), 200);
    assert_eq!(f.get_u64("t.u32").unwrap(), 4_000_000_000);
    assert_eq!(f.get_i64("t.i32").unwrap(), -2_000_000_000);
    assert_eq!(f.get_f32("t.f64").unwrap(), std::f64::consts::PI as f32);
    assert!(f.get_bool("t.bool").unwrap());
    assert_eq!(f.get_str("general.architecture").unwrap(), "testarch");
    assert_eq!(f.architecture().unwrap(), "testarch");
    assert_eq!(f.get_u32_or("missing.key", 17).unwrap(), 17);
    assert_eq!(f.get_f32_or("missing.key", 0.25).unwrap(), 0.25);
    assert!(!f.get_bool_or("missing.key", false).unwrap());
    assert_eq!(f.get_array_u32("t.a.u32").unwrap(), vec![7, 8, 9]);
    assert_eq!(f.get_array_i32("t.a.u8").unwrap(), vec![1, 2, 255]);
    assert_eq!(f.get_array_u64("t.a.u64").unwrap(), vec![u64::MAX]);
    assert_eq!(f.get_array_f32("t.a.f32").unwrap()[0], 0.5);
    assert_eq!(f.get_array_str("t.a.str").unwrap(), vec!["a", "", "ü b"]);

    let msg = |r: Result<u32, strata_gguf::GgufError>| r.unwrap_err().to_string();
    let m = msg(f.get_u32("t.i32"));
    assert!(
        m.contains("getters.gguf")
            && m.contains("'t.i32'")
            && m.contains("fits in u32")
            && m.contains("offset"),
        "{m}"
    );
    let m = msg(f.get_u32("t.u64"));
    assert!(m.contains("'t.u64'"), "{m}");
    let m = msg(f.get_u32_or("t.str", 1));
    assert!(m.contains("'t.str'") && m.contains("found string"), "{m}");
    let m = msg(f.get_u32("nope"));
    assert!(
        m.contains("getters.gguf") && m.contains("'nope' not found"),
        "{m}"
    );
    let m = f.get_array_u32("t.a.i32").unwrap_err().to_string();
    assert!(m.contains("element 0 = -7"), "{m}");
    let m = f.get_array_str("t.a.u32").unwrap_err().to_string();
    assert!(m.contains("array of u32 (3 items)"), "{m}");
    let m = f.tensor_bytes("no.such.tensor").unwrap_err().to_string();
    assert!(
        m.contains("getters.gguf") && m.contains("'no.such.tensor'"),
        "{m}"
    );
}

#[test]
fn real_files_rewrite_byte_for_byte() {
    let mut files = vec![
        repo().join("fixtures/qwen4exp/tiny/model-f32.gguf"),
        repo().join("fixtures/qwen4exp/tiny/model-bf16.gguf"),
    ];
    for extra in [
        "../shared/fixtures/qwen4exp/small/q2_0-mix.gguf",
        "../shared/fixtures/qwen4exp/small/iq-mix.gguf",
        "../llama-src/llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-qwen2.gguf",
    ] {
        let p = repo().join(extra);
        if p.exists() {
            files.push(p);
        } else {
            eprintln!("skipping {}: not found", p.display());
        }
    }
    for p in files {
        let orig = std::fs::read(&p).unwrap();
        let f = GgufFile::open(&p).unwrap();
        let w = GgufWriter::from_file(&f).unwrap();
        let out = w.to_bytes().unwrap();
        let g = GgufFile::from_bytes(out.clone(), "rewritten").unwrap();
        assert_eq!(g.metadata(), f.metadata(), "{}", p.display());
        assert_eq!(g.tensors(), f.tensors(), "{}", p.display());
        for t in f.tensors() {
            assert_eq!(g.tensor_data(t).unwrap(), f.tensor_data(t).unwrap());
        }
        // gguf-py and ggml lay files out exactly as our writer does.
        assert_eq!(out.len(), orig.len(), "{}", p.display());
        assert!(out == orig, "{}: rewritten bytes differ", p.display());
    }
}
