//! The write-fault tracer: loads rksm's eBPF program and drains what it records.
//!
//! A write to an anonymous page faults only when the page is not writable, so once rksm has
//! write-protected a page, the page's next write is a fault the program sees. This module owns
//! the kernel side of that: checking the tracepoint's layout, loading and attaching the
//! program, telling it which processes to track, draining its `(tgid, page)` records into a
//! [`WriteLog`], and reading its counters, including the per-process count of records it
//! could not store. A process with any loss must be treated as entirely written.

use std::{
    collections::{HashMap, HashSet},
    os::fd::{AsFd, BorrowedFd},
};

use aya::{
    maps::{Array, HashMap as BpfHashMap, Map, MapData, MapError, PerCpuArray},
    programs::{ProgramError, TracePoint},
    Ebpf, EbpfError,
};
use rksm_common::{
    names, tracepoint, TracerCounters, TrackedProcess, WriteRecord, DEFAULT_RING_BYTES, PAGE_SIZE,
};

use crate::ebpf::{
    ring::Ring,
    tracefs::{self, TracefsError},
};

/// The eBPF object built by `cargo xtask build` (empty if this binary was built without it).
pub(crate) static EBPF_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/rksm.bpf.o"));

/// Errors loading or talking to the eBPF program.
#[derive(Debug, thiserror::Error)]
pub enum TracerError {
    /// The binary was built without the eBPF object.
    #[error(
        "this rksm binary was built without its eBPF program; build it with `cargo xtask build`"
    )]
    NotBuiltIn,
    /// The ring size is not a power-of-two multiple of the page size.
    #[error("record ring size {0} must be a power of two and at least {PAGE_SIZE} bytes")]
    BadRingSize(u32),
    /// Tracefs is missing or the tracepoint's layout differs from the program's.
    #[error(transparent)]
    Tracefs(#[from] TracefsError),
    /// The kernel refused the object or one of its maps.
    #[error("loading the eBPF program failed{hint}: {source}")]
    Load {
        /// What the kernel or aya said.
        source: EbpfError,
        /// A hint about privileges when not running as root.
        hint: &'static str,
    },
    /// The kernel refused to load or attach the program.
    #[error(
        "attaching the eBPF program to {}:{} failed{hint}: {source}",
        tracepoint::CATEGORY,
        tracepoint::NAME
    )]
    Attach {
        /// What the kernel or aya said.
        source: ProgramError,
        /// A hint about privileges when not running as root.
        hint: &'static str,
    },
    /// The object lacks a map or program the daemon expects (object and daemon out of sync).
    #[error("the eBPF object has no {0}; rebuild with `cargo xtask build`")]
    Missing(&'static str),
    /// A map of the object is not of the kind the daemon reads it as (object and daemon out
    /// of sync).
    #[error("the eBPF object's {0} is not a {1}; rebuild with `cargo xtask build`")]
    WrongKind(&'static str, &'static str),
    /// The record ring could not be mapped.
    #[error("mapping the tracer's record ring: {0}")]
    Ring(#[source] std::io::Error),
    /// A map operation failed.
    #[error("eBPF map {map}: {source}")]
    Map {
        /// The map's name.
        map: &'static str,
        /// What failed.
        source: MapError,
    },
}

fn privilege_hint() -> &'static str {
    if nix::unistd::geteuid().is_root() {
        ""
    } else {
        " (rksm must run as root, or with CAP_BPF and CAP_PERFMON)"
    }
}

/// How to load the tracer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TracerConfig {
    /// Size of the record ring in bytes: a power of two, at least one page. Each write fault
    /// takes 24 bytes; a full ring costs records, which become per-process losses.
    pub ring_bytes: u32,
    /// How many processes can be tracked at once; tracking one more fails, and its owner
    /// must then treat that process as entirely written.
    pub max_tracked: u32,
}

impl Default for TracerConfig {
    fn default() -> Self {
        TracerConfig {
            ring_bytes: DEFAULT_RING_BYTES,
            max_tracked: rksm_common::MAX_TRACKED,
        }
    }
}

