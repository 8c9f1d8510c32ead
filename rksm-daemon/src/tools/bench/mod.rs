//! `rksm bench`: ksmd against rksm's modes on the same workload, measured side by side.
//!
//! The linux-mm experiment that started rksm measured, per hash function, CoW count,
//! checksum time per page, pages_sharing and pages_unshared. This module reruns it for six
//! configurations on one machine in one run: ksmd alone at its default pace with the
//! workloads' memory marked mergeable, ksmd paced to sweep that memory in rksm's interval,
//! ksmd steered by the kernel's own advisor (`advisor_mode=scan-time`, what a user would pick
//! instead of rksm), and the rksm daemon in hash-only, pagemap and ebpf mode, each rksm mode
//! with xxh64 and crc32c. Every run starts fresh workloads (`rksm workload`), samples
//! pages_sharing and the CPU time of rksm and of ksmd from /proc twice a second, and ends by
//! asking every workload to check its own memory. The last 40% of each run is its steady
//! state, reported on its own: what rksm and ksmd cost per minute once merging has settled.

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use rksm_common::{PAGE, PAGE_SIZE};
use serde::Serialize;

pub mod report;
pub mod verdict;

pub use report::{markdown, svg};

use crate::{
    kernel::{
        ksmd::{self, KsmdOwner, KsmdSettings},
        procfs,
        reader::{self, ProcMem},
    },
    service::status,
    tools::{
        guest::{self, GuestImage, GuestMemory, GuestProcess},
        workload::{Profile, WorkloadProcess},
    },
};

/// One configuration of the comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Config {
    /// ksmd alone at its default settings, the memory marked mergeable by the workloads.
    Ksmd,
    /// ksmd alone, paced to sweep the memory in rksm's interval.
    KsmdTuned,
    /// ksmd alone, its pace set by the kernel's advisor to sweep in rksm's interval.
    KsmdAdvisor,
    /// The rksm daemon in a dirty mode.
    Rksm(&'static str),
}

impl Config {
    /// Takes ksmd over with this ksmd-only configuration's pace: its defaults (100 pages
    /// every 20 ms), or, tuned, sweeping `mergeable_pages` in `sweep_secs`.
    fn own_ksmd(self, mergeable_pages: u64, sweep_secs: f64) -> Result<KsmdOwner, String> {
        let settings = match self {
            Config::KsmdTuned => ksmd::pace(mergeable_pages, sweep_secs, 20),
            _ => KsmdSettings {
                run: 1,
                pages_to_scan: 100,
                sleep_millisecs: 20,
            },
        };
        KsmdOwner::take(
            Path::new(ksmd::KSM_SYSFS),
            Path::new(ksmd::STATE_PATH),
            settings,
        )
        .map_err(|e| e.to_string())
    }

    /// The `mode` column.
    pub fn name(self) -> &'static str {
        match self {
            Config::Ksmd => "ksmd",
            Config::KsmdTuned => "ksmd-tuned",
            Config::KsmdAdvisor => "ksmd-advisor",
            Config::Rksm(mode) => mode,
        }
    }
}

/// One sample of a run.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Sample {
    /// Seconds since the run started.
    pub t: f64,
    /// ksmd's pages_sharing, minus what it was before the run.
    pub pages_sharing: u64,
    /// CPU seconds of the rksm daemon so far.
    pub rksm_cpu: f64,
    /// CPU seconds of ksmd so far.
    pub ksmd_cpu: f64,
}

