//! What the daemon tells operators: the status model (counters, the last pass, each
//! target), served on a unix socket and, with a token, over HTTP (`server`), read back by
//! `rksm status` (`client`), and rendered as Prometheus text (`metrics`).
//!
//! The model is one serde type, so the socket's JSON, `rksm status --json` and the metrics
//! all say the same thing; the server holds a snapshot the daemon replaces after each pass,
//! so answering a client never waits for a pass.

use std::{io, path::PathBuf};

use serde::{Deserialize, Serialize};

use rksm_common::PAGE_SIZE;

use crate::{
    daemon::{unix_time, Daemon, DaemonStats, DirtyMode, PassSummary},
    engine::{
        heap,
        target::{Target, TargetCounters},
    },
    kernel::procfs::KsmStat,
};

pub use crate::kernel::procfs::printable;

mod client;
mod metrics;
mod server;

pub use client::query;
pub use metrics::{render_metrics, render_public_metrics, write_textfile};
pub use server::{HttpAccess, StatusServer, CLIENT_DEADLINE};

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

/// rksm's resident memory.
fn own_resident_bytes() -> i64 {
    heap::resident_bytes().map_or(0, |bytes| bytes as i64)
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
            counters: target.counters().clone(),
            ..TargetStatus::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{os::unix::net::UnixStream, time::Duration};

    use super::server::write_by;
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
            HttpAccess::read_token(&token).unwrap(),
            "s3cret-token-for-the-test"
        );
        // Through a link, as a Kubernetes secret volume has it: the file it names counts.
        let link = dir.join("link");
        std::os::unix::fs::symlink(&token, &link).unwrap();
        assert!(HttpAccess::read_token(&link).is_ok());
        std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o640)).unwrap();
        let open = HttpAccess::read_token(&link).unwrap_err().to_string();
        assert!(open.contains("chmod 600"), "{open}");
        if nix::unistd::geteuid().is_root() {
            std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
            std::os::unix::fs::chown(&token, Some(65534), None).unwrap();
            let theirs = HttpAccess::read_token(&token).unwrap_err().to_string();
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
