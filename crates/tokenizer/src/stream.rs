//! Streaming detokenization: tokens arrive one at a time and a byte-level token can end in the
//! middle of a UTF-8 sequence (an emoji is often three or four tokens), so bytes are held back
//! until they complete a character. What is emitted is always valid UTF-8, and the
//! concatenation of everything emitted equals the lossy decoding of all the bytes.

use crate::{Result, Tokenizer};

/// Turns a stream of token ids into text pieces. It holds no reference to the tokenizer, so it
/// can live next to one in a struct.
#[derive(Debug, Default, Clone)]
pub struct StreamDecoder {
    pending: Vec<u8>,
    special: bool,
}

impl StreamDecoder {
    /// `special`: print control tokens (as `Tokenizer::token_to_piece` does).
    pub fn new(special: bool) -> StreamDecoder {
        StreamDecoder {
            pending: Vec::new(),
            special,
        }
    }

    /// Adds one token; returns the text that became complete (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        let piece = tok.token_to_piece(id, self.special)?;
        Ok(self.push_bytes(piece))
    }

    /// Adds raw bytes; returns the text that became complete.
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // The first `valid_up_to` bytes are valid UTF-8 by definition.
                    out.push_str(std::str::from_utf8(&self.pending[..valid]).unwrap_or_default());
                    match e.error_len() {
                        // An unfinished sequence at the end: wait for more bytes.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        // Bytes that can never become a character.
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }

    /// Whether bytes are being held back.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Ends the stream: held-back bytes (an unfinished character) become U+FFFD.
    pub fn flush(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

#[cfg(test)]
mod tests {
    use super::StreamDecoder;

    #[test]
    fn holds_back_partial_characters() {
        let mut d = StreamDecoder::new(false);
        let crab = "🦀".as_bytes();
        assert_eq!(d.push_bytes(b"a"), "a");
        assert_eq!(d.push_bytes(&crab[..1]), "");
        assert_eq!(d.push_bytes(&crab[1..3]), "");
        assert!(d.has_pending());
        assert_eq!(d.push_bytes(&crab[3..]), "🦀");
        assert_eq!(d.push_bytes(b"\xFFb"), "\u{FFFD}b");
        assert_eq!(d.push_bytes(&crab[..2]), "");
        assert_eq!(d.flush(), "\u{FFFD}");
        assert!(!d.has_pending());
    }
}