/// One run's results (the JSON row).
#[derive(Debug, Clone, Serialize)]
pub struct RunResult {
    /// ksmd, ksmd-tuned, hash-only, ebpf or pagemap.
    pub mode: String,
    /// xxh64 or crc32c (ksmd always uses the kernel's xxhash).
    pub checksum: String,
    /// pages_sharing at the end.
    pub pages_sharing: u64,
    /// Pages hashed per pass in steady state (ksmd: pages scanned per full scan).
    pub pages_hashed: u64,
    /// CPU seconds of the rksm daemon.
    pub cpu_seconds: f64,
    /// CPU seconds of ksmd.
    pub ksmd_cpu_seconds: f64,
    /// Seconds until pages_sharing reached 90% of what the profile allows (None: never).
    pub seconds_to_90pct: Option<f64>,
    /// rksm + ksmd CPU seconds spent until then.
    pub cpu_to_90pct: Option<f64>,
    /// ksmd's part of that: in rksm modes, the merging of what rksm marked, which ksmd
    /// tuned alone pays as well (so it bounds how far below ksmd-tuned rksm can get).
    #[serde(default)]
    pub ksmd_cpu_to_90pct: Option<f64>,
    /// Copy-on-write breaks the tracer saw (rksm modes only).
    pub cow_breaks: Option<u64>,
    /// ksmd's pages_unshared at the end.
    pub pages_unshared: u64,
    /// pages_unshared / pages_sharing.
    pub unshared_per_sharing: f64,
    /// Checksum time per hashed page (rksm modes only).
    pub checksum_ns_per_page: Option<f64>,
    /// Steady state (the last 40% of the run): rksm + ksmd CPU seconds per minute.
    pub steady_cpu_per_minute: Option<f64>,
    /// Steady state: rksm's CPU seconds per minute.
    pub steady_rksm_cpu_per_minute: Option<f64>,
    /// Steady state: the median pass time (rksm modes).
    pub steady_pass_seconds: Option<f64>,
    /// rksm's CPU seconds when its first pass ended (rksm modes).
    pub first_pass_cpu: Option<f64>,
    /// What rksm's first pass read per second, in GB (rksm modes).
    #[serde(default)]
    pub first_pass_gbps: Option<f64>,
    /// Pages rksm's first pass took up: read whole or only sampled (rksm modes).
    #[serde(default)]
    pub first_pass_pages: Option<u64>,
    /// ksmd's CPU nanoseconds per page scanned (ksmd rows).
    pub ksmd_ns_per_page: Option<f64>,
    /// Pages rksm marked mergeable (rksm modes).
    pub pages_marked: Option<u64>,
    /// rksm's resident memory per page of the workloads at the end of the run, and at its
    /// peak, in bytes (rksm modes; VmRSS and VmHWM).
    #[serde(default)]
    pub rss_bytes_per_page: Option<f64>,
    #[serde(default)]
    pub peak_rss_bytes_per_page: Option<f64>,
    /// The write-protect sources the targets used (rksm modes), as `source: targets`.
    #[serde(default)]
    pub write_protect: Option<String>,
    /// Steady state: rksm's CPU seconds per pass.
    #[serde(default)]
    pub steady_rksm_cpu_per_pass: Option<f64>,
    /// Steady state: pages whose written bit the dirty source looked at per pass (median).
    #[serde(default)]
    pub written_bits_read: Option<u64>,
    /// Clears of the targets' soft-dirty bits, and the kernel's milliseconds per clear.
    #[serde(default)]
    pub soft_dirty_clears: Option<u64>,
    #[serde(default)]
    pub ms_per_clear: Option<f64>,
    /// Every workload's memory held exactly what it wrote.
    pub integrity_ok: bool,
    /// The time series.
    pub samples: Vec<Sample>,
}

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchPlan {
    /// The workload.
    pub profile: Profile,
    /// How long each run lasts.
    pub run_seconds: f64,
    /// Seconds between rksm passes.
    pub interval: f64,
    /// The rksm binary (the running one).
    pub rksm: PathBuf,
    /// Runs per configuration (medians are reported).
    pub repeat: u32,
    /// ksmd at its default pace is slow: its runs go on until 90% is reached, up to this long.
    pub ksmd_default_cap: f64,
    /// What the guests boot, for a profile of guests.
    pub guest: Option<GuestImage>,
    /// The daemon's `--write-protect` (None: its default, auto).
    pub write_protect: Option<String>,
}

/// One process of the workload: an `rksm workload` or a qemu guest.
enum Workload {
    Process(WorkloadProcess),
    Guest(GuestProcess),
}

