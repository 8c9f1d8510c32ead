//! Soft-dirty, the write protection of kernels before 6.7: cleared only when something was
//! written, never where the target or someone else uses the bits, and a huge page written
//! once counted written whole.
//!
//! These scenarios run where the kernel keeps soft-dirty bits (Debian 12's 6.1 and 6.12, in
//! the kernel matrix's guests: `cargo xtask test --kernel debian12`). On a kernel without
//! them (this project's host), each checks the other side of the same promise: soft-dirty is
//! neither used nor claimed, and says why.

use std::time::{Duration, Instant};

use rksm::{
    daemon::{Daemon, DaemonConfig, DaemonError, DirtyMode},
    engine::{
        checksum::ChecksumKind,
        dirty::protection::{WriteProtect, WriteProtectChoice},
        targets::TargetSpec,
    },
    kernel::softdirty,
};
use rksm_tests::{ksm_pages, ksm_turn, require_root, Region, TestChild, PAGE};

const N: u64 = 128;
const SEED: u64 = 5150;

fn daemon(pid: u32, regions: &[(Region, u64)], mode: DirtyMode, wp: WriteProtectChoice) -> Daemon {
    Daemon::start(config(pid, regions, mode, wp)).expect("daemon starts")
}

fn config(
    pid: u32,
    regions: &[(Region, u64)],
    mode: DirtyMode,
    write_protect: WriteProtectChoice,
) -> DaemonConfig {
    DaemonConfig {
        targets: TargetSpec {
            pids: vec![pid],
            ..TargetSpec::default()
        },
        dirty: mode,
        write_protect,
        checksum: ChecksumKind::Xxh64,
        only_ranges: regions
            .iter()
            .map(|(r, pages)| (pid, r.base, r.base + pages * PAGE))
            .collect(),
        audit_passes: 4,
        ..DaemonConfig::default()
    }
}

fn pass(daemon: &mut Daemon) {
    daemon.pass();
    daemon.wait(Instant::now() + Duration::from_millis(200), &[]);
}

/// Runs passes until `done`, at most 60 s; whether it held.
fn passes_until(daemon: &mut Daemon, mut done: impl FnMut(&Daemon) -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        pass(daemon);
        if done(daemon) {
            return true;
        }
    }
    false
}

fn source(daemon: &Daemon) -> (WriteProtect, String) {
    let target = daemon.targets().next().expect("the target");
    let (source, why) = target.write_protect();
    (source, why.to_string())
}

fn clears(daemon: &Daemon) -> u64 {
    daemon
        .targets()
        .map(|t| t.counters().soft_dirty_clears)
        .sum()
}

#[test]
fn soft_dirty_is_used_exactly_where_the_kernel_keeps_the_bits() {
    require_root();
    let _turn = ksm_turn();
    let mut child = TestChild::spawn();
    let region = child.map(N);
    child.write_unique(region, 0, N, 100);
    let pid = child.pid();
    let asked = Daemon::start(config(
        pid,
        &[(region, N)],
        DirtyMode::Ebpf,
        WriteProtectChoice::SoftDirty,
    ));
    if !softdirty::supported() {
        let err = asked.err().expect("refused without soft-dirty");
        assert!(matches!(err, DaemonError::NotOffered(_)), "{err}");
        assert!(err.to_string().contains("CONFIG_MEM_SOFT_DIRTY"), "{err}");
        return;
    }
    let mut daemon = asked.expect("daemon starts");
    pass(&mut daemon);
    assert_eq!(source(&daemon).0, WriteProtect::SoftDirty);
    assert_eq!(clears(&daemon), 1, "the first pass clears");
    daemon.finish();
}

/// Every mode, on soft-dirty: idle passes neither clear nor hash, a write is hashed, and a
/// clear follows the writes (at once in pagemap mode, once due in ebpf mode).
#[test]
fn clears_follow_the_writes_and_idle_passes_clear_nothing() {
    require_root();
    if !softdirty::supported() {
        return soft_dirty_is_not_claimed();
    }
    let _turn = ksm_turn();
    for mode in [DirtyMode::Pagemap, DirtyMode::Ebpf] {
        let mut child = TestChild::spawn();
        let region = child.map(N);
        child.write_unique(region, 0, N, 200);
        let pid = child.pid();
        let mut daemon = daemon(pid, &[(region, N)], mode, WriteProtectChoice::SoftDirty);
        for _ in 0..3 {
            pass(&mut daemon);
        }
        let settled = clears(&daemon);
        for _ in 0..5 {
            pass(&mut daemon);
            let idle = daemon.last_pass().unwrap().clone();
            assert_eq!(idle.pages_hashed, 0, "{mode}: {idle:?}");
        }
        assert_eq!(clears(&daemon), settled, "{mode}: idle passes cleared");
        child.write_unique(region, 0, 1, 90_000);
        daemon.pass();
        assert_eq!(daemon.last_pass().unwrap().pages_hashed, 1, "{mode}");
        assert!(
            passes_until(&mut daemon, |d| clears(d) > settled),
            "{mode}: never cleared after a write"
        );
        let after_clear = clears(&daemon);
        for _ in 0..3 {
            pass(&mut daemon);
        }
        assert_eq!(daemon.last_pass().unwrap().pages_hashed, 0, "{mode}");
        assert_eq!(
            clears(&daemon),
            after_clear,
            "{mode}: cleared with nothing written"
        );
        assert!(child.verify_unique(region, 1, N - 1, 201));
        daemon.finish();
    }
}

