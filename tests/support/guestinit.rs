//! The init of the test guests: a qemu guest (TCG, a Debian kernel, this program as `/init`
//! in a tiny initramfs) that holds known memory and checks it on request.
//!
//! Built by `cargo xtask guest-image` with `rustc -C target-feature=+crt-static` (std only,
//! no crates), so the initramfs needs no shared libraries. The kernel passes what follows
//! `--` on its command line as arguments: `DUP_MIB UNIQUE_MIB INDEX`. The guest fills DUP_MIB
//! MiB with pages that are the same in every guest, then UNIQUE_MIB MiB unique to guest
//! INDEX (`rksm bench --profile guests` and the tests start them as `rksm::tools::guest`). Then
//! it prints `rksm-guest: ready PAGES` on the console, and for every line it reads there
//! (`check`), verifies every page and prints `rksm-guest: ok PAGES` or
//! `rksm-guest: corrupt page N`. It never exits: an init that exits panics the kernel.

use std::io::{BufRead, Write};

// Built by rustc alone (`cargo xtask guest-image`), without crates: the page size is written
// here rather than taken from rksm-common.
const WORDS: usize = 4096 / 8;

fn word(page: u64, word: usize, index: u64, shared: u64) -> u64 {
    let owner = if page < shared { 0 } else { index + 1 };
    (page.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ owner.wrapping_mul(0xc2b2_ae3d_27d4_eb4f))
        .wrapping_add(word as u64 | 1)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize, default: u64| args.get(i).and_then(|a| a.parse().ok()).unwrap_or(default);
    let (shared, unique, index) = (arg(1, 32) * 256, arg(2, 32) * 256, arg(3, 0));
    let pages = shared + unique;
    let mut memory = vec![0u64; pages as usize * WORDS];
    for (p, page) in memory.chunks_mut(WORDS).enumerate() {
        for (w, v) in page.iter_mut().enumerate() {
            *v = word(p as u64, w, index, shared);
        }
    }
    let mut out = std::io::stdout();
    let _ = writeln!(out, "rksm-guest: ready {pages}");
    let _ = out.flush();
    let stdin = std::io::stdin();
    let mut line = String::new();
    loop {
        line.clear();
        match stdin.lock().read_line(&mut line) {
            Ok(0) | Err(_) => {
                std::thread::sleep(std::time::Duration::from_secs(3600));
                continue;
            }
            Ok(_) => {}
        }
        if !line.contains("check") {
            continue;
        }
        let bad = memory.chunks(WORDS).enumerate().find_map(|(p, page)| {
            let wrong = page
                .iter()
                .enumerate()
                .any(|(w, &v)| v != word(p as u64, w, index, shared));
            wrong.then_some(p)
        });
        let _ = match bad {
            None => writeln!(out, "rksm-guest: ok {pages}"),
            Some(p) => writeln!(out, "rksm-guest: corrupt page {p}"),
        };
        let _ = out.flush();
    }
}
