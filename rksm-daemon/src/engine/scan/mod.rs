use std::{
    collections::{HashMap, HashSet, VecDeque},
    time::Instant,
};

use rksm_common::{sample::digest_of, PAGE};

use crate::{
    ebpf::sampler::Sampler,
    engine::{
        checksum::ChecksumKind,
        dirty::{DirtySource, Lent},
        index::{Index, PageRef, TopContent},
        keys::{KeyMap, PidMap},
        samples::SampleIndex,
        target::{Finds, Target},
    },
    kernel::{
        limits,
        procfs::{self, KpageFlags, Pagemap, PagemapEntry, ProcfsError, Vma},
        ranges::{Range, RangeSet},
        reader::{ProcMem, ReaderError},
    },
};

mod place;
mod plan;
mod reads;
mod report;
mod sampling;

use reads::{LiveMemory, RecentBatches};
pub use report::{PageCounts, PassReport, ProcessCounts, Progress};
use sampling::settle;

/// Pages looked up per pagemap read (and sampled per run of the sampler).
const CHUNK_PAGES: usize = 512;
/// Pages read per batch (512 KiB of contents): a batch and the one before it stay in a
/// core's cache while its pages are checksummed and compared with their twins (2 MiB
/// batches did not).
const READ_PAGES: usize = 128;
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
    /// Report the most duplicated contents (a walk over every duplicated content).
    pub report_top: bool,
}

/// Why one process's scan stopped.
enum ProcessScanError {
    Gone,
    Failed(String),
    /// rksm had no file descriptor left: the process is read again next pass.
    ShortOfFiles,
}

impl From<ProcfsError> for ProcessScanError {
    fn from(e: ProcfsError) -> Self {
        match e {
            ProcfsError::Gone(_) => ProcessScanError::Gone,
            ProcfsError::Io { source, .. } if limits::out_of_files(&source) => {
                ProcessScanError::ShortOfFiles
            }
            other => ProcessScanError::Failed(other.to_string()),
        }
    }
}

impl From<ReaderError> for ProcessScanError {
    fn from(e: ReaderError) -> Self {
        match e {
            ReaderError::Gone(_) => ProcessScanError::Gone,
            ReaderError::Denied {
                errno: nix::errno::Errno::EMFILE | nix::errno::Errno::ENFILE,
                ..
            } => ProcessScanError::ShortOfFiles,
            other => ProcessScanError::Failed(other.to_string()),
        }
    }
}

/// How one present page is obtained this pass.
#[derive(Clone, Copy)]
enum Source {
    /// The kernel's zero page: content known, nothing to read.
    Zero,
    /// Read into slot `n` of the batch buffer.
    Read(usize),
    /// Unchanged since it was hashed (it waits for the gate): its checksum stands.
    Known,
}

#[derive(Clone, Copy)]
struct Candidate {
    addr: u64,
    ksm: bool,
    source: Source,
    pfn: u64,
    previous: u64,
    /// The digest the sample index counted for it.
    digest: Option<u32>,
}

/// What one target's pass looks at: everything the dirty source cannot vouch for, and of
/// the rest only what changed.
#[derive(Debug, Default)]
struct Work {
    /// Ranges looked at page by page, every present page hashed: not under write protection
    /// since they were last read, or never read.
    full: Vec<Range>,
    /// Pages looked at one by one, in address order: written, waiting for the gate, or found
    /// changed by a comparison.
    sparse: Vec<u64>,
    /// Of `sparse`, the pages whose content may have changed: hashed again.
    rehash: HashSet<u64>,
    /// Pages the audit found written that no record names: a changed checksum is a miss.
    unseen: HashSet<u64>,
    /// Ranges under write protection from now on: a page read in them for the first time
    /// is placed at once, and its duplicates held for the gate (see [`Target::take_held`]).
    hold: RangeSet,
    /// Duplicates held at the last pass that passed the gate now: this pass's finds.
    released: u64,
    /// Pages whose written bit the dirty source looked at.
    written_bits_read: u64,
    /// Ranges whose new pages were sampled instead of read: known in full at the end.
    sampled: Vec<Range>,
    /// Pages sampled, and of them those left only sampled.
    pages_sampled: u64,
    pages_only_sampled: u64,
    /// Digests of pages only sampled that are read whole this pass because they were
    /// written: for the audit's check of pages it found written unrecorded.
    sampled_before: HashMap<u64, u32>,
}

