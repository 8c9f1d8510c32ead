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

pub mod crossings;
pub mod domains;

use std::{
    cell::RefCell,
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    fmt,
    os::fd::BorrowedFd,
    path::PathBuf,
    rc::Rc,
    time::{Duration, Instant, SystemTime},
};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use rksm_common::{PAGE, PAGE_SIZE};
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
        checksum::{ChecksumKind, NO_CHECKSUM},
        dirty::{
            protection::{NotOffered, Offer, WriteProtectChoice},
            DirtySource, EbpfSource, HashOnly, PagemapSource, DEFAULT_AUDIT_PASSES,
        },
        merge::{Marker, MergePolicy, Run, REGION_SHIFT},
        scan::{PassReport, ScanConfig, Scanner},
        target::Target,
        targets::{SelectionError, TargetSpec},
    },
    kernel::{
        ksmd::{self, KsmdError, KsmdOwner},
        limits, oom,
        process::{Process, ProcessId},
        procfs::{self, ProcfsError},
        ranges::{page_runs, Range},
        reader::ProcMem,
        remote::{self, RemoteError, RemoteRefusal},
    },
};

/// How often, at most, running out of file descriptors is warned about while it lasts.
const SHORT_OF_FILES_WARN_EVERY: Duration = Duration::from_secs(60);

/// A pass that found this many duplicates gives the heap its marking freed back.
const RELEASE_AFTER_DUPLICATES: u64 = 32 * 1024;

/// How often, at most, the daemon drains the tracer's ring between passes.
pub const DRAIN_EVERY: Duration = Duration::from_millis(100);

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
    MergeableOutsiders(Vec<domains::Outsider>),
}

/// The counters the daemon reports (names follow /sys/kernel/mm/ksm).
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize)]
pub struct DaemonStats {
    /// KSM frames (ksmd's counter: every process's mergeable memory, not only the targets').
    pub pages_shared: u64,
    /// Further mappings of KSM frames, the memory saved (ksmd's counter, likewise).
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
    /// New pages sampled in the kernel instead of read, all passes.
    pub pages_sampled: u64,
    /// Of those, pages whose digest met no other page's: never read (until written).
    pub pages_only_sampled: u64,
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
    /// Borrows that may have made a target see EINTR: its thread was asleep in a call the
    /// kernel does not restart, and rksm could not restart it either.
    #[serde(default)]
    pub eintr_risk: u64,
    /// Threads of targets borrowed (stopped for remote system calls and let go).
    #[serde(default)]
    pub borrows: u64,
    /// Borrowed threads found inside an rseq critical section, sent to its abort handler as
    /// the kernel would have sent them.
    #[serde(default)]
    pub rseq_aborts: u64,
    /// Timed waits (`epoll_wait`) a borrow interrupted that were entered again with the time
    /// they had left, rather than return EINTR.
    #[serde(default)]
    pub timed_restarts: u64,
    /// Targets that took up userfaultfd themselves while rksm write-protected them with one:
    /// rksm gave its own up before their registration.
    #[serde(default)]
    pub userfaultfd_handovers: u64,
    /// Targets whose merge domain changed (setuid, a cgroup move), unmarked and placed again.
    #[serde(default)]
    pub domain_changes: u64,
    /// Processes outside the targets, of another domain, seen marking memory mergeable.
    #[serde(default)]
    pub mergeable_outsiders: u64,
    /// KSM frames found mapped in more than one merge domain (each time one is found).
    #[serde(default)]
    pub cross_domain_merges: u64,
    /// Pages of targets unmarked (and so unmerged) because their frame crossed domains.
    #[serde(default)]
    pub cross_domain_unmarked: u64,
    /// Looks for frames mapped in more than one domain, and the time they took.
    #[serde(default)]
    pub cross_domain_checks: u64,
    /// Time spent looking, all looks.
    #[serde(default)]
    pub cross_domain_check_ns: u64,
    /// Targets refused, by reason.
    pub targets_refused: BTreeMap<String, u64>,
    /// Processes and targets left for a pass because rksm had no file descriptor left
    /// (EMFILE, ENFILE); each is taken up again the next pass.
    #[serde(default)]
    pub short_of_files: u64,
    /// The dirty mode in use.
    pub dirty_mode: DirtyMode,
    /// How new pages are taken up: `sample` (the sampler loaded) or `read`.
    #[serde(default)]
    pub new_pages: NewPages,
    /// Current targets by write-protect source (`userfaultfd`, `soft-dirty`, `none`).
    #[serde(default)]
    pub write_protect: BTreeMap<String, u64>,
    /// Clears of targets' soft-dirty bits (each write-protects a whole address space).
    #[serde(default)]
    pub soft_dirty_clears: u64,
    /// Time the kernel took for them.
    #[serde(default)]
    pub soft_dirty_clear_seconds: f64,
    /// Passes over a target (pagemap mode, soft-dirty) that read it whole because one of its
    /// faults raced with a clear the tracer could not vouch for.
    #[serde(default)]
    pub soft_dirty_clear_races: u64,
    /// Regions currently backed off because their merged pages keep breaking.
    pub regions_backed_off: u64,
    /// Pages marked mergeable in the live targets.
    pub pages_marked: u64,
    /// How long the first pass took and how many pages it read: the pass that reads every
    /// page, whose speed is compared with the memory's.
    #[serde(default)]
    pub first_pass_seconds: f64,
    /// Pages the first pass took up: read whole, or sampled and left unread.
    #[serde(default)]
    pub first_pass_pages: u64,
    /// The `run` value someone else wrote to ksmd while rksm owned it; rksm then stops
    /// pacing ksmd rather than fight them.
    pub ksmd_taken_back: Option<u64>,
}

