//! The daemon: passes over live targets, marking verified duplicates for ksmd to merge.
//!
//! One pass: refresh the targets (new processes matching the selection join, exited ones
//! leave, ones that cannot be borrowed are refused with a reason), let the dirty source arm
//! and say what changed, scan (read, checksum, index), count copy-on-write breaks of merged
//! pages, back off regions that keep breaking, mark the new duplicate runs in each target,
//! and pace ksmd to the marked set. Merges are counted only when the kernel shows them: pages
//! the scan finds mapped to KSM frames (kpageflags) in the targets. Between passes the tracer's
//! ring is drained as records arrive.

use std::{
    cell::RefCell,
    collections::{BTreeMap, HashMap, HashSet},
    fmt,
    os::fd::BorrowedFd,
    path::PathBuf,
    rc::Rc,
    str::FromStr,
    time::{Duration, Instant, SystemTime},
};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use rksm_common::PAGE_SIZE;
use serde::Serialize;

use crate::{
    checksum::ChecksumKind,
    dirty::{DirtySource, EbpfSource, HashOnly, PagemapSource, TracerHub},
    ksmd::{self, KsmdError, KsmdOwner},
    merge::{Marker, MergePolicy, Run},
    procfs::ProcfsError,
    remote::{self, RemoteError, RemoteRefusal},
    scan::{PassReport, ScanConfig, Scanner},
    status::{unix_time, LastPass, Status, TargetStatus},
    targets::{Process, SelectionError, TargetSpec},
    tracer::{Tracer, TracerConfig, TracerError},
};

/// How the daemon decides which pages to hash again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DirtyMode {
    /// ebpf if the tracer loads, else pagemap if write-protect arming works, else hash-only.
    #[default]
    Auto,
    /// KSM's rule: rehash everything every pass.
    HashOnly,
    /// The eBPF write-fault tracer plus write-protect arming.
    Ebpf,
    /// Write-protect arming, written bits from PAGEMAP_SCAN.
    Pagemap,
}

impl DirtyMode {
    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            DirtyMode::Auto => "auto",
            DirtyMode::HashOnly => "hash-only",
            DirtyMode::Ebpf => "ebpf",
            DirtyMode::Pagemap => "pagemap",
        }
    }
}

impl fmt::Display for DirtyMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An unknown `--dirty` value.
#[derive(Debug, thiserror::Error)]
#[error("unknown dirty mode `{0}` (expected ebpf, pagemap, hash-only or auto)")]
pub struct UnknownDirtyMode(String);

impl FromStr for DirtyMode {
    type Err = UnknownDirtyMode;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(DirtyMode::Auto),
            "hash-only" => Ok(DirtyMode::HashOnly),
            "ebpf" => Ok(DirtyMode::Ebpf),
            "pagemap" => Ok(DirtyMode::Pagemap),
            other => Err(UnknownDirtyMode(other.into())),
        }
    }
}

/// Which processes may share merged pages with each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DomainPolicy {
    /// Processes of the same user (real uid).
    #[default]
    Uid,
    /// Processes of the same cgroup.
    Cgroup,
    /// All targets.
    None,
}

impl DomainPolicy {
    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            DomainPolicy::Uid => "uid",
            DomainPolicy::Cgroup => "cgroup",
            DomainPolicy::None => "none",
        }
    }

    /// The domain `pid` belongs to (None if /proc no longer says).
    fn domain_of(self, pid: u32) -> Option<String> {
        match self {
            DomainPolicy::None => Some("all".into()),
            DomainPolicy::Uid => {
                let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
                let uid = status
                    .lines()
                    .find_map(|l| l.strip_prefix("Uid:"))?
                    .split_whitespace()
                    .next()?;
                Some(format!("uid {uid}"))
            }
            DomainPolicy::Cgroup => {
                // The whole membership list: v2's single line, or every v1 hierarchy's.
                let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
                Some(format!("cgroup {}", cgroups.trim().replace('\n', ";")))
            }
        }
    }
}

impl fmt::Display for DomainPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An unknown `--domain` value.
#[derive(Debug, thiserror::Error)]
#[error("unknown merge domain `{0}` (expected uid, cgroup or none)")]
pub struct UnknownDomain(String);

