//! `rksm estimate`.

use std::{
    io::{self, IsTerminal, Write},
    time::{Duration, Instant},
};

use clap::Args;
use rksm::{
    engine::{
        checksum::ChecksumKind,
        dirty::{HashOnly, Lent},
        scan::{PageCounts, PassReport, Progress, ScanConfig, Scanner},
        target::Target,
    },
    kernel::{procfs::printable, remote::Borrower},
    service::config::Seconds,
};
use serde_json::{json, Value};

use super::{targets::TargetArgs, BadInput};

/// Estimate how much merging would save, without changing anything.
///
/// Reads the private anonymous memory of the targets for a few passes and reports, per
/// process and in total, how many present pages are zero, duplicates of another page (what
/// merging would free), unique, volatile (changed between passes, so KSM would not merge
/// them yet) or already shared, and the ten most duplicated contents. Nothing is written to
/// any target: memory is only read, with process_vm_readv.
#[derive(Debug, Args)]
#[command(
    after_help = "Example:\n  rksm estimate --comm '^python' --min-age 60\n  rksm estimate --cgroup system.slice/workers.service --passes 3 --interval 5 --json"
)]
pub struct EstimateArgs {
    #[command(flatten)]
    targets: TargetArgs,
    /// Passes to run; the checksum gate needs two to tell stable pages from volatile ones.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=1000))]
    passes: u32,
    /// Seconds between passes.
    #[arg(long, value_name = "SECS", default_value_t = 1.0, value_parser = |s: &str| Seconds::ESTIMATE.parse(s))]
    interval: f64,
    /// Checksum for the gate.
    #[arg(long, value_name = "xxh64|crc32c", default_value = "xxh64")]
    checksum: ChecksumKind,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    json: bool,
}

pub fn run(args: EstimateArgs) -> anyhow::Result<()> {
    // Each process read holds files open; the hard limit is what the user allows.
    if let Err(e) = rksm::kernel::limits::raise_open_files() {
        log::debug!("open files: the soft limit could not be raised: {e}");
    }
    let selection = args.targets.resolve()?;
    if selection.processes.is_empty() {
        return Err(BadInput("no process matches the given targets".into()).into());
    }
    let config = ScanConfig {
        checksum: args.checksum,
        report_top: true,
        ..ScanConfig::default()
    };
    let mut scanner = Scanner::new(config, Box::new(HashOnly))?;
    let mut targets: Vec<Target> = selection.processes.into_iter().map(Target::new).collect();
    let show_progress = io::stderr().is_terminal();
    let mut report = PassReport::default();
    for pass in 1..=args.passes {
        if pass > 1 {
            std::thread::sleep(Duration::from_secs_f64(args.interval));
        }
        let mut last_drawn = Instant::now();
        let mut bar = |p: Progress| {
            if show_progress && last_drawn.elapsed() >= Duration::from_millis(100) {
                last_drawn = Instant::now();
                let pct = p.pages_done as f64 * 100.0 / p.pages_total.max(1) as f64;
                eprint!(
                    "\rpass {pass}/{}: {pct:5.1}% of {} MiB",
                    args.passes,
                    p.pages_total / 256
                );
            }
        };
        // A hash-only scan arms nothing, so it borrows no thread.
        report = scanner.pass(
            &mut targets,
            &mut Lent::borrower(&Borrower::new()),
            &mut bar,
        );
        if show_progress {
            eprint!("\r\x1b[K");
        }
        for (pid, why) in &report.failed {
            log::warn!("pid {pid} could not be scanned: {why}");
        }
        for pid in &report.exited {
            log::info!("pid {pid} exited during pass {pass}; its pages are not counted");
        }
        if !report.short_of_files.is_empty() {
            log::warn!(
                "{} process(es) could not be scanned in pass {pass}: out of file descriptors (raise `ulimit -n`); their pages are not counted",
                report.short_of_files.len()
            );
        }
    }
    let mut out = io::stdout().lock();
    if args.json {
        serde_json::to_writer(&mut out, &to_json(&report, &args))?;
        writeln!(out)?;
    } else {
        print_tables(&mut out, &report, &args)?;
    }
    Ok(())
}

fn counts_json(counts: &PageCounts) -> Value {
    let mut value = serde_json::to_value(counts).expect("plain struct");
    value["savings_mib"] = json!((counts.savings_mib() * 100.0).round() / 100.0);
    value
}

fn to_json(report: &PassReport, args: &EstimateArgs) -> Value {
    let processes: Vec<Value> = report
        .processes
        .iter()
        .map(|p| {
            let mut v = counts_json(&p.counts);
            v["pid"] = json!(p.pid);
            v["comm"] = json!(p.comm);
            v
        })
        .collect();
    let top: Vec<Value> = report
        .top
        .iter()
        .map(|t| json!({"checksum": format!("{:016x}", t.checksum), "copies": t.copies, "zero": t.zero, "pids": t.pids}))
        .collect();
    json!({
        "total": counts_json(&report.total),
        "processes": processes,
        "top_duplicates": top,
        "exited": report.exited,
        "passes": args.passes,
        "checksum": args.checksum.to_string(),
        "checksum_ns_per_page": report.total.checksum_ns.checked_div(report.total.pages_hashed).unwrap_or(0),
        "seconds": report.seconds,
    })
}

fn print_tables(out: &mut impl Write, report: &PassReport, args: &EstimateArgs) -> io::Result<()> {
    writeln!(
        out,
        "{:>8}  {:<16} {:>10} {:>8} {:>10} {:>9} {:>9} {:>9} {:>12}",
        "PID",
        "COMM",
        "SCANNED",
        "ZERO",
        "DUPLICATE",
        "UNIQUE",
        "VOLATILE",
        "SHARED",
        "SAVINGS_MiB"
    )?;
    let row = |out: &mut dyn Write, pid: &str, comm: &str, c: &PageCounts| {
        writeln!(
            out,
            "{pid:>8}  {comm:<16} {:>10} {:>8} {:>10} {:>9} {:>9} {:>9} {:>12.1}",
            c.scanned_pages,
            c.zero_pages,
            c.duplicate_pages,
            c.unique_pages,
            c.volatile_pages,
            c.already_shared_pages,
            c.savings_mib()
        )
    };
    for p in &report.processes {
        row(out, &p.pid.to_string(), &printable(&p.comm), &p.counts)?;
    }
    row(out, "", "TOTAL", &report.total)?;
    writeln!(
        out,
        "\n{} pass(es) with {}; the last took {:.2} s. Would save {:.1} MiB.",
        args.passes,
        args.checksum,
        report.seconds,
        report.total.savings_mib()
    )?;
    if !report.top.is_empty() {
        writeln!(out, "\nMost duplicated contents:")?;
        for (i, t) in report.top.iter().enumerate() {
            let pids: Vec<String> = t.pids.iter().map(u32::to_string).collect();
            let what = if t.zero {
                "zero page".to_string()
            } else {
                format!("{:016x}", t.checksum)
            };
            writeln!(
                out,
                "{:>3}. {:>8} copies  {what:<17} pids {}",
                i + 1,
                t.copies,
                pids.join(", ")
            )?;
        }
    }
    Ok(())
}
