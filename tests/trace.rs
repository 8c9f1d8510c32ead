//! The write-fault tracer against real child processes and the real kernel.

use std::{
    collections::BTreeSet,
    io::{BufRead, BufReader},
    process::Stdio,
};

use rksm::{
    ebpf::{
        recorder::Recorder,
        tracer::{Tracer, TracerConfig, WriteLog},
        Object,
    },
    engine::dirty::{
        protection::{Offer, WriteProtectChoice},
        DirtySet, DirtySource, DirtyState, EbpfSource, Lent, DEFAULT_AUDIT_PASSES,
    },
    kernel::{process::Process, procfs, remote::Borrower},
    tools::trace::TraceSession,
};
use rksm_tests::{require_root, rksm_command, Region, TestChild, PAGE};

const K_WRITTEN: u64 = 48;
const L_PRESENT: u64 = 40;
const L_FRESH: u64 = 40;

/// The indices of the region's pages among `written` addresses.
fn pages_in(region: Region, pages: u64, written: impl Iterator<Item = u64>) -> BTreeSet<u64> {
    let end = region.base + pages * PAGE;
    written
        .filter(|&p| p >= region.base && p < end)
        .map(|p| (p - region.base) / PAGE)
        .collect()
}

#[test]
fn records_exactly_the_pages_written_after_attach_and_none_only_read() {
    require_root();
    let mut child = TestChild::spawn();
    let region = child.map(K_WRITTEN + L_PRESENT + L_FRESH);
    // Pages K..K+L_PRESENT are made present and writable before tracing starts; the last
    // L_FRESH pages are never written, so reading them maps the zero page with a read fault.
    child.write(region, K_WRITTEN, L_PRESENT, 1);

    let process = Process::open(child.pid()).unwrap();
    let mut session = TraceSession::start(vec![process], TracerConfig::default()).unwrap();
    child.write(region, 0, K_WRITTEN, 2);
    child.read(region, K_WRITTEN, L_PRESENT + L_FRESH);
    // The fault is recorded before the faulting write completes, and the child replies only
    // after its writes, so everything is in the ring by now.
    session.drain();

    let written = pages_in(
        region,
        K_WRITTEN + L_PRESENT + L_FRESH,
        session.written(child.pid()),
    );
    let expected: BTreeSet<u64> = (0..K_WRITTEN).collect();
    assert_eq!(
        written, expected,
        "recorded pages differ from the pages written"
    );

    let report = session.finish().unwrap();
    assert_eq!(report[0].pid, child.pid());
    assert_eq!(report[0].lost, 0);
    assert!(report[0].write_faults >= K_WRITTEN, "{report:?}");
    assert!(report[0].written_pages >= K_WRITTEN, "{report:?}");
    assert!(
        child.verify(region, 0, K_WRITTEN, 2),
        "tracing changed the child's memory"
    );
}

#[test]
fn a_full_ring_is_reported_as_a_loss_of_that_process() {
    require_root();
    let mut tracked = TestChild::spawn();
    let mut untracked = TestChild::spawn();
    let tracked_region = tracked.map(2000);
    let untracked_region = untracked.map(100);

    // The logger must be in place before the tracer binds aya-log to it.
    let _ = log::set_logger(&CapturedLog).map(|()| log::set_max_level(log::LevelFilter::Trace));
    // One page of ring holds about 170 records; nothing drains it while 2000 pages fault.
    let mut tracer = Tracer::load(
        TracerConfig {
            ring_bytes: 4096,
            ..TracerConfig::default()
        },
        &mut Object::new(),
    )
    .unwrap();
    tracer.track(tracked.pid()).unwrap();
    tracked.write(tracked_region, 0, 2000, 7);
    untracked.write(untracked_region, 0, 100, 7);

    let counters = tracer.process_counters(tracked.pid()).unwrap().unwrap();
    assert!(
        counters.lost > 0,
        "no loss recorded after overflowing the ring: {counters:?}"
    );
    assert!(counters.write_faults >= 2000, "{counters:?}");
    assert_eq!(tracer.process_counters(untracked.pid()).unwrap(), None);

    let mut log = WriteLog::default();
    tracer.drain(&mut log);
    assert!(
        log.records(tracked.pid()) < 2000,
        "the ring cannot have held every record"
    );
    // Every write fault of the process is either a record or a counted loss.
    let counters = tracer.process_counters(tracked.pid()).unwrap().unwrap();
    assert_eq!(
        log.records(tracked.pid()) + counters.lost,
        counters.write_faults
    );
    assert_eq!(
        log.records(untracked.pid()),
        0,
        "an untracked process was recorded"
    );
    let global = tracer.counters().unwrap();
    assert!(global.lost >= counters.lost, "{global:?}");
    assert!(global.recorded >= log.records(tracked.pid()), "{global:?}");

    // The program says so itself, through aya-log, in the daemon's log.
    tracer.flush_log();
    let lines = CapturedLog::lines();
    let said = format!("tgid {} is now treated as fully written", tracked.pid());
    assert!(
        lines.iter().any(|l| l.contains(&said)),
        "no eBPF log line about the loss in {lines:?}"
    );
}

