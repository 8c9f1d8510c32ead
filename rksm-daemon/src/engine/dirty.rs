//! Dirty sources: which pages must be hashed again this pass.
//!
//! This is where rksm differs from KSM. KSM rehashes every candidate on every pass because it
//! has no other way to know a page is unchanged. A dirty source answers that question per
//! target: "every page" (hash-only, KSM's rule), or "these pages, and no others" when it can
//! prove the others clean (the eBPF tracer, or PAGEMAP_SCAN, after write-protecting). The
//! scanner treats a page as clean only when the source says so *and* it has a checksum from a
//! previous pass; the index still compares contents before anything counts. What a source
//! keeps about a target lives in the target's record ([`DirtyState`]); a source itself holds
//! only what all targets share (the recorder, a counter).

use std::{cell::RefCell, collections::HashSet, rc::Rc};

use rksm_common::PAGE_SIZE;

use crate::{
    ebpf::recorder::{Recorder, TracerState},
    kernel::{
        arming::{ArmError, Armed},
        process::Process,
        procfs::{self, Vma},
        ranges::{Range, RangeSet},
        remote::{RemoteError, RemoteSession},
    },
};

/// The pages a source says were written since the previous pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DirtySet {
    /// Treat every page as written (hash-only mode, or the source lost track).
    All,
    /// Inside `armed` (ranges that were write-protected when last hashed), only `written`
    /// pages were written; pages outside `armed` are not provably clean.
    Only {
        /// Pages written since the previous pass.
        written: HashSet<u64>,
        /// Ranges under write protection.
        armed: RangeSet,
    },
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

/// A target's write-protect arming, from its first pass on.
#[derive(Debug, Default)]
enum Arming {
    /// Not tried yet.
    #[default]
    NotYet,
    /// Armed: a userfaultfd registered over its VMAs.
    Armed(Armed),
    /// Arming failed (refused, no userfaultfd): not tried again; hashed in full.
    Failed,
}

/// What the dirty sources keep about one target between passes. It lives in the target's
/// record, so it goes with the target: the userfaultfd closes and the kernel unregisters.
#[derive(Debug, Default)]
pub struct DirtyState {
    arming: Arming,
    /// What the tracer recorder keeps about the target.
    pub tracer: TracerState,
    /// Pages seen written after the last protection: dirty again next pass.
    carried: HashSet<u64>,
    /// Why the target is tracked exactly (by PAGEMAP_SCAN over every armed page) rather than
    /// by the tracer: it writes without faulting, as the audit found or a KVM vCPU shows.
    exact: Option<String>,
    /// Written pages the tracer missed and the audit found.
    pub misses: u64,
    /// Where the next audit slice starts.
    audit_cursor: u64,
    /// Pages the last audit found written that no record names: if their content changed,
    /// they were written without a fault.
    pub(crate) unseen: HashSet<u64>,
}

impl DirtyState {
    /// Whether the target's pages are write-protected between passes.
    pub fn armed(&self) -> bool {
        matches!(self.arming, Arming::Armed(_))
    }

    /// The ranges under write protection from now on: a page read in them now is vouched
    /// for at the next pass, unless it was written.
    pub(crate) fn armed_ranges(&self) -> Option<&RangeSet> {
        match &self.arming {
            Arming::Armed(armed) => Some(armed.armed_ranges()),
            _ => None,
        }
    }

    /// Why the tracer is not trusted for this target, if it is not.
    pub fn exact(&self) -> Option<&str> {
        self.exact.as_deref()
    }

    /// Counts `missed` pages written without a fault (their content changed, and no record
    /// names them), and tracks the target exactly from now on, saying why once.
    pub(crate) fn note_misses(&mut self, pid: u32, missed: u64) {
        if missed == 0 {
            return;
        }
        self.misses += missed;
        if self.exact.is_none() {
            let why = format!(
                "the kernel saw {missed} page(s) written that the tracer did not (writes \
                 without a fault: process_vm_writev, O_DIRECT, io_uring, a KVM guest)"
            );
            log::warn!("pid {pid}: tracking its writes with PAGEMAP_SCAN from now on: {why}");
            self.exact = Some(why);
        }
    }
}

