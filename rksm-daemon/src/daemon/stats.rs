//! What the daemon counts: its totals since start (`DaemonStats`, printed at exit, served by
//! the status and its metrics) and the summary of its last pass.

use std::{collections::BTreeMap, fmt, time::SystemTime};

use rksm_common::PAGE_SIZE;
use serde::{Deserialize, Serialize};

use super::{DirtyMode, NewPages};

/// The counters the daemon reports (names follow /sys/kernel/mm/ksm).
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize)]
pub struct DaemonStats {
    /// KSM frames (ksmd's counter: every process's mergeable memory, not only the targets').
    pub pages_shared: u64,
    /// Further mappings of KSM frames, the memory saved (ksmd's counter, likewise).
    pub pages_sharing: u64,
    /// Marked pages ksmd found unique (ksmd's counter).
    pub pages_unshared: u64,
    /// Pages whose checksum changed since the previous pass (last pass).
    pub pages_volatile: u64,
    /// Passes completed.
    pub full_scans: u64,
    /// Pages read and checksummed, all passes.
    pub pages_hashed: u64,
    /// Pages the dirty source proved clean and were not read, all passes.
    pub pages_skipped_clean: u64,
    /// New pages sampled in the kernel instead of read, all passes.
    pub pages_sampled: u64,
    /// Of those, pages whose digest met no other page's: never read (until written).
    pub pages_only_sampled: u64,
    /// Of the pages read, new pages whose checksum was taken from a page just read with the
    /// same bytes (its twin) rather than computed, all passes.
    #[serde(default)]
    pub pages_twinned: u64,
    /// Time spent in checksums, all passes.
    pub checksum_ns: u64,
    /// Write faults the tracer saw in the targets.
    pub write_faults: u64,
    /// Write faults the tracer could not record.
    pub tracer_lost: u64,
    /// Writes the tracer saw on pages that were merged (copy-on-write breaks).
    pub cow_breaks: u64,
    /// System calls made inside targets (marking, arming).
    pub remote_syscalls: u64,
    /// Borrows that may have made a target see EINTR: its thread was asleep in a call the
    /// kernel does not restart, and rksm could not restart it either.
    #[serde(default)]
    pub eintr_risk: u64,
    /// Threads of targets borrowed (stopped for remote system calls and let go).
    #[serde(default)]
    pub borrows: u64,
    /// Borrowed threads found inside an rseq critical section, sent to its abort handler as
    /// the kernel would have sent them.
    #[serde(default)]
    pub rseq_aborts: u64,
    /// Timed waits (`epoll_wait`) a borrow interrupted that were entered again with the time
    /// they had left, rather than return EINTR.
    #[serde(default)]
    pub timed_restarts: u64,
    /// Targets that took up userfaultfd themselves while rksm write-protected them with one:
    /// rksm gave its own up before their registration.
    #[serde(default)]
    pub userfaultfd_handovers: u64,
    /// Targets whose merge domain changed (setuid, a cgroup move), unmarked and placed again.
    #[serde(default)]
    pub domain_changes: u64,
    /// Processes outside the targets, of another domain, seen marking memory mergeable.
    #[serde(default)]
    pub mergeable_outsiders: u64,
    /// KSM frames found mapped in more than one merge domain (each time one is found).
    #[serde(default)]
    pub cross_domain_merges: u64,
    /// Pages of targets unmarked (and so unmerged) because their frame crossed domains.
    #[serde(default)]
    pub cross_domain_unmarked: u64,
    /// Looks for frames mapped in more than one domain, and the time they took.
    #[serde(default)]
    pub cross_domain_checks: u64,
    /// Time spent looking, all looks.
    #[serde(default)]
    pub cross_domain_check_ns: u64,
    /// Targets refused, by reason.
    pub targets_refused: BTreeMap<String, u64>,
    /// Processes and targets left for a pass because rksm had no file descriptor left
    /// (EMFILE, ENFILE); each is taken up again the next pass.
    #[serde(default)]
    pub short_of_files: u64,
    /// The dirty mode in use.
    pub dirty_mode: DirtyMode,
    /// How new pages are taken up: `sample` (the sampler loaded) or `read`.
    #[serde(default)]
    pub new_pages: NewPages,
    /// Current targets by write-protect source (`userfaultfd`, `soft-dirty`, `none`).
    #[serde(default)]
    pub write_protect: BTreeMap<String, u64>,
    /// Clears of targets' soft-dirty bits (each write-protects a whole address space).
    #[serde(default)]
    pub soft_dirty_clears: u64,
    /// Time the kernel took for them.
    #[serde(default)]
    pub soft_dirty_clear_seconds: f64,
    /// Passes over a target (pagemap mode, soft-dirty) that read it whole because one of its
    /// faults raced with a clear the tracer could not vouch for.
    #[serde(default)]
    pub soft_dirty_clear_races: u64,
    /// Regions currently backed off because their merged pages keep breaking.
    pub regions_backed_off: u64,
    /// Pages marked mergeable in the live targets.
    pub pages_marked: u64,
    /// How long the first pass took and how many pages it read: the pass that reads every
    /// page, whose speed is compared with the memory's.
    #[serde(default)]
    pub first_pass_seconds: f64,
    /// Pages the first pass took up: read whole, or sampled and left unread.
    #[serde(default)]
    pub first_pass_pages: u64,
    /// The daemon's CPU time from its start (its eBPF programs loaded, its targets found)
    /// to the end of its first pass, all threads: what taking up that memory cost.
    #[serde(default)]
    pub first_pass_cpu_seconds: f64,
    /// The `run` value someone else wrote to ksmd while rksm owned it; rksm then stops
    /// pacing ksmd rather than fight them.
    pub ksmd_taken_back: Option<u64>,
}

/// What one pass did: the one-line summary, and the status's last pass.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PassSummary {
    /// Its number (1 for the first).
    pub number: u64,
    /// When it ended (seconds since the Unix epoch).
    pub ended_unix: f64,
    /// Wall time.
    pub seconds: f64,
    /// Targets scanned.
    pub targets: usize,
    /// Pages hashed this pass.
    pub pages_hashed: u64,
    /// Pages skipped as clean this pass.
    pub pages_skipped_clean: u64,
    /// Pagemap entries read this pass (a steady pass reads only the written pages').
    #[serde(default)]
    pub pagemap_pages: u64,
    /// /proc/kpageflags reads this pass.
    #[serde(default)]
    pub kpageflags_reads: u64,
    /// Pages whose written bit the dirty source looked at this pass (PAGEMAP_SCAN's walk,
    /// or soft-dirty bits read one pagemap entry each).
    #[serde(default)]
    pub written_bits_read: u64,
    /// Verified duplicates found this pass.
    pub duplicates: u64,
    /// Runs newly marked.
    pub runs_marked: u64,
    /// Copy-on-write breaks seen this pass.
    pub cow_breaks: u64,
}

impl fmt::Display for PassSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} targets, hashed {} skipped {} pages, {} duplicates, marked {} runs, {} cow breaks, {:.3} s",
            self.targets, self.pages_hashed, self.pages_skipped_clean, self.duplicates, self.runs_marked, self.cow_breaks, self.seconds
        )
    }
}

/// Seconds since the Unix epoch, as the status reports times.
pub fn unix_time(t: SystemTime) -> f64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Pages in MiB.
pub fn mib(pages: u64) -> f64 {
    (pages * PAGE_SIZE) as f64 / (1024.0 * 1024.0)
}