/// The loaded and attached write-fault tracer. Dropping it detaches the program.
pub struct Tracer {
    records: Ring,
    tracked: BpfHashMap<MapData, u32, TrackedProcess>,
    counters: PerCpuArray<MapData, TracerCounters>,
    /// When the program wakes a reader ([`names::WAKE`]), and the threshold it was set to.
    wake: Array<MapData, u64>,
    wake_at: u64,
    ring_bytes: u64,
    logger: Option<aya_log::EbpfLogger<&'static dyn log::Log>>,
    // Holds the program and its link; declared last so the maps above are dropped first.
    _ebpf: Ebpf,
}

impl Tracer {
    /// Checks the tracepoint's layout, loads the program and attaches it. Nothing is tracked
    /// until [`Tracer::track`] is called.
    pub fn load(config: TracerConfig, object: &mut super::Object) -> Result<Self, TracerError> {
        let ring = config.ring_bytes;
        if !ring.is_power_of_two() || u64::from(ring) < PAGE_SIZE {
            return Err(TracerError::BadRingSize(ring));
        }
        if EBPF_OBJECT.is_empty() {
            return Err(TracerError::NotBuiltIn);
        }
        let tracefs = tracefs::ensure_mounted()?;
        tracefs::check_page_fault_layouts(tracefs)?;

        let load_err = |source| TracerError::Load {
            source,
            hint: privilege_hint(),
        };
        let mut ebpf = object
            .load(
                &[names::RECORDS, names::TRACKED],
                &[
                    (names::RECORDS, ring),
                    (names::TRACKED, config.max_tracked.max(1)),
                ],
            )
            .map_err(load_err)?;
        // The program logs only rare events (the first loss of a process); without the log
        // map (an object built without aya-log) the tracer still works.
        let logger = match aya_log::EbpfLogger::init(&mut ebpf) {
            Ok(logger) => Some(logger),
            Err(e) => {
                log::debug!("eBPF log lines unavailable: {e}");
                None
            }
        };
        let attach_err = |source| TracerError::Attach {
            source,
            hint: privilege_hint(),
        };
        // User-mode write faults, and kernel-mode ones at user addresses (the kernel writing
        // for the process): a dirty bit that missed the latter would miss read(2) buffers.
        for (program, event) in [
            (names::PROGRAM, tracepoint::NAME),
            (names::KERNEL_PROGRAM, tracepoint::KERNEL_NAME),
        ] {
            let program: &mut TracePoint = ebpf
                .program_mut(program)
                .ok_or(TracerError::Missing(program))?
                .try_into()
                .map_err(attach_err)?;
            program.load().map_err(attach_err)?;
            program
                .attach(tracepoint::CATEGORY, event)
                .map_err(attach_err)?;
        }

        let map_err = |map| move |source| TracerError::Map { map, source };
        let take = |ebpf: &mut Ebpf, name| ebpf.take_map(name).ok_or(TracerError::Missing(name));
        let records = match take(&mut ebpf, names::RECORDS)? {
            Map::RingBuf(map) => Ring::new(map, ring).map_err(TracerError::Ring)?,
            _ => return Err(TracerError::WrongKind(names::RECORDS, "ring buffer")),
        };
        let tracked = BpfHashMap::try_from(take(&mut ebpf, names::TRACKED)?)
            .map_err(map_err(names::TRACKED))?;
        let counters = PerCpuArray::try_from(take(&mut ebpf, names::COUNTERS)?)
            .map_err(map_err(names::COUNTERS))?;
        let wake = Array::try_from(take(&mut ebpf, names::WAKE)?).map_err(map_err(names::WAKE))?;
        Ok(Tracer {
            records,
            tracked,
            counters,
            wake,
            wake_at: 0,
            ring_bytes: u64::from(ring),
            logger,
            _ebpf: ebpf,
        })
    }

    /// Starts recording the write faults of process `pid`, with its counters at zero.
    pub fn track(&mut self, pid: u32) -> Result<(), TracerError> {
        self.tracked
            .insert(pid, TrackedProcess::default(), 0)
            .map_err(|source| TracerError::Map {
                map: names::TRACKED,
                source,
            })
    }

