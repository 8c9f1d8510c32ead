//! Merges across merge domains, undone: the frames [`super::crossings`] finds mapped in more
//! than one domain are unmapped from the domains that must give way, which then never mark
//! that content again.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    time::Instant,
};

use rksm_common::{PAGE, PAGE_SIZE};

use super::{adopted::Adopted, backoff::REGION_SHIFT, crossings, Daemon};
use crate::{
    engine::{checksum::NO_CHECKSUM, merge::Run},
    kernel::{
        ksmd, procfs,
        ranges::{page_runs, Range},
        reader::ProcMem,
    },
};

impl Daemon {
    /// Step 4b: finds KSM frames mapped in more than one merge domain ([`crossings`]), counts
    /// and logs them, and undoes them in the targets: the mappings of the domains that must
    /// give way are unmarked (which unmerges them), and those domains do not mark the content
    /// again (or, if they gave way to an outsider, back off). Only ksmd merges, so a look is
    /// taken only with more than one domain among the targets and the mergeable outsiders,
    /// and only if ksmd has scanned since the last look or who is in which domain changed:
    /// after convergence, with ksmd idle, it costs nothing. A look reads smaps and pagemap of
    /// every mergeable VMA of those processes.
    pub(super) fn undo_crossings(&mut self) {
        let mut mappers: Vec<crossings::Mapper> = self
            .targets
            .values()
            .filter(|t| !t.skipped())
            .map(|t| crossings::Mapper {
                pid: t.pid(),
                domain: t.domain(),
                target: true,
            })
            .collect();
        // Outsiders of a domain no target is in get numbers of their own, from the top.
        let mut strangers: HashMap<&str, u32> = HashMap::new();
        for o in &self.outsiders {
            let domain = self.domains.id_of(&o.domain).unwrap_or_else(|| {
                let next = u32::MAX - strangers.len() as u32;
                *strangers.entry(&o.domain).or_insert(next)
            });
            mappers.push(crossings::Mapper {
                pid: o.pid,
                domain,
                target: false,
            });
        }
        let domains: HashSet<u32> = mappers.iter().map(|m| m.domain).collect();
        self.several_domains = domains.len() > 1;
        if !self.several_domains {
            self.crossings_looked_at = None;
            return;
        }
        let scanned = ksmd::counters(&self.config.ksm_root)
            .ok()
            .and_then(|k| k.pages_scanned);
        let inputs = crossings::Inputs::new(scanned, &mappers);
        if inputs.unchanged_since(self.crossings_looked_at.as_ref()) {
            return;
        }
        self.crossings_looked_at = Some(inputs);
        let Ok(kpageflags) = procfs::KpageFlags::open() else {
            return;
        };
        let started = Instant::now();
        let found = crossings::find(&mappers, &kpageflags);
        self.stats.cross_domain_checks += 1;
        self.stats.cross_domain_check_ns += started.elapsed().as_nanos() as u64;
        if found.crossings.is_empty() {
            return;
        }
        // Zeros tell nobody anything: a frame of zeros is not a crossing, so no outsider can
        // stop the targets from merging theirs. The checksum only says which frames to read;
        // a frame is passed over only if a target's mapping of it reads as zeros.
        let zero = self.zero_checksum;
        let holds_zeros = |c: &crossings::Crossing| {
            c.mappings.iter().find(|m| m.target).is_some_and(|m| {
                let mut page = [0u8; PAGE];
                ProcMem::open(m.pid).is_ok_and(|mem| mem.read_page(m.addr, &mut page))
                    && page.iter().all(|&b| b == 0)
            })
        };
        let sum_of = |targets: &BTreeMap<u32, Adopted>, m: &crossings::Mapping| {
            let info = targets.get(&m.pid)?.pages().get(m.addr)?;
            (info.checksum != NO_CHECKSUM).then_some(info.checksum)
        };
        let crossings: Vec<(&crossings::Crossing, Option<u64>)> = found
            .crossings
            .iter()
            .map(|c| (c, c.mappings.iter().find_map(|m| sum_of(&self.targets, m))))
            .filter(|&(c, sum)| sum != Some(zero) || !holds_zeros(c))
            .collect();
        if crossings.is_empty() {
            return;
        }
        // Which pages of which targets give way. A domain that gave way to another domain of
        // targets never marks the content again; one that gave way to an outsider backs off
        // (the region, for longer each time), so an outsider holding a content does not end
        // its merging for good.
        let mut give_way: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
        let mut again_later: HashMap<u32, Vec<(u64, u64)>> = HashMap::new();
        let now = self.stats.full_scans;
        for &(crossing, sum) in &crossings {
            let owner = sum.and_then(|s| self.domains.owner(s));
            let to_an_outsider = crossing.mappings.iter().any(|m| !m.target);
            for m in crossing.to_undo(owner) {
                give_way.entry(m.pid).or_default().push(m.addr);
                match sum {
                    Some(sum) if !to_an_outsider => self.domains.contest(sum, m.domain),
                    _ => {
                        if let Some(target) = self.targets.get_mut(&m.pid) {
                            target.backoff_mut().hit(m.addr >> REGION_SHIFT, now);
                        }
                        if let Some(sum) = sum {
                            again_later.entry(m.pid).or_default().push((m.addr, sum));
                        }
                    }
                }
            }
        }
        let described: Vec<String> = crossings
            .iter()
            .take(4)
            .map(|(c, _)| self.describe(c))
            .collect();
        log::warn!(
            "{} KSM frames were mapped in more than one merge domain ({}{}); unmarking them in the targets that must give way",
            crossings.len(),
            described.join("; "),
            if crossings.len() > 4 { "; ..." } else { "" }
        );
        self.stats.cross_domain_merges += crossings.len() as u64;
        for (pid, mut pages) in give_way {
            let Some(target) = self.targets.get_mut(&pid) else {
                continue;
            };
            pages.sort_unstable();
            pages.dedup();
            for &page in &pages {
                target.page_gone(page);
            }
            // Given way to an outsider: a candidate again once the back-off ends.
            target.add_candidates(again_later.remove(&pid).unwrap_or_default());
            // What rksm marked is unmarked; what the process marked itself is its own.
            let mut mine: Vec<Run> = Vec::new();
            let mut theirs = false;
            for run in page_runs(&pages, usize::MAX) {
                let run = Range::new(run[0], run[run.len() - 1] + PAGE_SIZE);
                mine.extend(target.marked().within(run));
                theirs |= !target.marked().minus(&[run]).is_empty();
            }
            if theirs && self.self_marked_warned.insert(target.id()) {
                log::warn!(
                    "pid {pid} marks its own memory mergeable, and some of it was merged across merge domains; rksm does not undo a process's own marks"
                );
            }
            match self.marker.unmark(&self.borrower, target, &mine) {
                Ok(outcome) => {
                    self.marking_syscalls += outcome.remote_syscalls;
                    self.stats.cross_domain_unmarked += outcome.pages;
                }
                Err(e) => log::warn!("pid {pid}: unmarking pages merged across domains: {e}"),
            }
        }
    }

    /// One crossing, for the log: who maps the frame, in which domain.
    fn describe(&self, crossing: &crossings::Crossing) -> String {
        let mut who: Vec<String> = crossing
            .mappings
            .iter()
            .map(|m| {
                let domain = self
                    .targets
                    .get(&m.pid)
                    .map(|t| t.domain_name().to_string())
                    .or_else(|| {
                        self.outsiders
                            .iter()
                            .find(|o| o.pid == m.pid)
                            .map(|o| o.domain.clone())
                    })
                    .unwrap_or_default();
                let kind = if m.target { "target" } else { "outsider" };
                format!("{kind} pid {} ({})", m.pid, procfs::printable(&domain))
            })
            .collect();
        who.dedup();
        format!("frame {:#x}: {}", crossing.pfn, who.join(", "))
    }
}
