//! The recorder: the loaded tracer and the write log its ring drains into, in one place.
//!
//! Both users of the tracer need the same three things: track a process, drain the ring as
//! records arrive (it is small, and a full ring loses records), and read what each process
//! was seen writing. `rksm trace` keeps everything it drained; the daemon takes each
//! process's writes once per pass and keeps, in the [`TracerState`] its target owns, what it
//! needs to tell a complete record from one with losses.

use std::{collections::HashSet, os::fd::BorrowedFd};

use rksm_common::TrackedProcess;

use crate::ebpf::tracer::{Tracer, TracerError, WriteLog};

/// What the recorder keeps about one tracked process, owned by whoever owns the process
/// (the daemon's target record), so that it goes when the process goes.
#[derive(Debug, Default)]
pub struct TracerState {
    tracked: bool,
    /// The program's loss count at the last take: a higher count means records were lost.
    lost_seen: u64,
    /// Every page seen written since the window was last closed (copy-on-write accounting).
    window: HashSet<u64>,
}

impl TracerState {
    /// Whether the program records this process's writes.
    pub fn tracked(&self) -> bool {
        self.tracked
    }

    /// Every page seen written since the last call, and a new window opened.
    pub fn close_window(&mut self) -> HashSet<u64> {
        std::mem::take(&mut self.window)
    }
}

/// What the tracer saw of one process since the last take.
#[derive(Debug, Default)]
pub struct TracedWrites {
    /// Pages written.
    pub pages: HashSet<u64>,
    /// Whether records were lost (the pages are then incomplete).
    pub lost: bool,
}

/// The tracer and what it recorded.
pub struct Recorder {
    tracer: Tracer,
    log: WriteLog,
}

impl Recorder {
    /// Wraps a loaded tracer.
    pub fn new(tracer: Tracer) -> Self {
        Recorder {
            tracer,
            log: WriteLog::default(),
        }
    }

    /// The ring's fd: readable when records are waiting.
    pub fn records_fd(&self) -> BorrowedFd<'_> {
        self.tracer.records_fd()
    }

    /// See [`Tracer::wake_at_once`].
    pub fn wake_at_once(&mut self, at_once: bool) -> Result<(), TracerError> {
        self.tracer.wake_at_once(at_once)
    }

    /// The fd of the program's log ring, if the program logs.
    pub fn log_fd(&self) -> Option<BorrowedFd<'_>> {
        self.tracer.log_fd()
    }

    /// Starts recording `pid` (a full tracked map refuses it: `state` then says untracked,
    /// and nothing of the process can be proven clean).
    pub fn track(&mut self, pid: u32, state: &mut TracerState) -> Result<(), TracerError> {
        if state.tracked {
            return Ok(());
        }
        self.tracer.track(pid)?;
        *state = TracerState {
            tracked: true,
            ..TracerState::default()
        };
        Ok(())
    }

    /// Stops recording `pid` and returns the program's final counters for it; what was
    /// recorded stays in the log. Records already in the ring are drained first.
    pub fn untrack(&mut self, pid: u32) -> Result<Option<TrackedProcess>, TracerError> {
        let last = self.tracer.untrack(pid)?;
        self.drain();
        Ok(last)
    }

    /// Stops recording `pid` and drops everything recorded for it (it is no longer a target).
    pub fn forget(&mut self, pid: u32) {
        if let Err(e) = self.untrack(pid) {
            log::debug!("untracking pid {pid}: {e}");
        }
        self.log.take(pid);
    }

    /// Moves records from the ring into the log and forwards the program's log lines.
    pub fn drain(&mut self) {
        self.tracer.drain(&mut self.log);
        self.tracer.flush_log();
    }

    /// Drains, then takes what was recorded for `pid` since the last take; a loss counted by
    /// the program since then sets `lost`. The pages also join the state's window.
    pub fn take(&mut self, pid: u32, state: &mut TracerState) -> TracedWrites {
        self.drain();
        let pages = self.log.take(pid);
        let lost_now = self.counters(pid).1;
        let lost = state.tracked && lost_now > std::mem::replace(&mut state.lost_seen, lost_now);
        state.window.extend(pages.iter().copied());
        TracedWrites { pages, lost }
    }

    /// What was drained so far and not taken.
    pub fn log(&self) -> &WriteLog {
        &self.log
    }

    /// What was drained so far and not taken, to watch what arrives (see
    /// [`WriteLog::take_fresh`]).
    pub fn log_mut(&mut self) -> &mut WriteLog {
        &mut self.log
    }

    /// Write faults and losses the program counted for `pid` since it was tracked.
    pub fn counters(&self, pid: u32) -> (u64, u64) {
        self.tracer
            .process_counters(pid)
            .ok()
            .flatten()
            .map_or((0, 0), |c| (c.write_faults, c.lost))
    }

    /// The program's counters for `pid` (`None` if it is not tracked).
    pub fn process_counters(&self, pid: u32) -> Result<Option<TrackedProcess>, TracerError> {
        self.tracer.process_counters(pid)
    }
}
