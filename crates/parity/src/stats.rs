//! Medians and paired, interleaved timing on the host clock (the CPU backend).

use std::time::Instant;

pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// Times `a` and `b` alternately (A B, then B A, …) `reps` times each after one warm-up call
/// of each; returns their medians in microseconds.
pub fn paired<E>(
    reps: usize,
    a: &mut dyn FnMut() -> Result<(), E>,
    b: &mut dyn FnMut() -> Result<(), E>,
) -> Result<(f64, f64), E> {
    a()?;
    b()?;
    let mut ta = Vec::with_capacity(reps);
    let mut tb = Vec::with_capacity(reps);
    let time = |f: &mut dyn FnMut() -> Result<(), E>, out: &mut Vec<f64>| -> Result<(), E> {
        let t = Instant::now();
        f()?;
        out.push(t.elapsed().as_secs_f64() * 1e6);
        Ok(())
    };
    for i in 0..reps {
        if i % 2 == 0 {
            time(a, &mut ta)?;
            time(b, &mut tb)?;
        } else {
            time(b, &mut tb)?;
            time(a, &mut ta)?;
        }
    }
    Ok((median(&mut ta), median(&mut tb)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_odd_even() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&mut []).is_nan());
    }
}