impl FromStr for DomainPolicy {
    type Err = UnknownDomain;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "uid" => Ok(DomainPolicy::Uid),
            "cgroup" => Ok(DomainPolicy::Cgroup),
            "none" => Ok(DomainPolicy::None),
            other => Err(UnknownDomain(other.into())),
        }
    }
}

/// Everything the daemon is told.
#[derive(Debug, Clone)]
pub struct DaemonConfig {
    /// Which processes.
    pub targets: TargetSpec,
    /// Dirty source.
    pub dirty: DirtyMode,
    /// Checksum for the gate.
    pub checksum: ChecksumKind,
    /// Which targets may share merged pages.
    pub domain: DomainPolicy,
    /// Where ksmd's sysfs files are.
    pub ksm_root: PathBuf,
    /// Where the settings found at take-over are kept until they are restored.
    pub ksm_state: PathBuf,
    /// Marking policy.
    pub policy: MergePolicy,
    /// How long ksmd should take to sweep the marked set.
    pub ksmd_sweep: Duration,
    /// ksmd's sleep between wake-ups while rksm owns it.
    pub ksmd_sleep_millisecs: u64,
    /// Restrict scanning to these `(pid, start, end)` ranges (tests).
    pub only_ranges: Vec<(u32, u64, u64)>,
}

impl Default for DaemonConfig {
    fn default() -> Self {
        DaemonConfig {
            targets: TargetSpec::default(),
            dirty: DirtyMode::Auto,
            checksum: ChecksumKind::Xxh64,
            domain: DomainPolicy::Uid,
            ksm_root: PathBuf::from(ksmd::KSM_SYSFS),
            ksm_state: PathBuf::from(ksmd::STATE_PATH),
            policy: MergePolicy::default(),
            ksmd_sweep: Duration::from_millis(500),
            ksmd_sleep_millisecs: 20,
            only_ranges: Vec::new(),
        }
    }
}

/// Errors starting the daemon.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// The target selection is wrong (the operator's input).
    #[error(transparent)]
    Targets(#[from] SelectionError),
    /// ksmd cannot be owned.
    #[error(transparent)]
    Ksmd(#[from] KsmdError),
    /// `--dirty ebpf` was asked for and the tracer does not load.
    #[error("--dirty ebpf needs the eBPF tracer: {0}")]
    Tracer(#[from] TracerError),
    /// /proc/kpageflags and friends.
    #[error(transparent)]
    Procfs(#[from] ProcfsError),
    /// Another rksm daemon owns ksmd.
    #[error("another rksm daemon is running (it holds {0}); two would fight over ksmd's settings")]
    Busy(PathBuf),
    /// The lock file could not be created.
    #[error("{path}: {source}")]
    Lock {
        /// The lock file.
        path: PathBuf,
        /// What failed.
        source: std::io::Error,
    },
}

/// Where the daemon's lock lives.
pub const LOCK_PATH: &str = "/run/rksm/daemon.lock";

/// Takes the daemon lock: one rksm daemon per host owns ksmd.
fn lock() -> Result<std::fs::File, DaemonError> {
    use std::os::fd::AsRawFd;
    let path = PathBuf::from(LOCK_PATH);
    let lock_err = |source| DaemonError::Lock {
        path: path.clone(),
        source,
    };
    std::fs::create_dir_all("/run/rksm").map_err(lock_err)?;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(lock_err)?;
    // SAFETY: flock on an fd we own.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        return Err(DaemonError::Busy(path));
    }
    Ok(file)
}

/// The counters the daemon reports (names follow /sys/kernel/mm/ksm).
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize)]
pub struct DaemonStats {
    /// KSM frames in the targets (last pass).
    pub pages_shared: u64,
    /// Further mappings of KSM frames in the targets (last pass): the memory saved.
    pub pages_sharing: u64,
    /// Marked pages ksmd found unique (ksmd's counter).
    pub pages_unshared: u64,
    /// Pages whose checksum changed since the previous pass (last pass).
    pub pages_volatile: u64,
    /// Passes completed.
    pub full_scans: u64,
    /// Pages read and checksummed, all passes.
    pub pages_hashed: u64,
    /// Pages the dirty source proved clean and were not read, all passes.
    pub pages_skipped_clean: u64,
    /// Time spent in checksums, all passes.
    pub checksum_ns: u64,
    /// Write faults the tracer saw in the targets.
    pub write_faults: u64,
    /// Write faults the tracer could not record.
    pub tracer_lost: u64,
    /// Writes the tracer saw on pages that were merged (copy-on-write breaks).
    pub cow_breaks: u64,
    /// System calls made inside targets (marking, arming).
    pub remote_syscalls: u64,
    /// Targets refused, by reason.
    pub targets_refused: BTreeMap<String, u64>,
    /// The dirty mode in use.
    pub dirty_mode: String,
    /// Regions currently backed off because their merged pages keep breaking.
    pub regions_backed_off: u64,
    /// Pages marked mergeable in the live targets.
    pub pages_marked: u64,
    /// The `run` value someone else wrote to ksmd while rksm owned it; rksm then stops
    /// pacing ksmd rather than fight them.
    pub ksmd_taken_back: Option<u64>,
}

