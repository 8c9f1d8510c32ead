//! The `rksm` command line: a thin layer over the `rksm` library.
//!
//! Errors are reported as one line on stderr. Exit status: 0 success, 1 the work failed
//! (kernel refused, I/O), 2 bad input (flags, pids, files).

use std::process::ExitCode;

use clap::Parser;

mod cli;

fn main() -> ExitCode {
    let args = cli::Cli::parse();
    cli::init_logging();
    match cli::run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("rksm: {err:#}");
            if err.downcast_ref::<cli::BadInput>().is_some() {
                ExitCode::from(2)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}
