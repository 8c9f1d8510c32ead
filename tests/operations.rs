//! rksm as operators run it: the configuration file, `rksm status` over its socket and as
//! Prometheus metrics, logs, completions and man pages, and the systemd unit's capabilities.
//!
//! Every scenario runs the real `rksm` binary on real child processes. One daemon at a time.

use std::{
    io::{Read, Write},
    net::TcpStream,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    time::{Duration, Instant},
};

use rksm_tests::{
    ksm_pages, ksm_turn, proc_status, require_root, rksm_command, twins, wait_for,
    with_hostile_host_config, Running, TestChild, PAGE,
};

/// A scratch directory for one test, removed at the end.
struct Scratch(PathBuf);

impl Scratch {
    fn new(test: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("rksm-ops-{}-{test}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    fn file(&self, name: &str, text: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn rksm(args: &[&str]) -> Output {
    rksm_command().args(args).output().unwrap()
}

fn json_stdout(output: &Output) -> serde_json::Value {
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("one JSON object on stdout")
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Stops a daemon started in the background with SIGTERM and returns what it printed.

#[test]
fn the_configuration_file_sets_the_daemon_and_flags_win_over_it() {
    require_root();
    let _turn = ksm_turn();
    let dir = Scratch::new("config");
    let mut child = TestChild::spawn();
    let r = child.map(8);
    child.write(r, 0, 8, 3);
    let pid = child.pid().to_string();
    let config = dir.file(
        "rksm.toml",
        &format!(
            "pid = [{pid}]\ndirty = \"hash-only\"\npasses = 2\ninterval = 0.1\njson = true\nsocket = \"{}\"\n",
            dir.path("s.sock").display()
        ),
    );
    let config = config.to_str().unwrap();

    let json = json_stdout(&rksm(&["daemon", "--config", config]));
    assert_eq!(json["dirty_mode"], "hash-only");
    assert_eq!(json["full_scans"], 2);

    let json = json_stdout(&rksm(&[
        "daemon", "--config", config, "--dirty", "pagemap", "--passes", "1",
    ]));
    assert_eq!(json["dirty_mode"], "pagemap", "--dirty did not win");
    assert_eq!(json["full_scans"], 1, "--passes did not win");

    // Targets on the command line replace the file's.
    let gone = dir.file(
        "gone.toml",
        "pid = [4194305]\npasses = 1\njson = true\ndirty = \"hash-only\"\n",
    );
    let output = rksm(&["daemon", "--config", gone.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
    assert!(stderr(&output).contains("4194305"), "{}", stderr(&output));
    let json = json_stdout(&rksm(&[
        "daemon",
        "--config",
        gone.to_str().unwrap(),
        "--pid",
        &pid,
    ]));
    assert_eq!(json["full_scans"], 1);
    assert!(child.verify(r, 0, 8, 3));
}

#[test]
fn a_bad_configuration_file_gets_one_line_naming_it_and_status_2() {
    require_root();
    let dir = Scratch::new("badconfig");
    let missing = dir.path("missing.toml");
    let unknown = dir.file("unknown.toml", "dirty = \"ebpf\"\nintervall = 2\n");
    let bad_value = dir.file("value.toml", "# tuning\n\ndomain = \"tenant\"\n");
    let not_toml = dir.file("garbage.toml", "[[[\n");
    let bad_type = dir.file("type.toml", "passes = \"many\"\n");
    for (args, says) in [
        (
            vec!["daemon", "--config", missing.to_str().unwrap(), "--all"],
            format!("{}: no such configuration file", missing.display()),
        ),
        (
            vec!["status", "--config", missing.to_str().unwrap()],
            format!("{}: no such configuration file", missing.display()),
        ),
        (
            vec!["daemon", "--config", unknown.to_str().unwrap(), "--all"],
            format!("{}: line 2: unknown field `intervall`", unknown.display()),
        ),
        (
            vec!["run", "--config", bad_value.to_str().unwrap(), "--", "true"],
            format!(
                "{}: line 3: unknown merge domain `tenant`",
                bad_value.display()
            ),
        ),
        (
            vec!["daemon", "--config", not_toml.to_str().unwrap(), "--all"],
            format!("{}: line 1: ", not_toml.display()),
        ),
        (
            vec!["daemon", "--config", bad_type.to_str().unwrap(), "--all"],
            format!("{}: line 1: invalid type", bad_type.display()),
        ),
    ] {
        let output = rksm(&args);
        let err = stderr(&output);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(&says), "{args:?}: expected {says:?} in {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

/// Sockets of `pid` that listen on TCP (from /proc/net/tcp{,6}: state 0A).
fn tcp_listeners_of(pid: u32) -> usize {
    let mine: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
        })
        .collect();
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|f| std::fs::read_to_string(f).ok())
        .flat_map(|t| t.lines().skip(1).map(str::to_string).collect::<Vec<_>>())
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.get(3) == Some(&"0A") && f.get(9).is_some_and(|i| mine.iter().any(|m| m == i))
        })
        .count()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn http_get(port: u16, path: &str) -> String {
    http_get_with(port, path, "")
}

/// GET `path` with extra header lines `headers` (each ending in CRLF).
fn http_get_with(port: u16, path: &str, headers: &str) -> String {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\n{headers}\r\n"
    )
    .unwrap();
    let mut reply = String::new();
    stream.read_to_string(&mut reply).unwrap();
    reply
}

fn status_json(socket: &Path) -> Option<serde_json::Value> {
    let output = rksm(&["status", "--json", "--socket", socket.to_str().unwrap()]);
    output
        .status
        .success()
        .then(|| serde_json::from_slice(&output.stdout).unwrap())
}

#[test]
fn status_shows_a_running_daemon_as_text_json_and_metrics() {
    require_root();
    let _turn = ksm_turn();
    let dir = Scratch::new("status");
    let socket = dir.path("rksm.sock");
    let mut kids = twins(2, 64, 41);
    let port = free_port();
    let token = dir.path("token");
    std::fs::write(&token, "s3cret-token-for-the-test\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
    let textfile = dir.path("rksm.prom");
    let mut args = vec![
        "daemon".to_string(),
        "--interval".into(),
        "0.3".into(),
        "--socket".into(),
        socket.display().to_string(),
        "--metrics-address".into(),
        format!("127.0.0.1:{port}"),
        "--metrics-token-file".into(),
        token.display().to_string(),
        "--metrics-textfile".into(),
        textfile.display().to_string(),
    ];
    for (child, _) in &kids {
        args.extend(["--pid".into(), child.pid().to_string()]);
    }
    // Under the unit's umask, which would make a file only root can read.
    let mut command = rksm_command();
    // SAFETY: umask is async-signal-safe and changes only the child's creation mask.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut command, || {
            libc::umask(0o077);
            Ok(())
        });
    }
    let daemon = Running::spawn(
        command
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    assert!(
        wait_for(Duration::from_secs(60), || kids
            .iter()
            .all(|(c, r)| ksm_pages(c.pid(), *r, 64).len() == 64)),
        "not merged"
    );
    // The status shows what the kernel shows, once a pass has seen it.
    let mut json = serde_json::Value::Null;
    assert!(
        wait_for(Duration::from_secs(10), || {
            json = status_json(&socket).unwrap_or_default();
            json["counters"]["pages_sharing"].as_u64() >= Some(64)
        }),
        "status never showed the merge: {json}"
    );
    assert_eq!(json["daemon_pid"], daemon.id());
    let pids: Vec<u64> = json["targets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["pid"].as_u64().unwrap())
        .collect();
    assert_eq!(pids.len(), 2);
    for (child, _) in &kids {
        assert!(pids.contains(&u64::from(child.pid())), "{json}");
    }
    // Profit is what merging saved less rksm's own memory, which is not nothing.
    let saved = json["counters"]["pages_sharing"].as_i64().unwrap() * PAGE as i64;
    let profit = json["general_profit"].as_i64().expect("general_profit");
    assert!(
        profit < saved && profit > saved - (1 << 30),
        "{profit} vs {saved}"
    );
    // Next to rksm's count, the kernel's own (/proc/PID/ksm_stat).
    for t in json["targets"].as_array().unwrap() {
        assert!(t["ksm_merging_pages"].as_u64() >= Some(64), "{t}");
    }
    assert!(json["last_pass"]["number"].as_u64() >= Some(1));

    let text = rksm(&["status", "--socket", socket.to_str().unwrap()]);
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(text.contains("last pass: #"), "{text}");
    assert!(text.contains("--dirty ebpf"), "{text}");
    for (child, _) in &kids {
        assert!(
            text.contains(&format!("{:>8} rksm-testchild", child.pid())),
            "{text}"
        );
    }

    let metrics = rksm(&["status", "--metrics", "--socket", socket.to_str().unwrap()]);
    let metrics = String::from_utf8(metrics.stdout).unwrap();
    let sharing: u64 = metrics
        .lines()
        .filter(|l| l.starts_with("rksm_target_ksm_merging_pages{"))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
        .sum();
    assert!(sharing >= 64, "{metrics}");
    for name in ["pages_marked", "pages_hashed_total", "dirty_misses_total"] {
        for (child, _) in &kids {
            let series = format!(
                "rksm_target_{name}{{pid=\"{}\",comm=\"rksm-testchild\"}} ",
                child.pid()
            );
            assert!(metrics.contains(&series), "no {series} in {metrics}");
        }
    }
    assert!(metrics.contains("\nrksm_full_scans_total "), "{metrics}");
    assert!(
        metrics.contains("# TYPE rksm_target_ksm_merging_pages gauge"),
        "{metrics}"
    );
    assert!(
        metrics.contains("\nrksm_general_profit_bytes "),
        "{metrics}"
    );

    // Over HTTP, because it was asked for: daemon-wide and per-domain series for anyone,
    // the per-process ones only with the token.
    let http = http_get(port, "/metrics");
    assert!(http.starts_with("HTTP/1.1 200 OK"), "{http}");
    assert!(
        http.contains("# TYPE rksm_full_scans_total counter"),
        "{http}"
    );
    assert!(
        http.contains("rksm_domain_ksm_merging_pages{domain=\""),
        "{http}"
    );
    // What an operator graphs: what merging saves, and what the dirty bit spares.
    let value = |text: &str, name: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .unwrap_or_else(|| panic!("no {name} in {text}"))
            .parse()
            .unwrap()
    };
    assert!(value(&http, "rksm_pages_sharing") >= 64, "{http}");
    assert_eq!(
        value(&http, "rksm_saved_bytes"),
        value(&http, "rksm_pages_sharing") * PAGE
    );
    assert!(value(&http, "rksm_pages_hashed_total") >= 128, "{http}");
    assert!(value(&http, "rksm_pages_skipped_clean_total") > 0, "{http}");
    assert!(!http.contains("pid=") && !http.contains("comm="), "{http}");
    assert!(!http.contains("uid 0"), "the domain's user shows: {http}");
    let wrong = http_get_with(port, "/metrics", "Authorization: Bearer not-the-token\r\n");
    assert!(!wrong.contains("pid="), "{wrong}");
    let trusted = http_get_with(
        port,
        "/metrics",
        "Authorization: Bearer s3cret-token-for-the-test\r\n",
    );
    assert!(
        trusted.contains("rksm_target_ksm_merging_pages{pid="),
        "{trusted}"
    );
    assert!(http_get(port, "/").starts_with("HTTP/1.1 404"));
    assert_eq!(tcp_listeners_of(daemon.id()), 1);
    // The textfile for node_exporter: the public series, written after every pass.
    let prom = std::fs::read_to_string(&textfile).expect("the metrics textfile");
    assert!(prom.contains("\nrksm_full_scans_total "), "{prom}");
    assert!(!prom.contains("pid="), "{prom}");
    // The collector runs as another user, and reads it.
    let as_nobody = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "cat"])
        .arg(&textfile)
        .output()
        .expect("setpriv");
    assert!(
        as_nobody.status.success()
            && String::from_utf8_lossy(&as_nobody.stdout).contains("rksm_full_scans_total"),
        "{}",
        String::from_utf8_lossy(&as_nobody.stderr)
    );

    // Clients that connect and send nothing delay nobody, even more of them than the HTTP
    // port serves at once: `rksm status` answers while they hang on.
    let silent: Vec<TcpStream> = (0..20)
        .map(|_| TcpStream::connect(("127.0.0.1", port)).unwrap())
        .collect();
    let asked = std::time::Instant::now();
    assert!(
        status_json(&socket).is_some(),
        "rksm status got no answer behind silent HTTP clients"
    );
    assert!(
        asked.elapsed() < Duration::from_secs(1),
        "rksm status waited {:?} behind silent HTTP clients",
        asked.elapsed()
    );
    drop(silent);

    // Root only: the socket's mode, and a user who asks anyway gets an error line.
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let output = Command::new("setpriv")
        .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
        .arg(rksm_tests::built_binary("rksm"))
        .args(["status", "--socket", socket.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    assert_eq!(stderr(&output).lines().count(), 1, "{}", stderr(&output));
    assert!(
        stderr(&output).contains("only root may ask"),
        "{}",
        stderr(&output)
    );

    let output = daemon.stop();
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(!socket.exists(), "socket left behind");
    let output = rksm(&["status", "--socket", socket.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(1));
    assert!(stderr(&output).contains("no rksm daemon is answering"));
    for (child, r) in &mut kids {
        assert!(child.verify(*r, 0, 64, 41));
    }
}

#[test]
fn outsiders_of_another_domain_marking_their_own_memory_are_named() {
    require_root();
    let _turn = ksm_turn();
    let root = TestChild::spawn();
    let mut prober = TestChild::spawn_as_nobody();
    let region = prober.map(16);
    prober.write(region, 0, 16, 5);
    prober.command(&format!("mergeable {}", region.id));
    // Another, whose name is not UTF-8: it is an outsider all the same.
    let mut nameless = TestChild::spawn_as_nobody();
    let other = nameless.map(4);
    nameless.write(other, 0, 4, 6);
    nameless.command(&format!("mergeable {}", other.id));
    assert_eq!(nameless.command("namehex ff78"), "ok");
    let (prober_pid, nameless_pid) = (prober.pid_from_proc(), nameless.pid_from_proc());
    let daemon = |extra: &[&str]| {
        let mut args = vec![
            "--log-level".to_string(),
            "warn".into(),
            "daemon".into(),
            "--passes".into(),
            "1".into(),
            "--socket".into(),
            std::env::temp_dir()
                .join(format!("rksm-outsiders-{prober_pid}.sock"))
                .display()
                .to_string(),
            "--pid".into(),
            root.pid().to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        rksm_command().args(&args).output().unwrap()
    };
    // Root's domain, and nobody processes outside it that mark themselves: they could probe
    // root's pages through ksmd. Refused by default, naming them.
    let refused = daemon(&[]);
    assert_eq!(refused.status.code(), Some(1), "{}", stderr(&refused));
    assert_eq!(stderr(&refused).lines().count(), 1, "{}", stderr(&refused));
    for named in [
        format!("pid {prober_pid} (rksm-testchild, uid 65534)"),
        format!("pid {nameless_pid} (\u{fffd}x, uid 65534)"),
    ] {
        assert!(
            stderr(&refused).contains(&named),
            "no {named} in {}",
            stderr(&refused)
        );
    }
    // Asked to, it starts and warns, naming them.
    let warned = daemon(&["--outsiders", "warn"]);
    assert!(warned.status.success(), "{}", stderr(&warned));
    assert!(
        stderr(&warned).contains(&format!(
            "pid {prober_pid} (rksm-testchild, uid 65534) marks"
        )),
        "{}",
        stderr(&warned)
    );
    // One domain for all: nothing to probe across.
    let one = daemon(&["--domain", "none"]);
    assert!(one.status.success(), "{}", stderr(&one));
    assert!(
        !stderr(&one).contains("outside the targets"),
        "{}",
        stderr(&one)
    );
}

#[test]
fn a_selection_by_name_takes_any_users_process_and_says_so_while_a_uid_narrowed_one_does_not() {
    require_root();
    let _turn = ksm_turn();
    let mut root = TestChild::spawn();
    let mut user = TestChild::spawn_as_nobody();
    let name = format!("rksmsel{}", std::process::id() % 100_000);
    for child in [&mut root, &mut user] {
        assert_eq!(child.command(&format!("name {name}")), "ok");
    }
    let user_pid = user.pid_from_proc();
    let daemon = |extra: &[&str]| {
        let mut args: Vec<String> = [
            "--log-level",
            "info",
            "daemon",
            "--passes",
            "1",
            "--domain",
            "none",
            "--comm",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.push(format!("^{name}$"));
        args.push("--socket".into());
        args.push(
            std::env::temp_dir()
                .join(format!("rksm-byname-{user_pid}.sock"))
                .display()
                .to_string(),
        );
        args.extend(extra.iter().map(|s| s.to_string()));
        rksm_command().args(&args).output().unwrap()
    };
    // By name alone: both users' processes, and a warning that any user can join.
    let by_name = daemon(&[]);
    assert!(by_name.status.success(), "{}", stderr(&by_name));
    assert!(
        stderr(&by_name).contains("selected by command name alone")
            && stderr(&by_name).contains("uid 0, 65534"),
        "{}",
        stderr(&by_name)
    );
    // Narrowing a user's processes: only theirs, and nothing to warn about.
    let narrowed = daemon(&["--uid", "65534"]);
    assert!(narrowed.status.success(), "{}", stderr(&narrowed));
    assert!(
        !stderr(&narrowed).contains("command name alone"),
        "{}",
        stderr(&narrowed)
    );
    let took =
        |out: &std::process::Output, pid: u32| stderr(out).contains(&format!("target pid {pid} ("));
    assert!(took(&by_name, root.pid()) && took(&by_name, user_pid));
    assert!(!took(&narrowed, root.pid()) && took(&narrowed, user_pid));
}

/// Voluntary context switches of each thread of `pid`, by thread name: how often each went
/// to sleep, which a thread that sleeps until it has work does once per piece of work.
fn sleeps_by_thread(pid: u32) -> std::collections::BTreeMap<String, u64> {
    let mut sleeps = std::collections::BTreeMap::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
    {
        let dir = task.path();
        let name = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        let status = std::fs::read_to_string(dir.join("status")).unwrap_or_default();
        let n: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        *sleeps.entry(name.trim().to_string()).or_default() += n;
    }
    sleeps
}

#[test]
fn between_passes_the_daemon_sleeps_while_its_target_writes() {
    require_root();
    let _turn = ksm_turn();
    let dir = Scratch::new("idle");
    let socket = dir.path("rksm.sock");
    // A workload rewriting 50 pages a second: write faults the tracer records all the time.
    let mut workload = Command::new(rksm_tests::built_binary("rksm"))
        .args(["--no-config", "workload", "--profile", "static"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut ready = [0u8; 6];
    workload
        .stdout
        .as_mut()
        .unwrap()
        .read_exact(&mut ready)
        .unwrap();
    assert_eq!(&ready, b"ready\n");
    let daemon = Running::spawn(
        rksm_command()
            .args([
                "--log-level",
                "warn",
                "daemon",
                "--interval",
                "2",
                "--socket",
            ])
            .arg(&socket)
            .args(["--pid", &workload.id().to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    );
    let passes = || status_json(&socket).and_then(|j| j["counters"]["full_scans"].as_u64());
    assert!(
        wait_for(Duration::from_secs(30), || passes() >= Some(3)),
        "no steady passes"
    );
    let passes_before = passes().unwrap();
    let before = sleeps_by_thread(daemon.id());
    let window = Instant::now();
    while window.elapsed() < Duration::from_secs(6) {
        std::thread::sleep(Duration::from_millis(500));
    }
    let after = sleeps_by_thread(daemon.id());
    let passes_in_window = passes().unwrap() - passes_before;
    let slept = |thread: &str| after.get(thread).copied().unwrap_or(0) - before[thread];
    eprintln!(
        "in 6 s, {passes_in_window} passes: main thread slept {} times, status thread {}",
        slept("rksm"),
        slept("rksm-status")
    );
    // A pass sleeps a few times (its borrows, its ksmd pacing); between passes the daemon
    // sleeps once, whatever its target writes (it woke ten times a second to drain the
    // tracer, and once a second for nothing), and the status server not at all.
    assert!(
        slept("rksm") <= 10 * passes_in_window.max(1) + 4,
        "{passes_in_window} passes, {} sleeps",
        slept("rksm")
    );
    assert!(slept("rksm-status") <= 1, "{}", slept("rksm-status"));
    drop(daemon);
    drop(workload.stdin.take());
    let _ = workload.wait();
}

#[test]
fn a_metrics_token_file_others_can_read_is_refused_in_one_line() {
    require_root();
    let dir = Scratch::new("token");
    let token = dir.path("token");
    std::fs::write(&token, "s3cret-token-for-the-test\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o644)).unwrap();
    let output = rksm(&[
        "daemon",
        "--pid",
        &std::process::id().to_string(),
        "--metrics-token-file",
        token.to_str().unwrap(),
    ]);
    assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
    assert_eq!(stderr(&output).lines().count(), 1, "{}", stderr(&output));
    assert!(stderr(&output).contains("chmod 600"), "{}", stderr(&output));
}

#[test]
fn metrics_are_not_served_over_tcp_unless_asked_for() {
    require_root();
    let _turn = ksm_turn();
    let dir = Scratch::new("nometrics");
    let socket = dir.path("rksm.sock");
    let child = TestChild::spawn();
    let daemon = Running::spawn(
        rksm_command()
            .args(["daemon", "--interval", "0.2", "--socket"])
            .arg(&socket)
            .args(["--pid", &child.pid().to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    );
    assert!(
        wait_for(Duration::from_secs(20), || status_json(&socket)
            .is_some_and(|j| j["last_pass"].is_object())),
        "daemon never answered"
    );
    assert_eq!(tcp_listeners_of(daemon.id()), 0, "a TCP port is open");
    assert!(daemon.stop().status.success());
}

/// The capabilities the packaged systemd unit grants.
fn unit_capabilities() -> Vec<String> {
    packaging("rksm.service")
        .lines()
        .find_map(|l| l.strip_prefix("CapabilityBoundingSet="))
        .expect("the unit sets CapabilityBoundingSet")
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

/// A file of packaging/.
fn packaging(file: &str) -> String {
    std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../packaging")
            .join(file),
    )
    .unwrap()
}

/// The values of the first `key: [..]` flow list after the line containing `after`.
fn yaml_list(yaml: &str, after: &str, key: &str) -> Vec<String> {
    yaml.lines()
        .skip_while(|l| !l.contains(after))
        .find_map(|l| l.trim().strip_prefix(&format!("{key}: ")))
        .unwrap_or_else(|| panic!("no `{key}:` after `{after}`"))
        .trim_matches(|c| c == '[' || c == ']')
        .split(',')
        .map(|v| v.trim().trim_matches('"').to_string())
        .collect()
}

/// Every `key: value` of the manifest, as (key, value) pairs.
fn yaml_values<'a>(yaml: &'a str, key: &'a str) -> impl Iterator<Item = &'a str> + 'a {
    yaml.lines()
        .filter_map(move |l| l.trim().trim_start_matches("- ").strip_prefix(key))
        .filter_map(|rest| rest.strip_prefix(": "))
        .map(str::trim)
}

#[test]
fn the_daemonset_grants_exactly_what_the_unit_grants() {
    let unit = packaging("rksm.service");
    let manifest = packaging("rksm-daemonset.yaml");
    // The same capabilities, and only those.
    let mut granted: Vec<String> = yaml_list(&manifest, "capabilities:", "add")
        .into_iter()
        .map(|c| format!("CAP_{c}"))
        .collect();
    let mut unit_caps = unit_capabilities();
    granted.sort();
    unit_caps.sort();
    assert_eq!(granted, unit_caps, "capabilities");
    assert_eq!(
        yaml_list(&manifest, "capabilities:", "drop"),
        ["ALL"],
        "everything else dropped"
    );
    for (key, value) in [
        ("hostPID", "true"),
        ("privileged", "false"),
        ("allowPrivilegeEscalation", "false"),
        ("readOnlyRootFilesystem", "true"),
        ("runAsUser", "0"),
    ] {
        assert_eq!(
            yaml_values(&manifest, key).collect::<Vec<_>>(),
            [value],
            "{key}"
        );
    }
    // Written: what the unit lets it write (ReadWritePaths, RuntimeDirectory), from the host.
    let unit_value = |key: &str| {
        unit.lines()
            .find_map(|l| l.strip_prefix(&format!("{key}=")))
            .unwrap_or_else(|| panic!("the unit has no {key}"))
            .to_string()
    };
    let mounts: Vec<&str> = yaml_values(&manifest, "mountPath").collect();
    let host_paths: Vec<&str> = yaml_values(&manifest, "path").collect();
    // Paths the unit marks optional (`-`) are the host's own integrations (node_exporter's
    // textfile directory); in a cluster the pod is scraped over HTTP instead.
    let required: Vec<String> = unit_value("ReadWritePaths")
        .split_whitespace()
        .filter(|p| !p.starts_with('-'))
        .map(String::from)
        .collect();
    assert!(!required.is_empty());
    for writable in required
        .into_iter()
        .chain([format!("/run/{}", unit_value("RuntimeDirectory"))])
    {
        assert!(
            mounts.contains(&writable.as_str()),
            "{writable} not mounted"
        );
        assert!(
            host_paths.contains(&writable.as_str()),
            "{writable} not the host's"
        );
    }
    // And the tracer reads the tracepoint's format from tracefs; the selection, the node's
    // cgroups.
    assert!(mounts.contains(&"/sys/kernel/tracing"));
    assert!(mounts.contains(&"/sys/fs/cgroup") && host_paths.contains(&"/sys/fs/cgroup"));
    let read_only = manifest.matches("readOnly: true").count();
    assert_eq!(
        read_only, 3,
        "tracefs, the cgroups and the configuration, and nothing else, read-only"
    );
    // Pods are told apart by cgroup, not by uid, which most share; that is several domains,
    // allowed knowingly.
    let config: rksm::service::config::ConfigFile = {
        let start = manifest.find("rksm.toml: |").expect("the ConfigMap");
        let text: String = manifest[start..]
            .lines()
            .skip(1)
            .take_while(|l| l.starts_with("    ") || l.is_empty())
            .map(|l| format!("{}\n", l.trim_start()))
            .collect();
        rksm::service::config::ConfigFile::parse(&text, Path::new("rksm.toml"))
            .expect("the ConfigMap's rksm.toml")
    };
    assert_eq!(config.domain, Some(rksm::daemon::DomainPolicy::Cgroup));
    assert_eq!(
        config.several_domains,
        Some(rksm::daemon::SeveralDomains::Allow)
    );
    assert!(!config.cgroup.is_empty(), "pods selected by name alone");
    // It runs the daemon as the unit does.
    let exec = unit_value("ExecStart");
    let args = yaml_list(&manifest, "- name: rksm", "args").join(" ");
    assert!(
        exec.ends_with(&args),
        "unit runs `{exec}`, the pod `{args}`"
    );
}

/// `rksm ARGS` as root with only `caps` (a bounding set, as systemd applies it).
fn rksm_with_only(caps: &[String], args: &[&str]) -> Command {
    let bounding: Vec<String> = caps
        .iter()
        .map(|c| format!("+{}", c.trim_start_matches("CAP_").to_lowercase()))
        .collect();
    let mut command = Command::new("setpriv");
    command
        .arg("--inh-caps=-all")
        .arg(format!("--bounding-set=-all,{}", bounding.join(",")))
        .arg(rksm_tests::built_binary("rksm"))
        .args(args);
    command
}

#[test]
fn the_systemd_units_capabilities_are_enough_and_each_is_needed() {
    require_root();
    let _turn = ksm_turn();
    let caps = unit_capabilities();
    assert_eq!(caps.len(), 6, "{caps:?}");
    // A root process and another user's, the same content in both.
    let mut root = TestChild::spawn();
    let mut nobody = TestChild::spawn_as_nobody();
    let nobody_pid = nobody.pid_from_proc();
    let (ra, rb) = (root.map(64), nobody.map(64));
    root.write(ra, 0, 64, 52);
    nobody.write(rb, 0, 64, 52);
    let (root_pid, nobody_arg) = (root.pid().to_string(), nobody_pid.to_string());
    let args = [
        "daemon",
        "--pid",
        &root_pid,
        "--pid",
        &nobody_arg,
        "--domain",
        "none",
        "--interval",
        "0.3",
        "--json",
    ];
    let daemon = Running::spawn(
        rksm_with_only(&caps, &args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    let merged = wait_for(Duration::from_secs(60), || {
        ksm_pages(root.pid(), ra, 64).len() == 64 && ksm_pages(nobody_pid, rb, 64).len() == 64
    });
    let output = daemon.stop();
    assert!(
        merged,
        "not merged with the unit's capabilities: {}",
        stderr(&output)
    );
    let json = json_stdout(&output);
    assert_eq!(json["targets_refused"], serde_json::json!({}), "{json}");
    // Both write-protected, the other user's process included (its clear_refs, on a kernel
    // with soft-dirty, is writable only with CAP_DAC_OVERRIDE).
    let source = match rksm::kernel::softdirty::supported() {
        true => "soft-dirty",
        false => "userfaultfd",
    };
    let both_protected: serde_json::Value =
        serde_json::from_str(&format!(r#"{{"{source}": 2}}"#)).unwrap();
    assert_eq!(json["write_protect"], both_protected, "{json}");

    for dropped in &caps {
        let fewer: Vec<String> = caps.iter().filter(|c| c != &dropped).cloned().collect();
        if dropped == "CAP_DAC_OVERRIDE" && !rksm::kernel::softdirty::supported() {
            // Without soft-dirty it is not used, and not asked for.
            let once: Vec<&str> = args.iter().copied().chain(["--passes", "1"]).collect();
            let output = rksm_with_only(&fewer, &once).output().unwrap();
            assert!(output.status.success(), "{}", stderr(&output));
            let json = json_stdout(&output);
            assert_eq!(json["write_protect"], both_protected, "{json}");
            continue;
        }
        let output = rksm_with_only(&fewer, &args).output().unwrap();
        let err = stderr(&output);
        assert_eq!(output.status.code(), Some(1), "without {dropped}: {err}");
        assert!(
            err.contains(&format!("missing {dropped}")),
            "without {dropped}: {err}"
        );
    }
    assert!(root.verify(ra, 0, 64, 52) && nobody.verify(rb, 0, 64, 52));
}

#[test]
fn logs_follow_the_level_flags_and_come_as_json_lines_with_fields() {
    require_root();
    let _turn = ksm_turn();
    let dir = Scratch::new("logs");
    let child = TestChild::spawn();
    let pid = child.pid().to_string();
    let socket = dir.path("s.sock");
    let run = |extra: &[&str], env: Option<&str>, config: Option<&Path>| -> String {
        let mut command = rksm_command();
        command.args(["daemon", "--pid", &pid, "--passes", "1", "--socket"]);
        command.arg(&socket).args(extra);
        if let Some(config) = config {
            command.arg("--config").arg(config);
        }
        match env {
            Some(v) => command.env("RUST_LOG", v),
            None => command.env_remove("RUST_LOG"),
        };
        let output = command.output().unwrap();
        assert!(output.status.success(), "{}", stderr(&output));
        stderr(&output)
    };
    let has = |log: &str, level: &str| {
        log.lines()
            .any(|l| l.starts_with(&format!("rksm: {level}: ")))
    };

    let default = run(&[], None, None);
    assert!(
        has(&default, "info") && !has(&default, "debug"),
        "{default}"
    );
    assert!(has(&run(&["--log-level", "debug"], None, None), "debug"));
    assert!(!has(&run(&["--log-level", "warn"], None, None), "info"));
    assert!(
        !has(&run(&[], Some("warn"), None), "info"),
        "RUST_LOG ignored"
    );
    assert!(
        has(&run(&["--log-level", "info"], Some("warn"), None), "info"),
        "flag must win"
    );
    let quiet = dir.file("quiet.toml", "log_level = \"warn\"\n");
    assert!(
        !has(&run(&[], None, Some(&quiet)), "info"),
        "file's log_level ignored"
    );
    assert!(
        has(&run(&[], Some("info"), Some(&quiet)), "info"),
        "RUST_LOG must win over the file"
    );

    let json = run(&["--log-format", "json"], None, None);
    let lines: Vec<serde_json::Value> = json
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert!(!lines.is_empty());
    for line in &lines {
        for key in ["time", "level", "target", "message"] {
            assert!(line[key].is_string(), "{key} missing: {line}");
        }
    }
    let pass = lines
        .iter()
        .find(|l| l["pass"] == 1)
        .unwrap_or_else(|| panic!("no pass line with fields in {json}"));
    assert_eq!(pass["targets"], 1);
    assert!(
        pass["pages_hashed"].is_u64() && pass["seconds"].is_f64(),
        "{pass}"
    );
    let target = lines
        .iter()
        .find(|l| l["pid"] == child.pid())
        .unwrap_or_else(|| panic!("no target line with its pid in {json}"));
    assert_eq!(target["comm"], "rksm-testchild");
}

#[test]
fn ebpf_log_lines_arrive_in_the_structured_log() {
    require_root();
    let mut child = TestChild::spawn();
    let r = child.map(20_000);
    let pid = child.pid().to_string();
    // A one-page ring overflows, and the eBPF program says so itself.
    let mut trace = rksm_command()
        .args(["trace", "--pid", &pid, "--ring-bytes", "4096", "--json"])
        .args(["--log-format", "json", "--duration", "30"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = std::io::BufReader::new(trace.stderr.take().unwrap());
    let mut line = String::new();
    while !line.contains("tracing write faults") {
        line.clear();
        assert!(std::io::BufRead::read_line(&mut stderr, &mut line).unwrap() > 0);
    }
    // With the reader stopped, nothing drains the ring: it overflows however fast the
    // reader would have been.
    let tracer = nix::unistd::Pid::from_raw(trace.id() as i32);
    nix::sys::signal::kill(tracer, nix::sys::signal::Signal::SIGSTOP).unwrap();
    assert!(wait_for(Duration::from_secs(10), || proc_status(
        trace.id(),
        "State:"
    )
    .starts_with('T')));
    child.write(r, 0, 20_000, 9);
    nix::sys::signal::kill(tracer, nix::sys::signal::Signal::SIGCONT).unwrap();
    child.exit();
    let mut rest = String::new();
    stderr.read_to_string(&mut rest).unwrap();
    trace.wait().unwrap();
    let said = rest
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|l| l["target"] == "rksm::ebpf")
        .unwrap_or_else(|| panic!("no eBPF line in {rest}"));
    assert_eq!(said["level"], "warn");
    assert!(
        said["message"]
            .as_str()
            .unwrap()
            .contains(&format!("tgid {pid} is now treated as fully written")),
        "{said}"
    );
}

#[test]
fn completions_and_man_pages_are_generated_from_the_same_flags() {
    let bash = rksm(&["completions", "bash"]);
    assert!(bash.status.success());
    let bash_text = String::from_utf8(bash.stdout).unwrap();
    assert!(bash_text.contains("complete -F _rksm"), "{bash_text}");
    assert!(bash_text.contains("--metrics-address"));
    // bash itself accepts it.
    let check = Command::new("bash")
        .args(["-n", "-c", &bash_text])
        .output()
        .unwrap();
    assert!(check.status.success(), "{}", stderr(&check));
    let zsh = String::from_utf8(rksm(&["completions", "zsh"]).stdout).unwrap();
    assert!(zsh.starts_with("#compdef rksm"), "{zsh}");
    let fish = String::from_utf8(rksm(&["completions", "fish"]).stdout).unwrap();
    assert!(fish.contains("complete -c rksm"), "{fish}");
    assert!(fish.contains("status"));
    let bad = rksm(&["completions", "powershell"]);
    assert_eq!(bad.status.code(), Some(2));

    let man = String::from_utf8(rksm(&["man"]).stdout).unwrap();
    assert!(man.contains(".TH rksm 1"), "{man}");
    let dir = Scratch::new("man");
    let out = rksm(&["man", "--out-dir", dir.0.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    for page in [
        "rksm.1",
        "rksm-daemon.1",
        "rksm-status.1",
        "rksm-completions.1",
    ] {
        let text = std::fs::read_to_string(dir.path(page)).unwrap();
        assert!(text.contains(".TH "), "{page}");
    }
    let daemon = std::fs::read_to_string(dir.path("rksm-daemon.1")).unwrap();
    assert!(
        daemon.contains("/etc/rksm/rksm.toml"),
        "the daemon page names its files"
    );
}

#[test]
fn a_hostile_host_configuration_changes_nothing_for_the_tools() {
    require_root();
    let _turn = ksm_turn();
    let pairs = twins(2, 64, 77);
    let pids: Vec<String> = pairs.iter().map(|(c, _)| c.pid().to_string()).collect();
    let scratch = Scratch::new("hostile");
    let socket = scratch.path("s.sock");
    let daemon_args = |passes: &'static str| {
        let mut args = vec!["daemon", "--pid", &pids[0], "--pid", &pids[1]];
        args.extend([
            "--interval",
            "0.3",
            "--passes",
            passes,
            "--json",
            "--socket",
        ]);
        args.push(socket.to_str().unwrap());
        args
    };
    // The hostile file is in force in its namespace: an rksm that reads it (no --no-config)
    // obeys it, so this test can tell a tool that reads the host's file from one that does
    // not.
    let mut reads_it = Command::new(rksm_tests::built_binary("rksm"));
    reads_it.args(daemon_args("1"));
    let out = with_hostile_host_config(&reads_it).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        json["dirty_mode"], "hash-only",
        "the hostile file was not read"
    );
    assert!(
        stderr.lines().all(|l| l.starts_with('{')),
        "json logs at warn level: {stderr}"
    );

    // What the tools and the tests run (`--no-config`): the defaults, whatever the host says.
    let mut tool = rksm_command();
    tool.args(daemon_args("20"));
    let daemon = Running::spawn(
        with_hostile_host_config(&tool)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    let (child, region) = &pairs[0];
    assert!(
        wait_for(Duration::from_secs(20), || !ksm_pages(
            child.pid(),
            *region,
            64
        )
        .is_empty()),
        "nothing merged"
    );
    let out = daemon.wait();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["dirty_mode"], "ebpf", "{json}");
    assert!(json["pages_sharing"].as_u64().unwrap() > 0, "{json}");
    assert!(
        stderr.contains("rksm: info: pass 1 (ebpf): 2 targets"),
        "text logs at info level: {stderr}"
    );
}

/// A process run from a FUSE mount whose server stopped answering (a hung network mount, a
/// user's `fusermount`) is a target like any other: anything that asks the file system about
/// its executable waits for as long as the server is silent, and rksm asks nothing of it.
#[test]
fn a_target_run_from_a_fuse_mount_that_stopped_answering_holds_nothing_up() {
    require_root();
    let _turn = ksm_turn();
    let fuse = rksm_tests::fuse::SilentFuse::mount(
        "exe",
        std::fs::read(rksm_tests::built_binary("rksm-testchild")).unwrap(),
    );
    let mut kids = vec![TestChild::spawn_from(&fuse.prog()), TestChild::spawn()];
    let mut regions = Vec::new();
    for child in &mut kids {
        child.command("name rksm-onfuse");
        let region = child.map(16);
        child.write(region, 0, 16, 77);
        regions.push(region);
    }
    // Its pages are cached; from now on a stat of the file waits for ever.
    std::fs::read(fuse.prog()).unwrap();
    fuse.silence();
    let socket = PathBuf::from("/run/rksm-test-onfuse.sock");
    let mut command = rksm_command();
    command
        .args(["--log-level", "warn", "daemon", "--comm", "^rksm-onfuse$"])
        .args(["--interval", "0.2", "--json", "--socket"])
        .arg(&socket)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let daemon = Running::spawn(&mut command);
    let pid = daemon.id();
    let passes_go_on = wait_for(Duration::from_secs(30), || {
        status_json(&socket).is_some_and(|json| {
            json["counters"]["full_scans"].as_u64() >= Some(10)
                && json["counters"]["pages_sharing"].as_u64() >= Some(16)
        })
    });
    // SIGTERM, and a bounded wait for the exit: a daemon stuck in the file system would not.
    let asked = Instant::now();
    // SAFETY: kill with a valid pid and signal.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    let exited = wait_for(Duration::from_secs(5), || {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map_or(true, |stat| stat.contains(") Z "))
    });
    let took = asked.elapsed();
    if !exited {
        // The test fails below; it must not hang on the way out: a request the server took
        // is waited for even through SIGKILL, until the connection is aborted.
        fuse.abort();
        // SAFETY: as above.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
    let output = daemon.wait();
    assert!(
        passes_go_on,
        "passes stopped or nothing merged: {:?}",
        status_json(&socket)
    );
    assert!(exited, "rksm did not exit within 5 s of SIGTERM");
    eprintln!("rksm exited {took:?} after SIGTERM");
    assert!(output.status.success(), "{output:?}");
    for (child, region) in kids.iter_mut().zip(regions) {
        assert!(child.verify(region, 0, 16, 77));
    }
}
