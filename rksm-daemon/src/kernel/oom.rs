//! The OOM killer and a borrowed thread: rksm must not die holding one.
//!
//! A thread rksm has stopped and pointed at its vDSO would, if rksm were killed right then,
//! be let go by the kernel as it is. Its registers are the thread's own between injected
//! calls, but during a call (milliseconds; seconds for an `madvise` over a large range) they
//! are not. rksm's memory grows with its targets, so under memory pressure it is a candidate
//! for the OOM killer like any process. While it holds a borrowed thread it makes itself
//! none: `/proc/self/oom_score_adj` goes down to the lowest value it may set, and back up
//! once no thread is held.
//!
//! Lowering one's own `oom_score_adj` needs `CAP_SYS_RESOURCE`, except down to the value the
//! process was started with: the systemd unit starts rksm at -1000 (`OOMScoreAdjust`), rksm
//! raises itself to 0 at start (an ordinary candidate the rest of the time) and may go back
//! down to -1000 for its borrows. Started by hand as root it has the capability; elsewhere
//! (the DaemonSet, whose pod's value the kubelet sets) it says once that it cannot.

use std::{
    fs::{File, OpenOptions},
    io::{Read, Seek, Write},
    sync::Mutex,
};

/// The shield's state: the file, the values, and how many holders there are.
struct State {
    file: Option<File>,
    /// The value while a thread is held.
    shielded: i32,
    /// The value otherwise.
    normal: i32,
    holders: usize,
    warned: bool,
}

static STATE: Mutex<State> = Mutex::new(State {
    file: None,
    shielded: -1000,
    normal: 0,
    holders: 0,
    warned: false,
});

fn write(file: &mut File, value: i32) -> std::io::Result<()> {
    file.rewind()?;
    file.write_all(value.to_string().as_bytes())
}

/// Reads the value rksm was started with and, if it is below 0 (the unit's floor), raises
/// it to 0 for the time no thread is held. Returns the value the shield will use.
pub fn init() -> std::io::Result<i32> {
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/proc/self/oom_score_adj")?;
    let mut text = String::new();
    file.read_to_string(&mut text)?;
    let start: i32 = text.trim().parse().unwrap_or(0);
    let mut state = STATE.lock().unwrap_or_else(|e| e.into_inner());
    state.normal = start.max(0);
    state.shielded = -1000;
    if start < 0 {
        write(&mut file, state.normal)?;
    }
    state.file = Some(file);
    Ok(state.shielded)
}

/// While one lives, rksm is no OOM candidate (as far as it may make itself none).
#[derive(Debug)]
pub struct Shield(());

impl Shield {
    /// Lowers `oom_score_adj` for the first holder. Without [`init`] it does nothing.
    pub fn raise() -> Shield {
        let mut state = STATE.lock().unwrap_or_else(|e| e.into_inner());
        state.holders += 1;
        if state.holders == 1 {
            let value = state.shielded;
            if let Some(file) = state.file.as_mut() {
                if let Err(e) = write(file, value) {
                    if !std::mem::replace(&mut state.warned, true) {
                        log::warn!(
                            "rksm cannot shield itself from the OOM killer while it holds a target's thread ({e}): start it with a negative oom_score_adj (the unit's OOMScoreAdjust) or give it CAP_SYS_RESOURCE"
                        );
                    }
                }
            }
        }
        Shield(())
    }
}

impl Drop for Shield {
    fn drop(&mut self) {
        let mut state = STATE.lock().unwrap_or_else(|e| e.into_inner());
        state.holders -= 1;
        if state.holders == 0 {
            let value = state.normal;
            if let Some(file) = state.file.as_mut() {
                let _ = write(file, value);
            }
        }
    }
}

/// The current `oom_score_adj` of rksm.
pub fn current() -> Option<i32> {
    std::fs::read_to_string("/proc/self/oom_score_adj")
        .ok()?
        .trim()
        .parse()
        .ok()
}
