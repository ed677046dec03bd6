//! cargo-fuzz target: every input goes through the reader, every accessor and, when accepted,
//! a write → read cycle (`strata_gguf::fuzzing::check`). Seeds: `cargo run --release -p
//! strata-gguf --example fuzz_seeds -- fuzz/corpus/gguf_read`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    strata_gguf::fuzzing::check(data);
});
