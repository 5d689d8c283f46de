//! Progress display on stderr (indicatif). Hidden automatically when stderr is not a
//! terminal, so piped output and tests see only the results.

use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

/// A spinner with a message and the elapsed time, ticking on its own thread.
pub fn spinner(msg: impl Into<String>) -> ProgressBar {
    let pb = ProgressBar::new_spinner();
    if let Ok(style) = ProgressStyle::with_template("{spinner:.cyan} {msg} [{elapsed}]") {
        pb.set_style(style);
    }
    pb.set_message(msg.into());
    pb.enable_steady_tick(Duration::from_millis(120));
    pb
}

/// Runs `f` under a spinner showing `msg`; the spinner is cleared when `f` returns.
pub fn with_spinner<T>(msg: impl Into<String>, f: impl FnOnce() -> T) -> T {
    let pb = spinner(msg);
    let out = f();
    pb.finish_and_clear();
    out
}

/// A bar of `len` steps with a message.
pub fn bar(len: u64, msg: impl Into<String>) -> ProgressBar {
    let pb = ProgressBar::new(len);
    if let Ok(style) =
        ProgressStyle::with_template("{spinner:.cyan} {msg} [{bar:30}] {pos}/{len} [{elapsed}]")
    {
        pb.set_style(style.progress_chars("=> "));
    }
    pb.set_message(msg.into());
    pb.enable_steady_tick(Duration::from_millis(120));
    pb
}
