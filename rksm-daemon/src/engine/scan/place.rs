//! Placing what a batch read: each page into its domain's index, with KSM's rules, and the
//! duplicates found into the candidates the marking takes.

use rksm_common::{sample::digest_of, PAGE};

use super::{
    reads::{preload_representatives, ReadDone},
    sampling::settle,
    InProgress, Prepared, ProcessScanError, Scanner, Source,
};
use crate::engine::{
    checksum::NO_CHECKSUM,
    index::{Content, Index, PageRef, Placement},
    keys::PidMap,
    pages::PageInfo,
};

/// Records `page` and `of`, found equal under `checksum`, among the pass's merge candidates:
/// marking both lets ksmd merge them.
pub(super) fn add_pair(
    candidates: &mut PidMap<Vec<(u64, u64)>>,
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

impl Scanner {
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
        let (pages, held) = target.pages_and_held();
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
}
