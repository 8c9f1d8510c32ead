//! `rksm bench` and `rksm workload`.

use std::{io::Write, path::PathBuf};

use anyhow::Context;
use clap::Args;
use rksm::{
    service::config::Seconds,
    tools::{
        bench::{self, BenchPlan, RunResult},
        workload::{self, Profile},
    },
};

use super::BadInput;

/// Compare ksmd and rksm's modes on the same workload, side by side, in one run.
///
/// Runs ksmd at its default settings, ksmd paced to sweep in rksm's interval, ksmd steered by
/// the kernel's advisor, ksmd told only the duplicates (the floor of what merging them costs
/// it), and the rksm daemon in hash-only, pagemap and ebpf mode with xxh64 and crc32c, each
/// on fresh workload processes, and reports pages_sharing over time, time and CPU (rksm +
/// ksmd) to 90% of the achievable savings, pages hashed per pass, checksum time, CoW breaks,
/// pages_unshared, and an integrity check of every workload. Needs root and no other rksm
/// daemon running.
#[derive(Debug, Args)]
#[command(
    after_help = "Example:\n  rksm bench --quick\n  rksm bench --profile mixed --repeat 3 --out bench-report --json\n  cargo xtask guest-image && rksm bench --profile guests --guest-initrd target/guest/initrd.cpio --interval 5 --seconds 120"
)]
pub struct BenchArgs {
    /// Workload: quick, static, mixed, static-4g, quarter-4g (25% duplicates), quarter-16g,
    /// alike-4g (static-4g, every page alike where rksm samples), large, guests (qemu guests
    /// that mark their own RAM mergeable; needs --guest-initrd), or a JSON file with the
    /// fields of a profile.
    #[arg(long, value_name = "NAME|FILE")]
    profile: Option<String>,
    /// Small workload, short runs, one repetition: under 3 minutes.
    #[arg(long)]
    quick: bool,
    /// Seconds per run (default 15 with --quick, else 30); ksmd at its default pace runs until
    /// it reaches 90% of the savings, up to 45 s with --quick, else 180 s.
    #[arg(long, value_name = "SECS", value_parser = |s: &str| Seconds::BENCH.parse(s))]
    seconds: Option<f64>,
    /// Seconds between rksm's passes; ksmd-tuned and ksmd-advisor sweep in the same time.
    #[arg(long, value_name = "SECS", default_value = "1", value_parser = |s: &str| Seconds::INTERVAL.parse(s))]
    interval: f64,
    /// The initramfs the guests boot (`cargo xtask guest-image` writes
    /// target/guest/initrd.cpio).
    #[arg(long, value_name = "FILE")]
    guest_initrd: Option<PathBuf>,
    /// The kernel the guests boot [default: the newest /boot/vmlinuz-*].
    #[arg(long, value_name = "FILE", requires = "guest_initrd")]
    guest_kernel: Option<PathBuf>,
    /// Runs per configuration; medians are reported (default 1 with --quick, else 3). The
    /// configurations take turns, in the opposite order every other round.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=20))]
    repeat: Option<u32>,
    /// Write report.md, report.json and pages_sharing.svg here.
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Only these configurations, comma-separated (ksmd, ksmd-tuned, ksmd-advisor,
    /// ksmd-duplicates: ksmd told only the duplicates, hash-only, pagemap, ebpf, ebpf-read:
    /// ebpf reading every new page whole) [default: all].
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    only: Vec<String>,
    /// Print `{"runs":[...]}` instead of the table.
    #[arg(long)]
    json: bool,
    /// Only the rksm rows with this checksum [default: both].
    #[arg(long, value_name = "xxh64|crc32c")]
    checksum: Option<rksm::engine::checksum::ChecksumKind>,
    /// The daemon's write protection in the rksm runs: auto, userfaultfd or soft-dirty
    /// [default: auto].
    #[arg(long, value_name = "SOURCE")]
    write_protect: Option<rksm::engine::dirty::protection::WriteProtectChoice>,
}

pub fn run_bench(args: BenchArgs) -> anyhow::Result<()> {
    let profile_arg = args
        .profile
        .clone()
        .unwrap_or_else(|| if args.quick { "quick" } else { "mixed" }.into());
    let profile = Profile::load(&profile_arg).map_err(|e| BadInput(e.to_string()))?;
    // Workloads are started by name or path: make a file path absolute for them.
    let profile_arg = match std::fs::canonicalize(&profile_arg) {
        Ok(path) if Profile::named(&profile_arg).is_none() => path.display().to_string(),
        _ => profile_arg,
    };
    let guest = match &args.guest_initrd {
        Some(initrd) => Some(
            rksm::tools::guest::GuestImage::new(initrd, args.guest_kernel.as_deref())
                .map_err(|e| BadInput(e.to_string()))?,
        ),
        None if profile.is_guests() => {
            return Err(BadInput(format!(
                "profile `{profile_arg}` runs qemu guests: pass --guest-initrd (build it with `cargo xtask guest-image`)"
            ))
            .into())
        }
        None => None,
    };
    let plan = BenchPlan {
        profile: profile.clone(),
        run_seconds: args.seconds.unwrap_or(if args.quick { 15.0 } else { 30.0 }),
        interval: args.interval,
        rksm: std::env::current_exe().context("locating the rksm binary")?,
        repeat: args.repeat.unwrap_or(if args.quick { 1 } else { 3 }),
        ksmd_default_cap: if args.quick { 45.0 } else { 180.0 },
        guest,
        write_protect: args.write_protect.map(|w| w.to_string()),
    };
    let mut names: Vec<&str> = bench::matrix().iter().map(|(c, _)| c.name()).collect();
    names.dedup();
    if let Some(bad) = args.only.iter().find(|o| !names.contains(&o.as_str())) {
        return Err(BadInput(format!(
            "--only: unknown configuration `{bad}` (expected {})",
            names.join(", ")
        ))
        .into());
    }
    // The memory's speed, what the first pass is held to, measured before the workloads run
    // (guests are judged on the whole run only).
    let memory = (!profile.is_guests()).then(bench::memory_speed);
    let machine = bench::Machine::this();
    log::info!("bench: on {}", machine.line());
    if let Some(m) = memory {
        log::info!(
            "bench: memcpy {:.1} GB/s, process_vm_readv {}",
            m.memcpy_gbps,
            m.process_vm_readv_gbps
                .map_or("not measured".into(), |r| format!("{r:.1} GB/s"))
        );
    }
    let mut chosen = Vec::new();
    for (config, checksum) in bench::matrix() {
        if !args.only.is_empty() && !args.only.iter().any(|o| o == config.name()) {
            continue;
        }
        // A guest marks all its RAM itself: there are no duplicates to tell ksmd of.
        if profile.is_guests() && matches!(config, bench::Config::KsmdDuplicates) {
            continue;
        }
        // ksmd's rows use the kernel's own checksum, whatever is asked.
        let ksmd = !matches!(config, bench::Config::Rksm(_));
        if args
            .checksum
            .is_some_and(|c| !ksmd && c.to_string() != checksum)
        {
            continue;
        }
        chosen.push((config, checksum));
    }
    let mut runs: Vec<Vec<RunResult>> = chosen.iter().map(|_| Vec::new()).collect();
    for (which, rep) in bench::run_order(chosen.len(), plan.repeat) {
        let (config, checksum) = chosen[which];
        log::info!(
            "bench: {} {checksum}, run {rep}/{}",
            config.name(),
            plan.repeat
        );
        let run = bench::run_once(&plan, &profile_arg, config, checksum)
            .map_err(|e| anyhow::anyhow!("{} {checksum}: {e}", config.name()))?;
        // Each run's own, for the spread the medians hide.
        if let Some(cpu) = run.cpu_to_90pct {
            let part = |p: Option<f64>| p.map_or("-".to_string(), |p| format!("{p:.2}"));
            log::info!(
                "bench: {} {checksum}, run {rep}: {cpu:.2} CPU s to 90% of the savings (ksmd {}, rksm {})",
                config.name(),
                part(run.ksmd_cpu_to_90pct),
                part(run.rksm_cpu_to_90pct)
            );
        }
        runs[which].push(run);
    }
    let results: Vec<RunResult> = runs.into_iter().map(bench::median_of).collect();
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let table = bench::markdown(&results, &profile, &command, &machine, memory);
    let report = serde_json::json!({
        "runs": results,
        "machine": machine,
        "memcpy_gbps": memory.map(|m| m.memcpy_gbps),
        "process_vm_readv_gbps": memory.and_then(|m| m.process_vm_readv_gbps),
    });
    if let Some(dir) = &args.out {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        std::fs::write(dir.join("report.md"), &table)?;
        std::fs::write(
            dir.join("report.json"),
            serde_json::to_string_pretty(&report)?,
        )?;
        std::fs::write(dir.join("pages_sharing.svg"), bench::svg(&results))?;
        log::info!("bench: report written to {}", dir.display());
    }
    let mut out = std::io::stdout().lock();
    if args.json {
        serde_json::to_writer(&mut out, &report)?;
        writeln!(out)?;
    } else {
        write!(out, "{table}")?;
    }
    if results.iter().any(|r| !r.integrity_ok) {
        anyhow::bail!("a workload's memory changed during the benchmark");
    }
    Ok(())
}

/// Run one benchmark workload process (rksm bench starts these).
///
/// Fills its memory per the profile (duplicate pages identical across processes, zeros,
/// unique pages, volatile pages rewritten at the profile's rate, pages shared with a forked
/// child), prints `ready`, then answers `verify` with `ok` or `mismatch PAGE`, until `exit`
/// or end of input.
#[derive(Debug, Args)]
#[command(after_help = "Example:\n  echo verify | rksm workload --profile quick --index 0")]
pub struct WorkloadArgs {
    /// quick, static, mixed, static-4g, quarter-4g, quarter-16g, alike-4g, large, or a JSON
    /// profile file.
    #[arg(long, value_name = "NAME|FILE", default_value = "quick")]
    profile: String,
    /// Which process of the profile this is (unique contents depend on it).
    #[arg(long, default_value_t = 0)]
    index: u32,
    /// Mark the memory MADV_MERGEABLE (for ksmd-only runs).
    #[arg(long)]
    mergeable: bool,
    /// Mark only the duplicated and zero-filled memory MADV_MERGEABLE (ksmd told where the
    /// duplicates are).
    #[arg(long, conflicts_with = "mergeable")]
    mark_duplicates: bool,
}

pub fn run_workload(args: WorkloadArgs) -> anyhow::Result<()> {
    let profile = Profile::load(&args.profile).map_err(|e| BadInput(e.to_string()))?;
    if profile.is_guests() {
        return Err(BadInput(format!(
            "profile `{}` is made of qemu guests, which `rksm bench` starts itself",
            args.profile
        ))
        .into());
    }
    let marks = match (args.mergeable, args.mark_duplicates) {
        (true, _) => workload::Marks::Everything,
        (_, true) => workload::Marks::Duplicates,
        _ => workload::Marks::Nothing,
    };
    workload::serve(&profile, args.index, marks).context("workload")
}
