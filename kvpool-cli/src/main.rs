//! The `kvpool` binary: [`kvpool_cli::run_command_line`] on the process's arguments.

fn main() {
    std::process::exit(kvpool_cli::run_command_line(std::env::args_os()));
}
