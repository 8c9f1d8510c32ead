//! Userfaultfd write protection (Linux 6.7+): make every first write after a pass fault, and
//! read who wrote, page by page.
//!
//! A dirty bit for anonymous memory that the hardware does not give userspace: rksm creates
//! a userfaultfd *inside* the target (a remote `userfaultfd(UFFD_USER_MODE_ONLY)`, which also
//! works for unprivileged targets), takes it with `pidfd_getfd`, closes the target's copy, and
//! from then on drives it from the daemon: `UFFDIO_API` with `WP_ASYNC | WP_UNPOPULATED`
//! (write faults on protected pages are resolved in the kernel, with no round trip to rksm)
//! and `UFFDIO_REGISTER` in write-protect mode on each scanned VMA. Each pass then calls
//! `PAGEMAP_SCAN` with `PM_SCAN_WP_MATCHING` on /proc/PID/pagemap: it returns the pages
//! written since the previous call and write-protects them again, atomically. That walks
//! every armed page; when the written pages are known otherwise (the eBPF tracer), only they
//! are protected again, with `UFFDIO_WRITEPROTECT` on coalesced ranges, and PAGEMAP_SCAN
//! walks only a slice ([`Armed::scan_written`]). Protection always happens before the pages
//! are read, so a write after the read shows up next pass.
//!
//! When rksm exits, its uffd closes and the kernel drops the registration; the target never
//! holds an extra fd. VMAs the target registered with a userfaultfd of its own cannot be
//! registered again (`EBUSY`); they stay unarmed, and their pages are rehashed every pass.
//! The other way round, a target that takes up userfaultfd while rksm holds one over its
//! memory would get that `EBUSY`: rksm's userfaultfd is a [`Handover`], which the userfaultfd
//! guard (`ebpf::guard`) closes from its own thread the moment the target reaches for one;
//! closing it is what makes the kernel drop every registration, at once.

use std::{
    collections::HashSet,
    fs::{self, File},
    io,
    os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd},
    sync::{Arc, Mutex},
};

use rksm_common::{PAGE, PAGE_SIZE};

use crate::kernel::{
    process::Process,
    procfs::{
        PageRegion, PageScan, Vma, PAGE_IS_WRITTEN, PM_SCAN_CHECK_WPASYNC, PM_SCAN_WP_MATCHING,
    },
    ranges::{Range, RangeSet},
    remote::{nr, RemoteError, RemoteSession},
};

const UFFD_API: u64 = 0xAA;
const UFFD_USER_MODE_ONLY: u64 = 1;
const UFFD_FEATURE_WP_UNPOPULATED: u64 = 1 << 13;
const UFFD_FEATURE_WP_ASYNC: u64 = 1 << 15;
const UFFDIO_REGISTER_MODE_WP: u64 = 1 << 1;
const UFFDIO_WRITEPROTECT_MODE_WP: u64 = 1 << 0;

#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioRegister {
    start: u64,
    len: u64,
    mode: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioWriteprotect {
    start: u64,
    len: u64,
    mode: u64,
}

nix::ioctl_readwrite!(uffdio_api, 0xAA, 0x3F, UffdioApi);
nix::ioctl_readwrite!(uffdio_register, 0xAA, 0x00, UffdioRegister);
nix::ioctl_readwrite!(uffdio_writeprotect, 0xAA, 0x06, UffdioWriteprotect);

/// Pages the tracer named this far apart (in pages) or closer are protected again by one
/// walk of the pages between them rather than one call each: a walk passes over a page table
/// entry in a few nanoseconds, a system call costs a microsecond or two.
const REPROTECT_GAP: u64 = 256;

