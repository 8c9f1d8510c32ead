//! Soft-dirty as a dirty source: when to clear, what to read back before, and how to notice
//! that someone else clears too.
//!
//! A clear write-protects the whole address space and erases every soft-dirty bit at once,
//! so the two things a dirty source needs, "protect again" and "read who wrote", cannot be
//! done for a slice of memory as userfaultfd does them. Three rules follow.
//!
//! - **Bits are read right before they are erased.** Before every clear, the bits of every
//!   armed page are read (one pagemap entry per virtual page: kernels without PAGEMAP_SCAN
//!   cannot skip holes), so a write that raised no fault (get_user_pages) is never lost.
//! - **In ebpf mode, a clear is not needed after every write.** A page written since the last
//!   clear (the tracer saw its fault, or the audit its bit) stays writable, so further writes
//!   to it are invisible: it is *unprotected*, and rehashed every pass until the next clear.
//!   A clear is done once the rehashing it would have spared since the last one costs as
//!   much as the clear and the reading of every armed page's bit before it (the rent-or-buy
//!   rule: never more than twice the cost of the better choice made in hindsight), both
//!   costs measured on the target as it goes ([`Costs`]). A page rewritten every pass costs
//!   the same either way, so the pages written again in the pass right after a clear are
//!   *hot*, and do not count toward the next one. Between clears the rolling audit reads a
//!   slice of the bits, which accumulate until the next clear.
//! - **The gap between reading the bits and clearing them is guarded.** A write there would
//!   be erased unseen; it faults (its page was protected), so the tracer records it: ebpf
//!   mode rehashes what it recorded, and so does pagemap mode, which keeps taking its
//!   decisions from the kernel's bits but lets the tracer (loaded in every mode, for the
//!   copy-on-write accounting) name the pages written in the gap. Where the tracer cannot
//!   vouch for a target (not loaded, not tracking it, records lost), the target's own fault
//!   count guards the gap: the kernel counts a fault before a clear can start (the clear
//!   takes the mmap lock for writing, a fault holds it for reading), so a count that moved
//!   between the read and the end of the clear means such a write may have happened, and
//!   that pass trusts nothing and reads the whole target, after the clear.
//!
//! The bits are one set per process, shared with whoever else clears them. Besides a target
//! holding a clear_refs open (checked before every clear), a write the tracer saw since
//! rksm's last clear must still show its bit: if a present page that is neither a KSM page
//! nor the zero page shows none, someone else cleared the bits (CRIU pre-dumping it, or the
//! program itself), and rksm stops clearing them for good.
//!
//! A write fault in a transparent huge page makes all of its 2 MiB writable, so the whole
//! huge page counts as written.

use std::collections::HashSet;

use rksm_common::{PAGE, PAGE_SIZE};

use crate::{
    engine::dirty::audit_slice,
    kernel::{
        process::Process,
        procfs::{self, Vma},
        ranges::{page_runs, Range, RangeSet},
        softdirty::{minor_faults, SoftDirty, SoftDirtyError},
    },
};

/// Until the costs are measured (a target's first passes), a clear is due once the pages
/// rehashed since the last clear only because they were unprotected add up to
/// 1/`CLEAR_SHARE` of the armed pages.
pub const CLEAR_SHARE: u64 = 64;

/// What one target's work costs here, measured as it goes (moving averages, nanoseconds):
/// the price of a clear, and of not clearing.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Costs {
    /// Rehashing one page: looking it up, copying it out, checksumming and placing it.
    rehash: Option<f64>,
    /// Reading one page's bit from pagemap.
    bit: Option<f64>,
    /// One clear.
    clear: Option<f64>,
}

impl Costs {
    fn note(slot: &mut Option<f64>, value: f64) {
        *slot = Some(slot.map_or(value, |old| 0.75 * old + 0.25 * value));
    }

    /// Whether rehashing `carried` pages has cost as much as reading `armed` pages' bits and
    /// clearing; before the costs are known, whether `carried` reached 1/[`CLEAR_SHARE`] of
    /// `armed`.
    fn clear_pays(&self, carried: u64, armed: u64) -> bool {
        match (self.rehash, self.bit, self.clear) {
            (Some(rehash), Some(bit), Some(clear)) => {
                carried as f64 * rehash >= armed as f64 * bit + clear
            }
            _ => carried >= (armed / CLEAR_SHARE).max(1),
        }
    }
}

/// The size of a transparent huge page.
const HUGE_PAGE: u64 = 2 << 20;

