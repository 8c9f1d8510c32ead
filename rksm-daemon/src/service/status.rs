//! What a running daemon is doing, for `rksm status` and for Prometheus.
//!
//! Operators ask a running service what it is doing without stopping it or reading its logs.
//! The daemon publishes a [`Status`] after every pass; a [`StatusServer`] thread hands the
//! latest one to whoever connects to a root-only unix socket (as one JSON object), and, only
//! if asked for, serves it as Prometheus text on an HTTP address (meant for 127.0.0.1). The
//! daemon's loop never waits on a client: the server thread answers from the last snapshot.
//!
//! ```
//! use rksm::service::status::{Status, render_metrics};
//! let text = render_metrics(&Status::default());
//! assert!(text.contains("# TYPE rksm_full_scans_total counter\nrksm_full_scans_total 0\n"));
//! ```

use std::{
    fmt::Write as _,
    io::{self, Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    os::{
        fd::AsFd,
        unix::{
            fs::FileTypeExt,
            net::{UnixListener, UnixStream},
        },
    },
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc, Mutex,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use serde::{Deserialize, Serialize};

use rksm_common::PAGE_SIZE;

use crate::{
    daemon::{unix_time, Daemon, DaemonStats, DirtyMode, PassSummary},
    engine::target::{Target, TargetCounters},
    kernel::procfs::KsmStat,
};

pub use crate::kernel::procfs::printable;

/// Where `rksm status` finds the daemon unless told otherwise.
pub const DEFAULT_SOCKET: &str = "/run/rksm/rksm.sock";

/// Errors serving or asking for the status.
#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    /// The socket or the metrics address cannot be set up.
    #[error("{what}: {source}")]
    Listen {
        /// The socket path or address.
        what: String,
        /// What failed.
        source: io::Error,
    },
    /// No daemon answers on the socket.
    #[error("no rksm daemon is answering on {socket} ({source}); is `rksm daemon` running?")]
    NotRunning {
        /// The socket.
        socket: PathBuf,
        /// What failed.
        source: io::Error,
    },
    /// The socket is there but only root may use it.
    #[error("{0}: permission denied; only root may ask the rksm daemon")]
    NotAllowed(PathBuf),
    /// Something answered, but not with a status.
    #[error("{socket}: not an rksm status: {reason}")]
    BadReply {
        /// The socket.
        socket: PathBuf,
        /// What was wrong.
        reason: String,
    },
}

/// Everything `rksm status` shows.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Status {
    /// rksm's version.
    pub version: String,
    /// The daemon's pid.
    pub daemon_pid: u32,
    /// The dirty mode in use.
    pub dirty_mode: DirtyMode,
    /// The checksum gate.
    pub checksum: String,
    /// The merge-domain policy.
    pub domain: String,
    /// When the daemon started (seconds since the Unix epoch).
    pub started_unix: f64,
    /// The last pass, once there was one.
    pub last_pass: Option<PassSummary>,
    /// The daemon's counters.
    pub counters: DaemonStats,
    /// What rksm gains the host, in bytes, as ksmd's `general_profit` does for KSM: the memory
    /// merging saves (ksmd's `pages_sharing` pages) minus rksm's own resident memory
    /// (filled in by [`Status::read_live`]).
    pub general_profit: i64,
    /// Every current target.
    pub targets: Vec<TargetStatus>,
}

impl Status {
    /// What `daemon` is doing: modes, counters, the last pass and every target. The kernel's
    /// own readings are left out: [`Status::read_live`] adds them when someone asks, so a
    /// pass does not pay for a file read per target that nobody may look at.
    pub fn of(daemon: &Daemon) -> Status {
        let config = daemon.config();
        Status {
            version: env!("CARGO_PKG_VERSION").into(),
            daemon_pid: std::process::id(),
            dirty_mode: daemon.dirty_mode(),
            checksum: config.checksum.to_string(),
            domain: config.domain.to_string(),
            started_unix: unix_time(daemon.started()),
            last_pass: daemon.last_pass().cloned(),
            counters: daemon.stats().clone(),
            general_profit: 0,
            targets: daemon.targets().map(TargetStatus::of).collect(),
        }
    }

    /// Adds what is read from the kernel at the moment of asking: each target's
    /// /proc/PID/ksm_stat and rksm's own resident memory (for `general_profit`).
    pub fn read_live(mut self) -> Status {
        for t in &mut self.targets {
            let kernel = KsmStat::read(t.pid);
            t.ksm_merging_pages = kernel.map(|k| k.merging_pages);
            t.ksm_process_profit = kernel.map(|k| k.process_profit);
        }
        self.general_profit =
            (self.counters.pages_sharing * PAGE_SIZE) as i64 - own_resident_bytes();
        self
    }
}

/// rksm's resident memory (/proc/self/statm's second field, in pages).
fn own_resident_bytes() -> i64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<i64>().ok())
        .map_or(0, |pages| pages * PAGE_SIZE as i64)
}