impl Workload {
    /// Starts the profile's processes and waits until every one has filled its memory.
    /// `mergeable` marks a workload process's memory (a guest marks its own).
    fn start_all(
        plan: &BenchPlan,
        profile_arg: &str,
        mergeable: bool,
    ) -> Result<Vec<Self>, String> {
        let n = plan.profile.processes;
        let Some(image) = plan.guest.as_ref().filter(|_| plan.profile.is_guests()) else {
            return (0..n)
                .map(|i| WorkloadProcess::start(&plan.rksm, profile_arg, i, mergeable))
                .map(|w| w.map(Workload::Process).map_err(|e| e.to_string()))
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

/// CPU seconds (user + system) of a process from /proc/PID/stat (fields 14 and 15).
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let ticks = |n| procfs::stat_field(&stat, n)?.parse::<u64>().ok();
    Some((ticks(14)? + ticks(15)?) as f64 / procfs::clock_ticks_per_second())
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
pub fn settle() -> Result<(), String> {
    let owner = KsmdOwner::take(
        Path::new(ksmd::KSM_SYSFS),
        Path::new(ksmd::STATE_PATH),
        KsmdSettings {
            run: 1,
            pages_to_scan: 10_000,
            sleep_millisecs: 10,
        },
    )
    .map_err(|e| e.to_string())?;
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

/// Runs one configuration once.
pub fn run_once(
    plan: &BenchPlan,
    profile_arg: &str,
    config: Config,
    checksum: &str,
) -> Result<RunResult, String> {
    let mergeable = matches!(
        config,
        Config::Ksmd | Config::KsmdTuned | Config::KsmdAdvisor
    );
    settle()?;
    let mut workloads = Workload::start_all(plan, profile_arg, mergeable)
        .map_err(|e| format!("starting the workload: {e}"))?;
    let ksmd = ksmd_pid().ok_or("no ksmd thread: is KSM built into this kernel?")?;
    let achievable = plan
        .profile
        .achievable_sharing(ksm_counter("max_page_sharing"));
    let base_sharing = ksm_counter("pages_sharing");
    let (base_scanned, base_scans) = (ksm_counter("pages_scanned"), ksm_counter("full_scans"));
    let ksmd_cpu0 = cpu_seconds(ksmd).unwrap_or(0.0);

    let mergeable_pages = plan.profile.mergeable_pages();
    let socket = std::env::temp_dir().join(format!("rksm-bench-{}.sock", std::process::id()));
    let mut advisor = None;
    let (owner, mut daemon) = match config {
        Config::Ksmd | Config::KsmdTuned => {
            (Some(config.own_ksmd(mergeable_pages, plan.interval)?), None)
        }
        Config::KsmdAdvisor => {
            // At ksmd's defaults; the advisor then sets its pace.
            let owner = Config::Ksmd.own_ksmd(0, plan.interval)?;
            advisor = Some(Advisor::start(plan.interval)?);
            (Some(owner), None)
        }
        Config::Rksm(mode) => {
            let mut cmd = Command::new(&plan.rksm);
            // Only what is on this command line counts: not the host's configuration file,
            // nor the status socket of a daemon the host runs.
            cmd.args(["--no-config", "--log-level", "warn"]);
            cmd.arg("daemon").arg("--socket").arg(&socket);
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
            for w in &workloads {
                cmd.args(["--pid", &w.pid().to_string()]);
            }
            let child = cmd
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .map_err(|e| format!("starting rksm: {e}"))?;
            (None, Some(child))
        }
    };
    let started = Instant::now();
    let mut samples = Vec::new();
    // Pages hashed and seconds of each pass, from the daemon's status (its last pass), not
    // its logs, with when it was seen.
    let mut passes: Vec<(u64, u64, f64, f64, u64)> = Vec::new();
    let mut first_pass_cpu = None;
    let daemon_pid = daemon.as_ref().map(Child::id);
    let mut last_rksm_cpu = 0.0;
    let mut rss = None;
    let target = 0.9 * achievable as f64;
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
    while keep_going(&samples) {
        std::thread::sleep(Duration::from_millis(500));
        if let Some(cpu) = daemon_pid.and_then(cpu_seconds) {
            last_rksm_cpu = cpu;
        }
        if let Some(now) = daemon_pid.and_then(resident_kib) {
            rss = Some(now);
        }
        // The status once a second: asking costs the daemon CPU, which this measures.
        if daemon_pid.is_some() && samples.len() % 2 == 0 {
            let last = status::query(&socket).ok().and_then(|s| s.last_pass);
            if let Some(pass) = last {
                if passes.last().is_none_or(|&(n, ..)| n < pass.number) {
                    passes.push((
                        pass.number,
                        pass.pages_hashed,
                        pass.seconds,
                        started.elapsed().as_secs_f64(),
                        pass.written_bits_read,
                    ));
                }
                first_pass_cpu.get_or_insert(last_rksm_cpu);
            }
        }
        samples.push(Sample {
            t: started.elapsed().as_secs_f64(),
            pages_sharing: ksm_counter("pages_sharing").saturating_sub(base_sharing),
            rksm_cpu: last_rksm_cpu,
            ksmd_cpu: cpu_seconds(ksmd).unwrap_or(0.0) - ksmd_cpu0,
        });
    }
    // rksm stops by itself at --duration; its JSON tells the rest.
    let mut rksm_stats = None;
    if let Some(child) = daemon.take() {
        let output = child
            .wait_with_output()
            .map_err(|e| format!("waiting for rksm: {e}"))?;
        if !output.status.success() {
            return Err(format!(
                "rksm daemon failed: {}",
                String::from_utf8_lossy(&output.stderr)
                    .lines()
                    .last()
                    .unwrap_or("")
            ));
        }
        rksm_stats = serde_json::from_slice::<serde_json::Value>(&output.stdout).ok();
    }
    let ksmd_cpu = cpu_seconds(ksmd).unwrap_or(0.0) - ksmd_cpu0;
    let pages_unshared = ksm_counter("pages_unshared");
    let pages_sharing = ksm_counter("pages_sharing").saturating_sub(base_sharing);
    let integrity_ok = workloads.iter_mut().all(|w| w.verify() == "ok");
    drop(advisor);
    drop(owner);
    drop(workloads);

    let at_90 = samples
        .iter()
        .find(|s| s.pages_sharing as f64 >= 0.9 * achievable as f64);
    let stat = |key: &str| rksm_stats.as_ref().and_then(|s| s[key].as_u64());
    // Steady state: the last 40% of the run, when merging has settled.
    let run_end = samples.last().map_or(0.0, |s| s.t);
    let steady_from = run_end * 0.6;
    let steady: Vec<&Sample> = samples.iter().filter(|s| s.t >= steady_from).collect();
    let per_minute = |f: fn(&Sample) -> f64| match (steady.first(), steady.last()) {
        (Some(a), Some(b)) if b.t - a.t >= 2.0 => Some((f(b) - f(a)) / (b.t - a.t) * 60.0),
        _ => None,
    };
    let steady_passes: Vec<&(u64, u64, f64, f64, u64)> =
        passes.iter().filter(|p| p.3 >= steady_from).collect();
    let ksm_scanned = ksm_counter("pages_scanned") - base_scanned;
    let pages_hashed = match config {
        Config::Rksm(_) => median_u64(steady_passes.iter().map(|p| p.1).collect()),
        _ => ksm_scanned
            .checked_div(ksm_counter("full_scans") - base_scans)
            .unwrap_or(0),
    };
    Ok(RunResult {
        mode: config.name().into(),
        checksum: if mergeable {
            "xxh64".into()
        } else {
            checksum.into()
        },
        pages_sharing,
        pages_hashed,
        cpu_seconds: last_rksm_cpu,
        ksmd_cpu_seconds: ksmd_cpu,
        seconds_to_90pct: at_90.map(|s| s.t),
        cpu_to_90pct: at_90.map(|s| s.rksm_cpu + s.ksmd_cpu),
        ksmd_cpu_to_90pct: at_90.map(|s| s.ksmd_cpu),
        cow_breaks: stat("cow_breaks"),
        pages_unshared,
        unshared_per_sharing: if pages_sharing > 0 {
            pages_unshared as f64 / pages_sharing as f64
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
            .then(|| median_f64(steady_passes.iter().map(|p| p.2).collect())),
        first_pass_cpu,
        first_pass_gbps: match (
            rksm_stats
                .as_ref()
                .and_then(|s| s["first_pass_seconds"].as_f64()),
            stat("first_pass_pages"),
        ) {
            (Some(secs), Some(pages)) if secs > 0.0 && pages > 0 => {
                Some(pages as f64 * PAGE_SIZE as f64 / secs / 1e9)
            }
            _ => None,
        },
        first_pass_pages: stat("first_pass_pages"),
        ksmd_ns_per_page: (mergeable && ksm_scanned > 0)
            .then(|| ksmd_cpu * 1e9 / ksm_scanned as f64),
        pages_marked: stat("pages_marked"),
        rss_bytes_per_page: rss
            .map(|(now, _)| now as f64 * 1024.0 / plan.profile.mergeable_pages().max(1) as f64),
        peak_rss_bytes_per_page: rss
            .map(|(_, peak)| peak as f64 * 1024.0 / plan.profile.mergeable_pages().max(1) as f64),
        write_protect: rksm_stats.as_ref().and_then(|s| {
            let sources = s["write_protect"].as_object()?;
            let list: Vec<String> = sources.iter().map(|(k, v)| format!("{k}: {v}")).collect();
            Some(list.join(", "))
        }),
        steady_rksm_cpu_per_pass: per_minute(|s| s.rksm_cpu).map(|m| m / 60.0 * plan.interval),
        written_bits_read: (matches!(config, Config::Rksm(_)) && !steady_passes.is_empty())
            .then(|| median_u64(steady_passes.iter().map(|p| p.4).collect())),
        soft_dirty_clears: stat("soft_dirty_clears"),
        ms_per_clear: match (
            rksm_stats
                .as_ref()
                .and_then(|s| s["soft_dirty_clear_seconds"].as_f64()),
            stat("soft_dirty_clears"),
        ) {
            (Some(secs), Some(n)) if n > 0 => Some(secs * 1e3 / n as f64),
            _ => None,
        },
        integrity_ok,
        samples,
    })
}

/// ksmd's advisor (Linux 6.7) steering its pace, put back to what it was when dropped.
struct Advisor {
    found: (String, String),
}

impl Advisor {
    const MODE: &'static str = "/sys/kernel/mm/ksm/advisor_mode";
    const TARGET: &'static str = "/sys/kernel/mm/ksm/advisor_target_scan_time";

    /// Asks the advisor to sweep all mergeable memory in `seconds` (at least 1).
    fn start(seconds: f64) -> Result<Advisor, String> {
        let read = |path: &str| {
            std::fs::read_to_string(path)
                .map_err(|e| format!("{path}: {e} (the advisor needs Linux 6.7)"))
        };
        let mode = read(Self::MODE)?;
        // "[none] scan-time": the bracketed one is in force.
        let found_mode = mode
            .split_whitespace()
            .find(|w| w.starts_with('['))
            .map_or("none", |w| w.trim_matches(['[', ']']))
            .to_string();
        let found = (found_mode, read(Self::TARGET)?.trim().to_string());
        let write = |path: &str, value: &str| {
            std::fs::write(path, value).map_err(|e| format!("{path}: {e}"))
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

fn median_u64(mut v: Vec<u64>) -> u64 {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

fn median_f64(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// The median run of several (by pages_sharing, then time to 90%), with every numeric field
/// replaced by its median; integrity holds only if it held in every run.
pub fn median_of(mut runs: Vec<RunResult>) -> RunResult {
    // The run whose pages_sharing is the median supplies the time series.
    runs.sort_by_key(|r| r.pages_sharing);
    let mut typical = runs[runs.len() / 2].clone();
    let u = |f: fn(&RunResult) -> u64| median_u64(runs.iter().map(f).collect());
    let f = |f: fn(&RunResult) -> f64| median_f64(runs.iter().map(f).collect());
    let some = |f: fn(&RunResult) -> Option<f64>| {
        let values: Vec<f64> = runs.iter().filter_map(f).collect();
        (values.len() * 2 > runs.len()).then(|| median_f64(values))
    };
    typical.pages_sharing = u(|r| r.pages_sharing);
    typical.pages_hashed = u(|r| r.pages_hashed);
    typical.pages_unshared = u(|r| r.pages_unshared);
    typical.cpu_seconds = f(|r| r.cpu_seconds);
    typical.ksmd_cpu_seconds = f(|r| r.ksmd_cpu_seconds);
    typical.seconds_to_90pct = some(|r| r.seconds_to_90pct);
    typical.cpu_to_90pct = some(|r| r.cpu_to_90pct);
    typical.ksmd_cpu_to_90pct = some(|r| r.ksmd_cpu_to_90pct);
    typical.checksum_ns_per_page = some(|r| r.checksum_ns_per_page);
    typical.steady_cpu_per_minute = some(|r| r.steady_cpu_per_minute);
    typical.steady_rksm_cpu_per_minute = some(|r| r.steady_rksm_cpu_per_minute);
    typical.steady_pass_seconds = some(|r| r.steady_pass_seconds);
    typical.first_pass_cpu = some(|r| r.first_pass_cpu);
    typical.first_pass_gbps = some(|r| r.first_pass_gbps);
    typical.first_pass_pages = typical
        .first_pass_pages
        .map(|_| u(|r| r.first_pass_pages.unwrap_or(0)));
    typical.rss_bytes_per_page = some(|r| r.rss_bytes_per_page);
    typical.peak_rss_bytes_per_page = some(|r| r.peak_rss_bytes_per_page);
    typical.ksmd_ns_per_page = some(|r| r.ksmd_ns_per_page);
    typical.steady_rksm_cpu_per_pass = some(|r| r.steady_rksm_cpu_per_pass);
    typical.ms_per_clear = some(|r| r.ms_per_clear);
    typical.written_bits_read = typical
        .written_bits_read
        .map(|_| u(|r| r.written_bits_read.unwrap_or(0)));
    typical.soft_dirty_clears = typical
        .soft_dirty_clears
        .map(|_| u(|r| r.soft_dirty_clears.unwrap_or(0)));
    typical.cow_breaks = typical.cow_breaks.map(|_| u(|r| r.cow_breaks.unwrap_or(0)));
    typical.unshared_per_sharing = if typical.pages_sharing > 0 {
        typical.pages_unshared as f64 / typical.pages_sharing as f64
    } else {
        0.0
    };
    typical.integrity_ok = runs.iter().all(|r| r.integrity_ok);
    typical
}

/// The configurations and checksums of a full comparison, in report order.
pub fn matrix() -> Vec<(Config, &'static str)> {
    let mut m = vec![
        (Config::Ksmd, "xxh64"),
        (Config::KsmdTuned, "xxh64"),
        (Config::KsmdAdvisor, "xxh64"),
    ];
    for mode in ["hash-only", "pagemap", "ebpf"] {
        for checksum in ["xxh64", "crc32c"] {
            m.push((Config::Rksm(mode), checksum));
        }
    }
    // ebpf reading every new page whole, next to ebpf sampling them.
    m.push((Config::Rksm(EBPF_READ), "xxh64"));
    m
}

/// The ebpf configuration with `--new-pages read`.
pub const EBPF_READ: &str = "ebpf-read";

/// This machine's memory speeds, in GB/s, what a first pass is held to.
#[derive(Debug, Clone, Copy)]
pub struct MemorySpeed {
    /// memcpy from 1 GiB of memory (no cache holds it) into a 2 MiB buffer, as a pass copies
    /// a target's pages: the first pass is to run at 0.9 of it.
    pub memcpy_gbps: f64,
    /// `process_vm_readv` of the same GiB into the same buffer, 512 pages a call, as a pass
    /// reads a target (here rksm's own memory, by the same kernel path): the copy a pass
    /// cannot avoid, one thread's ceiling. None if it could not be read.
    pub process_vm_readv_gbps: Option<f64>,
}

/// Measures [`MemorySpeed`], the median of three of each.
pub fn memory_speed() -> MemorySpeed {
    const SOURCE: usize = 1 << 30;
    const CHUNK: usize = 2 << 20;
    // Page-aligned, as a target's pages are (a read across two pages pins both).
    let backing = vec![0x5au8; SOURCE + PAGE];
    let offset = backing.as_ptr().align_offset(PAGE);
    let source = &backing[offset..offset + SOURCE];
    let mut chunk = vec![0u8; CHUNK];
    // GB/s of `copy` over the whole source, a chunk at a time, the median of three sweeps;
    // None if a copy fails.
    let mut speed = |copy: &mut dyn FnMut(&[u8], &mut [u8]) -> bool| -> Option<f64> {
        let mut speeds = Vec::new();
        for _ in 0..3 {
            let started = Instant::now();
            for from in source.chunks(CHUNK) {
                if !copy(std::hint::black_box(from), &mut chunk) {
                    return None;
                }
                std::hint::black_box(&mut chunk);
            }
            speeds.push(SOURCE as f64 / started.elapsed().as_secs_f64() / 1e9);
        }
        Some(median_f64(speeds))
    };
    let memcpy_gbps = speed(&mut |from, to| {
        to.copy_from_slice(from);
        true
    })
    .unwrap_or(0.0);
    let process_vm_readv_gbps = ProcMem::open(std::process::id()).ok().and_then(|mem| {
        let pages = CHUNK / PAGE;
        let mapped_once = vec![true; pages];
        let mut read = vec![false; pages];
        let mut addrs = Vec::with_capacity(pages);
        speed(&mut |from, to| {
            let base = from.as_ptr() as u64;
            addrs.clear();
            addrs.extend((0..pages as u64).map(|i| base + i * PAGE_SIZE));
            reader::read_pages(&mem, &addrs, &mapped_once, to, &mut read).ok() == Some(pages)
        })
    });
    MemorySpeed {
        memcpy_gbps,
        process_vm_readv_gbps,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row of `mode` with `checksum` that hashed `hashed` pages a steady pass and reached
    /// 90% of the savings in `t90` s and `cpu90` CPU s.
    pub(super) fn run(
        mode: &str,
        checksum: &str,
        hashed: u64,
        t90: Option<f64>,
        cpu90: Option<f64>,
    ) -> RunResult {
        RunResult {
            mode: mode.into(),
            checksum: checksum.into(),
            pages_sharing: 1000,
            pages_hashed: hashed,
            cpu_seconds: 1.0,
            ksmd_cpu_seconds: 1.0,
            seconds_to_90pct: t90,
            cpu_to_90pct: cpu90,
            ksmd_cpu_to_90pct: cpu90.map(|c| c * 0.4),
            cow_breaks: None,
            pages_unshared: 10,
            unshared_per_sharing: 0.01,
            checksum_ns_per_page: None,
            steady_cpu_per_minute: Some(cpu90.unwrap_or(1.0)),
            steady_rksm_cpu_per_minute: None,
            steady_pass_seconds: Some(hashed as f64 / 1e5),
            first_pass_cpu: Some(0.2),
            first_pass_gbps: Some(hashed as f64 / 1000.0),
            first_pass_pages: None,
            ksmd_ns_per_page: Some(100.0),
            pages_marked: Some(1000),
            rss_bytes_per_page: None,
            peak_rss_bytes_per_page: None,
            write_protect: None,
            steady_rksm_cpu_per_pass: None,
            written_bits_read: None,
            soft_dirty_clears: None,
            ms_per_clear: None,
            integrity_ok: true,
            samples: vec![Sample {
                t: 30.0,
                pages_sharing: 1000,
                rksm_cpu: 0.5,
                ksmd_cpu: 0.5,
            }],
        }
    }

    #[test]
    fn medians_take_the_middle_and_integrity_needs_every_run() {
        let mut runs = vec![
            run("ebpf", "xxh64", 1, Some(1.0), Some(1.0)),
            run("ebpf", "xxh64", 9, Some(3.0), Some(3.0)),
            run("ebpf", "xxh64", 5, Some(2.0), Some(2.0)),
        ];
        runs[1].integrity_ok = false;
        runs[0].pages_unshared = 500;
        let m = median_of(runs);
        assert_eq!(m.pages_hashed, 5);
        assert_eq!(m.seconds_to_90pct, Some(2.0));
        assert_eq!(m.unshared_per_sharing, 0.01, "recomputed from the medians");
        assert!(!m.integrity_ok);
    }

    #[test]
    fn the_matrix_has_every_mode_with_both_checksums() {
        let m = matrix();
        assert_eq!(m.len(), 10);
        assert!(m.contains(&(Config::KsmdAdvisor, "xxh64")));
        assert!(m.contains(&(Config::Rksm("ebpf"), "crc32c")));
    }
}
