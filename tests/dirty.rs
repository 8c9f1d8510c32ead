//! The dirty bit misses no write, and a steady pass costs what the writes cost.
//!
//! Each scenario starts a child whose pages are all different, lets the daemon settle on it
//! (armed, hashed, placed), then turns every page into a copy of one content in one way:
//! written by the child, by the kernel for the child (read(2), recv(2), an O_DIRECT read),
//! by another process (process_vm_writev), refilled after MADV_DONTNEED, or moved in with
//! mremap. Every dirty mode must then merge them all, as hash-only does, by the kernel's own
//! evidence (kpageflags), with the child's memory intact.

use std::time::{Duration, Instant};

use nix::{
    sys::uio::{process_vm_writev, RemoteIoVec},
    unistd::Pid,
};
use rksm::{
    daemon::{Daemon, DaemonConfig, DirtyMode},
    engine::{
        checksum::ChecksumKind,
        dirty::protection::{Offer, WriteProtect, WriteProtectChoice},
        targets::TargetSpec,
    },
};
use rksm_tests::{
    ksm_pages, ksm_turn, require_root, seed_content, Region, SeedFile, TestChild, PAGE,
};

const N: u64 = 128;
const SEED: u64 = 4242;
/// A short audit cycle, so that the tests see one complete.
const AUDIT_PASSES: u32 = 4;
/// A dirty mode, and the write protection it is given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Config {
    mode: DirtyMode,
    protection: WriteProtectChoice,
}

impl std::fmt::Display for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.mode {
            DirtyMode::HashOnly => write!(f, "hash-only"),
            mode => write!(f, "{mode} with {}", self.protection),
        }
    }
}

/// Hash-only, if asked, then pagemap and ebpf with each write protection this kernel offers
/// (userfaultfd on the host's 6.18, soft-dirty on Debian 12's 6.1, both on its 6.12).
fn configurations(hash_only: bool) -> Vec<Config> {
    let offer = Offer::probe(WriteProtectChoice::Auto);
    let mut sources = Vec::new();
    if offer.soft_dirty {
        sources.push(WriteProtectChoice::SoftDirty);
    }
    if offer.userfaultfd {
        sources.push(WriteProtectChoice::Userfaultfd);
    }
    let mut all = Vec::new();
    if hash_only {
        all.push(Config {
            mode: DirtyMode::HashOnly,
            protection: WriteProtectChoice::Auto,
        });
    }
    for mode in [DirtyMode::Pagemap, DirtyMode::Ebpf] {
        for &protection in &sources {
            all.push(Config { mode, protection });
        }
    }
    all
}

fn daemon_over(pid: u32, regions: &[Region], config: Config) -> Daemon {
    daemon_auditing(pid, regions, config, AUDIT_PASSES)
}

/// [`daemon_over`] with an audit cycle of `audit_passes`.
fn daemon_auditing(pid: u32, regions: &[Region], config: Config, audit_passes: u32) -> Daemon {
    let daemon = Daemon::start(DaemonConfig {
        targets: TargetSpec {
            pids: vec![pid],
            ..TargetSpec::default()
        },
        dirty: config.mode,
        write_protect: config.protection,
        checksum: ChecksumKind::Xxh64,
        only_ranges: regions
            .iter()
            .map(|r| (pid, r.base, r.base + N * PAGE))
            .collect(),
        audit_passes,
        ..DaemonConfig::default()
    })
    .expect("daemon starts");
    assert_eq!(daemon.dirty_mode(), config.mode);
    daemon
}

/// The daemon's target is write-protected as `config` asks.
fn protected_as_asked(daemon: &Daemon, config: Config) {
    let target = daemon.targets().next().expect("the target");
    let (source, why) = target.write_protect();
    let expected = match config.protection {
        _ if config.mode == DirtyMode::HashOnly => WriteProtect::None,
        WriteProtectChoice::SoftDirty => WriteProtect::SoftDirty,
        WriteProtectChoice::Userfaultfd => WriteProtect::Userfaultfd,
        WriteProtectChoice::Auto => return,
    };
    assert_eq!(source, expected, "{config}: {why}");
}

fn pass_and_wait(daemon: &mut Daemon) {
    daemon.pass();
    daemon.wait(Instant::now() + Duration::from_millis(250), &[]);
}