/// Decides, per target and pass, which pages must be rehashed.
pub trait DirtySource {
    /// The mode's name as the command line spells it (`hash-only`, `ebpf`, `pagemap`).
    fn mode(&self) -> &'static str;

    /// The pages of `process` (within its scanned `vmas`) written since the previous call
    /// with the same `state`. Sources that arm do it here, before the pages are read. The
    /// first call for a target must return [`DirtySet::All`] or an empty armed set.
    fn dirty_pages(
        &mut self,
        process: &Process,
        state: &mut DirtyState,
        vmas: &[Vma],
    ) -> Result<DirtySet, DirtyError>;

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

    fn dirty_pages(
        &mut self,
        _process: &Process,
        _state: &mut DirtyState,
        _vmas: &[Vma],
    ) -> Result<DirtySet, DirtyError> {
        Ok(DirtySet::All)
    }
}

/// What protecting one target found: the pages written since the previous protection, and
/// the ranges that were under protection all along (only their clean pages can be trusted).
pub type Protected = (HashSet<u64>, RangeSet);

/// Arms `process` if it is not yet; the arming, or `None` if it cannot be armed.
fn armed<'s>(
    process: &Process,
    arming: &'s mut Arming,
    remote_syscalls: &mut u64,
) -> Option<&'s mut Armed> {
    if let Arming::NotYet = arming {
        let armed = RemoteSession::begin(process)
            .map_err(ArmError::from)
            .and_then(|mut session| {
                let armed = Armed::arm(process, &mut session);
                *remote_syscalls += session.calls();
                session.finish()?;
                armed
            });
        *arming = match armed {
            Ok(armed) => Arming::Armed(armed),
            // Exited or exec'd since it was opened: the next pass sees to it. A thread that
            // did not stop in time, or a passing reason to refuse: the next pass tries again.
            Err(ArmError::Remote(
                RemoteError::Gone(_)
                | RemoteError::NewImage(_)
                | RemoteError::NoStop { .. }
                | RemoteError::Unsettled(_),
            )) => return None,
            Err(ArmError::Remote(RemoteError::Refused { reason, .. })) if !reason.is_lasting() => {
                return None
            }
            Err(e) => {
                log::warn!(
                    "pid {} cannot be write-protected, hashing all its pages every pass: {e}",
                    process.pid()
                );
                Arming::Failed
            }
        };
    }
    match arming {
        Arming::Armed(armed) => Some(armed),
        _ => None,
    }
}

/// Arms `process` if it is not yet, registers new VMAs, write-protects every armed page, and
/// returns the pages written since the previous call with the armed ranges; `None` if it
/// cannot be armed.
fn protect(
    process: &Process,
    state: &mut DirtyState,
    vmas: &[Vma],
    remote_syscalls: &mut u64,
) -> Option<Protected> {
    let armed = armed(process, &mut state.arming, remote_syscalls)?;
    // Only ranges armed *before* this call (and still armed after protecting, which finds
    // ranges that lost their registration) have pages whose cleanliness can be trusted.
    armed.forget_lost(vmas);
    let before = armed.armed_ranges().clone();
    armed.register(vmas);
    let written = armed.protect();
    let trusted = before.intersection(armed.armed_ranges());
    Some((written, trusted))
}

