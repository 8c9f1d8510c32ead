//! Dirty sources: which pages must be hashed again this pass.
//!
//! This is where rksm differs from KSM. KSM rehashes every candidate on every pass because it
//! has no other way to know a page is unchanged. A dirty source answers that question per
//! target: "every page" (hash-only, KSM's rule), or "these pages, and no others" when it can
//! prove the others clean: after write-protecting them, from the pages the eBPF tracer saw
//! written (ebpf) or from the kernel's own written bits (pagemap). Write protection comes
//! from userfaultfd or from soft-dirty, whichever the kernel offers and the target allows
//! ([`protection`]); each has its own rules for one pass ([`uffd`], [`softdirty`]). The
//! scanner treats a page as clean only when the source says so *and* it has a checksum from
//! a previous pass; the index still compares contents before anything counts. What a source
//! keeps about a target lives in the target's record ([`DirtyState`]); a source itself holds
//! only what all targets share (what the kernel offers, a counter). The tracer's records and
//! the borrower are the daemon's, lent for each call ([`Lent`]).

pub mod protection;
pub(crate) mod softdirty;
pub(crate) mod uffd;

use std::collections::HashSet;

use rksm_common::PAGE_SIZE;

use self::{
    protection::{Offer, WriteProtect},
    softdirty::{Found, SoftDirtyArming, Stop},
    uffd::NotArmed,
};
use crate::{
    ebpf::recorder::{Recorder, TracerState},
    kernel::{
        limits,
        process::Process,
        procfs::{self, Vma},
        ranges::{Range, RangeSet},
        remote::{Borrower, RemoteRefusal},
        userfaultfd::Armed,
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

/// Why a target that took up userfaultfd itself is not write-protected with one by rksm.
const TOOK_UP_USERFAULTFD: &str =
    "it took up userfaultfd itself, and rksm gave its own up before the process registered";

/// A target's write protection, from its first pass on.
#[derive(Debug, Default)]
enum Arming {
    /// Not chosen yet (or to be chosen again).
    #[default]
    NotYet,
    /// A userfaultfd registered over its VMAs.
    Userfaultfd(Armed),
    /// Its soft-dirty bits (boxed: most of what they keep is only for soft-dirty targets).
    SoftDirty(Box<SoftDirtyArming>),
    /// Nothing offered or allowed works for it: hashed in full.
    Unprotected,
}

/// What the dirty sources keep about one target between passes. It lives in the target's
/// record, so it goes with the target: the userfaultfd closes and the kernel unregisters.
#[derive(Debug, Default)]
pub struct DirtyState {
    arming: Arming,
    /// The source it got, and why (or why none).
    protection: (WriteProtect, String),
    /// Sources that failed for it for good, with why.
    failed: Vec<(WriteProtect, String)>,
    /// Why its soft-dirty bits must not be cleared, found after soft-dirty was chosen.
    soft_dirty_refused: Option<String>,
    /// What the tracer recorder keeps about the target.
    pub tracer: TracerState,
    /// Pages seen written after the last protection: dirty again next pass.
    carried: HashSet<u64>,
    /// Why the target is tracked exactly (every armed page's written bit each pass) rather
    /// than by the tracer: it writes without faulting, as the audit found or a KVM vCPU shows.
    exact: Option<String>,
    /// Written pages the tracer missed and the audit found.
    pub misses: u64,
    /// Where the next audit slice starts.
    audit_cursor: u64,
    /// Pages the last audit found written that no record names: if their content changed,
    /// they were written without a fault.
    pub(crate) unseen: HashSet<u64>,
    /// Pages whose written bit was looked at since the last take.
    bits_read: u64,
    /// Soft-dirty clears, their time and races, under an arming since given up.
    past_clears: (u64, u64, u64),
    /// It could not be armed for want of file descriptors.
    short_of_files: bool,
    /// Borrowing it to arm it found it must never be borrowed (nor read) again.
    refused: Option<RemoteRefusal>,
}

impl DirtyState {
    /// Whether the target's pages are write-protected between passes.
    pub fn armed(&self) -> bool {
        matches!(self.arming, Arming::Userfaultfd(_) | Arming::SoftDirty(_))
    }

    /// The ranges under write protection from now on: a page read in them now is vouched
    /// for at the next pass, unless it was written.
    pub(crate) fn armed_ranges(&self) -> Option<&RangeSet> {
        match &self.arming {
            Arming::Userfaultfd(armed) => Some(armed.armed_ranges()),
            Arming::SoftDirty(bits) => Some(bits.armed_ranges()),
            _ => None,
        }
    }

    /// Which write-protect source the target uses, and why (or why it has none). Before
    /// its first pass: none, "not armed yet".
    pub fn write_protect(&self) -> (WriteProtect, &str) {
        match (&self.arming, self.protection.1.as_str()) {
            (Arming::NotYet, "") => (WriteProtect::None, "not armed yet"),
            (_, why) => (self.protection.0, why),
        }
    }

    /// Soft-dirty clears of the target so far, and the kernel's time for them in
    /// nanoseconds; and the pagemap-mode passes that read it whole because a fault raced
    /// with a clear.
    pub fn soft_dirty_clears(&self) -> (u64, u64, u64) {
        let (n, ns, raced) = self.past_clears;
        match &self.arming {
            Arming::SoftDirty(bits) => {
                let (now, now_ns) = bits.clears();
                (n + now, ns + now_ns, raced + bits.raced())
            }
            _ => (n, ns, raced),
        }
    }

    /// What looking up, reading, checksumming and placing `pages` pages of the target cost
    /// this pass, which soft-dirty weighs against a clear.
    pub(crate) fn note_rehash_cost(&mut self, ns: u64, pages: u64) {
        if let Arming::SoftDirty(bits) = &mut self.arming {
            bits.note_rehash_cost(ns, pages);
        }
    }

    /// Pages whose written bit was looked at since the last call.
    pub(crate) fn take_bits_read(&mut self) -> u64 {
        std::mem::take(&mut self.bits_read)
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
            let how = match self.protection.0 {
                WriteProtect::SoftDirty => "every soft-dirty bit",
                _ => "PAGEMAP_SCAN",
            };
            log::warn!("pid {pid}: tracking its writes with {how} from now on: {why}");
            self.exact = Some(why);
        }
    }

    /// Chooses and sets up the target's write protection if it has none yet; whether it is
    /// protected now.
    fn arm(
        &mut self,
        process: &Process,
        offer: &Offer,
        borrower: &Borrower,
        remote_syscalls: &mut u64,
    ) -> bool {
        let pid = process.pid();
        if matches!(&self.arming, Arming::Userfaultfd(armed) if armed.given_up()) {
            // The guard gave rksm's userfaultfd up for the target's own: never again.
            self.failed
                .push((WriteProtect::Userfaultfd, TOOK_UP_USERFAULTFD.into()));
            self.arming = Arming::NotYet;
            self.protection = (WriteProtect::None, String::new());
        }
        if !matches!(self.arming, Arming::NotYet) {
            return self.armed();
        }
        let plan = offer.plan(pid, self.soft_dirty_refused.as_deref());
        let mut failed = self.failed.clone();
        for source in plan.order.iter().copied() {
            if failed.iter().any(|(s, _)| *s == source) {
                continue;
            }
            let armed = match source {
                WriteProtect::Userfaultfd => match uffd::arm(borrower, process, remote_syscalls) {
                    Ok(armed) => Ok(Arming::Userfaultfd(armed)),
                    Err(NotArmed::Passing) => {
                        self.failed = failed;
                        return false;
                    }
                    Err(NotArmed::Refused(reason)) => {
                        self.refused = Some(reason);
                        self.failed = failed;
                        return false;
                    }
                    Err(NotArmed::ShortOfFiles) => {
                        self.short_of_files(pid);
                        self.failed = failed;
                        return false;
                    }
                    Err(NotArmed::Lasting(why)) => Err(why),
                },
                WriteProtect::SoftDirty
                    if !limits::room_for(process.pidfd(), 1 + limits::PASS_RESERVE) =>
                {
                    self.short_of_files(pid);
                    return false;
                }
                WriteProtect::SoftDirty => match SoftDirtyArming::open(process) {
                    Ok(bits) => Ok(Arming::SoftDirty(Box::new(bits))),
                    Err(e) if e.out_of_files() => {
                        self.short_of_files(pid);
                        return false;
                    }
                    Err(e) if process.has_exited() => {
                        log::debug!("pid {pid}: {e}");
                        return false;
                    }
                    Err(e) => Err(e.to_string()),
                },
                WriteProtect::None => continue,
            };
            match armed {
                Ok(arming) => {
                    let why = plan.why_chosen(source, &failed);
                    log::info!(
                        pid, write_protect = source.as_str();
                        "pid {pid}: write-protected with {source} ({why})"
                    );
                    self.arming = arming;
                    self.protection = (source, why);
                    self.failed = failed;
                    return true;
                }
                Err(why) => failed.push((source, why)),
            }
        }
        let why = plan.why_none(&failed);
        log::warn!(
            pid, write_protect = "none";
            "pid {pid} cannot be write-protected, hashing all its pages every pass: {why}"
        );
        self.arming = Arming::Unprotected;
        self.protection = (WriteProtect::None, why);
        self.failed = failed;
        false
    }

    /// The target could not be write-protected this pass for want of file descriptors: it is
    /// hashed whole until it can be. The daemon counts it and tells the operator.
    fn short_of_files(&mut self, pid: u32) {
        log::debug!("pid {pid}: not write-protected this pass: out of file descriptors");
        self.short_of_files = true;
    }

    /// Why the target must be refused, if arming it found out: the daemon refuses it before
    /// it is read.
    pub fn refused(&self) -> Option<RemoteRefusal> {
        self.refused
    }

    /// Whether the target went without write protection for want of file descriptors since
    /// the last call.
    pub fn take_short_of_files(&mut self) -> bool {
        std::mem::take(&mut self.short_of_files)
    }

    /// Soft-dirty stopped for the target: it is chosen for again next pass (another source,
    /// or none), with soft-dirty left out for `stop`'s reason; after a passing one, soft-dirty
    /// starts over.
    fn stop_soft_dirty(&mut self, pid: u32, stop: Stop) {
        let why = match stop {
            Stop::Gone => return,
            Stop::Passing(why) => {
                log::debug!("pid {pid}: soft-dirty starts over next pass: {why}");
                self.past_clears = self.soft_dirty_clears();
                self.arming = Arming::NotYet;
                self.protection = (WriteProtect::None, String::new());
                return;
            }
            Stop::Refused(why) => {
                self.soft_dirty_refused = Some(why.clone());
                why
            }
            Stop::Failed(why) => {
                self.failed.push((WriteProtect::SoftDirty, why.clone()));
                why
            }
        };
        log::warn!("pid {pid}: no longer clearing its soft-dirty bits: {why}");
        self.past_clears = self.soft_dirty_clears();
        self.arming = Arming::NotYet;
        self.protection = (WriteProtect::None, String::new());
    }
}

/// How the daemon decides which pages to hash again.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum DirtyMode {
    /// ebpf if the tracer loads, else pagemap, where the kernel offers write protection;
    /// hash-only where it offers none.
    #[default]
    Auto,
    /// KSM's rule: rehash everything every pass ([`HashOnly`]).
    HashOnly,
    /// The eBPF write-fault tracer plus write protection, userfaultfd or soft-dirty
    /// ([`EbpfSource`]).
    Ebpf,
    /// Write protection, written bits from the kernel, PAGEMAP_SCAN or soft-dirty bits
    /// ([`PagemapSource`]).
    Pagemap,
}

