//! The merge executor: turns verified duplicates into `MADV_MERGEABLE` runs inside targets.
//!
//! No system call merges two given pages, so rksm marks exactly the verified duplicates (both
//! the kept copy and the copies) mergeable from inside each target (see [`crate::kernel::remote`]),
//! and ksmd, which only ever sees the marked set, does the merging. Marking is per VMA range,
//! and every marked range can split a VMA in three, so marking page by page could push a
//! process towards `vm.max_map_count` (65530 by default) and make its next mmap fail. The
//! policy: nearby pages are coalesced into runs (gaps of up to [`MergePolicy::max_gap_pages`]
//! unmarked pages are marked too: ksmd then finds them unique, which costs it a look, not a
//! wrong merge); if a process would still get more than its budget of runs in one pass, the
//! gap is doubled until it does not; and the budget never lets rksm's splits take a process
//! past half of `vm.max_map_count`. Ranges marked once are remembered and not marked again.

use rksm_common::PAGE_SIZE;

use crate::{
    engine::target::Target,
    kernel::{
        process::Process,
        procfs::Vma,
        ranges::{Range, RangeSet},
        remote::{nr, Borrower, RemoteError, RemoteSession},
    },
};

const MADV_MERGEABLE: u64 = 12;
const MADV_UNMERGEABLE: u64 = 13;

/// A run of pages to mark: an address range.
pub type Run = Range;

/// How marking is bounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MergePolicy {
    /// Unmarked pages allowed inside a run before it is split in two.
    pub max_gap_pages: u64,
    /// New runs per process per pass, at most.
    pub max_new_runs: usize,
    /// `vm.max_map_count`; rksm's splits never take a process past half of it.
    pub max_map_count: u64,
}

impl Default for MergePolicy {
    fn default() -> Self {
        MergePolicy {
            max_gap_pages: 8,
            max_new_runs: 256,
            max_map_count: std::fs::read_to_string("/proc/sys/vm/max_map_count")
                .ok()
                .and_then(|s| s.trim().parse().ok())
                .unwrap_or(65530),
        }
    }
}

/// Coalesces `pages` (page addresses, any order) into runs inside their VMAs, at most
/// `max_runs` of them, with gaps of at most `max_gap_pages` unless more are needed to stay
/// within `max_runs`.
///
/// ```
/// use rksm::{engine::merge::{coalesce, Run}, kernel::procfs::Vma};
/// let vma = Vma::anonymous(0x10000, 0x20000);
/// let runs = coalesce(&[0x10000, 0x11000, 0x14000, 0x1f000], &[vma], 1, 10);
/// assert_eq!(runs, [Run { start: 0x10000, end: 0x12000 }, Run { start: 0x14000, end: 0x15000 }, Run { start: 0x1f000, end: 0x20000 }]);
/// ```
pub fn coalesce(pages: &[u64], vmas: &[Vma], max_gap_pages: u64, max_runs: usize) -> Vec<Run> {
    let mut sorted = pages.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut gap = max_gap_pages;
    loop {
        let runs = coalesce_with_gap(&sorted, vmas, gap);
        if runs.len() <= max_runs || gap > (1 << 40) {
            return runs;
        }
        gap = (gap * 2).max(1);
    }
}

fn coalesce_with_gap(sorted: &[u64], vmas: &[Vma], gap_pages: u64) -> Vec<Run> {
    let mut runs: Vec<Run> = Vec::new();
    let vma_of = |addr: u64| vmas.iter().position(|v| v.start <= addr && addr < v.end);
    let mut last_vma = None;
    for &page in sorted {
        let Some(vma) = vma_of(page) else { continue };
        match runs.last_mut() {
            Some(run) if last_vma == Some(vma) && page <= run.end + gap_pages * PAGE_SIZE => {
                run.end = page + PAGE_SIZE;
            }
            _ => runs.push(Run {
                start: page,
                end: page + PAGE_SIZE,
            }),
        }
        last_vma = Some(vma);
    }
    runs
}

/// What marking did in one process.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MarkOutcome {
    /// Runs the kernel accepted.
    pub runs: u64,
    /// Pages in them.
    pub pages: u64,
    /// System calls made inside the target.
    pub remote_syscalls: u64,
}

/// Plans and marks runs; what is marked in a target is kept in its record.
#[derive(Debug, Default)]
pub struct Marker {
    policy: MergePolicy,
}

impl Marker {
    /// A marker following `policy`.
    pub fn new(policy: MergePolicy) -> Self {
        Marker { policy }
    }

    /// The runs to mark in `pid` for `pages`, leaving out what is `marked` already, within
    /// the process's budget; `vma_count` is how many VMAs it has in all. Without `allow_gaps`
    /// a run holds only the given pages (other pages could hold another merge domain's
    /// contents), and runs over the budget wait for a later pass.
    pub fn plan(
        &self,
        pid: u32,
        marked: &RangeSet,
        pages: &[u64],
        vmas: &[Vma],
        vma_count: usize,
        allow_gaps: bool,
    ) -> Vec<Run> {
        let budget = (self.policy.max_map_count / 2).saturating_sub(vma_count as u64) / 2;
        let max_runs = self.policy.max_new_runs.min(budget as usize);
        if max_runs == 0 {
            log::warn!("pid {pid} has {vma_count} VMAs; not splitting more of them");
            return Vec::new();
        }
        if !allow_gaps {
            let mut sorted = pages.to_vec();
            sorted.sort_unstable();
            sorted.dedup();
            let mut runs = marked.minus(&coalesce_with_gap(&sorted, vmas, 0));
            runs.truncate(max_runs);
            return runs;
        }
        marked.minus(&coalesce(pages, vmas, self.policy.max_gap_pages, max_runs))
    }

