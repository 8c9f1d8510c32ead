//! When ksmd sweeps and when it rests.
//!
//! ksmd cannot be pointed at pages: each full scan visits all mergeable memory, rksm's marks
//! and whatever processes marked themselves (qemu marks its guest's RAM). So a sweep is worth
//! starting only for a batch of work. A batch is due when the work found since the last one
//! reaches 1/64 of the marked pages (the first pass's duplicates, a workload that changed) or
//! has waited `ksmd_max_delay` (the trickle of a steady state: a guest kernel zeroing a few
//! pages a second). Then ksmd is paced to sweep the marked set in about `ksmd_sweep` until it
//! has completed three more full scans: a page needs two sweeps to be merged, and the scan in
//! progress may have passed its process already. Merges that are still coming in as the third
//! scan ends (ksmd's `pages_sharing` grew by a batch within a pass) extend it. With no batch
//! due, ksmd gets back the settings found at take-over (stopped, on a host that had not
//! started it): after convergence it costs nothing until the dirty bit finds work.
//!
//! [`Pacing::after_pass`] decides, from counts and times alone; the daemon applies it.

use std::time::{Duration, Instant};

use super::Daemon;
use crate::kernel::ksmd;

/// How long a trickle of steady-state work may wait for ksmd by default: three sweeps a
/// minute at most, against twelve for ksmd tuned to sweep everything in 5 s.
pub const DEFAULT_KSMD_MAX_DELAY: Duration = Duration::from_secs(60);

/// Full scans a batch of work keeps ksmd sweeping for.
const SWEEPS_PER_BATCH: u64 = 3;

/// What a pass found for ksmd to do.
#[derive(Debug, Clone, Copy)]
pub(super) struct KsmdWork {
    /// Runs newly marked and duplicates newly found.
    pub(super) new: u64,
    /// How much ksmd's `pages_sharing` grew during the pass.
    pub(super) merged: u64,
}

/// What ksmd is to do until the next pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KsmdPace {
    /// Sweep the marked pages.
    Sweep,
    /// Rest: the settings found at take-over.
    Rest,
}

/// When ksmd sweeps: until its `full_scans` reaches `busy_until`; and the work found since it
/// was last set going, not yet worth a sweep of its own.
#[derive(Debug, Default)]
pub(super) struct Pacing {
    busy_until: u64,
    backlog: u64,
    since: Option<Instant>,
}

impl Pacing {
    /// After a pass that found `work`, with ksmd at `full_scans` and `marked` pages marked,
    /// at `now`: what ksmd is to do. Work waits for a batch of 1/64 of the marked pages, or
    /// for `max_delay`.
    fn after_pass(
        &mut self,
        work: KsmdWork,
        full_scans: u64,
        marked: u64,
        now: Instant,
        max_delay: Duration,
    ) -> KsmdPace {
        let busy = full_scans < self.busy_until;
        let batch = (marked / 64).max(1);
        if work.new > 0 {
            self.backlog += work.new;
            self.since.get_or_insert(now);
        }
        let waited = self
            .since
            .is_some_and(|since| now.saturating_duration_since(since) >= max_delay);
        if self.backlog >= batch || waited || (busy && work.merged >= batch) {
            self.busy_until = full_scans + SWEEPS_PER_BATCH;
            self.backlog = 0;
            self.since = None;
        }
        match full_scans < self.busy_until {
            true => KsmdPace::Sweep,
            false => KsmdPace::Rest,
        }
    }
}

