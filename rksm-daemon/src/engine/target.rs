//! The target record: everything rksm keeps about one process, in one place.
//!
//! A process becomes a target when it is adopted, and everything rksm learns about it from
//! then on lives here: who it is (a pidfd, its start time and image), which merge domain it
//! is in, its arming and tracer state, the checksums of its pages, what is marked and merged
//! in it, and its counters. The rules that tie these together (a page that changes is no
//! longer a verified duplicate, a write to a merged page is a copy-on-write break) are its
//! methods, so no other file touches its fields. The daemon owns the records (with its own
//! policy for each next to it) and lends them to the scan and the marking for a call. When a
//! target is dropped, all of it goes at once: nothing about a process outlives its record,
//! and since the record holds a pidfd, nothing in it can ever describe a later process that
//! reuses the pid.
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{
    engine::{
        dirty::{protection::WriteProtect, DirtyState},
        keys::PageSet,
        pages::{PageInfo, PageState, TakenHeld},
    },
    kernel::{
        process::{Process, ProcessId},
        procfs::Vma,
        ranges::{Range, RangeSet},
    },
};

/// A target's counters, for status and metrics (the last pass's readings, and totals).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TargetCounters {
    /// Pages whose checksum changed since the previous pass (last pass).
    pub pages_volatile: u64,
    /// Pages marked mergeable.
    pub pages_marked: u64,
    /// Pages read and checksummed, all passes.
    pub pages_hashed: u64,
    /// Pages proven clean and not read, all passes.
    pub pages_skipped_clean: u64,
    /// Write faults the tracer counted since the target was tracked.
    pub write_faults: u64,
    /// Writes the tracer saw on merged pages.
    pub cow_breaks: u64,
    /// Written pages the tracer missed and the audit found (ebpf mode); any makes the
    /// target tracked exactly from then on.
    pub dirty_misses: u64,
    /// Clears of its soft-dirty bits.
    #[serde(default)]
    pub soft_dirty_clears: u64,
    /// Time the kernel took for them, in nanoseconds.
    #[serde(default)]
    pub soft_dirty_clear_ns: u64,
    /// Passes that read it whole because a fault raced with a clear (pagemap mode, where
    /// the tracer could not vouch for it).
    #[serde(default)]
    pub soft_dirty_clear_races: u64,
}

/// What the last pass found in a target, kept in its record for the marking that follows:
/// the scan finds some of it while reading other targets (a duplicate's company), so it is
/// handed to each record once the pass ends.
#[derive(Debug, Default)]
pub struct Finds {
    /// Verified duplicates found, with their checksums.
    pub candidates: Vec<(u64, u64)>,
    /// Pages found mapped to KSM frames.
    pub ksm_pages: Vec<u64>,
    /// The checksums of those pages' contents.
    pub ksm_checksums: Vec<u64>,
    /// The VMAs it scanned, and how many VMAs it has in all; `None` if it was not scanned.
    pub vmas: Option<(Vec<Vma>, usize)>,
}

/// Everything kept about one process.
#[derive(Debug)]
pub struct Target {
    process: Process,
    domain: u32,
    domain_name: String,
    /// Arming and tracer state: what the dirty source needs to prove pages clean.
    dirty: DirtyState,
    /// What is known of its present pages: checksums, and which are in the index.
    pages: PageState,
    /// Ranges marked mergeable in it.
    marked: RangeSet,
    /// Pages mapped to KSM frames at the last pass.
    merged: PageSet,
    /// Verified duplicates not yet marked, with their checksum, in address order: marking
    /// takes them in that order, and a first pass finds hundreds of thousands at once, which
    /// are built into the tree in one go rather than hashed one by one and sorted after.
    candidates: BTreeMap<u64, u64>,
    /// What the last pass found in it, until the marking takes it.
    finds: Finds,
    /// Counters.
    counters: TargetCounters,
    /// Left out of this pass (a passing reason: stopped, traced for a moment).
    skipped: bool,
}

impl Target {
    /// Adopts `process` into merge domain `domain` (named `domain_name` for people).
    pub fn adopt(process: Process, domain: u32, domain_name: String) -> Self {
        Target {
            process,
            domain,
            domain_name,
            dirty: DirtyState::default(),
            pages: PageState::default(),
            marked: RangeSet::default(),
            merged: PageSet::default(),
            candidates: BTreeMap::new(),
            finds: Finds::default(),
            counters: TargetCounters::default(),
            skipped: false,
        }
    }

