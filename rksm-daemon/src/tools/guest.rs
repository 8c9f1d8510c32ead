//! Virtual machines as workloads: qemu guests that mark their own RAM mergeable.
//!
//! Hosts that run KSM are mostly hosts of virtual machines, and qemu is the one target that
//! marks its memory mergeable itself (`mem-merge=on`, its default), so ksmd sweeps all of
//! its guest's RAM whatever rksm marks. This module starts such a guest under software
//! emulation (TCG; no /dev/kvm needed) with a kernel of the host's (`/boot/vmlinuz-*`) and an
//! initramfs whose `/init` fills known memory and checks it on request
//! (`tests/support/guestinit.rs`, built by `cargo xtask guest-image`). `rksm bench --profile
//! guests` and the tests drive it over its serial console: `ready` once the memory is filled,
//! then `ok` or `corrupt page N` for each `check`.

use std::{
    io::{BufRead, BufReader, Write},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, Stdio},
    sync::mpsc::{self, Receiver},
    time::{Duration, Instant},
};

/// Why a guest cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum GuestError {
    /// No kernel to boot it with.
    #[error("no /boot/vmlinuz-* to boot guests with (install linux-image-amd64, or pass --guest-kernel)")]
    NoKernel,
    /// The kernel or the initramfs given is not a file.
    #[error("guest {what} {} is not a file", .path.display())]
    NotAFile {
        /// Which: kernel or initramfs.
        what: &'static str,
        /// The path given.
        path: PathBuf,
    },
    /// qemu would not start.
    #[error(
        "starting qemu-system-x86_64: {0} (install qemu-system-x86, or run `cargo xtask setup`)"
    )]
    Qemu(std::io::Error),
    /// The guest did not say its memory was filled in time.
    #[error("guest (qemu pid {pid}) did not start: {why}")]
    NotReady {
        /// qemu's pid.
        pid: u32,
        /// What happened instead.
        why: ConsoleError,
    },
}

/// Why the guest's console gave no answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ConsoleError {
    /// Not within the deadline.
    #[error("timed out")]
    TimedOut,
    /// qemu is gone.
    #[error("qemu exited")]
    Exited,
}

/// What a guest boots: a kernel and the initramfs with the test `/init`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestImage {
    /// A bzImage, such as Debian's `/boot/vmlinuz-*`.
    pub kernel: PathBuf,
    /// The initramfs `cargo xtask guest-image` writes (target/guest/initrd.cpio).
    pub initrd: PathBuf,
}

impl GuestImage {
    /// The initramfs at `initrd` and `kernel`, or the newest `/boot/vmlinuz-*`.
    pub fn new(initrd: &Path, kernel: Option<&Path>) -> Result<GuestImage, GuestError> {
        let kernel = match kernel {
            Some(k) => k.to_path_buf(),
            None => newest_kernel().ok_or(GuestError::NoKernel)?,
        };
        for (what, path) in [("kernel", &kernel), ("initramfs", &initrd.to_path_buf())] {
            if !path.is_file() {
                return Err(GuestError::NotAFile {
                    what,
                    path: path.clone(),
                });
            }
        }
        Ok(GuestImage {
            kernel,
            initrd: initrd.to_path_buf(),
        })
    }
}

/// The newest kernel in /boot (by modification time).
pub fn newest_kernel() -> Option<PathBuf> {
    std::fs::read_dir("/boot")
        .ok()?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("vmlinuz-"))
        .max_by_key(|e| e.metadata().and_then(|m| m.modified()).ok())
        .map(|e| e.path())
}

/// The memory of one guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GuestMemory {
    /// The guest's RAM.
    pub ram_mib: u64,
    /// Filled with pages that are the same in every guest.
    pub duplicate_mib: u64,
    /// Filled with pages unique to this guest.
    pub unique_mib: u64,
}

/// A running guest; killed when dropped.
pub struct GuestProcess {
    child: Child,
    stdin: ChildStdin,
    console: Receiver<String>,
}

/// How long a guest may take to boot and fill its memory under TCG.
pub const BOOT_DEADLINE: Duration = Duration::from_secs(240);
/// How long a guest may take to check its memory.
const CHECK_DEADLINE: Duration = Duration::from_secs(120);

impl GuestProcess {
    /// Starts guest `index`; [`GuestProcess::ready`] waits for it to have filled its memory.
    pub fn start(image: &GuestImage, memory: GuestMemory, index: u32) -> Result<Self, GuestError> {
        let append = format!(
            "console=ttyS0 quiet loglevel=1 panic=-1 -- {} {} {index}",
            memory.duplicate_mib, memory.unique_mib
        );
        let mut child = Command::new("qemu-system-x86_64")
            .args(["-machine", "pc,mem-merge=on", "-accel", "tcg", "-smp", "1"])
            .args(["-m", &memory.ram_mib.to_string()])
            .args(["-display", "none", "-nodefaults", "-no-reboot"])
            .args(["-serial", "stdio"])
            .arg("-kernel")
            .arg(&image.kernel)
            .arg("-initrd")
            .arg(&image.initrd)
            .args(["-append", &append])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(GuestError::Qemu)?;
        let stdin = child.stdin.take().expect("piped");
        let stdout = child.stdout.take().expect("piped");
        let (lines, console) = mpsc::channel();
        // The console is read on its own thread so that every wait can have a deadline.
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).split(b'\n').map_while(Result::ok) {
                let line = String::from_utf8_lossy(&line).trim().to_string();
                if lines.send(line).is_err() {
                    break;
                }
            }
        });
        Ok(GuestProcess {
            child,
            stdin,
            console,
        })
    }

    /// Waits, up to `deadline`, for the guest to say its memory is filled.
    pub fn ready(&mut self, deadline: Instant) -> Result<(), GuestError> {
        self.expect(deadline, "ready")
            .map(drop)
            .map_err(|why| GuestError::NotReady {
                pid: self.pid(),
                why,
            })
    }

    /// The qemu process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Asks the guest to check all its memory: `ok`, or `corrupt page N`, or why it could
    /// not answer.
    pub fn verify(&mut self) -> String {
        if let Err(e) = writeln!(self.stdin, "check").and_then(|()| self.stdin.flush()) {
            return format!("no answer: {e}");
        }
        match self.expect(Instant::now() + CHECK_DEADLINE, "") {
            Ok(answer) if answer.starts_with("ok") => "ok".into(),
            Ok(answer) => answer,
            Err(e) => format!("no answer: {e}"),
        }
    }

    /// The rest of the next `rksm-guest: WORD...` line whose rest starts with `word`.
    fn expect(&mut self, deadline: Instant, word: &str) -> Result<String, ConsoleError> {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self.console.recv_timeout(left).map_err(|e| match e {
                mpsc::RecvTimeoutError::Timeout => ConsoleError::TimedOut,
                mpsc::RecvTimeoutError::Disconnected => ConsoleError::Exited,
            })?;
            if let Some(rest) = line
                .split_once("rksm-guest: ")
                .map(|(_, r)| r)
                .filter(|r| r.starts_with(word))
            {
                return Ok(rest.to_string());
            }
        }
    }
}

impl Drop for GuestProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
