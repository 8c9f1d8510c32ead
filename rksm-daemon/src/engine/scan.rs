//! One pass over the targets: maps → dirty source → pagemap → read → checksum → index.
//!
//! This is the pipeline every rksm mode shares, and its cost follows the writes. Per process
//! it lists the private anonymous writable VMAs and asks the dirty source what changed. A
//! range under write protection since it was last read is vouched for: of it, the pass looks
//! only at the pages written since (and the ones waiting for the checksum gate), one pagemap
//! read per run of them; a clean page is not looked at, not read, not placed again; it stays
//! in the [`Index`] and in the target's [`PageState`]. Every other range (hash-only mode, a
//! target that cannot be armed, memory never read) is read in full, as KSM would. Looked-at
//! pages are asked of pagemap (and kpageflags, for pages mapped more than once, whether they
//! are KSM or zero pages), read in batches with `process_vm_readv`, checksummed and placed.
//! Physical pages are counted once: a frame mapped a second time (fork, KSM, the zero page) is
//! already shared, and merging cannot free it again. The targets are read side by side, one
//! 2 MiB chunk of each in turn, so that copies of a content in several processes meet while
//! its representative is still cached. A large pass reads and checksums on two reader
//! threads ([`Reads`]) while this one places the chunks read before; everything that decides
//! stays on this thread. A process that exits or unmaps memory mid-pass only loses its own
//! numbers for that pass.

use std::{
    collections::{HashMap, HashSet, VecDeque},
    sync::{mpsc, Arc},
    thread,
    time::Instant,
};

use rksm_common::{sample::digest_of, PAGE, PAGE_SIZE};
use serde::Serialize;

use crate::{
    ebpf::sampler::{Sampler, SamplerError},
    engine::{
        checksum::{ChecksumKind, NO_CHECKSUM},
        dirty::{DirtySet, DirtySource},
        heap,
        index::{Content, ContentSource, Index, PageRef, Placement, TopContent},
        pages::{PageInfo, PageState},
        samples::{Meets, SampleIndex},
        target::Target,
    },
    kernel::{
        limits,
        procfs::{self, KpageFlags, Pagemap, PagemapEntry, ProcfsError, Vma},
        ranges::{page_runs, Range, RangeSet},
        reader::{self, ProcMem, ReaderError},
        remote::RemoteRefusal,
    },
};

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
    /// Report the most duplicated contents (a walk over every duplicated content).
    pub report_top: bool,
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

/// How many batches read in a pass are kept after they are placed.
const RECENT_BATCHES: usize = 3;

/// The last batches read in a pass, kept for the representatives of the next ones: the
/// targets are read side by side, so the page a copy is compared with was most often read
/// one to three steps before, and its bytes are still here, with the checksum computed from
/// them. Finding it here spares a /proc/PID/mem read and a checksum. The buffers go round:
/// keeping a batch gives the oldest one's buffer back for the next read.
#[derive(Default)]
struct RecentBatches {
    batches: VecDeque<ReadBatch>,
}

/// One batch: page `addrs[i]` of `pid`, with checksum `sums[i]`, at `bytes[i * PAGE..]`.
struct ReadBatch {
    pid: u32,
    addrs: Vec<u64>,
    sums: Vec<u64>,
    bytes: Vec<u8>,
}

impl RecentBatches {
    /// The bytes of `page`, if a recent batch read it and they have checksum `sum`.
    fn find(&self, page: PageRef, sum: u64) -> Option<&[u8; PAGE]> {
        self.batches
            .iter()
            .filter(|b| b.pid == page.pid)
            .find_map(|b| {
                let i = b.addrs.binary_search(&page.addr).ok()?;
                if b.sums[i] != sum {
                    return None;
                }
                b.bytes[i * PAGE..(i + 1) * PAGE].try_into().ok()
            })
    }

    /// Keeps the batch just placed (`pid`'s pages `addrs`, ascending, with `sums`, in
    /// `bytes`), and gives back the buffer of the oldest kept batch for another read.
    fn keep(
        &mut self,
        pid: u32,
        addrs: Vec<u64>,
        sums: Vec<u64>,
        bytes: Vec<u8>,
    ) -> Option<Vec<u8>> {
        let spare = match self.batches.len() {
            n if n >= RECENT_BATCHES => self.batches.pop_front().map(|b| b.bytes),
            _ => None,
        };
        self.batches.push_back(ReadBatch {
            pid,
            addrs,
            sums,
            bytes,
        });
        spare
    }