/// What one mode did with one way of making duplicates.
struct Outcome {
    merged: usize,
    misses: u64,
    /// Why the target ended up tracked exactly, if it did.
    exact: Option<String>,
    /// Passes after the change until the first miss was counted.
    passes_to_miss: Option<u32>,
}

/// Settles `mode` on a child with N distinct pages, lets `make` turn pages into N copies of
/// SEED's content (it returns where they are), and runs passes until ksmd merged them all.
fn run(mode: Config, make: &dyn Fn(&mut TestChild, Region, Region) -> Region) -> Outcome {
    let mut child = TestChild::spawn();
    let region = child.map(N);
    let spare = child.map(N);
    child.write_unique(region, 0, N, 1000);
    let pid = child.pid();
    let mut daemon = daemon_over(pid, &[region, spare], mode);
    for _ in 0..3 {
        pass_and_wait(&mut daemon);
    }
    protected_as_asked(&daemon, mode);
    let copies = make(&mut child, region, spare);
    assert!(
        child.verify(copies, 0, N, SEED),
        "{mode}: the copies are not SEED's"
    );
    let misses = |d: &Daemon| d.targets().map(|t| t.counters().dirty_misses).sum::<u64>();
    let deadline = Instant::now() + Duration::from_secs(40);
    let mut passes = 0;
    let mut passes_to_miss = None;
    let mut merged = 0;
    while Instant::now() < deadline {
        pass_and_wait(&mut daemon);
        passes += 1;
        if passes_to_miss.is_none() && misses(&daemon) > 0 {
            passes_to_miss = Some(passes);
        }
        merged = ksm_pages(pid, copies, N).len();
        if merged == N as usize {
            break;
        }
    }
    let outcome = Outcome {
        merged,
        misses: misses(&daemon),
        exact: daemon
            .targets()
            .find_map(|t| t.exact_tracking().map(str::to_string)),
        passes_to_miss,
    };
    daemon.finish();
    assert!(child.verify(copies, 0, N, SEED), "{mode}: memory changed");
    outcome
}

/// Every mode, with every write protection the kernel offers, merges every copy; returns
/// the ebpf mode's outcomes.
fn every_mode_merges(
    how: &str,
    make: &dyn Fn(&mut TestChild, Region, Region) -> Region,
) -> Vec<(Config, Outcome)> {
    require_root();
    let _turn = ksm_turn();
    let mut ebpf = Vec::new();
    for config in configurations(true) {
        let outcome = run(config, make);
        assert_eq!(
            outcome.merged, N as usize,
            "{config}: {how}: {} of {N} copies merged (hash-only merges them all)",
            outcome.merged
        );
        if config.mode == DirtyMode::Ebpf {
            ebpf.push((config, outcome));
        }
    }
    assert!(!ebpf.is_empty(), "ebpf ran");
    ebpf
}

#[test]
fn copies_written_by_the_process_are_merged_in_every_mode() {
    for (config, ebpf) in every_mode_merges("user writes", &|child, region, _| {
        child.write(region, 0, N, SEED);
        region
    }) {
        assert_eq!(ebpf.misses, 0, "{config}: the tracer sees user writes");
        assert_eq!(ebpf.exact, None, "{config}");
    }
}

#[test]
fn copies_read_into_armed_memory_are_merged_in_every_mode() {
    let file = SeedFile::new("read", SEED, N);
    for (config, ebpf) in every_mode_merges("read(2)", &|child, region, _| {
        child.read_into(region, 0, N, &file.0, "read");
        region
    }) {
        assert_eq!(
            ebpf.misses, 0,
            "{config}: read(2) faults in kernel mode: the tracer sees it"
        );
    }
}

#[test]
fn copies_received_from_a_socket_are_merged_in_every_mode() {
    let file = SeedFile::new("recv", SEED, N);
    for (config, ebpf) in every_mode_merges("recv(2)", &|child, region, _| {
        child.read_into(region, 0, N, &file.0, "recv");
        region
    }) {
        assert_eq!(
            ebpf.misses, 0,
            "{config}: recv(2) faults in kernel mode: the tracer sees it"
        );
    }
}