/// What one pass did, for the one-line summary.
#[derive(Debug, Clone, Default)]
pub struct PassSummary {
    /// Targets scanned.
    pub targets: usize,
    /// Pages hashed this pass.
    pub pages_hashed: u64,
    /// Pages skipped as clean this pass.
    pub pages_skipped_clean: u64,
    /// Verified duplicates found this pass.
    pub duplicates: u64,
    /// Runs newly marked.
    pub runs_marked: u64,
    /// Copy-on-write breaks seen this pass.
    pub cow_breaks: u64,
    /// Wall time.
    pub seconds: f64,
}

impl fmt::Display for PassSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} targets, hashed {} skipped {} pages, {} duplicates, marked {} runs, {} cow breaks, {:.3} s",
            self.targets, self.pages_hashed, self.pages_skipped_clean, self.duplicates, self.runs_marked, self.cow_breaks, self.seconds
        )
    }
}

/// Per-region copy-on-write backoff: a 2 MiB region whose merged pages broke is not marked
/// again for a while, and the while doubles each time it happens again.
#[derive(Debug, Default)]
struct Backoff {
    regions: HashMap<(u32, u64), (u64, u64)>,
}

const REGION_SHIFT: u32 = 21;
const FIRST_BACKOFF_PASSES: u64 = 4;
const MAX_BACKOFF_PASSES: u64 = 256;

impl Backoff {
    /// Puts `region` of `pid` in backoff from pass `now`; returns true if it was not already.
    fn hit(&mut self, pid: u32, region: u64, now: u64) -> bool {
        let entry = self
            .regions
            .entry((pid, region))
            .or_insert((0, FIRST_BACKOFF_PASSES / 2));
        let fresh = entry.0 <= now;
        if fresh {
            entry.1 = (entry.1 * 2).min(MAX_BACKOFF_PASSES);
            entry.0 = now + entry.1;
        }
        fresh
    }

    fn blocks(&self, pid: u32, page: u64, now: u64) -> bool {
        self.regions
            .get(&(pid, page >> REGION_SHIFT))
            .is_some_and(|&(until, _)| until > now)
    }

    fn active(&self, now: u64) -> u64 {
        self.regions
            .values()
            .filter(|&&(until, _)| until > now)
            .count() as u64
    }

    fn forget(&mut self, pid: u32) {
        self.regions.retain(|&(p, _), _| p != pid);
    }
}

/// The running daemon.
pub struct Daemon {
    config: DaemonConfig,
    scanner: Scanner,
    marker: Marker,
    ksmd: KsmdOwner,
    hub: Option<Rc<RefCell<TracerHub>>>,
    processes: BTreeMap<u32, Process>,
    /// Processes refused for as long as they live.
    refused: BTreeMap<u32, String>,
    /// Targets left out of this pass (a passing reason to refuse them).
    skipped: HashSet<u32>,
    /// Refusals already counted, so each process counts once per reason.
    refusals_seen: HashSet<(u32, String)>,
    /// Pages mapped to KSM frames at the last pass, per process.
    merged: HashMap<u32, HashSet<u64>>,
    backoff: Backoff,
    stats: DaemonStats,
    marking_syscalls: u64,
    /// Each target's merge domain, numbered.
    domain_of: HashMap<u32, u32>,
    domain_ids: HashMap<String, u32>,
    /// Which domain a content (by checksum) is marked in: it is never marked in another, so
    /// ksmd cannot merge across domains. A checksum collision only makes this stricter.
    content_owner: HashMap<u64, u32>,
    /// Runs marked in each of the last few passes, newest last.
    recent_marks: std::collections::VecDeque<u64>,
    /// Per-target counters, for `rksm status`.
    per_target: BTreeMap<u32, TargetStatus>,
    started: SystemTime,
    last_pass: Option<LastPass>,
    _lock: std::fs::File,
}

