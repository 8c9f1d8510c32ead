//! One run of one configuration: start fresh workloads, start what is measured (ksmd at a
//! pace, or the rksm daemon), sample pages_sharing and both CPU times ten times a second, stop,
//! check every workload's memory, and reduce the samples to a [`RunResult`].

use std::{
    collections::HashMap,
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use rksm_common::PAGE_SIZE;

use super::{median_f64, median_u64, BenchPlan, Config, RunResult, Sample, EBPF_READ};
use crate::{
    kernel::{
        ksmd::{self, KsmdError, KsmdOwner, KsmdSettings},
        procfs,
    },
    service::status,
    tools::{
        guest::{self, GuestError, GuestMemory, GuestProcess},
        workload::{Marks, WorkloadProcess},
    },
};

/// Why a run could not be measured.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// ksmd could not be taken over, or set going.
    #[error(transparent)]
    Ksmd(#[from] KsmdError),
    /// There is no ksmd thread.
    #[error("no ksmd thread: is KSM built into this kernel?")]
    NoKsmd,
    /// A workload process did not start.
    #[error("starting the workload: {0}")]
    Workload(std::io::Error),
    /// A guest did not start.
    #[error("starting the workload: {0}")]
    Guest(#[from] GuestError),
    /// ksmd's advisor could not be read or set.
    #[error("{path}: {source} (the advisor needs Linux 6.7)")]
    Advisor {
        /// Its sysfs file.
        path: &'static str,
        /// What the kernel said.
        source: std::io::Error,
    },
    /// The rksm daemon would not start, or could not be waited for.
    #[error("{what} rksm: {source}")]
    Daemon {
        /// Starting or waiting for.
        what: &'static str,
        /// What the kernel said.
        source: std::io::Error,
    },
    /// The rksm daemon exited with an error.
    #[error("rksm daemon failed: {0}")]
    DaemonFailed(String),
}

/// One process of the workload: an `rksm workload` or a qemu guest.
enum Workload {
    Process(WorkloadProcess),
    Guest(GuestProcess),
}

impl Workload {
    /// Starts the profile's processes and waits until every one has filled its memory.
    /// A workload process marks its memory as `marks` says (a guest marks its own).
    fn start_all(
        plan: &BenchPlan,
        profile_arg: &str,
        marks: Marks,
    ) -> Result<Vec<Self>, BenchError> {
        let n = plan.profile.processes;
        let Some(image) = plan.guest.as_ref().filter(|_| plan.profile.is_guests()) else {
            return (0..n)
                .map(|i| WorkloadProcess::start(&plan.rksm, profile_arg, i, marks))
                .map(|w| w.map(Workload::Process).map_err(BenchError::Workload))
                .collect();
        };
        let memory = GuestMemory {
            ram_mib: plan.profile.guest_ram_mib,
            duplicate_mib: plan.profile.duplicate_mib,
            unique_mib: plan.profile.unique_mib,
        };
        // Booted side by side: under TCG each takes tens of seconds.
        let mut guests = (0..n)
            .map(|i| GuestProcess::start(image, memory, i))
            .collect::<Result<Vec<_>, _>>()?;
        let deadline = Instant::now() + guest::BOOT_DEADLINE;
        for g in &mut guests {
            g.ready(deadline)?;
        }
        Ok(guests.into_iter().map(Workload::Guest).collect())
    }

    fn pid(&self) -> u32 {
        match self {
            Workload::Process(w) => w.pid(),
            Workload::Guest(g) => g.pid(),
        }
    }

    fn verify(&mut self) -> String {
        match self {
            Workload::Process(w) => w.verify(),
            Workload::Guest(g) => g.verify(),
        }
    }
}

/// CPU seconds (user + system) of a process from /proc/PID/stat (fields 14 and 15), in
/// clock ticks.
fn cpu_ticks_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let ticks = |n| procfs::stat_field(&stat, n)?.parse::<u64>().ok();
    Some((ticks(14)? + ticks(15)?) as f64 / procfs::clock_ticks_per_second())
}

/// Nanoseconds task `path` (a /proc/PID or /proc/PID/task/TID directory) has run, from its
/// `schedstat` (kernels with scheduler statistics).
fn run_ns(path: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("{path}/schedstat")).ok()?;
    text.split_whitespace().next()?.parse().ok()
}

