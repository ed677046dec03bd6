//! The variant registry: every catalogue op has named variants (`baseline`, `optimized`, and
//! any experimental ones), and one run-time selection shared by all backends.
//!
//! Selection order for an op: an API override ([`select`]), then the `STRATA_KERNELS`
//! environment variable (`op=variant,op=variant`, `*=variant` for every op), then `optimized`.
//! A backend looks the chosen name up in its own table (the CPU functions in [`Op`], the CUDA
//! kernels in `strata-cuda`), so a name valid for one backend is valid for all.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock, RwLock};

use super::KernelError;

pub const BASELINE: &str = "baseline";
pub const OPTIMIZED: &str = "optimized";

/// Every op of the catalogue and the variant names every backend provides for it.
pub const CATALOGUE: &[(&str, &[&str])] = &[
    ("rms_xprep", &[BASELINE, OPTIMIZED]),
    ("combine_gnorm", &[BASELINE, OPTIMIZED]),
    ("xprep", &[BASELINE, OPTIMIZED]),
    ("embed", &[BASELINE, OPTIMIZED]),
    ("slop_pen", &[BASELINE, OPTIMIZED]),
    ("pick", &[BASELINE, OPTIMIZED]),
    ("route", &[BASELINE, OPTIMIZED]),
    ("gemv", &[BASELINE, OPTIMIZED]),
];

/// One named implementation of an op.
pub struct Variant<F: 'static> {
    pub name: &'static str,
    pub f: F,
}

/// An op's CPU implementations, by variant name.
pub struct Op<F: 'static> {
    pub name: &'static str,
    pub variants: &'static [Variant<F>],
}

impl<F: Copy> Op<F> {
    /// The variant called `name`.
    pub fn variant(&self, name: &str) -> Result<F, KernelError> {
        self.variants
            .iter()
            .find(|v| v.name == name)
            .map(|v| v.f)
            .ok_or_else(|| KernelError::UnknownVariant {
                op: self.name.to_string(),
                variant: name.to_string(),
                origin: "the CPU registry",
                known: self
                    .variants
                    .iter()
                    .map(|v| v.name)
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }

    pub fn baseline(&self) -> F {
        self.variants[0].f
    }

    /// The variant chosen by [`selected_variant`] (counted in [`use_count`]: a live path that
    /// asks here is one that `STRATA_KERNELS` switches).
    pub fn selected(&self) -> Result<F, KernelError> {
        let name = selected_variant(self.name)?;
        let f = self.variant(&name)?;
        let mut uses = use_counts().lock().unwrap_or_else(|p| p.into_inner());
        *uses.entry((self.name, name)).or_insert(0) += 1;
        Ok(f)
    }
}

fn known_ops() -> String {
    CATALOGUE
        .iter()
        .map(|(o, _)| *o)
        .collect::<Vec<_>>()
        .join(", ")
}

fn check(op: &str, variant: &str, origin: &'static str) -> Result<(), KernelError> {
    if op == "*" {
        // A wildcard must name a variant every op has.
        if CATALOGUE.iter().all(|(_, vs)| vs.contains(&variant)) {
            return Ok(());
        }
        return Err(KernelError::UnknownVariant {
            op: op.to_string(),
            variant: variant.to_string(),
            origin,
            known: format!("{BASELINE}, {OPTIMIZED}"),
        });
    }
    let (_, vs) =
        CATALOGUE
            .iter()
            .find(|(o, _)| *o == op)
            .ok_or_else(|| KernelError::UnknownOp {
                op: op.to_string(),
                origin,
                known: known_ops(),
            })?;
    if !vs.contains(&variant) {
        return Err(KernelError::UnknownVariant {
            op: op.to_string(),
            variant: variant.to_string(),
            origin,
            known: vs.join(", "),
        });
    }
    Ok(())
}

/// Parses `op=variant[,op=variant...]` (whitespace around entries ignored, empty entries
/// skipped), checking every name against [`CATALOGUE`].
pub fn parse_selection(
    spec: &str,
    origin: &'static str,
) -> Result<Vec<(String, String)>, KernelError> {
    let mut out = Vec::new();
    for entry in spec.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let (op, variant) = entry
            .split_once('=')
            .map(|(a, b)| (a.trim(), b.trim()))
            .filter(|(a, b)| !a.is_empty() && !b.is_empty())
            .ok_or_else(|| KernelError::Malformed {
                entry: entry.to_string(),
                origin,
            })?;
        check(op, variant, origin)?;
        out.push((op.to_string(), variant.to_string()));
    }
    Ok(out)
}

fn use_counts() -> &'static Mutex<HashMap<(&'static str, String), u64>> {
    static U: OnceLock<Mutex<HashMap<(&'static str, String), u64>>> = OnceLock::new();
    U.get_or_init(|| Mutex::new(HashMap::new()))
}

/// How many times this process ran `op`'s `variant` through [`Op::selected`].
pub fn use_count(op: &str, variant: &str) -> u64 {
    let uses = use_counts().lock().unwrap_or_else(|p| p.into_inner());
    uses.iter()
        .filter(|((o, v), _)| *o == op && v == variant)
        .map(|(_, n)| *n)
        .sum()
}

fn overrides() -> &'static RwLock<HashMap<String, String>> {
    static O: OnceLock<RwLock<HashMap<String, String>>> = OnceLock::new();
    O.get_or_init(|| RwLock::new(HashMap::new()))
}

