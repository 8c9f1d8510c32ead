//! A host's worth of targets under the limits a service gets: the shipped unit sets its own
//! `LimitNOFILE`, but a daemon started by hand, or under another service manager, gets the
//! soft limit of 1024 open files, and rksm holds files for each target.

use std::{
    os::unix::process::CommandExt,
    process::Stdio,
    time::{Duration, Instant},
};

use rksm::kernel::limits;
use rksm_tests::{
    fd_count, final_json, ksm_merging_pages, ksm_pages, ksm_turn, require_root, rksm_command,
    wait_for, Region, Running, TestChild,
};

/// Pages each target holds, the same content in every one.
const PAGES: u64 = 4;

/// `n` children named `name`, each holding [`PAGES`] pages of one content.
fn named_twins(n: usize, name: &str, seed: u64) -> Vec<(TestChild, Region)> {
    (0..n)
        .map(|_| {
            let mut child = TestChild::spawn();
            child.command(&format!("name {name}"));
            let region = child.map(PAGES);
            child.write(region, 0, PAGES, seed);
            (child, region)
        })
        .collect()
}

/// `rksm daemon` over the processes called `name`, started with an open-files limit of
/// `soft` (and `hard`, if given; else the test's own hard limit).
fn daemon_over(name: &str, soft: u64, hard: Option<u64>) -> Running {
    let mut command = rksm_command();
    // Warnings only: a line per target would fill the pipe, which is read at the end.
    command
        .args(["--log-level", "warn"])
        .args(["daemon", "--comm", &format!("^{name}$"), "--interval", "1"])
        .args(["--socket", &format!("/run/rksm-test-{name}.sock"), "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: setrlimit is async-signal-safe, and the closure touches nothing else.
    unsafe {
        command.pre_exec(move || {
            let mut limit = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            limit.rlim_cur = soft;
            limit.rlim_max = hard.unwrap_or(limit.rlim_max);
            match libc::setrlimit(libc::RLIMIT_NOFILE, &limit) {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            }
        });
    }
    Running::spawn(&mut command)
}

/// The test holds two pipes per child: it needs a soft limit above that.
fn room_for_children(n: usize) {
    let raised = limits::raise_open_files().expect("getrlimit");
    assert!(
        raised.now as usize > 2 * n + 64,
        "this test needs {} open files (the hard limit is {})",
        2 * n + 64,
        raised.now
    );
}

/// User and system CPU seconds the thread of `pid` called `name` has used, from its stat.
fn thread_cpu_seconds(pid: u32, name: &str) -> f64 {
    let task = std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("task dir")
        .flatten()
        .map(|t| t.path())
        .find(|t| std::fs::read_to_string(t.join("comm")).is_ok_and(|c| c.trim() == name))
        .unwrap_or_else(|| panic!("no thread {name} in pid {pid}"));
    let stat = std::fs::read_to_string(task.join("stat")).expect("stat");
    let after_comm = &stat[stat.rfind(')').expect("comm") + 2..];
    let fields: Vec<&str> = after_comm.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of stat, 12 and 13 after the comm.
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    // SAFETY: sysconf has no preconditions.
    ticks as f64 / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64
}

#[test]
fn a_thousand_targets_under_a_soft_limit_of_1024_are_all_adopted_and_merged() {
    require_root();
    let _turn = ksm_turn();
    const TARGETS: usize = 1000;
    room_for_children(TARGETS);
    let children = named_twins(TARGETS, "rksm-thousand", 93);
    let daemon = daemon_over("rksm-thousand", 1024, None);
    let started = Instant::now();
    // Cheap to poll (a program's own heap may have duplicates too); the pages themselves are
    // checked at the end.
    let merged = wait_for(Duration::from_secs(300), || {
        children
            .iter()
            .all(|(child, _)| ksm_merging_pages(child.pid()) >= PAGES)
    });
    let seconds = started.elapsed().as_secs_f64();
    let fds = fd_count(daemon.id());
    // Started at 1024, it raised its own soft limit to the hard one.
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", daemon.id())).unwrap();
    let soft: u64 = limits
        .lines()
        .find_map(|l| l.strip_prefix("Max open files"))
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
        .expect("Max open files in /proc/PID/limits");
    let output = daemon.stop();
    let stderr = String::from_utf8_lossy(&output.stderr);
    let unmerged = children
        .iter()
        .filter(|(child, region)| ksm_pages(child.pid(), *region, PAGES).len() as u64 != PAGES)
        .count();
    assert!(
        merged && unmerged == 0,
        "{unmerged} of {TARGETS} targets not merged after {seconds:.0} s: {stderr}"
    );
    let json = final_json(&output);
    assert_eq!(json["targets_refused"], serde_json::json!({}), "{stderr}");
    assert_eq!(json["short_of_files"], 0, "{stderr}");
    assert!(soft > 1024, "the soft limit stayed at {soft}");
    // What rksm holds per target, as docs/operations.md states it: three files at most,
    // plus what a pass and the service hold.
    assert!(
        fds <= 3 * TARGETS + 200,
        "rksm held {fds} files for {TARGETS} targets"
    );
    for (mut child, region) in children {
        assert!(child.verify(region, 0, PAGES, 93), "contents changed");
    }
}

#[test]
fn running_out_of_files_leaves_targets_for_a_pass_and_refuses_none() {
    require_root();
    let _turn = ksm_turn();
    // A hard limit below what the targets need: rksm cannot raise its way out.
    const TARGETS: usize = 200;
    room_for_children(TARGETS);
    let children = named_twins(TARGETS, "rksm-fewfiles", 94);
    let daemon = daemon_over("rksm-fewfiles", 256, Some(256));
    // Some are merged all the same: the files left go to passes before write protection.
    let some_merged = wait_for(Duration::from_secs(120), || {
        children
            .iter()
            .filter(|(child, region)| ksm_pages(child.pid(), *region, PAGES).len() as u64 == PAGES)
            .count()
            >= 16
    });
    let output = daemon.stop();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(some_merged, "nothing merged: {stderr}");
    let json = final_json(&output);
    assert_eq!(json["targets_refused"], serde_json::json!({}), "{stderr}");
    assert!(
        json["short_of_files"].as_u64().unwrap_or(0) > 0,
        "never short of files with {TARGETS} targets under 256: {json}"
    );
    assert!(
        stderr.contains("out of file descriptors") && stderr.contains("LimitNOFILE"),
        "{stderr}"
    );
    for (mut child, region) in children {
        assert!(child.verify(region, 0, PAGES, 94), "contents changed");
    }
}

/// Sets the soft open-files limit of running process `pid`, its hard limit left as it is.
fn set_open_files(pid: u32, soft: u64) {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: prlimit with no new limit writes the current one into `limit`.
    let r = unsafe {
        libc::prlimit(
            pid as libc::pid_t,
            libc::RLIMIT_NOFILE,
            std::ptr::null(),
            &mut limit,
        )
    };
    assert_eq!(r, 0, "prlimit: {}", std::io::Error::last_os_error());
    limit.rlim_cur = soft;
    // SAFETY: prlimit reads `limit` and writes nothing (no old-limit pointer).
    let r = unsafe {
        libc::prlimit(
            pid as libc::pid_t,
            libc::RLIMIT_NOFILE,
            &limit,
            std::ptr::null_mut(),
        )
    };
    assert_eq!(r, 0, "prlimit: {}", std::io::Error::last_os_error());
}

#[test]
fn the_status_server_pauses_while_it_cannot_accept_and_answers_after() {
    require_root();
    let _turn = ksm_turn();
    let children = named_twins(4, "rksm-nofiles", 95);
    let daemon = daemon_over("rksm-nofiles", 1024, None);
    let socket = "/run/rksm-test-rksm-nofiles.sock";
    // This daemon's own answer, not the file alone: a socket left behind by a daemon that
    // was killed is in place until this one replaces it.
    assert!(
        wait_for(Duration::from_secs(30), || status_of(socket)
            .is_some_and(|s| s["daemon_pid"] == daemon.id())),
        "no status from this daemon on {socket}"
    );
    // No file can be opened, whatever it closes: a new fd is the lowest free number, and
    // none is below 3. The next accept fails with EMFILE.
    set_open_files(daemon.id(), 3);
    let mut client = std::os::unix::net::UnixStream::connect(socket).expect("connecting");
    // Measured over a fixed window: what is asked is how much it spins meanwhile.
    let before = thread_cpu_seconds(daemon.id(), "rksm-status");
    std::thread::sleep(Duration::from_secs(3));
    let spent = thread_cpu_seconds(daemon.id(), "rksm-status") - before;
    // Room again: the client waiting in the queue is answered.
    set_open_files(daemon.id(), 1024);
    client
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut answer = String::new();
    let read = std::io::Read::read_to_string(&mut client, &mut answer);
    let output = daemon.stop();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        spent < 0.3,
        "the status server used {spent:.2} CPU s in 3 s with a client it could not accept: {stderr}"
    );
    assert!(
        stderr.contains("accepting on the status socket"),
        "{stderr}"
    );
    assert!(
        read.is_ok() && answer.contains("\"daemon_pid\""),
        "no status once files were free again ({read:?}): {answer}"
    );
    let json = final_json(&output);
    assert_eq!(json["targets_refused"], serde_json::json!({}), "{stderr}");
    drop(children);
}

/// `rksm status --json` of the daemon listening on `socket`, if it answers.
fn status_of(socket: &str) -> Option<serde_json::Value> {
    let output = rksm_command()
        .args(["status", "--json", "--socket", socket])
        .output()
        .ok()?;
    output
        .status
        .success()
        .then(|| serde_json::from_slice(&output.stdout).ok())
        .flatten()
}

/// A measurement, not a check: rksm over many small processes (`RKSM_SCALE_TARGETS`,
/// 10,000 by default; each 4 pages, the same in all), under this process's hard limit on
/// open files: targets adopted, first and steady pass, rksm's resident memory. Run with
/// `cargo test --release -p rksm-tests --test scale -- --ignored --nocapture`.
#[test]
#[ignore = "a measurement over thousands of processes, not a check"]
fn measure_many_small_processes() {
    require_root();
    let _turn = ksm_turn();
    let n: usize = std::env::var("RKSM_SCALE_TARGETS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let hard = limits::raise_open_files().expect("getrlimit").now;
    let started = Instant::now();
    let mut children: Vec<std::process::Child> = (0..n)
        .map(|_| {
            std::process::Command::new(rksm_tests::built_binary("rksm-testchild"))
                .arg(format!("map {PAGES}; write 0 0 {PAGES} 96; name rksm-many"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .spawn()
                .expect("spawning rksm-testchild")
        })
        .collect();
    let named = |c: &std::process::Child| {
        std::fs::read_to_string(format!("/proc/{}/comm", c.id()))
            .is_ok_and(|comm| comm.trim() == "rksm-many")
    };
    assert!(
        wait_for(Duration::from_secs(600), || children.iter().all(named)),
        "the children did not all start"
    );
    eprintln!(
        "{n} processes ready in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let socket = "/run/rksm-test-rksm-many.sock";
    let daemon = daemon_over("rksm-many", hard, None);
    let pid = daemon.id();
    let mut last = serde_json::Value::Null;
    let settled = wait_for(Duration::from_secs(900), || {
        if let Some(status) = status_of(socket) {
            last = status;
        }
        last["last_pass"]["number"].as_u64().unwrap_or(0) >= 6
    });
    let rss = rksm_tests::proc_status(pid, "VmRSS:");
    let peak = rksm_tests::proc_status(pid, "VmHWM:");
    let fds = fd_count(pid);
    let output = daemon.stop();
    for child in &mut children {
        let _ = child.kill();
        let _ = child.wait();
    }
    assert!(
        settled,
        "no sixth pass: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let json = final_json(&output);
    eprintln!(
        "{n} processes, hard limit {hard} open files: {} targets in the last pass, first pass {:.2} s ({} pages hashed), steady pass {:.3} s; rksm resident {rss}, peak {peak}; {fds} files open; pages_sharing {}; short of files {}; refused {}",
        last["last_pass"]["targets"],
        json["first_pass_seconds"].as_f64().unwrap_or(0.0),
        json["first_pass_pages"],
        last["last_pass"]["seconds"].as_f64().unwrap_or(0.0),
        json["pages_sharing"],
        json["short_of_files"],
        json["targets_refused"],
    );
}