/// What one pass did: the one-line summary, and the status's last pass.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PassSummary {
    /// Its number (1 for the first).
    pub number: u64,
    /// When it ended (seconds since the Unix epoch).
    pub ended_unix: f64,
    /// Wall time.
    pub seconds: f64,
    /// Targets scanned.
    pub targets: usize,
    /// Pages hashed this pass.
    pub pages_hashed: u64,
    /// Pages skipped as clean this pass.
    pub pages_skipped_clean: u64,
    /// Pagemap entries read this pass (a steady pass reads only the written pages').
    #[serde(default)]
    pub pagemap_pages: u64,
    /// /proc/kpageflags reads this pass.
    #[serde(default)]
    pub kpageflags_reads: u64,
    /// Pages whose written bit the dirty source looked at this pass (PAGEMAP_SCAN's walk,
    /// or soft-dirty bits read one pagemap entry each).
    #[serde(default)]
    pub written_bits_read: u64,
    /// Verified duplicates found this pass.
    pub duplicates: u64,
    /// Runs newly marked.
    pub runs_marked: u64,
    /// Copy-on-write breaks seen this pass.
    pub cow_breaks: u64,
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

/// Seconds since the Unix epoch, as the status reports times.
pub fn unix_time(t: SystemTime) -> f64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Processes refused, by identity (pid and start time), so a later process that reuses a
/// pid inherits nothing.
#[derive(Debug, Default)]
struct Refusals {
    /// Refused for as long as they live: never touched again.
    lasting: HashMap<ProcessId, String>,
    /// Refusals already counted, so each process counts once per reason.
    counted: HashSet<(ProcessId, String)>,
}

impl Refusals {
    fn lasting(&self, id: ProcessId) -> bool {
        self.lasting.contains_key(&id)
    }

    /// Forgets processes that have exited (whatever now has their pid is someone else).
    fn prune(&mut self) {
        let alive = |id: &ProcessId| ProcessId::of(id.pid) == Some(*id);
        self.lasting.retain(|id, _| alive(id));
        self.counted.retain(|(id, _)| alive(id));
    }
}

/// How long a trickle of steady-state work may wait for ksmd by default: three sweeps a
/// minute at most, against twelve for ksmd tuned to sweep everything in 5 s.
pub const DEFAULT_KSMD_MAX_DELAY: Duration = Duration::from_secs(60);

/// What a pass found for ksmd to do.
#[derive(Debug, Clone, Copy)]
struct KsmdWork {
    /// Runs newly marked and duplicates newly found.
    new: u64,
    /// How much ksmd's `pages_sharing` grew during the pass.
    merged: u64,
}

/// Work waiting for ksmd's next batch of sweeps.
#[derive(Debug, Default)]
struct KsmdBacklog {
    pages: u64,
    since: Option<Instant>,
}

impl KsmdBacklog {
    /// Adds `work` found at `now`; returns the backlog.
    fn add(&mut self, work: u64, now: Instant) -> u64 {
        if work > 0 {
            self.pages += work;
            self.since.get_or_insert(now);
        }
        self.pages
    }

    /// True if work has waited `delay` or longer.
    fn waited(&self, delay: Duration) -> bool {
        self.since.is_some_and(|t| t.elapsed() >= delay)
    }
}