/// Errors arming a process.
#[derive(Debug, thiserror::Error)]
pub enum ArmError {
    /// The remote part (creating or closing the target's userfaultfd) failed or was refused.
    #[error(transparent)]
    Remote(#[from] RemoteError),
    /// The target could not create a userfaultfd.
    #[error("pid {pid}: userfaultfd() inside the target returned {errno}")]
    Create {
        /// The process.
        pid: u32,
        /// The negative errno.
        errno: i64,
    },
    /// A local system call failed.
    #[error("pid {pid}: {what}: {source}")]
    Io {
        /// The process.
        pid: u32,
        /// Which call.
        what: &'static str,
        /// What the kernel said.
        source: io::Error,
    },
}

/// Whether this kernel has asynchronous userfaultfd write protection (Linux 6.7+), tried on
/// a userfaultfd of rksm's own.
pub fn supported() -> bool {
    // SAFETY: userfaultfd takes flags and returns a new fd or -1.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_userfaultfd,
            libc::O_CLOEXEC as u64 | UFFD_USER_MODE_ONLY,
        )
    };
    if fd < 0 {
        return false;
    }
    // SAFETY: the kernel just returned this fd and nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let mut api = UffdioApi {
        api: UFFD_API,
        features: UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED,
        ioctls: 0,
    };
    // SAFETY: a valid uffd and a properly laid out uffdio_api.
    unsafe { uffdio_api(fd.as_raw_fd(), &mut api) }.is_ok()
}

/// rksm's userfaultfd for one target, which another thread may give up at any moment: the
/// last close of a userfaultfd makes the kernel unregister it from every VMA of the target,
/// and then nothing of rksm's stands in the way of the target's own `UFFDIO_REGISTER`.
#[derive(Debug)]
pub struct Handover {
    fd: Mutex<Option<OwnedFd>>,
}

impl Handover {
    fn new(fd: OwnedFd) -> Arc<Self> {
        Arc::new(Handover {
            fd: Mutex::new(Some(fd)),
        })
    }

    /// Runs `f` with the userfaultfd, unless it was given up. The lock is held for `f` only
    /// (one ioctl), so giving up waits at most for that.
    fn with<R>(&self, f: impl FnOnce(RawFd) -> R) -> Option<R> {
        let fd = self.fd.lock().unwrap_or_else(|e| e.into_inner());
        fd.as_ref().map(|fd| f(fd.as_raw_fd()))
    }

    /// Closes the userfaultfd; when this returns, the kernel has dropped its registrations.
    /// True if it was still held.
    pub fn give_up(&self) -> bool {
        let taken = self.fd.lock().unwrap_or_else(|e| e.into_inner()).take();
        taken.is_some()
    }

    /// Whether it was given up.
    pub fn given_up(&self) -> bool {
        self.fd.lock().unwrap_or_else(|e| e.into_inner()).is_none()
    }
}

/// One process's write-protect arming.
#[derive(Debug)]
pub struct Armed {
    pid: u32,
    uffd: Arc<Handover>,
    pagemap: File,
    /// Ranges registered for write protection.
    registered: RangeSet,
    /// Ranges that refused registration (the target's own userfaultfd): never armed.
    refused: RangeSet,
}

