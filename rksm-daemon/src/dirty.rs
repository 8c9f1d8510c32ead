//! Dirty sources: which pages must be hashed again this pass.
//!
//! This is where rksm differs from KSM. KSM rehashes every candidate on every pass because it
//! has no other way to know a page is unchanged. A dirty source answers that question per
//! process: "every page" (hash-only, KSM's rule), or "these pages, and no others" when it can
//! prove the others clean (the eBPF tracer or PAGEMAP_SCAN after write-protecting, in later
//! modules). The scanner treats a page as clean only when the source says so *and* it has a
//! checksum from a previous pass; the index still compares contents before anything counts.

use std::{
    cell::RefCell,
    collections::{HashMap, HashSet},
    rc::Rc,
};

use crate::{
    arming::Armed,
    procfs::Vma,
    remote::RemoteSession,
    targets::Process,
    tracer::{Tracer, WriteLog},
};

/// The pages a source says were written since the previous pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DirtySet {
    /// Treat every page as written (hash-only mode, or the source lost track).
    All,
    /// Inside `armed` (sorted `(start, end)` ranges that were write-protected when last
    /// hashed), only `written` pages were written; pages outside `armed` are not provably
    /// clean.
    Only {
        /// Pages written since the previous pass.
        written: HashSet<u64>,
        /// Ranges under write protection.
        armed: Vec<(u64, u64)>,
    },
}

impl DirtySet {
    /// Whether `page` must be hashed again.
    pub fn contains(&self, page: u64) -> bool {
        match self {
            DirtySet::All => true,
            DirtySet::Only { written, armed } => {
                written.contains(&page) || !armed.iter().any(|&(s, e)| s <= page && page < e)
            }
        }
    }
}

/// Errors a dirty source can hit (arming or reading write state).
#[derive(Debug, thiserror::Error)]
#[error("dirty source {source_name} on pid {pid}: {message}")]
pub struct DirtyError {
    /// The source's mode name.
    pub source_name: &'static str,
    /// The process.
    pub pid: u32,
    /// What went wrong.
    pub message: String,
}

/// Decides, per process and pass, which pages must be rehashed.
pub trait DirtySource {
    /// The mode's name as the command line spells it (`hash-only`, `ebpf`, `pagemap`).
    fn mode(&self) -> &'static str;

    /// The pages of `process` (within its scanned `vmas`) written since the previous call
    /// for the same process. Sources that arm do it here, before the pages are read. The
    /// first call for a process must return [`DirtySet::All`] or an empty armed set.
    fn dirty_pages(&mut self, process: &Process, vmas: &[Vma]) -> Result<DirtySet, DirtyError>;

    /// `pid` is gone: drop whatever is kept for it.
    fn forget(&mut self, pid: u32);

    /// System calls made inside targets (to arm them) so far.
    fn remote_syscalls(&self) -> u64 {
        0
    }
}

/// KSM's rule: every candidate is rehashed every pass.
#[derive(Debug, Default, Clone, Copy)]
pub struct HashOnly;

impl DirtySource for HashOnly {
    fn mode(&self) -> &'static str {
        "hash-only"
    }

    fn dirty_pages(&mut self, _process: &Process, _vmas: &[Vma]) -> Result<DirtySet, DirtyError> {
        Ok(DirtySet::All)
    }

    fn forget(&mut self, _pid: u32) {}
}

/// What protecting one process found: the pages written since the previous protection, and
/// the ranges that were under protection all along (only their clean pages can be trusted).
pub type Protected = (HashSet<u64>, Vec<(u64, u64)>);

/// Write-protect arming of every target, created on first use. A process whose arming
/// failed (refused, no userfaultfd) is not tried again and is hashed in full.
#[derive(Debug, Default)]
pub struct Arming {
    processes: HashMap<u32, Option<Armed>>,
    /// Remote system calls made to arm processes.
    pub remote_syscalls: u64,
}

