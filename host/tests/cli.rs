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

/// What a loopback run of the digits bundle prints at `RUST_LOG=info` into a pipe (the
/// in-process server's lines among it), with `extra` lines in its config.
fn loopback_run_output(extra: &str) -> String {
    let bundles = std::path::PathBuf::from(std::env::var("CLEAVE_TEST_BUNDLES").unwrap_or_else(|_| "../target/test-bundles".into()));
    let tmp = tempfile::tempdir().unwrap();
    let config = tmp.path().join("edge.yaml");
    let yaml = format!(
        "server: http://127.0.0.1:1\nbundle: {}\nsplit: 4\ndevice: cpu\nbatch_size: 2\nrequests: 2\n\
         input: {{kind: synthetic, seed: 3}}\noutput: {}\nloopback: {{device: cpu}}\n{extra}",
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
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    stdout
}

#[test]
fn logs_written_to_a_file_carry_no_colour_codes() {
    let logs = loopback_run_output("");
    assert!(logs.contains("INFO"), "the run logged at info: {logs}");
    assert!(!logs.contains('\u{1b}'), "colour codes in logs that are not a terminal: {logs:?}");
}

#[test]
fn log_format_json_writes_each_log_line_as_a_json_object() {
    let stdout = loopback_run_output("log_format: json\n");
    let logs: Vec<serde_json::Value> = stdout.lines().filter(|l| l.starts_with('{')).map(|l| serde_json::from_str(l).unwrap()).collect();
    assert!(logs.iter().any(|l| l["level"] == "INFO" && l["fields"]["message"].is_string()), "{stdout}");
    assert!(!stdout.lines().any(|l| l.contains(" INFO ")), "no text log lines: {stdout}");
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

#[test]
fn a_run_split_at_a_share_of_the_flops_prints_the_share_its_cut_holds() {
    let bundles = std::path::PathBuf::from(std::env::var("CLEAVE_TEST_BUNDLES").unwrap_or_else(|_| "../target/test-bundles".into()));
    let tmp = tempfile::tempdir().unwrap();
    let config = tmp.path().join("edge.yaml");
    let yaml = format!(
        "server: http://127.0.0.1:1\nbundle: {}\nsplit: 40%\ndevice: cpu\nbatch_size: 2\nrequests: 1\n\
         input: {{kind: synthetic, seed: 3}}\noutput: {}\nloopback: {{device: cpu}}\n",
        std::fs::canonicalize(bundles.join("digits")).expect("the digits test bundle (make test-bundles)").display(),
        tmp.path().join("out").display()
    );
    std::fs::write(&config, yaml).unwrap();
    let out =
        Command::new(env!("CARGO_BIN_EXE_host")).args(["--config".as_ref(), config.as_os_str(), "--loopback".as_ref()]).output().expect("run host");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let line = stdout.lines().find(|l| l.contains(" split at cut ")).unwrap_or_else(|| panic!("{stdout}"));
    let share: f64 =
        line.split("% of the FLOPs").next().and_then(|s| s.rsplit(", ").next()).and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("{line}"));
    assert!((40.0..=100.0).contains(&share), "the first cut where the edge holds at least 40%: {line}");
}

#[test]
fn splits_shows_the_short_bundle_id_and_plan_without_measure_has_no_measured_column() {
    let bundles = std::path::PathBuf::from(std::env::var("CLEAVE_TEST_BUNDLES").unwrap_or_else(|_| "../target/test-bundles".into()));
    let digits = std::fs::canonicalize(bundles.join("digits")).expect("the digits test bundle (make test-bundles)");
    let splits = Command::new(env!("CARGO_BIN_EXE_host")).args(["splits".as_ref(), "--bundle".as_ref(), digits.as_os_str()]).output().unwrap();
    let stdout = String::from_utf8_lossy(&splits.stdout);
    let id = stdout.lines().next().and_then(|l| l.rsplit("id ").next()).unwrap_or_else(|| panic!("{stdout}"));
    assert!(id.len() == 16 && id.chars().all(|c| c.is_ascii_hexdigit()), "one short form, 16 hex digits: {stdout}");

    let tmp = tempfile::tempdir().unwrap();
    let config = tmp.path().join("edge.yaml");
    let yaml = format!(
        "server: http://127.0.0.1:1\nbundle: {}\nsplit: 4\ndevice: cpu\nbatch_size: 2\ninput: {{kind: synthetic}}\noutput: {}\nloopback: {{device: cpu}}\n",
        digits.display(),
        tmp.path().join("out").display()
    );
    std::fs::write(&config, yaml).unwrap();
    let plan = Command::new(env!("CARGO_BIN_EXE_host"))
        .args(["plan".as_ref(), "--config".as_ref(), config.as_os_str(), "--loopback".as_ref(), "--repeats".as_ref(), "1".as_ref()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&plan.stdout);
    assert!(plan.status.success(), "{stdout}{}", String::from_utf8_lossy(&plan.stderr));
    assert!(stdout.contains("; objective latency"), "{stdout}");
    assert!(stdout.contains("predicted ms") && !stdout.contains("measured ms"), "{stdout}");
}