#[test]
fn records_that_wrap_past_the_rings_end_are_read_whole() {
    require_root();
    let mut child = TestChild::spawn();
    let region = child.map(2000);
    // One page of ring: 24-byte records, so one in about 170 straddles its end. Drained after
    // every 100 faults, it never fills.
    let mut tracer = Tracer::load(
        TracerConfig {
            ring_bytes: 4096,
            ..TracerConfig::default()
        },
        &mut Object::new(),
    )
    .unwrap();
    tracer.track(child.pid()).unwrap();
    let mut log = WriteLog::default();
    for batch in 0..20 {
        child.write(region, batch * 100, 100, 3);
        tracer.drain(&mut log);
    }
    let counters = tracer.process_counters(child.pid()).unwrap().unwrap();
    assert_eq!(counters.lost, 0, "{counters:?}");
    assert_eq!(log.records(child.pid()), counters.write_faults);
    // Every page written is there, at its own address: a record read in two pieces the wrong
    // way would name another page or another process.
    let written = pages_in(region, 2000, log.pages(child.pid()));
    assert_eq!(written, (0..2000).collect::<BTreeSet<u64>>());
}

/// A logger that keeps every line, so a test can check what the eBPF program logged.
struct CapturedLog;
static CAPTURED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

impl CapturedLog {
    fn lines() -> Vec<String> {
        CAPTURED.lock().unwrap().clone()
    }
}

impl log::Log for CapturedLog {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }
    fn log(&self, record: &log::Record<'_>) {
        CAPTURED.lock().unwrap().push(record.args().to_string());
    }
    fn flush(&self) {}
}

/// Starts `rksm trace ARGS` and waits until it says it is tracing.
fn start_trace(args: &[String]) -> (std::process::Child, BufReader<std::process::ChildStderr>) {
    let mut rksm = rksm_command()
        .arg("trace")
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting rksm trace");
    let mut stderr = BufReader::new(rksm.stderr.take().expect("piped"));
    let mut line = String::new();
    while !line.contains("rksm: tracing write faults") {
        line.clear();
        assert_ne!(
            stderr.read_line(&mut line).unwrap(),
            0,
            "rksm trace exited before tracing"
        );
    }
    (rksm, stderr)
}

fn json_of(rksm: std::process::Child) -> serde_json::Value {
    let output = rksm.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "rksm trace failed: {:?}",
        output.status
    );
    serde_json::from_slice(&output.stdout).expect("one JSON object on stdout")
}

#[test]
fn trace_json_reports_a_childs_fresh_writes_after_ctrl_c() {
    require_root();
    let mut child = TestChild::spawn();
    let region = child.map(K_WRITTEN);
    let (rksm, _stderr) = start_trace(&["--pid".into(), child.pid().to_string(), "--json".into()]);
    child.write(region, 0, K_WRITTEN, 3);
    // SAFETY: kill with a valid pid and signal number.
    assert_eq!(unsafe { libc::kill(rksm.id() as i32, libc::SIGINT) }, 0);
    let json = json_of(rksm);

    let process = &json["processes"][0];
    assert_eq!(process["pid"], child.pid());
    let written = process["written_pages"].as_u64().unwrap();
    // The child's own bookkeeping (stack, stdio buffers) may add a few pages of its own.
    assert!((K_WRITTEN..K_WRITTEN + 16).contains(&written), "{json}");
    assert!(
        process["write_faults"].as_u64().unwrap() >= written,
        "{json}"
    );
    assert_eq!(process["lost"], 0);
    assert!(json["seconds"].as_f64().unwrap() > 0.0);
}

