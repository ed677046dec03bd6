//! Interrupts: what the process must undo when SIGINT, SIGTERM or SIGHUP ends it — the temporary
//! files and folders it is writing (so no partial output is left behind) and the child processes
//! it started (so no `pip` keeps running after a killed `strata fetch`).
//!
//! The signals are blocked in every thread (the mask is set in `main` before any other thread
//! exists, and threads inherit it) and one thread takes them with `sigwait`, so the clean-up runs
//! as ordinary code, not inside an async-signal handler. Children start with an empty mask
//! (the standard library resets it in `Command::spawn`).

use std::path::{Path, PathBuf};
use std::sync::Mutex;

struct Cleanup {
    paths: Vec<PathBuf>,
    /// Process-group leaders (each child runs in its own group, so the whole group is ended).
    children: Vec<u32>,
}

static CLEANUP: Mutex<Cleanup> = Mutex::new(Cleanup {
    paths: Vec::new(),
    children: Vec::new(),
});

const SIGNALS: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

fn signal_set() -> libc::sigset_t {
    // SAFETY: sigemptyset/sigaddset only write the set they are given.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in SIGNALS {
            libc::sigaddset(&mut set, s);
        }
        set
    }
}

/// Blocks the signals in this thread (and so in every thread started after) and starts the
/// thread that handles them. Call first thing in `main`.
pub fn install() {
    let set = signal_set();
    // SAFETY: `set` is a valid signal set; the old mask is not needed.
    let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if rc != 0 {
        return; // signals keep their default action: nothing is cleaned, nothing breaks
    }
    let spawned = std::thread::Builder::new()
        .name("strata-signals".into())
        .spawn(move || loop {
            let mut sig: libc::c_int = 0;
            // SAFETY: `set` and `sig` are valid for the call.
            if unsafe { libc::sigwait(&set, &mut sig) } == 0 {
                clean_up();
                die_by(sig);
            }
        });
    if spawned.is_err() {
        // SAFETY: as above; without the handling thread the default actions must come back.
        unsafe { libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut()) };
    }
}

/// Ends the process by `sig` itself, so a parent sees what ended it (a shell loop stops on
/// Ctrl-C only when the child died by SIGINT), not an ordinary exit status.
fn die_by(sig: libc::c_int) -> ! {
    // SAFETY: resetting the action to the default, unblocking and raising in this thread.
    unsafe {
        libc::signal(sig, libc::SIG_DFL);
        let mut one: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut one);
        libc::sigaddset(&mut one, sig);
        libc::pthread_sigmask(libc::SIG_UNBLOCK, &one, std::ptr::null_mut());
        libc::raise(sig);
    }
    // Not reached when the default action ends the process; 128 + n as a shell reports it.
    std::process::exit(128 + sig)
}

fn lock() -> std::sync::MutexGuard<'static, Cleanup> {
    CLEANUP.lock().unwrap_or_else(|e| e.into_inner())
}

/// Removes `path` (a file or a folder) if the process is interrupted before [`forget_path`].
pub fn remove_on_interrupt(path: &Path) {
    lock().paths.push(path.to_path_buf());
}

pub fn forget_path(path: &Path) {
    lock().paths.retain(|p| p != path);
}

/// Spawns `cmd` in a process group of its own, which an interrupt ends until
/// [`forget_child`]. The registry stays locked from the spawn to the registration, so an
/// interrupt in between waits for it instead of missing the child.
///
/// A SIGKILL cannot be handled: for that case the kernel sends the child SIGTERM when this
/// thread dies (`PR_SET_PDEATHSIG`; call from the main thread, which lives as long as the
/// process).
pub fn spawn_child(cmd: &mut std::process::Command) -> std::io::Result<std::process::Child> {
    use std::os::unix::process::CommandExt;
    cmd.process_group(0);
    // SAFETY: prctl is async-signal-safe and touches only the child's own settings.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        });
    }
    let mut c = lock();
    let child = cmd.spawn()?;
    c.children.push(child.id());
    Ok(child)
}

pub fn forget_child(pid: u32) {
    lock().children.retain(|&p| p != pid);
}

fn clean_up() {
    let c = lock();
    for &pid in &c.children {
        end_child(pid);
    }
    for p in c.paths.iter().rev() {
        if p.is_dir() {
            let _ = std::fs::remove_dir_all(p);
        } else {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// SIGTERM to the child's group, up to two seconds for it to go, then SIGKILL; reaped, so no
/// zombie is left either (another thread waiting on it may reap it first: ECHILD is fine).
fn end_child(pid: u32) {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return;
    };
    // SAFETY: kill and waitpid take plain integers; a stale pid at worst gets ESRCH/ECHILD.
    unsafe {
        libc::kill(-pid, libc::SIGTERM);
        libc::kill(pid, libc::SIGTERM);
        for _ in 0..200 {
            let mut status = 0;
            let r = libc::waitpid(pid, &mut status, libc::WNOHANG);
            if r != 0 {
                return; // reaped, or not ours to reap any more
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        libc::kill(-pid, libc::SIGKILL);
        libc::kill(pid, libc::SIGKILL);
        let mut status = 0;
        libc::waitpid(pid, &mut status, 0);
    }
}
