//! `rksm bench`: ksmd against rksm's modes on the same workload, measured side by side.
//!
//! The linux-mm experiment that started rksm measured, per hash function, CoW count,
//! checksum time per page, pages_sharing and pages_unshared. This module reruns it for seven
//! configurations on one machine in one run: ksmd alone at its default pace with the
//! workloads' memory marked mergeable, ksmd paced to sweep that memory in rksm's interval,
//! ksmd steered by the kernel's own advisor (`advisor_mode=scan-time`, what a user would pick
//! instead of rksm), ksmd told only the duplicates (the workloads mark just those: what the
//! merging alone costs ksmd, the floor for rksm, which hands it the same pages), and the
//! rksm daemon in hash-only, pagemap and ebpf mode, each rksm mode with xxh64 and crc32c.
//! Every run starts fresh workloads (`rksm workload`), samples pages_sharing and the CPU
//! time of rksm and of ksmd from /proc ten times a second, and ends by asking every workload
//! to check its own memory. The last 40% of each run is its steady state, reported on its
//! own: what rksm and ksmd cost per minute once merging has settled.

use std::{
    path::{Path, PathBuf},
    time::Instant,
};

use rksm_common::{PAGE, PAGE_SIZE};
use serde::Serialize;

mod machine;
pub mod report;
mod run;
pub mod verdict;

pub use machine::Machine;
pub use report::{markdown, svg};
pub use run::{run_once, settle, BenchError};

use crate::{
    kernel::{
        ksmd::{self, KsmdError, KsmdOwner, KsmdSettings},
        reader::{self, ProcMem},
    },
    tools::{
        guest::GuestImage,
        workload::{Marks, Profile},
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
    /// ksmd alone over only the duplicated and zero-filled pages, which the workloads mark
    /// themselves, paced as the daemon paces it: what merging the duplicates costs ksmd when
    /// finding them costs nothing, the floor under any design that leaves the merge to ksmd.
    KsmdDuplicates,
    /// The rksm daemon in a dirty mode.
    Rksm(&'static str),
}

impl Config {
    /// Takes ksmd over with this ksmd-only configuration's pace: its defaults (100 pages
    /// every 20 ms), or, tuned, sweeping `mergeable_pages` in `sweep_secs`.
    fn own_ksmd(self, mergeable_pages: u64, sweep_secs: f64) -> Result<KsmdOwner, KsmdError> {
        let settings = match self {
            Config::KsmdTuned => ksmd::pace(mergeable_pages, sweep_secs, 20),
            Config::KsmdDuplicates => {
                let daemon = crate::daemon::DaemonConfig::default();
                ksmd::pace(
                    mergeable_pages,
                    daemon.ksmd_sweep.as_secs_f64(),
                    daemon.ksmd_sleep_millisecs,
                )
            }
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
    }

    /// Whether ksmd runs alone in this configuration, over memory the workloads marked.
    fn ksmd_only(self) -> bool {
        !matches!(self, Config::Rksm(_))
    }

    /// What the workloads mark themselves in this configuration.
    fn marks(self) -> Marks {
        match self {
            Config::Rksm(_) => Marks::Nothing,
            Config::KsmdDuplicates => Marks::Duplicates,
            _ => Marks::Everything,
        }
    }

    /// The `mode` column.
    pub fn name(self) -> &'static str {
        match self {
            Config::Ksmd => "ksmd",
            Config::KsmdTuned => "ksmd-tuned",
            Config::KsmdAdvisor => "ksmd-advisor",
            Config::KsmdDuplicates => "ksmd-duplicates",
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
    /// rksm's own part of it, the daemon's CPU until then. Of several runs, the median of
    /// each run's part: the difference of the two medians above may be no run's.
    #[serde(default)]
    pub rksm_cpu_to_90pct: Option<f64>,
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
    typical.rksm_cpu_to_90pct = some(|r| r.rksm_cpu_to_90pct);
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
        (Config::KsmdDuplicates, "xxh64"),
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

/// The order of a bench's runs: `(configuration, repeat)` pairs, the `configurations` taking
/// turns in rounds, each round in the opposite order of the one before: a machine that
/// drifts over the minutes of a bench (a shared virtual machine does) would otherwise bias
/// the comparison against whichever configuration's repeats ran last (docs/BENCHMARKS.md,
/// "How it is run").
pub fn run_order(configurations: usize, repeat: u32) -> Vec<(usize, u32)> {
    let mut order = Vec::with_capacity(configurations * repeat as usize);
    for rep in 1..=repeat {
        let round: Vec<usize> = match rep % 2 {
            1 => (0..configurations).collect(),
            _ => (0..configurations).rev().collect(),
        };
        order.extend(round.into_iter().map(|c| (c, rep)));
    }
    order
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

    #[test]
    fn configurations_take_turns_in_rounds_of_alternating_order() {
        assert_eq!(
            run_order(3, 3),
            vec![
                (0, 1),
                (1, 1),
                (2, 1),
                (2, 2),
                (1, 2),
                (0, 2),
                (0, 3),
                (1, 3),
                (2, 3)
            ]
        );
        // One run of each is the matrix's own order; every configuration runs `repeat` times.
        assert_eq!(run_order(2, 1), vec![(0, 1), (1, 1)]);
        let order = run_order(4, 5);
        for c in 0..4 {
            assert_eq!(order.iter().filter(|(which, _)| *which == c).count(), 5);
        }
        assert!(run_order(0, 3).is_empty());
    }

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
            rksm_cpu_to_90pct: cpu90.map(|c| c * 0.6),
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
    fn rksm_s_part_of_several_runs_is_the_median_of_each_run_s_part() {
        // (rksm + ksmd, ksmd) CPU to 90% in three runs: rksm's parts 0.7, 1.1 and 0.9.
        let runs = [(4.0, 3.3), (4.3, 3.2), (4.6, 3.7)].map(|(cpu, ksmd)| {
            let mut r = run("ebpf", "xxh64", 5, Some(2.0), Some(cpu));
            r.ksmd_cpu_to_90pct = Some(ksmd);
            r.rksm_cpu_to_90pct = Some(cpu - ksmd);
            r
        });
        let m = median_of(runs.to_vec());
        assert_eq!(
            (m.cpu_to_90pct, m.ksmd_cpu_to_90pct),
            (Some(4.3), Some(3.3))
        );
        // Not 4.3 - 3.3, which no run had.
        let own = m.rksm_cpu_to_90pct.expect("rksm's part");
        assert!((own - 0.9).abs() < 1e-9, "{own}");
    }

    #[test]
    fn the_matrix_has_every_mode_with_both_checksums() {
        let m = matrix();
        assert_eq!(m.len(), 11);
        assert!(m.contains(&(Config::KsmdAdvisor, "xxh64")));
        assert!(m.contains(&(Config::KsmdDuplicates, "xxh64")));
        // The workloads of ksmd alone mark their memory themselves; rksm's leave it to rksm.
        assert_eq!(Config::KsmdTuned.marks(), Marks::Everything);
        assert_eq!(Config::KsmdDuplicates.marks(), Marks::Duplicates);
        assert_eq!(Config::Rksm("ebpf").marks(), Marks::Nothing);
        assert!(m.contains(&(Config::Rksm("ebpf"), "crc32c")));
    }
}
