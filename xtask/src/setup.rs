//! Setting the machine up: the route that compiles the eBPF program (Debian's precompiled
//! `core` for the bpf target, or a nightly with rust-src), bpf-linker, and the packages the
//! tests' qemu guests need; what is missing is installed, what cannot be is named.

use std::{
    env,
    ffi::OsString,
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{bail, Result};

use crate::{build::run_checked, is_root, workspace_root};

/// What the qemu test guests need: the emulator, a kernel to boot, and the busybox their
/// initramfs runs.
const GUEST_PACKAGES: &[&str] = &["qemu-system-x86", "linux-image-amd64", "busybox"];

/// Debian packages of the verified route: rustc 1.96 with LLVM 22, `core` for the bpf
/// target, and LLVM 22 itself for building bpf-linker.
const DEBIAN_PACKAGES: &[&str] = &[
    "rustc-web",
    "cargo-web",
    "libstd-rust-web-dev-bpf",
    "llvm-22-dev",
    "libpolly-22-dev",
    "clang-22",
    "lld-22",
];
pub(crate) const DEBIAN_RUSTC: &str = "/usr/bin/rustc";
const DEBIAN_BPF_SYSROOT: &str = "/usr/lib/rustlib/bpfel-unknown-none/lib";
const LLVM_22: &str = "/usr/lib/llvm-22";
const BPF_LINKER_VERSION: &str = "0.13.0";
pub(crate) const BPF_TARGET: &str = "bpfel-unknown-none";

/// How the eBPF crate gets compiled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// Debian's rustc 1.96 with its precompiled `core` for bpfel (`RUSTC_BOOTSTRAP=1`).
    Debian,
    /// rustup nightly with rust-src (`-Z build-std=core`), the standard aya route.
    Nightly,
}

fn debian_route_ready() -> bool {
    Path::new(DEBIAN_RUSTC).exists()
        && fs::read_dir(DEBIAN_BPF_SYSROOT)
            .map(|d| {
                d.flatten()
                    .any(|e| e.file_name().to_string_lossy().starts_with("libcore-"))
            })
            .unwrap_or(false)
}

fn nightly_route_ready() -> bool {
    let Ok(out) = Command::new("rustup")
        .args(["run", "nightly", "rustc", "--print", "sysroot"])
        .stderr(Stdio::null())
        .output()
    else {
        return false;
    };
    let sysroot = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    out.status.success() && sysroot.join("lib/rustlib/src/rust/library/core").exists()
}

fn cargo_bin_dir() -> PathBuf {
    env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .unwrap_or_else(|| PathBuf::from("/root/.cargo"))
        .join("bin")
}

/// PATH with cargo's bin directory first, where `cargo install` puts bpf-linker.
pub(crate) fn path_with_cargo_bin() -> OsString {
    let mut dirs = vec![cargo_bin_dir()];
    dirs.extend(env::split_paths(&env::var_os("PATH").unwrap_or_default()));
    env::join_paths(dirs).expect("PATH entries have no separators")
}

fn bpf_linker_ready() -> bool {
    Command::new("bpf-linker")
        .arg("--version")
        .env("PATH", path_with_cargo_bin())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

fn missing_debian_packages(packages: &[&'static str]) -> Vec<&'static str> {
    packages
        .iter()
        .copied()
        .filter(|p| {
            let out = Command::new("dpkg-query")
                .args(["-W", "-f=${db:Status-Status}", p])
                .stderr(Stdio::null())
                .output();
            !matches!(out, Ok(o) if o.stdout == b"installed")
        })
        .collect()
}

pub(crate) fn apt_install(packages: &[&str]) -> Result<()> {
    if packages.is_empty() {
        return Ok(());
    }
    if Command::new("apt-get").arg("--version").output().is_err() {
        bail!(
            "missing Debian packages {} and there is no apt-get here; install their equivalents \
             (rustc 1.96 with LLVM 22 and a `core` for {BPF_TARGET}, LLVM 22 development files), \
             or rustup nightly with rust-src",
            packages.join(" ")
        );
    }
    if !is_root() {
        bail!(
            "installing {} needs root: run `sudo cargo xtask setup`",
            packages.join(" ")
        );
    }
    eprintln!("xtask: installing {}", packages.join(" "));
    run_checked(Command::new("apt-get").args(["update", "-q"]))?;
    run_checked(
        Command::new("apt-get")
            .args(["install", "-y", "-q"])
            .args(packages)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
}

/// Installs what is missing and returns the route the eBPF build will take.
pub(crate) fn setup() -> Result<Route> {
    let route = if debian_route_ready() {
        Route::Debian
    } else if nightly_route_ready() {
        Route::Nightly
    } else {
        eprintln!("xtask: no compiler for {BPF_TARGET} yet (neither Debian's rustc-web with libstd-rust-web-dev-bpf nor rustup nightly with rust-src)");
        apt_install(&missing_debian_packages(DEBIAN_PACKAGES))?;
        if !debian_route_ready() {
            bail!("{DEBIAN_BPF_SYSROOT} still has no libcore after installing the Debian packages");
        }
        Route::Debian
    };
    if !bpf_linker_ready() {
        // bpf-linker links against LLVM; without LLVM 22's prefix its build script picks the
        // system llvm-config (LLVM 14) and fails with `unable to find library -lLLVM`.
        apt_install(&missing_debian_packages(&[
            "llvm-22-dev",
            "libpolly-22-dev",
        ]))?;
        eprintln!(
            "xtask: building bpf-linker {BPF_LINKER_VERSION} against LLVM 22 (a few minutes, once)"
        );
        let mut path = vec![PathBuf::from(LLVM_22).join("bin")];
        path.extend(env::split_paths(&path_with_cargo_bin()));
        run_checked(
            Command::new("cargo")
                .args([
                    "install",
                    &format!("bpf-linker@{BPF_LINKER_VERSION}"),
                    "--locked",
                ])
                .args(["--no-default-features", "--features", "llvm-22"])
                .env("PATH", env::join_paths(path)?)
                .env("LLVM_PREFIX", LLVM_22)
                .env("LLVM_SYS_220_PREFIX", LLVM_22),
        )?;
        if !bpf_linker_ready() {
            bail!(
                "bpf-linker is still not runnable from {}",
                cargo_bin_dir().display()
            );
        }
    }
    // The tests and `rksm bench --profile guests` boot qemu guests (TCG) with a Debian kernel;
    // the kernel matrix also boots Debian 12's 6.12, unpacked under target/kernels.
    apt_install(&missing_debian_packages(GUEST_PACKAGES))?;
    if crate::vm::Kernel::Debian12Linux612
        .image(&workspace_root())
        .is_none()
    {
        if !is_root() {
            bail!("fetching Debian's 6.12 kernel for the test guests needs root: run `sudo cargo xtask setup`");
        }
        run_checked(Command::new("apt-get").args(["update", "-q"]))?;
        crate::vm::fetch_linux_612(&workspace_root())?;
    }
    eprintln!("xtask: set-up complete ({route:?} route for the eBPF program, bpf-linker present, qemu and the guest kernels)");
    Ok(route)
}
