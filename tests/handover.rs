//! A target's own userfaultfd always works: rksm write-protects targets with a userfaultfd of
//! its own making, a VMA belongs to one userfaultfd at a time, and a target that registers
//! one over memory rksm holds (qemu's postcopy migration and background snapshots, CRIU's lazy
//! restore) must still succeed, whether it registers seconds later or at once.

use std::{process::Stdio, time::Duration};

use rksm::kernel::userfaultfd;
use rksm_tests::{
    final_json, ksm_turn, require_root, rksm_command, wait_for, Region, Running, TestChild,
};

/// `rksm daemon` write-protecting the processes called `name` with userfaultfd.
fn daemon_over(name: &str) -> Running {
    let mut command = rksm_command();
    command
        .args(["--log-level", "warn"])
        .args([
            "daemon",
            "--comm",
            &format!("^{name}$"),
            "--interval",
            "0.2",
        ])
        .args(["--dirty", "pagemap", "--write-protect", "userfaultfd"])
        .args(["--socket", &format!("/run/rksm-test-{name}.sock"), "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    Running::spawn(&mut command)
}

/// The VmFlags of the VMA holding `region` in `pid`.
fn vm_flags(pid: u32, region: Region) -> Vec<String> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap_or_default();
    let mut inside = false;
    for line in smaps.lines() {
        let bounds = line
            .split_whitespace()
            .next()
            .and_then(|r| r.split_once('-'))
            .and_then(|(a, b)| {
                Some((
                    u64::from_str_radix(a, 16).ok()?,
                    u64::from_str_radix(b, 16).ok()?,
                ))
            });
        if let Some((start, end)) = bounds {
            inside = (start..end).contains(&region.base);
        } else if let (true, Some(flags)) = (inside, line.strip_prefix("VmFlags:")) {
            return flags.split_whitespace().map(String::from).collect();
        }
    }
    Vec::new()
}

/// Waits until the daemon over `name` counted `n` handovers (a pass after the last).
fn wait_for_handovers(name: &str, n: usize) {
    let socket = format!("/run/rksm-test-{name}.sock");
    let handovers = || {
        let output = rksm_command()
            .args(["status", "--json", "--socket", &socket])
            .output()
            .expect("rksm status");
        serde_json::from_slice::<serde_json::Value>(&output.stdout)
            .ok()
            .and_then(|json| json["counters"]["userfaultfd_handovers"].as_u64())
    };
    assert!(
        wait_for(Duration::from_secs(30), || handovers() == Some(n as u64)),
        "handovers: {:?}, expected {n}",
        handovers()
    );
}

/// Whether this kernel lets rksm write-protect with userfaultfd at all.
fn userfaultfd_offered() -> bool {
    let offered = userfaultfd::supported();
    if !offered {
        eprintln!("skipped: no asynchronous userfaultfd write protection on this kernel");
    }
    offered
}

/// `n` children called `name`, each with 8 pages of one content.
fn children(n: usize, name: &str) -> Vec<(TestChild, Region)> {
    (0..n)
        .map(|_| {
            let mut child = TestChild::spawn();
            child.command(&format!("name {name}"));
            let region = child.map(8);
            child.write(region, 0, 8, 31);
            (child, region)
        })
        .collect()
}

#[test]
fn a_target_that_registers_its_own_userfaultfd_seconds_later_gets_it_in_either_mode() {
    require_root();
    if !userfaultfd_offered() {
        return;
    }
    let _turn = ksm_turn();
    let name = "rksm-uffdlate";
    let mut targets = children(2, name);
    let daemon = daemon_over(name);
    for (child, region) in &targets {
        assert!(
            wait_for(Duration::from_secs(30), || vm_flags(child.pid(), *region)
                .contains(&"uw".to_string())),
            "rksm did not write-protect pid {}",
            child.pid()
        );
    }
    // Armed for a while, as a VM is before its migration starts.
    std::thread::sleep(Duration::from_secs(2));
    for ((child, region), (mode, flag)) in targets.iter_mut().zip([("wp", "uw"), ("missing", "um")])
    {
        assert_eq!(
            child.command(&format!("ownuffd 0 {mode}")),
            "ownuffd ok",
            "{mode}"
        );
        assert!(
            vm_flags(child.pid(), *region).contains(&flag.to_string()),
            "{mode}: {:?}",
            vm_flags(child.pid(), *region)
        );
    }
    wait_for_handovers(name, 2);
    let output = daemon.stop();
    let json = final_json(&output);
    assert_eq!(json["userfaultfd_handovers"], 2, "{json}");
    // rksm no longer write-protects them; their own registrations stand after it left.
    assert_eq!(json["write_protect"]["none"], 2, "{json}");
    for ((child, region), flag) in targets.iter().zip(["uw", "um"]) {
        assert!(vm_flags(child.pid(), *region).contains(&flag.to_string()));
    }
}

/// Registers `targets`' regions with their own userfaultfds, one process at a time, each the
/// moment it has created its userfaultfd (half in each mode); returns the failures.
fn register_one_by_one(targets: &mut [(TestChild, Region)], round: usize) -> Vec<String> {
    let mut failed = Vec::new();
    for (i, (child, region)) in targets.iter_mut().enumerate() {
        assert!(
            wait_for(Duration::from_secs(60), || vm_flags(child.pid(), *region)
                .contains(&"uw".to_string())),
            "rksm never write-protected pid {}: the registration would prove nothing",
            child.pid()
        );
        let mode = if i % 2 == 0 { "wp" } else { "missing" };
        match child.command(&format!("ownuffd 0 {mode}")).as_str() {
            "ownuffd ok" => {}
            other => failed.push(format!(
                "round {round}: pid {} ({mode}): {other}",
                child.pid()
            )),
        }
    }
    failed
}

#[test]
fn a_thousand_programs_registering_the_moment_they_create_a_userfaultfd_all_succeed() {
    require_root();
    if !userfaultfd_offered() {
        return;
    }
    let _turn = ksm_turn();
    let name = "rksm-uffdnow";
    let daemon = daemon_over(name);
    const ROUNDS: usize = 10;
    const PER_ROUND: usize = 100;
    let mut failed = Vec::new();
    for round in 0..ROUNDS {
        let mut targets = children(PER_ROUND, name);
        failed.extend(register_one_by_one(&mut targets, round));
    }
    eprintln!(
        "{} registrations, each at once after its userfaultfd was created: {} failed",
        ROUNDS * PER_ROUND,
        failed.len(),
    );
    assert!(failed.is_empty(), "{} failed: {failed:?}", failed.len());
    wait_for_handovers(name, ROUNDS * PER_ROUND);
    let json = final_json(&daemon.stop());
    assert_eq!(
        json["userfaultfd_handovers"],
        (ROUNDS * PER_ROUND) as u64,
        "{json}"
    );
}

/// A measurement, not a check: `PER_ROUND` targets that all register within the same few
/// milliseconds (each the moment it sees rksm's registration). Each is held at the entry of
/// its `UFFDIO_REGISTER` until rksm gave its userfaultfd up; on a kernel without involuntary
/// preemption, when every CPU holds such a thread, rksm's own thread cannot run until a hold
/// reaches its bound, and those registrations fail. Run with
/// `cargo test --release -p rksm-tests --test handover -- --ignored --nocapture`.
#[test]
#[ignore = "a measurement of a bound, see docs/security.md"]
fn measure_registrations_that_all_come_at_once() {
    require_root();
    if !userfaultfd_offered() {
        return;
    }
    let _turn = ksm_turn();
    let name = "rksm-uffdburst";
    let daemon = daemon_over(name);
    const ROUNDS: usize = 10;
    const PER_ROUND: usize = 100;
    let (mut ok, mut failed, mut not_armed) = (0, 0, 0);
    for _ in 0..ROUNDS {
        let mut targets = children(PER_ROUND, name);
        for (i, (child, _)) in targets.iter_mut().enumerate() {
            let mode = if i % 2 == 0 { "wp" } else { "missing" };
            child.send(&format!("raceuffd 0 {mode} 60000"));
        }
        for (child, _) in &mut targets {
            match child.reply().as_str() {
                "raceuffd ok" => ok += 1,
                "raceuffd notarmed" => not_armed += 1,
                _ => failed += 1,
            }
        }
    }
    drop(daemon);
    eprintln!(
        "{} targets, {PER_ROUND} at a time registering together on {} CPUs: {ok} succeeded, {failed} failed (EBUSY), {not_armed} never armed",
        ROUNDS * PER_ROUND,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    assert_eq!(ok + failed + not_armed, ROUNDS * PER_ROUND);
}