/// Why soft-dirty stopped for a target.
#[derive(Debug)]
pub(crate) enum Stop {
    /// The process exited.
    Gone,
    /// Its bits must not be cleared by rksm (it or someone else clears them): why.
    Refused(String),
    /// Clearing or reading failed for a lasting reason: why.
    Failed(String),
    /// rksm ran out of file descriptors: it starts over with the target next pass.
    Passing(String),
}

impl From<SoftDirtyError> for Stop {
    fn from(e: SoftDirtyError) -> Self {
        match e {
            SoftDirtyError::Gone(_) => Stop::Gone,
            e @ SoftDirtyError::UsedByTarget { .. } => Stop::Refused(format!(
                "{e}: clearing them too would lose writes it has not read yet"
            )),
            e if e.out_of_files() => Stop::Passing(e.to_string()),
            e => Stop::Failed(e.to_string()),
        }
    }
}

/// What one pass of the source found.
#[derive(Debug, Default)]
pub(crate) struct Found {
    /// Nothing can be vouched for this pass: read everything.
    pub all: bool,
    /// Pages to rehash.
    pub written: HashSet<u64>,
    /// Ranges under protection since before this pass: their other pages are clean.
    pub trusted: RangeSet,
    /// Pages whose bit showed a write no fault was recorded for: a changed checksum is a miss.
    pub unseen: HashSet<u64>,
}

impl Found {
    fn everything() -> Found {
        Found {
            all: true,
            ..Found::default()
        }
    }
}

/// What soft-dirty keeps about one target.
#[derive(Debug)]
pub(crate) struct SoftDirtyArming {
    bits: SoftDirty,
    /// Ranges that existed at the last clear (and still do): every page in them was
    /// write-protected then.
    armed: RangeSet,
    cleared: bool,
    /// Pages written since the last clear: writable, so writes to them are not seen.
    unprotected: HashSet<u64>,
    /// Pages rehashed since the last clear only because they were unprotected or new, and
    /// not hot.
    carried_since_clear: u64,
    /// The unprotected pages the last clear protected, until the next pass says which of
    /// them came back at once.
    before_clear: HashSet<u64>,
    /// Those that did: a clear spares them nothing.
    hot: HashSet<u64>,
    /// Pages seen mapped to the zero page when their bits were last read.
    zero: RangeSet,
    clears: u64,
    clear_ns: u64,
    raced: u64,
    /// Pagemap entries read since the last take.
    bits_read: u64,
    costs: Costs,
}

impl SoftDirtyArming {
    /// Soft-dirty for `process`; the first pass clears.
    pub fn open(process: &Process) -> Result<Self, SoftDirtyError> {
        Ok(SoftDirtyArming {
            bits: SoftDirty::open(process)?,
            armed: RangeSet::default(),
            cleared: false,
            unprotected: HashSet::new(),
            before_clear: HashSet::new(),
            hot: HashSet::new(),
            carried_since_clear: 0,
            zero: RangeSet::default(),
            clears: 0,
            clear_ns: 0,
            raced: 0,
            bits_read: 0,
            costs: Costs::default(),
        })
    }

    /// Ranges whose pages are write-protected from now on.
    pub fn armed_ranges(&self) -> &RangeSet {
        &self.armed
    }

    /// Clears so far, and the time the kernel took for them.
    pub fn clears(&self) -> (u64, u64) {
        (self.clears, self.clear_ns)
    }

    /// Passes (pagemap mode) that read the whole target because a fault raced with a clear
    /// the tracer could not vouch for.
    pub fn raced(&self) -> u64 {
        self.raced
    }

    /// What rehashing `pages` pages cost this pass (a pass that read only a few says little).
    pub fn note_rehash_cost(&mut self, ns: u64, pages: u64) {
        if pages >= 64 {
            Costs::note(&mut self.costs.rehash, ns as f64 / pages as f64);
        }
    }

    /// Pagemap entries read since the last call.
    pub fn take_bits_read(&mut self) -> u64 {
        std::mem::take(&mut self.bits_read)
    }

