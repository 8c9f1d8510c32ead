//! Placing what a batch read: each page into its domain's index, with KSM's rules, and the
//! duplicates found into the candidates the marking takes.

use std::time::Instant;

use rksm_common::{sample::digest_of, PAGE};

use super::{
    reads::{preload_representatives, ReadDone},
    sampling::settle,
    Candidate, InProgress, Prepared, ProcessScanError, Scanner, Source,
};
use crate::{
    engine::{
        checksum::NO_CHECKSUM,
        index::{Content, Index, PageRef, Placement},
        keys::PidMap,
        pages::{PageInfo, Record},
    },
    kernel::ranges::RangeSet,
};

/// Records `pages`, found equal under `checksum`, among the pass's merge candidates: marking
/// them lets ksmd merge them.
pub(super) fn add_candidates(
    candidates: &mut PidMap<Vec<(u64, u64)>>,
    pages: impl IntoIterator<Item = PageRef>,
    checksum: u64,
) {
    for p in pages {
        candidates
            .entry(p.pid)
            .or_default()
            .push((p.addr, checksum));
    }
}

/// Page `slot` of a batch's `bytes`.
fn page_of(bytes: &[u8], slot: usize) -> &[u8; PAGE] {
    bytes[slot * PAGE..(slot + 1) * PAGE]
        .try_into()
        .expect("a page's bytes")
}

/// The checksums of a batch's pages read, by slot.
struct Checksums {
    /// [`NO_CHECKSUM`] for a page that could not be read.
    sums: Vec<u64>,
    /// The sample's digest of each page read where one is needed: where new pages are
    /// sampled, and of every first read, to find its twin by.
    digests: Vec<Option<u32>>,
    /// The page of a recent batch whose bytes a first read has, whose checksum it took.
    twins: Vec<Option<PageRef>>,
    /// Time spent on them.
    ns: u64,
}

impl Scanner {
    /// The checksum of every page of a batch that was read. A first read (a new page where
    /// writes are tracked from now on) whose bytes equal those of a page of the recent
    /// batches, found by the sample's digest, is that page's twin: it has that page's
    /// checksum, computed from the same bytes, and needs no hashing. The others are hashed,
    /// together (see [`crate::engine::checksum::ChecksumKind::checksum_pages`]). Hash-only and a page read again keep
    /// KSM's rule: hashed every time.
    fn checksums(
        &self,
        candidates: &[Candidate],
        hold: &RangeSet,
        read_ok: &[bool],
        bytes: &[u8],
    ) -> Checksums {
        let started = Instant::now();
        let slots = read_ok.len();
        let mut sums = vec![NO_CHECKSUM; slots];
        let mut digests = vec![None; slots];
        let mut twins = vec![None; slots];
        let mut to_hash = Vec::with_capacity(slots);
        for candidate in candidates {
            let Source::Read(slot) = candidate.source else {
                continue;
            };
            if !read_ok[slot] {
                continue;
            }
            let content = page_of(bytes, slot);
            let first_read = candidate.previous == NO_CHECKSUM && hold.contains(candidate.addr);
            if first_read || self.sampler.is_some() {
                digests[slot] = Some(digest_of(content));
            }
            if let (true, Some(digest)) = (first_read, digests[slot]) {
                if let Some((twin, sum)) = self.recent.twin(digest, content) {
                    sums[slot] = sum;
                    twins[slot] = Some(twin);
                    continue;
                }
            }
            to_hash.push(slot);
        }
        let pages: Vec<&[u8; PAGE]> = to_hash.iter().map(|&slot| page_of(bytes, slot)).collect();
        let mut hashed = vec![0; pages.len()];
        self.config.checksum.checksum_pages(&pages, &mut hashed);
        for (&slot, sum) in to_hash.iter().zip(hashed) {
            sums[slot] = sum;
        }
        Checksums {
            sums,
            digests,
            twins,
            ns: started.elapsed().as_nanos() as u64,
        }
    }