/// Writes that raise no fault at all are found by the audit within one cycle, counted, and
/// the target is tracked exactly from then on.
fn found_by_the_audit(outcomes: &[(Config, Outcome)], how: &str) {
    for (config, ebpf) in outcomes {
        found_by_the_audit_with(ebpf, &format!("{config}: {how}"));
    }
}

fn found_by_the_audit_with(ebpf: &Outcome, how: &str) {
    assert!(ebpf.misses > 0, "{how}: no miss counted");
    let why = ebpf.exact.as_deref().unwrap_or_default();
    assert!(
        why.contains("written that the tracer did not"),
        "{how}: not switched to exact tracking: {why:?}"
    );
    let passes = ebpf.passes_to_miss.expect("a miss");
    assert!(
        passes <= AUDIT_PASSES,
        "{how}: found after {passes} passes, the audit cycle is {AUDIT_PASSES}"
    );
}

#[test]
fn copies_written_by_another_process_are_found_by_the_audit() {
    let outcomes = every_mode_merges("process_vm_writev", &|child, region, _| {
        let content: Vec<u8> = (0..N).flat_map(|_| seed_content(SEED)).collect();
        let remote = [RemoteIoVec {
            base: region.base as usize,
            len: content.len(),
        }];
        let written = process_vm_writev(
            Pid::from_raw(child.pid() as i32),
            &[std::io::IoSlice::new(&content)],
            &remote,
        )
        .expect("process_vm_writev");
        assert_eq!(written, content.len());
        region
    });
    found_by_the_audit(&outcomes, "process_vm_writev");
}

#[test]
fn a_write_without_a_fault_among_written_pages_is_found_when_they_are_protected_again() {
    require_root();
    let _turn = ksm_turn();
    if !Offer::probe(WriteProtectChoice::Auto).userfaultfd {
        return;
    }
    let config = Config {
        mode: DirtyMode::Ebpf,
        protection: WriteProtectChoice::Userfaultfd,
    };
    let mut child = TestChild::spawn();
    let region = child.map(N);
    child.write_unique(region, 0, N, 1000);
    let pid = child.pid();
    // An audit cycle far longer than the test: only protecting the written pages again can
    // find the write in time.
    let mut daemon = daemon_auditing(pid, &[region], config, 100_000);
    for _ in 0..3 {
        pass_and_wait(&mut daemon);
    }
    protected_as_asked(&daemon, config);
    let misses = |d: &Daemon| d.targets().map(|t| t.counters().dirty_misses).sum::<u64>();
    assert_eq!(misses(&daemon), 0);
    // Pages 40 and 50 written by the child (faults the tracer sees), page 45 between them by
    // another process (no fault).
    child.write_unique(region, 40, 1, 5000);
    child.write_unique(region, 50, 1, 6000);
    let content = seed_content(SEED);
    let remote = [RemoteIoVec {
        base: (region.base + 45 * PAGE) as usize,
        len: content.len(),
    }];
    let written = process_vm_writev(
        Pid::from_raw(pid as i32),
        &[std::io::IoSlice::new(&content)],
        &remote,
    )
    .expect("process_vm_writev");
    assert_eq!(written, content.len());
    pass_and_wait(&mut daemon);
    assert_eq!(
        misses(&daemon),
        1,
        "the write between them, at the next pass"
    );
    let why = daemon
        .targets()
        .find_map(|t| t.exact_tracking().map(str::to_string))
        .unwrap_or_default();
    assert!(
        why.contains("written that the tracer did not"),
        "not tracked exactly from then on: {why:?}"
    );
    daemon.finish();
    assert!(child.verify(region, 45, 1, SEED), "memory changed");
    assert!(child.verify_unique(region, 40, 1, 5000) && child.verify_unique(region, 50, 1, 6000));
    for (first, count) in [(0, 40), (41, 4), (46, 4), (51, N - 51)] {
        assert!(
            child.verify_unique(region, first, count, 1000 + first),
            "memory changed"
        );
    }
}

#[test]
fn copies_read_with_o_direct_are_found_by_the_audit() {
    let file = SeedFile::new("direct", SEED, N);
    let outcomes = every_mode_merges("O_DIRECT read", &|child, region, _| {
        child.read_into(region, 0, N, &file.0, "direct");
        region
    });
    found_by_the_audit(&outcomes, "O_DIRECT");
}