    /// `--dirty pagemap`: every armed page's bit, read each pass; a clear when any was set.
    /// `gap`, where the tracer can vouch for the target, takes the pages it recorded
    /// written since it was last called (None if it cannot vouch): it is called before the
    /// bits are read and after the clear, and names the writes in between.
    pub fn pagemap_pass(
        &mut self,
        process: &Process,
        vmas: &[Vma],
        gap: &mut dyn FnMut() -> Option<HashSet<u64>>,
    ) -> Result<Found, Stop> {
        let ranges = ranges_of(vmas);
        let armed_before = self.armed.clip_to(vmas.iter().map(Vma::range));
        if !self.cleared {
            self.clear(process, &ranges)?;
            return Ok(Found::everything());
        }
        let traced = gap().is_some();
        let faults = minor_faults(process.pid());
        let mut found = Found {
            trusted: armed_before.clone(),
            ..Found::default()
        };
        // Without a tracer a set bit is simply a write (none is a miss), and so is a page
        // newly mapped to the zero page.
        let mut set = HashSet::new();
        self.look(armed_before.as_slice(), &mut found.written, &mut set)?;
        found.written.extend(set);
        let new = armed_before.minus(&ranges);
        if found.written.is_empty() && new.is_empty() {
            return Ok(found);
        }
        self.clear(process, &ranges)?;
        match gap() {
            Some(written) if traced => found
                .written
                .extend(written.into_iter().filter(|&p| armed_before.contains(p))),
            _ if faults.is_some() && minor_faults(process.pid()) == faults => {}
            _ => {
                self.raced += 1;
                found.trusted = RangeSet::default();
            }
        }
        Ok(found)
    }

    /// `--dirty ebpf`: the tracer's records (`recorded`, taken before this call; `after`
    /// takes those that arrive while it runs), a rolling audit of the bits, and a clear when
    /// one is due. `exact` reads every armed page's bit each pass and clears whenever
    /// something was written (a target that writes without faulting).
    pub fn ebpf_pass(
        &mut self,
        process: &Process,
        vmas: &[Vma],
        exact: bool,
        recorded: &HashSet<u64>,
        audit: (&mut u64, u32),
        after: &mut dyn FnMut() -> HashSet<u64>,
    ) -> Result<Found, Stop> {
        let pid = process.pid();
        let ranges = ranges_of(vmas);
        let armed_before = self.armed.clip_to(vmas.iter().map(Vma::range));
        self.unprotected.retain(|&p| armed_before.contains(p));
        if !self.cleared {
            self.clear(process, &ranges)?;
            self.unprotected.extend(after());
            return Ok(Found::everything());
        }
        let mut recorded: Vec<u64> = recorded
            .iter()
            .copied()
            .filter(|&p| armed_before.contains(p))
            .collect();
        recorded.sort_unstable();
        // Pages written since the last clear whose bit is not set yet: looked at again below.
        let suspects = self.unset(&recorded)?;
        self.unprotected.extend(recorded.iter().copied());
        for base in huge_pages(pid, &recorded) {
            let huge = Range::new(base, base + HUGE_PAGE);
            for r in armed_before.within(huge) {
                self.unprotected.extend((r.start..r.end).step_by(PAGE));
            }
        }
        let mut found = Found {
            trusted: armed_before.clone(),
            ..Found::default()
        };
        let slice = match exact {
            true => armed_before.as_slice().to_vec(),
            false => audit_slice(&armed_before, audit.0, audit.1),
        };
        let mut zeroed = HashSet::new();
        self.look(&slice, &mut zeroed, &mut found.unseen)?;
        self.unprotected.extend(found.unseen.iter().copied());
        if !self.before_clear.is_empty() {
            let before = std::mem::take(&mut self.before_clear);
            self.hot = self
                .unprotected
                .iter()
                .copied()
                .filter(|p| before.contains(p))
                .collect();
        }
        let new = armed_before.minus(&ranges);
        let cold = self.unprotected.iter().filter(|p| !self.hot.contains(p));
        let carry = cold.count() as u64 + new.iter().map(Range::pages).sum::<u64>();
        let due = carry > 0
            && (exact
                || self
                    .costs
                    .clear_pays(self.carried_since_clear + carry, armed_before.pages()));
        found.written.extend(self.unprotected.iter().copied());
        found.written.extend(zeroed);
        if due && !exact {
            // Every bit is read right before the clear erases it.
            let rest = RangeSet::of(&slice).minus(armed_before.as_slice());
            let mut zeroed = HashSet::new();
            self.look(&rest, &mut zeroed, &mut found.unseen)?;
            found.written.extend(zeroed);
        }
        if !suspects.is_empty() {
            let still = self.unset(&suspects)?;
            if !still.is_empty() {
                return Err(Stop::Refused(format!(
                    "its soft-dirty bits are cleared by someone else too (CRIU pre-dumping it, or the program itself): {} page(s) written since rksm's last clear show no bit",
                    still.len()
                )));
            }
        }
        if due {
            self.clear(process, &ranges)?;
        } else {
            self.carried_since_clear += carry;
        }
        found.written.extend(found.unseen.iter().copied());
        let late = after();
        found.written.extend(late.iter().copied());
        self.unprotected.extend(late);
        Ok(found)
    }

