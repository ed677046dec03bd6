//! The streaming mode: a file whose tensor bytes are written by the caller at the offsets
//! `layout()` gives is byte-identical to the in-memory writer's file for the same tensors.

use strata_gguf::{GgmlType, GgufFile, GgufWriter, Value};

#[test]
fn deferred_tensors_at_layout_offsets_equal_the_in_memory_file() {
    let tensors: [(&str, Vec<u64>, GgmlType); 3] = [
        ("a", vec![32, 3], GgmlType::Q8_0),
        ("b", vec![5], GgmlType::F32),
        ("c", vec![64, 2], GgmlType::Q2_0),
    ];
    let bytes = |i: usize, n: u64| {
        (0..n)
            .map(|j| (j as usize * 7 + i) as u8)
            .collect::<Vec<u8>>()
    };
    let mut whole = GgufWriter::new();
    let mut stream = GgufWriter::new();
    for w in [&mut whole, &mut stream] {
        w.add_kv("general.architecture", Value::String("x".into()));
    }
    let mut sizes = vec![];
    for (i, (name, dims, ty)) in tensors.iter().enumerate() {
        let n = stream.add_tensor_deferred(name, dims, *ty).unwrap();
        sizes.push(n);
        whole.add_tensor(name, dims, *ty, &bytes(i, n)).unwrap();
    }
    assert_eq!(sizes, [102, 20, 36]);
    let want = whole.to_bytes().unwrap();
    let layout = stream.layout().unwrap();
    let mut got = vec![0u8; layout.file_len as usize];
    got[..layout.header.len()].copy_from_slice(&layout.header);
    for (i, &(off, len)) in layout.tensors.iter().enumerate() {
        got[off as usize..(off + len) as usize].copy_from_slice(&bytes(i, len));
    }
    assert_eq!(got, want);
    let f = GgufFile::from_bytes(got, "stream").unwrap();
    assert_eq!(f.tensor_bytes("c").unwrap(), bytes(2, 36).as_slice());
    // A deferred tensor has no bytes for write_to; a wrong shape is refused as before.
    assert!(stream.to_bytes().is_err());
    assert!(stream
        .add_tensor_deferred("d", &[33], GgmlType::Q8_0)
        .is_err());
}
