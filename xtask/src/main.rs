//! `cargo xtask`: set up the machine, build the eBPF program and the daemon, run, test.
//!
//! rksm's eBPF program needs a compiler that can target `bpfel-unknown-none` and the
//! `bpf-linker`. On the machines this project runs on, rustup has no nightly with rust-src,
//! so the usual aya route is closed; Debian ships a precompiled `core` for the bpf target and
//! an LLVM 22 to build bpf-linker against (see docs/operations.md, "What set-up installs"). This crate
//! knows both routes, prefers what is present, installs what is missing, and says exactly
//! what it could not find.

use std::{
    env,
    ffi::OsString,
    fs,
    path::{Path, PathBuf},
    process::{Command, ExitCode, Stdio},
};

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

mod deb;
mod kernel_bench;
mod vm;

/// Debian packages of the verified route: rustc 1.96 with LLVM 22, `core` for the bpf
/// target, and LLVM 22 itself for building bpf-linker.
/// What the qemu test guests need: the emulator, a kernel to boot, and the busybox their
/// initramfs runs.
const GUEST_PACKAGES: &[&str] = &["qemu-system-x86", "linux-image-amd64", "busybox"];

const DEBIAN_PACKAGES: &[&str] = &[
    "rustc-web",
    "cargo-web",
    "libstd-rust-web-dev-bpf",
    "llvm-22-dev",
    "libpolly-22-dev",
    "clang-22",
    "lld-22",
];
const DEBIAN_RUSTC: &str = "/usr/bin/rustc";
const DEBIAN_BPF_SYSROOT: &str = "/usr/lib/rustlib/bpfel-unknown-none/lib";
const LLVM_22: &str = "/usr/lib/llvm-22";
const BPF_LINKER_VERSION: &str = "0.13.0";
const BPF_TARGET: &str = "bpfel-unknown-none";