/// The other side, where the kernel keeps no soft-dirty bits: nothing claims them.
fn soft_dirty_is_not_claimed() {
    let _turn = ksm_turn();
    let mut child = TestChild::spawn();
    let region = child.map(N);
    child.write_unique(region, 0, N, 400);
    let mut daemon = daemon(
        child.pid(),
        &[(region, N)],
        DirtyMode::Ebpf,
        WriteProtectChoice::Auto,
    );
    pass(&mut daemon);
    let (source, _) = source(&daemon);
    assert_ne!(source, WriteProtect::SoftDirty);
    assert_eq!(clears(&daemon), 0);
    daemon.finish();
}

/// A program that tracks its own writes with soft-dirty bits (Boehm GC's incremental mode
/// keeps /proc/self/clear_refs open) keeps them: rksm never clears them, says why, and still
/// merges its duplicates.
#[test]
fn a_target_that_clears_its_own_soft_dirty_bits_keeps_them() {
    require_root();
    let _turn = ksm_turn();
    for mode in [DirtyMode::Pagemap, DirtyMode::Ebpf] {
        let mut child = TestChild::spawn();
        let own = child.map(N);
        let copies = child.map(N);
        // Contents that equal no other page: ksmd would map a KSM page, without the bit.
        child.write_unique(own, 0, N, 10_000);
        child.write(copies, 0, N, SEED);
        child.clear_own_soft_dirty();
        child.write_unique(own, 0, 4, 20_000);
        let bits_before = child.soft_dirty_pages(own, 0, N);
        let pid = child.pid();
        let mut daemon = daemon(
            pid,
            &[(own, N), (copies, N)],
            mode,
            WriteProtectChoice::Auto,
        );
        assert!(
            passes_until(&mut daemon, |_| ksm_pages(pid, copies, N).len()
                == N as usize),
            "{mode}: its duplicates were not merged"
        );
        let (source, why) = source(&daemon);
        assert_ne!(source, WriteProtect::SoftDirty, "{mode}");
        if softdirty::supported() {
            assert!(
                why.contains("clears its own soft-dirty bits"),
                "{mode}: {why}"
            );
            assert!(why.contains("clear_refs"), "{mode}: {why}");
            assert_eq!(bits_before, 4, "the child's own four writes");
        } else {
            assert!(why.contains("CONFIG_MEM_SOFT_DIRTY"), "{mode}: {why}");
            assert_eq!(bits_before, 0, "no soft-dirty bits on this kernel");
        }
        // Its bits are as it left them: rksm cleared none.
        assert_eq!(child.soft_dirty_pages(own, 0, N), bits_before, "{mode}");
        assert_eq!(clears(&daemon), 0, "{mode}");
        daemon.finish();
        assert!(child.verify(copies, 0, N, SEED) && child.verify_unique(own, 4, N - 4, 10_004));
    }
}

/// Someone else clears the target's bits (CRIU pre-dumping it): writes rksm saw since its
/// own clear lose their bits. rksm notices before it clears again, stops clearing for good,
/// says why, and goes on merging with what is left.
#[test]
fn a_target_whose_bits_someone_else_clears_is_no_longer_cleared() {
    require_root();
    if !softdirty::supported() {
        return soft_dirty_is_not_claimed();
    }
    let _turn = ksm_turn();
    let mut child = TestChild::spawn();
    let region = child.map(N);
    let copies = child.map(N);
    child.write_unique(region, 0, N, 30_000);
    child.write_unique(copies, 0, N, 40_000);
    let pid = child.pid();
    let mut daemon = daemon(
        pid,
        &[(region, N), (copies, N)],
        DirtyMode::Ebpf,
        WriteProtectChoice::Auto,
    );
    for _ in 0..3 {
        pass(&mut daemon);
    }
    assert_eq!(source(&daemon).0, WriteProtect::SoftDirty);
    // Written after rksm's clear (the tracer sees the faults), then cleared by another.
    child.write_unique(region, 0, 8, 50_000);
    std::fs::write(format!("/proc/{pid}/clear_refs"), "4").expect("clearing its bits");
    let before = clears(&daemon);
    pass(&mut daemon);
    let (source, why) = source(&daemon);
    assert_ne!(source, WriteProtect::SoftDirty, "{why}");
    assert_eq!(clears(&daemon), before, "rksm cleared again");
    let stats = daemon.stats().clone();
    assert!(!stats.write_protect.contains_key("soft-dirty"), "{stats:?}");
    // Whatever protects it now (userfaultfd, or nothing), its duplicates still merge.
    child.write(copies, 0, N, SEED);
    assert!(
        passes_until(&mut daemon, |_| ksm_pages(pid, copies, N).len()
            == N as usize),
        "not merged after soft-dirty stopped ({source}: {why})"
    );
    let after = daemon
        .targets()
        .next()
        .unwrap()
        .write_protect()
        .1
        .to_string();
    assert!(after.contains("cleared by someone else"), "{after}");
    daemon.finish();
    assert!(child.verify(copies, 0, N, SEED) && child.verify_unique(region, 0, 8, 50_000));
}