impl Work {
    fn pages(&self) -> u64 {
        self.full.iter().map(Range::pages).sum::<u64>() + self.sparse.len() as u64
    }
}

/// One chunk of a target's scan: `pages` pages of address space from `start`, looked up
/// with one pagemap read and read with one job.
#[derive(Debug, Clone, Copy)]
struct Step {
    start: u64,
    pages: usize,
    /// Of sparse pages, which of `Work::sparse` lie in it (the others are not looked at);
    /// only `Work::rehash` pages are hashed again.
    sparse: Option<Sparse>,
    /// Pages of address space it accounts for, for progress.
    weight: u64,
}

impl Step {
    /// The pages it looks at: all of them, or of a sparse step only its own.
    fn looks(&self) -> u64 {
        self.sparse.map_or(self.pages, |s| s.count) as u64
    }
}

/// The sparse pages of a step: `Work::sparse[first..first + count]`.
#[derive(Debug, Clone, Copy)]
struct Sparse {
    first: usize,
    count: usize,
}

/// One target's scan in a pass, advanced a chunk at a time.
struct InProgress<'t> {
    target: &'t mut Target,
    work: Work,
    open: Option<Open>,
    steps: VecDeque<Step>,
    counts: PageCounts,
    misses: u64,
    /// Pages of address space done, for progress.
    done: u64,
    /// Pages its steps taken so far look at ([`Step::looks`]): the targets read side by side
    /// are kept level by it.
    taken: u64,
    error: Option<ProcessScanError>,
}

fn scans_done(scans: &[InProgress<'_>]) -> u64 {
    scans.iter().map(|s| s.done).sum()
}

/// The open files of the target being scanned.
struct Open {
    pid: u32,
    domain: u32,
    pagemap: Pagemap,
    mem: ProcMem,
}

/// A chunk looked up in pagemap, waiting for its pages to be read before they are placed.
struct Prepared {
    /// Pages pagemap covered.
    got: usize,
    candidates: Vec<Candidate>,
    /// Further mappings of frames seen earlier in the pass: `(addr, pfn, previous checksum)`.
    shared_mappings: Vec<(u64, u64, u64)>,
}

/// Targets read side by side, at most: each holds its pagemap and mem files open while it
/// is read, so this bounds what a pass adds to the files rksm holds.
const SCAN_GROUP: usize = 64;

/// A pass that read or sampled this many pages gives back what it held only for itself.
const RELEASE_AFTER_PAGES: u64 = 64 * CHUNK_PAGES as u64;

/// The largest buffer of a batch a small pass keeps for the next (16 pages).
const KEPT_BATCH_BYTES: usize = 16 * rksm_common::PAGE;

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
    pfns_seen: KeyMap<u64>,
    /// Buffers for batches of pages read, not in use (one batch: [`CHUNK_PAGES`] pages).
    spare_batches: Vec<Vec<u8>>,
    entries: Vec<PagemapEntry>,
    live: LiveMemory,
    /// Representatives read ahead of their comparisons.
    rep_batch: Vec<u8>,
    /// The batches read last, for the representatives of the next ones.
    recent: RecentBatches,
    /// Pages a comparison found changed or gone, by pid: hashed again at its next pass.
    recheck: PidMap<Vec<u64>>,
    merge_candidates: PidMap<Vec<(u64, u64)>>,
    ksm_pages: PidMap<Vec<u64>>,
    ksm_checksums: PidMap<Vec<u64>>,
    /// Samples new pages in write-protected memory, if it could be loaded.
    sampler: Option<Sampler>,
    /// One sample index per merge domain, as the indexes.
    samples: HashMap<u32, SampleIndex>,
    /// The digest of a page of zeros.
    zero_digest: u32,
    /// Asked between chunks: true ends the pass where it is (the daemon is stopping).
    stop: Option<Box<dyn Fn() -> bool>>,
}

impl Scanner {
    /// Ends passes early, between chunks, once `stop` says so. What a pass cut short leaves
    /// is for a daemon that is exiting: pages of the targets not yet read are out of the
    /// index until they are read again.
    pub fn stop_when(&mut self, stop: impl Fn() -> bool + 'static) {
        self.stop = Some(Box::new(stop));
    }

