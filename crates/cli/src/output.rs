//! Everything the CLI writes: stdout (where a reader that goes away — `| head` — ends the
//! command quietly with status 0, never a panic or an error), and output files, which never
//! replace one of the command's inputs, are written to a temporary file in the destination's
//! folder and renamed into place only when complete (so an error or an interrupt leaves no
//! partial file and the old file, if any, intact).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// Stdout's reader went away (EPIPE). Not a failure: `main` ends the command with status 0.
#[derive(Debug)]
pub struct ReaderGone;

impl std::fmt::Display for ReaderGone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("stdout was closed by its reader")
    }
}

impl std::error::Error for ReaderGone {}

/// An error of writing to stdout: [`ReaderGone`] for a closed pipe, else the OS error.
pub fn stdout_error(e: std::io::Error) -> anyhow::Error {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        anyhow::Error::new(ReaderGone)
    } else {
        anyhow::Error::new(e).context("writing to stdout")
    }
}

/// Writes `s` to stdout and flushes it.
pub fn print(s: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(s.as_bytes())
        .and_then(|()| out.flush())
        .map_err(stdout_error)
}

/// `println!` through [`print`]: evaluates to `anyhow::Result<()>`.
#[macro_export]
macro_rules! outln {
    () => { $crate::output::print("\n") };
    ($($t:tt)*) => { $crate::output::print(&format!("{}\n", format_args!($($t)*))) };
}

