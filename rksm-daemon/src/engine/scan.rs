//! One pass over the targets: maps → pagemap → dirty source → read → checksum → index.
//!
//! This is the pipeline every rksm mode shares. Per process it lists the private anonymous
//! writable VMAs, asks pagemap which pages are present (and kpageflags, for pages mapped more
//! than once, whether they are KSM or zero pages), asks the dirty source which pages must be
//! hashed again, reads those in batches with `process_vm_readv`, checksums them, and places
//! every present page in the [`Index`]. Pages the dirty source proves clean keep the checksum
//! of their last pass and are read only if a comparison needs them. Physical pages are counted
//! once: a frame mapped a second time (fork, KSM, the zero page) is already shared, and merging
//! cannot free it again. A process that exits or unmaps memory mid-pass only loses its own
//! numbers for that pass.

use std::{
    collections::{BTreeMap, HashMap},
    time::Instant,
};

use rksm_common::PAGE_SIZE;
use serde::Serialize;

use crate::{
    engine::{
        checksum::{ChecksumKind, NO_CHECKSUM},
        dirty::{DirtySet, DirtySource},
        index::{Content, ContentSource, Index, PageRef, Placement, TopContent},
        target::Target,
    },
    kernel::{
        procfs::{self, KpageFlags, Pagemap, PagemapEntry, ProcfsError, Vma},
        ranges::RangeSet,
        reader::{self, ProcMem, ReaderError},
    },
};

const PAGE: usize = PAGE_SIZE as usize;
/// Pages looked at per pagemap read and per `process_vm_readv` batch (2 MiB of contents).
const CHUNK_PAGES: usize = 512;
const MIB: f64 = 1024.0 * 1024.0;

/// How to scan.
#[derive(Debug, Clone, Default)]
pub struct ScanConfig {
    /// Checksum for the gate.
    pub checksum: ChecksumKind,
    /// Restrict the scan to these `(pid, start, end)` address ranges (tests, targeted runs);
    /// empty means every private anonymous writable VMA of every target.
    pub only_ranges: Vec<(u32, u64, u64)>,
    /// Collect the verified duplicates of each pass for the merge executor.
    pub collect_merge_candidates: bool,
}

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
    /// Pages the dirty source proved clean, so not read this pass.
    #[serde(skip)]
    pub pages_skipped_clean: u64,
    /// Pages that vanished between pagemap and reading (unmapped mid-pass).
    #[serde(skip)]
    pub pages_vanished: u64,
    /// Time spent computing checksums.
    #[serde(skip)]
    pub checksum_ns: u64,
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

    fn add(&mut self, other: &PageCounts) {
        self.scanned_pages += other.scanned_pages;
        self.zero_pages += other.zero_pages;
        self.duplicate_pages += other.duplicate_pages;
        self.unique_pages += other.unique_pages;
        self.volatile_pages += other.volatile_pages;
        self.already_shared_pages += other.already_shared_pages;
        self.pages_hashed += other.pages_hashed;
        self.pages_skipped_clean += other.pages_skipped_clean;
        self.pages_vanished += other.pages_vanished;
        self.checksum_ns += other.checksum_ns;
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
    /// Processes scanned to the end, by pid.
    pub processes: Vec<ProcessCounts>,
    /// Sum over `processes`.
    pub total: PageCounts,
    /// The most duplicated contents.
    pub top: Vec<TopContent>,
    /// Processes that exited during the pass (their numbers are not in the totals).
    pub exited: Vec<u32>,
    /// Processes that could not be scanned, with the reason.
    pub failed: Vec<(u32, String)>,
    /// Wall time of the pass.
    pub seconds: f64,
    /// Per process, the pages whose content was verified equal to another page's, with the
    /// pages they equal, and the content's checksum (only with
    /// [`ScanConfig::collect_merge_candidates`]).
    pub merge_candidates: HashMap<u32, Vec<(u64, u64)>>,
    /// Per process, the checksums of the contents of its KSM pages.
    pub ksm_checksums: HashMap<u32, Vec<u64>>,
    /// Per process, the pages mapped to KSM pages.
    pub ksm_pages: HashMap<u32, Vec<u64>>,
    /// Per process, the VMAs scanned and how many VMAs it has in all.
    pub vmas: HashMap<u32, (Vec<Vma>, usize)>,
}