#[test]
fn trace_stops_when_every_traced_process_exits_and_keeps_its_numbers() {
    require_root();
    let mut child = TestChild::spawn();
    let region = child.map(K_WRITTEN);
    let pid = child.pid();
    let (rksm, mut stderr) = start_trace(&[
        "--pid".into(),
        pid.to_string(),
        "--duration".into(),
        "120".into(),
        "--json".into(),
    ]);
    child.write(region, 0, K_WRITTEN, 4);
    child.exit();

    let mut said_exited = false;
    let mut line = String::new();
    while stderr.read_line(&mut line).unwrap() > 0 {
        said_exited |= line.contains(&format!("pid {pid} (rksm-testchild) exited"));
        line.clear();
    }
    assert!(said_exited, "rksm trace did not say the child exited");
    let json = json_of(rksm);
    assert!(
        json["seconds"].as_f64().unwrap() < 60.0,
        "did not stop when the child exited: {json}"
    );
    assert!(
        json["processes"][0]["written_pages"].as_u64().unwrap() >= K_WRITTEN,
        "{json}"
    );
}

#[test]
fn a_missing_pid_is_reported_and_the_others_are_traced() {
    require_root();
    let child = TestChild::spawn();
    let output = rksm_command()
        .args([
            "trace",
            "--pid",
            "4194305",
            "--pid",
            &child.pid().to_string(),
            "--duration",
            "1",
            "--json",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(stderr.contains("pid 4194305 does not exist"), "{stderr}");
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(json["processes"].as_array().unwrap().len(), 1);
    assert_eq!(json["processes"][0]["pid"], child.pid());
}

#[test]
fn bad_input_gets_one_line_and_a_nonzero_exit() {
    for args in [
        &["trace", "--pid", "4194305"][..],
        &["trace", "--pid", "0"],
        &["trace", "--pid", "abc"],
        &["trace", "--pid", "1", "--duration", "-3"],
        &["trace"],
    ] {
        let output = rksm_command().args(args).output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        let first = stderr.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
        assert!(
            first.starts_with("rksm: ") || first.starts_with("error: "),
            "{args:?}: {stderr}"
        );
    }
}

#[test]
fn a_full_tracked_map_refuses_more_and_the_ebpf_source_hashes_those_in_full() {
    require_root();
    let (tracked, extra) = (TestChild::spawn(), TestChild::spawn());
    let tracer = Tracer::load(
        TracerConfig {
            max_tracked: 1,
            ..TracerConfig::default()
        },
        &mut Object::new(),
    )
    .unwrap();
    let mut recorder = Recorder::new(tracer);
    let (mut tracked_state, mut extra_state) = (DirtyState::default(), DirtyState::default());
    recorder
        .track(tracked.pid(), &mut tracked_state.tracer)
        .unwrap();
    assert!(
        recorder
            .track(extra.pid(), &mut extra_state.tracer)
            .is_err(),
        "the map holds one process"
    );
    assert!(tracked_state.tracer.tracked() && !extra_state.tracer.tracked());

    let offer = Offer::probe(WriteProtectChoice::Auto);
    let mut source = EbpfSource::new(DEFAULT_AUDIT_PASSES, offer);
    let borrower = Borrower::new();
    let process = Process::open(extra.pid()).unwrap();
    let vmas: Vec<_> = procfs::read_maps(extra.pid())
        .unwrap()
        .into_iter()
        .filter(|v| v.is_private_anonymous_writable())
        .collect();
    for pass in 0..3 {
        // Untracked writes would go unseen: nothing of this process may count as clean.
        let mut lent = Lent {
            borrower: &borrower,
            recorder: Some(&mut recorder),
        };
        assert_eq!(
            source
                .dirty_pages(&process, &mut extra_state, &vmas, &mut lent)
                .unwrap(),
            DirtySet::All,
            "pass {pass}"
        );
    }
}
