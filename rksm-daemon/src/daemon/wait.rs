//! Between passes: the daemon sleeps until its next pass, a signal or a child's exit, waking
//! only when the tracer needs draining, and a pass can be ended early between two chunks.

use std::{
    os::fd::BorrowedFd,
    time::{Duration, Instant},
};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

use super::{Daemon, DRAIN_EVERY};
use crate::ebpf::recorder::Recorder;

impl Daemon {
    /// Waits until `deadline`, draining the tracer when it needs it; returns early (false)
    /// when one of `interrupts` becomes readable (a signalfd, a child's pidfd). Nothing else
    /// wakes it: with one domain the tracer wakes it only when an eighth of its ring waits
    /// unread, with several for every write (to unmark a written marked page at once), and
    /// then the ring is drained at most every [`DRAIN_EVERY`]: waking for each record would
    /// cost a context switch per write fault. The rest of the ring (3.5 MiB, ~150,000 faults)
    /// holds that interval's faults up to 3 million a second.
    pub fn wait(&mut self, deadline: Instant, interrupts: &[BorrowedFd<'_>]) -> bool {
        // With several domains a write to a marked page is acted on at once; otherwise the
        // records wait for the next pass, and the tracer wakes the daemon only to keep its
        // ring from filling.
        if let Some(recorder) = &mut self.recorder {
            if let Err(e) = recorder.wake_at_once(self.several_domains) {
                log::debug!("the tracer's wake-up: {e}");
            }
        }
        let mut ring_quiet_until = Instant::now();
        loop {
            let now = Instant::now();
            let left = deadline.saturating_duration_since(now);
            if left.is_zero() {
                return true;
            }
            let watch_ring = now >= ring_quiet_until;
            let step = if watch_ring {
                left
            } else {
                left.min(ring_quiet_until - now)
            };
            // A thread given up for not stopping in time is let go as soon as it stops: look
            // every 10 ms while there is one. Otherwise nothing needs the daemon before the
            // deadline but the fds polled.
            let step = if self.borrower.reap_lingering() > 0 {
                step.min(Duration::from_millis(10))
            } else {
                step
            };
            // Rounded up: a timeout cut to whole milliseconds would wake just before the
            // deadline and spin until it.
            let millis = step.as_nanos().div_ceil(1_000_000).min(i32::MAX as u128) as i32;
            let timeout = PollTimeout::try_from(millis).unwrap_or(PollTimeout::MAX);
            let records = self.recorder.as_ref().map(Recorder::records_fd);
            let mut fds: Vec<PollFd<'_>> = interrupts
                .iter()
                .map(|&fd| PollFd::new(fd, PollFlags::POLLIN))
                .collect();
            if let Some(fd) = records.filter(|_| watch_ring) {
                fds.push(PollFd::new(fd, PollFlags::POLLIN));
            }
            match poll(&mut fds, timeout) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                // Not expected of the daemon's own fds; sleeping out the step keeps a poll
                // that keeps failing from spinning until the deadline.
                Err(e) => {
                    log::warn!("waiting for the next pass: poll: {e}");
                    std::thread::sleep(step);
                }
            }
            let interrupted = fds[..interrupts.len()]
                .iter()
                .any(|fd| fd.revents().is_some_and(|r| !r.is_empty()));
            let ring_woke = watch_ring
                && fds
                    .get(interrupts.len())
                    .and_then(|fd| fd.revents())
                    .is_some_and(|r| !r.is_empty());
            drop(fds);
            if let Some(r) = &mut self.recorder {
                r.drain();
                r.log_mut().watch_fresh(self.several_domains);
                let written = r.log_mut().take_fresh();
                self.back_off_written_marks(written);
            }
            if ring_woke {
                ring_quiet_until = Instant::now() + DRAIN_EVERY;
            }
            if interrupted {
                return false;
            }
        }
    }

    /// Ends a pass early, between two chunks, once one of `fds` is readable (the signalfd of
    /// SIGINT and SIGTERM): the daemon then stops within one chunk's read, not one pass.
    pub fn stop_on(&mut self, fds: &[BorrowedFd<'_>]) -> std::io::Result<()> {
        let fds: Vec<std::os::fd::OwnedFd> = fds
            .iter()
            .map(|fd| fd.try_clone_to_owned())
            .collect::<Result<_, _>>()?;
        self.scanner.stop_when(move || {
            use std::os::fd::AsFd;
            let mut polled: Vec<PollFd<'_>> = fds
                .iter()
                .map(|fd| PollFd::new(fd.as_fd(), PollFlags::POLLIN))
                .collect();
            poll(&mut polled, PollTimeout::ZERO).is_ok_and(|n| n > 0)
        });
        Ok(())
    }

    /// True once a pass was cut short to stop.
    pub fn stopping(&self) -> bool {
        self.stopping
    }
}
