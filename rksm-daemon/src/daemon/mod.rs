//! The daemon: passes over live targets, marking verified duplicates for ksmd to merge.
//!
//! One pass is a short sequence of named steps ([`Daemon::pass_with`]): refresh the targets
//! (new processes matching the selection are adopted, exited ones dropped, ones that cannot
//! be borrowed refused with a reason), scan them (the dirty source arms and says what
//! changed; pages are read, checksummed and indexed), count copy-on-write breaks of merged
//! pages and back off regions that keep breaking, mark the new duplicate runs in each
//! target, account, and pace ksmd to the marked set. Merges are counted only when the kernel
//! shows them: pages the scan finds mapped to KSM frames (kpageflags) in the targets. Between
//! passes the tracer's ring is drained as records arrive.
//!
//! Everything about one process lives in its [`Target`] record, which the daemon owns and
//! lends to the scan and the marking; dropping the record drops all of it.
//!
//! Here: the configuration, start-up and the pass's sequence. Each step's work is a module:
//! `adoption` (which processes are targets), `marking`, `undo` (merges across domains,
//! undone), `pacing` (ksmd's sweeps), `wait` (between passes), `refusals`, `stats`.

mod adopted;
mod adoption;
mod backoff;
pub mod crossings;
pub mod domains;
mod marking;
pub mod outsiders;
mod pacing;
mod refusals;
mod stats;
mod undo;
mod wait;

use adopted::Adopted;
pub use pacing::DEFAULT_KSMD_MAX_DELAY;
use pacing::{KsmdWork, Pacing};
use refusals::Refusals;
pub use stats::{mib, unix_time, DaemonStats, PassSummary};

use std::{
    collections::{BTreeMap, HashSet},
    path::PathBuf,
    time::{Duration, Instant, SystemTime},
};

use rksm_common::PAGE;
use serde::{Deserialize, Serialize};

use self::domains::Domains;
pub use self::domains::{DomainPolicy, OutsiderPolicy, SeveralDomains};
use crate::ebpf::sampler::Sampler;
use crate::{
    ebpf::{
        guard,
        marks::MarkWatch,
        recorder::Recorder,
        tracer::{Tracer, TracerConfig, TracerError},
        waits,
    },
    engine::{
        checksum::ChecksumKind,
        dirty::{
            protection::{NotOffered, Offer, WriteProtectChoice},
            DirtySource, EbpfSource, HashOnly, Lent, PagemapSource, DEFAULT_AUDIT_PASSES,
        },
        heap::FreedMemory,
        merge::{Marker, MergePolicy},
        scan::{PassReport, ScanConfig, Scanner},
        target::Target,
        targets::{SelectionError, TargetSpec},
    },
    kernel::{
        ksmd::{self, KsmdError, KsmdOwner},
        limits, oom,
        process::ProcessId,
        procfs::{self, ProcfsError},
        remote::Borrower,
    },
};

/// How often, at most, running out of file descriptors is warned about while it lasts.
const SHORT_OF_FILES_WARN_EVERY: Duration = Duration::from_secs(60);

/// How often, at most, the daemon drains the tracer's ring between passes.
pub const DRAIN_EVERY: Duration = Duration::from_millis(50);

pub use crate::engine::dirty::DirtyMode;

/// How the ebpf mode takes up memory it has not seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NewPages {
    /// Sample each new page in the kernel (a few bytes, through the direct map) and read
    /// whole only those whose sample meets another page's; read them all where the sampler
    /// cannot load.
    #[default]
    Sample,
    /// Read every new page whole.
    Read,
}

crate::value_enum_text!(NewPages => "new-page policy");

/// Everything the daemon is told.
#[derive(Debug, Clone)]
pub struct DaemonConfig {
    /// Which processes.
    pub targets: TargetSpec,
    /// Dirty source.
    pub dirty: DirtyMode,
    /// Which write-protect sources the dirty modes may use.
    pub write_protect: WriteProtectChoice,
    /// ebpf mode: how new memory is taken up.
    pub new_pages: NewPages,
    /// Checksum for the gate.
    pub checksum: ChecksumKind,
    /// Which targets may share merged pages.
    pub domain: DomainPolicy,
    /// Whether the targets may span more than one merge domain.
    pub several_domains: SeveralDomains,
    /// What to do about processes outside the targets, of another domain, that mark their own
    /// memory mergeable.
    pub outsiders: OutsiderPolicy,
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
    /// After convergence, how long a trickle of new duplicates (fewer than 1/64 of the marked
    /// pages) may wait before ksmd is set going for it.
    pub ksmd_max_delay: Duration,
    /// Restrict scanning to these `(pid, start, end)` ranges (tests).
    pub only_ranges: Vec<(u32, u64, u64)>,
    /// ebpf mode: passes over which every armed page is audited once.
    pub audit_passes: u32,
}