    /// Clears the bits and arms `ranges`.
    fn clear(&mut self, process: &Process, ranges: &[Range]) -> Result<(), Stop> {
        let took = self.bits.clear(process)?;
        Costs::note(&mut self.costs.clear, took.as_nanos() as f64);
        self.armed = RangeSet::of(ranges);
        self.cleared = true;
        self.before_clear = std::mem::take(&mut self.unprotected);
        self.carried_since_clear = 0;
        self.clears += 1;
        self.clear_ns += took.as_nanos() as u64;
        Ok(())
    }

    /// Reads the bits of `ranges`: pages with a bit set that are not known to be unprotected
    /// go to `unseen`, and pages newly mapped to the zero page to `zeroed` (a page emptied
    /// with `MADV_DONTNEED` and read again changed without a write).
    fn look(
        &mut self,
        ranges: &[Range],
        zeroed: &mut HashSet<u64>,
        unseen: &mut HashSet<u64>,
    ) -> Result<(), Stop> {
        if ranges.is_empty() {
            return Ok(());
        }
        let started = std::time::Instant::now();
        let bits = self.bits.read(ranges)?;
        self.bits_read += bits.entries;
        if bits.entries >= 512 {
            let ns = started.elapsed().as_nanos() as f64;
            Costs::note(&mut self.costs.bit, ns / bits.entries as f64);
        }
        unseen.extend(
            bits.written
                .iter()
                .copied()
                .filter(|p| !self.unprotected.contains(p)),
        );
        zeroed.extend(
            bits.zero
                .iter()
                .copied()
                .filter(|&p| !self.zero.contains(p)),
        );
        self.zero.remove(ranges);
        let runs: Vec<Range> = page_runs(&bits.zero, usize::MAX)
            .map(|run| Range::new(run[0], run[run.len() - 1] + PAGE_SIZE))
            .collect();
        self.zero.union(&runs);
        Ok(())
    }

    /// Those of `pages` (sorted) present with their bit clear, and mapped to neither a KSM
    /// page nor the zero page: written since the last clear, yet clean.
    fn unset(&mut self, pages: &[u64]) -> Result<Vec<u64>, Stop> {
        if pages.is_empty() {
            return Ok(Vec::new());
        }
        let bits = self.bits.read_pages(pages)?;
        self.bits_read += bits.entries;
        let clean = bits.clean;
        let merged = procfs::ksm_mapped(self.bits.pid(), &clean);
        Ok(clean.into_iter().filter(|p| !merged.contains(p)).collect())
    }
}

/// The ranges of `vmas`.
fn ranges_of(vmas: &[Vma]) -> Vec<Range> {
    vmas.iter().map(Vma::range).collect()
}

/// The 2 MiB-aligned starts of the transparent huge pages among `pages` (sorted) of `pid`,
/// from kpageflags; none where the host allocates no huge pages.
fn huge_pages(pid: u32, pages: &[u64]) -> Vec<u64> {
    if pages.is_empty() || !procfs::thp_enabled() {
        return Vec::new();
    }
    // One page per huge-page-sized block is enough to ask about.
    let mut firsts: Vec<u64> = pages.to_vec();
    firsts.dedup_by_key(|p| *p / HUGE_PAGE);
    let mut bases: Vec<u64> = procfs::thp_mapped(pid, &firsts)
        .into_iter()
        .map(|p| p / HUGE_PAGE * HUGE_PAGE)
        .collect();
    bases.sort_unstable();
    bases
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clear_is_due_when_the_rehashing_it_spares_costs_as_much_as_it() {
        let mut costs = Costs::default();
        // Before anything is measured: 1/CLEAR_SHARE of the armed pages.
        assert!(!costs.clear_pays(CLEAR_SHARE - 1, 64 * CLEAR_SHARE));
        assert!(costs.clear_pays(64, 64 * CLEAR_SHARE));
        assert!(costs.clear_pays(1, 10), "at least one page");
        // A rehash costs 20 times a bit; a clear, 1000 bits' worth.
        Costs::note(&mut costs.rehash, 2000.0);
        Costs::note(&mut costs.bit, 100.0);
        Costs::note(&mut costs.clear, 100_000.0);
        let armed = 10_000;
        // Clearing: 10,000 bits and the clear, 1.1 ms; rehashing: 550 pages, 1.1 ms.
        assert!(!costs.clear_pays(549, armed));
        assert!(costs.clear_pays(550, armed));
        // Averages move a quarter of the way to each new reading.
        Costs::note(&mut costs.rehash, 6000.0);
        assert_eq!(costs.rehash, Some(3000.0));
        assert!(costs.clear_pays(367, armed) && !costs.clear_pays(366, armed));
    }
}