impl Daemon {
    /// Resolves the targets, picks the dirty mode, and takes ksmd over.
    pub fn start(config: DaemonConfig) -> Result<Daemon, DaemonError> {
        let selection = config.targets.resolve()?;
        let lock = lock()?;
        let tracer = match Tracer::load(TracerConfig::default()) {
            Ok(tracer) => Some(tracer),
            Err(e) if config.dirty == DirtyMode::Ebpf => return Err(e.into()),
            Err(e) => {
                log::info!("eBPF tracer unavailable ({e}); no copy-on-write accounting");
                None
            }
        };
        let hub = tracer.map(TracerHub::new);
        let (mode, dirty): (DirtyMode, Box<dyn DirtySource>) = match (config.dirty, &hub) {
            (DirtyMode::HashOnly, _) => (DirtyMode::HashOnly, Box::new(HashOnly)),
            (DirtyMode::Pagemap, _) => (DirtyMode::Pagemap, Box::new(PagemapSource::default())),
            (DirtyMode::Ebpf | DirtyMode::Auto, Some(hub)) => {
                (DirtyMode::Ebpf, Box::new(EbpfSource::new(hub.clone())))
            }
            (DirtyMode::Auto, None) if crate::arming::supported() => {
                (DirtyMode::Pagemap, Box::new(PagemapSource::default()))
            }
            (DirtyMode::Ebpf | DirtyMode::Auto, None) => (DirtyMode::HashOnly, Box::new(HashOnly)),
        };
        if config.dirty == DirtyMode::Auto {
            log::info!("dirty mode: {mode} (chosen automatically)");
        }
        let scanner = Scanner::new(
            ScanConfig {
                checksum: config.checksum,
                only_ranges: config.only_ranges.clone(),
                collect_merge_candidates: true,
            },
            dirty,
        )?;
        let ksmd = KsmdOwner::take(
            &config.ksm_root,
            &config.ksm_state,
            ksmd::pace(
                0,
                config.ksmd_sweep.as_secs_f64(),
                config.ksmd_sleep_millisecs,
            ),
        )?;
        let mut daemon = Daemon {
            marker: Marker::new(config.policy),
            config,
            scanner,
            ksmd,
            hub,
            processes: BTreeMap::new(),
            refused: BTreeMap::new(),
            skipped: HashSet::new(),
            refusals_seen: HashSet::new(),
            merged: HashMap::new(),
            backoff: Backoff::default(),
            stats: DaemonStats {
                dirty_mode: mode.name().into(),
                ..DaemonStats::default()
            },
            marking_syscalls: 0,
            recent_marks: std::collections::VecDeque::new(),
            per_target: BTreeMap::new(),
            started: SystemTime::now(),
            last_pass: None,
            domain_of: HashMap::new(),
            domain_ids: HashMap::new(),
            content_owner: HashMap::new(),
            _lock: lock,
        };
        daemon.adopt(selection.processes);
        Ok(daemon)
    }

    /// The dirty mode in use.
    pub fn dirty_mode(&self) -> &str {
        &self.stats.dirty_mode
    }

    /// The counters so far.
    pub fn stats(&self) -> &DaemonStats {
        &self.stats
    }

    fn adopt(&mut self, processes: Vec<Process>) {
        for process in processes {
            let pid = process.pid();
            if self.processes.contains_key(&pid) || self.refused.contains_key(&pid) {
                continue;
            }
            let Some(domain) = self.config.domain.domain_of(pid) else {
                continue;
            };
            let next = self.domain_ids.len() as u32;
            let id = *self.domain_ids.entry(domain.clone()).or_insert(next);
            self.domain_of.insert(pid, id);
            self.scanner.set_domain(pid, id);
            if let Some(hub) = &self.hub {
                hub.borrow_mut().track(pid);
            }
            log::info!(
                pid, comm = process.comm(), domain = domain.as_str();
                "target pid {pid} ({}), merge domain {domain}",
                process.comm()
            );
            self.per_target.insert(
                pid,
                TargetStatus {
                    pid,
                    comm: process.comm().into(),
                    domain,
                    ..TargetStatus::default()
                },
            );
            self.processes.insert(pid, process);
        }
    }