    /// Places the pages of a prepared step, once its read is `done`: what was read is
    /// checksummed, the present pages are placed and recorded in the target's pages. A page of
    /// the work's `unseen` whose checksum changed is counted as a miss.
    pub(super) fn place(
        &mut self,
        scan: &mut InProgress<'_>,
        prepared: Prepared,
        done: ReadDone,
    ) -> Result<(), ProcessScanError> {
        let ReadDone {
            addrs: to_read,
            bytes,
            read_ok,
            result,
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
        let pages = target.pages_mut();
        let pid = open.pid;
        let kind = self.config.checksum;
        let page_at = |slot: usize| page_of(&bytes, slot);
        let checksums = self.checksums(&candidates, hold, &read_ok, &bytes);
        counts.checksum_ns += checksums.ns;
        counts.pages_hashed += read_ok.iter().filter(|&&ok| ok).count() as u64;
        counts.pages_twinned += checksums.twins.iter().flatten().count() as u64;
        let Checksums {
            sums: fresh,
            digests,
            twins,
            ..
        } = checksums;

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
                    Source::Read(slot) if twins[slot].is_some() => return None,
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
        let mut twin_list = Vec::new();
        let mut read_whole = Vec::new();
        let mut records = Vec::with_capacity(candidates.len());
        for candidate in &candidates {
            let page = PageRef {
                pid,
                addr: candidate.addr,
            };
            let slot = match candidate.source {
                Source::Read(slot) => Some(slot),
                Source::Zero | Source::Known => None,
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
                            Some(&digest) => digest != digest_of(page_at(slot)),
                            None => fresh[slot] != candidate.previous,
                        };
                        *misses += u64::from(changed);
                    }
                    (fresh[slot], Content::Loaded(page_at(slot)))
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
            let twin = slot.and_then(|slot| twins[slot]);
            let (placement, gated) = if let Some(twin) = twin {
                index.place_twin(page, checksum, twin, candidate.ksm, content, &mut self.live)
            } else if first_read {
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
            let mut hold = false;
            match placement {
                Placement::Unique => counts.unique_pages += 1,
                // New, so not yet through the gate: volatile this pass, as before.
                Placement::Duplicate { .. } if gated => {
                    counts.volatile_pages += 1;
                    hold = true;
                }
                Placement::Duplicate { of } => {
                    counts.duplicate_pages += 1;
                    if self.config.collect_merge_candidates {
                        add_candidates(&mut self.merge_candidates, [page, of], checksum);
                    }
                }
                Placement::Volatile => counts.volatile_pages += 1,
                Placement::Vanished => {
                    counts.pages_vanished += 1;
                    counts.scanned_pages -= 1;
                    continue;
                }
            }
            // A first read placed: a later page of the pass with its bytes is its twin.
            if let (true, Some(slot)) = (first_read, slot) {
                if let Some(digest) = digests[slot] {
                    twin_list.push((digest, slot as u32));
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
                (true, Content::Loaded(_)) => slot.and_then(|slot| digests[slot]),
                (true, Content::Unread) => candidate.digest,
            };
            records.push(Record {
                addr: page.addr,
                info: PageInfo {
                    checksum,
                    placed: placement != Placement::Volatile,
                },
                digest,
                held: hold,
            });
            // A page read whole (written, or new where nothing is sampled) that meets pages
            // only sampled: those are read whole at their target's next pass.
            if let (Some(digest), Content::Loaded(_)) = (digest, content) {
                read_whole.push(digest);
            }
            if let Some(known) = self.pfns_seen.get_mut(&candidate.pfn) {
                *known = checksum;
            }
        }
        pages.record_all(&records);
        if let Some(samples) = self.samples.get_mut(&open.domain) {
            samples.read_whole_all(&read_whole);
        }
        if let Some(spare) = self.recent.keep(pid, to_read, fresh, bytes, &twin_list) {
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
}
