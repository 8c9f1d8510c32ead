//! The status as Prometheus text: every series, with per-target series only where asked for
//! (the HTTP endpoint with its token), and the textfile for node_exporter.

use std::fmt::Write as _;
use std::io::{self, Write as _};
use std::path::Path;

use super::{Status, TargetStatus};
use crate::kernel::procfs::printable;

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
