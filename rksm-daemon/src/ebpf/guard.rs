//! The userfaultfd guard: a target that takes up userfaultfd itself always gets it.
//!
//! A VMA belongs to one userfaultfd at a time, so while rksm's (write protection) is
//! registered over a target's memory, the target's own `UFFDIO_REGISTER` there fails with
//! `EBUSY`: qemu's postcopy migration and background snapshots, CRIU's lazy restore. rksm
//! cannot know in advance who will, and a program may register microseconds after creating
//! its userfaultfd, sooner than any daemon could react to having seen it. So the guard's two
//! eBPF programs (rksm-ebpf's `guard`) watch the processes rksm holds a userfaultfd for:
//! creating one, or `UFFDIO_API` on one, posts a claim to a ring this module's thread waits
//! on, which gives rksm's userfaultfd up (closing it makes the kernel drop every one of its
//! registrations) and lets the process go; the `UFFDIO_REGISTER` itself is held at its entry
//! until then, bounded by [`MAX_HOLD_NS`]. The engine then arms the process otherwise
//! (soft-dirty, where the kernel has it) or hashes it, and never arms it with userfaultfd
//! again.
//!
//! The guard is process-wide, like the kernel objects it loads: [`install`] once, and the
//! engine finds it with [`installed`].

use std::{
    collections::HashMap,
    os::fd::{AsFd, AsRawFd},
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex, OnceLock, Weak,
    },
    time::Duration,
};

use aya::{
    maps::{HashMap as BpfHashMap, MapData, MapError, RingBuf},
    programs::ProgramError,
    Ebpf, EbpfError,
};
use rksm_common::uffd_guard::{
    CATEGORY, CLAIMS, CREATE_EVENT, CREATE_PROGRAM, HELD, IOCTL_CMD_OFFSET, IOCTL_EVENT,
    IOCTL_PROGRAM, MAX_HOLD_NS,
};

use crate::{
    ebpf::{
        tracefs::{self, TracefsError},
        tracer::EBPF_OBJECT,
    },
    kernel::userfaultfd::Handover,
};