    /// Counts a refusal once per process and reason.
    fn count_refusal(&mut self, pid: u32, reason: &str, why: &dyn fmt::Display) {
        if self.refusals_seen.insert((pid, reason.to_string())) {
            log::warn!("refusing pid {pid}: {why}");
            *self.stats.targets_refused.entry(reason.into()).or_default() += 1;
        }
    }

    /// Refuses `pid` for as long as it lives: it is never touched again.
    fn refuse(&mut self, pid: u32, reason: &str, why: &dyn fmt::Display) {
        self.count_refusal(pid, reason, why);
        self.refused.insert(pid, reason.into());
        self.drop_target(pid);
    }

    /// Refuses `pid` for `reason`, for good if the reason lasts, else for this pass only.
    fn refuse_remote(&mut self, pid: u32, reason: RemoteRefusal) {
        if reason.is_lasting() {
            self.refuse(pid, reason.as_str(), &reason);
        } else {
            self.count_refusal(pid, reason.as_str(), &reason);
            self.skipped.insert(pid);
        }
    }

    fn drop_target(&mut self, pid: u32) {
        self.processes.remove(&pid);
        self.domain_of.remove(&pid);
        self.per_target.remove(&pid);
        self.scanner.forget(pid);
        self.marker.forget(pid);
        self.merged.remove(&pid);
        self.backoff.forget(pid);
        if let Some(hub) = &self.hub {
            hub.borrow_mut().untrack(pid);
        }
    }

    /// Refreshes the targets: exited ones leave, new matches join, unborrowable ones are
    /// refused before anything is done to them.
    fn refresh_targets(&mut self) {
        let exited: Vec<u32> = self
            .processes
            .iter()
            .filter(|(_, p)| p.has_exited())
            .map(|(&pid, _)| pid)
            .collect();
        for pid in exited {
            log::info!("pid {pid} exited");
            self.drop_target(pid);
        }
        // A process that exec'd has a new address space: its arming, marks and checksums
        // describe one that no longer exists. It starts over, as a new target.
        let exec_d: Vec<u32> = self
            .processes
            .iter()
            .filter(|(_, p)| p.has_new_image())
            .map(|(&pid, _)| pid)
            .collect();
        for pid in exec_d {
            log::info!("pid {pid} executed a new program; starting over with it");
            self.drop_target(pid);
        }
        match self.config.targets.resolve_again() {
            Ok(selection) => {
                for (pid, _, reason) in &selection.refused {
                    if !self.refused.contains_key(pid) {
                        self.refuse(*pid, reason.as_str(), reason);
                    }
                }
                self.adopt(selection.processes);
            }
            Err(e) => log::warn!("refreshing targets: {e}"),
        }
        self.skipped.clear();
        let pids: Vec<u32> = self.processes.keys().copied().collect();
        for pid in pids {
            if let Err(RemoteError::Refused { reason, .. }) = remote::check_borrowable(pid) {
                self.refuse_remote(pid, reason);
            }
        }
        let alive = |pid: &u32| std::path::Path::new(&format!("/proc/{pid}")).exists();
        self.refused.retain(|pid, _| alive(pid));
        self.refusals_seen.retain(|(pid, _)| alive(pid));
    }

    /// Runs one pass.
    pub fn pass(&mut self) -> PassSummary {
        self.pass_with(&mut || {})
    }

