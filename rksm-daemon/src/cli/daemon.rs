//! `rksm daemon` and `rksm run`.

use std::{
    io::{self, Write},
    net::SocketAddr,
    os::fd::{AsFd, OwnedFd},
    path::PathBuf,
    process::{Command, ExitStatus},
    time::{Duration, Instant},
};

use anyhow::Context;
use clap::Args;
use rksm::{
    daemon::{
        mib, Daemon, DaemonConfig, DaemonError, DaemonStats, DirtyMode, DomainPolicy, NewPages,
        OutsiderPolicy, SeveralDomains,
    },
    engine::{
        checksum::ChecksumKind,
        dirty::{protection::WriteProtectChoice, DEFAULT_AUDIT_PASSES},
        targets::TargetSpec,
    },
    service::{
        config::{ConfigFile, Seconds},
        status::{self, HttpAccess, Status, StatusServer, DEFAULT_SOCKET},
    },
};

use super::{targets::TargetArgs, termination_signals, BadInput};

/// Options shared by `daemon` and `run`. Each has a key of the same name in the
/// configuration file; a flag given here wins over the file.
#[derive(Debug, Args)]
pub struct DaemonOptions {
    /// Configuration file [default: /etc/rksm/rksm.toml, if it exists].
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// Dirty source: ebpf, pagemap, hash-only, or auto (ebpf if the tracer loads, else
    /// pagemap, where the kernel offers write protection; else hash-only) [default: auto].
    #[arg(long, value_name = "MODE")]
    dirty: Option<DirtyMode>,
    /// Write protection the dirty modes may use: userfaultfd (Linux 6.7+), soft-dirty
    /// (kernels built with CONFIG_MEM_SOFT_DIRTY), or auto (per target, the best the kernel
    /// offers: soft-dirty where both are, unless the target uses soft-dirty itself)
    /// [default: auto].
    #[arg(long, value_name = "SOURCE")]
    write_protect: Option<WriteProtectChoice>,
    /// ebpf mode: sample new pages in the kernel and read whole only those whose sample meets
    /// another page's, or read every new page whole [default: sample].
    #[arg(long, value_name = "sample|read")]
    new_pages: Option<NewPages>,
    /// Checksum for the gate [default: xxh64].
    #[arg(long, value_name = "xxh64|crc32c")]
    checksum: Option<ChecksumKind>,
    /// Which targets may share merged pages: uid (same user), cgroup (same cgroup) or none
    /// (all). What ksmd merges across domains is undone [default: uid].
    #[arg(long, value_name = "uid|cgroup|none")]
    domain: Option<DomainPolicy>,
    /// Targets in more than one merge domain: refuse to start, naming the domains, or allow
    /// it (each domain can then learn whether another holds a page it guesses, one ksmd
    /// merge cycle per guess) [default: refuse].
    #[arg(long, value_name = "refuse|allow")]
    several_domains: Option<SeveralDomains>,
    /// With more than one merge domain, processes outside the targets that mark their own
    /// memory mergeable could probe other domains' pages through ksmd: refuse to start,
    /// naming them, or warn [default: refuse].
    #[arg(long, value_name = "refuse|warn")]
    outsiders: Option<OutsiderPolicy>,
    /// Seconds between passes [default: 5].
    #[arg(long, value_name = "SECS", value_parser = |s: &str| Seconds::INTERVAL.parse(s))]
    interval: Option<f64>,
    /// Stop after this many seconds.
    #[arg(long, value_name = "SECS", value_parser = |s: &str| Seconds::INTERVAL.parse(s), conflicts_with = "passes")]
    duration: Option<f64>,
    /// Stop after this many passes.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    passes: Option<u64>,
    /// ebpf mode: audit every armed page against the kernel's written bits once every N
    /// passes, to find writes the tracer cannot see (process_vm_writev, O_DIRECT) [default: 8].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=1000))]
    audit_passes: Option<u64>,
    /// Print the final counters as one JSON object.
    #[arg(long)]
    json: bool,
    /// The root-only socket `rksm status` asks [default: /run/rksm/rksm.sock].
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Also serve Prometheus metrics over HTTP at this address, e.g. 127.0.0.1:9464 (off
    /// unless given).
    #[arg(long, value_name = "ADDR")]
    metrics_address: Option<SocketAddr>,
    /// A file (mode 0600) holding a token: HTTP clients that send `Authorization: Bearer
    /// TOKEN` also get the per-process series; others get daemon-wide and per-domain sums.
    #[arg(long, value_name = "PATH")]
    metrics_token_file: Option<PathBuf>,
    /// Write the daemon-wide and per-domain metrics to this file after every pass, for
    /// node_exporter's textfile collector (e.g. /var/lib/node_exporter/textfile/rksm.prom).
    #[arg(long, value_name = "PATH")]
    metrics_textfile: Option<PathBuf>,
}

/// The daemon's settings once the command line and the configuration file are combined.
#[derive(Debug)]
struct Settings {
    dirty: DirtyMode,
    write_protect: WriteProtectChoice,
    new_pages: NewPages,
    checksum: ChecksumKind,
    domain: DomainPolicy,
    several_domains: SeveralDomains,
    outsiders: OutsiderPolicy,
    interval: f64,
    duration: Option<f64>,
    passes: Option<u64>,
    audit_passes: u32,
    json: bool,
    socket: PathBuf,
    metrics_address: Option<SocketAddr>,
    metrics_token_file: Option<PathBuf>,
    metrics_textfile: Option<PathBuf>,
}

impl DaemonOptions {
    fn settings(&self, file: &ConfigFile) -> Settings {
        Settings {
            dirty: self.dirty.or(file.dirty).unwrap_or_default(),
            write_protect: self
                .write_protect
                .or(file.write_protect)
                .unwrap_or_default(),
            new_pages: self.new_pages.or(file.new_pages).unwrap_or_default(),
            checksum: self
                .checksum
                .or(file.checksum)
                .unwrap_or(ChecksumKind::Xxh64),
            domain: self.domain.or(file.domain).unwrap_or_default(),
            several_domains: self
                .several_domains
                .or(file.several_domains)
                .unwrap_or_default(),
            outsiders: self.outsiders.or(file.outsiders).unwrap_or_default(),
            interval: self.interval.or(file.interval).unwrap_or(5.0),
            duration: self.duration.or(file.duration),
            passes: self.passes.or(file.passes),
            audit_passes: self
                .audit_passes
                .or(file.audit_passes)
                .map_or(DEFAULT_AUDIT_PASSES, |n| n as u32),
            json: self.json || file.json == Some(true),
            socket: self
                .socket
                .clone()
                .or_else(|| file.socket.clone())
                .unwrap_or_else(|| DEFAULT_SOCKET.into()),
            metrics_address: self.metrics_address.or(file.metrics_address),
            metrics_token_file: self
                .metrics_token_file
                .clone()
                .or_else(|| file.metrics_token_file.clone()),
            metrics_textfile: self
                .metrics_textfile
                .clone()
                .or_else(|| file.metrics_textfile.clone()),
        }
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
    after_help = "Example:\n  rksm daemon --uid 1000 --comm '^python' --dirty ebpf --interval 2\n  rksm daemon --pid 4242 --dirty pagemap --write-protect soft-dirty\n  rksm daemon --cgroup system.slice/workers.service --duration 600 --json\n  rksm daemon --config /etc/rksm/rksm.toml --metrics-address 127.0.0.1:9464\n\nFiles:\n  /etc/rksm/rksm.toml      settings (every flag has a key; flags win)\n  /run/rksm/rksm.sock      root-only socket `rksm status` asks\n  /run/rksm/ksmd-settings  ksmd's settings found at start, until restored\n  /run/rksm/daemon.lock    one daemon per host"
)]
pub struct DaemonArgs {
    #[command(flatten)]
    targets: TargetArgs,
    #[command(flatten)]
    pub options: DaemonOptions,
}

/// Start CMD and merge identical pages of it and its children until it exits.
///
/// rksm's exit status is CMD's.
#[derive(Debug, Args)]
#[command(after_help = "Example:\n  rksm run --dirty ebpf -- ./serve-model --workers 8")]
pub struct RunArgs {
    #[command(flatten)]
    pub options: DaemonOptions,
    /// The command and its arguments.
    #[arg(last = true, required = true, value_name = "CMD")]
    command: Vec<String>,
}

pub fn run_daemon(args: DaemonArgs, file: &ConfigFile) -> anyhow::Result<()> {
    let spec = args.targets.spec_or(file);
    if spec.is_empty() {
        return Err(BadInput(
            "no targets given: use --pid, --cgroup, --uid, --comm or --all, or their keys in the configuration file"
                .into(),
        )
        .into());
    }
    serve(spec, &args.options.settings(file), None).map(|_| ())
}

pub fn run_command(args: RunArgs, file: &ConfigFile) -> anyhow::Result<()> {
    if file.has_targets() {
        log::info!(
            "`rksm run` works on its command: the configuration file's targets are not used"
        );
    }
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
    let result = serve(spec, &args.options.settings(file), Some(pid));
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
    rksm::kernel::process::pidfd_open(pid).context("pidfd_open")
}

fn serve(spec: TargetSpec, options: &Settings, child: Option<u32>) -> anyhow::Result<DaemonStats> {
    let signals = termination_signals()?;
    let child_exit = child.map(pidfd).transpose()?;

    let config = DaemonConfig {
        targets: spec,
        dirty: options.dirty,
        write_protect: options.write_protect,
        new_pages: options.new_pages,
        checksum: options.checksum,
        domain: options.domain,
        several_domains: options.several_domains,
        outsiders: options.outsiders,
        audit_passes: options.audit_passes,
        ..DaemonConfig::default()
    };
    // Bad input is refused before ksmd is touched.
    let token = options
        .metrics_token_file
        .as_deref()
        .map(HttpAccess::read_token)
        .transpose()
        .map_err(|e| BadInput(e.to_string()))?;
    let mut daemon = Daemon::start(config).map_err(|e| match e {
        e @ (DaemonError::Targets(_)
        | DaemonError::SeveralDomains(_)
        | DaemonError::NotOffered(_)
        | DaemonError::NoWriteProtect { .. }) => anyhow::Error::new(BadInput(e.to_string())),
        other => anyhow::Error::new(other),
    })?;
    log::info!(
        dirty = daemon.dirty_mode().to_string().as_str(), checksum = options.checksum.to_string().as_str(),
        domain = options.domain.to_string().as_str(), interval = options.interval;
        "running with --dirty {} --checksum {} --domain {}",
        daemon.dirty_mode(),
        options.checksum,
        options.domain
    );
    let server = StatusServer::start(
        &options.socket,
        HttpAccess {
            address: options.metrics_address,
            token,
        },
    )?;
    server.publish(Status::of(&daemon));
    if let Some(addr) = options.metrics_address {
        log::info!("serving Prometheus metrics on http://{addr}/metrics");
    }
    let started = Instant::now();
    let end = options
        .duration
        .map(|d| started + Duration::from_secs_f64(d));
    let interval = Duration::from_secs_f64(options.interval);
    let mut interrupts = vec![signals.as_fd()];
    if let Some(fd) = &child_exit {
        interrupts.push(fd.as_fd());
    }
    daemon
        .stop_on(&[signals.as_fd()])
        .context("watching for SIGTERM")?;
    for pass in 1.. {
        let summary = daemon.pass();
        if daemon.stopping() {
            break;
        }
        server.publish(Status::of(&daemon));
        if let Some(path) = &options.metrics_textfile {
            if let Err(e) = status::write_textfile(path, &Status::of(&daemon).read_live()) {
                log::warn!("writing {}: {e}", path.display());
            }
        }
        let s = daemon.stats();
        log::info!(
            pass, targets = summary.targets, pages_hashed = summary.pages_hashed,
            pages_skipped_clean = summary.pages_skipped_clean, duplicates = summary.duplicates,
            runs_marked = summary.runs_marked, cow_breaks = summary.cow_breaks,
            seconds = summary.seconds, pages_sharing = s.pages_sharing,
            pages_shared = s.pages_shared;
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
    drop(server);
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
