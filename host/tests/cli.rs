//! The `host` binary's command line: mistakes end in a usage error, never a panic.

use std::process::Command;

#[test]
fn run_options_without_a_config_are_a_usage_error_not_a_panic() {
    for args in [&["--loopback"][..], &["--split", "3"], &["--force"], &["--output", "x"], &["--resume"], &["--monolithic"]] {
        let out = Command::new(env!("CARGO_BIN_EXE_host")).args(args).output().expect("run host");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "host {args:?}: {stderr}");
        assert!(stderr.contains("--config edge.yaml") && !stderr.contains("panicked"), "host {args:?}: {stderr}");
    }
}