    /// Runs one pass, calling `between_scan_and_mark` after the targets were read and before
    /// anything is marked in them: the widest window in which a target can exit, exec, fork
    /// or unmap under a pass. Tests use it to do exactly that.
    pub fn pass_with(&mut self, between_scan_and_mark: &mut dyn FnMut()) -> PassSummary {
        let started = Instant::now();
        self.refresh_targets();
        for &pid in self.processes.keys() {
            self.scanner.set_settled(pid, self.marker.marked(pid));
        }
        // A process skipped this pass (traced, stopped, in a disk wait) is not even read: its
        // pages could not be marked anyway.
        let targets: Vec<&Process> = self
            .processes
            .values()
            .filter(|p| !self.skipped.contains(&p.pid()))
            .collect();
        let report = self.scanner.pass_over(&targets, &mut |_| {});
        let now = self.stats.full_scans;
        let mut summary = PassSummary {
            targets: report.processes.len(),
            pages_hashed: report.total.pages_hashed,
            pages_skipped_clean: report.total.pages_skipped_clean,
            duplicates: report.total.duplicate_pages,
            ..PassSummary::default()
        };
        for &pid in &report.exited {
            self.drop_target(pid);
        }
        for (pid, why) in &report.failed {
            self.count_refusal(
                *pid,
                "unreadable",
                &format!("cannot read its memory: {why}"),
            );
        }
        between_scan_and_mark();
        summary.cow_breaks = self.account_cow_breaks(&report, now);
        summary.runs_marked = self.mark(&report, now);
        self.recent_marks.push_back(summary.runs_marked);
        if self.recent_marks.len() > 3 {
            self.recent_marks.pop_front();
        }
        self.update_stats(&report);
        summary.seconds = started.elapsed().as_secs_f64();
        self.last_pass = Some(LastPass {
            number: self.stats.full_scans,
            ended_unix: unix_time(SystemTime::now()),
            seconds: summary.seconds,
            targets: summary.targets,
            pages_hashed: summary.pages_hashed,
            pages_skipped_clean: summary.pages_skipped_clean,
            duplicates: summary.duplicates,
            runs_marked: summary.runs_marked,
        });
        summary
    }

    /// What `rksm status` shows: modes, counters, the last pass and every target. The
    /// kernel's own readings are left out: [`Status::read_live`] adds them when someone asks,
    /// so a pass does not pay for a file read per target that nobody may look at.
    pub fn status(&self) -> Status {
        Status {
            version: env!("CARGO_PKG_VERSION").into(),
            daemon_pid: std::process::id(),
            dirty_mode: self.stats.dirty_mode.clone(),
            checksum: self.config.checksum.to_string(),
            domain: self.config.domain.to_string(),
            started_unix: unix_time(self.started),
            last_pass: self.last_pass.clone(),
            counters: self.stats.clone(),
            general_profit: 0,
            targets: self.per_target.values().cloned().collect(),
        }
    }

    /// Counts writes the tracer saw on pages that were merged at the previous pass, and backs
    /// off the regions they happened in.
    fn account_cow_breaks(&mut self, report: &PassReport, now: u64) -> u64 {
        let mut breaks = 0;
        let mut backed_off: Vec<(u32, u64)> = Vec::new();
        for p in &report.processes {
            let written = match &self.hub {
                Some(hub) => hub.borrow_mut().pass_window(p.pid),
                None => HashSet::new(),
            };
            if let Some(merged) = self.merged.get(&p.pid) {
                let broken: Vec<u64> = written
                    .iter()
                    .copied()
                    .filter(|page| merged.contains(page))
                    .collect();
                breaks += broken.len() as u64;
                if let Some(t) = self.per_target.get_mut(&p.pid) {
                    t.cow_breaks += broken.len() as u64;
                }
                let regions: HashSet<u64> =
                    broken.iter().map(|page| page >> REGION_SHIFT).collect();
                for region in regions {
                    if self.backoff.hit(p.pid, region, now) {
                        backed_off.push((p.pid, region));
                    }
                }
            }
            let merged_now: HashSet<u64> = report
                .ksm_pages
                .get(&p.pid)
                .map(|v| v.iter().copied().collect())
                .unwrap_or_default();
            self.merged.insert(p.pid, merged_now);
        }
        // Backing off unmarks the region, so ksmd stops merging pages that do not stay merged.
        for (pid, region) in backed_off {
            let (start, end) = (region << REGION_SHIFT, (region + 1) << REGION_SHIFT);
            let runs = self.marker.marked_within(pid, start, end);
            let clipped: Vec<Run> = runs
                .iter()
                .map(|r| Run {
                    start: r.start.max(start),
                    end: r.end.min(end),
                })
                .collect();
            if let Some(process) = self.processes.get(&pid) {
                log::info!(
                    "pid {pid}: merged pages in {start:#x}-{end:#x} keep breaking; backing off"
                );
                match self.marker.unmark(process, &clipped) {
                    Ok(outcome) => self.marking_syscalls += outcome.remote_syscalls,
                    Err(e) => log::warn!("pid {pid}: unmarking a backed-off region: {e}"),
                }
            }
        }
        self.stats.cow_breaks += breaks;
        breaks
    }