/// CPU seconds of a single-threaded process (ksmd): to the nanosecond where the kernel
/// keeps scheduler statistics, else in clock ticks.
fn cpu_seconds(pid: u32) -> Option<f64> {
    run_ns(&format!("/proc/{pid}"))
        .map(|ns| ns as f64 / 1e9)
        .or_else(|| cpu_ticks_seconds(pid))
}

/// A process's CPU seconds to the nanosecond: its threads' run times summed, each thread's
/// last one kept once it has exited. /proc/PID/stat counts in ticks of 10 ms, as much as a
/// steady pass costs, which made a steady state's CPU a count of a few ticks.
#[derive(Debug, Default)]
struct CpuClock {
    threads: HashMap<u32, u64>,
}

impl CpuClock {
    /// The process's CPU seconds so far (in clock ticks where the kernel keeps no scheduler
    /// statistics).
    fn read(&mut self, pid: u32) -> Option<f64> {
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
        let mut any = false;
        for tid in tasks
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        {
            if let Some(ns) = run_ns(&format!("/proc/{pid}/task/{tid}")) {
                self.threads.insert(tid, ns);
                any = true;
            }
        }
        match any {
            true => Some(self.threads.values().sum::<u64>() as f64 / 1e9),
            false => cpu_ticks_seconds(pid),
        }
    }
}

/// A process's VmRSS and VmHWM, in KiB.
fn resident_kib(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))?
            .split_whitespace()
            .next()?
            .parse::<u64>()
            .ok()
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

fn ksmd_pid() -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        (std::fs::read_to_string(format!("/proc/{pid}/comm"))
            .ok()?
            .trim()
            == "ksmd")
            .then_some(pid)
    })
}

