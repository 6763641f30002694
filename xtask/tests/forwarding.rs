//! `cargo xtask` from a checkout: orcd-cli's commands and its own `gpu-bundle`, one help.
use std::process::Command;

/// xtask's help for `args`; `None` where the binary is not there (a GPU bundle ships only
/// `bin/orcd`, whose commands `cli.rs` tests).
fn help(args: &[&str]) -> Option<String> {
    let exe = std::path::Path::new(env!("CARGO_BIN_EXE_xtask"));
    if !exe.exists() {
        println!("skipped: no xtask binary here");
        return None;
    }
    let out = Command::new(exe)
        .args(args)
        .output()
        .expect("running xtask");
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    Some(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[test]
fn every_command_is_there() {
    let Some(top) = help(&["--help"]) else {
        return;
    };
    let commands: Vec<&str> = top
        .split("Commands:\n")
        .nth(1)
        .unwrap()
        .lines()
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    for c in [
        "run",
        "serve",
        "logits",
        "bench",
        "bench-serve",
        "fetch-model",
        "inspect",
        "tokenize",
        "gpu-bundle",
    ] {
        assert!(commands.contains(&c), "{c} missing from {commands:?}");
    }
}

/// A forwarded command parses as orcd's own: its options reach orcd-cli.
#[test]
fn forwarded_commands_take_their_options() {
    let Some(run) = help(&["run", "--help"]) else {
        return;
    };
    assert!(run.starts_with("Generate text for a prompt"), "{run}");
    assert!(run.contains("--repeat-penalty <REPEAT_PENALTY>"), "{run}");
    let serve = help(&["serve", "--help"]).unwrap();
    assert!(serve.contains("--api-key <API_KEY>"), "{serve}");
}
