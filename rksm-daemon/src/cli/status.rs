//! `rksm status`.

use std::{io::Write, path::PathBuf, time::SystemTime};

use clap::Args;
use rksm::{
    daemon::{mib, unix_time},
    kernel::procfs::printable,
    service::{
        config::ConfigFile,
        status::{query, render_metrics, Status, DEFAULT_SOCKET},
    },
};

/// Show what the running daemon is doing: its modes, counters, last pass and targets.
///
/// Asks the daemon over its root-only socket; nothing is stopped or changed.
#[derive(Debug, Args)]
#[command(
    after_help = "Example:\n  sudo rksm status\n  sudo rksm status --json | jq .counters.pages_sharing\n  sudo rksm status --metrics > /var/lib/node_exporter/textfile/rksm.prom"
)]
pub struct StatusArgs {
    /// Print the status as one JSON object.
    #[arg(long, conflicts_with = "metrics")]
    json: bool,
    /// Print Prometheus text exposition.
    #[arg(long)]
    metrics: bool,
    /// The daemon's socket [default: the configuration file's, else /run/rksm/rksm.sock].
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Configuration file, for its `socket` key [default: /etc/rksm/rksm.toml, if it exists].
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,
}

pub fn run(args: StatusArgs, file: &ConfigFile) -> anyhow::Result<()> {
    let socket = args
        .socket
        .or_else(|| file.socket.clone())
        .unwrap_or_else(|| DEFAULT_SOCKET.into());
    let status = query(&socket)?;
    let mut out = std::io::stdout().lock();
    if args.json {
        serde_json::to_writer(&mut out, &status)?;
        writeln!(out)?;
    } else if args.metrics {
        out.write_all(render_metrics(&status).as_bytes())?;
    } else {
        out.write_all(human(&status, SystemTime::now()).as_bytes())?;
    }
    Ok(())
}

fn human(s: &Status, now: SystemTime) -> String {
    let now = unix_time(now);
    let c = &s.counters;
    let mut text = format!(
        "rksm {} (pid {}), up {:.0} s: --dirty {} --checksum {} --domain {}\n",
        s.version,
        s.daemon_pid,
        (now - s.started_unix).max(0.0),
        s.dirty_mode,
        s.checksum,
        s.domain
    );
    match &s.last_pass {
        Some(p) => text += &format!(
            "last pass: #{} ended {:.1} s ago, took {:.3} s: {} targets, hashed {} skipped {} pages, {} duplicates, marked {} runs\n",
            p.number,
            (now - p.ended_unix).max(0.0),
            p.seconds,
            p.targets,
            p.pages_hashed,
            p.pages_skipped_clean,
            p.duplicates,
            p.runs_marked
        ),
        None => text += "last pass: none yet\n",
    }
    text += &format!(
        "merged: {} pages sharing {} KSM pages ({:.1} MiB saved, {:.1} MiB net of rksm's own memory); {} marked; {} unshared\n\
         all passes: {} full scans, hashed {} pages, skipped {} clean, {:.1} ms in checksums; {} write faults ({} lost), {} cow breaks, {} remote syscalls in {} borrows ({} may have caused an EINTR, {} aborted an rseq section)\n",
        c.pages_sharing,
        c.pages_shared,
        mib(c.pages_sharing),
        s.general_profit as f64 / (1024.0 * 1024.0),
        c.pages_marked,
        c.pages_unshared,
        c.full_scans,
        c.pages_hashed,
        c.pages_skipped_clean,
        c.checksum_ns as f64 / 1e6,
        c.write_faults,
        c.tracer_lost,
        c.cow_breaks,
        c.remote_syscalls,
        c.borrows,
        c.eintr_risk,
        c.rseq_aborts
    );
    if !c.targets_refused.is_empty() {
        let refused: Vec<String> = c
            .targets_refused
            .iter()
            .map(|(reason, n)| format!("{n} {reason}"))
            .collect();
        text += &format!("refused: {}\n", refused.join(", "));
    }
    if c.domain_changes + c.mergeable_outsiders + c.cross_domain_checks > 0 {
        text += &format!(
            "domains: {} targets moved domain, {} outsiders marking their own memory; {} KSM frames found merged across domains in {} looks ({:.1} ms), {} target pages unmarked for it\n",
            c.domain_changes,
            c.mergeable_outsiders,
            c.cross_domain_merges,
            c.cross_domain_checks,
            c.cross_domain_check_ns as f64 / 1e6,
            c.cross_domain_unmarked
        );
    }
    if !c.write_protect.is_empty() {
        let sources: Vec<String> = c
            .write_protect
            .iter()
            .map(|(source, n)| format!("{n} {source}"))
            .collect();
        text += &format!("write protection: {}", sources.join(", "));
        if c.soft_dirty_clears > 0 {
            text += &format!(
                "; {} soft-dirty clears ({:.1} ms in the kernel, {} raced with a fault)",
                c.soft_dirty_clears,
                c.soft_dirty_clear_seconds * 1e3,
                c.soft_dirty_clear_races
            );
        }
        text += "\n";
    }
    if let Some(run) = c.ksmd_taken_back {
        text += &format!("ksmd: run set to {run} by someone else; rksm no longer paces it\n");
    }
    // One row format for the header and the targets. MERGED: the process's pages mapped to
    // KSM pages, as the kernel's /proc/PID/ksm_stat says.
    macro_rules! row {
        ($($field:expr),*) => {
            format!("{:>8} {:<16} {:>9} {:>9} {:>12} {:>12} {:>9} {:>7} {:>7}  {:<11} {}\n", $($field),*)
        };
    }
    text += "\n";
    text += &row!(
        "PID",
        "COMM",
        "MERGED",
        "MARKED",
        "HASHED",
        "SKIPPED",
        "FAULTS",
        "COW",
        "MISSES",
        "PROTECTION",
        "DOMAIN"
    );
    for t in &s.targets {
        text += &row!(
            t.pid,
            printable(&t.comm),
            t.ksm_merging_pages.map_or("-".into(), |n| n.to_string()),
            t.counters.pages_marked,
            t.counters.pages_hashed,
            t.counters.pages_skipped_clean,
            t.counters.write_faults,
            t.counters.cow_breaks,
            t.counters.dirty_misses,
            t.write_protect,
            printable(&t.domain)
        );
    }
    // Why each target has its source, once per distinct reason.
    let mut reasons: Vec<(&str, &str, Vec<u32>)> = Vec::new();
    for t in &s.targets {
        match reasons
            .iter_mut()
            .find(|(source, why, _)| *source == t.write_protect && *why == t.write_protect_why)
        {
            Some((_, _, pids)) => pids.push(t.pid),
            None => reasons.push((&t.write_protect, &t.write_protect_why, vec![t.pid])),
        }
    }
    if !reasons.is_empty() {
        text += "\n";
    }
    for (source, why, pids) in reasons {
        let pids: Vec<String> = pids.iter().map(u32::to_string).collect();
        text += &format!("{source} for pid {}: {}\n", pids.join(", "), printable(why));
    }
    text
}
