//! `rksm daemon` and `rksm run`.

use std::{
    io::{self, Write},
    os::fd::{AsFd, FromRawFd, OwnedFd},
    process::{Command, ExitStatus},
    time::{Duration, Instant},
};

use anyhow::Context;
use clap::Args;
use nix::sys::{
    signal::{SigSet, Signal},
    signalfd::{SfdFlags, SignalFd},
};
use rksm::{
    checksum::ChecksumKind,
    daemon::{mib, Daemon, DaemonConfig, DaemonError, DaemonStats, DirtyMode, DomainPolicy},
    targets::TargetSpec,
};

use super::{targets::TargetArgs, BadInput};

/// Options shared by `daemon` and `run`.
#[derive(Debug, Args)]
pub struct DaemonOptions {
    /// Dirty source: ebpf, pagemap, hash-only, or auto (ebpf if the tracer loads, else
    /// pagemap, else hash-only).
    #[arg(long, value_name = "MODE", default_value = "auto")]
    dirty: DirtyMode,
    /// Checksum for the gate.
    #[arg(long, value_name = "xxh64|crc32c", default_value = "xxh64")]
    checksum: ChecksumKind,
    /// Which targets may share merged pages: uid (same user), cgroup (same cgroup) or none
    /// (all). A content is marked in one domain only, so ksmd cannot merge across domains.
    #[arg(long, value_name = "uid|cgroup|none", default_value = "uid")]
    domain: DomainPolicy,
    /// Seconds between passes.
    #[arg(long, value_name = "SECS", default_value_t = 5.0, value_parser = parse_interval)]
    interval: f64,
    /// Stop after this many seconds.
    #[arg(long, value_name = "SECS", value_parser = parse_interval, conflicts_with = "passes")]
    duration: Option<f64>,
    /// Stop after this many passes.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    passes: Option<u64>,
    /// Print the final counters as one JSON object.
    #[arg(long)]
    json: bool,
}

fn parse_interval(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v <= 86_400.0 => Ok(v),
        _ => Err(format!(
            "`{s}` is not a number of seconds between 0 and 86400"
        )),
    }
}

/// Merge identical pages of running processes, pass after pass, until stopped.
///
/// Each pass finds verified duplicates (contents compared, not just checksums), marks them
/// MADV_MERGEABLE inside their processes, and lets ksmd merge them; ksmd's settings are
/// owned while rksm runs and restored when it stops (Ctrl-C, SIGTERM, --duration, --passes).
/// New processes matching the targets are picked up; exited ones dropped.
#[derive(Debug, Args)]
#[command(
    after_help = "Example:\n  rksm daemon --comm '^python' --dirty ebpf --interval 2\n  rksm daemon --cgroup system.slice/workers.service --duration 600 --json"
)]
pub struct DaemonArgs {
    #[command(flatten)]
    targets: TargetArgs,
    #[command(flatten)]
    options: DaemonOptions,
}

/// Start CMD and merge identical pages of it and its children until it exits.
///
/// rksm's exit status is CMD's.
#[derive(Debug, Args)]
#[command(after_help = "Example:\n  rksm run --dirty ebpf -- ./serve-model --workers 8")]
pub struct RunArgs {
    #[command(flatten)]
    options: DaemonOptions,
    /// The command and its arguments.
    #[arg(last = true, required = true, value_name = "CMD")]
    command: Vec<String>,
}

pub fn run_daemon(args: DaemonArgs) -> anyhow::Result<()> {
    let spec = args.targets.spec();
    if spec.is_empty() {
        return Err(
            BadInput("no targets given: use --pid, --cgroup, --comm or --all".into()).into(),
        );
    }
    serve(spec, &args.options, None).map(|_| ())
}

pub fn run_command(args: RunArgs) -> anyhow::Result<()> {
    // Spawn before blocking signals: the child must not inherit the blocked mask.
    let mut child = Command::new(&args.command[0])
        .args(&args.command[1..])
        .spawn()
        .map_err(|e| BadInput(format!("cannot start `{}`: {e}", args.command[0])))?;
    let pid = child.id();
    let spec = TargetSpec {
        tree_of: Some(pid),
        ..TargetSpec::default()
    };
    let result = serve(spec, &args.options, Some(pid));
    let status = child.wait().context("waiting for the command")?;
    result?;
    exit_like(status)
}

/// Exits with the command's status (a signal death becomes 128 + the signal, as in shells).
fn exit_like(status: ExitStatus) -> anyhow::Result<()> {
    use std::os::unix::process::ExitStatusExt;
    let code = status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0));
    if code != 0 {
        std::process::exit(code);
    }
    Ok(())
}

fn pidfd(pid: u32) -> anyhow::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error()).context("pidfd_open");
    }
    // SAFETY: the fd was just returned to us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

fn serve(
    spec: TargetSpec,
    options: &DaemonOptions,
    child: Option<u32>,
) -> anyhow::Result<DaemonStats> {
    let mut mask = SigSet::empty();
    mask.add(Signal::SIGINT);
    mask.add(Signal::SIGTERM);
    mask.thread_block().context("blocking SIGINT and SIGTERM")?;
    let signals = SignalFd::with_flags(&mask, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC)
        .context("signalfd")?;
    let child_exit = child.map(pidfd).transpose()?;

    let config = DaemonConfig {
        targets: spec,
        dirty: options.dirty,
        checksum: options.checksum,
        domain: options.domain,
        ..DaemonConfig::default()
    };
    let mut daemon = Daemon::start(config).map_err(|e| match e {
        DaemonError::Targets(e) => anyhow::Error::new(BadInput(e.to_string())),
        other => anyhow::Error::new(other),
    })?;
    log::info!(
        "running with --dirty {} --checksum {}",
        daemon.dirty_mode(),
        options.checksum
    );
    let started = Instant::now();
    let end = options
        .duration
        .map(|d| started + Duration::from_secs_f64(d));
    let interval = Duration::from_secs_f64(options.interval);
    let mut interrupts = vec![signals.as_fd()];
    if let Some(fd) = &child_exit {
        interrupts.push(fd.as_fd());
    }
    for pass in 1.. {
        let summary = daemon.pass();
        let s = daemon.stats();
        log::info!(
            "pass {pass} ({}): {summary}; merged: {} pages sharing {} KSM pages, saving {:.1} MiB",
            s.dirty_mode,
            s.pages_sharing,
            s.pages_shared,
            mib(s.pages_sharing)
        );
        if options.passes.is_some_and(|n| pass >= n) {
            break;
        }
        let next = Instant::now() + interval;
        let until = end.map_or(next, |e| e.min(next));
        if !daemon.wait(until, &interrupts) || end.is_some_and(|e| Instant::now() >= e) {
            break;
        }
    }
    let stats = daemon.finish();
    let mut out = io::stdout().lock();
    if options.json {
        serde_json::to_writer(&mut out, &stats)?;
        writeln!(out)?;
    } else {
        writeln!(
            out,
            "{} passes ({}): {} pages sharing {} KSM pages ({:.1} MiB saved); hashed {} pages, skipped {} clean; {} cow breaks; {} remote syscalls",
            stats.full_scans,
            stats.dirty_mode,
            stats.pages_sharing,
            stats.pages_shared,
            mib(stats.pages_sharing),
            stats.pages_hashed,
            stats.pages_skipped_clean,
            stats.cow_breaks,
            stats.remote_syscalls
        )?;
    }
    Ok(stats)
}
