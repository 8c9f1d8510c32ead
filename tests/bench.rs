//! `rksm workload` and `rksm bench` end to end, on a tiny profile.

use std::{
    io::{BufRead, BufReader, Write},
    process::Stdio,
};

use rksm_tests::{ksm_turn, require_root, rksm_command, with_hostile_host_config, PAGE};

fn tiny_profile(test: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!(
        "rksm-tiny-profile-{}-{test}.json",
        std::process::id()
    ));
    std::fs::write(
        &path,
        r#"{"processes": 2, "duplicate_mib": 2, "zero_mib": 1, "unique_mib": 1, "volatile_mib": 1,
            "volatile_pages_per_sec": 200, "same_value_percent": 50, "fork_mib": 1}"#,
    )
    .unwrap();
    path
}

#[test]
fn a_workload_verifies_its_own_memory_while_it_writes() {
    require_root();
    let profile = tiny_profile("workload");
    let mut workload = rksm_command()
        .args([
            "workload",
            "--profile",
            profile.to_str().unwrap(),
            "--index",
            "1",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = workload.stdin.take().unwrap();
    let mut stdout = BufReader::new(workload.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "ready");
    for _ in 0..3 {
        writeln!(stdin, "verify").unwrap();
        line.clear();
        stdout.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "ok");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // Its memory is really its own: changing a byte behind its back is caught.
    let pid = workload.id();
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let big = maps
        .lines()
        .filter(|l| l.ends_with(" 0 ") || l.trim_end().ends_with(" 0"))
        .filter_map(|l| {
            let (s, e) = l.split_whitespace().next()?.split_once('-')?;
            Some((
                u64::from_str_radix(s, 16).ok()?,
                u64::from_str_radix(e, 16).ok()?,
            ))
        })
        .find(|(s, e)| e - s == 6 << 20)
        .expect("the workload's 6 MiB mapping");
    scribble(pid, big.0 + PAGE * 10);
    writeln!(stdin, "verify").unwrap();
    line.clear();
    stdout.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "mismatch 10");
    writeln!(stdin, "exit").unwrap();
    assert!(workload.wait().unwrap().success());
    std::fs::remove_file(profile).unwrap();
}

#[test]
fn a_workload_told_to_mark_its_duplicates_marks_exactly_them() {
    require_root();
    let profile = tiny_profile("marks");
    let mut workload = rksm_command()
        .args(["workload", "--profile", profile.to_str().unwrap()])
        .arg("--mark-duplicates")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = workload.stdin.take().unwrap();
    let mut stdout = BufReader::new(workload.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "ready");
    // The kernel's own account: the VMAs flagged mergeable (`mg`) in smaps.
    let smaps = std::fs::read_to_string(format!("/proc/{}/smaps", workload.id())).unwrap();
    let mut vmas: Vec<(u64, u64, bool)> = Vec::new();
    for l in smaps.lines() {
        if let Some((range, _)) = l.split_once(' ') {
            if let Some((s, e)) = range.split_once('-') {
                if let (Ok(s), Ok(e)) = (u64::from_str_radix(s, 16), u64::from_str_radix(e, 16)) {
                    vmas.push((s, e, false));
                    continue;
                }
            }
        }
        if let Some(flags) = l.strip_prefix("VmFlags:") {
            let last = vmas.last_mut().expect("flags follow their VMA");
            last.2 = flags.split_whitespace().any(|f| f == "mg");
        }
    }
    let marked: Vec<_> = vmas.iter().filter(|v| v.2).collect();
    // 2 MiB duplicated and 1 MiB of zeros, at the start of its one 6 MiB mapping.
    assert_eq!(marked.len(), 1, "{vmas:x?}");
    let (start, end, _) = *marked[0];
    assert_eq!(end - start, 3 << 20, "{vmas:x?}");
    let rest = vmas
        .iter()
        .find(|v| v.0 == end)
        .expect("the rest of the mapping follows");
    assert_eq!(rest.1 - rest.0, 3 << 20, "{vmas:x?}");
    writeln!(stdin, "verify").unwrap();
    line.clear();
    stdout.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "ok");
    writeln!(stdin, "exit").unwrap();
    assert!(workload.wait().unwrap().success());
    std::fs::remove_file(profile).unwrap();
}

/// Changes one byte of the test's own workload through /proc/PID/mem (root only), to check
/// that its self-verification notices.
fn scribble(pid: u32, addr: u64) {
    use std::os::unix::fs::FileExt;
    let mem = std::fs::OpenOptions::new()
        .write(true)
        .open(format!("/proc/{pid}/mem"))
        .unwrap();
    mem.write_at(&[0xAA], addr).unwrap();
}

