//! `rksm trace`.

use std::{
    io::{self, Write},
    os::fd::AsFd,
    time::{Duration, Instant},
};

use anyhow::Context;
use clap::Args;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use rksm::{
    ebpf::tracer::TracerConfig,
    kernel::process::{Process, TargetError},
    kernel::procfs::printable,
    service::config::Seconds,
    tools::trace::{ProcessReport, TraceSession},
};

use super::{termination_signals, BadInput};

/// Show which pages of running processes get written, as the eBPF tracer sees them.
///
/// Every second prints, per process, the distinct pages written since tracing started and the
/// write faults seen; a summary follows at the end (after --duration, Ctrl-C, or when every
/// traced process has exited). Only the first write to a page after it became read-only
/// faults (fresh pages, copy-on-write), so a page rewritten in place is counted once.
#[derive(Debug, Args)]
#[command(
    after_help = "Example:\n  rksm trace --pid 1234 --pid 5678 --duration 10\n  rksm trace --pid \"$(pgrep -o memcached)\" --duration 5 --json"
)]
pub struct TraceArgs {
    /// Process to trace (repeatable). A thread id traces its whole process.
    #[arg(long = "pid", value_name = "PID", required = true, value_parser = clap::value_parser!(u32).range(1..))]
    pids: Vec<u32>,
    /// Stop after this many seconds (default: run until Ctrl-C).
    #[arg(long, value_name = "SECS", value_parser = |s: &str| Seconds::TRACE.parse(s))]
    duration: Option<f64>,
    /// Print one JSON object at the end instead of the per-second lines and the table.
    #[arg(long)]
    json: bool,
    /// Size of the tracer's record ring: a power of two from 4096 (each write fault takes 24
    /// bytes; faults that find the ring full are counted as lost) [default: 8388608].
    #[arg(long, value_name = "BYTES", value_parser = parse_ring_bytes)]
    ring_bytes: Option<u32>,
}

fn parse_ring_bytes(s: &str) -> Result<u32, String> {
    match s.parse::<u32>() {
        Ok(v) if v.is_power_of_two() && (4096..=1 << 30).contains(&v) => Ok(v),
        _ => Err(format!(
            "`{s}` is not a power of two between 4096 and 1073741824"
        )),
    }
}

#[derive(serde::Serialize)]
struct JsonSummary<'a> {
    processes: &'a [ProcessReport],
    seconds: f64,
}

pub fn run(args: TraceArgs) -> anyhow::Result<()> {
    let processes = open_targets(&args.pids)?;
    trace(processes, &args)
}

/// Opens every pid; a missing or refused one is reported and skipped, unless none is left.
fn open_targets(pids: &[u32]) -> anyhow::Result<Vec<Process>> {
    let mut processes: Vec<Process> = Vec::new();
    for &pid in pids {
        match Process::open(pid) {
            Ok(p) if processes.iter().any(|q| q.pid() == p.pid()) => {}
            Ok(p) => {
                if p.pid() != pid {
                    eprintln!(
                        "rksm: pid {pid} is a thread of process {}; tracing the process",
                        p.pid()
                    );
                }
                processes.push(p);
            }
            Err(e @ (TargetError::NotFound(_) | TargetError::Refused { .. })) => {
                eprintln!("rksm: {e}; not tracing it");
            }
            Err(e) => return Err(e.into()),
        }
    }
    if processes.is_empty() {
        return Err(BadInput("none of the given processes can be traced".into()).into());
    }
    Ok(processes)
}

fn trace(processes: Vec<Process>, args: &TraceArgs) -> anyhow::Result<()> {
    let signals = termination_signals()?;
    let pids: Vec<String> = processes.iter().map(|p| p.pid().to_string()).collect();
    let config = TracerConfig {
        ring_bytes: args
            .ring_bytes
            .unwrap_or(TracerConfig::default().ring_bytes),
        ..TracerConfig::default()
    };
    let mut session = TraceSession::start(processes, config)?;
    let started = Instant::now();
    eprintln!(
        "rksm: tracing write faults of pid {} ({})",
        pids.join(", "),
        match args.duration {
            Some(d) => format!("for {d} s"),
            None => "until Ctrl-C".into(),
        }
    );

    // Drain whenever records arrive, not just once a second: a busy process can fill the
    // ring within a second, and every record that does not fit is a loss.
    let deadline = args.duration.map(|d| started + Duration::from_secs_f64(d));
    let mut next_tick = started + Duration::from_secs(1);
    loop {
        let now = Instant::now();
        if deadline.is_some_and(|d| now >= d) {
            break;
        }
        let wake = deadline.map_or(next_tick, |d| d.min(next_tick));
        let timeout =
            PollTimeout::try_from(wake.saturating_duration_since(now)).unwrap_or(PollTimeout::MAX);
        let recorder = session.recorder();
        let mut fds = vec![
            PollFd::new(signals.as_fd(), PollFlags::POLLIN),
            PollFd::new(recorder.records_fd(), PollFlags::POLLIN),
        ];
        if let Some(fd) = recorder.log_fd() {
            fds.push(PollFd::new(fd, PollFlags::POLLIN));
        }
        match poll(&mut fds, timeout) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(e).context("waiting for records"),
        }
        let signalled = fds[0].revents().is_some_and(|r| !r.is_empty());
        drop(fds);
        session.drain();
        if signalled {
            break;
        }
        if Instant::now() >= next_tick {
            next_tick += Duration::from_secs(1);
            for gone in session.reap_exited()? {
                eprintln!(
                    "rksm: pid {} ({}) exited; its numbers are final",
                    gone.pid,
                    printable(&gone.comm)
                );
            }
            if !args.json {
                print_progress(started.elapsed(), &session.report()?)?;
            }
            if session.all_exited() {
                eprintln!("rksm: every traced process has exited");
                break;
            }
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let reports = session.finish()?;
    let mut out = io::stdout().lock();
    if args.json {
        serde_json::to_writer(
            &mut out,
            &JsonSummary {
                processes: &reports,
                seconds,
            },
        )?;
        writeln!(out)?;
    } else {
        print_summary(&mut out, seconds, &reports)?;
    }
    Ok(())
}

fn print_progress(elapsed: Duration, reports: &[ProcessReport]) -> io::Result<()> {
    let mut out = io::stdout().lock();
    for r in reports.iter().filter(|r| !r.exited) {
        writeln!(
            out,
            "{:>6.1}s  pid {} ({}): {} written pages, {} write faults{}",
            elapsed.as_secs_f64(),
            r.pid,
            printable(&r.comm),
            r.written_pages,
            r.write_faults,
            lost_note(r.lost),
        )?;
    }
    out.flush()
}

fn lost_note(lost: u64) -> String {
    if lost == 0 {
        String::new()
    } else {
        format!(", {lost} LOST (process treated as fully written)")
    }
}

fn print_summary(out: &mut impl Write, seconds: f64, reports: &[ProcessReport]) -> io::Result<()> {
    writeln!(
        out,
        "\ntraced {} process(es) for {seconds:.1} s",
        reports.len()
    )?;
    writeln!(
        out,
        "{:>8}  {:<16} {:>14} {:>13} {:>8}",
        "PID", "COMM", "WRITTEN_PAGES", "WRITE_FAULTS", "LOST"
    )?;
    for r in reports {
        writeln!(
            out,
            "{:>8}  {:<16} {:>14} {:>13} {:>8}{}",
            r.pid,
            printable(&r.comm),
            r.written_pages,
            r.write_faults,
            r.lost,
            if r.exited { "  (exited)" } else { "" }
        )?;
    }
    Ok(())
}
