//! Streaming detokenization never emits broken UTF-8 and adds up to the whole decoding: for
//! random byte chunkings and random token sequences (which split characters anywhere), the
//! concatenated output equals `String::from_utf8_lossy` of all the bytes.

use std::path::PathBuf;
use std::sync::OnceLock;

use proptest::prelude::*;
use strata_gguf::GgufFile;
use strata_tokenizer::{StreamDecoder, Tokenizer};

fn qwen() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../fixtures/tokenizer/qwen25-coder-vocab.gguf");
        Tokenizer::from_gguf(&GgufFile::open(p).unwrap()).unwrap()
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn byte_chunks_add_up(data in proptest::collection::vec(any::<u8>(), 0..64), cuts in proptest::collection::vec(0usize..64, 0..8)) {
        let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(data.len())).collect();
        cuts.sort_unstable();
        let mut d = StreamDecoder::new(false);
        let mut out = String::new();
        let mut prev = 0;
        for c in cuts.into_iter().chain([data.len()]) {
            out.push_str(&d.push_bytes(&data[prev..c]));
            prev = c;
        }
        out.push_str(&d.flush());
        prop_assert_eq!(out, String::from_utf8_lossy(&data).into_owned());
    }

    #[test]
    fn token_streams_add_up(ids in proptest::collection::vec(0u32..151_936, 0..40)) {
        let tok = qwen();
        let mut d = StreamDecoder::new(true);
        let mut out = String::new();
        for &id in &ids {
            out.push_str(&d.push(tok, id).unwrap());
        }
        out.push_str(&d.flush());
        prop_assert_eq!(out, tok.decode(&ids, true).unwrap());
    }
}