crate::value_enum_text!(DirtyMode => "dirty mode");

/// Decides, per target and pass, which pages must be rehashed.
pub trait DirtySource {
    /// The pages of `process` (within its scanned `vmas`) written since the previous call
    /// with the same `state`. Sources that arm do it here (borrowing a thread from what is
    /// `lent`), before the pages are read. The
    /// first call for a target must return [`DirtySet::All`] or an empty armed set.
    fn dirty_pages(
        &mut self,
        process: &Process,
        state: &mut DirtyState,
        vmas: &[Vma],
        lent: &mut Lent<'_>,
    ) -> Result<DirtySet, DirtyError>;

    /// System calls made inside targets (to arm them) so far.
    fn remote_syscalls(&self) -> u64 {
        0
    }

    /// Whether it takes each target's tracer records at the target's pass (so that the
    /// daemon, counting copy-on-write breaks after the pass, must not: a write made since
    /// belongs to the next pass's dirty set).
    fn takes_records(&self) -> bool {
        false
    }
}

/// What the daemon, which owns them, lends a dirty source for one call: the borrower that
/// arms a target borrows its thread from, and the tracer's recorder where it is loaded.
pub struct Lent<'a> {
    /// Where threads are borrowed from.
    pub borrower: &'a Borrower,
    /// The tracer's records, if the tracer is loaded.
    pub recorder: Option<&'a mut Recorder>,
}

