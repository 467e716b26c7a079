//! The project's example bundles and datasets and the `make` target that creates each, so
//! that an error about a missing one says how to make it (a fresh clone has none of them).

use std::path::Path;

/// Example paths (as the example configs name them) and the target that creates each.
const MADE_BY: &[(&str, &str)] = &[
    ("bundles/resnet18", "bundles/resnet18/manifest.json"),
    ("bundles/resnet18-top", "bundles/resnet18-top/manifest.json"),
    ("bundles/digits-cnn", "digits-cnn"),
    ("bundles/digits-train.safetensors", "digits-cnn"),
    ("bundles/digits-test.safetensors", "digits-cnn"),
    ("bundles/digits-trained", "digits-trained"),
    ("target/test-bundles", "test-bundles"),
];

/// The `make` target that creates `path`, when it is one of the examples (or inside one).
pub(crate) fn make_target(path: &Path) -> Option<&'static str> {
    MADE_BY.iter().find(|(made, _)| path.ancestors().any(|a| a.ends_with(made))).map(|(_, target)| *target)
}

/// What to tell a user whose `path` is missing: `: run make X, which creates it` for an
/// example, `otherwise` (with its own leading `: `) or nothing for anything else.
pub(crate) fn missing_hint(path: &Path, otherwise: &str) -> String {
    match make_target(path) {
        Some(target) => format!(": run `make {target}`, which creates it"),
        None => otherwise.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn examples_and_paths_inside_them_name_their_target() {
        assert_eq!(make_target(Path::new("/work/main/bundles/digits-cnn")), Some("digits-cnn"));
        assert_eq!(make_target(Path::new("bundles/digits-cnn/manifest.json")), Some("digits-cnn"));
        assert_eq!(make_target(Path::new("bundles/digits-train.safetensors")), Some("digits-cnn"));
        assert_eq!(make_target(Path::new("/data/bundles/resnet18")), Some("bundles/resnet18/manifest.json"));
        assert_eq!(make_target(Path::new("/data/bundles/resnet18x")), None);
        assert_eq!(missing_hint(Path::new("/elsewhere/model"), ": export one"), ": export one");
    }

    #[test]
    fn every_make_target_named_is_in_the_makefile() {
        let makefile = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../Makefile")).unwrap();
        for (path, target) in MADE_BY {
            let phony = makefile.lines().any(|l| l.starts_with(&format!("{target}:")));
            let file_rule = target.ends_with("/manifest.json") && makefile.contains(path);
            assert!(phony || file_rule, "make {target} (for {path}) is not a target of the Makefile");
        }
    }
}
