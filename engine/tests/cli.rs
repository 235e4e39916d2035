//! The `kiln` binary as a user meets it: help text and clear errors for bad choices.
use std::process::Command;

fn kiln(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .output()
        .expect("kiln runs")
}

#[test]
fn help_lists_the_subcommands() {
    let out = kiln(&["--help"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for sub in ["check", "info"] {
        assert!(text.contains(sub), "--help does not mention {sub}:\n{text}");
    }
}

#[test]
fn an_unknown_backend_is_named_in_the_error() {
    let out = kiln(&["info", "--backend", "metal"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown backend \"metal\""));
}

#[cfg(not(feature = "cuda"))]
#[test]
fn a_backend_not_compiled_in_says_how_to_get_it() {
    let out = kiln(&["check", "--backend", "cuda"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--features cuda"));
}
