//! Torture: many processes with writers at different rates, rksm merging them in each dirty
//! mode, every process checking its own memory all along. Zero mismatches allowed.
//!
//! Short by default (a few seconds per mode); `RKSM_TORTURE_SECS=600 cargo xtask test --
//! --test torture` runs the long form.

use std::{
    process::Stdio,
    time::{Duration, Instant},
};

use rksm::tools::workload::{Marks, WorkloadProcess};
use rksm_tests::{ksm_turn, require_root, rksm_command};

/// A profile with writers at `rate` pages per second, half of them rewriting the same value
/// (copy-on-write breaks of merged pages: the volatile pages start identical in every
/// workload, so some are merged before they are rewritten), half changing it.
fn profile(rate: u64) -> std::path::PathBuf {
    let path =
        std::env::temp_dir().join(format!("rksm-torture-{}-{rate}.json", std::process::id()));
    let json = format!(
        r#"{{"processes": 1, "duplicate_mib": 4, "zero_mib": 1, "unique_mib": 2, "volatile_mib": 4,
            "volatile_pages_per_sec": {rate}, "same_value_percent": 50, "fork_mib": 1,
            "volatile_identical": true}}"#
    );
    std::fs::write(&path, json).unwrap();
    path
}

#[test]
fn memory_stays_exact_under_random_writers_in_every_mode() {
    require_root();
    let _turn = ksm_turn();
    let seconds: f64 = std::env::var("RKSM_TORTURE_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(6.0);
    let rates = [10, 200, 1000, 5000, 20_000, 100, 3000, 50];
    let profiles: Vec<_> = rates.iter().map(|&r| profile(r)).collect();
    for mode in ["hash-only", "pagemap", "ebpf"] {
        let mut workloads: Vec<WorkloadProcess> = profiles
            .iter()
            .enumerate()
            .map(|(i, p)| {
                WorkloadProcess::start(
                    &rksm_tests::built_binary("rksm"),
                    p.to_str().unwrap(),
                    i as u32,
                    Marks::Nothing,
                )
                .unwrap()
            })
            .collect();
        let mut cmd = rksm_command();
        cmd.args([
            "daemon",
            "--dirty",
            mode,
            "--interval",
            "0.2",
            "--duration",
            &seconds.to_string(),
            "--json",
        ]);
        for w in &workloads {
            cmd.args(["--pid", &w.pid().to_string()]);
        }
        let rksm = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let started = Instant::now();
        let mut checks = 0;
        while started.elapsed() < Duration::from_secs_f64(seconds) {
            for (i, w) in workloads.iter_mut().enumerate() {
                let answer = w.verify();
                assert_eq!(
                    answer, "ok",
                    "{mode}: workload {i} (writes {}/s) found its memory changed",
                    rates[i]
                );
                checks += 1;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let output = rksm.wait_with_output().unwrap();
        assert!(output.status.success(), "{mode}: rksm failed");
        let stats: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
        for (i, w) in workloads.iter_mut().enumerate() {
            assert_eq!(w.verify(), "ok", "{mode}: workload {i} after the run");
        }
        assert!(
            checks > workloads.len(),
            "{mode}: verified only {checks} times"
        );
        assert!(
            stats["pages_sharing"].as_u64().unwrap() > 0,
            "{mode}: nothing merged: {stats}"
        );
        assert!(
            stats["full_scans"].as_u64().unwrap() >= 3,
            "{mode}: {stats}"
        );
        // The writers did break merged pages, and the tracer saw it (it loads in every mode,
        // for this accounting): the run tested what it claims to.
        assert!(
            stats["cow_breaks"].as_u64().unwrap() > 0,
            "{mode}: no copy-on-write break of a merged page: {stats}"
        );
        eprintln!(
            "torture {mode}: {seconds} s, {checks} whole-memory checks by the workloads, 0 mismatches; {} passes, pages_sharing {}, cow_breaks {}, pages_hashed {}, pages_skipped_clean {}",
            stats["full_scans"], stats["pages_sharing"], stats["cow_breaks"], stats["pages_hashed"], stats["pages_skipped_clean"]
        );
    }
    for p in profiles {
        std::fs::remove_file(p).unwrap();
    }
}
