//! The error type of the command line: one message, printed as `error: <message>`.

use std::fmt;

/// A failure of a `cce` command, carrying the message shown to the user.
///
/// Every library error (loading, generating, validating, computing, plotting) converts into
/// one; `main` prints it as `error: <message>` and exits with status 1.
#[derive(Debug)]
pub struct CliError(pub String);

/// `Result` with [`CliError`].
pub type CliResult<T> = Result<T, CliError>;

impl CliError {
    /// An error with the given message.
    pub fn msg(m: impl Into<String>) -> Self {
        CliError(m.into())
    }

    /// Prefix the message with what was being done (`"loading input: ..."`).
    pub fn context(self, what: &str) -> Self {
        CliError(format!("{what}: {}", self.0))
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CliError {}

/// The message of an error followed by those of its sources that it does not already quote.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        let m = inner.to_string();
        if !s.contains(&m) {
            s.push_str(": ");
            s.push_str(&m);
        }
        src = inner.source();
    }
    s
}

impl From<cce_data::DataError> for CliError {
    fn from(e: cce_data::DataError) -> Self {
        CliError(chain(&e))
    }
}

impl From<cut_cross_entropy::CceError> for CliError {
    fn from(e: cut_cross_entropy::CceError) -> Self {
        CliError(chain(&e))
    }
}

impl From<std::io::Error> for CliError {
    fn from(e: std::io::Error) -> Self {
        CliError(chain(&e))
    }
}
