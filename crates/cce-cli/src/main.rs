//! `cce`: the command line of cut-cross-entropy.
//!
//! - `cce run`: one forward (and backward) call on the shipped real fixture (default), a
//!   safetensors or NumPy file, or a generated case; prints the loss (and the file's reference),
//!   an lse summary, wall times, peak memory and the call statistics; `--check` compares every
//!   output with the f64 oracle and fails the run when one is outside its tolerance,
//!   `--save-grads` writes the gradients.
//! - `cce repro`: the seed's experiment (regular, c/8, e/8, c*8, e*8 and lm inputs) as a table,
//!   optionally plotted.
//!
//! Errors print as `error: <message>` with exit status 1 (2 for bad command-line syntax).

/// `println!` that ignores a closed stdout (`cce run | head -3`) instead of panicking; the
/// work (and `--save-grads`, `--plot`) goes on.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

/// `print!` counterpart of `outln!`.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = write!(std::io::stdout(), $($arg)*);
    }};
}

mod backend;
mod cli;
mod error;
mod input;
mod judge;
mod plot;
mod progress;
mod report;
mod repro;
mod run;
#[cfg(all(unix, feature = "wgpu"))]
mod runtime_dir;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    // A private XDG_RUNTIME_DIR when none is usable, so that the Vulkan loader's device
    // selection does not print libwayland's complaint about it (`runtime_dir`). Here, before
    // any thread exists: it sets an environment variable. Removed when `main` returns.
    #[cfg(all(unix, feature = "wgpu"))]
    let _runtime_dir = {
        let backend = match &cli.command {
            cli::Command::Run(a) => &a.backend,
            cli::Command::Repro(a) => &a.backend,
        };
        matches!(backend.as_str(), "wgpu" | "auto")
            .then(runtime_dir::ensure)
            .flatten()
    };
    let result = match &cli.command {
        cli::Command::Run(args) => run::main(args),
        cli::Command::Repro(args) => repro::main(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