/// One target's counters.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TargetStatus {
    /// Process id.
    pub pid: u32,
    /// Command name.
    pub comm: String,
    /// Its merge domain.
    pub domain: String,
    /// Its merge domain's number (the same while the domain has targets; never reused).
    #[serde(default)]
    pub domain_number: u32,
    /// Its write-protect source: `userfaultfd`, `soft-dirty` or `none`.
    #[serde(default)]
    pub write_protect: String,
    /// Why that source (or why none).
    #[serde(default)]
    pub write_protect_why: String,
    /// Its counters.
    #[serde(flatten)]
    pub counters: TargetCounters,
    /// The kernel's own count of the process's pages mapped to KSM pages
    /// (/proc/PID/ksm_stat), when it has one (filled in by [`Status::read_live`]).
    pub ksm_merging_pages: Option<u64>,
    /// The kernel's `ksm_process_profit` for the process, in bytes.
    pub ksm_process_profit: Option<i64>,
}

impl TargetStatus {
    /// What the status shows of `target`.
    pub fn of(target: &Target) -> TargetStatus {
        TargetStatus {
            pid: target.pid(),
            comm: target.process().comm().into(),
            domain: target.domain_name().into(),
            domain_number: target.domain(),
            write_protect: target.write_protect().0.to_string(),
            write_protect_why: target.write_protect().1.into(),
            counters: target.counters.clone(),
            ..TargetStatus::default()
        }
    }
}

/// Prometheus text exposition (version 0.0.4) of `status`: daemon-wide counters without
/// labels, per-target ones with `pid` and `comm` labels (sum them for totals).
pub fn render_metrics(status: &Status) -> String {
    render(status, true)
}

/// The Prometheus text for whoever cannot ptrace the targets (the HTTP endpoint without the
/// token, the textfile): daemon-wide series and per-domain sums, no pid, no command name.
pub fn render_public_metrics(status: &Status) -> String {
    render(status, false)
}