    /// Marks the new duplicate runs of every target; returns how many runs were marked.
    fn mark(&mut self, report: &PassReport, now: u64) -> u64 {
        let mut runs_marked = 0;
        let mut refusals = Vec::new();
        // Contents already merged somewhere belong to that process's domain.
        for (pid, sums) in &report.ksm_checksums {
            if let Some(&domain) = self.domain_of.get(pid) {
                for &sum in sums {
                    self.content_owner.entry(sum).or_insert(domain);
                }
            }
        }
        let domains: HashSet<u32> = self.domain_of.values().copied().collect();
        let allow_gaps = domains.len() <= 1;
        // In pid order, so which domain first marks a content does not depend on hashing.
        let mut candidates: Vec<(&u32, &Vec<(u64, u64)>)> =
            report.merge_candidates.iter().collect();
        candidates.sort_unstable_by_key(|(pid, _)| **pid);
        for (&pid, pages) in candidates {
            let Some(process) = self.processes.get(&pid) else {
                continue;
            };
            let Some((vmas, vma_count)) = report.vmas.get(&pid) else {
                continue;
            };
            let Some(&domain) = self.domain_of.get(&pid) else {
                continue;
            };
            let mut mine = Vec::with_capacity(pages.len());
            for &(page, sum) in pages {
                if self.backoff.blocks(pid, page, now) {
                    continue;
                }
                // First domain to mark a content owns it.
                if *self.content_owner.entry(sum).or_insert(domain) == domain {
                    mine.push(page);
                }
            }
            let runs = self.marker.plan(pid, &mine, vmas, *vma_count, allow_gaps);
            match self.marker.mark(process, &runs) {
                Ok(outcome) => {
                    runs_marked += outcome.runs;
                    self.marking_syscalls += outcome.remote_syscalls;
                }
                Err(RemoteError::Refused { reason, .. }) => refusals.push((pid, reason)),
                // The next pass drops it, or starts over with its new program.
                Err(RemoteError::Gone(_) | RemoteError::NewImage(_)) => {}
                Err(e) => log::warn!("marking in pid {pid}: {e}"),
            }
        }
        for (pid, reason) in refusals {
            self.refuse_remote(pid, reason);
        }
        runs_marked
    }

    fn update_stats(&mut self, report: &PassReport) {
        let s = &mut self.stats;
        s.full_scans += 1;
        s.pages_shared = report.total.ksm_pages_shared;
        s.pages_sharing = report.total.ksm_pages_sharing;
        s.pages_volatile = report.total.volatile_pages;
        s.pages_hashed += report.total.pages_hashed;
        s.pages_skipped_clean += report.total.pages_skipped_clean;
        s.checksum_ns += report.total.checksum_ns;
        s.remote_syscalls = self.marking_syscalls + self.scanner.dirty_remote_syscalls();
        s.regions_backed_off = self.backoff.active(s.full_scans);
        s.pages_marked = self
            .processes
            .keys()
            .map(|&pid| self.marker.marked_pages(pid))
            .sum();
        for p in &report.processes {
            if let Some(t) = self.per_target.get_mut(&p.pid) {
                t.pages_shared = p.counts.ksm_pages_shared;
                t.pages_sharing = p.counts.ksm_pages_sharing;
                t.pages_volatile = p.counts.volatile_pages;
                t.pages_hashed += p.counts.pages_hashed;
                t.pages_skipped_clean += p.counts.pages_skipped_clean;
                t.pages_marked = self.marker.marked_pages(p.pid);
                if let Some(hub) = &self.hub {
                    t.write_faults = hub.borrow().counters(p.pid).0;
                }
            }
        }
        if let Ok(k) = ksmd::counters(&self.config.ksm_root) {
            s.pages_unshared = k.pages_unshared;
        }
        if let Some(hub) = &self.hub {
            let hub = hub.borrow();
            let (faults, lost) = self
                .processes
                .keys()
                .map(|&pid| hub.counters(pid))
                .fold((0, 0), |a, c| (a.0 + c.0, a.1 + c.1));
            s.write_faults = s.write_faults.max(faults);
            s.tracer_lost = s.tracer_lost.max(lost);
        }
        // While new runs were marked in the last passes, pace ksmd to sweep the marked set in
        // about `ksmd_sweep` (it needs two sweeps to merge a page); once nothing new is
        // marked, let it fall back to its default pace, which is enough to re-merge the odd
        // page and costs little.
        let busy = self.recent_marks.iter().sum::<u64>() > 0;
        let pages = if busy { s.pages_marked } else { 0 };
        let pace = ksmd::pace(
            pages,
            self.config.ksmd_sweep.as_secs_f64(),
            self.config.ksmd_sleep_millisecs,
        );
        if let Err(e) = self.ksmd.set(pace) {
            log::warn!("pacing ksmd: {e}");
        }
        s.ksmd_taken_back = self.ksmd.taken_back();
    }

