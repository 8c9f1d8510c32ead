//! What a pass reports: per process and in total, what was looked at, read, found and
//! skipped, and the work it leaves for the marking.

use rksm_common::PAGE;
use serde::Serialize;

use super::MIB;
use crate::{engine::index::TopContent, kernel::remote::RemoteRefusal};

/// Page counts of one process or of all (the `estimate` report's fields).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PageCounts {
    /// Present pages looked at (each mapping counts).
    pub scanned_pages: u64,
    /// Scanned pages whose content is all zeros (the zero page or zero-filled pages).
    pub zero_pages: u64,
    /// Pages merging would free: copies minus one for every distinct content.
    pub duplicate_pages: u64,
    /// Distinct contents: the one copy of each that would stay.
    pub unique_pages: u64,
    /// Pages whose checksum changed since the previous pass (or that are new).
    pub volatile_pages: u64,
    /// Mappings of a physical page already counted (shared by fork, KSM or the zero page).
    pub already_shared_pages: u64,
    /// Pages read and checksummed this pass.
    #[serde(skip)]
    pub pages_hashed: u64,
    /// Pages known from earlier passes and not looked at this pass (proven clean).
    #[serde(skip)]
    pub pages_skipped_clean: u64,
    /// Pagemap entries read: the pass's per-page system call cost.
    #[serde(skip)]
    pub pagemap_pages: u64,
    /// New pages sampled (see `ebpf::sampler`) instead of read.
    #[serde(skip)]
    pub pages_sampled: u64,
    /// Of those, pages left only sampled: their digest met no other page's.
    #[serde(skip)]
    pub pages_only_sampled: u64,
    /// /proc/kpageflags reads (one `pread` each).
    #[serde(skip)]
    pub kpageflags_reads: u64,
    /// Pages whose written bit the dirty source looked at (PAGEMAP_SCAN's walk, or soft-dirty
    /// bits read from pagemap, one entry each).
    #[serde(skip)]
    pub written_bits_read: u64,
    /// Pages that vanished between pagemap and reading (unmapped mid-pass).
    #[serde(skip)]
    pub pages_vanished: u64,
    /// Of the pages read, new pages whose checksum was their twin's: a page read just
    /// before, with the same bytes.
    #[serde(skip)]
    pub pages_twinned: u64,
    /// Time spent computing checksums.
    #[serde(skip)]
    pub checksum_ns: u64,
    /// Time spent on the pages read: looking them up in pagemap, copying them out of the
    /// process, checksumming and placing them.
    #[serde(skip)]
    pub work_ns: u64,
    /// KSM pages (counted once each), as ksmd's `pages_shared`.
    #[serde(skip)]
    pub ksm_pages_shared: u64,
    /// Further mappings of KSM pages, as ksmd's `pages_sharing`: the memory merging saved.
    #[serde(skip)]
    pub ksm_pages_sharing: u64,
}

impl PageCounts {
    /// What merging the duplicates would save.
    pub fn savings_mib(&self) -> f64 {
        self.duplicate_pages as f64 * PAGE as f64 / MIB
    }

    pub(super) fn add(&mut self, other: &PageCounts) {
        self.scanned_pages += other.scanned_pages;
        self.zero_pages += other.zero_pages;
        self.duplicate_pages += other.duplicate_pages;
        self.unique_pages += other.unique_pages;
        self.volatile_pages += other.volatile_pages;
        self.already_shared_pages += other.already_shared_pages;
        self.pages_hashed += other.pages_hashed;
        self.pages_skipped_clean += other.pages_skipped_clean;
        self.pages_vanished += other.pages_vanished;
        self.pages_twinned += other.pages_twinned;
        self.pagemap_pages += other.pagemap_pages;
        self.pages_sampled += other.pages_sampled;
        self.pages_only_sampled += other.pages_only_sampled;
        self.kpageflags_reads += other.kpageflags_reads;
        self.written_bits_read += other.written_bits_read;
        self.checksum_ns += other.checksum_ns;
        self.work_ns += other.work_ns;
        self.ksm_pages_shared += other.ksm_pages_shared;
        self.ksm_pages_sharing += other.ksm_pages_sharing;
    }
}

/// One process's numbers in a pass.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProcessCounts {
    /// Process id.
    pub pid: u32,
    /// Command name.
    pub comm: String,
    /// Its page counts.
    #[serde(flatten)]
    pub counts: PageCounts,
}

/// Everything one pass found.
#[derive(Debug, Clone, Default)]
pub struct PassReport {
    /// The pass was cut short: the daemon is stopping.
    pub stopped: bool,
    /// Processes scanned to the end, by pid.
    pub processes: Vec<ProcessCounts>,
    /// Sum over `processes`.
    pub total: PageCounts,
    /// The most duplicated contents (only with [`ScanConfig::report_top`]).
    pub top: Vec<TopContent>,
    /// Processes that exited during the pass (their numbers are not in the totals).
    pub exited: Vec<u32>,
    /// Processes that could not be scanned, with the reason.
    pub failed: Vec<(u32, String)>,
    /// Processes left for this pass because rksm had no file descriptor left.
    pub short_of_files: Vec<u32>,
    /// Processes found off limits when they were borrowed to be armed, not read.
    pub refused: Vec<(u32, RemoteRefusal)>,
    /// Wall time of the pass.
    pub seconds: f64,
}

/// Progress within a pass, for a progress bar.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    /// Pages of address space looked at so far.
    pub pages_done: u64,
    /// Pages of address space in all targets' scanned VMAs.
    pub pages_total: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_add_up_and_savings_are_in_mib() {
        let mut total = PageCounts::default();
        let one = PageCounts {
            scanned_pages: 10,
            duplicate_pages: 256,
            ..PageCounts::default()
        };
        total.add(&one);
        total.add(&one);
        assert_eq!(total.scanned_pages, 20);
        assert_eq!(total.savings_mib(), 2.0);
    }
}