    /// Forgets what was read (a new pass: pages may have changed since); keeps the buffers.
    fn forget(&mut self) {
        for batch in &mut self.batches {
            batch.addrs.clear();
            batch.sums.clear();
        }
    }
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
    /// is placed at once, and its duplicates held for the gate (see [`Target::held`]).
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

/// One chunk of a target's scan.
#[derive(Debug, Clone, Copy)]
struct Step {
    start: u64,
    pages: usize,
    /// Of sparse pages: only `Work::rehash` pages are hashed again.
    sparse: bool,
    /// Pages of address space it accounts for, for progress.
    weight: u64,
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
    /// Shared with the reader threads.
    mem: Arc<ProcMem>,
}

/// A chunk looked up in pagemap, waiting for its pages to be read before they are placed.
struct Prepared {
    /// Which of the pass's scans it belongs to.
    scan: usize,
    step: Step,
    /// Pages pagemap covered.
    got: usize,
    candidates: Vec<Candidate>,
    /// Further mappings of frames seen earlier in the pass: `(addr, pfn, previous checksum)`.
    shared_mappings: Vec<(u64, u64, u64)>,
}

/// Pages of one process to read and checksum: `addrs`, ascending, into `bytes`.
struct ReadJob {
    mem: Arc<ProcMem>,
    addrs: Vec<u64>,
    mapped_once: Vec<bool>,
    bytes: Vec<u8>,
}

/// A job done: page `addrs[i]` at `bytes[i * PAGE..]` with checksum `sums[i]`
/// ([`NO_CHECKSUM`] if it could not be read).
struct ReadDone {
    addrs: Vec<u64>,
    bytes: Vec<u8>,
    sums: Vec<u64>,
    result: Result<(), ReaderError>,
    checksum_ns: u64,
    /// The whole job: the copy and the checksums.
    read_hash_ns: u64,
}

/// Reads and checksums `job`'s pages.
fn read_and_hash(job: ReadJob, kind: ChecksumKind) -> ReadDone {
    let ReadJob {
        mem,
        addrs,
        mapped_once,
        mut bytes,
    } = job;
    // As large as this job needs: a steady pass reads a few pages, and its buffers stay
    // with the recent batches until the next large pass.
    if bytes.len() < addrs.len() * PAGE {
        bytes.resize(addrs.len() * PAGE, 0);
    }
    let started = Instant::now();
    let mut read_ok = vec![false; addrs.len()];
    let result = reader::read_pages(&mem, &addrs, &mapped_once, &mut bytes, &mut read_ok);
    let hashing = Instant::now();
    let sums = match result {
        Ok(_) => (0..addrs.len())
            .map(|slot| match read_ok[slot] {
                true => kind.checksum(&bytes[slot * PAGE..(slot + 1) * PAGE]),
                false => NO_CHECKSUM,
            })
            .collect(),
        Err(_) => Vec::new(),
    };
    ReadDone {
        addrs,
        bytes,
        sums,
        result: result.map(|_| ()),
        checksum_ns: hashing.elapsed().as_nanos() as u64,
        read_hash_ns: started.elapsed().as_nanos() as u64,
    }
}

/// Chunks prepared at most: the one being placed and those handed to the readers after it.
/// Chunks differ in what they cost to read and to place, and readers kept a few ahead are
/// not kept waiting by one costly placement (two were slower than four; eight too, their
/// buffers no longer in the cache).
const READ_AHEAD_CHUNKS: usize = 4;
/// Targets read side by side, at most: each holds its pagemap and mem files open while it
/// is read, so this bounds what a pass adds to the files rksm holds.
const SCAN_GROUP: usize = 64;

/// A pass that read or sampled this many pages gives back what it held only for itself.
const RELEASE_AFTER_PAGES: u64 = 64 * CHUNK_PAGES as u64;

/// Reader threads of a large pass.
const READERS: usize = 2;

/// A pass over at least this many pages reads on reader threads (given two CPUs or more).
const READ_AHEAD_PAGES: u64 = 8 * CHUNK_PAGES as u64;

/// Where the chunks of a pass are read, in the order they were prepared. A pass over much
/// memory spends half its time copying pages out of the targets and checksumming them and
/// half placing them in the index; reader threads do the first for the next chunks while
/// the scanner places the one before, so the two halves overlap (on two cores a first pass
/// takes 0.7 of the time, 0.6 in hash-only mode, for the same CPU). A small pass (the steady
/// state's few written pages) reads in line: a thread would cost more than it saves.
enum Reads {
    InLine {
        kind: ChecksumKind,
        done: VecDeque<ReadDone>,
    },
    /// Jobs go to the readers in turn, and come back in the same turn.
    Threads {
        readers: Vec<(mpsc::Sender<ReadJob>, mpsc::Receiver<ReadDone>)>,
        submitted: usize,
        taken: usize,
    },
}

impl Reads {
    fn in_line(kind: ChecksumKind) -> Self {
        Reads::InLine {
            kind,
            done: VecDeque::new(),
        }
    }

    /// `n` reader threads in `scope`, named `rksm-reader`; they end when this is dropped. If
    /// a thread cannot be started (a task limit), the pass reads in line instead.
    fn threads<'scope>(
        scope: &'scope thread::Scope<'scope, '_>,
        kind: ChecksumKind,
        n: usize,
    ) -> Self {
        let mut readers = Vec::with_capacity(n);
        for _ in 0..n {
            let (jobs, todo) = mpsc::channel::<ReadJob>();
            let (finished, done) = mpsc::channel();
            let started = thread::Builder::new()
                .name("rksm-reader".into())
                .spawn_scoped(scope, move || {
                    for job in todo {
                        if finished.send(read_and_hash(job, kind)).is_err() {
                            break;
                        }
                    }
                });
            if let Err(e) = started {
                log::debug!("reading in line: no reader thread ({e})");
                return Reads::in_line(kind);
            }
            readers.push((jobs, done));
        }
        Reads::Threads {
            readers,
            submitted: 0,
            taken: 0,
        }
    }

    fn submit(&mut self, job: ReadJob) {
        match self {
            Reads::InLine { kind, done } => done.push_back(read_and_hash(job, *kind)),
            Reads::Threads {
                readers, submitted, ..
            } => {
                // A reader that is gone (a bug: it does not panic) shows as a job never done.
                _ = readers[*submitted % readers.len()].0.send(job);
                *submitted += 1;
            }
        }
    }

    /// The oldest job submitted and not yet taken, once done: the reader thread's wait is
    /// the one an in-line read would have had.
    fn next(&mut self) -> Option<ReadDone> {
        match self {
            Reads::InLine { done, .. } => done.pop_front(),
            Reads::Threads {
                readers,
                submitted,
                taken,
            } => {
                if taken == submitted {
                    return None;
                }
                let done = readers[*taken % readers.len()].1.recv().ok();
                *taken += 1;
                done
            }
        }
    }
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
    /// CPUs this process may run on, when it started: with one, reader threads would only
    /// take turns with the scanner.
    cpus: usize,
    /// Buffers for batches of pages read, not in use (one batch: [`CHUNK_PAGES`] pages).
    spare_batches: Vec<Vec<u8>>,
    entries: Vec<PagemapEntry>,
    live: LiveMemory,
    /// Representatives read ahead of their comparisons.
    rep_batch: Vec<u8>,
    /// The batches read last, for the representatives of the next ones.
    recent: RecentBatches,
    /// Pages a comparison found changed or gone, by pid: hashed again at its next pass.
    recheck: HashMap<u32, Vec<u64>>,
    merge_candidates: HashMap<u32, Vec<(u64, u64)>>,
    ksm_pages: HashMap<u32, Vec<u64>>,
    ksm_checksums: HashMap<u32, Vec<u64>>,
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
            pfns_seen: HashMap::new(),
            cpus: thread::available_parallelism().map_or(1, |n| n.get()),
            spare_batches: Vec::new(),
            entries: vec![PagemapEntry(0); CHUNK_PAGES],
            live: LiveMemory::default(),
            rep_batch: Vec::new(),
            recent: RecentBatches::default(),
            recheck: HashMap::new(),
            merge_candidates: HashMap::new(),
            ksm_pages: HashMap::new(),
            ksm_checksums: HashMap::new(),
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
        let pages = target.pages.clear();
        target.held.clear();
        if let Some(index) = self.indexes.get_mut(&target.domain()) {
            for (addr, info) in pages {
                if info.placed {
                    index.remove(PageRef { pid, addr }, info.checksum);
                }
            }
        }
        settle(&mut self.samples, target.domain(), &mut target.pages);
        self.recheck.remove(&pid);
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
        self.pfns_seen.clear();
        self.live.open.clear();
        self.recent.forget();

