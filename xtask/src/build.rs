//! Building: the eBPF program, the daemon, the stripped binary that is shipped, and the
//! initramfs the qemu guests boot.

use std::{env, fs, path::PathBuf, process::Command};

use anyhow::{bail, Context, Result};

use crate::{
    ebpf_object,
    setup::{path_with_cargo_bin, setup, Route, BPF_TARGET, DEBIAN_RUSTC},
    workspace_root,
};

pub(crate) fn run_checked(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("running {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed with {status}");
    }
    Ok(())
}

pub(crate) fn cargo() -> Command {
    let mut cmd = Command::new(env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.current_dir(workspace_root());
    cmd
}

fn build_ebpf(route: Route) -> Result<()> {
    let mut cmd = Command::new("cargo");
    if route == Route::Nightly {
        cmd.arg("+nightly");
    }
    cmd.current_dir(workspace_root().join("rksm-ebpf"))
        .args(["build", "--release", "--locked", "--target", BPF_TARGET])
        .env("PATH", path_with_cargo_bin())
        // The outer `cargo run` pins this process to the stable toolchain; the eBPF build
        // picks its own compiler.
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("RUSTC")
        .env_remove("RUSTC_WRAPPER");
    match route {
        Route::Debian => {
            // Debian's sysroot already has `core` for bpfel, so no -Z build-std; the bootstrap
            // flag is for aya-ebpf's `asm_experimental_arch` and rksm-ebpf's core intrinsics.
            cmd.env("RUSTC", DEBIAN_RUSTC).env("RUSTC_BOOTSTRAP", "1");
        }
        Route::Nightly => {
            cmd.args(["-Z", "build-std=core"]);
        }
    }
    run_checked(&mut cmd).context("building the eBPF program")
}

pub(crate) fn build() -> Result<()> {
    let route = setup()?;
    build_ebpf(route)?;
    run_checked(
        cargo()
            .args(["build", "--release", "--workspace"])
            .env("RKSM_EBPF_OBJECT", ebpf_object()),
    )
    .context("building the daemon")
}

/// Builds target/guest/initrd.cpio: tests/support/guestinit.rs, linked statically (so the
/// initramfs needs no libraries), as `/init`, and the `/dev/console` node the kernel opens
/// for it. Returns its path.
pub(crate) fn guest_image() -> Result<PathBuf> {
    let root = workspace_root();
    let dir = root.join("target/guest");
    fs::create_dir_all(&dir)?;
    let init = dir.join("init");
    run_checked(
        Command::new("rustc")
            .args([
                "--edition",
                "2021",
                "-O",
                "-C",
                "target-feature=+crt-static",
                "-C",
                "strip=symbols",
            ])
            .arg(root.join("tests/support/guestinit.rs"))
            .arg("-o")
            .arg(&init),
    )
    .context("building the guest's /init")?;
    let mut cpio = Vec::new();
    newc_entry(&mut cpio, "dev", 0o040_755, (0, 0), &[]);
    newc_entry(&mut cpio, "dev/console", 0o020_600, (5, 1), &[]);
    newc_entry(&mut cpio, "init", 0o100_755, (0, 0), &fs::read(&init)?);
    newc_entry(&mut cpio, "TRAILER!!!", 0, (0, 0), &[]);
    let image = dir.join("initrd.cpio");
    fs::write(&image, cpio)?;
    Ok(image)
}

/// Appends one entry in the kernel's initramfs format (cpio "newc": a header of hex fields,
/// the name, the data, each padded to 4 bytes).
pub(crate) fn newc_entry(out: &mut Vec<u8>, name: &str, mode: u32, rdev: (u32, u32), data: &[u8]) {
    let ino = out.len() as u32 + 1;
    let fields = [
        ino,
        mode,
        0,
        0,
        1,
        0,
        data.len() as u32,
        0,
        0,
        rdev.0,
        rdev.1,
        name.len() as u32 + 1,
        0,
    ];
    out.extend_from_slice(b"070701");
    for f in fields {
        out.extend_from_slice(format!("{f:08x}").as_bytes());
    }
    out.extend_from_slice(name.as_bytes());
    out.push(0);
    out.resize(out.len().next_multiple_of(4), 0);
    out.extend_from_slice(data);
    out.resize(out.len().next_multiple_of(4), 0);
}

/// Builds the stripped, optimised binary (the `dist` profile); returns its path.
pub(crate) fn build_dist() -> Result<PathBuf> {
    let route = setup()?;
    build_ebpf(route)?;
    run_checked(
        cargo()
            .args(["build", "--profile", "dist", "-p", "rksm", "--bin", "rksm"])
            .env("RKSM_EBPF_OBJECT", ebpf_object()),
    )
    .context("building the dist binary")?;
    Ok(workspace_root().join("target/dist/rksm"))
}