#[test]
fn bench_compares_every_configuration_and_checks_integrity() {
    require_root();
    let _turn = ksm_turn();
    let profile = tiny_profile("bench");
    let out = std::env::temp_dir().join(format!("rksm-bench-out-{}", std::process::id()));
    // On a host whose /etc/rksm/rksm.toml would change everything if bench read it.
    let mut bench = rksm_command();
    bench.args([
        "bench",
        "--quick",
        "--seconds",
        "3",
        "--json",
        "--profile",
        profile.to_str().unwrap(),
        "--out",
    ]);
    bench.arg(&out);
    let output = with_hostile_host_config(&bench).output().unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let runs = json["runs"].as_array().unwrap();
    let rows: Vec<(String, String)> = runs
        .iter()
        .map(|r| {
            (
                r["mode"].as_str().unwrap().to_string(),
                r["checksum"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    for mode in ["hash-only", "pagemap", "ebpf"] {
        for checksum in ["xxh64", "crc32c"] {
            assert!(
                rows.contains(&(mode.to_string(), checksum.to_string())),
                "{rows:?}"
            );
        }
    }
    for mode in ["ksmd", "ksmd-tuned", "ksmd-advisor", "ksmd-duplicates"] {
        assert!(
            rows.contains(&(mode.to_string(), "xxh64".to_string())),
            "{rows:?}"
        );
    }
    // ksmd told only the duplicates merges them: 2 processes x 512 duplicate pages.
    let told = runs
        .iter()
        .find(|r| r["mode"] == "ksmd-duplicates")
        .unwrap();
    assert!(told["pages_sharing"].as_u64().unwrap() >= 512, "{told}");
    for run in runs {
        let rksm_row = !run["mode"].as_str().unwrap().starts_with("ksmd");
        for key in ["pages_sharing", "pages_hashed", "pages_unshared"] {
            assert!(run[key].is_u64(), "{key} is not a count in {run}");
        }
        for key in ["cpu_seconds", "ksmd_cpu_seconds"] {
            let seconds = run[key].as_f64();
            assert!(
                seconds.is_some_and(|s| s.is_finite() && s >= 0.0),
                "{key} in {run}"
            );
        }
        // Reached within the run, or not at all (null).
        assert!(
            run["seconds_to_90pct"].is_null()
                || run["seconds_to_90pct"]
                    .as_f64()
                    .is_some_and(|s| s > 0.0 && s < 60.0),
            "{run}"
        );
        // Copy-on-write breaks are counted by rksm's tracer: in rksm rows only.
        assert_eq!(run["cow_breaks"].is_u64(), rksm_row, "{run}");
        assert_eq!(run["integrity_ok"], true, "{run}");
        // ksmd's part of the CPU to 90% is reported with it: all of it in the ksmd rows.
        if let Some(cpu) = run["cpu_to_90pct"].as_f64() {
            let ksmd = run["ksmd_cpu_to_90pct"].as_f64().expect("ksmd's part");
            assert!((0.0..=cpu).contains(&ksmd), "{run}");
            if run["mode"].as_str().unwrap().starts_with("ksmd") {
                assert_eq!(ksmd, cpu, "{run}");
            }
        }
    }
    // The machine the figures belong to, read off this one.
    let machine = &json["machine"];
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    assert_eq!(machine["kernel"], release.trim(), "{machine}");
    assert!(
        machine["cpus"].as_u64().is_some_and(|n| n >= 1),
        "{machine}"
    );
    assert!(
        machine["memory_gib"].as_f64().is_some_and(|g| g > 0.0),
        "{machine}"
    );
    assert!(machine["xxh64_side_by_side"].is_boolean(), "{machine}");
    // The first pass's speed, next to the machine's memcpy.
    assert!(
        json["memcpy_gbps"].as_f64().is_some_and(|g| g > 0.0),
        "no memcpy speed"
    );
    // And the copy out of an address space every read of a page makes, the pass's ceiling.
    assert!(
        json["process_vm_readv_gbps"]
            .as_f64()
            .is_some_and(|g| g > 0.0),
        "no process_vm_readv speed"
    );
    for run in runs
        .iter()
        .filter(|r| !r["mode"].as_str().unwrap().starts_with("ksmd"))
    {
        assert!(
            run["first_pass_gbps"].as_f64().is_some_and(|g| g > 0.0),
            "{run}"
        );
    }
    // Pages hashed per pass come from the daemon's status, whatever its logs look like:
    // hash-only hashes every page of both processes every pass (2 x 1536, less the zero page
    // mappings and what is shared with the forked children).
    for run in runs.iter().filter(|r| r["mode"] == "hash-only") {
        assert!(run["pages_hashed"].as_u64().unwrap() >= 1024, "{run}");
    }
    // The rksm modes merged the duplicates: 2 processes x 512 duplicate pages.
    let ebpf = runs.iter().find(|r| r["mode"] == "ebpf").unwrap();
    assert!(ebpf["pages_sharing"].as_u64().unwrap() >= 512, "{ebpf}");
    for file in ["report.md", "report.json", "pages_sharing.svg"] {
        assert!(out.join(file).exists(), "{file} not written");
    }
    // The report ends with a line per goal, judged, for reference, or not measured.
    let report = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(
        report.contains(&format!(
            "Machine: {}",
            machine["cpu_model"].as_str().unwrap()
        )),
        "{report}"
    );
    for goal in ["(a)", "(b)", "(c)", "(d)", "(e)", "(f)"] {
        assert!(
            report
                .lines()
                .any(|l| l.starts_with("- ") && l.contains(goal)),
            "no verdict on {goal} in {report}"
        );
    }
    std::fs::remove_dir_all(out).unwrap();
    std::fs::remove_file(profile).unwrap();
}