        // Every target is planned, and what may have changed taken out of the index, before
        // anything is placed: a page is then never found equal to its own former self, and a
        // hash-only pass places every page afresh, as KSM's rebuilt unstable tree does.
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
                    let work = self.plan(target, &vmas);
                    settle(&mut self.samples, target.domain(), &mut target.pages);
                    // Arming it found it off limits: it is not read.
                    if let Some(reason) = target.dirty.refused() {
                        report.refused.push((pid, reason));
                        continue;
                    }
                    report.vmas.insert(pid, (vmas, total));
                    plans.push((&mut **target, work));
                }
                Err(ProcessScanError::Gone) => report.exited.push(pid),
                Err(ProcessScanError::Failed(why)) => report.failed.push((pid, why)),
                Err(ProcessScanError::ShortOfFiles) => report.short_of_files.push(pid),
            }
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
        // What a large pass held only for itself goes back to the system: the
        // representatives it cached, and the heap its batches and lists freed.
        let taken_up = report.total.pages_hashed + report.total.pages_sampled;
        if taken_up >= RELEASE_AFTER_PAGES {
            for index in self.indexes.values_mut() {
                index.release_cache();
            }
            self.spare_batches = Vec::new();
            self.recent = RecentBatches::default();
            heap::give_back_freed();
        }
        report.ksm_checksums = std::mem::take(&mut self.ksm_checksums);
        report.merge_candidates = std::mem::take(&mut self.merge_candidates);
        report.ksm_pages = std::mem::take(&mut self.ksm_pages);
        report.seconds = started.elapsed().as_secs_f64();
        report
    }

    /// Reads and places `scans`, side by side; true if it was stopped.
    fn read_side_by_side(
        &mut self,
        scans: &mut [InProgress<'_>],
        pages_total: u64,
        pages_before: u64,
        progress: &mut dyn FnMut(Progress),
    ) -> bool {
        let mut stopped = false;
        // The targets are read side by side, a chunk of each in turn: workers of one program
        // hold their copies of a content at about the same place, so the representative a
        // copy is compared with is still in the index's cache when the next copies come. One
        // chunk is read while the one before it is placed.
        let kind = self.config.checksum;
        thread::scope(|scope| {
            let mut reads = match pages_total >= READ_AHEAD_PAGES && self.cpus > 1 {
                true => Reads::threads(scope, kind, READERS),
                false => Reads::in_line(kind),
            };
            // Read in line, each chunk is placed as soon as it is read.
            let ahead = match reads {
                Reads::InLine { .. } => 1,
                Reads::Threads { .. } => READ_AHEAD_CHUNKS,
            };
            let mut in_flight: VecDeque<Prepared> = VecDeque::new();
            let mut turn = 0;
            loop {
                while in_flight.len() < ahead {
                    let Some(which) = (0..scans.len())
                        .map(|k| (turn + k) % scans.len())
                        .find(|&k| !scans[k].steps.is_empty())
                    else {
                        break;
                    };
                    if self.stop.as_ref().is_some_and(|stop| stop()) {
                        stopped = true;
                        return;
                    }
                    turn = which + 1;
                    let started = Instant::now();
                    let prepared = self.prepare_next(&mut scans[which], which, &mut reads);
                    scans[which].counts.work_ns += started.elapsed().as_nanos() as u64;
                    if let Some(prepared) = prepared {
                        in_flight.push_back(prepared);
                    }
                }
                let Some(prepared) = in_flight.pop_front() else {
                    break;
                };
                let scan = &mut scans[prepared.scan];
                let weight = prepared.step.weight;
                match reads.next() {
                    // Its scan failed since it was prepared: nothing of it is placed.
                    Some(done) if scan.error.is_some() => self.spare_batches.push(done.bytes),
                    Some(done) => {
                        let started = Instant::now();
                        if let Err(e) = self.place(scan, prepared, done) {
                            scan.error = Some(e);
                            scan.steps.clear();
                        }
                        scan.counts.work_ns += started.elapsed().as_nanos() as u64;
                    }
                    None => {
                        scan.error =
                            Some(ProcessScanError::Failed("the reader thread ended".into()));
                        scan.steps.clear();
                    }
                }
                scan.done += weight;
                progress(Progress {
                    pages_done: pages_before + scans_done(scans),
                    pages_total,
                });
            }
        });
        stopped
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

    /// Asks the dirty source what changed in `target`, decides what to look at, and takes
    /// what may have changed out of the index.
    fn plan(&mut self, target: &mut Target, vmas: &[Vma]) -> Work {
        let pid = target.pid();
        let (process, state) = target.process_and_dirty();
        let dirty = self
            .dirty
            .dirty_pages(process, state, vmas)
            .unwrap_or_else(|e| {
                log::warn!("{e}; rehashing every page of pid {pid} this pass");
                DirtySet::All
            });
        // Only the daemon marks; a one-off scan keeps KSM's gate as it is.
        let hold = match state.armed_ranges() {
            Some(armed) if self.config.collect_merge_candidates => armed.clone(),
            _ => RangeSet::default(),
        };
        let kind = self.config.checksum;
        let index = self
            .indexes
            .entry(target.domain())
            .or_insert_with(|| Index::new(kind));
        let mut leave = |addr: u64, info: PageInfo| {
            if info.placed {
                index.remove(PageRef { pid, addr }, info.checksum);
            }
        };
        for (addr, info) in target.pages.keep_within(vmas) {
            leave(addr, info);
            target.merged.remove(addr);
            target.candidates.remove(&addr);
        }
        // Only pages under write protection since they were last read are vouched for.
        let trusted = match &dirty {
            DirtySet::All => RangeSet::default(),
            DirtySet::Only { armed, .. } => armed.intersection(&target.pages.scanned),
        };
        let vma_ranges: Vec<Range> = vmas.iter().map(|v| Range::new(v.start, v.end)).collect();
        let full = trusted.minus(&vma_ranges);
        let mut rehash: HashSet<u64> = self
            .recheck
            .remove(&pid)
            .unwrap_or_default()
            .into_iter()
            .filter(|&a| trusted.contains(a))
            .collect();
        if let DirtySet::Only { written, .. } = &dirty {
            rehash.extend(written.iter().copied().filter(|&a| trusted.contains(a)));
        }
        let mut sparse: Vec<u64> = rehash.iter().copied().collect();
        for r in trusted.as_slice() {
            sparse.extend(target.pages.pending_in(r.start, r.end));
        }
        sparse.sort_unstable();
        sparse.dedup();
        for r in &full {
            for (addr, info) in target.pages.pages_in(r.start, r.end) {
                leave(addr, info);
                target.candidates.remove(&addr);
            }
            target.pages.forget_sampled_in(r.start, r.end);
        }
        let mut sampled_before = HashMap::new();
        for &addr in &rehash {
            if let Some(info) = target.pages.get(addr) {
                leave(addr, info);
            }
            if let Some(digest) = target.pages.sampled_digest(addr) {
                sampled_before.insert(addr, digest);
                target.pages.forget_sampled_in(addr, addr + PAGE_SIZE);
            }
            target.candidates.remove(&addr);
        }
        Work {
            full,
            sparse,
            rehash,
            unseen: std::mem::take(&mut target.dirty.unseen),
            hold,
            released: 0,
            written_bits_read: target.dirty.take_bits_read(),
            sampled: Vec::new(),
            pages_sampled: 0,
            pages_only_sampled: 0,
            sampled_before,
        }
    }

    /// Makes candidates of the duplicates `target` held at its last pass that passed the gate:
    /// still in the index with company once every target's written pages have left it (a
    /// written page leaves in [`Scanner::plan`]), so neither they nor what they equal were
    /// written since they were compared. Their company is marked too, as at a placement.
    /// Returns how many passed.
    fn release_held(&mut self, target: &mut Target) -> u64 {
        let held = std::mem::take(&mut target.held);
        let Some(index) = self.indexes.get(&target.domain()) else {
            return 0;
        };
        let pid = target.pid();
        let mut released = 0;
        for (addr, checksum) in held {
            let page = PageRef { pid, addr };
            if let Some(other) = index.company(page, checksum) {
                released += 1;
                add_pair(&mut self.merge_candidates, page, other, checksum);
            }
        }
        released
    }

    /// Opens `target` and lists what its scan will look at, chunk by chunk: the present
    /// runs of its full ranges (pages known from before and absent now are forgotten), then
    /// the runs of its sparse pages.
    fn begin<'t>(&mut self, target: &'t mut Target, work: Work) -> InProgress<'t> {
        let pid = target.pid();
        let mut scan = InProgress {
            open: None,
            steps: VecDeque::new(),
            // Held duplicates count as found in the pass that lets them through the gate.
            counts: PageCounts {
                duplicate_pages: work.released,
                written_bits_read: work.written_bits_read,
                pages_sampled: work.pages_sampled,
                pages_only_sampled: work.pages_only_sampled,
                // A page only sampled is, as far as anyone knows, one of a kind.
                scanned_pages: work.pages_only_sampled,
                unique_pages: work.pages_only_sampled,
                ..PageCounts::default()
            },
            misses: 0,
            done: 0,
            error: None,
            target,
            work,
        };
        let opened = Pagemap::open(pid)
            .map_err(ProcessScanError::from)
            .and_then(|pagemap| {
                let mem = ProcMem::open(pid)?;
                // Opened on the address space the target has now: if that is another
                // program's since the target was adopted (a set-id one, which may also be
                // another domain's), it is not read. Later execs are caught by the reader.
                if scan.target.process().has_new_image() {
                    return Err(ProcessScanError::Gone);
                }
                Ok(Open {
                    pid,
                    domain: scan.target.domain(),
                    pagemap,
                    mem: Arc::new(mem),
                })
            });
        let open = match opened {
            Ok(open) => open,
            Err(e) => {
                scan.error = Some(e);
                return scan;
            }
        };
        for range in &scan.work.full {
            let present = match open.pagemap.present_runs(range.start, range.end) {
                Ok(present) => present,
                Err(e) => {
                    // Nothing of it is read: it starts over next pass.
                    scan.error = Some(e.into());
                    scan.steps.clear();
                    return scan;
                }
            };
            let mut gap_start = range.start;
            for run in present.iter().chain([&Range::new(range.end, range.end)]) {
                for (addr, _) in scan.target.pages.pages_in(gap_start, run.start) {
                    scan.target.pages.remove(addr);
                }
                gap_start = run.end;
            }
            let domain = scan.target.domain();
            settle(&mut self.samples, domain, &mut scan.target.pages);
            // The absent pages of the range count for its progress too, with its first step.
            let mut weight = range.pages() - present.iter().map(Range::pages).sum::<u64>();
            for run in &present {
                let mut from = run.start;
                while from < run.end {
                    let n = (((run.end - from) / PAGE_SIZE) as usize).min(CHUNK_PAGES);
                    scan.steps.push_back(Step {
                        start: from,
                        pages: n,
                        sparse: false,
                        weight: std::mem::take(&mut weight) + n as u64,
                    });
                    from += n as u64 * PAGE_SIZE;
                }
            }
            scan.done += weight;
        }
        // One pagemap read per run of consecutive pages.
        for run in page_runs(&scan.work.sparse, CHUNK_PAGES) {
            scan.steps.push_back(Step {
                start: run[0],
                pages: run.len(),
                sparse: true,
                weight: run.len() as u64,
            });
        }
        scan.open = Some(open);
        scan
    }

    /// Takes the next chunk of `scan` and looks it up in pagemap: what to read of it goes to
    /// `reads`, the rest waits in the returned [`Prepared`] for [`Scanner::place`]. A failure
    /// ends the scan.
    fn prepare_next(
        &mut self,
        scan: &mut InProgress<'_>,
        which: usize,
        reads: &mut Reads,
    ) -> Option<Prepared> {
        let step = scan.steps.pop_front()?;
        match self.prepare(scan, which, step) {
            Ok(Some((prepared, job))) => {
                // Fewer entries than asked: the rest of the run, from where pagemap stopped.
                let got = prepared.got;
                if got > 0 && got < step.pages {
                    scan.steps.push_front(Step {
                        start: step.start + got as u64 * PAGE_SIZE,
                        pages: step.pages - got,
                        weight: 0,
                        ..step
                    });
                }
                reads.submit(job);
                Some(prepared)
            }
            Ok(None) => {
                scan.done += step.weight;
                None
            }
            Err(e) => {
                scan.error = Some(e);
                scan.steps.clear();
                scan.done += step.weight;
                None
            }
        }
    }

    /// Ends `scan`: what it counted, or why it failed.
    fn finish(scan: &mut InProgress<'_>) -> Result<PageCounts, ProcessScanError> {
        if let Some(e) = scan.error.take() {
            return Err(e);
        }
        for range in scan.work.full.iter().chain(&scan.work.sampled) {
            scan.target.pages.scanned.insert(*range);
        }
        let mut counts = scan.counts;
        let pages = &scan.target.pages;
        counts.pages_skipped_clean =
            (pages.len() + pages.sampled_len()).saturating_sub(counts.scanned_pages);
        let pid = scan.target.pid();
        scan.target.dirty.note_misses(pid, scan.misses);
        scan.target
            .dirty
            .note_rehash_cost(counts.work_ns, counts.pages_hashed);
        Ok(counts)
    }

    /// Looks up the pages of `step` (of scan number `which`) in pagemap: forgets the absent,
    /// and lists the present with how each is to be obtained; those that may have changed (of
    /// a sparse step, the work's `rehash`; else all) are to be read, in the returned job.
    /// None if the target could not be opened.
    fn prepare(
        &mut self,
        scan: &mut InProgress<'_>,
        which: usize,
        step: Step,
    ) -> Result<Option<(Prepared, ReadJob)>, ProcessScanError> {
        let InProgress {
            target,
            work,
            open: Some(open),
            counts,
            ..
        } = scan
        else {
            return Ok(None);
        };
        let (start, n) = (step.start, step.pages);
        let rehash = step.sparse.then_some(&work.rehash);
        let pages = &mut target.pages;
        let pid = open.pid;
        let got = open.pagemap.read(start, &mut self.entries[..n])?;
        counts.pagemap_pages += got as u64;
        // What was known about these pages is taken out, and put back for those present.
        let old = pages.pages_in(start, start + got as u64 * PAGE_SIZE);
        let old_digests: Vec<Option<u32>> =
            old.iter().map(|&(a, _)| pages.counted_digest(a)).collect();
        for &(addr, _) in &old {
            pages.remove(addr);
        }
        settle(&mut self.samples, open.domain, pages);
        let digest_of_old = |addr: u64| {
            old.binary_search_by_key(&addr, |p| p.0)
                .map_or(None, |i| old_digests[i])
        };
        let previous_of = |addr: u64| {
            old.binary_search_by_key(&addr, |p| p.0)
                .map_or(NO_CHECKSUM, |i| old[i].1.checksum)
        };
        let mut candidates = Vec::with_capacity(got);
        let mut to_read = Vec::with_capacity(got);
        let mut mapped_once = Vec::with_capacity(got);
        let mut shared_mappings = Vec::new();
        for (i, entry) in self.entries[..got].iter().enumerate() {
            let Some(pfn) = entry.pfn() else { continue };
            if entry.file_or_shared() {
                continue;
            }
            counts.scanned_pages += 1;
            let addr = start + i as u64 * PAGE_SIZE;
            let previous = previous_of(addr);
            // A page mapped more than once may be a KSM page, the zero page, or shared with a
            // forked relative; count each physical page once.
            let (mut ksm, mut zero) = (false, false);
            if !entry.exclusive() && pfn != 0 {
                let flags = self.kpageflags.get(pfn).unwrap_or_default();
                counts.kpageflags_reads += 1;
                (ksm, zero) = (flags.ksm(), flags.zero_page());
                if ksm {
                    self.ksm_pages.entry(pid).or_default().push(addr);
                }
                if self.pfns_seen.contains_key(&pfn) {
                    counts.already_shared_pages += 1;
                    counts.ksm_pages_sharing += u64::from(ksm);
                    // Shared or not, a mapping of the zero page is a zero page.
                    counts.zero_pages += u64::from(zero);
                    // This mapping's content is the frame's: it is recorded with the frame's
                    // checksum, so that after a copy-on-write break the gate sees it unchanged.
                    shared_mappings.push((addr, pfn, previous));
                    continue;
                }
                self.pfns_seen.insert(pfn, NO_CHECKSUM);
                counts.ksm_pages_shared += u64::from(ksm);
            }
            // A page known unchanged is read anyway if the index holds its checksum: it will
            // be compared, and reading it here, in the batch, is much cheaper than one
            // /proc/PID/mem read at the comparison (only pages mapped once: see reader).
            let compared = entry.exclusive()
                && self
                    .indexes
                    .get(&open.domain)
                    .is_some_and(|i| i.holds(previous));
            let must_read =
                rehash.is_none_or(|r| r.contains(&addr)) || previous == NO_CHECKSUM || compared;
            let source = if zero {
                Source::Zero
            } else if must_read {
                to_read.push(addr);
                mapped_once.push(entry.exclusive());
                Source::Read(to_read.len() - 1)
            } else {
                Source::Known
            };
            candidates.push(Candidate {
                addr,
                ksm,
                source,
                pfn,
                previous,
                digest: digest_of_old(addr),
            });
        }

        let job = ReadJob {
            mem: open.mem.clone(),
            addrs: to_read,
            mapped_once,
            bytes: self.spare_batches.pop().unwrap_or_default(),
        };
        let prepared = Prepared {
            scan: which,
            step,
            got,
            candidates,
            shared_mappings,
        };
        Ok(Some((prepared, job)))
    }

    /// Places the pages of a prepared step, once its read is `done`: what was read is
    /// checksummed, the present pages are placed and recorded in the target's pages. A page of
    /// the work's `unseen` whose checksum changed is counted as a miss.
    fn place(
        &mut self,
        scan: &mut InProgress<'_>,
        prepared: Prepared,
        done: ReadDone,
    ) -> Result<(), ProcessScanError> {
        let ReadDone {
            addrs: to_read,
            bytes,
            sums: fresh,
            result,
            checksum_ns,
            read_hash_ns,
        } = done;
        let InProgress {
            target,
            work,
            open: Some(open),
            counts,
            misses,
            ..
        } = scan
        else {
            self.spare_batches.push(bytes);
            return Ok(());
        };
        if let Err(e) = result {
            self.spare_batches.push(bytes);
            return Err(e.into());
        }
        let Prepared {
            candidates,
            shared_mappings,
            ..
        } = prepared;
        let (unseen, hold) = (&work.unseen, &work.hold);
        let (pages, held) = (&mut target.pages, &mut target.held);
        let pid = open.pid;
        let kind = self.config.checksum;
        counts.checksum_ns += checksum_ns;
        counts.work_ns += read_hash_ns;
        counts.pages_hashed += fresh.iter().filter(|&&c| c != NO_CHECKSUM).count() as u64;

        let index = self
            .indexes
            .entry(open.domain)
            .or_insert_with(|| Index::new(kind));
        // The representatives these pages will be compared with, read in runs.
        let wanted: Vec<(PageRef, u64)> = candidates
            .iter()
            .filter_map(|c| {
                let sum = match c.source {
                    Source::Zero => return None,
                    Source::Read(slot) => fresh[slot],
                    Source::Known => c.previous,
                };
                Some((index.representative_to_read(sum)?, sum))
            })
            .collect();
        preload_representatives(
            index,
            &self.recent,
            &mut self.live,
            wanted,
            &mut self.rep_batch,
        );
        for candidate in &candidates {
            let page = PageRef {
                pid,
                addr: candidate.addr,
            };
            let (checksum, content) = match candidate.source {
                Source::Zero => (self.zero_checksum, Content::Zero),
                Source::Read(slot) if fresh[slot] == NO_CHECKSUM => {
                    counts.pages_vanished += 1;
                    counts.scanned_pages -= 1;
                    continue;
                }
                Source::Read(slot) => {
                    if unseen.contains(&candidate.addr) {
                        let changed = match work.sampled_before.get(&candidate.addr) {
                            Some(&digest) => digest != digest_of(&bytes[slot * PAGE..][..PAGE]),
                            None => fresh[slot] != candidate.previous,
                        };
                        *misses += u64::from(changed);
                    }
                    (
                        fresh[slot],
                        Content::Loaded(&bytes[slot * PAGE..(slot + 1) * PAGE]),
                    )
                }
                Source::Known => (candidate.previous, Content::Unread),
            };
            let is_zero = checksum == self.zero_checksum
                && match content {
                    Content::Loaded(bytes) => bytes.iter().all(|&b| b == 0),
                    Content::Zero | Content::Unread => true,
                };
            // Read for the first time where writes are tracked from now on: compared now,
            // while its content is at hand, and held for the gate.
            let first_read = candidate.previous == NO_CHECKSUM
                && matches!(candidate.source, Source::Read(_))
                && hold.contains(candidate.addr);
            let (placement, gated) = if first_read {
                index.place_first_read(page, checksum, candidate.ksm, content, &mut self.live)
            } else {
                let placement = index.place(
                    page,
                    checksum,
                    candidate.previous,
                    candidate.ksm,
                    content,
                    &mut self.live,
                );
                (placement, false)
            };
            for stale in index.take_stale() {
                self.recheck.entry(stale.pid).or_default().push(stale.addr);
            }
            match placement {
                Placement::Unique => counts.unique_pages += 1,
                // New, so not yet through the gate: volatile this pass, as before.
                Placement::Duplicate { .. } if gated => {
                    counts.volatile_pages += 1;
                    held.push((page.addr, checksum));
                }
                Placement::Duplicate { of } => {
                    counts.duplicate_pages += 1;
                    if self.config.collect_merge_candidates {
                        add_pair(&mut self.merge_candidates, page, of, checksum);
                    }
                }
                Placement::Volatile => counts.volatile_pages += 1,
                Placement::Vanished => {
                    counts.pages_vanished += 1;
                    counts.scanned_pages -= 1;
                    continue;
                }
            }
            if is_zero {
                counts.zero_pages += 1;
            }
            if candidate.ksm {
                self.ksm_checksums.entry(pid).or_default().push(checksum);
            }
            let digest = match (self.sampler.is_some(), content) {
                (false, _) => None,
                (true, Content::Zero) => Some(self.zero_digest),
                (true, Content::Loaded(bytes)) => Some(digest_of(bytes)),
                (true, Content::Unread) => candidate.digest,
            };
            pages.set_with_digest(
                page.addr,
                PageInfo {
                    checksum,
                    placed: placement != Placement::Volatile,
                },
                digest,
            );
            // A page read whole (written, or new where nothing is sampled) that meets pages
            // only sampled: those are read whole at their target's next pass.
            if let (Some(digest), Content::Loaded(_)) = (digest, content) {
                if let Some(samples) = self.samples.get_mut(&open.domain) {
                    samples.read_whole(digest);
                }
            }
            if let Some(known) = self.pfns_seen.get_mut(&candidate.pfn) {
                *known = checksum;
            }
        }
        if let Some(spare) = self.recent.keep(pid, to_read, fresh, bytes) {
            self.spare_batches.push(spare);
        }
        for (addr, pfn, previous) in shared_mappings {
            // Another mapping of a frame placed once already: settled, not in the index.
            let checksum = match self.pfns_seen.get(&pfn) {
                Some(&known) if known != NO_CHECKSUM => known,
                _ => previous,
            };
            if checksum != NO_CHECKSUM {
                pages.set(
                    addr,
                    PageInfo {
                        checksum,
                        placed: true,
                    },
                );
            }
        }
        settle(&mut self.samples, open.domain, pages);
        Ok(())
    }

    /// Samples the new pages of `plans` (present for the first time where writes are tracked
    /// from now on) instead of reading them: the pages whose digest meets another page's of
    /// the domain, this pass or kept from before, go to their work's sparse pages to be read
    /// whole (with the page only sampled they met, from its own target's work); the others
    /// are recorded as only sampled and are not read. A range that cannot be sampled is read
    /// in full, as without a sampler.
    fn sample_new(&mut self, plans: &mut [(&mut Target, Work)]) {
        let Some(sampler) = self.sampler.as_mut() else {
            return;
        };
        let mut wanted = HashMap::new();
        let mut entries = vec![PagemapEntry(0); CHUNK_PAGES];
        let mut batch = SampleBatch::default();
        let mut broken = false;
        for (target, work) in plans.iter_mut() {
            if broken || work.full.is_empty() || work.hold.is_empty() {
                continue;
            }
            let Ok(pagemap) = Pagemap::open(target.pid()) else {
                continue;
            };
            let index = self.samples.entry(target.domain()).or_default();
            let mut full = Vec::new();
            for range in std::mem::take(&mut work.full) {
                // Only memory present for the first time where writes are tracked from now on.
                let new = !broken
                    && work.hold.covers(range.start, range.end)
                    && target.pages.pages_in(range.start, range.end).is_empty();
                let present = new.then(|| pagemap.present_runs(range.start, range.end));
                let Some(Ok(present)) = present else {
                    full.push(range);
                    continue;
                };
                let mut whole = true;
                'runs: for run in &present {
                    let mut from = run.start;
                    while from < run.end {
                        let n = (((run.end - from) / PAGE_SIZE) as usize).min(CHUNK_PAGES);
                        let got = match pagemap.read(from, &mut entries[..n]) {
                            Ok(0) => break,
                            Ok(got) => got,
                            Err(_) => {
                                whole = false;
                                break 'runs;
                            }
                        };
                        let pages = &mut target.pages;
                        if let Err(e) =
                            batch.take_up(sampler, index, from, &entries[..got], pages, work)
                        {
                            log::warn!(
                                "sampling failed ({e}); new pages are read whole from now on"
                            );
                            (whole, broken) = (false, true);
                            break 'runs;
                        }
                        from += got as u64 * PAGE_SIZE;
                    }
                }
                match whole {
                    true => work.sampled.push(range),
                    // Read in full after all; what was listed is read twice at most.
                    false => full.push(range),
                }
            }
            work.full = full;
        }
        if broken {
            self.sampler = None;
        }
        // The pages only sampled whose digest a page met (this pass, or read whole since the
        // last) are read whole now, found by their digest in the targets of this pass.
        for (target, work) in plans.iter_mut() {
            let Some(index) = self.samples.get_mut(&target.domain()) else {
                continue;
            };
            let wanted = wanted
                .entry(target.domain())
                .or_insert_with(|| index.take_wanted());
            if wanted.is_empty() || target.pages.sampled_len() == 0 {
                continue;
            }
            for (addr, digest) in target.pages.take_sampled_where(|d| wanted.contains(&d)) {
                index.unsample(digest);
                work.sparse.push(addr);
                // Sampled this pass: it was counted as one of a kind.
                if work
                    .sampled
                    .iter()
                    .any(|r| (r.start..r.end).contains(&addr))
                {
                    work.pages_only_sampled -= 1;
                }
            }
        }
        // Pages only sampled with a wanted digest in targets this pass did not cover are
        // looked for again at the next.
        for (domain, digests) in wanted {
            if let Some(index) = self.samples.get_mut(&domain) {
                index.want_again(digests);
            }
        }
        for (_, work) in plans.iter_mut() {
            if work.pages_sampled > 0 || !work.sparse.is_sorted() {
                work.sparse.sort_unstable();
                work.sparse.dedup();
            }
        }
    }
}