    /// Stops recording `pid` and returns its final counters (`None` if it was not tracked).
    /// Records already in the ring are still delivered by the next [`Tracer::drain`].
    pub fn untrack(&mut self, pid: u32) -> Result<Option<TrackedProcess>, TracerError> {
        let last = self.process_counters(pid)?;
        if last.is_some() {
            self.tracked
                .remove(&pid)
                .map_err(|source| TracerError::Map {
                    map: names::TRACKED,
                    source,
                })?;
        }
        Ok(last)
    }

    /// The counters the program keeps for `pid` (`None` if it is not tracked).
    pub fn process_counters(&self, pid: u32) -> Result<Option<TrackedProcess>, TracerError> {
        match self.tracked.get(&pid, 0) {
            Ok(counters) => Ok(Some(counters)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(source) => Err(TracerError::Map {
                map: names::TRACKED,
                source,
            }),
        }
    }

    /// The program's counters, summed over CPUs.
    pub fn counters(&self) -> Result<TracerCounters, TracerError> {
        let per_cpu = self
            .counters
            .get(&0, 0)
            .map_err(|source| TracerError::Map {
                map: names::COUNTERS,
                source,
            })?;
        Ok(per_cpu
            .iter()
            .fold(TracerCounters::default(), |sum, c| TracerCounters {
                events: sum.events + c.events,
                tracked_writes: sum.tracked_writes + c.tracked_writes,
                recorded: sum.recorded + c.recorded,
                lost: sum.lost + c.lost,
            }))
    }

    /// Moves every record now in the ring into `log`; returns how many there were.
    pub fn drain(&mut self, log: &mut WriteLog) -> usize {
        let mut drained = 0;
        self.records.drain::<{ size_of::<WriteRecord>() }>(|bytes| {
            // A record shorter than the program writes is not one of its records.
            if let Some(record) = WriteRecord::from_bytes(bytes) {
                log.record(record.tgid, record.page);
                drained += 1;
            }
        });
        drained
    }

    /// Whether a reader polling [`Tracer::records_fd`] is woken for the first record after
    /// it caught up (`at_once`, the ring's own rule), or only once an eighth of the ring
    /// waits unread: enough to drain it before it fills, and no wake-up per write for a
    /// reader that needs the records only at its next pass.
    pub fn wake_at_once(&mut self, at_once: bool) -> Result<(), TracerError> {
        let wake_at = if at_once { 0 } else { self.ring_bytes / 8 };
        if wake_at != self.wake_at {
            self.wake
                .set(0, wake_at, 0)
                .map_err(|source| TracerError::Map {
                    map: names::WAKE,
                    source,
                })?;
            self.wake_at = wake_at;
        }
        Ok(())
    }

    /// The ring's fd: readable when records are waiting (see [`Tracer::wake_at_once`]).
    /// Poll it to drain before it fills.
    pub fn records_fd(&self) -> BorrowedFd<'_> {
        self.records.as_fd()
    }

    /// The fd of the program's log ring, if the program logs.
    pub fn log_fd(&self) -> Option<BorrowedFd<'_>> {
        self.logger.as_ref().map(|l| l.as_fd())
    }

    /// Forwards the program's pending log lines to the `log` crate.
    pub fn flush_log(&mut self) {
        if let Some(logger) = &mut self.logger {
            logger.flush();
        }
    }
}

trait FromRingBytes: Sized {
    fn from_bytes(bytes: &[u8]) -> Option<Self>;
}

impl FromRingBytes for WriteRecord {
    fn from_bytes(bytes: &[u8]) -> Option<Self> {
        let tgid = u32::from_ne_bytes(bytes.get(0..4)?.try_into().ok()?);
        let page = u64::from_ne_bytes(bytes.get(8..16)?.try_into().ok()?);
        Some(WriteRecord {
            tgid,
            _pad: 0,
            page,
        })
    }
}