    /// A scanner with no history. Needs root: PFNs and /proc/kpageflags are root-only.
    pub fn new(config: ScanConfig, dirty: Box<dyn DirtySource>) -> Result<Self, ProcfsError> {
        Ok(Scanner {
            indexes: HashMap::new(),
            zero_checksum: config.checksum.checksum(&[0u8; PAGE]),
            config,
            dirty,
            kpageflags: KpageFlags::open()?,
            pfns_seen: KeyMap::default(),
            spare_batches: Vec::new(),
            entries: vec![PagemapEntry(0); CHUNK_PAGES],
            live: LiveMemory::default(),
            rep_batch: Vec::new(),
            recent: RecentBatches::default(),
            recheck: PidMap::default(),
            merge_candidates: PidMap::default(),
            ksm_pages: PidMap::default(),
            ksm_checksums: PidMap::default(),
            sampler: None,
            samples: HashMap::new(),
            zero_digest: digest_of(&[0u8; PAGE]),
            stop: None,
        })
    }

    /// From now on, new pages in write-protected memory are sampled by `sampler`, and read
    /// whole only when their digest meets another page's.
    pub fn sample_with(&mut self, sampler: Sampler) {
        self.sampler = Some(sampler);
    }

    /// Whether new pages are sampled.
    pub fn samples(&self) -> bool {
        self.sampler.is_some()
    }

    /// Drops the index of merge domain `domain` (its last target left).
    pub fn forget_domain(&mut self, domain: u32) {
        self.indexes.remove(&domain);
        self.samples.remove(&domain);
    }

    /// Takes every page of `target` out of its domain's index and forgets its pages (it is
    /// dropped, or its scan failed half-way and it is read in full next time).
    pub fn forget(&mut self, target: &mut Target) {
        let pid = target.pid();
        let pages = target.forget_pages();
        if let Some(index) = self.indexes.get_mut(&target.domain()) {
            for (addr, info) in pages {
                if info.placed {
                    index.remove(PageRef { pid, addr }, info.checksum);
                }
            }
        }
        settle(&mut self.samples, target.domain(), target.pages_mut());
        self.recheck.remove(&pid);
    }

    /// System calls the dirty source made inside targets.
    pub fn dirty_remote_syscalls(&self) -> u64 {
        self.dirty.remote_syscalls()
    }

    /// Whether its dirty source takes each target's tracer records at the target's pass.
    pub fn dirty_takes_records(&self) -> bool {
        self.dirty.takes_records()
    }

    /// Runs one pass over `targets`.
    pub fn pass(
        &mut self,
        targets: &mut [Target],
        lent: &mut Lent<'_>,
        progress: &mut dyn FnMut(Progress),
    ) -> PassReport {
        let mut refs: Vec<&mut Target> = targets.iter_mut().collect();
        self.pass_over(&mut refs, lent, progress)
    }