/// Progress within a pass, for a progress bar.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    /// Pages of address space looked at so far.
    pub pages_done: u64,
    /// Pages of address space in all targets' scanned VMAs.
    pub pages_total: u64,
}

/// Checksums of the previous pass for one VMA, page by page.
#[derive(Debug, Default)]
struct VmaState {
    end: u64,
    checksums: Vec<u64>,
}

/// The checksums of one target's pages at its last pass, VMA by VMA (kept in its
/// [`Target`] record).
#[derive(Debug, Default)]
pub struct PageState {
    vmas: BTreeMap<u64, VmaState>,
}

impl PageState {
    /// The previous checksums for `vma`'s pages: moved over whole if the VMA is unchanged,
    /// copied page by page from overlapping old VMAs if it grew, shrank, split or merged.
    fn take_checksums(&mut self, vma: &Vma) -> Vec<u64> {
        if self
            .vmas
            .get(&vma.start)
            .is_some_and(|old| old.end == vma.end)
        {
            return self
                .vmas
                .remove(&vma.start)
                .map(|old| old.checksums)
                .unwrap_or_default();
        }
        let mut checksums = vec![NO_CHECKSUM; vma.pages() as usize];
        for (&start, old) in self.vmas.range(..vma.end) {
            let (from, to) = (start.max(vma.start), old.end.min(vma.end));
            if from >= to {
                continue;
            }
            let n = ((to - from) / PAGE_SIZE) as usize;
            let src = ((from - start) / PAGE_SIZE) as usize;
            let dst = ((from - vma.start) / PAGE_SIZE) as usize;
            checksums[dst..dst + n].copy_from_slice(&old.checksums[src..src + n]);
        }
        checksums
    }
}

/// Reads single pages of live processes for the index's comparisons, through /proc/PID/mem
/// (a representative may well be a KSM or fork-shared page, which pinning would unshare).
#[derive(Default)]
struct LiveMemory {
    open: HashMap<u32, Option<ProcMem>>,
}

impl ContentSource for LiveMemory {
    fn read(&mut self, page: PageRef, buf: &mut [u8; PAGE]) -> bool {
        let mem = self
            .open
            .entry(page.pid)
            .or_insert_with(|| ProcMem::open(page.pid).ok());
        mem.as_ref().is_some_and(|m| m.read_page(page.addr, buf))
    }
}

/// Why one process's scan stopped.
enum ProcessScanError {
    Gone,
    Failed(String),
}

impl From<ProcfsError> for ProcessScanError {
    fn from(e: ProcfsError) -> Self {
        match e {
            ProcfsError::Gone(_) => ProcessScanError::Gone,
            other => ProcessScanError::Failed(other.to_string()),
        }
    }
}

impl From<ReaderError> for ProcessScanError {
    fn from(e: ReaderError) -> Self {
        match e {
            ReaderError::Gone(_) => ProcessScanError::Gone,
            other => ProcessScanError::Failed(other.to_string()),
        }
    }
}

/// How one present page will be obtained this pass.
#[derive(Clone, Copy)]
enum Source {
    /// The kernel's zero page: content known, nothing to read.
    Zero,
    /// Read into slot `n` of the batch buffer.
    Read(usize),
    /// Proven clean by the dirty source: keep the previous checksum.
    Clean,
}

#[derive(Clone, Copy)]
struct Candidate {
    index_in_vma: usize,
    ksm: bool,
    source: Source,
    pfn: u64,
}

/// What scanning one process's VMAs reads from.
#[derive(Clone, Copy)]
struct OpenTarget<'a> {
    pid: u32,
    domain: u32,
    pagemap: &'a Pagemap,
    mem: &'a ProcMem,
    dirty: &'a DirtySet,
    /// Ranges already marked mergeable: their clean pages need no comparison.
    settled: &'a RangeSet,
}