impl<'a> Lent<'a> {
    /// `borrower` alone, without a tracer (one-off scans, hash-only).
    pub fn borrower(borrower: &'a Borrower) -> Self {
        Lent {
            borrower,
            recorder: None,
        }
    }
}

/// KSM's rule: every candidate is rehashed every pass.
#[derive(Debug, Default, Clone, Copy)]
pub struct HashOnly;

impl DirtySource for HashOnly {
    fn dirty_pages(
        &mut self,
        _process: &Process,
        _state: &mut DirtyState,
        _vmas: &[Vma],
        _lent: &mut Lent<'_>,
    ) -> Result<DirtySet, DirtyError> {
        Ok(DirtySet::All)
    }
}

impl From<Found> for DirtySet {
    fn from(found: Found) -> Self {
        match found.all {
            true => DirtySet::All,
            false => DirtySet::Only {
                written: found.written,
                armed: found.trusted,
            },
        }
    }
}

/// The part of `ranges` to audit this pass: about 1/`passes` of their pages, from `cursor`
/// on, wrapping around, so that every page is audited once every `passes` passes.
pub(crate) fn audit_slice(ranges: &RangeSet, cursor: &mut u64, passes: u32) -> Vec<Range> {
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

/// `--dirty pagemap`: written bits straight from the kernel (PAGEMAP_SCAN, or soft-dirty
/// bits read page by page); the exact reference. With soft-dirty, reading the bits and
/// clearing them are two steps, and the tracer, where it is loaded, names the writes in
/// between ([`softdirty`]); it decides nothing else.
pub struct PagemapSource {
    offer: Offer,
    remote_syscalls: u64,
}

impl PagemapSource {
    /// A source using what `offer` offers, and the tracer's records (lent with each call),
    /// if it is loaded, for the gap between reading soft-dirty bits and clearing them.
    pub fn new(offer: Offer) -> Self {
        PagemapSource {
            offer,
            remote_syscalls: 0,
        }
    }
}

impl DirtySource for PagemapSource {
    fn dirty_pages(
        &mut self,
        process: &Process,
        state: &mut DirtyState,
        vmas: &[Vma],
        lent: &mut Lent<'_>,
    ) -> Result<DirtySet, DirtyError> {
        if !state.arm(
            process,
            &self.offer,
            lent.borrower,
            &mut self.remote_syscalls,
        ) {
            return Ok(DirtySet::All);
        }
        let found = match &mut state.arming {
            Arming::Userfaultfd(armed) => {
                let (written, armed, walked) = uffd::pagemap_pass(armed, vmas);
                state.bits_read += walked;
                return Ok(DirtySet::Only { written, armed });
            }
            Arming::SoftDirty(bits) => {
                let (recorder, tracer, pid) =
                    (&mut lent.recorder, &mut state.tracer, process.pid());
                let mut gap = || {
                    let recorder = recorder.as_deref_mut()?;
                    let taken = recorder.take(pid, tracer);
                    (tracer.tracked() && !taken.lost).then_some(taken.pages)
                };
                let found = bits.pagemap_pass(process, vmas, &mut gap);
                state.bits_read += bits.take_bits_read();
                found
            }
            _ => return Ok(DirtySet::All),
        };
        Ok(match found {
            Ok(found) => found.into(),
            Err(stop) => {
                state.stop_soft_dirty(process.pid(), stop);
                DirtySet::All
            }
        })
    }

    fn remote_syscalls(&self) -> u64 {
        self.remote_syscalls
    }
}

/// Passes over which the audit covers every armed page once, by default. With the default
/// 5 s interval a write the tracer cannot see (get_user_pages: `process_vm_writev`, O_DIRECT,
/// io_uring fixed buffers) is found within 40 s, after which the target is tracked exactly;
/// each pass reads an eighth of the armed pages' written bits, which costs a few nanoseconds
/// a page, where hashing costs hundreds.
pub const DEFAULT_AUDIT_PASSES: u32 = 8;

/// `--dirty ebpf`: the write-fault tracer says which pages were written, and only those are
/// hashed again; an audit compares a rolling slice of the armed pages with the kernel's
/// written bits, so that a write the tracer cannot see is found, rehashed and counted, and
/// its target tracked exactly from then on. With userfaultfd, only the written pages are
/// protected again (`UFFDIO_WRITEPROTECT`); with soft-dirty, a clear protects everything
/// when one is due ([`softdirty`]).
pub struct EbpfSource {
    audit_passes: u32,
    offer: Offer,
    remote_syscalls: u64,
}

impl EbpfSource {
    /// A source over the tracer's records (lent with each call by the daemon, which drains
    /// them between passes), using what `offer` offers, auditing every armed page once every
    /// `audit_passes` passes.
    pub fn new(audit_passes: u32, offer: Offer) -> Self {
        EbpfSource {
            audit_passes,
            offer,
            remote_syscalls: 0,
        }
    }
}

impl DirtySource for EbpfSource {
    fn dirty_pages(
        &mut self,
        process: &Process,
        state: &mut DirtyState,
        vmas: &[Vma],
        lent: &mut Lent<'_>,
    ) -> Result<DirtySet, DirtyError> {
        let pid = process.pid();
        // Without the tracer's records nothing is vouched for.
        let Some(recorder) = lent.recorder.as_deref_mut() else {
            return Ok(DirtySet::All);
        };
        let first_time = !state.tracer.tracked();
        if let Err(e) = recorder.track(pid, &mut state.tracer) {
            log::warn!("tracer cannot track pid {pid}: {e}");
        }
        if first_time && state.exact.is_none() && procfs::holds_kvm(pid) {
            let why = "it holds a KVM vCPU, whose guest writes without faulting";
            log::info!("pid {pid}: tracking its writes exactly: {why}");
            state.exact = Some(why.into());
        }
        // Writes up to now; then protect; then writes that raced with protecting.
        let before = recorder.take(pid, &mut state.tracer);
        let carried = std::mem::take(&mut state.carried);
        if !state.arm(
            process,
            &self.offer,
            lent.borrower,
            &mut self.remote_syscalls,
        ) {
            return Ok(DirtySet::All);
        }
        let DirtyState {
            arming,
            tracer,
            exact,
            audit_cursor,
            ..
        } = state;
        let mut lost_after = false;
        let mut after = || {
            let late = recorder.take(pid, tracer);
            lost_after |= late.lost;
            late.pages
        };
        let audit = (audit_cursor, self.audit_passes);
        let dirty = match arming {
            Arming::Userfaultfd(armed) => {
                let mut recorded = carried;
                recorded.extend(before.pages.iter().copied());
                let (found, late) = uffd::ebpf_pass(
                    pid,
                    armed,
                    vmas,
                    exact.is_some(),
                    recorded,
                    audit,
                    &mut after,
                );
                state.carried = late;
                state.bits_read += found.walked;
                if let Some(unseen) = found.unseen {
                    state.unseen = unseen;
                }
                DirtySet::Only {
                    written: found.written,
                    armed: found.trusted,
                }
            }
            Arming::SoftDirty(bits) => {
                let found = bits.ebpf_pass(
                    process,
                    vmas,
                    exact.is_some(),
                    &before.pages,
                    audit,
                    &mut after,
                );
                state.bits_read += bits.take_bits_read();
                match found {
                    Ok(mut found) => {
                        state.unseen = std::mem::take(&mut found.unseen);
                        found.into()
                    }
                    Err(stop) => {
                        state.stop_soft_dirty(pid, stop);
                        DirtySet::All
                    }
                }
            }
            _ => DirtySet::All,
        };
        if first_time || before.lost || lost_after || !state.tracer.tracked() {
            return Ok(DirtySet::All);
        }
        Ok(dirty)
    }

    fn remote_syscalls(&self) -> u64 {
        self.remote_syscalls
    }

    fn takes_records(&self) -> bool {
        true
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
                .dirty_pages(
                    &process,
                    &mut DirtyState::default(),
                    &[],
                    &mut Lent::borrower(&Borrower::new()),
                )
                .unwrap();
            assert_eq!(dirty, DirtySet::All);
        }
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