/// The pages each process was seen writing, as drained from the tracer.
#[derive(Debug, Default, Clone)]
pub struct WriteLog {
    pages: HashMap<u32, HashSet<u64>>,
    faults: HashMap<u32, u64>,
    /// Pages first seen written since the last [`WriteLog::take_fresh`], when watched.
    fresh: Option<Vec<(u32, u64)>>,
}

impl WriteLog {
    /// Notes that `tgid` wrote `page` (a page-aligned virtual address).
    pub fn record(&mut self, tgid: u32, page: u64) {
        if self.pages.entry(tgid).or_default().insert(page) {
            if let Some(fresh) = &mut self.fresh {
                fresh.push((tgid, page));
            }
        }
        *self.faults.entry(tgid).or_default() += 1;
    }

    /// Starts or stops keeping the pages first seen written, for [`WriteLog::take_fresh`].
    pub fn watch_fresh(&mut self, on: bool) {
        if on != self.fresh.is_some() {
            self.fresh = on.then(Vec::new);
        }
    }

    /// The (tgid, page) pairs first seen written since the last call, while watched: what
    /// arrived since, without taking anything from the log.
    pub fn take_fresh(&mut self) -> Vec<(u32, u64)> {
        self.fresh.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// The distinct pages `tgid` was seen writing.
    pub fn pages(&self, tgid: u32) -> impl Iterator<Item = u64> + '_ {
        self.pages.get(&tgid).into_iter().flatten().copied()
    }

    /// How many distinct pages `tgid` was seen writing.
    pub fn written_pages(&self, tgid: u32) -> usize {
        self.pages.get(&tgid).map_or(0, HashSet::len)
    }

    /// How many records (write faults) were drained for `tgid`.
    pub fn records(&self, tgid: u32) -> u64 {
        self.faults.get(&tgid).copied().unwrap_or(0)
    }

    /// Whether `tgid` was seen writing `page`.
    pub fn was_written(&self, tgid: u32, page: u64) -> bool {
        self.pages.get(&tgid).is_some_and(|p| p.contains(&page))
    }

    /// Forgets everything about `tgid` and returns its pages.
    pub fn take(&mut self, tgid: u32) -> HashSet<u64> {
        self.faults.remove(&tgid);
        self.pages.remove(&tgid).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_log_counts_distinct_pages_and_every_fault() {
        let mut log = WriteLog::default();
        log.record(7, 0x1000);
        log.record(7, 0x1000);
        log.record(7, 0x3000);
        log.record(8, 0x1000);
        assert_eq!(log.written_pages(7), 2);
        assert_eq!(log.records(7), 3);
        assert!(log.was_written(7, 0x3000));
        assert!(!log.was_written(8, 0x3000));
        let mut pages: Vec<_> = log.pages(7).collect();
        pages.sort_unstable();
        assert_eq!(pages, [0x1000, 0x3000]);
        assert_eq!(log.take(7).len(), 2);
        assert_eq!(log.written_pages(7), 0);
        assert_eq!(log.written_pages(8), 1);
    }

    #[test]
    fn ring_records_decode_like_the_program_encodes_them() {
        let mut bytes = [0u8; 16];
        bytes[0..4].copy_from_slice(&1234u32.to_ne_bytes());
        bytes[8..16].copy_from_slice(&0x7f00_dead_b000u64.to_ne_bytes());
        let record = WriteRecord::from_bytes(&bytes).unwrap();
        assert_eq!((record.tgid, record.page), (1234, 0x7f00_dead_b000));
        assert_eq!(size_of::<WriteRecord>(), 16);
        assert_eq!(WriteRecord::from_bytes(&bytes[..12]), None);
    }

    #[test]
    fn ring_sizes_that_the_kernel_would_refuse_are_refused_first() {
        for bad in [0, 100, 4095, 3 * 4096] {
            let err = Tracer::load(
                TracerConfig {
                    ring_bytes: bad,
                    ..TracerConfig::default()
                },
                &mut crate::ebpf::Object::new(),
            )
            .err()
            .unwrap();
            assert!(
                matches!(err, TracerError::BadRingSize(b) if b == bad),
                "{err}"
            );
        }
    }
}