/// The part of `ranges` to audit this pass: about 1/`passes` of their pages, from `cursor`
/// on, wrapping around, so that every page is audited once every `passes` passes.
fn audit_slice(ranges: &RangeSet, cursor: &mut u64, passes: u32) -> Vec<Range> {
    let all = ranges.as_slice();
    let total = ranges.pages();
    if total == 0 {
        return Vec::new();
    }
    let mut budget = total.div_ceil(u64::from(passes.max(1)));
    // Start at the cursor, or over from the first range once past the last one (the ranges
    // may also have shrunk under it).
    let (first, from) = match all.partition_point(|r| r.end <= *cursor) {
        i if i == all.len() => (0, all[0].start),
        i => (i, (*cursor).max(all[i].start)),
    };
    let mut slice = Vec::new();
    // Once around at most: from the cursor to the end, then from the beginning back to it.
    for k in 0..=all.len() {
        if budget == 0 {
            break;
        }
        let r = all[(first + k) % all.len()];
        let start = if k == 0 { from } else { r.start };
        let end = if k == all.len() { from } else { r.end };
        let take = (end.saturating_sub(start) / PAGE_SIZE).min(budget);
        if take == 0 {
            continue;
        }
        let taken_end = start + take * PAGE_SIZE;
        slice.push(Range::new(start, taken_end));
        budget -= take;
        *cursor = taken_end;
    }
    slice.sort_unstable_by_key(|r| r.start);
    let mut set = RangeSet::default();
    set.union(&slice);
    set.as_slice().to_vec()
}

/// `--dirty pagemap`: written bits straight from PAGEMAP_SCAN; the exact reference.
#[derive(Debug, Default)]
pub struct PagemapSource {
    remote_syscalls: u64,
}

impl DirtySource for PagemapSource {
    fn mode(&self) -> &'static str {
        "pagemap"
    }

    fn dirty_pages(
        &mut self,
        process: &Process,
        state: &mut DirtyState,
        vmas: &[Vma],
    ) -> Result<DirtySet, DirtyError> {
        Ok(
            match protect(process, state, vmas, &mut self.remote_syscalls) {
                Some((written, armed)) => DirtySet::Only { written, armed },
                None => DirtySet::All,
            },
        )
    }

    fn remote_syscalls(&self) -> u64 {
        self.remote_syscalls
    }
}

/// Passes over which the audit covers every armed page once, by default. With the default
/// 5 s interval a write the tracer cannot see (get_user_pages: `process_vm_writev`, O_DIRECT,
/// io_uring fixed buffers) is found within 40 s, after which the target is tracked exactly;
/// each pass walks an eighth of the armed pages with PAGEMAP_SCAN, a page-table walk that
/// costs a few nanoseconds a page, where hashing costs hundreds.
pub const DEFAULT_AUDIT_PASSES: u32 = 8;

/// `--dirty ebpf`: the write-fault tracer says which pages were written, and only those are
/// write-protected again (`UFFDIO_WRITEPROTECT`); an audit compares a rolling slice of the
/// armed pages with the kernel's written bits, so that a write the tracer cannot see is
/// found, rehashed and counted, and its target tracked exactly from then on.
pub struct EbpfSource {
    recorder: Rc<RefCell<Recorder>>,
    audit_passes: u32,
    remote_syscalls: u64,
}

impl EbpfSource {
    /// A source over a recorder shared with the daemon (which drains it between passes),
    /// auditing every armed page once every `audit_passes` passes.
    pub fn new(recorder: Rc<RefCell<Recorder>>, audit_passes: u32) -> Self {
        EbpfSource {
            recorder,
            audit_passes,
            remote_syscalls: 0,
        }
    }
}

