//! Comparisons: bitwise (naming the first differing element) and within a tolerance.

/// `BITWISE PASS` when every element has the same bits, else the first difference.
pub fn bitwise_f32(a: &[f32], b: &[f32]) -> Result<(), String> {
    if a.len() != b.len() {
        return Err(format!("lengths differ: {} vs {}", a.len(), b.len()));
    }
    match a
        .iter()
        .zip(b)
        .position(|(x, y)| x.to_bits() != y.to_bits())
    {
        None => Ok(()),
        Some(i) => Err(format!(
            "element {i}: {:e} ({:#010x}) vs {:e} ({:#010x})",
            a[i],
            a[i].to_bits(),
            b[i],
            b[i].to_bits()
        )),
    }
}

pub fn bitwise_bytes(a: &[u8], b: &[u8]) -> Result<(), String> {
    if a.len() != b.len() {
        return Err(format!("lengths differ: {} vs {}", a.len(), b.len()));
    }
    match a.iter().zip(b).position(|(x, y)| x != y) {
        None => Ok(()),
        Some(i) => Err(format!("byte {i}: {:#04x} vs {:#04x}", a[i], b[i])),
    }
}

pub fn bitwise_i32(a: &[i32], b: &[i32]) -> Result<(), String> {
    if a.len() != b.len() {
        return Err(format!("lengths differ: {} vs {}", a.len(), b.len()));
    }
    match a.iter().zip(b).position(|(x, y)| x != y) {
        None => Ok(()),
        Some(i) => Err(format!("element {i}: {} vs {}", a[i], b[i])),
    }
}

/// `|got − want| ≤ tol[i]` everywhere (NaN never passes); returns the largest error relative
/// to its tolerance.
pub fn within(got: &[f32], want: &[f32], tol: &[f64]) -> Result<f64, String> {
    if got.len() != want.len() || tol.len() != want.len() {
        return Err(format!(
            "lengths differ: {} / {} / {}",
            got.len(),
            want.len(),
            tol.len()
        ));
    }
    let mut worst = 0f64;
    for i in 0..got.len() {
        let (g, w) = (got[i] as f64, want[i] as f64);
        let e = (g - w).abs();
        let ok = e
            .partial_cmp(&tol[i])
            .is_some_and(|o| o != std::cmp::Ordering::Greater);
        if !ok && g != w {
            return Err(format!(
                "element {i}: {g:e} vs reference {w:e} (tolerance {:e})",
                tol[i]
            ));
        }
        if tol[i] > 0.0 {
            worst = worst.max(e / tol[i]);
        }
    }
    Ok(worst)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_first_difference() {
        assert!(bitwise_f32(&[1.0, 0.0], &[1.0, 0.0]).is_ok());
        let e = bitwise_f32(&[1.0, 0.0], &[1.0, -0.0]).unwrap_err();
        assert!(e.starts_with("element 1"), "{e}");
        assert!(bitwise_bytes(&[1, 2], &[1, 3])
            .unwrap_err()
            .starts_with("byte 1"));
        assert!(within(&[1.0, f32::NAN], &[1.0, 1.0], &[0.1, 0.1]).is_err());
        assert!(within(&[1.05], &[1.0], &[0.1]).is_ok());
        assert!(within(&[1.2], &[1.0], &[0.1]).is_err());
    }
}
