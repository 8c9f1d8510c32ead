//! How a pass reads pages: batches copied out of the targets and checksummed, one at a time
//! on the scanning thread, the last batches kept for the representatives of the next ones,
//! and the representatives a batch will be compared with read ahead in runs.

use std::{
    collections::{HashMap, VecDeque},
    time::Instant,
};

use rksm_common::{PAGE, PAGE_SIZE};

use super::{
    report::Progress, sampling::settle, scans_done, Candidate, InProgress, Prepared,
    ProcessScanError, Scanner, Source, Sparse, Step,
};
use crate::{
    engine::{
        checksum::NO_CHECKSUM,
        index::{ContentSource, Index, PageRef},
        pages::PageInfo,
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

/// How many batches read in a pass are kept after they are placed (2 MiB at most). A copy's
/// twin is nearly always in the batch just before it (the targets are kept level by the
/// pages each looked at), and a read then copies into a buffer written 2 MiB of copies
/// ago, still in the processor's cache; with sixteen (8 MiB) it had mostly left it, and a
/// first pass cost more (docs/BENCHMARKS.md, (f)).
const RECENT_BATCHES: usize = 4;

/// The last batches read in a pass, kept for the representatives of the next ones: the
/// targets are read side by side, so the page a copy is compared with was most often read a
/// few steps before, and its bytes are still here, with the checksum computed from them.
/// Finding it here spares a /proc/PID/mem read and a checksum. The buffers go round: keeping
/// a batch gives the oldest one's buffer back for the next read.
///
/// A batch's pages read for the first time can also be found by their sample's digest
/// ([`RecentBatches::twin`]): a new page byte-equal to one of them has that page's
/// checksum, which spares hashing it, and joins that page's class without a comparison.
#[derive(Default)]
pub(super) struct RecentBatches {
    batches: VecDeque<ReadBatch>,
    /// Batches kept since the pass began: the number of the next one.
    kept: u64,
    /// Where the newest page kept with a digest is, by the digest's low bits: a twin is
    /// looked for a few batches after it was kept, so one place a digest costs no hashing
    /// and no allocation, and a page whose place another digest took meanwhile is only
    /// hashed and compared as any other.
    twins: Vec<TwinPlace>,
}

/// Places in [`RecentBatches::twins`].
const TWIN_PLACES: usize = 1 << 14;

/// A page of the recent batches a newcomer may be the twin of.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
struct TwinPlace {
    digest: u32,
    slot: u32,
    /// One more than the batch's number: 0 is an empty place.
    batch: u64,
}

fn twin_place(digest: u32) -> usize {
    digest as usize % TWIN_PLACES
}

/// One batch: page `addrs[i]` of `pid`, with checksum `sums[i]`, at `bytes[i * PAGE..]`.
struct ReadBatch {
    number: u64,
    pid: u32,
    addrs: Vec<u64>,
    sums: Vec<u64>,
    bytes: Vec<u8>,
}

impl ReadBatch {
    fn page(&self, i: usize) -> &[u8; PAGE] {
        self.bytes[i * PAGE..(i + 1) * PAGE]
            .try_into()
            .expect("a page's bytes")
    }
}

impl RecentBatches {
    /// The bytes of `page`, if a recent batch read it and they have checksum `sum`.
    fn find(&self, page: PageRef, sum: u64) -> Option<&[u8; PAGE]> {
        self.batches
            .iter()
            .filter(|b| b.pid == page.pid)
            .find_map(|b| {
                let i = b.addrs.binary_search(&page.addr).ok()?;
                (b.sums[i] == sum).then(|| b.page(i))
            })
    }

    /// The page of the recent batches last listed with `digest`, if its bytes are
    /// `content`'s, with its checksum.
    pub(super) fn twin(&self, digest: u32, content: &[u8; PAGE]) -> Option<(PageRef, u64)> {
        let place = *self.twins.get(twin_place(digest))?;
        if place.digest != digest || place.batch == 0 {
            return None;
        }
        let oldest = self.batches.front()?.number;
        let at = (place.batch - 1).checked_sub(oldest)?;
        let batch = self.batches.get(at as usize)?;
        let slot = place.slot as usize;
        (batch.page(slot) == content).then(|| {
            let page = PageRef {
                pid: batch.pid,
                addr: batch.addrs[slot],
            };
            (page, batch.sums[slot])
        })
    }

    /// Keeps the batch just placed (`pid`'s pages `addrs`, ascending, with `sums`, in
    /// `bytes`; `twins` the `(digest, slot)` of those a newcomer may be the twin of), and
    /// gives back the buffer of the oldest kept batch for another read.
    pub(super) fn keep(
        &mut self,
        pid: u32,
        addrs: Vec<u64>,
        sums: Vec<u64>,
        bytes: Vec<u8>,
        twins: &[(u32, u32)],
    ) -> Option<Vec<u8>> {
        let spare = match self.batches.len() {
            n if n >= RECENT_BATCHES => self.batches.pop_front().map(|old| old.bytes),
            _ => None,
        };
        let number = self.kept;
        self.kept += 1;
        if self.twins.is_empty() && !twins.is_empty() {
            self.twins = vec![TwinPlace::default(); TWIN_PLACES];
        }
        for &(digest, slot) in twins {
            self.twins[twin_place(digest)] = TwinPlace {
                digest,
                batch: number + 1,
                slot,
            };
        }
        self.batches.push_back(ReadBatch {
            number,
            pid,
            addrs,
            sums,
            bytes,
        });
        spare
    }

    /// Lets go of the buffers of the batches kept that hold more than `bytes`: what they
    /// read is of no use to the next pass, which forgets it.
    pub(super) fn release_larger_than(&mut self, bytes: usize) {
        for batch in &mut self.batches {
            if batch.bytes.capacity() > bytes {
                batch.bytes = Vec::new();
                batch.addrs.clear();
                batch.sums.clear();
            }
        }
    }

    /// Forgets what was read (a new pass: pages may have changed since); keeps the buffers.
    pub(super) fn forget(&mut self) {
        for batch in &mut self.batches {
            batch.addrs.clear();
            batch.sums.clear();
        }
        self.twins.fill(TwinPlace::default());
    }
}

/// Pages of one process to read: `addrs`, ascending, into `bytes`.
struct ReadJob {
    addrs: Vec<u64>,
    mapped_once: Vec<bool>,
    bytes: Vec<u8>,
}

/// A job done: page `addrs[i]` at `bytes[i * PAGE..]`, where `read_ok[i]` (a page that
/// could not be read vanished since pagemap listed it).
pub(super) struct ReadDone {
    pub(super) addrs: Vec<u64>,
    pub(super) bytes: Vec<u8>,
    pub(super) read_ok: Vec<bool>,
    pub(super) result: Result<(), ReaderError>,
}

/// Reads `job`'s pages out of `mem`.
fn read(mem: &ProcMem, job: ReadJob) -> ReadDone {
    let ReadJob {
        addrs,
        mapped_once,
        mut bytes,
    } = job;
    // As large as this job needs: a steady pass reads a few pages, and its buffers stay
    // with the recent batches until the next large pass.
    if bytes.len() < addrs.len() * PAGE {
        bytes.resize(addrs.len() * PAGE, 0);
    }
    let mut read_ok = vec![false; addrs.len()];
    let result = reader::read_pages(mem, &addrs, &mapped_once, &mut bytes, &mut read_ok);
    if result.is_err() {
        read_ok.fill(false);
    }
    ReadDone {
        addrs,
        bytes,
        read_ok,
        result: result.map(|_| ()),
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
    ///
    /// All on this thread, a chunk at a time: copied out, checksummed and placed while its
    /// bytes are still in this core's cache. Reader threads that copied and checksummed the
    /// next chunks while this one was placed took a first pass's time down and its CPU up:
    /// the placing thread then compared bytes another core had written, out of the shared
    /// cache or memory (docs/design.md, "One thread reads and places").
    pub(super) fn read_side_by_side(
        &mut self,
        scans: &mut [InProgress<'_>],
        pages_total: u64,
        pages_before: u64,
        progress: &mut dyn FnMut(Progress),
    ) -> bool {
        // The targets are read side by side, kept level by the pages each has looked at (of
        // a sparse step, the pages listed in it, not the address space it spans): workers of
        // one program list their copies of a content in the same order among the pages they
        // read, however the pages only sampled lie between them, so the page a copy is
        // compared with, or is the twin of, is in the batch before it or the one before
        // that. (Kept level by address space spanned, a target whose copies lay further
        // apart fell further behind at every batch, out of reach of the recent batches;
        // taking a step of each in turn did the same to one whose copies followed more
        // small runs of pages.)
        loop {
            let Some(which) = (0..scans.len())
                .filter(|&k| !scans[k].steps.is_empty())
                .min_by_key(|&k| scans[k].taken)
            else {
                return false;
            };
            if self.stop.as_ref().is_some_and(|stop| stop()) {
                return true;
            }
            let scan = &mut scans[which];
            let started = Instant::now();
            let (weight, looks) = scan.steps.front().map_or((0, 0), |s| (s.weight, s.looks()));
            scan.taken += looks;
            let next = self.prepare_next(scan);
            let read = next.and_then(|(prepared, job)| {
                let open = scan.open.as_ref()?;
                Some((prepared, read(&open.mem, job)))
            });
            if let Some((prepared, done)) = read {
                if let Err(e) = self.place(scan, prepared, done) {
                    scan.error = Some(e);
                    scan.steps.clear();
                }
                scan.done += weight;
            }
            scan.counts.work_ns += started.elapsed().as_nanos() as u64;
            progress(Progress {
                pages_done: pages_before + scans_done(scans),
                pages_total,
            });
        }
    }

    /// Takes the next chunk of `scan` and looks it up in pagemap: what to read of it, and
    /// the rest waiting in the returned [`Prepared`] for [`Scanner::place`]. A failure ends
    /// the scan.
    fn prepare_next(&mut self, scan: &mut InProgress<'_>) -> Option<(Prepared, ReadJob)> {
        let step = scan.steps.pop_front()?;
        match self.prepare(scan, step) {
            Ok(Some((prepared, job))) => {
                // Fewer entries than asked: the rest of the step, from where pagemap stopped.
                let got = prepared.got;
                if got > 0 && got < step.pages {
                    let start = step.start + got as u64 * PAGE_SIZE;
                    let sparse = step.sparse.map(|s| {
                        let taken = scan.work.sparse[s.first..s.first + s.count]
                            .partition_point(|&a| a < start);
                        Sparse {
                            first: s.first + taken,
                            count: s.count - taken,
                        }
                    });
                    let rest = Step {
                        start,
                        pages: step.pages - got,
                        sparse,
                        weight: 0,
                    };
                    // Counted again when it is taken.
                    scan.taken -= rest.looks();
                    scan.steps.push_front(rest);
                }
                Some((prepared, job))
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

    /// Looks up the pages of `step` in pagemap: forgets the absent,
    /// and lists the present with how each is to be obtained; those that may have changed (of
    /// a sparse step, the work's `rehash`; else all) are to be read, in the returned job.
    /// None if the target could not be opened.
    fn prepare(
        &mut self,
        scan: &mut InProgress<'_>,
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
        let rehash = step.sparse.is_some().then_some(&work.rehash);
        let pages = target.pages_mut();
        let pid = open.pid;
        let got = open.pagemap.read(start, &mut self.entries[..n])?;
        let end = start + got as u64 * PAGE_SIZE;
        // The pages looked at: all those pagemap covered, or of a sparse step only its own.
        let looked_at: Vec<usize> = match step.sparse {
            None => (0..got).collect(),
            Some(s) => work.sparse[s.first..s.first + s.count]
                .iter()
                .take_while(|&&a| a < end)
                .map(|&a| ((a - start) / PAGE_SIZE) as usize)
                .collect(),
        };
        counts.pagemap_pages += got as u64;
        // What was known about these pages is taken out, and put back for those present.
        let old: Vec<(u64, PageInfo)> = match step.sparse {
            None => pages.pages_in(start, end),
            Some(_) => pages.known_at(looked_at.iter().map(|&i| start + i as u64 * PAGE_SIZE)),
        };
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
        for &i in &looked_at {
            let entry = self.entries[i];
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
                && previous != NO_CHECKSUM
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
            addrs: to_read,
            mapped_once,
            bytes: self.spare_batches.pop().unwrap_or_default(),
        };
        let prepared = Prepared {
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
    fn a_job_is_read_page_by_page_and_an_unmapped_page_is_not_read() {
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
        let mem = ProcMem::open(std::process::id()).expect("/proc/self/mem");
        // Jobs of 1 to 11 pages, one with an unmapped page at the end (address 8 is never
        // mapped), each into a buffer too small or left from a larger job.
        let mut bytes = Vec::new();
        for n in 1..=11u64 {
            let first = (n * n) % 53;
            let mut addrs: Vec<u64> = (first..first + n)
                .map(|i| base as u64 + i * PAGE_SIZE)
                .collect();
            if n == 5 {
                addrs.push(8 * PAGE_SIZE);
            }
            let job = ReadJob {
                mapped_once: vec![true; addrs.len()],
                addrs: addrs.clone(),
                bytes,
            };
            let done = read(&mem, job);
            assert_eq!(done.addrs, addrs, "job {n}");
            assert!(done.result.is_ok(), "job {n}");
            for (slot, i) in (first..first + n).enumerate() {
                let page = &done.bytes[slot * PAGE..(slot + 1) * PAGE];
                assert!(page.iter().all(|&x| x == i as u8), "job {n}, page {i}");
                assert!(done.read_ok[slot], "job {n}, page {i}");
            }
            if n == 5 {
                assert_eq!(
                    done.read_ok.last(),
                    Some(&false),
                    "an unmapped page is not read"
                );
            }
            bytes = done.bytes;
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
            recent.keep(1, vec![0x1000, 0x3000], vec![10, 11], batch(10), &[(77, 1)]),
            None,
            "nothing to give back yet"
        );
        assert_eq!(recent.find(page(1, 0x3000), 11), Some(&[11; PAGE]));
        assert_eq!(recent.find(page(1, 0x3000), 12), None, "another checksum");
        assert_eq!(recent.find(page(2, 0x3000), 11), None, "another process");
        assert_eq!(recent.find(page(1, 0x2000), 10), None, "not read");
        // A twin is found by its digest and its bytes alike.
        assert_eq!(recent.twin(77, &[11; PAGE]), Some((page(1, 0x3000), 11)));
        assert_eq!(recent.twin(77, &[12; PAGE]), None, "other bytes");
        assert_eq!(recent.twin(78, &[11; PAGE]), None, "another digest");
        assert_eq!(recent.twin(77, &[10; PAGE]), None, "a page not listed");
        // Older batches give their buffers back for newer ones.
        for pid in 2..=RECENT_BATCHES as u32 {
            let spare = recent.keep(
                pid,
                vec![0x1000, 0x2000],
                vec![1, 2],
                batch(pid as u8 * 10),
                &[],
            );
            assert_eq!(spare, None);
        }
        let spare = recent.keep(4, vec![0x1000, 0x2000], vec![1, 2], batch(40), &[]);
        assert_eq!(spare, Some(batch(10)), "the oldest batch's buffer");
        assert_eq!(recent.batches.len(), RECENT_BATCHES);
        assert_eq!(recent.find(page(1, 0x3000), 11), None, "the oldest went");
        assert_eq!(recent.twin(77, &[11; PAGE]), None, "with its twins");
        assert_eq!(recent.find(page(4, 0x2000), 2), Some(&[41; PAGE]));
        recent.forget();
        assert_eq!(recent.find(page(4, 0x2000), 2), None, "a new pass");
    }
}