fn ksm_counter(name: &str) -> u64 {
    std::fs::read_to_string(Path::new(ksmd::KSM_SYSFS).join(name))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// Lets ksmd forget the previous run's workloads before the next one is measured: ksmd only
/// drops an exited process's pages from its counters when it next scans, so it is run fast
/// until pages_shared and pages_sharing stop moving (at most 30 s).
pub fn settle() -> Result<(), BenchError> {
    let owner = KsmdOwner::take(
        Path::new(ksmd::KSM_SYSFS),
        Path::new(ksmd::STATE_PATH),
        KsmdSettings {
            run: 1,
            pages_to_scan: 10_000,
            sleep_millisecs: 10,
        },
    )?;
    let reading = || (ksm_counter("pages_shared"), ksm_counter("pages_sharing"));
    let deadline = Instant::now() + Duration::from_secs(30);
    let (mut last, mut still) = (reading(), 0);
    // Settled when the counters are zero or have not moved for a second.
    while Instant::now() < deadline && last != (0, 0) && still < 4 {
        std::thread::sleep(Duration::from_millis(250));
        let now = reading();
        still = if now == last { still + 1 } else { 0 };
        last = now;
    }
    drop(owner);
    Ok(())
}

/// What a run measures: ksmd at a pace (steered by the advisor, for that row), or the rksm
/// daemon. Dropping it turns the advisor off, then puts ksmd's settings back (fields drop in
/// this order), so that nothing the advisor set outlives the run.
struct Subject {
    advisor: Option<Advisor>,
    ksmd: Option<KsmdOwner>,
    daemon: Option<Child>,
}

impl Subject {
    /// Starts `config` over `workloads`, the daemon answering on `socket`.
    fn start(
        plan: &BenchPlan,
        config: Config,
        checksum: &str,
        workloads: &[Workload],
        socket: &Path,
    ) -> Result<Subject, BenchError> {
        let mergeable_pages = plan.profile.mergeable_pages();
        let mut subject = Subject {
            advisor: None,
            ksmd: None,
            daemon: None,
        };
        match config {
            Config::Ksmd | Config::KsmdTuned => {
                subject.ksmd = Some(config.own_ksmd(mergeable_pages, plan.interval)?);
            }
            Config::KsmdDuplicates => {
                let marked = plan.profile.duplicate_pages();
                subject.ksmd = Some(config.own_ksmd(marked, plan.interval)?);
            }
            Config::KsmdAdvisor => {
                // At ksmd's defaults; the advisor then sets its pace.
                subject.ksmd = Some(Config::Ksmd.own_ksmd(0, plan.interval)?);
                subject.advisor = Some(Advisor::start(plan.interval)?);
            }
            Config::Rksm(mode) => {
                subject.daemon = Some(
                    daemon_command(plan, mode, checksum, workloads, socket)
                        .stdout(Stdio::piped())
                        .stderr(Stdio::piped())
                        .spawn()
                        .map_err(|source| BenchError::Daemon {
                            what: "starting",
                            source,
                        })?,
                );
            }
        }
        Ok(subject)
    }

    /// The rksm daemon's pid, in rksm rows.
    fn daemon_pid(&self) -> Option<u32> {
        self.daemon.as_ref().map(Child::id)
    }

    /// Waits for the daemon, which stops by itself at `--duration`, and returns its final
    /// counters (`--json`); `None` in ksmd rows.
    fn finish(&mut self) -> Result<Option<serde_json::Value>, BenchError> {
        let Some(child) = self.daemon.take() else {
            return Ok(None);
        };
        let output = child
            .wait_with_output()
            .map_err(|source| BenchError::Daemon {
                what: "waiting for",
                source,
            })?;
        if !output.status.success() {
            let stderr = String::from_utf8_lossy(&output.stderr);
            return Err(BenchError::DaemonFailed(
                stderr.lines().last().unwrap_or("").to_string(),
            ));
        }
        Ok(serde_json::from_slice(&output.stdout).ok())
    }
}

/// The rksm daemon in `mode` over `workloads`: only what is on this command line counts, not
/// the host's configuration file, nor the status socket of a daemon the host runs.
fn daemon_command(
    plan: &BenchPlan,
    mode: &str,
    checksum: &str,
    workloads: &[Workload],
    socket: &Path,
) -> Command {
    let mut cmd = Command::new(&plan.rksm);
    cmd.args(["--no-config", "--log-level", "warn"]);
    cmd.arg("daemon").arg("--socket").arg(socket);
    let (mode, new_pages) = match mode {
        EBPF_READ => ("ebpf", "read"),
        mode => (mode, "sample"),
    };
    cmd.args([
        "--dirty",
        mode,
        "--new-pages",
        new_pages,
        "--checksum",
        checksum,
        "--interval",
        &plan.interval.to_string(),
    ]);
    cmd.args(["--duration", &plan.run_seconds.to_string(), "--json"]);
    if let Some(source) = &plan.write_protect {
        cmd.args(["--write-protect", source]);
    }
    for w in workloads {
        cmd.args(["--pid", &w.pid().to_string()]);
    }
    cmd
}

/// One pass of the daemon, as its status showed it, and when.
#[derive(Debug, Clone, Copy)]
struct PassSeen {
    number: u64,
    pages_hashed: u64,
    seconds: f64,
    /// Seconds into the run when the status showed it.
    seen_at: f64,
    written_bits_read: u64,
}

/// What was watched while a run went on.
#[derive(Debug, Default)]
struct Watched {
    samples: Vec<Sample>,
    /// The daemon's passes, from its status (its last pass), not its logs.
    passes: Vec<PassSeen>,
    /// The daemon's CPU seconds when the first status after its first pass was seen.
    first_pass_cpu: Option<f64>,
    /// The daemon's CPU seconds at the last sample.
    rksm_cpu: f64,
    /// The daemon's VmRSS and VmHWM at the last sample, in KiB.
    rss: Option<(u64, u64)>,
}

/// ksmd's counters and CPU when a run started: the run counts what they grew by.
#[derive(Debug, Clone, Copy)]
struct Baseline {
    ksmd: u32,
    ksmd_cpu: f64,
    pages_sharing: u64,
    pages_scanned: u64,
    full_scans: u64,
}

impl Baseline {
    fn now() -> Result<Baseline, BenchError> {
        let ksmd = ksmd_pid().ok_or(BenchError::NoKsmd)?;
        Ok(Baseline {
            ksmd,
            ksmd_cpu: cpu_seconds(ksmd).unwrap_or(0.0),
            pages_sharing: ksm_counter("pages_sharing"),
            pages_scanned: ksm_counter("pages_scanned"),
            full_scans: ksm_counter("full_scans"),
        })
    }

    fn ksmd_cpu(&self) -> f64 {
        cpu_seconds(self.ksmd).unwrap_or(0.0) - self.ksmd_cpu
    }

    fn pages_sharing(&self) -> u64 {
        ksm_counter("pages_sharing").saturating_sub(self.pages_sharing)
    }
}

/// How often a run is sampled: CPU to 90% of the savings is read at the first sample past
/// the 90%, so a coarser sampling adds up to a sample's worth of CPU to every row.
const SAMPLE_EVERY: Duration = Duration::from_millis(100);
/// Samples between two queries of the daemon's status (once a second): asking costs the
/// daemon CPU, which a run measures.
const SAMPLES_PER_STATUS: usize = 10;

/// Samples ten times a second until the run is over: `plan.run_seconds`, or, for ksmd at its
/// default pace, until it reaches `target` pages_sharing (bounded by its cap).
fn watch(
    plan: &BenchPlan,
    config: Config,
    subject: &Subject,
    socket: &Path,
    base: &Baseline,
    target: f64,
) -> Watched {
    let started = Instant::now();
    let daemon_pid = subject.daemon_pid();
    let mut w = Watched::default();
    let mut daemon_cpu = CpuClock::default();
    let keep_going = |samples: &[Sample]| {
        let t = started.elapsed().as_secs_f64();
        match config {
            Config::Ksmd => {
                t < plan.ksmd_default_cap
                    && (t < plan.run_seconds
                        || samples
                            .last()
                            .is_none_or(|s| (s.pages_sharing as f64) < target))
            }
            _ => t < plan.run_seconds,
        }
    };
    while keep_going(&w.samples) {
        std::thread::sleep(SAMPLE_EVERY);
        if let Some(cpu) = daemon_pid.and_then(|pid| daemon_cpu.read(pid)) {
            w.rksm_cpu = cpu;
        }
        if let Some(now) = daemon_pid.and_then(resident_kib) {
            w.rss = Some(now);
        }
        if daemon_pid.is_some() && w.samples.len().is_multiple_of(SAMPLES_PER_STATUS) {
            w.see_last_pass(socket, started);
        }
        w.samples.push(Sample {
            t: started.elapsed().as_secs_f64(),
            pages_sharing: base.pages_sharing(),
            rksm_cpu: w.rksm_cpu,
            ksmd_cpu: base.ksmd_cpu(),
        });
    }
    // The pass that ended since the last look: a short run may otherwise see none in its
    // steady state, where its queries fell just before its passes ended.
    if daemon_pid.is_some() {
        w.see_last_pass(socket, started);
    }
    w
}

impl Watched {
    /// Asks the daemon for its last pass, and keeps it if it is new.
    fn see_last_pass(&mut self, socket: &Path, started: Instant) {
        let Some(pass) = status::query(socket).ok().and_then(|s| s.last_pass) else {
            return;
        };
        if self.passes.last().is_none_or(|p| p.number < pass.number) {
            self.passes.push(PassSeen {
                number: pass.number,
                pages_hashed: pass.pages_hashed,
                seconds: pass.seconds,
                seen_at: started.elapsed().as_secs_f64(),
                written_bits_read: pass.written_bits_read,
            });
        }
        self.first_pass_cpu.get_or_insert(self.rksm_cpu);
    }
}

/// Runs one configuration once.
pub fn run_once(
    plan: &BenchPlan,
    profile_arg: &str,
    config: Config,
    checksum: &str,
) -> Result<RunResult, BenchError> {
    settle()?;
    let mut workloads = Workload::start_all(plan, profile_arg, config.marks())?;
    let base = Baseline::now()?;
    let achievable = plan
        .profile
        .achievable_sharing(ksm_counter("max_page_sharing"));
    let socket = std::env::temp_dir().join(format!("rksm-bench-{}.sock", std::process::id()));
    let mut subject = Subject::start(plan, config, checksum, &workloads, &socket)?;
    let watched = watch(
        plan,
        config,
        &subject,
        &socket,
        &base,
        0.9 * achievable as f64,
    );
    let rksm_stats = subject.finish()?;
    let ksmd_cpu = base.ksmd_cpu();
    let pages_unshared = ksm_counter("pages_unshared");
    let pages_sharing = base.pages_sharing();
    let integrity_ok = workloads.iter_mut().all(|w| w.verify() == "ok");
    drop(subject);
    drop(workloads);
    let ksm_scanned = ksm_counter("pages_scanned") - base.pages_scanned;
    let ksm_full_scans = ksm_counter("full_scans") - base.full_scans;
    Ok(summarize(
        plan,
        config,
        checksum,
        watched,
        rksm_stats,
        Ended {
            achievable,
            pages_sharing,
            pages_unshared,
            ksmd_cpu,
            ksm_scanned,
            ksm_full_scans,
            integrity_ok,
        },
    ))
}

/// The counters read when a run ended.
struct Ended {
    achievable: u64,
    pages_sharing: u64,
    pages_unshared: u64,
    ksmd_cpu: f64,
    ksm_scanned: u64,
    ksm_full_scans: u64,
    integrity_ok: bool,
}

/// Reduces what a run watched, and the daemon's final counters, to its row.
fn summarize(
    plan: &BenchPlan,
    config: Config,
    checksum: &str,
    watched: Watched,
    rksm_stats: Option<serde_json::Value>,
    end: Ended,
) -> RunResult {
    let Watched {
        samples,
        passes,
        first_pass_cpu,
        rksm_cpu,
        rss,
    } = watched;
    let mergeable = config.ksmd_only();
    let at_90 = samples
        .iter()
        .find(|s| s.pages_sharing as f64 >= 0.9 * end.achievable as f64);
    let stat = |key: &str| rksm_stats.as_ref().and_then(|s| s[key].as_u64());
    let stat_f64 = |key: &str| rksm_stats.as_ref().and_then(|s| s[key].as_f64());
    // Steady state: the last 40% of the run, when merging has settled.
    let run_end = samples.last().map_or(0.0, |s| s.t);
    let steady_from = run_end * 0.6;
    let steady: Vec<&Sample> = samples.iter().filter(|s| s.t >= steady_from).collect();
    let per_minute = |f: fn(&Sample) -> f64| match (steady.first(), steady.last()) {
        (Some(a), Some(b)) if b.t - a.t >= 2.0 => Some((f(b) - f(a)) / (b.t - a.t) * 60.0),
        _ => None,
    };
    let steady_passes: Vec<&PassSeen> =
        passes.iter().filter(|p| p.seen_at >= steady_from).collect();
    let pages_hashed = match config {
        Config::Rksm(_) => median_u64(steady_passes.iter().map(|p| p.pages_hashed).collect()),
        _ => end.ksm_scanned.checked_div(end.ksm_full_scans).unwrap_or(0),
    };
    let per_page = |kib: u64| kib as f64 * 1024.0 / plan.profile.mergeable_pages().max(1) as f64;
    RunResult {
        mode: config.name().into(),
        checksum: if mergeable {
            "xxh64".into()
        } else {
            checksum.into()
        },
        pages_sharing: end.pages_sharing,
        pages_hashed,
        cpu_seconds: rksm_cpu,
        ksmd_cpu_seconds: end.ksmd_cpu,
        seconds_to_90pct: at_90.map(|s| s.t),
        cpu_to_90pct: at_90.map(|s| s.rksm_cpu + s.ksmd_cpu),
        ksmd_cpu_to_90pct: at_90.map(|s| s.ksmd_cpu),
        rksm_cpu_to_90pct: at_90.filter(|_| !mergeable).map(|s| s.rksm_cpu),
        cow_breaks: stat("cow_breaks"),
        pages_unshared: end.pages_unshared,
        unshared_per_sharing: if end.pages_sharing > 0 {
            end.pages_unshared as f64 / end.pages_sharing as f64
        } else {
            0.0
        },
        checksum_ns_per_page: match (stat("checksum_ns"), stat("pages_hashed")) {
            (Some(ns), Some(pages)) if pages > 0 => Some(ns as f64 / pages as f64),
            _ => None,
        },
        steady_cpu_per_minute: per_minute(|s| s.rksm_cpu + s.ksmd_cpu),
        steady_rksm_cpu_per_minute: per_minute(|s| s.rksm_cpu),
        steady_pass_seconds: (!steady_passes.is_empty())
            .then(|| median_f64(steady_passes.iter().map(|p| p.seconds).collect())),
        // The daemon's own count, to the end of its first pass; else the CPU seen at the first
        // status that showed a pass, up to a second later.
        first_pass_cpu: stat_f64("first_pass_cpu_seconds")
            .filter(|&cpu| cpu > 0.0)
            .or(first_pass_cpu),
        first_pass_gbps: match (stat_f64("first_pass_seconds"), stat("first_pass_pages")) {
            (Some(secs), Some(pages)) if secs > 0.0 && pages > 0 => {
                Some(pages as f64 * PAGE_SIZE as f64 / secs / 1e9)
            }
            _ => None,
        },
        first_pass_pages: stat("first_pass_pages"),
        ksmd_ns_per_page: (mergeable && end.ksm_scanned > 0)
            .then(|| end.ksmd_cpu * 1e9 / end.ksm_scanned as f64),
        pages_marked: stat("pages_marked"),
        rss_bytes_per_page: rss.map(|(now, _)| per_page(now)),
        peak_rss_bytes_per_page: rss.map(|(_, peak)| per_page(peak)),
        write_protect: rksm_stats.as_ref().and_then(|s| {
            let sources = s["write_protect"].as_object()?;
            let list: Vec<String> = sources.iter().map(|(k, v)| format!("{k}: {v}")).collect();
            Some(list.join(", "))
        }),
        steady_rksm_cpu_per_pass: per_minute(|s| s.rksm_cpu).map(|m| m / 60.0 * plan.interval),
        written_bits_read: (matches!(config, Config::Rksm(_)) && !steady_passes.is_empty())
            .then(|| median_u64(steady_passes.iter().map(|p| p.written_bits_read).collect())),
        soft_dirty_clears: stat("soft_dirty_clears"),
        ms_per_clear: match (
            stat_f64("soft_dirty_clear_seconds"),
            stat("soft_dirty_clears"),
        ) {
            (Some(secs), Some(n)) if n > 0 => Some(secs * 1e3 / n as f64),
            _ => None,
        },
        integrity_ok: end.integrity_ok,
        samples,
    }
}

/// ksmd's advisor (Linux 6.7) steering its pace, put back to what it was when dropped.
struct Advisor {
    found: (String, String),
}

impl Advisor {
    const MODE: &'static str = "/sys/kernel/mm/ksm/advisor_mode";
    const TARGET: &'static str = "/sys/kernel/mm/ksm/advisor_target_scan_time";

    /// Asks the advisor to sweep all mergeable memory in `seconds` (at least 1).
    fn start(seconds: f64) -> Result<Advisor, BenchError> {
        let read = |path: &'static str| {
            std::fs::read_to_string(path).map_err(|source| BenchError::Advisor { path, source })
        };
        let mode = read(Self::MODE)?;
        // "[none] scan-time": the bracketed one is in force.
        let found_mode = mode
            .split_whitespace()
            .find(|w| w.starts_with('['))
            .map_or("none", |w| w.trim_matches(['[', ']']))
            .to_string();
        let found = (found_mode, read(Self::TARGET)?.trim().to_string());
        let write = |path: &'static str, value: &str| {
            std::fs::write(path, value).map_err(|source| BenchError::Advisor { path, source })
        };
        write(Self::TARGET, &(seconds.ceil().max(1.0) as u64).to_string())?;
        write(Self::MODE, "scan-time")?;
        Ok(Advisor { found })
    }
}

impl Drop for Advisor {
    fn drop(&mut self) {
        for (path, value) in [(Self::MODE, &self.found.0), (Self::TARGET, &self.found.1)] {
            if let Err(e) = std::fs::write(path, value) {
                log::warn!("restoring {path}: {e}");
            }
        }
    }
}