impl DirtySource for EbpfSource {
    fn mode(&self) -> &'static str {
        "ebpf"
    }

    fn dirty_pages(
        &mut self,
        process: &Process,
        state: &mut DirtyState,
        vmas: &[Vma],
    ) -> Result<DirtySet, DirtyError> {
        let pid = process.pid();
        let first_time = !state.tracer.tracked();
        if let Err(e) = self.recorder.borrow_mut().track(pid, &mut state.tracer) {
            log::warn!("tracer cannot track pid {pid}: {e}");
        }
        if first_time && state.exact.is_none() && procfs::holds_kvm(pid) {
            let why = "it holds a KVM vCPU, whose guest writes without faulting";
            log::info!("pid {pid}: tracking its writes with PAGEMAP_SCAN: {why}");
            state.exact = Some(why.into());
        }
        // Writes up to now; then protect; then writes that raced with protecting, which are
        // dirty now and, since they may land after the read, again next pass.
        let before = self.recorder.borrow_mut().take(pid, &mut state.tracer);
        let carried = std::mem::take(&mut state.carried);
        let Some(armed) = armed(process, &mut state.arming, &mut self.remote_syscalls) else {
            return Ok(DirtySet::All);
        };
        armed.forget_lost(vmas);
        let armed_before = armed.armed_ranges().clone();
        armed.register(vmas);
        let mut written: HashSet<u64>;
        let audit;
        if state.exact.is_some() {
            written = armed.protect();
            audit = None;
        } else {
            // Newly registered memory is protected for the first time; what was written
            // since the last pass is protected again; a slice is audited.
            let new = armed_before.minus(armed.armed_ranges().as_slice());
            armed.scan_written(&new);
            written = carried;
            written.extend(before.pages.iter().copied());
            armed.reprotect(&written);
            let vouched = armed_before.intersection(armed.armed_ranges());
            let slice = audit_slice(&vouched, &mut state.audit_cursor, self.audit_passes);
            audit = Some(armed.scan_written(&slice));
        }
        let trusted = armed_before.intersection(armed.armed_ranges());
        let after = self.recorder.borrow_mut().take(pid, &mut state.tracer);
        written.extend(after.pages.iter().copied());
        if let Some(audit) = audit {
            // Every fault is recorded before the kernel makes its page writable, so a page
            // the audit saw written is in the records taken by now, unless it was written
            // without a fault.
            let mut unseen: Vec<u64> = audit
                .pages
                .iter()
                .copied()
                .filter(|p| !written.contains(p) && !audit.zero_page.contains(p))
                .collect();
            unseen.sort_unstable();
            // ksmd merging a page maps the KSM page without the protection: neither a write
            // nor a change of content.
            let merged = procfs::ksm_mapped(pid, &unseen);
            written.extend(audit.pages.into_iter().filter(|p| !merged.contains(p)));
            // The scan rehashes them; those whose content changed are misses. (ksmd's own
            // copy-on-write of a page it failed to merge writes it without a fault, with the
            // same bytes: no miss.)
            state.unseen = unseen.into_iter().filter(|p| !merged.contains(p)).collect();
        }
        state.carried = after.pages;
        if first_time || before.lost || after.lost || !state.tracer.tracked() {
            return Ok(DirtySet::All);
        }
        Ok(DirtySet::Only {
            written,
            armed: trusted,
        })
    }

    fn remote_syscalls(&self) -> u64 {
        self.remote_syscalls
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
            let dirty = source
                .dirty_pages(&process, &mut DirtyState::default(), &[])
                .unwrap();
            assert_eq!(dirty, DirtySet::All);
        }
        assert_eq!(source.mode(), "hash-only");
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn the_audit_covers_every_page_once_per_cycle_and_starts_over() {
        let p = PAGE_SIZE;
        let mut ranges = RangeSet::default();
        ranges.insert(Range::new(p, 5 * p));
        ranges.insert(Range::new(16 * p, 18 * p));
        let mut cursor = 0;
        let mut seen: Vec<u64> = Vec::new();
        for _ in 0..3 {
            let slice = audit_slice(&ranges, &mut cursor, 3);
            assert_eq!(slice.iter().map(Range::pages).sum::<u64>(), 2, "{slice:?}");
            seen.extend(
                slice
                    .iter()
                    .flat_map(|r| (r.start..r.end).step_by(p as usize)),
            );
        }
        seen.sort_unstable();
        assert_eq!(seen, [1, 2, 3, 4, 16, 17].map(|i| i * p), "each page once");
        // Past the last range: over from the first.
        assert_eq!(audit_slice(&ranges, &mut cursor, 3), [Range::new(p, 3 * p)]);
        // A cursor inside a range wraps around back to itself, never past it.
        let mut cursor = 3 * p;
        let all = audit_slice(&ranges, &mut cursor, 1);
        assert_eq!(all.iter().map(Range::pages).sum::<u64>(), 6, "{all:?}");
        // The ranges shrank under the cursor.
        let mut cursor = 100 * p;
        assert_eq!(audit_slice(&ranges, &mut cursor, 6), [Range::new(p, 2 * p)]);
    }
}
