//! The daemon on live processes: duplicates merged (kernel evidence), memory intact,
//! processes running, targets refused when they must be, ksmd restored.
//!
//! One rksm daemon owns ksmd at a time, so the scenarios here take turns.

use std::{
    collections::HashSet,
    process::Stdio,
    time::{Duration, Instant},
};

use rksm::{
    daemon::{
        Daemon, DaemonConfig, DaemonError, DaemonStats, DirtyMode, DomainPolicy, OutsiderPolicy,
        SeveralDomains,
    },
    engine::{checksum::ChecksumKind, dirty::protection::WriteProtect, targets::TargetSpec},
};
use rksm_tests::{
    any_vma_mergeable, blocked_syscall, fd_count, ksm_merging_pages, ksm_pages, ksm_turn,
    ksmd_settings, page_frames, proc_status, require_root, rksm_command, twins, vma_mergeable,
    wait_for, Region, Running, TestChild, PAGE,
};

/// A daemon over exactly these regions, in `mode`.
fn daemon_over(regions: &[(u32, Region, u64)], mode: DirtyMode) -> Daemon {
    daemon_with_domains(regions, mode, DomainPolicy::Uid)
}

fn daemon_with_domains(
    regions: &[(u32, Region, u64)],
    mode: DirtyMode,
    domain: DomainPolicy,
) -> Daemon {
    let config = DaemonConfig {
        domain,
        several_domains: SeveralDomains::Allow,
        targets: TargetSpec {
            pids: regions.iter().map(|r| r.0).collect(),
            ..TargetSpec::default()
        },
        dirty: mode,
        checksum: ChecksumKind::Xxh64,
        only_ranges: regions
            .iter()
            .map(|&(pid, r, pages)| (pid, r.base, r.base + pages * PAGE))
            .collect(),
        ..DaemonConfig::default()
    };
    let daemon = Daemon::start(config).expect("daemon starts");
    assert_eq!(daemon.dirty_mode(), mode);
    daemon
}

/// Runs passes until `after_pass` (which may also change the workload) says done, or 60 s.
fn passes_until(daemon: &mut Daemon, mut after_pass: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        daemon.pass();
        if after_pass() {
            return true;
        }
        daemon.wait(Instant::now() + Duration::from_millis(300), &[]);
    }
    false
}

/// Runs passes until `done` says so (or 60 s), stops the daemon and returns its counters;
/// fails with `what` and the counters if `done` never said so.
fn finish_when(mut daemon: Daemon, what: &str, done: impl FnMut() -> bool) -> DaemonStats {
    let done = passes_until(&mut daemon, done);
    let stats = daemon.finish();
    assert!(done, "{what}: {stats:?}");
    stats
}

/// Whether each of `kids` has the first `pages` pages of its region merged.
fn all_merged(kids: &[(TestChild, Region)], pages: u64) -> bool {
    kids.iter()
        .all(|(c, r)| ksm_pages(c.pid(), *r, pages).len() == pages as usize)
}

const PAGES: u64 = 256;
const SHARED: u64 = 128; // pages 0..128: the same content in every child
const UNIQUE: u64 = 64; // pages 128..192: different in every child
                        // pages 192..256: rewritten between passes (volatile)

struct Worker {
    child: TestChild,
    region: Region,
    seed: u64,
}

fn workers(n: u64) -> Vec<Worker> {
    (0..n)
        .map(|i| {
            let mut child = TestChild::spawn();
            let region = child.map(PAGES);
            child.write(region, 0, SHARED, 1);
            child.write_unique(region, SHARED, UNIQUE, 1000 * (i + 1));
            child.write_unique(
                region,
                SHARED + UNIQUE,
                PAGES - SHARED - UNIQUE,
                50_000 * (i + 1),
            );
            Worker {
                child,
                region,
                seed: 1000 * (i + 1),
            }
        })
        .collect()
}

fn regions(workers: &[Worker]) -> Vec<(u32, Region, u64)> {
    workers
        .iter()
        .map(|w| (w.child.pid(), w.region, PAGES))
        .collect()
}

/// Every shared page of every worker is a KSM page, and no unique page is.
fn shared_pages_merged(workers: &[Worker]) -> bool {
    workers.iter().all(|w| {
        ksm_pages(w.child.pid(), w.region, SHARED + UNIQUE) == (0..SHARED).collect::<Vec<_>>()
    })
}

fn merge_scenario(mode: DirtyMode) -> (DaemonStats, Vec<Vec<u64>>) {
    let mut workers = workers(3);
    let fds_before: Vec<usize> = workers.iter().map(|w| fd_count(w.child.pid())).collect();
    let daemon = daemon_over(&regions(&workers), mode);
    let mut round = 0u64;
    let stats = finish_when(
        daemon,
        &format!("{mode}: shared pages not merged in time"),
        || {
            // Writers keep changing the volatile pages while rksm works.
            round += 1;
            for (i, w) in workers.iter_mut().enumerate() {
                w.child.write_unique(
                    w.region,
                    SHARED + UNIQUE,
                    PAGES - SHARED - UNIQUE,
                    100_000 * round + i as u64 * 1000,
                );
            }
            shared_pages_merged(&workers)
        },
    );
    let merged_sets = workers
        .iter()
        .map(|w| ksm_pages(w.child.pid(), w.region, PAGES))
        .collect();
    for (i, w) in workers.iter_mut().enumerate() {
        let pid = w.child.pid();
        assert!(
            ksm_merging_pages(pid) >= SHARED,
            "{mode}: /proc/{pid}/ksm_merging_pages"
        );
        assert!(
            w.child.verify(w.region, 0, SHARED, 1),
            "{mode}: shared content changed"
        );
        assert!(
            w.child.verify_unique(w.region, SHARED, UNIQUE, w.seed),
            "{mode}: unique content changed"
        );
        let last = 100_000 * round + i as u64 * 1000;
        assert!(
            w.child
                .verify_unique(w.region, SHARED + UNIQUE, PAGES - SHARED - UNIQUE, last),
            "{mode}: volatile content changed"
        );
        assert_eq!(
            fd_count(pid),
            fds_before[i],
            "{mode}: fd left in the target"
        );
        assert_eq!(proc_status(pid, "TracerPid:"), "0");
    }
    (stats, merged_sets)
}

#[test]
fn every_dirty_mode_merges_the_same_pages_and_leaves_memory_intact() {
    require_root();
    let _turn = ksm_turn();
    let mut sets = Vec::new();
    for mode in [DirtyMode::HashOnly, DirtyMode::Pagemap, DirtyMode::Ebpf] {
        let (stats, merged) = merge_scenario(mode);
        assert!(stats.pages_sharing >= 3 * SHARED - 3, "{mode}: {stats:?}");
        assert!(stats.remote_syscalls > 0);
        sets.push((mode, merged));
    }
    let reference = &sets[0].1;
    for (mode, merged) in &sets {
        // Only the shared pages, in every child: the same set in every mode.
        assert_eq!(
            merged, reference,
            "{mode} merged different pages than hash-only"
        );
        assert!(
            merged.iter().all(|pages| pages.iter().all(|&p| p < SHARED)),
            "{mode}: a unique or volatile page was merged"
        );
    }
}

#[test]
fn ebpf_mode_hashes_a_small_fraction_of_what_hash_only_does_on_static_memory() {
    require_root();
    let _turn = ksm_turn();
    let mut hashed = Vec::new();
    for mode in [DirtyMode::HashOnly, DirtyMode::Ebpf] {
        let workers = workers(2);
        let mut daemon = daemon_over(&regions(&workers), mode);
        for _ in 0..3 {
            daemon.pass();
        }
        let before = daemon.stats().pages_hashed;
        for _ in 0..3 {
            daemon.pass();
        }
        let steady = daemon.stats().pages_hashed - before;
        hashed.push(steady);
        daemon.finish();
    }
    let (hash_only, ebpf) = (hashed[0], hashed[1]);
    assert!(
        hash_only >= 3 * 2 * (PAGES - SHARED),
        "hash-only rehashes everything: {hash_only}"
    );
    assert!(
        ebpf * 10 <= hash_only,
        "ebpf hashed {ebpf} pages in steady state, hash-only {hash_only}"
    );
}

/// In a dirty-bit mode a page is compared when it is first read, and what it duplicates is
/// marked at the next pass only if neither copy was written in between: KSM's checksum gate,
/// kept by the dirty bit instead of by reading everything a second time.
#[test]
fn duplicates_found_at_the_first_read_are_marked_after_a_clean_pass_without_reading_again() {
    require_root();
    let _turn = ksm_turn();
    for mode in [DirtyMode::Pagemap, DirtyMode::Ebpf] {
        let (mut a, mut b) = (TestChild::spawn(), TestChild::spawn());
        let (ra, rb) = (a.map(64), b.map(64));
        a.write_unique(ra, 0, 64, 500);
        b.write_unique(rb, 0, 64, 500);
        let mut daemon = daemon_over(&[(a.pid(), ra, 64), (b.pid(), rb, 64)], mode);

        let first = daemon.pass();
        assert_eq!(
            (first.duplicates, first.runs_marked),
            (0, 0),
            "{mode}: nothing is a duplicate before the gate: {first:?}"
        );
        assert!(!vma_mergeable(a.pid(), ra.base) && !vma_mergeable(b.pid(), rb.base));

        // The second half of one copy changes: neither copy of it may pass the gate.
        b.write_unique(rb, 32, 32, 9000);
        let second = daemon.pass();
        assert_eq!(
            (second.pages_hashed, second.duplicates),
            (32, 32),
            "{mode}: only the written pages are read again; the clean copies pass: {second:?}"
        );
        for (pid, region) in [(a.pid(), ra), (b.pid(), rb)] {
            assert!(
                vma_mergeable(pid, region.base),
                "{mode}: pid {pid} not marked"
            );
            assert!(
                !vma_mergeable(pid, region.base + 48 * PAGE),
                "{mode}: pid {pid}: a page that failed the gate was marked"
            );
        }

        let halves = (0..32).collect::<Vec<u64>>();
        finish_when(
            daemon,
            &format!("{mode}: the clean halves were not merged"),
            || ksm_pages(a.pid(), ra, 64) == halves && ksm_pages(b.pid(), rb, 64) == halves,
        );
        assert!(a.verify_unique(ra, 0, 64, 500));
        assert!(b.verify_unique(rb, 0, 32, 500) && b.verify_unique(rb, 32, 32, 9000));
    }
}

