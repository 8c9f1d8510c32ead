//! Merges across domains: KSM frames mapped in more than one merge domain, found after the
//! fact so that they can be undone.
//!
//! Merge domains hold only as far as what rksm marks: ksmd merges any two mergeable pages
//! with equal bytes, whoever marked them. A content can still reach another domain's frame:
//! a marked page rewritten between two passes while ksmd sweeps, a process outside the
//! targets that marks its own memory (qemu does; so would a prober), a target that marks its
//! own. Only ksmd merges, so after ksmd has worked rksm looks at the result: the frames of
//! every mergeable VMA (smaps' `mg`) of the targets and of the mergeable outsiders, keeping
//! those mapped in more than one domain that kpageflags says are KSM frames. This reads
//! smaps, pagemap and kpageflags; it never stops or borrows a process, and it decides
//! which mappings must go, while the daemon unmarks them (in its targets only).

use std::collections::{BTreeSet, HashSet};

use crate::kernel::procfs::{self, KpageFlags, Pagemap, PagemapEntry};

/// Pagemap entries read at once: 512 KiB of entries, 256 MiB of address space.
const CHUNK: usize = 64 * 1024;

/// A process whose mergeable memory is looked at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mapper {
    /// Its pid.
    pub pid: u32,
    /// Its merge domain's number.
    pub domain: u32,
    /// A target (rksm may unmark in it), or an outsider (never touched).
    pub target: bool,
}

/// One mapping of a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mapping {
    /// The process mapping it.
    pub pid: u32,
    /// The page's address in it.
    pub addr: u64,
    /// Its merge domain's number.
    pub domain: u32,
    /// Whether the process is a target.
    pub target: bool,
}

/// What a look was taken over: ksmd's `pages_scanned` and every (pid, domain) looked at.
/// Only ksmd merges, so while neither changes nothing new can have crossed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inputs {
    pages_scanned: Option<u64>,
    mappers: Vec<(u32, u32)>,
}

impl Inputs {
    /// The inputs of a look over `mappers`, ksmd having scanned `pages_scanned` pages (None
    /// on kernels that do not say: then every pass looks).
    pub fn new(pages_scanned: Option<u64>, mappers: &[Mapper]) -> Self {
        let mut mappers: Vec<(u32, u32)> = mappers.iter().map(|m| (m.pid, m.domain)).collect();
        mappers.sort_unstable();
        Inputs {
            pages_scanned,
            mappers,
        }
    }

    /// Whether a look over these inputs would find nothing the `last` one did not.
    pub fn unchanged_since(&self, last: Option<&Inputs>) -> bool {
        self.pages_scanned.is_some() && last == Some(self)
    }
}

/// A KSM frame mapped in more than one merge domain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Crossing {
    /// The frame.
    pub pfn: u64,
    /// Every mapping of it found, in more than one domain.
    pub mappings: Vec<Mapping>,
}

impl Crossing {
    /// The domains mapping the frame.
    pub fn domains(&self) -> BTreeSet<u32> {
        self.mappings.iter().map(|m| m.domain).collect()
    }

    /// The domain whose mappings of the frame stay. An outsider's, if outsiders of one
    /// domain map it: rksm never touches them, so only the targets can give way. Otherwise
    /// `owner`, the domain that owned the content first, if it maps the frame; otherwise the
    /// oldest domain (the lowest number). None if outsiders of several domains map it:
    /// nothing rksm may do keeps it in one domain.
    pub fn keeper(&self, owner: Option<u32>) -> Option<u32> {
        let outsiders: BTreeSet<u32> = self
            .mappings
            .iter()
            .filter(|m| !m.target)
            .map(|m| m.domain)
            .collect();
        match outsiders.len() {
            0 => {}
            1 => return outsiders.first().copied(),
            _ => return None,
        }
        let domains = self.domains();
        owner
            .filter(|o| domains.contains(o))
            .or_else(|| domains.first().copied())
    }

    /// The targets' mappings to unmark and unmerge so that the frame is left in one domain
    /// (or in outsiders only).
    pub fn to_undo(&self, owner: Option<u32>) -> Vec<Mapping> {
        let keeper = self.keeper(owner);
        self.mappings
            .iter()
            .filter(|m| m.target && Some(m.domain) != keeper)
            .copied()
            .collect()
    }
}

/// The frames of `mapped` (frame, mapping) that are mapped in more than one domain.
fn shared_across(mut mapped: Vec<(u64, Mapping)>) -> Vec<Crossing> {
    mapped.sort_unstable_by_key(|&(pfn, m)| (pfn, m.pid, m.addr));
    mapped
        .chunk_by(|a, b| a.0 == b.0)
        .filter(|group| group.iter().any(|(_, m)| m.domain != group[0].1.domain))
        .map(|group| Crossing {
            pfn: group[0].0,
            mappings: group.iter().map(|&(_, m)| m).collect(),
        })
        .collect()
}

/// What one look found.
#[derive(Debug, Default)]
pub struct Found {
    /// KSM frames mapped in more than one domain.
    pub crossings: Vec<Crossing>,
    /// Pagemap entries read.
    pub pages_looked_at: u64,
}