    /// Runs one pass over `targets` (borrowed from wherever they are kept). What is learnt
    /// about each target (checksums, arming) goes back into its record. The dirty source
    /// uses what is `lent` (the borrower to arm with, the tracer's records).
    pub fn pass_over(
        &mut self,
        targets: &mut [&mut Target],
        lent: &mut Lent<'_>,
        progress: &mut dyn FnMut(Progress),
    ) -> PassReport {
        let started = Instant::now();
        let mut report = PassReport::default();
        self.pfns_seen.clear();
        self.live.open.clear();
        self.recent.forget();

        // Every target is planned, and what may have changed taken out of the index, before
        // anything is placed: a page is then never found equal to its own former self, and a
        // hash-only pass places every page afresh, as KSM's rebuilt unstable tree does.
        let mut plans = Vec::new();
        let mut vmas_scanned = HashMap::new();
        for target in targets.iter_mut() {
            let pid = target.pid();
            // A zombie still has a /proc entry, with no memory: it has exited all the same.
            if target.process().has_exited() {
                report.exited.push(pid);
                continue;
            }
            match self.vmas_of(pid) {
                Ok((vmas, total)) => {
                    let work = self.plan(target, &vmas, lent);
                    settle(&mut self.samples, target.domain(), target.pages_mut());
                    // Arming it found it off limits: it is not read.
                    if let Some(reason) = target.dirty().refused() {
                        report.refused.push((pid, reason));
                        continue;
                    }
                    vmas_scanned.insert(pid, (vmas, total));
                    plans.push((&mut **target, work));
                }
                Err(ProcessScanError::Gone) => report.exited.push(pid),
                Err(ProcessScanError::Failed(why)) => report.failed.push((pid, why)),
                Err(ProcessScanError::ShortOfFiles) => report.short_of_files.push(pid),
            }
        }
        for index in self.indexes.values_mut() {
            index.begin_release();
        }
        for (target, work) in &mut plans {
            work.released = self.release_held(target);
        }
        self.sample_new(&mut plans);
        let pages_total = plans.iter().map(|(_, w)| w.pages()).sum();
        let mut pages_before = 0;
        let mut plans = plans.into_iter().peekable();
        // A group of targets at a time: each one being read holds two files open.
        while plans.peek().is_some() && !report.stopped {
            let mut scans: Vec<InProgress<'_>> = plans
                .by_ref()
                .take(SCAN_GROUP)
                .map(|(target, work)| self.begin(target, work))
                .collect();
            report.stopped =
                self.read_side_by_side(&mut scans, pages_total, pages_before, progress);
            pages_before += scans_done(&scans);
            for mut scan in scans {
                if report.stopped {
                    break;
                }
                let pid = scan.target.pid();
                let result = Self::finish(&mut scan);
                if result.is_err() {
                    // Half-placed: it starts over next pass.
                    self.forget(scan.target);
                }
                match result {
                    // Exited while being scanned: what was counted may be missing pages.
                    Ok(_) if scan.target.process().has_exited() => report.exited.push(pid),
                    Ok(counts) => {
                        report.total.add(&counts);
                        report.processes.push(ProcessCounts {
                            pid,
                            comm: scan.target.process().comm().to_string(),
                            counts,
                        });
                    }
                    Err(ProcessScanError::Gone) => report.exited.push(pid),
                    Err(ProcessScanError::Failed(why)) => report.failed.push((pid, why)),
                    Err(ProcessScanError::ShortOfFiles) => report.short_of_files.push(pid),
                }
            }
        }
        if self.config.report_top {
            let mut top: Vec<TopContent> = self.indexes.values().flat_map(|i| i.top(10)).collect();
            top.sort_unstable_by(|a, b| b.copies.cmp(&a.copies).then(a.checksum.cmp(&b.checksum)));
            top.truncate(10);
            report.top = top;
        }
        // What a large pass held only for itself is let go: the representatives it cached
        // and its batches (the daemon hands the freed heap back after the pass).
        let taken_up = report.total.pages_hashed + report.total.pages_sampled;
        if taken_up >= RELEASE_AFTER_PAGES {
            for index in self.indexes.values_mut() {
                index.release_cache();
            }
            self.spare_batches = Vec::new();
            self.recent = RecentBatches::default();
        } else {
            // A small pass keeps its batches' buffers for the next, as large as its reads
            // were; one that read a window of scattered pages keeps none larger than a steady
            // pass needs.
            self.spare_batches
                .retain(|b| b.capacity() <= KEPT_BATCH_BYTES);
            self.recent.release_larger_than(KEPT_BATCH_BYTES);
            // The room a large pass made in the sample indexes for its new pages, many of
            // which shared a digest or left, is given back once new memory stops coming: a
            // fleet of workers starting one after another would otherwise have it rebuilt
            // smaller and grown again at every one.
            for samples in self.samples.values_mut() {
                samples.shrink();
            }
        }
        // What was found in each target goes to its record; a duplicate's company may be
        // found in another target's scan, so only now.
        for target in targets.iter_mut() {
            let pid = target.pid();
            target.found(Finds {
                candidates: self.merge_candidates.remove(&pid).unwrap_or_default(),
                ksm_pages: self.ksm_pages.remove(&pid).unwrap_or_default(),
                ksm_checksums: self.ksm_checksums.remove(&pid).unwrap_or_default(),
                vmas: vmas_scanned.remove(&pid),
            });
        }
        self.merge_candidates.clear();
        self.ksm_pages.clear();
        self.ksm_checksums.clear();
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

    /// Ends `scan`: what it counted, or why it failed.
    fn finish(scan: &mut InProgress<'_>) -> Result<PageCounts, ProcessScanError> {
        if let Some(e) = scan.error.take() {
            return Err(e);
        }
        for range in scan.work.full.iter().chain(&scan.work.sampled) {
            scan.target.pages_mut().scanned.insert(*range);
        }
        let mut counts = scan.counts;
        let pages = scan.target.pages();
        counts.pages_skipped_clean =
            (pages.len() + pages.sampled_len()).saturating_sub(counts.scanned_pages);
        let pid = scan.target.pid();
        scan.target.dirty_mut().note_misses(pid, scan.misses);
        scan.target
            .dirty_mut()
            .note_rehash_cost(counts.work_ns, counts.pages_hashed);
        Ok(counts)
    }
}