/// True when `e` (anywhere in its chain) is stdout's reader going away.
pub fn is_reader_gone(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.is::<ReaderGone>()
            || c.downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// Streams generated text to stdout; remembers a write failure (a closed pipe) so the
/// generation loop can stop instead of computing tokens nobody reads.
pub struct Stream {
    failed: Option<std::io::Error>,
}

impl Stream {
    pub fn new() -> Stream {
        Stream { failed: None }
    }

    /// False once stdout is gone.
    pub fn write(&mut self, s: &str) -> bool {
        if self.failed.is_some() {
            return false;
        }
        let mut lock = std::io::stdout().lock();
        if let Err(e) = lock.write_all(s.as_bytes()).and_then(|_| lock.flush()) {
            self.failed = Some(e);
            return false;
        }
        true
    }

    pub fn gone(&self) -> bool {
        self.failed.is_some()
    }

    pub fn finish(self) -> Result<()> {
        match self.failed {
            // A reader that went away early (`| head`) is not an error of ours.
            Some(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
            Some(e) => Err(e).context("writing to stdout"),
            None => Ok(()),
        }
    }
}

/// What a path names, for telling whether two paths are one file: the device and inode of an
/// existing file (links followed, so a symlink or hard link to an input is that input), else
/// the canonical folder joined with the name.
#[derive(PartialEq, Eq, Debug)]
enum Identity {
    Inode(u64, u64),
    Path(PathBuf),
}

fn identity(p: &Path) -> Identity {
    if let Ok(m) = std::fs::metadata(p) {
        return Identity::Inode(m.dev(), m.ino());
    }
    let parent = match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let dir = std::fs::canonicalize(parent).unwrap_or_else(|_| parent.to_path_buf());
    Identity::Path(match p.file_name() {
        Some(n) => dir.join(n),
        None => dir,
    })
}

/// Refuses output paths that are (or link to) an input, or each other, or a folder. Each
/// entry is (the flag that named it, the path).
pub fn check_outputs(outputs: &[(&str, &Path)], inputs: &[(&str, &Path)]) -> Result<()> {
    for (i, &(flag, out)) in outputs.iter().enumerate() {
        if out.is_dir() {
            bail!(
                "{flag} {}: is a folder; give a file path to write",
                out.display()
            );
        }
        let id = identity(out);
        for &(in_flag, input) in inputs {
            if identity(input) == id {
                bail!(
                    "{flag} {} is the input {in_flag} {}: writing it would destroy the input; \
                     choose another output path",
                    out.display(),
                    input.display()
                );
            }
        }
        for &(other_flag, other) in &outputs[..i] {
            if identity(other) == id {
                bail!(
                    "{flag} {} and {other_flag} {} are the same file; give two different paths",
                    out.display(),
                    other.display()
                );
            }
        }
    }
    Ok(())
}

/// An output file being written: a temporary file beside the destination, renamed onto it by
/// [`OutputFile::commit`]; dropped uncommitted (an error) or interrupted, it is removed.
pub struct OutputFile {
    dest: PathBuf,
    tmp: PathBuf,
    writer: Option<BufWriter<File>>,
}

impl OutputFile {
    /// Creates the temporary file for `dest` (check `dest` with [`check_outputs`] first).
    pub fn create(dest: &Path) -> Result<OutputFile> {
        let mut f = OutputFile::reserve(dest)?;
        let file = File::create(&f.tmp).with_context(|| format!("creating {}", f.tmp.display()))?;
        f.writer = Some(BufWriter::with_capacity(1 << 20, file));
        Ok(f)
    }

    /// Only the temporary path, for writers that take a path; it is removed on error or
    /// interrupt all the same.
    pub fn reserve(dest: &Path) -> Result<OutputFile> {
        let name = dest
            .file_name()
            .with_context(|| format!("{}: not a file path", dest.display()))?;
        let dir = match dest.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        if !dir.is_dir() {
            bail!(
                "{}: the folder {} does not exist",
                dest.display(),
                dir.display()
            );
        }
        let mut prefix = std::ffi::OsString::from(".");
        prefix.push(name);
        prefix.push(".strata-tmp-");
        remove_stale(&dir, &prefix.to_string_lossy());
        let mut tmp_name = prefix;
        tmp_name.push(std::process::id().to_string());
        let tmp = dir.join(tmp_name);
        crate::signals::remove_on_interrupt(&tmp);
        Ok(OutputFile {
            dest: dest.to_path_buf(),
            tmp,
            writer: None,
        })
    }

    pub fn tmp_path(&self) -> &Path {
        &self.tmp
    }

    pub fn writer(&mut self) -> &mut BufWriter<File> {
        self.writer
            .as_mut()
            .expect("OutputFile::writer on a file made by reserve")
    }

    /// Flushes the file and renames it onto the destination.
    pub fn commit(mut self) -> Result<()> {
        if let Some(w) = self.writer.take() {
            let file = w
                .into_inner()
                .map_err(|e| e.into_error())
                .with_context(|| format!("writing {}", self.tmp.display()))?;
            file.sync_all()
                .with_context(|| format!("writing {}", self.tmp.display()))?;
        }
        std::fs::rename(&self.tmp, &self.dest).with_context(|| {
            format!("moving {} onto {}", self.tmp.display(), self.dest.display())
        })?;
        crate::signals::forget_path(&self.tmp);
        self.tmp = PathBuf::new();
        Ok(())
    }
}

/// Temporaries for the same destination left by a process that no longer exists (one killed
/// with SIGKILL, which nothing can clean up after).
fn remove_stale(dir: &Path, prefix: &str) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(prefix))
            .and_then(|p| p.parse::<libc::pid_t>().ok())
        else {
            continue;
        };
        // SAFETY: signal 0 only asks whether the process exists.
        let gone = unsafe { libc::kill(pid, 0) } != 0
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if gone {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

impl Drop for OutputFile {
    fn drop(&mut self) {
        if !self.tmp.as_os_str().is_empty() {
            self.writer = None;
            let _ = std::fs::remove_file(&self.tmp);
            crate::signals::forget_path(&self.tmp);
        }
    }
}

/// Refuses an input path that is missing or a folder, with the flag that named it; a folder's
/// `.gguf` files are listed, since the usual mistake is giving the folder a model sits in.
pub fn check_input(flag: &str, p: &Path) -> Result<()> {
    match std::fs::metadata(p) {
        Ok(m) if m.is_dir() => {
            let mut ggufs: Vec<String> = std::fs::read_dir(p)
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".gguf"))
                .collect();
            ggufs.sort();
            let hint = match ggufs.len() {
                0 => String::new(),
                _ => format!(" (it holds {})", ggufs.join(", ")),
            };
            bail!("{flag} {}: is a folder; give a file{hint}", p.display())
        }
        Ok(_) => Ok(()),
        Err(e) => Err(anyhow::Error::new(e).context(format!("{flag} {}", p.display()))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("strata-output-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_dead_process_temporary_is_removed_and_a_live_one_kept() {
        let d = scratch("stale");
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let stale = d.join(format!(".out.bin.strata-tmp-{dead}"));
        let live = d.join(".out.bin.strata-tmp-1"); // init never goes away
        let other = d.join(format!(".other.bin.strata-tmp-{dead}"));
        for p in [&stale, &live, &other] {
            std::fs::write(p, b"x").unwrap();
        }
        let f = OutputFile::create(&d.join("out.bin")).unwrap();
        assert!(!stale.exists() && live.exists() && other.exists());
        drop(f);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_closed_pipe_is_a_quiet_end_and_other_write_errors_are_errors() {
        let gone = stdout_error(std::io::Error::from(std::io::ErrorKind::BrokenPipe));
        assert!(is_reader_gone(&gone));
        assert!(is_reader_gone(&gone.context("printing the table")));
        let full = stdout_error(std::io::Error::from_raw_os_error(libc::ENOSPC));
        assert!(!is_reader_gone(&full));
        assert!(
            format!("{full:#}").starts_with("writing to stdout: "),
            "{full:#}"
        );
    }

    #[test]
    fn an_output_that_is_or_links_to_an_input_is_refused() {
        let d = scratch("links");
        let input = d.join("in.gguf");
        std::fs::write(&input, b"data").unwrap();
        std::os::unix::fs::symlink(&input, d.join("sym")).unwrap();
        std::fs::hard_link(&input, d.join("hard")).unwrap();
        let dotted = d.join("sub/../in.gguf");
        std::fs::create_dir_all(d.join("sub")).unwrap();
        for out in [input.clone(), d.join("sym"), d.join("hard"), dotted] {
            let e = check_outputs(&[("--out", &out)], &[("-m", &input)]).unwrap_err();
            assert!(e.to_string().contains("destroy the input"), "{e}");
        }
        check_outputs(&[("--out", &d.join("new.npy"))], &[("-m", &input)]).unwrap();
        // Two outputs onto one new path.
        let x = d.join("x.st");
        let e = check_outputs(&[("--out", &x), ("--mtp-out", &d.join("./x.st"))], &[]).unwrap_err();
        assert!(e.to_string().contains("same file"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn an_uncommitted_output_leaves_nothing_and_the_old_file_intact() {
        let d = scratch("commit");
        let dest = d.join("out.bin");
        std::fs::write(&dest, b"old").unwrap();
        {
            let mut f = OutputFile::create(&dest).unwrap();
            f.writer().write_all(b"partial").unwrap();
            // dropped without commit: an error part-way
        }
        assert_eq!(std::fs::read(&dest).unwrap(), b"old");
        assert_eq!(
            std::fs::read_dir(&d).unwrap().count(),
            1,
            "a temporary was left"
        );
        let mut f = OutputFile::create(&dest).unwrap();
        f.writer().write_all(b"new").unwrap();
        f.commit().unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), b"new");
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 1);
        std::fs::remove_dir_all(&d).unwrap();
    }
}
