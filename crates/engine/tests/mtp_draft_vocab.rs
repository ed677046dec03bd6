//! Draft vocabulary files: the raw little-endian i32 format, its errors, and the frequency
//! builder's choice (most frequent first, ties to the lower id, required ids always in).

use strata_engine::speculative::DraftVocab;

fn write(tag: &str, bytes: &[u8]) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("strata-dv-{tag}-{}.bin", std::process::id()));
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn file_round_trip_and_inverse_map() {
    let v = DraftVocab::new(vec![5, 0, 299, 17], 320, "test").unwrap();
    let p = write("ok", &v.to_bytes());
    let back = DraftVocab::load(&p, 320).unwrap();
    std::fs::remove_file(&p).ok();
    assert_eq!(back, v);
    assert_eq!(back.ids(), &[5, 0, 299, 17]);
    assert_eq!(back.inverse(299), 2);
    assert_eq!(back.inverse(6), -1);
    assert_eq!(back.inverse(100_000), -1);
    assert_eq!(v.to_bytes()[..8], [5, 0, 0, 0, 0, 0, 0, 0]);
}

#[test]
fn bad_files_are_named_errors() {
    let cases: [(&str, Vec<u8>, &str); 5] = [
        ("ragged", vec![1, 0, 0, 0, 2, 0], "6 bytes"),
        (
            "negative",
            [3i32, -1].iter().flat_map(|v| v.to_le_bytes()).collect(),
            "entry 1 (offset 4) is -1",
        ),
        (
            "range",
            [3i32, 320].iter().flat_map(|v| v.to_le_bytes()).collect(),
            "token 320, outside",
        ),
        (
            "dup",
            [3i32, 9, 3].iter().flat_map(|v| v.to_le_bytes()).collect(),
            "token 3 appears twice",
        ),
        ("empty", vec![], "empty"),
    ];
    for (tag, bytes, want) in cases {
        let p = write(tag, &bytes);
        let err = DraftVocab::load(&p, 320).unwrap_err().to_string();
        std::fs::remove_file(&p).ok();
        assert!(err.contains(want), "{tag}: {err}");
        assert!(
            err.contains(&format!("strata-dv-{tag}")),
            "{tag}: names the file: {err}"
        );
    }
    let err = DraftVocab::load("/nonexistent/dv.bin", 320)
        .unwrap_err()
        .to_string();
    assert!(err.contains("/nonexistent/dv.bin"), "{err}");
}

#[test]
fn frequency_builder_keeps_the_most_frequent() {
    let mut counts = vec![0u64; 10];
    for (id, c) in [(7, 50), (2, 50), (4, 10), (9, 3), (1, 3)] {
        counts[id] = c;
    }
    // Size 4 with EOS 0 required: 0, then 2 and 7 (tied, both in), then 4.
    let v = DraftVocab::by_frequency(&counts, 4, &[0]).unwrap();
    assert_eq!(v.ids(), &[0, 2, 4, 7]);
    // Ties at the cut go to the lower id: 1 beats 9 (both counted 3).
    let v = DraftVocab::by_frequency(&counts, 4, &[]).unwrap();
    assert_eq!(v.ids(), &[1, 2, 4, 7]);
    assert_eq!(
        DraftVocab::by_frequency(&counts, 100, &[]).unwrap().len(),
        10
    );
}