/// The look-alike kinds of the test child: pages the sampler's bytes cannot tell apart.
const ALIKE: [&str; 3] = ["sample", "oddbyte", "lastline"];

#[test]
fn pages_the_sample_cannot_tell_apart_are_merged_only_where_they_are_equal_in_full() {
    require_root();
    let _turn = ksm_turn();
    let (mut a, mut b) = (TestChild::spawn(), TestChild::spawn());
    let (ra, rb) = (a.map(192), b.map(192));
    // Per kind, 32 pages identical in both children, then 32 that differ between them only
    // where the sample does not look.
    for (k, kind) in ALIKE.iter().enumerate() {
        let first = 64 * k as u64;
        a.write_alike(kind, ra, first, 32, 7);
        b.write_alike(kind, rb, first, 32, 7);
        a.write_alike(kind, ra, first + 32, 32, 1000);
        b.write_alike(kind, rb, first + 32, 32, 2000);
    }
    let mut daemon = daemon_over(&[(a.pid(), ra, 192), (b.pid(), rb, 192)], DirtyMode::Ebpf);
    let equal: Vec<u64> = (0..3).flat_map(|k| 64 * k..64 * k + 32).collect();
    let mut passes = 0;
    let merged = passes_until(&mut daemon, || {
        passes += 1;
        ksm_pages(a.pid(), ra, 192) == equal && ksm_pages(b.pid(), rb, 192) == equal
    });
    // Two more passes: what differs stays apart.
    daemon.pass();
    daemon.pass();
    let stats = daemon.finish();
    assert!(merged, "the equal pages were not merged: {stats:?}");
    assert_eq!(
        ksm_pages(a.pid(), ra, 192),
        equal,
        "only equal pages merged"
    );
    assert_eq!(
        ksm_pages(b.pid(), rb, 192),
        equal,
        "only equal pages merged"
    );
    assert_eq!(
        stats.pages_sampled, 384,
        "every new page was sampled: {stats:?}"
    );
    assert_eq!(
        stats.pages_only_sampled, 0,
        "no look-alike was left unread: {stats:?}"
    );
    for (k, kind) in ALIKE.iter().enumerate() {
        let first = 64 * k as u64;
        assert!(a.verify_alike(kind, ra, first, 32, 7) && b.verify_alike(kind, rb, first, 32, 7));
        assert!(a.verify_alike(kind, ra, first + 32, 32, 1000), "{kind}");
        assert!(b.verify_alike(kind, rb, first + 32, 32, 2000), "{kind}");
    }
}

#[test]
fn a_clean_page_only_sampled_is_read_whole_when_a_newcomer_meets_it_and_merged() {
    require_root();
    let _turn = ksm_turn();
    let (mut old, mut new) = (TestChild::spawn(), TestChild::spawn());
    let ro = old.map(64);
    old.write_unique(ro, 0, 64, 800);
    // The newcomer's memory comes later, where the daemon already looks.
    let base = 0x5a00_0000_0000;
    let regions = [(old.pid(), ro, 64), (new.pid(), Region { id: 0, base }, 64)];
    let mut daemon = daemon_over(&regions, DirtyMode::Ebpf);
    let first = daemon.pass();
    let stats = daemon.stats().clone();
    assert_eq!(
        (
            stats.pages_sampled,
            stats.pages_only_sampled,
            first.pages_hashed
        ),
        (64, 64, 0),
        "the old pages are one of a kind: sampled, not read: {stats:?}"
    );
    daemon.pass();
    assert_eq!(
        daemon.stats().pages_hashed,
        0,
        "clean pages only sampled stay unread"
    );

    // Half of them come again in a new mapping of the newcomer.
    let rn = new.map_at(64, base);
    new.write_unique(rn, 0, 32, 800);
    let all: Vec<u64> = (0..32).collect();
    let stats = finish_when(
        daemon,
        "the old sampled pages were not merged with the newcomer's",
        || ksm_pages(old.pid(), ro, 64) == all && ksm_pages(new.pid(), rn, 64) == all,
    );
    assert!(
        stats.pages_hashed >= 64 && stats.pages_hashed < 96,
        "the newcomer's 32 pages and the 32 they met were read whole, not the other 32: {stats:?}"
    );
    assert!(old.verify_unique(ro, 0, 64, 800) && new.verify_unique(rn, 0, 32, 800));
}

#[test]
fn a_written_page_that_meets_a_page_only_sampled_has_it_read_whole_and_merged() {
    require_root();
    let _turn = ksm_turn();
    let (mut old, mut writer) = (TestChild::spawn(), TestChild::spawn());
    let (ro, rw) = (old.map(64), writer.map(64));
    old.write_unique(ro, 0, 64, 800);
    writer.write_unique(rw, 0, 64, 5000);
    let mut daemon = daemon_over(
        &[(old.pid(), ro, 64), (writer.pid(), rw, 64)],
        DirtyMode::Ebpf,
    );
    daemon.pass();
    assert_eq!(
        daemon.stats().pages_only_sampled,
        128,
        "every page is one of a kind: {:?}",
        daemon.stats()
    );
    // The writer's pages, already known, are rewritten with the old pages' contents: they
    // are read whole as written pages, not sampled.
    writer.write_unique(rw, 0, 64, 800);
    let all: Vec<u64> = (0..64).collect();
    let stats = finish_when(
        daemon,
        "the pages only sampled were not merged with the written ones",
        || ksm_pages(old.pid(), ro, 64) == all && ksm_pages(writer.pid(), rw, 64) == all,
    );
    assert_eq!(stats.pages_sampled, 128, "nothing sampled twice: {stats:?}");
    assert!(old.verify_unique(ro, 0, 64, 800) && writer.verify_unique(rw, 0, 64, 800));
}

#[test]
fn a_large_first_pass_takes_the_checksum_of_each_copy_from_its_twin_and_merges_them_all() {
    require_root();
    let _turn = ksm_turn();
    // Two processes holding the same 32 MiB, every page different, each the same in both: a
    // first pass of 16,384 pages, read side by side.
    const TWIN_PAGES: u64 = 8192;
    let twins: Vec<(TestChild, Region)> = (0..2)
        .map(|_| {
            let mut child = TestChild::spawn();
            let region = child.map(TWIN_PAGES);
            child.write_unique(region, 0, TWIN_PAGES, 31);
            (child, region)
        })
        .collect();
    let regions: Vec<(u32, Region, u64)> = twins
        .iter()
        .map(|(c, r)| (c.pid(), *r, TWIN_PAGES))
        .collect();
    let mut daemon = daemon_over(&regions, DirtyMode::Ebpf);
    let first = daemon.pass();
    assert_eq!(first.pages_hashed, 2 * TWIN_PAGES, "{first:?}");
    let stats = daemon.stats();
    // Each page of the second process read is a copy of one the first's batch just held:
    // its checksum is that page's, not computed again. A few lose their twin's place in the
    // table of twins to another digest and are hashed.
    assert!(
        stats.pages_twinned > TWIN_PAGES * 9 / 10 && stats.pages_twinned <= TWIN_PAGES,
        "{} of {TWIN_PAGES} copies twinned",
        stats.pages_twinned
    );
    // What the bench holds against memcpy: the first pass, its pages, seconds and CPU.
    assert_eq!(stats.first_pass_pages, 2 * TWIN_PAGES);
    assert_eq!(stats.first_pass_seconds, first.seconds);
    assert!(stats.first_pass_cpu_seconds > 0.0, "{stats:?}");
    let second = daemon.pass();
    assert_eq!(second.duplicates, TWIN_PAGES, "{second:?}");
    finish_when(daemon, "not merged", || {
        twins
            .iter()
            .all(|(c, _)| ksm_merging_pages(c.pid()) == TWIN_PAGES)
    });
    for (mut child, region) in twins {
        assert!(child.verify_unique(region, 0, TWIN_PAGES, 31));
    }
}

#[test]
fn copies_laid_out_differently_in_each_process_still_take_their_twins_checksum() {
    require_root();
    let _turn = ksm_turn();
    // The same 4,096 pages in two processes: packed in the first; in the second, in blocks
    // of 32 with 32 pages of its own after each, which are one of a kind and only sampled.
    // The second's batches of 128 copies span 224 pages of its memory, the first's 128: read
    // level by address space, the second fell further behind at every batch, out of reach of
    // the batches kept.
    const COPIES: u64 = 4096;
    const BLOCK: u64 = 32;
    let mut packed = TestChild::spawn();
    let packed_region = packed.map(COPIES);
    packed.write_unique(packed_region, 0, COPIES, 31);
    let mut spread = TestChild::spawn();
    let spread_region = spread.map(2 * COPIES);
    for block in 0..COPIES / BLOCK {
        let at = 2 * block * BLOCK;
        spread.write_unique(spread_region, at, BLOCK, 31 + block * BLOCK);
        spread.write_unique(spread_region, at + BLOCK, BLOCK, 1_000_000 + block * BLOCK);
    }
    let regions = [
        (packed.pid(), packed_region, COPIES),
        (spread.pid(), spread_region, 2 * COPIES),
    ];
    let mut daemon = daemon_over(&regions, DirtyMode::Ebpf);
    let first = daemon.pass();
    let stats = daemon.stats();
    assert_eq!(stats.pages_only_sampled, COPIES, "{stats:?}");
    assert_eq!(first.pages_hashed, 2 * COPIES, "{first:?}");
    assert!(
        stats.pages_twinned > COPIES * 9 / 10 && stats.pages_twinned <= COPIES,
        "{} of {COPIES} copies twinned",
        stats.pages_twinned
    );
    let second = daemon.pass();
    assert_eq!(second.duplicates, COPIES, "{second:?}");
    daemon.finish();
    assert!(packed.verify_unique(packed_region, 0, COPIES, 31));
    for block in 0..COPIES / BLOCK {
        let at = 2 * block * BLOCK;
        assert!(spread.verify_unique(spread_region, at, BLOCK, 31 + block * BLOCK));
        assert!(spread.verify_unique(spread_region, at + BLOCK, BLOCK, 1_000_000 + block * BLOCK));
    }
}

