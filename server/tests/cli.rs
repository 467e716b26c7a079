//! The `server` binary as a user starts it: what it says on start-up.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

#[test]
fn the_server_says_where_training_checkpoints_go_beside_its_config_by_default() {
    let bundles = std::path::PathBuf::from(std::env::var("CLEAVE_TEST_BUNDLES").unwrap_or_else(|_| "../target/test-bundles".into()));
    let bundle = std::fs::canonicalize(bundles.join("digits")).expect("the digits test bundle (make test-bundles)");
    let tmp = tempfile::tempdir().unwrap();
    let config = tmp.path().join("server.yaml");
    std::fs::write(&config, format!("listen: 127.0.0.1:0\nbundle: {}\ndevice: cpu\n", bundle.display())).unwrap();
    let mut server = Command::new(env!("CARGO_BIN_EXE_server")).arg("--config").arg(&config).stdout(Stdio::piped()).spawn().expect("start server");
    let stdout = server.stdout.take().unwrap();
    let (lines, said) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = lines.send(line);
        }
    });
    let mut seen = Vec::new();
    let wanted = format!("training checkpoints go to {} (`training.checkpoint_dir`)", tmp.path().join("checkpoints").display());
    while let Ok(line) = said.recv_timeout(Duration::from_secs(60)) {
        let found = line == wanted;
        seen.push(line);
        if found {
            break;
        }
    }
    server.kill().unwrap();
    server.wait().unwrap();
    assert_eq!(seen.last(), Some(&wanted), "{seen:?}");
}