/// The buffers of the sampling stage, kept from batch to batch.
#[derive(Default)]
struct SampleBatch {
    pfns: Vec<u64>,
    addrs: Vec<u64>,
    digests: Vec<u32>,
    alone: Vec<u64>,
    alone_digests: Vec<u32>,
}

impl SampleBatch {
    /// Takes up the pages `entries` describe (from `from`, a batch at most): those mapped
    /// once are sampled and met in `index`; a page mapped more than once (KSM, the zero page,
    /// a fork), one the sampler could not read, or one whose digest another page has goes to
    /// `work`'s sparse pages to be read whole; the others are recorded in `pages` as only
    /// sampled. An error is the sampler's: nothing of the batch was taken up.
    fn take_up(
        &mut self,
        sampler: &mut Sampler,
        index: &mut SampleIndex,
        from: u64,
        entries: &[PagemapEntry],
        pages: &mut PageState,
        work: &mut Work,
    ) -> Result<(), SamplerError> {
        self.pfns.clear();
        self.addrs.clear();
        for (i, entry) in entries.iter().enumerate() {
            let addr = from + i as u64 * PAGE_SIZE;
            let Some(pfn) = entry.pfn() else { continue };
            if entry.file_or_shared() {
                continue;
            }
            if entry.exclusive() && pfn != 0 {
                self.pfns.push(pfn);
                self.addrs.push(addr);
            } else {
                work.sparse.push(addr);
            }
        }
        self.digests.resize(self.pfns.len(), 0);
        sampler.sample(&self.pfns, &mut self.digests)?;
        self.alone.clear();
        self.alone_digests.clear();
        for (&addr, &digest) in self.addrs.iter().zip(&self.digests) {
            if digest == rksm_common::sample::UNREAD {
                work.sparse.push(addr);
                continue;
            }
            match index.meet(digest) {
                Meets::Nothing => {
                    self.alone.push(addr);
                    self.alone_digests.push(digest);
                }
                Meets::Company | Meets::Sampled => work.sparse.push(addr),
            }
        }
        pages.set_sampled(&self.alone, &self.alone_digests);
        work.pages_only_sampled += self.alone.len() as u64;
        work.pages_sampled += self.addrs.len() as u64;
        Ok(())
    }
}