/// Scans targets pass after pass; what it remembers about each target is kept in the
/// target's record, and only what spans targets (the indexes) is kept here.
pub struct Scanner {
    config: ScanConfig,
    /// One index per merge domain: pages of different domains are never compared, so they
    /// can never be found duplicates of each other.
    indexes: HashMap<u32, Index>,
    dirty: Box<dyn DirtySource>,
    kpageflags: KpageFlags,
    zero_checksum: u64,
    /// Physical pages mapped more than once, seen this pass, with their checksum once known.
    pfns_seen: HashMap<u64, u64>,
    batch: Vec<u8>,
    read_ok: Vec<bool>,
    entries: Vec<PagemapEntry>,
    live: LiveMemory,
    merge_candidates: HashMap<u32, Vec<(u64, u64)>>,
    ksm_pages: HashMap<u32, Vec<u64>>,
    ksm_checksums: HashMap<u32, Vec<u64>>,
}

impl Scanner {
    /// A scanner with no history. Needs root: PFNs and /proc/kpageflags are root-only.
    pub fn new(config: ScanConfig, dirty: Box<dyn DirtySource>) -> Result<Self, ProcfsError> {
        Ok(Scanner {
            indexes: HashMap::new(),
            zero_checksum: config.checksum.checksum(&[0u8; PAGE]),
            config,
            dirty,
            kpageflags: KpageFlags::open()?,
            pfns_seen: HashMap::new(),
            batch: vec![0u8; CHUNK_PAGES * PAGE],
            read_ok: vec![false; CHUNK_PAGES],
            entries: vec![PagemapEntry(0); CHUNK_PAGES],
            live: LiveMemory::default(),
            merge_candidates: HashMap::new(),
            ksm_pages: HashMap::new(),
            ksm_checksums: HashMap::new(),
        })
    }

    /// Drops the index of merge domain `domain` (its last target left).
    pub fn forget_domain(&mut self, domain: u32) {
        self.indexes.remove(&domain);
    }