impl Daemon {
    /// Step 7: pace ksmd to the work (see the module's documentation).
    pub(super) fn pace_ksmd(&mut self, work: KsmdWork) {
        let full_scans = ksmd::counters(&self.config.ksm_root).map_or(0, |k| k.full_scans);
        let pace = match self.ksmd_pacing.after_pass(
            work,
            full_scans,
            self.stats.pages_marked,
            Instant::now(),
            self.config.ksmd_max_delay,
        ) {
            KsmdPace::Sweep => ksmd::pace(
                self.stats.pages_marked,
                self.config.ksmd_sweep.as_secs_f64(),
                self.config.ksmd_sleep_millisecs,
            ),
            KsmdPace::Rest => ksmd::idle(self.ksmd.saved()),
        };
        if let Err(e) = self.ksmd.set(pace) {
            log::warn!("pacing ksmd: {e}");
        }
        self.stats.ksmd_taken_back = self.ksmd.taken_back();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX_DELAY: Duration = Duration::from_secs(60);

    fn work(new: u64, merged: u64) -> KsmdWork {
        KsmdWork { new, merged }
    }

    #[test]
    fn a_batch_of_new_work_sets_ksmd_sweeping_for_three_full_scans() {
        let (mut pacing, t0) = (Pacing::default(), Instant::now());
        // A first pass marked 64,000 pages and found as many duplicates: a batch.
        let pace = pacing.after_pass(work(64_000, 0), 10, 64_000, t0, MAX_DELAY);
        assert_eq!(pace, KsmdPace::Sweep);
        for scans in [11, 12] {
            assert_eq!(
                pacing.after_pass(work(0, 0), scans, 64_000, t0, MAX_DELAY),
                KsmdPace::Sweep,
                "still sweeping at full scan {scans}"
            );
        }
        assert_eq!(
            pacing.after_pass(work(0, 0), 13, 64_000, t0, MAX_DELAY),
            KsmdPace::Rest,
            "three full scans after the batch, ksmd rests"
        );
    }

    #[test]
    fn a_trickle_waits_until_it_makes_a_batch_or_has_waited_long_enough() {
        let (mut pacing, t0) = (Pacing::default(), Instant::now());
        // 1/64 of 64,000 marked pages is 1,000: 10 pages a pass is a trickle.
        let trickle = |p: &mut Pacing, at: Duration| {
            p.after_pass(work(10, 0), 20, 64_000, t0 + at, MAX_DELAY)
        };
        assert_eq!(trickle(&mut pacing, Duration::ZERO), KsmdPace::Rest);
        assert_eq!(
            trickle(&mut pacing, Duration::from_secs(59)),
            KsmdPace::Rest
        );
        assert_eq!(
            trickle(&mut pacing, Duration::from_secs(60)),
            KsmdPace::Sweep,
            "the first of it has waited the maximum delay"
        );
        // The backlog went with that sweep: the next trickle waits again, from its own start.
        assert_eq!(
            trickle(&mut pacing, Duration::from_secs(61)),
            KsmdPace::Sweep
        );
        assert_eq!(
            pacing.after_pass(
                work(10, 0),
                23,
                64_000,
                t0 + Duration::from_secs(62),
                MAX_DELAY
            ),
            KsmdPace::Rest,
            "ksmd's three scans are done and the new trickle has not waited"
        );
        // Or it adds up to a batch first: 10 + 990 pages.
        let mut adding_up = Pacing::default();
        assert_eq!(trickle(&mut adding_up, Duration::ZERO), KsmdPace::Rest);
        assert_eq!(
            adding_up.after_pass(work(990, 0), 20, 64_000, t0, MAX_DELAY),
            KsmdPace::Sweep
        );
    }

    #[test]
    fn merges_still_coming_in_keep_ksmd_sweeping() {
        let (mut pacing, t0) = (Pacing::default(), Instant::now());
        assert_eq!(
            pacing.after_pass(work(64_000, 0), 10, 64_000, t0, MAX_DELAY),
            KsmdPace::Sweep
        );
        // At the third scan, pages_sharing grew by a batch within the pass: three more.
        assert_eq!(
            pacing.after_pass(work(0, 5_000), 12, 64_000, t0, MAX_DELAY),
            KsmdPace::Sweep
        );
        assert_eq!(
            pacing.after_pass(work(0, 0), 14, 64_000, t0, MAX_DELAY),
            KsmdPace::Sweep,
            "extended to full scan 15"
        );
        assert_eq!(
            pacing.after_pass(work(0, 0), 15, 64_000, t0, MAX_DELAY),
            KsmdPace::Rest
        );
        // Merges while ksmd rests (another process's marks) do not start it.
        assert_eq!(
            pacing.after_pass(work(0, 5_000), 16, 64_000, t0, MAX_DELAY),
            KsmdPace::Rest
        );
    }
}