#[test]
fn a_thread_with_a_seccomp_filter_of_its_own_is_never_borrowed() {
    require_root();
    let _turn = ksm_turn();
    let mut pair = twins(2, 32, 61);
    // A worker that dies on madvise, running: the thread a borrow would otherwise prefer.
    pair[0].0.command("seccompworker");
    let regions: Vec<(u32, Region, u64)> = pair.iter().map(|(c, r)| (c.pid(), *r, 32)).collect();
    let daemon = daemon_over(&regions, DirtyMode::Pagemap);
    let stats = finish_when(daemon, "not merged", || all_merged(&pair, 32));
    assert!(stats.targets_refused.is_empty(), "{stats:?}");
    for (child, region) in &mut pair {
        assert!(
            child.verify(*region, 0, 32, 61),
            "the process died or changed"
        );
    }
}

#[test]
fn traced_and_seccomp_targets_are_refused_and_left_alone() {
    require_root();
    let _turn = ksm_turn();
    let mut ok = TestChild::spawn();
    let mut filtered = TestChild::spawn();
    filtered.seccomp();
    let traced = TestChild::spawn();
    let tid = nix::unistd::Pid::from_raw(traced.pid() as i32);
    nix::sys::ptrace::seize(tid, nix::sys::ptrace::Options::empty()).unwrap();
    let mut regions = Vec::new();
    for child in [&mut ok, &mut filtered] {
        let r = child.map(64);
        child.write(r, 0, 64, 9);
        regions.push((child.pid(), r, 64));
    }
    regions.push((
        traced.pid(),
        Region {
            id: 0,
            base: 0x1000_0000,
        },
        1,
    ));
    assert!(wait_for(Duration::from_secs(5), || proc_status(
        filtered.pid(),
        "State:"
    )
    .starts_with('S')));
    let before = blocked_syscall(filtered.pid());

    let mut daemon = daemon_over(&regions, DirtyMode::Pagemap);
    for _ in 0..3 {
        daemon.pass();
    }
    let stats = daemon.finish();
    assert_eq!(stats.targets_refused.get("seccomp"), Some(&1), "{stats:?}");
    assert_eq!(stats.targets_refused.get("traced"), Some(&1), "{stats:?}");
    assert_eq!(ksm_merging_pages(filtered.pid()), 0);
    assert_eq!(
        blocked_syscall(filtered.pid()),
        before,
        "the seccomp target was touched"
    );
    assert_eq!(proc_status(filtered.pid(), "TracerPid:"), "0");
    assert_eq!(
        proc_status(traced.pid(), "TracerPid:"),
        nix::unistd::gettid().to_string(),
        "only our own seize"
    );
    nix::sys::ptrace::interrupt(tid).unwrap();
    nix::sys::wait::waitpid(tid, Some(nix::sys::wait::WaitPidFlag::__WALL)).unwrap();
    nix::sys::ptrace::detach(tid, None).unwrap();
}

#[test]
fn multithreaded_and_sleeping_targets_are_merged_and_keep_running() {
    require_root();
    let _turn = ksm_turn();
    let mut threaded = TestChild::spawn();
    threaded.threads(4);
    let mut sleeper = TestChild::spawn();
    let mut regions = Vec::new();
    for child in [&mut threaded, &mut sleeper] {
        let r = child.map(64);
        child.write(r, 0, 64, 11);
        regions.push((child.pid(), r, 64));
    }
    let started = Instant::now();
    sleeper.send("sleep 3000");
    let mut daemon = daemon_over(&regions, DirtyMode::Ebpf);
    let merged = passes_until(&mut daemon, || {
        regions
            .iter()
            .all(|&(pid, r, n)| ksm_pages(pid, r, n).len() == n as usize)
    });
    daemon.finish();
    assert!(merged, "not merged");
    assert_eq!(sleeper.reply(), "slept");
    assert!(
        started.elapsed() >= Duration::from_millis(3000),
        "the sleep was cut short"
    );
    assert!(threaded.verify(regions[0].1, 0, 64, 11) && sleeper.verify(regions[1].1, 0, 64, 11));
}

