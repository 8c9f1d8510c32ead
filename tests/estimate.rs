//! The scanner and `rksm estimate` against real child processes with known memory.
//!
//! Library-level scenarios restrict the scan to the children's own regions, where the truth
//! is known exactly; the command-line scenarios check the report's shape and bounds.

use std::process::Command;

use rksm::{
    engine::{
        checksum::ChecksumKind,
        dirty::{HashOnly, Lent},
        scan::{PageCounts, PassReport, ScanConfig, Scanner},
        target::Target,
    },
    kernel::{process::Process, remote::Borrower},
};
use rksm_tests::{require_root, rksm_command, Region, TestChild, PAGE};

/// A scanner over exactly these (child, region, pages) ranges.
fn scanner_over(ranges: &[(u32, Region, u64)], checksum: ChecksumKind) -> Scanner {
    let only_ranges = ranges
        .iter()
        .map(|&(pid, r, pages)| (pid, r.base, r.base + pages * PAGE))
        .collect();
    Scanner::new(
        ScanConfig {
            checksum,
            only_ranges,
            collect_merge_candidates: false,
            report_top: true,
        },
        Box::new(HashOnly),
    )
    .unwrap()
}

/// The processes, as targets of a one-domain scan.
fn open(pids: &[u32]) -> Vec<Target> {
    pids.iter()
        .map(|&pid| Target::new(Process::open(pid).unwrap()))
        .collect()
}

fn pass(scanner: &mut Scanner, targets: &mut [Target]) -> PassReport {
    scanner.pass(targets, &mut Lent::borrower(&Borrower::new()), &mut |_| {})
}

fn counts_of(report: &PassReport, pid: u32) -> PageCounts {
    report
        .processes
        .iter()
        .find(|p| p.pid == pid)
        .expect("process in report")
        .counts
}

/// Two processes: shared content, unique pages, zero-filled pages and zero-page mappings.
struct TwoWorkers {
    a: TestChild,
    b: TestChild,
    ra: Region,
    rb: Region,
}

const A_PAGES: u64 = 200;
const B_PAGES: u64 = 140;

fn two_workers() -> TwoWorkers {
    let mut a = TestChild::spawn();
    let mut b = TestChild::spawn();
    let ra = a.map(A_PAGES);
    a.write(ra, 0, 100, 1); // 100 pages of content 1
    a.write_unique(ra, 100, 50, 1000); // 50 unique pages
    a.fill(ra, 150, 30, 0); // 30 zero-filled private pages
    a.read(ra, 180, 20); // 20 mappings of the kernel's zero page
    let rb = b.map(B_PAGES);
    b.write(rb, 0, 100, 1); // 100 more pages of content 1
    b.write(rb, 100, 20, 2); // 20 pages of content 2
    b.write_unique(rb, 120, 20, 5000); // 20 unique pages
    TwoWorkers { a, b, ra, rb }
}

#[test]
fn the_estimate_matches_the_truth_exactly_within_the_childrens_regions() {
    require_root();
    for checksum in [ChecksumKind::Xxh64, ChecksumKind::Crc32c] {
        let mut w = two_workers();
        let (pa, pb) = (w.a.pid(), w.b.pid());
        let mut scanner = scanner_over(&[(pa, w.ra, A_PAGES), (pb, w.rb, B_PAGES)], checksum);
        let mut processes = open(&[pa, pb]);
        let first = pass(&mut scanner, &mut processes);
        // First pass: nothing has a previous checksum, so nothing passes the gate.
        assert_eq!(
            first.total.volatile_pages,
            340 - 19,
            "{checksum}: {:?}",
            first.total
        );
        let report = pass(&mut scanner, &mut processes);
        let t = report.total;
        assert_eq!(t.scanned_pages, 340, "{checksum}: {t:?}");
        assert_eq!(
            t.already_shared_pages, 19,
            "zero-page mappings after the first: {t:?}"
        );
        assert_eq!(
            t.zero_pages, 50,
            "30 zero-filled + 20 zero-page mappings: {t:?}"
        );
        // Content 1: 200 copies → 199; zeros: 30 private + the zero page → 30; content 2: 19.
        assert_eq!(t.duplicate_pages, 199 + 30 + 19, "{t:?}");
        // Contents 1, 2, zero, and 50 + 20 unique pages.
        assert_eq!(t.unique_pages, 3 + 70, "{t:?}");
        assert_eq!(t.volatile_pages, 0, "{t:?}");
        assert_eq!(
            t.pages_hashed,
            340 - 20,
            "zero-page mappings are not read: {t:?}"
        );
        for (pid, pages) in [(pa, A_PAGES), (pb, B_PAGES)] {
            let c = counts_of(&report, pid);
            assert_eq!(c.scanned_pages, pages);
            assert_eq!(
                c.scanned_pages,
                c.already_shared_pages + c.duplicate_pages + c.unique_pages + c.volatile_pages
            );
        }
        let top = &report.top[0];
        assert_eq!(
            top.copies, 200,
            "content 1 is the most duplicated: {:?}",
            report.top
        );
        assert_eq!(top.pids.len(), 2);
        assert!(
            report.top.iter().any(|t| t.zero && t.copies == 31),
            "{:?}",
            report.top
        );
        // Reading changed nothing.
        assert!(
            w.a.verify(w.ra, 0, 100, 1)
                && w.b.verify(w.rb, 0, 100, 1)
                && w.b.verify(w.rb, 100, 20, 2)
        );
    }
}

