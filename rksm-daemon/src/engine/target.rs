//! The target record: everything rksm keeps about one process, in one place.
//!
//! A process becomes a target when it is adopted, and everything rksm learns about it from
//! then on lives here: who it is (a pidfd, its start time and image), which merge domain it
//! is in, its arming and tracer state, the checksums of its pages, what is marked and merged
//! in it, the regions backed off, and its counters. The daemon owns the records and lends
//! them to the scan and the marking for the length of a call. When a target is dropped, all
//! of it goes at once: nothing about a process outlives its record, and since the record
//! holds a pidfd, nothing in it can ever describe a later process that reuses the pid.
use serde::{Deserialize, Serialize};

use crate::{
    engine::{
        dirty::{protection::WriteProtect, DirtyState},
        keys::{KeyMap, KeySet, PageSet},
        merge::Backoff,
        pages::PageState,
    },
    kernel::{
        process::{Process, ProcessId},
        ranges::RangeSet,
    },
};

/// A target's counters, for status and metrics (the last pass's readings, and totals).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TargetCounters {
    /// Pages whose checksum changed since the previous pass (last pass).
    pub pages_volatile: u64,
    /// Pages marked mergeable.
    pub pages_marked: u64,
    /// Pages read and checksummed, all passes.
    pub pages_hashed: u64,
    /// Pages proven clean and not read, all passes.
    pub pages_skipped_clean: u64,
    /// Write faults the tracer counted since the target was tracked.
    pub write_faults: u64,
    /// Writes the tracer saw on merged pages.
    pub cow_breaks: u64,
    /// Written pages the tracer missed and the audit found (ebpf mode); any makes the
    /// target tracked exactly from then on.
    pub dirty_misses: u64,
    /// Clears of its soft-dirty bits.
    #[serde(default)]
    pub soft_dirty_clears: u64,
    /// Time the kernel took for them, in nanoseconds.
    #[serde(default)]
    pub soft_dirty_clear_ns: u64,
    /// Passes that read it whole because a fault raced with a clear (pagemap mode, where
    /// the tracer could not vouch for it).
    #[serde(default)]
    pub soft_dirty_clear_races: u64,
}

/// Everything kept about one process.
#[derive(Debug)]
pub struct Target {
    process: Process,
    domain: u32,
    domain_name: String,
    /// Arming and tracer state: what the dirty source needs to prove pages clean.
    pub(crate) dirty: DirtyState,
    /// What is known of its present pages: checksums, and which are in the index.
    pub(crate) pages: PageState,
    /// Ranges marked mergeable in it.
    pub(crate) marked: RangeSet,
    /// Pages mapped to KSM frames at the last pass.
    pub(crate) merged: PageSet,
    /// Verified duplicates not yet marked, with their checksum.
    pub(crate) candidates: KeyMap<u64>,
    /// Duplicates found when their page was first read, with their checksum: they become
    /// candidates at the next pass if they are still in the index with company then (that
    /// is, neither they nor their class were written: the checksum gate, kept by the dirty
    /// bit instead of by hashing again).
    pub(crate) held: Vec<(u64, u64)>,
    /// Contents (by checksum) it has marked or has merged: its domain owns them.
    pub(crate) owned: KeySet,
    /// Regions whose merged pages keep breaking.
    pub(crate) backoff: Backoff,
    /// Counters.
    pub(crate) counters: TargetCounters,
    /// Left out of this pass (a passing reason: stopped, traced for a moment).
    skipped: bool,
}

impl Target {
    /// Adopts `process` into merge domain `domain` (named `domain_name` for people).
    pub fn adopt(process: Process, domain: u32, domain_name: String) -> Self {
        Target {
            process,
            domain,
            domain_name,
            dirty: DirtyState::default(),
            pages: PageState::default(),
            marked: RangeSet::default(),
            merged: PageSet::default(),
            candidates: KeyMap::default(),
            held: Vec::new(),
            owned: KeySet::default(),
            backoff: Backoff::default(),
            counters: TargetCounters::default(),
            skipped: false,
        }
    }

    /// A target in the single domain 0, for one-off scans (`rksm estimate`, tests).
    pub fn new(process: Process) -> Self {
        Target::adopt(process, 0, "all".into())
    }

    /// The process.
    pub fn process(&self) -> &Process {
        &self.process
    }

    /// The process, with the dirty state to update while looking at it.
    pub fn process_and_dirty(&mut self) -> (&Process, &mut DirtyState) {
        (&self.process, &mut self.dirty)
    }

    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// Its identity: pid and start time, which no later process shares.
    pub fn id(&self) -> ProcessId {
        self.process.id()
    }

    /// Its merge domain.
    pub fn domain(&self) -> u32 {
        self.domain
    }

    /// Its merge domain's name.
    pub fn domain_name(&self) -> &str {
        &self.domain_name
    }

    /// Why its writes are tracked exactly (every armed page's written bit, each pass)
    /// rather than by the tracer, if they are: the audit found writes without a fault, or
    /// it holds a KVM vCPU.
    pub fn exact_tracking(&self) -> Option<&str> {
        self.dirty.exact()
    }

    /// Which write-protect source it uses, and why (or why it has none).
    pub fn write_protect(&self) -> (WriteProtect, &str) {
        self.dirty.write_protect()
    }

    /// Its counters.
    pub fn counters(&self) -> &TargetCounters {
        &self.counters
    }

    /// Whether it sits this pass out.
    pub fn skipped(&self) -> bool {
        self.skipped
    }

    /// Leaves it out of this pass only: it keeps its arming, its tracer and its checksums,
    /// so the next pass takes it up where it was.
    pub fn skip_this_pass(&mut self) {
        self.skipped = true;
    }

    /// Starts a new pass: a target skipped last time is back in.
    pub fn refresh(&mut self) {
        self.skipped = false;
    }
}