impl Armed {
    /// Creates the userfaultfd inside `process` (in `session`, one stop shared with other
    /// remote calls) and takes it over. Nothing is registered yet.
    pub fn arm(process: &Process, session: &mut RemoteSession) -> Result<Self, ArmError> {
        let pid = process.pid();
        let flags = libc::O_CLOEXEC as u64 | libc::O_NONBLOCK as u64 | UFFD_USER_MODE_ONLY;
        let remote_fd = session.syscall(nr::USERFAULTFD, &[flags])?;
        if remote_fd < 0 {
            return Err(ArmError::Create {
                pid,
                errno: remote_fd,
            });
        }
        // SAFETY: pidfd_getfd takes a pidfd we own, a fd number and flags; it returns a new fd.
        let local = unsafe {
            libc::syscall(
                libc::SYS_pidfd_getfd,
                process.pidfd().as_raw_fd(),
                remote_fd as i32,
                0,
            )
        };
        let taken = io::Error::last_os_error();
        if local < 0 {
            // Its copy goes: the target must not keep an extra fd.
            session.syscall(nr::CLOSE, &[remote_fd as u64])?;
            return Err(ArmError::Io {
                pid,
                what: "pidfd_getfd",
                source: taken,
            });
        }
        // SAFETY: the kernel just gave us this fd and nothing else owns it.
        let uffd = unsafe { OwnedFd::from_raw_fd(local as i32) };
        // Another thread of the target may have closed the number and opened something else
        // under it meanwhile. Only a userfaultfd is ours to take, and its copy ours to close.
        let what = fs::read_link(format!("/proc/self/fd/{local}")).unwrap_or_default();
        if what.as_os_str() != "anon_inode:[userfaultfd]" {
            return Err(ArmError::Io {
                pid,
                what: "pidfd_getfd",
                source: io::Error::other(format!(
                    "fd {remote_fd} is now {}, not the userfaultfd made for rksm; left alone",
                    what.display()
                )),
            });
        }
        let closed = session.syscall(nr::CLOSE, &[remote_fd as u64])?;
        if closed != 0 {
            log::warn!("pid {pid}: closing its userfaultfd copy returned {closed}");
        }
        let mut api = UffdioApi {
            api: UFFD_API,
            features: UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED,
            ioctls: 0,
        };
        // SAFETY: a valid uffd and a properly laid out uffdio_api.
        unsafe { uffdio_api(uffd.as_raw_fd(), &mut api) }.map_err(|e| ArmError::Io {
            pid,
            what: "UFFDIO_API (WP_ASYNC needs Linux 6.7)",
            source: e.into(),
        })?;
        let pagemap =
            File::open(format!("/proc/{pid}/pagemap")).map_err(|source| ArmError::Io {
                pid,
                what: "opening pagemap",
                source,
            })?;
        Ok(Armed {
            pid,
            uffd: Handover::new(uffd),
            pagemap,
            registered: RangeSet::default(),
            refused: RangeSet::default(),
        })
    }

    /// Registers the VMAs not covered yet. The kernel keeps a registration across VMA splits
    /// and merges (marking a run mergeable splits VMAs), so coverage is kept as address ranges,
    /// clipped to the VMAs that exist now; a VMA unmapped and mapped again at the same place
    /// is caught by [`Armed::protect`], which then drops it so it is registered again.
    pub fn register(&mut self, vmas: &[Vma]) {
        self.registered = self.registered.clip_to(vmas.iter().map(Vma::range));
        self.refused = self.refused.clip_to(vmas.iter().map(Vma::range));
        for vma in vmas {
            if self.registered.covers(vma.start, vma.end) || self.refused.covers(vma.start, vma.end)
            {
                continue;
            }
            let mut reg = UffdioRegister {
                start: vma.start,
                len: vma.end - vma.start,
                mode: UFFDIO_REGISTER_MODE_WP,
                ioctls: 0,
            };
            let registered = self.uffd.with(|fd| {
                // SAFETY: a valid uffd and a properly laid out uffdio_register.
                unsafe { uffdio_register(fd, &mut reg) }
            });
            match registered {
                None => return,
                Some(Ok(_)) => self.registered.insert(vma.range()),
                Some(Err(errno)) => {
                    log::debug!(
                        "pid {}: cannot arm {:#x}-{:#x}: {errno}",
                        self.pid,
                        vma.start,
                        vma.end
                    );
                    self.refused.insert(vma.range());
                }
            }
        }
    }