impl Arming {
    /// Arms `process` if it is not yet, registers new VMAs, write-protects, and returns the
    /// pages written since the previous call with the armed ranges; `None` if unarmed.
    pub fn protect(&mut self, process: &Process, vmas: &[Vma]) -> Option<Protected> {
        let pid = process.pid();
        if !self.processes.contains_key(&pid) {
            let armed = RemoteSession::begin(process)
                .map_err(crate::arming::ArmError::from)
                .and_then(|mut session| {
                    let armed = Armed::arm(process, &mut session);
                    self.remote_syscalls += session.calls();
                    session.finish()?;
                    armed
                });
            // Exited or exec'd since it was opened: the next pass sees to it.
            if let Err(crate::arming::ArmError::Remote(
                crate::remote::RemoteError::Gone(_) | crate::remote::RemoteError::NewImage(_),
            )) = &armed
            {
                return None;
            }
            if let Err(e) = &armed {
                log::warn!(
                    "pid {pid} cannot be write-protected, hashing all its pages every pass: {e}"
                );
            }
            self.processes.insert(pid, armed.ok());
        }
        let armed = self.processes.get_mut(&pid)?.as_mut()?;
        // Only ranges armed *before* this call (and still armed after protecting, which finds
        // ranges that lost their registration) have pages whose cleanliness can be trusted.
        let before = armed.armed_ranges().to_vec();
        armed.register(vmas);
        let written = armed.protect();
        let after = armed.armed_ranges();
        let trusted = before
            .iter()
            .flat_map(|&(s, e)| after.iter().map(move |&(s2, e2)| (s.max(s2), e.min(e2))))
            .filter(|(s, e)| s < e)
            .collect();
        Some((written, trusted))
    }

    /// Drops `pid`'s arming (its uffd closes; the kernel unregisters).
    pub fn forget(&mut self, pid: u32) {
        self.processes.remove(&pid);
    }
}

/// `--dirty pagemap`: written bits straight from PAGEMAP_SCAN; the exact reference.
#[derive(Debug, Default)]
pub struct PagemapSource {
    arming: Arming,
}

impl DirtySource for PagemapSource {
    fn mode(&self) -> &'static str {
        "pagemap"
    }

    fn dirty_pages(&mut self, process: &Process, vmas: &[Vma]) -> Result<DirtySet, DirtyError> {
        Ok(match self.arming.protect(process, vmas) {
            Some((written, armed)) => DirtySet::Only { written, armed },
            None => DirtySet::All,
        })
    }

    fn forget(&mut self, pid: u32) {
        self.arming.forget(pid);
    }

    fn remote_syscalls(&self) -> u64 {
        self.arming.remote_syscalls
    }
}

/// The tracer and what it recorded, shared by the eBPF dirty source and the daemon's
/// copy-on-write accounting.
pub struct TracerHub {
    tracer: Tracer,
    log: WriteLog,
    /// Tracked processes, with the loss count last seen for each.
    lost_seen: HashMap<u32, u64>,
    /// Per process, every page the tracer saw written in the current pass window.
    seen: HashMap<u32, HashSet<u64>>,
}

/// What the tracer saw of one process since the last look.
#[derive(Debug, Default)]
pub struct TracedWrites {
    /// Pages written.
    pub pages: HashSet<u64>,
    /// Whether records were lost (the pages are then incomplete).
    pub lost: bool,
}

impl TracerHub {
    /// Wraps a loaded tracer.
    pub fn new(tracer: Tracer) -> Rc<RefCell<TracerHub>> {
        Rc::new(RefCell::new(TracerHub {
            tracer,
            log: WriteLog::default(),
            lost_seen: HashMap::new(),
            seen: HashMap::new(),
        }))
    }

    /// The tracer, to poll its fd.
    pub fn tracer(&self) -> &Tracer {
        &self.tracer
    }

    /// Starts recording `pid`.
    pub fn track(&mut self, pid: u32) {
        if self.lost_seen.contains_key(&pid) {
            return;
        }
        match self.tracer.track(pid) {
            Ok(()) => {
                self.lost_seen.insert(pid, 0);
            }
            Err(e) => log::warn!("tracer cannot track pid {pid}: {e}"),
        }
    }

    /// Whether `pid` is tracked.
    pub fn tracks(&self, pid: u32) -> bool {
        self.lost_seen.contains_key(&pid)
    }

    /// Stops recording `pid` and forgets it.
    pub fn untrack(&mut self, pid: u32) {
        let _ = self.tracer.untrack(pid);
        self.lost_seen.remove(&pid);
        self.seen.remove(&pid);
        self.log.take(pid);
    }

    /// Moves records from the ring into the log.
    pub fn drain(&mut self) {
        self.tracer.drain(&mut self.log);
        self.tracer.flush_log();
    }

