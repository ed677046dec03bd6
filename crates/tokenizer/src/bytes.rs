//! GPT-2's byte ↔ character map: byte-level BPE vocabularies spell every byte as one printable
//! code point (printable Latin-1 bytes as themselves, the rest shifted to U+0100..), so merges
//! and tokens are plain strings.

use std::sync::OnceLock;

struct Maps {
    to_char: [char; 256],
    /// Indexed by code point for U+0000..U+0143, the only range the map uses.
    to_byte: [i16; 0x144],
}

fn maps() -> &'static Maps {
    static M: OnceLock<Maps> = OnceLock::new();
    M.get_or_init(|| {
        let mut to_char = ['\0'; 256];
        let mut to_byte = [-1i16; 0x144];
        let kept = |b: u32| {
            (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b)
        };
        let mut shifted = 0u32;
        for b in 0u32..256 {
            let cp = if kept(b) {
                b
            } else {
                shifted += 1;
                255 + shifted
            };
            // cp < 0x144 by construction: 188 bytes keep their value, 68 go to 0x100..0x143.
            to_char[b as usize] = char::from_u32(cp).unwrap_or('\u{FFFD}');
            if let Some(slot) = to_byte.get_mut(cp as usize) {
                *slot = b as i16;
            }
        }
        Maps { to_char, to_byte }
    })
}

/// Appends the byte-level spelling of `bytes` to `out`.
pub(crate) fn encode_into(bytes: &[u8], out: &mut String) {
    for &b in bytes {
        out.push(byte_to_char(b));
    }
}

/// The byte a character of the byte-level alphabet stands for.
pub(crate) fn char_to_byte(c: char) -> Option<u8> {
    let m = maps();
    m.to_byte
        .get(c as usize)
        .and_then(|&b| u8::try_from(b).ok())
}

/// The byte-level spelling of one byte.
pub(crate) fn byte_to_char(b: u8) -> char {
    maps().to_char[b as usize]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_spellings_and_round_trip() {
        assert_eq!(byte_to_char(b'!'), '!');
        assert_eq!(byte_to_char(b' '), 'Ġ');
        assert_eq!(byte_to_char(b'\n'), 'Ċ');
        assert_eq!(byte_to_char(0), 'Ā');
        for b in 0..=255u8 {
            assert_eq!(char_to_byte(byte_to_char(b)), Some(b));
        }
        assert_eq!(char_to_byte('a'), Some(b'a'));
        assert_eq!(char_to_byte('Ń'), Some(0xAD));
        assert_eq!(char_to_byte('中'), None);
    }
}