/// The running daemon.
pub struct Daemon {
    config: DaemonConfig,
    scanner: Scanner,
    marker: Marker,
    ksmd: KsmdOwner,
    recorder: Option<Rc<RefCell<Recorder>>>,
    /// The dirty source takes the tracer's records itself (ebpf mode): the copy-on-write
    /// accounting then only reads the window those takes fill.
    dirty_takes_records: bool,
    /// The targets, by pid: one record each, the only place anything about them is kept.
    targets: BTreeMap<u32, Target>,
    refusals: Refusals,
    domains: Domains,
    stats: DaemonStats,
    marking_syscalls: u64,
    /// A pass was cut short by [`Daemon::stop_on`]'s signal.
    stopping: bool,
    /// Outsiders already warned about.
    outsiders_seen: HashSet<ProcessId>,
    /// When running out of file descriptors was last warned about.
    warned_short_of_files: Option<Instant>,
    /// Outsiders of another domain with mergeable memory, as of this pass.
    outsiders: Vec<domains::Outsider>,
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
    /// The borrows' process-wide counters, and the guard's handovers, when the daemon
    /// started: its own are the difference.
    borrows_at_start: remote::BorrowCounters,
    handovers_at_start: u64,
    /// ksmd is paced to the marked set until its `full_scans` reaches this.
    ksmd_busy_until: u64,
    /// Work found since ksmd was last set going, not yet worth a sweep of its own.
    ksmd_backlog: KsmdBacklog,
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
        // Every eBPF part is loaded from one reading of the kernel's BTF, let go after start-up.
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
        let recorder = tracer.map(|t| Rc::new(RefCell::new(Recorder::new(t))));
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
            (DirtyMode::Pagemap, recorder) => (
                DirtyMode::Pagemap,
                Box::new(PagemapSource::new(offer, recorder.clone())),
            ),
            (DirtyMode::Auto, _) if !offer.any() => {
                log::info!(
                    "no dirty bit on this kernel ({}): hashing every page every pass",
                    offer.why_none()
                );
                (DirtyMode::HashOnly, Box::new(HashOnly))
            }
            (DirtyMode::Ebpf | DirtyMode::Auto, Some(recorder)) => (
                DirtyMode::Ebpf,
                Box::new(EbpfSource::new(
                    recorder.clone(),
                    config.audit_passes,
                    offer,
                )),
            ),
            (DirtyMode::Auto, None) => (
                DirtyMode::Pagemap,
                Box::new(PagemapSource::new(offer, None)),
            ),
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
        let mut daemon = Daemon {
            marker: Marker::new(config.policy),
            config,
            scanner,
            ksmd,
            recorder,
            dirty_takes_records: mode == DirtyMode::Ebpf,
            targets: BTreeMap::new(),
            refusals: Refusals::default(),
            domains: Domains::default(),
            stats: DaemonStats {
                dirty_mode: mode,
                new_pages,
                ..DaemonStats::default()
            },
            marking_syscalls: 0,
            borrows_at_start: remote::BorrowCounters::now(),
            handovers_at_start: guard::installed().map_or(0, |g| g.given_up()),
            stopping: false,
            outsiders_seen: HashSet::new(),
            warned_short_of_files: None,
            outsiders: Vec::new(),
            crossings_looked_at: None,
            self_marked_warned: HashSet::new(),
            several_domains: false,
            zero_checksum,
            marks,
            warned_name_only: false,
            ksmd_busy_until: 0,
            ksmd_backlog: KsmdBacklog::default(),
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
        self.targets.values()
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
        let (runs_marked, pages_marked) = self.mark(&report, now);
        // Marking many pages built and dropped their lists: give the heap back.
        if report.total.duplicate_pages >= RELEASE_AFTER_DUPLICATES {
            crate::engine::heap::give_back_freed();
        }
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
            // Pages taken up: read whole, or only sampled.
            self.stats.first_pass_pages = summary.pages_hashed + report.total.pages_only_sampled;
        }
        self.last_pass = Some(summary.clone());
        summary
    }

    /// Adopts the processes not yet targets and not refused: each gets its record. At start
    /// every match is taken (several domains are then refused as a whole); later, with
    /// `--several-domains refuse`, a process of another domain than the targets' is not.
    fn adopt(&mut self, processes: Vec<Process>, at_start: bool) {
        let (mut short, before) = (0, self.targets.len());
        // Their pidfds are open already: when a pass's files fit beside them all, none need
        // be dropped, and the room is not tried again for each.
        let roomy = processes
            .first()
            .is_some_and(|p| limits::room_for(p.pidfd(), limits::PASS_RESERVE));
        for process in processes {
            let pid = process.pid();
            if self.targets.contains_key(&pid) || self.refusals.lasting(process.id()) {
                continue;
            }
            // A target holds its pidfd for as long as it lives; the files a pass needs come
            // first.
            if !roomy && !limits::room_for(process.pidfd(), limits::PASS_RESERVE) {
                short += 1;
                continue;
            }
            // The user ids were read when the process was opened, just now.
            let Some(name) = self.config.domain.domain_with_uids(pid, &process.uids()) else {
                continue;
            };
            if !at_start
                && self.config.several_domains == SeveralDomains::Refuse
                && self.domains.count() > 0
                && self.domains.id_of(&name).is_none()
            {
                let why = format!(
                    "it is in merge domain {}, the targets in {} (--several-domains refuse)",
                    procfs::printable(&name),
                    procfs::printable(&self.domains.names().join(", "))
                );
                self.count_refusal(process.id(), "other_domain", &why);
                continue;
            }
            let domain = self.domains.join(&name);
            log::info!(
                pid, comm = process.comm(), domain = name.as_str();
                "target pid {pid} ({}), merge domain {}",
                procfs::printable(process.comm()),
                procfs::printable(&name)
            );
            let mut target = Target::adopt(process, domain, name);
            // Tracked from adoption in every mode: the copy-on-write accounting needs the
            // tracer even where the dirty source does not.
            if let Some(recorder) = &self.recorder {
                if let Err(e) = recorder.borrow_mut().track(pid, &mut target.dirty.tracer) {
                    log::warn!("tracer cannot track pid {pid}: {e}");
                }
            }
            if let Some(watch) = waits::installed() {
                watch.watch(pid);
            }
            self.targets.insert(pid, target);
        }
        if short > 0 {
            self.short_of_files(short, "new process(es) not adopted");
        }
        if self.targets.len() > before {
            self.warn_if_named_by_anyone();
        }
    }

    /// Warns, once, when processes selected by command name alone belong to several users:
    /// any user can give a process of theirs that name.
    fn warn_if_named_by_anyone(&mut self) {
        if self.warned_name_only || !self.config.targets.by_name_only() {
            return;
        }
        let users: BTreeSet<u32> = self
            .targets
            .values()
            .flat_map(|t| t.process().uids())
            .collect();
        if users.len() > 1 {
            self.warned_name_only = true;
            let users: Vec<String> = users.iter().map(u32::to_string).collect();
            log::warn!(
                "the targets are selected by command name alone and belong to several users (uid {}): any user can name a process so; select them by --cgroup or --uid, and narrow that with --comm",
                users.join(", ")
            );
        }
    }

    /// Each domain with targets in it, and the first of its targets' pids, for people.
    fn domains_with_pids(&self) -> Vec<String> {
        self.domains
            .names()
            .into_iter()
            .map(|name| {
                let pids: Vec<String> = self
                    .targets
                    .values()
                    .filter(|t| t.domain_name() == name)
                    .map(|t| t.pid().to_string())
                    .collect();
                let more = if pids.len() > 8 { ", ..." } else { "" };
                format!(
                    "{} (pid {}{more})",
                    procfs::printable(name),
                    pids[..pids.len().min(8)].join(", ")
                )
            })
            .collect()
    }

    /// Drops `pid`'s record, and with it everything kept about the process.
    fn drop_target(&mut self, pid: u32) {
        let Some(mut target) = self.targets.remove(&pid) else {
            return;
        };
        if let Some(watch) = waits::installed() {
            watch.unwatch(pid);
        }
        if let Some(guard) = guard::installed() {
            guard.forget(pid);
        }
        self.scanner.forget(&mut target);
        if let Some(recorder) = &self.recorder {
            recorder.borrow_mut().forget(pid);
        }
        if self.domains.leave(target.domain_name(), &target.owned) {
            self.scanner.forget_domain(target.domain());
        }
    }

    /// Counts `n` processes or targets left for this pass for want of file descriptors, and
    /// says so: at once, then at most once a minute while it lasts.
    fn short_of_files(&mut self, n: usize, what: &str) {
        self.stats.short_of_files += n as u64;
        let now = Instant::now();
        if self
            .warned_short_of_files
            .is_none_or(|at| now.duration_since(at) >= SHORT_OF_FILES_WARN_EVERY)
        {
            self.warned_short_of_files = Some(now);
            log::warn!(
                "out of file descriptors (limit {}): {n} {what}; tried again every pass; raise the hard limit (LimitNOFILE)",
                limits::open_files_limit()
            );
        }
    }

    /// Counts a refusal once per process and reason.
    fn count_refusal(&mut self, id: ProcessId, reason: &str, why: &dyn fmt::Display) {
        if self.refusals.counted.insert((id, reason.to_string())) {
            log::warn!("refusing pid {}: {why}", id.pid);
            *self.stats.targets_refused.entry(reason.into()).or_default() += 1;
        }
    }

    /// Refuses process `id` for as long as it lives: it is never touched again.
    fn refuse(&mut self, id: ProcessId, reason: &str, why: &dyn fmt::Display) {
        self.count_refusal(id, reason, why);
        self.refusals.lasting.insert(id, reason.into());
        if self.targets.get(&id.pid).is_some_and(|t| t.id() == id) {
            self.drop_target(id.pid);
        }
    }

    /// Refuses target `pid` for `reason`: for good if the reason lasts, else for this pass.
    fn refuse_remote(&mut self, pid: u32, reason: RemoteRefusal) {
        let Some(id) = self.targets.get(&pid).map(Target::id) else {
            return;
        };
        if reason.is_lasting() {
            self.refuse(id, reason.as_str(), &reason);
        } else {
            self.count_refusal(id, reason.as_str(), &reason);
            if let Some(target) = self.targets.get_mut(&pid) {
                target.skip_this_pass();
            }
        }
    }

    /// Step 1: exited and exec'd targets are dropped, new matches adopted, and targets that
    /// cannot be borrowed now are refused before anything is done to them.
    fn refresh_targets(&mut self) {
        for target in self.targets.values_mut() {
            target.refresh();
        }
        let exited: Vec<u32> = self
            .targets
            .values()
            .filter(|t| t.process().has_exited())
            .map(Target::pid)
            .collect();
        for pid in exited {
            log::info!("pid {pid} exited");
            self.drop_target(pid);
        }
        // A process that exec'd has a new address space: its arming, marks and checksums
        // describe one that no longer exists. It starts over, as a new target.
        let exec_d: Vec<u32> = self
            .targets
            .values()
            .filter(|t| t.process().has_new_image())
            .map(Target::pid)
            .collect();
        for pid in exec_d {
            log::info!("pid {pid} executed a new program; starting over with it");
            self.drop_target(pid);
        }
        self.follow_the_processes();
        self.refusals.prune();
        let targets = &self.targets;
        match self
            .config
            .targets
            .resolve_again(&|pid| targets.contains_key(&pid))
        {
            Ok(selection) => {
                if selection.short_of_files > 0 {
                    self.short_of_files(selection.short_of_files, "new process(es) not looked at");
                }
                for (pid, _, reason) in &selection.refused {
                    if let Some(id) = ProcessId::of(*pid) {
                        if !self.refusals.lasting(id) {
                            self.refuse(id, reason.as_str(), reason);
                        }
                    }
                }
                self.adopt(selection.processes, false);
            }
            Err(e) => log::warn!("refreshing targets: {e}"),
        }
        let pids: Vec<u32> = self.targets.keys().copied().collect();
        for pid in pids {
            if let Err(RemoteError::Refused { reason, .. }) = remote::check_borrowable(pid) {
                self.refuse_remote(pid, reason);
            }
        }
    }

    /// Step 1, continued: what a process is can change under rksm. One that made itself off
    /// limits (a set-id change, `PR_SET_DUMPABLE` 0) is refused from now on and never
    /// borrowed again, so what was marked in it stays marked. One whose merge domain changed
    /// (a `setuid`, a move to another cgroup) takes nothing marked into its new domain: rksm
    /// unmarks what it marked there and places it again, as a new target, next pass.
    fn follow_the_processes(&mut self) {
        let outsiders = self.new_outsiders();
        self.warn_about(&outsiders);
        let mut off_limits = Vec::new();
        let mut moved = Vec::new();
        for target in self.targets.values() {
            let Some(standing) = target.process().standing() else {
                continue;
            };
            if let Some(reason) = standing.off_limits {
                off_limits.push((target.id(), reason));
            } else if let Some(now) = self
                .config
                .domain
                .domain_with_uids(target.pid(), &standing.uids)
            {
                if now != target.domain_name() {
                    moved.push((target.pid(), now));
                }
            }
        }
        for (id, reason) in off_limits {
            if self
                .targets
                .get(&id.pid)
                .is_some_and(|t| !t.marked.is_empty())
            {
                log::warn!(
                    "pid {}: {reason} now; what rksm marked in it stays marked, since it is not touched again",
                    id.pid
                );
            }
            self.refuse(id, reason.as_str(), &reason);
        }
        for (pid, now) in moved {
            let Some(target) = self.targets.get_mut(&pid) else {
                continue;
            };
            log::warn!(
                "pid {pid} moved from merge domain {} to {}: unmarking what rksm marked in it",
                procfs::printable(target.domain_name()),
                procfs::printable(&now)
            );
            let runs = target.marked.within(Range::new(0, u64::MAX));
            if !runs.is_empty() {
                match self.marker.unmark(target, &runs) {
                    Ok(outcome) => self.marking_syscalls += outcome.remote_syscalls,
                    Err(e) => log::warn!("pid {pid}: unmarking after a domain change: {e}"),
                }
            }
            self.stats.domain_changes += 1;
            self.drop_target(pid);
        }
    }

    /// Processes outside the targets, of another domain than some target's, whose memory is
    /// mergeable, and which have not been warned about yet.
    fn new_outsiders(&mut self) -> Vec<domains::Outsider> {
        let pids: HashSet<u32> = self.targets.keys().copied().collect();
        let names: HashSet<String> = self
            .targets
            .values()
            .map(|t| t.domain_name().to_string())
            .collect();
        self.outsiders_seen
            .retain(|id| ProcessId::of(id.pid) == Some(*id));
        let marked = self.marks.as_ref().map(MarkWatch::take).unwrap_or_default();
        self.outsiders = domains::mergeable_outsiders(self.config.domain, &pids, &names, &marked);
        self.outsiders
            .iter()
            .filter(|o| ProcessId::of(o.pid).is_some_and(|id| !self.outsiders_seen.contains(&id)))
            .cloned()
            .collect()
    }

    /// Warns once about each of `outsiders`, and counts them.
    fn warn_about(&mut self, outsiders: &[domains::Outsider]) {
        for o in outsiders {
            if let Some(id) = ProcessId::of(o.pid) {
                self.outsiders_seen.insert(id);
            }
            log::warn!(
                "{o} marks its memory mergeable outside the targets, in another merge domain: ksmd may merge its pages with a target's, so it can probe what rksm marks"
            );
            self.stats.mergeable_outsiders += 1;
        }
    }

    /// Step 2: reads, checksums and indexes every target not sitting this pass out. A target
    /// skipped (traced, stopped, in a disk wait) keeps its arming and checksums: its pages
    /// could not be marked anyway, and the next pass takes it up where it was.
    fn scan(&mut self) -> PassReport {
        let mut targets: Vec<&mut Target> =
            self.targets.values_mut().filter(|t| !t.skipped()).collect();
        self.scanner.pass_over(&mut targets, &mut |_| {})
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
            if let Some(id) = self.targets.get(pid).map(Target::id) {
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
            .map(|t| t.dirty.take_short_of_files())
            .filter(|&short| short)
            .count();
        if unprotected > 0 {
            self.short_of_files(
                unprotected,
                "target(s) not write-protected (hashed in full)",
            );
        }
    }

    /// Step 4: counts writes the tracer saw on pages that were merged at the previous pass,
    /// and backs off the regions they happened in.
    fn account_cow_breaks(&mut self, report: &PassReport, now: u64) -> u64 {
        let mut breaks = 0;
        let mut backed_off: Vec<(u32, u64)> = Vec::new();
        for p in &report.processes {
            let Some(target) = self.targets.get_mut(&p.pid) else {
                continue;
            };
            let written = match &self.recorder {
                Some(recorder) => {
                    // Taking records here in ebpf mode would hide a write made since the
                    // scan from the next pass's dirty set; it joins the next window instead.
                    if !self.dirty_takes_records {
                        recorder.borrow_mut().take(p.pid, &mut target.dirty.tracer);
                    }
                    target.dirty.tracer.close_window()
                }
                None => HashSet::new(),
            };
            let broken: Vec<u64> = written
                .iter()
                .copied()
                .filter(|&page| target.merged.remove(page))
                .collect();
            breaks += broken.len() as u64;
            target.counters.cow_breaks += broken.len() as u64;
            let regions: HashSet<u64> = broken.iter().map(|page| page >> REGION_SHIFT).collect();
            for region in regions {
                if target.backoff.hit(region, now) {
                    backed_off.push((p.pid, region));
                }
            }
            // Pages looked at this pass and found mapped to KSM frames; with the verified
            // duplicates marked (step 5), the pages a write would break.
            if let Some(merged) = report.ksm_pages.get(&p.pid) {
                target.merged.extend(merged.iter().copied());
            }
        }
        for (pid, region) in backed_off {
            self.unmark_region(pid, region);
        }
        self.stats.cow_breaks += breaks;
        breaks
    }

    /// Backing off unmarks the region, so ksmd stops merging pages that do not stay merged.
    fn unmark_region(&mut self, pid: u32, region: u64) {
        let Some(target) = self.targets.get_mut(&pid) else {
            return;
        };
        let (start, end) = (region << REGION_SHIFT, (region + 1) << REGION_SHIFT);
        let runs: Vec<Run> = target.marked.within(Range::new(start, end));
        log::info!("pid {pid}: merged pages in {start:#x}-{end:#x} keep breaking; backing off");
        match self.marker.unmark(target, &runs) {
            Ok(outcome) => self.marking_syscalls += outcome.remote_syscalls,
            Err(e) => log::warn!("pid {pid}: unmarking a backed-off region: {e}"),
        }
    }

    /// Between passes, with more than one merge domain: a write the tracer saw on a marked
    /// duplicate may put another domain's content there, and ksmd, if it is sweeping, would
    /// merge it before the next pass looks. So its region backs off now, as the next pass
    /// would have done (the pass then finds it backed off already and counts the break).
    fn back_off_written_marks(&mut self, written: Vec<(u32, u64)>) {
        let now = self.stats.full_scans;
        let mut backed_off = Vec::new();
        for (pid, page) in written {
            let Some(target) = self.targets.get_mut(&pid) else {
                continue;
            };
            if target.merged.contains(page) && target.backoff.hit(page >> REGION_SHIFT, now) {
                backed_off.push((pid, page >> REGION_SHIFT));
            }
        }
        for (pid, region) in backed_off {
            self.unmark_region(pid, region);
        }
    }

    /// Step 4b: finds KSM frames mapped in more than one merge domain ([`crossings`]), counts
    /// and logs them, and undoes them in the targets: the mappings of the domains that must
    /// give way are unmarked (which unmerges them), and those domains do not mark the content
    /// again (or, if they gave way to an outsider, back off). Only ksmd merges, so a look is
    /// taken only with more than one domain among the targets and the mergeable outsiders,
    /// and only if ksmd has scanned since the last look or who is in which domain changed:
    /// after convergence, with ksmd idle, it costs nothing. A look reads smaps and pagemap of
    /// every mergeable VMA of those processes.
    fn undo_crossings(&mut self) {
        let mut mappers: Vec<crossings::Mapper> = self
            .targets
            .values()
            .filter(|t| !t.skipped())
            .map(|t| crossings::Mapper {
                pid: t.pid(),
                domain: t.domain(),
                target: true,
            })
            .collect();
        // Outsiders of a domain no target is in get numbers of their own, from the top.
        let mut strangers: HashMap<&str, u32> = HashMap::new();
        for o in &self.outsiders {
            let domain = self.domains.id_of(&o.domain).unwrap_or_else(|| {
                let next = u32::MAX - strangers.len() as u32;
                *strangers.entry(&o.domain).or_insert(next)
            });
            mappers.push(crossings::Mapper {
                pid: o.pid,
                domain,
                target: false,
            });
        }
        let domains: HashSet<u32> = mappers.iter().map(|m| m.domain).collect();
        self.several_domains = domains.len() > 1;
        if !self.several_domains {
            self.crossings_looked_at = None;
            return;
        }
        let scanned = ksmd::counters(&self.config.ksm_root)
            .ok()
            .and_then(|k| k.pages_scanned);
        let inputs = crossings::Inputs::new(scanned, &mappers);
        if inputs.unchanged_since(self.crossings_looked_at.as_ref()) {
            return;
        }
        self.crossings_looked_at = Some(inputs);
        let Ok(kpageflags) = procfs::KpageFlags::open() else {
            return;
        };
        let started = Instant::now();
        let found = crossings::find(&mappers, &kpageflags);
        self.stats.cross_domain_checks += 1;
        self.stats.cross_domain_check_ns += started.elapsed().as_nanos() as u64;
        if found.crossings.is_empty() {
            return;
        }
        // Zeros tell nobody anything: a frame of zeros is not a crossing, so no outsider can
        // stop the targets from merging theirs. The checksum only says which frames to read;
        // a frame is passed over only if a target's mapping of it reads as zeros.
        let zero = self.zero_checksum;
        let holds_zeros = |c: &crossings::Crossing| {
            c.mappings.iter().find(|m| m.target).is_some_and(|m| {
                let mut page = [0u8; PAGE];
                ProcMem::open(m.pid).is_ok_and(|mem| mem.read_page(m.addr, &mut page))
                    && page.iter().all(|&b| b == 0)
            })
        };
        let sum_of = |targets: &BTreeMap<u32, Target>, m: &crossings::Mapping| {
            let info = targets.get(&m.pid)?.pages.get(m.addr)?;
            (info.checksum != NO_CHECKSUM).then_some(info.checksum)
        };
        let crossings: Vec<(&crossings::Crossing, Option<u64>)> = found
            .crossings
            .iter()
            .map(|c| (c, c.mappings.iter().find_map(|m| sum_of(&self.targets, m))))
            .filter(|&(c, sum)| sum != Some(zero) || !holds_zeros(c))
            .collect();
        if crossings.is_empty() {
            return;
        }
        // Which pages of which targets give way. A domain that gave way to another domain of
        // targets never marks the content again; one that gave way to an outsider backs off
        // (the region, for longer each time), so an outsider holding a content does not end
        // its merging for good.
        let mut give_way: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
        let mut again_later: HashMap<u32, Vec<(u64, u64)>> = HashMap::new();
        let now = self.stats.full_scans;
        for &(crossing, sum) in &crossings {
            let owner = sum.and_then(|s| self.domains.owner(s));
            let to_an_outsider = crossing.mappings.iter().any(|m| !m.target);
            for m in crossing.to_undo(owner) {
                give_way.entry(m.pid).or_default().push(m.addr);
                match sum {
                    Some(sum) if !to_an_outsider => self.domains.contest(sum, m.domain),
                    _ => {
                        if let Some(target) = self.targets.get_mut(&m.pid) {
                            target.backoff.hit(m.addr >> REGION_SHIFT, now);
                        }
                        if let Some(sum) = sum {
                            again_later.entry(m.pid).or_default().push((m.addr, sum));
                        }
                    }
                }
            }
        }
        let described: Vec<String> = crossings
            .iter()
            .take(4)
            .map(|(c, _)| self.describe(c))
            .collect();
        log::warn!(
            "{} KSM frames were mapped in more than one merge domain ({}{}); unmarking them in the targets that must give way",
            crossings.len(),
            described.join("; "),
            if crossings.len() > 4 { "; ..." } else { "" }
        );
        self.stats.cross_domain_merges += crossings.len() as u64;
        for (pid, mut pages) in give_way {
            let Some(target) = self.targets.get_mut(&pid) else {
                continue;
            };
            pages.sort_unstable();
            pages.dedup();
            for page in &pages {
                target.merged.remove(*page);
                target.candidates.remove(page);
            }
            // Given way to an outsider: a candidate again once the back-off ends.
            for (page, sum) in again_later.remove(&pid).unwrap_or_default() {
                target.candidates.insert(page, sum);
            }
            // What rksm marked is unmarked; what the process marked itself is its own.
            let mut mine: Vec<Run> = Vec::new();
            let mut theirs = false;
            for run in page_runs(&pages, usize::MAX) {
                let run = Range::new(run[0], run[run.len() - 1] + PAGE_SIZE);
                mine.extend(target.marked.within(run));
                theirs |= !target.marked.minus(&[run]).is_empty();
            }
            if theirs && self.self_marked_warned.insert(target.id()) {
                log::warn!(
                    "pid {pid} marks its own memory mergeable, and some of it was merged across merge domains; rksm does not undo a process's own marks"
                );
            }
            match self.marker.unmark(target, &mine) {
                Ok(outcome) => {
                    self.marking_syscalls += outcome.remote_syscalls;
                    self.stats.cross_domain_unmarked += outcome.pages;
                }
                Err(e) => log::warn!("pid {pid}: unmarking pages merged across domains: {e}"),
            }
        }
    }

    /// One crossing, for the log: who maps the frame, in which domain.
    fn describe(&self, crossing: &crossings::Crossing) -> String {
        let mut who: Vec<String> = crossing
            .mappings
            .iter()
            .map(|m| {
                let domain = self
                    .targets
                    .get(&m.pid)
                    .map(|t| t.domain_name().to_string())
                    .or_else(|| {
                        self.outsiders
                            .iter()
                            .find(|o| o.pid == m.pid)
                            .map(|o| o.domain.clone())
                    })
                    .unwrap_or_default();
                let kind = if m.target { "target" } else { "outsider" };
                format!("{kind} pid {} ({})", m.pid, procfs::printable(&domain))
            })
            .collect();
        who.dedup();
        format!("frame {:#x}: {}", crossing.pfn, who.join(", "))
    }

    /// Step 5: marks the new duplicate runs of every target; returns how many runs, and
    /// pages in them, were marked.
    fn mark(&mut self, report: &PassReport, now: u64) -> (u64, u64) {
        let (mut runs_marked, mut pages_marked) = (0, 0);
        let mut refusals = Vec::new();
        // Contents already merged somewhere belong to that process's domain.
        for (pid, sums) in &report.ksm_checksums {
            if let Some(target) = self.targets.get_mut(pid) {
                for &sum in sums {
                    self.domains.claim(sum, target.domain(), &mut target.owned);
                }
            }
        }
        let allow_gaps = self.domains.count() <= 1;
        // A verified duplicate is found once, when it is placed; it stays a candidate until
        // it is marked, written or unmapped (a domain's claim, a back-off or the marking
        // budget may hold it back for a while).
        for (pid, pages) in &report.merge_candidates {
            if let Some(target) = self.targets.get_mut(pid) {
                target.candidates.extend(pages.iter().copied());
            }
        }
        // In pid order, so which domain first marks a content does not depend on hashing.
        for (&pid, target) in self.targets.iter_mut() {
            if target.candidates.is_empty() {
                continue;
            }
            let Some((vmas, vma_count)) = report.vmas.get(&pid) else {
                continue;
            };
            let domain = target.domain();
            let marked = &target.marked;
            target.candidates.retain(|&page, _| !marked.contains(page));
            let mut mine = Vec::with_capacity(target.candidates.len());
            let mut pages: Vec<(u64, u64)> =
                target.candidates.iter().map(|(&p, &s)| (p, s)).collect();
            pages.sort_unstable();
            for (page, sum) in pages {
                if target.backoff.blocks(page, now) {
                    continue;
                }
                // Decided from this domain's own history only.
                if self.domains.claim(sum, domain, &mut target.owned) {
                    mine.push(page);
                }
            }
            // Marked verified duplicates are ksmd's to merge: a write to one breaks a merge,
            // or one about to happen.
            target.merged.extend(mine.iter().copied());
            let runs = self
                .marker
                .plan(pid, &target.marked, &mine, vmas, *vma_count, allow_gaps);
            match self.marker.mark(target, &runs) {
                Ok(outcome) => {
                    runs_marked += outcome.runs;
                    pages_marked += outcome.pages;
                    self.marking_syscalls += outcome.remote_syscalls;
                }
                Err(RemoteError::Refused { reason, .. }) => refusals.push((pid, reason)),
                // The next pass drops it, or starts over with its new program.
                Err(RemoteError::Gone(_) | RemoteError::NewImage(_)) => {}
                Err(e) => log::warn!("marking in pid {pid}: {e}"),
            }
            let marked = &target.marked;
            target.candidates.retain(|&page, _| !marked.contains(page));
            // A first pass's candidates are marked at once: their table is not kept.
            if target.candidates.capacity() > 4 * target.candidates.len() + 1024 {
                target.candidates.shrink_to_fit();
            }
        }
        for (pid, reason) in refusals {
            self.refuse_remote(pid, reason);
        }
        (runs_marked, pages_marked)
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
        s.remote_syscalls = self.marking_syscalls + self.scanner.dirty_remote_syscalls();
        let borrowing = remote::BorrowCounters::now().since(self.borrows_at_start);
        s.eintr_risk = borrowing.eintr_risk;
        s.borrows = borrowing.borrows;
        s.rseq_aborts = borrowing.rseq_aborts;
        s.timed_restarts = borrowing.timed_restarts;
        s.userfaultfd_handovers =
            guard::installed().map_or(0, |g| g.given_up()) - self.handovers_at_start;
        s.regions_backed_off = self
            .targets
            .values()
            .map(|t| t.backoff.active(s.full_scans))
            .sum();
        s.pages_marked = self.targets.values().map(|t| t.marked.pages()).sum();
        s.write_protect.clear();
        for t in self.targets.values_mut() {
            *s.write_protect
                .entry(t.dirty.write_protect().0.to_string())
                .or_default() += 1;
            // The daemon's totals grow by what each target's grew since the last pass.
            let (clears, ns, races) = t.dirty.soft_dirty_clears();
            let c = &mut t.counters;
            s.soft_dirty_clears += clears.saturating_sub(c.soft_dirty_clears);
            s.soft_dirty_clear_seconds += ns.saturating_sub(c.soft_dirty_clear_ns) as f64 / 1e9;
            s.soft_dirty_clear_races += races.saturating_sub(c.soft_dirty_clear_races);
            (
                c.soft_dirty_clears,
                c.soft_dirty_clear_ns,
                c.soft_dirty_clear_races,
            ) = (clears, ns, races);
        }
        for p in &report.processes {
            if let Some(t) = self.targets.get_mut(&p.pid) {
                let c = &mut t.counters;
                c.pages_volatile = p.counts.volatile_pages;
                c.pages_hashed += p.counts.pages_hashed;
                c.pages_skipped_clean += p.counts.pages_skipped_clean;
                c.dirty_misses = t.dirty.misses;
                c.pages_marked = t.marked.pages();
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
            let recorder = recorder.borrow();
            let (mut faults, mut lost) = (0, 0);
            for t in self.targets.values_mut() {
                let (f, l) = recorder.counters(t.pid());
                t.counters.write_faults = f;
                (faults, lost) = (faults + f, lost + l);
            }
            s.write_faults = s.write_faults.max(faults);
            s.tracer_lost = s.tracer_lost.max(lost);
        }
    }

    /// Step 7: pace ksmd to the work. ksmd cannot be pointed at pages: each full scan visits
    /// all mergeable memory, rksm's marks and whatever processes marked themselves (qemu
    /// marks its guest's RAM). So a sweep is worth starting only for a batch of work. A batch
    /// is due when the work found since the last one reaches 1/64 of the marked pages (the
    /// first pass's duplicates, a workload that changed) or has waited `ksmd_max_delay` (the
    /// trickle of a steady state: a guest kernel zeroing a few pages a second). Then ksmd is
    /// paced to sweep the marked set in about `ksmd_sweep` until it has completed three more
    /// full scans: a page needs two sweeps to be merged, and the scan in progress may have
    /// passed its process already. Merges that are still coming in as the third scan ends
    /// (ksmd's `pages_sharing` grew by a batch within a pass) extend it. With no batch due,
    /// ksmd gets back the settings found at take-over (stopped, on a host that had not
    /// started it): after convergence it costs nothing until the dirty bit finds work.
    fn pace_ksmd(&mut self, work: KsmdWork) {
        let full_scans = ksmd::counters(&self.config.ksm_root).map_or(0, |k| k.full_scans);
        let busy = full_scans < self.ksmd_busy_until;
        let batch = (self.stats.pages_marked / 64).max(1);
        if self.ksmd_backlog.add(work.new, Instant::now()) >= batch
            || self.ksmd_backlog.waited(self.config.ksmd_max_delay)
            || (busy && work.merged >= batch)
        {
            self.ksmd_busy_until = full_scans + 3;
            self.ksmd_backlog = KsmdBacklog::default();
        }
        let pace = if full_scans < self.ksmd_busy_until {
            ksmd::pace(
                self.stats.pages_marked,
                self.config.ksmd_sweep.as_secs_f64(),
                self.config.ksmd_sleep_millisecs,
            )
        } else {
            ksmd::idle(self.ksmd.saved())
        };
        if let Err(e) = self.ksmd.set(pace) {
            log::warn!("pacing ksmd: {e}");
        }
        self.stats.ksmd_taken_back = self.ksmd.taken_back();
    }

    /// Waits until `deadline`, draining the tracer when it needs it; returns early (false)
    /// when one of `interrupts` becomes readable (a signalfd, a child's pidfd). Nothing else
    /// wakes it: with one domain the tracer wakes it only when a quarter of its ring waits
    /// unread, with several for every write (to unmark a written marked page at once), and
    /// then the ring is drained at most every [`DRAIN_EVERY`]: waking for each record would
    /// cost a context switch per write fault, and the ring holds far more than that
    /// interval's faults.
    pub fn wait(&mut self, deadline: Instant, interrupts: &[BorrowedFd<'_>]) -> bool {
        // With several domains a write to a marked page is acted on at once; otherwise the
        // records wait for the next pass, and the tracer wakes the daemon only to keep its
        // ring from filling.
        if let Some(recorder) = &self.recorder {
            if let Err(e) = recorder.borrow_mut().wake_at_once(self.several_domains) {
                log::debug!("the tracer's wake-up: {e}");
            }
        }
        let mut ring_quiet_until = Instant::now();
        loop {
            let now = Instant::now();
            let left = deadline.saturating_duration_since(now);
            if left.is_zero() {
                return true;
            }
            let watch_ring = now >= ring_quiet_until;
            let step = if watch_ring {
                left
            } else {
                left.min(ring_quiet_until - now)
            };
            // A thread given up for not stopping in time is let go as soon as it stops: look
            // every 10 ms while there is one. Otherwise nothing needs the daemon before the
            // deadline but the fds polled.
            let step = if remote::reap_lingering() > 0 {
                step.min(Duration::from_millis(10))
            } else {
                step
            };
            // Rounded up: a timeout cut to whole milliseconds would wake just before the
            // deadline and spin until it.
            let millis = step.as_nanos().div_ceil(1_000_000).min(i32::MAX as u128) as i32;
            let timeout = PollTimeout::try_from(millis).unwrap_or(PollTimeout::MAX);
            let recorder = self.recorder.clone();
            let recorder_ref = recorder.as_ref().map(|r| r.borrow());
            let records = recorder_ref.as_ref().map(|r| r.records_fd());
            let mut fds: Vec<PollFd<'_>> = interrupts
                .iter()
                .map(|&fd| PollFd::new(fd, PollFlags::POLLIN))
                .collect();
            if let Some(fd) = records.filter(|_| watch_ring) {
                fds.push(PollFd::new(fd, PollFlags::POLLIN));
            }
            match poll(&mut fds, timeout) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                // Not expected of the daemon's own fds; sleeping out the step keeps a poll
                // that keeps failing from spinning until the deadline.
                Err(e) => {
                    log::warn!("waiting for the next pass: poll: {e}");
                    std::thread::sleep(step);
                }
            }
            let interrupted = fds[..interrupts.len()]
                .iter()
                .any(|fd| fd.revents().is_some_and(|r| !r.is_empty()));
            let ring_woke = watch_ring
                && fds
                    .get(interrupts.len())
                    .and_then(|fd| fd.revents())
                    .is_some_and(|r| !r.is_empty());
            drop(fds);
            drop(recorder_ref);
            if let Some(r) = &recorder {
                let mut r = r.borrow_mut();
                r.drain();
                r.log_mut().watch_fresh(self.several_domains);
                let written = r.log_mut().take_fresh();
                drop(r);
                self.back_off_written_marks(written);
            }
            if ring_woke {
                ring_quiet_until = Instant::now() + DRAIN_EVERY;
            }
            if interrupted {
                return false;
            }
        }
    }

    /// Ends a pass early, between two chunks, once one of `fds` is readable (the signalfd of
    /// SIGINT and SIGTERM): the daemon then stops within one chunk's read, not one pass.
    pub fn stop_on(&mut self, fds: &[BorrowedFd<'_>]) -> std::io::Result<()> {
        let fds: Vec<std::os::fd::OwnedFd> = fds
            .iter()
            .map(|fd| fd.try_clone_to_owned())
            .collect::<Result<_, _>>()?;
        self.scanner.stop_when(move || {
            use std::os::fd::AsFd;
            let mut polled: Vec<PollFd<'_>> = fds
                .iter()
                .map(|fd| PollFd::new(fd.as_fd(), PollFlags::POLLIN))
                .collect();
            poll(&mut polled, PollTimeout::ZERO).is_ok_and(|n| n > 0)
        });
        Ok(())
    }

    /// True once a pass was cut short to stop.
    pub fn stopping(&self) -> bool {
        self.stopping
    }

    /// Stops: restores ksmd's settings and returns the final counters. Marked ranges stay
    /// marked and merged pages stay merged; the targets' userfaultfds close with rksm.
    pub fn finish(self) -> DaemonStats {
        // Threads given up for missing a deadline are let go only by rksm: wait for them,
        // bounded, before leaving (the kernel would let them go as they are).
        let deadline = Instant::now() + LINGER_AT_EXIT;
        while remote::reap_lingering() > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        match remote::reap_lingering() {
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

/// Pages in MiB.
pub fn mib(pages: u64) -> f64 {
    (pages * PAGE_SIZE) as f64 / (1024.0 * 1024.0)
}

#[cfg(test)]
mod tests {
    use clap::ValueEnum;

    use super::*;

    #[test]
    fn a_refusal_is_not_inherited_by_a_process_that_reuses_the_pid() {
        let me = ProcessId::of(std::process::id()).unwrap();
        // An earlier process that had this pid, and was refused for good.
        let earlier = ProcessId {
            start_ticks: me.start_ticks - 1,
            ..me
        };
        let mut refusals = Refusals::default();
        refusals.lasting.insert(earlier, "seccomp".into());
        refusals.counted.insert((earlier, "seccomp".into()));
        assert!(refusals.lasting(earlier));
        assert!(!refusals.lasting(me), "inherited by the pid's new owner");
        refusals.lasting.insert(me, "seccomp".into());
        refusals.prune();
        assert!(refusals.lasting(me), "a live process's refusal lasts");
        assert!(
            !refusals.lasting(earlier),
            "the exited process is forgotten"
        );
        assert!(refusals.counted.is_empty());
    }

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
