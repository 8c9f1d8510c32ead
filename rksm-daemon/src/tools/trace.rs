//! `rksm trace`: which pages of running processes get written, as the tracer sees them.
//!
//! This is the tracer on its own, for operators who want to know how much of a workload's
//! memory is static (the pages a dirty-bit scanner would never rehash) before they run the
//! daemon, and for tests of the tracer against real processes. Nothing is armed here, so a
//! page shows up the first time it is written after tracing starts (fresh pages, copy-on-write
//! breaks), not on every write.

use serde::Serialize;

use crate::{
    ebpf::{
        recorder::{Recorder, TracerState},
        tracer::{Tracer, TracerConfig, TracerError},
    },
    kernel::process::Process,
};

/// One traced process's numbers so far.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ProcessReport {
    /// Process id.
    pub pid: u32,
    /// Command name.
    #[serde(skip)]
    pub comm: String,
    /// Distinct pages recorded as written.
    pub written_pages: u64,
    /// Write faults the program saw, recorded or not.
    pub write_faults: u64,
    /// Write faults the program could not record (ring full).
    pub lost: u64,
    /// Whether the process has exited (its numbers are final).
    #[serde(skip)]
    pub exited: bool,
}

struct Traced {
    process: Process,
    /// Counters read when the process exited and was untracked; `None` while it runs.
    final_counters: Option<rksm_common::TrackedProcess>,
}

/// A tracer tracking a fixed set of processes until they exit.
pub struct TraceSession {
    recorder: Recorder,
    traced: Vec<Traced>,
}

impl TraceSession {
    /// Loads the tracer and starts tracking `processes`.
    pub fn start(processes: Vec<Process>, config: TracerConfig) -> Result<Self, TracerError> {
        let mut recorder = Recorder::new(Tracer::load(config, &mut crate::ebpf::Object::new())?);
        for process in &processes {
            recorder.track(process.pid(), &mut TracerState::default())?;
        }
        Ok(TraceSession {
            recorder,
            traced: processes
                .into_iter()
                .map(|process| Traced {
                    process,
                    final_counters: None,
                })
                .collect(),
        })
    }

    /// The recorder, to poll its fds.
    pub fn recorder(&self) -> &Recorder {
        &self.recorder
    }

    /// Moves pending records into the session and forwards the program's log lines.
    pub fn drain(&mut self) {
        self.recorder.drain();
    }

    /// Untracks processes that exited since the last call and returns them.
    pub fn reap_exited(&mut self) -> Result<Vec<ProcessReport>, TracerError> {
        let mut reaped = Vec::new();
        for i in 0..self.traced.len() {
            let traced = &self.traced[i];
            if traced.final_counters.is_some() || !traced.process.has_exited() {
                continue;
            }
            let pid = traced.process.pid();
            let last = self.recorder.untrack(pid)?.unwrap_or_default();
            self.traced[i].final_counters = Some(last);
            reaped.push(self.report_one(&self.traced[i])?);
        }
        Ok(reaped)
    }

    /// True when every traced process has exited.
    pub fn all_exited(&self) -> bool {
        self.traced.iter().all(|t| t.final_counters.is_some())
    }

    /// The numbers of every traced process, in the order they were given.
    pub fn report(&self) -> Result<Vec<ProcessReport>, TracerError> {
        self.traced.iter().map(|t| self.report_one(t)).collect()
    }

    /// Stops tracking everything, drains what is left and returns the final numbers.
    pub fn finish(mut self) -> Result<Vec<ProcessReport>, TracerError> {
        for i in 0..self.traced.len() {
            if self.traced[i].final_counters.is_none() {
                let pid = self.traced[i].process.pid();
                let last = self.recorder.untrack(pid)?.unwrap_or_default();
                self.traced[i].final_counters = Some(last);
            }
        }
        self.drain();
        self.traced
            .iter()
            .map(|t| {
                Ok(ProcessReport {
                    exited: t.process.has_exited(),
                    ..self.report_one(t)?
                })
            })
            .collect()
    }

    /// The pages `pid` was seen writing so far.
    pub fn written(&self, pid: u32) -> impl Iterator<Item = u64> + '_ {
        self.recorder.log().pages(pid)
    }

    fn report_one(&self, traced: &Traced) -> Result<ProcessReport, TracerError> {
        let pid = traced.process.pid();
        let counters = match traced.final_counters {
            Some(last) => last,
            None => self.recorder.process_counters(pid)?.unwrap_or_default(),
        };
        Ok(ProcessReport {
            pid,
            comm: traced.process.comm().to_string(),
            written_pages: self.recorder.log().written_pages(pid) as u64,
            write_faults: counters.write_faults,
            lost: counters.lost,
            exited: traced.final_counters.is_some(),
        })
    }
}