    /// A target in the single domain 0, for one-off scans (`rksm estimate`, tests).
    pub fn new(process: Process) -> Self {
        Target::adopt(process, 0, "all".into())
    }

    /// The process.
    pub fn process(&self) -> &Process {
        &self.process
    }

    /// The process, with the dirty state to update while looking at it.
    pub fn process_and_dirty(&mut self) -> (&Process, &mut DirtyState) {
        (&self.process, &mut self.dirty)
    }

    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// Its identity: pid and start time, which no later process shares.
    pub fn id(&self) -> ProcessId {
        self.process.id()
    }

    /// Its merge domain.
    pub fn domain(&self) -> u32 {
        self.domain
    }

    /// Its merge domain's name.
    pub fn domain_name(&self) -> &str {
        &self.domain_name
    }

    /// Why its writes are tracked exactly (every armed page's written bit, each pass)
    /// rather than by the tracer, if they are: the audit found writes without a fault, or
    /// it holds a KVM vCPU.
    pub fn exact_tracking(&self) -> Option<&str> {
        self.dirty.exact()
    }

    /// Which write-protect source it uses, and why (or why it has none).
    pub fn write_protect(&self) -> (WriteProtect, &str) {
        self.dirty.write_protect()
    }

    /// Its counters.
    pub fn counters(&self) -> &TargetCounters {
        &self.counters
    }

    /// Whether it sits this pass out.
    pub fn skipped(&self) -> bool {
        self.skipped
    }

    /// Leaves it out of this pass only: it keeps its arming, its tracer and its checksums,
    /// so the next pass takes it up where it was.
    pub fn skip_this_pass(&mut self) {
        self.skipped = true;
    }

    /// Starts a new pass: a target skipped last time is back in, and nothing found by an
    /// earlier pass is left for this one's marking.
    pub fn refresh(&mut self) {
        self.skipped = false;
        self.forget_finds();
    }

    /// Lets go of what the last pass found (the marking took what it needed): the VMAs it
    /// saw are not kept between passes.
    pub fn forget_finds(&mut self) {
        self.finds = Finds::default();
    }

    /// What this pass found in it (it replaces an earlier pass's).
    pub fn found(&mut self, finds: Finds) {
        self.finds = finds;
    }

    /// The pages this pass found mapped to KSM frames are merged: a write to one breaks it.
    /// (After the writes since the last pass were counted: [`Target::break_merges`].)
    pub fn take_up_ksm_pages_found(&mut self) {
        let found = std::mem::take(&mut self.finds.ksm_pages);
        self.merged.extend(found);
    }