fn render(status: &Status, per_target: bool) -> String {
    let mut out = String::new();
    let c = &status.counters;
    // Names follow the exposition conventions: counters end in `_total`, and quantities are
    // in base units (seconds, bytes), as their names say.
    let mut family = |name: &str, kind: &str, help: &str, samples: &[(String, f64)]| {
        let name = match kind {
            "counter" => format!("{name}_total"),
            _ => name.to_string(),
        };
        let _ = writeln!(out, "# HELP rksm_{name} {help}\n# TYPE rksm_{name} {kind}");
        for (labels, value) in samples {
            let _ = writeln!(out, "rksm_{name}{labels} {value}");
        }
    };
    family(
        "info",
        "gauge",
        "The running daemon's version and modes.",
        &[(
            labels(&[
                ("version", &status.version),
                ("dirty_mode", &status.dirty_mode.to_string()),
                ("checksum", &status.checksum),
                ("domain", &status.domain),
            ]),
            1.0,
        )],
    );
    let last = status.last_pass.as_ref();
    let daemon_wide: [(&str, &str, &str, f64); 30] = [
        (
            "pages_sharing",
            "gauge",
            "Further mappings of KSM pages: pages saved (ksmd's counter, over every process that marks memory mergeable; without outsiders, the targets).",
            c.pages_sharing as f64,
        ),
        (
            "pages_shared",
            "gauge",
            "KSM pages in use (ksmd's counter, likewise).",
            c.pages_shared as f64,
        ),
        (
            "saved_bytes",
            "gauge",
            "Memory merging saves: pages_sharing in bytes.",
            (c.pages_sharing * rksm_common::PAGE_SIZE) as f64,
        ),
        (
            "pages_hashed",
            "counter",
            "Pages read and checksummed, all targets.",
            c.pages_hashed as f64,
        ),
        (
            "pages_sampled",
            "counter",
            "New pages sampled in the kernel instead of read, all targets.",
            c.pages_sampled as f64,
        ),
        (
            "pages_only_sampled",
            "counter",
            "Sampled pages whose sample met no other page's: not read.",
            c.pages_only_sampled as f64,
        ),
        (
            "pages_skipped_clean",
            "counter",
            "Pages the dirty source proved clean, not read, all targets.",
            c.pages_skipped_clean as f64,
        ),
        (
            "full_scans",
            "counter",
            "Passes completed.",
            c.full_scans as f64,
        ),
        (
            "pass_seconds",
            "gauge",
            "Wall time of the last pass.",
            last.map_or(0.0, |p| p.seconds),
        ),
        (
            "last_pass_timestamp_seconds",
            "gauge",
            "When the last pass ended (Unix time).",
            last.map_or(0.0, |p| p.ended_unix),
        ),
        (
            "targets",
            "gauge",
            "Current targets.",
            status.targets.len() as f64,
        ),
        (
            "general_profit_bytes",
            "gauge",
            "Bytes merging saves in the targets minus rksm's own resident memory.",
            status.general_profit as f64,
        ),
        (
            "pages_unshared",
            "gauge",
            "Marked pages ksmd found unique (ksmd's counter).",
            c.pages_unshared as f64,
        ),
        (
            "checksum_seconds",
            "counter",
            "Time spent in checksums.",
            c.checksum_ns as f64 / 1e9,
        ),
        (
            "tracer_lost",
            "counter",
            "Write faults the tracer could not record.",
            c.tracer_lost as f64,
        ),
        (
            "remote_syscalls",
            "counter",
            "System calls made inside targets.",
            c.remote_syscalls as f64,
        ),
        (
            "borrows",
            "counter",
            "Threads of targets stopped for remote system calls and let go.",
            c.borrows as f64,
        ),
        (
            "userfaultfd_handovers",
            "counter",
            "Targets that took up userfaultfd themselves; rksm gave its own up first.",
            c.userfaultfd_handovers as f64,
        ),
        (
            "timed_restarts",
            "counter",
            "Timed waits a borrow interrupted, entered again with the time they had left.",
            c.timed_restarts as f64,
        ),
        (
            "rseq_aborts",
            "counter",
            "Borrowed threads inside an rseq critical section, sent to its abort handler.",
            c.rseq_aborts as f64,
        ),
        (
            "eintr_risk",
            "counter",
            "Borrows that may have made a target see EINTR.",
            c.eintr_risk as f64,
        ),
        (
            "cross_domain_merges",
            "counter",
            "KSM frames found mapped in more than one merge domain.",
            c.cross_domain_merges as f64,
        ),
        (
            "cross_domain_unmarked",
            "counter",
            "Pages of targets unmarked because their frame was merged across domains.",
            c.cross_domain_unmarked as f64,
        ),
        (
            "mergeable_outsiders",
            "counter",
            "Processes outside the targets, of another domain, seen marking memory mergeable.",
            c.mergeable_outsiders as f64,
        ),
        (
            "domain_changes",
            "counter",
            "Targets whose merge domain changed, unmarked and placed again.",
            c.domain_changes as f64,
        ),
        (
            "short_of_files",
            "counter",
            "Processes and targets left for a pass because rksm had no file descriptor left.",
            c.short_of_files as f64,
        ),
        (
            "soft_dirty_clears",
            "counter",
            "Clears of targets' soft-dirty bits (each write-protects a whole address space).",
            c.soft_dirty_clears as f64,
        ),
        (
            "soft_dirty_clear_seconds",
            "counter",
            "Time the kernel took to clear targets' soft-dirty bits.",
            c.soft_dirty_clear_seconds,
        ),
        (
            "soft_dirty_clear_races",
            "counter",
            "Passes that read a target whole because one of its faults raced with a clear the tracer could not vouch for.",
            c.soft_dirty_clear_races as f64,
        ),
        (
            "regions_backed_off",
            "gauge",
            "2 MiB regions not marked because their merged pages keep breaking.",
            c.regions_backed_off as f64,
        ),
    ];
    for (name, kind, help, value) in daemon_wide {
        family(name, kind, help, &[(String::new(), value)]);
    }
    let refused: Vec<(String, f64)> = c
        .targets_refused
        .iter()
        .map(|(reason, &n)| (labels(&[("reason", reason)]), n as f64))
        .collect();
    family(
        "targets_refused",
        "counter",
        "Processes refused, by reason.",
        &refused,
    );
    let protected: Vec<(String, f64)> = c
        .write_protect
        .iter()
        .map(|(source, &n)| (labels(&[("source", source)]), n as f64))
        .collect();
    family(
        "targets_write_protected",
        "gauge",
        "Current targets by write-protect source (userfaultfd, soft-dirty, none).",
        &protected,
    );
    // Per target; `None` (the kernel has no ksm_stat for it) leaves the series out.
    type Field = fn(&TargetStatus) -> Option<f64>;
    let per_target_series: [(&str, &str, &str, Field); 9] = [
        (
            "target_pages_volatile",
            "gauge",
            "Pages whose checksum changed since the pass before (last pass).",
            |t| Some(t.counters.pages_volatile as f64),
        ),
        (
            "target_pages_marked",
            "gauge",
            "Pages marked mergeable.",
            |t| Some(t.counters.pages_marked as f64),
        ),
        (
            "target_pages_hashed",
            "counter",
            "Pages read and checksummed.",
            |t| Some(t.counters.pages_hashed as f64),
        ),
        (
            "target_pages_skipped_clean",
            "counter",
            "Pages the dirty source proved clean and were not read.",
            |t| Some(t.counters.pages_skipped_clean as f64),
        ),
        (
            "target_write_faults",
            "counter",
            "Write faults the tracer saw.",
            |t| Some(t.counters.write_faults as f64),
        ),
        (
            "target_cow_breaks",
            "counter",
            "Writes the tracer saw to merged pages.",
            |t| Some(t.counters.cow_breaks as f64),
        ),
        (
            "target_dirty_misses",
            "counter",
            "Written pages the tracer missed and the audit found.",
            |t| Some(t.counters.dirty_misses as f64),
        ),
        (
            "target_ksm_merging_pages",
            "gauge",
            "The kernel's count of the target's pages mapped to KSM pages (/proc/PID/ksm_stat).",
            |t| t.ksm_merging_pages.map(|v| v as f64),
        ),
        (
            "target_ksm_process_profit_bytes",
            "gauge",
            "The kernel's ksm_process_profit for the target, in bytes.",
            |t| t.ksm_process_profit.map(|v| v as f64),
        ),
    ];
    // Per merge domain: sums over its targets. Without the token a domain is its number
    // only: a uid or a cgroup path would say whose processes these are.
    let mut domains: std::collections::BTreeMap<(u32, &str), [f64; 3]> = Default::default();
    for t in &status.targets {
        let sums = domains
            .entry((t.domain_number, t.domain.as_str()))
            .or_default();
        sums[0] += 1.0;
        sums[1] += t.counters.pages_marked as f64;
        sums[2] += t.ksm_merging_pages.unwrap_or(0) as f64;
    }
    {
        for (i, (name, help)) in [
            ("domain_targets", "Targets in the merge domain."),
            (
                "domain_pages_marked",
                "Pages marked mergeable in the domain's targets.",
            ),
            (
                "domain_ksm_merging_pages",
                "The kernel's ksm_merging_pages summed over the domain's targets.",
            ),
        ]
        .into_iter()
        .enumerate()
        {
            let samples: Vec<(String, f64)> = domains
                .iter()
                .map(|((number, name), sums)| {
                    let number = number.to_string();
                    let pairs: &[(&str, &str)] = if per_target {
                        &[("domain", &number), ("name", name)]
                    } else {
                        &[("domain", &number)]
                    };
                    (labels(pairs), sums[i])
                })
                .collect();
            family(name, "gauge", help, &samples);
        }
    }
    if !per_target {
        return out;
    }
    for (name, kind, help, field) in per_target_series {
        let samples: Vec<(String, f64)> = status
            .targets
            .iter()
            .filter_map(|t| {
                let value = field(t)?;
                Some((
                    labels(&[("pid", &t.pid.to_string()), ("comm", &t.comm)]),
                    value,
                ))
            })
            .collect();
        family(name, kind, help, &samples);
    }
    out
}

