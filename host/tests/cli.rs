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

#[test]
fn logs_written_to_a_file_carry_no_colour_codes() {
    // A loopback run logs at info (the in-process server's lines among them) into a pipe.
    let bundles = std::path::PathBuf::from(std::env::var("CLEAVE_TEST_BUNDLES").unwrap_or_else(|_| "../target/test-bundles".into()));
    let tmp = tempfile::tempdir().unwrap();
    let config = tmp.path().join("edge.yaml");
    let yaml = format!(
        "server: http://127.0.0.1:1\nbundle: {}\nsplit: 4\ndevice: cpu\nbatch_size: 2\nrequests: 2\n\
         input: {{kind: synthetic, seed: 3}}\noutput: {}\nloopback: {{device: cpu}}\n",
        std::fs::canonicalize(bundles.join("digits")).expect("the digits test bundle (make test-bundles)").display(),
        tmp.path().join("out").display()
    );
    std::fs::write(&config, yaml).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_host"))
        .args(["--config".as_ref(), config.as_os_str(), "--loopback".as_ref()])
        .env("RUST_LOG", "info")
        .env_remove("NO_COLOR")
        .output()
        .expect("run host");
    let logs = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{logs}{}", String::from_utf8_lossy(&out.stderr));
    assert!(logs.contains("INFO"), "the run logged at info: {logs}");
    assert!(!logs.contains('\u{1b}'), "colour codes in logs that are not a terminal: {logs:?}");
}

#[test]
fn host_load_writes_into_the_config_s_output_and_refuses_an_earlier_load_run_there() {
    let tmp = tempfile::tempdir().unwrap();
    let (config, out) = (tmp.path().join("edge.yaml"), tmp.path().join("out"));
    let yaml =
        format!("server: http://127.0.0.1:1\nbundle: bundles/none\nsplit: 4\ndevice: cpu\ninput: {{kind: synthetic}}\noutput: {}\n", out.display());
    std::fs::write(&config, yaml).unwrap();
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("load.json"), "{}").unwrap();
    let load = Command::new(env!("CARGO_BIN_EXE_host"))
        .current_dir(tmp.path())
        .args(["load", "--config", "edge.yaml", "--edges", "1", "--closed", "--duration", "1s"])
        .output()
        .expect("run host");
    let stderr = String::from_utf8_lossy(&load.stderr);
    assert_eq!(load.status.code(), Some(2), "{stderr}");
    let refused = format!("the output directory {} holds an earlier load run (load.json): give --force to replace it", out.display());
    assert!(stderr.contains(&refused), "{stderr}");
    assert!(!tmp.path().join("results").exists(), "nothing under the current directory");
}
