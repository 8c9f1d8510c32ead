//! Userfaultfd write protection as a dirty source (Linux 6.7+): arming a target, and what
//! one pass asks of it in each mode.
//!
//! Protection is per page: PAGEMAP_SCAN reports the written pages and protects them again in
//! one step, so the pagemap mode is exact as it stands, and the ebpf mode protects again only
//! the pages the tracer saw written, auditing a slice of the rest against the kernel's
//! written bits each pass.

use std::collections::HashSet;

use crate::{
    ebpf::guard,
    engine::dirty::audit_slice,
    kernel::{
        limits,
        process::Process,
        procfs::{self, Vma},
        ranges::RangeSet,
        remote::{Borrower, RemoteError, RemoteRefusal, RemoteSession},
        userfaultfd::{ArmError, Armed},
    },
};

/// Why arming did not happen.
pub(crate) enum NotArmed {
    /// For now (exited, exec'd, a thread that did not stop in time): try again next pass.
    Passing,
    /// For good, and why.
    Lasting(String),
    /// rksm has no file descriptor to spare: try again next pass.
    ShortOfFiles,
    /// The process must not be borrowed, for as long as it lives.
    Refused(RemoteRefusal),
}

/// Files an armed target holds open in rksm: the userfaultfd and its pagemap.
const ARMED_FILES: usize = 2;

/// Creates a userfaultfd inside `process` and takes it over (one borrow).
pub(crate) fn arm(
    borrower: &Borrower,
    process: &Process,
    remote_syscalls: &mut u64,
) -> Result<Armed, NotArmed> {
    // The userfaultfd and the pagemap it is scanned through stay open in rksm; without room
    // for them (and for passes), the target is not borrowed for nothing.
    if !limits::room_for(process.pidfd(), ARMED_FILES + limits::PASS_RESERVE) {
        return Err(NotArmed::ShortOfFiles);
    }
    let armed = RemoteSession::begin(borrower, process)
        .map_err(ArmError::from)
        .and_then(|mut session| {
            let armed = Armed::arm(process, &mut session);
            *remote_syscalls += session.calls();
            session.finish()?;
            armed
        });
    if let Ok(armed) = &armed {
        if let Some(guard) = guard::installed() {
            guard.hold(process.pid(), &armed.handover());
        }
    }
    armed.map_err(|e| match e {
        ArmError::Remote(
            RemoteError::Gone(_)
            | RemoteError::NewImage(_)
            | RemoteError::NoStop { .. }
            | RemoteError::Unsettled(_)
            | RemoteError::Rseq { .. },
        ) => NotArmed::Passing,
        ArmError::Remote(RemoteError::Refused { reason, .. }) if !reason.is_lasting() => {
            NotArmed::Passing
        }
        // What the borrow found (the process says it is not dumpable, every thread has a
        // seccomp filter) refuses the process itself, not only this source.
        ArmError::Remote(RemoteError::Refused { reason, .. }) => NotArmed::Refused(reason),
        // rksm's own files ran out taking the userfaultfd over (the session closed it in
        // the target).
        ArmError::Io { ref source, .. } if limits::out_of_files(source) => NotArmed::ShortOfFiles,
        e => NotArmed::Lasting(e.to_string()),
    })
}

/// `--dirty pagemap`: registers new VMAs and write-protects every armed page; the pages
/// written since the last pass, the ranges that were under protection all along (only
/// their clean pages can be trusted), and the pages walked.
pub(crate) fn pagemap_pass(armed: &mut Armed, vmas: &[Vma]) -> (HashSet<u64>, RangeSet, u64) {
    // Only ranges armed *before* this call (and still armed after protecting, which finds
    // ranges that lost their registration) have pages whose cleanliness can be trusted.
    armed.forget_lost(vmas);
    let before = armed.armed_ranges().clone();
    armed.register(vmas);
    let walked = armed.armed_ranges().pages();
    let written = armed.protect(&before);
    let trusted = before.intersection(armed.armed_ranges());
    (written, trusted, walked)
}

/// What the ebpf pass over a userfaultfd-armed target found.
pub(crate) struct EbpfFound {
    pub written: HashSet<u64>,
    pub trusted: RangeSet,
    /// Pages the audit found written that no record names (and that ksmd did not merge).
    pub unseen: Option<HashSet<u64>>,
    /// Pages PAGEMAP_SCAN walked.
    pub walked: u64,
}

/// `--dirty ebpf`: newly registered memory is protected for the first time, what the tracer
/// saw written (`recorded`, and `carried` from the last pass) is protected again, a slice is
/// audited; `exact` protects every armed page with PAGEMAP_SCAN instead. `after` takes the
/// records of writes that raced with protecting, which are dirty now and, since they may
/// land after the read, again next pass.
pub(crate) fn ebpf_pass(
    pid: u32,
    armed: &mut Armed,
    vmas: &[Vma],
    exact: bool,
    recorded: HashSet<u64>,
    audit: (&mut u64, u32),
    after: &mut dyn FnMut() -> HashSet<u64>,
) -> (EbpfFound, HashSet<u64>) {
    armed.forget_lost(vmas);
    let armed_before = armed.armed_ranges().clone();
    armed.register(vmas);
    let mut written: HashSet<u64>;
    let audited;
    let walked;
    if exact {
        walked = armed.armed_ranges().pages();
        written = armed.protect(&armed_before);
        audited = None;
    } else {
        let new = armed_before.minus(armed.armed_ranges().as_slice());
        armed.protect_new(&new);
        written = recorded;
        // Protecting the recorded pages again walks some pages between them, and reports
        // those it finds written: audited, as the slice is.
        let (between, walked_between) = armed.reprotect(&written);
        let vouched = armed_before.intersection(armed.armed_ranges());
        let slice = audit_slice(&vouched, audit.0, audit.1);
        walked = new.iter().chain(&slice).map(|r| r.pages()).sum::<u64>() + walked_between;
        let mut audit = armed.scan_written(&slice);
        audit.extend(between);
        audited = Some(audit);
    }
    let trusted = armed_before.intersection(armed.armed_ranges());
    let late = after();
    written.extend(late.iter().copied());
    let unseen = audited.map(|audit| {
        // Every fault is recorded before the kernel makes its page writable, so a page the
        // audit saw written is in the records taken by now, unless it was written without
        // a fault.
        let mut unseen: Vec<u64> = audit
            .iter()
            .copied()
            .filter(|p| !written.contains(p))
            .collect();
        unseen.sort_unstable();
        // ksmd merging a page maps the KSM page without the protection: neither a write nor
        // a change of content. A read after `MADV_DONTNEED` maps the zero page unprotected:
        // no write either, but a change of content, which the scan rehashes.
        let (merged, zero) = procfs::ksm_or_zero_mapped(pid, &unseen);
        written.extend(audit.into_iter().filter(|p| !merged.contains(p)));
        // The scan rehashes them; those whose content changed are misses. (ksmd's own
        // copy-on-write of a page it failed to merge writes it without a fault, with the
        // same bytes: no miss.)
        unseen
            .into_iter()
            .filter(|p| !merged.contains(p) && !zero.contains(p))
            .collect()
    });
    (
        EbpfFound {
            written,
            trusted,
            unseen,
            walked,
        },
        late,
    )
}