#[test]
fn pages_shared_by_fork_are_counted_once_until_copy_on_write_breaks_them() {
    require_root();
    let mut parent = TestChild::spawn();
    let region = parent.map(100);
    parent.write_unique(region, 0, 100, 77);
    let forked = parent.fork();
    let mut scanner = scanner_over(
        &[(parent.pid(), region, 100), (forked, region, 100)],
        ChecksumKind::Xxh64,
    );
    let mut processes = open(&[parent.pid(), forked]);
    pass(&mut scanner, &mut processes);
    let t = pass(&mut scanner, &mut processes).total;
    assert_eq!(
        (
            t.scanned_pages,
            t.unique_pages,
            t.already_shared_pages,
            t.duplicate_pages
        ),
        (200, 100, 100, 0),
        "{t:?}"
    );

    // The parent rewrites 10 pages with the content they already had: copy-on-write gives it
    // private copies, which are now duplicates of the forked child's pages.
    parent.write_unique(region, 0, 10, 77);
    let t = pass(&mut scanner, &mut processes).total;
    assert_eq!(
        (
            t.scanned_pages,
            t.unique_pages,
            t.already_shared_pages,
            t.duplicate_pages
        ),
        (200, 100, 90, 10),
        "{t:?}"
    );
}

#[test]
fn pages_changed_between_passes_are_volatile() {
    require_root();
    let mut child = TestChild::spawn();
    let region = child.map(64);
    child.write(region, 0, 64, 3);
    let mut scanner = scanner_over(&[(child.pid(), region, 64)], ChecksumKind::Crc32c);
    let mut processes = open(&[child.pid()]);
    pass(&mut scanner, &mut processes);
    child.write(region, 0, 10, 4);
    let t = pass(&mut scanner, &mut processes).total;
    assert_eq!(
        (t.volatile_pages, t.duplicate_pages, t.unique_pages),
        (10, 53, 1),
        "{t:?}"
    );
    // Unchanged since: the ten now meet in the unstable tree too.
    let t = pass(&mut scanner, &mut processes).total;
    assert_eq!(
        (t.volatile_pages, t.duplicate_pages, t.unique_pages),
        (0, 53 + 9, 2),
        "{t:?}"
    );
}

#[test]
fn a_process_that_exits_or_unmaps_between_passes_does_not_disturb_the_others() {
    require_root();
    let mut w = two_workers();
    let (pa, pb) = (w.a.pid(), w.b.pid());
    let mut scanner = scanner_over(
        &[(pa, w.ra, A_PAGES), (pb, w.rb, B_PAGES)],
        ChecksumKind::Xxh64,
    );
    let mut processes = open(&[pa, pb]);
    pass(&mut scanner, &mut processes);
    w.a.unmap(w.ra);
    let b = std::mem::replace(&mut w.b, TestChild::spawn());
    b.exit();
    let report = pass(&mut scanner, &mut processes);
    assert_eq!(report.exited, [pb]);
    assert_eq!(
        counts_of(&report, pa),
        PageCounts::default(),
        "A's region is gone"
    );
    assert!(report.processes.iter().all(|p| p.pid != pb));
    assert_eq!(report.total, PageCounts::default());
}

fn estimate_json(args: &[String]) -> serde_json::Value {
    let output = rksm_command()
        .arg("estimate")
        .args(args)
        .arg("--json")
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("one JSON object")
}

const FIELDS: [&str; 7] = [
    "scanned_pages",
    "zero_pages",
    "duplicate_pages",
    "unique_pages",
    "volatile_pages",
    "already_shared_pages",
    "savings_mib",
];

#[test]
fn estimate_json_reports_every_field_per_process_and_in_total() {
    require_root();
    let mut w = two_workers();
    let (pa, pb) = (w.a.pid(), w.b.pid());
    let json = estimate_json(&[
        "--pid".into(),
        pa.to_string(),
        "--pid".into(),
        pb.to_string(),
        "--interval".into(),
        "0.2".into(),
    ]);
    for field in FIELDS {
        assert!(
            json["total"][field].is_number(),
            "total.{field} missing: {json}"
        );
    }
    let processes = json["processes"].as_array().unwrap();
    let pids: Vec<u64> = processes
        .iter()
        .map(|p| p["pid"].as_u64().unwrap())
        .collect();
    assert_eq!(pids, [u64::from(pa.min(pb)), u64::from(pa.max(pb))]);
    let total = |f: &str| json["total"][f].as_u64().unwrap();
    let sum = |f: &str| {
        processes
            .iter()
            .map(|p| p[f].as_u64().unwrap())
            .sum::<u64>()
    };
    for field in &FIELDS[..6] {
        assert_eq!(total(field), sum(field), "{field}");
    }
    // The whole processes hold at least what their regions hold.
    assert!(total("duplicate_pages") >= 248, "{json}");
    assert!(total("zero_pages") >= 50, "{json}");
    let savings = json["total"]["savings_mib"].as_f64().unwrap();
    assert!(
        (savings - total("duplicate_pages") as f64 / 256.0).abs() < 0.01,
        "{json}"
    );
    assert!(json["top_duplicates"].as_array().unwrap().len() <= 10);
    assert!(
        w.a.verify(w.ra, 0, 100, 1) && w.b.verify(w.rb, 0, 100, 1),
        "estimate changed memory"
    );
}

