//! Marking: the verified duplicates of each target handed to ksmd (in pid order, each
//! decided from its domain's own history), the copy-on-write breaks counted, and the regions
//! whose merged pages keep breaking backed off.

use std::collections::HashSet;

use super::{backoff::REGION_SHIFT, Daemon};
use crate::{
    engine::{merge::Run, scan::PassReport},
    kernel::{ranges::Range, remote::RemoteError},
};

impl Daemon {
    /// Step 4: counts writes the tracer saw on pages that were merged at the previous pass,
    /// and backs off the regions they happened in.
    pub(super) fn account_cow_breaks(&mut self, report: &PassReport, now: u64) -> u64 {
        let mut breaks = 0;
        let mut backed_off: Vec<(u32, u64)> = Vec::new();
        for p in &report.processes {
            let Some(target) = self.targets.get_mut(&p.pid) else {
                continue;
            };
            let written = match &mut self.recorder {
                Some(recorder) => {
                    // Taking records here in ebpf mode would hide a write made since the
                    // scan from the next pass's dirty set; it joins the next window instead.
                    if !self.scanner.dirty_takes_records() {
                        recorder.take(p.pid, &mut target.dirty_mut().tracer);
                    }
                    target.dirty_mut().tracer.close_window()
                }
                None => HashSet::new(),
            };
            let broken = target.break_merges(written);
            breaks += broken.len() as u64;
            let regions: HashSet<u64> = broken.iter().map(|page| page >> REGION_SHIFT).collect();
            for region in regions {
                if target.backoff_mut().hit(region, now) {
                    backed_off.push((p.pid, region));
                }
            }
            // Pages looked at this pass and found mapped to KSM frames; with the verified
            // duplicates marked (step 5), the pages a write would break.
            target.take_up_ksm_pages_found();
        }
        for (pid, region) in backed_off {
            self.unmark_region(pid, region);
        }
        self.stats.cow_breaks += breaks;
        breaks
    }

    /// Backing off unmarks the region, so ksmd stops merging pages that do not stay merged.
    fn unmark_region(&mut self, pid: u32, region: u64) {
        let Some(target) = self.targets.get_mut(&pid) else {
            return;
        };
        let (start, end) = (region << REGION_SHIFT, (region + 1) << REGION_SHIFT);
        let runs: Vec<Run> = target.marked().within(Range::new(start, end));
        log::info!("pid {pid}: merged pages in {start:#x}-{end:#x} keep breaking; backing off");
        match self.marker.unmark(&self.borrower, target, &runs) {
            Ok(outcome) => self.marking_syscalls += outcome.remote_syscalls,
            Err(e) => log::warn!("pid {pid}: unmarking a backed-off region: {e}"),
        }
    }

    /// Between passes, with more than one merge domain: a write the tracer saw on a marked
    /// duplicate may put another domain's content there, and ksmd, if it is sweeping, would
    /// merge it before the next pass looks. So its region backs off now, as the next pass
    /// would have done (the pass then finds it backed off already and counts the break).
    pub(super) fn back_off_written_marks(&mut self, written: Vec<(u32, u64)>) {
        let now = self.stats.full_scans;
        let mut backed_off = Vec::new();
        for (pid, page) in written {
            let Some(target) = self.targets.get_mut(&pid) else {
                continue;
            };
            if target.is_merged(page) && target.backoff_mut().hit(page >> REGION_SHIFT, now) {
                backed_off.push((pid, page >> REGION_SHIFT));
            }
        }
        for (pid, region) in backed_off {
            self.unmark_region(pid, region);
        }
    }

    /// Step 5: marks the new duplicate runs of every target; returns how many runs, and
    /// pages in them, were marked.
    pub(super) fn mark(&mut self, now: u64) -> (u64, u64) {
        let (mut runs_marked, mut pages_marked) = (0, 0);
        let mut refusals = Vec::new();
        // Contents already merged somewhere belong to that process's domain.
        for target in self.targets.values_mut() {
            let (sums, domain) = (target.take_ksm_checksums_found(), target.domain());
            for sum in sums {
                self.domains.claim(sum, domain, target.owned_mut());
            }
        }
        let allow_gaps = self.domains.count() <= 1;
        // A verified duplicate is found once, when it is placed; it stays a candidate until
        // it is marked, written or unmapped (a domain's claim, a back-off or the marking
        // budget may hold it back for a while).
        for target in self.targets.values_mut() {
            target.take_up_candidates_found();
        }
        // In pid order, so which domain first marks a content does not depend on hashing.
        for (&pid, target) in self.targets.iter_mut() {
            // Only what this pass scanned is marked, within the VMAs it saw.
            if !target.has_candidates() || target.vmas_scanned().is_none() {
                continue;
            }
            let domain = target.domain();
            let pages = target.unmarked_candidates();
            let mut mine = Vec::with_capacity(pages.len());
            for (page, sum) in pages {
                if target.backoff().blocks(page, now) {
                    continue;
                }
                // Decided from this domain's own history only.
                if self.domains.claim(sum, domain, target.owned_mut()) {
                    mine.push(page);
                }
            }
            // Marked verified duplicates are ksmd's to merge: a write to one breaks a merge,
            // or one about to happen.
            target.note_merged(mine.iter().copied());
            let Some((vmas, vma_count)) = target.vmas_scanned() else {
                continue;
            };
            let runs = self
                .marker
                .plan(pid, target.marked(), &mine, vmas, vma_count, allow_gaps);
            match self.marker.mark(&self.borrower, target, &runs) {
                Ok(outcome) => {
                    runs_marked += outcome.runs;
                    pages_marked += outcome.pages;
                    self.marking_syscalls += outcome.remote_syscalls;
                }
                Err(RemoteError::Refused { reason, .. }) => refusals.push((pid, reason)),
                // The next pass drops it, or starts over with its new program.
                Err(RemoteError::Gone(_) | RemoteError::NewImage(_)) => {}
                Err(e) => log::warn!("marking in pid {pid}: {e}"),
            }
            target.settle_candidates();
        }
        for target in self.targets.values_mut() {
            target.forget_finds();
        }
        for (pid, reason) in refusals {
            self.refuse_remote(pid, reason);
        }
        (runs_marked, pages_marked)
    }
}
