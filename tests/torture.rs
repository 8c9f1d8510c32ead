//! Torture: many processes with writers at different rates, rksm merging them in each dirty
//! mode, every process checking its own memory all along. Zero mismatches allowed.
//!
//! Short by default (a few seconds per mode); `RKSM_TORTURE_SECS=600 cargo xtask test --
//! --test torture` runs the long form.

use std::{
    io::{BufRead, BufReader, Write},
    process::{Child, ChildStdin, ChildStdout, Stdio},
    time::{Duration, Instant},
};

use rksm_tests::{require_root, rksm_command};

struct Workload {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Workload {
    fn start(profile: &std::path::Path, index: u32) -> Workload {
        let mut child = rksm_command()
            .args([
                "workload",
                "--profile",
                profile.to_str().unwrap(),
                "--index",
                &index.to_string(),
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "ready");
        Workload {
            child,
            stdin,
            stdout,
        }
    }

    fn verify(&mut self) -> String {
        writeln!(self.stdin, "verify").unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        line.trim().to_string()
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A profile with writers at `rate` pages per second, half of them rewriting the same value
/// (copy-on-write breaks of merged pages), half changing it.
fn profile(rate: u64) -> std::path::PathBuf {
    let path =
        std::env::temp_dir().join(format!("rksm-torture-{}-{rate}.json", std::process::id()));
    let json = format!(
        r#"{{"processes": 1, "duplicate_mib": 4, "zero_mib": 1, "unique_mib": 2, "volatile_mib": 4,
            "volatile_pages_per_sec": {rate}, "same_value_percent": 50, "fork_mib": 1}}"#
    );
    std::fs::write(&path, json).unwrap();
    path
}

#[test]
fn memory_stays_exact_under_random_writers_in_every_mode() {
    require_root();
    let seconds: f64 = std::env::var("RKSM_TORTURE_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(6.0);
    let rates = [10, 200, 1000, 5000, 20_000, 100, 3000, 50];
    let profiles: Vec<_> = rates.iter().map(|&r| profile(r)).collect();
    for mode in ["hash-only", "pagemap", "ebpf"] {
        let mut workloads: Vec<Workload> = profiles
            .iter()
            .enumerate()
            .map(|(i, p)| Workload::start(p, i as u32))
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
            cmd.args(["--pid", &w.child.id().to_string()]);
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
    }
    for p in profiles {
        std::fs::remove_file(p).unwrap();
    }
}