    /// Marks `runs` mergeable inside `target`, in one stop of one thread.
    pub fn mark(
        &self,
        borrower: &Borrower,
        target: &mut Target,
        runs: &[Run],
    ) -> Result<MarkOutcome, RemoteError> {
        let (outcome, done) = advise(borrower, target.process(), runs, MADV_MERGEABLE)?;
        target.note_marked(&done);
        Ok(outcome)
    }

    /// Marks `runs` unmergeable again in `target` (ksmd unmerges what it merged there).
    pub fn unmark(
        &self,
        borrower: &Borrower,
        target: &mut Target,
        runs: &[Run],
    ) -> Result<MarkOutcome, RemoteError> {
        let (outcome, done) = advise(borrower, target.process(), runs, MADV_UNMERGEABLE)?;
        target.note_unmarked(&done);
        Ok(outcome)
    }
}

/// `madvise(advice)` over each run inside `process`; returns what the kernel accepted.
fn advise(
    borrower: &Borrower,
    process: &Process,
    runs: &[Run],
    advice: u64,
) -> Result<(MarkOutcome, Vec<Run>), RemoteError> {
    let mut outcome = MarkOutcome::default();
    if runs.is_empty() {
        return Ok((outcome, Vec::new()));
    }
    let mut session = RemoteSession::begin(borrower, process)?;
    let mut done = Vec::with_capacity(runs.len());
    for run in runs {
        let result = session.syscall(nr::MADVISE, &[run.start, run.end - run.start, advice])?;
        if result == 0 {
            done.push(*run);
            outcome.runs += 1;
            outcome.pages += run.pages();
        } else {
            // The range changed since the scan (unmapped, remapped): skip it.
            log::debug!(
                "pid {}: madvise({:#x}, {}) returned {result}",
                process.pid(),
                run.start,
                run.end - run.start
            );
        }
    }
    outcome.remote_syscalls = session.finish()?;
    Ok((outcome, done))
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: u64 = PAGE_SIZE;

    #[test]
    fn runs_never_cross_vmas() {
        let vmas = [Vma::anonymous(0, 4 * P), Vma::anonymous(4 * P, 8 * P)];
        let runs = coalesce(&[2 * P, 3 * P, 4 * P, 5 * P], &vmas, 100, 10);
        assert_eq!(
            runs,
            [
                Run {
                    start: 2 * P,
                    end: 4 * P
                },
                Run {
                    start: 4 * P,
                    end: 6 * P
                }
            ]
        );
    }

    #[test]
    fn pages_outside_every_vma_are_dropped() {
        assert_eq!(coalesce(&[100 * P], &[Vma::anonymous(0, 4 * P)], 1, 10), []);
    }

    #[test]
    fn the_gap_widens_until_the_budget_holds() {
        let pages: Vec<u64> = (0..100).map(|i| i * 4 * P).collect();
        let vmas = [Vma::anonymous(0, 400 * P)];
        assert_eq!(
            coalesce(&pages, &vmas, 2, 1000).len(),
            100,
            "gap 2 keeps every page apart"
        );
        let runs = coalesce(&pages, &vmas, 2, 10);
        assert!(runs.len() <= 10, "{runs:?}");
        let covered: u64 = runs.iter().map(Run::pages).sum();
        assert!((100..=397).contains(&covered));
        assert!(
            pages
                .iter()
                .all(|&p| runs.iter().any(|r| r.start <= p && p < r.end)),
            "a page was lost"
        );
    }

    #[test]
    fn without_gaps_runs_hold_only_the_given_pages_and_wait_beyond_the_budget() {
        let marker = Marker::new(MergePolicy {
            max_gap_pages: 8,
            max_new_runs: 3,
            max_map_count: 65530,
        });
        let vmas = [Vma::anonymous(0, 100 * P)];
        let pages = [0, P, 3 * P, 6 * P, 9 * P];
        let runs = marker.plan(1, &RangeSet::default(), &pages, &vmas, 10, false);
        assert_eq!(
            runs,
            [
                Run {
                    start: 0,
                    end: 2 * P
                },
                Run {
                    start: 3 * P,
                    end: 4 * P
                },
                Run {
                    start: 6 * P,
                    end: 7 * P
                }
            ]
        );
        assert_eq!(
            marker.plan(1, &RangeSet::default(), &pages, &vmas, 10, true),
            [Run {
                start: 0,
                end: 10 * P
            }],
            "with gaps: one run"
        );
    }

    #[test]
    fn a_crowded_process_gets_no_new_runs() {
        let marker = Marker::new(MergePolicy {
            max_gap_pages: 0,
            max_new_runs: 100,
            max_map_count: 1000,
        });
        let vmas = [Vma::anonymous(0, 100 * P)];
        let pages: Vec<u64> = (0..50).map(|i| i * 2 * P).collect();
        assert_eq!(
            marker
                .plan(1, &RangeSet::default(), &pages, &vmas, 499, true)
                .len(),
            0,
            "at half of max_map_count"
        );
        let runs = marker.plan(1, &RangeSet::default(), &pages, &vmas, 480, true);
        assert!(
            (1..=10).contains(&runs.len()),
            "(500 - 480) / 2 runs left: {runs:?}"
        );
    }
}
