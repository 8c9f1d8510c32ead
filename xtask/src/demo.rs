//! `cargo xtask run`: the demo (workloads with known duplicates, the daemon over them, its
//! status) or, with arguments, the built `rksm` as root.

use std::{
    env,
    ffi::OsString,
    fs,
    path::Path,
    process::{Command, Stdio},
};

use anyhow::{bail, Context, Result};

use crate::{build::build, is_root, workspace_root};

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

pub(crate) fn run(args: Vec<OsString>) -> Result<()> {
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

pub(crate) fn demo(release: &Path) -> Result<()> {
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