/// Errors installing the guard (or the wait watch, which loads the same way).
#[derive(Debug, thiserror::Error)]
pub enum GuardError {
    /// The binary was built without the eBPF object.
    #[error("this rksm binary was built without its eBPF program")]
    NotBuiltIn,
    /// Tracefs is missing.
    #[error(transparent)]
    Tracefs(#[from] TracefsError),
    /// The `ioctl` tracepoint is not there, or not laid out as the program reads it.
    #[error("{0}")]
    Layout(String),
    /// The kernel refused the object.
    #[error("loading the eBPF object failed: {0}")]
    Load(#[from] EbpfError),
    /// The kernel refused a program.
    #[error("attaching to {CATEGORY}:{1} failed: {0}")]
    Attach(ProgramError, &'static str),
    /// A map is missing or of the wrong kind.
    #[error("eBPF map {0}: {1}")]
    Map(&'static str, MapError),
    /// The object lacks a program or map (object and daemon out of sync).
    #[error("the eBPF object has no {0}; rebuild with `cargo xtask build`")]
    Missing(&'static str),
    /// The thread that serves claims could not start.
    #[error("starting the guard's thread: {0}")]
    Thread(std::io::Error),
}

/// What the daemon's threads share with the claim thread.
struct Shared {
    /// The processes rksm holds a userfaultfd for, as the programs see them.
    held: Mutex<BpfHashMap<MapData, u32, u32>>,
    /// Their userfaultfds (weak: a target that goes away closes its own).
    handovers: Mutex<HashMap<u32, Weak<Handover>>>,
    /// Userfaultfds given up because their target took up one of its own.
    given_up: AtomicU64,
}

impl Shared {
    /// Gives up `pid`'s userfaultfd, then lets its held call go on.
    fn serve(&self, pid: u32) {
        let handover = self
            .handovers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&pid)
            .and_then(|weak| weak.upgrade());
        if handover.is_some_and(|h| h.give_up()) {
            self.given_up.fetch_add(1, Ordering::Relaxed);
            log::info!(
                pid, write_protect = "userfaultfd";
                "pid {pid} takes up userfaultfd itself: rksm gave its own up before the process registered"
            );
        }
        let _ = self
            .held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&pid);
    }
}

/// The loaded guard. Lives as long as the process.
pub struct UffdGuard {
    shared: Arc<Shared>,
    // Holds the programs and their links.
    _ebpf: Mutex<Ebpf>,
}

static GUARD: OnceLock<UffdGuard> = OnceLock::new();

/// Loads and attaches the guard and starts its thread, once per process.
pub fn install(object: &mut super::Object) -> Result<&'static UffdGuard, GuardError> {
    if let Some(guard) = GUARD.get() {
        return Ok(guard);
    }
    let guard = UffdGuard::load(object)?;
    Ok(GUARD.get_or_init(|| guard))
}

/// The guard, if [`install`] succeeded.
pub fn installed() -> Option<&'static UffdGuard> {
    GUARD.get()
}

impl UffdGuard {
    fn load(object: &mut super::Object) -> Result<Self, GuardError> {
        if EBPF_OBJECT.is_empty() {
            return Err(GuardError::NotBuiltIn);
        }
        let tracefs = tracefs::ensure_mounted()?;
        super::check_syscall_field(tracefs, IOCTL_EVENT, "cmd", IOCTL_CMD_OFFSET)?;
        let mut ebpf = object.load(&[HELD], &[])?;
        super::attach_syscall_programs(
            &mut ebpf,
            &[(CREATE_PROGRAM, CREATE_EVENT), (IOCTL_PROGRAM, IOCTL_EVENT)],
        )?;
        let take = |ebpf: &mut Ebpf, name| ebpf.take_map(name).ok_or(GuardError::Missing(name));
        let held =
            BpfHashMap::try_from(take(&mut ebpf, HELD)?).map_err(|e| GuardError::Map(HELD, e))?;
        let claims =
            RingBuf::try_from(take(&mut ebpf, CLAIMS)?).map_err(|e| GuardError::Map(CLAIMS, e))?;
        let shared = Arc::new(Shared {
            held: Mutex::new(held),
            handovers: Mutex::new(HashMap::new()),
            given_up: AtomicU64::new(0),
        });
        let serving = shared.clone();
        std::thread::Builder::new()
            .name("rksm-uffd-guard".into())
            .spawn(move || serve_claims(claims, &serving))
            .map_err(GuardError::Thread)?;
        Ok(UffdGuard {
            shared,
            _ebpf: Mutex::new(ebpf),
        })
    }

    /// Watches `pid`, whose memory `handover` is registered over: if it takes up userfaultfd
    /// itself, `handover` is given up first.
    pub fn hold(&self, pid: u32, handover: &Arc<Handover>) {
        let mut handovers = self
            .shared
            .handovers
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let mut held = self.shared.held.lock().unwrap_or_else(|e| e.into_inner());
        handovers.insert(pid, Arc::downgrade(handover));
        if let Err(e) = held.insert(pid, 0, 0) {
            log::warn!(
                "pid {pid}: not guarded ({e}): if it registers a userfaultfd of its own it may fail with EBUSY"
            );
        }
    }

    /// Stops watching `pid` (it is no longer a target).
    pub fn forget(&self, pid: u32) {
        let mut handovers = self
            .shared
            .handovers
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if handovers.remove(&pid).is_some() {
            let _ = self
                .shared
                .held
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&pid);
        }
    }

    /// Userfaultfds given up so far because their target took up its own.
    pub fn given_up(&self) -> u64 {
        self.shared.given_up.load(Ordering::Relaxed)
    }
}

/// The claim thread: waits on the ring (no timeout: the programs wake it), serves each claim.
fn serve_claims(mut claims: RingBuf<MapData>, shared: &Shared) {
    let fd = claims.as_fd().as_raw_fd();
    loop {
        let mut poll = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd, owned by this frame.
        let ready = unsafe { libc::poll(&mut poll, 1, -1) };
        if ready < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            log::warn!(
                "the userfaultfd guard stopped: poll: {}",
                std::io::Error::last_os_error()
            );
            return;
        }
        while let Some(item) = claims.next() {
            let Ok(bytes) = <[u8; 4]>::try_from(&item[..4.min(item.len())]) else {
                continue;
            };
            shared.serve(u32::from_ne_bytes(bytes));
        }
    }
}

/// The longest a target's `UFFDIO_REGISTER` waits for the guard.
pub const MAX_HOLD: Duration = Duration::from_nanos(MAX_HOLD_NS);