    /// The checksums of the contents this pass found merged in it, to claim for its domain.
    pub fn take_ksm_checksums_found(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.finds.ksm_checksums)
    }

    /// The verified duplicates this pass found become candidates, until they are marked,
    /// written or unmapped.
    pub fn take_up_candidates_found(&mut self) {
        let found = std::mem::take(&mut self.finds.candidates);
        self.add_candidates(found);
    }

    /// The VMAs this pass scanned, and how many it has in all, if it was scanned.
    pub fn vmas_scanned(&self) -> Option<(&[Vma], usize)> {
        self.finds.vmas.as_ref().map(|(v, n)| (v.as_slice(), *n))
    }

    /// Its arming and tracer state.
    pub fn dirty(&self) -> &DirtyState {
        &self.dirty
    }

    /// Its arming and tracer state, to update.
    pub fn dirty_mut(&mut self) -> &mut DirtyState {
        &mut self.dirty
    }

    /// What is known of its present pages.
    pub fn pages(&self) -> &PageState {
        &self.pages
    }

    /// What is known of its present pages, to update. Taking a page out of it is the
    /// caller's business with the index; what that means for the page's merge state is
    /// [`Target::page_gone`]'s and [`Target::page_changed`]'s.
    pub fn pages_mut(&mut self) -> &mut PageState {
        &mut self.pages
    }

    /// The duplicates held at its last pass, to put through the gate, with their checksums:
    /// found when their page was first read, they become candidates at the next pass if
    /// they are still in the index with company then (that is, neither they nor their class
    /// were written: the checksum gate, kept by the dirty bit instead of by hashing again).
    /// Its pages hold them ([`PageState::hold`]).
    pub fn take_held(&mut self) -> TakenHeld<'_> {
        self.pages.take_held()
    }

    /// Forgets every page (the process is dropped, or its scan failed half-way and it is read
    /// in full next time); returns them, for the index.
    pub fn forget_pages(&mut self) -> Vec<(u64, PageInfo)> {
        self.pages.clear()
    }

    /// The page at `addr` was unmapped: it is neither merged nor a candidate any more.
    pub fn page_gone(&mut self, addr: u64) {
        self.merged.remove(addr);
        self.candidates.remove(&addr);
    }

    /// The page at `addr` may have changed: it is no longer a verified duplicate. (Whether a
    /// merge broke is the tracer's to say: [`Target::break_merges`].)
    pub fn page_changed(&mut self, addr: u64) {
        self.candidates.remove(&addr);
    }

    /// The ranges marked mergeable in it.
    pub fn marked(&self) -> &RangeSet {
        &self.marked
    }

    /// `runs` were marked mergeable.
    pub fn note_marked(&mut self, runs: &[Range]) {
        self.marked.union(runs);
    }

    /// `runs` were marked unmergeable again.
    pub fn note_unmarked(&mut self, runs: &[Range]) {
        self.marked.remove(runs);
    }

    /// Whether `page` was merged (or handed to ksmd to merge) at the last pass.
    pub fn is_merged(&self, page: u64) -> bool {
        self.merged.contains(page)
    }

    /// `pages` are merged, or handed to ksmd to merge: a write to one breaks a merge.
    pub fn note_merged(&mut self, pages: impl IntoIterator<Item = u64>) {
        self.merged.extend(pages);
    }

    /// The tracer saw `written` pages written: those that were merged are no longer, and
    /// count as copy-on-write breaks. Returns them.
    pub fn break_merges(&mut self, written: impl IntoIterator<Item = u64>) -> Vec<u64> {
        let broken: Vec<u64> = written
            .into_iter()
            .filter(|&page| self.merged.remove(page))
            .collect();
        self.counters.cow_breaks += broken.len() as u64;
        broken
    }

    /// Verified duplicates found, with their checksums: candidates until they are marked,
    /// written or unmapped.
    pub fn add_candidates(&mut self, pages: impl IntoIterator<Item = (u64, u64)>) {
        if self.candidates.is_empty() {
            self.candidates = pages.into_iter().collect();
        } else {
            self.candidates.extend(pages);
        }
    }

    /// Whether it has candidates not yet marked.
    pub fn has_candidates(&self) -> bool {
        !self.candidates.is_empty()
    }

    /// Its candidates not yet marked, with their checksums, in address order (those marked
    /// meanwhile, by it or by rksm, leave).
    pub fn unmarked_candidates(&mut self) -> Vec<(u64, u64)> {
        self.drop_marked_candidates();
        self.candidates.iter().map(|(&p, &s)| (p, s)).collect()
    }

    /// After marking: the candidates now marked leave.
    pub fn settle_candidates(&mut self) {
        self.drop_marked_candidates();
    }

    /// Candidates that are marked now (by rksm, or by the process itself) are candidates no
    /// longer.
    fn drop_marked_candidates(&mut self) {
        let marked = &self.marked;
        let runs = marked.as_slice();
        // Those in marked runs, in address order, found from the smaller side: a few
        // candidates among many runs (a steady pass), or many candidates in a few runs.
        let leaving: Vec<u64> = if self.candidates.len() <= runs.len() {
            let candidates = self.candidates.keys().copied();
            candidates.filter(|&page| marked.contains(page)).collect()
        } else {
            let in_run = |r: &Range| self.candidates.range(r.start..r.end).map(|(&p, _)| p);
            runs.iter().flat_map(in_run).collect()
        };
        if leaving.len() == self.candidates.len() {
            self.candidates.clear();
        } else if leaving.len() > self.candidates.len() / 2 {
            // Most leave (a first pass's many, marked at once): the tree is built anew from
            // those left, in one go, rather than have them taken out one by one.
            let mut leaving = leaving.into_iter().peekable();
            self.candidates = std::mem::take(&mut self.candidates)
                .into_iter()
                .filter(|&(page, _)| leaving.next_if_eq(&page).is_none())
                .collect();
        } else {
            for page in leaving {
                self.candidates.remove(&page);
            }
        }
    }

    /// Its counters after a pass in which `volatile` of its pages changed, `hashed` were read
    /// and `skipped_clean` proven clean.
    pub fn count_pass(&mut self, volatile: u64, hashed: u64, skipped_clean: u64) {
        let c = &mut self.counters;
        c.pages_volatile = volatile;
        c.pages_hashed += hashed;
        c.pages_skipped_clean += skipped_clean;
        c.dirty_misses = self.dirty.misses;
        c.pages_marked = self.marked.pages();
    }

    /// Takes up the dirty source's soft-dirty counts; returns how much each grew since the
    /// last call (clears, nanoseconds, races).
    pub fn count_soft_dirty_clears(&mut self) -> (u64, u64, u64) {
        let (clears, ns, races) = self.dirty.soft_dirty_clears();
        let c = &mut self.counters;
        let grown = (
            clears.saturating_sub(c.soft_dirty_clears),
            ns.saturating_sub(c.soft_dirty_clear_ns),
            races.saturating_sub(c.soft_dirty_clear_races),
        );
        (
            c.soft_dirty_clears,
            c.soft_dirty_clear_ns,
            c.soft_dirty_clear_races,
        ) = (clears, ns, races);
        grown
    }

    /// The tracer counted `faults` write faults in it.
    pub fn count_write_faults(&mut self, faults: u64) {
        self.counters.write_faults = faults;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::process::Sleeper;

    const PAGE: u64 = 4096;

    /// A target (a sleeping child) with candidates at pages `pages` of an arena.
    fn with_candidates(pages: impl IntoIterator<Item = u64>) -> (Sleeper, Target) {
        let child = Sleeper::spawn();
        let process = Process::open(child.pid()).expect("the child");
        let mut target = Target::adopt(process, 0, "test".into());
        target.add_candidates(pages.into_iter().map(|i| (i * PAGE, i + 100)));
        (child, target)
    }

    fn run(first: u64, end: u64) -> Range {
        Range::new(first * PAGE, end * PAGE)
    }

    fn listed(target: &mut Target) -> Vec<u64> {
        target
            .unmarked_candidates()
            .into_iter()
            .map(|(addr, checksum)| {
                assert_eq!(
                    checksum,
                    addr / PAGE + 100,
                    "a candidate keeps its checksum"
                );
                addr / PAGE
            })
            .collect()
    }

    #[test]
    fn candidates_are_listed_in_address_order_and_leave_once_marked() {
        // Found out of order, some twice (a page and the copy it was paired with).
        let (_child, mut target) = with_candidates([9, 3, 7, 3, 1, 9, 5]);
        assert_eq!(listed(&mut target), [1, 3, 5, 7, 9]);
        // A few leave: taken out one by one.
        target.note_marked(&[run(3, 4)]);
        assert_eq!(listed(&mut target), [1, 5, 7, 9]);
        // Most leave: the rest are kept.
        target.note_marked(&[run(5, 10)]);
        assert_eq!(listed(&mut target), [1]);
        target.add_candidates([(20 * PAGE, 120), (2 * PAGE, 102)]);
        assert_eq!(listed(&mut target), [1, 2, 20]);
        // All leave.
        target.note_marked(&[run(0, 30)]);
        target.settle_candidates();
        assert!(!target.has_candidates());
        assert!(listed(&mut target).is_empty());
    }

    #[test]
    fn a_few_candidates_among_many_marked_runs_leave_as_many_do() {
        let (_child, mut target) = with_candidates([101, 205, 300, 402]);
        // Forty runs of one page, every tenth page: more runs than candidates.
        let runs: Vec<Range> = (0..40).map(|i| run(i * 10 + 1, i * 10 + 2)).collect();
        target.note_marked(&runs);
        assert_eq!(
            listed(&mut target),
            [205, 300, 402],
            "only 101 was in a run"
        );
        target.note_marked(&[run(300, 301), run(402, 403)]);
        assert_eq!(listed(&mut target), [205]);
        target.note_marked(&[run(205, 206)]);
        assert_eq!(listed(&mut target), Vec::<u64>::new());
    }

    #[test]
    fn a_page_written_or_gone_is_a_candidate_no_longer() {
        let (_child, mut target) = with_candidates(0..6);
        target.page_changed(2 * PAGE);
        target.page_gone(4 * PAGE);
        assert_eq!(listed(&mut target), [0, 1, 3, 5]);
    }
}