#[derive(Parser)]
#[command(name = "cargo xtask", about = "Build, run and test rksm")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what building the eBPF program needs (Debian packages, bpf-linker); does
    /// nothing when everything is there.
    Setup,
    /// Build the eBPF object and the daemon in release mode (target/release/rksm).
    Build,
    /// Build, then run `rksm ARGS` as root; without ARGS, a short demo.
    Run {
        /// Arguments for rksm.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
    /// Run the benchmarks (as root): checksums per page (criterion), scan throughput, what
    /// borrowing a thread costs, and what reading a page costs, whole or sampled.
    Bench {
        /// Only the checksum benchmark (seconds instead of minutes).
        #[arg(long)]
        checksums_only: bool,
        /// Instead: the kernels table, a steady pass's cost in each dirty mode on `host`, a
        /// guest kernel (`debian12`, `debian12-6.12`, once per write-protect source) or
        /// `all`; reports go to docs/bench-kernels/.
        #[arg(long, value_name = "KERNEL")]
        kernel: Option<String>,
        /// With --kernel: runs per mode (medians are reported).
        #[arg(long, default_value = "3", requires = "kernel")]
        repeat: u32,
        /// With --kernel: seconds per run.
        #[arg(long, default_value = "40", requires = "kernel")]
        seconds: u32,
    },
    /// Build, check formatting and lints, and run every test (as root): the full suite on
    /// the host's kernel, then the kernel-facing suites in qemu guests booting Debian 12's
    /// kernels (6.1: soft-dirty only; 6.12: soft-dirty and userfaultfd).
    Test {
        /// Leave out the suites that take minutes (bench, torture, programs, and the guests);
        /// CI runs them all.
        #[arg(long)]
        quick: bool,
        /// Which kernels: `host`, a guest kernel (`debian12`, `debian12-6.12`), or `all`.
        #[arg(long, default_value = "all", value_name = "KERNEL")]
        kernel: String,
        /// Extra arguments for `cargo test` (a filter, `--nocapture`, ...).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
    /// Build the initramfs the qemu test guests boot (target/guest/initrd.cpio): a static
    /// `/init` that fills known memory and checks it on request.
    GuestImage,
    /// Build a stripped, optimised rksm (the `dist` profile) and install it, its man pages,
    /// its bash completions, and the unit and example configuration to copy into place.
    Install {
        /// Where to install: PREFIX/bin, PREFIX/share/man/man1, PREFIX/share/rksm.
        #[arg(long, default_value = "/usr/local")]
        prefix: PathBuf,
    },
    /// Build a Debian package (target/deb/rksm_VERSION_amd64.deb): the stripped binary, the
    /// unit, the example configuration, man pages and completions; nothing is started on
    /// install. It is installed into a scratch root and checked, and lintian run on it.
    Deb,
}

/// Test suites that take minutes; `cargo xtask test --quick` leaves them out.
const SLOW_SUITES: &[&str] = &["bench", "torture", "programs"];

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Cmd::Setup => setup().map(|_| ()),
        Cmd::Build => build(),
        Cmd::Run { args } => run(args),
        Cmd::Test {
            quick,
            kernel,
            args,
        } => test(quick, &kernel, args),
        Cmd::Install { prefix } => install(&prefix),
        Cmd::Deb => build_dist()
            .and_then(|binary| deb::build(&workspace_root(), &binary))
            .map(|deb| println!("xtask: {} built and checked", deb.display())),
        Cmd::GuestImage => guest_image().map(|path| println!("{}", path.display())),
        Cmd::Bench {
            kernel: Some(kernel),
            repeat,
            seconds,
            ..
        } => {
            build().and_then(|()| kernel_bench::bench(&workspace_root(), &kernel, repeat, seconds))
        }
        Cmd::Bench { checksums_only, .. } => bench(checksums_only),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

fn ebpf_object() -> PathBuf {
    workspace_root()
        .join("rksm-ebpf/target")
        .join(BPF_TARGET)
        .join("release/rksm")
}

fn is_root() -> bool {
    // `id -u` avoids an unsafe libc call for one number.
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// How the eBPF crate gets compiled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
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
fn path_with_cargo_bin() -> OsString {
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

fn apt_install(packages: &[&str]) -> Result<()> {
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
fn setup() -> Result<Route> {
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
    if vm::Kernel::Debian12Linux612
        .image(&workspace_root())
        .is_none()
    {
        if !is_root() {
            bail!("fetching Debian's 6.12 kernel for the test guests needs root: run `sudo cargo xtask setup`");
        }
        run_checked(Command::new("apt-get").args(["update", "-q"]))?;
        vm::fetch_linux_612(&workspace_root())?;
    }
    eprintln!("xtask: set-up complete ({route:?} route for the eBPF program, bpf-linker present, qemu and the guest kernels)");
    Ok(route)
}

fn run_checked(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("running {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed with {status}");
    }
    Ok(())
}

fn cargo() -> Command {
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

fn build() -> Result<()> {
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
fn guest_image() -> Result<PathBuf> {
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
fn newc_entry(out: &mut Vec<u8>, name: &str, mode: u32, rdev: (u32, u32), data: &[u8]) {
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

fn as_root(program: &Path) -> Command {
    if is_root() {
        Command::new(program)
    } else {
        eprintln!("xtask: rksm needs root; running it with sudo");
        let mut cmd = Command::new("sudo");
        cmd.arg(program);
        cmd
    }
}

fn run(args: Vec<OsString>) -> Result<()> {
    build()?;
    let release = workspace_root().join("target/release");
    if !args.is_empty() {
        let status = as_root(&release.join("rksm")).args(&args).status()?;
        if !status.success() {
            bail!("rksm exited with {status}");
        }
        return Ok(());
    }
    demo(&release)
}

/// The demo's workloads: `rksm workload` processes with this profile (the format
/// `rksm bench --profile FILE` takes), so the demo measures what the bench measures.
const DEMO_PROFILE: &str = r#"{"processes": 4, "duplicate_mib": 32, "zero_mib": 8,
  "unique_mib": 16, "volatile_mib": 8, "volatile_pages_per_sec": 4096,
  "same_value_percent": 0, "fork_mib": 0}"#;
const DEMO_WORKLOADS: u32 = 4;

/// One `rksm workload` process: it fills its memory, rewrites its volatile pages, and checks
/// every byte when asked (`verify` → `ok`). Killed when dropped.
struct Workload {
    child: std::process::Child,
    stdin: std::process::ChildStdin,
    stdout: std::io::BufReader<std::process::ChildStdout>,
}

impl Workload {
    fn start(rksm: &Path, profile: &Path, index: u32) -> Result<Workload> {
        use std::io::BufRead;
        let mut child = Command::new(rksm)
            .arg("workload")
            .arg("--profile")
            .arg(profile)
            .args(["--index", &index.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting a demo workload")?;
        let stdin = child.stdin.take().context("workload stdin")?;
        let mut stdout = std::io::BufReader::new(child.stdout.take().context("workload stdout")?);
        let mut ready = String::new();
        stdout.read_line(&mut ready)?;
        if ready.trim() != "ready" {
            bail!("workload {index} did not start: `{}`", ready.trim());
        }
        Ok(Workload {
            child,
            stdin,
            stdout,
        })
    }

    fn verify(&mut self) -> Result<String> {
        use std::io::{BufRead, Write};
        writeln!(self.stdin, "verify")?;
        let mut reply = String::new();
        self.stdout.read_line(&mut reply)?;
        Ok(reply.trim().to_string())
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn demo(release: &Path) -> Result<()> {
    eprintln!(
        "xtask: demo: {DEMO_WORKLOADS} workloads x 64 MiB (32 MiB the same everywhere, 8 MiB zeros, 16 MiB unique, 8 MiB rewritten all the time); rksm daemon --dirty ebpf for 15 s"
    );
    let rksm = release.join("rksm");
    let profile = env::temp_dir().join(format!("rksm-demo-{}.json", std::process::id()));
    fs::write(&profile, DEMO_PROFILE)?;
    let workloads: Result<Vec<Workload>> = (0..DEMO_WORKLOADS)
        .map(|i| Workload::start(&rksm, &profile, i))
        .collect();
    let _ = fs::remove_file(&profile);
    let mut workloads = workloads?;
    let mut args: Vec<String> = [
        "--no-config",
        "daemon",
        "--dirty",
        "ebpf",
        "--interval",
        "1",
    ]
    .map(String::from)
    .into();
    args.extend(["--duration".into(), "15".into(), "--json".into()]);
    for w in &workloads {
        args.extend(["--pid".into(), w.child.id().to_string()]);
    }
    let output = as_root(&rksm)
        .args(&args)
        .stderr(Stdio::inherit())
        .output()
        .context("running rksm daemon")?;
    if !output.status.success() {
        bail!("rksm daemon exited with {}", output.status);
    }
    let stats: serde_json::Value =
        serde_json::from_slice(&output.stdout).context("rksm's JSON summary")?;

    eprintln!("xtask: checking every byte of every workload");
    let mut intact = true;
    for (i, w) in workloads.iter_mut().enumerate() {
        let answer = w.verify()?;
        intact &= answer == "ok";
        let merged = fs::read_to_string(format!("/proc/{}/ksm_merging_pages", w.child.id()))
            .unwrap_or_default();
        eprintln!(
            "xtask:   workload {} (pid {}): {} pages merged (kernel's ksm_merging_pages), memory {}",
            i + 1,
            w.child.id(),
            merged.trim(),
            if answer == "ok" { "intact".to_string() } else { format!("CHANGED: {answer}") }
        );
    }
    let sharing = stats["pages_sharing"].as_u64().unwrap_or(0);
    println!(
        "demo: rksm saved {:.1} MiB ({} pages sharing {} KSM pages); hashed {} pages and skipped {} clean ones; {} copy-on-write breaks; memory of every workload {}",
        sharing as f64 * 4096.0 / 1048576.0,
        sharing,
        stats["pages_shared"],
        stats["pages_hashed"],
        stats["pages_skipped_clean"],
        stats["cow_breaks"],
        if intact { "intact" } else { "CHANGED" }
    );
    if !intact {
        bail!("a workload's memory changed");
    }
    Ok(())
}

fn test(quick: bool, kernel: &str, args: Vec<OsString>) -> Result<()> {
    let guests: Vec<vm::Kernel> = match kernel {
        "all" if quick => Vec::new(),
        "all" => vm::Kernel::ALL.to_vec(),
        "host" => Vec::new(),
        name => vec![vm::Kernel::from_name(name).with_context(|| {
            format!("unknown kernel `{name}` (expected host, all, debian12, debian12-6.12)")
        })?],
    };
    let on_host = matches!(kernel, "all" | "host");
    if !is_root() {
        bail!("the tests load eBPF programs and trace other processes: run `sudo cargo xtask test` (CI runs as root)");
    }
    build()?;
    run_checked(cargo().args(["fmt", "--all", "--", "--check"]))
        .context("formatting (run `cargo fmt --all`)")?;
    run_checked(cargo().args([
        "fmt",
        "--manifest-path",
        "rksm-ebpf/Cargo.toml",
        "--",
        "--check",
    ]))
    .context("formatting of rksm-ebpf")?;
    run_checked(
        cargo()
            .args([
                "clippy",
                "--workspace",
                "--all-targets",
                "--release",
                "--",
                "-D",
                "warnings",
            ])
            .env("RKSM_EBPF_OBJECT", ebpf_object()),
    )
    .context("clippy")?;
    // The qemu guests of the `programs` suite boot this.
    let guest = guest_image()?;
    let test = || {
        let mut test = cargo();
        test.args(["test", "--workspace", "--release"])
            .env("RKSM_EBPF_OBJECT", ebpf_object())
            .env("RKSM_GUEST_INITRD", &guest);
        test
    };
    let mut runs = Vec::new();
    if quick {
        // Every target but the slow suites, named one by one (cargo has no exclusion, and
        // will not mix doc tests with other targets).
        let mut some = test();
        some.args(["--lib", "--bins"]);
        for suite in test_suites()? {
            if !SLOW_SUITES.contains(&suite.as_str()) {
                some.args(["--test", &suite]);
            }
        }
        let mut docs = test();
        docs.arg("--doc");
        runs.extend([some, docs]);
        eprintln!("xtask: --quick: leaving out {}", SLOW_SUITES.join(", "));
    } else {
        runs.push(test());
    }
    if !on_host {
        runs.clear();
    }
    let (mut passed, mut failed) = (0, 0);
    let mut outcome = Ok(());
    let mut lines = Vec::new();
    for mut run in runs {
        let (p, f, result) = cargo_test(run.args(&args))?;
        (passed, failed) = (passed + p, failed + f);
        outcome = outcome.and(result);
    }
    if on_host {
        lines.push(format!("host kernel: {passed} passed, {failed} failed"));
    }
    for guest in guests {
        let run = vm::test(&workspace_root(), guest, &ebpf_object())?;
        (passed, failed) = (passed + run.passed, failed + run.failed);
        let mut line = format!(
            "{}: {} passed, {} failed",
            guest.name(),
            run.passed,
            run.failed
        );
        if !run.problems.is_empty() {
            line += &format!(" ({})", run.problems.join("; "));
            outcome = outcome.and(Err(anyhow::anyhow!(
                "the {} guest: {}",
                guest.name(),
                run.problems.join("; ")
            )));
        }
        lines.push(line);
    }
    // One line totalling every test binary's `test result:` line, so the outcome does not
    // hinge on which binary ran last; and one per kernel.
    for line in lines {
        println!("tests on {line}");
    }
    // The Debian package, built from the dist binary and checked in a scratch root.
    if on_host && !quick {
        let packaged = build_dist().and_then(|binary| deb::build(&workspace_root(), &binary));
        match &packaged {
            Ok(deb) => println!(
                "package: {} built, installed into a scratch root, checked",
                deb.display()
            ),
            Err(e) => println!("package: {e:#}"),
        }
        outcome = outcome.and(packaged.map(|_| ()));
    }
    println!("tests: {passed} passed, {failed} failed");
    outcome?;
    if passed == 0 {
        bail!("cargo test ran no test");
    }
    Ok(())
}

/// The integration test suites, as tests/Cargo.toml names them.
fn test_suites() -> Result<Vec<String>> {
    let manifest = fs::read_to_string(workspace_root().join("tests/Cargo.toml"))?;
    let mut suites = Vec::new();
    let mut in_test = false;
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            in_test = line == "[[test]]";
        } else if let Some(name) = line.strip_prefix("name = ").filter(|_| in_test) {
            suites.push(name.trim_matches('"').to_string());
        }
    }
    if suites.is_empty() {
        bail!("no [[test]] in tests/Cargo.toml");
    }
    Ok(suites)
}

/// Builds the stripped, optimised binary (the `dist` profile); returns its path.
fn build_dist() -> Result<PathBuf> {
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

fn install(prefix: &Path) -> Result<()> {
    let built = build_dist()?;
    let root = workspace_root();
    let bin = prefix.join("bin");
    let man = prefix.join("share/man/man1");
    let share = prefix.join("share/rksm");
    let completions = prefix.join("share/bash-completion/completions");
    for dir in [&bin, &man, &share, &completions] {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let rksm = bin.join("rksm");
    // Copy to a new file and rename it into place: a running rksm keeps its old inode.
    let staging = bin.join(".rksm.new");
    fs::copy(&built, &staging).with_context(|| format!("copying to {}", staging.display()))?;
    fs::rename(&staging, &rksm)?;
    run_checked(Command::new(&rksm).arg("man").arg("--out-dir").arg(&man))?;
    let bash = Command::new(&rksm).args(["completions", "bash"]).output()?;
    fs::write(completions.join("rksm"), bash.stdout)?;
    for file in ["rksm.service", "rksm.toml", "rksm-daemonset.yaml"] {
        fs::copy(root.join("packaging").join(file), share.join(file))?;
    }
    let size = fs::metadata(&rksm)?.len();
    println!(
        "xtask: installed {} ({:.1} MiB, stripped), its man pages in {}, bash completions, and {}/{{rksm.service,rksm.toml,rksm-daemonset.yaml}}",
        rksm.display(),
        size as f64 / 1048576.0,
        man.display(),
        share.display()
    );
    println!("xtask: next, as root: install -D -m 0644 {0}/rksm.toml /etc/rksm/rksm.toml (edit the targets); install -m 0644 {0}/rksm.service /etc/systemd/system/; systemctl daemon-reload; systemctl enable --now rksm", share.display());
    Ok(())
}

/// Runs `cargo test`, passing its output through; returns the tests passed and failed, as
/// its `test result:` lines count them, and whether it succeeded.
fn cargo_test(cmd: &mut Command) -> Result<(u64, u64, Result<()>)> {
    use std::io::{BufRead, BufReader};
    let mut child = cmd
        .stdout(Stdio::piped())
        .spawn()
        .context("running cargo test")?;
    let (mut passed, mut failed) = (0u64, 0u64);
    for line in BufReader::new(child.stdout.take().context("cargo test stdout")?).lines() {
        let line = line?;
        println!("{line}");
        if let Some(result) = line.strip_prefix("test result: ") {
            passed += count_before(result, " passed");
            failed += count_before(result, " failed");
        }
    }
    let status = child.wait()?;
    let result = if status.success() {
        Ok(())
    } else {
        Err(anyhow::anyhow!("cargo test failed with {status}"))
    };
    Ok((passed, failed, result))
}

/// In `ok. 6 passed; 0 failed; ...`, the number before `word`.
fn count_before(result: &str, word: &str) -> u64 {
    result
        .split(';')
        .find_map(|part| {
            part.trim()
                .trim_start_matches("ok.")
                .trim_start_matches("FAILED.")
                .trim()
                .strip_suffix(word.trim())
        })
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

fn bench(checksums_only: bool) -> Result<()> {
    if !is_root() {
        bail!("the scan benchmark reads PFNs and /proc/kpageflags: run `sudo cargo xtask bench`");
    }
    build()?;
    run_checked(
        cargo()
            .args(["bench", "-p", "rksm", "--bench", "checksum"])
            .env("RKSM_EBPF_OBJECT", ebpf_object()),
    )?;
    println!("\n# checksum per 4 KiB page, criterion medians");
    println!("| checksum | ns/page | MB/s |");
    println!("|---|---|---|");
    for name in ["xxh64", "crc32c", "jhash2"] {
        let path = workspace_root().join(format!(
            "target/criterion/checksum_4k_page/{name}/new/estimates.json"
        ));
        let text =
            fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        let estimates: serde_json::Value = serde_json::from_str(&text)?;
        let ns = estimates["median"]["point_estimate"]
            .as_f64()
            .context("no median in estimates.json")?;
        println!("| {name} | {ns:.0} | {:.0} |", 4096.0 / ns * 1000.0);
    }
    if checksums_only {
        return Ok(());
    }
    run_checked(
        cargo()
            .args(["bench", "-p", "rksm", "--bench", "scan"])
            .env("RKSM_EBPF_OBJECT", ebpf_object()),
    )?;
    run_checked(
        cargo()
            .args(["bench", "-p", "rksm", "--bench", "borrow"])
            .env("RKSM_EBPF_OBJECT", ebpf_object()),
    )?;
    run_checked(
        cargo()
            .args(["bench", "-p", "rksm", "--bench", "sample"])
            .env("RKSM_EBPF_OBJECT", ebpf_object()),
    )
}