/// Starts `rksm daemon --json` over `pids` with its status socket at `socket`.
fn spawn_daemon(pids: &[u32], socket: &std::path::Path) -> std::process::Child {
    let mut cmd = rksm_command();
    cmd.args(["daemon", "--interval", "0.2", "--json", "--socket"])
        .arg(socket);
    for pid in pids {
        cmd.args(["--pid", &pid.to_string()]);
    }
    cmd.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// SIGTERMs `rksm` and returns its JSON counters, checking it exited cleanly.
fn terminate(rksm: std::process::Child) -> serde_json::Value {
    // SAFETY: kill with a valid pid and signal.
    assert_eq!(unsafe { libc::kill(rksm.id() as i32, libc::SIGTERM) }, 0);
    let output = rksm.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("JSON on stdout")
}

#[test]
fn sigterm_restores_ksmd_and_prints_the_counters() {
    require_root();
    let _turn = ksm_turn();
    let before = ksmd_settings();
    let mut child = TestChild::spawn();
    let r = child.map(32);
    child.write(r, 0, 32, 5);
    let socket = std::env::temp_dir().join(format!("rksm-sigterm-{}.sock", child.pid()));
    let rksm = spawn_daemon(&[child.pid()], &socket);
    assert!(
        wait_for(Duration::from_secs(10), || {
            rksm::service::status::query(&socket).is_ok_and(|s| s.last_pass.is_some())
        }),
        "no pass was reported"
    );
    let json = terminate(rksm);
    assert_eq!(ksmd_settings(), before, "ksmd's settings were not restored");
    for key in [
        "pages_shared",
        "pages_sharing",
        "pages_unshared",
        "pages_volatile",
        "full_scans",
        "pages_hashed",
        "pages_skipped_clean",
        "checksum_ns",
        "write_faults",
        "tracer_lost",
        "cow_breaks",
        "remote_syscalls",
        "borrows",
        "rseq_aborts",
        "eintr_risk",
    ] {
        assert!(json[key].is_u64(), "{key} missing: {json}");
    }
    assert!(json["targets_refused"].is_object());
    assert!(json["full_scans"].as_u64().unwrap() >= 1);
}

#[test]
fn sigterm_mid_pass_stops_between_targets() {
    require_root();
    let _turn = ksm_turn();
    let before = ksmd_settings();
    // Eight targets of 256 MiB: a first pass that reads 2 GiB, long enough to be inside.
    let mut children: Vec<TestChild> = (0..8).map(|_| TestChild::spawn()).collect();
    for (i, child) in children.iter_mut().enumerate() {
        let r = child.map(65536);
        child.command(&format!("unique {} 0 65536 {}", r.id, i * 100_000));
    }
    let pids: Vec<u32> = children.iter().map(TestChild::pid).collect();
    let socket = std::env::temp_dir().join(format!("rksm-midpass-{}.sock", pids[0]));
    let rksm = spawn_daemon(&pids, &socket);
    // The status socket answers from the start; the first pass is then under way.
    assert!(wait_for(Duration::from_secs(10), || {
        rksm::service::status::query(&socket).is_ok()
    }));
    let json = terminate(rksm);
    assert_eq!(
        json["full_scans"].as_u64(),
        Some(0),
        "the first pass ran to its end: {json}"
    );
    assert!(json["pages_hashed"].as_u64().unwrap() < 8 * 65536);
    assert_eq!(ksmd_settings(), before, "ksmd's settings were not restored");
    for child in &children {
        assert_eq!(proc_status(child.pid(), "TracerPid:"), "0");
    }
}

#[test]
fn run_manages_a_command_and_its_children_and_exits_with_its_status() {
    require_root();
    let _turn = ksm_turn();
    let before = ksmd_settings();
    let status = rksm_command()
        .args(["run", "--interval", "0.2", "--", "sh", "-c", "exit 7"])
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(7));
    assert_eq!(ksmd_settings(), before);

    // A real workload under `rksm run`: the test talks to it through rksm's stdin/stdout.
    let mut rksm = rksm_command()
        .args([
            "run",
            "--interval",
            "0.3",
            "--json",
            "--",
            rksm_tests::built_binary("rksm-testchild").to_str().unwrap(),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut child = TestChild::attach(&mut rksm);
    let mut log = rksm.stderr.take().unwrap();
    let r = child.map(128);
    child.write(r, 0, 128, 21);
    let forked = child.fork();
    let pid = child.pid_from_proc();
    assert!(
        wait_for(Duration::from_secs(60), || ksm_pages(pid, r, 128).len()
            == 128),
        "rksm run did not merge"
    );
    assert!(child.verify(r, 0, 128, 21));
    child.send("exit");
    let rest = child.rest_of_output();
    assert!(rksm.wait().unwrap().success());
    let last = rest.lines().last().unwrap_or("").to_string();
    let json: serde_json::Value =
        serde_json::from_str(&last).expect("JSON after the command's output");
    // The counters are those of the last pass, which may predate ksmd's merge; what rksm
    // marked is not.
    assert!(json["pages_marked"].as_u64().unwrap() >= 128, "{json}");
    assert_eq!(ksmd_settings(), before);
    let mut log_text = String::new();
    std::io::Read::read_to_string(&mut log, &mut log_text).unwrap();
    assert!(
        log_text.contains(&format!("target pid {pid} ")),
        "{log_text}"
    );
    assert!(
        log_text.contains(&format!("target pid {forked} ")),
        "the forked child was not picked up: {log_text}"
    );
}

#[test]
fn bad_daemon_input_gets_one_line_and_status_2() {
    let _turn = ksm_turn();
    for args in [
        &["daemon", "--pid", "1", "--dirty", "soft-dirty"][..],
        &["daemon", "--pid", "4194305", "--passes", "1"],
        &["daemon", "--cgroup", "no/such/cgroup-rksm", "--passes", "1"],
        &["daemon", "--passes", "1"],
        &["daemon", "--pid", "1", "--passes", "0"],
        &["run", "--", "/no/such/program-rksm"],
    ] {
        let output = rksm_command().args(args).output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

#[test]
fn copy_on_write_breaks_are_counted_and_their_region_backs_off() {
    require_root();
    let _turn = ksm_turn();
    let mut child = TestChild::spawn();
    let r = child.map(512);
    child.write(r, 0, 512, 31);
    let pid = child.pid();
    let mut daemon = daemon_over(&[(pid, r, 512)], DirtyMode::Ebpf);
    assert!(
        passes_until(&mut daemon, || ksm_pages(pid, r, 512).len() == 512),
        "never merged"
    );
    assert_eq!(daemon.stats().cow_breaks, 0);

    // Writing merged pages breaks them (copy-on-write), even with the same bytes.
    child.write(r, 0, 64, 31);
    daemon.pass();
    let stats = daemon.stats().clone();
    assert!(stats.cow_breaks >= 64, "{stats:?}");
    assert!(stats.regions_backed_off >= 1, "{stats:?}");
    // Backed off (for 4 passes the first time): unmarked, so ksmd leaves the broken pages
    // alone although they are duplicates again.
    for _ in 0..3 {
        daemon.wait(Instant::now() + Duration::from_millis(400), &[]);
        daemon.pass();
    }
    assert!(
        ksm_pages(pid, r, 64).is_empty(),
        "a backed-off region was merged again"
    );
    daemon.finish();
    assert!(child.verify(r, 0, 512, 31));
}

/// A target that holds a userfaultfd of its own keeps that facility whole: where the kernel
/// keeps soft-dirty bits, rksm protects it that way, all of it; where only userfaultfd
/// protection exists, rksm does not register its own (the target could not register any
/// more memory) and hashes the target whole every pass.
#[test]
fn memory_the_target_registered_with_its_own_userfaultfd_is_left_to_it() {
    require_root();
    let _turn = ksm_turn();
    let mut child = TestChild::spawn();
    let own = child.map(64);
    let plain = child.map(64);
    child.write(own, 0, 64, 41);
    child.write(plain, 0, 64, 42);
    child.own_userfaultfd(own);
    let pid = child.pid();
    let mut daemon = daemon_over(&[(pid, own, 64), (pid, plain, 64)], DirtyMode::Pagemap);
    for _ in 0..3 {
        daemon.pass();
    }
    let before = daemon.stats().clone();
    daemon.pass();
    let after = daemon.stats().clone();
    let target = daemon.targets().next().expect("the target");
    let (source, why) = target.write_protect();
    let rehashed = if rksm::kernel::softdirty::supported() {
        assert_eq!(source, WriteProtect::SoftDirty, "{why}");
        0
    } else {
        assert_eq!(source, WriteProtect::None, "{why}");
        assert!(why.contains("a userfaultfd of its own"), "{why}");
        128
    };
    assert_eq!(
        after.pages_hashed - before.pages_hashed,
        rehashed,
        "{after:?}"
    );
    assert_eq!(
        after.pages_skipped_clean - before.pages_skipped_clean,
        128 - rehashed,
        "{after:?}"
    );
    assert!(passes_until(&mut daemon, || ksm_pages(pid, own, 64).len()
        == 64
        && ksm_pages(pid, plain, 64).len() == 64));
    daemon.finish();
    assert!(child.verify(own, 0, 64, 41) && child.verify(plain, 0, 64, 42));
}

#[test]
fn after_sigkill_no_target_is_left_stopped_and_the_next_start_restores_ksmd() {
    require_root();
    let _turn = ksm_turn();
    let before = ksmd_settings();
    let mut child = TestChild::spawn();
    let r = child.map(256);
    child.write(r, 0, 256, 17);
    let pid = child.pid().to_string();
    let mut rksm = rksm_command()
        .args([
            "daemon",
            "--pid",
            &pid,
            "--interval",
            "0.05",
            "--dirty",
            "ebpf",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    assert!(
        wait_for(Duration::from_secs(10), || ksmd_settings().0 == "1"),
        "rksm did not take ksmd over"
    );
    // Let it run a few passes (and remote calls), then kill it without warning.
    std::thread::sleep(Duration::from_millis(300));
    rksm.kill().unwrap();
    rksm.wait().unwrap();
    assert!(
        std::path::Path::new(rksm::kernel::ksmd::STATE_PATH).exists(),
        "no record of ksmd's settings"
    );
    assert!(wait_for(Duration::from_secs(5), || proc_status(
        child.pid(),
        "State:"
    )
    .starts_with('S')));
    assert_eq!(proc_status(child.pid(), "TracerPid:"), "0");
    assert!(child.verify(r, 0, 256, 17), "memory changed");

    let status = rksm_command()
        .args(["daemon", "--pid", &pid, "--passes", "1"])
        .status()
        .unwrap();
    assert!(status.success());
    assert_eq!(
        ksmd_settings(),
        before,
        "ksmd's settings from before the killed rksm are not back"
    );
    assert!(!std::path::Path::new(rksm::kernel::ksmd::STATE_PATH).exists());
}

#[test]
fn a_non_dumpable_process_with_duplicates_is_never_marked() {
    require_root();
    let _turn = ksm_turn();
    let mut open = TestChild::spawn_as_nobody();
    let mut secretive = TestChild::spawn_as_nobody();
    let (ra, rb) = (open.map(64), secretive.map(64));
    open.write(ra, 0, 64, 79);
    secretive.write(rb, 0, 64, 79);
    let (open_pid, secretive_pid) = (open.pid_from_proc(), secretive.pid_from_proc());
    let regions = [(open_pid, ra, 64), (secretive_pid, rb, 64)];
    let mut daemon = daemon_with_domains(&regions, DirtyMode::Pagemap, DomainPolicy::Uid);
    // Named on the command line it would be refused at start with an error; turning
    // non-dumpable once rksm runs, it is refused before its first pass.
    secretive.command("nodump");
    // The other one's own duplicates are merged; the secretive one is never touched.
    let merged = passes_until(&mut daemon, || ksm_pages(open_pid, ra, 64).len() == 64);
    let stats = daemon.finish();
    assert!(merged, "the dumpable process was not merged");
    assert!(!vma_mergeable(secretive_pid, rb.base));
    assert_eq!(stats.targets_refused.get("non_dumpable"), Some(&1));
    assert_eq!(proc_status(secretive_pid, "TracerPid:"), "0");
    assert!(secretive.verify(rb, 0, 64, 79));
}

#[test]
fn a_root_process_that_made_itself_non_dumpable_is_never_marked() {
    require_root();
    let _turn = ksm_turn();
    // Root's /proc files are root's whether or not it is dumpable: only the process knows.
    let mut open = TestChild::spawn();
    let mut secretive = TestChild::spawn();
    let (ra, rb) = (open.map(64), secretive.map(64));
    open.write(ra, 0, 64, 80);
    secretive.write(rb, 0, 64, 80);
    secretive.command("nodump");
    let regions = [(open.pid(), ra, 64), (secretive.pid(), rb, 64)];
    let daemon = daemon_with_domains(&regions, DirtyMode::Pagemap, DomainPolicy::Uid);
    let stats = finish_when(daemon, "the dumpable process was not merged", || {
        ksm_pages(open.pid(), ra, 64).len() == 64
    });
    assert!(!vma_mergeable(secretive.pid(), rb.base), "{stats:?}");
    assert_eq!(
        stats.targets_refused.get("non_dumpable"),
        Some(&1),
        "{stats:?}"
    );
    assert_eq!(proc_status(secretive.pid(), "TracerPid:"), "0");
    assert!(secretive.verify(rb, 0, 64, 80));
}

/// A root process and a `nobody` process, each holding 64 pages of one content.
struct TwoUsers {
    root: TestChild,
    user: TestChild,
    ra: Region,
    rb: Region,
    user_pid: u32,
}

impl TwoUsers {
    fn spawn(root_seed: u64, user_seed: u64) -> TwoUsers {
        let mut root = TestChild::spawn();
        let mut user = TestChild::spawn_as_nobody();
        let (ra, rb) = (root.map(64), user.map(64));
        root.write(ra, 0, 64, root_seed);
        user.write(rb, 0, 64, user_seed);
        let user_pid = user.pid_from_proc();
        TwoUsers {
            root,
            user,
            ra,
            rb,
            user_pid,
        }
    }

    /// Both regions, for a daemon over exactly them.
    fn regions(&self) -> [(u32, Region, u64); 2] {
        [(self.root.pid(), self.ra, 64), (self.user_pid, self.rb, 64)]
    }
}

#[test]
fn a_marked_page_rewritten_with_another_domains_content_is_never_merged_across() {
    require_root();
    let _turn = ksm_turn();
    let TwoUsers {
        mut root,
        mut user,
        ra,
        rb,
        user_pid,
    } = TwoUsers::spawn(80, 81);
    let regions = [(root.pid(), ra, 64), (user_pid, rb, 64)];
    let mut daemon = daemon_with_domains(&regions, DirtyMode::Pagemap, DomainPolicy::Uid);
    assert!(
        passes_until(&mut daemon, || ksm_pages(root.pid(), ra, 64).len() == 64
            && ksm_pages(user_pid, rb, 64).len() == 64),
        "each domain's own duplicates were not merged"
    );
    // The user writes root's content into four pages of its marked range: ksmd would merge
    // them with root's pages at its next sweep. A write to a marked duplicate counts as a
    // copy-on-write break, so the region backs off (is unmarked) at the next pass, and the
    // content, root's, is never the user's domain's to mark again.
    user.write(rb, 0, 4, 80);
    let unmarked = passes_until(&mut daemon, || !vma_mergeable(user_pid, rb.base));
    // ksmd's sweeps, and more passes, change nothing.
    for _ in 0..6 {
        daemon.wait(Instant::now() + Duration::from_millis(300), &[]);
        daemon.pass();
    }
    let stats = daemon.finish();
    assert!(unmarked, "the rewritten pages stayed marked");
    let merged: Vec<u64> = ksm_pages(user_pid, rb, 64);
    assert!(
        merged.iter().all(|&i| i >= 4),
        "root's content merged into the user's pages: {merged:?}"
    );
    assert!(stats.cow_breaks >= 4, "{stats:?}");
    assert!(user.verify(rb, 0, 4, 80) && user.verify(rb, 4, 60, 81));
    assert!(root.verify(ra, 0, 64, 80));
}

#[test]
fn a_prober_outside_the_targets_that_merges_with_a_domains_pages_is_undone() {
    require_root();
    let _turn = ksm_turn();
    let users = TwoUsers::spawn(82, 83);
    let regions = users.regions();
    let TwoUsers {
        mut root,
        mut user,
        ra,
        rb,
        user_pid,
    } = users;
    let mut prober = TestChild::spawn_as_nobody();
    let rp = prober.map(16);
    // Another user's process, not a target, marks its own memory and fills it with copies of
    // root's duplicated pages: once ksmd merges them, a copy-on-write timing would tell it so.
    prober.write(rp, 0, 16, 82);
    prober.command(&format!("mergeable {}", rp.id));
    let prober_pid = prober.pid_from_proc();
    let mut daemon = Daemon::start(DaemonConfig {
        domain: DomainPolicy::Uid,
        several_domains: SeveralDomains::Allow,
        outsiders: OutsiderPolicy::Warn,
        targets: TargetSpec {
            pids: vec![root.pid(), user_pid],
            ..TargetSpec::default()
        },
        dirty: DirtyMode::Pagemap,
        only_ranges: regions
            .iter()
            .map(|&(pid, r, pages)| (pid, r.base, r.base + pages * PAGE))
            .collect(),
        ..DaemonConfig::default()
    })
    .expect("starts, warning about the prober");
    let shares_a_frame = |a: u32, ra: Region, pa: u64, b: u32, rb: Region, pb: u64| {
        let theirs: HashSet<u64> = page_frames(b, rb, pb).into_iter().flatten().collect();
        page_frames(a, ra, pa)
            .into_iter()
            .flatten()
            .any(|f| theirs.contains(&f))
    };
    // Root's pages are marked; ksmd merges the prober's copies into root's frames; the next
    // look finds frames mapped by two domains and unmarks root's side (the prober is never
    // touched). Root's region backs off, longer each time it meets the prober again.
    let crossed = || shares_a_frame(root.pid(), ra, 64, prober_pid, rp, 16);
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut undone = false;
    while !undone && Instant::now() < deadline {
        daemon.pass();
        undone = daemon.stats().cross_domain_merges > 0 && !crossed();
        daemon.wait(Instant::now() + Duration::from_millis(300), &[]);
    }
    let unmarked_then = daemon.stats().cross_domain_unmarked;
    assert!(undone, "{:?}", daemon.stats());
    assert!(unmarked_then >= 1);
    assert!(!shares_a_frame(root.pid(), ra, 64, user_pid, rb, 64));
    assert_eq!(
        ksm_pages(user_pid, rb, 64).len(),
        64,
        "the user's own merges stay"
    );
    assert_eq!(proc_status(prober_pid, "TracerPid:"), "0");
    assert!(
        vma_mergeable(prober_pid, rp.base),
        "the prober's own mark was changed"
    );
    assert!(prober.verify(rp, 0, 16, 82));
    // The prober goes: it did not end root's merging of that content for good.
    drop(prober);
    let merged_again = passes_until(&mut daemon, || ksm_pages(root.pid(), ra, 64).len() == 64);
    let stats = daemon.finish();
    assert!(
        merged_again,
        "root's pages stayed given up ({} merged, marked: {}): {stats:?}",
        ksm_pages(root.pid(), ra, 64).len(),
        vma_mergeable(root.pid(), ra.base)
    );
    assert!(root.verify(ra, 0, 64, 82) && user.verify(rb, 0, 64, 83));
    eprintln!(
        "{} frames found in {} looks ({:.1} ms), {} pages unmarked",
        stats.cross_domain_merges,
        stats.cross_domain_checks,
        stats.cross_domain_check_ns as f64 / 1e6,
        stats.cross_domain_unmarked
    );
}

#[test]
fn an_outsider_that_marks_and_unmarks_its_memory_between_two_passes_is_seen() {
    require_root();
    let _turn = ksm_turn();
    let mut root = TestChild::spawn();
    let ra = root.map(16);
    root.write(ra, 0, 16, 88);
    let mut prober = TestChild::spawn_as_nobody();
    let rp = prober.map(16);
    prober.write(rp, 0, 16, 88);
    let prober_pid = prober.pid_from_proc();
    let mut daemon = Daemon::start(DaemonConfig {
        outsiders: OutsiderPolicy::Warn,
        targets: TargetSpec {
            pids: vec![root.pid()],
            ..TargetSpec::default()
        },
        dirty: DirtyMode::Pagemap,
        only_ranges: vec![(root.pid(), ra.base, ra.base + 16 * PAGE)],
        ..DaemonConfig::default()
    })
    .expect("starts");
    daemon.pass();
    assert_eq!(daemon.stats().mergeable_outsiders, 0);
    // Between two passes, another user's process marks its memory, and unmarks it again:
    // /proc shows nothing at the next look; the mark watch saw the call.
    prober.command(&format!("mergeable {}", rp.id));
    prober.command(&format!("unmergeable {}", rp.id));
    assert!(!vma_mergeable(prober_pid, rp.base));
    daemon.pass();
    let stats = daemon.finish();
    assert_eq!(stats.mergeable_outsiders, 1, "{stats:?}");
    assert!(prober.verify(rp, 0, 16, 88) && root.verify(ra, 0, 16, 88));
}

#[test]
fn an_outsider_holding_zeros_does_not_stop_the_targets_merging_theirs() {
    require_root();
    let _turn = ksm_turn();
    let mut root = TestChild::spawn();
    let ra = root.map(64);
    root.command(&format!("fill {} 0 64 0", ra.id));
    // Another user's process, not a target, marks zero-filled pages of its own: ksmd merges
    // them with the targets' frame of zeros. Zeros tell nobody anything.
    let mut outsider = TestChild::spawn_as_nobody();
    let ro = outsider.map(16);
    outsider.command(&format!("fill {} 0 16 0", ro.id));
    outsider.command(&format!("mergeable {}", ro.id));
    let outsider_pid = outsider.pid_from_proc();
    let mut daemon = Daemon::start(DaemonConfig {
        outsiders: OutsiderPolicy::Warn,
        targets: TargetSpec {
            pids: vec![root.pid()],
            ..TargetSpec::default()
        },
        dirty: DirtyMode::Pagemap,
        only_ranges: vec![(root.pid(), ra.base, ra.base + 64 * PAGE)],
        ..DaemonConfig::default()
    })
    .expect("starts, warning about the outsider");
    let (targets, theirs) = ((root.pid(), ra, 64), (outsider_pid, ro, 16));
    let crossed = passes_until(&mut daemon, || shares_a_frame(targets, theirs));
    for _ in 0..6 {
        daemon.wait(Instant::now() + Duration::from_millis(300), &[]);
        daemon.pass();
    }
    let stats = daemon.finish();
    assert!(crossed, "ksmd never merged the zeros: {stats:?}");
    assert_eq!(stats.cross_domain_merges, 0, "{stats:?}");
    assert_eq!(ksm_pages(root.pid(), ra, 64).len(), 64, "{stats:?}");
    assert!(vma_mergeable(root.pid(), ra.base));
    assert!(root.command(&format!("verifyfill {} 0 64 0", ra.id)) == "ok");
}

#[test]
fn with_several_domains_a_written_marked_page_is_unmarked_before_the_next_pass() {
    require_root();
    let _turn = ksm_turn();
    for mode in [DirtyMode::Pagemap, DirtyMode::Ebpf] {
        let users = TwoUsers::spawn(84, 85);
        let mut daemon = daemon_with_domains(&users.regions(), mode, DomainPolicy::Uid);
        let TwoUsers {
            mut root,
            mut user,
            ra,
            rb,
            user_pid,
        } = users;
        assert!(
            passes_until(&mut daemon, || ksm_pages(user_pid, rb, 64).len() == 64),
            "{mode}: the user's duplicates were not merged"
        );
        // The user writes root's content into a merged page. No pass runs: the daemon only
        // waits, draining the tracer, and unmarks the region on the write it sees.
        let written = Instant::now();
        user.write(rb, 0, 1, 84);
        let mut unmarked = None;
        while written.elapsed() < Duration::from_secs(10) {
            daemon.wait(Instant::now() + Duration::from_millis(1), &[]);
            if !vma_mergeable(user_pid, rb.base) {
                unmarked = Some(written.elapsed());
                break;
            }
        }
        let passes = daemon.stats().full_scans;
        daemon.pass();
        let stats = daemon.finish();
        let unmarked = unmarked.unwrap_or_else(|| panic!("{mode}: still marked after 10 s"));
        eprintln!(
            "{mode}: write to unmark {:.1} ms",
            unmarked.as_secs_f64() * 1e3
        );
        assert_eq!(stats.full_scans, passes + 1);
        assert!(stats.cow_breaks >= 1, "{mode}: {stats:?}");
        assert!(!ksm_pages(user_pid, rb, 64).contains(&0));
        assert!(user.verify(rb, 0, 1, 84) && user.verify(rb, 1, 63, 85));
        assert!(root.verify(ra, 0, 64, 84));
    }
}

#[test]
fn a_process_that_calls_setuid_moves_domain_and_its_merges_with_the_old_one_are_undone() {
    require_root();
    let _turn = ksm_turn();
    let mut stays = TestChild::spawn();
    let mut moves = TestChild::spawn();
    let (ra, rb) = (stays.map(64), moves.map(64));
    stays.write(ra, 0, 64, 78);
    moves.write(rb, 0, 64, 78);
    let moves_pid = moves.pid_from_proc();
    let regions = [(stays.pid(), ra, 64), (moves_pid, rb, 64)];
    let mut daemon = daemon_with_domains(&regions, DirtyMode::Pagemap, DomainPolicy::Uid);
    assert!(
        passes_until(&mut daemon, || ksm_pages(moves_pid, rb, 64).len() == 64),
        "not merged in the first place"
    );
    assert!(vma_mergeable(moves_pid, rb.base));
    moves.command("setuid 65534");
    // It is unmarked (and its merged pages unmerged) at the next pass, and placed again in
    // its new domain, as a new target. There its copies are its domain's duplicates, and
    // marked; ksmd merges them with root's frame; rksm undoes that, and the content is not
    // the new domain's to mark again.
    let (old_domain, moved) = ((stays.pid(), ra, 64), (moves_pid, rb, 64));
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut settled = false;
    while !settled && Instant::now() < deadline {
        daemon.wait(Instant::now() + Duration::from_millis(300), &[]);
        daemon.pass();
        settled = daemon.stats().cross_domain_unmarked > 0
            && !vma_mergeable(moves_pid, rb.base)
            && !shares_a_frame(old_domain, moved);
    }
    for _ in 0..3 {
        daemon.wait(Instant::now() + Duration::from_millis(300), &[]);
        daemon.pass();
        assert!(!vma_mergeable(moves_pid, rb.base), "marked again");
    }
    let stats = daemon.finish();
    assert!(settled, "still merged with its old domain: {stats:?}");
    assert!(!shares_a_frame(old_domain, moved));
    assert_eq!(stats.domain_changes, 1);
    assert!(moves.verify(rb, 0, 64, 78) && stays.verify(ra, 0, 64, 78));
}

/// Whether some page of `a`'s region maps a frame some page of `b`'s region maps.
fn shares_a_frame(a: (u32, Region, u64), b: (u32, Region, u64)) -> bool {
    let theirs: HashSet<u64> = page_frames(b.0, b.1, b.2).into_iter().flatten().collect();
    page_frames(a.0, a.1, a.2)
        .into_iter()
        .flatten()
        .any(|f| theirs.contains(&f))
}

#[test]
fn targets_of_two_users_are_refused_unless_allowed_and_one_domain_shares() {
    require_root();
    let _turn = ksm_turn();
    let mut users = TwoUsers::spawn(77, 77);
    let regions = users.regions();
    let config = |domain, several_domains| DaemonConfig {
        domain,
        several_domains,
        targets: TargetSpec {
            pids: regions.iter().map(|r| r.0).collect(),
            ..TargetSpec::default()
        },
        dirty: DirtyMode::Pagemap,
        only_ranges: regions
            .iter()
            .map(|&(pid, r, pages)| (pid, r.base, r.base + pages * PAGE))
            .collect(),
        ..DaemonConfig::default()
    };
    // By default, two domains over one ksmd are refused, naming both.
    let refused = Daemon::start(config(DomainPolicy::Uid, SeveralDomains::Refuse));
    let Err(e @ DaemonError::SeveralDomains(_)) = refused else {
        panic!("two users' targets were not refused");
    };
    let said = e.to_string();
    for domain in [
        format!("uid 0 (pid {})", users.root.pid()),
        format!("uid 65534 (pid {})", users.user_pid),
    ] {
        assert!(said.contains(&domain), "{said}");
    }
    assert!(!vma_mergeable(users.root.pid(), users.ra.base));
    // One domain for all: the two share their pages.
    let mut daemon = Daemon::start(config(DomainPolicy::None, SeveralDomains::Refuse))
        .expect("one domain starts");
    let shared = passes_until(&mut daemon, || {
        shares_a_frame(regions[0], regions[1])
            && ksm_pages(users.user_pid, users.rb, 64).len() == 64
    });
    daemon.finish();
    assert!(
        shared,
        "one domain for all, and the users' copies did not merge"
    );
    assert!(users.root.verify(users.ra, 0, 64, 77) && users.user.verify(users.rb, 0, 64, 77));
}

#[test]
fn a_process_that_moves_into_another_domain_is_not_taken_up_again_by_default() {
    require_root();
    let _turn = ksm_turn();
    let mut stays = TestChild::spawn();
    let mut moves = TestChild::spawn();
    let (ra, rb) = (stays.map(64), moves.map(64));
    stays.write(ra, 0, 64, 76);
    moves.write(rb, 0, 64, 76);
    let moves_pid = moves.pid_from_proc();
    let regions = [(stays.pid(), ra, 64), (moves_pid, rb, 64)];
    let mut daemon = Daemon::start(DaemonConfig {
        targets: TargetSpec {
            pids: vec![stays.pid(), moves_pid],
            ..TargetSpec::default()
        },
        dirty: DirtyMode::Pagemap,
        only_ranges: regions
            .iter()
            .map(|&(pid, r, pages)| (pid, r.base, r.base + pages * PAGE))
            .collect(),
        ..DaemonConfig::default()
    })
    .expect("one domain starts");
    assert!(
        passes_until(&mut daemon, || ksm_pages(moves_pid, rb, 64).len() == 64),
        "not merged in the first place"
    );
    moves.command("setuid 65534");
    let unmarked = passes_until(&mut daemon, || !vma_mergeable(moves_pid, rb.base));
    for _ in 0..3 {
        daemon.wait(Instant::now() + Duration::from_millis(300), &[]);
        daemon.pass();
        assert!(
            !vma_mergeable(moves_pid, rb.base),
            "marked in its new domain"
        );
    }
    let stats = daemon.finish();
    assert!(unmarked, "still marked after moving to uid 65534");
    assert_eq!(stats.domain_changes, 1, "{stats:?}");
    assert_eq!(
        stats.targets_refused.get("other_domain"),
        Some(&1),
        "{stats:?}"
    );
    assert!(!shares_a_frame(regions[0], regions[1]));
    assert!(moves.verify(rb, 0, 64, 76) && stays.verify(ra, 0, 64, 76));
}

#[test]
fn a_domains_duplicates_are_marked_whatever_another_domain_holds_and_merges_across_are_undone() {
    require_root();
    let _turn = ksm_turn();
    // Root holds 64 copies of a content. The user holds 64 copies of the same content (a
    // guess of what root holds) and, apart, 64 copies of a content of its own.
    let mut root = TestChild::spawn();
    let mut user = TestChild::spawn_as_nobody();
    let (ra, guess, own) = (root.map(64), user.map(64), user.map(64));
    root.write(ra, 0, 64, 86);
    user.write(guess, 0, 64, 86);
    user.write(own, 0, 64, 87);
    let user_pid = user.pid_from_proc();
    let root_region = (root.pid(), ra, 64);
    let regions = [root_region, (user_pid, guess, 64), (user_pid, own, 64)];
    let mut daemon = daemon_with_domains(&regions, DirtyMode::Pagemap, DomainPolicy::Uid);
    // What rksm marks in the user's memory is decided from the user's pages alone: the
    // guess and the user's own content are marked in the same pass.
    let marked = passes_until(&mut daemon, || {
        vma_mergeable(user_pid, guess.base) || vma_mergeable(user_pid, own.base)
    });
    assert!(marked, "nothing of the user's was marked");
    assert!(
        vma_mergeable(user_pid, guess.base) && vma_mergeable(user_pid, own.base),
        "the user's duplicates were not marked alike"
    );
    // ksmd merges the guess with root's frames; rksm undoes it in the user, and the user
    // never marks that content again. Root's and the user's own merges stay.
    let guessed = (user_pid, guess, 64);
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut undone = false;
    while !undone && Instant::now() < deadline {
        daemon.wait(Instant::now() + Duration::from_millis(300), &[]);
        daemon.pass();
        let stats = daemon.stats();
        undone = stats.cross_domain_merges > 0
            && stats.cross_domain_unmarked > 0
            && !shares_a_frame(root_region, guessed);
    }
    for _ in 0..6 {
        daemon.wait(Instant::now() + Duration::from_millis(300), &[]);
        daemon.pass();
        assert!(!shares_a_frame(root_region, guessed), "merged across again");
    }
    let stats = daemon.finish();
    assert!(undone, "{stats:?}");
    assert!(
        !vma_mergeable(user_pid, guess.base),
        "the guess is marked again"
    );
    assert_eq!(
        ksm_pages(root.pid(), ra, 64).len(),
        64,
        "root's merges went"
    );
    assert_eq!(
        ksm_pages(user_pid, own, 64).len(),
        64,
        "the user's own merges went"
    );
    assert!(stats.cross_domain_unmarked >= 64, "{stats:?}");
    assert!(root.verify(ra, 0, 64, 86));
    assert!(user.verify(guess, 0, 64, 86) && user.verify(own, 0, 64, 87));
}

#[test]
fn a_target_that_executes_a_new_program_is_armed_and_merged_again() {
    require_root();
    let _turn = ksm_turn();
    let mut child = TestChild::spawn();
    let pid = child.pid();
    let config = DaemonConfig {
        targets: TargetSpec {
            pids: vec![pid],
            ..TargetSpec::default()
        },
        dirty: DirtyMode::Pagemap,
        ..DaemonConfig::default()
    };
    let mut daemon = Daemon::start(config).unwrap();
    let r = child.map(128);
    child.write(r, 0, 128, 61);
    assert!(
        passes_until(&mut daemon, || ksm_pages(pid, r, 128).len() == 128),
        "not merged before exec"
    );

    // Same pid, new program, new memory: rksm must start over with it.
    assert_eq!(child.command("exec"), "ok");
    let r = child.map(128);
    child.write(r, 0, 128, 62);
    assert!(
        passes_until(&mut daemon, || ksm_pages(pid, r, 128).len() == 128),
        "not merged after exec"
    );
    // Armed again: a pass after merging skips the new region's clean pages.
    let before = daemon.stats().pages_skipped_clean;
    daemon.pass();
    assert!(
        daemon.stats().pages_skipped_clean > before,
        "the exec'd process is no longer write-protected"
    );
    daemon.finish();
    assert!(child.verify(r, 0, 128, 62));
}

#[test]
fn without_ksm_the_daemon_says_so_and_estimate_still_works() {
    require_root();
    let _turn = ksm_turn();
    let mut child = TestChild::spawn();
    let r = child.map(16);
    child.write(r, 0, 16, 3);
    let config = DaemonConfig {
        targets: TargetSpec {
            pids: vec![child.pid()],
            ..TargetSpec::default()
        },
        ksm_root: "/nonexistent/mm/ksm".into(),
        ..DaemonConfig::default()
    };
    let err = Daemon::start(config).err().expect("no KSM, no daemon");
    assert!(err.to_string().contains("KSM is not available"), "{err}");
    assert!(
        err.to_string().contains("`rksm estimate` still works"),
        "{err}"
    );
    // And it does: estimate never touches ksmd.
    let output = rksm_command()
        .args([
            "estimate",
            "--pid",
            &child.pid().to_string(),
            "--passes",
            "1",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(output.status.success());
}

#[test]
fn an_operator_who_stops_ksmd_mid_run_is_not_overruled() {
    require_root();
    let _turn = ksm_turn();
    let before = ksmd_settings();
    let mut kids = twins(2, 32, 71);
    let regions: Vec<_> = kids.iter().map(|(c, r)| (c.pid(), *r, 32)).collect();
    let mut daemon = daemon_over(&regions, DirtyMode::Pagemap);
    // The second pass finds the duplicates: work for ksmd.
    daemon.pass();
    daemon.pass();
    assert_eq!(
        ksmd_settings().0,
        "1",
        "rksm runs ksmd while it has work for it"
    );
    std::fs::write("/sys/kernel/mm/ksm/run", "0").unwrap();
    daemon.pass();
    daemon.pass();
    assert_eq!(daemon.stats().ksmd_taken_back, Some(0));
    assert_eq!(ksmd_settings().0, "0", "rksm started ksmd again");
    daemon.finish();
    let after = ksmd_settings();
    assert_eq!(after.0, "0", "rksm's restore overruled the operator");
    assert_eq!(
        (&after.1, &after.2),
        (&before.1, &before.2),
        "ksmd's pace was not restored"
    );
    std::fs::write("/sys/kernel/mm/ksm/run", &before.0).unwrap();
    for (child, r) in &mut kids {
        assert!(child.verify(*r, 0, 32, 71));
    }
}

#[test]
fn a_target_that_exits_in_the_middle_of_a_pass_is_dropped_and_the_others_merge() {
    require_root();
    let _turn = ksm_turn();
    let mut kids = twins(3, 64, 71);
    let regions: Vec<_> = kids.iter().map(|(c, r)| (c.pid(), *r, 64)).collect();
    let mut daemon = daemon_over(&regions, DirtyMode::Ebpf);
    daemon.pass();
    let (leaver, _) = kids.remove(0);
    let mut leaver = Some(leaver);
    let summary = daemon.pass_with(&mut || leaver.take().unwrap().exit());
    assert_eq!(
        summary.targets, 3,
        "the pass read all three before one left"
    );
    let summary = daemon.pass();
    assert_eq!(summary.targets, 2, "the one that exited is still a target");
    assert!(
        passes_until(&mut daemon, || all_merged(&kids, 64)),
        "the remaining two were not merged"
    );
    daemon.finish();
    for (child, r) in &mut kids {
        assert!(child.verify(*r, 0, 64, 71));
    }
}

#[test]
fn a_target_that_unmaps_in_the_middle_of_a_pass_has_nothing_marked_there() {
    require_root();
    let _turn = ksm_turn();
    let mut kids = twins(3, 64, 71);
    let (first, first_region) = (kids[0].0.pid(), kids[0].1);
    let keep = kids[0].0.map(16);
    kids[0].0.write_unique(keep, 0, 16, 900);
    let regions: Vec<_> = kids.iter().map(|(c, r)| (c.pid(), *r, 64)).collect();
    let mut daemon = daemon_over(&regions, DirtyMode::Pagemap);
    // Duplicates are marked at the second sight (the first only shows them stable).
    daemon.pass();
    let (unmapper, _) = &mut kids[0];
    daemon.pass_with(&mut || unmapper.unmap(first_region));
    assert!(
        !any_vma_mergeable(first),
        "something was marked in the target that unmapped"
    );
    assert!(
        passes_until(&mut daemon, || all_merged(&kids[1..], 64)),
        "the other two were not merged"
    );
    daemon.finish();
    assert!(kids[0].0.verify_unique(keep, 0, 16, 900));
    assert_eq!(proc_status(first, "TracerPid:"), "0");
}

#[test]
fn a_target_that_execs_in_the_middle_of_a_pass_is_not_marked_in_its_new_program() {
    require_root();
    let _turn = ksm_turn();
    let mut kids = twins(2, 64, 71);
    let (pid, old) = (kids[0].0.pid(), kids[0].1);
    let regions: Vec<_> = kids.iter().map(|(c, r)| (c.pid(), *r, 64)).collect();
    let mut daemon = daemon_over(&regions, DirtyMode::Pagemap);
    daemon.pass();
    // After the scan, the first child becomes a new program with the same content at the
    // same address: marking what the scan found would mark memory rksm never read.
    let (execer, _) = &mut kids[0];
    let mut new = None;
    daemon.pass_with(&mut || {
        assert_eq!(execer.command("exec"), "ok");
        let r = execer.map_at(64, old.base);
        execer.write(r, 0, 64, 71);
        new = Some(r);
    });
    let new = new.unwrap();
    assert!(
        !vma_mergeable(pid, new.base),
        "marked in a program rksm has not scanned"
    );
    // Started over with the new program, it is merged like any other.
    kids[0].1 = new;
    assert!(
        passes_until(&mut daemon, || all_merged(&kids, 64)),
        "not merged after starting over"
    );
    daemon.finish();
    for (child, r) in &mut kids {
        assert!(child.verify(*r, 0, 64, 71));
    }
}

#[test]
fn a_target_that_forks_in_the_middle_of_a_pass_keeps_running_and_its_child_joins() {
    require_root();
    let _turn = ksm_turn();
    let mut kids = twins(2, 64, 71);
    let parent = kids[0].0.pid();
    let config = DaemonConfig {
        targets: TargetSpec {
            pids: vec![kids[1].0.pid()],
            tree_of: Some(parent),
            ..TargetSpec::default()
        },
        dirty: DirtyMode::Ebpf,
        ..DaemonConfig::default()
    };
    let mut daemon = Daemon::start(config).unwrap();
    daemon.pass();
    let (forker, _) = &mut kids[0];
    let mut forked = 0;
    let summary = daemon.pass_with(&mut || forked = forker.fork());
    assert_eq!(summary.targets, 2);
    assert!(summary.runs_marked > 0, "nothing marked in the pass");
    let summary = daemon.pass();
    assert_eq!(summary.targets, 3, "the forked child did not join");
    assert!(
        passes_until(&mut daemon, || ksm_pages(kids[1].0.pid(), kids[1].1, 64)
            .len()
            == 64),
        "not merged after the fork"
    );
    daemon.finish();
    for pid in [parent, forked] {
        let state = proc_status(pid, "State:");
        assert!(!state.starts_with(['t', 'T']), "pid {pid} left {state}");
        assert_eq!(proc_status(pid, "TracerPid:"), "0");
    }
    for (child, r) in &mut kids {
        assert!(child.verify(*r, 0, 64, 71));
    }
}

#[test]
fn with_ksmd_read_only_the_daemon_says_so_records_nothing_and_estimate_works() {
    require_root();
    let _turn = ksm_turn();
    let before = ksmd_settings();
    let state = std::path::Path::new(rksm::kernel::ksmd::STATE_PATH);
    let state_before = std::fs::read_to_string(state).ok();
    let mut child = TestChild::spawn();
    let r = child.map(16);
    child.write(r, 0, 16, 8);
    // In a mount namespace of its own, /sys/kernel/mm/ksm is read-only, as in a container.
    let rksm = rksm_tests::built_binary("rksm");
    let (rksm, pid) = (rksm.display(), child.pid());
    let script = format!(
        "mount --bind -o ro /sys/kernel/mm/ksm /sys/kernel/mm/ksm || exit 99
         {rksm} daemon --pid {pid} --passes 1; echo \"daemon exit $?\" >&2
         {rksm} estimate --pid {pid} --passes 1 --json"
    );
    let output = std::process::Command::new("unshare")
        .args(["-m", "sh", "-c", &script])
        .output()
        .expect("unshare (util-linux)");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("daemon exit 1"), "{stderr}");
    let errors: Vec<&str> = stderr
        .lines()
        .filter(|l| !l.starts_with("rksm: info:") && !l.starts_with("daemon exit"))
        .collect();
    assert_eq!(errors.len(), 1, "{stderr}");
    assert!(errors[0].contains("cannot control ksmd"), "{stderr}");
    assert!(
        errors[0].contains("`rksm estimate` still works"),
        "{stderr}"
    );
    let json: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("estimate's JSON on stdout");
    assert!(json["total"].is_object(), "{json}");
    assert_eq!(
        std::fs::read_to_string(state).ok(),
        state_before,
        "a ksmd state was recorded although nothing changed"
    );
    assert_eq!(ksmd_settings(), before);
    assert!(child.verify(r, 0, 16, 8));
}

#[test]
fn a_target_skipped_for_a_pass_keeps_its_arming_and_checksums() {
    require_root();
    let _turn = ksm_turn();
    let mut child = TestChild::spawn();
    let r = child.map(256);
    child.write_unique(r, 0, 256, 4242);
    let mut daemon = daemon_over(&[(child.pid(), r, 256)], DirtyMode::Ebpf);
    daemon.pass();
    daemon.pass();
    let steady = daemon.pass();
    assert!(steady.pages_hashed < 16, "not steady yet: {steady}");
    let arming_syscalls = daemon.stats().remote_syscalls;

    // A debugger attaches for a moment: the target sits one pass out, and writes meanwhile.
    let tid = nix::unistd::Pid::from_raw(child.pid() as i32);
    nix::sys::ptrace::seize(tid, nix::sys::ptrace::Options::empty()).unwrap();
    child.write_unique(r, 10, 3, 99_000);
    let skipped = daemon.pass();
    assert_eq!(skipped.targets, 0, "{skipped}");
    assert_eq!(daemon.stats().targets_refused.get("traced"), Some(&1));
    nix::sys::ptrace::interrupt(tid).unwrap();
    nix::sys::wait::waitpid(tid, Some(nix::sys::wait::WaitPidFlag::__WALL)).unwrap();
    nix::sys::ptrace::detach(tid, None).unwrap();

    // Back: the writes made while it was skipped are seen, and nothing else is rehashed; it
    // was neither disarmed nor armed again (no remote system call).
    let back = daemon.pass();
    assert_eq!(back.targets, 1, "{back}");
    assert!(
        (3..16).contains(&back.pages_hashed),
        "expected the 3 pages written while skipped, not a full rehash: {back}"
    );
    assert_eq!(daemon.stats().remote_syscalls, arming_syscalls);
    let stats = daemon.finish();
    assert_eq!(stats.targets_refused.len(), 1, "{stats:?}");
    assert!(child.verify_unique(r, 10, 3, 99_000) && child.verify_unique(r, 13, 243, 4255));
}

#[test]
fn a_write_between_the_scan_and_the_marking_is_hashed_next_pass() {
    require_root();
    let _turn = ksm_turn();
    let mut child = TestChild::spawn();
    let r = child.map(128);
    child.write_unique(r, 0, 128, 5150);
    let mut daemon = daemon_over(&[(child.pid(), r, 128)], DirtyMode::Ebpf);
    daemon.pass();
    daemon.pass();
    let steady = daemon.pass();
    assert!(steady.pages_hashed < 8, "not steady yet: {steady}");
    // The page is written after this pass read it: the tracer sees the write, and the next
    // pass must rehash the page, whatever else this pass does with the tracer's records.
    daemon.pass_with(&mut || child.write_unique(r, 7, 1, 99_777));
    let next = daemon.pass();
    assert!(
        (1..8).contains(&next.pages_hashed),
        "the page written after the scan was not rehashed: {next}"
    );
    assert!(child.verify_unique(r, 7, 1, 99_777));
}

/// A target that executes another program (a set-id one, say) after it was looked at is
/// never read as its new self: the reader reads only the address space it opened, and
/// process_vm_readv, which reads whatever the pid runs now, is checked against it.
#[test]
fn memory_of_a_program_the_target_executed_after_it_was_opened_is_never_read() {
    use rksm::kernel::reader::{read_pages, ProcMem};
    require_root();
    const AT: u64 = 0x5a5a_0000_0000;
    let mut child = TestChild::spawn();
    let pid = child.pid();
    let before = child.map_at(1, AT);
    child.write(before, 0, 1, 7);
    let mem = ProcMem::open(pid).unwrap();
    let read_once = |mem: &ProcMem| {
        let mut out = vec![0u8; PAGE as usize];
        let mut read = [false];
        let result = read_pages(mem, &[AT], &[true], &mut out, &mut read);
        (result.ok(), read[0], out)
    };
    let (n, read, old) = read_once(&mem);
    assert_eq!((n, read), (Some(1), true), "the page before the exec");
    // Same pid, a new program, and at the same address other content: its own.
    assert_eq!(child.command("exec"), "ok");
    let after = child.map_at(1, AT);
    child.write(after, 0, 1, 99);
    let (n, read, new) = read_once(&mem);
    assert!(
        !read && n.is_none(),
        "read the new program's page through a reader opened before the exec (same content as before: {})",
        new == old
    );
    // A reader opened now reads the new program, as a new target would.
    let (n, read, _) = read_once(&ProcMem::open(pid).unwrap());
    assert_eq!((n, read), (Some(1), true));
    assert!(child.verify(after, 0, 1, 99));
}

/// The probe rate a user gets where several domains are allowed: how many guessed contents
/// a target answers per minute about another domain's pages, under the shipped pacing
/// (`rksm daemon` with its default interval). A measurement, run by hand:
/// `cargo test --release -p rksm-tests --test daemon probe_rate -- --ignored --nocapture`.
#[test]
#[ignore = "a measurement of about a minute; docs/security.md quotes it"]
fn probe_rate_across_domains() {
    require_root();
    let _turn = ksm_turn();
    const SECRETS: u64 = 128;
    // Root holds 128 contents, two copies each: merged, as a victim's would be.
    let mut root = TestChild::spawn();
    let ra = root.map(2 * SECRETS);
    for i in 0..SECRETS {
        root.write(ra, 2 * i, 2, 1000 + i);
    }
    let mut prober = TestChild::spawn_as_nobody();
    let guesses = prober.map(4 * SECRETS);
    let prober_pid = prober.pid_from_proc();
    let daemon = Running::spawn(
        rksm_command()
            .args([
                "--log-level",
                "error",
                "daemon",
                "--several-domains",
                "allow",
            ])
            .args([
                "--pid",
                &root.pid().to_string(),
                "--pid",
                &prober_pid.to_string(),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    );
    assert!(
        wait_for(
            Duration::from_secs(120),
            || ksm_pages(root.pid(), ra, 2 * SECRETS).len() as u64 == 2 * SECRETS
        ),
        "root's pages were not merged"
    );
    // 256 guesses, two copies each (a content is marked only where its domain holds it
    // twice): the first 128 are root's contents, the others are not.
    let written = Instant::now();
    for i in 0..2 * SECRETS {
        let seed = if i < SECRETS { 1000 + i } else { 9000 + i };
        prober.write(guesses, 2 * i, 2, seed);
    }
    // What the prober can see of its own pages: which are marked (smaps) and which merged.
    // A guess of root's content is merged, then unmarked; any other stays merged.
    let page = |i: u64| guesses.base + 2 * i * PAGE;
    let mut answered_at = vec![None; 2 * SECRETS as usize];
    let mut was_marked = vec![false; SECRETS as usize];
    let deadline = written + Duration::from_secs(300);
    while answered_at.iter().any(Option::is_none) && Instant::now() < deadline {
        let marked = rksm::kernel::procfs::mergeable_ranges(prober_pid).unwrap_or_default();
        let is_marked = |a: u64| marked.iter().any(|r| r.start <= a && a < r.end);
        let merged: HashSet<u64> = ksm_pages(prober_pid, guesses, 4 * SECRETS)
            .into_iter()
            .collect();
        for i in 0..2 * SECRETS {
            if answered_at[i as usize].is_some() {
                continue;
            }
            let done = if i < SECRETS {
                let marked_now = is_marked(page(i));
                was_marked[i as usize] |= marked_now;
                was_marked[i as usize] && !marked_now && !merged.contains(&(2 * i))
            } else {
                merged.contains(&(2 * i)) && merged.contains(&(2 * i + 1))
            };
            if done {
                answered_at[i as usize] = Some(written.elapsed());
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(daemon);
    let answered: Vec<Duration> = answered_at.iter().flatten().copied().collect();
    assert_eq!(
        answered.len() as u64,
        2 * SECRETS,
        "not every guess was answered"
    );
    let first = answered.iter().min().unwrap().as_secs_f64();
    let last = answered.iter().max().unwrap().as_secs_f64();
    eprintln!(
        "{} guesses ({SECRETS} of root's contents) answered {first:.1}-{last:.1} s after they were written: {:.0} contents per minute",
        answered.len(),
        answered.len() as f64 * 60.0 / last
    );
    assert!(root.verify(ra, 0, 2, 1000));
}