/// A write fault in a transparent huge page makes all of its 2 MiB writable: every page of
/// it is rehashed, none missed, and the copies written there merge.
#[test]
fn a_write_to_a_huge_page_counts_its_whole_2_mib_as_written() {
    require_root();
    let _turn = ksm_turn();
    const HUGE: u64 = 512;
    let mut child = TestChild::spawn();
    let region = child.map_huge(2 * HUGE);
    child.write_unique(region, 0, 2 * HUGE, 1000);
    let pid = child.pid();
    let huge = thp_pages(pid, region, 2 * HUGE);
    eprintln!("{huge} of {} pages in transparent huge pages", 2 * HUGE);
    let mut daemon = daemon(
        pid,
        &[(region, 2 * HUGE)],
        DirtyMode::Ebpf,
        WriteProtectChoice::Auto,
    );
    for _ in 0..3 {
        pass(&mut daemon);
    }
    // One fault (the first write), then writes the tracer cannot see if the page is huge.
    child.write(region, 0, HUGE, SEED);
    let merged = passes_until(&mut daemon, |_| {
        ksm_pages(pid, region, HUGE).len() == HUGE as usize
    });
    let misses: u64 = daemon.targets().map(|t| t.counters().dirty_misses).sum();
    daemon.finish();
    assert!(merged, "the copies in the huge page were not all merged");
    assert_eq!(misses, 0, "pages of the huge page were missed");
    assert!(child.verify(region, 0, HUGE, SEED));
    assert!(child.verify_unique(region, HUGE, HUGE, 1000 + HUGE));
}

/// How many of `region`'s first `pages` pages are part of a transparent huge page.
fn thp_pages(pid: u32, region: Region, pages: u64) -> usize {
    use std::os::unix::fs::FileExt;
    let kpageflags = std::fs::File::open("/proc/kpageflags").expect("kpageflags");
    rksm_tests::page_frames(pid, region, pages)
        .into_iter()
        .flatten()
        .filter(|pfn| {
            let mut flags = [0u8; 8];
            kpageflags.read_exact_at(&mut flags, pfn * 8).is_ok()
                && u64::from_ne_bytes(flags) >> 22 & 1 == 1
        })
        .count()
}

/// Pagemap mode on a busy target: its threads write all the time, so they fault right after
/// every clear. The tracer names the pages written between reading the bits and clearing
/// them, so no pass has to read the target whole (`soft_dirty_clear_races`), and each pass
/// hashes the page written since the last one, not the target.
#[test]
fn pagemap_mode_on_a_busy_target_reads_only_what_was_written() {
    require_root();
    if !softdirty::supported() {
        return soft_dirty_is_not_claimed();
    }
    let _turn = ksm_turn();
    let mut child = TestChild::spawn();
    let region = child.map(N);
    child.write_unique(region, 0, N, 60_000);
    child.threads(2);
    let pid = child.pid();
    let mut daemon = daemon(
        pid,
        &[(region, N)],
        DirtyMode::Pagemap,
        WriteProtectChoice::SoftDirty,
    );
    for _ in 0..3 {
        pass(&mut daemon);
    }
    for round in 0..8 {
        child.write_unique(region, round, 1, 70_000 + round);
        daemon.pass();
        let last = daemon.last_pass().unwrap().clone();
        assert_eq!(last.pages_hashed, 1, "round {round}: {last:?}");
    }
    let stats = daemon.finish();
    assert_eq!(stats.soft_dirty_clear_races, 0, "{stats:?}");
    assert!(stats.soft_dirty_clears >= 9, "{stats:?}");
    assert!(child.verify_unique(region, 8, N - 8, 60_008));
}