    /// Drains, then takes what was recorded for `pid` since the last take; a loss counted
    /// by the program since then sets `lost`. The pages are also kept in the pass window.
    pub fn take(&mut self, pid: u32) -> TracedWrites {
        self.drain();
        let pages = self.log.take(pid);
        let lost_now = self
            .tracer
            .process_counters(pid)
            .ok()
            .flatten()
            .map_or(0, |c| c.lost);
        // Only a tracked process has a loss count to compare with; an untracked one is not
        // recorded at all, and `tracks` must keep saying so.
        let lost_before = match self.lost_seen.get_mut(&pid) {
            Some(seen) => std::mem::replace(seen, lost_now),
            None => lost_now,
        };
        self.seen
            .entry(pid)
            .or_default()
            .extend(pages.iter().copied());
        TracedWrites {
            pages,
            lost: lost_now > lost_before,
        }
    }

    /// Every page seen written by `pid` since the last call (takes pending records first).
    pub fn pass_window(&mut self, pid: u32) -> HashSet<u64> {
        self.take(pid);
        self.seen.remove(&pid).unwrap_or_default()
    }

    /// Write faults and losses the program counted for `pid` since it was tracked.
    pub fn counters(&self, pid: u32) -> (u64, u64) {
        self.tracer
            .process_counters(pid)
            .ok()
            .flatten()
            .map_or((0, 0), |c| (c.write_faults, c.lost))
    }
}

/// `--dirty ebpf`: the write-fault tracer says which pages were written; PAGEMAP_SCAN only
/// re-arms the write protection that makes every first write fault.
pub struct EbpfSource {
    hub: Rc<RefCell<TracerHub>>,
    arming: Arming,
    /// Pages seen written after the last protection: dirty again next pass.
    carried: HashMap<u32, HashSet<u64>>,
}

impl EbpfSource {
    /// A source over a shared tracer.
    pub fn new(hub: Rc<RefCell<TracerHub>>) -> Self {
        EbpfSource {
            hub,
            arming: Arming::default(),
            carried: HashMap::new(),
        }
    }
}

impl DirtySource for EbpfSource {
    fn mode(&self) -> &'static str {
        "ebpf"
    }

    fn dirty_pages(&mut self, process: &Process, vmas: &[Vma]) -> Result<DirtySet, DirtyError> {
        let pid = process.pid();
        let first_time = !self.hub.borrow().tracks(pid);
        self.hub.borrow_mut().track(pid);
        // Writes up to now; then protect; then writes that raced with protecting, which are
        // dirty now and, since they may land after the read, again next pass.
        let before = self.hub.borrow_mut().take(pid);
        let Some((_, armed)) = self.arming.protect(process, vmas) else {
            return Ok(DirtySet::All);
        };
        let after = self.hub.borrow_mut().take(pid);
        if first_time || before.lost || after.lost || !self.hub.borrow().tracks(pid) {
            self.carried.insert(pid, after.pages);
            return Ok(DirtySet::All);
        }
        let mut written = self.carried.remove(&pid).unwrap_or_default();
        written.extend(before.pages);
        written.extend(after.pages.iter().copied());
        self.carried.insert(pid, after.pages);
        Ok(DirtySet::Only { written, armed })
    }

    fn forget(&mut self, pid: u32) {
        self.arming.forget(pid);
        self.carried.remove(&pid);
        self.hub.borrow_mut().untrack(pid);
    }

    fn remote_syscalls(&self) -> u64 {
        self.arming.remote_syscalls
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_only_marks_everything_dirty_every_time() {
        let mut source = HashOnly;
        let mut child = std::process::Command::new("sleep")
            .arg("10")
            .spawn()
            .unwrap();
        let process = Process::open(child.id()).unwrap();
        for _ in 0..3 {
            let dirty = source.dirty_pages(&process, &[]).unwrap();
            assert!(dirty.contains(0x1000) && dirty.contains(0xdead_0000));
        }
        assert_eq!(source.mode(), "hash-only");
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn only_the_written_pages_of_armed_ranges_are_clean_candidates() {
        let dirty = DirtySet::Only {
            written: [0x1000, 0x3000].into_iter().collect(),
            armed: vec![(0x1000, 0x5000)],
        };
        assert!(dirty.contains(0x1000) && dirty.contains(0x3000), "written");
        assert!(
            !dirty.contains(0x2000) && !dirty.contains(0x4000),
            "armed and not written: clean"
        );
        assert!(
            dirty.contains(0x5000) && dirty.contains(0x0),
            "outside the armed ranges: not provably clean"
        );
    }
}