fn env_selection() -> Result<&'static HashMap<String, String>, KernelError> {
    static E: OnceLock<Result<HashMap<String, String>, KernelError>> = OnceLock::new();
    E.get_or_init(|| {
        let spec = std::env::var("STRATA_KERNELS").unwrap_or_default();
        Ok(parse_selection(&spec, "STRATA_KERNELS")?
            .into_iter()
            .collect())
    })
    .as_ref()
    .map_err(Clone::clone)
}

impl Clone for KernelError {
    fn clone(&self) -> Self {
        match self {
            KernelError::Length {
                kernel,
                what,
                got,
                expected,
            } => KernelError::Length {
                kernel,
                what,
                got: *got,
                expected: *expected,
            },
            KernelError::Invalid { kernel, what } => KernelError::Invalid {
                kernel,
                what: what.clone(),
            },
            KernelError::Quant { kernel, source } => KernelError::Invalid {
                kernel,
                what: source.to_string(),
            },
            KernelError::UnknownOp { op, origin, known } => KernelError::UnknownOp {
                op: op.clone(),
                origin,
                known: known.clone(),
            },
            KernelError::UnknownVariant {
                op,
                variant,
                origin,
                known,
            } => KernelError::UnknownVariant {
                op: op.clone(),
                variant: variant.clone(),
                origin,
                known: known.clone(),
            },
            KernelError::Malformed { entry, origin } => KernelError::Malformed {
                entry: entry.clone(),
                origin,
            },
        }
    }
}

/// Chooses `variant` for `op` (or for every op with `op = "*"`) for the rest of the process,
/// over `STRATA_KERNELS`.
pub fn select(op: &str, variant: &str) -> Result<(), KernelError> {
    check(op, variant, "the API")?;
    let mut o = overrides().write().unwrap_or_else(|p| p.into_inner());
    if op == "*" {
        o.clear();
    }
    o.insert(op.to_string(), variant.to_string());
    Ok(())
}

/// Applies a whole `op=variant,...` selection through [`select`].
pub fn select_spec(spec: &str) -> Result<(), KernelError> {
    for (op, v) in parse_selection(spec, "the API")? {
        select(&op, &v)?;
    }
    Ok(())
}

/// Drops every API override (the environment and the default apply again).
pub fn clear_selection() {
    overrides()
        .write()
        .unwrap_or_else(|p| p.into_inner())
        .clear();
}

/// The variant name in force for `op`.
pub fn selected_variant(op: &str) -> Result<String, KernelError> {
    check(op, BASELINE, "the API")?;
    {
        let o = overrides().read().unwrap_or_else(|p| p.into_inner());
        if let Some(v) = o.get(op).or_else(|| o.get("*")) {
            return Ok(v.clone());
        }
    }
    let env = env_selection()?;
    Ok(env
        .get(op)
        .or_else(|| env.get("*"))
        .cloned()
        .unwrap_or_else(|| OPTIMIZED.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_checks_names() {
        let v = parse_selection(" rms_xprep=baseline, pick=optimized ,", "test").unwrap();
        assert_eq!(v.len(), 2);
        assert_eq!(v[0], ("rms_xprep".into(), "baseline".into()));
        assert!(matches!(
            parse_selection("nope=baseline", "test"),
            Err(KernelError::UnknownOp { .. })
        ));
        assert!(matches!(
            parse_selection("pick=fast", "test"),
            Err(KernelError::UnknownVariant { .. })
        ));
        assert!(matches!(
            parse_selection("pick", "test"),
            Err(KernelError::Malformed { .. })
        ));
        assert!(parse_selection("*=baseline", "test").is_ok());
    }

    #[test]
    fn api_override_wins_and_clears() {
        // Only this test touches the "gemv"/"route" overrides.
        select("gemv", BASELINE).unwrap();
        assert_eq!(selected_variant("gemv").unwrap(), BASELINE);
        assert!(select("gemv", "bogus").is_err());
        assert_eq!(selected_variant("gemv").unwrap(), BASELINE);
        assert!(selected_variant("bogus").is_err());
    }
}