/// `{a="x",b="y"}` with Prometheus escaping.
fn labels(pairs: &[(&str, &str)]) -> String {
    let inner: Vec<String> = pairs
        .iter()
        .map(|(k, v)| {
            // Prometheus escapes backslash, quote and newline; other control characters
            // are written out so that no reader's terminal sees them.
            let v = printable(v).replace('\\', "\\\\").replace('"', "\\\"");
            format!("{k}=\"{v}\"")
        })
        .collect();
    format!("{{{}}}", inner.join(","))
}

/// Who may see what over HTTP: without `token`, daemon-wide and per-domain series only.
#[derive(Debug, Clone, Default)]
pub struct HttpAccess {
    /// The address to serve `GET /metrics` on.
    pub address: Option<SocketAddr>,
    /// A bearer token (`Authorization: Bearer ...`) that also gets the per-target series.
    pub token: Option<String>,
}

impl HttpAccess {
    /// Reads the token from `path`: one line, in a file owned by rksm's user (root) and
    /// kept from other users (mode 0600 or narrower), or a one-line reason why not. The
    /// checks are made on the file opened, so a file swapped in between is not read; a link
    /// (a Kubernetes secret volume's) is followed to the file it names.
    pub fn read_token(path: &Path) -> Result<String, String> {
        use std::os::unix::fs::MetadataExt;
        let fail = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
        let mut file = std::fs::File::open(path).map_err(|e| fail(&e))?;
        let meta = file.metadata().map_err(|e| fail(&e))?;
        let me = nix::unistd::geteuid().as_raw();
        if meta.uid() != me {
            return Err(fail(&format_args!(
                "the metrics token file must be owned by uid {me}, rksm's user, not uid {} (chown)",
                meta.uid()
            )));
        }
        if meta.mode() & 0o077 != 0 {
            return Err(fail(
                &"the metrics token file must not be readable by group or others (chmod 600)",
            ));
        }
        let mut token = String::new();
        file.read_to_string(&mut token).map_err(|e| fail(&e))?;
        let token = token.trim().to_string();
        if token.len() < 16 || token.contains(char::is_whitespace) {
            return Err(format!(
                "{}: the metrics token must be one word of at least 16 characters",
                path.display()
            ));
        }
        Ok(token)
    }
}

/// How long one client of the status server may take, reading its request and the answer:
/// each client has a thread and a deadline of its own, so a slow one delays nobody else.
pub const CLIENT_DEADLINE: Duration = Duration::from_secs(2);
/// Clients served at once, on the socket and on the HTTP port each; more wait in the
/// listen queue.
const MAX_CLIENTS: usize = 16;

/// Serves the latest [`Status`] from a thread, until dropped.
pub struct StatusServer {
    latest: Arc<Mutex<Status>>,
    stop: Arc<AtomicBool>,
    /// Dropped to wake the accept loop: it sleeps until a client or this.
    waker: Option<UnixStream>,
    thread: Option<JoinHandle<()>>,
    socket: PathBuf,
}