    /// Forgets registrations the kernel no longer has. A VMA unmapped and mapped again at an
    /// armed address (`mmap`, `mremap` onto it) is a new VMA without the registration, whose
    /// writes neither fault nor show as written: it must be registered again and read in
    /// full. One single-page PAGEMAP_SCAN per VMA asks the kernel.
    pub fn forget_lost(&mut self, vmas: &[Vma]) {
        self.registered = self.registered.clip_to(vmas.iter().map(Vma::range));
        self.refused = self.refused.clip_to(vmas.iter().map(Vma::range));
        let mut lost = Vec::new();
        for vma in vmas {
            let Some(first) = self.registered.within(vma.range()).first().copied() else {
                continue;
            };
            // Without PM_SCAN_WP_MATCHING the probe changes nothing.
            let probe = PageScan {
                flags: PM_SCAN_CHECK_WPASYNC,
                category_mask: PAGE_IS_WRITTEN,
                return_mask: PAGE_IS_WRITTEN,
            };
            let page = first.start;
            if probe
                .walk(self.pagemap.as_fd(), page, page + PAGE_SIZE, &mut |_| {})
                .is_err()
            {
                log::debug!(
                    "pid {}: {:#x}-{:#x} lost its registration (mapped anew)",
                    self.pid,
                    vma.start,
                    vma.end
                );
                lost.push(vma.range());
            }
        }
        lost.sort_unstable_by_key(|r| r.start);
        self.registered.remove(&lost);
    }

    /// The userfaultfd, for the guard that gives it up when the target takes up its own.
    pub fn handover(&self) -> Arc<Handover> {
        self.uffd.clone()
    }

    /// Whether the userfaultfd was given up (the target took up one of its own): nothing is
    /// protected any more, and the target must be armed otherwise or hashed.
    pub fn given_up(&self) -> bool {
        self.uffd.given_up()
    }

    /// Ranges whose pages are write-protected after [`Armed::protect`].
    pub fn armed_ranges(&self) -> &RangeSet {
        &self.registered
    }

    /// Write-protects every armed page and returns the pages written since the previous call
    /// among those armed `before` it. The pages armed since are protected for the first time
    /// and all count as written: the caller reads them in full, and they are not listed. A
    /// range that fails (unmapped and mapped again meanwhile) is dropped from the armed set,
    /// so its pages count as unprotected.
    pub fn protect(&mut self, before: &RangeSet) -> HashSet<u64> {
        let known = before.intersection(&self.registered);
        let new = known.minus(self.registered.as_slice());
        self.protect_new(&new);
        self.scan_written(known.as_slice())
    }

    /// Write-protects the armed pages in `ranges` (sorted) with PAGEMAP_SCAN and returns
    /// those written since they were last protected. A range that fails is dropped from the
    /// armed set.
    ///
    /// A page mapped to the zero page is among them (a read fault after `MADV_DONTNEED` maps
    /// it unprotected, with no write at all); asking the walk to say which would take the
    /// kernel off its fast path (a page table entry's protection bit alone) onto looking up
    /// every entry's page, so the few pages that matter are looked up afterwards instead.
    pub fn scan_written(&mut self, ranges: &[Range]) -> HashSet<u64> {
        let mut written = HashSet::new();
        self.walk_protecting(
            ranges,
            Some(&mut |region: &PageRegion| {
                written.extend((region.start..region.end).step_by(PAGE));
            }),
        );
        written
    }

    /// Write-protects the armed pages in `ranges` (sorted) for the first time: all of them
    /// count as written then, which the caller knows, so none is listed (a first pass over
    /// a large target would spend more on the list than on the protecting).
    pub fn protect_new(&mut self, ranges: &[Range]) {
        self.walk_protecting(ranges, None);
    }

    /// Write-protects the armed pages in `ranges` with PAGEMAP_SCAN, handing `found` each
    /// region of pages written since they were last protected (with no `found`, the walk
    /// lists nothing). A range that fails is dropped from the armed set.
    fn walk_protecting(
        &mut self,
        ranges: &[Range],
        mut found: Option<&mut dyn FnMut(&PageRegion)>,
    ) {
        let mut failed = Vec::new();
        let scan = PageScan {
            flags: PM_SCAN_WP_MATCHING | PM_SCAN_CHECK_WPASYNC,
            category_mask: PAGE_IS_WRITTEN,
            return_mask: PAGE_IS_WRITTEN,
        };
        for range in ranges {
            for Range { start, end } in self.registered.within(*range) {
                let fd = self.pagemap.as_fd();
                let done = match found.as_mut() {
                    Some(found) => scan.walk(fd, start, end, &mut **found),
                    None => scan.protect(fd, start, end),
                };
                if let Err(errno) = done {
                    log::debug!(
                        "pid {}: PAGEMAP_SCAN {start:#x}-{end:#x}: {errno}",
                        self.pid
                    );
                    failed.push(Range::new(start, end));
                }
            }
        }
        self.registered.remove(&failed);
    }