#[test]
fn comm_and_cgroup_selectors_find_the_right_processes() {
    require_root();
    let mut child = TestChild::spawn();
    let region = child.map(8);
    child.write(region, 0, 8, 9);
    let pid = child.pid();

    let json = estimate_json(&[
        "--comm".into(),
        "^rksm-testchild$".into(),
        "--passes".into(),
        "1".into(),
    ]);
    let pids: Vec<u64> = json["processes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["pid"].as_u64().unwrap())
        .collect();
    assert!(pids.contains(&u64::from(pid)), "{json}");

    // A v1 hierarchy and the v2 one, whichever this host mounts.
    for hierarchy in ["pids", "unified", ""] {
        let root = std::path::Path::new("/sys/fs/cgroup").join(hierarchy);
        if !root.join("cgroup.procs").exists() {
            continue;
        }
        let dir = root.join(format!("rksm-test-{pid}"));
        std::fs::create_dir_all(dir.join("inner")).unwrap();
        std::fs::write(dir.join("inner/cgroup.procs"), pid.to_string()).unwrap();
        let relative = dir
            .strip_prefix("/sys/fs/cgroup")
            .unwrap()
            .display()
            .to_string();
        let json = estimate_json(&["--cgroup".into(), relative, "--passes".into(), "1".into()]);
        // Move the child back before asserting, so the cgroups can always be removed.
        std::fs::write(root.join("cgroup.procs"), pid.to_string()).unwrap();
        std::fs::remove_dir(dir.join("inner")).unwrap();
        std::fs::remove_dir(&dir).unwrap();
        let pids: Vec<u64> = json["processes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["pid"].as_u64().unwrap())
            .collect();
        assert_eq!(pids, [u64::from(pid)], "{hierarchy}: {json}");
    }
}

#[test]
fn estimate_refuses_bad_targets_with_one_line_and_status_2() {
    for (args, says) in [
        (&["--pid", "4194305"][..], "does not exist"),
        (&["--cgroup", "no/such/cgroup-rksm"], "not found"),
        (&["--comm", "(unclosed"], "regular expression"),
        (&[], "no targets"),
        (&["--pid", "1", "--checksum", "md5"], "md5"),
        (&["--pid", "1", "--passes", "0"], "0"),
        (&["--comm", "^no-process-is-called-this$"], "no process"),
    ] {
        let output = rksm_command().arg("estimate").args(args).output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

#[test]
fn estimate_help_has_an_example() {
    let output = Command::new(rksm_tests::built_binary("rksm"))
        .args(["estimate", "--help"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&output.stdout).contains("Example:\n  rksm estimate"));
}

#[test]
fn all_covers_user_processes_but_not_rksm_and_min_age_filters() {
    require_root();
    let child = TestChild::spawn();
    let output = rksm_command()
        .args(["estimate", "--all", "--passes", "1", "--json"])
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let pids: Vec<u64> = json["processes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["pid"].as_u64().unwrap())
        .collect();
    assert!(pids.contains(&u64::from(child.pid())), "{json}");
    assert!(
        pids.contains(&u64::from(std::process::id())),
        "the test process is a user process too"
    );
    assert!(
        json["processes"]
            .as_array()
            .unwrap()
            .iter()
            .all(|p| p["comm"] != "rksm"),
        "rksm scanned itself"
    );

    // The child is seconds old: an hour's minimum age leaves nothing.
    let output = rksm_command()
        .args([
            "estimate",
            "--pid",
            &child.pid().to_string(),
            "--min-age",
            "3600",
        ])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("no process matches"));
}

#[test]
fn without_privileges_rksm_says_which_capabilities_are_missing() {
    require_root();
    let rksm = rksm_tests::built_binary("rksm");
    for (args, says) in [
        (
            &["estimate", "--pid", "1"][..],
            "missing CAP_SYS_PTRACE, CAP_SYS_ADMIN, CAP_DAC_READ_SEARCH",
        ),
        (
            &["daemon", "--pid", "1"],
            "missing CAP_SYS_PTRACE, CAP_SYS_ADMIN, CAP_BPF, CAP_PERFMON, CAP_DAC_READ_SEARCH",
        ),
        (&["trace", "--pid", "1"], "missing CAP_BPF, CAP_PERFMON"),
    ] {
        // As nobody, with no capabilities left.
        let output = Command::new("setpriv")
            .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
            .arg(&rksm)
            .args(args)
            .output()
            .expect("setpriv (util-linux)");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
}