impl StatusServer {
    /// Listens on `socket` (created mode 0600, so only root can connect; a stale socket left
    /// by a dead daemon is replaced, any other file is not) and, if `http.address` is given,
    /// serves metrics over HTTP there.
    pub fn start(socket: &Path, http: HttpAccess) -> Result<Self, StatusError> {
        let listen_err = |what: String| move |source| StatusError::Listen { what, source };
        let sock_err = listen_err(socket.display().to_string());
        if let Some(dir) = socket.parent() {
            std::fs::create_dir_all(dir).map_err(listen_err(dir.display().to_string()))?;
        }
        match std::fs::symlink_metadata(socket) {
            Ok(meta) if meta.file_type().is_socket() => {
                std::fs::remove_file(socket).map_err(listen_err(socket.display().to_string()))?
            }
            Ok(_) => {
                return Err(sock_err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    "exists and is not a socket",
                )))
            }
            Err(_) => {}
        }
        // The socket file takes its mode from the umask at bind: closed to all but root from
        // its first instant. Nothing else runs in rksm while the umask is narrowed.
        use nix::sys::stat::{umask, Mode};
        let old = umask(Mode::from_bits_truncate(0o177));
        let unix = UnixListener::bind(socket);
        umask(old);
        let unix = unix.map_err(sock_err)?;
        unix.set_nonblocking(true)
            .map_err(listen_err(socket.display().to_string()))?;
        let listener = http
            .address
            .map(|addr| {
                let listener = TcpListener::bind(addr).map_err(listen_err(addr.to_string()))?;
                listener
                    .set_nonblocking(true)
                    .map_err(listen_err(addr.to_string()))?;
                Ok::<_, StatusError>(listener)
            })
            .transpose()?;
        let latest = Arc::new(Mutex::new(Status::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (waker, woken) = UnixStream::pair().map_err(listen_err("status thread".into()))?;
        let thread = {
            let (latest, stop) = (latest.clone(), stop.clone());
            let token = http.token;
            std::thread::Builder::new()
                .name("rksm-status".into())
                .spawn(move || serve(&unix, listener.as_ref(), token, &latest, &stop, &woken))
                .map_err(listen_err("status thread".into()))?
        };
        Ok(StatusServer {
            latest,
            stop,
            waker: Some(waker),
            thread: Some(thread),
            socket: socket.into(),
        })
    }

    /// Replaces the status served.
    pub fn publish(&self, status: Status) {
        *self.latest.lock().unwrap_or_else(|p| p.into_inner()) = status;
    }
}

impl Drop for StatusServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Its peer becomes readable (end of file): the accept loop wakes and sees the flag.
        drop(self.waker.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// Accepts clients and hands each to a thread of its own, sleeping until one comes, a
/// paused listener is due, or `woken` says to look at `stop`.
fn serve(
    unix: &UnixListener,
    http: Option<&TcpListener>,
    token: Option<String>,
    latest: &Arc<Mutex<Status>>,
    stop: &AtomicBool,
    woken: &UnixStream,
) {
    // Root's socket and the HTTP port each have their own clients' budget, so that a crowd
    // of HTTP clients cannot keep `rksm status` out.
    let (unix_busy, http_busy) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let token = Arc::new(token);
    let spawn = |busy: &Arc<AtomicUsize>,
                 name: String,
                 work: Box<dyn FnOnce(Status) -> io::Result<()> + Send>| {
        busy.fetch_add(1, Ordering::Relaxed);
        let (mine, latest) = (busy.clone(), latest.clone());
        let spawned = std::thread::Builder::new()
            .name("rksm-status-client".into())
            .spawn(move || {
                // The snapshot is taken, and its live values read, in the client's thread.
                let status = latest
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clone()
                    .read_live();
                if let Err(e) = work(status) {
                    log::debug!("{name}: {e}");
                }
                mine.fetch_sub(1, Ordering::Relaxed);
            });
        if spawned.is_err() {
            busy.fetch_sub(1, Ordering::Relaxed);
        }
    };
    let has_room = |busy: &AtomicUsize| busy.load(Ordering::Relaxed) < MAX_CLIENTS;
    let (mut unix_backoff, mut http_backoff) = (Backoff::default(), Backoff::default());
    while !stop.load(Ordering::Relaxed) {
        // A listener whose clients are all busy is not accepted from: newcomers wait in its
        // listen queue, not closed. Nor is one whose last accept failed (out of files, say),
        // for a while: its queue stays readable, and polling it again at once would spin.
        let now = Instant::now();
        let unix_open = has_room(&unix_busy) && unix_backoff.ready(now);
        let http_open = http.filter(|_| has_room(&http_busy) && http_backoff.ready(now));
        let mut fds = Vec::with_capacity(3);
        fds.push(PollFd::new(woken.as_fd(), PollFlags::POLLIN));
        if unix_open {
            fds.push(PollFd::new(unix.as_fd(), PollFlags::POLLIN));
        }
        if let Some(http) = http_open {
            fds.push(PollFd::new(http.as_fd(), PollFlags::POLLIN));
        }
        // A listener left out because its clients are all busy is looked at again after a
        // while (a client thread ending wakes nobody); one paused, when its pause ends.
        let full = !has_room(&unix_busy) || (http.is_some() && !has_room(&http_busy));
        let wait = [
            unix_backoff.left(now),
            http_backoff.left(now),
            full.then_some(BUSY_POLL),
        ]
        .into_iter()
        .flatten()
        .min();
        let timeout = wait.map_or(PollTimeout::NONE, |w| {
            PollTimeout::try_from(w).unwrap_or(PollTimeout::MAX)
        });
        if poll(&mut fds, timeout).unwrap_or(0) <= 0 {
            continue;
        }
        if fds[0].revents().is_some_and(|r| !r.is_empty()) {
            continue;
        }
        drop(fds);
        if unix_open {
            match unix.accept() {
                Ok((stream, _)) => {
                    unix_backoff.succeeded();
                    spawn(
                        &unix_busy,
                        "status client".into(),
                        Box::new(move |status| answer_unix(stream, &status)),
                    );
                }
                Err(e) => unix_backoff.failed("the status socket", &e),
            }
        }
        if let Some(http) = http_open {
            match http.accept() {
                Ok((stream, peer)) => {
                    http_backoff.succeeded();
                    let token = token.clone();
                    spawn(
                        &http_busy,
                        format!("metrics client {peer}"),
                        Box::new(move |status| answer_http(stream, &status, token.as_deref())),
                    );
                }
                Err(e) => http_backoff.failed("the metrics port", &e),
            }
        }
    }
}

/// How often the accept loop looks again at a listener whose clients were all busy.
const BUSY_POLL: Duration = Duration::from_millis(50);

/// Pauses a listener after a failed accept: 10 ms, doubling up to a second while accepts
/// keep failing.
#[derive(Debug, Default)]
struct Backoff {
    until: Option<Instant>,
    wait: Duration,
}

impl Backoff {
    const FIRST: Duration = Duration::from_millis(10);
    const MOST: Duration = Duration::from_secs(1);

    fn ready(&self, now: Instant) -> bool {
        self.until.is_none_or(|until| now >= until)
    }

    /// How long until the listener is looked at again, while it is paused.
    fn left(&self, now: Instant) -> Option<Duration> {
        self.until
            .filter(|&until| until > now)
            .map(|until| until - now)
    }

    fn succeeded(&mut self) {
        self.until = None;
        self.wait = Duration::ZERO;
    }

    fn failed(&mut self, what: &str, e: &io::Error) {
        // Nothing was waiting after all (another thread took it, or the client left).
        if matches!(
            e.kind(),
            io::ErrorKind::WouldBlock
                | io::ErrorKind::Interrupted
                | io::ErrorKind::ConnectionAborted
        ) {
            return;
        }
        if self.wait.is_zero() {
            log::warn!("accepting on {what}: {e}; pausing it, up to a second at a time, until it works again");
        }
        self.wait = (self.wait * 2).clamp(Self::FIRST, Self::MOST);
        self.until = Some(Instant::now() + self.wait);
    }
}

fn answer_unix(mut stream: UnixStream, status: &Status) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_write_timeout(Some(CLIENT_DEADLINE))?;
    // Only root: the socket's mode says so already; the peer's credentials say it again.
    let peer = nix::sys::socket::getsockopt(&stream, nix::sys::socket::sockopt::PeerCredentials)
        .map_err(io::Error::from)?;
    if peer.uid() != 0 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("uid {} is not root", peer.uid()),
        ));
    }
    let mut body = serde_json::to_vec(status).map_err(io::Error::other)?;
    body.push(b'\n');
    write_by(
        &mut stream,
        &body,
        std::time::Instant::now() + CLIENT_DEADLINE,
    )
}