    /// Write-protects `pages` again (the pages written since they were last protected, as
    /// the tracer saw them) and returns the other pages found written among them, with the
    /// number of pages whose written bit was read to find them.
    ///
    /// Pages the tracer names lie scattered (a steady pass finds one page written here, one
    /// there), and a system call per run of them cost a steady pass more than anything else
    /// it did. So pages at most [`REPROTECT_GAP`] apart are protected again together: a run
    /// of consecutive pages with one `UFFDIO_WRITEPROTECT`, pages with gaps between them by
    /// one PAGEMAP_SCAN walk over the gaps too, which protects only what it finds written
    /// and reports it. A page written without a fault (the audit's business) is then
    /// reported, never protected unseen. A part that fails (its range no longer registered)
    /// is dropped from the armed set.
    pub fn reprotect(&mut self, pages: &HashSet<u64>) -> (HashSet<u64>, u64) {
        let mut sorted: Vec<u64> = pages
            .iter()
            .copied()
            .filter(|&p| self.registered.contains(p))
            .collect();
        sorted.sort_unstable();
        let mut found = HashSet::new();
        let mut walked = 0;
        let mut failed = Vec::new();
        for cluster in sorted.chunk_by(|a, b| b - a <= REPROTECT_GAP * PAGE_SIZE) {
            let run = Range::new(cluster[0], cluster[cluster.len() - 1] + PAGE_SIZE);
            if cluster.len() as u64 != run.pages() {
                // Walked as the audit walks; what it finds written besides `pages` is
                // returned.
                walked += run.pages();
                let written = self.scan_written(&[run]);
                found.extend(written.into_iter().filter(|p| !pages.contains(p)));
                continue;
            }
            // A run may straddle two registered ranges (VMAs): protect each part.
            for part in self.registered.within(run) {
                let mut wp = UffdioWriteprotect {
                    start: part.start,
                    len: part.end - part.start,
                    mode: UFFDIO_WRITEPROTECT_MODE_WP,
                };
                let done = self
                    .uffd
                    .with(|fd| {
                        // SAFETY: a valid uffd and a properly laid out uffdio_writeprotect.
                        unsafe { uffdio_writeprotect(fd, &mut wp) }
                    })
                    .unwrap_or(Err(nix::errno::Errno::EBADF));
                if let Err(errno) = done {
                    log::debug!(
                        "pid {}: UFFDIO_WRITEPROTECT {:#x}-{:#x}: {errno}",
                        self.pid,
                        part.start,
                        part.end
                    );
                    failed.push(part);
                }
            }
        }
        self.registered.remove(&failed);
        (found, walked)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn asynchronous_write_protection_is_found_from_linux_6_7_on() {
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
        let mut numbers = release.split(|c: char| !c.is_ascii_digit());
        let major: u32 = numbers.next().unwrap().parse().unwrap();
        let minor: u32 = numbers.next().unwrap().parse().unwrap();
        assert_eq!(
            supported(),
            (major, minor) >= (6, 7),
            "Linux {}",
            release.trim()
        );
    }

    #[test]
    fn kernel_structures_have_the_kernels_sizes() {
        assert_eq!(size_of::<UffdioApi>(), 24);
        assert_eq!(size_of::<UffdioRegister>(), 32);
        assert_eq!(size_of::<UffdioWriteprotect>(), 24);
    }
}