#[test]
fn copies_refilled_after_madv_dontneed_are_merged_in_every_mode() {
    every_mode_merges("MADV_DONTNEED, then writes", &|child, region, _| {
        child.dont_need(region, 0, N);
        child.write(region, 0, N, SEED);
        region
    });
}

#[test]
fn copies_moved_in_with_mremap_are_merged_in_every_mode() {
    every_mode_merges("mremap", &|child, _, spare| {
        // Written where rksm does not look, then moved onto memory it armed: a new VMA at
        // an armed address, without the registration.
        let outside = child.map(N);
        child.write(outside, 0, N, SEED);
        child.mremap(outside, spare)
    });
}

/// Runs passes until `done`, at most 60 s.
fn passes_until(daemon: &mut Daemon, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        pass_and_wait(daemon);
        if done() {
            return true;
        }
    }
    false
}

#[test]
fn a_steady_pass_looks_at_no_clean_page_and_the_merges_are_no_misses() {
    require_root();
    let _turn = ksm_turn();
    for mode in configurations(false) {
        let mut child = TestChild::spawn();
        let region = child.map(N);
        let other = child.map(N);
        child.write(region, 0, N, SEED);
        child.write_unique(other, 0, N, 7000);
        let pid = child.pid();
        let ksmd_run = || std::fs::read_to_string("/sys/kernel/mm/ksm/run").unwrap();
        let found_run = ksmd_run();
        let mut daemon = daemon_over(pid, &[region, other], mode);
        assert!(
            passes_until(&mut daemon, || ksm_pages(pid, region, N).len()
                == N as usize),
            "{mode}: never merged"
        );
        // Nothing left to merge: ksmd goes back to what the daemon found.
        assert!(
            passes_until(&mut daemon, || ksmd_run() == found_run),
            "{mode}: ksmd still paced after convergence"
        );
        // Two audit cycles over merged memory: ksmd replacing a page is no write.
        for _ in 0..2 * AUDIT_PASSES {
            pass_and_wait(&mut daemon);
        }
        let target = daemon.targets().next().expect("the target");
        assert_eq!(
            target.counters().dirty_misses,
            0,
            "{mode}: merges counted as misses"
        );
        let steady = daemon.last_pass().expect("a pass").clone();
        assert_eq!(
            (
                steady.pages_hashed,
                steady.pagemap_pages,
                steady.kpageflags_reads
            ),
            (0, 0, 0),
            "{mode}: a steady pass looked at clean pages: {steady:?}"
        );
        assert!(
            steady.pages_skipped_clean >= 2 * N - 1,
            "{mode}: {steady:?}"
        );

        // 16 pages written: the next pass looks at those and no others.
        child.write_unique(other, 0, 16, 9000);
        daemon.pass();
        let after = daemon.last_pass().expect("a pass").clone();
        assert_eq!(after.pages_hashed, 16, "{mode}: {after:?}");
        assert!(after.pagemap_pages <= 32, "{mode}: {after:?}");
        daemon.finish();
        assert!(child.verify(region, 0, N, SEED) && child.verify_unique(other, 16, N - 16, 7016));
    }
}

#[test]
fn a_terabyte_arena_with_a_few_pages_touched_is_scanned_in_bounded_memory() {
    require_root();
    let _turn = ksm_turn();
    const TIB_PAGES: u64 = (1 << 40) / PAGE;
    let mut child = TestChild::spawn();
    let arena = child.map_sparse(TIB_PAGES);
    // 16 pages, 64 GiB apart, the same content: 15 duplicates.
    for i in 0..16 {
        child.write(arena, i * (TIB_PAGES / 16), 1, SEED);
    }
    let output = rksm_tests::rksm_command()
        .args([
            "estimate",
            "--pid",
            &child.pid().to_string(),
            "--passes",
            "2",
            "--interval",
            "0.1",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let process = &json["processes"][0];
    assert!(process["duplicate_pages"].as_u64() >= Some(15), "{json}");
    // Its peak resident set, from the rusage of this test binary's exited children (the
    // other tests of this binary run no rksm command).
    let usage = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_CHILDREN)
        .expect("getrusage");
    let max_rss_kib = usage.max_rss();
    assert!(
        max_rss_kib < 64 * 1024,
        "estimate used {max_rss_kib} KiB for a sparse TiB (8 bytes a virtual page would be 2 GiB)"
    );
}