impl Default for DaemonConfig {
    fn default() -> Self {
        DaemonConfig {
            targets: TargetSpec::default(),
            dirty: DirtyMode::Auto,
            write_protect: WriteProtectChoice::Auto,
            new_pages: NewPages::Sample,
            checksum: ChecksumKind::Xxh64,
            domain: DomainPolicy::Uid,
            several_domains: SeveralDomains::Refuse,
            outsiders: OutsiderPolicy::Refuse,
            ksm_root: PathBuf::from(ksmd::KSM_SYSFS),
            ksm_state: PathBuf::from(ksmd::STATE_PATH),
            policy: MergePolicy::default(),
            ksmd_sweep: Duration::from_millis(500),
            ksmd_sleep_millisecs: 20,
            ksmd_max_delay: DEFAULT_KSMD_MAX_DELAY,
            only_ranges: Vec::new(),
            audit_passes: DEFAULT_AUDIT_PASSES,
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
    /// A write-protect source was asked for that this kernel does not have.
    #[error(transparent)]
    NotOffered(#[from] NotOffered),
    /// A dirty-bit mode was asked for on a kernel that offers no write protection.
    #[error("--dirty {mode} needs write protection, and {why}; use --dirty hash-only")]
    NoWriteProtect {
        /// The mode asked for.
        mode: DirtyMode,
        /// What the kernel lacks.
        why: String,
    },
    /// /proc/kpageflags and friends.
    #[error(transparent)]
    Procfs(#[from] ProcfsError),
    /// The targets span several merge domains, and that was not allowed.
    #[error("the targets span {} merge domains: {}; over one ksmd each could learn whether another holds a page it guesses (docs/security.md); select one domain's processes, use --domain none if they may share pages, or allow it with --several-domains allow", .0.len(), .0.join("; "))]
    SeveralDomains(Vec<String>),
    /// Processes outside the targets could probe other domains' pages through ksmd.
    #[error("processes outside the targets mark their memory mergeable in another merge domain, so ksmd would merge their pages with the targets' and they could probe every page rksm marks: {}; target them too, use one domain (--domain none), or start anyway with --outsiders warn", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join(", "))]
    MergeableOutsiders(Vec<outsiders::Outsider>),
}

/// The running daemon.
pub struct Daemon {
    config: DaemonConfig,
    scanner: Scanner,
    marker: Marker,
    ksmd: KsmdOwner,
    /// The tracer's records, where it is loaded: the daemon drains them between passes and
    /// lends them to the dirty source for each target's call.
    recorder: Option<Recorder>,
    /// The targets, by pid: one record each, the only place anything about them is kept.
    targets: BTreeMap<u32, Adopted>,
    refusals: Refusals,
    domains: Domains,
    stats: DaemonStats,
    marking_syscalls: u64,
    /// The heap memory freed, to hand back after a pass.
    freed: FreedMemory,
    /// A pass was cut short by [`Daemon::stop_on`]'s signal.
    stopping: bool,
    /// Outsiders already warned about.
    outsiders_seen: HashSet<ProcessId>,
    /// When running out of file descriptors was last warned about.
    warned_short_of_files: Option<Instant>,
    /// Outsiders of another domain with mergeable memory, as of this pass.
    outsiders: Vec<outsiders::Outsider>,
    /// What the looks for them remember from one pass to the next.
    outsider_looks: outsiders::OutsiderLooks,
    /// What the last look for frames across domains was taken over.
    crossings_looked_at: Option<crossings::Inputs>,
    /// Targets whose own marks crossed domains, warned about once.
    self_marked_warned: HashSet<ProcessId>,
    /// More than one merge domain among the targets and the mergeable outsiders.
    several_domains: bool,
    /// The checksum of a page of zeros.
    zero_checksum: u64,
    /// Who asked to make memory mergeable between two looks for outsiders.
    marks: Option<MarkWatch>,
    /// A selection by name alone was found to span several users, and said so.
    warned_name_only: bool,
    /// Every thread the daemon borrows (to arm and to mark) is borrowed from here: it counts
    /// the borrows, and keeps the threads given up until they can be let go.
    borrower: Borrower,
    /// The guard's handovers when the daemon started: its own are the difference.
    handovers_at_start: u64,
    /// When ksmd sweeps and when it rests.
    ksmd_pacing: Pacing,
    started: SystemTime,
    last_pass: Option<PassSummary>,
}

impl Daemon {
    /// Resolves the targets, picks the dirty mode, and takes ksmd over (with the host's
    /// one-daemon lock, which [`KsmdOwner`] holds for as long as it owns ksmd).
    pub fn start(config: DaemonConfig) -> Result<Daemon, DaemonError> {
        crate::engine::heap::one_arena();
        if let Err(e) = oom::init() {
            log::warn!("/proc/self/oom_score_adj: {e}");
        }
        match limits::raise_open_files() {
            Ok(limit) if limit.now > limit.was => log::info!(
                "open files: soft limit raised from {} to the hard limit, {}",
                limit.was,
                limit.now
            ),
            Ok(_) => {}
            Err(e) => log::warn!("open files: the soft limit could not be raised: {e}"),
        }
        // Every eBPF part is loaded from one object, let go after start-up.
        let mut object = crate::ebpf::Object::new();
        // The tracer's files first: the targets' must not leave it none.
        let tracer = match Tracer::load(TracerConfig::default(), &mut object) {
            Ok(tracer) => Some(tracer),
            Err(e) if config.dirty == DirtyMode::Ebpf => return Err(e.into()),
            Err(e) => {
                log::info!("eBPF tracer unavailable ({e}); no copy-on-write accounting");
                None
            }
        };
        let selection = config.targets.resolve()?;
        let ksmd = KsmdOwner::take(
            &config.ksm_root,
            &config.ksm_state,
            ksmd::pace(
                0,
                config.ksmd_sweep.as_secs_f64(),
                config.ksmd_sleep_millisecs,
            ),
        )?;
        let recorder = tracer.map(Recorder::new);
        let offer = Offer::probe(config.write_protect);
        offer.check()?;
        let no_protection = |mode| DaemonError::NoWriteProtect {
            mode,
            why: offer.why_none(),
        };
        let (mode, dirty): (DirtyMode, Box<dyn DirtySource>) = match (config.dirty, &recorder) {
            (DirtyMode::HashOnly, _) => (DirtyMode::HashOnly, Box::new(HashOnly)),
            (mode @ (DirtyMode::Pagemap | DirtyMode::Ebpf), _) if !offer.any() => {
                return Err(no_protection(mode))
            }
            (DirtyMode::Pagemap, _) => (DirtyMode::Pagemap, Box::new(PagemapSource::new(offer))),
            (DirtyMode::Auto, _) if !offer.any() => {
                log::info!(
                    "no dirty bit on this kernel ({}): hashing every page every pass",
                    offer.why_none()
                );
                (DirtyMode::HashOnly, Box::new(HashOnly))
            }
            (DirtyMode::Ebpf | DirtyMode::Auto, Some(_)) => (
                DirtyMode::Ebpf,
                Box::new(EbpfSource::new(config.audit_passes, offer)),
            ),
            (DirtyMode::Auto, None) => (DirtyMode::Pagemap, Box::new(PagemapSource::new(offer))),
            (DirtyMode::Ebpf, None) => unreachable!("a tracer that does not load is an error"),
        };
        if config.dirty == DirtyMode::Auto {
            log::info!("dirty mode: {mode} (chosen automatically)");
        }
        if let Err(e) = waits::install(&mut object) {
            log::info!(
                "no wait watch ({e}): a timed epoll_wait a borrow interrupts returns EINTR (counted in eintr_risk)"
            );
        }
        if mode != DirtyMode::HashOnly && offer.userfaultfd_allowed() {
            if let Err(e) = guard::install(&mut object) {
                log::warn!(
                    "a target that takes up userfaultfd itself while rksm write-protects it with one may see EBUSY: {e}"
                );
            }
        }
        if !procfs::ksm_flag_reliable() {
            log::warn!(
                "this kernel marks every anonymous page KSM in /proc/kpageflags (a kernel bug): rksm counts a frame as merged only when it is mapped more than once, so frames shared by fork count as merged too"
            );
        }
        if mode != DirtyMode::HashOnly {
            log::info!(
                "write protection this kernel offers: userfaultfd {}, soft-dirty {}",
                if offer.userfaultfd {
                    "yes"
                } else {
                    "no (Linux 6.7+)"
                },
                if offer.soft_dirty {
                    "yes"
                } else {
                    "no (CONFIG_MEM_SOFT_DIRTY)"
                },
            );
        }
        let mut scanner = Scanner::new(
            ScanConfig {
                checksum: config.checksum,
                only_ranges: config.only_ranges.clone(),
                collect_merge_candidates: true,
                report_top: false,
            },
            dirty,
        )?;
        if mode == DirtyMode::Ebpf && config.new_pages == NewPages::Sample {
            match Sampler::load(&mut object) {
                Ok(sampler) => scanner.sample_with(sampler),
                Err(e) => log::info!("new pages are read whole: no sampler ({e})"),
            }
        }
        let zero_checksum = config.checksum.checksum(&[0; PAGE]);
        let marks = match config.domain {
            DomainPolicy::None => None,
            _ => MarkWatch::load(&mut object)
                .inspect_err(|e| {
                    log::info!(
                        "no mark watch ({e}): a process that marks its memory mergeable and unmarks it again between two passes is not seen"
                    )
                })
                .ok(),
        };
        let new_pages = match scanner.samples() {
            true => NewPages::Sample,
            false => NewPages::Read,
        };
        let several = config.several_domains;
        let mut daemon = Daemon {
            marker: Marker::new(config.policy),
            config,
            scanner,
            ksmd,
            recorder,
            targets: BTreeMap::new(),
            refusals: Refusals::default(),
            domains: Domains::new(several),
            stats: DaemonStats {
                dirty_mode: mode,
                new_pages,
                ..DaemonStats::default()
            },
            marking_syscalls: 0,
            freed: FreedMemory::default(),
            borrower: Borrower::new(),
            handovers_at_start: guard::installed().map_or(0, |g| g.given_up()),
            stopping: false,
            outsiders_seen: HashSet::new(),
            warned_short_of_files: None,
            outsiders: Vec::new(),
            outsider_looks: outsiders::OutsiderLooks::default(),
            crossings_looked_at: None,
            self_marked_warned: HashSet::new(),
            several_domains: false,
            zero_checksum,
            marks,
            warned_name_only: false,
            ksmd_pacing: Pacing::default(),
            started: SystemTime::now(),
            last_pass: None,
        };
        daemon.adopt(selection.processes, true);
        if daemon.domains.count() > 1 && daemon.config.several_domains == SeveralDomains::Refuse {
            return Err(DaemonError::SeveralDomains(daemon.domains_with_pids()));
        }
        let outsiders = daemon.new_outsiders();
        if !outsiders.is_empty() && daemon.config.outsiders == OutsiderPolicy::Refuse {
            return Err(DaemonError::MergeableOutsiders(outsiders));
        }
        daemon.warn_about(&outsiders);
        Ok(daemon)
    }

    /// The dirty mode in use.
    pub fn dirty_mode(&self) -> DirtyMode {
        self.stats.dirty_mode
    }

    /// The counters so far.
    pub fn stats(&self) -> &DaemonStats {
        &self.stats
    }

    /// What the daemon was told.
    pub fn config(&self) -> &DaemonConfig {
        &self.config
    }

    /// The current targets, by pid.
    pub fn targets(&self) -> impl Iterator<Item = &Target> {
        self.targets.values().map(|t| &**t)
    }

    /// The last pass, once there was one.
    pub fn last_pass(&self) -> Option<&PassSummary> {
        self.last_pass.as_ref()
    }

    /// When the daemon started.
    pub fn started(&self) -> SystemTime {
        self.started
    }

    /// Merge domains with targets in them, and contents owned by one of them.
    pub fn domain_counts(&self) -> (usize, usize) {
        (self.domains.count(), self.domains.owned_contents())
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
        let now = self.stats.full_scans;
        self.refresh_targets();
        let report = self.scan();
        if report.stopped {
            // SIGTERM or SIGINT mid-pass: nothing more is started, the daemon stops.
            self.stopping = true;
            return PassSummary {
                number: self.stats.full_scans,
                ended_unix: unix_time(SystemTime::now()),
                seconds: started.elapsed().as_secs_f64(),
                ..PassSummary::default()
            };
        }
        self.drop_lost(&report);
        between_scan_and_mark();
        let cow_breaks = self.account_cow_breaks(&report, now);
        self.undo_crossings();
        let (runs_marked, pages_marked) = self.mark(now);
        // Whatever this pass built and dropped (batches, the marking's lists, what ksmd's
        // merges changed) does not stay resident.
        self.freed.give_back_if_grown();
        let sharing_before = self.stats.pages_sharing;
        self.account(&report);
        // Work for ksmd: pages newly marked, duplicates newly found (in marked runs too: a page
        // whose merge broke and that is a duplicate again), and, while it sweeps, ksmd still
        // merging.
        let work = KsmdWork {
            new: pages_marked + report.total.duplicate_pages,
            merged: self.stats.pages_sharing.saturating_sub(sharing_before),
        };
        self.pace_ksmd(work);
        let summary = PassSummary {
            number: self.stats.full_scans,
            ended_unix: unix_time(SystemTime::now()),
            seconds: started.elapsed().as_secs_f64(),
            targets: report.processes.len(),
            pages_hashed: report.total.pages_hashed,
            pages_skipped_clean: report.total.pages_skipped_clean,
            pagemap_pages: report.total.pagemap_pages,
            kpageflags_reads: report.total.kpageflags_reads,
            written_bits_read: report.total.written_bits_read,
            duplicates: report.total.duplicate_pages,
            runs_marked,
            cow_breaks,
        };
        if summary.number == 1 {
            self.stats.first_pass_seconds = summary.seconds;
            self.stats.first_pass_cpu_seconds = procfs::own_cpu_seconds();
            // Pages taken up: read whole, or only sampled.
            self.stats.first_pass_pages = summary.pages_hashed + report.total.pages_only_sampled;
        }
        self.last_pass = Some(summary.clone());
        summary
    }

    /// Step 2: reads, checksums and indexes every target not sitting this pass out. A target
    /// skipped (traced, stopped, in a disk wait) keeps its arming and checksums: its pages
    /// could not be marked anyway, and the next pass takes it up where it was.
    fn scan(&mut self) -> PassReport {
        let mut targets: Vec<&mut Target> = self
            .targets
            .values_mut()
            .filter(|t| !t.skipped())
            .map(|t| &mut **t)
            .collect();
        let mut lent = Lent {
            borrower: &self.borrower,
            recorder: self.recorder.as_mut(),
        };
        self.scanner.pass_over(&mut targets, &mut lent, &mut |_| {})
    }

    /// Step 3: targets that exited during the scan are dropped; unreadable ones counted. One
    /// whose read failed half-way has had its checksums forgotten by the scan (it is read in
    /// full next time); one whose maps could not be read was not protected either, so, like a
    /// skipped target, it keeps them.
    fn drop_lost(&mut self, report: &PassReport) {
        for &pid in &report.exited {
            self.drop_target(pid);
        }
        for (pid, why) in &report.failed {
            if let Some(id) = self.targets.get(pid).map(|t| t.id()) {
                self.count_refusal(id, "unreadable", &format!("cannot read its memory: {why}"));
            }
        }
        for &(pid, reason) in &report.refused {
            self.refuse_remote(pid, reason);
        }
        if !report.short_of_files.is_empty() {
            self.short_of_files(report.short_of_files.len(), "target(s) not read");
        }
        let unprotected = self
            .targets
            .values_mut()
            .map(|t| t.dirty_mut().take_short_of_files())
            .filter(|&short| short)
            .count();
        if unprotected > 0 {
            self.short_of_files(
                unprotected,
                "target(s) not write-protected (hashed in full)",
            );
        }
    }

    /// Step 6: the daemon's and each target's counters.
    fn account(&mut self, report: &PassReport) {
        let s = &mut self.stats;
        s.full_scans += 1;
        s.pages_volatile = report.total.volatile_pages;
        s.pages_hashed += report.total.pages_hashed;
        s.pages_skipped_clean += report.total.pages_skipped_clean;
        s.pages_sampled += report.total.pages_sampled;
        s.pages_only_sampled += report.total.pages_only_sampled;
        s.checksum_ns += report.total.checksum_ns;
        s.pages_twinned += report.total.pages_twinned;
        s.remote_syscalls = self.marking_syscalls + self.scanner.dirty_remote_syscalls();
        let borrowing = self.borrower.counters();
        s.eintr_risk = borrowing.eintr_risk;
        s.borrows = borrowing.borrows;
        s.rseq_aborts = borrowing.rseq_aborts;
        s.timed_restarts = borrowing.timed_restarts;
        s.userfaultfd_handovers =
            guard::installed().map_or(0, |g| g.given_up()) - self.handovers_at_start;
        s.regions_backed_off = self
            .targets
            .values()
            .map(|t| t.backoff().active(s.full_scans))
            .sum();
        s.pages_marked = self.targets.values().map(|t| t.marked().pages()).sum();
        s.write_protect.clear();
        for t in self.targets.values_mut() {
            *s.write_protect
                .entry(t.write_protect().0.to_string())
                .or_default() += 1;
            // The daemon's totals grow by what each target's grew since the last pass.
            let (clears, ns, races) = t.count_soft_dirty_clears();
            s.soft_dirty_clears += clears;
            s.soft_dirty_clear_seconds += ns as f64 / 1e9;
            s.soft_dirty_clear_races += races;
        }
        for p in &report.processes {
            if let Some(t) = self.targets.get_mut(&p.pid) {
                let c = &p.counts;
                t.count_pass(c.volatile_pages, c.pages_hashed, c.pages_skipped_clean);
            }
        }
        // The kernel's counts: a pass no longer looks at every merged page to count them.
        if let Ok(k) = ksmd::counters(&self.config.ksm_root) {
            s.pages_shared = k.pages_shared;
            s.pages_sharing = k.pages_sharing;
            s.pages_unshared = k.pages_unshared;
        }
        // One map lookup per target: its own count, and the daemon-wide sums.
        if let Some(recorder) = &self.recorder {
            let (mut faults, mut lost) = (0, 0);
            for t in self.targets.values_mut() {
                let (f, l) = recorder.counters(t.pid());
                t.count_write_faults(f);
                (faults, lost) = (faults + f, lost + l);
            }
            s.write_faults = s.write_faults.max(faults);
            s.tracer_lost = s.tracer_lost.max(lost);
        }
    }

    /// Stops: restores ksmd's settings and returns the final counters. Marked ranges stay
    /// marked and merged pages stay merged; the targets' userfaultfds close with rksm.
    pub fn finish(self) -> DaemonStats {
        // Threads given up for missing a deadline are let go only by rksm: wait for them,
        // bounded, before leaving (the kernel would let them go as they are).
        let deadline = Instant::now() + LINGER_AT_EXIT;
        while self.borrower.reap_lingering() > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        match self.borrower.reap_lingering() {
            0 => {}
            n => log::error!(
                "{n} borrowed thread(s) did not stop within {LINGER_AT_EXIT:?} of stopping: they resume as the kernel leaves them when rksm exits"
            ),
        }
        let stats = self.stats.clone();
        if let Err(e) = self.ksmd.restore() {
            log::error!("restoring ksmd's settings: {e}");
        }
        stats
    }
}

/// How long stopping waits for threads given up for missing a deadline (a call may take
/// [`remote::CALL_DEADLINE`]; past that, something holds the thread in the kernel).
pub const LINGER_AT_EXIT: Duration = Duration::from_secs(10);

#[cfg(test)]
mod tests {
    use clap::ValueEnum;

    use super::*;

    #[test]
    fn dirty_modes_parse_and_print() {
        for mode in DirtyMode::value_variants() {
            assert_eq!(mode.to_string().parse::<DirtyMode>().unwrap(), *mode);
        }
        assert_eq!(DirtyMode::HashOnly.to_string(), "hash-only");
        let err = "soft-dirty".parse::<DirtyMode>().unwrap_err();
        assert_eq!(
            err,
            "unknown dirty mode `soft-dirty` (expected auto, hash-only, ebpf, pagemap)"
        );
    }
}