    /// The dirty source's mode name.
    pub fn dirty_mode(&self) -> &'static str {
        self.dirty.mode()
    }

    /// System calls the dirty source made inside targets.
    pub fn dirty_remote_syscalls(&self) -> u64 {
        self.dirty.remote_syscalls()
    }

    /// Runs one pass over `targets`.
    pub fn pass(
        &mut self,
        targets: &mut [Target],
        progress: &mut dyn FnMut(Progress),
    ) -> PassReport {
        let mut refs: Vec<&mut Target> = targets.iter_mut().collect();
        self.pass_over(&mut refs, progress)
    }

    /// Runs one pass over `targets` (borrowed from wherever they are kept). What is learnt
    /// about each target (checksums, arming) goes back into its record.
    pub fn pass_over(
        &mut self,
        targets: &mut [&mut Target],
        progress: &mut dyn FnMut(Progress),
    ) -> PassReport {
        let started = Instant::now();
        let mut report = PassReport::default();
        for index in self.indexes.values_mut() {
            index.begin_pass();
        }
        self.pfns_seen.clear();
        self.live.open.clear();

        let mut plans = Vec::new();
        for target in targets.iter_mut() {
            let pid = target.pid();
            // A zombie still has a /proc entry, with no memory: it has exited all the same.
            if target.process().has_exited() {
                report.exited.push(pid);
                continue;
            }
            match self.vmas_of(pid) {
                Ok((vmas, total)) => {
                    report.vmas.insert(pid, (vmas.clone(), total));
                    plans.push((&mut **target, vmas));
                }
                Err(ProcessScanError::Gone) => report.exited.push(pid),
                Err(ProcessScanError::Failed(why)) => report.failed.push((pid, why)),
            }
        }
        let pages_total = plans
            .iter()
            .flat_map(|(_, v)| v.iter())
            .map(Vma::pages)
            .sum();
        let mut pages_done = 0;
        for (target, vmas) in plans {
            let pid = target.pid();
            match self.scan_target(target, &vmas, &mut |done| {
                progress(Progress {
                    pages_done: pages_done + done,
                    pages_total,
                })
            }) {
                // Exited while being scanned: what was counted may be missing pages.
                Ok(_) if target.process().has_exited() => report.exited.push(pid),
                Ok(counts) => {
                    report.total.add(&counts);
                    report.processes.push(ProcessCounts {
                        pid,
                        comm: target.process().comm().to_string(),
                        counts,
                    });
                }
                Err(ProcessScanError::Gone) => report.exited.push(pid),
                Err(ProcessScanError::Failed(why)) => report.failed.push((pid, why)),
            }
            pages_done += vmas.iter().map(Vma::pages).sum::<u64>();
        }
        let mut top: Vec<TopContent> = self.indexes.values().flat_map(|i| i.top(10)).collect();
        top.sort_unstable_by(|a, b| b.copies.cmp(&a.copies).then(a.checksum.cmp(&b.checksum)));
        top.truncate(10);
        report.top = top;
        report.ksm_checksums = std::mem::take(&mut self.ksm_checksums);
        report.merge_candidates = std::mem::take(&mut self.merge_candidates);
        report.ksm_pages = std::mem::take(&mut self.ksm_pages);
        report.seconds = started.elapsed().as_secs_f64();
        report
    }

    /// The VMAs of `pid` that this scanner covers, and the number of VMAs it has in all.
    fn vmas_of(&self, pid: u32) -> Result<(Vec<Vma>, usize), ProcessScanError> {
        let all = procfs::read_maps(pid)?;
        let total = all.len();
        let vmas = all.into_iter().filter(Vma::is_private_anonymous_writable);
        if self.config.only_ranges.is_empty() {
            return Ok((vmas.collect(), total));
        }
        let ranges: Vec<(u64, u64)> = self
            .config
            .only_ranges
            .iter()
            .filter(|r| r.0 == pid)
            .map(|r| (r.1, r.2))
            .collect();
        Ok((
            vmas.flat_map(|vma| {
                ranges.iter().filter_map(move |&(start, end)| {
                    let (from, to) = (start.max(vma.start), end.min(vma.end));
                    (from < to).then(|| Vma {
                        start: from,
                        end: to,
                        ..vma.clone()
                    })
                })
            })
            .collect(),
            total,
        ))
    }

    fn scan_target(
        &mut self,
        target: &mut Target,
        vmas: &[Vma],
        progress: &mut dyn FnMut(u64),
    ) -> Result<PageCounts, ProcessScanError> {
        let pid = target.pid();
        let (process, state) = target.process_and_dirty();
        let dirty = self
            .dirty
            .dirty_pages(process, state, vmas)
            .unwrap_or_else(|e| {
                log::warn!("{e}; rehashing every page of pid {pid} this pass");
                DirtySet::All
            });
        // Whatever fails below, the old checksums are gone with it: every page of a target
        // whose scan failed is read again next pass.
        let mut old = std::mem::take(&mut target.pages);
        let pagemap = Pagemap::open(pid)?;
        let mem = ProcMem::open(pid)?;
        let mut state = PageState::default();
        let mut counts = PageCounts::default();
        let mut done = 0;
        for vma in vmas {
            let mut checksums = old.take_checksums(vma);
            let open = OpenTarget {
                pid,
                domain: target.domain(),
                pagemap: &pagemap,
                mem: &mem,
                dirty: &dirty,
                settled: &target.marked,
            };
            let result = self.scan_vma(&open, vma, &mut checksums, &mut counts, &mut |in_vma| {
                progress(done + in_vma)
            });
            state.vmas.insert(
                vma.start,
                VmaState {
                    end: vma.end,
                    checksums,
                },
            );
            result?;
            done += vma.pages();
            progress(done);
        }
        target.pages = state;
        Ok(counts)
    }

    fn scan_vma(
        &mut self,
        target: &OpenTarget<'_>,
        vma: &Vma,
        checksums: &mut [u64],
        counts: &mut PageCounts,
        progress: &mut dyn FnMut(u64),
    ) -> Result<(), ProcessScanError> {
        let OpenTarget {
            pid,
            domain,
            pagemap,
            mem,
            dirty,
            settled,
        } = *target;
        let kind = self.config.checksum;
        let mut chunk_start = vma.start;
        let mut candidates = Vec::with_capacity(CHUNK_PAGES);
        let mut to_read = Vec::with_capacity(CHUNK_PAGES);
        let mut mapped_once = Vec::with_capacity(CHUNK_PAGES);
        let mut shared_mappings = Vec::new();
        while chunk_start < vma.end {
            let want = (((vma.end - chunk_start) / PAGE_SIZE) as usize).min(CHUNK_PAGES);
            let got = pagemap.read(chunk_start, &mut self.entries[..want])?;
            if got == 0 {
                break;
            }
            let first_index = ((chunk_start - vma.start) / PAGE_SIZE) as usize;
            candidates.clear();
            to_read.clear();
            mapped_once.clear();
            shared_mappings.clear();
            for (i, entry) in self.entries[..got].iter().enumerate() {
                let Some(pfn) = entry.pfn() else { continue };
                if entry.file_or_shared() {
                    continue;
                }
                counts.scanned_pages += 1;
                let addr = chunk_start + i as u64 * PAGE_SIZE;
                let index_in_vma = first_index + i;
                // A page mapped more than once may be a KSM page, the zero page, or shared
                // with a forked relative; count each physical page once.
                let (mut ksm, mut zero) = (false, false);
                if !entry.exclusive() && pfn != 0 {
                    let flags = self.kpageflags.get(pfn).unwrap_or_default();
                    (ksm, zero) = (flags.ksm(), flags.zero_page());
                    if ksm {
                        self.ksm_pages.entry(pid).or_default().push(addr);
                    }
                    if self.pfns_seen.contains_key(&pfn) {
                        counts.already_shared_pages += 1;
                        counts.ksm_pages_sharing += u64::from(ksm);
                        // Shared or not, a mapping of the zero page is a zero page.
                        counts.zero_pages += u64::from(zero);
                        // This mapping's content is the frame's: remember its checksum, so
                        // that after a copy-on-write break the gate sees it unchanged.
                        shared_mappings.push((index_in_vma, pfn));
                        continue;
                    }
                    self.pfns_seen.insert(pfn, NO_CHECKSUM);
                    counts.ksm_pages_shared += u64::from(ksm);
                }
                let source = if zero {
                    Source::Zero
                } else if dirty.contains(addr) || checksums[index_in_vma] == NO_CHECKSUM {
                    to_read.push(addr);
                    mapped_once.push(entry.exclusive());
                    Source::Read(to_read.len() - 1)
                } else {
                    Source::Clean
                };
                candidates.push(Candidate {
                    index_in_vma,
                    ksm,
                    source,
                    pfn,
                });
            }

            reader::read_pages(
                mem,
                &to_read,
                &mapped_once,
                &mut self.batch,
                &mut self.read_ok,
            )?;
            let hashing = Instant::now();
            let fresh: Vec<u64> = (0..to_read.len())
                .map(|slot| {
                    if self.read_ok[slot] {
                        kind.checksum(&self.batch[slot * PAGE..(slot + 1) * PAGE])
                    } else {
                        NO_CHECKSUM
                    }
                })
                .collect();
            counts.checksum_ns += hashing.elapsed().as_nanos() as u64;
            counts.pages_hashed += fresh.iter().filter(|&&c| c != NO_CHECKSUM).count() as u64;

            for candidate in &candidates {
                let page = PageRef {
                    pid,
                    addr: vma.start + candidate.index_in_vma as u64 * PAGE_SIZE,
                };
                let previous = checksums[candidate.index_in_vma];
                let (checksum, content) = match candidate.source {
                    Source::Zero => (self.zero_checksum, Content::Zero),
                    Source::Read(slot) if fresh[slot] == NO_CHECKSUM => {
                        counts.pages_vanished += 1;
                        counts.scanned_pages -= 1;
                        checksums[candidate.index_in_vma] = NO_CHECKSUM;
                        continue;
                    }
                    Source::Read(slot) => (
                        fresh[slot],
                        Content::Loaded(&self.batch[slot * PAGE..(slot + 1) * PAGE]),
                    ),
                    Source::Clean => {
                        counts.pages_skipped_clean += 1;
                        (
                            previous,
                            if settled.contains(page.addr) {
                                Content::Settled
                            } else {
                                Content::Unread
                            },
                        )
                    }
                };
                let is_zero = checksum == self.zero_checksum
                    && match content {
                        Content::Loaded(bytes) => bytes.iter().all(|&b| b == 0),
                        Content::Zero | Content::Unread | Content::Settled => true,
                    };
                let kind = self.config.checksum;
                let index = self
                    .indexes
                    .entry(domain)
                    .or_insert_with(|| Index::new(kind));
                match index.place(
                    page,
                    checksum,
                    previous,
                    candidate.ksm,
                    content,
                    &mut self.live,
                ) {
                    Placement::Unique => counts.unique_pages += 1,
                    Placement::Duplicate { of } => {
                        counts.duplicate_pages += 1;
                        if self.config.collect_merge_candidates {
                            self.merge_candidates
                                .entry(pid)
                                .or_default()
                                .push((page.addr, checksum));
                            self.merge_candidates
                                .entry(of.pid)
                                .or_default()
                                .push((of.addr, checksum));
                        }
                    }
                    Placement::Volatile => counts.volatile_pages += 1,
                    Placement::Vanished => {
                        counts.pages_vanished += 1;
                        counts.scanned_pages -= 1;
                        checksums[candidate.index_in_vma] = NO_CHECKSUM;
                        continue;
                    }
                }
                if is_zero {
                    counts.zero_pages += 1;
                }
                if candidate.ksm {
                    self.ksm_checksums.entry(pid).or_default().push(checksum);
                }
                checksums[candidate.index_in_vma] = checksum;
                if let Some(known) = self.pfns_seen.get_mut(&candidate.pfn) {
                    *known = checksum;
                }
            }
            for &(index_in_vma, pfn) in &shared_mappings {
                checksums[index_in_vma] = self.pfns_seen.get(&pfn).copied().unwrap_or(NO_CHECKSUM);
            }
            chunk_start += got as u64 * PAGE_SIZE;
            progress((chunk_start - vma.start) / PAGE_SIZE);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_follow_vmas_that_grow_shrink_and_split() {
        let p = PAGE_SIZE;
        let mut state = PageState::default();
        state.vmas.insert(
            0,
            VmaState {
                end: 4 * p,
                checksums: vec![10, 11, 12, 13],
            },
        );
        state.vmas.insert(
            8 * p,
            VmaState {
                end: 10 * p,
                checksums: vec![80, 81],
            },
        );
        // Unchanged: moved over as is.
        let mut same = PageState::default();
        same.vmas.insert(
            0,
            VmaState {
                end: 4 * p,
                checksums: vec![1, 2, 3, 4],
            },
        );
        assert_eq!(same.take_checksums(&Vma::anonymous(0, 4 * p)), [1, 2, 3, 4]);
        // Grown across a gap into the next VMA, and shifted: copied page by page.
        assert_eq!(
            state.take_checksums(&Vma::anonymous(2 * p, 10 * p)),
            [
                12,
                13,
                NO_CHECKSUM,
                NO_CHECKSUM,
                NO_CHECKSUM,
                NO_CHECKSUM,
                80,
                81
            ]
        );
        // New memory: nothing known.
        assert_eq!(
            state.take_checksums(&Vma::anonymous(20 * p, 21 * p)),
            [NO_CHECKSUM]
        );
    }

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
