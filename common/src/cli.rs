//! Command-line errors as operators want them: one line naming the flag, exit code 2.

/// Turns a clap error into the one line an operator sees (the flag and the reason), keeping
/// help and version output untouched. Returns the process exit code.
pub fn report_parse_error(err: &clap::Error) -> u8 {
    use clap::error::ErrorKind;
    match err.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
            let _ = err.print();
            0
        }
        _ => {
            eprintln!("{}", one_line(&err.render().to_string()));
            2
        }
    }
}

/// The error paragraph of a clap message joined into one line (usage and tips dropped).
pub fn one_line(rendered: &str) -> String {
    rendered
        .lines()
        .map(str::trim)
        .take_while(|l| !l.is_empty() && !l.starts_with("Usage:") && !l.starts_with("For more"))
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_only_the_error_paragraph() {
        let rendered = "error: invalid value 'x' for '--period <PERIOD>': bad\n\nUsage: p [OPTIONS]\n\nFor more information, try '--help'.\n";
        assert_eq!(
            one_line(rendered),
            "error: invalid value 'x' for '--period <PERIOD>': bad"
        );
        let two = "error: the following required arguments were not provided:\n  --node-name <NODE_NAME>\n\nUsage: a\n";
        assert_eq!(
            one_line(two),
            "error: the following required arguments were not provided: --node-name <NODE_NAME>"
        );
    }
}
