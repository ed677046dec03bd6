//! The variant registry: every catalogue op has named variants (`baseline`, `optimized`, and
//! any experimental ones), and one run-time selection shared by all backends.
//!
//! Selection order for an op: an API override ([`select`]), then the `STRATA_KERNELS`
//! environment variable (`op=variant,op=variant`, `*=variant` for every op), then `optimized`.
//! A backend looks the chosen name up in its own table (the CPU functions in [`Op`], the CUDA
//! kernels in `strata-cuda`), so a name valid for one backend is valid for all.
//!
//! A backend resolves its choice once ([`Op::resolve`], at creation), never per call: the hot
//! path holds a [`Chosen`] function and counts its calls in a relaxed atomic. [`lookups`]
//! counts resolutions, so a test can show that a forward pass makes none.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock, RwLock};

use super::KernelError;

pub const BASELINE: &str = "baseline";
pub const OPTIMIZED: &str = "optimized";

/// Every op of the catalogue and the variant names every backend provides for it.
pub const CATALOGUE: &[(&str, &[&str])] = &[
    ("rms_xprep", &[BASELINE, OPTIMIZED]),
    ("combine_gnorm", &[BASELINE, OPTIMIZED]),
    ("xprep", &[BASELINE, OPTIMIZED]),
    // The CPU's pairings outside the four formats above (F16, Q8_1): no GPU kernel takes them.
    ("xprep_pair", &[BASELINE, OPTIMIZED]),
    ("embed", &[BASELINE, OPTIMIZED]),
    ("slop_pen", &[BASELINE, OPTIMIZED]),
    ("pick", &[BASELINE, OPTIMIZED]),
    ("route", &[BASELINE, OPTIMIZED]),
    ("gemv", &[BASELINE, OPTIMIZED]),
    // The core RMS norm (the CPU's `rms_norm`): `baseline` and `optimized` are its live,
    // sequential summation order; `lanes` is the canonical 256-lane order of [`super::norm`]
    // (a GPU block's), which gives other bits: a named oracle, not a same-bits variant.
    (
        "rms_norm",
        &[BASELINE, OPTIMIZED, super::norm::LANES_VARIANT],
    ),
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

    /// The variant chosen by [`selected_variant`], resolved once: what a backend keeps at
    /// creation and calls through [`Chosen::get`] (counted in [`use_count`]: a live path that
    /// holds one is one that `STRATA_KERNELS` switches).
    pub fn resolve(&self) -> Result<Chosen<F>, KernelError> {
        let name = selected_variant(self.name)?;
        let v = self
            .variants
            .iter()
            .find(|v| v.name == name)
            .ok_or_else(|| KernelError::UnknownVariant {
                op: self.name.to_string(),
                variant: name.clone(),
                origin: "the CPU registry",
                known: self
                    .variants
                    .iter()
                    .map(|v| v.name)
                    .collect::<Vec<_>>()
                    .join(", "),
            })?;
        Ok(Chosen {
            f: v.f,
            op: self.name,
            name: v.name,
            uses: counter(self.name, v.name),
        })
    }

    /// [`Op::resolve`] and one call's worth of [`Chosen::get`] (for a path that is not hot).
    pub fn selected(&self) -> Result<F, KernelError> {
        Ok(self.resolve()?.get())
    }
}

/// An op's variant as a backend holds it after [`Op::resolve`].
#[derive(Clone, Copy)]
pub struct Chosen<F: 'static> {
    f: F,
    pub op: &'static str,
    pub name: &'static str,
    uses: &'static AtomicU64,
}

impl<F: Copy> Chosen<F> {
    /// The function, counting the use (one relaxed atomic add: no lookup, no lock).
    #[inline]
    pub fn get(&self) -> F {
        self.uses.fetch_add(1, Ordering::Relaxed);
        self.f
    }
}

impl<F> std::fmt::Debug for Chosen<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}={}", self.op, self.name)
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

type Counters = Mutex<HashMap<(&'static str, &'static str), &'static AtomicU64>>;

fn use_counts() -> &'static Counters {
    static U: OnceLock<Counters> = OnceLock::new();
    U.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The use counter of `op`'s `variant` (one per pair for the process: the map holds at most
/// the catalogue's pairs, so the leak is bounded).
fn counter(op: &'static str, variant: &'static str) -> &'static AtomicU64 {
    let mut uses = use_counts().lock().unwrap_or_else(|p| p.into_inner());
    uses.entry((op, variant))
        .or_insert_with(|| Box::leak(Box::new(AtomicU64::new(0))))
}

/// How many times this process called `op`'s `variant` through a [`Chosen`].
pub fn use_count(op: &str, variant: &str) -> u64 {
    let uses = use_counts().lock().unwrap_or_else(|p| p.into_inner());
    uses.iter()
        .filter(|((o, v), _)| *o == op && *v == variant)
        .map(|(_, n)| n.load(Ordering::Relaxed))
        .sum()
}

static LOOKUPS: AtomicU64 = AtomicU64::new(0);

/// How many times this process looked a selection up ([`selected_variant`], which every
/// [`Op::resolve`] calls): a hot path that resolved its variants up front adds none.
pub fn lookups() -> u64 {
    LOOKUPS.load(Ordering::Relaxed)
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
    LOOKUPS.fetch_add(1, Ordering::Relaxed);
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
