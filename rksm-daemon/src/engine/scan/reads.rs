//! How a pass reads pages: batches copied out of the targets and checksummed, in line or on
//! reader threads, the last batches kept for the representatives of the next ones, and the
//! representatives a batch will be compared with read ahead in runs.

use std::{
    collections::{HashMap, VecDeque},
    sync::{mpsc, Arc},
    thread,
    time::Instant,
};

use rksm_common::{PAGE, PAGE_SIZE};

use super::{
    report::Progress, sampling::settle, scans_done, Candidate, InProgress, Prepared,
    ProcessScanError, Scanner, Source, Step, CHUNK_PAGES,
};
use crate::{
    engine::{
        checksum::{ChecksumKind, NO_CHECKSUM},
        index::{ContentSource, Index, PageRef},
    },
    kernel::reader::{self, ProcMem, ReaderError},
};

/// Reads single pages of live processes for the index's comparisons, through /proc/PID/mem
/// (a representative may well be a KSM or fork-shared page, which pinning would unshare).
#[derive(Default)]
pub(super) struct LiveMemory {
    pub(super) open: HashMap<u32, Option<ProcMem>>,
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
pub(super) struct RecentBatches {
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
    pub(super) fn keep(
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
    pub(super) fn forget(&mut self) {
        for batch in &mut self.batches {
            batch.addrs.clear();
            batch.sums.clear();
        }
    }
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
pub(super) struct ReadDone {
    pub(super) addrs: Vec<u64>,
    pub(super) bytes: Vec<u8>,
    pub(super) sums: Vec<u64>,
    pub(super) result: Result<(), ReaderError>,
    pub(super) checksum_ns: u64,
    /// The whole job: the copy and the checksums.
    pub(super) read_hash_ns: u64,
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
        Ok(_) => {
            let pages: Vec<&[u8; PAGE]> = bytes
                .as_chunks::<PAGE>()
                .0
                .iter()
                .zip(&read_ok)
                .filter_map(|(page, &ok)| ok.then_some(page))
                .collect();
            let mut read_sums = vec![0; pages.len()];
            kind.checksum_pages(&pages, &mut read_sums);
            let mut read_sums = read_sums.into_iter();
            read_ok
                .iter()
                .map(|&ok| match ok {
                    true => read_sums.next().unwrap_or(NO_CHECKSUM),
                    false => NO_CHECKSUM,
                })
                .collect()
        }
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

/// Puts the representatives `wanted` (with the checksum each must still have) into the
/// index's cache: from the recent batches if one of them read it, else read in runs of
/// consecutive pages, one /proc/PID/mem read per run instead of one per comparison. The
/// first pass after arming compares every duplicate with a page of another process, and
/// those are mostly consecutive there too. A run that cannot be read in
/// full is left to the comparisons, which read page by page and find what changed.
pub(super) fn preload_representatives(
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

impl Scanner {
    /// Reads and places `scans`, side by side; true if it was stopped.
    pub(super) fn read_side_by_side(
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
        let pages = target.pages_mut();
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
}

#[cfg(test)]
mod tests {
    use super::*;

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