/// Writes all of `bytes` to `stream` by `deadline`, or fails with `TimedOut`: a client that
/// stops reading holds its thread no longer than that. `stream` must have a write timeout
/// setter, which each write is given as the time left.
fn write_by<S: Write + WriteTimeout>(
    stream: &mut S,
    mut bytes: &[u8],
    deadline: std::time::Instant,
) -> io::Result<()> {
    while !bytes.is_empty() {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "client too slow"));
        }
        stream.set_write_deadline(left)?;
        match stream.write(bytes) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Err(io::Error::new(io::ErrorKind::TimedOut, "client too slow"))
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// A stream whose writes can be bounded in time.
trait WriteTimeout {
    fn set_write_deadline(&self, left: Duration) -> io::Result<()>;
}

impl WriteTimeout for UnixStream {
    fn set_write_deadline(&self, left: Duration) -> io::Result<()> {
        self.set_write_timeout(Some(left))
    }
}

impl WriteTimeout for TcpStream {
    fn set_write_deadline(&self, left: Duration) -> io::Result<()> {
        self.set_write_timeout(Some(left))
    }
}

/// True if `a` equals `b`, in time that does not depend on where they differ.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn answer_http(mut stream: TcpStream, status: &Status, token: Option<&str>) -> io::Result<()> {
    let deadline = std::time::Instant::now() + CLIENT_DEADLINE;
    stream.set_nonblocking(false)?;
    stream.set_write_timeout(Some(CLIENT_DEADLINE))?;
    let mut request = Vec::new();
    let mut buf = [0u8; 1024];
    while !request.windows(4).any(|w| w == b"\r\n\r\n") && request.len() < 8192 {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "request too slow"));
        }
        stream.set_read_timeout(Some(left))?;
        let n = stream.read(&mut buf)?;
        if n == 0 {
            break;
        }
        request.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&request);
    let target = text.split_whitespace().nth(1).unwrap_or("");
    let presented = text.lines().find_map(|l| {
        let (name, value) = l.split_once(':')?;
        name.trim()
            .eq_ignore_ascii_case("authorization")
            .then(|| value.trim().strip_prefix("Bearer ").map(str::trim))?
    });
    let trusted =
        matches!((token, presented), (Some(t), Some(p)) if same_secret(t.as_bytes(), p.as_bytes()));
    let (code, body) = match (text.starts_with("GET "), target) {
        (true, "/metrics") if trusted => ("200 OK", render_metrics(status)),
        (true, "/metrics") => ("200 OK", render_public_metrics(status)),
        (true, _) => ("404 Not Found", "rksm serves /metrics\n".into()),
        (false, _) => ("405 Method Not Allowed", "GET only\n".into()),
    };
    let answer = format!(
        "HTTP/1.1 {code}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    write_by(&mut stream, answer.as_bytes(), deadline)
}

