//! Planning a target's part of a pass: which ranges the dirty source says must be looked
//! at, which pages wait for the gate, and the duplicates held from the pass before.

use std::collections::{HashMap, HashSet, VecDeque};

use rksm_common::PAGE_SIZE;

use super::{
    place::add_candidates, report::PageCounts, sampling::settle, InProgress, Open,
    ProcessScanError, Scanner, Sparse, Step, Work, CHUNK_PAGES, READ_PAGES,
};
use crate::{
    engine::{
        dirty::{DirtySet, Lent},
        index::{Index, PageRef},
        pages::PageInfo,
        target::Target,
    },
    kernel::{
        procfs::{Pagemap, Vma},
        ranges::{Range, RangeSet},
        reader::ProcMem,
    },
};

/// How many held duplicates ahead of its lookup a duplicate's place in the index is fetched:
/// the held of a first pass are hundreds of thousands of unrelated checksums, each of which
/// would otherwise wait for memory in turn.
const COMPANY_AHEAD: usize = 16;

impl Scanner {
    /// Asks the dirty source what changed in `target`, decides what to look at, and takes
    /// what may have changed out of the index.
    pub(super) fn plan(&mut self, target: &mut Target, vmas: &[Vma], lent: &mut Lent<'_>) -> Work {
        let pid = target.pid();
        let (process, state) = target.process_and_dirty();
        let dirty = self
            .dirty
            .dirty_pages(process, state, vmas, lent)
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
        for (addr, info) in target.pages_mut().keep_within(vmas) {
            leave(addr, info);
            target.page_gone(addr);
        }
        // Only pages under write protection since they were last read are vouched for.
        let trusted = match &dirty {
            DirtySet::All => RangeSet::default(),
            DirtySet::Only { armed, .. } => armed.intersection(&target.pages().scanned),
        };
        let vma_ranges: Vec<Range> = vmas.iter().map(Vma::range).collect();
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
            sparse.extend(target.pages().pending_in(r.start, r.end));
        }
        sparse.sort_unstable();
        sparse.dedup();
        for r in &full {
            for (addr, info) in target.pages().pages_in(r.start, r.end) {
                leave(addr, info);
                target.page_changed(addr);
            }
            target.pages_mut().forget_sampled_in(r.start, r.end);
        }
        let mut sampled_before = HashMap::new();
        for &addr in &rehash {
            if let Some(info) = target.pages().get(addr) {
                leave(addr, info);
            }
            if let Some(digest) = target.pages().sampled_digest(addr) {
                sampled_before.insert(addr, digest);
                target.pages_mut().forget_sampled_in(addr, addr + PAGE_SIZE);
            }
            target.page_changed(addr);
        }
        Work {
            full,
            sparse,
            rehash,
            unseen: std::mem::take(&mut target.dirty_mut().unseen),
            hold,
            released: 0,
            written_bits_read: target.dirty_mut().take_bits_read(),
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
    pub(super) fn release_held(&mut self, target: &mut Target) -> u64 {
        let (pid, domain) = (target.pid(), target.domain());
        let mut held = target.take_held();
        let Some(index) = self.indexes.get_mut(&domain) else {
            // Nothing to have company in: none passes, and none stays held.
            held.for_each(drop);
            return 0;
        };
        // The next COMPANY_AHEAD, their places in the index fetched while earlier ones are
        // looked up.
        let mut coming = VecDeque::with_capacity(COMPANY_AHEAD + 1);
        let mut released = 0;
        loop {
            while coming.len() <= COMPANY_AHEAD {
                let Some((addr, checksum)) = held.next() else {
                    break;
                };
                index.prefetch_company(checksum);
                coming.push_back((addr, checksum));
            }
            let Some((addr, checksum)) = coming.pop_front() else {
                break;
            };
            let page = PageRef { pid, addr };
            if let Some(other) = index.company_to_list(page, checksum) {
                released += 1;
                add_candidates(
                    &mut self.merge_candidates,
                    std::iter::once(page).chain(other),
                    checksum,
                );
            }
        }
        released
    }

    /// Opens `target` and lists what its scan will look at, chunk by chunk: the present
    /// runs of its full ranges (pages known from before and absent now are forgotten), then
    /// the runs of its sparse pages.
    pub(super) fn begin<'t>(&mut self, target: &'t mut Target, work: Work) -> InProgress<'t> {
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
            taken: 0,
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
                    mem,
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
                let pages = scan.target.pages_mut();
                for (addr, _) in pages.pages_in(gap_start, run.start) {
                    pages.remove(addr);
                }
                gap_start = run.end;
            }
            let domain = scan.target.domain();
            settle(&mut self.samples, domain, scan.target.pages_mut());
            // The absent pages of the range count for its progress too, with its first step.
            let mut weight = range.pages() - present.iter().map(Range::pages).sum::<u64>();
            for run in &present {
                let mut from = run.start;
                while from < run.end {
                    let n = (((run.end - from) / PAGE_SIZE) as usize).min(READ_PAGES);
                    scan.steps.push_back(Step {
                        start: from,
                        pages: n,
                        sparse: None,
                        weight: std::mem::take(&mut weight) + n as u64,
                    });
                    from += n as u64 * PAGE_SIZE;
                }
            }
            scan.done += weight;
        }
        // Sparse pages a window of address space at a time (as many pages as one pagemap
        // read returns, of which as many as one batch reads): one pagemap read and one read
        // for the pages written near each other, however many runs they make (a steady pass
        // finds writes scattered one page here, one there).
        let sparse = &scan.work.sparse;
        let mut first = 0;
        while let Some(&start) = sparse.get(first) {
            let end = start + CHUNK_PAGES as u64 * PAGE_SIZE;
            let count = sparse[first..]
                .iter()
                .take(READ_PAGES)
                .take_while(|&&a| a < end)
                .count();
            let last = sparse[first + count - 1];
            scan.steps.push_back(Step {
                start,
                pages: ((last - start) / PAGE_SIZE) as usize + 1,
                sparse: Some(Sparse { first, count }),
                weight: count as u64,
            });
            first += count;
        }
        scan.open = Some(open);
        scan
    }
}