    /// Waits until `deadline`, draining the tracer as records arrive; returns early (false)
    /// when one of `interrupts` becomes readable (a signalfd, a child's pidfd).
    pub fn wait(&mut self, deadline: Instant, interrupts: &[BorrowedFd<'_>]) -> bool {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return true;
            }
            let timeout =
                PollTimeout::try_from(left.min(Duration::from_secs(1))).unwrap_or(PollTimeout::MAX);
            let hub = self.hub.clone();
            let hub_ref = hub.as_ref().map(|h| h.borrow());
            let records = hub_ref.as_ref().map(|h| h.tracer().records_fd());
            let mut fds: Vec<PollFd<'_>> = interrupts
                .iter()
                .map(|&fd| PollFd::new(fd, PollFlags::POLLIN))
                .collect();
            if let Some(fd) = records {
                fds.push(PollFd::new(fd, PollFlags::POLLIN));
            }
            let _ = poll(&mut fds, timeout);
            let interrupted = fds[..interrupts.len()]
                .iter()
                .any(|fd| fd.revents().is_some_and(|r| !r.is_empty()));
            drop(fds);
            drop(hub_ref);
            if let Some(h) = &hub {
                h.borrow_mut().drain();
            }
            if interrupted {
                return false;
            }
        }
    }

    /// Stops: restores ksmd's settings and returns the final counters. Marked ranges stay
    /// marked and merged pages stay merged; the targets' userfaultfds close with rksm.
    pub fn finish(self) -> DaemonStats {
        let stats = self.stats.clone();
        if let Err(e) = self.ksmd.restore() {
            log::error!("restoring ksmd's settings: {e}");
        }
        stats
    }
}

/// Pages in MiB.
pub fn mib(pages: u64) -> f64 {
    (pages * PAGE_SIZE) as f64 / (1024.0 * 1024.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dirty_modes_parse_and_print() {
        for mode in [
            DirtyMode::Auto,
            DirtyMode::HashOnly,
            DirtyMode::Ebpf,
            DirtyMode::Pagemap,
        ] {
            assert_eq!(mode.name().parse::<DirtyMode>().unwrap(), mode);
        }
        let err = "soft-dirty".parse::<DirtyMode>().unwrap_err();
        assert!(err.to_string().contains("soft-dirty"));
    }

    #[test]
    fn backoff_grows_and_expires() {
        let mut backoff = Backoff::default();
        assert!(backoff.hit(1, 7, 0));
        assert!(backoff.blocks(1, 7 << REGION_SHIFT, 3));
        assert!(
            !backoff.blocks(1, 7 << REGION_SHIFT, 4),
            "first backoff is {FIRST_BACKOFF_PASSES} passes"
        );
        assert!(!backoff.hit(1, 7, 2), "already backed off");
        assert!(backoff.hit(1, 7, 10));
        assert!(
            backoff.blocks(1, 7 << REGION_SHIFT, 17),
            "second is twice as long"
        );
        assert!(!backoff.blocks(1, 7 << REGION_SHIFT, 18));
        assert!(!backoff.blocks(2, 7 << REGION_SHIFT, 11), "per process");
        assert_eq!(backoff.active(11), 1);
    }
}