/// Writes the public metrics to `path` for node_exporter's textfile collector: to a
/// temporary file beside it, then renamed over it, so the collector never reads half. The
/// directory may be writable by others (a textfile directory shared with other exporters):
/// the temporary file is created new, never through a link someone planted there (a
/// regular file left by a crash is removed first; anything else is refused), and made
/// readable by all (0644, whatever rksm's umask), since the collector runs as another user.
pub fn write_textfile(path: &Path, status: &Status) -> io::Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let tmp = path.with_extension("prom.tmp");
    match std::fs::symlink_metadata(&tmp) {
        Ok(meta) if meta.file_type().is_file() => std::fs::remove_file(&tmp)?,
        Ok(_) => {
            return Err(io::Error::other(format!(
                "{} exists and is not a regular file; left alone",
                tmp.display()
            )))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW)
        .mode(0o644)
        .open(&tmp)?;
    file.set_permissions(std::fs::Permissions::from_mode(0o644))?;
    file.write_all(render_public_metrics(status).as_bytes())?;
    drop(file);
    std::fs::rename(&tmp, path)
}

/// Asks the daemon listening on `socket` for its status.
pub fn query(socket: &Path) -> Result<Status, StatusError> {
    let not_running = |source| StatusError::NotRunning {
        socket: socket.into(),
        source,
    };
    let mut stream = UnixStream::connect(socket).map_err(|e| {
        if e.kind() == io::ErrorKind::PermissionDenied {
            StatusError::NotAllowed(socket.into())
        } else {
            not_running(e)
        }
    })?;
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(not_running)?;
    let mut reply = Vec::new();
    stream.read_to_end(&mut reply).map_err(not_running)?;
    serde_json::from_slice(&reply).map_err(|e| StatusError::BadReply {
        socket: socket.into(),
        reason: if reply.is_empty() {
            "empty reply (only root may ask)".into()
        } else {
            e.to_string()
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scratch directory of this test's own.
    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("rksm-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn the_textfile_never_follows_a_planted_link_and_others_can_read_it() {
        use std::os::unix::fs::PermissionsExt;
        let dir = scratch("textfile");
        let path = dir.join("rksm.prom");
        let victim = dir.join("victim");
        std::fs::write(&victim, "precious").unwrap();
        // Someone who can write to the directory plants a link where the temporary goes.
        std::os::unix::fs::symlink(&victim, path.with_extension("prom.tmp")).unwrap();
        let refused = write_textfile(&path, &Status::default()).unwrap_err();
        assert!(
            refused.to_string().contains("not a regular file"),
            "{refused}"
        );
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        // A regular file left behind (a crash) is replaced, and the result is 0644 under
        // the unit's umask.
        std::fs::remove_file(path.with_extension("prom.tmp")).unwrap();
        std::fs::write(path.with_extension("prom.tmp"), "half").unwrap();
        // SAFETY: umask only changes this process's file creation mask.
        let old = unsafe { libc::umask(0o077) };
        let written = write_textfile(&path, &Status::default());
        // SAFETY: as above.
        unsafe { libc::umask(old) };
        written.unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o644);
        assert!(std::fs::read_to_string(&path).unwrap().contains("rksm_"));
        assert!(!path.with_extension("prom.tmp").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn sample() -> Status {
        let mut status = Status {
            version: "0.1.0".into(),
            dirty_mode: DirtyMode::Ebpf,
            checksum: "xxh64".into(),
            domain: "uid".into(),
            last_pass: Some(PassSummary {
                number: 3,
                seconds: 0.25,
                ..PassSummary::default()
            }),
            targets: vec![
                TargetStatus {
                    pid: 10,
                    comm: "py\"thon".into(),
                    counters: TargetCounters {
                        pages_marked: 7,
                        pages_hashed: 100,
                        ..TargetCounters::default()
                    },
                    ..TargetStatus::default()
                },
                TargetStatus {
                    pid: 11,
                    comm: "node".into(),
                    counters: TargetCounters {
                        pages_marked: 5,
                        ..TargetCounters::default()
                    },
                    ..TargetStatus::default()
                },
            ],
            ..Status::default()
        };
        status.counters.full_scans = 3;
        status.counters.targets_refused.insert("traced".into(), 2);
        status
    }

    #[test]
    fn a_token_file_of_another_owner_or_readable_by_others_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = scratch("token");
        let token = dir.join("token");
        std::fs::write(&token, "s3cret-token-for-the-test\n").unwrap();
        std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(
            HttpAccess::read_token(&token).as_deref(),
            Ok("s3cret-token-for-the-test")
        );
        // Through a link, as a Kubernetes secret volume has it: the file it names counts.
        let link = dir.join("link");
        std::os::unix::fs::symlink(&token, &link).unwrap();
        assert!(HttpAccess::read_token(&link).is_ok());
        std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o640)).unwrap();
        let open = HttpAccess::read_token(&link).unwrap_err();
        assert!(open.contains("chmod 600"), "{open}");
        if nix::unistd::geteuid().is_root() {
            std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
            std::os::unix::fs::chown(&token, Some(65534), None).unwrap();
            let theirs = HttpAccess::read_token(&token).unwrap_err();
            assert!(
                theirs.contains("must be owned by uid 0") && theirs.contains("not uid 65534"),
                "{theirs}"
            );
        }
    }

    #[test]
    fn an_answer_to_a_client_that_stops_reading_ends_at_its_deadline() {
        let (mut ours, theirs) = UnixStream::pair().unwrap();
        let started = std::time::Instant::now();
        let deadline = started + Duration::from_millis(300);
        // Far more than the socket buffers hold; the peer never reads.
        let body = vec![b'x'; 64 << 20];
        let err = write_by(&mut ours, &body, deadline).unwrap_err();
        let took = started.elapsed();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
        assert!(
            took >= Duration::from_millis(300) && took < Duration::from_secs(2),
            "{took:?}"
        );
        drop(theirs);
    }

    #[test]
    fn metrics_have_the_design_names_per_process_labels_and_types() {
        let text = render_metrics(&sample());
        for line in [
            "# TYPE rksm_full_scans_total counter",
            "rksm_full_scans_total 3",
            "# TYPE rksm_target_pages_marked gauge",
            "rksm_target_pages_marked{pid=\"10\",comm=\"py\\\"thon\"} 7",
            "rksm_target_pages_marked{pid=\"11\",comm=\"node\"} 5",
            "rksm_target_dirty_misses_total{pid=\"11\",comm=\"node\"} 0",
            "# TYPE rksm_target_pages_hashed_total counter",
            "rksm_target_pages_hashed_total{pid=\"10\",comm=\"py\\\"thon\"} 100",
            "rksm_targets_refused_total{reason=\"traced\"} 2",
            "# TYPE rksm_checksum_seconds_total counter",
            "# TYPE rksm_general_profit_bytes gauge",
            "rksm_pass_seconds 0.25",
            "rksm_info{version=\"0.1.0\",dirty_mode=\"ebpf\",checksum=\"xxh64\",domain=\"uid\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "no `{line}` in\n{text}");
        }
        // Every sample belongs to a family announced just before it, and every counter's
        // name ends in `_total`.
        let mut family = "";
        for l in text.lines() {
            if let Some(rest) = l.strip_prefix("# TYPE ") {
                family = rest.split(' ').next().unwrap();
                if rest.ends_with(" counter") {
                    assert!(family.ends_with("_total"), "{l}");
                }
            } else if !l.starts_with('#') {
                let name = l.split(['{', ' ']).next().unwrap();
                assert_eq!(name, family, "{l}");
            }
        }
    }

    #[test]
    fn public_metrics_sum_per_domain_and_name_no_process() {
        let mut status = sample();
        for t in &mut status.targets {
            t.domain = "uid 1000".into();
            t.domain_number = 3;
        }
        status.targets[1].comm = "evil\x1b[2J\nrksm_fake 1".into();
        status.counters.pages_sharing = 5;
        status.counters.pages_hashed = 40;
        status.counters.pages_skipped_clean = 60;
        let text = render_public_metrics(&status);
        assert!(!text.contains("pid=") && !text.contains("comm="), "{text}");
        assert!(
            !text.contains("uid 1000"),
            "the domain's user shows:\n{text}"
        );
        for line in [
            "rksm_full_scans_total 3",
            "rksm_pages_sharing 5",
            "rksm_saved_bytes 20480",
            "rksm_pages_hashed_total 40",
            "rksm_pages_skipped_clean_total 60",
            "rksm_domain_targets{domain=\"3\"} 2",
            "rksm_domain_pages_marked{domain=\"3\"} 12",
        ] {
            assert!(text.lines().any(|l| l == line), "no `{line}` in\n{text}");
        }
        // With the token, the domain's name is there too.
        let full = render_metrics(&status);
        assert!(
            full.lines()
                .any(|l| l == "rksm_domain_targets{domain=\"3\",name=\"uid 1000\"} 2"),
            "{full}"
        );
        // And the full text keeps another user's command name on its own line, escaped.
        let full = render_metrics(&status);
        assert!(!full.contains('\x1b'), "{full}");
        assert!(!full.lines().any(|l| l.starts_with("rksm_fake")), "{full}");
    }

    #[test]
    fn the_socket_serves_the_latest_status_and_refuses_to_clobber_other_files() {
        let dir = std::env::temp_dir().join(format!("rksm-status-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("s.sock");
        let server = StatusServer::start(&socket, HttpAccess::default()).unwrap();
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&socket).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        server.publish(sample());
        let got = query(&socket);
        // Only root gets an answer: as anyone else the reply is empty.
        if nix::unistd::geteuid().is_root() {
            assert_eq!(got.unwrap().counters.full_scans, 3);
        } else {
            assert!(got.is_err());
        }
        drop(server);
        assert!(!socket.exists(), "socket left behind");
        let err = query(&socket).unwrap_err();
        assert!(
            err.to_string().contains("is `rksm daemon` running?"),
            "{err}"
        );

        std::fs::write(&socket, "not a socket").unwrap();
        let err = StatusServer::start(&socket, HttpAccess::default())
            .err()
            .unwrap();
        assert!(err.to_string().contains("not a socket"), "{err}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
