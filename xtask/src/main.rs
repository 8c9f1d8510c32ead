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
    process::{Command, ExitCode},
};

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

use build::{build, build_dist, cargo, guest_image, run_checked};
use setup::BPF_TARGET;

mod build;
mod deb;
mod demo;
mod kernel_bench;
mod setup;
mod testing;
mod vm;
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Cmd::Setup => setup::setup().map(|_| ()),
        Cmd::Build => build(),
        Cmd::Run { args } => demo::run(args),
        Cmd::Test {
            quick,
            kernel,
            args,
        } => testing::test(quick, &kernel, args),
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