/// Tells domain `domain`'s sample index what changed in `pages` (of `pid`).
fn settle(samples: &mut HashMap<u32, SampleIndex>, domain: u32, pages: &mut PageState) {
    let changes = pages.take_changes();
    if !changes.is_empty() {
        samples.entry(domain).or_default().follow(&changes);
    }
}

/// Records `page` and `of`, found equal under `checksum`, among the pass's merge candidates:
/// marking both lets ksmd merge them.
fn add_pair(
    candidates: &mut HashMap<u32, Vec<(u64, u64)>>,
    page: PageRef,
    of: PageRef,
    checksum: u64,
) {
    for p in [page, of] {
        candidates
            .entry(p.pid)
            .or_default()
            .push((p.addr, checksum));
    }
}

/// Puts the representatives `wanted` (with the checksum each must still have) into the
/// index's cache: from the recent batches if one of them read it, else read in runs of
/// consecutive pages, one /proc/PID/mem read per run instead of one per comparison. The
/// first pass after arming compares every duplicate with a page of another process, and
/// those are mostly consecutive there too. A run that cannot be read in
/// full is left to the comparisons, which read page by page and find what changed.
fn preload_representatives(
    index: &mut Index,
    recent: &RecentBatches,
    live: &mut LiveMemory,
    mut wanted: Vec<(PageRef, u64)>,
    buf: &mut Vec<u8>,
) {
    wanted.retain(|&(page, sum)| match recent.find(page, sum) {
        Some(bytes) => {
            index.preload_hashed(page, bytes);
            false
        }
        None => true,
    });
    wanted.sort_unstable_by_key(|(page, _)| *page);
    wanted.dedup_by_key(|(page, _)| *page);
    let consecutive = |a: &(PageRef, u64), b: &(PageRef, u64)| {
        a.0.pid == b.0.pid && a.0.addr + PAGE_SIZE == b.0.addr
    };
    for run in wanted.chunk_by(consecutive) {
        let (first, _) = run[0];
        buf.resize(run.len() * PAGE, 0);
        let mem = live
            .open
            .entry(first.pid)
            .or_insert_with(|| ProcMem::open(first.pid).ok());
        if !mem.as_ref().is_some_and(|m| m.read_at(first.addr, buf)) {
            continue;
        }
        for (i, &(page, sum)) in run.iter().enumerate() {
            index.preload(page, sum, &buf[i * PAGE..(i + 1) * PAGE]);
        }
    }
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

    #[test]
    fn readers_give_back_every_job_read_and_checksummed_in_the_order_it_was_submitted() {
        // This process's own pages, 64 of them, each filled with its number.
        let mut memory = vec![0u8; 65 * PAGE];
        let base = (memory.as_ptr() as usize).next_multiple_of(PAGE);
        let offset = base - memory.as_ptr() as usize;
        for (i, page) in memory[offset..offset + 64 * PAGE]
            .chunks_mut(PAGE)
            .enumerate()
        {
            page.fill(i as u8);
        }
        let mem = Arc::new(ProcMem::open(std::process::id()).expect("/proc/self/mem"));
        let kind = ChecksumKind::Xxh64;
        // Jobs of 1 to 11 pages, one left unmapped at the end (address 8 is never mapped).
        let jobs = || {
            (1..=11u64).map(|n| {
                let first = (n * n) % 53;
                let mut addrs: Vec<u64> = (first..first + n)
                    .map(|i| base as u64 + i * PAGE_SIZE)
                    .collect();
                if n == 5 {
                    addrs.push(8 * PAGE_SIZE);
                }
                ReadJob {
                    mem: mem.clone(),
                    mapped_once: vec![true; addrs.len()],
                    addrs,
                    bytes: Vec::new(),
                }
            })
        };
        let in_line: Vec<ReadDone> = {
            let mut reads = Reads::in_line(kind);
            jobs().for_each(|j| reads.submit(j));
            std::iter::from_fn(|| reads.next()).collect()
        };
        let threaded: Vec<ReadDone> = thread::scope(|scope| {
            let mut reads = Reads::threads(scope, kind, 3);
            jobs().for_each(|j| reads.submit(j));
            (0..11).filter_map(|_| reads.next()).collect()
        });
        assert_eq!(in_line.len(), 11);
        assert_eq!(threaded.len(), 11);
        for (n, (a, b)) in (1..=11u64).zip(in_line.iter().zip(&threaded)) {
            let first = (n * n) % 53;
            assert_eq!(a.addrs, b.addrs, "job {n}: in order");
            assert_eq!(a.sums, b.sums, "job {n}");
            for (slot, i) in (first..first + n).enumerate() {
                let page = &b.bytes[slot * PAGE..(slot + 1) * PAGE];
                assert!(page.iter().all(|&x| x == i as u8), "job {n}, page {i}");
                assert_eq!(b.sums[slot], kind.checksum(page), "job {n}, page {i}");
            }
            assert!(b.result.is_ok(), "job {n}");
            if n == 5 {
                assert_eq!(
                    b.sums.last(),
                    Some(&NO_CHECKSUM),
                    "an unmapped page is not read"
                );
            }
        }
        drop(memory);
    }

    #[test]
    fn recent_batches_give_back_what_they_read_with_its_checksum_and_only_this_pass() {
        let mut recent = RecentBatches::default();
        let batch = |fill: u8| {
            let mut bytes = vec![fill; 2 * PAGE];
            bytes[PAGE..].fill(fill + 1);
            bytes
        };
        let page = |pid, addr| PageRef { pid, addr };
        assert_eq!(
            recent.keep(1, vec![0x1000, 0x3000], vec![10, 11], batch(10)),
            None,
            "nothing to give back yet"
        );
        assert_eq!(recent.find(page(1, 0x3000), 11), Some(&[11; PAGE]));
        assert_eq!(recent.find(page(1, 0x3000), 12), None, "another checksum");
        assert_eq!(recent.find(page(2, 0x3000), 11), None, "another process");
        assert_eq!(recent.find(page(1, 0x2000), 10), None, "not read");
        // Older batches give their buffers back for newer ones.
        for pid in 2..=RECENT_BATCHES as u32 {
            let spare = recent.keep(pid, vec![0x1000, 0x2000], vec![1, 2], batch(pid as u8 * 10));
            assert_eq!(spare, None);
        }
        let spare = recent.keep(4, vec![0x1000, 0x2000], vec![1, 2], batch(40));
        assert_eq!(spare, Some(batch(10)), "the oldest batch's buffer");
        assert_eq!(recent.batches.len(), RECENT_BATCHES);
        assert_eq!(recent.find(page(1, 0x3000), 11), None, "the oldest went");
        assert_eq!(recent.find(page(4, 0x2000), 2), Some(&[41; PAGE]));
        recent.forget();
        assert_eq!(recent.find(page(4, 0x2000), 2), None, "a new pass");
    }
}