/// Every KSM frame that the mergeable memory of `mappers` maps in more than one domain. A
/// process that exits, or whose files cannot be read, meanwhile is left out: what it mapped
/// is gone with it, or is found at the next look. Targets are looked at first; of an
/// outsider, only the frames some target maps are kept, so what a look holds is bounded by
/// the targets' shared pages, whatever an outsider maps.
pub fn find(mappers: &[Mapper], kpageflags: &KpageFlags) -> Found {
    let mut found = Found::default();
    let mut mapped = Vec::new();
    let mut entries = vec![PagemapEntry(0); CHUNK];
    let (targets, outsiders): (Vec<&Mapper>, Vec<&Mapper>) = mappers.iter().partition(|m| m.target);
    let mut targets_frames: Option<HashSet<u64>> = None;
    for mapper in targets.into_iter().chain(outsiders) {
        if !mapper.target && targets_frames.is_none() {
            targets_frames = Some(mapped.iter().map(|&(pfn, _)| pfn).collect());
        }
        let (Ok(ranges), Ok(pagemap)) = (
            procfs::mergeable_ranges(mapper.pid),
            Pagemap::open(mapper.pid),
        ) else {
            continue;
        };
        for range in ranges {
            let Ok(present) = pagemap.present_runs(range.start, range.end) else {
                break;
            };
            for run in present {
                let mut addr = run.start;
                while addr < run.end {
                    let want = (run.pages() - (addr - run.start) / rksm_common::PAGE_SIZE)
                        .min(CHUNK as u64) as usize;
                    let Ok(got) = pagemap.read(addr, &mut entries[..want]) else {
                        break;
                    };
                    if got == 0 {
                        break;
                    }
                    found.pages_looked_at += got as u64;
                    for (i, entry) in entries[..got].iter().enumerate() {
                        // A frame this mapping alone maps, or a file's, crosses nothing.
                        match entry.pfn() {
                            Some(pfn)
                                if pfn != 0
                                    && !entry.exclusive()
                                    && !entry.file_or_shared()
                                    && targets_frames
                                        .as_ref()
                                        .is_none_or(|frames| frames.contains(&pfn)) =>
                            {
                                mapped.push((
                                    pfn,
                                    Mapping {
                                        pid: mapper.pid,
                                        addr: addr + i as u64 * rksm_common::PAGE_SIZE,
                                        domain: mapper.domain,
                                        target: mapper.target,
                                    },
                                ))
                            }
                            _ => {}
                        }
                    }
                    addr += got as u64 * rksm_common::PAGE_SIZE;
                }
            }
        }
    }
    // Frames shared by fork, or the zero page, are not ksmd's doing.
    found.crossings = shared_across(mapped)
        .into_iter()
        .filter(|c| {
            kpageflags
                .get(c.pfn)
                .is_ok_and(|f| f.ksm() && !f.zero_page())
        })
        .collect();
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(pid: u32, domain: u32, target: bool) -> Mapping {
        Mapping {
            pid,
            addr: 0x1000 * u64::from(pid),
            domain,
            target,
        }
    }

    #[test]
    fn a_look_is_due_when_ksmd_scanned_or_a_domain_changed() {
        let m = |pid, domain| Mapper {
            pid,
            domain,
            target: true,
        };
        let last = Inputs::new(Some(100), &[m(2, 1), m(1, 0)]);
        assert!(Inputs::new(Some(100), &[m(1, 0), m(2, 1)]).unchanged_since(Some(&last)));
        assert!(!Inputs::new(Some(101), &[m(1, 0), m(2, 1)]).unchanged_since(Some(&last)));
        assert!(!Inputs::new(Some(100), &[m(1, 0), m(2, 0)]).unchanged_since(Some(&last)));
        assert!(!Inputs::new(Some(100), &[m(1, 0), m(2, 1)]).unchanged_since(None));
        let unknown = Inputs::new(None, &[m(1, 0), m(2, 1)]);
        assert!(!unknown.unchanged_since(Some(&unknown.clone())));
    }

    #[test]
    fn only_frames_mapped_in_two_domains_cross() {
        let found = shared_across(vec![
            (7, at(1, 0, true)),
            (9, at(2, 0, true)),
            (7, at(3, 1, true)),
            (9, at(1, 0, true)),
            (5, at(4, 1, false)),
        ]);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].pfn, 7);
        assert_eq!(found[0].domains(), BTreeSet::from([0, 1]));
    }

    #[test]
    fn the_owner_keeps_its_mappings_and_the_others_give_way() {
        let c = Crossing {
            pfn: 1,
            mappings: vec![at(1, 0, true), at(2, 1, true), at(3, 2, true)],
        };
        let undone = |owner| -> Vec<u32> { c.to_undo(owner).iter().map(|m| m.pid).collect() };
        assert_eq!(undone(Some(1)), [1, 3]);
        // No owner known, or an owner that does not map it: the oldest domain stays.
        assert_eq!(undone(None), [2, 3]);
        assert_eq!(undone(Some(9)), [2, 3]);
    }

    #[test]
    fn outsiders_are_never_undone_so_the_targets_give_way() {
        let one = Crossing {
            pfn: 1,
            mappings: vec![at(1, 0, true), at(2, 1, false), at(3, 1, true)],
        };
        // The outsider's domain keeps it, whoever owned the content.
        assert_eq!(one.keeper(Some(0)), Some(1));
        assert_eq!(one.to_undo(Some(0)), [at(1, 0, true)]);
        let two = Crossing {
            pfn: 1,
            mappings: vec![at(1, 0, true), at(2, 1, false), at(3, 2, false)],
        };
        assert_eq!(two.keeper(Some(0)), None);
        assert_eq!(two.to_undo(Some(0)), [at(1, 0, true)]);
    }
}
