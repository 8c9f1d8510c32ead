//! The sampling stage of a pass: new pages sampled in the kernel, batch by batch, and what
//! their digests meet in the domain's sample index decides which are read whole.

use std::collections::HashMap;

use rksm_common::PAGE_SIZE;

use super::{Scanner, Work, CHUNK_PAGES};
use crate::{
    ebpf::sampler::{Sampler, SamplerError},
    engine::{
        pages::PageState,
        samples::{self, Meets, SampleIndex},
        target::Target,
    },
    kernel::{
        procfs::{Pagemap, PagemapEntry},
        ranges::Range,
    },
};

/// The buffers of the sampling stage, kept from batch to batch.
#[derive(Default)]
pub(super) struct SampleBatch {
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
        for (i, (&addr, &digest)) in self.addrs.iter().zip(&self.digests).enumerate() {
            if let Some(&ahead) = self.digests.get(i + samples::AHEAD) {
                index.prefetch(ahead);
            }
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
pub(super) fn settle(samples: &mut HashMap<u32, SampleIndex>, domain: u32, pages: &mut PageState) {
    pages.settle_changes(|changes| samples.entry(domain).or_default().follow(changes));
}

impl Scanner {
    /// Samples the new pages of `plans` (present for the first time where writes are tracked
    /// from now on) instead of reading them: the pages whose digest meets another page's of
    /// the domain, this pass or kept from before, go to their work's sparse pages to be read
    /// whole (with the page only sampled they met, from its own target's work); the others
    /// are recorded as only sampled and are not read. A range that cannot be sampled is read
    /// in full, as without a sampler.
    pub(super) fn sample_new(&mut self, plans: &mut [(&mut Target, Work)]) {
        let Some(sampler) = self.sampler.as_mut() else {
            return;
        };
        // The present runs of each target's new ranges (memory present for the first time
        // where writes are tracked from now on), found first: each domain's sample index
        // then makes room for all its new pages at once instead of growing as it meets them.
        let mut news: Vec<Option<Vec<Option<Vec<Range>>>>> = Vec::with_capacity(plans.len());
        let mut coming: HashMap<u32, usize> = HashMap::new();
        for (target, work) in plans.iter() {
            let pagemap = (!work.full.is_empty() && !work.hold.is_empty())
                .then(|| Pagemap::open(target.pid()).ok())
                .flatten();
            let Some(pagemap) = pagemap else {
                news.push(None);
                continue;
            };
            let presents: Vec<Option<Vec<Range>>> = work
                .full
                .iter()
                .map(|range| {
                    let new = work.hold.covers(range.start, range.end)
                        && target.pages().pages_in(range.start, range.end).is_empty();
                    new.then(|| pagemap.present_runs(range.start, range.end).ok())
                        .flatten()
                })
                .collect();
            *coming.entry(target.domain()).or_default() += presents
                .iter()
                .flatten()
                .flatten()
                .map(|run| run.pages() as usize)
                .sum::<usize>();
            news.push(Some(presents));
        }
        for (domain, pages) in coming {
            self.samples.entry(domain).or_default().reserve(pages);
        }
        let mut wanted = HashMap::new();
        let mut entries = vec![PagemapEntry(0); CHUNK_PAGES];
        let mut batch = SampleBatch::default();
        let mut broken = false;
        for ((target, work), presents) in plans.iter_mut().zip(news) {
            let Some(presents) = presents else {
                continue;
            };
            if broken {
                continue;
            }
            let Ok(pagemap) = Pagemap::open(target.pid()) else {
                continue;
            };
            let index = self.samples.entry(target.domain()).or_default();
            // Room for every new page in the list of pages to read whole, which most of a
            // first pass's may join: room never written to costs no memory.
            let new_pages: u64 = presents.iter().flatten().flatten().map(Range::pages).sum();
            work.sparse.reserve(new_pages as usize);
            let mut full = Vec::new();
            for (range, present) in std::mem::take(&mut work.full).into_iter().zip(presents) {
                let Some(present) = present.filter(|_| !broken) else {
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
                        let pages = target.pages_mut();
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
            if wanted.is_empty() || target.pages().sampled_len() == 0 {
                continue;
            }
            for (addr, digest) in target
                .pages_mut()
                .take_sampled_where(|d| wanted.contains(&d))
            {
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
